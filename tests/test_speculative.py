"""Speculative decoding (attn/speculative.py): greedy outputs equal the target's own greedy
decoding token for token, for the translator and the language model, whatever the draft and k;
sampled outputs are distributed as the target's (a chi-square test against the exact
distribution of the target's sequences, which a wrong acceptance rule fails); several positions
decoded in one pass equal one at a time, and the cache rolls back; the commands' flags.

The models are tiny random ones in float64, so that the target's pass over k + 1 positions and
its one-position steps round alike and an argmax never flips on a near tie.
"""
from __future__ import annotations

import itertools
import math

import pytest

import attn.backend as B
from attn import speculative as S
from attn.data import EOS, Vocab
from attn.decode import greedy_decode
from attn.masks import cached_causal_mask, causal_mask, padding_mask
from attn.model import Transformer, TransformerConfig, log_softmax
from attn.sample import Sampler, choose, distribution, generate
from attn.testing.speculative import chi_square_critical

np = B.host
#: The level of every chi-square test here: a right rule fails it with probability 0.001.
LEVEL = 0.001


# --------------------------------------------------------------------------- the chi-square test

def chi_square(counts: dict, probs: dict) -> tuple[float, int]:
    """Pearson's statistic of the observed ``counts`` against the probabilities ``probs`` (same
    keys; keys absent from ``probs`` have probability 0) and its degrees of freedom; the cells
    expected fewer than 5 times pooled into one. A count where ``probs`` says 0 is infinite."""
    n = sum(counts.values())
    if any(c and probs.get(key, 0.0) == 0.0 for key, c in counts.items()):
        return math.inf, 1
    expected = {key: n * p for key, p in probs.items() if p > 0}
    small = [key for key, e in expected.items() if e < 5]
    cells = [(counts.get(key, 0), e) for key, e in expected.items() if e >= 5]
    if small:
        cells.append((sum(counts.get(key, 0) for key in small), sum(expected[key] for key in small)))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def test_the_chi_square_threshold_is_the_tables():
    """The 0.001 critical values of a printed table (e.g. NIST's e-Handbook, 1.3.6.7.4)."""
    for dof, table in ((1, 10.828), (8, 26.124), (26, 54.052), (63, 103.442)):
        assert chi_square_critical(dof, LEVEL) == pytest.approx(table, abs=2e-3), dof
    print(f"chi-square at level {LEVEL}: dof 8 -> {chi_square_critical(8, LEVEL):.3f}")


# --------------------------------------------------------------------------- several positions in one pass

def _config(**kw):
    return TransformerConfig(**{"vocab_size": 13, "d_model": 16, "n_heads": 2, "d_ff": 32, "n_encoder_layers": 2,
                                "n_decoder_layers": 2, "dropout": 0.0, **kw})


def test_the_cached_causal_mask_is_the_last_rows_of_the_causal_mask():
    for past, T in ((0, 1), (0, 4), (3, 1), (3, 4)):
        want = causal_mask(past + T, np)[:, :, past:, :]
        assert (cached_causal_mask(T, past, np) == want).all(), (past, T)


@pytest.mark.parametrize("kw", [{}, {"n_encoder_layers": 0, "positional": "rope", "kv_heads": 1,
                                     "norm_position": "pre"}, {"positional": "learned"}],
                         ids=["translator", "lm-rope-mqa", "learned"])
def test_positions_in_one_pass_equal_one_at_a_time_and_a_rollback_forgets(kw):
    model = Transformer(_config(**kw), seed=1, dtype="float64")
    rng = np.random.default_rng(0)
    memory = mask = None
    if model.block.cross_attention is not None:
        src = B.to_device(rng.integers(4, 13, (2, 5)))
        mask = padding_mask(src)
        memory = model.encode(src, None, mask)[0]
    tokens = B.to_device(rng.integers(4, 13, (2, 7)))
    state, rows = model.start_decoding(memory, mask), []
    for t in range(7):
        logp, state, _ = model.decode_step(tokens[:, t], state)
        rows.append(B.to_host(logp))
    one = np.stack(rows, axis=1)                                                  # (2, 7, V)
    state = model.start_decoding(memory, mask)
    a, state, _ = model.decode_positions(tokens[:, :3], state)
    b, state, _ = model.decode_positions(tokens[:, 3:], state)
    assert state.length == 7
    np.testing.assert_allclose(np.concatenate([B.to_host(a), B.to_host(b)], axis=1), one, atol=1e-12)
    back = state.truncate(4)                       # positions 4.. forgotten: read again, the same
    c, back, _ = model.decode_positions(tokens[:, 4:], back)
    np.testing.assert_allclose(B.to_host(c), one[:, 4:], atol=1e-12)
    with pytest.raises(ValueError, match="truncate: length must be in 0..7"):
        back.truncate(8)


# --------------------------------------------------------------------------- greedy: the target's tokens

@pytest.fixture(scope="module")
def translators():
    """A target, a smaller draft of another seed (which disagrees with it often), and sentences."""
    target = Transformer(_config(), seed=1, dtype="float64")
    target.params["embedding.weight"][EOS] *= 2.0              # some sentences end before the limit
    draft = Transformer(_config(d_model=8, d_ff=16, n_encoder_layers=1, n_decoder_layers=1), seed=2, dtype="float64")
    rng = np.random.default_rng(5)
    src = rng.integers(4, 13, (12, 7))
    for i, n in enumerate(rng.integers(1, 8, 12)):
        src[i, n:] = 0
    return target, draft, src, greedy_decode(target, B.to_device(src), max_len=10)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_translations_are_the_targets_token_for_token(translators, k):
    target, draft, src, plain = translators
    result, acceptance = S.translate(target, draft, src, k, max_len=10)
    assert result.tokens == plain.tokens
    np.testing.assert_allclose(result.scores, plain.scores, atol=1e-9)
    assert acceptance.rounds < acceptance.tokens                 # some drafts accepted ...
    assert acceptance.rate < 0.8, acceptance.line(k)             # ... and many refused
    print(acceptance.line(k))


def test_a_draft_equal_to_the_target_is_always_accepted(translators):
    target, _, src, plain = translators
    result, acceptance = S.translate(target, target, src[:4], 4, max_len=10)
    assert acceptance.rate == 1.0 and result.tokens == plain.tokens[:4]


@pytest.mark.parametrize("k", [1, 8])
def test_greedy_texts_are_the_targets_across_restarted_windows(k):
    """A language model's greedy text, 30 tokens through windows of 10 (restarted as
    :func:`attn.sample.generate` restarts them), for several prompts. The weights are doubled so
    that the text depends on its context (a tiny random model's repeats one token); the draft is
    the target's weights with noise, close enough that some rounds run past a window's end."""
    cfg = _config(n_encoder_layers=0, max_len=10)
    target = Transformer(cfg, seed=3, dtype="float64")
    target.params.update({k: 2 * w for k, w in target.params.items() if k.endswith("weight") or ".w_" in k})
    rng = np.random.default_rng(0)
    draft = Transformer(cfg, dtype="float64", params={k: w * (1 + 0.2 * rng.standard_normal(w.shape))
                                                      for k, w in target.params.items()})
    accepted = proposed = 0
    for prompt in ([4], [8, 9, 10, 11, 12, 4, 5]):
        want = generate(target, prompt, 30, Sampler(0), banned=[0, 1])
        got, acceptance = S.generate(target, draft, prompt, 30, k, Sampler(0), banned=[0, 1])
        assert got == want, prompt
        assert len(set(zip(want, want[1:]))) > 5, want                 # a text that depends on its context
        accepted, proposed = accepted + acceptance.accepted, proposed + acceptance.proposed
    assert 0 < accepted < proposed


# --------------------------------------------------------------------------- sampling: the target's distribution

#: p and q of the one-position test: the draft favours what the target does not.
P, Q = np.array([0.5, 0.3, 0.15, 0.05]), np.array([0.1, 0.2, 0.3, 0.4])


def _first_tokens(n: int, seed: int = 0) -> dict:
    """The first token a round keeps, over ``n`` rounds of one draft token from Q checked against P."""
    rng, counts = np.random.default_rng(seed), {}
    p, q = np.stack([P, P]), Q[None, :]
    for _ in range(n):
        d = choose(Q, float(rng.random()))
        kept, token = S.verify(p, q, [d], rng)
        first = d if kept else token
        counts[first] = counts.get(first, 0) + 1
    return counts


@pytest.fixture
def wrong_rule(monkeypatch):
    """Replace one half of the rule: ``always`` accepts every draft token, ``from_p`` draws a
    rejected token from p instead of max(0, p - q)."""
    def use(which):
        if which == "always":
            monkeypatch.setattr(S, "accepts", lambda p_d, q_d, u: True)
        else:
            monkeypatch.setattr(S, "residual", lambda p, q: p)
    return use


def test_one_position_keeps_the_targets_distribution_and_a_wrong_rule_does_not(wrong_rule):
    probs = dict(enumerate(P))
    stat, dof = chi_square(_first_tokens(1500), probs)
    assert stat < chi_square_critical(dof, LEVEL), (stat, dof)
    for which in ("always", "from_p"):
        wrong_rule(which)
        bad, dof = chi_square(_first_tokens(1500), probs)
        assert bad > chi_square_critical(dof, LEVEL), (which, bad, dof)


def test_the_exercises_rule_at_n_trials_is_the_decoders_one_trial_at_a_time():
    """``speculative_accept`` (what lesson 31's exercise is graded against) keeps and draws as
    :func:`S.accepts` and :func:`choose` of :func:`S.residual` do, trial by trial."""
    rng = np.random.default_rng(3)
    drafts = rng.choice(len(Q), size=400, p=Q)
    u, v = rng.random(400), rng.random(400)
    got = S.speculative_accept(P, Q, drafts, u, v)
    want = [d if S.accepts(P[d], Q[d], a) else choose(S.residual(P, Q), b) for d, a, b in zip(drafts, u, v)]
    assert got.dtype == drafts.dtype and got.tolist() == want and (got != drafts).any()


#: The sequence test: 3 tokens from a vocabulary of 3 (7 less the 4 specials, banned), the
#: draft proposing k=2, at temperature 1; ``draws`` texts of seeds 0, 1, ...
STEPS, K, BANNED_IDS = 3, 2, [0, 1, 2, 3]


@pytest.fixture(scope="module")
def language_models():
    """A target whose next-token distributions are spread and a draft (another seed) that
    prefers other tokens; the target's exact probability of every text of STEPS tokens."""
    cfg = TransformerConfig(vocab_size=7, d_model=8, n_heads=1, d_ff=8, n_encoder_layers=0, n_decoder_layers=1,
                            dropout=0.0, max_len=16)
    target, draft = Transformer(cfg, seed=2, dtype="float64"), Transformer(cfg, seed=6, dtype="float64")
    exact = {}
    for text in itertools.product(range(4, 7), repeat=STEPS):
        logits, _ = target.forward(None, B.to_device(np.asarray([[4, *text]])))   # every position at once
        logp = B.to_host(log_softmax(logits[0])).astype("float64")
        logp[:, BANNED_IDS] = -np.inf
        exact[text] = math.prod(distribution(logp[j])[t] for j, t in enumerate(text))
    return target, draft, exact


def _texts(target, draft, draws: int) -> dict:
    counts = {}
    for seed in range(draws):
        text, _ = S.generate(target, draft, [4], STEPS, K, Sampler(1.0), seed=seed, banned=BANNED_IDS)
        counts[tuple(text)] = counts.get(tuple(text), 0) + 1
    return counts


def test_sampled_texts_are_distributed_as_the_targets(language_models):
    target, draft, exact = language_models
    stat, dof = chi_square(_texts(target, draft, 300), exact)
    critical = chi_square_critical(dof, LEVEL)
    print(f"chi-square {stat:.1f} on {dof} dof, critical {critical:.1f} at level {LEVEL}")
    assert stat < critical


@pytest.mark.parametrize("which, draws", [("always", 60), ("from_p", 200)])
def test_a_wrong_acceptance_rule_fails_the_same_test(language_models, wrong_rule, which, draws):
    target, draft, exact = language_models
    wrong_rule(which)
    stat, dof = chi_square(_texts(target, draft, draws), exact)
    assert stat > chi_square_critical(dof, LEVEL), (which, stat, dof)


# --------------------------------------------------------------------------- what is refused

def test_a_draft_of_another_kind_or_vocabulary_is_refused(translators):
    target, draft, src, _ = translators
    lm = Transformer(_config(n_encoder_layers=0), seed=1)
    with pytest.raises(ValueError, match="both be translators"):
        S.translate(target, lm, src, 2)
    with pytest.raises(ValueError, match="draft's vocab_size is 11, the target's 13"):
        S.translate(target, Transformer(_config(vocab_size=11), seed=1), src, 2)
    with pytest.raises(ValueError, match="k .--speculate. must be an integer >= 0"):
        S.translate(target, draft, src, -1)
    short = Transformer(_config(positional="learned", max_len=8), seed=1, dtype="float64")
    with pytest.raises(ValueError, match="draft's learned positions hold 8, the target decodes up to 10"):
        S.translate(target, short, src, 2, max_len=10)


def test_a_language_models_draft_must_hold_the_window():
    cfg = _config(n_encoder_layers=0, max_len=12)
    target, short = Transformer(cfg, seed=1), Transformer(_config(n_encoder_layers=0, positional="learned", max_len=8))
    with pytest.raises(ValueError, match="draft's learned positions hold 8, the target reads windows of 12"):
        S.generate(target, short, [4], 3, 2)


# --------------------------------------------------------------------------- the commands

@pytest.fixture
def restore_backend():
    """``main`` selects a backend; put the previous choice back afterwards."""
    saved = (B._current, B._xp)
    yield
    B._current, B._xp = saved


def _saved(tmp_path, name, vocab, seed, meta=None, **kw):
    cfg = _config(**{"vocab_size": len(vocab), "d_model": 8, "d_ff": 16, "n_encoder_layers": 1,
                     "n_decoder_layers": 1, **kw})
    model = Transformer(cfg, seed=seed, dtype="float64")
    model.params["embedding.weight"][EOS] *= 2.0
    return str(model.save(tmp_path / name, extra_meta={"vocab": vocab.to_json(), **(meta or {})}))


def test_attn_translate_with_a_draft_prints_greedy_decodings_translations(tmp_path, capsys, restore_backend):
    from attn.translate import main
    vocab = Vocab.build([list("abcdefg.")])
    target, draft = _saved(tmp_path, "t.npz", vocab, 1), _saved(tmp_path, "d.npz", vocab, 2)
    sentences = ["a b c .", "g f e d .", "b ."]
    assert main(["--checkpoint", target, "--backend", "numpy", *sentences]) == 0
    plain = capsys.readouterr().out
    assert main(["--checkpoint", target, "--draft", draft, "--speculate", "3", "--backend", "numpy", *sentences]) == 0
    got = capsys.readouterr()
    assert got.out == plain and "attn-translate: speculative decoding, k=3:" in got.err
    other = _saved(tmp_path, "o.npz", Vocab.build([list("abcdefgh.")]), 2)
    for flags, words in ((["--speculate", "2"], "--speculate needs a --draft"),
                         (["--draft", draft, "--beam", "4"], "without --beam"),
                         (["--draft", draft, "--speculate", "-1"], "--speculate must be between 0 and 64"),
                         (["--draft", other], "its vocabulary differs from --checkpoint's")):
        assert main(["--checkpoint", target, "--backend", "numpy", *flags, "a ."]) == 2
        assert words in capsys.readouterr().err, flags


def test_attn_generate_with_a_draft_prints_the_same_greedy_text(tmp_path, capsys, restore_backend):
    from attn.generate import main
    vocab, meta = Vocab(["<pad>", "<s>", "</s>", "<unk>", *"abcdef"]), {"args": {"char": True, "context": 12}}
    target = _saved(tmp_path, "t.npz", vocab, 1, meta, n_encoder_layers=0, max_len=12)
    draft = _saved(tmp_path, "d.npz", vocab, 2, meta, n_encoder_layers=0, max_len=12)
    flags = ["--checkpoint", target, "--prompt", "abc", "--temperature", "0", "--max-tokens", "20"]
    assert main(flags) == 0
    plain = capsys.readouterr().out
    assert main([*flags, "--draft", draft, "--speculate", "4"]) == 0
    got = capsys.readouterr()
    assert got.out == plain and "attn-generate: speculative decoding, k=4:" in got.err
    translator = _saved(tmp_path, "mt.npz", vocab, 2, meta)
    for extra, words in ((["--speculate", "2"], "--speculate needs a --draft"),
                         (["--draft", translator], "--draft " + translator + " holds a translator")):
        assert main([*flags, *extra]) == 2
        assert words in capsys.readouterr().err, extra

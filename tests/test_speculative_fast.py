"""Speculative decoding on the fast engine (attn/speculative.py through the engine interface): its
caches roll back rejected positions (:meth:`attn.engine.DecodingState.truncate`) and read a chunk
of positions in one pass (:meth:`attn.engine.Model.decode_positions`), so greedy outputs are the
fast engine's own greedy outputs, token for token, and the readable engine's speculative ones;
sampled texts keep the target's distribution. The models are test_speculative.py's tiny float64
ones, handed to the fast engine over the same parameters.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import attn.backend as B
from attn import engine as engines
from attn import speculative as S
from attn.decode import greedy_decode
from attn.masks import padding_mask
from attn.model import Transformer
from attn.sample import Sampler, generate
from attn.testing.speculative import chi_square_critical
from conftest import selected_backend
from attn.data import EOS, Vocab
from test_speculative import LEVEL, _config, _texts, chi_square, language_models, translators  # noqa: F401

np = B.host


def _fast(model):
    """The fast engine's model over ``model``'s parameters (and dtype)."""
    return engines.get("fast").model(model.config, dtype=model.dtype, params=model.params)


@pytest.fixture(scope="module")
def fast_translators(translators):
    target, draft, src, _ = translators
    fast_target = _fast(target)
    return fast_target, _fast(draft), src, greedy_decode(fast_target, B.to_device(src), max_len=10)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_fast_greedy_translations_are_its_own_greedy_ones_and_the_readable_engines(translators, fast_translators, k):
    target, draft, _, _ = translators
    fast_target, fast_draft, src, plain = fast_translators
    result, acceptance = S.translate(fast_target, fast_draft, src, k, max_len=10)
    assert result.tokens == plain.tokens
    np.testing.assert_allclose(result.scores, plain.scores, atol=1e-9)
    assert acceptance.rounds < acceptance.tokens and acceptance.rate < 0.8, acceptance.line(k)
    if k == 3:                                     # the readable engine's rounds, one for one
        readable, readable_acceptance = S.translate(target, draft, src, k, max_len=10)
        assert result.tokens == readable.tokens and acceptance == readable_acceptance
    if k == 8:                                     # a draft on the other engine
        mixed, _ = S.translate(fast_target, draft, src[:4], k, max_len=10)
        assert mixed.tokens == plain.tokens[:4]


def _chunks(model, memory, mask, tokens, cuts):
    """The state after ``tokens`` (B, T) fed in the chunks that ``cuts`` mark, and each chunk's
    log-probabilities (host)."""
    state, out = model.start_decoding(memory, mask), []
    for a, b in zip((0, *cuts), (*cuts, tokens.shape[1])):
        logp, state, _ = model.decode_positions(tokens[:, a:b], state)
        out.append(B.to_host(logp).copy())
    return state, out


def _rollback_holds(where: str, kw: dict, steps: bool = True) -> None:
    """Seven positions read as 4 + 3, rolled back to 4: the cache is the one that read the 4
    alone, to the last bit, and reading on from it gives the same numbers; (``steps``) chunks of
    positions equal one position at a time."""
    with selected_backend(where):
        fast = _fast(Transformer(_config(**kw), seed=1, dtype="float64"))
        rng = np.random.default_rng(0)
        memory = mask = None
        if fast.block.cross_attention is not None:
            src = rng.integers(4, 13, (3, 5))
            src[1, 3:] = 0
            src = B.to_device(src)
            mask = padding_mask(src)
            memory = fast.encode(src, None, mask)[0]
        tokens = B.to_device(rng.integers(4, 13, (3, 7)))
        state, (a, _) = _chunks(fast, memory, mask, tokens, [4])
        back = state.truncate(4)
        fresh, (b,) = _chunks(fast, memory, mask, tokens[:, :4], [])
        assert back.length == fresh.length == 4 and (a == b).all()
        for (k1, v1), (k2, v2) in zip(back.self_kv, fresh.self_kv):
            assert (B.to_host(k1) == B.to_host(k2)).all() and (B.to_host(v1) == B.to_host(v2)).all()
        on_back = B.to_host(fast.decode_positions(tokens[:, 4:6], back)[0])
        on_fresh = B.to_host(fast.decode_positions(tokens[:, 4:6], fresh)[0])
        assert (on_back == on_fresh).all()
        with pytest.raises(ValueError, match="truncate: length must be in 0..2"):
            _chunks(fast, memory, mask, tokens[:, :2], [])[0].truncate(3)
        if steps:
            one, state = [], fast.start_decoding(memory, mask)
            for t in range(7):
                logp, state, _ = fast.decode_step(tokens[:, t], state)
                one.append(B.to_host(logp).copy())
            _, chunks = _chunks(fast, memory, mask, tokens, [3])
            np.testing.assert_allclose(np.concatenate(chunks, axis=1), np.stack(one, axis=1), atol=1e-12)


@pytest.mark.parametrize("where, kw", [("numpy", {}), ("numpy", {"positional": "rope", "kv_heads": 1,
                                                               "norm_position": "pre", "ffn": "swiglu"}),
                                       ("cupy", {}), ("numpy", {"n_encoder_layers": 0})],
                         ids=["host", "host-later", "device", "lm"])
def test_a_rolled_back_cache_is_the_cache_of_the_kept_prefix_bit_for_bit(where, kw):
    """On NumPy, on CuPy (the stand-in without a GPU: its chunks are its steps) and for a
    language model (whose fast engine decodes on the readable model's cache)."""
    _rollback_holds(where, kw, steps=where != "cupy")


def test_a_rollback_one_position_short_fails_that_test(monkeypatch):
    """The guard of the test above: a truncate that keeps one position more than asked."""
    from attn.fast.decoding.host import FastDecodeState
    keep = FastDecodeState.truncate
    monkeypatch.setattr(FastDecodeState, "truncate", lambda s, n: keep(s, min(s.length, n + 1)))
    with pytest.raises(AssertionError):
        _rollback_holds("numpy", {}, steps=False)


def test_fast_greedy_texts_are_its_own():
    cfg = _config(n_encoder_layers=0, max_len=10)
    target = Transformer(cfg, seed=3, dtype="float64")
    target.params.update({k: 2 * w for k, w in target.params.items() if k.endswith("weight") or ".w_" in k})
    fast_target, fast_draft = _fast(target), _fast(Transformer(cfg, seed=4, dtype="float64"))
    want = generate(fast_target, [8, 9, 10], 30, Sampler(0), banned=[0, 1])
    got, acceptance = S.generate(fast_target, fast_draft, [8, 9, 10], 30, 4, Sampler(0), banned=[0, 1])
    assert got == want and acceptance.proposed > 0


def test_fast_sampled_texts_are_distributed_as_the_targets(language_models):
    target, draft, exact = language_models
    stat, dof = chi_square(_texts(_fast(target), _fast(draft), 100), exact)
    assert stat < chi_square_critical(dof, LEVEL), (stat, dof)


def test_the_benchmark_prints_greedy_beam_and_each_k_on_the_fast_engine(tmp_path, capsys):
    """benchmarks/speculative.py end to end on a tiny float64 checkpoint (its own draft): a row for
    greedy and beam search (one sentence at a time and one batch) and each k, every speculative
    output the greedy one."""
    spec = importlib.util.spec_from_file_location("speculative_bench",
                                                  Path(__file__).resolve().parents[1] / "benchmarks" / "speculative.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    vocab = Vocab.build([list("abcdefg.")])
    model = Transformer(_config(vocab_size=len(vocab), d_model=8, d_ff=16, n_encoder_layers=1, n_decoder_layers=1),
                        seed=1, dtype="float64")
    model.params["embedding.weight"][EOS] *= 9.0                                 # short translations
    target = str(model.save(tmp_path / "t.npz", extra_meta={"vocab": vocab.to_json()}))
    (tmp_path / "src.txt").write_text("a b c .\nb .\n")
    assert bench.main(["--engine", "fast", "--target", target, "--draft", target, "--sources", str(tmp_path / "src.txt"),
                       "--k", "0,3", "--beam", "2", "--repeats", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"][:6] for r in rows] == ["greedy", "greedy", "beam 2", "beam 2", "the ta", "specul"]
    assert [r["identical"] for r in rows[4:]] == [2, 2] and rows[-1]["acceptance"] == 1.0    # the draft: the target

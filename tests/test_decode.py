"""Greedy decoding and beam search: the equivalences a reader would state aloud.

Decoding needs no trained model to be tested: on a tiny random float64 model,
the cached and the uncached paths must agree token for token (scores to
rounding), beam size 1 must be greedy, a batch must decode as its sentences do
one by one, scores must be what teacher forcing gives for the returned tokens,
and a wide beam must find the exhaustive optimum on a short horizon.

A random model rarely emits EOS, so :func:`eos_model` makes the EOS embedding
row (which is also its output projection row) longer: sentences then end at
varied lengths, and the tests check that they do, so no test passes vacuously.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import attn.backend as B
from attn.data import BOS, EOS, PAD
from attn.decode import EXTRA_LENGTH, beam_search, greedy_decode, length_penalty
from attn.model import Transformer, TransformerConfig, log_softmax

V = 13


def tiny_model(seed=1, eos_scale=3.0, vocab_size=V, **overrides):
    cfg = TransformerConfig(vocab_size=vocab_size, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                            n_decoder_layers=1, **overrides)
    m = Transformer(cfg, seed=seed, dtype="float64")
    m.params["embedding.weight"][EOS] *= eos_scale
    return m


def eos_model():
    """A model whose greedy outputs on :func:`sources` end with EOS at varied lengths."""
    return tiny_model(seed=1, eos_scale=3.0)


def sources(n=6, S=7, seed=0):
    """(n, S) host ids of real tokens (ids >= 4) with trailing padding of several lengths."""
    rng = np.random.default_rng(seed)
    src = rng.integers(4, V, (n, S))
    for i, L in enumerate([S, 4, S, 2, 5, 1][:n]):
        src[i, L:] = PAD
    return src


def dev(model, a):
    return model.xp.asarray(a)


def teacher_forced_logprob(model, src_row, tokens, with_eos):
    """Sum of log P(token | prefix) by one full forward pass (the reference for scores)."""
    real = src_row[src_row != PAD][None]
    tgt = [BOS] + list(tokens)
    out = list(tokens) + ([EOS] if with_eos else [])
    logits, cache = model.forward(dev(model, real), dev(model, np.array([tgt])))
    logp = B.to_host(log_softmax(logits))[0]
    return float(sum(logp[t, y] for t, y in enumerate(out))), cache


def test_outputs_end_at_varied_lengths():
    """The fixture model is a meaningful test case: some outputs end with EOS, at different lengths."""
    src = sources()
    res = greedy_decode(eos_model(), src)
    limits = (src != PAD).sum(1) + EXTRA_LENGTH
    lengths = [len(t) for t in res.tokens]
    assert sum(L < lim for L, lim in zip(lengths, limits)) >= 3, lengths
    assert len(set(lengths)) >= 3, lengths


@pytest.mark.parametrize("K", [None, 1, 3])
def test_cached_equals_uncached(backend, K):
    """Incremental decoding with cached keys/values is an optimisation, not a different search."""
    m = eos_model()
    src = dev(m, sources())
    run = (lambda c: greedy_decode(m, src, use_cache=c, with_attention=True)) if K is None else \
        (lambda c: beam_search(m, src, beam_size=K, use_cache=c, with_attention=True))
    a, b = run(True), run(False)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.scores, b.scores, rtol=0, atol=1e-9)
    for x, y in zip(a.cross_attention, b.cross_attention):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-9)


@pytest.mark.parametrize("K", [None, 3])
@pytest.mark.parametrize("with_attention", [False, True])
def test_fast_uncached_decoding_is_the_reference_search(backend, K, with_attention):
    """Without the cache the fast search's ``prefix`` takes the cross-attention keys and values
    projected once (reordered only when a row changes sentence) and keeps no weights unless
    the attention is asked for: the same search as the reference's, sentences ending at
    several lengths (rows dropped, beams reordered)."""
    from attn.fast import FastTransformer
    ref = eos_model()
    fast = FastTransformer.from_model(ref)
    calls = []
    search = fast.search()                  # the model's one search, which the searches step
    real_prefix = search.prefix

    def prefix(tgt_in, memory, src_mask, cross_kv, keep_weights):     # the new path is the one taken
        calls.append((cross_kv is not None, keep_weights))
        return real_prefix(tgt_in, memory, src_mask, cross_kv, keep_weights)
    search.prefix = prefix
    src = dev(ref, sources())
    run = (lambda m, c: greedy_decode(m, src, use_cache=c, with_attention=with_attention)) if K is None else \
        (lambda m, c: beam_search(m, src, beam_size=K, use_cache=c, with_attention=with_attention))
    want = run(ref, False)
    assert len({len(t) for t in want.tokens}) >= 3
    uncached = run(fast, False)
    assert calls and set(calls) == {(True, with_attention)}
    for got in (uncached, run(fast, True)):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-9)
        assert (got.cross_attention is None) == (not with_attention)
        for x, y in zip(got.cross_attention or [], want.cross_attention or []):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_least_columns_keeps_the_least_values(backend, seed):
    """Beam search's preselection (two rounds over blocks of the vocabulary when it is large)
    keeps, in each row, c entries whose values are the c least of the row, also with many
    exact ties and banned (+inf) entries."""
    from attn.decode import PRESELECT_BLOCK
    from attn.decode import least_columns as _least_columns
    rng = np.random.default_rng(seed)
    for V in (5, PRESELECT_BLOCK * 9 + 37, PRESELECT_BLOCK * 40):
        for c in (1, 3, 8):
            a = rng.integers(0, 1 + 40 * (seed % 3), (4, V)).astype(np.float32)   # many ties
            if seed % 2:
                a += rng.normal(size=a.shape).astype(np.float32)
            a[:, rng.integers(0, V, 3)] = np.inf
            c = min(c, V)
            got = B.to_host(_least_columns(backend.asarray(a), c))
            assert got.shape == (4, c) and all(len(set(r)) == c for r in got.tolist())
            kept = np.sort(np.take_along_axis(a, got, axis=1), axis=1)
            assert np.array_equal(kept, np.sort(a, axis=1)[:, :c]), (V, c)


@pytest.mark.parametrize("seed,eos_scale", [(1, 3.0), (1, 1.0), (2, 2.0), (3, 3.0)])
def test_beam_one_is_greedy(seed, eos_scale):
    m = tiny_model(seed, eos_scale)
    src = sources()
    g = greedy_decode(m, src)
    b = beam_search(m, src, beam_size=1, alpha=0.0)
    assert b.tokens == g.tokens
    # With alpha = 0 the length penalty is 1 and the scores are the same sums.
    np.testing.assert_allclose(b.scores, g.scores, rtol=0, atol=1e-9)
    # With alpha > 0 beam 1 still finishes greedy's hypothesis, and may go on to a better-scored one.
    b6 = beam_search(m, src, beam_size=1, alpha=0.6)
    limits = (src != PAD).sum(1) + EXTRA_LENGTH
    for i, toks in enumerate(g.tokens):
        greedy_score = g.scores[i] / length_penalty(len(toks) + (len(toks) < limits[i]), 0.6)
        assert b6.scores[i] >= greedy_score - 1e-9
        assert (toks, pytest.approx(greedy_score, abs=1e-9)) in b6.n_best[i]


@pytest.mark.parametrize("K", [1, 3])
def test_batched_equals_one_by_one(K):
    """Padding and batch neighbours change nothing: each sentence decodes as it does alone."""
    m = eos_model()
    src = sources()
    search = greedy_decode if K == 1 else (lambda m, s: beam_search(m, s, beam_size=K))
    batch = search(m, src)
    for i, row in enumerate(src):
        alone = search(m, row[row != PAD][None])
        assert alone.tokens[0] == batch.tokens[i], i
        assert abs(alone.scores[0] - batch.scores[i]) < 1e-9, i


def test_greedy_scores_and_attention_match_teacher_forcing():
    m = eos_model()
    src = sources()
    res = greedy_decode(m, src, with_attention=True)
    limits = (src != PAD).sum(1) + EXTRA_LENGTH
    for i, toks in enumerate(res.tokens):
        assert PAD not in toks and BOS not in toks and EOS not in toks
        ended = len(toks) < limits[i]
        ref, cache = teacher_forced_logprob(m, src[i], toks, ended)
        assert abs(res.scores[i] - ref) < 1e-9, i
        # Row t of the cross-attention is where the model looked while choosing tokens[t].
        w = B.to_host(Transformer.attention_weights(cache)["decoder.0.cross_attn"])[0].mean(0)  # (T, S_i)
        assert res.cross_attention[i].shape == (len(toks), int((src[i] != PAD).sum()))
        np.testing.assert_allclose(res.cross_attention[i], w[:len(toks)], atol=1e-12)
        np.testing.assert_allclose(res.cross_attention[i].sum(1), 1.0, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_beam_scores_are_sorted_and_match_teacher_forcing(alpha):
    m = eos_model()
    src = sources()
    res = beam_search(m, src, beam_size=4, alpha=alpha, with_attention=True)
    limits = (src != PAD).sum(1) + EXTRA_LENGTH
    for i, toks in enumerate(res.tokens):
        scores = [s for _, s in res.n_best[i]]
        assert scores == sorted(scores, reverse=True)
        assert (toks, res.scores[i]) == res.n_best[i][0]
        assert len(res.n_best[i]) >= 1
        for hyp, s in res.n_best[i]:
            ended = len(hyp) < limits[i]
            ref, _ = teacher_forced_logprob(m, src[i], hyp, ended)
            assert abs(s - ref / length_penalty(len(hyp) + ended, alpha)) < 1e-9
        _, cache = teacher_forced_logprob(m, src[i], toks, False)
        w = B.to_host(Transformer.attention_weights(cache)["decoder.0.cross_attn"])[0].mean(0)
        np.testing.assert_allclose(res.cross_attention[i], w[:len(toks)], atol=1e-12)


def test_wide_beam_finds_the_exhaustive_best():
    """With a beam as wide as every prefix, beam search is exact over a short horizon."""
    vocab_size, L = 7, 3
    m = tiny_model(seed=2, eos_scale=2.0, vocab_size=vocab_size)
    src = np.array([[4, 5, 6, 4]])
    allowed = [t for t in range(vocab_size) if t not in (PAD, BOS)]
    best = -math.inf
    for n in range(L + 1):
        for body in itertools.product([t for t in allowed if t != EOS], repeat=n):
            ended = n < L                   # shorter ones end with EOS; length L stops at the limit
            lp, _ = teacher_forced_logprob(m, src[0], body, ended)
            best = max(best, lp / length_penalty(n + ended, 0.6))
    res = beam_search(m, src, beam_size=len(allowed) ** (L - 1), alpha=0.6, max_len=L)
    assert abs(res.scores[0] - best) < 1e-9


def test_max_len_is_respected():
    m = tiny_model(seed=1, eos_scale=1.0)         # rarely stops by itself
    src = sources()
    for res in (greedy_decode(m, src, max_len=5), beam_search(m, src, beam_size=3, max_len=5)):
        assert all(len(t) <= 5 for t in res.tokens)
        assert any(len(t) == 5 for t in res.tokens)
    res = greedy_decode(m, src)                   # default: own source length + 50
    limits = (src != PAD).sum(1) + EXTRA_LENGTH
    assert all(len(t) <= lim for t, lim in zip(res.tokens, limits))
    assert any(len(t) == lim for t, lim in zip(res.tokens, limits))


def test_learned_positions_cap_the_length():
    """decode_step indexes the learned table at each position: the limit stays inside it."""
    m = tiny_model(seed=1, eos_scale=1.0, positional="learned", max_len=9)
    src = sources()
    for use_cache in (True, False):
        for res in (greedy_decode(m, src, use_cache=use_cache), beam_search(m, src, 2, use_cache=use_cache)):
            assert all(len(t) <= 9 for t in res.tokens)


def test_float32_model_decodes():
    cfg = TransformerConfig(vocab_size=V, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1)
    m = Transformer(cfg, seed=0)
    res = beam_search(m, sources(), beam_size=2, max_len=6)
    assert len(res.tokens) == 6 and all(math.isfinite(s) for s in res.scores)


def test_bad_input_and_empty_batch():
    m = eos_model()
    with pytest.raises(ValueError, match="src must be"):
        greedy_decode(m, np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(m, sources(), beam_size=0)
    empty = np.zeros((0, 4), dtype=np.int64)
    assert greedy_decode(m, empty).tokens == [] and beam_search(m, empty).tokens == []


class MarkovModel:
    """A stand-in model whose next-token distribution is a table keyed by the prefix, so a
    test can lay out exactly which hypotheses beam search meets (what
    :class:`attn.decode.ReadableSearch` asks of a model: ``encode``, ``start_decoding``,
    ``decode_step``; the choice of tokens is the readable search's)."""

    class State:
        def __init__(self, prefixes):
            self.prefixes = prefixes

        def select(self, index):
            return MarkovModel.State([self.prefixes[int(i)] for i in B.to_host(index)])

    def __init__(self, table, vocab_size=6):
        self.table, self.V = table, vocab_size
        self.xp = np
        self.config = TransformerConfig(vocab_size=vocab_size, d_model=8, n_heads=2, d_ff=16,
                                        n_encoder_layers=1, n_decoder_layers=1)

    def encode(self, src, rng, src_mask):
        return np.zeros(src.shape + (1,)), None

    def start_decoding(self, memory, src_mask):
        return self.State([() for _ in range(memory.shape[0])])

    def decode_step(self, tokens, state):
        prefixes = [p + (int(t),) for p, t in zip(state.prefixes, tokens)]
        logp = np.empty((len(prefixes), self.V))
        for r, p in enumerate(prefixes):
            probs = dict(self.table.get(p[1:], {}))             # p[0] is BOS
            rest = [t for t in range(self.V) if t not in probs]
            left = max(1.0 - sum(probs.values()), 1e-6)
            logp[r] = [math.log(probs[t]) if t in probs else math.log(left / len(rest)) for t in range(self.V)]
        return logp, self.State(prefixes), None


A_, B_ = 4, 5
#: After BOS: A .5, EOS .3, B .2. After A: A .98. After A A: EOS .99. After B: EOS .9.
#: Beam 2 finishes "" (log .3 / lp(1) = -1.20) and "B" (log .18 / lp(2) = -1.56) by step 2,
#: while "A A" (log .485 / lp(3) = -0.61), greedy's answer, is still live.
TRAP = {(): {A_: 0.5, EOS: 0.3, B_: 0.2 - 1e-4}, (A_,): {A_: 0.98, EOS: 0.01}, (A_, A_): {EOS: 0.99},
        (B_,): {EOS: 0.9}}


def test_beam_search_waits_for_a_better_longer_hypothesis():
    """Two short, unlikely hypotheses finish first; the search must not stop at K finished ones
    while a live beam can still beat them under the length penalty."""
    m = MarkovModel(TRAP)
    src = np.array([[4, 4, 4]])
    g = greedy_decode(m, src)
    assert g.tokens == [[A_, A_]]
    for K in (2, 3, 4):
        res = beam_search(m, src, beam_size=K, alpha=0.6)
        assert res.tokens == [[A_, A_]], (K, res.n_best)
        expected = math.log(0.5 * 0.98 * 0.99) / length_penalty(3, 0.6)
        assert abs(res.scores[0] - expected) < 1e-9


def test_beam_search_stops_once_no_live_beam_can_win():
    """The search is not run to the length limit: it ends when every live beam's bound
    (log P / lp(limit)) is below the best finished score."""
    m = MarkovModel(TRAP)
    res = beam_search(m, np.array([[4, 4, 4]]), beam_size=2, alpha=0.6)
    longest = max(len(t) for t, _ in res.n_best[0])
    assert longest < 10, res.n_best[0]            # the limit is 3 + 50 tokens
    with pytest.raises(ValueError, match="alpha"):
        beam_search(m, np.array([[4]]), beam_size=2, alpha=-0.5)


@pytest.mark.parametrize("every", [1, 2, 5, 8])
@pytest.mark.parametrize("fast", [False, True])
def test_greedy_on_a_gpu_looks_for_eos_every_few_positions(monkeypatch, every, fast):
    """On a GPU the fast engine's greedy decoding learns which sentences have ended only every
    ``EOS_CHECK_EVERY`` positions (one transfer each; the readable search, made to look as
    seldom, runs the same loop): finished rows run on until the next look, and the host replays
    the positions in order. Tokens, scores and attention are those of looking at every position
    (NumPy's), with sentences ending at several lengths (rows leave the batch at the looks)."""
    import attn.decode as D
    import attn.fast.decoding.search as fast_decoding
    from conftest import selected_backend
    with selected_backend("numpy"):
        want = greedy_decode(eos_model(), sources(), with_attention=True)
    assert len({len(t) for t in want.tokens}) >= 3
    monkeypatch.setattr(D.ReadableSearch, "check_every", every)      # the readable search looks every position
    monkeypatch.setattr(fast_decoding, "EOS_CHECK_EVERY", every)
    with selected_backend("fakecupy") as cp:
        m = eos_model()
        if fast:
            from attn.fast import FastTransformer
            m = FastTransformer.from_model(m)
        got = greedy_decode(m, cp.asarray(sources()), with_attention=True)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-12)
    for a, b in zip(got.cross_attention, want.cross_attention):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("K", [1, 3, 5])
@pytest.mark.parametrize("fast", [False, True])
def test_beam_search_on_a_gpu_ranks_candidates_in_one_kernel(K, fast):
    """On a GPU each step's candidates are ranked by one kernel (``beam_candidates``: each beam's
    best tokens, then each sentence's best 2K) instead of NumPy's preselection and partitions: the
    same hypotheses, scores, n-best lists and attention as on NumPy, with hypotheses finishing at
    several lengths (K = 5 keeps 10 of 13 tokens a beam: the two banned ids are never candidates)."""
    from conftest import selected_backend
    with selected_backend("numpy"):
        want = beam_search(eos_model(), sources(), beam_size=K, with_attention=True)
    assert len({len(h) for nb in want.n_best for h, _ in nb}) >= 3      # hypotheses end at several lengths
    with selected_backend("fakecupy") as cp:
        m = eos_model()
        if fast:
            from attn.fast import FastTransformer
            m = FastTransformer.from_model(m)
        got = beam_search(m, cp.asarray(sources()), beam_size=K, with_attention=True)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-12)
    assert [[h for h, _ in nb] for nb in got.n_best] == [[h for h, _ in nb] for nb in want.n_best]
    for a, b in zip(got.cross_attention, want.cross_attention):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)

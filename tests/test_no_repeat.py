"""Decoding that does not repeat itself: ``no_repeat_ngram`` blocks, at every step, each token
that would complete an n-gram the hypothesis already holds (:func:`attn.decode.repeated_ngrams`).

A tiny random model whose EOS is rare loops, which makes it a fair test case: the tests check
that its unblocked output does repeat n-grams, so none passes vacuously.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attn.decode import beam_search, greedy_decode, repeated_ngrams
from test_decode import dev, sources, tiny_model


def brute_force(history, n):
    """Each (row, token) that would repeat an n-gram, by looking at every earlier window."""
    out = set()
    for r, row in enumerate(history.tolist()):
        t = len(row)
        if n == 1:
            out |= {(r, x) for x in row}
            continue
        if t < n - 1:
            continue
        last = row[t - n + 1:]
        for j in range(t - n + 1):
            if row[j:j + n - 1] == last:
                out.add((r, row[j + n - 1]))
    return out


def ngrams(tokens, n):
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def repeats(tokens, n):
    grams = ngrams(tokens, n)
    return len(grams) != len(set(grams))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5), st.integers(0, 12), st.integers(1, 4), st.integers(2, 5), st.integers(0, 2**32 - 1))
def test_repeated_ngrams_is_the_brute_force(rows, t, n, alphabet, seed):
    history = np.random.default_rng(seed).integers(0, alphabet, (rows, t))
    r, tok = repeated_ngrams(history, n)
    assert r.dtype == tok.dtype == np.int64
    assert set(zip(r.tolist(), tok.tolist())) == brute_force(history, n)


def test_repeated_ngrams_example():
    h = np.array([[5, 6, 7, 5, 6], [1, 2, 3, 4, 5]])
    r, tok = repeated_ngrams(h, 3)                  # row 0 ends in "5 6", seen before "7"
    assert list(zip(r.tolist(), tok.tolist())) == [(0, 7)]
    r, tok = repeated_ngrams(h, 2)                  # row 0 ends in "6": followed by 7 before
    assert list(zip(r.tolist(), tok.tolist())) == [(0, 7)]


def looping_model():
    return tiny_model(seed=2, eos_scale=0.5)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("K", [None, 3])
def test_blocked_outputs_hold_no_repeated_ngram(n, K):
    m = looping_model()
    src = dev(m, sources())
    run = (lambda **kw: greedy_decode(m, src, **kw)) if K is None else \
        (lambda **kw: beam_search(m, src, beam_size=K, **kw))
    free = run()
    assert sum(repeats(t, n) for t in free.tokens) >= 3, free.tokens       # the model does loop
    blocked = run(no_repeat_ngram=n)
    assert not any(repeats(t, n) for t in blocked.tokens), blocked.tokens
    for hyps in blocked.n_best or []:
        assert not any(repeats(h, n) for h, _ in hyps)


def test_blocking_beyond_the_outputs_changes_nothing():
    m = tiny_model()
    src = dev(m, sources())
    want = beam_search(m, src, beam_size=3)
    longest = max(len(h) for nb in want.n_best for h, _ in nb)
    got = beam_search(m, src, beam_size=3, no_repeat_ngram=longest + 2)
    assert got.tokens == want.tokens and got.scores == want.scores


@pytest.mark.parametrize("K", [None, 3])
@pytest.mark.parametrize("use_cache", [True, False])
def test_fast_engine_and_a_gpu_block_the_same_tokens(K, use_cache):
    """The fast model on the CuPy stand-in (where greedy decoding otherwise looks at the device
    only every few positions) blocks what the readable model on NumPy blocks."""
    from attn.fast import FastTransformer
    from conftest import selected_backend
    run = (lambda m, s: greedy_decode(m, s, use_cache=use_cache, no_repeat_ngram=3)) if K is None else \
        (lambda m, s: beam_search(m, s, beam_size=K, use_cache=use_cache, no_repeat_ngram=3))
    with selected_backend("numpy"):
        want = run(looping_model(), sources())
    with selected_backend("fakecupy") as cp:
        got = run(FastTransformer.from_model(looping_model()), cp.asarray(sources()))
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [-1, 2.0, True, "3"])
def test_bad_no_repeat_is_refused(bad):
    m = tiny_model()
    for search in (greedy_decode, beam_search):
        with pytest.raises(ValueError, match="no_repeat_ngram"):
            search(m, np.array([[4, 5]]), no_repeat_ngram=bad)

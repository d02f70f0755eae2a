"""Decoding through the fast path (:mod:`attn.fast`, :mod:`attn.fast.decoding`) against the
reference (:mod:`attn.model`, :mod:`attn.decode`), on every backend this machine has.

* Greedy and beam search pick the reference's tokens with its scores: rows split over
  threads, buffers grown past their first capacity, a source of padding alone, pre- and
  post-norm.
* ``encode``, ``decode`` and ``project`` give the reference's numbers, split over threads or
  not; decoding with the attention returned gives its cross-attention, cached and uncached.
* A decode state stepped twice leaves its successor alone; rows of one sentence share its
  cross-attention keys and values; ``select`` hands the buffers on, and the states it came
  from refuse to be used again.
* On CuPy (the stand-in where no GPU is usable) the device decode state is the reference's
  step by step and refuses an older state; the decoding kernels equal the sums they stand for.
"""
from __future__ import annotations

import numpy as np
import pytest

import attn.backend as B
from attn.fast import FastTransformer
from attn.gradcheck import rel_error
from attn.model import Transformer, TransformerConfig


def _ref_and_fast(seed, **config):
    """A float64 reference model on the current backend (2 heads, no dropout unless asked)
    and the fast view of it."""
    cfg = TransformerConfig(**{"n_heads": 2, "dropout": 0.0, "max_len": 32, **config})
    ref = Transformer(cfg, seed=seed, dtype="float64")
    return cfg, ref, FastTransformer.from_model(ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beam", [1, 3])
def test_fast_decoding_matches_reference(backend, seed, beam):
    """Greedy and beam search through FastTransformer (single-threaded BLAS for small steps,
    cross-attention keys/values kept when a reorder leaves every row's sentence) pick the
    reference's tokens with its scores; the random models end some sentences early."""
    from attn import decode
    cfg, ref, fast = _ref_and_fast(seed=seed, vocab_size=9, d_model=8, d_ff=12,
                                   n_encoder_layers=1, n_decoder_layers=2)
    src = B.to_device(np.array([[4, 5, 6, 7, 0], [8, 5, 4, 6, 7], [6, 0, 0, 0, 0], [7, 7, 5, 0, 0]]))
    if beam == 1:
        want, got = (decode.greedy_decode(m, src, max_len=8) for m in (ref, fast))
    else:
        want, got = (decode.beam_search(m, src, beam_size=beam, max_len=8) for m in (ref, fast))
    assert got.tokens == want.tokens
    assert np.allclose(got.scores, want.scores, rtol=1e-12, atol=1e-12)
    # seeds 0 and 1 end sentences early (lengths [8, 8, 8, 4] / [3, 1, 8, 8] and [8, 0, 8, 8] /
    # [0, 0, 0, 0]), so rows leave the batch; seed 2 runs every sentence to the limit


@pytest.mark.parametrize("norm,positional", [("post", "sinusoidal"), ("pre", "learned")])
@pytest.mark.parametrize("beam", [1, 3])
def test_fast_decoding_split_and_grown_matches_reference(monkeypatch, norm, positional, beam):
    """The fast step with its rows split over threads (parts of 2 rows), buffers grown past
    their first capacity (40 positions), a source that is all padding, pre- and post-norm:
    the reference decoder's tokens and scores."""
    from attn import decode
    from attn.fast.decoding import host as decoding
    monkeypatch.setattr(decoding, "MIN_ROWS_PER_PART", 2)
    B.set_backend("numpy")
    cfg, ref, fast = _ref_and_fast(seed=4, vocab_size=11, d_model=8, d_ff=12,
                                   n_encoder_layers=1, n_decoder_layers=2, max_len=64, norm_position=norm,
                                   positional=positional)
    fast.workers = 3
    src = np.array([[4, 5, 6, 7, 0], [8, 5, 4, 6, 7], [0, 0, 0, 0, 0], [7, 7, 5, 0, 0], [9, 10, 4, 0, 0],
                    [6, 6, 6, 6, 6]])
    if beam == 1:
        want, got = (decode.greedy_decode(m, src, max_len=40) for m in (ref, fast))
    else:
        want, got = (decode.beam_search(m, src, beam_size=beam, max_len=40) for m in (ref, fast))
    assert got.tokens == want.tokens
    assert np.allclose(got.scores, want.scores, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("use_cache", [True, False])
def test_fast_encode_decode_and_attention_match_reference(workers, use_cache):
    """FastTransformer.encode / decode without dropout (the fast stacks, split over threads)
    give the reference's memory and decoder output, and decoding with the attention returned
    (cached and uncached) gives the reference's tokens, scores and cross-attention."""
    from attn import decode
    from attn.masks import padding_mask
    B.set_backend("numpy")
    cfg, ref, fast = _ref_and_fast(seed=2, vocab_size=13, d_model=8, d_ff=12,
                                   n_encoder_layers=2, n_decoder_layers=2, dropout=0.1)
    fast.workers = workers
    fast.SPLIT_MIN_SIZE = 0
    src = np.array([[4, 5, 6, 7, 0], [8, 9, 10, 11, 12], [0, 0, 0, 0, 0], [7, 7, 5, 0, 0]])
    mask = padding_mask(src)
    m_ref, m_fast = ref.encode(src, None, mask)[0], fast.encode(src, None, mask)[0]
    assert rel_error(m_fast, m_ref) < 1e-12
    tgt = np.array([[1, 4, 5], [1, 6, 0], [1, 0, 0], [1, 9, 9]])
    (h_ref, c_ref, tm_ref), (h_fast, c_fast, tm_fast) = (m.decode(tgt, m_ref, mask) for m in (ref, fast))
    assert rel_error(h_fast, h_ref) < 1e-12 and np.array_equal(tm_fast, tm_ref)
    for i in range(cfg.n_decoder_layers):
        w_ref, w_fast = c_ref.layers[i][1].sub.attn.weights, c_fast.layers[i][1].sub.attn.weights
        assert w_fast.shape == w_ref.shape and rel_error(w_fast, w_ref) < 1e-12
    want = decode.greedy_decode(ref, src, max_len=7, use_cache=use_cache, with_attention=True)
    got = decode.greedy_decode(fast, src, max_len=7, use_cache=use_cache, with_attention=True)
    assert got.tokens == want.tokens and np.allclose(got.scores, want.scores, rtol=1e-12, atol=1e-12)
    for a, b in zip(got.cross_attention, want.cross_attention):
        assert a.shape == b.shape and np.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_fast_decode_state_can_be_stepped_twice():
    """Stepping a state writes the next position into buffers its successor shares; stepping the
    same (older) state again must not disturb that successor, and gives the reference's numbers."""
    B.set_backend("numpy")
    cfg, ref, fast = _ref_and_fast(seed=1, vocab_size=9, d_model=8, d_ff=12,
                                   n_encoder_layers=1, n_decoder_layers=1)
    src = np.array([[4, 5, 6, 0], [7, 8, 4, 5]])
    mask = (src != 0)[:, None, None, :]
    memory, _ = ref.encode(src, None, mask)
    s_ref, s_fast = ref.start_decoding(memory, mask), fast.start_decoding(memory, mask)
    for tok in ([1, 1], [4, 5]):
        _, s_ref, _ = ref.decode_step(np.array(tok), s_ref)
        _, s_fast, _ = fast.decode_step(np.array(tok), s_fast)
    a_logp, a_state, _ = fast.decode_step(np.array([6, 6]), s_fast)
    b_logp, b_state, _ = fast.decode_step(np.array([7, 8]), s_fast)       # the same state again
    c_logp, _, _ = fast.decode_step(np.array([5, 5]), a_state)            # a's successor still right
    r_a, r_a_state, _ = ref.decode_step(np.array([6, 6]), s_ref)
    r_b, _, _ = ref.decode_step(np.array([7, 8]), s_ref)
    r_c, _, _ = ref.decode_step(np.array([5, 5]), r_a_state)
    for got, want in ((a_logp, r_a), (b_logp, r_b), (c_logp, r_c)):
        assert rel_error(got, want) < 1e-12
    for (k, v), (rk, rv) in zip(b_state.self_kv, ref.decode_step(np.array([7, 8]), s_ref)[1].self_kv):
        assert rel_error(k, rk) < 1e-12 and rel_error(v, rv) < 1e-12


@pytest.mark.parametrize("workers", [1, 2])
def test_fast_decode_state_shares_cross_attention_within_groups(workers):
    """Rows of one sentence side by side share one copy of its cross-attention keys and
    values (beam search's layout), reordering within the groups copies none of them, and
    irregular selections fall back to smaller groups: the numbers stay the reference's (a
    source of padding alone included: its row attends to nothing)."""
    B.set_backend("numpy")
    cfg, ref, fast = _ref_and_fast(seed=4, vocab_size=11, d_model=8, d_ff=12,
                                   n_encoder_layers=1, n_decoder_layers=2)
    fast.workers = workers
    src = np.array([[4, 5, 6, 0], [7, 8, 4, 5], [0, 0, 0, 0], [5, 5, 6, 7], [8, 4, 0, 0], [6, 9, 10, 4]])
    mask = (src != 0)[:, None, None, :]
    memory, _ = ref.encode(src, None, mask)
    s_ref, s_fast = ref.start_decoding(memory, mask), fast.start_decoding(memory, mask)
    rng = np.random.default_rng(0)

    def step(s_ref, s_fast):
        toks = rng.integers(3, cfg.vocab_size, s_fast.sentence.shape[0])
        want, s_ref, w_ref = ref.decode_step(toks, s_ref)
        got, s_fast, w_fast = fast.decode_step(toks, s_fast)
        assert rel_error(got, want) < 1e-12
        for a, b in zip(w_fast, w_ref):
            assert rel_error(a, b) < 1e-12
        return s_ref, s_fast
    s_ref, s_fast = step(s_ref, s_fast)
    selections = [(np.repeat(np.arange(6), 3), 3, "kept"),                 # beam 3's first select
                  (np.arange(18).reshape(6, 3)[:, [2, 0, 0]].ravel(), 3, "kept"),   # within the groups
                  (np.array([0, 1, 2, 6, 6, 6, 15, 16, 17]), 3, "copied"),  # sentences 1, 3, 4 finished
                  (np.array([0, 0, 3, 4, 4, 5, 8]), 1, "copied")]           # irregular
    for index, group, cross in selections:
        before = s_fast.cross
        s_ref, s_fast = s_ref.select(index), s_fast.select(index)
        assert s_fast.group == group
        assert (s_fast.cross is before) == (cross == "kept")
        assert s_fast.cross[0][0].shape[0] == index.shape[0] // group
        for (k, v), (rk, rv) in zip(s_fast.cross_kv, s_ref.cross_kv):
            assert rel_error(k, rk) < 1e-15 and rel_error(v, rv) < 1e-15
        s_ref, s_fast = step(s_ref, s_fast)


def test_fast_decode_state_select_hands_its_buffers_on():
    """select() moves the key/value buffers to the new state, reordered layer by layer: its
    numbers are the reference's, the states it came from refuse to be used again (a clear
    ValueError, not wrong numbers), and the reorder needs about one layer's array beyond the
    buffers, not a second set of them (as growing the buffers does)."""
    import tracemalloc
    B.set_backend("numpy")
    tracemalloc.start()            # before the buffers exist: it sees frees only of what it saw allocated
    try:
        _select_hands_its_buffers_on(tracemalloc)
    finally:
        tracemalloc.stop()


def _select_hands_its_buffers_on(tracemalloc):
    cfg, ref, fast = _ref_and_fast(seed=1, vocab_size=9, d_model=64, d_ff=16,
                                   n_encoder_layers=1, n_decoder_layers=4, max_len=64)
    n = 48
    src = np.tile(np.array([[4, 5, 6, 0], [7, 8, 4, 5]]), (n // 2, 1))
    mask = (src != 0)[:, None, None, :]
    memory, _ = ref.encode(src, None, mask)
    s_ref, s_fast = ref.start_decoding(memory, mask), fast.start_decoding(memory, mask)
    toks = np.arange(n) % 5 + 3
    for _ in range(3):
        _, s_ref, _ = ref.decode_step(toks, s_ref)
        _, older, _ = fast.decode_step(toks, s_fast)
        s_fast, s_prev = older, s_fast
    first = np.repeat(np.arange(n // 2), 2)                    # as beam search's first select: 2 rows a sentence
    s_fast, s_ref = s_fast.select(first), s_ref.select(first)
    _, s_ref, _ = ref.decode_step(toks, s_ref)
    _, s_fast, _ = fast.decode_step(toks, s_fast)
    index = np.arange(n).reshape(-1, 2)[:, ::-1].ravel()      # the two rows of each sentence swap
    one_array = s_fast.kv.keys[0].nbytes
    buffers = 2 * cfg.n_decoder_layers * one_array
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    s_sel = s_fast.select(index)
    peak = tracemalloc.get_traced_memory()[1] - before
    assert peak < one_array + buffers / 8, (peak, one_array, buffers)
    r_sel = s_ref.select(index)
    got, _, _ = fast.decode_step(toks, s_sel)
    want, _, _ = ref.decode_step(toks, r_sel)
    assert rel_error(got, want) < 1e-12
    for stale, what in ((s_fast, "decode_step"), (s_prev, "decode_step")):
        with pytest.raises(ValueError, match="select"):
            fast.decode_step(toks, stale)
    with pytest.raises(ValueError, match="select"):
        s_fast.select(index)
    with pytest.raises(ValueError, match="select"):
        s_fast.self_kv


def test_keep_freed_memory_is_harmless():
    """A process-wide malloc setting: it must not break allocation, and it says whether it applied."""
    import subprocess
    import sys
    code = ("import numpy as np; from attn.fast import keep_freed_memory; ok = keep_freed_memory(); "
            "a = [np.ones(1 << 20) for _ in range(20)]; del a; b = np.ones(1 << 22); print(ok, b.sum())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ok, total = r.stdout.split()
    assert ok in ("True", "False") and float(total) == 1 << 22


@pytest.mark.parametrize("workers,split_min", [(None, 0), (None, 1 << 40), (1, 0), (3, 0)])
def test_fast_projection_matches_reference(workers, split_min):
    """FastTransformer.project (rows split over the helper threads, or on one BLAS thread, or
    BLAS's own with workers=1) is the reference's projection, for (n, D) and (B, T, D) inputs,
    a strided view included (the last position of each row, as decoding projects it)."""
    B.set_backend("numpy")
    cfg, ref, fast = _ref_and_fast(seed=3, vocab_size=23, d_model=8, d_ff=12,
                                   n_encoder_layers=1, n_decoder_layers=1, dropout=0.1)
    fast.workers, fast.SPLIT_MIN_SIZE = workers, split_min
    h = np.random.default_rng(0).normal(size=(5, 7, 8))
    for x in (h, h[:, -1, :], h[0]):
        got, want = fast.project(x), ref.project(x)
        assert got.shape == want.shape == x.shape[:-1] + (23,)
        assert rel_error(got, want) < 1e-14


@pytest.mark.parametrize("norm,positional", [("post", "sinusoidal"), ("pre", "learned")])
def test_device_decode_state_matches_reference(norm, positional):
    """On CuPy (the stand-in: the kernels' NumPy twins) FastTransformer decodes with a
    DeviceDecodeState: step by step its log-probabilities, cross-attention weights and cached
    keys/values are the reference decoder's, through buffers grown past their first 16 positions
    and 6 rows (no reserve), beam search's selects (groups kept, reordered within them, then
    irregular) and a source of padding alone; pre- and post-norm."""
    from attn.fast import DeviceDecodeState
    from conftest import selected_backend
    with selected_backend("fakecupy") as cp:
        cfg, ref, fast = _ref_and_fast(seed=4, vocab_size=11, d_model=8, d_ff=12, n_encoder_layers=1,
                                       n_decoder_layers=2, norm_position=norm, positional=positional)
        src = cp.asarray(np.array([[4, 5, 6, 0], [7, 8, 4, 5], [0, 0, 0, 0], [5, 5, 6, 7], [8, 4, 0, 0],
                                   [6, 9, 10, 4]]))
        mask = (src != 0)[:, None, None, :]
        memory, _ = ref.encode(src, None, mask)
        s_ref, s_fast = ref.start_decoding(memory, mask), fast.start_decoding(memory, mask)
        assert isinstance(s_fast, DeviceDecodeState) and s_fast.buf.capacity == 16 and s_fast.buf.rows == 6
        rng = np.random.default_rng(0)

        def step(s_ref, s_fast):
            toks = cp.asarray(rng.integers(3, cfg.vocab_size, s_fast.n))
            want, s_ref, w_ref = ref.decode_step(toks, s_ref)
            got, s_fast, w_fast = fast.decode_step(toks, s_fast)
            assert rel_error(B.to_host(got), B.to_host(want)) < 1e-12
            for a, b in zip(w_fast, w_ref):
                assert a.shape == b.shape and rel_error(B.to_host(a), B.to_host(b)) < 1e-12
            return s_ref, s_fast
        selections = [(np.repeat(np.arange(6), 3), 3, True),                      # beam 3's first select
                      (np.arange(18).reshape(6, 3)[:, [2, 0, 0]].ravel(), 3, True),   # within the groups
                      (np.array([0, 1, 2, 6, 6, 6, 15, 16, 17]), 3, False),      # sentences 1, 3, 4 finished
                      (np.array([0, 0, 3, 4, 4, 5, 8]), 1, False)]               # irregular
        for t in range(20):
            s_ref, s_fast = step(s_ref, s_fast)
            if t % 4 == 1 and selections:
                index, group, kept = selections.pop(0)
                before = s_fast.cross
                s_ref, s_fast = s_ref.select(cp.asarray(index)), s_fast.select(cp.asarray(index), index)
                assert s_fast.group == group and (s_fast.cross is before) == kept
        assert s_fast.buf.capacity >= 20 and s_fast.buf.rows >= 18 and not selections
        for (k, v), (rk, rv) in zip(s_fast.self_kv, s_ref.self_kv):
            assert rel_error(B.to_host(k), B.to_host(rk)) < 1e-12 and rel_error(B.to_host(v), B.to_host(rv)) < 1e-12


def test_device_decode_state_is_stepped_once():
    """A DeviceDecodeState's buffers move on with each step and select: an older state raises a
    ValueError that says which state to use, rather than giving the numbers of a later position."""
    from conftest import selected_backend
    with selected_backend("fakecupy") as cp:
        cfg, ref, fast = _ref_and_fast(seed=1, vocab_size=9, d_model=8, d_ff=12, n_encoder_layers=1,
                                       n_decoder_layers=1)
        src = cp.asarray(np.array([[4, 5, 6, 0], [7, 8, 4, 5]]))
        mask = (src != 0)[:, None, None, :]
        s0 = fast.start_decoding(fast.encode(src, None, mask)[0], mask)
        toks = cp.asarray(np.array([1, 1]))
        _, s1, _ = fast.decode_step(toks, s0)
        with pytest.raises(ValueError, match="already stepped"):
            fast.decode_step(toks, s0)
        s2 = s1.select(cp.asarray(np.array([1, 0])), np.array([1, 0]))
        for stale in (lambda: fast.decode_step(toks, s1), lambda: s1.select(toks, np.array([0, 0])),
                      lambda: s1.self_kv):
            with pytest.raises(ValueError, match="use the state"):
                stale()
        _, s3, _ = fast.decode_step(toks, s2)
        with pytest.raises(IndexError, match="out of range"):
            s3.select(toks, np.array([0, 2]))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cupy_decoding_kernels_match_numpy(cupy, dtype):
    """The decoding kernels (launched by DecodeKernels) against the sums they stand for: the
    single-query attention with rows sharing keys in groups, a padded source and a source of
    padding alone (zero weights), the self-attention's new key and value written into the cache;
    the residual-and-norm epilogue (out may be x); the log-softmax; and the two picks, whose
    equal scores go to the lower id (as argmax and a stable sort by score do); the cache's reorder."""
    from attn.fast.decoding.device import kernels
    cp = cupy
    K = kernels(cp)
    rng = np.random.default_rng(1)
    tol = 1e-5 if dtype == "float32" else 1e-12
    dt = np.dtype(dtype).type
    n, g, H, Dh, S, cap = 6, 2, 2, 3, 5, 7
    D = H * Dh
    # cross-attention: rows 2j and 2j+1 share keys j; sentence 1 has 3 real positions, sentence 2 none
    q, bq = rng.standard_normal((n, D)).astype(dtype), rng.standard_normal(D).astype(dtype)
    k, v = (rng.standard_normal((n // g, H, S, Dh)).astype(dtype) for _ in range(2))
    real = np.ones((n, S), bool)
    real[2:4, 3:] = False
    real[4:6] = False
    bias = np.where(real, 0, np.finfo(dtype).min).astype(dtype)
    w, ctx = cp.zeros((n, H, S), dtype=dtype), cp.zeros((n, D), dtype=dtype)
    K.attend(cp.asarray(q), cp.asarray(bq), cp.asarray(k), cp.asarray(v), g, cp.asarray(bias), w, ctx, H, S, False)
    qh = (q + bq).reshape(n, H, Dh)
    kk, vv = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)
    s = np.einsum("nhd,nhjd->nhj", qh, kk)
    s = np.where(real[:, None], s, -np.inf)
    with np.errstate(invalid="ignore"):                                    # rows with no key: nan, then 0
        e = np.exp(s - s.max(-1, keepdims=True))
        want_w = np.nan_to_num(e / e.sum(-1, keepdims=True))
    assert np.array_equal(cp.asnumpy(w) == 0, want_w == 0) and rel_error(cp.asnumpy(w), want_w) < tol
    want_ctx = np.einsum("nhj,nhjd->nhd", want_w, vv).reshape(n, D)
    assert np.all(cp.asnumpy(ctx)[4:] == 0) and rel_error(cp.asnumpy(ctx), want_ctx) < tol
    # self-attention at position t = 3 of a cache with room for 7: writes the new key and value first
    t = 3
    qkv, bqkv = rng.standard_normal((n, 3 * D)).astype(dtype), rng.standard_normal(3 * D).astype(dtype)
    cache = rng.standard_normal((n, 2, H, cap, Dh)).astype(dtype)
    cache_d, ws = cp.asarray(cache), cp.zeros((n, H, cap), dtype=dtype)
    K.attend(cp.asarray(qkv), cp.asarray(bqkv), cache_d[:, 0], cache_d[:, 1], 1, None, ws, ctx, H, t + 1, True)
    new = (qkv + bqkv).reshape(n, 3, H, Dh)
    cache[:, 0, :, t], cache[:, 1, :, t] = new[:, 1], new[:, 2]
    assert rel_error(cp.asnumpy(cache_d), cache) < tol                    # position t written, the rest kept
    s = np.einsum("nhd,nhjd->nhj", new[:, 0], cache[:, 0, :, :t + 1])
    e = np.exp(s - s.max(-1, keepdims=True))
    want_ctx = np.einsum("nhj,nhjd->nhd", e / e.sum(-1, keepdims=True), cache[:, 1, :, :t + 1]).reshape(n, D)
    assert rel_error(cp.asnumpy(ctx), want_ctx) < tol
    # add_norm, into another buffer and into x itself
    x, sub, b = (rng.standard_normal(shape).astype(dtype) for shape in ((n, D), (n, D), (D,)))
    gamma, beta = rng.standard_normal(D).astype(dtype), rng.standard_normal(D).astype(dtype)
    y = (sub + b) + x
    want = (y - y.mean(1, keepdims=True)) / np.sqrt(y.var(1, keepdims=True) + dt(1e-6)) * gamma + beta
    x_d, out_d = cp.asarray(x), cp.empty((n, D), dtype=dtype)
    K.add_norm(x_d, cp.asarray(sub), cp.asarray(b), out_d, cp.asarray(gamma), cp.asarray(beta), 1e-6)
    assert rel_error(cp.asnumpy(x_d), y) < tol and rel_error(cp.asnumpy(out_d), want) < tol
    x_d = cp.asarray(x)
    K.add_norm(x_d, cp.asarray(sub), cp.asarray(b), x_d, cp.asarray(gamma), cp.asarray(beta), 1e-6)
    assert rel_error(cp.asnumpy(x_d), want) < tol
    # log-softmax in place, then the picks with ties (ids 0 and 1 banned)
    V = 9
    logits = rng.standard_normal((4, V)).astype(dtype)
    logits[0, [0, 3, 5]] = 9.0                                             # a banned id above a tie of 3 and 5
    logits[1, [2, 7]] = 8.0
    lp = cp.asarray(logits)
    K.log_softmax(lp, lp)
    want_lp = logits - logits.max(1, keepdims=True)
    want_lp -= np.log(np.exp(want_lp).sum(1, keepdims=True))
    assert rel_error(cp.asnumpy(lp), want_lp) < tol
    info, toks = cp.zeros((2, 4), dtype=np.float64), cp.zeros(4, dtype=np.int64)
    K.greedy_pick(lp, (0, 1), info, toks)
    banned = want_lp.copy()
    banned[:, :2] = -np.inf
    ids = banned.argmax(1)
    assert ids[0] == 3 and ids[1] == 2 and cp.asnumpy(toks).tolist() == ids.tolist()
    assert np.array_equal(cp.asnumpy(info), np.stack([ids, cp.asnumpy(lp)[np.arange(4), ids]]))
    with pytest.raises(ValueError, match="every one of the 2 tokens is banned"):     # nothing to choose
        K.greedy_pick(cp.zeros((4, 2), dtype=dtype), (0, 1), info, toks)
    # beam: 2 sentences x W = 2 beams, each beam's c = 3 best, the sentence's C = 4 best
    W, c, C = 2, 3, 4
    scores = np.array([0.0, -0.5, -1.0, -np.inf])                          # the last beam is dead
    cand = cp.zeros((2, 2, C), dtype=np.float64)
    K.beam_candidates(lp, cp.asarray(scores), W, c, C, (0, 1), cand)
    host = cp.asnumpy(lp).astype(np.float64)
    for sent in range(2):
        pool = []
        for wb in range(W):
            row = sent * W + wb
            best = sorted(range(2, V), key=lambda j: (-host[row, j], j))[:c]
            pool += [(scores[row] + host[row, j], wb * V + j) for j in best]
        top = sorted(pool, key=lambda p: (-p[0], p[1]))[:C]
        assert cp.asnumpy(cand)[:, sent].T.tolist() == [list(p) for p in top], sent
    # the cache's reorder: the written positions of the rows picked (with repeats), the room left alone
    src = rng.standard_normal((4, 2, 2, H, cap, Dh)).astype(dtype)
    dst = rng.standard_normal((5, 2, 2, H, cap, Dh)).astype(dtype)
    dst_d, index = cp.asarray(dst), np.array([3, 3, 0])
    K.gather_prefix(cp.asarray(src), dst_d, cp.asarray(index), 4)
    dst[:3, ..., :4, :] = src[index][..., :4, :]
    assert np.array_equal(cp.asnumpy(dst_d), dst)

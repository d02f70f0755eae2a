"""The fast path (:mod:`attn.fast`) against the reference (:mod:`attn.model`, :mod:`attn.loss`,
:mod:`attn.optim`), on every backend this machine has.

* Logits, loss and every parameter's gradient agree with the reference: to float64 rounding
  on tiny models drawn by hypothesis (every config option, padded batches, sentences that
  are all padding), to float32 rounding on a larger one.
* With dropout on (residual, attention, ReLU), the fast path's own gradient agrees with
  central differences (the masks are reproduced by a fresh seeded RNG).
* The invariants: masked attention weights are exactly zero, a query with no key gets an
  all-zero row, rows sum to one; forward and backward never write into the parameters.
* The pieces: in-place softmax and layer norm against the layers, the fused cross-entropy
  (in place or not) against the reference loss, FastAdam against Adam, the embedding
  scatter-add against ``np.add.at``, the dropout rate and scale.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attn.backend as B
from attn.fast import FastAdam, FastTransformer, Mask, cross_entropy as fast_ce, ops_for
from attn.gradcheck import numerical_gradient, rel_error
from attn.layers import layer_norm_forward, layer_norm_backward, softmax_forward, softmax_backward
from attn.layers.softmax import SoftmaxCache
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig
from attn.optim import Adam
from strategies import padded_ids

# ----------------------------------------------------------------------------- tiny models


@st.composite
def configs(draw, dropout: bool = False, max_width: int = 8):
    """Tiny configs drawing every option: the paper's block and the later one's (RMSNorm, rotary
    positions where the head size is even, SwiGLU, grouped-query attention)."""
    H = draw(st.sampled_from([1, 2, 4] if max_width >= 8 else [1, 2]))
    D = H * draw(st.integers(max(1, 4 // H), max_width // H))     # d_model >= 4: at 2, layer norm
                                                                    # maps every row to +-1
    positionals = ["sinusoidal", "learned"] + (["rope"] if (D // H) % 2 == 0 else [])
    share = draw(st.booleans())
    V = draw(st.integers(3, 9))
    Vt = V if share else draw(st.integers(3, 9))
    p = 0.3 if dropout else 0.0
    return TransformerConfig(
        vocab_size=V, tgt_vocab_size=None if share else Vt, share_embeddings=share,
        d_model=D, n_heads=H, d_ff=draw(st.integers(2, 8)),
        n_encoder_layers=draw(st.integers(1, 2)), n_decoder_layers=draw(st.integers(1, 2)),
        dropout=p, attention_dropout=p, relu_dropout=p,
        label_smoothing=draw(st.sampled_from([0.0, 0.1])), max_len=16,
        positional=draw(st.sampled_from(positionals)), norm_position=draw(st.sampled_from(["post", "pre"])),
        norm_kind=draw(st.sampled_from(["layer", "rms"])), ffn=draw(st.sampled_from(["relu", "swiglu"])),
        kv_heads=draw(st.sampled_from([None] + [k for k in (1, 2) if H % k == 0 and k < H])))


@st.composite
def batches(draw, cfg, max_batch=3, max_len=5, all_pad_row=True):
    Bsz = draw(st.integers(1, max_batch))
    S, T = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    src = draw(padded_ids(Bsz, S, cfg.vocab_size))
    tgt = draw(padded_ids(Bsz, T + 1, cfg.target_vocab_size, min_len=2))
    if all_pad_row and Bsz > 1 and draw(st.booleans()):
        src[-1] = 0                                   # a sentence that is all padding
    return src, tgt[:, :-1].copy(), tgt[:, 1:].copy()


def _both(cfg, seed, dtype, batch, workers=None):
    ref = Transformer(cfg, seed=seed, dtype=dtype)
    fast = FastTransformer.from_model(ref)
    fast.workers = workers
    src, tgt_in, tgt_out = (B.to_device(a) for a in batch)
    l_ref, c_ref = ref.forward(src, tgt_in)
    l_fast, c_fast = fast.forward(src, tgt_in)
    loss_ref, d_ref = cross_entropy(l_ref, tgt_out, cfg.label_smoothing)
    logits_fast = l_fast.copy()
    loss_fast, d_fast = fast_ce(l_fast, tgt_out, cfg.label_smoothing, inplace=True)
    return (ref, fast, logits_fast, l_ref, loss_ref, loss_fast,
            ref.backward(d_ref, c_ref), fast.backward(d_fast, c_fast))


def _assert_close_grads(g_ref, g_fast, tol):
    assert set(g_ref) == set(g_fast)
    for k in g_ref:
        assert g_fast[k].shape == g_ref[k].shape and g_fast[k].dtype == g_ref[k].dtype, k
        err = rel_error(B.to_host(g_ref[k]), B.to_host(g_fast[k]))
        assert err < tol, f"gradient of {k}: relative error {err:.2e} (tolerance {tol:.0e})"


@settings(max_examples=25)
@given(data=st.data(), workers=st.sampled_from([1, 2, 3]))
def test_fast_matches_reference_float64(backend, data, workers):
    """workers > 1: the batch is split over threads (NumPy) and the parts' gradients summed."""
    cfg = data.draw(configs())
    batch = data.draw(batches(cfg))
    _, _, logits, l_ref, loss_ref, loss_fast, g_ref, g_fast = _both(cfg, 0, "float64", batch, workers)
    assert rel_error(B.to_host(l_ref), B.to_host(logits)) < 1e-12
    assert abs(float(loss_ref) - float(loss_fast)) < 1e-12 * max(1.0, abs(float(loss_ref)))
    _assert_close_grads(g_ref, g_fast, 1e-10)


@pytest.mark.parametrize("workers", [1, 2])
def test_fast_matches_reference_float32(backend, workers):
    cfg = TransformerConfig(vocab_size=300, d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2,
                            n_decoder_layers=2, dropout=0.0, label_smoothing=0.1, max_len=32)
    rng = np.random.default_rng(3)
    src = rng.integers(4, 300, (6, 12))
    tgt = rng.integers(4, 300, (6, 11))
    src[0, 7:] = 0
    tgt[1, 5:] = 0
    ref, fast, logits, l_ref, loss_ref, loss_fast, g_ref, g_fast = _both(
        cfg, 1, "float32", (src, tgt[:, :-1].copy(), tgt[:, 1:].copy()), workers)
    assert logits.dtype == B.host.float32 and all(g.dtype == np.float32 for g in g_fast.values())
    assert rel_error(B.to_host(l_ref), B.to_host(logits)) < 1e-5
    assert abs(float(loss_ref) - float(loss_fast)) < 1e-5
    _assert_close_grads(g_ref, g_fast, 1e-4)


@pytest.mark.parametrize("workers", [1, 2])
def test_logits_for_evaluation_match_forward(backend, workers):
    cfg = TransformerConfig(vocab_size=20, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=2,
                            n_decoder_layers=2, dropout=0.2)
    model = FastTransformer(cfg, seed=2)
    model.workers = workers
    src = B.to_device(np.array([[5, 6, 7, 0], [8, 9, 0, 0], [4, 4, 4, 4]]))
    tgt = B.to_device(np.array([[1, 5, 6], [1, 7, 0], [1, 3, 3]]))
    want = Transformer(cfg, seed=2).forward(src, tgt)[0]
    assert rel_error(B.to_host(model.logits(src, tgt)), B.to_host(want)) < 1e-5


@pytest.mark.parametrize("workers", [1, 2])
def test_forward_backward_leave_parameters_and_inputs_alone(backend, workers):
    cfg = TransformerConfig(vocab_size=20, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=2,
                            n_decoder_layers=2, dropout=0.2, attention_dropout=0.1, relu_dropout=0.1)
    model = FastTransformer(cfg, seed=2)
    model.workers = workers
    before = {k: B.to_host(v).copy() for k, v in model.params.items()}
    src = B.to_device(np.array([[5, 6, 7, 0], [8, 9, 0, 0]]))
    tgt = B.to_device(np.array([[1, 5, 6], [1, 7, 0]]))
    src_h, tgt_h = B.to_host(src).copy(), B.to_host(tgt).copy()
    logits, cache = model.forward(src, tgt, B.DeviceRNG(0))
    _, d = fast_ce(logits, tgt, 0.1, inplace=True)
    model.backward(d, cache)
    for k, v in model.params.items():
        assert np.array_equal(B.to_host(v), before[k]), f"{k} was modified"
    assert np.array_equal(B.to_host(src), src_h) and np.array_equal(B.to_host(tgt), tgt_h)


@settings(max_examples=4)
@given(data=st.data(), workers=st.sampled_from([1, 2]))
def test_fast_gradient_with_dropout_matches_numerical(data, workers):
    """float64, every dropout on; the masks repeat because every forward gets a fresh RNG
    with the same seed (so the loss is a fixed function of the parameters)."""
    B.set_backend("numpy")
    cfg = data.draw(configs(dropout=True, max_width=4))
    cfg = TransformerConfig(**{**cfg.to_dict(), "n_encoder_layers": 1, "n_decoder_layers": 1})
    src, tgt_in, tgt_out = data.draw(batches(cfg, max_batch=2, max_len=3, all_pad_row=False))
    model = FastTransformer(cfg, seed=0, dtype="float64")
    model.workers = workers

    def loss():
        logits, _ = model.forward(src, tgt_in, B.DeviceRNG(7))
        return cross_entropy(logits, tgt_out, cfg.label_smoothing)[0]

    logits, cache = model.forward(src, tgt_in, B.DeviceRNG(7))
    _, d = fast_ce(logits, tgt_out, cfg.label_smoothing)
    grads = model.backward(d, cache)
    for name, p in model.params.items():
        num = numerical_gradient(loss, p)
        err = rel_error(grads[name], num)
        # central differences at h = 1e-6 round to about 1e-16 |loss| / h = 1e-10 per entry: a
        # gradient whose entries are all near 1e-4 (RMSNorm over d_model 4) is judged at that
        off = float(np.abs(grads[name] - num).max())
        assert err < 1e-6 or off < 1e-9, f"{name}: relative error {err:.2e}, at most {off:.1e}, with dropout on"


@pytest.mark.parametrize("workers", [1, 2])
def test_attention_invariants(backend, workers):
    cfg = TransformerConfig(vocab_size=12, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1,
                            n_decoder_layers=2, dropout=0.0)
    model = FastTransformer(cfg, seed=0)
    model.workers = workers
    src = np.array([[4, 5, 6, 0], [0, 0, 0, 0], [7, 0, 0, 0]])
    tgt = np.array([[1, 4, 5], [1, 0, 0], [1, 6, 0]])
    _, cache = model.forward(B.to_device(src), B.to_device(tgt))
    for name, w in model.attention_weights(cache).items():
        w = B.to_host(w)
        keys = src != 0 if "encoder" in name or "cross" in name else tgt != 0
        allowed = np.broadcast_to(keys[:, None, None, :], w.shape).copy()
        if name.endswith("self_attn") and name.startswith("decoder"):
            allowed &= np.tril(np.ones((3, 3), dtype=bool))[None, None]
        assert np.all(w[~allowed] == 0), f"{name}: weight on a masked key"
        sums = w.sum(-1)
        has_key = allowed.any(-1)
        assert np.allclose(sums[has_key], 1, atol=1e-6), name
        assert np.all(sums[~has_key] == 0), f"{name}: a query with no key must get zeros"
    assert any((B.to_host(w) == 0).all(axis=-1).any() for w in model.attention_weights(cache).values())

# ----------------------------------------------------------------------------- pieces


def test_softmax_and_layer_norm_ops_match_the_layers(backend):
    xp = backend
    ops = ops_for(xp)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 5)) * 10
    mask = rng.random((2, 1, 4, 5)) > 0.4
    mask[0, 0, 1] = False                               # a row with no key
    y_ref, _ = softmax_forward(xp.asarray(x), xp.asarray(mask))
    # the fast path keeps scores keys-first: (Tk, B, H, Tq)
    bias = xp.where(xp.asarray(mask), 0.0, np.finfo(np.float64).min).transpose(3, 0, 1, 2)
    rows = xp.asarray(mask.any(-1, keepdims=True).astype(np.float64)).transpose(3, 0, 1, 2)
    y = ops.softmax0_(xp.asarray(x.transpose(3, 0, 1, 2).copy()), bias, rows).transpose(1, 2, 3, 0)
    assert np.array_equal(B.to_host(y) == 0, B.to_host(y_ref) == 0)
    assert rel_error(B.to_host(y), B.to_host(y_ref)) < 1e-14
    dy = xp.asarray(rng.standard_normal(x.shape))
    dx_ref = softmax_backward(dy, SoftmaxCache(y_ref))
    dx = ops.softmax0_backward_(dy.transpose(3, 0, 1, 2).copy(), y.transpose(3, 0, 1, 2)).transpose(1, 2, 3, 0)
    assert rel_error(B.to_host(dx), B.to_host(dx_ref)) < 1e-12

    h = xp.asarray(rng.standard_normal((7, 6)) * 3 + 1)
    g, b = xp.asarray(rng.standard_normal(6)), xp.asarray(rng.standard_normal(6))
    out_ref, cache = layer_norm_forward(h, g, b, 1e-6)
    xhat = h.copy()
    out, rstd = ops.layer_norm_(xhat, g, b, 1e-6)
    assert rel_error(B.to_host(out), B.to_host(out_ref)) < 1e-13
    d = xp.asarray(rng.standard_normal((7, 6)))
    ref = layer_norm_backward(d, cache)
    got = ops.layer_norm_backward_(d.copy(), xhat, rstd, g)
    for a, r in zip(got, ref):
        assert rel_error(B.to_host(a), B.to_host(r)) < 1e-12


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("pad_id", [0, None])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(3, 4, 7), (40, 30, 300)])
def test_cross_entropy_matches_reference(backend, smoothing, pad_id, dtype, shape):
    """The larger shape is split over threads on NumPy."""
    xp = backend
    rng = np.random.default_rng(1)
    logits = xp.asarray((rng.standard_normal(shape) * 5).astype(dtype))
    targets = xp.asarray(rng.integers(0, shape[-1], shape[:-1]))
    targets[0, 2:] = 0
    loss_ref, d_ref = cross_entropy(logits, targets, smoothing, pad_id)
    keep = logits.copy()
    loss, d = fast_ce(logits, targets, smoothing, pad_id)
    assert np.array_equal(B.to_host(logits), B.to_host(keep)), "inplace=False must not touch the logits"
    tol = 1e-5 if dtype == "float32" else 1e-12
    assert abs(float(loss) - float(loss_ref)) < tol * max(1, abs(float(loss_ref)))
    assert rel_error(B.to_host(d), B.to_host(d_ref)) < tol and d.dtype == d_ref.dtype
    loss2, d2 = fast_ce(logits, targets, smoothing, pad_id, inplace=True)
    assert float(loss2) == float(loss)
    assert np.array_equal(B.to_host(logits), B.to_host(d2)), "inplace=True writes dlogits into the logits"
    assert rel_error(B.to_host(d2), B.to_host(d_ref)) < tol


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("rows_per_block", [1, 3, 64])
def test_cross_entropy_in_blocks_matches_reference(monkeypatch, smoothing, rows_per_block):
    """The NumPy loss works on a few rows of a large vocabulary at a time: with blocks of 1 row,
    of 3 (37 rows leave a short last block) and of more rows than there are, it gives the
    readable loss and gradient to float64 rounding."""
    from attn.fast.core.ops import Ops
    V = 5003
    monkeypatch.setattr(Ops, "CE_BLOCK_BYTES", rows_per_block * V * 8)
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((37, V)) * 6 + 40.0      # large logits: the row max shift matters
    targets = rng.integers(0, V, 37)
    targets[[0, 5, 36]] = 0                              # padding rows get a zero gradient
    loss_ref, d_ref = cross_entropy(logits, targets, smoothing)
    loss, d = fast_ce(logits.copy(), targets, smoothing, inplace=True, workers=1)
    assert abs(float(loss) - float(loss_ref)) < 1e-12 * abs(float(loss_ref))
    assert rel_error(d, d_ref) < 1e-12
    assert not d[[0, 5, 36]].any()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_gradient_is_numerical(monkeypatch, smoothing):
    """The fused, blocked loss's dlogits against central differences of its own loss (float64)."""
    from attn.fast.core.ops import Ops
    V = 11
    monkeypatch.setattr(Ops, "CE_BLOCK_BYTES", 2 * V * 8)                 # blocks of two rows
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 3, V)) * 3
    targets = np.array([[4, 0, 7], [10, 2, 0]])

    def loss():
        return fast_ce(logits, targets, smoothing, workers=1)[0]
    _, d = fast_ce(logits, targets, smoothing, workers=1)
    num = numerical_gradient(loss, logits)
    assert rel_error(d, num) < 1e-8, f"fast cross-entropy gradient: relative error {rel_error(d, num):.1e}"


@pytest.mark.parametrize("workers", [1, 2])
def test_step_keeps_one_logits_buffer(workers):
    """Where the vocabulary dominates, a step (forward, in-place loss, backward) allocates little
    beyond the one (B, T, V) logits buffer: no (B*T, V) temporaries in the projection, the
    softmax or the loss (NumPy reports its allocations to tracemalloc, so this is a NumPy test:
    it selects NumPy whatever ``ATTN_BACKEND`` selected for the run)."""
    from conftest import selected_backend
    with selected_backend("numpy"):
        _one_logits_buffer(workers)


def _one_logits_buffer(workers):
    import tracemalloc
    cfg = TransformerConfig(vocab_size=6000, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                            n_decoder_layers=1, dropout=0.1, label_smoothing=0.1, max_len=32)
    model = FastTransformer(cfg, seed=0)
    model.workers = workers
    rng = np.random.default_rng(0)
    src, tgt_in, tgt_out = (rng.integers(4, 6000, (8, 24)) for _ in range(3))
    drop = B.DeviceRNG(0)

    def step():
        logits, cache = model.forward(src, tgt_in, drop)
        loss, d = fast_ce(logits, tgt_out, 0.1, inplace=True)
        model.backward(d, cache)
    step()
    logits_bytes = 8 * 24 * 6000 * 4
    grads_bytes = sum(p.nbytes for p in model.params.values())
    tracemalloc.start()
    try:
        step()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the logits, every gradient (one set, plus a part's (V, D) embedding gradient while it is
    # summed) and the activations, which are small here
    budget = logits_bytes + 2 * grads_bytes + logits_bytes // 4
    assert peak < budget, (f"a step allocated {peak / 2**20:.1f} MiB at its peak; the logits are "
                           f"{logits_bytes / 2**20:.1f} MiB, the gradients {grads_bytes / 2**20:.1f} MiB")


def test_cross_entropy_all_padding_and_nonfinite(backend):
    xp = backend
    logits = xp.zeros((2, 3, 5))
    loss, d = fast_ce(logits, xp.zeros((2, 3), dtype=xp.int64), 0.1)
    assert float(loss) == 0 and not B.to_host(d).any()
    logits[0, 0, 1] = float("nan")
    with pytest.raises(FloatingPointError):
        fast_ce(logits, xp.ones((2, 3), dtype=xp.int64), 0.1)
    with pytest.raises(IndexError):
        fast_ce(xp.zeros((1, 2, 3)), xp.asarray([[0, 3]]), 0.0)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fast_adam_matches_adam(backend, threads, dtype):
    xp = backend
    rng = np.random.default_rng(2)
    shapes = {"a": (5, 3), "b": (7,), "c": (2, 2, 2), "d": (1,)}
    p1 = {k: xp.asarray(rng.standard_normal(s).astype(dtype)) for k, s in shapes.items()}
    p2 = {k: v.copy() for k, v in p1.items()}
    ref, fast = Adam(p1, d_model=16, warmup_steps=3), FastAdam(p2, d_model=16, warmup_steps=3)
    fast.threads = threads
    for _ in range(4):
        grads = {k: xp.asarray(rng.standard_normal(s).astype(dtype)) for k, s in shapes.items()}
        keep = {k: g.copy() for k, g in grads.items()}
        assert ref.step(grads) == fast.step(grads)
        for k in grads:
            assert np.array_equal(B.to_host(grads[k]), B.to_host(keep[k])), "FastAdam must not touch grads"
    tol = 1e-5 if dtype == "float32" else 1e-12
    for k in shapes:
        assert rel_error(B.to_host(p1[k]), B.to_host(p2[k])) < tol, k
        assert rel_error(B.to_host(ref.m[k]), B.to_host(fast.m[k])) < tol, k
        assert rel_error(B.to_host(ref.v[k]), B.to_host(fast.v[k])) < tol, k
    assert fast.t == ref.t == 4


def test_scatter_rows_accumulates_repeats(backend):
    xp = backend
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 6, 40)
    ids[:5] = 3
    rows = rng.standard_normal((40, 4)).astype("float32")
    want = np.zeros((6, 4), dtype="float32")
    np.add.at(want, ids, rows)
    got = ops_for(xp).scatter_rows_(xp.zeros((6, 4), dtype="float32"), xp.asarray(ids), xp.asarray(rows))
    assert np.allclose(B.to_host(got), want, atol=1e-5)


def test_dropout_mask_rate_and_scale(backend):
    xp = backend
    rng = B.DeviceRNG(0)
    ops = ops_for(xp)
    m = ops.dropout_mask(rng, (400, 500), 0.1)
    assert isinstance(m, Mask)
    keep = B.to_host(ops.dropout_(xp.ones((400, 500), dtype=xp.float32), m)) != 0
    assert abs(float(keep.mean()) - 0.9) < 0.003
    # NumPy quantises p to 1/65536 (16 random bits per element), as CuPy's counter dropout does;
    # CuPy's drawn masks keep p exact
    p_eff = 0.1 if B.is_device_array(m.keep) else round(0.1 * 65536) / 65536
    assert math.isclose(m.scale * (1 - p_eff), 1.0, rel_tol=1e-12)
    m2 = ops.dropout_mask(rng, (400, 500), 0.1)
    keep2 = B.to_host(ops.dropout_(xp.ones((400, 500), dtype=xp.float32), m2)) != 0
    assert not np.array_equal(keep, keep2), "each call draws a fresh mask"


def test_blas_threads_restored_and_errors_propagate():
    from attn.fast.core.threads import THREADS
    before = B.blas_threads()

    def boom():
        raise KeyError("part failed")
    with pytest.raises(KeyError, match="part failed"):
        THREADS.parallel([lambda: 1, boom])
    assert B.blas_threads() == before
    assert THREADS.parallel([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]
    assert B.blas_threads() == before

# ----------------------------------------------------------------------------- CuPy kernels


def _np_cp(cp, a):
    return a, cp.asarray(a)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mask_shape", [(3, 1, 1, 5), (3, 1, 4, 5)])
def test_cupy_softmax_kernels_match_numpy(cupy, dtype, mask_shape):
    from attn.fast.gpu.kernels import CupyOps
    cp = cupy
    ops_np, ops_cp = ops_for(np), ops_for(cp)
    assert isinstance(ops_cp, CupyOps)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 2, 4, 5)) * 4).astype(dtype)             # (B, H, Tq, Tk)
    mask = rng.random(mask_shape) > 0.3
    mask[1] = False                                                        # a sentence with no key
    bias = np.where(mask, 0, np.finfo(dtype).min).astype(dtype).transpose(3, 0, 1, 2)
    rows = mask.any(-1, keepdims=True).astype(dtype).transpose(3, 0, 1, 2)
    s = np.ascontiguousarray(x.transpose(3, 0, 1, 2))
    want = ops_np.softmax0_(s.copy(), bias, rows)
    got = ops_cp.softmax0_(cp.asarray(s), cp.asarray(bias), cp.asarray(rows))
    tol = 1e-6 if dtype == "float32" else 1e-14
    assert np.array_equal(cp.asnumpy(got) == 0, want == 0)
    assert rel_error(cp.asnumpy(got), want) < tol
    dy = rng.standard_normal(s.shape).astype(dtype)
    want_d = ops_np.softmax0_backward_(dy.copy(), want)
    got_d = ops_cp.softmax0_backward_(cp.asarray(dy), got)
    assert rel_error(cp.asnumpy(got_d), want_d) < 10 * tol


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("D", [7, 256, 513])
def test_cupy_layer_norm_kernels_match_numpy(cupy, dtype, D):
    cp = cupy
    ops_np, ops_cp = ops_for(np), ops_for(cp)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((9, D)) * 3 + 2).astype(dtype)
    g, b = rng.standard_normal(D).astype(dtype), rng.standard_normal(D).astype(dtype)
    xh_np = x.copy()
    out_np, rstd_np = ops_np.layer_norm_(xh_np, g, b, 1e-6)
    xh_cp = cp.asarray(x)
    out_cp, rstd_cp = ops_cp.layer_norm_(xh_cp, cp.asarray(g), cp.asarray(b), 1e-6)
    tol = 1e-5 if dtype == "float32" else 1e-12
    for a, w in ((xh_cp, xh_np), (out_cp, out_np), (rstd_cp, rstd_np)):
        assert rel_error(cp.asnumpy(a), w) < tol
    d = rng.standard_normal((9, D)).astype(dtype)
    want = ops_np.layer_norm_backward_(d.copy(), xh_np, rstd_np, g)
    got = ops_cp.layer_norm_backward_(cp.asarray(d), xh_cp, rstd_cp, cp.asarray(g))
    for a, w in zip(got, want):
        assert rel_error(cp.asnumpy(a), w) < 10 * tol


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("V", [7, 1000])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cupy_cross_entropy_kernel_matches_numpy(cupy, dtype, V, smoothing):
    cp = cupy
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((4, 6, V)) * 3).astype(dtype)
    targets = rng.integers(0, V, (4, 6))
    targets[0, 3:] = 0
    loss_np, d_np = fast_ce(logits.copy(), targets, smoothing)
    loss_cp, d_cp = fast_ce(cp.asarray(logits), cp.asarray(targets), smoothing, inplace=True,
                            check_finite=False, validate=False)
    assert isinstance(loss_cp, cp.ndarray) and loss_cp.ndim == 0     # stays on the device
    tol = 1e-5 if dtype == "float32" else 1e-12
    assert abs(float(loss_cp) - float(loss_np)) < tol * max(1.0, abs(float(loss_np)))
    assert rel_error(cp.asnumpy(d_cp), d_np) < tol


def test_cupy_dropout_relu_adam_kernels(cupy, monkeypatch):
    """The dropout kernels of masks drawn from the stream (``counter_dropout`` off; the
    counter-based ones are tested in tests/test_arena.py), ReLU's backward, Adam."""
    from attn.fast.gpu.kernels import CupyOps
    monkeypatch.setattr(CupyOps, "counter_dropout", False)
    cp = cupy
    ops_cp = ops_for(cp)
    rng = np.random.default_rng(3)
    m = ops_cp.dropout_mask(B.DeviceRNG(0), (300, 200), 0.25)
    keep = cp.asnumpy(m.keep)
    assert keep.dtype == bool and abs(float(keep.mean()) - 0.75) < 0.01 and m.scale == 1 / 0.75
    x = rng.standard_normal((300, 200)).astype("float32")
    got = ops_cp.dropout_(cp.asarray(x), m)
    assert np.allclose(cp.asnumpy(got), x * keep / 0.75, rtol=1e-6, atol=0)
    back = ops_cp.dropout_backward(cp.asarray(x), m)
    assert np.allclose(cp.asnumpy(back), x * keep / 0.75, rtol=1e-6, atol=0)
    a = np.maximum(rng.standard_normal((50, 60)), 0).astype("float32")
    da = rng.standard_normal((50, 60)).astype("float32")
    assert np.array_equal(cp.asnumpy(ops_cp.relu_backward_(cp.asarray(da), cp.asarray(a))), da * (a > 0))
    shapes = {"w": (20, 30), "b": (30,)}
    p1 = {k: rng.standard_normal(s) for k, s in shapes.items()}
    p2 = {k: cp.asarray(v) for k, v in p1.items()}
    o1, o2 = FastAdam(p1, d_model=16, warmup_steps=3), FastAdam(p2, d_model=16, warmup_steps=3)
    for _ in range(3):
        g = {k: rng.standard_normal(s) for k, s in shapes.items()}
        o1.step(g)
        o2.step({k: cp.asarray(v) for k, v in g.items()})
    for k in shapes:
        assert rel_error(cp.asnumpy(p2[k]), p1[k]) < 1e-12


@pytest.mark.filterwarnings("ignore:cupyx.allow_synchronize:UserWarning")   # CuPy's own, entered here on purpose
def test_cupy_fast_step_never_waits_for_the_device(cupy):
    """With id validation and the finiteness check off, a whole fast step (forward, loss,
    backward, Adam) never synchronises with the host: CuPy raises if it would."""
    cp = cupy
    cupyx = B._cupyx()                       # real cupyx, or the stand-in's
    cfg = TransformerConfig(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                            n_decoder_layers=1, dropout=0.1)
    model = FastTransformer(cfg, seed=0, check_ids=False)
    opt = FastAdam(model.params, d_model=16)
    src = cp.asarray(np.array([[5, 6, 7, 0], [8, 9, 0, 0]]))
    tgt_in = cp.asarray(np.array([[1, 5, 6], [1, 7, 0]]))
    tgt_out = cp.asarray(np.array([[5, 6, 2], [7, 2, 0]]))
    rng = B.DeviceRNG(0)

    def step():
        logits, cache = model.forward(src, tgt_in, rng)
        loss, d = fast_ce(logits, tgt_out, 0.1, inplace=True, check_finite=False, validate=False)
        opt.step(model.backward(d, cache))
        return loss
    step()                                   # compiles the kernels, builds the positional table
    with cupyx.allow_synchronize(False):
        loss = step()
    assert np.isfinite(float(loss))


def test_idle_helper_threads_hold_no_task():
    """A helper lets go of its task before the caller hears of its end, so an idle helper
    keeps nothing alive: decoding's last step (its keys and values) and a training step's
    cache were held that way until the next task."""
    import weakref
    from attn.fast.core.threads import THREADS

    class Buffers:
        pass
    held = [Buffers() for _ in range(3)]
    refs = [weakref.ref(b) for b in held]
    THREADS.run([lambda b=b: None for b in held])
    try:
        THREADS.run([lambda: None, lambda b=held[1]: 1 / 0])
    except ZeroDivisionError:
        pass
    del held
    assert [r() for r in refs] == [None, None, None]


def test_threads_survive_a_fork():
    """A child forked after the helper threads exist gets fresh ones (it inherits the queues,
    not the threads) instead of waiting forever."""
    import multiprocessing as mp
    from attn.fast.core.threads import THREADS
    THREADS.run([lambda: 1, lambda: 2])
    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork on this platform")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=lambda: q.put(THREADS.run([lambda: 3, lambda: 4])))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and q.get(timeout=5) == [3, 4]

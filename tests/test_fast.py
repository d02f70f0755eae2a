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
    H = draw(st.sampled_from([1, 2]))
    D = H * draw(st.integers(max(1, 4 // H), max_width // H))     # d_model >= 4: at 2, layer norm
                                                                    # maps every row to +-1
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
        positional=draw(st.sampled_from(["sinusoidal", "learned"])),
        norm=draw(st.sampled_from(["post", "pre"])))


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
        assert err < 1e-6, f"{name}: relative error {err:.2e} with dropout on"


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
    m = ops_for(xp).dropout_mask(rng, (400, 500), 0.1)
    assert isinstance(m, Mask) and m.keep.dtype == bool
    keep = float(B.to_host(m.keep).mean())
    assert abs(keep - 0.9) < 0.003
    p_eff = round(0.1 * 65536) / 65536
    assert math.isclose(m.scale * (1 - p_eff), 1.0, rel_tol=1e-12)
    m2 = ops_for(xp).dropout_mask(rng, (400, 500), 0.1)
    assert not np.array_equal(B.to_host(m.keep), B.to_host(m2.keep)), "each call draws a fresh mask"


def test_blas_threads_restored_and_errors_propagate():
    from attn.fast import _THREADS
    before = B.blas_threads()

    def boom():
        raise KeyError("part failed")
    with pytest.raises(KeyError, match="part failed"):
        _THREADS.parallel([lambda: 1, boom])
    assert B.blas_threads() == before
    assert _THREADS.parallel([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]
    assert B.blas_threads() == before

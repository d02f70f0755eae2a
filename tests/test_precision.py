"""attn.precision: the rounding of a product's inputs to bf16 and tf32, bit for bit.

Against ``ml_dtypes.bfloat16`` (the type CuPy 14 uses for bf16 arrays) where it is installed,
and against the rule itself (the nearest representable number, ties to the even significand)
with integers, so that the tests stand without it; then the edge cases one by one.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attn import precision as P

float32s = hnp.arrays(np.float32, st.integers(1, 64),
                      elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True))
#: Any 32-bit pattern: every NaN payload, every subnormal, every exponent.
words = hnp.arrays(np.uint32, st.integers(1, 64))


def nearest_even(u: np.ndarray, drop: int) -> np.ndarray:
    """The rule spelled with Python integers on finite, non-NaN words: the candidates below and
    above, the nearer one, the even one on a tie (the significand's bit ``drop``)."""
    out = []
    for w in u.tolist():
        low = w & ~((1 << drop) - 1)
        rest, half = w - low, 1 << (drop - 1)
        up = rest > half or (rest == half and (low >> drop) & 1)
        out.append(low + (1 << drop) if up else low)
    return np.array(out, dtype=np.uint64).astype(np.uint32)


@given(words)
def test_bf16_and_tf32_round_to_nearest_even(u):
    finite = u[(u & 0x7FFFFFFF) < 0x7F800000]
    x = finite.view(np.float32)
    assert np.array_equal(P.round_bf16(x).view(np.uint32), nearest_even(finite, 16))
    assert np.array_equal(P.round_tf32(x).view(np.uint32), nearest_even(finite, 13))


@given(float32s)
def test_bf16_matches_ml_dtypes(x):
    ml = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    want = x.astype(ml.bfloat16).astype(np.float32)
    got = P.round_bf16(x)
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))     # signed zeros too
    assert np.array_equal(P.bf16_bits(x)[~nan], x[~nan].astype(ml.bfloat16).view(np.uint16))


@given(words)
def test_nan_stays_nan_with_its_sign(u):
    x = (u | np.uint32(0x7F800001)).view(np.float32)       # every exponent bit set, a payload: NaN
    for f in (P.round_bf16, P.round_tf32):
        r = f(x)
        assert np.isnan(r).all(), f.__name__
        assert np.array_equal(np.signbit(r), np.signbit(x)), f.__name__


def bits(*ws):
    return np.array(ws, dtype=np.uint32).view(np.float32)


def test_ties_go_to_the_even_significand():
    # 1 + 2^-8 lies halfway between bf16's 1 and 1 + 2^-7: to 1 (even). 1 + 3 * 2^-8 lies halfway
    # between 1 + 2^-7 (odd) and 1 + 2^-6: up, to the even one.
    assert P.round_bf16(bits(0x3F808000, 0x3F818000)).tolist() == [1.0, 1.0 + 2 ** -6]
    # Just above a tie rounds up; just below, down.
    assert P.round_bf16(bits(0x3F808001, 0x3F807FFF)).tolist() == [1.0 + 2 ** -7, 1.0]
    # TF32: 1 + 2^-11 halfway between 1 and 1 + 2^-10.
    assert P.round_tf32(bits(0x3F801000, 0x3F803000)).tolist() == [1.0, 1.0 + 2 ** -9]


def test_infinities_overflow_and_subnormals():
    big = np.finfo(np.float32).max
    r = P.round_bf16(np.array([np.inf, -np.inf, big, -big], dtype=np.float32))
    assert r.tolist() == [np.inf, -np.inf, np.inf, -np.inf]           # past bf16's largest finite: inf
    bf16_max = bits(0x7F7F0000)
    assert P.round_bf16(bf16_max)[0] == bf16_max[0]                     # the largest finite stays
    assert P.round_bf16(bits(0x7F7F7FFF))[0] == bf16_max[0]             # below the halfway point: down
    assert P.round_tf32(np.array([big], dtype=np.float32))[0] == np.inf
    sub = bits(0x00000001, 0x00008000, 0x00018000, 0x00007FFF, 0x80008000)
    assert P.round_bf16(sub).view(np.uint32).tolist() == [0, 0, 0x00020000, 0, 0x80000000]
    assert np.signbit(P.round_bf16(np.array([-0.0], dtype=np.float32)))[0]


def test_round_to_keeps_fp32_and_other_dtypes_as_they_are():
    x = np.linspace(-3, 3, 11, dtype=np.float32)
    assert P.round_to(x, "fp32") is x
    d = x.astype(np.float64)
    assert P.round_to(d, "bf16") is d                      # float64 gradient checks stay exact
    out = np.empty_like(x)
    assert P.round_to(x, "bf16", out=out) is out and np.array_equal(out, P.round_bf16(x))
    y = x.copy()
    P.round_to(y, "tf32", out=y)
    assert np.array_equal(y, P.round_tf32(x))


def test_bits_round_trip():
    x = np.array([1.5, -2.25, 3.0e38, 1e-40], dtype=np.float32)
    assert np.array_equal(P.from_bf16_bits(P.bf16_bits(x)), P.round_bf16(x))


def test_precision_names_are_checked():
    assert P.check("bf16") == "bf16"
    with pytest.raises(P.PrecisionError, match="fp32, tf32, bf16.*'fp16'"):
        P.check("fp16")
    with pytest.raises(TypeError, match="float32"):
        P.round_bf16(np.zeros(3, dtype=np.float16))


def test_the_bf16_weight_copy_kernel_is_the_rounding():
    """``round_bf16`` (the per-step bf16 copy of the master weights) on CuPy, or on the stand-in
    by its NumPy twin, against :func:`attn.precision.bf16_bits` on the host: ties, NaN, infinities,
    overflow, subnormals and ordinary numbers, in a buffer longer than one block."""
    from attn.fast import ops_for
    from conftest import selected_backend
    special = bits(0x3F808000, 0x3F818000, 0x7F7F7FFF, 0x7F7FFFFF, 0xFFC00001, 0x7F800001, 0x7F800000,
                   0x00018000, 0x80008000, 0x00000000)
    x = np.concatenate([special, np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 1e3])
    with selected_backend("cupy") as cp:
        out = cp.zeros(x.size, dtype=np.uint16)
        ops_for(cp).round_bf16_(cp.asarray(x), out)
        got = cp.asnumpy(out)
        with pytest.raises(ValueError, match="uint16 dst"):
            ops_for(cp).round_bf16_(cp.asarray(x), cp.zeros(x.size, dtype=np.float32))
    want = P.bf16_bits(x)
    assert np.array_equal(got, want)
    nan = np.isnan(x)
    assert np.array_equal(P.from_bf16_bits(got)[~nan], P.round_bf16(x)[~nan])
    assert np.isnan(P.from_bf16_bits(got)[nan]).all()


# ----------------------------------------------------------------------------- the engine's products


def test_products_read_rounded_operands_and_sum_in_float32():
    from attn.fast import ops_for
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((7, 3)).astype(np.float32)
    fp32 = ops_for(np)
    assert ops_for(np, "fp32") is fp32 and fp32.precision == "fp32"
    assert np.array_equal(fp32.mm(a, b), a @ b)
    for name, rnd in (("bf16", P.round_bf16), ("tf32", P.round_tf32)):
        ops = ops_for(np, name)
        assert ops.precision == name and ops._ones is fp32._ones          # one set of buffers
        assert np.array_equal(ops.mm(a, b), rnd(a) @ rnd(b))
        assert np.array_equal(ops.mm(a.T.copy().T, b[:, :2]), rnd(a) @ rnd(b[:, :2].copy()))   # views
        out = np.empty((2, 3, 5, 5), dtype=np.float32)
        x = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
        ops.bmm(x, x.swapaxes(-1, -2), out=out)
        assert np.array_equal(out, rnd(x) @ rnd(x).swapaxes(-1, -2))
        assert not np.array_equal(ops.mm(a, b), a @ b)
    d = a.astype(np.float64)
    assert np.array_equal(ops_for(np, "bf16").mm(d, d.T), d @ d.T)      # float64 (gradient checks): exact

    from types import SimpleNamespace
    from attn.fast.core.ops import Ops
    assert ops_for(np, SimpleNamespace(name="bf16")) is ops_for(np, "bf16")   # a precision object: its name
    made = Ops(np, "bf16")                  # made at its precision, as it is: no copy, no class made for it
    assert type(made) is Ops and type(ops_for(np, "tf32")) is Ops and made._ones is not fp32._ones
    assert np.array_equal(made.mm(a, b), P.round_bf16(a) @ P.round_bf16(b))
    for bad in ("fp16", SimpleNamespace(name="fp16")):
        with pytest.raises(P.PrecisionError, match="fp16"):
            ops_for(np, bad)
    with pytest.raises(P.PrecisionError, match="fp16"):
        Ops(np, "fp16")


def test_the_fast_engine_knows_its_precision():
    from conftest import selected_backend
    from attn.fast import FastTransformer, ops_for
    from attn.model import TransformerConfig
    with selected_backend("numpy"):
        cfg = TransformerConfig.preset("toy", vocab_size=20, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                                       n_decoder_layers=1)
        m = FastTransformer(cfg, seed=0)
        assert m.precision == P.FP32 and m.ops is ops_for(np)               # fp32: the very object as before
        bf16 = FastTransformer(cfg, params=m.params, precision=P.Precision("bf16"))
        assert type(bf16) is FastTransformer and bf16.ops is ops_for(np, "bf16")
        with pytest.raises(P.PrecisionError, match="fp16"):
            FastTransformer(cfg, seed=0, precision="fp16")
        with pytest.raises(P.PrecisionError, match="float64"):
            FastTransformer(cfg, seed=0, dtype="float64", precision="tf32")


# ----------------------------------------------------------------------------- the loss curves

#: How far the loss curve of a run at bf16 (and tf32) may stray from fp32's: the largest absolute
#: difference of the running means of 10 steps, over 30 steps of a tiny model on the toy corpus.
#: bfloat16 keeps 8 significant bits (a relative rounding of at most 2^-9 per operand); the run's
#: differences are a few 1e-4 with NumPy's OpenBLAS, so the bound leaves room for another BLAS's
#: order of summation, and none for a rounding that drops more bits than the format does.
CURVE_TOLERANCE = {"tf32": 0.005, "bf16": 0.01}


def _tiny(precision, **kw):
    from attn.training.config import TrainConfig
    return TrainConfig(d_model=32, heads=2, d_ff=64, layers=1, max_tokens=512, steps=30, precision=precision,
                       backend="numpy", **kw)


def test_bf16_and_tf32_training_stay_within_the_tolerance_of_fp32():
    from attn.bench.precision import compare, loss_curves
    curves = loss_curves(_tiny("fp32"))
    result = compare(curves, k=10)
    for p, tol in CURVE_TOLERANCE.items():
        assert 0 < result[p]["max_diff"] <= tol, (p, result[p])         # rounded (not fp32), and close


@pytest.mark.parametrize("options", [{}, {"norm_kind": "rms", "positional": "rope", "ffn": "swiglu", "kv_heads": 1}])
def test_the_cupy_path_rounds_as_the_numpy_twin(options):
    """On CuPy (or the stand-in) a bf16 step's products read the same rounded operands as on
    NumPy: the loss and a gradient agree to float32 rounding, and both differ from fp32's; the
    paper's block and the later one."""
    from attn.fast import FastTransformer, cross_entropy
    from attn.model import Transformer, TransformerConfig
    from conftest import selected_backend
    cfg = TransformerConfig.preset("toy", vocab_size=20, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                                   n_decoder_layers=1, dropout=0.0, **options)
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(3, 20, (3, 5)), rng.integers(3, 20, (3, 6))

    def step(xp, precision):
        m = FastTransformer.from_model(Transformer(cfg, seed=0, params=None), precision)
        if xp is not np:
            m = FastTransformer(cfg, params={k: xp.asarray(v) for k, v in m.params.items()}, precision=precision)
        logits, cache = m.forward(xp.asarray(src), xp.asarray(tgt[:, :-1]), None)
        loss, d = cross_entropy(logits, xp.asarray(tgt[:, 1:]), 0.1)
        g = m.backward(d, cache)["encoder.0.ffn.w2"]
        return float(loss), (g.get() if hasattr(g, "get") else g).copy()

    with selected_backend("cupy") as cp:
        on_device = step(cp, "bf16")
    with selected_backend("numpy"):
        on_host, fp32 = step(np, "bf16"), step(np, "fp32")
    assert on_device[0] == pytest.approx(on_host[0], rel=1e-6)
    np.testing.assert_allclose(on_device[1], on_host[1], rtol=1e-4, atol=1e-6)
    assert not np.allclose(on_host[1], fp32[1], rtol=1e-6, atol=0)


def _truncate_tf32(x):
    """float32 ``x`` with its 13 low significand bits cleared: TF32 rounded toward zero."""
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def tf32_rounding(got, a, b) -> str | None:
    """Which TF32 definition ``got`` (a float32 product of ``a`` and ``b``, batched or not) is:
    "nearest" or "toward zero" where every element lies within float32 accumulation's bound
    (``k`` units of 2^-24 of the sum of the products' magnitudes, summed in any order) of the
    exact product of the operands rounded so, else None. The two roundings are what hardware
    does (tensor cores convert float32 operands by either, depending on the GPU and library)."""
    k = a.shape[-1]
    for name, rnd in (("nearest", P.round_tf32), ("toward zero", _truncate_tf32)):
        ra, rb = rnd(a).astype(np.float64), rnd(b).astype(np.float64)
        bound = k * 2.0 ** -24 * (np.abs(ra) @ np.abs(rb)) + 1e-30
        if np.all(np.abs(got.astype(np.float64) - ra @ rb) <= bound):
            return name
    return None


def test_tf32_on_cupy_is_tf32_on_attns_handle_and_put_back():
    """At tf32 the CuPy kernels' products run on attn's own cuBLAS handle in TF32 tensor-op math
    mode (the stand-in's cuBLAS then reads float32 operands as TF32), and that handle's mode is
    put back after each. Shapes a tensor core takes (multiples of 16), so that a GPU's cuBLAS
    uses one; the result checked against the TF32 definition, either rounding, within float32
    accumulation's bound in any order (what hardware gives), and not float32's product. TF32 is a
    permission, not a promise: a small product (the stand-in's rule, cuBLAS's heuristics on a
    GPU) may run on a float32 kernel, which is right too."""
    from attn.fast import ops_for
    from attn.fast.gpu.kernels import Tf32Products
    from conftest import selected_backend
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((64, 128)).astype(np.float32), rng.standard_normal((128, 48)).astype(np.float32)
    x = rng.standard_normal((2, 2, 32, 64)).astype(np.float32)
    with selected_backend("cupy") as cp:
        ops = ops_for(cp, "tf32")
        assert isinstance(ops.products, Tf32Products) and ops._functions is ops_for(cp)._functions
        cublas, handle = ops.products.cublas()                          # attn's handle, not CuPy's
        before = cublas.getMathMode(handle)
        seen = []
        set_mode = cublas.setMathMode
        cublas.setMathMode = lambda h, mode: seen.append((h, mode)) or set_mode(h, mode)
        try:
            got = cp.asnumpy(ops.mm(cp.asarray(a), cp.asarray(b)))
            got_b = cp.asnumpy(ops.bmm(cp.asarray(x), cp.asarray(x).swapaxes(-1, -2)))
            got_small = cp.asnumpy(ops.mm(cp.asarray(a[:8, :16]), cp.asarray(b[:16, :8])))
        finally:
            cublas.setMathMode = set_mode
        fp32 = cp.asnumpy(ops_for(cp).mm(cp.asarray(a), cp.asarray(b)))
        assert cublas.getMathMode(handle) == before
    assert (handle, cublas.CUBLAS_TF32_TENSOR_OP_MATH) in seen and all(h == handle for h, _ in seen), seen
    assert tf32_rounding(got, a, b) is not None
    assert tf32_rounding(got_b, x, x.swapaxes(-1, -2)) is not None
    assert tf32_rounding(fp32, a, b) is None                     # float32's product is not TF32's
    assert tf32_rounding(got_small, a[:8, :16], b[:16, :8]) is not None or fp32_product(got_small, a[:8, :16],
                                                                                        b[:16, :8])
    if cp.__name__ != "cupy":                # the stand-in: a product that small stays float32
        assert fp32_product(got_small, a[:8, :16], b[:16, :8]) and tf32_rounding(got_small, a[:8, :16],
                                                                                  b[:16, :8]) is None


def fp32_product(got, a, b) -> bool:
    """Whether ``got`` is float32's product of ``a`` and ``b``: within float32 accumulation's bound
    (``k`` units of 2^-24 of the sum of the products' magnitudes) of the exact product."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    bound = a.shape[-1] * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64)) + 1e-30
    return bool(np.all(np.abs(got.astype(np.float64) - a64 @ b64) <= bound))


def test_the_tf32_check_tells_tf32_from_float32_and_takes_either_rounding():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((64, 16)).astype(np.float32)
    assert tf32_rounding(P.round_tf32(a) @ P.round_tf32(b), a, b) == "nearest"
    assert tf32_rounding(_truncate_tf32(a) @ _truncate_tf32(b), a, b) == "toward zero"
    assert tf32_rounding(a @ b, a, b) is None


def test_bf16_on_cupy_reads_bf16_operands_through_gemm_ex():
    """At bf16 the CuPy kernels' products are cuBLAS's ``gemmEx`` family on ``CUDA_R_16BF``
    operands (the stand-in's cuBLAS reads their 16-bit patterns), summed in float32: equal to the
    NumPy twin's rounded operands multiplied in float32. A parameter operand (a view of the
    prepared arena, transposed or a block of columns) is read from the weights' bf16 copy with no
    launch of its own; an activation is copied into bf16 by one ``round_bf16_gather``; batched
    head views go through ``gemmBatchedEx`` (pointer arrays) or, where ``out``'s batch is one
    stride, ``gemmStridedBatchedEx``."""
    from attn.bench.counts import Tally
    from attn.fast import ops_for
    from attn.fast.gpu.kernels import Bf16Products
    from conftest import selected_backend
    rng = np.random.default_rng(2)
    f32 = np.float32
    params = rng.standard_normal(9 * 12 + 40).astype(f32)
    x = rng.standard_normal((7, 9)).astype(f32)
    qkv = rng.standard_normal((2 * 5, 3 * 8)).astype(f32)             # (B*T, 3*H*Dh), B 2, T 5, H 2, Dh 4

    def heads(a):
        return a.reshape(2, 5, 3, 2, 4)[:, :, 0].transpose(0, 2, 1, 3), a.reshape(2, 5, 3, 2, 4)[:, :, 1].transpose(0, 2, 1, 3)
    with selected_backend("fakecupy") as cp:
        fcp = cp
        ops = ops_for(cp, "bf16")
        assert isinstance(ops.products, Bf16Products) and ops._functions is ops_for(cp)._functions
        P_d = cp.asarray(params)
        ops.prepare_weights(P_d)
        W = P_d[40:].reshape(9, 12)[:, 2:8]                          # a block of columns of a parameter
        runs = {}
        for name, call in (
                ("x W", lambda: ops.mm(cp.asarray(x), W)),
                ("x x^T", lambda: ops.mm(cp.asarray(x), cp.asarray(x).T)),
                ("W^T x^T += ", lambda: ops.mm(W.T, cp.asarray(x).T, out=cp.ones((6, 7), dtype=f32), accumulate=True)),
                ("q k^T, (B, H) out", lambda: ops.bmm(*(lambda q, k: (q, k.swapaxes(-1, -2)))(*heads(cp.asarray(qkv))))),
                ("q k^T into head views", lambda: ops.bmm(heads(cp.asarray(qkv))[0], heads(cp.asarray(qkv))[1].swapaxes(-1, -2)[..., :4],
                                                          out=cp.zeros((2, 5, 2, 4), dtype=f32).transpose(0, 2, 1, 3)))):
            tally = fcp.tracer = Tally()
            try:
                runs[name] = (cp.asnumpy(call()), dict(tally.ops))
            finally:
                fcp.tracer = None
    r = P.round_bf16
    Wh = params[40:].reshape(9, 12)[:, 2:8]
    q, k = qkv.reshape(2, 5, 3, 2, 4)[:, :, 0].transpose(0, 2, 1, 3), qkv.reshape(2, 5, 3, 2, 4)[:, :, 1].transpose(0, 2, 1, 3)
    want = {"x W": r(x) @ r(Wh), "x x^T": r(x) @ r(x).T, "W^T x^T += ": 1 + r(Wh).T @ r(x).T,
            "q k^T, (B, H) out": r(q) @ r(k).swapaxes(-1, -2),
            "q k^T into head views": r(q) @ r(k).swapaxes(-1, -2)[..., :4]}
    launches = {"x W": {"round_bf16_gather": 1, "cublas gemmEx": 1},
                "x x^T": {"round_bf16_gather": 2, "cublas gemmEx": 1},
                "W^T x^T += ": {"round_bf16_gather": 1, "cublas gemmEx": 1},
                "q k^T, (B, H) out": {"round_bf16_gather": 2, "cublas gemmStridedBatchedEx": 1},
                "q k^T into head views": {"round_bf16_gather": 2, "gemm_pointers": 1, "cublas gemmBatchedEx": 1}}
    for name, (got, ops_seen) in runs.items():
        np.testing.assert_allclose(got, want[name], rtol=2e-6, atol=2e-6, err_msg=name)
        seen = {op: n for (kind, op), n in ops_seen.items() if kind in ("raw", "matmul")}
        assert seen == launches[name], (name, ops_seen)
    assert not np.allclose(runs["x W"][0], x @ Wh, rtol=1e-6, atol=0)     # rounded: not fp32's product


def test_bf16_weights_prepared_for_another_arena_are_not_read():
    """The weights' bf16 copy serves the arena it was made from: after another arena is
    prepared, a product of the first one's views copies them like any operand (the same numbers)
    instead of reading the other's copy; a float64 operand is refused with its dtype named."""
    from attn.bench.counts import Tally
    from attn.fast import ops_for
    from conftest import selected_backend
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(30).astype(np.float32) for _ in range(2))
    x = rng.standard_normal((4, 5)).astype(np.float32)
    with selected_backend("fakecupy") as cp:
        ops = ops_for(cp, "bf16")
        A, Bp = cp.asarray(a), cp.asarray(b)
        ops.prepare_weights(A)
        ops.prepare_weights(Bp)
        tally = cp.tracer = Tally()
        try:
            got = cp.asnumpy(ops.mm(cp.asarray(x), A.reshape(5, 6)))
        finally:
            cp.tracer = None
        assert tally.ops[("raw", "round_bf16_gather")] == 2
        with pytest.raises(ValueError, match="float32 operands.*float64"):
            ops.mm(cp.zeros((2, 3)), cp.zeros((3, 2)))
    np.testing.assert_allclose(got, P.round_bf16(x) @ P.round_bf16(a.reshape(5, 6)), rtol=2e-6, atol=2e-6)

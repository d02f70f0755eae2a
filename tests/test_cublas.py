"""The training step's matrix products through cuBLAS: ``ops.mm`` and ``ops.bmm`` (NumPy's
``matmul`` on NumPy; ``cupy.cuda.cublas`` on the views as they lie on CuPy) against NumPy, on
every backend this machine has, and the CuPy stand-in's ``cupy.cuda.cublas`` against what
cuBLAS defines (column-major, leading dimensions, transposes, batch strides, pointer arrays),
including that a wrong argument raises instead of reading memory outside an array."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import attn.backend as B
from attn.fast.core.dispatch import ops_for
import gemm_cases
from fakecupy import cupy as fcp

DTYPES = [np.float32, np.float64]
TOL = {np.float32: 1e-5, np.float64: 1e-12}


def close(got, want, dtype):
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    return float(np.abs(got - want).max(initial=0.0)) <= TOL[dtype] * scale * 10


# --------------------------------------------------------------------------- ops.mm / ops.bmm


def _matrix_view(xp, rng, shape, dtype, how):
    """A (R, C) operand laid out as ``how``: a contiguous array, the transpose of one, or a block of
    columns of a wider array. Returns (device view, its values on the host)."""
    R, C = shape
    if how == "c":
        h = rng.standard_normal((R, C)).astype(dtype)
        return xp.asarray(h), h
    if how == "t":
        h = rng.standard_normal((C, R)).astype(dtype)
        return xp.asarray(h).T, h.T
    h = rng.standard_normal((R, C + 7)).astype(dtype)
    return xp.asarray(h)[:, 3:3 + C], h[:, 3:3 + C]


@pytest.mark.parametrize("dtype", DTYPES)
@given(M=st.integers(1, 9), K=st.integers(1, 9), N=st.integers(1, 9),
       ha=st.sampled_from("ctb"), hb=st.sampled_from("ctb"), ho=st.sampled_from(["new", "c", "t", "b"]),
       seed=st.integers(0, 2 ** 16))
def test_mm_equals_numpy_on_views(backend, dtype, M, K, N, ha, hb, ho, seed):
    xp, ops = backend, ops_for(backend)
    rng = np.random.default_rng(seed)
    a, ah = _matrix_view(xp, rng, (M, K), dtype, ha)
    b, bh = _matrix_view(xp, rng, (K, N), dtype, hb)
    out = None if ho == "new" else _matrix_view(xp, rng, (M, N), dtype, ho)[0]
    r = ops.mm(a, b, out=out)
    if out is not None:
        assert r is out
    assert r.dtype == dtype and close(B.to_host(r), ah.astype(np.float64) @ bh, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@given(Bsz=st.integers(1, 3), H=st.integers(1, 4), T=st.integers(1, 6), S=st.integers(1, 6),
       Dh=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_bmm_equals_numpy_on_the_attention_views(backend, dtype, Bsz, H, T, S, Dh, seed):
    """The attention's products as attn.fast.model makes them: head views of (B*T, n*D)
    projections (two batch strides), keys-first scores written through a transposed view."""
    xp, ops = backend, ops_for(backend)
    rng = np.random.default_rng(seed)
    D = H * Dh
    qkv = rng.standard_normal((Bsz * T, 3 * D)).astype(dtype)
    kv = rng.standard_normal((Bsz * S, 2 * D)).astype(dtype)

    def heads(a, L, n):
        return [a.reshape(Bsz, L, n, H, Dh)[:, :, j].transpose(0, 2, 1, 3) for j in range(n)]
    q, _, _ = heads(xp.asarray(qkv), T, 3)
    k, v = heads(xp.asarray(kv), S, 2)
    qh, _, _ = heads(qkv, T, 3)
    kh, vh = heads(kv, S, 2)
    w = xp.empty((S, Bsz, H, T), dtype=dtype)                       # keys first
    assert ops.bmm(k, q.swapaxes(-1, -2), out=w.transpose(1, 2, 0, 3)) is not None
    want = kh.astype(np.float64) @ qh.swapaxes(-1, -2)
    assert close(B.to_host(w).transpose(1, 2, 0, 3), want, dtype)
    ctx = xp.empty((Bsz, T, H, Dh), dtype=dtype)
    ops.bmm(w.transpose(1, 2, 3, 0), v, out=ctx.transpose(0, 2, 1, 3))
    wh = B.to_host(w)
    assert close(B.to_host(ctx).transpose(0, 2, 1, 3), wh.transpose(1, 2, 3, 0).astype(np.float64) @ vh, dtype)
    dqkv = xp.empty((Bsz * S, 2 * D), dtype=dtype)                   # into head views of a gradient
    dk, _ = heads(dqkv, S, 2)
    ops.bmm(w.transpose(1, 2, 0, 3), q, out=dk)
    assert close(B.to_host(dk), wh.transpose(1, 2, 0, 3).astype(np.float64) @ qh, dtype)
    x3 = xp.asarray(rng.standard_normal((H, T, Dh)).astype(dtype))  # one batch axis, a new result
    y3 = xp.asarray(rng.standard_normal((H, Dh, S)).astype(dtype))
    assert close(B.to_host(ops.bmm(x3, y3)), B.to_host(x3).astype(np.float64) @ B.to_host(y3), dtype)


def test_cupy_products_refuse_what_cublas_cannot_read(backend):
    if backend is B.host:
        pytest.skip("NumPy's matmul takes any view")
    ops = ops_for(backend)
    a = backend.zeros((4, 6, 5), dtype=np.float32)[:, ::2, ::2]        # no contiguous axis
    with pytest.raises(ValueError, match="neither its rows nor its columns"):
        ops.mm(a[0], backend.zeros((3, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="shapes do not match"):
        ops.mm(backend.zeros((2, 3), dtype=np.float32), backend.zeros((4, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="float32 or both float64"):
        ops.mm(backend.zeros((2, 3), dtype=np.float32), backend.zeros((3, 2), dtype=np.float64))


def test_the_stand_in_counts_one_launch_per_product_and_no_copy():
    from attn.bench.counts import Tally
    from conftest import selected_backend
    with selected_backend("fakecupy") as xp:
        ops = ops_for(xp)
        qkv = xp.zeros((2 * 3, 3 * 8), dtype=np.float32)
        q = qkv.reshape(2, 3, 3, 2, 4)[:, :, 0].transpose(0, 2, 1, 3)
        w = xp.empty((3, 2, 2, 3), dtype=np.float32)
        x, W, g = xp.zeros((6, 8), dtype=np.float32), xp.zeros((8, 5), dtype=np.float32), xp.empty((8, 8), np.float32)

        def products():
            ops.bmm(q, q.swapaxes(-1, -2), out=w.transpose(1, 2, 0, 3))
            ops.mm(x.T, x, out=g)
            ops.mm(x, W)
        products()                  # the scratch buffers, whichever test first made them or not
        tally = fcp.tracer = Tally()
        try:
            products()
        finally:
            fcp.tracer = None
    assert tally.ops[("matmul", "cublas sgemmBatched")] == 1 and tally.ops[("raw", "gemm_pointers")] == 1
    assert tally.ops[("matmul", "cublas sgemm")] == 2
    assert tally.launches == 4 and tally.allocations == 1, tally.ops          # the one new result


@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_accumulates_into_out_in_the_same_product(backend, dtype):
    """``mm(a, b, out=c, accumulate=True)`` is ``c += a @ b`` on the views as they lie: on CuPy
    one GEMM with beta = 1 (no addition launched); without ``out`` it is refused."""
    from attn.bench.counts import Tally
    rng = np.random.default_rng(3)
    ops = ops_for(backend)
    a, ha = _matrix_view(backend, rng, (5, 4), dtype, "t")
    b, hb = _matrix_view(backend, rng, (4, 6), dtype, "s")
    c, hc = _matrix_view(backend, rng, (5, 6), dtype, "s")
    hc = hc.copy()                                  # on NumPy, c's own memory
    tally = Tally()
    if B.is_device_array(c) and backend.__name__ == "fakecupy.cupy":
        fcp.tracer = tally
    try:
        got = ops.mm(a, b, out=c, accumulate=True)
    finally:
        fcp.tracer = None
    assert got is c and close(B.to_host(c), hc + ha @ hb, dtype)
    if tally.launches:
        assert dict(tally.ops) == {("matmul", f"cublas {'s' if dtype == np.float32 else 'd'}gemm"): 1}
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        ops.mm(a, b, accumulate=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_column_sums_of_the_same_rows_are_one_launch(dtype):
    """``colsums`` sums two (N, D) and (N, D1) matrices in one ``column_sums`` launch (the tiles
    of the second after the first's, its partial sums after the first's), equal to NumPy's;
    matrices of other rows go in launches of their own."""
    from attn.bench.counts import Tally
    from conftest import selected_backend
    rng = np.random.default_rng(4)
    hs = [rng.standard_normal(shape).astype(dtype) for shape in ((150, 40), (150, 70), (9, 33))]
    with selected_backend("fakecupy") as xp:
        ops = ops_for(xp)
        xs = [xp.asarray(h) for h in hs]
        outs = [xp.full((h.shape[1],), np.nan, dtype=dtype) for h in hs]
        tally = fcp.tracer = Tally()
        try:
            ops.colsums((xs[0], outs[0]), (xs[1], outs[1]))
            assert tally.ops[("raw", "column_sums")] == 1 and tally.kinds["elementwise"] <= 1   # (its counters, once)
            ops.colsums((xs[1], outs[1]), (xs[2], outs[2]), (xs[0], outs[0]))
            assert tally.ops[("raw", "column_sums")] == 4             # in turn: 2 and 33 differ, 33 and 40 too
        finally:
            fcp.tracer = None
        for h, o in zip(hs, outs):
            assert close(B.to_host(o), h.sum(axis=0), dtype)


def test_a_steady_step_keeps_its_batched_products_pointer_arrays():
    """Inside a step memory, a batched product of head views makes its ``gemmBatched`` pointer
    arrays once (the first step in the slab) and reads them again in every later step at the
    same addresses: no ``gemm_pointers`` launch, the same result. Outside a step (addresses from
    the pool) every product fills a scratch buffer with one launch."""
    from attn.bench.counts import Tally
    from attn.fast.gpu.stepmem import StepMemory
    from conftest import selected_backend
    rng = np.random.default_rng(6)
    h = rng.standard_normal((2 * 3, 3 * 8)).astype(np.float32)
    want = h.reshape(2, 3, 3, 2, 4)[:, :, 0].transpose(0, 2, 1, 3)
    want = want @ want.swapaxes(-1, -2)

    class Owner:
        pass
    with selected_backend("fakecupy") as xp:
        from attn.fast.gpu.kernels import CupyOps
        ops, owner = CupyOps(xp), Owner()                # pointer arrays kept by no other test
        owner.xp = xp
        memory = StepMemory.of(owner)

        def step():
            qkv = xp.asarray(h)
            q = qkv.reshape(2, 3, 3, 2, 4)[:, :, 0].transpose(0, 2, 1, 3)
            return B.to_host(ops.bmm(q, q.swapaxes(-1, -2)))
        launches = []
        for i in range(4):
            tally = fcp.tracer = Tally()
            try:
                if i < 3:
                    with memory.step():
                        got = step()
                else:
                    got = step()
            finally:
                fcp.tracer = None
            launches.append(tally.ops[("raw", "gemm_pointers")])
            assert np.allclose(got, want, rtol=1e-5, atol=1e-5), i
    assert launches == [1, 1, 0, 1], launches      # pool; first in the slab (kept); kept ones; pool again


def test_the_kept_pointer_arrays_make_room_but_keep_what_a_graph_reads():
    """Past ``POINTER_CACHE_BYTES`` the least recently used pointer arrays are dropped to make
    room (an eager run whose batches take many shapes keeps its latest products'), except those
    a stream captured, which a graph reads at every replay; a product that finds no room gets a
    scratch buffer. Every product's result stays right."""
    from attn.fast.gpu.kernels import CupyOps
    from attn.fast.gpu.stepmem import StepMemory
    from conftest import selected_backend
    rng = np.random.default_rng(8)
    h = rng.standard_normal((2 * 3, 4 * 3 * 8)).astype(np.float32)     # four (2, 2, 3, 4) head views a step

    class Owner:
        pass
    with selected_backend("fakecupy") as xp:
        ops, owner = CupyOps(xp), Owner()
        owner.xp = xp
        ops.products.POINTER_CACHE_BYTES = 2 * 24 * 4                           # room for two products' arrays
        memory = StepMemory.of(owner)

        def products(which, qkv=None):
            qkv = xp.asarray(h) if qkv is None else qkv              # the step's first array: one address
            v = qkv.reshape(2, 3, 4, 3, 2, 4)
            got = []
            for j in which:
                q = v[:, :, j, 0].transpose(0, 2, 1, 3)
                got.append(ops.bmm(q, q.swapaxes(-1, -2)))
            return got
        want = [hj @ hj.swapaxes(-1, -2) for hj in (h.reshape(2, 3, 4, 3, 2, 4)[:, :, j, 0].transpose(0, 2, 1, 3)
                                                     for j in range(4))]
        with memory.step():
            products(range(4))                                       # in the pool: nothing kept
        cache = lambda: ops._scratch.get("gemm_pointer_arrays", {})  # noqa: E731
        sets = []
        for which in ([0, 1], [0, 1], [2, 3]):
            with memory.step():
                got = products(which)
            for j, g in zip(which, got):
                assert np.allclose(B.to_host(g), want[j], rtol=1e-5, atol=1e-5)
            sets.append(set(cache()))
        assert len(sets[0]) == 2 and sets[0] == sets[1] and not sets[1] & sets[2]   # [2, 3] made room
        kept = sets[2]
        stream = xp.cuda.Stream(non_blocking=True)
        with memory.step(), stream:                                  # a capture reads the two kept ones
            qkv = xp.asarray(h)                                      # (a capture takes no host transfer)
            stream.begin_capture()
            products([2, 3], qkv)
            stream.end_capture()
        with memory.step():
            got = products([0, 1])                                   # no room: the captured ones stay
            assert all(np.allclose(B.to_host(g), want[j], rtol=1e-5, atol=1e-5) for j, g in zip([0, 1], got))
        assert set(cache()) == kept and ops._scratch["gemm_pointer_bytes"] <= ops.products.POINTER_CACHE_BYTES


# --------------------------------------------------------------------------- the stand-in's cuBLAS

CB = fcp.cuda.cublas


def _scalars(dtype, alpha, beta):
    return np.array([alpha, beta], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@given(m=st.integers(1, 7), n=st.integers(1, 7), k=st.integers(1, 7), ta=st.integers(0, 1), tb=st.integers(0, 1),
       pads=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)), batch=st.integers(1, 4),
       kind=st.sampled_from(["gemm", "strided", "pointers"]), alpha=st.sampled_from([1.0, 0.5, -2.0]),
       beta=st.sampled_from([0.0, 1.0, 0.25]), seed=st.integers(0, 2 ** 16))
def test_stand_in_cublas_computes_what_cublas_defines(dtype, m, n, k, ta, tb, pads, batch, kind, alpha, beta, seed):
    rng = np.random.default_rng(seed)
    h = fcp.cuda.device.get_cublas_handle()
    batch = 1 if kind == "gemm" else batch
    c = gemm_cases.case(rng, m, n, k, ta, tb, pads, batch, alpha, beta, dtype)
    sc = _scalars(dtype, alpha, beta)
    al, be = sc.ctypes.data, sc.ctypes.data + sc.itemsize
    s = "s" if dtype == np.float32 else "d"
    if kind == "gemm":
        getattr(CB, f"{s}gemm")(h, ta, tb, m, n, k, al, c.As[0][0].data.ptr, c.lda, c.Bs[0][0].data.ptr, c.ldb, be,
                                c.Cs[0][0].data.ptr, c.ldc)
        got = [c.Cs[0][0]]
    elif kind == "strided":                    # one buffer per operand, the matrices one stride apart
        (pa, sa), (pb, sb), (pc, scs) = (gemm_cases.pack(ms, ld, cols, dtype, np.nan) for ms, ld, cols in
                                         ((c.As, c.lda, c.ca), (c.Bs, c.ldb, c.cb), (c.Cs, c.ldc, n)))
        getattr(CB, f"{s}gemmStridedBatched")(h, ta, tb, m, n, k, al, pa.data.ptr, c.lda, sa, pb.data.ptr, c.ldb,
                                              sb, be, pc.data.ptr, c.ldc, scs, batch)
        got = [pc[i * scs:i * scs + c.ldc * n] for i in range(batch)]
    else:                                      # pointer arrays on the device, matrices anywhere
        ptrs, _ = gemm_cases.pointer_array(c)
        p = ptrs.data.ptr
        getattr(CB, f"{s}gemmBatched")(h, ta, tb, m, n, k, al, p, c.lda, p + 8 * batch, c.ldb, be, p + 16 * batch,
                                       c.ldc, batch)
        got = [x[0] for x in c.Cs]
    for mat, w in zip(gemm_cases.results(got, m, n, c.ldc), c.want):
        assert close(mat, w, dtype)


def test_stand_in_cublas_refuses_what_would_leave_an_array():
    h = fcp.cuda.device.get_cublas_handle()
    a, b, c = (fcp.zeros((4, 4), dtype=np.float32) for _ in range(3))
    sc = _scalars(np.float32, 1.0, 0.0)
    al, be = sc.ctypes.data, sc.ctypes.data + 4
    with pytest.raises(CB.CUBLASError, match="not inside any live device array"):      # ld too large
        CB.sgemm(h, CB.CUBLAS_OP_N, CB.CUBLAS_OP_N, 4, 4, 4, al, a.data.ptr, 5, b.data.ptr, 4, be, c.data.ptr, 4)
    with pytest.raises(CB.CUBLASError, match="ldb 3 < max"):                          # ld too small
        CB.sgemm(h, CB.CUBLAS_OP_N, CB.CUBLAS_OP_N, 4, 4, 4, al, a.data.ptr, 4, b.data.ptr, 3, be, c.data.ptr, 4)
    with pytest.raises(CB.CUBLASError, match="not inside any live device array"):      # a stride past the end
        CB.sgemmStridedBatched(h, 0, 0, 2, 2, 2, al, a.data.ptr, 2, 4, b.data.ptr, 2, 4, be, c.data.ptr, 2, 4, 5)
    with pytest.raises(TypeError, match="must be an integer"):
        CB.sgemm(h, 0, 0, 4.0, 4, 4, al, a.data.ptr, 4, b.data.ptr, 4, be, c.data.ptr, 4)
    c[...] = np.nan                                   # beta 0: C is written, never read
    a[...] = 1
    b[...] = 2
    CB.sgemm(h, 0, 0, 4, 4, 4, al, a.data.ptr, 4, b.data.ptr, 4, be, c.data.ptr, 4)
    assert (c.get() == 8).all()
    # aliasing: cuBLAS reads A and B while it writes C, so a C sharing memory with either is
    # undefined on a GPU; the stand-in refuses it (it would read everything first and pass)
    with pytest.raises(CB.CUBLASError, match="C shares memory with A"):
        CB.sgemm(h, 0, 0, 4, 4, 4, al, a.data.ptr, 4, b.data.ptr, 4, be, a.data.ptr, 4)
    wide = fcp.zeros((8, 4), dtype=np.float32)                 # B and C two halves of one array: fine
    CB.sgemm(h, 0, 0, 4, 4, 4, al, a.data.ptr, 4, wide.data.ptr, 4, be, wide[4:].data.ptr, 4)
    with pytest.raises(CB.CUBLASError, match="C shares memory with B"):           # one row in common
        CB.sgemm(h, 0, 0, 4, 4, 4, al, a.data.ptr, 4, wide.data.ptr, 4, be, wide[3:].data.ptr, 4)


def test_a_captured_cublas_call_replays_on_what_memory_holds_then():
    """The library called directly (as attn.fast.gpu.cublas does, with a handle of its own): a
    captured call replays on what memory holds then, with alpha as it was at the call."""
    D = fcp.cuda.direct_cublas()
    h = D.create()
    a = fcp.asarray(np.eye(3, dtype=np.float32))
    b = fcp.asarray(np.arange(9, dtype=np.float32).reshape(3, 3))
    c = fcp.zeros((3, 3), dtype=np.float32)
    sc = _scalars(np.float32, 2.0, 0.0)
    stream = fcp.cuda.Stream(non_blocking=True)
    workspace = fcp.empty((1 << 16,), dtype=np.uint8)
    with stream:
        stream.begin_capture()
        D.setStream(h, fcp.cuda.get_current_stream().ptr)       # back on cuBLAS's default workspace
        with pytest.raises(fcp.StreamCaptureError, match="default workspace"):
            D.sgemm(h, 0, 0, 3, 3, 3, sc.ctypes.data, b.data.ptr, 3, a.data.ptr, 3, sc.ctypes.data + 4, c.data.ptr, 3)
        D.setWorkspace(h, workspace.data.ptr, workspace.size)
        D.sgemm(h, 0, 0, 3, 3, 3, sc.ctypes.data, b.data.ptr, 3, a.data.ptr, 3, sc.ctypes.data + 4, c.data.ptr, 3)
        graph = stream.end_capture()
    assert (c.get() == 0).all()                        # a capture leaves memory as it was
    sc[0] = 5.0                                        # alpha was read at the call: the graph keeps 2
    a[...] = fcp.asarray(3 * np.eye(3, dtype=np.float32))
    graph.launch()
    assert np.array_equal(c.get(), 6 * np.arange(9, dtype=np.float32).reshape(3, 3))
    with stream:
        stream.begin_capture()
        D.setStream(h, 0)                              # the handle left on the legacy stream
        D.setWorkspace(h, workspace.data.ptr, workspace.size)
        with pytest.raises(fcp.StreamCaptureError, match="not the capturing stream"):
            D.sgemm(h, 0, 0, 3, 3, 3, sc.ctypes.data, b.data.ptr, 3, a.data.ptr, 3, sc.ctypes.data + 4,
                    c.data.ptr, 3)
        stream.end_capture()


def test_cupys_cublas_wrappers_refuse_while_a_stream_captures():
    """As CuPy's do: each wrapper sets the handle's stream first, and that raises during a
    capture; outside one they run."""
    h = fcp.cuda.device.get_cublas_handle()
    a = fcp.asarray(np.eye(2, dtype=np.float32))
    c = fcp.zeros((2, 2), dtype=np.float32)
    sc = _scalars(np.float32, 1.0, 0.0)
    stream = fcp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for call in (lambda: CB.setStream(h, stream.ptr),
                     lambda: CB.sgemm(h, 0, 0, 2, 2, 2, sc.ctypes.data, a.data.ptr, 2, a.data.ptr, 2,
                                      sc.ctypes.data + 4, c.data.ptr, 2)):
            with pytest.raises(fcp.StreamCaptureError, match="during stream capture is currently unsupported"):
                call()
        stream.end_capture()
    CB.setStream(h, 0)
    CB.sgemm(h, 0, 0, 2, 2, 2, sc.ctypes.data, a.data.ptr, 2, a.data.ptr, 2, sc.ctypes.data + 4, c.data.ptr, 2)
    assert np.array_equal(c.get(), np.eye(2, dtype=np.float32))


def test_the_stand_in_has_the_real_cupy_cublas_signatures():
    """Each cuBLAS function the stand-in models takes the parameters of the installed CuPy's
    (read from the compiled module's embedded signatures: importing it needs libcublas)."""
    import importlib.util
    import inspect
    import re
    try:
        spec = importlib.util.find_spec("cupy_backends.cuda.libs.cublas")
    except ImportError:
        spec = None
    if spec is None or not spec.origin:
        pytest.skip("cupy-cuda12x is not installed; CI installs it with .[gpu-ci]")
    with open(spec.origin, "rb") as f:
        binary = f.read()
    names = ["sgemm", "dgemm", "sgemmStridedBatched", "dgemmStridedBatched", "sgemmBatched", "dgemmBatched",
             "gemmEx", "gemmStridedBatchedEx",
             "setStream", "getStream", "setPointerMode", "getPointerMode", "setMathMode", "getMathMode"]

    def real_parameters(name):
        m = re.search(rb"\b" + name.encode() + rb"\((intptr_t handle[^)]*)\)", binary)
        return m and [p.split()[-1] for p in m.group(1).decode().split(",")]

    for name in names:
        real = real_parameters(name)
        assert real, f"the installed CuPy's cublas has no {name}"
        ours = list(inspect.signature(getattr(CB, name)).parameters)
        assert real[1:] == ours[1:] and ours[0] == "handle", (name, real, ours)
    # cublasGemmBatchedEx: the stand-in's CuPy module has it exactly when the installed CuPy does
    # (CuPy 14 does not: attn calls it directly); the direct library's follows the C API
    real = real_parameters("gemmBatchedEx")
    assert hasattr(CB, "gemmBatchedEx") == bool(real)
    ours = list(inspect.signature(fcp.cuda.direct_cublas().gemmBatchedEx).parameters)
    assert ours == ["handle", "transa", "transb", "m", "n", "k", "alpha", "Aarray", "Atype", "lda", "Barray",
                    "Btype", "ldb", "beta", "Carray", "Ctype", "ldc", "batchCount", "computeType", "algo"]
    assert not real or real[1:] == ours[1:], real
    # the math mode --precision tf32 sets; the Ex GEMMs' compute types and algos
    for const in ("CUBLAS_TF32_TENSOR_OP_MATH", "CUBLAS_COMPUTE_32F", "CUBLAS_COMPUTE_32F_FAST_TF32",
                  "CUBLAS_COMPUTE_64F", "CUBLAS_GEMM_DEFAULT", "CUBLAS_GEMM_DEFAULT_TENSOR_OP"):
        assert const.encode() in binary and hasattr(CB, const), const


def test_a_product_met_again_reuses_its_arguments(monkeypatch):
    """The checks and the GEMM's arguments are worked out once per operand signature: a product
    met again (the same shapes, strides and dtype, new data) only reads its operands' addresses,
    and computes what a first product does."""
    from conftest import selected_backend
    from attn.fast.core.dispatch import ops_for
    from attn.fast.gpu.kernels.products import Products
    rng = np.random.default_rng(0)
    with selected_backend("fakecupy") as cp:
        ops = ops_for(cp)
        ops._scratch.pop("product_plans", None)
        worked = []
        real = Products._gemm_args
        monkeypatch.setattr(Products, "_gemm_args", lambda self, *a: worked.append(a[1]) or real(self, *a))
        for _ in range(3):
            a = rng.standard_normal((6, 9)).astype(np.float32)
            b = rng.standard_normal((5, 9)).astype(np.float32).T          # a transposed view
            x = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
            np.testing.assert_allclose(ops.mm(cp.asarray(a), cp.asarray(b.T).T).get(), a @ b, rtol=1e-5)
            got = ops.bmm(cp.asarray(x), cp.asarray(x).swapaxes(-1, -2)).get()
            np.testing.assert_allclose(got, x @ x.swapaxes(-1, -2), rtol=1e-5, atol=1e-6)
        assert worked == ["mm", "bmm"]                    # once each, not once a call
        with pytest.raises(ValueError, match="do not match"):
            ops.mm(cp.asarray(a), cp.asarray(a))          # a new signature is checked

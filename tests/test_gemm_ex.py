"""The CuPy stand-in's mixed-precision GEMMs (``gemmEx``, ``gemmStridedBatchedEx`` and the
direct library's ``gemmBatchedEx``) against what cuBLAS defines: bf16 A and B (16-bit
patterns in uint16 device arrays) into fp32 C, summed in float32 from the operands' exact
values; each matrix bounded by its own element size; the type combinations not modelled
refused as cuBLAS refuses them; captured and replayed like the other GEMMs."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from attn.precision import bf16_bits
import gemm_cases
from fakecupy import cupy as fcp

CB = fcp.cuda.cublas
D = fcp.cuda.direct_cublas()
BF16, F32, F64 = CB.CUDA_R_16BF, CB.CUDA_R_32F, CB.CUDA_R_64F
COMPUTE_32F = CB.CUBLAS_COMPUTE_32F


def _scalars(alpha, beta, dtype=np.float32):
    """alpha and beta in host memory (the default pointer mode): the array and the two addresses."""
    sc = np.array([alpha, beta], dtype=dtype)
    return sc, sc.ctypes.data, sc.ctypes.data + sc.itemsize


def _close(got, want):
    """float32 sums of exact products against a float64 reference: float32's rounding."""
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    return float(np.abs(got - want).max(initial=0.0)) <= 1e-5 * scale * 10


@pytest.mark.parametrize("kind", ["gemm", "strided", "pointers"])
@given(m=st.integers(1, 7), n=st.integers(1, 7), k=st.integers(1, 7), ta=st.integers(0, 1), tb=st.integers(0, 1),
       pads=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)), batch=st.integers(1, 3),
       direct=st.booleans(),
       algo=st.sampled_from([CB.CUBLAS_GEMM_DEFAULT, CB.CUBLAS_GEMM_DEFAULT_TENSOR_OP]),
       alpha=st.sampled_from([1.0, 0.5, -2.0]), beta=st.sampled_from([0.0, 1.0, 0.25]), seed=st.integers(0, 2 ** 16))
def test_bf16_gemm_ex_computes_what_cublas_defines(m, n, k, ta, tb, pads, batch, kind, direct, algo, alpha, beta,
                                                   seed):
    rng = np.random.default_rng(seed)
    lib = D if direct or kind == "pointers" else CB          # CuPy 14 has no gemmBatchedEx
    h = D.create() if lib is D else fcp.cuda.device.get_cublas_handle()
    batch = 1 if kind == "gemm" else batch
    c = gemm_cases.case(rng, m, n, k, ta, tb, pads, batch, alpha, beta, np.float32, bf16=True)
    lda, ldb, ldc = c.lda, c.ldb, c.ldc
    sc, al, be = _scalars(alpha, beta)
    if kind == "gemm":
        lib.gemmEx(h, ta, tb, m, n, k, al, c.As[0][0].data.ptr, BF16, lda, c.Bs[0][0].data.ptr, BF16, ldb, be,
                   c.Cs[0][0].data.ptr, F32, ldc, COMPUTE_32F, algo)
        got = [c.Cs[0][0]]
    elif kind == "strided":                    # one buffer per operand, the matrices one stride apart
        (pa, sa), (pb, sb) = (gemm_cases.pack(ms, ld, cols, np.uint16, 0x7FC0)      # bf16 NaN between them
                              for ms, ld, cols in ((c.As, lda, c.ca), (c.Bs, ldb, c.cb)))
        pc, scs = gemm_cases.pack(c.Cs, ldc, n, np.float32, np.nan)
        lib.gemmStridedBatchedEx(h, ta, tb, m, n, k, al, pa.data.ptr, BF16, lda, sa, pb.data.ptr, BF16, ldb, sb,
                                 be, pc.data.ptr, F32, ldc, scs, batch, COMPUTE_32F, algo)
        got = [pc[i * scs:i * scs + ldc * n] for i in range(batch)]
    else:                                      # pointer arrays on the device, matrices anywhere
        ptrs, _ = gemm_cases.pointer_array(c)
        p = ptrs.data.ptr
        lib.gemmBatchedEx(h, ta, tb, m, n, k, al, p, BF16, lda, p + 8 * batch, BF16, ldb, be, p + 16 * batch,
                          F32, ldc, batch, COMPUTE_32F, algo)
        got = [x[0] for x in c.Cs]
    for g in got:
        assert g.dtype == np.float32
    for mat, w in zip(gemm_cases.results(got, m, n, ldc), c.want):
        assert _close(mat, w)


def test_all_fp32_and_all_fp64_gemm_ex_are_sgemm_and_dgemm():
    """gemmEx with every type fp32 (CUBLAS_COMPUTE_32F) is an sgemm, every type fp64
    (CUBLAS_COMPUTE_64F) a dgemm: the same results, bit for bit."""
    h = fcp.cuda.device.get_cublas_handle()
    rng = np.random.default_rng(0)
    for dtype, t, compute, plain in ((np.float32, F32, COMPUTE_32F, CB.sgemm),
                                     (np.float64, F64, CB.CUBLAS_COMPUTE_64F, CB.dgemm)):
        a, b = (fcp.asarray(rng.standard_normal((5, 4)).astype(dtype)) for _ in range(2))
        c0 = rng.standard_normal((5, 5)).astype(dtype)
        c1, c2 = fcp.asarray(c0), fcp.asarray(c0)
        sc, al, be = _scalars(1.5, 0.5, dtype)
        CB.gemmEx(h, 1, 0, 5, 5, 4, al, a.data.ptr, t, 4, b.data.ptr, t, 4, be, c1.data.ptr, t, 5, compute, -1)
        plain(h, 1, 0, 5, 5, 4, al, a.data.ptr, 4, b.data.ptr, 4, be, c2.data.ptr, 5)
        assert not np.array_equal(c1.get(), c0)
        assert np.array_equal(c1.get(), c2.get()), dtype


def test_device_pointer_mode_reads_alpha_and_beta_from_device_memory():
    h = D.create()
    a = fcp.asarray(bf16_bits(np.eye(3, dtype=np.float32)))
    b = fcp.asarray(bf16_bits(np.arange(9, dtype=np.float32).reshape(3, 3)))
    c = fcp.asarray(np.ones((3, 3), dtype=np.float32))
    sc = fcp.asarray(np.array([2.0, 1.0], dtype=np.float32))
    D.setPointerMode(h, D.CUBLAS_POINTER_MODE_DEVICE)
    D.gemmEx(h, 0, 0, 3, 3, 3, sc.data.ptr, a.data.ptr, BF16, 3, b.data.ptr, BF16, 3, sc.data.ptr + 4,
             c.data.ptr, F32, 3, COMPUTE_32F, 99)
    # column-major: C = 2 * I @ B + C, B's stored columns being the rows of the C-order array
    assert np.array_equal(c.get(), 2 * np.arange(9, dtype=np.float32).reshape(3, 3) + 1)


@pytest.mark.parametrize("types", [(BF16, BF16, BF16, 68), (BF16, F32, F32, 68), (F32, BF16, F32, 68),
                                   (BF16, BF16, F32, 70), (BF16, BF16, F32, 77), (F32, F32, F32, 77),
                                   (CB.CUDA_R_16F, CB.CUDA_R_16F, F32, 68), (F64, F64, F64, 68),
                                   (F32, F32, F32, 70)])
def test_type_combinations_not_modelled_are_not_supported(types):
    h = fcp.cuda.device.get_cublas_handle()
    x = fcp.zeros((16,), dtype=np.float64)
    sc, al, be = _scalars(1.0, 0.0)
    at, bt, ct, compute = types
    with pytest.raises(CB.CUBLASError, match=r"CUBLAS_STATUS_NOT_SUPPORTED: gemmEx: Atype CUDA_R_\w+, Btype "):
        CB.gemmEx(h, 0, 0, 2, 2, 2, al, x.data.ptr, at, 2, x.data.ptr, bt, 2, be, x.data.ptr, ct, 2, compute, -1)
    with pytest.raises(CB.CUBLASError, match="NOT_SUPPORTED: gemmStridedBatchedEx"):
        CB.gemmStridedBatchedEx(h, 0, 0, 2, 2, 2, al, x.data.ptr, at, 2, 4, x.data.ptr, bt, 2, 4, be, x.data.ptr,
                                ct, 2, 4, 1, compute, -1)
    with pytest.raises(CB.CUBLASError, match="NOT_SUPPORTED: gemmBatchedEx"):
        D.gemmBatchedEx(D.create(), 0, 0, 2, 2, 2, al, x.data.ptr, at, 2, x.data.ptr, bt, 2, be, x.data.ptr, ct, 2,
                        1, compute, -1)


def test_the_error_names_the_types_and_an_algo_not_modelled_is_not_supported():
    h = fcp.cuda.device.get_cublas_handle()
    a, c = fcp.zeros((4,), dtype=np.uint16), fcp.zeros((4,), dtype=np.float32)
    sc, al, be = _scalars(1.0, 0.0)
    with pytest.raises(CB.CUBLASError, match="Atype CUDA_R_16BF, Btype CUDA_R_16BF, Ctype CUDA_R_16BF, "
                                             "computeType CUBLAS_COMPUTE_32F_FAST_TF32"):
        CB.gemmEx(h, 0, 0, 2, 2, 2, al, a.data.ptr, BF16, 2, a.data.ptr, BF16, 2, be, a.data.ptr, BF16, 2, 77, -1)
    with pytest.raises(CB.CUBLASError, match="NOT_SUPPORTED: gemmEx: algo 5"):
        CB.gemmEx(h, 0, 0, 2, 2, 2, al, a.data.ptr, BF16, 2, a.data.ptr, BF16, 2, be, c.data.ptr, F32, 2, 68, 5)
    with pytest.raises(TypeError, match="Atype must be an integer"):
        CB.gemmEx(h, 0, 0, 2, 2, 2, al, a.data.ptr, "bf16", 2, a.data.ptr, BF16, 2, be, c.data.ptr, F32, 2, 68, -1)


def test_each_matrix_is_bounded_by_its_own_element_size():
    """A 4 x 4 bf16 matrix fills a 16-element uint16 array (32 bytes: read as float32 it would
    not fit), so lda 4 runs; lda 5 would read past the array, and raises; a C of bf16 size
    would be too short for fp32 results."""
    h = fcp.cuda.device.get_cublas_handle()
    a = fcp.asarray(bf16_bits(np.full((4, 4), 1.0, dtype=np.float32)))
    b = fcp.asarray(bf16_bits(np.full((4, 4), 2.0, dtype=np.float32)))
    c = fcp.asarray(np.full((4, 4), np.nan, dtype=np.float32))         # beta 0: written, never read
    sc, al, be = _scalars(1.0, 0.0)
    CB.gemmEx(h, 0, 0, 4, 4, 4, al, a.data.ptr, BF16, 4, b.data.ptr, BF16, 4, be, c.data.ptr, F32, 4, 68, -1)
    assert (c.get() == 8).all()
    with pytest.raises(CB.CUBLASError, match=r"gemmEx A: matrix 0 of 1, 4 x 4 \(column-major, ld 5\) .* 38 bytes, "
                                             "is not inside any live device array"):
        CB.gemmEx(h, 0, 0, 4, 4, 4, al, a.data.ptr, BF16, 5, b.data.ptr, BF16, 4, be, c.data.ptr, F32, 4, 68, -1)
    with pytest.raises(CB.CUBLASError, match="gemmEx B: .* not inside any live device array"):
        CB.gemmEx(h, 1, 1, 4, 4, 4, al, a.data.ptr, BF16, 4, b.data.ptr + 2, BF16, 4, be, c.data.ptr, F32, 4, 68, -1)
    short = fcp.zeros((16,), dtype=np.uint16)                          # 32 bytes: half a 4 x 4 fp32 C
    with pytest.raises(CB.CUBLASError, match="gemmEx C: .* 64 bytes, is not inside any live device array"):
        CB.gemmEx(h, 0, 0, 4, 4, 4, al, a.data.ptr, BF16, 4, b.data.ptr, BF16, 4, be, short.data.ptr, F32, 4, 68, -1)
    with pytest.raises(CB.CUBLASError, match="gemmStridedBatchedEx A: matrix 1 of 2"):    # strides in elements
        CB.gemmStridedBatchedEx(h, 0, 0, 2, 2, 2, al, a.data.ptr, BF16, 2, 15, b.data.ptr, BF16, 2, 0, be,
                                c.data.ptr, F32, 2, 4, 2, 68, -1)
    with pytest.raises(CB.CUBLASError, match="lda 1 < max"):
        CB.gemmEx(h, 0, 0, 4, 4, 4, al, a.data.ptr, BF16, 1, b.data.ptr, BF16, 4, be, c.data.ptr, F32, 4, 68, -1)


def test_the_tracer_counts_a_bf16_product_at_two_bytes_an_operand_element():
    from attn.bench.counts import Tally
    h = fcp.cuda.device.get_cublas_handle()
    a, b = fcp.zeros((3, 4), dtype=np.uint16), fcp.zeros((4, 5), dtype=np.uint16)
    c = fcp.zeros((3, 5), dtype=np.float32)
    sc, al, be = _scalars(1.0, 0.0)
    tally = fcp.tracer = Tally()
    try:
        CB.gemmEx(h, 0, 0, 5, 3, 4, al, b.data.ptr, BF16, 5, a.data.ptr, BF16, 4, be, c.data.ptr, F32, 5, 68, -1)
    finally:
        fcp.tracer = None
    assert tally.ops[("matmul", "cublas gemmEx")] == 1 and tally.launches == 1
    assert tally.bytes == 2 * (12 + 20) + 4 * 15


def test_a_captured_gemm_ex_replays_on_what_memory_holds_then():
    """The library called directly: captured like its other GEMMs (a workspace set, the handle
    on the capturing stream), the replay reading the bf16 operands as memory holds them then and
    alpha as it was at the call."""
    h = D.create()
    a = fcp.asarray(bf16_bits(np.eye(3, dtype=np.float32)))
    b = fcp.asarray(bf16_bits(np.arange(9, dtype=np.float32).reshape(3, 3)))
    c = fcp.zeros((3, 3), dtype=np.float32)
    sc, al, be = _scalars(2.0, 0.0)
    ptrs = fcp.asarray(np.array([b.data.ptr, a.data.ptr, c.data.ptr], dtype=np.uint64))
    stream = fcp.cuda.Stream(non_blocking=True)
    workspace = fcp.empty((1 << 16,), dtype=np.uint8)

    def calls():
        D.gemmEx(h, 0, 0, 3, 3, 3, al, b.data.ptr, BF16, 3, a.data.ptr, BF16, 3, be, c.data.ptr, F32, 3, 68, 99)
        D.gemmStridedBatchedEx(h, 0, 0, 3, 3, 3, al, b.data.ptr, BF16, 3, 0, a.data.ptr, BF16, 3, 0, be,
                               c.data.ptr, F32, 3, 0, 1, 68, -1)
        D.gemmBatchedEx(h, 0, 0, 3, 3, 3, al, ptrs.data.ptr, BF16, 3, ptrs.data.ptr + 8, BF16, 3, be,
                        ptrs.data.ptr + 16, F32, 3, 1, 68, -1)
    with stream:
        stream.begin_capture()
        D.setStream(h, fcp.cuda.get_current_stream().ptr)       # back on cuBLAS's default workspace
        with pytest.raises(fcp.StreamCaptureError, match="cuBLAS gemmEx in its default workspace"):
            calls()
        D.setWorkspace(h, workspace.data.ptr, workspace.size)
        calls()
        graph = stream.end_capture()
    assert (c.get() == 0).all()                        # a capture leaves memory as it was
    sc[0] = 5.0                                        # alpha was read at the call: the graph keeps 2
    a[...] = fcp.asarray(bf16_bits(3 * np.eye(3, dtype=np.float32)))
    graph.launch()
    assert np.array_equal(c.get(), 6 * np.arange(9, dtype=np.float32).reshape(3, 3))
    with stream:
        stream.begin_capture()
        D.setStream(h, 0)                              # the handle left on the legacy stream
        D.setWorkspace(h, workspace.data.ptr, workspace.size)
        with pytest.raises(fcp.StreamCaptureError, match="cuBLAS gemmBatchedEx on stream 0x0, not the capturing"):
            D.gemmBatchedEx(h, 0, 0, 3, 3, 3, al, ptrs.data.ptr, BF16, 3, ptrs.data.ptr + 8, BF16, 3, be,
                            ptrs.data.ptr + 16, F32, 3, 1, 68, -1)
        stream.end_capture()


def test_cupys_gemm_ex_wrappers_refuse_while_a_stream_captures():
    """As CuPy's other wrappers: refused during a capture before anything is read (even types
    it would refuse), run outside one."""
    h = fcp.cuda.device.get_cublas_handle()
    a = fcp.asarray(bf16_bits(np.eye(2, dtype=np.float32)))
    c = fcp.zeros((2, 2), dtype=np.float32)
    sc, al, be = _scalars(1.0, 0.0)
    stream = fcp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for call in (lambda: CB.gemmEx(h, 0, 0, 2, 2, 2, al, a.data.ptr, BF16, 2, a.data.ptr, BF16, 2, be,
                                       c.data.ptr, F32, 2, 68, -1),
                     lambda: CB.gemmStridedBatchedEx(h, 0, 0, 2, 2, 2, al, a.data.ptr, BF16, 2, 0, a.data.ptr, BF16,
                                                     2, 0, be, c.data.ptr, F32, 2, 0, 1, 68, -1),
                     lambda: CB.gemmEx(h, 0, 0, 2, 2, 2, al, a.data.ptr, BF16, 2, a.data.ptr, BF16, 2, be,
                                       c.data.ptr, BF16, 2, 77, 7)):
            with pytest.raises(fcp.StreamCaptureError, match="gemm\\w*Ex: calling cuBLAS API during stream capture"):
                call()
        stream.end_capture()
    CB.gemmEx(h, 0, 0, 2, 2, 2, al, a.data.ptr, BF16, 2, a.data.ptr, BF16, 2, be, c.data.ptr, F32, 2, 68, -1)
    assert np.array_equal(c.get(), np.eye(2, dtype=np.float32))

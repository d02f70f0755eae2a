"""``cupy.cuda.cublas``: the GEMMs attn calls, resolved from device pointers to the arrays
whose address was taken, with cuBLAS's constants and what cuBLAS defines for the arguments;
and ``cupy.cuda`` itself (:class:`_Cuda`), which gathers it with the runtime.
Part of :mod:`fakecupy.cupy`, which re-exports every name; its state lives there.
"""
from __future__ import annotations

import builtins
import math
import time

import numpy as np

from . import cupy as _c


def _spans(ptr: int, n: int) -> list:
    """[(owner, first byte, one past the last)] of the ``n`` bytes at device address ``ptr``, in
    the memory whose address was taken (none where it is not such memory)."""
    return [(owner, ptr - lo, ptr - lo + n) for lo, hi, owner in _c._exposed_memory() if lo <= ptr < hi]


def _device_time(f):
    """``f``, its time added to :data:`device_seconds` (the device's work, not the host's)."""
    import functools

    @functools.wraps(f)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            _c.device_seconds[0] += time.perf_counter() - t0
    return timed


class _Cublas:
    """``cupy.cuda.cublas`` (``cupy_backends.cuda.libs.cublas``): the GEMMs attn calls, with
    CuPy 14's signatures and cuBLAS's constants, computed with NumPy exactly as cuBLAS defines
    them (column-major: ``C = alpha op(A) op(B) + beta C`` with ``op(X)`` X or X^T, element
    (i, j) of a stored matrix at ``X + (i + j * ld) * itemsize``; C not read when beta is 0).

    Pointers are device addresses (``a.data.ptr``, here NumPy data addresses). Every matrix a
    call touches, and every pointer array of the batched calls, must lie inside one live device
    array whose address was taken: a wrong ld, stride or pointer raises :class:`CUBLASError`
    instead of reading what lies there. ``alpha`` and ``beta`` are host pointers (the pointer
    mode, host by default, as cuBLAS's) and are read when the call is made, as cuBLAS does; the
    pointer arrays and matrices are read when the work runs, so a captured call replays on what
    memory holds then. During a capture the handle must be on the capturing stream
    (``setStream``): work on another stream is not captured on a GPU.

    As in CuPy, these wrappers refuse every call while a stream captures (each first sets the
    handle's stream, and CuPy's ``setStream`` raises ``NotImplementedError('calling cuBLAS API
    during stream capture is currently unsupported')``); :class:`_DirectCublas`, the library
    called without CuPy (``attn.fast.gpu.cublas``), does not.

    The Ex GEMMs (``gemmEx``, ``gemmStridedBatchedEx``) take each matrix's storage type and the
    compute type: bf16 A and B (16-bit patterns, a uint16 array here) into fp32 C, summed in
    float32 from the operands' exact values; all fp32 (an sgemm, TF32 under the handle's TF32
    math mode as sgemm's) or all fp64. Other combinations are ``CUBLAS_STATUS_NOT_SUPPORTED``."""

    #: False for the library called directly (no CuPy wrapper in between)
    _through_cupy = True

    CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_OP_C = 0, 1, 2
    CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE = 0, 1
    CUBLAS_DEFAULT_MATH, CUBLAS_TENSOR_OP_MATH, CUBLAS_PEDANTIC_MATH, CUBLAS_TF32_TENSOR_OP_MATH = 0, 1, 2, 3
    #: cudaDataType (library_types.h; CuPy has them in ``cupy_backends.cuda.api.runtime``), the
    #: storage types of the Ex GEMMs' matrices
    CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
    #: cublasComputeType_t and cublasGemmAlgo_t (cublas_api.h)
    CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F = 68, 77, 70
    CUBLAS_GEMM_DEFAULT, CUBLAS_GEMM_DEFAULT_TENSOR_OP = -1, 99
    HANDLE = 0x5EED0001

    class CUBLASError(RuntimeError):
        pass

    #: handle -> [stream, pointer mode, math mode]
    _state = {HANDLE: [0, 0, 0, None]}     # stream, pointer mode, math mode, workspace

    @classmethod
    def _handle(cls, handle):
        st = cls._state.get(handle)
        if st is None:
            raise cls.CUBLASError(f"CUBLAS_STATUS_NOT_INITIALIZED: {handle!r} is not a cuBLAS handle")
        return st

    @classmethod
    def _cupy_refuses(cls, name):
        if _c._capturing is not None and cls._through_cupy:
            _c._refuse_in_capture(f"cupy.cuda.cublas.{name}: calling cuBLAS API during stream capture is currently "
                               "unsupported (CuPy's wrappers refuse; attn.fast.gpu.cublas calls the library directly)",
                               "CuPy cuBLAS")

    @classmethod
    def setStream(cls, handle, stream):
        cls._cupy_refuses("setStream")
        cls._handle(handle)[0] = _int(stream, "stream", 64, unsigned=True)

    @classmethod
    def getStream(cls, handle):
        return cls._handle(handle)[0]

    @classmethod
    def setPointerMode(cls, handle, mode):
        if mode not in (0, 1):
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: pointer mode {mode!r}")
        cls._handle(handle)[1] = int(mode)

    @classmethod
    def getPointerMode(cls, handle):
        return cls._handle(handle)[1]

    @staticmethod
    def tf32_taken(m: int, n: int, k: int) -> bool:
        """Whether a GEMM allowed TF32 takes it: TF32 math mode is a permission, not a promise
        (cuBLAS's heuristics run small products on float32 SIMT kernels); here products of fewer
        than 2^16 multiply-adds stay float32."""
        return m * n * k >= 1 << 16

    @classmethod
    def setMathMode(cls, handle, mode):
        """The handle's math mode: with ``CUBLAS_TF32_TENSOR_OP_MATH`` the single-precision GEMMs
        large enough (:meth:`tf32_taken`) read their operands as TF32 (here rounded to 10 stored significand bits, to nearest even,
        by :func:`attn.precision.round_tf32`) and sum in float32; the others as they are."""
        cls._cupy_refuses("setMathMode")
        if int(mode) & ~0x10 not in (0, 1, 2, 3):
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: math mode {mode!r}")
        cls._handle(handle)[2] = int(mode)

    @classmethod
    def getMathMode(cls, handle):
        return cls._handle(handle)[2]

    # ---- the GEMMs (CuPy 14's argument lists)

    @classmethod
    def sgemm(cls, handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        cls._gemm("sgemm", np.float32, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, 0), ("B", B, ldb, 0), ("C", C, ldc, 0), 1, False)

    @classmethod
    def dgemm(cls, handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        cls._gemm("dgemm", np.float64, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, 0), ("B", B, ldb, 0), ("C", C, ldc, 0), 1, False)

    @classmethod
    def sgemmStridedBatched(cls, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
                            beta, C, ldc, strideC, batchCount):
        cls._gemm("sgemmStridedBatched", np.float32, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, strideA), ("B", B, ldb, strideB), ("C", C, ldc, strideC), batchCount, False)

    @classmethod
    def dgemmStridedBatched(cls, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
                            beta, C, ldc, strideC, batchCount):
        cls._gemm("dgemmStridedBatched", np.float64, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, strideA), ("B", B, ldb, strideB), ("C", C, ldc, strideC), batchCount, False)

    @classmethod
    def sgemmBatched(cls, handle, transa, transb, m, n, k, alpha, Aarray, lda, Barray, ldb, beta, Carray, ldc,
                     batchCount):
        cls._gemm("sgemmBatched", np.float32, handle, transa, transb, m, n, k, alpha, beta,
                  ("Aarray", Aarray, lda, None), ("Barray", Barray, ldb, None), ("Carray", Carray, ldc, None),
                  batchCount, True)

    @classmethod
    def dgemmBatched(cls, handle, transa, transb, m, n, k, alpha, Aarray, lda, Barray, ldb, beta, Carray, ldc,
                     batchCount):
        cls._gemm("dgemmBatched", np.float64, handle, transa, transb, m, n, k, alpha, beta,
                  ("Aarray", Aarray, lda, None), ("Barray", Barray, ldb, None), ("Carray", Carray, ldc, None),
                  batchCount, True)

    # ---- the mixed-precision GEMMs: each matrix's storage type and the compute type are arguments

    #: (Atype, Btype, Ctype, computeType) -> the storage dtypes of A, B, C and the compute dtype
    #: (that of alpha and beta): the combinations modelled. bf16 matrices hold 16-bit patterns
    #: (uint16 in device memory), read as the float32 they are the top half of.
    _EX_TYPES = {(14, 14, 0, 68): ((np.uint16, np.uint16, np.float32), np.float32),     # bf16 x bf16 -> fp32
                 (0, 0, 0, 68): ((np.float32,) * 3, np.float32),                      # an sgemm
                 (1, 1, 1, 70): ((np.float64,) * 3, np.float64)}                      # a dgemm
    _TYPE_NAMES = {0: "CUDA_R_32F", 1: "CUDA_R_64F", 2: "CUDA_R_16F", 14: "CUDA_R_16BF",
                   68: "CUBLAS_COMPUTE_32F", 77: "CUBLAS_COMPUTE_32F_FAST_TF32", 70: "CUBLAS_COMPUTE_64F"}

    @classmethod
    def _ex_types(cls, name, Atype, Btype, Ctype, computeType, algo):
        """The storage dtypes and the compute dtype of an Ex GEMM's type arguments; a
        combination not modelled, or an algo other than the default ones, is cuBLAS's
        ``CUBLAS_STATUS_NOT_SUPPORTED`` (what it answers for combinations it lacks)."""
        cls._cupy_refuses(name)                     # CuPy's wrapper sets the stream before anything
        types = tuple(_int(t, w, 32) for t, w in ((Atype, "Atype"), (Btype, "Btype"), (Ctype, "Ctype"),
                                                  (computeType, "computeType")))
        algo = _int(algo, "algo", 32)
        got = cls._EX_TYPES.get(types)
        if got is None:
            named = ", ".join(f"{w} {cls._TYPE_NAMES.get(t, t)}"
                              for t, w in zip(types, ("Atype", "Btype", "Ctype", "computeType")))
            raise cls.CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: {name}: {named} (the stand-in models bf16 x bf16 "
                                  "-> fp32, fp32 and fp64, with the compute type of their precision)")
        if algo not in (cls.CUBLAS_GEMM_DEFAULT, cls.CUBLAS_GEMM_DEFAULT_TENSOR_OP):
            raise cls.CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: {name}: algo {algo} (the stand-in models "
                                  "CUBLAS_GEMM_DEFAULT and CUBLAS_GEMM_DEFAULT_TENSOR_OP)")
        return got

    @classmethod
    def gemmEx(cls, handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
               computeType, algo):
        dtypes, dtype = cls._ex_types("gemmEx", Atype, Btype, Ctype, computeType, algo)
        cls._gemm("gemmEx", dtype, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, 0), ("B", B, ldb, 0), ("C", C, ldc, 0), 1, False, dtypes=dtypes)

    @classmethod
    def gemmStridedBatchedEx(cls, handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
                             strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
        dtypes, dtype = cls._ex_types("gemmStridedBatchedEx", Atype, Btype, Ctype, computeType, algo)
        cls._gemm("gemmStridedBatchedEx", dtype, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, strideA), ("B", B, ldb, strideB), ("C", C, ldc, strideC), batchCount, False,
                  dtypes=dtypes)

    # ---- what they compute

    @classmethod
    @_device_time
    def _gemm(cls, name, dtype, handle, transa, transb, m, n, k, alpha, beta, A, B, C, count, arrays, dtypes=None):
        """One GEMM call, checked and run. ``dtype`` is the compute type (alpha's and beta's, and
        the sums'); ``dtypes`` the storage dtypes of A, B and C (all ``dtype`` when not given):
        uint16 is bf16 patterns, read as the float32 values they are the top half of. Lengths,
        strides and alignment are in each matrix's own elements."""
        cls._cupy_refuses(name)
        dtypes = tuple(np.dtype(d) for d in (dtypes or (dtype,) * 3))
        stream, mode, math, workspace = cls._handle(handle)
        if _c._capturing is not None and not cls._through_cupy and workspace is None:
            _c._refuse_in_capture(f"cuBLAS {name} in its default workspace during a capture (cublasSetStream puts a "
                               "handle back on it: set the workspace again after it)", "cuBLAS default workspace")
        tf32 = dtype == np.float32 and math & ~0x10 == cls.CUBLAS_TF32_TENSOR_OP_MATH    # read at the call
        tf32 = tf32 and cls.tf32_taken(_int(m, "m", 32), _int(n, "n", 32), _int(k, "k", 32))
        ta, tb = (_int(t, f"trans{w}", 32) for t, w in ((transa, "a"), (transb, "b")))
        m, n, k, count = (_int(v, w, 32) for v, w in ((m, "m"), (n, "n"), (k, "k"), (count, "batchCount")))
        if ta not in (0, 1, 2) or tb not in (0, 1, 2):
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: {name}: transa {ta}, transb {tb}")
        if min(m, n, k, count) < 0:
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: {name}: m {m}, n {n}, k {k}, batchCount {count}")
        # the stored shapes (rows, columns) of A, B and C: op(A) is m x k, op(B) k x n, C m x n
        shapes = {"A": (m, k) if ta == 0 else (k, m), "B": (k, n) if tb == 0 else (n, k), "C": (m, n)}
        specs = []
        for (what, ptr, ld, stride), key in zip((A, B, C), "ABC"):
            ld = _int(ld, f"ld{key.lower()}", 32)
            rows, cols = shapes[key]
            if ld < max(1, rows):
                raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: {name}: ld{key.lower()} {ld} < max(1, {rows}) "
                                      f"(the rows of the stored {key}, {rows} x {cols})")
            stride = None if stride is None else _int(stride, f"stride{key}", 64)
            specs.append((what, _int(ptr, what, 64, unsigned=True), ld, stride, rows, cols))
        if _c._capturing is not None and stream != _c._capturing.stream.ptr:
            _c._refuse_in_capture(f"cuBLAS {name} on stream {stream:#x}, not the capturing stream (setStream first)",
                               "cuBLAS off the capturing stream")
        if mode == cls.CUBLAS_POINTER_MODE_HOST:
            a_s, b_s = (_host_scalar(p, dtype, w) for p, w in ((alpha, "alpha"), (beta, "beta")))
            def scalars():
                return a_s, b_s
        else:
            def scalars():                   # device pointers: read when the work runs
                return tuple(_device_scalar(p, dtype, w) for p, w in ((alpha, "alpha"), (beta, "beta")))

        def run():
            if m == 0 or n == 0 or count == 0:
                return [np.empty(0, dt) for dt in dtypes]
            al, be = scalars()
            ops = []
            for (what, ptr, ld, stride, rows, cols), dt in zip(specs, dtypes):
                ptrs = (_device_words(ptr, count, f"{name} {what}") if arrays
                        else ptr + np.arange(count, dtype=np.int64) * (stride * dt.itemsize))
                ops.append(_Matrices(ptrs, rows, cols, ld, dt, f"{name} {what}"))
            a, b, c = ops
            spans[:] = [a.spans() + b.spans(), c.spans()]
            for x, which in ((a, "A"), (b, "B")):
                if c.overlaps(x):               # cuBLAS reads and writes as it goes: the result is undefined
                    raise cls.CUBLASError(f"fakecupy cublas {name}: C shares memory with {which} (cuBLAS does "
                                          "not allow aliasing: the result would be undefined)")
            sa, sb = a.read(), b.read()         # as stored (bf16: 16-bit patterns)
            ra, rb = (_bf16_values(x) if x.dtype == np.uint16 else x for x in (sa, sb))
            if tf32:
                from attn.precision import round_tf32
                ra, rb = round_tf32(ra), round_tf32(rb)
            opa = ra if ta == 0 else ra.transpose(0, 2, 1)
            opb = rb if tb == 0 else rb.transpose(0, 2, 1)
            r = np.matmul(opa, opb) if k else np.zeros((count, m, n), dtype=dtype)
            if al != 1:
                r *= dtype(al)
            if be != 0:
                r += dtype(be) * c.read()
            c.write(r)
            return [sa, sb, r]                  # what was read and written (the tracer's bytes)

        spans = [[], []]                        # (owner, first byte, past the last) read, written
        touched = run()
        if _c._capturing is not None:
            _c._record(run, stream)
        if _c.tracer is not None:
            _c.tracer("matmul", f"cublas {name}", touched[:2], touched[2:], {"fresh": [], "stream": stream,
                                                                          "read_at": spans[0], "written_at": spans[1]})


class _Matrices:
    """``count`` stored matrices (rows x cols, column-major with leading dimension ``ld``) at
    device addresses ``ptrs``: each inside one live device array, else :class:`_Cublas.CUBLASError`."""

    def __init__(self, ptrs, rows, cols, ld, dtype, what):
        item = np.dtype(dtype).itemsize
        ptrs = np.asarray(ptrs, dtype=np.int64)
        extent = ((cols - 1) * ld + rows) * item if rows and cols else 0
        self.shape, self.dtype, self.arrays = (rows, cols), np.dtype(dtype), []
        self._extent = extent
        self._parts = []                    # (indices into the batch, element view of the owner, offsets)
        left = np.ones(len(ptrs), dtype=bool)
        if extent == 0:
            return
        for lo, hi, owner in _c._exposed_memory():
            inside = left & (ptrs >= lo) & (ptrs + extent <= hi)
            if not inside.any():
                continue
            if (lo % item) or ((ptrs[inside] - lo) % item).any():
                raise _Cublas.CUBLASError(f"fakecupy cublas {what}: a pointer not aligned to {item} bytes")
            mem = _memory_at(lo, (hi - lo) // item, self.dtype)
            self._parts.append((np.flatnonzero(inside), mem, (ptrs[inside] - lo) // item, owner))
            self.arrays.append(owner)
            left &= ~inside
            if not left.any():
                break
        if left.any():
            i = int(np.flatnonzero(left)[0])
            raise _Cublas.CUBLASError(
                f"fakecupy cublas {what}: matrix {i} of {len(ptrs)}, {rows} x {cols} (column-major, ld {ld}) at "
                f"{int(ptrs[i]):#x}, {extent} bytes, is not inside any live device array")
        rr, cc = np.arange(rows), np.arange(cols)
        self._cell = rr[:, None] + cc[None, :] * ld                     # (rows, cols) element offsets
        self._n = len(ptrs)

    def addresses(self) -> np.ndarray:
        """The device address of every element these matrices touch (sorted)."""
        item = self.dtype.itemsize
        found = [mem.__array_interface__["data"][0] + (off[:, None, None] + self._cell).ravel() * item
                 for _, mem, off, _ in self._parts]
        return np.sort(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)

    def overlaps(self, other: "_Matrices") -> bool:
        """Whether a byte of these matrices is a byte of ``other``'s (their spans first: the usual
        answer, no; then element by element)."""
        if not any(lo < other_hi and other_lo < hi for lo, hi in self._bounds() for other_lo, other_hi in other._bounds()):
            return False
        mine, theirs = self.addresses(), other.addresses()
        a, b = self.dtype.itemsize, other.dtype.itemsize
        if not mine.size or not theirs.size or mine[-1] + a <= theirs[0] or theirs[-1] + b <= mine[0]:
            return False
        g = math.gcd(a, b)                       # compare in units of g bytes
        units = [(x[:, None] + np.arange(0, w, g)).ravel() for x, w in ((mine, a), (theirs, b))]
        return np.intersect1d(*units).size > 0

    def _bounds(self) -> list:
        """(first byte, one past the last) of each part, as device addresses: bytes outside them
        are not touched."""
        item = self.dtype.itemsize
        return [(mem.__array_interface__["data"][0] + int(off.min()) * item,
                 mem.__array_interface__["data"][0] + int(off.max()) * item + self._extent)
                for _, mem, off, _ in self._parts]

    def spans(self) -> list:
        """(owner, first byte, one past the last) in each array these matrices lie in."""
        item = self.dtype.itemsize
        return [(owner, int(off.min()) * item, int(off.max()) * item + self._extent)
                for _, _, off, owner in self._parts]

    def read(self):
        out = np.empty((self._n,) + self.shape, dtype=self.dtype)
        for idx, mem, off, _ in self._parts:
            out[idx] = mem[off[:, None, None] + self._cell]
        return out

    def write(self, r):
        for idx, mem, off, _ in self._parts:
            mem[off[:, None, None] + self._cell] = r[idx]


def _bf16_values(h: np.ndarray) -> np.ndarray:
    """bf16 16-bit patterns (uint16) as the float32 values they are the top half of (exact)."""
    return (h.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _memory_at(address: int, n: int, dtype) -> np.ndarray:
    """The n elements of ``dtype`` at a device address (NumPy memory here), writable."""
    import ctypes
    return np.frombuffer((ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(address), dtype=dtype)


def _device_words(ptr: int, count: int, what: str) -> np.ndarray:
    """The ``count`` 64-bit pointers of a device pointer array at ``ptr``."""
    m = _Matrices([ptr], count, 1, max(count, 1), np.uint64, f"{what} (pointer array)")
    return m.read().reshape(-1).astype(np.int64) if count else np.empty(0, np.int64)


def _host_scalar(ptr, dtype, what: str):
    """A scalar at a host address (pointer mode host), read now."""
    import ctypes
    ptr = _int(ptr, what, 64, unsigned=True)
    if not ptr:
        raise _Cublas.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: {what} is a null pointer")
    return np.frombuffer((ctypes.c_char * np.dtype(dtype).itemsize).from_address(ptr), dtype=dtype)[0].copy()


def _device_scalar(ptr, dtype, what: str):
    return _Matrices([_int(ptr, what, 64, unsigned=True)], 1, 1, 1, dtype, what).read().reshape(())[()]


def _int(v, what: str, bits: int, unsigned: bool = False) -> int:
    """An argument CuPy's Cython wrapper converts to a C integer of ``bits`` bits (a pointer:
    ``size_t``, unsigned)."""
    if isinstance(v, (builtins.bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"fakecupy cublas: {what} must be an integer, got {type(v).__name__} {v!r}")
    v = int(v)
    low, high = (0, 1 << bits) if unsigned else (-(1 << (bits - 1)), 1 << (bits - 1))
    if not low <= v < high:
        raise OverflowError(f"fakecupy cublas: {what} = {v} does not fit in {bits} bits")
    return v


class _DirectCublas(_Cublas):
    """libcublas called directly (what :func:`attn.fast.gpu.cublas.direct_cublas` gives on the
    stand-in, in place of the library bound through ctypes): the same calls as :class:`_Cublas`,
    not refused during a capture, and handles of the caller's own (``create``) with a workspace
    (``setWorkspace``: a device buffer the handle works in, so that cuBLAS allocates nothing
    during a capture)."""
    _through_cupy = False
    _next = [0x5EED1000]

    @classmethod
    def create(cls) -> int:
        handle = cls._next[0] = cls._next[0] + 1
        cls._state[handle] = [0, 0, 0, None]
        return handle

    @classmethod
    def setStream(cls, handle, stream):
        """As cuBLAS's: the handle goes back to cuBLAS's default workspace."""
        super().setStream(handle, stream)
        cls._handle(handle)[3] = None

    @classmethod
    def setWorkspace(cls, handle, workspace, size):
        cls._handle(handle)
        size = _int(size, "workspaceSizeInBytes", 64, unsigned=True)
        ptr = _int(workspace, "workspace", 64, unsigned=True)
        if size and not any(lo <= ptr and ptr + size <= hi for lo, hi, _ in _c._exposed_memory()):
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: setWorkspace: {size} bytes at {ptr:#x} lie in no "
                                  "live device array")
        cls._handle(handle)[3] = (ptr, size)

    @classmethod
    def gemmBatchedEx(cls, handle, transa, transb, m, n, k, alpha, Aarray, Atype, lda, Barray, Btype, ldb, beta,
                      Carray, Ctype, ldc, batchCount, computeType, algo):
        """cublasGemmBatchedEx (the C API's argument order, as CuPy names the others): in
        libcublas, so here, but not among CuPy 14's wrappers (``cupy.cuda.cublas`` has gemmEx
        and gemmStridedBatchedEx only)."""
        dtypes, dtype = cls._ex_types("gemmBatchedEx", Atype, Btype, Ctype, computeType, algo)
        cls._gemm("gemmBatchedEx", dtype, handle, transa, transb, m, n, k, alpha, beta,
                  ("Aarray", Aarray, lda, None), ("Barray", Barray, ldb, None), ("Carray", Carray, ldc, None),
                  batchCount, True, dtypes=dtypes)


class _DeviceModule:
    """``cupy.cuda.device``: the current device's cuBLAS handle."""
    Device = _c.Device

    @staticmethod
    def get_cublas_handle():
        return _Cublas.HANDLE


class _Cuda:
    Device, Stream, Event, MemoryHook, MemoryPool, Graph = _c.Device, _c.Stream, _c.Event, _c.MemoryHook, _c.MemoryPool, _c.Graph
    nccl = _c._Nccl
    cublas = None                   # set below: _Cublas
    device = None                   # set below: _DeviceModule
    get_elapsed_time = staticmethod(_c.get_elapsed_time)
    runtime = _c._Runtime()
    driver = None                   # set in fakecupy.kernels' import: Driver
    MemoryPointer = _c.MemoryPointer
    UnownedMemory = _c.UnownedMemory
    using_allocator = staticmethod(_c._using_allocator)
    set_allocator = staticmethod(_c._set_allocator)
    get_allocator = staticmethod(_c._get_allocator)

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def get_current_stream():
        return _c._current_stream()

    @staticmethod
    def get_cublas_handle():
        return _Cublas.HANDLE

    @staticmethod
    def direct_cublas():
        """The stand-in's libcublas for :func:`attn.fast.gpu.cublas.direct_cublas` (not CuPy API)."""
        return _DirectCublas

"""cuBLAS called directly through ``ctypes``, not through CuPy, whose wrappers refuse every call
while a stream captures (docs/GPU.md): :func:`direct_cublas` gives an object with the method names
and argument order of ``cupy.cuda.cublas``, so the launch code reads the same either way. On the
CuPy stand-in its own cuBLAS model takes the calls (``cupy.cuda.direct_cublas``)."""
from __future__ import annotations

import ctypes
from functools import partial

#: cublasStatus_t names of the codes a call can return.
_STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
           11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED",
           16: "LICENSE_ERROR"}

_P, _I, _LL, _Z = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_size_t
_GEMM = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _I]
_STRIDED = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _LL, _P, _I, _LL, _P, _P, _I, _LL, _I]
_BATCHED = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _I, _I]
# the Ex GEMMs: each matrix followed by its cudaDataType, and computeType, algo last (C ints)
_GEMM_EX = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I]
_STRIDED_EX = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _LL, _P, _I, _I, _LL, _P, _P, _I, _I, _LL, _I, _I, _I]
_BATCHED_EX = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I, _I]
#: the C functions bound, with their arguments (cublas_api.h, CUDA 12 and 13)
SIGNATURES = {
    "cublasCreate_v2": [ctypes.POINTER(_P)],
    "cublasDestroy_v2": [_P],
    "cublasSetStream_v2": [_P, _P],
    "cublasSetPointerMode_v2": [_P, _I],
    "cublasSetWorkspace_v2": [_P, _P, _Z],
    "cublasSetMathMode": [_P, _I],
    "cublasGetMathMode": [_P, ctypes.POINTER(_I)],
    "cublasSgemm_v2": _GEMM,
    "cublasDgemm_v2": _GEMM,
    "cublasSgemmStridedBatched": _STRIDED,
    "cublasDgemmStridedBatched": _STRIDED,
    "cublasSgemmBatched": _BATCHED,
    "cublasDgemmBatched": _BATCHED,
    "cublasGemmEx": _GEMM_EX,
    "cublasGemmStridedBatchedEx": _STRIDED_EX,
    "cublasGemmBatchedEx": _BATCHED_EX,
}
#: cupy.cuda.cublas's name of each the launch code calls (``cublasSgemm_v2``: ``sgemm``)
CUPY_NAMES = {c: c[6].lower() + c[7:].removesuffix("_v2") for c in SIGNATURES
              if c not in ("cublasCreate_v2", "cublasDestroy_v2", "cublasGetMathMode")}


class CublasError(RuntimeError):
    """A cuBLAS call returned an error status (the message names the call and the status)."""


def _call(cname: str, fn, *args) -> None:
    """``fn(*args)``, ``fn`` the C function ``cname``, its status checked."""
    status = fn(*args)
    if status != 0:
        raise CublasError(f"{cname} returned CUBLAS_STATUS_{_STATUS.get(status, status)}")


class CtypesCublas:
    """The entry points of :data:`SIGNATURES` bound from a loaded libcublas, under
    ``cupy.cuda.cublas``'s names (:data:`CUPY_NAMES`), each checking its status; and
    :meth:`create`, a handle of attn's own."""

    CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
    CUBLAS_POINTER_MODE_HOST = 0
    CUBLAS_TF32_TENSOR_OP_MATH = 3
    #: cudaDataType (library_types.h), cublasComputeType_t and cublasGemmAlgo_t (cublas_api.h):
    #: the Ex GEMMs' type arguments, named as on the CuPy stand-in
    CUDA_R_32F, CUDA_R_16BF = 0, 14
    CUBLAS_COMPUTE_32F = 68
    CUBLAS_GEMM_DEFAULT = -1

    def __init__(self, lib):
        self.lib = lib
        for cname, argtypes in SIGNATURES.items():
            fn = getattr(lib, cname)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            if cname in CUPY_NAMES:
                setattr(self, CUPY_NAMES[cname], partial(_call, cname, fn))

    def getMathMode(self, handle) -> int:
        mode = _I()
        _call("cublasGetMathMode", self.lib.cublasGetMathMode, handle, ctypes.byref(mode))
        return int(mode.value)

    def create(self) -> int:
        handle = _P()
        _call("cublasCreate_v2", self.lib.cublasCreate_v2, ctypes.byref(handle))
        return int(handle.value)


def _load(xp):
    """libcublas as CuPy loaded it: by its soname, which finds the copy already in the process
    (CuPy loads it when a handle is first asked for), else the first path the process maps."""
    xp.cuda.device.get_cublas_handle()                 # makes CuPy load the library
    major = xp.cuda.runtime.runtimeGetVersion() // 1000
    tried = []
    for name in (f"libcublas.so.{major}", "libcublas.so"):
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name}: {e}")
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                if "libcublas.so" in line and "libcublasLt" not in line:
                    return ctypes.CDLL(line.split()[-1])
    except OSError as e:
        tried.append(f"/proc/self/maps: {e}")
    raise CublasError("attn.fast.gpu.cublas: cannot load libcublas to call it directly (" + "; ".join(tried) + ")")


_DIRECT: dict = {}

#: Whether attn's products call cuBLAS directly (through ctypes, on attn's own handle); False:
#: through CuPy's ``matmul`` (what :mod:`attn.fast.gpu.fallback` switches to where the probe fails;
#: such a step cannot be captured, and runs at fp32).
DIRECT = True

#: Bytes of the workspace attn's handle works in (PyTorch gives cuBLAS 32 MiB on recent GPUs):
#: set once, so that cuBLAS allocates nothing while a step is captured.
WORKSPACE_BYTES = 32 << 20


def direct_cublas(xp):
    """The cuBLAS entry points for ``xp`` (CuPy, or the stand-in's model of them), made once."""
    key = xp.__name__
    got = _DIRECT.get(key)
    if got is None:
        stand_in = getattr(xp.cuda, "direct_cublas", None)
        got = _DIRECT[key] = stand_in() if stand_in is not None else CtypesCublas(_load(xp))
    return got

"""cuBLAS called directly (:mod:`attn.fast.gpu.cublas`): the binding's argument lists and its
status checks, without a GPU (a library object of Python functions stands for libcublas)."""
from __future__ import annotations

import ctypes

import pytest

from attn.fast.gpu import cublas as C

#: Arguments of each bound function in cublas_api.h (CUDA 12 and 13), counted by hand from the
#: prototypes: handle, transa, transb, m, n, k, alpha, A, lda, ... as the C API has them.
C_ARG_COUNTS = {"cublasSgemm_v2": 14, "cublasDgemm_v2": 14, "cublasSgemmStridedBatched": 18,
                "cublasDgemmStridedBatched": 18, "cublasSgemmBatched": 15, "cublasDgemmBatched": 15,
                "cublasSetStream_v2": 2,
                "cublasSetPointerMode_v2": 2, "cublasSetWorkspace_v2": 3, "cublasSetMathMode": 2, "cublasGetMathMode": 2,
                "cublasCreate_v2": 1, "cublasDestroy_v2": 1,
                "cublasGemmEx": 19, "cublasGemmStridedBatchedEx": 23, "cublasGemmBatchedEx": 20}


def test_the_bound_prototypes_have_the_c_apis_arguments():
    assert {k: len(v) for k, v in C.SIGNATURES.items()} == C_ARG_COUNTS
    for name in ("cublasSgemmStridedBatched", "cublasDgemmStridedBatched", "cublasGemmStridedBatchedEx"):
        assert sum(t is ctypes.c_longlong for t in C.SIGNATURES[name]) == 3            # strides are long long
    assert C.SIGNATURES["cublasSetWorkspace_v2"][2] is ctypes.c_size_t
    # the Ex GEMMs: a C int (cudaDataType) after each matrix pointer, computeType and algo C ints last
    for name, types_at in (("cublasGemmEx", (8, 11, 15)), ("cublasGemmStridedBatchedEx", (8, 12, 17)),
                           ("cublasGemmBatchedEx", (8, 11, 15))):
        sig = C.SIGNATURES[name]
        assert all(sig[i - 1] is ctypes.c_void_p and sig[i] is ctypes.c_int for i in types_at), name
        assert sig[-2:] == [ctypes.c_int, ctypes.c_int], name


def test_the_stand_in_models_every_bound_call_with_its_arguments_and_constants():
    """What attn.fast.gpu.cublas binds, the stand-in's direct library (what direct_cublas gives on
    it) has under the same name, taking as many arguments; and the constants agree."""
    import inspect
    from fakecupy import cupy as fcp
    D = fcp.cuda.direct_cublas()
    for cname, name in C.CUPY_NAMES.items():
        assert len(inspect.signature(getattr(D, name)).parameters) == len(C.SIGNATURES[cname]), name
    consts = [k for k in vars(C.CtypesCublas) if k.isupper()]
    assert {"CUDA_R_16BF", "CUBLAS_COMPUTE_32F", "CUBLAS_GEMM_DEFAULT"} <= set(consts)
    assert {k: getattr(D, k) for k in consts} == {k: getattr(C.CtypesCublas, k) for k in consts}


class _Function:
    def __init__(self, name, status, calls):
        self.name, self.status, self.calls = name, status, calls

    def __call__(self, *args):
        self.calls.append((self.name, args))
        if self.name == "cublasCreate_v2":
            args[0]._obj.value = 1234
        return self.status.get(self.name, 0)


class _Library:
    def __init__(self, status=None):
        self.calls, self.status = [], status or {}

    def __getattr__(self, name):
        f = _Function(name, self.status, self.calls)
        setattr(self, name, f)
        return f


def test_calls_go_through_under_cupys_names_and_a_bad_status_is_an_error_naming_the_call():
    lib = _Library({"cublasSgemm_v2": 7})
    cb = C.CtypesCublas(lib)
    assert cb.create() == 1234
    cb.setStream(1234, 0)
    cb.dgemm(1234, 0, 1, 2, 3, 4, 0, 0, 2, 0, 4, 0, 0, 2)
    assert [n for n, _ in lib.calls] == ["cublasCreate_v2", "cublasSetStream_v2", "cublasDgemm_v2"]
    assert lib.cublasDgemm_v2.argtypes == C.SIGNATURES["cublasDgemm_v2"] and lib.cublasDgemm_v2.restype is ctypes.c_int
    with pytest.raises(C.CublasError, match="cublasSgemm_v2 returned CUBLAS_STATUS_INVALID_VALUE"):
        cb.sgemm(1234, 0, 1, 2, 3, 4, 0, 0, 2, 0, 4, 0, 0, 2)

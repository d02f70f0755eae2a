"""One GEMM problem as cuBLAS stores it, for the tests of the stand-in's cuBLAS
(``tests/test_cublas.py``: the sgemm/dgemm family; ``tests/test_gemm_ex.py``: the bf16 gemmEx
family): column-major operands with padded leading dimensions in device buffers, the float64
reference result, and the packing and reading back of a batch."""
from typing import NamedTuple

import numpy as np

from attn.precision import bf16_bits, from_bf16_bits
from fakecupy import cupy as fcp


def colmajor(rng, rows, cols, ld, dtype, bf16=False):
    """A device buffer holding a rows x cols column-major matrix with leading dimension ld (the
    rest of each column is noise), in ``dtype`` or, with ``bf16``, as bf16 patterns (uint16) of
    float32 numbers. Returns the buffer and the matrix's values on the host (for bf16 the float32
    numbers the patterns stand for exactly)."""
    buf = rng.standard_normal(max(1, ld * cols)).astype(np.float32 if bf16 else dtype)
    if bf16:
        buf = bf16_bits(buf)
    mat = np.lib.stride_tricks.as_strided(buf, (rows, cols), (buf.itemsize, ld * buf.itemsize)).copy()
    return fcp.asarray(buf), (from_bf16_bits(mat) if bf16 else mat)


class Case(NamedTuple):
    lda: int
    ldb: int
    ldc: int
    ca: int          # the stored A's columns
    cb: int          # the stored B's columns
    As: list         # (device buffer, host matrix) per batch entry
    Bs: list
    Cs: list
    want: list       # alpha op(A) op(B) + beta C per batch entry, in float64


def case(rng, m, n, k, ta, tb, pads, batch, alpha, beta, dtype, bf16=False) -> Case:
    """A batch of ``batch`` problems ``C = alpha op(A) op(B) + beta C`` (op(A) m x k, op(B) k x n),
    the leading dimensions padded by ``pads``; A and B in ``dtype`` or bf16, C in ``dtype``."""
    ra, ca = (m, k) if ta == 0 else (k, m)
    rb, cb = (k, n) if tb == 0 else (n, k)
    lda, ldb, ldc = ra + pads[0], rb + pads[1], m + pads[2]
    As = [colmajor(rng, ra, ca, lda, dtype, bf16) for _ in range(batch)]
    Bs = [colmajor(rng, rb, cb, ldb, dtype, bf16) for _ in range(batch)]
    Cs = [colmajor(rng, m, n, ldc, dtype) for _ in range(batch)]
    want = [alpha * ((a if ta == 0 else a.T).astype(np.float64) @ (b if tb == 0 else b.T)) + beta * c
            for (_, a), (_, b), (_, c) in zip(As, Bs, Cs)]
    return Case(lda, ldb, ldc, ca, cb, As, Bs, Cs, want)


def pack(ms, ld, cols, dtype, fill):
    """The batch's matrices in one device buffer, each ``ld * cols + 2`` elements (the stride)
    after the one before, ``fill`` between them. Returns the buffer and the stride."""
    stride = ld * cols + 2
    buf = np.full(stride * len(ms), fill, dtype=dtype)
    for i, (d, _) in enumerate(ms):
        buf[i * stride:i * stride + ld * cols] = d.get()[:ld * cols]
    return fcp.asarray(buf), stride


def pointer_array(c: Case):
    """The device array of every A's, then B's, then C's address (a batched call's three pointer
    arrays back to back), and the batch size."""
    return fcp.asarray(np.array([x[0].data.ptr for x in c.As + c.Bs + c.Cs], dtype=np.uint64)), len(c.As)


def results(got, m, n, ldc) -> list:
    """The m x n result matrices (column-major, leading dimension ldc) in the device buffers ``got``."""
    out = []
    for g in got:
        g = g.get()
        out.append(np.lib.stride_tricks.as_strided(g, (m, n), (g.itemsize, ldc * g.itemsize)))
    return out

"""The CuPy operations whose products read narrower operands (:mod:`attn.precision`):
:class:`Tf32CupyOps` and :class:`Bf16CupyOps`, made by :func:`attn.fast.core.dispatch.ops_for`."""
from __future__ import annotations

import math

from .... import backend as B
from ..stepmem import outside_step
from .common import grid_of
from .cupy_ops import CupyOps


class Bf16CupyOps(CupyOps):
    """:class:`CupyOps` whose products read bfloat16 operands (``attn-train --precision bf16``):
    cuBLAS's ``gemmEx`` family with ``CUDA_R_16BF`` A and B, a float32 C and float32 compute
    (``CUBLAS_COMPUTE_32F``): the tensor cores' bf16 products, summed in float32.

    Where an operand is a parameter (a view of the model's arena), the product reads it from
    the bf16 copy of the master weights that :meth:`prepare_weights` makes at every forward, in
    one launch, at the same offsets and strides; any other operand (an activation, a gradient)
    is copied into bf16 first by one ``round_bf16_gather`` launch (contiguous matrices, each
    batch entry starting on 16 bytes). The rounding is :func:`attn.precision.round_bf16`'s, so
    the NumPy twin (``Ops(numpy, "bf16")``: operands rounded, float32 products) computes
    the same numbers up to the order of the float32 sums."""

    precision = "bf16"

    #: A rounded batch's matrices start this many bf16 elements apart at least (16 bytes).
    BATCH_ALIGN = 8

    def prepare_weights(self, params, into=None):
        """The bf16 copy of ``params`` (the arena's flat float32 parameters) by one ``round_bf16``
        launch into ``into`` (uint16, params' size: the owner's buffer, kept between steps; None:
        a new one, made outside any step, which the caller keeps and passes again). Returns it.
        Until the next call, the products read their operands that are views of ``params`` from
        it. One arena at a time: after another arena is prepared, the products round the first
        one's views as they round activations (the same numbers), and never read another arena's
        copy. Each arena has a copy of its own, so a graph captured on one keeps its address."""
        if params.dtype != B.host.float32 or not params.flags.c_contiguous or params.ndim != 1:
            raise ValueError(f"Bf16CupyOps.prepare_weights: the arena's flat float32 parameters are needed, got "
                             f"{tuple(params.shape)} {params.dtype}")
        if into is None:
            with outside_step():
                into = self.xp.empty((params.size,), dtype=B.host.uint16)
        self.round_bf16_(params, into)
        self._scratch["bf16_weights"] = (params, into)
        return into

    def _weight_copy(self, x):
        """The address of ``x``'s first element in the bf16 copy of the weights, where ``x`` is
        a view of the prepared parameters (its whole extent inside them); else None."""
        kept = self._scratch.get("bf16_weights")
        if kept is None:
            return None
        params, mirror = kept
        base, end = params.data.ptr, params.data.ptr + params.nbytes
        lo, hi = x.data.ptr, x.data.ptr + x.itemsize
        for n, st in zip(x.shape, x.strides):
            if n == 0:
                return None
            if st < 0:
                lo += (n - 1) * st
            else:
                hi += (n - 1) * st
        if not (base <= lo and hi <= end) or (x.data.ptr - base) % x.itemsize:
            return None
        return mirror.data.ptr + (x.data.ptr - base) // x.itemsize * 2

    def _gathered(self, x):
        """A bf16 copy of ``x`` (..., R, C) with at most two batch axes: (address, per), its
        matrices row-major and contiguous, entry ``i`` of the flattened batch at ``i * per``."""
        *batch, R, C = x.shape
        batch = [1] * (2 - len(batch)) + batch
        strides = [0] * (4 - x.ndim) + [st // x.itemsize for st in x.strides]
        per = R * C if not any(b > 1 for b in batch) else -(-R * C // self.BATCH_ALIGN) * self.BATCH_ALIGN
        n = batch[0] * batch[1] * R * C
        dst = self.xp.empty((max(1, batch[0] * batch[1] * per),), dtype=B.host.uint16)
        if n:
            self.kernel("round_bf16_gather", x.dtype)(
                grid_of(n, 256), (256,), (x, dst, B.host.int64(n), B.host.int64(batch[1]), B.host.int64(R),
                                        B.host.int64(C), *(B.host.int64(st) for st in strides), B.host.int64(per)))
        return dst, per

    def _bf16_operand(self, x, where, name, batched):
        """How the GEMM reads ``x`` in bf16: (keep-alive array or None, address, rows
        contiguous, ld, batch stride in elements)."""
        if not batched:
            ptr = self._weight_copy(x)
            if ptr is not None:
                rows, ld = self._matrix(x, where, name)
                return None, ptr, rows, ld, 0
        dst, per = self._gathered(x)
        return dst, dst.data.ptr, True, max(1, x.shape[-1]), per

    def _check_float32(self, where, a):
        if a.dtype != B.host.float32:
            raise ValueError(f"Bf16CupyOps.{where}: bf16 products take float32 operands (the master weights' "
                             f"dtype), got {a.dtype}")

    def mm(self, a, b, out=None, accumulate: bool = False):
        """``a @ b`` by one ``gemmEx`` (bf16 A and B, float32 C and sums), after the bf16 copy
        of each operand that is not a prepared parameter; ``accumulate`` as :meth:`CupyOps.mm`."""
        self._check_float32("mm", a)
        out, dims = self._mm_operands(a, b, out, accumulate)
        if dims is None:
            return out
        cublas, handle = self._cublas()
        ka, pa, ra, lda, _ = self._bf16_operand(a, "mm", "a", False)
        kb, pb, rb, ldb, _ = self._bf16_operand(b, "mm", "b", False)
        c_rows, ldc = self._matrix(out, "mm", "out")
        ta, tb, m, n, k, first, second = self._plan(cublas, (pa, ra, lda), (pb, rb, ldb), c_rows, *dims)
        alpha, beta = self._alpha_beta(a.dtype, accumulate)
        bf, f32 = cublas.CUDA_R_16BF, cublas.CUDA_R_32F
        cublas.gemmEx(handle, ta, tb, m, n, k, alpha, first[0], bf, first[2], second[0], bf, second[2], beta,
                      out.data.ptr, f32, ldc, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        del ka, kb                          # (the copies lived until the call: stream order keeps them)
        return out

    def bmm(self, a, b, out=None):
        """``a @ b`` batched (see :meth:`CupyOps.bmm`) with bf16 operands: both copied into bf16
        (contiguous matrices), then one ``gemmStridedBatchedEx`` where ``out``'s batch is one
        stride, else ``gemmBatchedEx`` with pointer arrays (:meth:`CupyOps._gemm_pointers`)."""
        if a.ndim not in (3, 4):
            raise ValueError(f"Bf16CupyOps.bmm: one or two batch axes, got a of shape {tuple(a.shape)}")
        out, M, N, K = self._operands("bmm", a, b, out, a.ndim - 2)
        self._check_float32("bmm", a)
        count = math.prod(out.shape[:-2])
        if self._nothing_to_multiply(out, M, N, K, count):
            return out
        cublas, handle = self._cublas()
        ka, pa, ra, lda, sa = self._bf16_operand(a, "bmm", "a", True)
        kb, pb, rb, ldb, sb = self._bf16_operand(b, "bmm", "b", True)
        c_rows, ldc = self._matrix(out, "bmm", "out")
        ta, tb, m, n, k, first, second = self._plan(cublas, (pa, ra, lda, sa), (pb, rb, ldb, sb), c_rows, M, N, K)
        outer, inner, so, si = self._batch_strides(out)
        alpha, beta = self._alpha_beta(a.dtype)
        bf, f32 = cublas.CUDA_R_16BF, cublas.CUDA_R_32F
        if outer == 1 or inner == 1 or so == si * inner:
            sc = so if inner == 1 else si
            cublas.gemmStridedBatchedEx(handle, ta, tb, m, n, k, alpha, first[0], bf, first[2], first[3], second[0],
                                        bf, second[2], second[3], beta, out.data.ptr, f32, ldc, sc, count,
                                        cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        else:
            # the pointers in float32 units (4 bytes): a bf16 copy's entries are an even number of elements apart
            ptrs = self._gemm_pointers(B.host.dtype(B.host.float32), count, inner, (
                (first[0], inner * first[3] // 2, first[3] // 2), (second[0], inner * second[3] // 2, second[3] // 2),
                (out.data.ptr, so, si)))
            p, step = ptrs.data.ptr, 8 * count
            cublas.gemmBatchedEx(handle, ta, tb, m, n, k, alpha, p, bf, first[2], p + step, bf, second[2], beta,
                                 p + 2 * step, f32, ldc, count, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        del ka, kb
        return out


class Tf32CupyOps(CupyOps):
    """:class:`CupyOps` whose products run on the cuBLAS handle's ``CUBLAS_TF32_TENSOR_OP_MATH``
    (``attn-train --precision tf32``): the GEMMs read their float32 operands as TF32 in the tensor
    cores and sum in float32. The handle's mode is set for each product and put back after it (the
    handle is shared with the fp32 ops of the same device, which the decoding uses)."""

    precision = "tf32"

    def _tf32(self, product, a, b, out):
        cublas, handle = self._cublas()
        before = cublas.getMathMode(handle)
        cublas.setMathMode(handle, cublas.CUBLAS_TF32_TENSOR_OP_MATH)
        try:
            return product(self, a, b, out=out)
        finally:
            cublas.setMathMode(handle, before)

    def mm(self, a, b, out=None, accumulate=False):
        return self._tf32(lambda ops, a, b, out: CupyOps.mm(ops, a, b, out=out, accumulate=accumulate), a, b, out)

    def bmm(self, a, b, out=None):
        return self._tf32(CupyOps.bmm, a, b, out)

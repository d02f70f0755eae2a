"""The matrix products of :class:`.cupy_ops.CupyOps`, by cuBLAS on the operands as they lie:
:class:`Products` (fp32), :class:`Tf32Products` and :class:`Bf16Products` (:mod:`attn.precision`),
the component a ``CupyOps`` holds for its precision (:data:`PRODUCTS`)."""
from __future__ import annotations

import collections
import math

from .... import backend as B
from .. import cublas as cublas_module
from ..stepmem import in_slab, outside_step
from .common import grid_of
from .registry import CTYPES


class Products:
    """``mm`` and ``bmm`` by cuBLAS for the operations ``ops`` (a :class:`.cupy_ops.CupyOps`, whose
    kernels and buffers they use), keeping their plans, pointer arrays and cuBLAS handle in
    ``scratch`` (the dict every precision's operations of one namespace share)."""

    def __init__(self, ops, scratch: dict):
        self.ops, self.xp, self.scratch = ops, ops.xp, scratch

    def cublas(self):
        """cuBLAS called directly (:func:`attn.fast.gpu.cublas.direct_cublas`) and attn's own handle, its
        workspace made once outside any step, set to the current stream (a capture has its own) and to
        host pointers for alpha and beta."""
        cublas, space = cublas_module.direct_cublas(self.xp), cublas_module.WORKSPACE_BYTES
        handle = self.scratch.get("cublas_handle")
        if handle is None:
            with outside_step():
                self.scratch["cublas_workspace"] = self.xp.empty((space,), dtype=B.host.uint8)
            handle = self.scratch["cublas_handle"] = cublas.create()
            cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        stream = self.xp.cuda.get_current_stream().ptr
        if self.scratch.get("cublas_stream") != stream:
            # cublasSetStream puts the handle back on cuBLAS's default workspace: set ours again
            cublas.setStream(handle, stream)
            cublas.setWorkspace(handle, self.scratch["cublas_workspace"].data.ptr, space)
            self.scratch["cublas_stream"] = stream
        return cublas, handle

    def _alpha_beta(self, dtype, accumulate: bool = False):
        """Host addresses of alpha = 1 and beta (0, or 1 to ``accumulate`` into C) in ``dtype``
        (kept alive here: cuBLAS reads them at the call)."""
        key = ("alpha_beta", dtype)
        ab = self.scratch.get(key)
        if ab is None:
            ab = self.scratch[key] = B.host.array([1, 0], dtype=dtype)
        return ab.ctypes.data, ab.ctypes.data + (0 if accumulate else ab.itemsize)

    @staticmethod
    def _matrix(x, where, name):
        """How cuBLAS reads matrix ``x`` (the last two axes, R x C) in place: (rows_contiguous,
        ld) with ld in elements; rows_contiguous when x's rows are contiguous (row-major with
        leading dimension ld: cuBLAS's column-major x^T), else its columns (x itself,
        column-major). Anything else cannot be given to cuBLAS as it is: ValueError."""
        R, C = x.shape[-2:]
        item = x.itemsize
        sr, sc = x.strides[-2:]
        if sr % item or sc % item:
            raise ValueError(f"CupyOps.{where}: {name} strides {x.strides} are not whole elements")
        sr, sc = sr // item, sc // item
        if (sc == 1 or C == 1) and (R == 1 or sr >= max(1, C)):
            return True, (sr if R > 1 else max(1, C))
        if (sr == 1 or R == 1) and (C == 1 or sc >= max(1, R)):
            return False, (sc if C > 1 else max(1, R))
        raise ValueError(f"CupyOps.{where}: {name} of shape {tuple(x.shape)}, strides {x.strides}: neither its rows "
                         "nor its columns are contiguous, so cuBLAS cannot read it as it is")

    def _operands(self, where, a, b, out, accumulate: bool = False):
        """The checks of ``mm`` or ``bmm``: (out, (M, N, K, count)) of a product left to cuBLAS, or
        (out, None) where nothing is (an empty out; a sum of K = 0 terms: zeros, or, accumulating,
        out as it is)."""
        if accumulate and out is None:
            raise ValueError(f"{type(self).__name__}.mm: accumulate=True needs out, the array the product is added to")
        if where == "bmm" and a.ndim not in (3, 4):
            raise ValueError(f"CupyOps.bmm: one or two batch axes, got a of shape {tuple(a.shape)}")
        ndim = a.ndim if where == "bmm" else 2
        if a.ndim != ndim or b.ndim != ndim:
            raise ValueError(f"CupyOps.{where}: a {tuple(a.shape)} and b {tuple(b.shape)} must have {ndim} "
                             "dimensions")
        *batch, M, K = a.shape
        if tuple(b.shape[:-2]) != tuple(batch) or b.shape[-2] != K:
            raise ValueError(f"CupyOps.{where}: a {tuple(a.shape)} @ b {tuple(b.shape)}: the shapes do not match")
        N = b.shape[-1]
        if a.dtype != b.dtype or str(a.dtype) not in CTYPES:
            raise ValueError(f"CupyOps.{where}: a and b must be both float32 or both float64, got {a.dtype} "
                             f"and {b.dtype}")
        if out is None:
            out = self.xp.empty((*batch, M, N), dtype=a.dtype)
        elif tuple(out.shape) != (*batch, M, N) or out.dtype != a.dtype:
            raise ValueError(f"CupyOps.{where}: out must be {(*batch, M, N)} {a.dtype}, got {tuple(out.shape)} "
                             f"{out.dtype}")
        count = math.prod(batch)
        if M == 0 or N == 0 or count == 0 or (K == 0 and accumulate):
            return out, None
        if K == 0:
            out.fill(0)
            return out, None
        return out, (M, N, K, count)

    def _gemm_args(self, cublas, where, a, b, out, M, N, K):
        """:meth:`_plan` for the arrays: (transa, transb, m, n, k, first, lda, second, ldb, ldc)."""
        a_rows, lda = self._matrix(a, where, "a")
        b_rows, ldb = self._matrix(b, where, "b")
        c_rows, ldc = self._matrix(out, where, "out")
        ta, tb, m, n, k, first, second = self._plan(cublas, (a, a_rows, lda), (b, b_rows, ldb), c_rows, M, N, K)
        return ta, tb, m, n, k, first[0], first[2], second[0], second[2], ldc

    @staticmethod
    def _plan(cublas, a, b, c_rows, M, N, K):
        """The column-major GEMM making ``out = a @ b`` from descriptions of its operands
        (what, rows contiguous, ld, ...) and whether ``out``'s rows are contiguous: (transa,
        transb, m, n, k, first, second), first and second the descriptions of cuBLAS's A and B.
        Row-major out is cuBLAS's C^T = B^T A^T (so cuBLAS's A is b), column-major out its C = A B."""
        N_, T_ = cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T
        if c_rows:                         # a row-major array's memory is its transpose, column-major
            return N_ if b[1] else T_, N_ if a[1] else T_, N, M, K, b, a
        return T_ if a[1] else N_, T_ if b[1] else N_, M, N, K, a, b

    #: Product arguments kept per operand signature (shapes, strides, dtype, out's, accumulate):
    #: the checks, the layout and the GEMM's arguments are worked out once per signature, and a
    #: product met again only reads its operands' addresses. At most this many are kept.
    PRODUCT_PLANS = 4096

    def _planned(self, where, a, b, out, accumulate: bool):
        """(out, the GEMM's arguments) of ``where`` (mm, bmm), kept by the operands' signature; (out, None)
        where nothing is left to cuBLAS (not kept: it is rare)."""
        plans = self.scratch.get("product_plans")
        if plans is None or len(plans) >= self.PRODUCT_PLANS:
            plans = self.scratch["product_plans"] = {}
        key = (where, a.shape, a.strides, b.shape, b.strides, a.dtype.char, b.dtype.char, accumulate,
               None if out is None else (out.shape, out.strides, out.dtype.char))
        plan = plans.get(key)
        if plan is not None:
            return (self.xp.empty(plan[0], dtype=a.dtype) if out is None else out), plan[1:]
        out, dims = self._operands(where, a, b, out, accumulate)
        if dims is None:
            return out, None
        cublas, _ = self.cublas()
        ta, tb, m, n, k, first, lda, second, ldb, ldc = self._gemm_args(cublas, where, a, b, out, *dims[:3])
        plan = ("s" if a.dtype == B.host.float32 else "d", ta, tb, m, n, k, first is a, lda, ldb, ldc,
                *self._alpha_beta(a.dtype, accumulate))
        if where == "bmm":
            batches = tuple(self._batch_strides(x) for x in (first, second, out))
            merged = tuple(so if inner == 1 else si for outer, inner, so, si in batches
                           if outer == 1 or inner == 1 or so == si * inner)
            plan += (dims[3], batches, merged if len(merged) == 3 else None)
        plans[key] = (tuple(out.shape), *plan)
        return out, plan

    def mm(self, a, b, out=None, accumulate: bool = False):
        """``a @ b`` (M, K) x (K, N) by one cuBLAS GEMM on the operands as they lie (each with its rows or
        its columns contiguous), into ``out`` (such a view too); with ``accumulate``, ``out += a @ b`` in
        the same GEMM (beta = 1). Returns out."""
        if not cublas_module.DIRECT:
            return self._matmul(a, b, out, accumulate)
        out, plan = self._planned("mm", a, b, out, accumulate)
        if plan is None:
            return out
        s, ta, tb, m, n, k, a_first, lda, ldb, ldc, alpha, beta = plan
        first, second = (a, b) if a_first else (b, a)
        cublas, handle = self.cublas()
        getattr(cublas, s + "gemm")(handle, ta, tb, m, n, k, alpha, first.data.ptr, lda, second.data.ptr, ldb,
                                    beta, out.data.ptr, ldc)
        return out

    def _matmul(self, a, b, out=None, accumulate: bool = False):
        """``a @ b`` by CuPy's ``matmul``, where cuBLAS through ctypes is switched off
        (:data:`attn.fast.gpu.cublas.DIRECT`); into ``out`` (added to it with ``accumulate``)."""
        r = self.xp.matmul(a, b)
        if out is None:
            return r
        if accumulate:
            out += r
        else:
            out[...] = r
        return out

    @staticmethod
    def _batch_strides(x):
        """The batch axes of ``x`` (one or two) as (outer, inner, outer stride, inner stride),
        strides in elements."""
        shape, strides = x.shape[:-2], tuple(s // x.itemsize for s in x.strides[:-2])
        if len(shape) == 1:
            return 1, shape[0], 0, strides[0]
        return shape[0], shape[1], strides[0], strides[1]

    def bmm(self, a, b, out=None):
        """``a @ b`` over one or two batch axes, each matrix as it lies (see :meth:`mm`): one
        ``gemmStridedBatched`` where each operand's batch is one stride, else (head views: batch and head
        two strides) ``gemmBatched`` with pointer arrays from :meth:`_gemm_pointers`. Returns out."""
        if not cublas_module.DIRECT:
            return self._matmul(a, b, out)
        out, plan = self._planned("bmm", a, b, out, False)
        if plan is None:
            return out
        s, ta, tb, m, n, k, a_first, lda, ldb, ldc, alpha, beta, count, batches, merged = plan
        first, second = (a, b) if a_first else (b, a)
        cublas, handle = self.cublas()
        head = (handle, ta, tb, m, n, k, alpha)
        if merged is not None:
            gemm = getattr(cublas, s + "gemmStridedBatched")
            gemm(*head, first.data.ptr, lda, merged[0], second.data.ptr, ldb, merged[1], beta, out.data.ptr,
                 ldc, merged[2], count)
            return out
        ptrs = self._gemm_pointers(a.dtype, count, batches[2][1],
                                   tuple((x.data.ptr, so, si) for x, (_, _, so, si) in zip((first, second, out), batches)))
        p, step = ptrs.data.ptr, 8 * count
        getattr(cublas, s + "gemmBatched")(*head, p, lda, p + step, ldb, beta, p + 2 * step, ldc, count)
        return out

    #: Bytes of pointer arrays :meth:`_gemm_pointers` keeps: past it, the least recently used
    #: that no captured graph reads make room.
    POINTER_CACHE_BYTES = 64 << 20

    def _gemm_pointers(self, dtype, count: int, inner: int, operands: tuple):
        """The three pointer arrays of a ``gemmBatched`` (A's, B's and C's ``count`` addresses,
        contiguous) for operands given as (address, outer stride, inner stride) each, made by one
        ``gemm_pointers`` launch. Where every operand lies in a step memory's slab (the same addresses
        every step) each product's arrays are made once and kept, so a steady-state step launches none;
        at most :attr:`POINTER_CACHE_BYTES`, the least recently used that no graph captured dropped
        first. Elsewhere, and while a stream captures (which may not allocate), a scratch buffer."""
        ptrs = key = None
        if all(in_slab(address) for address, _, _ in operands):
            key = (dtype, count, inner, operands)
            cache = self.scratch.setdefault("gemm_pointer_arrays", collections.OrderedDict())
            capturing = self.xp.cuda.get_current_stream().is_capturing()
            ptrs = cache.get(key)
            if ptrs is not None:
                cache.move_to_end(key)
                if capturing:
                    self.scratch.setdefault("gemm_pointers_captured", set()).add(key)
                return ptrs
            if capturing or not self._pointer_room(cache, 24 * count):   # a capture allocates nothing
                key = None
            else:
                with outside_step():
                    ptrs = self.xp.empty((3 * count,), dtype=B.host.uint64)
        if ptrs is None:
            ptrs = self.ops.buffer("gemm_pointers", 3 * count, B.host.uint64)
        args = []
        for address, so, si in operands:
            args += [B.host.uint64(address), B.host.int64(so), B.host.int64(si)]
        threads = 128
        self.ops.kernel("gemm_pointers", dtype)((-(-count // threads),), (threads,),
                                         (ptrs, *args, B.host.int32(count), B.host.int32(inner)))
        if key is not None:                              # kept once made
            cache[key] = ptrs
            self.scratch["gemm_pointer_bytes"] = self.scratch.get("gemm_pointer_bytes", 0) + ptrs.nbytes
        return ptrs

    def _pointer_room(self, cache, nbytes: int) -> bool:
        """Whether ``nbytes`` more pointer arrays fit in :attr:`POINTER_CACHE_BYTES`, after
        dropping the least recently used ones no graph captured, as many as it takes."""
        kept = self.scratch.get("gemm_pointer_bytes", 0)
        captured = self.scratch.get("gemm_pointers_captured", set())
        if kept + nbytes > self.POINTER_CACHE_BYTES:
            for old in [k for k in cache if k not in captured]:
                kept -= cache.pop(old).nbytes
                if kept + nbytes <= self.POINTER_CACHE_BYTES:
                    break
            self.scratch["gemm_pointer_bytes"] = kept
        return kept + nbytes <= self.POINTER_CACHE_BYTES


class Bf16Products(Products):
    """The products with bfloat16 operands (``--precision bf16``): cuBLAS's ``gemmEx`` family with
    ``CUDA_R_16BF`` A and B, float32 C and ``CUBLAS_COMPUTE_32F``. A parameter is read from the bf16
    copy of the master weights (:meth:`prepare_weights`, at every forward) at its own offsets and
    strides; any other operand is first copied into bf16 by one ``round_bf16_gather`` launch. The
    rounding is :func:`attn.precision.round_bf16`'s, so ``Ops(numpy, "bf16")`` computes the same
    numbers up to the order of the float32 sums."""

    #: A rounded batch's matrices start this many bf16 elements apart at least (16 bytes).
    BATCH_ALIGN = 8

    def prepare_weights(self, params, into=None):
        """The bf16 copy of ``params`` (the arena's flat float32 parameters) by one ``round_bf16`` launch
        into ``into`` (uint16, kept by the caller between steps; None: a new one, made outside any step).
        Returns it. Until the next call the products read views of ``params`` from it; one arena at a
        time (another arena's views are rounded as activations are: the same numbers)."""
        if params.dtype != B.host.float32 or not params.flags.c_contiguous or params.ndim != 1:
            raise ValueError(f"Bf16Products.prepare_weights: the arena's flat float32 parameters are needed, got "
                             f"{tuple(params.shape)} {params.dtype}")
        if into is None:
            with outside_step():
                into = self.xp.empty((params.size,), dtype=B.host.uint16)
        self.ops.round_bf16_(params, into)
        self.scratch["bf16_weights"] = (params, into)
        return into

    def _weight_copy(self, x):
        """The address of ``x``'s first element in the bf16 copy of the weights, where ``x`` is
        a view of the prepared parameters (its whole extent inside them); else None."""
        kept = self.scratch.get("bf16_weights")
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
            self.ops.kernel("round_bf16_gather", x.dtype)(
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

    def mm(self, a, b, out=None, accumulate: bool = False):
        """``a @ b`` by one ``gemmEx`` (bf16 A and B, float32 C and sums), after the bf16 copy
        of each operand that is not a prepared parameter; ``accumulate`` as :meth:`Products.mm`."""
        return self._product("mm", a, b, out, accumulate)

    def bmm(self, a, b, out=None):
        """``a @ b`` batched (see :meth:`Products.bmm`) with bf16 operands: both copied into bf16
        (contiguous matrices), then one ``gemmStridedBatchedEx`` where ``out``'s batch is one
        stride, else ``gemmBatchedEx`` with pointer arrays (:meth:`Products._gemm_pointers`)."""
        return self._product("bmm", a, b, out, False)

    def _product(self, where, a, b, out, accumulate):
        if a.dtype != B.host.float32:
            raise ValueError(f"Bf16Products.{where}: bf16 products take float32 operands (the master weights' "
                             f"dtype), got {a.dtype}")
        out, dims = self._operands(where, a, b, out, accumulate)
        if dims is None:
            return out
        cublas, handle = self.cublas()
        ka, pa, ra, lda, sa = self._bf16_operand(a, where, "a", where == "bmm")
        kb, pb, rb, ldb, sb = self._bf16_operand(b, where, "b", where == "bmm")
        c_rows, ldc = self._matrix(out, where, "out")
        plan = self._plan(cublas, (pa, ra, lda, sa), (pb, rb, ldb, sb), c_rows, *dims[:3])
        (p1, _, ld1, s1), (p2, _, ld2, s2) = plan[5:]
        alpha, beta = self._alpha_beta(a.dtype, accumulate)
        bf, f32, count = cublas.CUDA_R_16BF, cublas.CUDA_R_32F, dims[3]
        head, tail = (handle, *plan[:5], alpha), (cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        outer, inner, so, si = self._batch_strides(out) if where == "bmm" else (1, 1, 0, 0)
        if where == "mm":
            cublas.gemmEx(*head, p1, bf, ld1, p2, bf, ld2, beta, out.data.ptr, f32, ldc, *tail)
        elif outer == 1 or inner == 1 or so == si * inner:
            cublas.gemmStridedBatchedEx(*head, p1, bf, ld1, s1, p2, bf, ld2, s2, beta, out.data.ptr, f32, ldc,
                                        so if inner == 1 else si, count, *tail)
        else:
            # the pointers in float32 units (4 bytes): a bf16 copy's entries are an even number of elements apart
            ptrs = self._gemm_pointers(B.host.dtype(B.host.float32), count, inner, (
                (p1, inner * s1 // 2, s1 // 2), (p2, inner * s2 // 2, s2 // 2), (out.data.ptr, so, si)))
            p, step = ptrs.data.ptr, 8 * count
            cublas.gemmBatchedEx(*head, p, bf, ld1, p + step, bf, ld2, beta, p + 2 * step, f32, ldc, count,
                                 *tail)
        del ka, kb                          # (the copies lived until the call: stream order keeps them)
        return out


class Tf32Products(Products):
    """The products on the cuBLAS handle's ``CUBLAS_TF32_TENSOR_OP_MATH`` (``--precision tf32``), set for
    each product and put back after it (the handle is shared with the fp32 operations)."""

    def _tf32(self, product, *args):
        cublas, handle = self.cublas()
        before = cublas.getMathMode(handle)
        cublas.setMathMode(handle, cublas.CUBLAS_TF32_TENSOR_OP_MATH)
        try:
            return product(*args)
        finally:
            cublas.setMathMode(handle, before)

    def mm(self, a, b, out=None, accumulate=False):
        return self._tf32(super().mm, a, b, out, accumulate)

    def bmm(self, a, b, out=None):
        return self._tf32(super().bmm, a, b, out)


#: The products of each precision.
PRODUCTS = {"fp32": Products, "tf32": Tf32Products, "bf16": Bf16Products}

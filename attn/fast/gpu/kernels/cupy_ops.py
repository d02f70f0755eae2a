"""The fast path's memory-bound operations and matrix products on CuPy: :class:`CupyOps`, the
launch code of the training step's kernels (see :mod:`attn.fast.gpu.kernels`)."""
from __future__ import annotations

import collections
import math
import weakref

from .... import backend as B
from .. import cublas as cublas_module
from ...core.ops import Mask, Ops
from ..stepmem import in_slab, outside_step, step_token
from .column_sums import COLUMN_CHUNK, COLUMN_MAX_ROW_BLOCKS
from .common import block_size_for, grid_of
from .dropout import M64, GOLDEN, HashedKeep
from .later_ops import LaterKernels
from .registry import CTYPES, NAME_EXPRESSIONS, OPTIONS, SOURCE


def _by_later(name: str):
    """The method of :class:`CupyOps` that its :attr:`~CupyOps.later` kernels run."""
    def method(self, *args, **kwargs):
        return getattr(self.later, name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    return method


class CupyOps(Ops):
    """The fast path's memory-bound operations as fused CuPy kernels (see :mod:`attn.fast.gpu.kernels`);
    the later block's (RMSNorm, rotary positions, SwiGLU's gate) by :attr:`later`, a
    :class:`.later_ops.LaterKernels` launching them with this object's module and buffers."""

    def __init__(self, xp, sharing: CupyOps | None = None):
        """The kernels' module compiled for ``xp``, or, with ``sharing`` (the fp32 operations of
        the same namespace), that object's module, kernels, buffers and seeds: the objects of
        the other precisions (:class:`.precision_ops.Tf32CupyOps`,
        :class:`.precision_ops.Bf16CupyOps`) differ from it in their products alone."""
        super().__init__(xp, self.precision, sharing)
        self.later = LaterKernels(self)
        if sharing is not None:
            self._module, self._functions, self._scratch = sharing._module, sharing._functions, sharing._scratch
            self._draws, self._seeds = sharing._draws, sharing._seeds
            return
        self._module = xp.RawModule(code=SOURCE, options=OPTIONS, name_expressions=NAME_EXPRESSIONS)
        self._functions: dict = {}
        self._scratch: dict = {}
        self._draws = weakref.WeakKeyDictionary()    # DeviceRNG -> dropout masks it has keyed
        self._seeds = weakref.WeakKeyDictionary()    # DeviceRNG -> its seed on the device

    def kernel(self, name, dtype):
        """The kernel ``name<T>`` for ``dtype``, looked up in the module once (a lookup is a
        string formatting and a driver call: microseconds at every launch otherwise)."""
        key = (name, dtype)                      # not str(dtype): that costs microseconds per call
        f = self._functions.get(key)
        if f is None:
            f = self._functions[key] = self._module.get_function(f"{name}<{CTYPES[str(dtype)]}>")
        return f

    @staticmethod
    def scalar(v, dtype):
        return B.host.dtype(dtype).type(v)

    @staticmethod
    def check_contiguous(where, **arrays):
        for name, a in arrays.items():
            if not a.flags.c_contiguous:
                raise ValueError(f"CupyOps.{where}: {name} must be contiguous, got shape {tuple(a.shape)} "
                                 f"strides {a.strides}")
        shapes = {tuple(a.shape) for a in arrays.values()}
        if len(shapes) > 1:
            raise ValueError(f"CupyOps.{where}: " + ", ".join(f"{n} {tuple(a.shape)}" for n, a in arrays.items())
                             + " must have one shape")

    def _elementwise(self, name, dtype, n, *args):
        threads = 256
        self.kernel(name, dtype)(grid_of(n, threads), (threads,), (*args, B.host.int64(n)))

    # ---- softmax (keys first)

    def softmax0_(self, s, bias=None, row_scale=None, scale: float = 1.0):
        """As :meth:`attn.fast.core.ops.Ops.softmax0_` for s (Tk, B, H, Tq) contiguous (``scale``
        multiplies the scores inside the kernel, at no extra pass); ``bias`` is
        required (0 / most negative finite, broadcastable), ``row_scale`` is not needed: a
        query with no allowed key is detected in the kernel."""
        cp = self.xp
        if bias is None:
            bias = cp.zeros((1, 1, 1, 1), dtype=s.dtype)
        if s.ndim != 4 or not s.flags.c_contiguous:
            raise ValueError("CupyOps.softmax0_: s must be a contiguous (Tk, B, H, Tq) array")
        Tk, Bsz, H, Tq = s.shape
        b4 = cp.broadcast_to(bias, s.shape)                 # a view: strides 0 where broadcast
        item = b4.dtype.itemsize
        sk, sb, sh, sq = (st // item for st in b4.strides)
        M = Bsz * H * Tq
        threads = 256
        i64 = B.host.int64
        self.kernel("softmax0_fwd", s.dtype)(
            ((M + threads - 1) // threads,), (threads,),
            (s, b4, self.scalar(scale, s.dtype), B.host.int32(Tk), i64(M), B.host.int32(H), B.host.int32(Tq),
             i64(sk), i64(sb), i64(sh), i64(sq)))
        return s

    def softmax0_backward_(self, dy, y, scale: float = 1.0):
        if not (dy.flags.c_contiguous and y.flags.c_contiguous) or dy.shape != y.shape:
            raise ValueError("CupyOps.softmax0_backward_: dy and y must be contiguous and of one shape")
        Tk = dy.shape[0]
        M = dy.size // Tk
        threads = 256
        self.kernel("softmax0_bwd", dy.dtype)(((M + threads - 1) // threads,), (threads,),
                                            (dy, y, self.scalar(scale, dy.dtype), B.host.int32(Tk),
                                             B.host.int64(M)))
        return dy

    # ---- layer norm

    def layer_norm_(self, x, gamma, beta, eps: float):
        cp = self.xp
        N, D = x.shape
        if not x.flags.c_contiguous:
            raise ValueError("CupyOps.layer_norm_: x must be contiguous")
        out = cp.empty_like(x)
        rstd = cp.empty((N,), dtype=x.dtype)
        threads = block_size_for(D)
        self.kernel("layer_norm_fwd", x.dtype)(
            (N,), (threads,), (x, out, rstd, cp.ascontiguousarray(gamma), cp.ascontiguousarray(beta),
                               B.host.int32(D), self.scalar(eps, x.dtype)),
            shared_mem=threads * x.dtype.itemsize)
        return out, rstd

    def residual_layer_norm_(self, s, bias, m, x, gamma, beta, eps: float):
        """As :meth:`attn.fast.core.ops.Ops.residual_layer_norm_`, in one ``residual_ln_fwd``
        launch (bias, dropout from its counter, residual sum and layer norm) where the mask is
        this class's own (a :class:`HashedKeep`) or there is none."""
        if not self.fused_mask(m, s.shape, "residual_layer_norm_"):
            return super().residual_layer_norm_(s, bias, m, x, gamma, beta, eps)
        cp = self.xp
        N, D = s.shape
        self.check_contiguous("residual_layer_norm_", s=s, x=x)
        out = cp.empty_like(s)
        rstd = cp.empty((N,), dtype=s.dtype)
        threads = block_size_for(D)
        self.kernel("residual_ln_fwd", s.dtype)(
            (N,), (threads,), (s, cp.ascontiguousarray(bias), x, out, rstd, cp.ascontiguousarray(gamma),
                               cp.ascontiguousarray(beta), *self.dropout_args(m, s.dtype), B.host.int32(D),
                               self.scalar(eps, s.dtype)),
            shared_mem=threads * s.dtype.itemsize)
        return out, rstd

    def layer_norm_backward_(self, dout, xhat, rstd, gamma, out=None):
        """As :meth:`attn.fast.core.ops.Ops.layer_norm_backward_`: dgamma and dbeta by one
        ``column_sums`` launch (into ``out``, (2, D), before ``dout`` is overwritten), then one
        block per row for ``dx``."""
        dout, out, _ = self._layer_norm_backward(dout, xhat, rstd, gamma, None, out, "layer_norm_backward_")
        return dout, out[0], out[1]

    def layer_norm_backward_dropout_(self, dout, xhat, rstd, gamma, m, out=None):
        """As :meth:`attn.fast.core.ops.Ops.layer_norm_backward_dropout_`: as :meth:`layer_norm_backward_`,
        then drop(dy) by the same ``layer_norm_bwd_drop`` launch (the mask regenerated from its counter)."""
        if m is None or not self.fused_mask(m, dout.shape, "layer_norm_backward_dropout_"):
            return super().layer_norm_backward_dropout_(dout, xhat, rstd, gamma, m, out)
        dout, _, ds = self._layer_norm_backward(dout, xhat, rstd, gamma, m, out, "layer_norm_backward_dropout_")
        return dout, ds

    def _layer_norm_backward(self, dout, xhat, rstd, gamma, m, out, where):
        cp = self.xp
        N, D = dout.shape
        self.check_contiguous(where, dout=dout, xhat=xhat)
        out = cp.empty((2, D), dtype=dout.dtype) if out is None else out
        self.column_sums(dout, xhat, out, where)
        ds = None if m is None else cp.empty_like(dout)
        args = (dout, xhat, rstd, cp.ascontiguousarray(gamma))
        if m is not None:
            args += (ds, *self.dropout_args(m, dout.dtype))
        threads = block_size_for(D)
        self.kernel("layer_norm_bwd" if m is None else "layer_norm_bwd_drop", dout.dtype)(
            (N,), (threads,), (*args, B.host.int32(D)), shared_mem=threads * dout.dtype.itemsize)
        return dout, out, ds

    # ---- the later block's (RMSNorm, rotary positions, SwiGLU's gate): launched by self.later
    rms_norm_ = _by_later("rms_norm_")
    residual_rms_norm_ = _by_later("residual_rms_norm_")
    rms_norm_backward_ = _by_later("rms_norm_backward_")
    rms_norm_backward_dropout_ = _by_later("rms_norm_backward_dropout_")
    rope_ = _by_later("rope_")
    swiglu_gate = _by_later("swiglu_gate")
    swiglu_gate_backward = _by_later("swiglu_gate_backward")

    # ---- column sums (bias gradients, dgamma and dbeta)

    def colsum(self, x2, out=None):
        """(R, C) -> (C,) by one ``column_sums`` launch (into ``out`` when given)."""
        out = self.xp.empty((x2.shape[1],), dtype=x2.dtype) if out is None else out
        self.column_sums(x2, None, out, "colsum")
        return out

    def colsums(self, *pairs):
        """``colsum(x2, out=out)`` for each ``(x2, out)``, two by two in one ``column_sums``
        launch where their rows agree (a backward's two bias gradients)."""
        i = 0
        while i < len(pairs):
            (a, out), nxt = pairs[i], pairs[i + 1] if i + 1 < len(pairs) else None
            if nxt is not None and nxt[0].shape[0] == a.shape[0] and nxt[0].dtype == a.dtype:
                self.column_sums(a, None, out, "colsums", second=nxt)
                i += 2
            else:
                self.column_sums(a, None, out, "colsums")
                i += 1

    def column_sums(self, a, b, out, where, second=None):
        """``column_sums`` of a (N, D) contiguous: K = 2 with b (a*b, then a), K = 1 without.
        ``out`` (K*D elements, contiguous) receives the sums; ``second`` = (a1, out1), a1
        (N, D1) contiguous, a second K = 1 sum in the same launch."""
        N, D = a.shape
        K = 1 if b is None else 2
        a1, out1 = second if second is not None else (a, out)
        D1 = a1.shape[1] if second is not None else 0
        for x, o, k, d in ((a, out, K, D), (a1, out1, 1, D1)):
            if (not x.flags.c_contiguous or not o.flags.c_contiguous or x.shape != (N, x.shape[1])
                    or (d and (o.size != k * d or o.dtype != a.dtype or x.dtype != a.dtype))):
                raise ValueError(f"CupyOps.{where}: a contiguous (N, D) input and a contiguous output of {k} x "
                                 f"{x.shape[1]} {a.dtype} are needed, got {tuple(x.shape)} strides {x.strides}, "
                                 f"out {tuple(o.shape)} {o.dtype}")
        tiles0 = max(1, -(-D // 32))
        tiles = tiles0 + -(-D1 // 32)
        from_rows = -(-N // COLUMN_CHUNK)
        R = max(1, min(from_rows, COLUMN_MAX_ROW_BLOCKS))
        partial = self.buffer("column_partials", R * (K * D + D1), a.dtype)
        counter = self._counters(tiles)
        self.kernel("column_sums", a.dtype)(
            (tiles, R), (32, 8), (a, a if b is None else b, partial, counter, out, B.host.int64(N),
                                  B.host.int32(D), B.host.int32(K), B.host.int32(COLUMN_CHUNK), a1, out1,
                                  B.host.int32(D1), B.host.int32(tiles0)))

    def buffer(self, name, n, dtype):
        """A scratch buffer of at least ``n`` elements kept between launches (one stream runs
        them in order, so a launch never finds the previous one still reading it). It grows by
        doubling, and a buffer it replaces is kept (:meth:`_retire`): a CUDA graph captured at a
        smaller shape still writes to it."""
        key = (name, dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            self._retire(buf)
            with outside_step():                 # kept between steps: never from a step's memory
                size = max(n, 1, 0 if buf is None else 2 * buf.size)
                buf = self._scratch[key] = self.xp.empty((size,), dtype=dtype)
        return buf[:max(n, 1)]

    def _counters(self, n):
        """``column_sums``' per-tile tickets: zeroed once, and set back to 0 by every launch
        (grown and replaced as :meth:`buffer`'s buffers are)."""
        c = self._scratch.get("counters")
        if c is None or c.size < n:
            self._retire(c)
            with outside_step():
                c = self._scratch["counters"] = self.xp.zeros((max(n, 64, 0 if c is None else 2 * c.size),),
                                                              dtype=B.host.uint32)
        return c

    def _retire(self, buf):
        """Keep a replaced scratch buffer alive: a graph captured before it was replaced holds its
        address, and the pool must not hand that memory to anything else."""
        if buf is not None:
            self._scratch.setdefault("retired", []).append(buf)

    # ---- the matrix products: cuBLAS on the views as they are

    def _cublas(self):
        """cuBLAS called directly (:func:`attn.fast.gpu.cublas.direct_cublas`: CuPy's own wrappers
        refuse every call while a stream captures) and attn's own handle, with a workspace made
        once outside any step, set to the current stream (a capture runs on a stream of its own)
        and to host pointers for alpha and beta (as CuPy's ``matmul``)."""
        from ..cublas import WORKSPACE_BYTES, direct_cublas
        cublas = direct_cublas(self.xp)
        handle = self._scratch.get("cublas_handle")
        if handle is None:
            with outside_step():
                self._scratch["cublas_workspace"] = self.xp.empty((WORKSPACE_BYTES,), dtype=B.host.uint8)
            handle = self._scratch["cublas_handle"] = cublas.create()
            cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        stream = self.xp.cuda.get_current_stream().ptr
        if self._scratch.get("cublas_stream") != stream:
            # cublasSetStream puts the handle back on cuBLAS's default workspace: set ours again
            cublas.setStream(handle, stream)
            cublas.setWorkspace(handle, self._scratch["cublas_workspace"].data.ptr, WORKSPACE_BYTES)
            self._scratch["cublas_stream"] = stream
        return cublas, handle

    def _alpha_beta(self, dtype, accumulate: bool = False):
        """Host addresses of alpha = 1 and beta (0, or 1 to ``accumulate`` into C) in ``dtype``
        (kept alive here: cuBLAS reads them at the call)."""
        key = ("alpha_beta", dtype)
        ab = self._scratch.get(key)
        if ab is None:
            ab = self._scratch[key] = B.host.array([1, 0], dtype=dtype)
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

    def _operands(self, where, a, b, out, nbatch):
        xp = self.xp
        if a.ndim != nbatch + 2 or b.ndim != nbatch + 2:
            raise ValueError(f"CupyOps.{where}: a {tuple(a.shape)} and b {tuple(b.shape)} must have {nbatch + 2} "
                             "dimensions")
        *batch, M, K = a.shape
        if tuple(b.shape[:-2]) != tuple(batch) or b.shape[-2] != K:
            raise ValueError(f"CupyOps.{where}: a {tuple(a.shape)} @ b {tuple(b.shape)}: the shapes do not match")
        N = b.shape[-1]
        if a.dtype != b.dtype or str(a.dtype) not in CTYPES:
            raise ValueError(f"CupyOps.{where}: a and b must be both float32 or both float64, got {a.dtype} "
                             f"and {b.dtype}")
        if out is None:
            out = xp.empty((*batch, M, N), dtype=a.dtype)
        elif tuple(out.shape) != (*batch, M, N) or out.dtype != a.dtype:
            raise ValueError(f"CupyOps.{where}: out must be {(*batch, M, N)} {a.dtype}, got {tuple(out.shape)} "
                             f"{out.dtype}")
        return out, M, N, K

    def _gemm_args(self, cublas, where, a, b, out, M, N, K):
        """The column-major GEMM that makes ``out = a @ b``: (transa, transb, m, n, k, first,
        lda, second, ldb, ldc), with first and second the arrays cuBLAS takes as its A and B.
        Row-major out is cuBLAS's C^T = B^T A^T (so cuBLAS's A is b), column-major out its
        C = A B."""
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

    def _mm_operands(self, a, b, out, accumulate: bool):
        """:meth:`mm`'s checks: (out, (M, N, K)) of a product left to cuBLAS, or (out, None) where
        nothing is left to multiply (an empty out; a sum of K = 0 terms: zeros, or, accumulating,
        out as it is)."""
        if accumulate and out is None:
            raise ValueError(f"{type(self).__name__}.mm: accumulate=True needs out, the array the product is added to")
        out, M, N, K = self._operands("mm", a, b, out, 0)
        if (accumulate and K == 0) or self._nothing_to_multiply(out, M, N, K, 1):
            return out, None
        return out, (M, N, K)

    #: Product arguments kept per operand signature (shapes, strides, dtype, out's, accumulate):
    #: the checks, the layout and the GEMM's arguments are worked out once per signature, and a
    #: product met again only reads its operands' addresses. At most this many are kept.
    PRODUCT_PLANS = 4096

    @staticmethod
    def _signature(a, b, out, accumulate):
        return (a.shape, a.strides, b.shape, b.strides, a.dtype.char, b.dtype.char, accumulate,
                None if out is None else (out.shape, out.strides, out.dtype.char))

    def _product_plans(self) -> dict:
        plans = self._scratch.get("product_plans")
        if plans is None or len(plans) >= self.PRODUCT_PLANS:
            plans = self._scratch["product_plans"] = {}
        return plans

    def mm(self, a, b, out=None, accumulate: bool = False):
        """``a @ b`` (M, K) x (K, N) by one cuBLAS GEMM (``sgemm``/``dgemm``) on the operands as
        they are (each needs its rows or its columns contiguous: a transposed matrix, a block
        of columns); ``out`` too may be such a view. With ``accumulate``, ``out += a @ b`` in the
        same GEMM (beta = 1). Returns out. The checks and the GEMM's arguments are worked out
        once per operand signature (:attr:`PRODUCT_PLANS`); a product met again reads only its
        operands' addresses."""
        if not cublas_module.DIRECT:
            return self._matmul(a, b, out, accumulate)
        plans = self._product_plans()
        key = ("mm",) + self._signature(a, b, out, accumulate)
        plan = plans.get(key)
        if plan is None:
            out, dims = self._mm_operands(a, b, out, accumulate)
            if dims is None:                              # nothing for cuBLAS (not kept: it is rare)
                return out
            cublas, _ = self._cublas()
            ta, tb, m, n, k, first, lda, second, ldb, ldc = self._gemm_args(cublas, "mm", a, b, out, *dims)
            alpha, beta = self._alpha_beta(a.dtype, accumulate)
            gemm = "sgemm" if a.dtype == B.host.float32 else "dgemm"
            plan = plans[key] = (tuple(out.shape), gemm, ta, tb, m, n, k, first is a, lda, ldb, ldc, alpha, beta)
        elif out is None:
            out = self.xp.empty(plan[0], dtype=a.dtype)
        _, gemm, ta, tb, m, n, k, a_first, lda, ldb, ldc, alpha, beta = plan
        first, second = (a, b) if a_first else (b, a)
        cublas, handle = self._cublas()
        getattr(cublas, gemm)(handle, ta, tb, m, n, k, alpha, first.data.ptr, lda, second.data.ptr, ldb, beta,
                              out.data.ptr, ldc)
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
    def _nothing_to_multiply(out, M, N, K, count) -> bool:
        """Whether a product of these sizes is done without cuBLAS: an empty ``out``, or zeros
        (a sum over K = 0 terms)."""
        if M == 0 or N == 0 or count == 0:
            return True
        if K == 0:
            out.fill(0)
            return True
        return False

    @staticmethod
    def _batch_strides(x):
        """The batch axes of ``x`` (one or two) as (outer, inner, outer stride, inner stride),
        strides in elements."""
        shape, strides = x.shape[:-2], tuple(s // x.itemsize for s in x.strides[:-2])
        if len(shape) == 1:
            return 1, shape[0], 0, strides[0]
        return shape[0], shape[1], strides[0], strides[1]

    def bmm(self, a, b, out=None):
        """``a @ b`` over one or two batch axes, (..., M, K) x (..., K, N), each matrix as it lies
        (see :meth:`mm`). Where each operand's batch is one stride (the batch axes merge), one
        ``gemmStridedBatched``; else (head views of a (B*T, n*D) projection: batch and head are
        two strides) the three pointer arrays of ``gemmBatched`` made on the device by one
        ``gemm_pointers`` launch (into a scratch buffer kept between products), then one
        ``gemmBatched``: two launches, no operand copied. Returns out."""
        if not cublas_module.DIRECT:
            return self._matmul(a, b, out)
        plans = self._product_plans()
        key = ("bmm",) + self._signature(a, b, out, False)
        plan = plans.get(key)
        if plan is None:
            if a.ndim not in (3, 4):
                raise ValueError(f"CupyOps.bmm: one or two batch axes, got a of shape {tuple(a.shape)}")
            out, M, N, K = self._operands("bmm", a, b, out, a.ndim - 2)
            count = math.prod(out.shape[:-2])
            if self._nothing_to_multiply(out, M, N, K, count):
                return out
            cublas, _ = self._cublas()
            ta, tb, m, n, k, first, lda, second, ldb, ldc = self._gemm_args(cublas, "bmm", a, b, out, M, N, K)
            batches = tuple(self._batch_strides(x) for x in (first, second, out))
            merged = tuple(so if inner == 1 else si for outer, inner, so, si in batches
                           if outer == 1 or inner == 1 or so == si * inner)
            alpha, beta = self._alpha_beta(a.dtype)
            single = B.host.float32 == a.dtype
            plan = plans[key] = (tuple(out.shape), count, ta, tb, m, n, k, first is a, lda, ldb, ldc, batches,
                                 merged if len(merged) == 3 else None, alpha, beta, single)
        elif out is None:
            out = self.xp.empty(plan[0], dtype=a.dtype)
        _, count, ta, tb, m, n, k, a_first, lda, ldb, ldc, batches, merged, alpha, beta, single = plan
        first, second = (a, b) if a_first else (b, a)
        cublas, handle = self._cublas()
        if merged is not None:
            gemm = cublas.sgemmStridedBatched if single else cublas.dgemmStridedBatched
            gemm(handle, ta, tb, m, n, k, alpha, first.data.ptr, lda, merged[0], second.data.ptr, ldb, merged[1],
                 beta, out.data.ptr, ldc, merged[2], count)
            return out
        ptrs = self._gemm_pointers(a.dtype, count, batches[2][1],
                                   tuple((x.data.ptr, so, si) for x, (_, _, so, si) in zip((first, second, out), batches)))
        gemm = cublas.sgemmBatched if single else cublas.dgemmBatched
        p, step = ptrs.data.ptr, 8 * count
        gemm(handle, ta, tb, m, n, k, alpha, p, lda, p + step, ldb, beta, p + 2 * step, ldc, count)
        return out

    #: Bytes of pointer arrays :meth:`_gemm_pointers` keeps: past it, the least recently used
    #: that no captured graph reads make room.
    POINTER_CACHE_BYTES = 64 << 20

    def _gemm_pointers(self, dtype, count: int, inner: int, operands: tuple):
        """The three pointer arrays of a ``gemmBatched`` (A's, B's and C's ``count`` addresses,
        contiguous) for operands given as (address, outer stride, inner stride) each.

        They are a function of those numbers alone. Operands in a step memory's slab
        (:mod:`attn.fast.gpu.stepmem`) lie at the same addresses every step, so for them each
        distinct product's arrays are made by one ``gemm_pointers`` launch the first time it is
        met and kept: a steady-state step launches none (the first step in a new slab makes
        them; see :class:`attn.fast.gpu.graph.GraphedTrainStep`'s two eager steps). At most
        :attr:`POINTER_CACHE_BYTES` are kept: an eager run whose batches take many shapes makes
        room by dropping the least recently used, never one that a stream captured (a graph
        reads it at every replay). Elsewhere (addresses from the pool change from call to call),
        and for a product first met while a stream captures (which may not allocate), one
        launch fills a scratch buffer."""
        ptrs = key = None
        if all(in_slab(address) for address, _, _ in operands):
            key = (dtype, count, inner, operands)
            cache = self._scratch.get("gemm_pointer_arrays")
            if cache is None:
                cache = self._scratch["gemm_pointer_arrays"] = collections.OrderedDict()
            capturing = self.xp.cuda.get_current_stream().is_capturing()
            ptrs = cache.get(key)
            if ptrs is not None:
                cache.move_to_end(key)
                if capturing:
                    self._scratch.setdefault("gemm_pointers_captured", set()).add(key)
                return ptrs
            if capturing or not self._pointer_room(cache, 24 * count):   # a capture allocates nothing
                key = None
            else:
                with outside_step():
                    ptrs = self.xp.empty((3 * count,), dtype=B.host.uint64)
        if ptrs is None:
            ptrs = self.buffer("gemm_pointers", 3 * count, B.host.uint64)
        args = []
        for address, so, si in operands:
            args += [B.host.uint64(address), B.host.int64(so), B.host.int64(si)]
        threads = 128
        self.kernel("gemm_pointers", dtype)((-(-count // threads),), (threads,),
                                         (ptrs, *args, B.host.int32(count), B.host.int32(inner)))
        if key is not None:                              # kept once made
            cache[key] = ptrs
            self._scratch["gemm_pointer_bytes"] = self._scratch.get("gemm_pointer_bytes", 0) + ptrs.nbytes
        return ptrs

    def _pointer_room(self, cache, nbytes: int) -> bool:
        """Whether ``nbytes`` more pointer arrays fit in :attr:`POINTER_CACHE_BYTES`, after
        dropping the least recently used ones no graph captured, as many as it takes."""
        kept = self._scratch.get("gemm_pointer_bytes", 0)
        captured = self._scratch.get("gemm_pointers_captured", set())
        if kept + nbytes > self.POINTER_CACHE_BYTES:
            for old in [k for k in cache if k not in captured]:
                kept -= cache.pop(old).nbytes
                if kept + nbytes <= self.POINTER_CACHE_BYTES:
                    break
            self._scratch["gemm_pointer_bytes"] = kept
        return kept + nbytes <= self.POINTER_CACHE_BYTES

    # ---- dropout, ReLU

    #: Dropout masks from the counter-based generator of ``dropout_hash`` (no draw, no mask in
    #: memory, one launch each way, and the fused epilogues apply them) instead of drawn from
    #: ``rng`` (a cuRAND draw and a comparison per site). On by default: the masks are keyed by
    #: (seed, step, site, index in the global batch), so the ranks of a data-parallel run draw
    #: what one process draws. Off: ``uniform >= p`` drawn from ``rng``, p exact.
    counter_dropout: bool = True

    def dropout_mask(self, rng, shape, p: float) -> Mask:
        """With :attr:`counter_dropout`, a mask drawn by no launch: ``keep`` is a
        :class:`HashedKeep`, the key of the counter-based generator of ``dropout_hash`` (from
        ``rng``'s seed, which the trainer makes from its seed and the step, and how many masks
        it has made: the site; on the host), which the forward and the backward both regenerate
        the mask from; then, as on NumPy, ``p`` is quantised to 1/65536 and kept units are scaled
        by the exact inverse. The counter is the element's index in the global batch: a
        data-parallel rank's ``rng`` says where its rows sit in it (``rng.place(shape)``:
        :class:`attn.training.distributed.RowsOf`); one process's index is the local one.
        Without it, drawn from ``rng``: ``uniform >= p`` (p exact)."""
        if not self.counter_dropout:
            return Mask(rng.random(shape, dtype="float32") >= p, 1.0 / (1.0 - p))
        thr = int(round(p * 65536))
        draws = self._draws.get(rng, 0)
        self._draws[rng] = draws + 1
        base, run, skip = rng.place(shape) if hasattr(rng, "place") else (0, 0, 0)
        return Mask(HashedKeep(self._seed_of(rng), draws, (base * GOLDEN) & M64, thr, tuple(shape), run, skip),
                    65536.0 / (65536 - thr))           # counter i -> base + i

    def _seed_of(self, rng):
        """``rng``'s seed on the device, where the dropout kernels read it: ``rng.device_seed``
        where it has one (a captured step's: a buffer the graph reads, refreshed before every
        replay), else a one-element array made once per ``rng`` (one host-to-device copy). The
        trainer makes an ``rng`` a step: the first time one is met inside a step memory its array
        comes from the slab, for that step only (nothing from the pool); one met again in another
        step (the benchmark's, which keeps one), or outside any step, gets one kept for good."""
        seed = getattr(rng, "device_seed", None)
        if seed is None:
            step = step_token()
            kept = self._seeds.get(rng)
            if kept is not None and (kept[0] is None or kept[0] == step):
                return kept[1]
            host = B.host.array([rng.seed & M64], dtype=B.host.uint64)
            if step is None or kept is not None:
                with outside_step():
                    kept = self._seeds[rng] = (None, self.xp.asarray(host))
            else:
                kept = self._seeds[rng] = (step, self.xp.asarray(host))
            seed = kept[1]
        return seed

    def _no_seed(self):
        """The seed given to a fused kernel that drops nothing (thr 0: never read)."""
        z = self._scratch.get("no_seed")
        if z is None:
            with outside_step():
                z = self._scratch["no_seed"] = self.xp.zeros((1,), dtype=B.host.uint64)
        return z

    def dropout_args(self, m, dtype):
        """(seed, site, offset, thr, scale in ``dtype``) of mask ``m`` (None: no dropout), the
        fused kernels' dropout arguments."""
        if m is None:
            return self._no_seed(), B.host.uint64(0), B.host.uint64(0), B.host.uint32(0), self.scalar(1.0, dtype)
        k = m.keep
        return k.seed, B.host.uint64(k.site), B.host.uint64(k.offset), B.host.uint32(k.thr), self.scalar(m.scale, dtype)

    def fused_mask(self, m, shape, where) -> bool:
        """Whether mask ``m`` (None: no dropout) can be regenerated by a kernel over the flat
        index of an array of ``shape`` (a :class:`HashedKeep` in one run); a wrong shape is an error."""
        if m is None:
            return True
        if not isinstance(m.keep, HashedKeep):
            return False
        if m.keep.shape != tuple(shape):
            raise ValueError(f"CupyOps.{where}: the mask was drawn for shape {m.keep.shape}, the array is "
                             f"{tuple(shape)}")
        self.check_rows(m, where)
        return True

    @staticmethod
    def check_rows(m, where):
        """A mask the fused epilogues can regenerate from the flat index row * D + j: one run (its
        rows are contiguous in the global batch, as (B*T, D) masks are)."""
        if m is not None and m.keep.skip:
            raise ValueError(f"CupyOps.{where}: the mask of shape {m.keep.shape} lies in runs of {m.keep.run} "
                             "elements in the global batch; the fused kernels take a row-major one (B*T, D)")

    def dropout_(self, x, m: Mask):
        if isinstance(m.keep, HashedKeep):
            return self._dropout_hash(x, x, m, "dropout_")
        self.check_contiguous("dropout_", x=x, keep=m.keep)
        self._elementwise("dropout_fwd", x.dtype, x.size, x, m.keep, self.scalar(m.scale, x.dtype))
        return x

    def dropout_backward(self, d, m: Mask):
        if isinstance(m.keep, HashedKeep):
            return self._dropout_hash(self.xp.empty_like(d), d, m, "dropout_backward")
        self.check_contiguous("dropout_backward", d=d, keep=m.keep)
        out = self.xp.empty_like(d)
        self._elementwise("dropout_bwd", d.dtype, d.size, d, m.keep, self.scalar(m.scale, d.dtype), out)
        return out

    def _dropout_hash(self, out, x, m: Mask, where):
        k = m.keep
        if tuple(x.shape) != k.shape:
            raise ValueError(f"CupyOps.{where}: the mask was drawn for shape {k.shape}, the array is "
                             f"{tuple(x.shape)}")
        self.check_contiguous(where, out=out, x=x)
        self._elementwise("dropout_hash", x.dtype, x.size, out, x, *self.dropout_args(m, x.dtype),
                          B.host.int64(max(k.run, 1)), B.host.int64(k.skip))
        return out

    def bias_relu_dropout_(self, a, bias, m):
        """As :meth:`attn.fast.core.ops.Ops.bias_relu_dropout_`, in one ``bias_relu_drop`` launch
        where the mask is this class's own or there is none."""
        if not self.fused_mask(m, a.shape, "bias_relu_dropout_"):
            return super().bias_relu_dropout_(a, bias, m)
        if not a.flags.c_contiguous or a.ndim != 2:
            raise ValueError(f"CupyOps.bias_relu_dropout_: a must be a contiguous (N, F) array, got shape "
                             f"{tuple(a.shape)} strides {a.strides}")
        threads = 256
        self.kernel("bias_relu_drop", a.dtype)(
            grid_of(a.size, threads), (threads,),
            (a, self.xp.ascontiguousarray(bias), *self.dropout_args(m, a.dtype),
             B.host.int64(a.size), B.host.int32(a.shape[1])))
        return a

    def relu_backward_(self, da, a):
        self.check_contiguous("relu_backward_", da=da, a=a)
        self._elementwise("relu_bwd", da.dtype, da.size, da, a)
        return da

    # ---- loss

    def cross_entropy_(self, x, y, valid, n, smoothing: float):
        cp = self.xp
        N, V = x.shape
        if not x.flags.c_contiguous:
            raise ValueError("CupyOps.cross_entropy_: x must be contiguous")
        w = valid.astype(x.dtype) / n
        loss_rows = cp.empty((N,), dtype=x.dtype)
        threads = block_size_for(V, 512)
        self.kernel("cross_entropy_fwd_bwd", x.dtype)(
            (N,), (threads,), (x, cp.ascontiguousarray(y.astype(cp.int64)), w, loss_rows,
                               B.host.int32(V), self.scalar(smoothing, x.dtype)),
            shared_mem=threads * x.dtype.itemsize)
        return loss_rows.sum()

    # ---- optimizer

    def adam_(self, p, g, m, v, consts, scratch=None):
        self.check_contiguous("adam_", p=p, g=g, m=m, v=v)
        one_m_b1, b2, one_m_b2, eps_c, step = (self.scalar(c, p.dtype) for c in consts)
        self._elementwise("adam", p.dtype, p.size, p, m, v, g, one_m_b1, b2, one_m_b2, eps_c, step)

    #: Most blocks of the gradient norm's first stage (``adam_flat`` sums their partials in
    #: every block) and of the flat update's grid-stride loop.
    NORM_BLOCKS, ADAM_BLOCKS = 256, 4096

    def adam_flat_(self, p, g, m, v, count, schedule, max_norm: float = 0.0):
        """Adam over flat arrays (the whole arena) in one launch; with ``max_norm > 0`` the
        gradient's global norm first, by one ``sumsq_partial`` launch, and the clipping decided
        inside ``adam_flat`` (no host synchronisation). ``g`` is not written. ``count`` (a
        one-element int64 device array) is the number of steps taken, which the kernel reads and
        advances; ``schedule`` is ``(lr_factor, fixed_lr or None, d_model, warmup_steps, b1, b2,
        eps)``, from which it makes the step's learning rate and bias corrections."""
        self.check_contiguous("adam_flat_", p=p, g=g, m=m, v=v)
        if count.shape != (1,) or count.dtype != B.host.int64:
            raise ValueError(f"CupyOps.adam_flat_: count must be a one-element int64 device array, got shape "
                             f"{tuple(count.shape)} {count.dtype}")
        lr_factor, fixed_lr, d_model, warmup, b1, b2, eps = schedule
        n, threads = p.size, 256
        partial = self.buffer("norm_partials", self.NORM_BLOCKS, B.host.float64)
        n_partial = 0
        if max_norm > 0:
            n_partial = max(1, min(self.NORM_BLOCKS, -(-n // (threads * 16))))
            self.kernel("sumsq_partial", g.dtype)((n_partial,), (threads,), (g, partial, B.host.int64(n)),
                                               shared_mem=threads * 8)
        f64 = B.host.float64
        self.kernel("adam_flat", p.dtype)(
            grid_of(n, threads, self.ADAM_BLOCKS), (threads,),
            (p, m, v, g, partial, B.host.int32(n_partial), f64(max_norm), count, self._ticket("adam_ticket"),
             f64(lr_factor), f64(0.0 if fixed_lr is None else fixed_lr), B.host.int32(fixed_lr is not None),
             f64(d_model), f64(warmup), f64(b1), f64(b2), f64(eps), B.host.int64(n)), shared_mem=threads * 8)

    # ---- the products' precision (attn.precision)

    def round_bf16_(self, src, dst):
        """dst (uint16, src's size) <- the bfloat16 patterns nearest to src (float32), in one
        launch (``round_bf16``; :func:`attn.precision.bf16_bits` is the same rounding on any
        array): the bf16 copy of the fp32 master weights that bf16 products with ``CUDA_R_16BF``
        operands read (:meth:`.precision_ops.Bf16CupyOps.prepare_weights`)."""
        if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.size != dst.size \
                or dst.dtype != B.host.uint16:
            raise ValueError(f"CupyOps.round_bf16_: contiguous src and a uint16 dst of its size are needed, got "
                             f"{tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
        self._elementwise("round_bf16", src.dtype, src.size, src, dst)
        return dst

    def _ticket(self, name):
        """A one-element counter a kernel's last block sets back to 0: zeroed once."""
        c = self._scratch.get(name)
        if c is None:
            with outside_step():
                c = self._scratch[name] = self.xp.zeros((1,), dtype=B.host.uint32)
        return c

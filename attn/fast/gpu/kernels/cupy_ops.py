"""The fast path's memory-bound operations and matrix products on CuPy: :class:`CupyOps`, the
launch code of the training step's kernels (see :mod:`attn.fast.gpu.kernels`), the later block's
(RMSNorm, rotary positions, SwiGLU's gate) among them."""
from __future__ import annotations

import weakref

from .... import backend as B
from ...core.ops import Mask, Ops
from ..stepmem import outside_step, step_token
from .column_sums import COLUMN_CHUNK, COLUMN_MAX_ROW_BLOCKS
from .common import block_size_for, grid_of
from .dropout import M64, GOLDEN, HashedKeep
from .products import PRODUCTS
from .registry import CTYPES, NAME_EXPRESSIONS, OPTIONS, SOURCE


class CupyOps(Ops):
    """The fast path's memory-bound operations as fused CuPy kernels (see :mod:`attn.fast.gpu.kernels`),
    with the matrix products at this object's precision in a component, :attr:`products`
    (:mod:`.products`). A mask that is not a kernel's own goes to the NumPy-style operations of
    :class:`attn.fast.core.ops.Ops`."""

    def __init__(self, xp, precision: str = "fp32", sharing: CupyOps | None = None):
        """The kernels' module compiled for ``xp``, or, with ``sharing`` (the fp32 operations of
        the same namespace), that object's module, kernels, buffers and seeds: the objects of
        the other precisions differ from it in their :attr:`products` alone."""
        super().__init__(xp, precision, sharing)
        if sharing is not None:
            self._module, self._functions, self._scratch = sharing._module, sharing._functions, sharing._scratch
            self._draws, self._seeds = sharing._draws, sharing._seeds
        else:
            self._module = xp.RawModule(code=SOURCE, options=OPTIONS, name_expressions=NAME_EXPRESSIONS)
            self._functions: dict = {}
            self._scratch: dict = {}
            self._draws = weakref.WeakKeyDictionary()    # DeviceRNG -> dropout masks it has keyed
            self._seeds = weakref.WeakKeyDictionary()    # DeviceRNG -> its seed on the device
        #: the matrix products at :attr:`precision` (:class:`.products.Products` or a subclass)
        self.products = PRODUCTS[self.precision](self, self._scratch)
        if self.precision == "bf16":                      # what the model's forward calls, where it exists
            self.prepare_weights = self.products.prepare_weights

    def mm(self, a, b, out=None, accumulate: bool = False):
        """``a @ b`` by cuBLAS at :attr:`precision`: :meth:`.products.Products.mm`."""
        return self.products.mm(a, b, out, accumulate)

    def bmm(self, a, b, out=None):
        """``a @ b`` batched by cuBLAS at :attr:`precision`: :meth:`.products.Products.bmm`."""
        return self.products.bmm(a, b, out)

    def function(self, name: str):
        """The module's function of the full name ``name`` (``flash_fwd<float, 64>``), looked up."""
        return self._module.get_function(name)

    def kernel(self, name, dtype):
        """The kernel ``name<T>`` for ``dtype``, looked up in the module once (a lookup is a
        string formatting and a driver call: microseconds at every launch otherwise)."""
        key = (name, dtype)                      # not str(dtype): that costs microseconds per call
        f = self._functions.get(key)
        if f is None:
            f = self._functions[key] = self.function(f"{name}<{CTYPES[str(dtype)]}>")
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
        """A grid-stride kernel over ``n`` elements (its last argument)."""
        self._stride(name, dtype, n, (*args, B.host.int64(n)))

    def _stride(self, name, dtype, n, args):
        """A grid-stride kernel over ``n`` elements, in blocks of 256 threads."""
        self.kernel(name, dtype)(grid_of(n, 256), (256,), args)

    def _rows(self, name, dtype, N, D, args, most: int = 256):
        """A kernel of one block per row of ``D`` values (a power-of-two block, at most ``most``
        threads, and its tree reduction's shared memory)."""
        threads = block_size_for(D, most)
        self.kernel(name, dtype)((N,), (threads,), args, shared_mem=threads * dtype.itemsize)

    # ---- softmax (keys first)

    def softmax0_(self, s, bias=None, row_scale=None, scale: float = 1.0):
        """As :meth:`attn.fast.core.ops.Ops.softmax0_` for s (Tk, B, H, Tq) contiguous, ``scale`` applied in
        the kernel; ``row_scale`` is not needed: a query with no allowed key is detected there."""
        cp = self.xp
        if bias is None:
            bias = cp.zeros((1, 1, 1, 1), dtype=s.dtype)
        if s.ndim != 4 or not s.flags.c_contiguous:
            raise ValueError("CupyOps.softmax0_: s must be a contiguous (Tk, B, H, Tq) array")
        Tk, Bsz, H, Tq = s.shape
        b4 = cp.broadcast_to(bias, s.shape)                 # a view: strides 0 where broadcast
        sk, sb, sh, sq = (st // b4.dtype.itemsize for st in b4.strides)
        M = Bsz * H * Tq
        i64 = B.host.int64
        self.kernel("softmax0_fwd", s.dtype)(
            (-(-M // 256),), (256,), (s, b4, self.scalar(scale, s.dtype), B.host.int32(Tk), i64(M),
                                      B.host.int32(H), B.host.int32(Tq), i64(sk), i64(sb), i64(sh), i64(sq)))
        return s

    def softmax0_backward_(self, dy, y, scale: float = 1.0):
        self.check_contiguous("softmax0_backward_", dy=dy, y=y)
        Tk = dy.shape[0]
        M = dy.size // Tk
        self.kernel("softmax0_bwd", dy.dtype)((-(-M // 256),), (256,), (dy, y, self.scalar(scale, dy.dtype),
                                                                      B.host.int32(Tk), B.host.int64(M)))
        return dy

    # ---- layer norm

    def layer_norm_(self, x, gamma, beta, eps: float):
        cp = self.xp
        N, D = x.shape
        self.check_contiguous("layer_norm_", x=x)
        out = cp.empty_like(x)
        rstd = cp.empty((N,), dtype=x.dtype)
        self._rows("layer_norm_fwd", x.dtype, N, D, (x, out, rstd, cp.ascontiguousarray(gamma),
                                                     cp.ascontiguousarray(beta), B.host.int32(D),
                                                     self.scalar(eps, x.dtype)))
        return out, rstd

    def residual_layer_norm_(self, s, bias, m, x, gamma, beta, eps: float):
        """As :meth:`attn.fast.core.ops.Ops.residual_layer_norm_`, in one ``residual_ln_fwd`` launch where
        the mask is this class's own (a :class:`HashedKeep`) or there is none."""
        if not self.fused_mask(m, s.shape, "residual_layer_norm_"):
            return super().residual_layer_norm_(s, bias, m, x, gamma, beta, eps)
        cp = self.xp
        N, D = s.shape
        self.check_contiguous("residual_layer_norm_", s=s, x=x)
        out = cp.empty_like(s)
        rstd = cp.empty((N,), dtype=s.dtype)
        self._rows("residual_ln_fwd", s.dtype, N, D,
                   (s, cp.ascontiguousarray(bias), x, out, rstd, cp.ascontiguousarray(gamma),
                    cp.ascontiguousarray(beta), *self.dropout_args(m, s.dtype), B.host.int32(D),
                    self.scalar(eps, s.dtype)))
        return out, rstd

    def layer_norm_backward_(self, dout, xhat, rstd, gamma, out=None):
        """As :meth:`attn.fast.core.ops.Ops.layer_norm_backward_`: dgamma and dbeta by one ``column_sums``
        launch (into ``out``, (2, D), before ``dout`` is overwritten), then dx by one ``layer_norm_bwd``."""
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
        name = "layer_norm_bwd" if m is None else "layer_norm_bwd_drop"
        self._rows(name, dout.dtype, N, D, (*args, B.host.int32(D)))
        return dout, out, ds

    # ---- the later block's (lesson 26): RMSNorm, rotary positions, SwiGLU's gate

    def _rms(self, s, bias, m, x, gamma, eps, residual: bool):
        cp = self.xp
        N, D = s.shape
        self.check_contiguous("rms_norm_", s=s, **({"x": x} if residual else {}))
        out = cp.empty_like(s)
        rstd = cp.empty((N,), dtype=s.dtype)
        self._rows("rms_norm_fwd", s.dtype, N, D,
                   (s, s if bias is None else cp.ascontiguousarray(bias), s if x is None else x, out, rstd,
                    cp.ascontiguousarray(gamma), *self.dropout_args(m, s.dtype), B.host.int32(D),
                    self.scalar(eps, s.dtype), B.host.int32(residual), B.host.int32(bias is not None)))
        return out, rstd

    def rms_norm_(self, x, gamma, eps: float):
        """As :meth:`attn.fast.core.ops.Ops.rms_norm_`: one ``rms_norm_fwd`` launch."""
        return self._rms(x, None, None, None, gamma, eps, False)

    def residual_rms_norm_(self, s, bias, m, x, gamma, eps: float):
        """As :meth:`attn.fast.core.ops.Ops.residual_rms_norm_`: one ``rms_norm_fwd`` launch."""
        if not self.fused_mask(m, s.shape, "residual_rms_norm_"):
            return super().residual_rms_norm_(s, bias, m, x, gamma, eps)
        return self._rms(s, bias, m, x, gamma, eps, True)

    def _rms_bwd(self, dout, xhat, rstd, gamma, m, out, where):
        cp = self.xp
        N, D = dout.shape
        self.check_contiguous(where, dout=dout, xhat=xhat)
        out = cp.empty((1, D), dtype=dout.dtype) if out is None else out
        sums = self.buffer("rms_column_sums", 2 * D, dout.dtype)          # sum(dout * xhat), sum(dout)
        self.column_sums(dout, xhat, sums, where)
        out[0] = sums[:D]
        ds = dout if m is None else cp.empty_like(dout)
        self._rows("rms_norm_bwd", dout.dtype, N, D, (dout, xhat, rstd, cp.ascontiguousarray(gamma), ds,
                                                      *self.dropout_args(m, dout.dtype), B.host.int32(D)))
        return dout, out[0], ds

    def rms_norm_backward_(self, dout, xhat, rstd, gamma, out=None):
        """As :meth:`attn.fast.core.ops.Ops.rms_norm_backward_`: dgamma by one ``column_sums`` launch, then
        dx by one ``rms_norm_bwd``."""
        return self._rms_bwd(dout, xhat, rstd, gamma, None, out, "rms_norm_backward_")[:2]

    def rms_norm_backward_dropout_(self, dout, xhat, rstd, gamma, m, out=None):
        """As :meth:`attn.fast.core.ops.Ops.rms_norm_backward_dropout_`, drop(dy) written by the
        ``rms_norm_bwd`` launch (the mask regenerated from its counter)."""
        if not self.fused_mask(m, dout.shape, "rms_norm_backward_dropout_"):
            return super().rms_norm_backward_dropout_(dout, xhat, rstd, gamma, m, out)
        dy, _, ds = self._rms_bwd(dout, xhat, rstd, gamma, m, out, "rms_norm_backward_dropout_")
        return dy, ds

    def rope_(self, x, cos, sin, inverse: bool = False):
        """As :meth:`attn.fast.core.ops.Ops.rope_`: one ``rope_rotate`` launch on the view as it lies
        (x (B, H, T, Dh), its last axis contiguous; cos and sin (T, Dh/2) contiguous)."""
        Bsz, H, T, Dh = x.shape
        item = x.dtype.itemsize
        if x.strides[3] != item or not (cos.flags.c_contiguous and sin.flags.c_contiguous):
            raise ValueError(f"CupyOps.rope_: x's last axis and cos, sin must be contiguous, got x strides "
                             f"{x.strides}")
        sb, sh, st = (s // item for s in x.strides[:3])
        n = Bsz * H * T * (Dh // 2)
        if n:
            i32, i64 = B.host.int32, B.host.int64
            self._stride("rope_rotate", x.dtype, n, (x, cos, sin, i32(H), i32(T), i32(Dh // 2), i64(sb),
                                                     i64(sh), i64(st), i32(inverse), i64(n)))
        return x

    def swiglu_gate(self, ab, m: Mask | None = None):
        """As :meth:`attn.fast.core.ops.Ops.swiglu_gate`: one ``swiglu_fwd`` launch."""
        N, F2 = ab.shape
        if not self.fused_mask(m, (N, F2 // 2), "swiglu_gate"):
            return super().swiglu_gate(ab, m)
        self.check_contiguous("swiglu_gate", ab=ab)
        h = self.xp.empty((N, F2 // 2), dtype=ab.dtype)
        self._stride("swiglu_fwd", ab.dtype, h.size, (ab, h, *self.dropout_args(m, ab.dtype),
                                                      B.host.int64(h.size), B.host.int32(F2 // 2)))
        return h

    def swiglu_gate_backward(self, dh, ab, m: Mask | None = None):
        """As :meth:`attn.fast.core.ops.Ops.swiglu_gate_backward`: one ``swiglu_bwd`` launch."""
        if not self.fused_mask(m, dh.shape, "swiglu_gate_backward"):
            return super().swiglu_gate_backward(dh, ab, m)
        self.check_contiguous("swiglu_gate_backward", dh=dh)
        self.check_contiguous("swiglu_gate_backward", ab=ab)
        dab = self.xp.empty(ab.shape, dtype=ab.dtype)
        self._stride("swiglu_bwd", ab.dtype, dh.size, (dh, ab, dab, *self.dropout_args(m, ab.dtype),
                                                       B.host.int64(dh.size), B.host.int32(dh.shape[1])))
        return dab

    # ---- column sums (bias gradients, dgamma and dbeta)

    def colsum(self, x2, out=None):
        """(R, C) -> (C,) by one ``column_sums`` launch (into ``out`` when given)."""
        out = self.xp.empty((x2.shape[1],), dtype=x2.dtype) if out is None else out
        self.column_sums(x2, None, out, "colsum")
        return out

    def colsums(self, *pairs):
        """``colsum(x2, out=out)`` for each ``(x2, out)``, two by two in one ``column_sums``
        launch where their rows agree (a backward's two bias gradients)."""
        pairs = list(pairs)
        while pairs:
            a, out = pairs.pop(0)
            two = pairs and pairs[0][0].shape[0] == a.shape[0] and pairs[0][0].dtype == a.dtype
            self.column_sums(a, None, out, "colsums", second=pairs.pop(0) if two else None)

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
        R = max(1, min(-(-N // COLUMN_CHUNK), COLUMN_MAX_ROW_BLOCKS))
        partial = self.buffer("column_partials", R * (K * D + D1), a.dtype)
        counter, i32 = self._counters(tiles), B.host.int32
        self.kernel("column_sums", a.dtype)(
            (tiles, R), (32, 8), (a, a if b is None else b, partial, counter, out, B.host.int64(N),
                                  i32(D), i32(K), i32(COLUMN_CHUNK), a1, out1, i32(D1), i32(tiles0)))

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
        """``column_sums``' per-tile tickets (its last block of a tile sets them back to 0)."""
        return self._zeros("counters", max(n, 64), B.host.uint32)

    def _retire(self, buf):
        """Keep a replaced scratch buffer alive: a graph captured before it was replaced holds its
        address, and the pool must not hand that memory to anything else."""
        if buf is not None:
            self._scratch.setdefault("retired", []).append(buf)

    def _zeros(self, name, n, dtype):
        """Zeros made outside any step and kept, at least ``n`` (grown and replaced as :meth:`buffer`'s
        buffers are): a kernel's tickets, which its last block sets back to 0, or the seed of a fused
        kernel that drops nothing (never read)."""
        z = self._scratch.get(name)
        if z is None or z.size < n:
            self._retire(z)
            with outside_step():
                size = max(n, 0 if z is None else 2 * z.size)
                z = self._scratch[name] = self.xp.zeros((size,), dtype=dtype)
        return z

    # ---- dropout, ReLU

    #: Dropout masks from ``dropout_hash``'s counter-based generator, regenerated by the kernels that
    #: apply them (docs/GPU.md: no draw, no mask in memory). Off: ``uniform >= p`` drawn from ``rng``.
    counter_dropout: bool = True

    def dropout_mask(self, rng, shape, p: float) -> Mask:
        """With :attr:`counter_dropout`, a mask drawn by no launch: ``keep`` is a :class:`HashedKeep`
        (``rng``'s seed, the site: how many masks it has made, and where ``rng.place(shape)`` puts its rows
        in the global batch); ``p`` quantised to 1/65536 as on NumPy. Without it, ``uniform >= p``."""
        if not self.counter_dropout:
            return Mask(rng.random(shape, dtype="float32") >= p, 1.0 / (1.0 - p))
        thr = int(round(p * 65536))
        draws = self._draws.get(rng, 0)
        self._draws[rng] = draws + 1
        base, run, skip = rng.place(shape) if hasattr(rng, "place") else (0, 0, 0)
        return Mask(HashedKeep(self._seed_of(rng), draws, (base * GOLDEN) & M64, thr, tuple(shape), run, skip),
                    65536.0 / (65536 - thr))           # counter i -> base + i

    def _seed_of(self, rng):
        """``rng``'s seed on the device: ``rng.device_seed`` where it has one (a captured step's buffer),
        else a one-element array made once per ``rng``: from the slab for the step it is first met in,
        or kept for good (outside the step's memory) when it is met again in another step or outside one."""
        seed = getattr(rng, "device_seed", None)
        if seed is not None:
            return seed
        step, kept = step_token(), self._seeds.get(rng)
        if kept is not None and (kept[0] is None or kept[0] == step):
            return kept[1]
        host = B.host.array([rng.seed & M64], dtype=B.host.uint64)
        if step is None or kept is not None:
            with outside_step():
                self._seeds[rng] = (None, self.xp.asarray(host))
        else:
            self._seeds[rng] = (step, self.xp.asarray(host))
        return self._seeds[rng][1]

    def dropout_args(self, m, dtype):
        """(seed, site, offset, thr, scale in ``dtype``) of mask ``m`` (None: no dropout), the
        fused kernels' dropout arguments."""
        if m is None:
            u64 = B.host.uint64
            return self._zeros("no_seed", 1, u64), u64(0), u64(0), B.host.uint32(0), self.scalar(1.0, dtype)
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
        if m.keep.skip:                                   # the fused kernels read the flat index row * D + j
            raise ValueError(f"CupyOps.{where}: the mask of shape {m.keep.shape} lies in runs of {m.keep.run} "
                             "elements in the global batch; the fused kernels take a row-major one (B*T, D)")
        return True

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
        """As :meth:`attn.fast.core.ops.Ops.bias_relu_dropout_`: one ``bias_relu_drop`` launch."""
        if not self.fused_mask(m, a.shape, "bias_relu_dropout_"):
            return super().bias_relu_dropout_(a, bias, m)
        if not a.flags.c_contiguous or a.ndim != 2:
            raise ValueError(f"CupyOps.bias_relu_dropout_: a must be a contiguous (N, F) array, got shape "
                             f"{tuple(a.shape)} strides {a.strides}")
        self._stride("bias_relu_drop", a.dtype, a.size, (a, self.xp.ascontiguousarray(bias),
                                                         *self.dropout_args(m, a.dtype), B.host.int64(a.size),
                                                         B.host.int32(a.shape[1])))
        return a

    def relu_backward_(self, da, a):
        self.check_contiguous("relu_backward_", da=da, a=a)
        self._elementwise("relu_bwd", da.dtype, da.size, da, a)
        return da

    # ---- loss

    def cross_entropy_(self, x, y, valid, n, smoothing: float):
        cp = self.xp
        N, V = x.shape
        self.check_contiguous("cross_entropy_", x=x)
        w = valid.astype(x.dtype) / n
        loss_rows = cp.empty((N,), dtype=x.dtype)
        args = (x, cp.ascontiguousarray(y.astype(cp.int64)), w, loss_rows, B.host.int32(V),
                self.scalar(smoothing, x.dtype))
        self._rows("cross_entropy_fwd_bwd", x.dtype, N, V, args, 512)
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
        """Adam over flat arrays (the whole arena) in one ``adam_flat`` launch; with ``max_norm > 0`` the
        gradient's norm first by one ``sumsq_partial`` launch, the clipping decided on the device. ``g``
        is not written; ``count`` (one int64 on the device) is the steps taken, read and advanced by the
        kernel; ``schedule`` = ``(lr_factor, fixed_lr or None, d_model, warmup_steps, b1, b2, eps)``."""
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
            (p, m, v, g, partial, B.host.int32(n_partial), f64(max_norm), count,
             self._zeros("adam_ticket", 1, B.host.uint32),
             f64(lr_factor), f64(0.0 if fixed_lr is None else fixed_lr), B.host.int32(fixed_lr is not None),
             f64(d_model), f64(warmup), f64(b1), f64(b2), f64(eps), B.host.int64(n)), shared_mem=threads * 8)

    # ---- the products' precision (attn.precision)

    def round_bf16_(self, src, dst):
        """dst (uint16, src's size) <- the bfloat16 patterns nearest to src (float32) in one ``round_bf16``
        launch (:func:`attn.precision.bf16_bits`' rounding): the weights' copy bf16 products read."""
        if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.size != dst.size \
                or dst.dtype != B.host.uint16:
            raise ValueError(f"CupyOps.round_bf16_: contiguous src and a uint16 dst of its size are needed, got "
                             f"{tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
        self._elementwise("round_bf16", src.dtype, src.size, src, dst)
        return dst

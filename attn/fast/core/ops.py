"""The memory-bound operations of a step (softmax, the norms, dropout, ReLU, the loss, Adam, the
embedding scatter-add) in in-place ufuncs, so that they run on NumPy and CuPy alike: :class:`Ops`,
which the CuPy kernels subclass (:func:`attn.fast.core.dispatch.ops_for` picks one)."""
from __future__ import annotations

from typing import NamedTuple

from ... import backend as B
from ...precision import check as check_precision
from ...precision import round_to
from ..gpu.stepmem import outside_step

class Mask(NamedTuple):
    """A dropout mask: ``keep`` (bool, True where the unit survives) and the scale of
    the kept units, ``1 / P(keep)``."""
    keep: object
    scale: float


class Ops:
    """The memory-bound operations on namespace ``xp``. Every method that ends in ``_``
    overwrites its first argument and returns it."""

    def __init__(self, xp, precision: str = "fp32", sharing: Ops | None = None):
        """``precision``: what the products read (:mod:`attn.precision`: ``fp32``, ``tf32`` or
        ``bf16``; sums and results are float32 in every mode); ``sharing``: an object of the
        same namespace whose kept vectors this one uses."""
        self.xp = xp
        self.precision = check_precision(precision)
        self._ones = {} if sharing is None else sharing._ones

    def ones(self, n: int, dtype):
        return self._kept(1, n, dtype)

    def zeros(self, n: int, dtype):
        """The output bias of a sub-layer that has none, for a fused epilogue that adds one."""
        return self._kept(0, n, dtype)

    def _kept(self, fill, n: int, dtype):
        key = (fill, n, dtype)                   # not str(dtype): that costs microseconds per call
        if key not in self._ones:
            with outside_step():                 # kept between steps: never from a step's memory
                self._ones[key] = self.xp.full(n, fill, dtype=dtype)
        return self._ones[key]

    # ---- the matrix products of a step

    def mm(self, a, b, out=None, accumulate: bool = False):
        """``a @ b`` for matrices a (M, K) and b (K, N), possibly views, into ``out`` (M, N) when
        given; with ``accumulate``, ``out += a @ b`` (on CuPy cuBLAS's beta = 1)."""
        if not accumulate:
            return self.bmm(a, b, out)
        if out is None:
            raise ValueError("mm: accumulate=True needs out, the array the product is added to")
        out += self.bmm(a, b)
        return out

    def bmm(self, a, b, out=None):
        """``a @ b`` batched over at most two leading dimensions (an attention's (B, H)); the
        operands and ``out`` may be strided views. At a precision other than fp32 both operands
        are rounded first, as the tensor cores read them."""
        if self.precision != "fp32":
            a, b = round_to(a, self.precision), round_to(b, self.precision)
        return self.xp.matmul(a, b, out=out)

    def rowsum(self, x2):
        """(R, C) -> (R,): a matrix-vector product, one BLAS call."""
        return x2 @ self.ones(x2.shape[1], x2.dtype)

    def colsum(self, x2, out=None):
        """(R, C) -> (C,), into ``out`` when given (a gradient's place in the arena)."""
        return self.xp.matmul(self.ones(x2.shape[0], x2.dtype), x2, out=out)

    def colsums(self, *pairs):
        """``colsum(x2, out=out)`` for each ``(x2, out)`` pair (on CuPy two in one launch)."""
        for x2, out in pairs:
            self.colsum(x2, out=out)

    # ---- softmax over the FIRST axis, in place

    def softmax0_(self, s, bias=None, row_scale=None, scale: float = 1.0):
        """``s`` (K, ...) logits -> ``softmax(scale * s + bias)`` over axis 0, in place.

        The attention keeps its scores as (Tk, B, H, Tq), keys first, so that every
        reduction here runs over whole contiguous rows of B*H*Tq numbers (a reduction
        over a short last axis costs NumPy a loop call per row). ``bias`` and ``row_scale``
        are :func:`attn.fast.core.attention.mask_bias`'s: masked entries come out exactly 0
        (``exp`` underflows), a query with no key at all a column of zeros."""
        xp = self.xp
        if scale != 1.0:
            s *= s.dtype.type(scale)
        if bias is not None:
            s += bias
        s -= s.max(axis=0)
        xp.exp(s, out=s)
        r = s.sum(axis=0)
        xp.reciprocal(r, out=r)
        if row_scale is not None:
            r *= row_scale[0]
        s *= r
        return s

    def softmax0_backward_(self, dy, y, scale: float = 1.0):
        """Forward was ``y = softmax(scale * x)`` over axis 0, so
        ``dx = scale * y * (dy - sum_0(dy * y))``; in place on ``dy``."""
        t = dy * y
        dy -= t.sum(axis=0)
        if scale != 1.0:
            self.xp.multiply(y, y.dtype.type(scale), out=t)
            dy *= t
        else:
            dy *= y
        return dy

    # ---- layer norm and RMSNorm (lesson 26) over the last axis of (N, D), in place

    def layer_norm_(self, x, gamma, beta, eps: float):
        """``x`` (N, D) becomes ``xhat = (x - mean) * rstd``. Returns out (N, D) new, rstd (N,)."""
        mean = self.rowsum(x)
        mean *= 1.0 / x.shape[1]
        x -= mean[:, None]
        rstd = self._scale_rows_(x, self.xp.einsum("ij,ij->i", x, x), eps)
        out = x * gamma
        out += beta
        return out, rstd

    def residual_layer_norm_(self, s, bias, m, x, gamma, beta, eps: float):
        """Post-norm's epilogue of a sub-layer whose output ``s`` (N, D) lacks its bias:
        ``LN(drop(s + bias) + x)``, with ``m`` the dropout :class:`Mask` (None: none). ``s``
        becomes xhat; returns out (N, D) new, rstd (N,)."""
        return self.layer_norm_(self._residual_(s, bias, m, x), gamma, beta, eps)

    def _residual_(self, s, bias, m, x):
        """``s = drop(s + bias) + x`` in place (``bias``, ``m`` None: none)."""
        if bias is not None:
            s += bias
        if m is not None:
            self.dropout_(s, m)
        s += x
        return s

    def layer_norm_backward_dropout_(self, dout, xhat, rstd, gamma, m, out=None):
        """Post-norm's backward through ``LN(x + drop(s))``: ``dout`` becomes dy (the norm's
        input gradient, in place; dgamma and dbeta into ``out``), and ``ds = drop(dy)`` with
        the forward's mask ``m`` (None: ``ds`` is dy). Returns dy, ds."""
        dy, _, _ = self.layer_norm_backward_(dout, xhat, rstd, gamma, out=out)
        return dy, (dy if m is None else self.dropout_backward(dy, m))

    def layer_norm_backward_(self, dout, xhat, rstd, gamma, out=None):
        """Forward was ``out = gamma * xhat + beta``, so with ``g = dout * gamma``:
        ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``; in place on ``dout``.
        Returns dx (= dout), dgamma, dbeta: the rows of ``out`` (2, D) when given (their
        place in the arena), else of a new array."""
        xp = self.xp
        D = dout.shape[1]
        out = xp.empty((2, D), dtype=dout.dtype) if out is None else out
        dgamma, dbeta = out[0], out[1]
        self.colsum(dout, out=dbeta)
        t = dout * xhat
        self.colsum(t, out=dgamma)
        b = t @ gamma                       # (N,) D * mean(g * xhat)
        a = dout @ gamma                    # (N,) D * mean(g)
        b *= 1.0 / D
        a *= 1.0 / D
        xp.multiply(xhat, b[:, None], out=t)
        dout *= gamma
        dout -= t
        dout -= a[:, None]
        dout *= rstd[:, None]
        return dout, dgamma, dbeta

    def rms_norm_(self, x, gamma, eps: float):
        """``x`` (N, D) becomes ``xhat = x * rstd`` with ``rstd = 1/sqrt(mean(x^2) + eps)``.
        Returns out = gamma * xhat (N, D) new, rstd (N,)."""
        sumsq = self.xp.square(x).sum(axis=1)     # not einsum: on CuPy cuBLAS, which a graph capture refuses
        rstd = self._scale_rows_(x, sumsq, eps)
        return x * gamma, rstd

    def _scale_rows_(self, x, sumsq, eps: float):
        """``x *= rstd``, ``rstd = 1/sqrt(sumsq / D + eps)`` (N,) made in sumsq's buffer. Returns rstd."""
        sumsq *= 1.0 / x.shape[1]
        sumsq += eps
        rstd = self.xp.sqrt(sumsq, out=sumsq)
        self.xp.reciprocal(rstd, out=rstd)
        x *= rstd[:, None]
        return rstd

    def residual_rms_norm_(self, s, bias, m, x, gamma, eps: float):
        """:meth:`residual_layer_norm_` with RMSNorm, ``bias`` None for a sub-layer without one."""
        return self.rms_norm_(self._residual_(s, bias, m, x), gamma, eps)

    def rms_norm_backward_(self, dout, xhat, rstd, gamma, out=None):
        """Forward was ``out = gamma * xhat``, so with ``g = dout * gamma``:
        ``dx = rstd * (g - xhat * mean(g * xhat))`` (layer norm's without its ``mean(g)``); in
        place on ``dout``. Returns dx (= dout), dgamma: the row of ``out`` (1, D) when given."""
        xp = self.xp
        D = dout.shape[1]
        out = xp.empty((1, D), dtype=dout.dtype) if out is None else out
        t = dout * xhat
        self.colsum(t, out=out[0])
        t *= gamma
        b = t.sum(axis=1)                   # (N,) D * mean(g * xhat); not a product: a graph capture takes it
        b *= 1.0 / D
        xp.multiply(xhat, b[:, None], out=t)
        dout *= gamma
        dout -= t
        dout *= rstd[:, None]
        return dout, out[0]

    def rms_norm_backward_dropout_(self, dout, xhat, rstd, gamma, m, out=None):
        """:meth:`layer_norm_backward_dropout_` with RMSNorm. Returns dy, ds."""
        dy, _ = self.rms_norm_backward_(dout, xhat, rstd, gamma, out=out)
        return dy, (dy if m is None else self.dropout_backward(dy, m))

    # ---- rotary positions and SwiGLU's gate (lesson 26)

    def rope_(self, x, cos, sin, inverse: bool = False):
        """Turn each pair ``(x_i, x_{i+Dh/2})`` of x (B, H, T, Dh) (a strided view) by its
        position's angle, in place: cos, sin (T, Dh/2) as :func:`attn.layers.rope.rope_angles`
        gives them. ``inverse``: turned back (the backward). Returns x."""
        h = x.shape[-1] // 2
        xa, xb = x[..., :h], x[..., h:]
        s = -sin if inverse else sin
        a = xa * cos
        a -= xb * s
        xb *= cos
        xb += xa * s
        xa[...] = a
        return x

    def _sigmoid(self, a):
        """A new ``sigmoid(a)``, as :func:`attn.layers.swiglu.silu` computes it."""
        h = self.xp.tanh(a * a.dtype.type(0.5))
        h += 1
        h *= a.dtype.type(0.5)
        return h

    def swiglu_gate(self, ab, m=None):
        """``ab`` (N, 2F) = ``[x W | x V]`` -> a new (N, F): ``drop(silu(x W) * x V)`` with the
        dropout :class:`Mask` ``m`` (None: none)."""
        F = ab.shape[1] // 2
        a, b = ab[:, :F], ab[:, F:]
        h = self._sigmoid(a)
        h *= a
        h *= b
        if m is not None:
            self.dropout_(h, m)
        return h

    def swiglu_gate_backward(self, dh, ab, m=None):
        """Backward of :meth:`swiglu_gate`: a new (N, 2F) ``[da | db]`` with ``db = dh' silu(a)``,
        ``da = dh' b s (1 + a (1 - s))``, ``s = sigmoid(a)``, ``dh'`` = dh through the dropout."""
        xp = self.xp
        F = ab.shape[1] // 2
        a, b = ab[:, :F], ab[:, F:]
        if m is not None:
            dh = self.dropout_backward(dh, m)
        dab = xp.empty(ab.shape, dtype=ab.dtype)
        da, db = dab[:, :F], dab[:, F:]
        s = self._sigmoid(a)
        xp.multiply(a, s, out=db)
        db *= dh                                # dh * silu(a)
        xp.subtract(1, s, out=da)
        da *= a
        da += 1
        da *= s
        da *= b
        da *= dh
        return dab

    # ---- dropout, ReLU

    def dropout_mask(self, rng, shape, p: float) -> Mask:
        """Keep each unit with probability ``1 - p`` (``p`` quantised to 1/65536)."""
        thr = int(round(p * 65536))
        keep = rng.random_uint16(shape) >= thr
        return Mask(keep, 65536.0 / (65536 - thr))

    def dropout_(self, x, m: Mask):
        x *= m.keep
        x *= x.dtype.type(m.scale)
        return x

    def dropout_backward(self, d, m: Mask):
        """A new array ``d * keep * scale``."""
        out = self.xp.multiply(d, m.keep)
        out *= out.dtype.type(m.scale)
        return out

    def bias_relu_dropout_(self, a, bias, m):
        """The feed-forward's hidden epilogue: ``a = drop(max(a + bias, 0))`` with the dropout
        :class:`Mask` ``m`` (None: none)."""
        a += bias
        self.relu_(a)
        if m is not None:
            self.dropout_(a, m)
        return a

    def relu_(self, h):
        return self.xp.maximum(h, 0, out=h)

    def relu_backward_(self, da, a):
        """Forward was ``a = max(h, 0)`` (then perhaps dropout, which keeps a >= 0 and
        zeroes exactly where it dropped), so ``dh = da * (a > 0)``; in place on ``da``."""
        return self.xp.multiply(da, a > 0, out=da)

    def scatter_rows_(self, target, ids, rows):
        """``target[ids[i]] += rows[i]`` accumulating repeats. target (V, D), ids (N,), rows (N, D)."""
        xp = self.xp
        if B.is_device_array(target):
            B.scatter_add(target, ids, rows)
            return target
        D = target.shape[1]
        idx_t = xp.int32 if target.size < 2 ** 31 else xp.int64
        flat = ids.astype(idx_t)[:, None] * idx_t(D) + xp.arange(D, dtype=idx_t)
        xp.add.at(target.reshape(-1), flat.reshape(-1), rows.reshape(-1))
        return target

    def adam_(self, p, g, m, v, consts, scratch):
        """One parameter's update in place (see :class:`FastAdam`), or a slice of the arena's;
        ``scratch`` is a buffer of p's shape."""
        xp = self.xp
        one_m_b1, b2, one_m_b2, eps_c, step = consts
        dt = p.dtype.type
        t = scratch
        xp.subtract(g, m, out=t)
        t *= dt(one_m_b1)
        m += t
        xp.multiply(g, g, out=t)
        t *= dt(one_m_b2)
        v *= dt(b2)
        v += t
        xp.sqrt(v, out=t)
        t += dt(eps_c)
        xp.divide(m, t, out=t)
        t *= dt(step)
        p -= t

    # ---- label-smoothed cross-entropy, in place on the logits

    #: Bytes of logits the loss works on at a time: a few rows of a large vocabulary, so that
    #: its passes over a block (max, shift, exp, sums, scale) run in cache and the (N, V)
    #: buffer is read from memory once and written once, whatever V is.
    CE_BLOCK_BYTES = 1 << 19

    def cross_entropy_(self, x, y, valid, n, smoothing: float):
        """x (N, V) logits -> dlogits in place; y (N,) targets; valid (N,) bool; n the number
        of real tokens (0-d, >= 1). Returns the loss (0-d). See :func:`attn.fast.cross_entropy`.

        Per block of :attr:`CE_BLOCK_BYTES`
        ``x -= max; mean = sum(x) / V; x = exp(x); se = sum(x); x *= w / se; x -= w eps / V``
        (``w`` = 1/n on real tokens, 0 on padding), and at the end the target's entry of each
        row gets ``- w (1 - eps)``."""
        xp = self.xp
        N, V = x.shape
        dt = x.dtype.type
        rows = xp.arange(N)
        x_y = x[rows, y]                                  # (N,) logit of the target, before any write
        w = valid.astype(x.dtype) / n                     # (N,) 1/n on real tokens, 0 on padding
        c = w * dt(smoothing / V)                         # (N,) the smoothing's share of each row
        mx, mean_x, se = (xp.empty((N,), dtype=x.dtype) for _ in range(3))   # (N,) max, mean, sum of exp
        nb = max(1, self.CE_BLOCK_BYTES // (V * x.itemsize))
        for a in range(0, N, nb):
            b = min(N, a + nb)
            xb = x[a:b]                                   # (nb, V), contiguous
            xp.max(xb, axis=1, out=mx[a:b])
            xb -= mx[a:b, None]
            xp.matmul(xb, self.ones(V, x.dtype), out=mean_x[a:b])
            xp.exp(xb, out=xb)
            xp.matmul(xb, self.ones(V, x.dtype), out=se[a:b])
            # dlogits = (softmax - q) / n on real tokens, q = (1 - eps) onehot + eps / V
            xb *= (w[a:b] / se[a:b])[:, None]
            if smoothing:
                xb -= c[a:b, None]
        x[rows, y] -= w * dt(1.0 - smoothing)
        mean_x *= 1.0 / V
        lse = xp.log(se)
        x_y -= mx
        per_tok = dt(1.0 - smoothing) * (x_y - lse) + dt(smoothing) * (mean_x - lse)
        return -(per_tok @ w)

"""Fused CuPy kernels for the memory-bound parts of the fast training step.

:class:`CupyOps` is what :func:`attn.fast.ops_for` returns for CuPy arrays: the same
methods as the NumPy ``_Ops`` (which they are tested against in ``tests/test_fast.py``),
each one kernel launch (or two) instead of a chain of elementwise operations:

=====================  =====================================================================
softmax0_              keys-first masked softmax: one thread per (batch, head, query) column,
                       three loops over the keys (max, exp and sum, scale); a query with no
                       key gets zeros
softmax0_backward_     one thread per column: ``dx = y * (dy - sum(dy * y))``
layer_norm_            one block per row: mean and variance by a shared-memory tree sum,
                       then ``xhat`` (in place) and ``gamma * xhat + beta``
layer_norm_backward_   dgamma, dbeta by column reductions (before ``dout`` is overwritten),
                       then one block per row for ``dx``
cross_entropy_         one block per row: max, sum of exp, then ``dlogits`` in place; the
                       per-row losses are summed on the device
dropout_mask / _       ``uniform >= p`` (exact p, no quantisation), ``x * keep * scale``
relu_backward_         ``da * (a > 0)``
adam_                  the whole Adam update of one parameter in one kernel
=====================  =====================================================================

Nothing here synchronises with the host; the loss stays a 0-d device array.

These kernels are written to be obviously correct rather than fast (no vectorised loads,
no warp-level tricks, power-of-two blocks with a textbook tree reduction). They have
**not been run on GPU hardware** in this repository's CI: the machine it was written on
has no GPU. ``tests/test_fast.py`` checks each one against the NumPy reference path and
skips cleanly where no GPU is usable.
"""
from __future__ import annotations

import math

from .. import backend as B
from .ops import Mask, _Ops

_SOURCE = r"""
// A tree sum / max over the block; blockDim.x must be a power of two and `sh` hold
// blockDim.x values. Every thread gets the result.
template <typename T>
__device__ T block_sum(T v, T* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads();
    return r;
}

template <typename T>
__device__ T block_max(T v, T* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && sh[threadIdx.x + s] > sh[threadIdx.x]) sh[threadIdx.x] = sh[threadIdx.x + s];
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads();
    return r;
}

// Keys-first softmax, in place: s is (Tk, M) with M = B*H*Tq, column m = (b, h, q).
// bias[k*sk + b*sb + h*sh + q*sq] is 0 (may attend) or the most negative finite value.
template <typename T>
__global__ void softmax0_fwd(T* s, const T* bias, int Tk, long long M, int H, int Tq,
                             long long sk, long long sb, long long shd, long long sq) {
    long long m = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    long long q = m % Tq, bh = m / Tq, h = bh % H, b = bh / H;
    long long boff = b * sb + h * shd + q * sq;
    bool any = false;
    T mx = 0;
    for (int k = 0; k < Tk; ++k) {
        T bk = bias[k * sk + boff];
        T v = s[k * M + m] + bk;
        s[k * M + m] = v;
        if (bk == T(0)) any = true;
        if (k == 0 || v > mx) mx = v;
    }
    T total = 0;
    for (int k = 0; k < Tk; ++k) {
        T e = exp(s[k * M + m] - mx);
        s[k * M + m] = e;
        total += e;
    }
    T scale = any ? T(1) / total : T(0);
    for (int k = 0; k < Tk; ++k) s[k * M + m] *= scale;
}

// dy <- y * (dy - sum_k dy * y), per column, in place.
template <typename T>
__global__ void softmax0_bwd(T* dy, const T* y, int Tk, long long M) {
    long long m = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    T t = 0;
    for (int k = 0; k < Tk; ++k) t += dy[k * M + m] * y[k * M + m];
    for (int k = 0; k < Tk; ++k) dy[k * M + m] = y[k * M + m] * (dy[k * M + m] - t);
}

// Layer norm of row blockIdx.x of x (N, D): x <- xhat, out <- gamma * xhat + beta, rstd[row].
template <typename T>
__global__ void layer_norm_fwd(T* x, T* out, T* rstd, const T* gamma, const T* beta, int D, T eps) {
    extern __shared__ unsigned char smem[];
    T* sh = reinterpret_cast<T*>(smem);
    long long row = blockIdx.x;
    T* xr = x + row * D;
    T* orow = out + row * D;
    T s = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) s += xr[j];
    T mean = block_sum(s, sh) / T(D);
    T v = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) { T c = xr[j] - mean; v += c * c; }
    T var = block_sum(v, sh) / T(D);
    T r = T(1) / sqrt(var + eps);
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        T xh = (xr[j] - mean) * r;
        xr[j] = xh;
        orow[j] = xh * gamma[j] + beta[j];
    }
    if (threadIdx.x == 0) rstd[row] = r;
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * gamma; in place on dout.
template <typename T>
__global__ void layer_norm_bwd(T* dout, const T* xhat, const T* rstd, const T* gamma, int D) {
    extern __shared__ unsigned char smem[];
    T* sh = reinterpret_cast<T*>(smem);
    long long row = blockIdx.x;
    T* dr = dout + row * D;
    const T* xr = xhat + row * D;
    T a = 0, b = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) { T g = dr[j] * gamma[j]; a += g; b += g * xr[j]; }
    a = block_sum(a, sh) / T(D);
    b = block_sum(b, sh) / T(D);
    T r = rstd[row];
    for (int j = threadIdx.x; j < D; j += blockDim.x) dr[j] = r * (dr[j] * gamma[j] - a - xr[j] * b);
}

// Label-smoothed cross-entropy of row blockIdx.x of x (N, V), in place: x <- dlogits.
// w[row] = 1/n on real tokens, 0 on padding; loss_rows[row] = w * loss of the token.
template <typename T>
__global__ void cross_entropy_fwd_bwd(T* x, const long long* y, const T* w, T* loss_rows, int V, T eps) {
    extern __shared__ unsigned char smem[];
    T* sh = reinterpret_cast<T*>(smem);
    long long row = blockIdx.x;
    T* xr = x + row * V;
    long long target = y[row];
    T x_y = xr[target];                       // read before any thread writes the row
    T mx = xr[0];
    for (int j = threadIdx.x; j < V; j += blockDim.x) if (xr[j] > mx) mx = xr[j];
    mx = block_max(mx, sh);
    T se = 0, ss = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) { T d = xr[j] - mx; se += exp(d); ss += d; }
    se = block_sum(se, sh);                   // the barriers inside also order the reads before the writes
    ss = block_sum(ss, sh);
    T lse = log(se);
    T wr = w[row];
    if (threadIdx.x == 0)
        loss_rows[row] = -wr * ((T(1) - eps) * (x_y - mx - lse) + eps * (ss / T(V) - lse));
    T off = eps / T(V);
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        T p = exp(xr[j] - mx - lse);
        xr[j] = wr * (p - off - (j == target ? T(1) - eps : T(0)));
    }
}
"""

_KERNELS = ("softmax0_fwd", "softmax0_bwd", "layer_norm_fwd", "layer_norm_bwd", "cross_entropy_fwd_bwd")
_CTYPES = {"float32": "float", "float64": "double"}


def _block(n: int, most: int = 256) -> int:
    """A power-of-two block size for rows of n elements (at least 32, at most ``most``)."""
    b = 32
    while b < most and b < n:
        b *= 2
    return b


class CupyOps(_Ops):
    """The fast path's memory-bound operations as fused CuPy kernels (see the module docstring)."""

    def __init__(self, xp):
        super().__init__(xp)
        cp = xp
        names = [f"{k}<{t}>" for k in _KERNELS for t in _CTYPES.values()]
        self._module = cp.RawModule(code=_SOURCE, options=("-std=c++14",), name_expressions=names)
        self._drop = cp.ElementwiseKernel("bool keep, T scale", "T x", "x = keep ? x * scale : T(0)",
                                          "attn_dropout")
        self._drop_back = cp.ElementwiseKernel("T d, bool keep, T scale", "T out",
                                               "out = keep ? d * scale : T(0)", "attn_dropout_back")
        self._relu_back = cp.ElementwiseKernel("T a", "T da", "da = a > T(0) ? da : T(0)", "attn_relu_back")
        self._colsum_prod = cp.ReductionKernel("T a, T b", "T y", "a * b", "a + b", "y = a", "0",
                                               "attn_colsum_prod")
        self._adam = cp.ElementwiseKernel(
            "T g, T one_m_b1, T b2, T one_m_b2, T eps_c, T step", "T p, T m, T v",
            """
            m += one_m_b1 * (g - m);
            v = b2 * v + one_m_b2 * g * g;
            p -= step * m / (sqrt(v) + eps_c);
            """, "attn_adam")

    def _fn(self, name, dtype):
        return self._module.get_function(f"{name}<{_CTYPES[str(dtype)]}>")

    @staticmethod
    def _scalar(v, dtype):
        return B.host.dtype(dtype).type(v)

    # ---- softmax (keys first)

    def softmax0_(self, s, bias=None, row_scale=None):
        """As :meth:`attn.fast.ops._Ops.softmax0_` for s (Tk, B, H, Tq) contiguous; ``bias`` is
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
        self._fn("softmax0_fwd", s.dtype)(
            ((M + threads - 1) // threads,), (threads,),
            (s, b4, B.host.int32(Tk), i64(M), B.host.int32(H), B.host.int32(Tq), i64(sk), i64(sb), i64(sh), i64(sq)))
        return s

    def softmax0_backward_(self, dy, y):
        if not (dy.flags.c_contiguous and y.flags.c_contiguous) or dy.shape != y.shape:
            raise ValueError("CupyOps.softmax0_backward_: dy and y must be contiguous and of one shape")
        Tk = dy.shape[0]
        M = dy.size // Tk
        threads = 256
        self._fn("softmax0_bwd", dy.dtype)(((M + threads - 1) // threads,), (threads,),
                                            (dy, y, B.host.int32(Tk), B.host.int64(M)))
        return dy

    # ---- layer norm

    def layer_norm_(self, x, gamma, beta, eps: float):
        cp = self.xp
        N, D = x.shape
        if not x.flags.c_contiguous:
            raise ValueError("CupyOps.layer_norm_: x must be contiguous")
        out = cp.empty_like(x)
        rstd = cp.empty((N,), dtype=x.dtype)
        threads = _block(D)
        self._fn("layer_norm_fwd", x.dtype)(
            (N,), (threads,), (x, out, rstd, cp.ascontiguousarray(gamma), cp.ascontiguousarray(beta),
                               B.host.int32(D), self._scalar(eps, x.dtype)),
            shared_mem=threads * x.dtype.itemsize)
        return out, rstd

    def layer_norm_backward_(self, dout, xhat, rstd, gamma):
        cp = self.xp
        N, D = dout.shape
        if not (dout.flags.c_contiguous and xhat.flags.c_contiguous):
            raise ValueError("CupyOps.layer_norm_backward_: dout and xhat must be contiguous")
        dgamma = self._colsum_prod(dout, xhat, axis=0)       # before dout is overwritten
        dbeta = dout.sum(axis=0)
        threads = _block(D)
        self._fn("layer_norm_bwd", dout.dtype)(
            (N,), (threads,), (dout, xhat, rstd, cp.ascontiguousarray(gamma), B.host.int32(D)),
            shared_mem=threads * dout.dtype.itemsize)
        return dout, dgamma, dbeta

    # ---- dropout, ReLU

    def dropout_mask(self, rng, shape, p: float) -> Mask:
        """Keep with probability exactly ``1 - p`` (uniform floats, as the reference draws them)."""
        keep = rng.random(shape, dtype="float32") >= p
        return Mask(keep, 1.0 / (1.0 - p))

    def dropout_(self, x, m: Mask):
        self._drop(m.keep, self._scalar(m.scale, x.dtype), x)
        return x

    def dropout_backward(self, d, m: Mask):
        return self._drop_back(d, m.keep, self._scalar(m.scale, d.dtype))

    def relu_backward_(self, da, a):
        self._relu_back(a, da)
        return da

    # ---- loss

    def cross_entropy_(self, x, y, valid, n, smoothing: float):
        cp = self.xp
        N, V = x.shape
        if not x.flags.c_contiguous:
            raise ValueError("CupyOps.cross_entropy_: x must be contiguous")
        w = valid.astype(x.dtype) / n
        loss_rows = cp.empty((N,), dtype=x.dtype)
        threads = _block(V, 512)
        self._fn("cross_entropy_fwd_bwd", x.dtype)(
            (N,), (threads,), (x, cp.ascontiguousarray(y.astype(cp.int64)), w, loss_rows,
                               B.host.int32(V), self._scalar(smoothing, x.dtype)),
            shared_mem=threads * x.dtype.itemsize)
        return loss_rows.sum()

    # ---- optimizer

    def adam_(self, p, g, m, v, consts, scratch=None):
        one_m_b1, b2, one_m_b2, eps_c, step = (self._scalar(c, p.dtype) for c in consts)
        self._adam(g, one_m_b1, b2, one_m_b2, eps_c, step, p, m, v)


def block_size_for(n: int) -> int:
    """Exposed for tests: the block size a row of ``n`` elements gets."""
    return _block(n)


assert _block(1) == 32 and _block(512) == 256 and _block(37000, 512) == 512 and math.log2(_block(100)) % 1 == 0

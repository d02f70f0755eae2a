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
layer_norm_backward_   dgamma (one thread per column), dbeta, before ``dout`` is
                       overwritten; then one block per row for ``dx``
cross_entropy_         one block per row: max, sum of exp, then ``dlogits`` in place; the
                       per-row losses are summed on the device
dropout_mask / _       ``uniform >= p`` (exact p, no quantisation), ``x * keep * scale``
relu_backward_         ``da * (a > 0)``
adam_                  the whole Adam update of one parameter in one kernel
=====================  =====================================================================

Nothing here synchronises with the host; the loss stays a 0-d device array.

Every kernel is CUDA source in this file, one ``RawModule`` in all (so that the whole of
it can be compiled by NVRTC without a GPU: ``tests/test_kernels.py`` does, for compute
capabilities 7.0, 8.0 and 9.0), and beside each kernel is its **NumPy twin**: a function
taking what the kernel takes (the launch's grid, block and shared memory, then the
arguments, the arrays as the memory the kernel's pointers point at) and computing what
the kernel computes, written as whole-array NumPy. The twin is the kernel's
specification; the test suite's CuPy stand-in (``tests/fakecupy``) runs the twins in
place of the CUDA, so the launch code below runs in CI exactly as on a GPU.

These kernels are written to be obviously correct rather than fast (no vectorised loads,
no warp-level tricks, power-of-two blocks with a textbook tree reduction). They have
**not been run on GPU hardware** in this repository's CI: the machine it was written on
has no GPU (docs/GPU.md lists what a GPU owner should run).
"""
from __future__ import annotations

import math

from .. import backend as B
from .ops import Mask, _Ops

# --------------------------------------------------------------------------- helpers


def _view(a, shape, strides):
    """What a kernel reads at ``a[i0 * strides[0] + i1 * strides[1] + ...]`` (element strides,
    from the array's first element) for the index ranges of ``shape``: a NumPy view, which
    writes go through. Raises IndexError where that would leave the array's memory (on a GPU:
    a silent out-of-bounds access)."""
    np = B.host
    shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)   # not int32 arithmetic
    it = a.itemsize
    start = a.__array_interface__["data"][0]
    lo, hi = np.lib.array_utils.byte_bounds(a)
    if all(n > 0 for n in shape):
        first = start + sum((n - 1) * s * it for n, s in zip(shape, strides) if s < 0)
        last = start + sum((n - 1) * s * it for n, s in zip(shape, strides) if s > 0) + it
        if first < lo or last > hi:
            raise IndexError(f"kernel access of shape {shape}, strides {strides} leaves the array "
                             f"(shape {a.shape}, strides {a.strides})")
    return np.lib.stride_tricks.as_strided(a, shape=shape, strides=tuple(s * it for s in strides), writeable=True)


def _check_threads(launch, n: int, what: str) -> None:
    """A one-thread-per-item kernel (no grid-stride loop) must be launched with enough threads."""
    if launch.blocks * launch.threads < n:
        raise ValueError(f"{launch.name}: {launch.blocks} x {launch.threads} threads cannot cover {n} {what}")


def _check_block_reduction(launch, itemsize: int) -> None:
    """``block_sum``/``block_max`` need a power-of-two block and blockDim.x values of shared memory."""
    t = launch.block[0]
    if t & (t - 1) or launch.threads != t:
        raise ValueError(f"{launch.name}: the block must be a power of two along x, got {launch.block}")
    if launch.shared_mem < t * itemsize:
        raise ValueError(f"{launch.name}: {launch.shared_mem} bytes of shared memory, "
                         f"the tree reduction needs {t * itemsize}")


_HELPERS = r"""
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
"""

# --------------------------------------------------------------------------- softmax

_SOFTMAX0_FWD = r"""
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
"""


def softmax0_fwd_np(launch, s, bias, Tk, M, H, Tq, sk, sb, shd, sq):
    """NumPy twin of ``softmax0_fwd``."""
    np = B.host
    _check_threads(launch, M, "columns")
    x = _view(s, (Tk, M), (M, 1))
    bias_t = _view(bias, (Tk, M // (H * Tq), H, Tq), (sk, sb, shd, sq)).reshape(Tk, M)
    x += bias_t
    allowed = (bias_t == 0).any(axis=0)
    x -= x.max(axis=0) if Tk else 0
    np.exp(x, out=x)
    total = x.sum(axis=0)
    x *= np.where(allowed, x.dtype.type(1) / np.where(allowed, total, 1), x.dtype.type(0))


_SOFTMAX0_BWD = r"""
// dy <- y * (dy - sum_k dy * y), per column, in place.
template <typename T>
__global__ void softmax0_bwd(T* dy, const T* y, int Tk, long long M) {
    long long m = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    T t = 0;
    for (int k = 0; k < Tk; ++k) t += dy[k * M + m] * y[k * M + m];
    for (int k = 0; k < Tk; ++k) dy[k * M + m] = y[k * M + m] * (dy[k * M + m] - t);
}
"""


def softmax0_bwd_np(launch, dy, y, Tk, M):
    """NumPy twin of ``softmax0_bwd``."""
    _check_threads(launch, M, "columns")
    d, w = _view(dy, (Tk, M), (M, 1)), _view(y, (Tk, M), (M, 1))
    t = (d * w).sum(axis=0)
    d -= t
    d *= w

# --------------------------------------------------------------------------- layer norm


_LAYER_NORM_FWD = r"""
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
"""


def layer_norm_fwd_np(launch, x, out, rstd, gamma, beta, D, eps):
    """NumPy twin of ``layer_norm_fwd`` (one block per row: N = the grid's size)."""
    np = B.host
    _check_block_reduction(launch, x.itemsize)
    N = launch.blocks
    xv, ov, rv = _view(x, (N, D), (D, 1)), _view(out, (N, D), (D, 1)), _view(rstd, (N,), (1,))
    g, b = _view(gamma, (D,), (1,)), _view(beta, (D,), (1,))
    dt = x.dtype.type
    mean = xv.sum(axis=1) / dt(D)
    xv -= mean[:, None]
    var = (xv * xv).sum(axis=1) / dt(D)
    r = dt(1) / np.sqrt(var + eps)
    xv *= r[:, None]
    ov[...] = xv * g + b
    rv[...] = r


_LAYER_NORM_BWD = r"""
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
"""


def layer_norm_bwd_np(launch, dout, xhat, rstd, gamma, D):
    """NumPy twin of ``layer_norm_bwd`` (one block per row)."""
    _check_block_reduction(launch, dout.itemsize)
    N = launch.blocks
    d, xh, r, gm = (_view(dout, (N, D), (D, 1)), _view(xhat, (N, D), (D, 1)), _view(rstd, (N,), (1,)),
                    _view(gamma, (D,), (1,)))
    dt = dout.dtype.type
    g = d * gm
    a = g.sum(axis=1) / dt(D)
    b = (g * xh).sum(axis=1) / dt(D)
    d[...] = r[:, None] * (g - a[:, None] - xh * b[:, None])


_COLSUM_PROD = r"""
// y[j] = sum_i a[i, j] * b[i, j] for a, b (N, D): one thread per column (layer norm's dgamma).
template <typename T>
__global__ void colsum_prod(const T* a, const T* b, T* y, long long N, int D) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    T s = 0;
    for (long long i = 0; i < N; ++i) s += a[i * D + j] * b[i * D + j];
    y[j] = s;
}
"""


def colsum_prod_np(launch, a, b, y, N, D):
    """NumPy twin of ``colsum_prod``."""
    _check_threads(launch, D, "columns")
    _view(y, (D,), (1,))[...] = (_view(a, (N, D), (D, 1)) * _view(b, (N, D), (D, 1))).sum(axis=0)

# --------------------------------------------------------------------------- loss


_CROSS_ENTROPY = r"""
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


def cross_entropy_fwd_bwd_np(launch, x, y, w, loss_rows, V, eps):
    """NumPy twin of ``cross_entropy_fwd_bwd`` (one block per row)."""
    np = B.host
    _check_block_reduction(launch, x.itemsize)
    N = launch.blocks
    xv, tv, wv, lv = (_view(x, (N, V), (V, 1)), _view(y, (N,), (1,)), _view(w, (N,), (1,)),
                      _view(loss_rows, (N,), (1,)))
    if N and (tv.min() < 0 or tv.max() >= V):
        raise IndexError(f"{launch.name}: a target outside [0, {V}) would be read out of bounds")
    dt = x.dtype.type
    rows = np.arange(N)
    x_y = xv[rows, tv]
    mx = xv.max(axis=1)
    d = xv - mx[:, None]
    se, ss = np.exp(d).sum(axis=1), d.sum(axis=1)
    lse = np.log(se)
    lv[...] = -wv * ((dt(1) - eps) * (x_y - mx - lse) + eps * (ss / dt(V) - lse))
    p = np.exp(d - lse[:, None])
    p -= eps / dt(V)
    p[rows, tv] -= dt(1) - eps
    xv[...] = wv[:, None] * p

# --------------------------------------------------------------------------- elementwise


_DROPOUT = r"""
// x <- keep ? x * scale : 0, in place (x and keep contiguous, n elements).
template <typename T>
__global__ void dropout_fwd(T* x, const bool* keep, T scale, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = keep[i] ? x[i] * scale : T(0);
}

// out <- keep ? d * scale : 0.
template <typename T>
__global__ void dropout_bwd(const T* d, const bool* keep, T scale, T* out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = keep[i] ? d[i] * scale : T(0);
}
"""


def dropout_fwd_np(launch, x, keep, scale, n):
    """NumPy twin of ``dropout_fwd``."""
    np = B.host
    xv = _view(x, (n,), (1,))
    xv[...] = np.where(_view(keep, (n,), (1,)), xv * scale, x.dtype.type(0))


def dropout_bwd_np(launch, d, keep, scale, out, n):
    """NumPy twin of ``dropout_bwd``."""
    np = B.host
    _view(out, (n,), (1,))[...] = np.where(_view(keep, (n,), (1,)), _view(d, (n,), (1,)) * scale,
                                           d.dtype.type(0))


_RELU_BWD = r"""
// da <- a > 0 ? da : 0, in place.
template <typename T>
__global__ void relu_bwd(T* da, const T* a, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        da[i] = a[i] > T(0) ? da[i] : T(0);
}
"""


def relu_bwd_np(launch, da, a, n):
    """NumPy twin of ``relu_bwd``."""
    np = B.host
    dv = _view(da, (n,), (1,))
    dv[...] = np.where(_view(a, (n,), (1,)) > 0, dv, da.dtype.type(0))


_ADAM = r"""
// One parameter's Adam update, in place on p, m, v (see attn.fast.optim.FastAdam).
template <typename T>
__global__ void adam(T* p, T* m, T* v, const T* g, T one_m_b1, T b2, T one_m_b2, T eps_c, T step, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        T gi = g[i];
        T mi = m[i] + one_m_b1 * (gi - m[i]);
        T vi = b2 * v[i] + one_m_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] -= step * mi / (sqrt(vi) + eps_c);
    }
}
"""


def adam_np(launch, p, m, v, g, one_m_b1, b2, one_m_b2, eps_c, step, n):
    """NumPy twin of ``adam``."""
    np = B.host
    pv, mv, vv, gv = (_view(a, (n,), (1,)) for a in (p, m, v, g))
    mv += one_m_b1 * (gv - mv)
    vv[...] = b2 * vv + one_m_b2 * gv * gv
    pv -= step * mv / (np.sqrt(vv) + eps_c)

# --------------------------------------------------------------------------- the module

_SOURCE = "".join([_HELPERS, _SOFTMAX0_FWD, _SOFTMAX0_BWD, _LAYER_NORM_FWD, _LAYER_NORM_BWD, _COLSUM_PROD,
                   _CROSS_ENTROPY, _DROPOUT, _RELU_BWD, _ADAM])

#: Every kernel of ``_SOURCE`` and its NumPy twin.
NUMPY_TWINS = {
    "softmax0_fwd": softmax0_fwd_np, "softmax0_bwd": softmax0_bwd_np,
    "layer_norm_fwd": layer_norm_fwd_np, "layer_norm_bwd": layer_norm_bwd_np, "colsum_prod": colsum_prod_np,
    "cross_entropy_fwd_bwd": cross_entropy_fwd_bwd_np,
    "dropout_fwd": dropout_fwd_np, "dropout_bwd": dropout_bwd_np, "relu_bwd": relu_bwd_np, "adam": adam_np,
}
_KERNELS = tuple(NUMPY_TWINS)
_CTYPES = {"float32": "float", "float64": "double"}
#: The template instantiations the module is compiled with (NVRTC's name expressions).
NAME_EXPRESSIONS = tuple(f"{k}<{t}>" for k in _KERNELS for t in _CTYPES.values())
#: Options for NVRTC.
OPTIONS = ("-std=c++14",)


def _block(n: int, most: int = 256) -> int:
    """A power-of-two block size for rows of n elements (at least 32, at most ``most``)."""
    b = 32
    while b < most and b < n:
        b *= 2
    return b


def _grid(n: int, threads: int = 256, most: int = 65535) -> tuple:
    """Blocks for a grid-stride loop over n elements."""
    return (max(1, min(most, (n + threads - 1) // threads)),)


class CupyOps(_Ops):
    """The fast path's memory-bound operations as fused CuPy kernels (see the module docstring)."""

    def __init__(self, xp):
        super().__init__(xp)
        self._module = xp.RawModule(code=_SOURCE, options=OPTIONS, name_expressions=NAME_EXPRESSIONS)
        self._functions: dict = {}

    def _fn(self, name, dtype):
        """The kernel ``name<T>`` for ``dtype``, looked up in the module once (a lookup is a
        string formatting and a driver call: microseconds at every launch otherwise)."""
        key = (name, dtype)                      # not str(dtype): that costs microseconds per call
        f = self._functions.get(key)
        if f is None:
            f = self._functions[key] = self._module.get_function(f"{name}<{_CTYPES[str(dtype)]}>")
        return f

    @staticmethod
    def _scalar(v, dtype):
        return B.host.dtype(dtype).type(v)

    @staticmethod
    def _contiguous(where, **arrays):
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
        self._fn(name, dtype)(_grid(n, threads), (threads,), (*args, B.host.int64(n)))

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
        self._contiguous("layer_norm_backward_", dout=dout, xhat=xhat)
        dgamma = cp.empty((D,), dtype=dout.dtype)                 # before dout is overwritten
        threads = 256
        self._fn("colsum_prod", dout.dtype)(((D + threads - 1) // threads,), (threads,),
                                             (dout, xhat, dgamma, B.host.int64(N), B.host.int32(D)))
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
        self._contiguous("dropout_", x=x, keep=m.keep)
        self._elementwise("dropout_fwd", x.dtype, x.size, x, m.keep, self._scalar(m.scale, x.dtype))
        return x

    def dropout_backward(self, d, m: Mask):
        self._contiguous("dropout_backward", d=d, keep=m.keep)
        out = self.xp.empty_like(d)
        self._elementwise("dropout_bwd", d.dtype, d.size, d, m.keep, self._scalar(m.scale, d.dtype), out)
        return out

    def relu_backward_(self, da, a):
        self._contiguous("relu_backward_", da=da, a=a)
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
        threads = _block(V, 512)
        self._fn("cross_entropy_fwd_bwd", x.dtype)(
            (N,), (threads,), (x, cp.ascontiguousarray(y.astype(cp.int64)), w, loss_rows,
                               B.host.int32(V), self._scalar(smoothing, x.dtype)),
            shared_mem=threads * x.dtype.itemsize)
        return loss_rows.sum()

    # ---- optimizer

    def adam_(self, p, g, m, v, consts, scratch=None):
        self._contiguous("adam_", p=p, g=g, m=m, v=v)
        one_m_b1, b2, one_m_b2, eps_c, step = (self._scalar(c, p.dtype) for c in consts)
        self._elementwise("adam", p.dtype, p.size, p, m, v, g, one_m_b1, b2, one_m_b2, eps_c, step)


def block_size_for(n: int) -> int:
    """Exposed for tests: the block size a row of ``n`` elements gets."""
    return _block(n)


assert _block(1) == 32 and _block(512) == 256 and _block(37000, 512) == 512 and math.log2(_block(100)) % 1 == 0

"""The later block's hot operations (lesson 26): RMSNorm forward (alone, or as post-norm's fused
epilogue) and backward, rotary positions applied in place to the heads of a projection's output,
and SwiGLU's gate forward and backward: CUDA source and NumPy twins."""
from __future__ import annotations

from .... import backend as B
from .common import check_block_reduction, strided_view
from .dropout import dropped_np
from .layer_norm import residual_np

RMS_NORM_FWD = r"""
// RMSNorm of row blockIdx.x of s (N, D), one block per row. With `residual`, post-norm's epilogue
// first: s <- drop(s + bias) + x (bias read where has_bias; dropout as dropout_hash over the flat
// index row * D + j, thr 0: none). Then s <- xhat = s * rstd, out <- gamma * xhat, rstd[row].
template <typename T>
__global__ void rms_norm_fwd(T* s, const T* bias, const T* x, T* out, T* rstd, const T* gamma,
                             const unsigned long long* seed, unsigned long long site, unsigned long long offset,
                             unsigned int thr, T scale, int D, T eps, int residual, int has_bias) {
    extern __shared__ unsigned char smem[];
    const unsigned long long key = thr > 0u ? dropout_key(seed, site, offset) : 0ULL;
    T* sh = reinterpret_cast<T*>(smem);
    long long row = blockIdx.x;
    T* sr = s + row * D;
    T q = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        T v = sr[j];
        if (residual) {
            if (has_bias) v += bias[j];
            if (thr > 0u) v = dropout_bits(key, row * D + j) >= thr ? v * scale : T(0);
            v += x[row * D + j];
            sr[j] = v;
        }
        q += v * v;
    }
    T r = T(1) / sqrt(block_sum(q, sh) / T(D) + eps);
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        T xh = sr[j] * r;
        sr[j] = xh;
        out[row * D + j] = xh * gamma[j];
    }
    if (threadIdx.x == 0) rstd[row] = r;
}
"""


def rms_norm_fwd_np(launch, s, bias, x, out, rstd, gamma, seed, site, offset, thr, scale, D, eps, residual,
                    has_bias):
    """NumPy twin of ``rms_norm_fwd`` (one block per row: N = the grid's size)."""
    np = B.host
    check_block_reduction(launch, s.itemsize)
    N, D = launch.blocks, int(D)
    sv = strided_view(s, (N, D), (D, 1))
    if residual:
        residual_np(sv, bias if has_bias else None, x, seed, site, offset, thr, scale)
    dt = s.dtype.type
    r = dt(1) / np.sqrt((sv * sv).sum(axis=1) / dt(D) + eps)
    sv *= r[:, None]
    strided_view(out, (N, D), (D, 1))[...] = sv * strided_view(gamma, (D,), (1,))
    strided_view(rstd, (N,), (1,))[...] = r


RMS_NORM_BWD = r"""
// RMSNorm's backward, one block per row: dx = rstd * (g - xhat * mean(g * xhat)), g = dout * gamma,
// in place on dout (layer norm's without its mean(g) term). With thr > 0 (post-norm through
// drop(s)), ds <- drop(dx) with the forward's mask regenerated over the flat index row * D + j.
template <typename T>
__global__ void rms_norm_bwd(T* dout, const T* xhat, const T* rstd, const T* gamma, T* ds,
                             const unsigned long long* seed, unsigned long long site, unsigned long long offset,
                             unsigned int thr, T scale, int D) {
    extern __shared__ unsigned char smem[];
    const unsigned long long key = thr > 0u ? dropout_key(seed, site, offset) : 0ULL;
    T* sh = reinterpret_cast<T*>(smem);
    long long row = blockIdx.x;
    T* dr = dout + row * D;
    const T* xr = xhat + row * D;
    T b = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) b += dr[j] * gamma[j] * xr[j];
    b = block_sum(b, sh) / T(D);
    T r = rstd[row];
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        T v = r * (dr[j] * gamma[j] - xr[j] * b);
        dr[j] = v;
        if (thr > 0u) ds[row * D + j] = dropout_bits(key, row * D + j) >= thr ? v * scale : T(0);
    }
}
"""


def rms_norm_bwd_np(launch, dout, xhat, rstd, gamma, ds, seed, site, offset, thr, scale, D):
    """NumPy twin of ``rms_norm_bwd`` (one block per row)."""
    check_block_reduction(launch, dout.itemsize)
    N, D = launch.blocks, int(D)
    d, xh = strided_view(dout, (N, D), (D, 1)), strided_view(xhat, (N, D), (D, 1))
    g = d * strided_view(gamma, (D,), (1,))
    b = (g * xh).sum(axis=1) / dout.dtype.type(D)
    d[...] = strided_view(rstd, (N,), (1,))[:, None] * (g - xh * b[:, None])
    if thr > 0:
        strided_view(ds, (N, D), (D, 1))[...] = dropped_np(d, seed, site, offset, thr, scale)


ROPE_ROTATE = r"""
// Rotary positions in place on heads x (B, H, T, Dh) lying at x + b * sb + h * sh + t * st + i (a
// view of a projection's output, the last axis contiguous): the pair (i, i + half) of position t
// turned by (cos, sin)[t * half + i], turned back where `inverse`. One thread per pair.
template <typename T>
__global__ void rope_rotate(T* x, const T* cos_t, const T* sin_t, int H, int Tn, int half, long long sb,
                            long long sh, long long st, int inverse, long long n) {
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < n; p += (long long)gridDim.x * blockDim.x) {
        long long i = p % half, t = (p / half) % Tn, h = (p / half / Tn) % H, b = p / half / Tn / H;
        T* xr = x + b * sb + h * sh + t * st;
        T c = cos_t[t * half + i], s = inverse ? -sin_t[t * half + i] : sin_t[t * half + i];
        T xa = xr[i], xb = xr[i + half];
        xr[i] = xa * c - xb * s;
        xr[i + half] = xa * s + xb * c;
    }
}
"""


def rope_rotate_np(launch, x, cos_t, sin_t, H, Tn, half, sb, sh, st, inverse, n):
    """NumPy twin of ``rope_rotate``."""
    H, Tn, half, n = int(H), int(Tn), int(half), int(n)
    Bsz = n // (H * Tn * half)
    c, s = strided_view(cos_t, (Tn, half), (half, 1)), strided_view(sin_t, (Tn, half), (half, 1))
    s = -s if inverse else s
    xv = strided_view(x, (Bsz, H, Tn, 2 * half), (sb, sh, st, 1))
    xa, xb = xv[..., :half], xv[..., half:]
    a, b = xa * c - xb * s, xa * s + xb * c
    xa[...], xb[...] = a, b


SWIGLU_FWD = r"""
// SwiGLU's gate: ab (N, 2F) = [x W | x V] -> h (N, F) = drop(silu(a) * b), silu(a) = a * sigmoid(a)
// with sigmoid(a) = (1 + tanh(a / 2)) / 2; dropout as dropout_hash over the flat index of h (thr 0:
// none).
template <typename T>
__global__ void swiglu_fwd(const T* ab, T* h, const unsigned long long* seed, unsigned long long site,
                           unsigned long long offset, unsigned int thr, T scale, long long n, int F) {
    const unsigned long long key = thr > 0u ? dropout_key(seed, site, offset) : 0ULL;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long row = i / F, j = i % F;
        T a = ab[row * 2 * F + j], b = ab[row * 2 * F + F + j];
        T v = a * (T(0.5) * (T(1) + tanh(T(0.5) * a))) * b;
        if (thr > 0u) v = dropout_bits(key, i) >= thr ? v * scale : T(0);
        h[i] = v;
    }
}
"""


def _silu_parts(ab, N, F):
    np = B.host
    v = strided_view(ab, (N, 2 * F), (2 * F, 1))
    a, b = v[:, :F], v[:, F:]
    s = ab.dtype.type(0.5) * (1 + np.tanh(ab.dtype.type(0.5) * a))
    return a, b, s


def swiglu_fwd_np(launch, ab, h, seed, site, offset, thr, scale, n, F):
    """NumPy twin of ``swiglu_fwd``."""
    n, F = int(n), int(F)
    a, b, s = _silu_parts(ab, n // F, F)
    v = a * s * b
    if thr > 0:
        v = dropped_np(v, seed, site, offset, thr, scale)
    strided_view(h, (n // F, F), (F, 1))[...] = v


SWIGLU_BWD = r"""
// SwiGLU's gate backward: dh (N, F) (through the forward's dropout, regenerated, where thr > 0)
// -> dab (N, 2F) = [da | db], db = dh * silu(a), da = dh * b * s * (1 + a * (1 - s)), s = sigmoid(a).
template <typename T>
__global__ void swiglu_bwd(const T* dh, const T* ab, T* dab, const unsigned long long* seed,
                           unsigned long long site, unsigned long long offset, unsigned int thr, T scale,
                           long long n, int F) {
    const unsigned long long key = thr > 0u ? dropout_key(seed, site, offset) : 0ULL;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long row = i / F, j = i % F;
        T d = dh[i];
        if (thr > 0u) d = dropout_bits(key, i) >= thr ? d * scale : T(0);
        T a = ab[row * 2 * F + j], b = ab[row * 2 * F + F + j];
        T s = T(0.5) * (T(1) + tanh(T(0.5) * a));
        dab[row * 2 * F + j] = d * b * s * (T(1) + a * (T(1) - s));
        dab[row * 2 * F + F + j] = d * a * s;
    }
}
"""


def swiglu_bwd_np(launch, dh, ab, dab, seed, site, offset, thr, scale, n, F):
    """NumPy twin of ``swiglu_bwd``."""
    n, F = int(n), int(F)
    N = n // F
    d = strided_view(dh, (N, F), (F, 1))
    if thr > 0:
        d = dropped_np(d, seed, site, offset, thr, scale)
    a, b, s = _silu_parts(ab, N, F)
    out = strided_view(dab, (N, 2 * F), (2 * F, 1))
    out[:, :F] = d * b * s * (1 + a * (1 - s))
    out[:, F:] = d * a * s

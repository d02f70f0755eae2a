"""Layer norm and its backward, and post-norm's fused epilogue (``s + bias``, dropout, ``+ x``,
layer norm) with its backward: CUDA source and NumPy twins."""
from __future__ import annotations

from .... import backend as B
from .common import check_block_reduction, strided_view
from .dropout import dropout_bits_np, dropout_key_np

LAYER_NORM_FWD = r"""
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
    normalise_row(xr, orow, rstd, row, s, gamma, beta, D, eps, sh);
}
"""


def layer_norm_fwd_np(launch, x, out, rstd, gamma, beta, D, eps):
    """NumPy twin of ``layer_norm_fwd`` (one block per row: N = the grid's size)."""
    np = B.host
    check_block_reduction(launch, x.itemsize)
    N = launch.blocks
    xv, ov, rv = strided_view(x, (N, D), (D, 1)), strided_view(out, (N, D), (D, 1)), strided_view(rstd, (N,), (1,))
    g, b = strided_view(gamma, (D,), (1,)), strided_view(beta, (D,), (1,))
    dt = x.dtype.type
    mean = xv.sum(axis=1) / dt(D)
    xv -= mean[:, None]
    var = (xv * xv).sum(axis=1) / dt(D)
    r = dt(1) / np.sqrt(var + eps)
    xv *= r[:, None]
    ov[...] = xv * g + b
    rv[...] = r


LAYER_NORM_BWD = r"""
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
    check_block_reduction(launch, dout.itemsize)
    N = launch.blocks
    d, xh, r, gm = (strided_view(dout, (N, D), (D, 1)), strided_view(xhat, (N, D), (D, 1)), strided_view(rstd, (N,), (1,)),
                    strided_view(gamma, (D,), (1,)))
    dt = dout.dtype.type
    g = d * gm
    a = g.sum(axis=1) / dt(D)
    b = (g * xh).sum(axis=1) / dt(D)
    d[...] = r[:, None] * (g - a[:, None] - xh * b[:, None])


RESIDUAL_LN_FWD = r"""
// The post-norm epilogue of a sub-layer, one block per row of s (N, D): the sub-layer's output
// s (its output projection without the bias) becomes v = drop(s + bias) + x, then layer norm:
// s <- xhat, out <- gamma * xhat + beta, rstd[row]. Dropout as dropout_hash over the flat index
// row * D + j (thr 0: none), so dropout_hash regenerates this mask in the backward.
template <typename T>
__global__ void residual_ln_fwd(T* s, const T* bias, const T* x, T* out, T* rstd, const T* gamma, const T* beta,
                                const unsigned long long* seed, unsigned long long site, unsigned long long offset,
                                unsigned int thr, T scale, int D, T eps) {
    extern __shared__ unsigned char smem[];
    const unsigned long long key = thr > 0u ? dropout_key(seed, site, offset) : 0ULL;
    T* sh = reinterpret_cast<T*>(smem);
    long long row = blockIdx.x;
    T* sr = s + row * D;
    const T* xr = x + row * D;
    T* orow = out + row * D;
    T sum = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        T v = sr[j] + bias[j];
        if (thr > 0u) v = dropout_bits(key, row * D + j) >= thr ? v * scale : T(0);
        v += xr[j];
        sr[j] = v;
        sum += v;
    }
    normalise_row(sr, orow, rstd, row, sum, gamma, beta, D, eps, sh);
}
"""


def residual_ln_fwd_np(launch, s, bias, x, out, rstd, gamma, beta, seed, site, offset, thr, scale, D, eps):
    """NumPy twin of ``residual_ln_fwd`` (one block per row: N = the grid's size)."""
    np = B.host
    check_block_reduction(launch, s.itemsize)
    N, D = launch.blocks, int(D)
    sv = strided_view(s, (N, D), (D, 1))
    v = sv + strided_view(bias, (D,), (1,))
    if thr > 0:
        keep = (dropout_bits_np(dropout_key_np(seed, site, offset), N * D) >= thr).reshape(N, D)
        v = np.where(keep, v * scale, s.dtype.type(0))
    v += strided_view(x, (N, D), (D, 1))
    sv[...] = v
    layer_norm_fwd_np(launch, s, out, rstd, gamma, beta, D, eps)


LAYER_NORM_BWD_DROP = r"""
// Post-norm's backward through the norm and the dropout, one block per row: dout <- dy, the
// layer norm's dx as in layer_norm_bwd (in place), and ds <- drop(dy) with the forward's mask
// regenerated by dropout_bits over the flat index row * D + j (see residual_ln_fwd).
template <typename T>
__global__ void layer_norm_bwd_drop(T* dout, const T* xhat, const T* rstd, const T* gamma, T* ds,
                                    const unsigned long long* seed, unsigned long long site,
                                    unsigned long long offset, unsigned int thr, T scale, int D) {
    extern __shared__ unsigned char smem[];
    const unsigned long long key = dropout_key(seed, site, offset);
    T* sh = reinterpret_cast<T*>(smem);
    long long row = blockIdx.x;
    T* dr = dout + row * D;
    const T* xr = xhat + row * D;
    T a = 0, b = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) { T g = dr[j] * gamma[j]; a += g; b += g * xr[j]; }
    a = block_sum(a, sh) / T(D);
    b = block_sum(b, sh) / T(D);
    T r = rstd[row];
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        T v = r * (dr[j] * gamma[j] - a - xr[j] * b);
        dr[j] = v;
        ds[row * D + j] = dropout_bits(key, row * D + j) >= thr ? v * scale : T(0);
    }
}
"""


def layer_norm_bwd_drop_np(launch, dout, xhat, rstd, gamma, ds, seed, site, offset, thr, scale, D):
    """NumPy twin of ``layer_norm_bwd_drop`` (one block per row)."""
    np = B.host
    layer_norm_bwd_np(launch, dout, xhat, rstd, gamma, D)
    N, D = launch.blocks, int(D)
    keep = (dropout_bits_np(dropout_key_np(seed, site, offset), N * D) >= thr).reshape(N, D)
    strided_view(ds, (N, D), (D, 1))[...] = np.where(keep, strided_view(dout, (N, D), (D, 1)) * scale, dout.dtype.type(0))

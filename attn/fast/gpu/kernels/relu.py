"""The feed-forward's hidden epilogue (``drop(max(a + b1, 0))``) and ReLU's backward: CUDA source
and NumPy twins."""
from __future__ import annotations

from .... import backend as B
from .common import strided_view
from .dropout import dropped_np

BIAS_RELU_DROP = r"""
// The feed-forward's hidden epilogue, in place on a (n / F, F): a <- drop(max(a + bias, 0)), the
// dropout as dropout_hash over the flat index (thr 0: none).
template <typename T>
__global__ void bias_relu_drop(T* a, const T* bias, const unsigned long long* seed, unsigned long long site,
                               unsigned long long offset, unsigned int thr, T scale, long long n, int F) {
    const unsigned long long key = thr > 0u ? dropout_key(seed, site, offset) : 0ULL;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        T v = a[i] + bias[i % F];
        v = v > T(0) ? v : T(0);
        if (thr > 0u) v = dropout_bits(key, i) >= thr ? v * scale : T(0);
        a[i] = v;
    }
}
"""


def bias_relu_drop_np(launch, a, bias, seed, site, offset, thr, scale, n, F):
    """NumPy twin of ``bias_relu_drop``."""
    np = B.host
    n, F = int(n), int(F)
    av = strided_view(a, (n // F, F), (F, 1))
    v = np.maximum(av + strided_view(bias, (F,), (1,)), a.dtype.type(0))
    if thr > 0:
        v = dropped_np(v, seed, site, offset, thr, scale)
    av[...] = v


RELU_BWD = r"""
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
    dv = strided_view(da, (n,), (1,))
    dv[...] = np.where(strided_view(a, (n,), (1,)) > 0, dv, da.dtype.type(0))

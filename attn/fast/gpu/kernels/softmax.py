"""The keys-first masked softmax of the attention and its backward: CUDA source and NumPy twins."""
from __future__ import annotations

from .... import backend as B
from .common import check_threads, strided_view

SOFTMAX0_FWD = r"""
// Keys-first softmax of alpha * s + bias, in place: s is (Tk, M) with M = B*H*Tq, column m = (b, h, q);
// alpha is the attention's 1/sqrt(d_k) (the weights are stored unscaled in the arena).
// bias[k*sk + b*sb + h*sh + q*sq] is 0 (may attend) or the most negative finite value.
template <typename T>
__global__ void softmax0_fwd(T* s, const T* bias, T alpha, int Tk, long long M, int H, int Tq,
                             long long sk, long long sb, long long shd, long long sq) {
    long long m = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    long long q = m % Tq, bh = m / Tq, h = bh % H, b = bh / H;
    long long boff = b * sb + h * shd + q * sq;
    bool any = false;
    T mx = 0;
    for (int k = 0; k < Tk; ++k) {
        T bk = bias[k * sk + boff];
        T v = alpha * s[k * M + m] + bk;
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


def softmax0_fwd_np(launch, s, bias, alpha, Tk, M, H, Tq, sk, sb, shd, sq):
    """NumPy twin of ``softmax0_fwd``."""
    np = B.host
    check_threads(launch, M, "columns")
    x = strided_view(s, (Tk, M), (M, 1))
    bias_t = strided_view(bias, (Tk, M // (H * Tq), H, Tq), (sk, sb, shd, sq)).reshape(Tk, M)
    x *= alpha
    x += bias_t
    allowed = (bias_t == 0).any(axis=0)
    x -= x.max(axis=0) if Tk else 0
    np.exp(x, out=x)
    total = x.sum(axis=0)
    x *= np.where(allowed, x.dtype.type(1) / np.where(allowed, total, 1), x.dtype.type(0))


SOFTMAX0_BWD = r"""
// dy <- alpha * y * (dy - sum_k dy * y), per column, in place (the forward was softmax(alpha * s)).
template <typename T>
__global__ void softmax0_bwd(T* dy, const T* y, T alpha, int Tk, long long M) {
    long long m = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    T t = 0;
    for (int k = 0; k < Tk; ++k) t += dy[k * M + m] * y[k * M + m];
    for (int k = 0; k < Tk; ++k) dy[k * M + m] = alpha * y[k * M + m] * (dy[k * M + m] - t);
}
"""


def softmax0_bwd_np(launch, dy, y, alpha, Tk, M):
    """NumPy twin of ``softmax0_bwd``."""
    check_threads(launch, M, "columns")
    d, w = strided_view(dy, (Tk, M), (M, 1)), strided_view(y, (Tk, M), (M, 1))
    t = (d * w).sum(axis=0)
    d -= t
    d *= w
    d *= alpha

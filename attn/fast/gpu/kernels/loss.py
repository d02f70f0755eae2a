"""The label-smoothed cross-entropy and its gradient in one launch: CUDA source and NumPy twin."""
from __future__ import annotations

from .... import backend as B
from .common import check_block_reduction, strided_view

CROSS_ENTROPY = r"""
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
    check_block_reduction(launch, x.itemsize)
    N = launch.blocks
    xv, tv, wv, lv = (strided_view(x, (N, V), (V, 1)), strided_view(y, (N,), (1,)), strided_view(w, (N,), (1,)),
                      strided_view(loss_rows, (N,), (1,)))
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

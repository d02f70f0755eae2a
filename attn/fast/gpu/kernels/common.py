"""What every kernel family shares: the twins' view of a kernel's memory and their checks of a
launch, the device functions the CUDA source opens with (:data:`HELPERS`), and the block and
grid sizes the launch code picks."""
from __future__ import annotations

import math

from .... import backend as B


def strided_view(a, shape, strides):
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


def check_threads(launch, n: int, what: str) -> None:
    """A one-thread-per-item kernel (no grid-stride loop) must be launched with enough threads."""
    if launch.blocks * launch.threads < n:
        raise ValueError(f"{launch.name}: {launch.blocks} x {launch.threads} threads cannot cover {n} {what}")


def check_block_reduction(launch, itemsize: int) -> None:
    """``block_sum``/``block_max`` need a power-of-two block and blockDim.x values of shared memory."""
    t = launch.block[0]
    if t & (t - 1) or launch.threads != t:
        raise ValueError(f"{launch.name}: the block must be a power of two along x, got {launch.block}")
    if launch.shared_mem < t * itemsize:
        raise ValueError(f"{launch.name}: {launch.shared_mem} bytes of shared memory, "
                         f"the tree reduction needs {t * itemsize}")


HELPERS = r"""
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

// Layer norm of one row, its values in xr and `part` this thread's share of their sum:
// xr <- xhat, orow <- gamma * xhat + beta, rstd[row] <- 1 / sqrt(var + eps). Shared by
// layer_norm_fwd and residual_ln_fwd.
template <typename T>
__device__ void normalise_row(T* xr, T* orow, T* rstd, long long row, T part, const T* gamma, const T* beta,
                              int D, T eps, T* sh) {
    T mean = block_sum(part, sh) / T(D);
    T q = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) { T c = xr[j] - mean; q += c * c; }
    T var = block_sum(q, sh) / T(D);
    T r = T(1) / sqrt(var + eps);
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        T xh = (xr[j] - mean) * r;
        xr[j] = xh;
        orow[j] = xh * gamma[j] + beta[j];
    }
    if (threadIdx.x == 0) rstd[row] = r;
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


def block_size_for(n: int, most: int = 256) -> int:
    """A power-of-two block size for rows of n elements (at least 32, at most ``most``)."""
    b = 32
    while b < most and b < n:
        b *= 2
    return b


def grid_of(n: int, threads: int = 256, most: int = 65535) -> tuple:
    """Blocks for a grid-stride loop over n elements."""
    return (max(1, min(most, (n + threads - 1) // threads)),)


assert block_size_for(1) == 32 and block_size_for(512) == 256 and block_size_for(37000, 512) == 512 and math.log2(block_size_for(100)) % 1 == 0

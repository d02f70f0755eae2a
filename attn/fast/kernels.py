"""Fused CuPy kernels for the memory-bound parts of the fast training step and decoding.

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
layer_norm_backward_   dgamma and dbeta by one ``column_sums`` launch (into the arena's
                       (2, D) block), before ``dout`` is overwritten; then one block per
                       row for ``dx``
colsum, colsums        the bias gradients: ``column_sums``, one launch of two stages
                       (blocks of 32 columns x 64-row chunks write partial sums; the last
                       block of each column tile to finish adds them up), so the grid
                       grows with the rows as well as the columns; two matrices of the same
                       rows in one launch (a sub-layer's two bias gradients)
cross_entropy_         one block per row: max, sum of exp, then ``dlogits`` in place; the
                       per-row losses are summed on the device
dropout_mask / _       ``uniform >= p`` (exact p), ``x * keep * scale``; with
                       ``counter_dropout`` (the default), no mask in memory: ``dropout_hash``
                       keeps element i where the top 16 bits of splitmix64(key + (g+1) golden)
                       are >= round(p * 65536), g the element's index in the global batch, the
                       key made in the kernel from the step's seed (read from device memory, so a
                       captured step draws new masks every replay) and the site's number; the
                       backward regenerates the same bits (one launch each way, nothing drawn)
layer_norm_backward_   post-norm's backward: dgamma and dbeta (one ``column_sums``), then
  dropout_             dy and drop(dy) in one launch (the mask regenerated)
residual_layer_norm_   post-norm's epilogue in one launch: ``s + bias``, dropout (from its
                       counter), ``+ x``, then layer norm of the row (one block per row)
bias_relu_dropout_     the feed-forward's hidden epilogue, ``drop(max(a + b1, 0))``, one launch
relu_backward_         ``da * (a > 0)``
adam_                  the whole Adam update of one parameter in one kernel
adam_flat_             the whole arena's Adam update in one kernel, after one
                       ``sumsq_partial`` launch when clipping: the norm and the decision
                       to clip stay on the device
mm, bmm                the step's matrix products by cuBLAS itself (``cupy.cuda.cublas``, the
                       handle set to the current stream, alpha and beta host pointers), the
                       operands and ``out`` as they lie (transposed, column blocks, head
                       views: leading dimensions and transposes, column-major C^T = B^T A^T):
                       ``sgemm``/``dgemm``; a batch that is one stride, ``gemmStridedBatched``;
                       head views (offset ``b * T * n*D + h * Dh``: two strides), the three
                       pointer arrays by one ``gemm_pointers`` launch (inside a step memory,
                       once per product and kept: the addresses repeat), then ``gemmBatched``.
                       Never CuPy's ``matmul``, which copies such views and which CuPy
                       refuses while a stream captures
=====================  =====================================================================

and, launched by :class:`DecodeKernels` for a cached decoding step on CuPy
(:mod:`attn.fast.decoding`, one position for every row):

=====================  =====================================================================
decode_embed           ``table[ids] * sqrt(D) + pe``, and pre-norm's first layer norm
one_query_attention    one block per (row, head): the new key and value written into the
                       cache (self-attention), the scores, the masked softmax and the
                       weighted sum of the values for the row's one query
add_norm               a sub-layer's epilogue: ``x <- (s + bias) + x`` and the next layer
                       norm of it (pre-norm: into the next sub-layer's input; post-norm:
                       into x). ``residual_ln_fwd`` writes xhat over its input and keeps
                       no residual stream, which pre-norm needs
log_softmax_rows       one block per row
greedy_pick            greedy decoding's choice (PAD and BOS banned) and its log-probability
beam_candidates        one block per sentence: each beam's best tokens, then the sentence's
                       best 2K candidates, in the order (score, then lower id)
gather_prefix          beam search's reorder of the key/value cache: the positions written
                       so far of the rows picked, one block per (row, layer, keys or values,
                       head)
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

import collections
import math
import weakref
from typing import NamedTuple

from .. import backend as B
from ..precision import bf16_bits
from .ops import Mask, _Ops
from .stepmem import in_slab, outside_step, step_token

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

# --------------------------------------------------------------------------- softmax

_SOFTMAX0_FWD = r"""
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
    _check_threads(launch, M, "columns")
    x = _view(s, (Tk, M), (M, 1))
    bias_t = _view(bias, (Tk, M // (H * Tq), H, Tq), (sk, sb, shd, sq)).reshape(Tk, M)
    x *= alpha
    x += bias_t
    allowed = (bias_t == 0).any(axis=0)
    x -= x.max(axis=0) if Tk else 0
    np.exp(x, out=x)
    total = x.sum(axis=0)
    x *= np.where(allowed, x.dtype.type(1) / np.where(allowed, total, 1), x.dtype.type(0))


_SOFTMAX0_BWD = r"""
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
    _check_threads(launch, M, "columns")
    d, w = _view(dy, (Tk, M), (M, 1)), _view(y, (Tk, M), (M, 1))
    t = (d * w).sum(axis=0)
    d -= t
    d *= w
    d *= alpha

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
    normalise_row(xr, orow, rstd, row, s, gamma, beta, D, eps, sh);
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


_COLUMN_SUMS = r"""
// Column sums of a, (N, D) contiguous, in one launch of two stages (layer norm's dgamma and
// dbeta, the bias gradients), and of a second matrix a1 (N, D1) in the same launch (two bias
// gradients of one backward: one launch instead of two): the grid grows with the rows as well
// as the columns. Tiles x < tiles0 are a's (32 columns each), tiles x >= tiles0 are a1's.
// Block (x, y) is 32 x 8 threads: the 32 columns of tile x, and 8 lanes over the rows of the
// chunks y, y + gridDim.y, ... of `chunk` rows each. Stage one: every block writes its partial
// sums, partial[(y * K + k) * D + j] (a1's after a's: partial + gridDim.y * K * D, K = 1).
// Stage two: the last block of tile x to finish (a ticket from counter[x], which must be 0 at
// the launch) sums the gridDim.y partials of its columns in a fixed order, and sets the counter
// back to 0 for the next launch.
// K = 2: out[j] = sum_i a[i, j] * b[i, j] and out[D + j] = sum_i a[i, j] (dgamma, dbeta);
// K = 1: out[j] = sum_i a[i, j] (b is not read). a1: out1[j] = sum_i a1[i, j] (D1 = 0: none).
template <typename T>
__global__ void column_sums(const T* a, const T* b, T* partial, unsigned int* counter, T* out,
                            long long N, int D, int K, int chunk, const T* a1, T* out1, int D1, int tiles0) {
    __shared__ T sh[2][8][33];
    __shared__ bool last;
    int tx = threadIdx.x, ty = threadIdx.y;
    const bool second = (int)blockIdx.x >= tiles0;
    if (second) {
        partial += (long long)gridDim.y * K * D;
        a = a1;
        out = out1;
        D = D1;
        K = 1;
    }
    int j = ((int)blockIdx.x - (second ? tiles0 : 0)) * 32 + tx;
    T s0 = 0, s1 = 0;
    if (j < D) {
        for (long long c = blockIdx.y; c * chunk < N; c += gridDim.y) {
            long long end = min(N, (c + 1) * chunk);
            for (long long i = c * chunk + ty; i < end; i += 8) {
                T x = a[i * D + j];
                if (K == 2) { s0 += x * b[i * D + j]; s1 += x; } else s0 += x;
            }
        }
    }
    sh[0][ty][tx] = s0;
    sh[1][ty][tx] = s1;
    __syncthreads();
    if (ty == 0 && j < D) {
        T t0 = 0, t1 = 0;
        for (int r = 0; r < 8; ++r) { t0 += sh[0][r][tx]; t1 += sh[1][r][tx]; }
        partial[(long long)blockIdx.y * K * D + j] = t0;
        if (K == 2) partial[((long long)blockIdx.y * K + 1) * D + j] = t1;
    }
    __threadfence();                        // this block's partials reach every block before its ticket
    __syncthreads();
    if (tx == 0 && ty == 0) last = atomicAdd(&counter[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    const volatile T* pv = partial;         // written by other blocks: read past the L1 cache
    s0 = 0;
    s1 = 0;
    if (j < D) {
        for (int r = ty; r < (int)gridDim.y; r += 8) {
            s0 += pv[(long long)r * K * D + j];
            if (K == 2) s1 += pv[((long long)r * K + 1) * D + j];
        }
    }
    sh[0][ty][tx] = s0;
    sh[1][ty][tx] = s1;
    __syncthreads();
    if (ty == 0 && j < D) {
        T t0 = 0, t1 = 0;
        for (int r = 0; r < 8; ++r) { t0 += sh[0][r][tx]; t1 += sh[1][r][tx]; }
        out[j] = t0;
        if (K == 2) out[D + j] = t1;
    }
    if (tx == 0 && ty == 0) counter[blockIdx.x] = 0;
}
"""

#: Rows per chunk of ``column_sums``, and the most row blocks (``gridDim.y``) it is launched with.
COLUMN_CHUNK, COLUMN_MAX_ROW_BLOCKS = 64, 1024


def column_sums_np(launch, a, b, partial, counter, out, N, D, K, chunk, a1, out1, D1, tiles0):
    """NumPy twin of ``column_sums``: the partial sums of every row block, then their sum; for
    a and, in the tiles from ``tiles0`` on, a1."""
    np = B.host
    if launch.block != (32, 8):
        raise ValueError(f"{launch.name}: the block must be (32, 8), got {launch.block}")
    tiles, R = launch.grid[0], (launch.grid[1] if len(launch.grid) > 1 else 1)
    N, D, D1, chunk, tiles0 = int(N), int(D), int(D1), int(chunk), int(tiles0)
    if tiles0 * 32 < D or (tiles - tiles0) * 32 < D1 or tiles0 > tiles:
        raise ValueError(f"{launch.name}: {tiles0} and {tiles - tiles0} tiles of 32 columns cannot cover {D} "
                         f"and {D1} columns")
    if K not in (1, 2):
        raise ValueError(f"{launch.name}: K must be 1 or 2, got {K}")
    cnt = _view(counter, (tiles,), (1,))
    if cnt.any():
        raise ValueError(f"{launch.name}: the tile counters must be 0 at the launch (a launch "
                         "before this one did not finish, or the counter buffer was not zeroed)")
    span = chunk * R                                  # rows of one round over the row blocks
    pad = -N % span
    jobs = [(x, y, o, DD, KK, start) for x, y, o, DD, KK, start in
            ((a, b, out, D, K, 0), (a1, None, out1, D1, 1, R * K * D)) if DD]
    for x, y, _, DD, KK, start in jobs:               # stage one: every block's partial sums
        xs = _view(x, (N, DD), (DD, 1))
        sums = [xs * _view(y, (N, DD), (DD, 1)), xs] if KK == 2 else [xs]
        part = np.empty((R, KK, DD), dtype=a.dtype)
        for k, t in enumerate(sums):
            t = np.concatenate([t, np.zeros((pad, DD), dtype=a.dtype)]) if pad else t
            part[:, k] = t.reshape(-1, R, chunk, DD).sum(axis=(0, 2))      # block y: chunks y, y + R, ...
        _view(partial.reshape(-1)[start:], (R, KK, DD), (KK * DD, DD, 1))[...] = part
    for _, _, o, DD, KK, start in jobs:               # stage two: from the partials as they lie
        part = _view(partial.reshape(-1)[start:], (R, KK, DD), (KK * DD, DD, 1))
        _view(o, (KK * DD,), (1,))[...] = part.sum(axis=0).reshape(-1)

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


_DROPOUT_HASH = r"""
// Dropout whose random numbers come from a counter-based generator, not from memory: element i
// of a site is kept when the top 16 bits of splitmix64(key + (i + 1) * golden) are >= thr, so the
// backward regenerates the forward's mask from (key, i) and no mask is stored or drawn.
// out <- keep ? x * scale : 0 (out may be x).
__device__ __forceinline__ unsigned int dropout_bits(unsigned long long key, long long i) {
    unsigned long long z = key + (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (unsigned int)(z >> 48);
}

// One step of splitmix64.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// The key of a dropout site: the step's seed, read from device memory (so that a step captured
// as a CUDA graph draws new masks at every replay: a seed passed by value would be replayed as
// it was captured), mixed with the site's number in the step, plus where the rank's first
// element sits in the global batch (offset = base * golden).
__device__ __forceinline__ unsigned long long dropout_key(const unsigned long long* seed, unsigned long long site,
                                                          unsigned long long offset) {
    return splitmix64(splitmix64(seed[0]) ^ site) + offset;
}

//
// The counter is the element's index in the GLOBAL batch, so that the ranks of a data-parallel
// run, each holding some of the batch's sentences, draw what one process draws for them: a
// rank's elements come in runs of `run` contiguous ones, each run `skip` elements before the
// next in the whole batch's array (the other ranks' sentences: keys-first attention weights
// (Tk, B, H, Tq) hold one run per key), so element i is the whole batch's i + (i / run) * skip;
// where the rank's first element sits is folded into `key` (key + base * golden). One process:
// skip 0.
template <typename T>
__global__ void dropout_hash(T* out, const T* x, const unsigned long long* seed, unsigned long long site,
                             unsigned long long offset, unsigned int thr, T scale, long long run, long long skip,
                             long long n) {
    const unsigned long long key = dropout_key(seed, site, offset);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = dropout_bits(key, i + (i / run) * skip) >= thr ? x[i] * scale : T(0);
}
"""

_M64 = (1 << 64) - 1
#: splitmix64's increment (the golden ratio in 64 bits): counter i is mixed as key + (i + 1) * GOLDEN.
GOLDEN = 0x9E3779B97F4A7C15


def dropout_bits_np(key: int, n: int, run: int = 0, skip: int = 0):
    """``dropout_bits`` of ``dropout_hash`` for its elements i = 0 .. n-1 (counters
    ``i + (i // run) * skip``; ``skip`` 0: i): uint32 in [0, 65536), bit for bit."""
    np = B.host
    i = np.arange(n, dtype=np.uint64)
    if skip:
        i += (i // np.uint64(run)) * np.uint64(skip)
    with np.errstate(over="ignore"):
        z = (i + np.uint64(1)) * np.uint64(GOLDEN) + np.uint64(key & _M64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(48)).astype(np.uint32)


def dropout_key_np(seed, site, offset) -> int:
    """``dropout_key``: the key of a site from the step's seed (a one-element uint64 array, as
    the kernels read it), the site's number and the rank's offset."""
    return (_splitmix64(_splitmix64(int(seed[0])) ^ int(site)) + int(offset)) & _M64


def dropout_hash_np(launch, out, x, seed, site, offset, thr, scale, run, skip, n):
    """NumPy twin of ``dropout_hash``."""
    np = B.host
    n = int(n)
    keep = dropout_bits_np(dropout_key_np(seed, site, offset), n, int(run), int(skip)) >= thr
    _view(out, (n,), (1,))[...] = np.where(keep, _view(x, (n,), (1,)) * scale, x.dtype.type(0))


_RESIDUAL_LN_FWD = r"""
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
    _check_block_reduction(launch, s.itemsize)
    N, D = launch.blocks, int(D)
    sv = _view(s, (N, D), (D, 1))
    v = sv + _view(bias, (D,), (1,))
    if thr > 0:
        keep = (dropout_bits_np(dropout_key_np(seed, site, offset), N * D) >= thr).reshape(N, D)
        v = np.where(keep, v * scale, s.dtype.type(0))
    v += _view(x, (N, D), (D, 1))
    sv[...] = v
    layer_norm_fwd_np(launch, s, out, rstd, gamma, beta, D, eps)


_LAYER_NORM_BWD_DROP = r"""
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
    _view(ds, (N, D), (D, 1))[...] = np.where(keep, _view(dout, (N, D), (D, 1)) * scale, dout.dtype.type(0))


_BIAS_RELU_DROP = r"""
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
    av = _view(a, (n // F, F), (F, 1))
    v = np.maximum(av + _view(bias, (F,), (1,)), a.dtype.type(0))
    if thr > 0:
        v = np.where((dropout_bits_np(dropout_key_np(seed, site, offset), n) >= thr).reshape(n // F, F), v * scale,
                     a.dtype.type(0))
    av[...] = v


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

_SUMSQ_PARTIAL = r"""
// Stage one of the global gradient norm: partial[b] = the sum of g[i]^2 (in double) over the
// elements that block b visits in a grid-stride loop. adam_flat sums the partials.
template <typename T>
__global__ void sumsq_partial(const T* g, double* partial, long long n) {
    extern __shared__ unsigned char smem[];
    double* sh = reinterpret_cast<double*>(smem);
    double s = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        double x = (double)g[i];
        s += x * x;
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
"""


def sumsq_partial_np(launch, g, partial, n):
    """NumPy twin of ``sumsq_partial``."""
    np = B.host
    _check_block_reduction(launch, 8)
    nb, t, n = launch.blocks, launch.threads, int(n)
    x = _view(g, (n,), (1,)).astype(np.float64)
    x = np.concatenate([x, np.zeros(-n % (nb * t))]).reshape(-1, nb, t)   # [round, block, thread]
    _view(partial, (nb,), (1,))[...] = (x * x).sum(axis=(0, 2))


_ADAM_FLAT = r"""
// Adam over the whole arena in one launch, in place on p, m, v (see attn.fast.optim.FastAdam).
// With n_partial > 0 the gradient is clipped first, decided here on the device: every block sums
// the n_partial partial sums of squares of sumsq_partial (in one fixed order, so every block gets
// the same norm), and g is used times max_norm / (norm + 1e-6) where norm > max_norm
// (attn.optim.clip_grad_norm's rule). g itself is not written.
//
// The step count lives on the device: every block reads t = count[0] + 1 and makes the step's
// numbers from it in double (section 5.3's learning rate, lr_factor * d_model^-0.5 *
// min(t^-0.5, t * warmup^-1.5), or fixed_lr where use_fixed; Adam's bias corrections
// c1 = 1 - b1^t, c2 = 1 - b2^t), and the last block to finish (a ticket, as in column_sums)
// sets count[0] = t. So a step captured as a CUDA graph takes a new learning rate and new
// corrections at every replay: numbers passed by value would be replayed as captured.
template <typename T>
__global__ void adam_flat(T* p, T* m, T* v, const T* g, const double* partial, int n_partial, double max_norm,
                          long long* count, unsigned int* ticket, double lr_factor, double fixed_lr, int use_fixed,
                          double d_model, double warmup, double b1, double b2, double eps, long long n) {
    extern __shared__ unsigned char smem[];
    double* sh = reinterpret_cast<double*>(smem);
    const double t = (double)count[0] + 1.0;
    const double lr = use_fixed ? fixed_lr : lr_factor / sqrt(d_model) * fmin(1.0 / sqrt(t), t * pow(warmup, -1.5));
    const double c1 = 1.0 - pow(b1, t), c2 = 1.0 - pow(b2, t);
    const T one_m_b1 = T(1.0 - b1), b2_t = T(b2), one_m_b2 = T(1.0 - b2), eps_c = T(eps * sqrt(c2));
    const T step = T(lr * sqrt(c2) / c1);
    T scale = T(1);
    if (n_partial > 0) {
        double s = 0;
        for (int j = threadIdx.x; j < n_partial; j += blockDim.x) s += partial[j];
        double norm = sqrt(block_sum(s, sh));
        if (norm > max_norm) scale = T(max_norm / (norm + 1e-6));
    }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        T gi = g[i] * scale;
        T mi = m[i] + one_m_b1 * (gi - m[i]);
        T vi = b2_t * v[i] + one_m_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] -= step * mi / (sqrt(vi) + eps_c);
    }
    __syncthreads();                        // every thread of this block has read count (above)
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(ticket, 1u) == gridDim.x - 1) { count[0] += 1; *ticket = 0u; }   // the last block
    }
}
"""


def adam_flat_np(launch, p, m, v, g, partial, n_partial, max_norm, count, ticket, lr_factor, fixed_lr, use_fixed,
                 d_model, warmup, b1, b2, eps, n):
    """NumPy twin of ``adam_flat``."""
    np = B.host
    n = int(n)
    dt = p.dtype.type
    count_v = _view(count, (1,), (1,))
    t = float(count_v[0]) + 1.0
    lr = float(fixed_lr) if use_fixed else float(lr_factor) / math.sqrt(float(d_model)) * min(
        1.0 / math.sqrt(t), t * float(warmup) ** -1.5)
    c1, c2 = 1.0 - float(b1) ** t, 1.0 - float(b2) ** t
    one_m_b1, b2, one_m_b2, eps_c = dt(1.0 - b1), dt(b2), dt(1.0 - b2), dt(float(eps) * math.sqrt(c2))
    step = dt(lr * math.sqrt(c2) / c1)
    scale = dt(1)
    if n_partial > 0:
        _check_block_reduction(launch, 8)
        norm = np.sqrt(_view(partial, (int(n_partial),), (1,)).sum())
        if norm > max_norm:
            scale = dt(max_norm / (norm + 1e-6))
    pv, mv, vv, gv = (_view(a, (n,), (1,)) for a in (p, m, v, g))
    gv = gv * scale
    mv += one_m_b1 * (gv - mv)
    vv[...] = b2 * vv + one_m_b2 * gv * gv
    pv -= step * mv / (np.sqrt(vv) + eps_c)
    count_v[0] += 1
    _view(ticket, (1,), (1,))[0] = 0

# --------------------------------------------------------------------------- the module

_SOURCE = "".join([_HELPERS, _SOFTMAX0_FWD, _SOFTMAX0_BWD, _LAYER_NORM_FWD, _LAYER_NORM_BWD, _COLUMN_SUMS,
                   _CROSS_ENTROPY, _DROPOUT, _DROPOUT_HASH, _RESIDUAL_LN_FWD, _LAYER_NORM_BWD_DROP, _BIAS_RELU_DROP, _RELU_BWD, _ADAM, _SUMSQ_PARTIAL, _ADAM_FLAT])

#: Every kernel of ``_SOURCE`` and its NumPy twin.
NUMPY_TWINS = {
    "softmax0_fwd": softmax0_fwd_np, "softmax0_bwd": softmax0_bwd_np,
    "layer_norm_fwd": layer_norm_fwd_np, "layer_norm_bwd": layer_norm_bwd_np, "column_sums": column_sums_np,
    "cross_entropy_fwd_bwd": cross_entropy_fwd_bwd_np,
    "dropout_fwd": dropout_fwd_np, "dropout_bwd": dropout_bwd_np, "dropout_hash": dropout_hash_np,
    "residual_ln_fwd": residual_ln_fwd_np, "layer_norm_bwd_drop": layer_norm_bwd_drop_np,
    "bias_relu_drop": bias_relu_drop_np,
    "relu_bwd": relu_bwd_np, "adam": adam_np,
    "sumsq_partial": sumsq_partial_np, "adam_flat": adam_flat_np,
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


class HashedKeep(NamedTuple):
    """The ``keep`` of a CuPy dropout :class:`Mask`: no array, what the kernels make the key of
    ``dropout_hash``'s generator from (``dropout_key``: the step's ``seed``, a one-element uint64
    device array; the ``site``'s number in the step; the ``offset`` of the rank's first element
    in the global batch times the golden ratio), the threshold (``round(p * 65536)``), the shape
    it was drawn for, and where the elements sit in the global batch: runs of ``run`` elements,
    ``skip`` apart (0: one run; see ``dropout_hash``). :attr:`key` and :meth:`array` (the
    boolean mask) read the seed from the device: for tests and inspection."""
    seed: object
    site: int
    offset: int
    thr: int
    shape: tuple
    run: int = 0
    skip: int = 0

    @property
    def key(self) -> int:
        return dropout_key_np(B.to_host(self.seed), self.site, self.offset)

    def array(self, xp):
        n = math.prod(self.shape)
        return xp.asarray(dropout_bits_np(self.key, n, self.run, self.skip) >= self.thr).reshape(self.shape)


def _splitmix64(x: int) -> int:
    """One step of splitmix64 on a Python int (host-side key mixing)."""
    z = (x + GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class CupyOps(_Ops):
    """The fast path's memory-bound operations as fused CuPy kernels (see the module docstring)."""

    def __init__(self, xp, sharing: CupyOps | None = None):
        """The kernels' module compiled for ``xp``, or, with ``sharing`` (the fp32 operations of
        the same namespace), that object's module, kernels, buffers and seeds: the objects of
        the other precisions (:class:`Tf32CupyOps`, :class:`Bf16CupyOps`) differ from it in
        their products alone."""
        super().__init__(xp, self.precision, sharing)
        if sharing is not None:
            self._module, self._functions, self._scratch = sharing._module, sharing._functions, sharing._scratch
            self._draws, self._seeds = sharing._draws, sharing._seeds
            return
        self._module = xp.RawModule(code=_SOURCE, options=OPTIONS, name_expressions=NAME_EXPRESSIONS)
        self._functions: dict = {}
        self._scratch: dict = {}
        self._draws = weakref.WeakKeyDictionary()    # DeviceRNG -> dropout masks it has keyed
        self._seeds = weakref.WeakKeyDictionary()    # DeviceRNG -> its seed on the device

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

    def softmax0_(self, s, bias=None, row_scale=None, scale: float = 1.0):
        """As :meth:`attn.fast.ops._Ops.softmax0_` for s (Tk, B, H, Tq) contiguous (``scale``
        multiplies the scores inside the kernel, at no extra pass); ``bias`` is
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
            (s, b4, self._scalar(scale, s.dtype), B.host.int32(Tk), i64(M), B.host.int32(H), B.host.int32(Tq),
             i64(sk), i64(sb), i64(sh), i64(sq)))
        return s

    def softmax0_backward_(self, dy, y, scale: float = 1.0):
        if not (dy.flags.c_contiguous and y.flags.c_contiguous) or dy.shape != y.shape:
            raise ValueError("CupyOps.softmax0_backward_: dy and y must be contiguous and of one shape")
        Tk = dy.shape[0]
        M = dy.size // Tk
        threads = 256
        self._fn("softmax0_bwd", dy.dtype)(((M + threads - 1) // threads,), (threads,),
                                            (dy, y, self._scalar(scale, dy.dtype), B.host.int32(Tk),
                                             B.host.int64(M)))
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

    def residual_layer_norm_(self, s, bias, m, x, gamma, beta, eps: float):
        """As :meth:`attn.fast.ops._Ops.residual_layer_norm_`, in one ``residual_ln_fwd``
        launch (bias, dropout from its counter, residual sum and layer norm) where the mask is
        this class's own (a :class:`HashedKeep`) or there is none."""
        if m is not None and not isinstance(m.keep, HashedKeep):
            return super().residual_layer_norm_(s, bias, m, x, gamma, beta, eps)
        cp = self.xp
        N, D = s.shape
        self._contiguous("residual_layer_norm_", s=s, x=x)
        self._rows(m, "residual_layer_norm_")
        if m is not None and m.keep.shape != (N, D):
            raise ValueError(f"CupyOps.residual_layer_norm_: the mask was drawn for shape {m.keep.shape}, "
                             f"s is {(N, D)}")
        out = cp.empty_like(s)
        rstd = cp.empty((N,), dtype=s.dtype)
        seed, site, offset, thr, scale = self._dropout_args(m)
        threads = _block(D)
        self._fn("residual_ln_fwd", s.dtype)(
            (N,), (threads,), (s, cp.ascontiguousarray(bias), x, out, rstd, cp.ascontiguousarray(gamma),
                               cp.ascontiguousarray(beta), seed, site, offset, thr,
                               self._scalar(scale, s.dtype), B.host.int32(D), self._scalar(eps, s.dtype)),
            shared_mem=threads * s.dtype.itemsize)
        return out, rstd

    def layer_norm_backward_(self, dout, xhat, rstd, gamma, out=None):
        """As :meth:`attn.fast.ops._Ops.layer_norm_backward_`: dgamma and dbeta by one
        ``column_sums`` launch (into ``out``, (2, D), before ``dout`` is overwritten), then one
        block per row for ``dx``."""
        cp = self.xp
        N, D = dout.shape
        self._contiguous("layer_norm_backward_", dout=dout, xhat=xhat)
        out = cp.empty((2, D), dtype=dout.dtype) if out is None else out
        self._column_sums(dout, xhat, out, "layer_norm_backward_")
        threads = _block(D)
        self._fn("layer_norm_bwd", dout.dtype)(
            (N,), (threads,), (dout, xhat, rstd, cp.ascontiguousarray(gamma), B.host.int32(D)),
            shared_mem=threads * dout.dtype.itemsize)
        return dout, out[0], out[1]

    def layer_norm_backward_dropout_(self, dout, xhat, rstd, gamma, m, out=None):
        """As :meth:`attn.fast.ops._Ops.layer_norm_backward_dropout_`: dgamma and dbeta by one
        ``column_sums`` launch, then dy and drop(dy) by one ``layer_norm_bwd_drop`` launch
        (the mask regenerated from its counter)."""
        if m is None or not isinstance(m.keep, HashedKeep):
            return super().layer_norm_backward_dropout_(dout, xhat, rstd, gamma, m, out)
        cp = self.xp
        N, D = dout.shape
        self._contiguous("layer_norm_backward_dropout_", dout=dout, xhat=xhat)
        self._rows(m, "layer_norm_backward_dropout_")
        if m.keep.shape != (N, D):
            raise ValueError(f"CupyOps.layer_norm_backward_dropout_: the mask was drawn for shape {m.keep.shape}, "
                             f"dout is {(N, D)}")
        out = cp.empty((2, D), dtype=dout.dtype) if out is None else out
        self._column_sums(dout, xhat, out, "layer_norm_backward_dropout_")
        ds = cp.empty_like(dout)
        threads = _block(D)
        seed, site, offset, thr, scale = self._dropout_args(m)
        self._fn("layer_norm_bwd_drop", dout.dtype)(
            (N,), (threads,), (dout, xhat, rstd, cp.ascontiguousarray(gamma), ds, seed, site, offset, thr,
                               self._scalar(scale, dout.dtype), B.host.int32(D)),
            shared_mem=threads * dout.dtype.itemsize)
        return dout, ds

    # ---- column sums (bias gradients, dgamma and dbeta)

    def colsum(self, x2, out=None):
        """(R, C) -> (C,) by one ``column_sums`` launch (into ``out`` when given)."""
        out = self.xp.empty((x2.shape[1],), dtype=x2.dtype) if out is None else out
        self._column_sums(x2, None, out, "colsum")
        return out

    def colsums(self, *pairs):
        """``colsum(x2, out=out)`` for each ``(x2, out)``, two by two in one ``column_sums``
        launch where their rows agree (a backward's two bias gradients)."""
        i = 0
        while i < len(pairs):
            (a, out), nxt = pairs[i], pairs[i + 1] if i + 1 < len(pairs) else None
            if nxt is not None and nxt[0].shape[0] == a.shape[0] and nxt[0].dtype == a.dtype:
                self._column_sums(a, None, out, "colsums", second=nxt)
                i += 2
            else:
                self._column_sums(a, None, out, "colsums")
                i += 1

    def _column_sums(self, a, b, out, where, second=None):
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
        from_rows = -(-N // COLUMN_CHUNK)
        R = max(1, min(from_rows, COLUMN_MAX_ROW_BLOCKS))
        partial = self._buffer("column_partials", R * (K * D + D1), a.dtype)
        counter = self._counters(tiles)
        self._fn("column_sums", a.dtype)(
            (tiles, R), (32, 8), (a, a if b is None else b, partial, counter, out, B.host.int64(N),
                                  B.host.int32(D), B.host.int32(K), B.host.int32(COLUMN_CHUNK), a1, out1,
                                  B.host.int32(D1), B.host.int32(tiles0)))

    def _buffer(self, name, n, dtype):
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
        """``column_sums``' per-tile tickets: zeroed once, and set back to 0 by every launch
        (grown and replaced as :meth:`_buffer`'s buffers are)."""
        c = self._scratch.get("counters")
        if c is None or c.size < n:
            self._retire(c)
            with outside_step():
                c = self._scratch["counters"] = self.xp.zeros((max(n, 64, 0 if c is None else 2 * c.size),),
                                                              dtype=B.host.uint32)
        return c

    def _retire(self, buf):
        """Keep a replaced scratch buffer alive: a graph captured before it was replaced holds its
        address, and the pool must not hand that memory to anything else."""
        if buf is not None:
            self._scratch.setdefault("retired", []).append(buf)

    # ---- the matrix products: cuBLAS on the views as they are

    def _cublas(self):
        """cuBLAS called directly (:func:`attn.fast.cublas.direct_cublas`: CuPy's own wrappers
        refuse every call while a stream captures) and attn's own handle, with a workspace made
        once outside any step, set to the current stream (a capture runs on a stream of its own)
        and to host pointers for alpha and beta (as CuPy's ``matmul``)."""
        from .cublas import WORKSPACE_BYTES, direct_cublas
        cublas = direct_cublas(self.xp)
        handle = self._scratch.get("cublas_handle")
        if handle is None:
            with outside_step():
                self._scratch["cublas_workspace"] = self.xp.empty((WORKSPACE_BYTES,), dtype=B.host.uint8)
            handle = self._scratch["cublas_handle"] = cublas.create()
            cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        stream = self.xp.cuda.get_current_stream().ptr
        if self._scratch.get("cublas_stream") != stream:
            # cublasSetStream puts the handle back on cuBLAS's default workspace: set ours again
            cublas.setStream(handle, stream)
            cublas.setWorkspace(handle, self._scratch["cublas_workspace"].data.ptr, WORKSPACE_BYTES)
            self._scratch["cublas_stream"] = stream
        return cublas, handle

    def _alpha_beta(self, dtype, accumulate: bool = False):
        """Host addresses of alpha = 1 and beta (0, or 1 to ``accumulate`` into C) in ``dtype``
        (kept alive here: cuBLAS reads them at the call)."""
        key = ("alpha_beta", dtype)
        ab = self._scratch.get(key)
        if ab is None:
            ab = self._scratch[key] = B.host.array([1, 0], dtype=dtype)
        return ab.ctypes.data, ab.ctypes.data + (0 if accumulate else ab.itemsize)

    @staticmethod
    def _matrix(x, where, name):
        """How cuBLAS reads matrix ``x`` (the last two axes, R x C) in place: (rows_contiguous,
        ld) with ld in elements; rows_contiguous when x's rows are contiguous (row-major with
        leading dimension ld: cuBLAS's column-major x^T), else its columns (x itself,
        column-major). Anything else cannot be given to cuBLAS as it is: ValueError."""
        R, C = x.shape[-2:]
        item = x.itemsize
        sr, sc = x.strides[-2:]
        if sr % item or sc % item:
            raise ValueError(f"CupyOps.{where}: {name} strides {x.strides} are not whole elements")
        sr, sc = sr // item, sc // item
        if (sc == 1 or C == 1) and (R == 1 or sr >= max(1, C)):
            return True, (sr if R > 1 else max(1, C))
        if (sr == 1 or R == 1) and (C == 1 or sc >= max(1, R)):
            return False, (sc if C > 1 else max(1, R))
        raise ValueError(f"CupyOps.{where}: {name} of shape {tuple(x.shape)}, strides {x.strides}: neither its rows "
                         "nor its columns are contiguous, so cuBLAS cannot read it as it is")

    def _operands(self, where, a, b, out, nbatch):
        xp = self.xp
        if a.ndim != nbatch + 2 or b.ndim != nbatch + 2:
            raise ValueError(f"CupyOps.{where}: a {tuple(a.shape)} and b {tuple(b.shape)} must have {nbatch + 2} "
                             "dimensions")
        *batch, M, K = a.shape
        if tuple(b.shape[:-2]) != tuple(batch) or b.shape[-2] != K:
            raise ValueError(f"CupyOps.{where}: a {tuple(a.shape)} @ b {tuple(b.shape)}: the shapes do not match")
        N = b.shape[-1]
        if a.dtype != b.dtype or str(a.dtype) not in _CTYPES:
            raise ValueError(f"CupyOps.{where}: a and b must be both float32 or both float64, got {a.dtype} "
                             f"and {b.dtype}")
        if out is None:
            out = xp.empty((*batch, M, N), dtype=a.dtype)
        elif tuple(out.shape) != (*batch, M, N) or out.dtype != a.dtype:
            raise ValueError(f"CupyOps.{where}: out must be {(*batch, M, N)} {a.dtype}, got {tuple(out.shape)} "
                             f"{out.dtype}")
        return out, M, N, K

    def _gemm_args(self, cublas, where, a, b, out, M, N, K):
        """The column-major GEMM that makes ``out = a @ b``: (transa, transb, m, n, k, first,
        lda, second, ldb, ldc), with first and second the arrays cuBLAS takes as its A and B.
        Row-major out is cuBLAS's C^T = B^T A^T (so cuBLAS's A is b), column-major out its
        C = A B."""
        a_rows, lda = self._matrix(a, where, "a")
        b_rows, ldb = self._matrix(b, where, "b")
        c_rows, ldc = self._matrix(out, where, "out")
        ta, tb, m, n, k, first, second = self._plan(cublas, (a, a_rows, lda), (b, b_rows, ldb), c_rows, M, N, K)
        return ta, tb, m, n, k, first[0], first[2], second[0], second[2], ldc

    @staticmethod
    def _plan(cublas, a, b, c_rows, M, N, K):
        """The column-major GEMM making ``out = a @ b`` from descriptions of its operands
        (what, rows contiguous, ld, ...) and whether ``out``'s rows are contiguous: (transa,
        transb, m, n, k, first, second), first and second the descriptions of cuBLAS's A and B.
        Row-major out is cuBLAS's C^T = B^T A^T (so cuBLAS's A is b), column-major out its C = A B."""
        N_, T_ = cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T
        if c_rows:                         # a row-major array's memory is its transpose, column-major
            return N_ if b[1] else T_, N_ if a[1] else T_, N, M, K, b, a
        return T_ if a[1] else N_, T_ if b[1] else N_, M, N, K, a, b

    def _mm_operands(self, a, b, out, accumulate: bool):
        """:meth:`mm`'s checks: (out, (M, N, K)) of a product left to cuBLAS, or (out, None) where
        nothing is left to multiply (an empty out; a sum of K = 0 terms: zeros, or, accumulating,
        out as it is)."""
        if accumulate and out is None:
            raise ValueError(f"{type(self).__name__}.mm: accumulate=True needs out, the array the product is added to")
        out, M, N, K = self._operands("mm", a, b, out, 0)
        if (accumulate and K == 0) or self._nothing_to_multiply(out, M, N, K, 1):
            return out, None
        return out, (M, N, K)

    def mm(self, a, b, out=None, accumulate: bool = False):
        """``a @ b`` (M, K) x (K, N) by one cuBLAS GEMM (``sgemm``/``dgemm``) on the operands as
        they are (each needs its rows or its columns contiguous: a transposed matrix, a block
        of columns); ``out`` too may be such a view. With ``accumulate``, ``out += a @ b`` in the
        same GEMM (beta = 1). Returns out."""
        out, dims = self._mm_operands(a, b, out, accumulate)
        if dims is None:
            return out
        cublas, handle = self._cublas()
        ta, tb, m, n, k, first, lda, second, ldb, ldc = self._gemm_args(cublas, "mm", a, b, out, *dims)
        alpha, beta = self._alpha_beta(a.dtype, accumulate)
        gemm = cublas.sgemm if a.dtype == B.host.float32 else cublas.dgemm
        gemm(handle, ta, tb, m, n, k, alpha, first.data.ptr, lda, second.data.ptr, ldb, beta, out.data.ptr, ldc)
        return out

    @staticmethod
    def _nothing_to_multiply(out, M, N, K, count) -> bool:
        """Whether a product of these sizes is done without cuBLAS: an empty ``out``, or zeros
        (a sum over K = 0 terms)."""
        if M == 0 or N == 0 or count == 0:
            return True
        if K == 0:
            out.fill(0)
            return True
        return False

    @staticmethod
    def _batch_strides(x):
        """The batch axes of ``x`` (one or two) as (outer, inner, outer stride, inner stride),
        strides in elements."""
        shape, strides = x.shape[:-2], tuple(s // x.itemsize for s in x.strides[:-2])
        if len(shape) == 1:
            return 1, shape[0], 0, strides[0]
        return shape[0], shape[1], strides[0], strides[1]

    def bmm(self, a, b, out=None):
        """``a @ b`` over one or two batch axes, (..., M, K) x (..., K, N), each matrix as it lies
        (see :meth:`mm`). Where each operand's batch is one stride (the batch axes merge), one
        ``gemmStridedBatched``; else (head views of a (B*T, n*D) projection: batch and head are
        two strides) the three pointer arrays of ``gemmBatched`` made on the device by one
        ``gemm_pointers`` launch (into a scratch buffer kept between products), then one
        ``gemmBatched``: two launches, no operand copied. Returns out."""
        if a.ndim not in (3, 4):
            raise ValueError(f"CupyOps.bmm: one or two batch axes, got a of shape {tuple(a.shape)}")
        out, M, N, K = self._operands("bmm", a, b, out, a.ndim - 2)
        count = math.prod(out.shape[:-2])
        if self._nothing_to_multiply(out, M, N, K, count):
            return out
        cublas, handle = self._cublas()
        ta, tb, m, n, k, first, lda, second, ldb, ldc = self._gemm_args(cublas, "bmm", a, b, out, M, N, K)
        batches = [self._batch_strides(x) for x in (first, second, out)]
        alpha, beta = self._alpha_beta(a.dtype)
        single = B.host.float32 == a.dtype
        merged = []
        for outer, inner, so, si in batches:
            if outer == 1 or inner == 1 or so == si * inner:
                merged.append(so if inner == 1 else si)
        if len(merged) == 3:
            gemm = cublas.sgemmStridedBatched if single else cublas.dgemmStridedBatched
            gemm(handle, ta, tb, m, n, k, alpha, first.data.ptr, lda, merged[0], second.data.ptr, ldb, merged[1],
                 beta, out.data.ptr, ldc, merged[2], count)
            return out
        ptrs = self._gemm_pointers(a.dtype, count, batches[2][1],
                                   tuple((x.data.ptr, so, si) for x, (_, _, so, si) in zip((first, second, out), batches)))
        gemm = cublas.sgemmBatched if single else cublas.dgemmBatched
        p, step = ptrs.data.ptr, 8 * count
        gemm(handle, ta, tb, m, n, k, alpha, p, lda, p + step, ldb, beta, p + 2 * step, ldc, count)
        return out

    #: Bytes of pointer arrays :meth:`_gemm_pointers` keeps: past it, the least recently used
    #: that no captured graph reads make room.
    POINTER_CACHE_BYTES = 64 << 20

    def _gemm_pointers(self, dtype, count: int, inner: int, operands: tuple):
        """The three pointer arrays of a ``gemmBatched`` (A's, B's and C's ``count`` addresses,
        contiguous) for operands given as (address, outer stride, inner stride) each.

        They are a function of those numbers alone. Operands in a step memory's slab
        (:mod:`attn.fast.stepmem`) lie at the same addresses every step, so for them each
        distinct product's arrays are made by one ``gemm_pointers`` launch the first time it is
        met and kept: a steady-state step launches none (the first step in a new slab makes
        them; see :class:`attn.fast.graph.GraphedTrainStep`'s two eager steps). At most
        :attr:`POINTER_CACHE_BYTES` are kept: an eager run whose batches take many shapes makes
        room by dropping the least recently used, never one that a stream captured (a graph
        reads it at every replay). Elsewhere (addresses from the pool change from call to call),
        and for a product first met while a stream captures (which may not allocate), one
        launch fills a scratch buffer."""
        ptrs = key = None
        if all(in_slab(address) for address, _, _ in operands):
            key = (dtype, count, inner, operands)
            cache = self._scratch.get("gemm_pointer_arrays")
            if cache is None:
                cache = self._scratch["gemm_pointer_arrays"] = collections.OrderedDict()
            capturing = self.xp.cuda.get_current_stream().is_capturing()
            ptrs = cache.get(key)
            if ptrs is not None:
                cache.move_to_end(key)
                if capturing:
                    self._scratch.setdefault("gemm_pointers_captured", set()).add(key)
                return ptrs
            if capturing or not self._pointer_room(cache, 24 * count):   # a capture allocates nothing
                key = None
            else:
                with outside_step():
                    ptrs = self.xp.empty((3 * count,), dtype=B.host.uint64)
        if ptrs is None:
            ptrs = self._buffer("gemm_pointers", 3 * count, B.host.uint64)
        args = []
        for address, so, si in operands:
            args += [B.host.uint64(address), B.host.int64(so), B.host.int64(si)]
        threads = 128
        self._fn("gemm_pointers", dtype)((-(-count // threads),), (threads,),
                                         (ptrs, *args, B.host.int32(count), B.host.int32(inner)))
        if key is not None:                              # kept once made
            cache[key] = ptrs
            self._scratch["gemm_pointer_bytes"] = self._scratch.get("gemm_pointer_bytes", 0) + ptrs.nbytes
        return ptrs

    def _pointer_room(self, cache, nbytes: int) -> bool:
        """Whether ``nbytes`` more pointer arrays fit in :attr:`POINTER_CACHE_BYTES`, after
        dropping the least recently used ones no graph captured, as many as it takes."""
        kept = self._scratch.get("gemm_pointer_bytes", 0)
        captured = self._scratch.get("gemm_pointers_captured", set())
        if kept + nbytes > self.POINTER_CACHE_BYTES:
            for old in [k for k in cache if k not in captured]:
                kept -= cache.pop(old).nbytes
                if kept + nbytes <= self.POINTER_CACHE_BYTES:
                    break
            self._scratch["gemm_pointer_bytes"] = kept
        return kept + nbytes <= self.POINTER_CACHE_BYTES

    # ---- dropout, ReLU

    #: Dropout masks from the counter-based generator of ``dropout_hash`` (no draw, no mask in
    #: memory, one launch each way, and the fused epilogues apply them) instead of drawn from
    #: ``rng`` (a cuRAND draw and a comparison per site). On by default: the masks are keyed by
    #: (seed, step, site, index in the global batch), so the ranks of a data-parallel run draw
    #: what one process draws. Off: ``uniform >= p`` drawn from ``rng``, p exact.
    counter_dropout: bool = True

    def dropout_mask(self, rng, shape, p: float) -> Mask:
        """With :attr:`counter_dropout`, a mask drawn by no launch: ``keep`` is a
        :class:`HashedKeep`, the key of the counter-based generator of ``dropout_hash`` (from
        ``rng``'s seed, which the trainer makes from its seed and the step, and how many masks
        it has made: the site; on the host), which the forward and the backward both regenerate
        the mask from; then, as on NumPy, ``p`` is quantised to 1/65536 and kept units are scaled
        by the exact inverse. The counter is the element's index in the global batch: a
        data-parallel rank's ``rng`` says where its rows sit in it (``rng.place(shape)``:
        :class:`attn.training.distributed.RowsOf`); one process's index is the local one.
        Without it, drawn from ``rng``: ``uniform >= p`` (p exact)."""
        if not self.counter_dropout:
            return Mask(rng.random(shape, dtype="float32") >= p, 1.0 / (1.0 - p))
        thr = int(round(p * 65536))
        draws = self._draws.get(rng, 0)
        self._draws[rng] = draws + 1
        base, run, skip = rng.place(shape) if hasattr(rng, "place") else (0, 0, 0)
        return Mask(HashedKeep(self._seed_of(rng), draws, (base * GOLDEN) & _M64, thr, tuple(shape), run, skip),
                    65536.0 / (65536 - thr))           # counter i -> base + i

    def _seed_of(self, rng):
        """``rng``'s seed on the device, where the dropout kernels read it: ``rng.device_seed``
        where it has one (a captured step's: a buffer the graph reads, refreshed before every
        replay), else a one-element array made once per ``rng`` (one host-to-device copy). The
        trainer makes an ``rng`` a step: the first time one is met inside a step memory its array
        comes from the slab, for that step only (nothing from the pool); one met again in another
        step (the benchmark's, which keeps one), or outside any step, gets one kept for good."""
        seed = getattr(rng, "device_seed", None)
        if seed is None:
            step = step_token()
            kept = self._seeds.get(rng)
            if kept is not None and (kept[0] is None or kept[0] == step):
                return kept[1]
            host = B.host.array([rng.seed & _M64], dtype=B.host.uint64)
            if step is None or kept is not None:
                with outside_step():
                    kept = self._seeds[rng] = (None, self.xp.asarray(host))
            else:
                kept = self._seeds[rng] = (step, self.xp.asarray(host))
            seed = kept[1]
        return seed

    def _no_seed(self):
        """The seed given to a fused kernel that drops nothing (thr 0: never read)."""
        z = self._scratch.get("no_seed")
        if z is None:
            with outside_step():
                z = self._scratch["no_seed"] = self.xp.zeros((1,), dtype=B.host.uint64)
        return z

    def _dropout_args(self, m):
        """(seed, site, offset, thr, scale) of mask ``m`` (None: no dropout) as the fused kernels take them."""
        if m is None:
            return self._no_seed(), B.host.uint64(0), B.host.uint64(0), B.host.uint32(0), 1.0
        k = m.keep
        return k.seed, B.host.uint64(k.site), B.host.uint64(k.offset), B.host.uint32(k.thr), m.scale

    @staticmethod
    def _rows(m, where):
        """A mask the fused epilogues can regenerate from the flat index row * D + j: one run (its
        rows are contiguous in the global batch, as (B*T, D) masks are)."""
        if m is not None and m.keep.skip:
            raise ValueError(f"CupyOps.{where}: the mask of shape {m.keep.shape} lies in runs of {m.keep.run} "
                             "elements in the global batch; the fused kernels take a row-major one (B*T, D)")

    def dropout_(self, x, m: Mask):
        if isinstance(m.keep, HashedKeep):
            return self._dropout_hash(x, x, m, "dropout_")
        self._contiguous("dropout_", x=x, keep=m.keep)
        self._elementwise("dropout_fwd", x.dtype, x.size, x, m.keep, self._scalar(m.scale, x.dtype))
        return x

    def dropout_backward(self, d, m: Mask):
        if isinstance(m.keep, HashedKeep):
            return self._dropout_hash(self.xp.empty_like(d), d, m, "dropout_backward")
        self._contiguous("dropout_backward", d=d, keep=m.keep)
        out = self.xp.empty_like(d)
        self._elementwise("dropout_bwd", d.dtype, d.size, d, m.keep, self._scalar(m.scale, d.dtype), out)
        return out

    def _dropout_hash(self, out, x, m: Mask, where):
        k = m.keep
        if tuple(x.shape) != k.shape:
            raise ValueError(f"CupyOps.{where}: the mask was drawn for shape {k.shape}, the array is "
                             f"{tuple(x.shape)}")
        self._contiguous(where, out=out, x=x)
        seed, site, offset, thr, scale = self._dropout_args(m)
        self._elementwise("dropout_hash", x.dtype, x.size, out, x, seed, site, offset, thr,
                          self._scalar(scale, x.dtype), B.host.int64(max(k.run, 1)), B.host.int64(k.skip))
        return out

    def bias_relu_dropout_(self, a, bias, m):
        """As :meth:`attn.fast.ops._Ops.bias_relu_dropout_`, in one ``bias_relu_drop`` launch
        where the mask is this class's own or there is none."""
        if m is not None and not isinstance(m.keep, HashedKeep):
            return super().bias_relu_dropout_(a, bias, m)
        if not a.flags.c_contiguous or a.ndim != 2:
            raise ValueError(f"CupyOps.bias_relu_dropout_: a must be a contiguous (N, F) array, got shape "
                             f"{tuple(a.shape)} strides {a.strides}")
        if m is not None and m.keep.shape != tuple(a.shape):
            raise ValueError(f"CupyOps.bias_relu_dropout_: the mask was drawn for shape {m.keep.shape}, "
                             f"a is {tuple(a.shape)}")
        self._rows(m, "bias_relu_dropout_")
        seed, site, offset, thr, scale = self._dropout_args(m)
        threads = 256
        self._fn("bias_relu_drop", a.dtype)(
            _grid(a.size, threads), (threads,),
            (a, self.xp.ascontiguousarray(bias), seed, site, offset, thr, self._scalar(scale, a.dtype),
             B.host.int64(a.size), B.host.int32(a.shape[1])))
        return a

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

    #: Most blocks of the gradient norm's first stage (``adam_flat`` sums their partials in
    #: every block) and of the flat update's grid-stride loop.
    NORM_BLOCKS, ADAM_BLOCKS = 256, 4096

    def adam_flat_(self, p, g, m, v, count, schedule, max_norm: float = 0.0):
        """Adam over flat arrays (the whole arena) in one launch; with ``max_norm > 0`` the
        gradient's global norm first, by one ``sumsq_partial`` launch, and the clipping decided
        inside ``adam_flat`` (no host synchronisation). ``g`` is not written. ``count`` (a
        one-element int64 device array) is the number of steps taken, which the kernel reads and
        advances; ``schedule`` is ``(lr_factor, fixed_lr or None, d_model, warmup_steps, b1, b2,
        eps)``, from which it makes the step's learning rate and bias corrections."""
        self._contiguous("adam_flat_", p=p, g=g, m=m, v=v)
        if count.shape != (1,) or count.dtype != B.host.int64:
            raise ValueError(f"CupyOps.adam_flat_: count must be a one-element int64 device array, got shape "
                             f"{tuple(count.shape)} {count.dtype}")
        lr_factor, fixed_lr, d_model, warmup, b1, b2, eps = schedule
        n, threads = p.size, 256
        partial = self._buffer("norm_partials", self.NORM_BLOCKS, B.host.float64)
        n_partial = 0
        if max_norm > 0:
            n_partial = max(1, min(self.NORM_BLOCKS, -(-n // (threads * 16))))
            self._fn("sumsq_partial", g.dtype)((n_partial,), (threads,), (g, partial, B.host.int64(n)),
                                               shared_mem=threads * 8)
        f64 = B.host.float64
        self._fn("adam_flat", p.dtype)(
            _grid(n, threads, self.ADAM_BLOCKS), (threads,),
            (p, m, v, g, partial, B.host.int32(n_partial), f64(max_norm), count, self._ticket("adam_ticket"),
             f64(lr_factor), f64(0.0 if fixed_lr is None else fixed_lr), B.host.int32(fixed_lr is not None),
             f64(d_model), f64(warmup), f64(b1), f64(b2), f64(eps), B.host.int64(n)), shared_mem=threads * 8)

    # ---- the products' precision (attn.precision)

    def round_bf16_(self, src, dst):
        """dst (uint16, src's size) <- the bfloat16 patterns nearest to src (float32), in one
        launch (``round_bf16``; :func:`attn.precision.bf16_bits` is the same rounding on any
        array): the bf16 copy of the fp32 master weights that bf16 products with ``CUDA_R_16BF``
        operands read (:meth:`Bf16CupyOps.prepare_weights`)."""
        if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.size != dst.size \
                or dst.dtype != B.host.uint16:
            raise ValueError(f"CupyOps.round_bf16_: contiguous src and a uint16 dst of its size are needed, got "
                             f"{tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
        self._elementwise("round_bf16", src.dtype, src.size, src, dst)
        return dst

    def _ticket(self, name):
        """A one-element counter a kernel's last block sets back to 0: zeroed once."""
        c = self._scratch.get(name)
        if c is None:
            with outside_step():
                c = self._scratch[name] = self.xp.zeros((1,), dtype=B.host.uint32)
        return c


def block_size_for(n: int) -> int:
    """Exposed for tests: the block size a row of ``n`` elements gets."""
    return _block(n)


assert _block(1) == 32 and _block(512) == 256 and _block(37000, 512) == 512 and math.log2(_block(100)) % 1 == 0

# --------------------------------------------------------------------------- decoding
#
# The kernels of a cached decoding step on CuPy (:mod:`attn.fast.decoding`): one position for
# every row, so each launch is small and the step is bound by how many there are. Per decoder
# layer a step is three products and one kernel per sub-layer (plus the feed-forward's ReLU):
# the single-query attention (the new key and value written into the cache, scores, softmax and
# the weighted sum in one launch), and the residual sum with the next layer norm in one launch.
# They join the module's source and twins below, so NVRTC compiles them with the others.

_DECODE_EMBED = r"""
// The decoder's input at one position, one block per row: x[r] <- table[ids[r]] * scale + pe;
// with norm = 1 (pre-norm) also out[r] <- gamma * xhat + beta, the first sub-layer's layer norm.
template <typename T>
__global__ void decode_embed(const long long* ids, const T* table, const T* pe, T scale, T* x, T* out,
                             const T* gamma, const T* beta, int D, T eps, int norm) {
    extern __shared__ unsigned char smem[];
    T* sh = reinterpret_cast<T*>(smem);
    long long r = blockIdx.x;
    const T* er = table + ids[r] * D;
    T* xr = x + r * D;
    T sum = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        T v = er[j] * scale + pe[j];
        xr[j] = v;
        sum += v;
    }
    if (!norm) return;
    T mean = block_sum(sum, sh) / T(D);
    T q = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) { T c = xr[j] - mean; q += c * c; }
    T rs = T(1) / sqrt(block_sum(q, sh) / T(D) + eps);
    for (int j = threadIdx.x; j < D; j += blockDim.x) out[r * D + j] = (xr[j] - mean) * rs * gamma[j] + beta[j];
}
"""


def _row_norm_np(v, gamma, beta, eps):
    """gamma * (v - mean) / sqrt(var + eps) + beta over the rows of v (N, D), as the kernels do."""
    np = B.host
    dt = v.dtype.type
    D = v.shape[1]
    c = v - (v.sum(axis=1) / dt(D))[:, None]
    r = dt(1) / np.sqrt((c * c).sum(axis=1) / dt(D) + dt(eps))
    return c * r[:, None] * gamma + beta


def decode_embed_np(launch, ids, table, pe, scale, x, out, gamma, beta, D, eps, norm):
    """NumPy twin of ``decode_embed`` (one block per row: n = the grid's size)."""
    _check_block_reduction(launch, x.itemsize)
    n, D = launch.blocks, int(D)
    idv = _view(ids, (n,), (1,))
    if idv.size and (idv.min() < 0 or (idv.max() + 1) * D > table.size):
        raise IndexError(f"decode_embed: a token id outside the table of {table.size // D} rows")
    xv = _view(x, (n, D), (D, 1))
    xv[...] = table.reshape(-1, D)[idv] * scale + _view(pe, (D,), (1,))
    if norm:
        _view(out, (n, D), (D, 1))[...] = _row_norm_np(xv, _view(gamma, (D,), (1,)), _view(beta, (D,), (1,)), eps)


_ADD_NORM = r"""
// A decoder sub-layer's epilogue, one block per row: v = (s + bias) + x (the sub-layer's output
// projection without its bias, plus the residual); x <- v, then out <- gamma * xhat(v) + beta.
// Pre-norm passes the next layer norm and its input buffer as out; post-norm passes out = x (the
// norm's output is the next residual). A thread reads and writes only its own elements of x and
// out, so out may be x.
template <typename T>
__global__ void add_norm(T* x, const T* s, const T* bias, T* out, const T* gamma, const T* beta, int D, T eps) {
    extern __shared__ unsigned char smem[];
    T* sh = reinterpret_cast<T*>(smem);
    long long r = blockIdx.x;
    T* xr = x + r * D;
    const T* sr = s + r * D;
    T sum = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        T v = (sr[j] + bias[j]) + xr[j];
        xr[j] = v;
        sum += v;
    }
    T mean = block_sum(sum, sh) / T(D);
    T q = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) { T c = xr[j] - mean; q += c * c; }
    T rs = T(1) / sqrt(block_sum(q, sh) / T(D) + eps);
    for (int j = threadIdx.x; j < D; j += blockDim.x) out[r * D + j] = (xr[j] - mean) * rs * gamma[j] + beta[j];
}
"""


def add_norm_np(launch, x, s, bias, out, gamma, beta, D, eps):
    """NumPy twin of ``add_norm`` (one block per row: n = the grid's size; ``out`` may be ``x``)."""
    _check_block_reduction(launch, x.itemsize)
    n, D = launch.blocks, int(D)
    xv = _view(x, (n, D), (D, 1))
    v = (_view(s, (n, D), (D, 1)) + _view(bias, (D,), (1,))) + xv
    xv[...] = v
    _view(out, (n, D), (D, 1))[...] = _row_norm_np(v, _view(gamma, (D,), (1,)), _view(beta, (D,), (1,)), eps)


_ONE_QUERY_ATTENTION = r"""
// Attention of one query per row and head -- a decoding step -- one block each (blockIdx.x = r * H + h).
// The query is q_in[r * q_row + h * Dh + d] + q_bias[h * Dh + d] (1/sqrt(d_k) folded into both). With
// self_attn = 1 the row's new key and value come next in q_in (columns D + ... and 2D + ..., plus their
// biases) and are first written at position Tk - 1 of the cache. Keys and values are read at
// k[(r / g) * s_row + h * s_head + j * s_pos + d]: g consecutive rows share one copy (a sentence's beams
// attend to its one cross-attention copy). Then w[r * w_row + h * w_head + j] = softmax_j(q . k_j + bias[r *
// bias_row + j]) (bias 0 or the most negative finite value; none with has_bias = 0; a row with no allowed
// key gets zero weights) and ctx[r, h * Dh + d] = sum_j w_j v_j, ctx (n, H * Dh). Shared memory: blockDim.x
// values for the reductions, then the query's Dh.
template <typename T>
__global__ void one_query_attention(const T* q_in, const T* q_bias, long long q_row, int self_attn,
                                    T* k, T* v, long long s_row, long long s_head, long long s_pos, int g,
                                    const T* bias, long long bias_row, int has_bias,
                                    T* w, long long w_row, long long w_head, T* ctx, int H, int Dh, int Tk, T lowest) {
    extern __shared__ unsigned char smem[];
    T* sh = reinterpret_cast<T*>(smem);
    T* qs = sh + blockDim.x;
    long long r = blockIdx.x / H;
    int h = blockIdx.x % H;
    int D = H * Dh;
    const T* qr = q_in + r * q_row + h * Dh;
    const T* qb = q_bias + h * Dh;
    T* kr = k + (r / g) * s_row + h * s_head;
    T* vr = v + (r / g) * s_row + h * s_head;
    for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
        qs[d] = qr[d] + qb[d];
        if (self_attn) {
            kr[(long long)(Tk - 1) * s_pos + d] = qr[D + d] + qb[D + d];
            vr[(long long)(Tk - 1) * s_pos + d] = qr[2 * D + d] + qb[2 * D + d];
        }
    }
    __syncthreads();
    T* wr = w + r * w_row + h * w_head;
    const T* br = bias + r * bias_row;
    T mx = lowest, allowed = 0;
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) {
        T sc = 0;
        for (int d = 0; d < Dh; ++d) sc += qs[d] * kr[j * s_pos + d];
        if (has_bias) { T bj = br[j]; sc += bj; if (bj == T(0)) allowed = 1; } else allowed = 1;
        wr[j] = sc;
        if (sc > mx) mx = sc;
    }
    mx = block_max(mx, sh);
    T any = block_sum(allowed, sh);
    T total = 0;
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) { T e = exp(wr[j] - mx); wr[j] = e; total += e; }
    total = block_sum(total, sh);
    T scale = any > T(0) ? T(1) / total : T(0);
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) wr[j] *= scale;
    __syncthreads();
    for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
        T acc = 0;
        for (int j = 0; j < Tk; ++j) acc += wr[j] * vr[j * s_pos + d];
        ctx[r * D + h * Dh + d] = acc;
    }
}
"""


def one_query_attention_np(launch, q_in, q_bias, q_row, self_attn, k, v, s_row, s_head, s_pos, g, bias, bias_row,
                           has_bias, w, w_row, w_head, ctx, H, Dh, Tk, lowest):
    """NumPy twin of ``one_query_attention`` (one block per row and head: n = the grid's size / H)."""
    np = B.host
    _check_block_reduction(launch, q_in.itemsize)
    H, Dh, Tk, g = int(H), int(Dh), int(Tk), int(g)
    if launch.blocks % H or launch.shared_mem < (launch.threads + Dh) * q_in.itemsize:
        raise ValueError(f"{launch.name}: {launch.blocks} blocks for {H} heads, {launch.shared_mem} bytes of "
                         f"shared memory for {launch.threads} threads and Dh {Dh}")
    n = launch.blocks // H
    if n % g:
        raise ValueError(f"{launch.name}: {n} rows are not whole groups of {g}")
    m, D = n // g, H * Dh
    dt = q_in.dtype.type
    q = _view(q_in, (n, H, Dh), (q_row, Dh, 1)) + _view(q_bias, (H, Dh), (Dh, 1))
    kv, vv = (_view(a, (m, H, Tk, Dh), (s_row, s_head, s_pos, 1)) for a in (k, v))
    if self_attn:                                      # each row its own cache: groups of one
        if g != 1:
            raise ValueError(f"{launch.name}: self-attention writes each row's own cache, got groups of {g}")
        new = _view(q_in, (n, 3, H, Dh), (q_row, D, Dh, 1))[:, 1:] + _view(q_bias, (3, H, Dh), (D, Dh, 1))[1:]
        kv[:, :, Tk - 1] = new[:, 0]
        vv[:, :, Tk - 1] = new[:, 1]
    qg = q.reshape(m, g, H, Dh).transpose(0, 2, 1, 3)                                       # (m, H, g, Dh)
    s = qg @ kv.swapaxes(-1, -2)                                                           # (m, H, g, Tk)
    if has_bias:
        b = _view(bias, (m, g, Tk), (g * bias_row, bias_row, 1))[:, None]                   # (m, 1, g, Tk)
        s += b
        allowed = (b == 0).any(axis=-1)
    else:
        allowed = np.ones((m, 1, g), dtype=bool)
    s -= np.maximum(s.max(axis=-1), dt(lowest))[..., None] if Tk else 0
    np.exp(s, out=s)
    total = s.sum(axis=-1)
    s *= np.where(allowed, dt(1) / np.where(allowed, total, 1), dt(0))[..., None]
    _view(w, (m, g, H, Tk), (g * w_row, w_row, w_head, 1))[...] = s.transpose(0, 2, 1, 3)
    out = (s @ vv).transpose(0, 2, 1, 3)                                                    # (m, g, H, Dh)
    _view(ctx, (n, D), (D, 1))[...] = out.reshape(n, D)


_LOG_SOFTMAX_ROWS = r"""
// Log-probabilities of each row of x (n, V), one block per row: out <- (x - max) - log(sum(exp(x - max))).
// out may be x.
template <typename T>
__global__ void log_softmax_rows(const T* x, T* out, int V) {
    extern __shared__ unsigned char smem[];
    T* sh = reinterpret_cast<T*>(smem);
    long long r = blockIdx.x;
    const T* xr = x + r * V;
    T mx = xr[0];
    for (int j = threadIdx.x; j < V; j += blockDim.x) if (xr[j] > mx) mx = xr[j];
    mx = block_max(mx, sh);
    T total = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) total += exp(xr[j] - mx);
    T lse = log(block_sum(total, sh));
    for (int j = threadIdx.x; j < V; j += blockDim.x) out[r * V + j] = (xr[j] - mx) - lse;
}
"""


def log_softmax_rows_np(launch, x, out, V):
    """NumPy twin of ``log_softmax_rows`` (one block per row: n = the grid's size)."""
    np = B.host
    _check_block_reduction(launch, x.itemsize)
    n, V = launch.blocks, int(V)
    s = _view(x, (n, V), (V, 1)).copy()
    s -= s.max(axis=1, keepdims=True)
    lse = np.log(np.exp(s).sum(axis=1, keepdims=True))
    _view(out, (n, V), (V, 1))[...] = s - lse


_GREEDY_PICK = r"""
// Greedy decoding's choice, one block per row of logp (n, V): the most probable token other than ban0 and
// ban1 (PAD and BOS; the lowest id among equals, as argmax picks). info[r] <- its id, info[n + r] <- its
// log-probability (as doubles: the host reads both in one transfer), tokens[r] <- its id (the next input).
// Shared memory: blockDim.x values and blockDim.x ints.
template <typename T>
__global__ void greedy_pick(const T* logp, int V, int ban0, int ban1, double* info, long long n,
                            long long* tokens) {
    extern __shared__ unsigned char smem[];
    T* sv = reinterpret_cast<T*>(smem);
    int* si = reinterpret_cast<int*>(sv + blockDim.x);
    long long r = blockIdx.x;
    const T* row = logp + r * V;
    T best = 0;
    int bi = -1;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        if (j == ban0 || j == ban1) continue;
        if (bi < 0 || row[j] > best) { best = row[j]; bi = j; }
    }
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            int oi = si[threadIdx.x + s], mi = si[threadIdx.x];
            T ov = sv[threadIdx.x + s], mv = sv[threadIdx.x];
            if (oi >= 0 && (mi < 0 || ov > mv || (ov == mv && oi < mi))) { sv[threadIdx.x] = ov; si[threadIdx.x] = oi; }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        int id = si[0];
        info[r] = (double)id;
        info[n + r] = (double)row[id];
        tokens[r] = id;
    }
}
"""


def greedy_pick_np(launch, logp, V, ban0, ban1, info, n, tokens):
    """NumPy twin of ``greedy_pick`` (one block per row: the grid's size is n)."""
    np = B.host
    t = launch.block[0]
    if t & (t - 1) or launch.shared_mem < t * (logp.itemsize + 4):
        raise ValueError(f"{launch.name}: a power-of-two block and {t} values and ints of shared memory are "
                         f"needed, got {launch.block} and {launch.shared_mem} bytes")
    n, V = int(n), int(V)
    if launch.blocks != n:
        raise ValueError(f"{launch.name}: {launch.blocks} blocks for {n} rows")
    x = _view(logp, (n, V), (V, 1)).copy()
    x[:, [int(ban0), int(ban1)]] = -np.inf
    ids = x.argmax(axis=1)
    iv = _view(info, (2, n), (n, 1))
    iv[0] = ids
    iv[1] = np.take_along_axis(x, ids[:, None], axis=1)[:, 0]
    _view(tokens, (n,), (1,))[...] = ids


_BEAM_CANDIDATES = r"""
// The best of (v, i) over the block, in the order (v descending, i ascending); i < 0 is no entry, NaN never
// wins. Every thread gets the result. sv and si hold blockDim.x pairs (a power of two).
__device__ void best_pair(double& v, long long& i, double* sv, long long* si) {
    sv[threadIdx.x] = v;
    si[threadIdx.x] = i;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            int o = threadIdx.x + s;
            if (si[o] >= 0 && (si[threadIdx.x] < 0 || sv[o] > sv[threadIdx.x] ||
                               (sv[o] == sv[threadIdx.x] && si[o] < si[threadIdx.x]))) {
                sv[threadIdx.x] = sv[o];
                si[threadIdx.x] = si[o];
            }
        }
        __syncthreads();
    }
    v = sv[0];
    i = si[0];
    __syncthreads();
}

// Whether (v, i) comes after (pv, pi) in the order of best_pair (everything does when pi < 0).
__device__ __forceinline__ bool after(double v, long long i, double pv, long long pi) {
    return pi < 0 || v < pv || (v == pv && i > pi);
}

// Beam search's candidates, one block per live sentence s, whose W beams are rows s * W .. s * W + W - 1 of
// logp (n, V): each beam's c most probable tokens other than ban0 and ban1, scored beam_scores[row] + logp
// (in double), then the C best of those W * c into info (2, n / W, C): info[0][s][k] the score, info[1][s][k]
// the id w * V + v (as a double), best first. Each round picks the best entry after the last one picked in the
// order (score descending, id ascending), so equal scores go to the lower id. Shared memory: blockDim.x
// (double, long long) pairs for the reductions, then the W * c candidates' pairs.
template <typename T>
__global__ void beam_candidates(const T* logp, const double* beam_scores, int V, int W, int c, int C, int ban0,
                                int ban1, double* info) {
    extern __shared__ unsigned char smem[];
    double* sv = reinterpret_cast<double*>(smem);
    long long* si = reinterpret_cast<long long*>(sv + blockDim.x);
    double* cv = reinterpret_cast<double*>(si + blockDim.x);
    long long* ci = reinterpret_cast<long long*>(cv + W * c);
    long long sent = blockIdx.x, n_sent = gridDim.x;
    for (int w = 0; w < W; ++w) {
        long long row = sent * W + w;
        const T* lr = logp + row * V;
        double pv = 0;
        long long pi = -1;
        for (int k = 0; k < c; ++k) {
            double bv = 0;
            long long bi = -1;
            for (int j = threadIdx.x; j < V; j += blockDim.x) {
                if (j == ban0 || j == ban1) continue;
                double x = (double)lr[j];
                if (!after(x, j, pv, pi)) continue;
                if (bi < 0 || x > bv || (x == bv && j < bi)) { bv = x; bi = j; }
            }
            best_pair(bv, bi, sv, si);
            if (threadIdx.x == 0) {
                cv[w * c + k] = beam_scores[row] + bv;
                ci[w * c + k] = (long long)w * V + bi;
            }
            pv = bv;
            pi = bi;
        }
    }
    __syncthreads();
    double pv = 0;
    long long pi = -1;
    for (int k = 0; k < C; ++k) {
        double bv = 0;
        long long bi = -1;
        for (int m = threadIdx.x; m < W * c; m += blockDim.x) {
            if (!after(cv[m], ci[m], pv, pi)) continue;
            if (bi < 0 || cv[m] > bv || (cv[m] == bv && ci[m] < bi)) { bv = cv[m]; bi = ci[m]; }
        }
        best_pair(bv, bi, sv, si);
        if (threadIdx.x == 0) {
            info[sent * C + k] = bv;
            info[n_sent * C + sent * C + k] = (double)bi;
        }
        pv = bv;
        pi = bi;
    }
}
"""


def _best_first(values, ids, k):
    """The first k of each row of (values, ids) in the order (value descending, id ascending), NaN last."""
    np = B.host
    order = np.lexsort((ids, -values), axis=-1)[..., :k]
    return np.take_along_axis(values, order, -1), np.take_along_axis(ids, order, -1)


def beam_candidates_np(launch, logp, beam_scores, V, W, c, C, ban0, ban1, info):
    """NumPy twin of ``beam_candidates`` (one block per sentence: the grid's size is the sentences)."""
    np = B.host
    t = launch.block[0]
    V, W, c, C = int(V), int(W), int(c), int(C)
    if t & (t - 1) or launch.shared_mem < 16 * (t + W * c):
        raise ValueError(f"{launch.name}: a power-of-two block and {16 * (t + W * c)} bytes of shared memory are "
                         f"needed, got {launch.block} and {launch.shared_mem}")
    if not (0 < c <= V - 2 and 0 < C <= W * c):
        raise ValueError(f"{launch.name}: c {c} must leave out the two banned ids of V {V}, and C {C} be at most W * c")
    m = launch.blocks
    x = _view(logp, (m * W, V), (V, 1)).astype(np.float64)
    x[:, [int(ban0), int(ban1)]] = np.nan                                   # never picked
    ids = np.broadcast_to(np.arange(V), x.shape)
    top, top_ids = _best_first(x, ids, c)                                   # (m * W, c)
    cand = (_view(beam_scores, (m * W, 1), (1, 0)) + top).reshape(m, W * c)
    flat = (np.arange(W)[None, :, None] * V + top_ids.reshape(m, W, c)).reshape(m, W * c)
    s, f = _best_first(cand, flat, C)
    iv = _view(info, (2, m, C), (m * C, C, 1))
    iv[0], iv[1] = s, f


_GATHER_PREFIX = r"""
// Beam search's reorder of the key/value cache: row r of dst (rows of `row` elements, each `segs` segments of
// `seg` elements: a layer's keys or values of one head) receives the first `len` elements of every segment of row
// index[r] of src (the positions decoded so far, not the room after them). One block per (row, segment).
template <typename T>
__global__ void gather_prefix(const T* src, T* dst, const long long* index, long long row, int segs, long long seg,
                              long long len) {
    long long r = blockIdx.x / segs, b = blockIdx.x % segs;
    const T* from = src + index[r] * row + b * seg;
    T* to = dst + r * row + b * seg;
    for (long long i = threadIdx.x; i < len; i += blockDim.x) to[i] = from[i];
}
"""


def gather_prefix_np(launch, src, dst, index, row, segs, seg, len):
    """NumPy twin of ``gather_prefix`` (one block per row and segment: the grid's size is rows * segs)."""
    row, segs, seg, len = int(row), int(segs), int(seg), int(len)
    if launch.blocks % segs or not 0 <= len <= seg or segs * seg > row:
        raise ValueError(f"{launch.name}: {launch.blocks} blocks for {segs} segments of {seg} ({len} copied) in rows "
                         f"of {row}")
    n = launch.blocks // segs
    idx = _view(index, (n,), (1,))
    if n and (idx.min() < 0 or (idx.max() + 1) * row > src.size):
        raise IndexError(f"{launch.name}: a row index outside the source's {src.size // row} rows")
    if n and len:
        whole = _view(src, (src.size // row, segs, len), (row, seg, 1))
        _view(dst, (n, segs, len), (row, seg, 1))[...] = whole[idx]


# The decoding kernels join the module's source and its table of twins (after the training step's,
# so that the names and launch code above do not move).
_SOURCE += "".join([_DECODE_EMBED, _ADD_NORM, _ONE_QUERY_ATTENTION, _LOG_SOFTMAX_ROWS, _GREEDY_PICK, _BEAM_CANDIDATES,
                     _GATHER_PREFIX])
NUMPY_TWINS.update({"decode_embed": decode_embed_np, "add_norm": add_norm_np,
                    "one_query_attention": one_query_attention_np, "log_softmax_rows": log_softmax_rows_np,
                    "greedy_pick": greedy_pick_np, "beam_candidates": beam_candidates_np,
                    "gather_prefix": gather_prefix_np})
_KERNELS = tuple(NUMPY_TWINS)
NAME_EXPRESSIONS = tuple(f"{k}<{t}>" for k in _KERNELS for t in _CTYPES.values())

# --------------------------------------------------------------------------- pointers for cuBLAS

_GEMM_POINTERS = r"""
// The three pointer arrays of a batched GEMM (cublas<t>gemmBatched) over a batch of two levels,
// outer x inner (an attention's batch x heads): for each operand j (0, 1, 2: cuBLAS's A, B, C) and
// batch entry i = o * inner + n, ptrs[j * count + i] = base_j + (o * outer_j + n * inner_j) elements of T
// (the strides may be negative). One thread per batch entry.
template <typename T>
__global__ void gemm_pointers(unsigned long long* ptrs, unsigned long long a, long long a_outer, long long a_inner,
                              unsigned long long b, long long b_outer, long long b_inner, unsigned long long c,
                              long long c_outer, long long c_inner, int count, int inner) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    long long o = i / inner, n = i % inner;
    const unsigned long long size = sizeof(T);
    ptrs[i] = a + size * (unsigned long long)(o * a_outer + n * a_inner);
    ptrs[count + i] = b + size * (unsigned long long)(o * b_outer + n * b_inner);
    ptrs[2 * (long long)count + i] = c + size * (unsigned long long)(o * c_outer + n * c_inner);
}
"""


def gemm_pointers_np(launch, ptrs, a, a_outer, a_inner, b, b_outer, b_inner, c, c_outer, c_inner, count, inner):
    """NumPy twin of ``gemm_pointers`` (``launch.name`` says T: float or double); the addresses
    are computed modulo 2**64, as the kernel's unsigned arithmetic does."""
    np = B.host
    count, inner = int(count), int(inner)
    _check_threads(launch, count, "batch entries")
    if inner < 1 or count % inner:
        raise ValueError(f"{launch.name}: {count} batch entries are not a whole number of {inner} inner entries")
    size = 8 if "double" in launch.name else 4
    i = np.arange(count, dtype=np.int64)
    o, n = i // inner, i % inner
    out = _view(ptrs, (3, count), (count, 1))
    for j, (base, so, si) in enumerate(((a, a_outer, a_inner), (b, b_outer, b_inner), (c, c_outer, c_inner))):
        offs = (o * int(so) + n * int(si)) * size                        # bytes, int64 (|offsets| < 2**63)
        out[j] = (offs.astype(np.uint64) + np.uint64(int(base)))         # modulo 2**64, as the kernel


_SOURCE += _GEMM_POINTERS
NUMPY_TWINS["gemm_pointers"] = gemm_pointers_np
_KERNELS = tuple(NUMPY_TWINS)
NAME_EXPRESSIONS = tuple(f"{k}<{t}>" for k in _KERNELS for t in _CTYPES.values())


_ROUND_BF16 = r"""
// --precision bf16: dst[i] = the bfloat16 nearest to src[i], as its 16-bit pattern (the top half of a
// float32). Round to nearest, ties to even, on the bits (attn.precision, CUDA's __float2bfloat16_rn):
// add 0x7FFF plus the lowest kept bit and keep the top half; a carry goes into the exponent, which
// rounds past bf16's largest finite value to infinity. A NaN keeps its sign and gets the quiet bit,
// so that dropping the low half cannot make it an infinity. A double is first made a float.
template <typename T>
__global__ void round_bf16(const T* src, unsigned short* dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned int u = __float_as_uint((float)src[i]);
        if ((u & 0x7FFFFFFFu) > 0x7F800000u) dst[i] = (unsigned short)((u | 0x00400000u) >> 16);
        else dst[i] = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}
"""


def round_bf16_np(launch, src, dst, n):
    """NumPy twin of ``round_bf16``."""
    np = B.host
    n = int(n)
    _view(dst, (n,), (1,))[...] = bf16_bits(_view(src, (n,), (1,)).astype(np.float32))


# The precision kernel joins last (the kernels above keep their names and order).
_SOURCE += _ROUND_BF16
NUMPY_TWINS["round_bf16"] = round_bf16_np
_KERNELS = tuple(NUMPY_TWINS)
NAME_EXPRESSIONS = tuple(f"{k}<{t}>" for k in _KERNELS for t in _CTYPES.values())


_ROUND_BF16_GATHER = r"""
// --precision bf16, a product's operand that is not a parameter: the bfloat16 copy of a strided
// view of up to four axes (n0, n1, n2, n3) with element strides (s0, s1, s2, s3), written as
// n0 * n1 matrices (n2, n3) of contiguous rows, each starting `per` elements after the one
// before (per >= n2 * n3; what lies between is not written): what cuBLAS's bf16 GEMMs read.
// The rounding is round_bf16's.
template <typename T>
__global__ void round_bf16_gather(const T* src, unsigned short* dst, long long n, long long n1, long long n2,
                                  long long n3, long long s0, long long s1, long long s2, long long s3,
                                  long long per) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long i3 = i % n3, t = i / n3;
        long long i2 = t % n2;
        t /= n2;
        long long i1 = t % n1, i0 = t / n1;
        unsigned int u = __float_as_uint((float)src[i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3]);
        unsigned short r;
        if ((u & 0x7FFFFFFFu) > 0x7F800000u) r = (unsigned short)((u | 0x00400000u) >> 16);
        else r = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        dst[(i0 * n1 + i1) * per + i2 * n3 + i3] = r;
    }
}
"""


def round_bf16_gather_np(launch, src, dst, n, n1, n2, n3, s0, s1, s2, s3, per):
    """NumPy twin of ``round_bf16_gather``."""
    np = B.host
    n, n1, n2, n3, per = (int(v) for v in (n, n1, n2, n3, per))
    if n % (n1 * n2 * n3 or 1) or per < n2 * n3:
        raise ValueError(f"{launch.name}: {n} elements are not a whole number of ({n1}, {n2}, {n3}) blocks, or per "
                         f"{per} < {n2} x {n3}")
    n0 = n // (n1 * n2 * n3) if n else 0
    if n == 0:
        return
    x = _view(src, (n0, n1, n2, n3), (s0, s1, s2, s3)).astype(np.float32)
    _view(dst, (n0, n1, n2, n3), (n1 * per, per, n3, 1))[...] = bf16_bits(x)


_SOURCE += _ROUND_BF16_GATHER
NUMPY_TWINS["round_bf16_gather"] = round_bf16_gather_np
_KERNELS = tuple(NUMPY_TWINS)
NAME_EXPRESSIONS = tuple(f"{k}<{t}>" for k in _KERNELS for t in _CTYPES.values())


class Bf16CupyOps(CupyOps):
    """:class:`CupyOps` whose products read bfloat16 operands (``attn-train --precision bf16``):
    cuBLAS's ``gemmEx`` family with ``CUDA_R_16BF`` A and B, a float32 C and float32 compute
    (``CUBLAS_COMPUTE_32F``): the tensor cores' bf16 products, summed in float32.

    Where an operand is a parameter (a view of the model's arena), the product reads it from
    the bf16 copy of the master weights that :meth:`prepare_weights` makes at every forward, in
    one launch, at the same offsets and strides; any other operand (an activation, a gradient)
    is copied into bf16 first by one ``round_bf16_gather`` launch (contiguous matrices, each
    batch entry starting on 16 bytes). The rounding is :func:`attn.precision.round_bf16`'s, so
    the NumPy twin (``_Ops(numpy, "bf16")``: operands rounded, float32 products) computes
    the same numbers up to the order of the float32 sums."""

    precision = "bf16"

    #: A rounded batch's matrices start this many bf16 elements apart at least (16 bytes).
    BATCH_ALIGN = 8

    def prepare_weights(self, params, into=None):
        """The bf16 copy of ``params`` (the arena's flat float32 parameters) by one ``round_bf16``
        launch into ``into`` (uint16, params' size: the owner's buffer, kept between steps; None:
        a new one, made outside any step, which the caller keeps and passes again). Returns it.
        Until the next call, the products read their operands that are views of ``params`` from
        it. One arena at a time: after another arena is prepared, the products round the first
        one's views as they round activations (the same numbers), and never read another arena's
        copy. Each arena has a copy of its own, so a graph captured on one keeps its address."""
        if params.dtype != B.host.float32 or not params.flags.c_contiguous or params.ndim != 1:
            raise ValueError(f"Bf16CupyOps.prepare_weights: the arena's flat float32 parameters are needed, got "
                             f"{tuple(params.shape)} {params.dtype}")
        if into is None:
            with outside_step():
                into = self.xp.empty((params.size,), dtype=B.host.uint16)
        self.round_bf16_(params, into)
        self._scratch["bf16_weights"] = (params, into)
        return into

    def _weight_copy(self, x):
        """The address of ``x``'s first element in the bf16 copy of the weights, where ``x`` is
        a view of the prepared parameters (its whole extent inside them); else None."""
        kept = self._scratch.get("bf16_weights")
        if kept is None:
            return None
        params, mirror = kept
        base, end = params.data.ptr, params.data.ptr + params.nbytes
        lo, hi = x.data.ptr, x.data.ptr + x.itemsize
        for n, st in zip(x.shape, x.strides):
            if n == 0:
                return None
            if st < 0:
                lo += (n - 1) * st
            else:
                hi += (n - 1) * st
        if not (base <= lo and hi <= end) or (x.data.ptr - base) % x.itemsize:
            return None
        return mirror.data.ptr + (x.data.ptr - base) // x.itemsize * 2

    def _gathered(self, x):
        """A bf16 copy of ``x`` (..., R, C) with at most two batch axes: (address, per), its
        matrices row-major and contiguous, entry ``i`` of the flattened batch at ``i * per``."""
        *batch, R, C = x.shape
        batch = [1] * (2 - len(batch)) + batch
        strides = [0] * (4 - x.ndim) + [st // x.itemsize for st in x.strides]
        per = R * C if not any(b > 1 for b in batch) else -(-R * C // self.BATCH_ALIGN) * self.BATCH_ALIGN
        n = batch[0] * batch[1] * R * C
        dst = self.xp.empty((max(1, batch[0] * batch[1] * per),), dtype=B.host.uint16)
        if n:
            self._fn("round_bf16_gather", x.dtype)(
                _grid(n, 256), (256,), (x, dst, B.host.int64(n), B.host.int64(batch[1]), B.host.int64(R),
                                        B.host.int64(C), *(B.host.int64(st) for st in strides), B.host.int64(per)))
        return dst, per

    def _bf16_operand(self, x, where, name, batched):
        """How the GEMM reads ``x`` in bf16: (keep-alive array or None, address, rows
        contiguous, ld, batch stride in elements)."""
        if not batched:
            ptr = self._weight_copy(x)
            if ptr is not None:
                rows, ld = self._matrix(x, where, name)
                return None, ptr, rows, ld, 0
        dst, per = self._gathered(x)
        return dst, dst.data.ptr, True, max(1, x.shape[-1]), per

    def _check_float32(self, where, a):
        if a.dtype != B.host.float32:
            raise ValueError(f"Bf16CupyOps.{where}: bf16 products take float32 operands (the master weights' "
                             f"dtype), got {a.dtype}")

    def mm(self, a, b, out=None, accumulate: bool = False):
        """``a @ b`` by one ``gemmEx`` (bf16 A and B, float32 C and sums), after the bf16 copy
        of each operand that is not a prepared parameter; ``accumulate`` as :meth:`CupyOps.mm`."""
        self._check_float32("mm", a)
        out, dims = self._mm_operands(a, b, out, accumulate)
        if dims is None:
            return out
        cublas, handle = self._cublas()
        ka, pa, ra, lda, _ = self._bf16_operand(a, "mm", "a", False)
        kb, pb, rb, ldb, _ = self._bf16_operand(b, "mm", "b", False)
        c_rows, ldc = self._matrix(out, "mm", "out")
        ta, tb, m, n, k, first, second = self._plan(cublas, (pa, ra, lda), (pb, rb, ldb), c_rows, *dims)
        alpha, beta = self._alpha_beta(a.dtype, accumulate)
        bf, f32 = cublas.CUDA_R_16BF, cublas.CUDA_R_32F
        cublas.gemmEx(handle, ta, tb, m, n, k, alpha, first[0], bf, first[2], second[0], bf, second[2], beta,
                      out.data.ptr, f32, ldc, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        del ka, kb                          # (the copies lived until the call: stream order keeps them)
        return out

    def bmm(self, a, b, out=None):
        """``a @ b`` batched (see :meth:`CupyOps.bmm`) with bf16 operands: both copied into bf16
        (contiguous matrices), then one ``gemmStridedBatchedEx`` where ``out``'s batch is one
        stride, else ``gemmBatchedEx`` with pointer arrays (:meth:`CupyOps._gemm_pointers`)."""
        if a.ndim not in (3, 4):
            raise ValueError(f"Bf16CupyOps.bmm: one or two batch axes, got a of shape {tuple(a.shape)}")
        out, M, N, K = self._operands("bmm", a, b, out, a.ndim - 2)
        self._check_float32("bmm", a)
        count = math.prod(out.shape[:-2])
        if self._nothing_to_multiply(out, M, N, K, count):
            return out
        cublas, handle = self._cublas()
        ka, pa, ra, lda, sa = self._bf16_operand(a, "bmm", "a", True)
        kb, pb, rb, ldb, sb = self._bf16_operand(b, "bmm", "b", True)
        c_rows, ldc = self._matrix(out, "bmm", "out")
        ta, tb, m, n, k, first, second = self._plan(cublas, (pa, ra, lda, sa), (pb, rb, ldb, sb), c_rows, M, N, K)
        outer, inner, so, si = self._batch_strides(out)
        alpha, beta = self._alpha_beta(a.dtype)
        bf, f32 = cublas.CUDA_R_16BF, cublas.CUDA_R_32F
        if outer == 1 or inner == 1 or so == si * inner:
            sc = so if inner == 1 else si
            cublas.gemmStridedBatchedEx(handle, ta, tb, m, n, k, alpha, first[0], bf, first[2], first[3], second[0],
                                        bf, second[2], second[3], beta, out.data.ptr, f32, ldc, sc, count,
                                        cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        else:
            # the pointers in float32 units (4 bytes): a bf16 copy's entries are an even number of elements apart
            ptrs = self._gemm_pointers(B.host.dtype(B.host.float32), count, inner, (
                (first[0], inner * first[3] // 2, first[3] // 2), (second[0], inner * second[3] // 2, second[3] // 2),
                (out.data.ptr, so, si)))
            p, step = ptrs.data.ptr, 8 * count
            cublas.gemmBatchedEx(handle, ta, tb, m, n, k, alpha, p, bf, first[2], p + step, bf, second[2], beta,
                                 p + 2 * step, f32, ldc, count, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        del ka, kb
        return out


class Tf32CupyOps(CupyOps):
    """:class:`CupyOps` whose products run on the cuBLAS handle's ``CUBLAS_TF32_TENSOR_OP_MATH``
    (``attn-train --precision tf32``): the GEMMs read their float32 operands as TF32 in the tensor
    cores and sum in float32. The handle's mode is set for each product and put back after it (the
    handle is shared with the fp32 ops of the same device, which the decoding uses)."""

    precision = "tf32"

    def _tf32(self, product, a, b, out):
        cublas, handle = self._cublas()
        before = cublas.getMathMode(handle)
        cublas.setMathMode(handle, cublas.CUBLAS_TF32_TENSOR_OP_MATH)
        try:
            return product(self, a, b, out=out)
        finally:
            cublas.setMathMode(handle, before)

    def mm(self, a, b, out=None, accumulate=False):
        return self._tf32(lambda ops, a, b, out: CupyOps.mm(ops, a, b, out=out, accumulate=accumulate), a, b, out)

    def bmm(self, a, b, out=None):
        return self._tf32(CupyOps.bmm, a, b, out)


class DecodeKernels:
    """The launches of the decoding kernels, on the module of a :class:`CupyOps` (what
    :mod:`attn.fast.decoding`'s device step calls). Arrays are CuPy arrays whose last axis is
    contiguous; each method says which must be contiguous as a whole."""

    def __init__(self, ops: CupyOps):
        self.ops = ops

    def _launch(self, name, dtype, grid, threads, args, shared):
        self.ops._fn(name, dtype)((grid,), (threads,), args, shared_mem=shared)

    def embed(self, ids, table, pe, scale: float, x, out, gamma, beta, eps: float, norm: bool):
        """x (n, D) <- table[ids] * scale + pe; with ``norm``, out (n, D) <- its layer norm."""
        n, D = x.shape
        self.ops._contiguous("decode_embed", x=x, out=out)
        if ids.dtype != B.host.int64 or not ids.flags.c_contiguous or ids.shape != (n,):
            raise ValueError(f"DecodeKernels.embed: ids must be a contiguous ({n},) int64 array, got "
                             f"{tuple(ids.shape)} {ids.dtype}")
        t = _block(D)
        dt = x.dtype
        self._launch("decode_embed", dt, n, t, (ids, table, pe, self.ops._scalar(scale, dt), x, out, gamma, beta,
                                                B.host.int32(D), self.ops._scalar(eps, dt), B.host.int32(int(norm))),
                     t * dt.itemsize)

    def add_norm(self, x, s, bias, out, gamma, beta, eps: float):
        """x (n, D) <- (s + bias) + x, then out <- its layer norm (out may be x)."""
        n, D = x.shape
        self.ops._contiguous("add_norm", x=x, s=s, out=out)
        t = _block(D)
        dt = x.dtype
        self._launch("add_norm", dt, n, t, (x, s, bias, out, gamma, beta, B.host.int32(D), self.ops._scalar(eps, dt)),
                     t * dt.itemsize)

    def attend(self, q_in, q_bias, k, v, group: int, bias, w, ctx, n_heads: int, Tk: int, self_attn: bool):
        """One query per row and head (see ``one_query_attention``): q_in (n, D) or, for
        self-attention, (n, 3D) with the new key and value; k, v (n / group, H, >= Tk, Dh) of one
        layout; bias (n, >= Tk) or None; w (n, H, >= Tk) receives the weights; ctx (n, D)."""
        n = q_in.shape[0]
        H, Dh = n_heads, k.shape[3]
        it = k.dtype.itemsize
        if k.strides != v.strides or k.strides[3] != it or w.strides[2] != w.dtype.itemsize \
                or not (q_in.flags.c_contiguous and ctx.flags.c_contiguous and q_bias.flags.c_contiguous):
            raise ValueError(f"DecodeKernels.attend: keys and values of one layout with contiguous rows of Dh, "
                             f"contiguous q_in, q_bias and ctx are needed (k {k.strides}, v {v.strides}, w "
                             f"{w.strides})")
        if n != k.shape[0] * group or Tk > k.shape[2] or Tk > w.shape[2]:
            raise ValueError(f"DecodeKernels.attend: {n} rows, groups of {group}, {Tk} keys, but k is "
                             f"{tuple(k.shape)} and w {tuple(w.shape)}")
        s_row, s_head, s_pos = (st // it for st in k.strides[:3])
        i64, i32 = B.host.int64, B.host.int32
        has_bias = bias is not None
        b = bias if has_bias else ctx
        b_row = bias.strides[0] // it if has_bias else 0
        w_row, w_head = (st // it for st in w.strides[:2])
        t = _block(max(Tk, Dh), 128)
        self._launch("one_query_attention", k.dtype, n * H, t,
                     (q_in, q_bias, i64(q_in.strides[0] // it), i32(int(self_attn)), k, v, i64(s_row), i64(s_head),
                      i64(s_pos), i32(group), b, i64(b_row), i32(int(has_bias)), w, i64(w_row), i64(w_head), ctx,
                      i32(H), i32(Dh), i32(Tk), self.ops._scalar(B.host.finfo(k.dtype).min, k.dtype)),
                     (t + Dh) * it)

    def log_softmax(self, x, out):
        """out (n, V) <- log_softmax(x) over each row (out may be x)."""
        n, V = x.shape
        self.ops._contiguous("log_softmax_rows", x=x, out=out)
        t = _block(V, 512)
        self._launch("log_softmax_rows", x.dtype, n, t, (x, out, B.host.int32(V)), t * x.dtype.itemsize)

    def greedy_pick(self, logp, ban, info, tokens):
        """Greedy decoding's choice per row of logp (n, V), ``ban`` (two ids) excluded: info (2, n)
        float64 <- (ids, their log-probabilities), tokens (n,) int64 <- ids."""
        n, V = logp.shape
        if not (logp.flags.c_contiguous and info.flags.c_contiguous and tokens.flags.c_contiguous) \
                or info.shape != (2, n) or info.dtype != B.host.float64 or tokens.shape != (n,) \
                or tokens.dtype != B.host.int64:
            raise ValueError(f"DecodeKernels.greedy_pick: contiguous logp (n, V), info (2, n) float64 and tokens "
                             f"(n,) int64 are needed, got {tuple(logp.shape)}, {tuple(info.shape)} {info.dtype}, "
                             f"{tuple(tokens.shape)} {tokens.dtype}")
        t = _block(V, 512)
        i32 = B.host.int32
        self._launch("greedy_pick", logp.dtype, n, t, (logp, i32(V), i32(ban[0]), i32(ban[1]), info, B.host.int64(n),
                                                      tokens), t * (logp.dtype.itemsize + 4))

    #: Most candidates (beams x tokens per beam) :meth:`beam_candidates` keeps in shared memory.
    BEAM_MAX_CANDIDATES = 1024

    def beam_candidates(self, logp, beam_scores, W: int, c: int, C: int, ban, info):
        """Beam search's best C candidates per sentence of W beams (see ``beam_candidates``): logp
        (n, V) contiguous, beam_scores (n,) float64, info (2, n / W, C) float64 receives the scores
        and the ids w * V + v, best first."""
        n, V = logp.shape
        if not (logp.flags.c_contiguous and beam_scores.flags.c_contiguous and info.flags.c_contiguous) \
                or beam_scores.shape != (n,) or info.shape != (2, n // W, C) or n % W \
                or beam_scores.dtype != B.host.float64 or info.dtype != B.host.float64 \
                or W * c > self.BEAM_MAX_CANDIDATES:
            raise ValueError(f"DecodeKernels.beam_candidates: contiguous logp (n, V), beam_scores (n,) and info "
                             f"(2, n / W, C) float64, at most {self.BEAM_MAX_CANDIDATES} candidates, are needed; got "
                             f"{tuple(logp.shape)}, {tuple(beam_scores.shape)}, {tuple(info.shape)}, W {W}, c {c}")
        t = 128
        i32 = B.host.int32
        self._launch("beam_candidates", logp.dtype, n // W, t,
                     (logp, beam_scores, i32(V), i32(W), i32(c), i32(C), i32(ban[0]), i32(ban[1]), info),
                     16 * (t + W * c))

    def gather_prefix(self, src, dst, index, length: int):
        """dst[r, ..., :length, :] <- src[index[r], ..., :length, :] for the caches (rows, L, 2, H,
        capacity, Dh) (both contiguous, one shape): the positions written so far, not the room."""
        if not (src.flags.c_contiguous and dst.flags.c_contiguous and index.flags.c_contiguous) \
                or src.shape[1:] != dst.shape[1:] or index.dtype != B.host.int64 or index.shape[0] > dst.shape[0]:
            raise ValueError(f"DecodeKernels.gather_prefix: contiguous caches of one shape and an int64 index are "
                             f"needed, got {tuple(src.shape)}, {tuple(dst.shape)}, index {tuple(index.shape)} "
                             f"{index.dtype}")
        n = index.shape[0]
        Dh, cap = src.shape[-1], src.shape[-2]
        segs = math.prod(src.shape[1:-2])
        if n == 0 or length == 0:
            return
        i64 = B.host.int64
        self._launch("gather_prefix", src.dtype, n * segs, _block(length * Dh, 256),
                     (src, dst, index, i64(segs * cap * Dh), B.host.int32(segs), i64(cap * Dh), i64(length * Dh)), 0)

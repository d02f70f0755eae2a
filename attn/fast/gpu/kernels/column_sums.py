"""Column sums in one launch of two stages (the bias gradients, layer norm's dgamma and dbeta):
CUDA source and NumPy twin."""
from __future__ import annotations

from .... import backend as B
from .common import strided_view

COLUMN_SUMS = r"""
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
    cnt = strided_view(counter, (tiles,), (1,))
    if cnt.any():
        raise ValueError(f"{launch.name}: the tile counters must be 0 at the launch (a launch "
                         "before this one did not finish, or the counter buffer was not zeroed)")
    span = chunk * R                                  # rows of one round over the row blocks
    pad = -N % span
    jobs = [job for job in ((a, b, out, D, K, 0), (a1, None, out1, D1, 1, R * K * D)) if job[3]]   # (D1 > 0)
    for x, y, _, DD, KK, start in jobs:               # stage one: every block's partial sums
        xs = strided_view(x, (N, DD), (DD, 1))
        sums = [xs * strided_view(y, (N, DD), (DD, 1)), xs] if KK == 2 else [xs]
        part = np.empty((R, KK, DD), dtype=a.dtype)
        for k, t in enumerate(sums):
            t = np.concatenate([t, np.zeros((pad, DD), dtype=a.dtype)]) if pad else t
            part[:, k] = t.reshape(-1, R, chunk, DD).sum(axis=(0, 2))      # block y: chunks y, y + R, ...
        strided_view(partial.reshape(-1)[start:], (R, KK, DD), (KK * DD, DD, 1))[...] = part
    if getattr(launch, "order", None) is not None:
        return _column_sums_in_order(launch, jobs, partial, cnt, tiles, tiles0, R)
    for _, _, o, DD, KK, start in jobs:               # stage two: from the partials as they lie
        part = strided_view(partial.reshape(-1)[start:], (R, KK, DD), (KK * DD, DD, 1))
        strided_view(o, (KK * DD,), (1,))[...] = part.sum(axis=0).reshape(-1)


def _column_sums_in_order(launch, jobs, partial, cnt, tiles, tiles0, R):
    """Stage two of :func:`column_sums_np` as the kernel does it, block by block in
    ``launch.order``: each block (tile x, row block y) publishes its partials and takes a ticket
    from ``counter[x]``; the tile's last block sums the tile's partials as they lie and sets the
    counter back to 0. The partials are first spoiled (NaN: what a block would read of a partial
    not yet written), so an order in which a tile's sum came before one of its partials reads NaN."""
    np = B.host
    done = []
    for _, _, _, DD, KK, start in jobs:
        view = strided_view(partial.reshape(-1)[start:], (R, KK, DD), (KK * DD, DD, 1))
        done.append(view.copy())                      # stage one's results, per block
        view[...] = np.nan
    for b in launch.order:
        x, y = b % tiles, b // tiles
        k = 0 if x < tiles0 else 1
        _, _, o, DD, KK, start = jobs[k] if k < len(jobs) else jobs[-1]
        cols = slice(32 * (x - (tiles0 if k else 0)), min(DD, 32 * (x - (tiles0 if k else 0)) + 32))
        view = strided_view(partial.reshape(-1)[start:], (R, KK, DD), (KK * DD, DD, 1))
        view[y, :, cols] = done[k][y, :, cols]
        cnt[x] += 1
        if cnt[x] == R:                               # the tile's last block
            out = strided_view(o, (KK, DD), (DD, 1))
            out[:, cols] = view.sum(axis=0)[:, cols]      # (the in-order twin's sums: other tiles' columns unread)
            cnt[x] = 0

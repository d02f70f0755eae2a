"""The kernels of a cached decoding step on CuPy (:mod:`attn.fast.decoding.device`): CUDA source,
NumPy twins, and :class:`DecodeKernels`, their launches. One position for every row, so the step
is bound by how many launches it makes: per decoder layer three products and one kernel per
sub-layer (plus the feed-forward's ReLU); docs/GPU.md ("What a step asks of a GPU") counts them."""
from __future__ import annotations

import math

from .... import backend as B
from .common import block_size_for, check_block_reduction, strided_view


DECODE_EMBED = r"""
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
    np, dt, D = B.host, v.dtype.type, v.shape[1]
    gamma, beta = (strided_view(a, (D,), (1,)) for a in (gamma, beta))
    c = v - (v.sum(axis=1) / dt(D))[:, None]
    r = dt(1) / np.sqrt((c * c).sum(axis=1) / dt(D) + dt(eps))
    return c * r[:, None] * gamma + beta


def decode_embed_np(launch, ids, table, pe, scale, x, out, gamma, beta, D, eps, norm):
    """NumPy twin of ``decode_embed`` (one block per row: n = the grid's size)."""
    check_block_reduction(launch, x.itemsize)
    n, D = launch.blocks, int(D)
    idv = strided_view(ids, (n,), (1,))
    if idv.size and (idv.min() < 0 or (idv.max() + 1) * D > table.size):
        raise IndexError(f"decode_embed: a token id outside the table of {table.size // D} rows")
    xv = strided_view(x, (n, D), (D, 1))
    xv[...] = table.reshape(-1, D)[idv] * scale + strided_view(pe, (D,), (1,))
    if norm:
        strided_view(out, (n, D), (D, 1))[...] = _row_norm_np(xv, gamma, beta, eps)


ADD_NORM = r"""
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
    check_block_reduction(launch, x.itemsize)
    n, D = launch.blocks, int(D)
    xv = strided_view(x, (n, D), (D, 1))
    v = (strided_view(s, (n, D), (D, 1)) + strided_view(bias, (D,), (1,))) + xv
    xv[...] = v
    strided_view(out, (n, D), (D, 1))[...] = _row_norm_np(v, gamma, beta, eps)


ONE_QUERY_ATTENTION = r"""
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
    check_block_reduction(launch, q_in.itemsize)
    H, Dh, Tk, g = int(H), int(Dh), int(Tk), int(g)
    if launch.blocks % H or launch.shared_mem < (launch.threads + Dh) * q_in.itemsize:
        raise ValueError(f"{launch.name}: {launch.blocks} blocks for {H} heads, {launch.shared_mem} bytes of "
                         f"shared memory for {launch.threads} threads and Dh {Dh}")
    n = launch.blocks // H
    if n % g:
        raise ValueError(f"{launch.name}: {n} rows are not whole groups of {g}")
    m, D = n // g, H * Dh
    dt = q_in.dtype.type
    q = strided_view(q_in, (n, H, Dh), (q_row, Dh, 1)) + strided_view(q_bias, (H, Dh), (Dh, 1))
    kv, vv = (strided_view(a, (m, H, Tk, Dh), (s_row, s_head, s_pos, 1)) for a in (k, v))
    if self_attn:                                      # each row its own cache: groups of one
        if g != 1:
            raise ValueError(f"{launch.name}: self-attention writes each row's own cache, got groups of {g}")
        new = strided_view(q_in, (n, 3, H, Dh), (q_row, D, Dh, 1))[:, 1:] + strided_view(q_bias, (3, H, Dh), (D, Dh, 1))[1:]
        kv[:, :, Tk - 1] = new[:, 0]
        vv[:, :, Tk - 1] = new[:, 1]
    qg = q.reshape(m, g, H, Dh).transpose(0, 2, 1, 3)                                       # (m, H, g, Dh)
    s = qg @ kv.swapaxes(-1, -2)                                                           # (m, H, g, Tk)
    if has_bias:
        b = strided_view(bias, (m, g, Tk), (g * bias_row, bias_row, 1))[:, None]                   # (m, 1, g, Tk)
        s += b
        allowed = (b == 0).any(axis=-1)
    else:
        allowed = np.ones((m, 1, g), dtype=bool)
    s -= np.maximum(s.max(axis=-1), dt(lowest))[..., None] if Tk else 0
    np.exp(s, out=s)
    total = s.sum(axis=-1)
    s *= np.where(allowed, dt(1) / np.where(allowed, total, 1), dt(0))[..., None]
    strided_view(w, (m, g, H, Tk), (g * w_row, w_row, w_head, 1))[...] = s.transpose(0, 2, 1, 3)
    out = (s @ vv).transpose(0, 2, 1, 3)                                                    # (m, g, H, Dh)
    strided_view(ctx, (n, D), (D, 1))[...] = out.reshape(n, D)


LOG_SOFTMAX_ROWS = r"""
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
    check_block_reduction(launch, x.itemsize)
    n, V = launch.blocks, int(V)
    s = strided_view(x, (n, V), (V, 1)).copy()
    s -= s.max(axis=1, keepdims=True)
    lse = np.log(np.exp(s).sum(axis=1, keepdims=True))
    strided_view(out, (n, V), (V, 1))[...] = s - lse


GREEDY_PICK = r"""
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
    if (threadIdx.x == 0) {  // every id banned (V <= 2): id -1 and -inf, never a read before the row
        int id = si[0];
        info[r] = (double)id;
        info[n + r] = id < 0 ? (double)(-__int_as_float(0x7f800000)) : (double)row[id];
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
    x = strided_view(logp, (n, V), (V, 1)).copy()
    banned = [j for j in (int(ban0), int(ban1)) if 0 <= j < V]
    x[:, banned] = -np.inf
    some = len(set(banned)) < V
    ids = x.argmax(axis=1) if some else np.full(n, -1)
    iv = strided_view(info, (2, n), (n, 1))
    iv[0], iv[1] = ids, np.take_along_axis(x, ids[:, None], axis=1)[:, 0] if some else -np.inf
    strided_view(tokens, (n,), (1,))[...] = ids


BEAM_CANDIDATES = r"""
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
    x = strided_view(logp, (m * W, V), (V, 1)).astype(np.float64)
    x[:, [int(ban0), int(ban1)]] = np.nan                                   # never picked
    ids = np.broadcast_to(np.arange(V), x.shape)
    top, top_ids = _best_first(x, ids, c)                                   # (m * W, c)
    cand = (strided_view(beam_scores, (m * W, 1), (1, 0)) + top).reshape(m, W * c)
    flat = (np.arange(W)[None, :, None] * V + top_ids.reshape(m, W, c)).reshape(m, W * c)
    s, f = _best_first(cand, flat, C)
    iv = strided_view(info, (2, m, C), (m * C, C, 1))
    iv[0], iv[1] = s, f


GATHER_PREFIX = r"""
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
    idx = strided_view(index, (n,), (1,))
    if n and (idx.min() < 0 or (idx.max() + 1) * row > src.size):
        raise IndexError(f"{launch.name}: a row index outside the source's {src.size // row} rows")
    if n and len:
        whole = strided_view(src, (src.size // row, segs, len), (row, seg, 1))
        strided_view(dst, (n, segs, len), (row, seg, 1))[...] = whole[idx]


class DecodeKernels:
    """The launches of the decoding kernels, on the module of a :class:`CupyOps` (what
    :mod:`attn.fast.decoding.device`'s step calls). Arrays are CuPy arrays whose last axis is
    contiguous; each method says which must be contiguous as a whole."""

    def __init__(self, ops):
        self.ops = ops

    def _launch(self, name, dtype, grid, threads, args, shared):
        self.ops.kernel(name, dtype)((grid,), (threads,), args, shared_mem=shared)

    def embed(self, ids, table, pe, scale: float, x, out, gamma, beta, eps: float, norm: bool):
        """x (n, D) <- table[ids] * scale + pe; with ``norm``, out (n, D) <- its layer norm. ``ids``
        (n,) contiguous int64, as the device step makes them."""
        n, D = x.shape
        self.ops.check_contiguous("decode_embed", x=x, out=out)
        t = block_size_for(D)
        dt = x.dtype
        self._launch("decode_embed", dt, n, t, (ids, table, pe, self.ops.scalar(scale, dt), x, out, gamma, beta,
                                                B.host.int32(D), self.ops.scalar(eps, dt), B.host.int32(int(norm))),
                     t * dt.itemsize)

    def add_norm(self, x, s, bias, out, gamma, beta, eps: float):
        """x (n, D) <- (s + bias) + x, then out <- its layer norm (out may be x)."""
        n, D = x.shape
        self.ops.check_contiguous("add_norm", x=x, s=s, out=out)
        t = block_size_for(D)
        dt = x.dtype
        self._launch("add_norm", dt, n, t, (x, s, bias, out, gamma, beta, B.host.int32(D), self.ops.scalar(eps, dt)),
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
        t = block_size_for(max(Tk, Dh), 128)
        self._launch("one_query_attention", k.dtype, n * H, t,
                     (q_in, q_bias, i64(q_in.strides[0] // it), i32(int(self_attn)), k, v, i64(s_row), i64(s_head),
                      i64(s_pos), i32(group), b, i64(b_row), i32(int(has_bias)), w, i64(w_row), i64(w_head), ctx,
                      i32(H), i32(Dh), i32(Tk), self.ops.scalar(B.host.finfo(k.dtype).min, k.dtype)),
                     (t + Dh) * it)

    def log_softmax(self, x, out):
        """out (n, V) <- log_softmax(x) over each row (out may be x)."""
        n, V = x.shape
        self.ops.check_contiguous("log_softmax_rows", x=x, out=out)
        t = block_size_for(V, 512)
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
        if not set(range(V)) - set(int(b) for b in ban):
            raise ValueError(f"DecodeKernels.greedy_pick: every one of the {V} tokens is banned ({tuple(ban)}): "
                             "there is nothing to choose")
        t = block_size_for(V, 512)
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
        self._launch("gather_prefix", src.dtype, n * segs, block_size_for(length * Dh, 256),
                     (src, dst, index, i64(segs * cap * Dh), B.host.int32(segs), i64(cap * Dh), i64(length * Dh)), 0)

"""FlashAttention's fused kernels (docs/GPU.md, "The tiled attention"): the tiled forward (online
softmax, one log-sum-exp kept per query) and the recomputing backward, CUDA source and NumPy
twins; the tiles and shared memory they launch with (:func:`flash_tiles`, :func:`flash_shared`).

Layouts: q (B, H, Tq, Dh), k and v (B, Hkv, Tk, Dh) at element strides (sentence, head,
position), each row contiguous; o and dO (B, Tq, H, Dh) contiguous; the log-sum-exp and
``D = rowsum(dO * O)`` (B, H, Tq). Query head h reads key head ``h / (H / Hkv)``;
``key_ok[b * okb + j]`` says whether key j of sentence b may be attended; with ``causal`` query i
sees keys j <= i (later key tiles skipped). A query with no key gets 0 and a log-sum-exp of 0
that nothing reads. Each thread owns one row of its tile; the heads are the grid's x, tiles its y."""
from __future__ import annotations

from typing import NamedTuple

from .... import backend as B
from .common import check_threads, strided_view

#: The largest tile (rows of queries or keys per block) the launch code picks.
MOST_TILE = 64
#: Shared memory a block may use without opting in (every GPU since Volta); above it the launch sets
#: the kernel's ``max_dynamic_shared_size_bytes``, up to what the device allows.
SHARED_LIMIT = 48 << 10
#: The head sizes the kernels are compiled for as a constant (float32; 0: any head size, at run time).
HEAD_SIZES = (0, 64)


def compiled_head(Dh: int, itemsize: int) -> int:
    """The ``DH`` template argument a launch at head size Dh uses: Dh where float32 kernels are
    compiled for it (the loops over the head unrolled), else 0 (the head size read at run time)."""
    return Dh if itemsize == 4 and Dh in HEAD_SIZES else 0

ALLOWED = r"""
// Whether query i may attend to key j of sentence b (the key exists, is no padding, is not ahead).
__device__ __forceinline__ bool flash_allowed(const bool* key_ok, long long okb, int b, int i, int j, int Tk,
                                              int causal) {
    return j < Tk && key_ok[b * okb + j] && (!causal || j <= i);
}

// A tile into shared memory, the block's threads sharing the copy: rows r0 .. r0 + n of src (rows of Dh
// at a stride of `stride` elements, `last` of them) into sh (n rows, `ld` apart), zeros past the last row.
// A tile whose rows the threads read one each (thread r, row r, the same d) has ld = Dh + 1: rows
// Dh apart would put every thread's value in one bank (Dh = 64 floats: a 32-way conflict).
template <typename T>
__device__ void flash_load(T* sh, const T* src, int r0, int n, int last, long long stride, int Dh, int ld) {
    for (int e = threadIdx.x; e < n * Dh; e += blockDim.x) {
        int r = e / Dh, d = e % Dh;
        sh[r * ld + d] = r0 + r < last ? src[(long long)(r0 + r) * stride + d] : T(0);
    }
}
"""

FLASH_FWD = r"""
// FlashAttention's forward, one block per (sentence * head, query tile), one thread per query of the
// tile (blockDim.x = Br). Shared memory: Q tile and the output's running sum (Br rows of Dh + 1 each), K
// and V tiles (Bc x Dh each: every thread reads the same value), the tile's scores (Br rows of Bc + 1).
// m, l: the query's running maximum and sum of exp(s - m). DH > 0: the head size at compile time (Dh
// then must equal it); 0: Dh's.
template <typename T, int DH>
__global__ void flash_fwd(const T* q, const T* k, const T* v, const bool* key_ok, T* o, T* lse, T scale,
                          T lowest, int H, int Hkv, int Tq, int Tk, int Dh, int causal, int Bc,
                          long long qb, long long qh, long long qt, long long kb, long long kh, long long kt,
                          long long okb) {
    extern __shared__ unsigned char smem[];
    const int D = DH > 0 ? DH : Dh, LD = D + 1;
    int Br = blockDim.x, r = threadIdx.x, SB = Bc + 1;
    T* qs = reinterpret_cast<T*>(smem);
    T* acc = qs + Br * LD;
    T* ks = acc + Br * LD;
    T* vs = ks + Bc * D;
    T* s = vs + Bc * D;
    int b = blockIdx.x / H, h = blockIdx.x % H, hk = h / (H / Hkv);
    int i0 = blockIdx.y * Br, i = i0 + r;
    const T* qg = q + b * qb + h * qh;
    const T* kg = k + b * kb + hk * kh;
    const T* vg = v + b * kb + hk * kh;
    flash_load(qs, qg, i0, Br, Tq, qt, D, LD);
    for (int e = r; e < Br * LD; e += Br) acc[e] = 0;
    T m = lowest, l = 0;
    int kend = causal ? min(Tk, i0 + Br) : Tk;          // causal: the tiles past the last query skipped
    for (int j0 = 0; j0 < kend; j0 += Bc) {
        __syncthreads();
        flash_load(ks, kg, j0, Bc, Tk, kt, D, D);
        flash_load(vs, vg, j0, Bc, Tk, kt, D, D);
        __syncthreads();
        if (i >= Tq) continue;
        T mt = lowest;
        bool any = false;
        for (int c = 0; c < Bc; ++c) {
            T sc = 0;
            if (flash_allowed(key_ok, okb, b, i, j0 + c, Tk, causal)) {
                for (int d = 0; d < D; ++d) sc += qs[r * LD + d] * ks[c * D + d];
                sc *= scale;
                if (!any || sc > mt) mt = sc;
                any = true;
            }
            s[r * SB + c] = sc;
        }
        if (!any) continue;                             // no key of this tile: nothing changes
        T mn = mt > m ? mt : m;
        T alpha = exp(m - mn);                          // the old sums rescaled to the new maximum
        l *= alpha;
        for (int d = 0; d < D; ++d) acc[r * LD + d] *= alpha;
        for (int c = 0; c < Bc; ++c) {
            if (!flash_allowed(key_ok, okb, b, i, j0 + c, Tk, causal)) continue;
            T p = exp(s[r * SB + c] - mn);
            l += p;
            for (int d = 0; d < D; ++d) acc[r * LD + d] += p * vs[c * D + d];
        }
        m = mn;
    }
    if (i >= Tq) return;
    T inv = l > T(0) ? T(1) / l : T(0);
    T* orow = o + (((long long)b * Tq + i) * H + h) * D;
    for (int d = 0; d < D; ++d) orow[d] = acc[r * LD + d] * inv;
    lse[(long long)blockIdx.x * Tq + i] = l > T(0) ? m + log(l) : T(0);
}
"""

FLASH_BWD_PREP = r"""
// D = rowsum(dO * O) of every query, one thread each: dout and o (B, Tq, H, Dh), dsum (B, H, Tq).
template <typename T>
__global__ void flash_bwd_prep(const T* dout, const T* o, T* dsum, int H, int Tq, int Dh, long long n) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    long long i = t % Tq, bh = t / Tq, h = bh % H, b = bh / H;
    long long row = ((b * Tq + i) * H + h) * Dh;
    T total = 0;
    for (int d = 0; d < Dh; ++d) total += dout[row + d] * o[row + d];
    dsum[t] = total;
}
"""

FLASH_BWD_KV = r"""
// dK and dV of one key tile, one block per (sentence * key head, key tile), one thread per key
// (blockDim.x = Bc): every query tile of every head of the group passes through shared memory (Q, dO:
// Br x Dh each, read alike by every thread; the log-sum-exp and D: Br each) while the key's K, V, dK and
// dV rows stay (Bc rows of Dh + 1 each: one a thread). P = exp(s - lse) is recomputed; dV += P dO,
// dP = dO . v, dS = P (dP - D), dK += scale dS q. DH as flash_fwd's.
template <typename T, int DH>
__global__ void flash_bwd_kv(const T* q, const T* k, const T* v, const bool* key_ok, const T* dout,
                             const T* lse, const T* dsum, T* dk, T* dv, T scale, int H, int Hkv, int Tq,
                             int Tk, int Dh, int causal, int Br, long long qb, long long qh, long long qt,
                             long long kb, long long kh, long long kt, long long dkb, long long dkh,
                             long long dkt, long long okb) {
    extern __shared__ unsigned char smem[];
    const int D = DH > 0 ? DH : Dh, LD = D + 1;
    int Bc = blockDim.x, c = threadIdx.x;
    T* ks = reinterpret_cast<T*>(smem);
    T* vs = ks + Bc * LD;
    T* dks = vs + Bc * LD;
    T* dvs = dks + Bc * LD;
    T* qs = dvs + Bc * LD;
    T* dos = qs + Br * D;
    T* ls = dos + Br * D;
    T* ds = ls + Br;
    int b = blockIdx.x / Hkv, hk = blockIdx.x % Hkv, G = H / Hkv;
    int j0 = blockIdx.y * Bc, j = j0 + c;
    const T* kg = k + b * kb + hk * kh;
    const T* vg = v + b * kb + hk * kh;
    flash_load(ks, kg, j0, Bc, Tk, kt, D, LD);
    flash_load(vs, vg, j0, Bc, Tk, kt, D, LD);
    for (int e = c; e < Bc * LD; e += Bc) dks[e] = dvs[e] = 0;
    int istart = causal ? (j0 / Br) * Br : 0;           // causal: the query tiles before the key tile skipped
    for (int h = hk * G; h < hk * G + G; ++h) {
        const T* qg = q + b * qb + h * qh;
        for (int i0 = istart; i0 < Tq; i0 += Br) {
            __syncthreads();
            flash_load(qs, qg, i0, Br, Tq, qt, D, D);
            flash_load(dos, dout + ((long long)b * Tq * H + h) * D, i0, Br, Tq, (long long)H * D, D, D);
            for (int rr = c; rr < Br; rr += Bc) {
                bool in = i0 + rr < Tq;
                ls[rr] = in ? lse[((long long)b * H + h) * Tq + i0 + rr] : T(0);
                ds[rr] = in ? dsum[((long long)b * H + h) * Tq + i0 + rr] : T(0);
            }
            __syncthreads();
            for (int rr = 0; rr < Br; ++rr) {
                int i = i0 + rr;
                if (i >= Tq || !flash_allowed(key_ok, okb, b, i, j, Tk, causal)) continue;
                T sc = 0, dp = 0;
                for (int d = 0; d < D; ++d) {
                    sc += qs[rr * D + d] * ks[c * LD + d];
                    dp += dos[rr * D + d] * vs[c * LD + d];
                }
                T p = exp(sc * scale - ls[rr]);
                T dsc = p * (dp - ds[rr]) * scale;
                for (int d = 0; d < D; ++d) {
                    dvs[c * LD + d] += p * dos[rr * D + d];
                    dks[c * LD + d] += dsc * qs[rr * D + d];
                }
            }
        }
    }
    if (j >= Tk) return;
    T* dkr = dk + b * dkb + hk * dkh + j * dkt;
    T* dvr = dv + b * dkb + hk * dkh + j * dkt;
    for (int d = 0; d < D; ++d) {
        dkr[d] = dks[c * LD + d];
        dvr[d] = dvs[c * LD + d];
    }
}
"""

FLASH_BWD_Q = r"""
// dQ of one query tile, one block per (sentence * head, query tile), one thread per query (blockDim.x = Br):
// the query's q, dO and dQ rows stay in shared memory (Br rows of Dh + 1 each), every key tile of its head
// passes through (K, V: Bc x Dh each). dQ += scale dS k with dS = P (dO . v - D), P recomputed from the
// lse. DH as flash_fwd's.
template <typename T, int DH>
__global__ void flash_bwd_q(const T* q, const T* k, const T* v, const bool* key_ok, const T* dout,
                            const T* lse, const T* dsum, T* dq, T scale, int H, int Hkv, int Tq, int Tk,
                            int Dh, int causal, int Bc, long long qb, long long qh, long long qt,
                            long long kb, long long kh, long long kt, long long dqb, long long dqh,
                            long long dqt, long long okb) {
    extern __shared__ unsigned char smem[];
    const int D = DH > 0 ? DH : Dh, LD = D + 1;
    int Br = blockDim.x, r = threadIdx.x;
    T* qs = reinterpret_cast<T*>(smem);
    T* dos = qs + Br * LD;
    T* dqs = dos + Br * LD;
    T* ks = dqs + Br * LD;
    T* vs = ks + Bc * D;
    int b = blockIdx.x / H, h = blockIdx.x % H, hk = h / (H / Hkv);
    int i0 = blockIdx.y * Br, i = i0 + r;
    const T* qg = q + b * qb + h * qh;
    const T* kg = k + b * kb + hk * kh;
    const T* vg = v + b * kb + hk * kh;
    flash_load(qs, qg, i0, Br, Tq, qt, D, LD);
    flash_load(dos, dout + ((long long)b * Tq * H + h) * D, i0, Br, Tq, (long long)H * D, D, LD);
    for (int e = r; e < Br * LD; e += Br) dqs[e] = 0;
    T li = i < Tq ? lse[(long long)blockIdx.x * Tq + i] : T(0);
    T di = i < Tq ? dsum[(long long)blockIdx.x * Tq + i] : T(0);
    int kend = causal ? min(Tk, i0 + Br) : Tk;
    for (int j0 = 0; j0 < kend; j0 += Bc) {
        __syncthreads();
        flash_load(ks, kg, j0, Bc, Tk, kt, D, D);
        flash_load(vs, vg, j0, Bc, Tk, kt, D, D);
        __syncthreads();
        if (i >= Tq) continue;
        for (int c = 0; c < Bc; ++c) {
            if (!flash_allowed(key_ok, okb, b, i, j0 + c, Tk, causal)) continue;
            T sc = 0, dp = 0;
            for (int d = 0; d < D; ++d) {
                sc += qs[r * LD + d] * ks[c * D + d];
                dp += dos[r * LD + d] * vs[c * D + d];
            }
            T p = exp(sc * scale - li);
            T dsc = p * (dp - di) * scale;
            for (int d = 0; d < D; ++d) dqs[r * LD + d] += dsc * ks[c * D + d];
        }
    }
    if (i >= Tq) return;
    T* dqr = dq + b * dqb + h * dqh + (long long)i * dqt;
    for (int d = 0; d < D; ++d) dqr[d] = dqs[r * LD + d];
}
"""


# --------------------------------------------------------------------------- launch sizes


def flash_shared(kernel: str, rows: int, cols: int, Dh: int, itemsize: int) -> int:
    """Bytes of shared memory ``kernel`` needs for tiles of ``rows`` threads' rows and ``cols``
    rows of the other operand (flash_fwd, flash_bwd_q: rows = Br queries, cols = Bc keys;
    flash_bwd_kv: rows = Bc keys, cols = Br queries). The rows a thread reads alone are padded by
    one value (the scores' by one column), those every thread reads alike are not."""
    per = {"flash_fwd": 2 * rows * (Dh + 1) + 2 * cols * Dh + rows * (cols + 1),
           "flash_bwd_q": 3 * rows * (Dh + 1) + 2 * cols * Dh,
           "flash_bwd_kv": 4 * rows * (Dh + 1) + 2 * cols * Dh + 2 * cols}
    if kernel not in per:
        raise ValueError(f"flash_shared: no kernel {kernel!r} (flash_fwd, flash_bwd_q, flash_bwd_kv)")
    return per[kernel] * itemsize


def flash_tiles(kernel: str, Dh: int, itemsize: int, limit: int = SHARED_LIMIT) -> int:
    """The tile (rows = columns, a power of two at most :data:`MOST_TILE`) ``kernel`` is
    launched with: the largest whose shared memory fits ``limit`` bytes."""
    t = MOST_TILE
    while t > 1 and flash_shared(kernel, t, t, Dh, itemsize) > limit:
        t //= 2
    if flash_shared(kernel, t, t, Dh, itemsize) > limit:
        raise ValueError(f"{kernel}: a head of {Dh} values does not fit {limit} bytes of shared memory "
                         f"even in tiles of one row")
    return t


class HostLaunch(NamedTuple):
    """A launch as the twins read it (what the CuPy stand-in gives them), for calling a twin
    on NumPy: the fast engine's tiled attention on the CPU runs the kernels' algorithm."""
    name: str
    grid: tuple
    block: tuple
    shared_mem: int
    order: object = None

    @property
    def threads(self) -> int:
        return self.block[0] * (self.block[1] if len(self.block) > 1 else 1)

    @property
    def blocks(self) -> int:
        return self.grid[0] * (self.grid[1] if len(self.grid) > 1 else 1)


# --------------------------------------------------------------------------- NumPy twins


def _check_tiled(launch, kernel: str, rows: int, n_rows: int, groups: int, cols: int, Dh: int, itemsize: int):
    """A tiled kernel's launch: ``rows`` threads per block along x, one block per tile of
    ``n_rows`` along the grid's y and one per head of each sentence (``groups``, counted from the
    arrays) along x (x may exceed y's 65,535 blocks), shared memory for the tiles; an instance
    compiled for a head size (``flash_fwd<float, 64>``) launched at that head size alone."""
    DH = int(launch.name.split(",")[1].rstrip("> ")) if "," in launch.name else 0
    if DH and DH != Dh:
        raise ValueError(f"{launch.name}: compiled for heads of {DH} values, launched with Dh = {Dh}")
    want = (groups, (n_rows + rows - 1) // rows)
    if tuple(launch.grid[:2]) != want:
        raise ValueError(f"{launch.name}: grid {launch.grid} and block {launch.block}, the tiles of {rows} "
                         f"need grid {want}")
    if launch.shared_mem < flash_shared(kernel, rows, cols, Dh, itemsize):
        raise ValueError(f"{launch.name}: {launch.shared_mem} bytes of shared memory, tiles of {rows} x {cols} "
                         f"with Dh {Dh} need {flash_shared(kernel, rows, cols, Dh, itemsize)}")


class Views(NamedTuple):
    """The twins' views of q (B, Hkv, G, Tq, Dh), k and v (B, Hkv, 1, Tk, Dh; :mod:`.flash_mma`'s (B, Hkv,
    Tk, DH)) and the key mask (B, 1, 1, 1, Tk), G = H / Hkv query heads per key head; for the backward,
    of dO (B, Hkv, G, Tq, Dh), the lse and D (B, Hkv, G, Tq)."""
    q: object
    k: object
    v: object
    ok: object
    d_o: object = None
    ls: object = None
    ds: object = None


def _heads(q, k, v, key_ok, Bsz, H, Hkv, Tq, Tk, Dh, strides, dout=None, lse=None, dsum=None) -> Views:
    qb, qh, qt, kb, kh, kt, okb = (int(s) for s in strides)
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"flash attention: {Hkv} key heads do not divide {H} query heads")
    G = H // Hkv
    back = () if dout is None else (per_query(dout, Bsz, H, Hkv, Tq, Dh), per_query(lse, Bsz, H, Hkv, Tq),
                                    per_query(dsum, Bsz, H, Hkv, Tq))
    return Views(strided_view(q, (Bsz, Hkv, G, Tq, Dh), (qb, G * qh, qh, qt, 1)),
                 strided_view(k, (Bsz, Hkv, 1, Tk, Dh), (kb, kh, 0, kt, 1)),
                 strided_view(v, (Bsz, Hkv, 1, Tk, Dh), (kb, kh, 0, kt, 1)),
                 strided_view(key_ok, (Bsz, 1, 1, 1, Tk), (okb, 0, 0, 0, 1)), *back)


def per_query(a, Bsz, H, Hkv, Tq, Dh=0):
    """The twins' (B, Hkv, G, Tq) view of a log-sum-exp or D (B, H, Tq); with ``Dh``, their
    (B, Hkv, G, Tq, Dh) view of o or dO (B, Tq, H, Dh)."""
    G = H // Hkv
    if not Dh:
        return strided_view(a, (Bsz, Hkv, G, Tq), (H * Tq, G * Tq, Tq, 1))
    return strided_view(a, (Bsz, Hkv, G, Tq, Dh), (Tq * H * Dh, G * Dh, Dh, H * Dh, 1))


def allowed_keys(ok, i0, i1, j0, j1, causal):
    """(B, 1, 1, rows, cols) bool: which of queries i0..i1 may attend to keys j0..j1."""
    np = B.host
    a = ok[..., j0:j1]
    if causal:
        a = a & (np.arange(j0, j1)[None, :] <= np.arange(i0, i1)[:, None])
    return a


def flash_fwd_np(launch, q, k, v, key_ok, o, lse, scale, lowest, H, Hkv, Tq, Tk, Dh, causal, Bc,
                 qb, qh, qt, kb, kh, kt, okb):
    """NumPy twin of ``flash_fwd``: the blocks of one query tile for every sentence and head at
    once, the key tiles one by one, as each block runs them."""
    np = B.host
    H, Hkv, Tq, Tk, Dh, Bc = (int(n) for n in (H, Hkv, Tq, Tk, Dh, Bc))
    Br = launch.threads
    _check_tiled(launch, "flash_fwd", Br, Tq, lse.size // Tq, Bc, Dh, q.itemsize)
    Bsz = launch.grid[0] // H
    hd = _heads(q, k, v, key_ok, Bsz, H, Hkv, Tq, Tk, Dh, (qb, qh, qt, kb, kh, kt, okb))
    out, lse_v, dt = per_query(o, Bsz, H, Hkv, Tq, Dh), per_query(lse, Bsz, H, Hkv, Tq), q.dtype.type
    for i0 in range(0, Tq, Br):
        i1 = min(Tq, i0 + Br)
        qi = hd.q[:, :, :, i0:i1]
        m = np.full(qi.shape[:-1], lowest, dtype=q.dtype)
        l = np.zeros(qi.shape[:-1], dtype=q.dtype)
        acc = np.zeros(qi.shape, dtype=q.dtype)
        for j0 in range(0, min(Tk, i1) if causal else Tk, Bc):
            j1 = min(Tk, j0 + Bc)
            ok = allowed_keys(hd.ok, i0, i1, j0, j1, causal)
            s = qi @ hd.k[:, :, :, j0:j1].swapaxes(-1, -2)
            s *= dt(scale)
            any_ = ok.any(axis=-1)
            mn = np.where(any_, np.maximum(m, np.where(ok, s, dt(lowest)).max(axis=-1)), m)
            alpha = np.exp(m - mn)
            p = np.where(ok, np.exp(np.where(ok, s, mn[..., None]) - mn[..., None]), dt(0))
            l = l * alpha + p.sum(axis=-1)
            acc *= alpha[..., None]
            acc += p @ hd.v[:, :, :, j0:j1]
            m = mn
        has = l > 0
        out[:, :, :, i0:i1] = acc * np.where(has, dt(1) / np.where(has, l, 1), dt(0))[..., None]
        lse_v[:, :, :, i0:i1] = np.where(has, m + np.log(np.where(has, l, 1)), dt(0))


def flash_bwd_prep_np(launch, dout, o, dsum, H, Tq, Dh, n):
    """NumPy twin of ``flash_bwd_prep``."""
    H, Tq, Dh, n = int(H), int(Tq), int(Dh), int(n)
    check_threads(launch, n, "queries")
    Bsz = n // (H * Tq)
    shape, strides = (Bsz, H, Tq, Dh), (Tq * H * Dh, Dh, H * Dh, 1)
    strided_view(dsum, (Bsz, H, Tq), (H * Tq, Tq, 1))[...] = (strided_view(dout, shape, strides) * strided_view(o, shape, strides)).sum(-1)


def _tile_grads(hd, i0, i1, j0, j1, causal, scale):
    """A (query tile, key tile)'s recomputed P and dS (B, Hkv, G, rows, cols), 0 where masked."""
    np = B.host
    dt = hd.q.dtype.type
    ok = allowed_keys(hd.ok, i0, i1, j0, j1, causal)
    s = hd.q[:, :, :, i0:i1] @ hd.k[:, :, :, j0:j1].swapaxes(-1, -2)
    s *= dt(scale)
    p = np.where(ok, np.exp(np.where(ok, s, hd.ls[..., i0:i1, None]) - hd.ls[..., i0:i1, None]), dt(0))
    dp = hd.d_o[:, :, :, i0:i1] @ hd.v[:, :, :, j0:j1].swapaxes(-1, -2)
    dp -= hd.ds[..., i0:i1, None]
    dp *= p
    dp *= dt(scale)
    return p, dp


def flash_bwd_kv_np(launch, q, k, v, key_ok, dout, lse, dsum, dk, dv, scale, H, Hkv, Tq, Tk, Dh, causal, Br,
                    qb, qh, qt, kb, kh, kt, dkb, dkh, dkt, okb):
    """NumPy twin of ``flash_bwd_kv``: the blocks of one key tile for every sentence and key head
    at once, the query tiles one by one, each head of a group summed in."""
    H, Hkv, Tq, Tk, Dh, Br = (int(n) for n in (H, Hkv, Tq, Tk, Dh, Br))
    Bc = launch.threads
    _check_tiled(launch, "flash_bwd_kv", Bc, Tk, lse.size // Tq // (H // Hkv), Br, Dh, q.itemsize)
    Bsz = launch.grid[0] // Hkv
    hd = _heads(q, k, v, key_ok, Bsz, H, Hkv, Tq, Tk, Dh, (qb, qh, qt, kb, kh, kt, okb), dout, lse, dsum)
    dk_v, dv_v = (strided_view(a, (Bsz, Hkv, Tk, Dh), (int(dkb), int(dkh), int(dkt), 1)) for a in (dk, dv))
    for j0 in range(0, Tk, Bc):
        j1 = min(Tk, j0 + Bc)
        dkt_, dvt_ = (B.host.zeros((Bsz, Hkv, j1 - j0, Dh), dtype=q.dtype) for _ in range(2))
        for i0 in range((j0 // Br) * Br if causal else 0, Tq, Br):
            i1 = min(Tq, i0 + Br)
            p, dsc = _tile_grads(hd, i0, i1, j0, j1, causal, scale)
            dvt_ += (p.swapaxes(-1, -2) @ hd.d_o[:, :, :, i0:i1]).sum(axis=2)
            dkt_ += (dsc.swapaxes(-1, -2) @ hd.q[:, :, :, i0:i1]).sum(axis=2)
        dk_v[:, :, j0:j1] = dkt_
        dv_v[:, :, j0:j1] = dvt_


def flash_bwd_q_np(launch, q, k, v, key_ok, dout, lse, dsum, dq, scale, H, Hkv, Tq, Tk, Dh, causal, Bc,
                   qb, qh, qt, kb, kh, kt, dqb, dqh, dqt, okb):
    """NumPy twin of ``flash_bwd_q``: the blocks of one query tile for every sentence and head at
    once, the key tiles one by one."""
    H, Hkv, Tq, Tk, Dh, Bc = (int(n) for n in (H, Hkv, Tq, Tk, Dh, Bc))
    Br = launch.threads
    _check_tiled(launch, "flash_bwd_q", Br, Tq, lse.size // Tq, Bc, Dh, q.itemsize)
    Bsz, G = launch.grid[0] // H, H // Hkv
    hd = _heads(q, k, v, key_ok, Bsz, H, Hkv, Tq, Tk, Dh, (qb, qh, qt, kb, kh, kt, okb), dout, lse, dsum)
    dq_v = strided_view(dq, (Bsz, Hkv, G, Tq, Dh), (int(dqb), G * int(dqh), int(dqh), int(dqt), 1))
    for i0 in range(0, Tq, Br):
        i1 = min(Tq, i0 + Br)
        acc = B.host.zeros((Bsz, Hkv, G, i1 - i0, Dh), dtype=q.dtype)
        for j0 in range(0, min(Tk, i1) if causal else Tk, Bc):
            j1 = min(Tk, j0 + Bc)
            _, dsc = _tile_grads(hd, i0, i1, j0, j1, causal, scale)
            acc += dsc @ hd.k[:, :, :, j0:j1]
        dq_v[:, :, :, i0:i1] = acc

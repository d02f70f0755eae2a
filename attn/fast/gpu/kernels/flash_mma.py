"""FlashAttention-2 on the tensor cores: bf16 or fp16 q, k, v (and dO) with float32 statistics
and accumulators, CUDA source compiled by NVRTC and NumPy twins. **Compiled for compute
capability 8.0 to 10.0, never yet run on a GPU** (docs/GPU.md, "The tensor-core attention").

Warps compute 16 x 8 x 16 tiles with ``mma.sync.m16n8k16`` from shared memory read by
``ldmatrix``; shared rows are padded by :data:`PAD` elements (16 bytes: the 8 rows one
``ldmatrix`` reads then start on 8 different banks); the streamed tiles are double-buffered by
``cp.async``. Template parameters: ``KIND`` (0 bf16, 1 fp16), ``DH``, ``BR`` and ``BC`` (the
tile's query and key rows); :data:`INSTANCES` lists those compiled, :func:`mma_tiles` those the
launch code picks. Layouts: the 16-bit copies q, dO (B, H, Tq, DH) and k, v (B, Hkv, Tk, DH)
contiguous (made by ``flash_mma_pack``); o (B, Tq, H, DH), the log-sum-exp and D (B, H, Tq)
float32; dq, dk, dv float32 views with contiguous rows. Masks as :mod:`.flash`'s. Each kernel's
source opens with what its blocks compute; D = rowsum(dO O) is :mod:`.flash`'s ``flash_bwd_prep``."""
from __future__ import annotations

import re

from .... import backend as B
from ....precision import bf16_bits, from_bf16_bits
from .common import strided_view
from .flash import Views, allowed_keys, per_query

#: Elements of padding after each shared-memory row (16 bytes).
PAD = 8
#: The 16-bit formats by ``KIND``.
KINDS = {"bf16": 0, "fp16": 1}
#: The head sizes compiled.
HEAD_SIZES = (64, 128)

PRELUDE = r"""
// The tensor-core attention's device functions. KIND 0: bfloat16, 1: float16 (16-bit patterns in
// unsigned short, two of them packed in an unsigned int, the lower column in the lower half).
// -infinity, the score of a key a query may not see (NVRTC has no math.h for INFINITY).
#define MMA_NEG_INF __int_as_float(0xff800000u)

template <int KIND>
__device__ __forceinline__ unsigned int mma_pack(float lo, float hi) {
    unsigned int r;
    if (KIND == 0) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c (16 x 8, float32) += a (16 x 16, row-major) b (16 x 8, column-major): one warp. Fragments as PTX's
// m16n8k16 says, g = lane / 4, t = lane % 4: a0 (row g, cols 2t, 2t+1), a1 (row g+8), a2 (row g,
// cols 2t+8, 2t+9), a3 (row g+8, cols 2t+8..); b0 (k rows 2t, 2t+1, col g), b1 (k rows 2t+8, 2t+9);
// c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8).
template <int KIND>
__device__ __forceinline__ void mma16816(float* c, const unsigned int* a, const unsigned int* b) {
    if (KIND == 0)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned int mma_smem(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}

// Four 8 x 8 matrices of 16-bit values from shared memory, lanes 8m .. 8m+7 naming the rows of
// matrix m; lane l gets (row l / 4, cols 2 (l % 4), +1) of each. With TRANS, the transposes.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(unsigned int* r, const unsigned short* p) {
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mma_smem(p)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mma_smem(p)));
}

// The A fragment (16 x 16) at row r0, column c0 of a row-major tile with rows LD apart; with TRANS
// over a k-major tile (rows k, columns n) the same addresses give the B fragments of n-blocks c0 and
// c0 + 8 (r[0], r[1] and r[2], r[3]).
template <bool TRANS, int LD>
__device__ __forceinline__ void ldsm_a(unsigned int* r, const unsigned short* tile, int r0, int c0) {
    int lane = threadIdx.x % 32;
    ldsm_x4<TRANS>(r, tile + (r0 + lane % 16) * LD + c0 + (lane / 16) * 8);
}

// The B fragments of n-blocks n0 and n0 + 8 (r[0], r[1] and r[2], r[3]) at k-column k0 of a tile
// holding B^T row-major (rows n, columns k: K's rows for Q K^T).
template <int LD>
__device__ __forceinline__ void ldsm_bt(unsigned int* r, const unsigned short* tile, int n0, int k0) {
    int lane = threadIdx.x % 32;
    ldsm_x4<false>(r, tile + (n0 + lane % 8 + (lane / 16) * 8) * LD + k0 + ((lane / 8) % 2) * 8);
}

// 16 bytes global -> shared without the registers; zeros where !valid (nothing is read).
__device__ __forceinline__ void cp_async16(unsigned short* sh, const unsigned short* g, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(mma_smem(sh)), "l"(g),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// Rows r0 .. r0 + N of a contiguous (rows x DH) array into a tile of rows DH + 8 apart, by cp.async,
// every thread of the block taking 16-byte pieces; zeros past row `last`.
template <int DH, int N>
__device__ __forceinline__ void mma_load(unsigned short* sh, const unsigned short* g, int r0, int last) {
    constexpr int PIECES = DH / 8;
    for (int e = threadIdx.x; e < N * PIECES; e += blockDim.x) {
        int r = e / PIECES, c = (e % PIECES) * 8;
        bool in = r0 + r < last;
        cp_async16(sh + r * (DH + 8) + c, g + (long long)(in ? r0 + r : 0) * DH + c, in);
    }
}

// Whether query i may attend to key j of sentence b.
__device__ __forceinline__ bool mma_allowed(const bool* key_ok, int b, int i, int j, int Tq, int Tk, int causal) {
    return i < Tq && j < Tk && key_ok[(long long)b * Tk + j] && (!causal || j <= i);
}

// Scores (16 x N of a warp, N / 8 n-blocks, k over DH): s = a (16 x DH, fragments in registers or in a
// tile) times the rows n0 .. n0 + N of a tile holding B^T (rows n, columns DH).
template <int KIND, int DH, int N>
__device__ __forceinline__ void mma_scores(float (*s)[4], unsigned int (*af)[4], const unsigned short* bt) {
    for (int n = 0; n < N / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    for (int kk = 0; kk < DH / 16; ++kk)
        for (int nb = 0; nb < N / 16; ++nb) {
            unsigned int bf[4];
            ldsm_bt<DH + 8>(bf, bt, nb * 16, kk * 16);
            mma16816<KIND>(s[2 * nb], af[kk], bf);
            mma16816<KIND>(s[2 * nb + 1], af[kk], bf + 2);
        }
}

// acc (16 x DH) += p (16 x N, the float32 accumulators of mma_scores, rounded to 16 bits here) times
// the N x DH k-major tile `kt` (rows N apart by DH + 8).
template <int KIND, int DH, int N>
__device__ __forceinline__ void mma_accumulate(float (*acc)[4], float (*p)[4], const unsigned short* kt) {
    for (int kk = 0; kk < N / 16; ++kk) {
        unsigned int pa[4] = {mma_pack<KIND>(p[2 * kk][0], p[2 * kk][1]), mma_pack<KIND>(p[2 * kk][2], p[2 * kk][3]),
                              mma_pack<KIND>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                              mma_pack<KIND>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        for (int nd = 0; nd < DH / 16; ++nd) {
            unsigned int bf[4];
            ldsm_a<true, DH + 8>(bf, kt, kk * 16, nd * 16);
            mma16816<KIND>(acc[2 * nd], pa, bf);
            mma16816<KIND>(acc[2 * nd + 1], pa, bf + 2);
        }
    }
}
"""

FLASH_MMA_PACK = r"""
// The 16-bit copy (KIND) of a (B, H, T, Dh) float32 view with contiguous rows at element strides
// (sb, sh, st): dst (B, H, T, Dh) contiguous, rounded to nearest even. A grid-stride loop.
template <int KIND>
__global__ void flash_mma_pack(const float* src, unsigned short* dst, int H, int T, int Dh, long long sb,
                               long long sh, long long st, long long n) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        long long d = e % Dh, r = e / Dh;
        long long t = r % T, bh = r / T;
        float x = src[(bh / H) * sb + (bh % H) * sh + t * st + d];
        unsigned short y;
        if (KIND == 0) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(y) : "f"(x));
        else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(y) : "f"(x));
        dst[e] = y;
    }
}
"""

FLASH_MMA_FWD = r"""
// FlashAttention-2's forward: one block per (sentence * head, query tile of BR), BR / 16 warps each
// owning 16 queries (its Q fragments in registers all along). Shared: Q (BR rows), K and V (BC rows,
// two buffers each), rows DH + 8 apart. Per key tile: S = Q K^T scaled and masked, the row maxima by
// the quad's shuffles, P = exp(S - m) in float32, l = l alpha + rowsum(P), O = O alpha + P16 V.
template <int KIND, int DH, int BR, int BC>
__global__ void __launch_bounds__(BR * 2) flash_mma_fwd(const unsigned short* q, const unsigned short* k,
        const unsigned short* v, const bool* key_ok, float* o, float* lse, float scale, int H, int Hkv, int Tq,
        int Tk, int causal) {
    static_assert(DH % 16 == 0 && BR % 16 == 0 && BC % 16 == 0, "whole 16 x 16 fragments");
    constexpr int LD = DH + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* qs = reinterpret_cast<unsigned short*>(smem);
    unsigned short* ks = qs + BR * LD;
    unsigned short* vs = ks + 2 * BC * LD;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    int b = blockIdx.x / H, h = blockIdx.x % H, hk = h / (H / Hkv), i0 = blockIdx.y * BR;
    const unsigned short* kg = k + ((long long)b * Hkv + hk) * Tk * DH;
    const unsigned short* vg = v + ((long long)b * Hkv + hk) * Tk * DH;
    int kend = causal ? min(Tk, i0 + BR) : Tk;          // causal: the tiles past the last query skipped
    int tiles = (kend + BC - 1) / BC;
    mma_load<DH, BR>(qs, q + (long long)blockIdx.x * Tq * DH, i0, Tq);
    if (tiles > 0) { mma_load<DH, BC>(ks, kg, 0, Tk); mma_load<DH, BC>(vs, vg, 0, Tk); }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned int qf[DH / 16][4];
    for (int kk = 0; kk < DH / 16; ++kk) ldsm_a<false, LD>(qf[kk], qs, warp * 16, kk * 16);
    float acc[DH / 8][4] = {};
    float m[2] = {MMA_NEG_INF, MMA_NEG_INF}, l[2] = {0.f, 0.f};
    int rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
    for (int jt = 0; jt < tiles; ++jt) {
        int buf = jt & 1;
        if (jt + 1 < tiles) {                           // the next tile in flight while this one is used
            mma_load<DH, BC>(ks + (buf ^ 1) * BC * LD, kg, (jt + 1) * BC, Tk);
            mma_load<DH, BC>(vs + (buf ^ 1) * BC * LD, vg, (jt + 1) * BC, Tk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        float s[BC / 8][4];
        mma_scores<KIND, DH, BC>(s, qf, ks + buf * BC * LD);
        float mx[2] = {MMA_NEG_INF, MMA_NEG_INF};
        for (int n = 0; n < BC / 8; ++n)
            for (int e = 0; e < 4; ++e) {
                int j = jt * BC + n * 8 + 2 * t4 + (e & 1);
                s[n][e] = mma_allowed(key_ok, b, rows[e / 2], j, Tq, Tk, causal) ? s[n][e] * scale : MMA_NEG_INF;
                mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
            }
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            float mn = fmaxf(m[r], mx[r]);
            float alpha = mn == MMA_NEG_INF ? 1.f : expf(m[r] - mn);   // the old sums rescaled to the new maximum
            l[r] *= alpha;
            for (int d = 0; d < DH / 8; ++d) { acc[d][2 * r] *= alpha; acc[d][2 * r + 1] *= alpha; }
            m[r] = mn;
        }
        for (int n = 0; n < BC / 8; ++n)
            for (int e = 0; e < 4; ++e) {
                float p = s[n][e] == MMA_NEG_INF ? 0.f : expf(s[n][e] - m[e / 2]);
                s[n][e] = p;
                l[e / 2] += p;                          // this thread's columns; the quad's summed at the end
            }
        mma_accumulate<KIND, DH, BC>(acc, s, vs + buf * BC * LD);
        __syncthreads();                                // every warp done with buf before it is refilled
    }
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        int i = rows[r];
        if (i >= Tq) continue;
        float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        float* orow = o + (((long long)b * Tq + i) * H + h) * DH;
        for (int d = 0; d < DH / 8; ++d) {
            orow[d * 8 + 2 * t4] = acc[d][2 * r] * inv;
            orow[d * 8 + 2 * t4 + 1] = acc[d][2 * r + 1] * inv;
        }
        if (t4 == 0) lse[(long long)blockIdx.x * Tq + i] = l[r] > 0.f ? m[r] + logf(l[r]) : 0.f;
    }
}
"""

FLASH_MMA_BWD_KV = r"""
// One (head, query tile) of flash_mma_bwd_kv for the warp's 16 keys: S^T = K Q^T and dP^T = V dO^T
// (16 x BR each), P^T = exp(S^T scale - lse) where allowed, else 0, dS^T = P^T (dP^T - D); then
// dV += P16^T dO and dK += dS16^T Q into the warp's accumulators (16 x DH each).
template <int KIND, int DH, int BR, int BC>
__device__ __forceinline__ void mma_kv_step(float (*dka)[4], float (*dva)[4], const unsigned short* ks,
        const unsigned short* vs, const unsigned short* qt, const unsigned short* dot, const float* ls,
        const float* ds, const bool* key_ok, int b, int i0, int j0, int Tq, int Tk, int causal, float scale) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    unsigned int af[DH / 16][4];
    float p[BR / 8][4], dp[BR / 8][4];
    for (int kk = 0; kk < DH / 16; ++kk) ldsm_a<false, DH + 8>(af[kk], ks, warp * 16, kk * 16);
    mma_scores<KIND, DH, BR>(p, af, qt);
    for (int kk = 0; kk < DH / 16; ++kk) ldsm_a<false, DH + 8>(af[kk], vs, warp * 16, kk * 16);
    mma_scores<KIND, DH, BR>(dp, af, dot);
    for (int n = 0; n < BR / 8; ++n)
        for (int e = 0; e < 4; ++e) {
            int j = j0 + warp * 16 + g + (e / 2) * 8, c = n * 8 + 2 * t4 + (e & 1);
            float pv = mma_allowed(key_ok, b, i0 + c, j, Tq, Tk, causal) ? expf(p[n][e] * scale - ls[c]) : 0.f;
            p[n][e] = pv;
            dp[n][e] = pv * (dp[n][e] - ds[c]);
        }
    mma_accumulate<KIND, DH, BR>(dva, p, dot);
    mma_accumulate<KIND, DH, BR>(dka, dp, qt);
}

// dK and dV of one key tile: one block per (sentence * key head, key tile of BC), BC / 16 warps each
// owning 16 keys, their dK and dV in registers. Shared: K, V (BC rows), then Q and dO (BR rows, two
// buffers each) with their log-sum-exp and D (BR floats, two buffers each) for every (head of the
// group, query tile) in turn: step st loads st's tiles while the warps use st - 1's. dK is scaled once
// at the end. No atomics: the block sums every query of the group's heads itself.
template <int KIND, int DH, int BR, int BC>
__global__ void __launch_bounds__(BC * 2) flash_mma_bwd_kv(const unsigned short* q, const unsigned short* k,
        const unsigned short* v, const bool* key_ok, const unsigned short* dout, const float* lse,
        const float* dsum, float* dk, float* dv, float scale, int H, int Hkv, int Tq, int Tk, int causal,
        long long dkb, long long dkh, long long dkt) {
    static_assert(DH % 16 == 0 && BR % 16 == 0 && BC % 16 == 0, "whole 16 x 16 fragments");
    constexpr int LD = DH + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* ks = reinterpret_cast<unsigned short*>(smem);
    unsigned short* vs = ks + BC * LD;
    unsigned short* qs = vs + BC * LD;
    unsigned short* dos = qs + 2 * BR * LD;
    float* ls = reinterpret_cast<float*>(dos + 2 * BR * LD);
    float* ds = ls + 2 * BR;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    int G = H / Hkv, b = blockIdx.x / Hkv, hk = blockIdx.x % Hkv, j0 = blockIdx.y * BC;
    int istart = causal ? (j0 / BR) * BR : 0;           // causal: the query tiles before the key tile skipped
    int per = istart < Tq ? (Tq - istart + BR - 1) / BR : 0, steps = G * per;
    mma_load<DH, BC>(ks, k + ((long long)b * Hkv + hk) * Tk * DH, j0, Tk);
    mma_load<DH, BC>(vs, v + ((long long)b * Hkv + hk) * Tk * DH, j0, Tk);
    float dka[DH / 8][4] = {}, dva[DH / 8][4] = {};
    for (int st = 0; st <= steps; ++st) {
        int buf = st & 1;
        if (st < steps) {
            long long bh = (long long)b * H + hk * G + st / per;
            int i0 = istart + (st % per) * BR;
            mma_load<DH, BR>(qs + buf * BR * LD, q + bh * Tq * DH, i0, Tq);
            mma_load<DH, BR>(dos + buf * BR * LD, dout + bh * Tq * DH, i0, Tq);
            for (int r = threadIdx.x; r < BR; r += blockDim.x) {
                ls[buf * BR + r] = i0 + r < Tq ? lse[bh * Tq + i0 + r] : 0.f;
                ds[buf * BR + r] = i0 + r < Tq ? dsum[bh * Tq + i0 + r] : 0.f;
            }
        }
        cp_async_commit();
        if (st == 0) continue;
        cp_async_wait<1>();                             // step st - 1's tiles have landed
        __syncthreads();
        int prev = buf ^ 1;
        mma_kv_step<KIND, DH, BR, BC>(dka, dva, ks, vs, qs + prev * BR * LD, dos + prev * BR * LD, ls + prev * BR,
                                      ds + prev * BR, key_ok, b, istart + ((st - 1) % per) * BR, j0, Tq, Tk,
                                      causal, scale);
        __syncthreads();                                // every warp done with prev before it is refilled
    }
    for (int r = 0; r < 2; ++r) {
        int j = j0 + warp * 16 + g + r * 8;
        if (j >= Tk) continue;
        float* dkr = dk + b * dkb + hk * dkh + j * dkt;
        float* dvr = dv + b * dkb + hk * dkh + j * dkt;
        for (int d = 0; d < DH / 8; ++d) {
            dkr[d * 8 + 2 * t4] = dka[d][2 * r] * scale;
            dkr[d * 8 + 2 * t4 + 1] = dka[d][2 * r + 1] * scale;
            dvr[d * 8 + 2 * t4] = dva[d][2 * r];
            dvr[d * 8 + 2 * t4 + 1] = dva[d][2 * r + 1];
        }
    }
}
"""

FLASH_MMA_BWD_Q = r"""
// dQ of one query tile, in a pass of its own: one block per (sentence * head, query tile of BR), BR / 16
// warps each owning 16 queries (their Q and dO fragments in registers). Shared: Q and dO (BR rows), K and
// V (BC rows, two buffers each). Per key tile: S = Q K^T, dP = dO V^T, P = exp(S scale - lse) where
// allowed, dS = P (dP - D), dQ += dS16 K; scaled once at the end.
template <int KIND, int DH, int BR, int BC>
__global__ void __launch_bounds__(BR * 2) flash_mma_bwd_q(const unsigned short* q, const unsigned short* k,
        const unsigned short* v, const bool* key_ok, const unsigned short* dout, const float* lse,
        const float* dsum, float* dq, float scale, int H, int Hkv, int Tq, int Tk, int causal, long long dqb,
        long long dqh, long long dqt) {
    static_assert(DH % 16 == 0 && BR % 16 == 0 && BC % 16 == 0, "whole 16 x 16 fragments");
    constexpr int LD = DH + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* qs = reinterpret_cast<unsigned short*>(smem);
    unsigned short* dos = qs + BR * LD;
    unsigned short* ks = dos + BR * LD;
    unsigned short* vs = ks + 2 * BC * LD;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    int b = blockIdx.x / H, h = blockIdx.x % H, hk = h / (H / Hkv), i0 = blockIdx.y * BR;
    const unsigned short* kg = k + ((long long)b * Hkv + hk) * Tk * DH;
    const unsigned short* vg = v + ((long long)b * Hkv + hk) * Tk * DH;
    int kend = causal ? min(Tk, i0 + BR) : Tk;
    int tiles = (kend + BC - 1) / BC;
    mma_load<DH, BR>(qs, q + (long long)blockIdx.x * Tq * DH, i0, Tq);
    mma_load<DH, BR>(dos, dout + (long long)blockIdx.x * Tq * DH, i0, Tq);
    if (tiles > 0) { mma_load<DH, BC>(ks, kg, 0, Tk); mma_load<DH, BC>(vs, vg, 0, Tk); }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned int qf[DH / 16][4], df[DH / 16][4];
    for (int kk = 0; kk < DH / 16; ++kk) {
        ldsm_a<false, LD>(qf[kk], qs, warp * 16, kk * 16);
        ldsm_a<false, LD>(df[kk], dos, warp * 16, kk * 16);
    }
    int rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
    float li[2], di[2];
    for (int r = 0; r < 2; ++r) {
        li[r] = rows[r] < Tq ? lse[(long long)blockIdx.x * Tq + rows[r]] : 0.f;
        di[r] = rows[r] < Tq ? dsum[(long long)blockIdx.x * Tq + rows[r]] : 0.f;
    }
    float acc[DH / 8][4] = {};
    for (int jt = 0; jt < tiles; ++jt) {
        int buf = jt & 1;
        if (jt + 1 < tiles) {
            mma_load<DH, BC>(ks + (buf ^ 1) * BC * LD, kg, (jt + 1) * BC, Tk);
            mma_load<DH, BC>(vs + (buf ^ 1) * BC * LD, vg, (jt + 1) * BC, Tk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        float s[BC / 8][4], dp[BC / 8][4];
        mma_scores<KIND, DH, BC>(s, qf, ks + buf * BC * LD);
        mma_scores<KIND, DH, BC>(dp, df, vs + buf * BC * LD);
        for (int n = 0; n < BC / 8; ++n)
            for (int e = 0; e < 4; ++e) {
                int j = jt * BC + n * 8 + 2 * t4 + (e & 1);
                float p = mma_allowed(key_ok, b, rows[e / 2], j, Tq, Tk, causal) ? expf(s[n][e] * scale - li[e / 2])
                                                                                 : 0.f;
                s[n][e] = p * (dp[n][e] - di[e / 2]);
            }
        mma_accumulate<KIND, DH, BC>(acc, s, ks + buf * BC * LD);
        __syncthreads();
    }
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= Tq) continue;
        float* dqr = dq + b * dqb + h * dqh + rows[r] * dqt;
        for (int d = 0; d < DH / 8; ++d) {
            dqr[d * 8 + 2 * t4] = acc[d][2 * r] * scale;
            dqr[d * 8 + 2 * t4 + 1] = acc[d][2 * r + 1] * scale;
        }
    }
}
"""


# --------------------------------------------------------------------------- instances and launch sizes

#: The tiles (BR query rows, BC key rows) each kernel is compiled and launched with, by head size:
#: the forward 64 x 64, the dQ pass 64 queries x 32 keys, the dK/dV pass 64 keys x 32 queries
#: (its Q and dO double-buffered), so that the largest (Dh = 128) needs at most 85 KiB (above
#: :data:`.flash.SHARED_LIMIT` a block opts in: sm_86 and sm_89 allow 99 KiB, sm_80 163, sm_90 227).
TILES = {"flash_mma_fwd": (64, 64), "flash_mma_bwd_kv": (32, 64), "flash_mma_bwd_q": (64, 32)}


def mma_shared(kernel: str, DH: int, BR: int, BC: int) -> int:
    """Bytes of shared memory ``kernel`` takes at head size DH and tiles BR x BC: the rows padded
    to DH + :data:`PAD`, the streamed operand's two buffers."""
    row = (DH + PAD) * 2
    rows = {"flash_mma_fwd": BR + 4 * BC, "flash_mma_bwd_q": 2 * BR + 4 * BC, "flash_mma_bwd_kv": 2 * BC + 4 * BR}
    if kernel not in rows:
        raise ValueError(f"mma_shared: no kernel {kernel!r} ({', '.join(rows)})")
    return rows[kernel] * row + (4 * BR * 4 if kernel == "flash_mma_bwd_kv" else 0)


def mma_rows(kernel: str, BR: int, BC: int) -> int:
    """The rows of the tile a block owns, a warp per 16 of them: queries; keys in the dK/dV pass."""
    return BC if kernel == "flash_mma_bwd_kv" else BR


def instance(kernel: str, fmt: str, DH: int | None = None, tiles: tuple | None = None) -> str:
    """The name expression of ``kernel`` for the 16-bit format ``fmt`` (bf16, fp16) and head size DH,
    at ``tiles`` (BR, BC; default its :data:`TILES`)."""
    if fmt not in KINDS:
        raise ValueError(f"the tensor-core attention reads bf16 or fp16, got {fmt!r}")
    if kernel == "flash_mma_pack":
        return f"flash_mma_pack<{KINDS[fmt]}>"
    if DH not in HEAD_SIZES:
        raise ValueError(f"{kernel}: compiled for heads of {HEAD_SIZES} values, got {DH}")
    BR, BC = TILES[kernel] if tiles is None else tiles
    return f"{kernel}<{KINDS[fmt]}, {DH}, {BR}, {BC}>"


def _consts(launch, n: int) -> tuple:
    """The template arguments of the launched instance (its name, e.g. ``flash_mma_fwd<0, 64, 64, 64>``)."""
    m = re.fullmatch(r"\w+\s*<\s*([\d\s,]+)>", launch.name)
    vals = tuple(int(x) for x in m.group(1).split(",")) if m else ()
    if len(vals) != n:
        raise ValueError(f"{launch.name}: an instance with {n} template arguments is needed")
    return vals


def _check_mma(launch, kernel: str, DH: int, BR: int, BC: int, n_rows: int, groups: int) -> None:
    """The grid (heads, tiles of ``n_rows``), the block (a warp per 16 rows) and the shared memory."""
    own = mma_rows(kernel, BR, BC)
    want = ((groups, -(-n_rows // own)), (2 * own,))
    if (tuple(launch.grid[:2]), tuple(launch.block)) != want:
        raise ValueError(f"{launch.name}: grid {launch.grid} and block {launch.block}, tiles of {own} need "
                         f"grid {want[0]} and block {want[1]}")
    if launch.shared_mem < mma_shared(kernel, DH, BR, BC):
        raise ValueError(f"{launch.name}: {launch.shared_mem} bytes of shared memory, it needs "
                         f"{mma_shared(kernel, DH, BR, BC)}")


# --------------------------------------------------------------------------- NumPy twins


def to_float(h, kind: int):
    """16-bit patterns (uint16) of ``kind`` -> float32 (exact)."""
    np = B.host
    return from_bf16_bits(h) if kind == 0 else h.view(np.float16).astype(np.float32)


def to_bits(x, kind: int):
    """float32 -> the nearest 16-bit values of ``kind`` (ties to even), as uint16 patterns."""
    np = B.host
    return bf16_bits(x) if kind == 0 else x.astype(np.float16).view(np.uint16)


def round16(x, kind: int):
    """float32 ``x`` rounded to ``kind``'s 16 bits, as float32: what ``mma_pack`` hands the tensor cores."""
    return to_float(to_bits(x, kind), kind)


def flash_mma_pack_np(launch, src, dst, H, T, Dh, sb, sh, st, n):
    """NumPy twin of ``flash_mma_pack``."""
    (kind,) = _consts(launch, 1)
    H, T, Dh, n = int(H), int(T), int(Dh), int(n)
    if n % (H * T * Dh or 1):
        raise ValueError(f"{launch.name}: {n} values are not a whole number of ({H}, {T}, {Dh}) blocks")
    if n:
        shape = (n // (H * T * Dh), H, T, Dh)
        x = strided_view(src, shape, (sb, sh, st, 1)).astype(B.host.float32)
        strided_view(dst, shape, (H * T * Dh, T * Dh, Dh, 1))[...] = to_bits(x, kind)


def _packed(kind, q, k, v, key_ok, Bsz, H, Hkv, Tq, Tk, DH, dout=None, lse=None, dsum=None) -> Views:
    """The twins' float32 views of the 16-bit copies: q (and dO) (B, Hkv, G, Tq, DH), k and v
    (B, Hkv, Tk, DH), the key mask (B, 1, 1, 1, Tk); the lse and D (B, Hkv, G, Tq)."""
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"flash attention: {Hkv} key heads do not divide {H} query heads")
    G = H // Hkv
    kv = (Bsz, Hkv, Tk, DH), (Hkv * Tk * DH, Tk * DH, DH, 1)
    heads = (Bsz, Hkv, G, Tq, DH), (H * Tq * DH, G * Tq * DH, Tq * DH, DH, 1)
    back = () if dout is None else (to_float(strided_view(dout, *heads), kind),
                                    per_query(lse, Bsz, H, Hkv, Tq), per_query(dsum, Bsz, H, Hkv, Tq))
    return Views(to_float(strided_view(q, *heads), kind), to_float(strided_view(k, *kv), kind),
                 to_float(strided_view(v, *kv), kind),
                 strided_view(key_ok, (Bsz, 1, 1, 1, Tk), (Tk, 0, 0, 0, 1)), *back)


def flash_mma_fwd_np(launch, q, k, v, key_ok, o, lse, scale, H, Hkv, Tq, Tk, causal):
    """NumPy twin of ``flash_mma_fwd``: the blocks of one query tile for every sentence and head at
    once, the key tiles one by one, in the kernel's order: S in float32 from the 16-bit values, the
    maximum, alpha, P = exp(S - m) in float32, l = l alpha + rowsum(P), acc = acc alpha + P16 V."""
    np = B.host
    kind, DH, BR, BC = _consts(launch, 4)
    H, Hkv, Tq, Tk, causal = (int(n) for n in (H, Hkv, Tq, Tk, causal))
    _check_mma(launch, "flash_mma_fwd", DH, BR, BC, Tq, lse.size // Tq)
    Bsz, f32 = launch.grid[0] // H, np.float32
    pk = _packed(kind, q, k, v, key_ok, Bsz, H, Hkv, Tq, Tk, DH)
    out, lse_v = per_query(o, Bsz, H, Hkv, Tq, DH), per_query(lse, Bsz, H, Hkv, Tq)
    for i0 in range(0, Tq, BR):
        i1 = min(Tq, i0 + BR)
        qi = pk.q[:, :, :, i0:i1]
        m = np.full(qi.shape[:-1], -np.inf, dtype=f32)
        l = np.zeros(qi.shape[:-1], dtype=f32)
        acc = np.zeros(qi.shape, dtype=f32)
        for j0 in range(0, min(Tk, i0 + BR) if causal else Tk, BC):
            j1 = min(Tk, j0 + BC)
            ok = allowed_keys(pk.ok, i0, i1, j0, j1, causal)
            s = np.where(ok, (qi @ pk.k[:, :, None, j0:j1].swapaxes(-1, -2)) * f32(scale), -np.inf)
            mn = np.maximum(m, s.max(axis=-1))
            with np.errstate(invalid="ignore"):          # -inf - -inf where nothing is visible yet: not used
                alpha = np.where(mn == -np.inf, f32(1), np.exp(m - mn))
                p = np.where(ok, np.exp(s - mn[..., None]), f32(0))
            l = l * alpha + p.sum(axis=-1, dtype=f32)
            acc = acc * alpha[..., None] + round16(p, kind) @ pk.v[:, :, None, j0:j1]
            m = mn
        has = l > 0
        out[:, :, :, i0:i1] = acc * np.where(has, f32(1) / np.where(has, l, f32(1)), f32(0))[..., None]
        lse_v[:, :, :, i0:i1] = np.where(has, m + np.log(np.where(has, l, f32(1))), f32(0))


def _tile_ds(pk, h, i0, i1, j0, j1, causal, scale):
    """Head h's (query tile, key tile) as the backward kernels recompute it, float32 (B, Hkv, rows,
    cols): P = exp(S scale - lse) where allowed, else 0, and dS = P (dP - D) with dP = dO V^T."""
    np = B.host
    f32 = np.float32
    ok = allowed_keys(pk.ok, i0, i1, j0, j1, causal)[:, :, 0]
    s = pk.q[:, :, h, i0:i1] @ pk.k[:, :, j0:j1].swapaxes(-1, -2)
    p = np.where(ok, np.exp(s * f32(scale) - pk.ls[:, :, h, i0:i1, None]), f32(0))
    dp = pk.d_o[:, :, h, i0:i1] @ pk.v[:, :, j0:j1].swapaxes(-1, -2)
    return p, p * (dp - pk.ds[:, :, h, i0:i1, None])


def flash_mma_bwd_kv_np(launch, q, k, v, key_ok, dout, lse, dsum, dk, dv, scale, H, Hkv, Tq, Tk, causal,
                        dkb, dkh, dkt):
    """NumPy twin of ``flash_mma_bwd_kv``: the blocks of one key tile for every sentence and key head
    at once; the group's heads, then the query tiles, one by one as the block steps through them;
    dV += P16^T dO and dK += dS16^T Q in float32, dK scaled at the end."""
    np = B.host
    kind, DH, BR, BC = _consts(launch, 4)
    H, Hkv, Tq, Tk, causal = (int(n) for n in (H, Hkv, Tq, Tk, causal))
    G = H // Hkv
    _check_mma(launch, "flash_mma_bwd_kv", DH, BR, BC, Tk, lse.size // Tq // G)
    Bsz = launch.grid[0] // Hkv
    pk = _packed(kind, q, k, v, key_ok, Bsz, H, Hkv, Tq, Tk, DH, dout, lse, dsum)
    dk_v, dv_v = (strided_view(a, (Bsz, Hkv, Tk, DH), (int(dkb), int(dkh), int(dkt), 1)) for a in (dk, dv))
    for j0 in range(0, Tk, BC):
        j1 = min(Tk, j0 + BC)
        dka, dva = (np.zeros((Bsz, Hkv, j1 - j0, DH), dtype=np.float32) for _ in range(2))
        for h in range(G):
            for i0 in range((j0 // BR) * BR if causal else 0, Tq, BR):
                i1 = min(Tq, i0 + BR)
                p, dsc = _tile_ds(pk, h, i0, i1, j0, j1, causal, scale)
                dva += round16(p, kind).swapaxes(-1, -2) @ pk.d_o[:, :, h, i0:i1]
                dka += round16(dsc, kind).swapaxes(-1, -2) @ pk.q[:, :, h, i0:i1]
        dk_v[:, :, j0:j1] = dka * np.float32(scale)
        dv_v[:, :, j0:j1] = dva


def flash_mma_bwd_q_np(launch, q, k, v, key_ok, dout, lse, dsum, dq, scale, H, Hkv, Tq, Tk, causal,
                       dqb, dqh, dqt):
    """NumPy twin of ``flash_mma_bwd_q``: the blocks of one query tile for every sentence and head at
    once, the key tiles one by one; dQ += dS16 K in float32, scaled at the end."""
    np = B.host
    kind, DH, BR, BC = _consts(launch, 4)
    H, Hkv, Tq, Tk, causal = (int(n) for n in (H, Hkv, Tq, Tk, causal))
    _check_mma(launch, "flash_mma_bwd_q", DH, BR, BC, Tq, lse.size // Tq)
    Bsz, G = launch.grid[0] // H, H // Hkv
    pk = _packed(kind, q, k, v, key_ok, Bsz, H, Hkv, Tq, Tk, DH, dout, lse, dsum)
    dq_v = strided_view(dq, (Bsz, Hkv, G, Tq, DH), (int(dqb), G * int(dqh), int(dqh), int(dqt), 1))
    for i0 in range(0, Tq, BR):
        i1 = min(Tq, i0 + BR)
        for h in range(G):
            acc = np.zeros((Bsz, Hkv, i1 - i0, DH), dtype=np.float32)
            for j0 in range(0, min(Tk, i0 + BR) if causal else Tk, BC):
                j1 = min(Tk, j0 + BC)
                _, dsc = _tile_ds(pk, h, i0, i1, j0, j1, causal, scale)
                acc += round16(dsc, kind) @ pk.k[:, :, j0:j1]
            dq_v[:, :, h, i0:i1] = acc * np.float32(scale)


#: Every kernel of the module: name -> (its CUDA source, its NumPy twin), in the source's order.
KERNELS = {
    "flash_mma_pack": (FLASH_MMA_PACK, flash_mma_pack_np),
    "flash_mma_fwd": (FLASH_MMA_FWD, flash_mma_fwd_np),
    "flash_mma_bwd_kv": (FLASH_MMA_BWD_KV, flash_mma_bwd_kv_np),
    "flash_mma_bwd_q": (FLASH_MMA_BWD_Q, flash_mma_bwd_q_np),
}
#: The CUDA source of the tensor-core module (its own ``RawModule``: it needs compute capability 8.0).
SOURCE = PRELUDE + "".join(source for source, _ in KERNELS.values())
#: The instances NVRTC compiles: every kernel for both formats and every head size.
NAME_EXPRESSIONS = tuple(instance(name, fmt, DH) for name in KERNELS for fmt in KINDS
                         for DH in (HEAD_SIZES if name != "flash_mma_pack" else (None,)))
#: Options for NVRTC.
OPTIONS = ("-std=c++14",)

"""Adam: one parameter's update, and the whole arena's in one launch after the gradients' sum of
squares (``sumsq_partial``) when clipping: CUDA source and NumPy twins."""
from __future__ import annotations

import math

from .... import backend as B
from .common import check_block_reduction, strided_view

ADAM = r"""
// One parameter's Adam update, in place on p, m, v (see attn.fast.training.optim.FastAdam).
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
    _update(*(strided_view(a, (n,), (1,)) for a in (p, m, v, g)), one_m_b1, b2, one_m_b2, eps_c, step)


def _update(pv, mv, vv, gv, one_m_b1, b2, one_m_b2, eps_c, step):
    """Adam's update of p, m, v in place, as the kernels make it."""
    mv += one_m_b1 * (gv - mv)
    vv[...] = b2 * vv + one_m_b2 * gv * gv
    pv -= step * mv / (B.host.sqrt(vv) + eps_c)


SUMSQ_PARTIAL = r"""
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
    check_block_reduction(launch, 8)
    nb, t, n = launch.blocks, launch.threads, int(n)
    x = strided_view(g, (n,), (1,)).astype(np.float64)
    x = np.concatenate([x, np.zeros(-n % (nb * t))]).reshape(-1, nb, t)   # [round, block, thread]
    strided_view(partial, (nb,), (1,))[...] = (x * x).sum(axis=(0, 2))


ADAM_FLAT = r"""
// Adam over the whole arena in one launch, in place on p, m, v (see attn.fast.training.optim.FastAdam).
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
    """NumPy twin of ``adam_flat``; where ``launch.order`` is given, block by block in it as the kernel
    runs them: each block reads the step count, updates its elements (``i = block * blockDim + thread``,
    striding by the grid), then takes a ticket; the last block advances the count and sets the ticket
    back."""
    np = B.host
    n, dt = int(n), p.dtype.type
    scale = dt(1)
    if n_partial > 0:
        check_block_reduction(launch, 8)
        norm = np.sqrt(strided_view(partial, (int(n_partial),), (1,)).sum())
        if norm > max_norm:
            scale = dt(max_norm / (norm + 1e-6))
    pv, mv, vv, gv = (strided_view(a, (n,), (1,)) for a in (p, m, v, g))
    count_v, ticket_v = strided_view(count, (1,), (1,)), strided_view(ticket, (1,), (1,))
    order = getattr(launch, "order", None)
    owner = None if order is None else (np.arange(n) // launch.threads) % launch.blocks
    for b in (None,) if order is None else order:
        i = slice(None) if b is None else owner == b           # the whole arena at once, or block b's
        t = float(count_v[0]) + 1.0
        lr = float(fixed_lr) if use_fixed else float(lr_factor) / math.sqrt(float(d_model)) * min(
            1.0 / math.sqrt(t), t * float(warmup) ** -1.5)
        c1, c2 = 1.0 - float(b1) ** t, 1.0 - float(b2) ** t
        pb, mb, vb = pv[i], mv[i], vv[i]
        _update(pb, mb, vb, gv[i] * scale, dt(1.0 - b1), dt(b2), dt(1.0 - b2), dt(float(eps) * math.sqrt(c2)),
                dt(lr * math.sqrt(c2) / c1))
        pv[i], mv[i], vv[i] = pb, mb, vb
        ticket_v[0] += 1
        if b is None or ticket_v[0] == launch.blocks:          # the last block
            count_v[0] += 1
            ticket_v[0] = 0

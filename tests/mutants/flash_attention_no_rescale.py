"""FlashAttention whose online softmax never rescales: when a key tile raises a query's running
maximum, what was summed under the old maximum is kept as it was, not multiplied by
exp(m_old - m_new). Right with one key tile, wrong with several."""
import math

from attn import backend as B
from attn.layers import flash_attention_backward  # noqa: F401
from attn.layers.flash_attention import FlashCache, _keep, _scores, key_tiles


def flash_attention_forward(q, k, v, mask=None, q_tile=64, k_tile=64, causal=False):
    xp = B.get_array_module(q)
    Tq, Tk, scale = q.shape[-2], k.shape[-2], 1 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for i0 in range(0, Tq, q_tile):
        i1 = min(i0 + q_tile, Tq)
        m = xp.full(q.shape[:-2] + (i1 - i0,), -math.inf, dtype=q.dtype)
        l, acc = xp.zeros_like(m), xp.zeros(m.shape + (v.shape[-1],), dtype=q.dtype)
        for j0, j1 in key_tiles(i0, i1, Tk, k_tile, causal, Tk - Tq):
            s = _scores(q[..., i0:i1, :], k[..., j0:j1, :], scale, _keep(xp, mask, causal, Tk - Tq, i0, i1, j0, j1))
            m = xp.maximum(m, s.max(axis=-1))
            p = xp.exp(s - xp.where(xp.isinf(m), 0.0, m)[..., None])
            l, acc = l + p.sum(axis=-1), acc + p @ v[..., j0:j1, :]
        outs.append(acc / xp.where(l > 0, l, 1.0)[..., None])
        lses.append(xp.where(l > 0, m + xp.log(xp.where(l > 0, l, 1.0)), math.inf))
    out = xp.concatenate(outs, axis=-2)
    return out, FlashCache(q, k, v, mask, out, xp.concatenate(lses, axis=-1), q_tile, k_tile, causal, scale, 0)

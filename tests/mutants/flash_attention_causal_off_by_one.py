"""FlashAttention whose causal forward skips a key tile by the query tile's first query
(j0 > i0) instead of its last (j0 > i1 - 1): the later queries of a tile lose keys they see."""
import math

from attn import backend as B
from attn.layers import flash_attention_backward  # noqa: F401
from attn.layers.flash_attention import FlashCache, _keep, _scores


def flash_attention_forward(q, k, v, mask=None, q_tile=64, k_tile=64, causal=False):
    xp = B.get_array_module(q)
    Tq, Tk, scale = q.shape[-2], k.shape[-2], 1 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for i0 in range(0, Tq, q_tile):
        i1 = min(i0 + q_tile, Tq)
        m = xp.full(q.shape[:-2] + (i1 - i0,), -math.inf, dtype=q.dtype)
        l, acc = xp.zeros_like(m), xp.zeros(m.shape + (v.shape[-1],), dtype=q.dtype)
        for j0 in range(0, Tk, k_tile):
            if causal and j0 > i0 + Tk - Tq:                  # the tile's first query, not its last
                continue
            j1 = min(j0 + k_tile, Tk)
            s = _scores(q[..., i0:i1, :], k[..., j0:j1, :], scale, _keep(xp, mask, causal, Tk - Tq, i0, i1, j0, j1))
            new = xp.maximum(m, s.max(axis=-1))
            ref = xp.where(xp.isinf(new), 0.0, new)
            p, alpha = xp.exp(s - ref[..., None]), xp.exp(m - ref)
            l, acc, m = alpha * l + p.sum(axis=-1), alpha[..., None] * acc + p @ v[..., j0:j1, :], new
        seen = l > 0
        outs.append(acc / xp.where(seen, l, 1.0)[..., None])
        lses.append(xp.where(seen, m + xp.log(xp.where(seen, l, 1.0)), math.inf))
    out = xp.concatenate(outs, axis=-2)
    return out, FlashCache(q, k, v, mask, out, xp.concatenate(lses, axis=-1), q_tile, k_tile, causal, scale, 0)

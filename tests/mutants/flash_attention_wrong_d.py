"""FlashAttention whose backward takes D = rowsum(P * dP) over each key tile's own weights
instead of D = rowsum(dout * out) over the whole row: right with one key tile only."""
from attn import backend as B
from attn.layers import flash_attention_forward  # noqa: F401
from attn.layers.flash_attention import _keep, _scores, _tiles, key_tiles


def flash_attention_backward(dout, cache):
    q, k, v, mask, out, lse, q_tile, k_tile, causal, scale, _ = cache
    xp = B.get_array_module(q)
    Tq, Tk = q.shape[-2], k.shape[-2]
    dq, dk, dv = xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    for i0, i1 in _tiles(Tq, q_tile):
        for j0, j1 in key_tiles(i0, i1, Tk, k_tile, causal, Tk - Tq):
            s = _scores(q[..., i0:i1, :], k[..., j0:j1, :], scale, _keep(xp, mask, causal, Tk - Tq, i0, i1, j0, j1))
            p = xp.exp(s - lse[..., i0:i1, None])
            dv[..., j0:j1, :] += p.swapaxes(-1, -2) @ dout[..., i0:i1, :]
            dp = dout[..., i0:i1, :] @ v[..., j0:j1, :].swapaxes(-1, -2)
            ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True)) * scale
            dq[..., i0:i1, :] += ds @ k[..., j0:j1, :]
            dk[..., j0:j1, :] += ds.swapaxes(-1, -2) @ q[..., i0:i1, :]
    return dq, dk, dv

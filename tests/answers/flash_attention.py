"""A learner's answer to lessons/exercises/flash_attention.py, written from its docstrings:
attn-check must pass it."""
import math

from attn import backend as B


def _seen(mask, causal, Tq, Tk, i0, i1, j0, j1):
    xp = B.xp()
    keep = xp.ones((i1 - i0, j1 - j0), dtype=bool)
    if mask is not None:
        m = xp.broadcast_to(mask, mask.shape[:-2] + (Tq, Tk))
        keep = keep & m[..., i0:i1, j0:j1]
    if causal:
        keep = keep & (xp.arange(j0, j1)[None, :] <= xp.arange(i0, i1)[:, None] + (Tk - Tq))
    return keep


def _scores(q, k, mask, causal, i0, i1, j0, j1):
    xp = B.get_array_module(q)
    s = q[..., i0:i1, :] @ k[..., j0:j1, :].swapaxes(-1, -2) * q.dtype.type(1 / math.sqrt(q.shape[-1]))
    return xp.where(_seen(mask, causal, q.shape[-2], k.shape[-2], i0, i1, j0, j1), s, q.dtype.type(-math.inf))


def _pairs(Tq, Tk, q_tile, k_tile, causal):
    for i0 in range(0, Tq, q_tile):
        i1 = min(i0 + q_tile, Tq)
        yield i0, i1, [(j0, min(j0 + k_tile, Tk)) for j0 in range(0, Tk, k_tile)
                       if not causal or j0 <= i1 - 1 + Tk - Tq]


def flash_attention_forward(q, k, v, mask=None, q_tile=64, k_tile=64, causal=False):
    xp = B.get_array_module(q)
    outs, lses = [], []
    for i0, i1, keys in _pairs(q.shape[-2], k.shape[-2], q_tile, k_tile, causal):
        m = xp.full(q.shape[:-2] + (i1 - i0, 1), -math.inf, dtype=q.dtype)
        l = xp.zeros_like(m)
        acc = xp.zeros(q.shape[:-2] + (i1 - i0, v.shape[-1]), dtype=q.dtype)
        for j0, j1 in keys:
            s = _scores(q, k, mask, causal, i0, i1, j0, j1)
            new = xp.maximum(m, s.max(axis=-1, keepdims=True))
            ref = xp.where(xp.isinf(new), q.dtype.type(0), new)
            p = xp.exp(s - ref)
            l = l * xp.exp(m - ref) + p.sum(axis=-1, keepdims=True)
            acc = acc * xp.exp(m - ref) + p @ v[..., j0:j1, :]
            m = new
        ok = l > 0
        outs.append(xp.where(ok, acc / xp.where(ok, l, 1), q.dtype.type(0)))
        lses.append(xp.where(ok, m + xp.log(xp.where(ok, l, 1)), q.dtype.type(math.inf)))
    out = xp.concatenate(outs, axis=-2)
    return out, (q, k, v, mask, causal, q_tile, k_tile, out, xp.concatenate(lses, axis=-2))


def flash_attention_backward(dout, cache):
    q, k, v, mask, causal, q_tile, k_tile, out, lse = cache
    xp = B.get_array_module(q)
    D = (dout * out).sum(axis=-1, keepdims=True)
    dq, dk, dv = xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    for i0, i1, keys in _pairs(q.shape[-2], k.shape[-2], q_tile, k_tile, causal):
        for j0, j1 in keys:
            p = xp.exp(_scores(q, k, mask, causal, i0, i1, j0, j1) - lse[..., i0:i1, :])
            dv[..., j0:j1, :] += p.swapaxes(-1, -2) @ dout[..., i0:i1, :]
            ds = p * (dout[..., i0:i1, :] @ v[..., j0:j1, :].swapaxes(-1, -2) - D[..., i0:i1, :])
            ds = ds * q.dtype.type(1 / math.sqrt(q.shape[-1]))
            dq[..., i0:i1, :] += ds @ k[..., j0:j1, :]
            dk[..., j0:j1, :] += ds.swapaxes(-1, -2) @ q[..., i0:i1, :]
    return dq, dk, dv

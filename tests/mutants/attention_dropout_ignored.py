"""Attention that takes dropout and rng and ignores them (every dropout example once passed)."""
import math

from attn import layers as L


def attention_forward(q, k, v, mask=None, dropout=0.0, rng=None):
    s = (q @ k.swapaxes(-1, -2)) * q.dtype.type(1 / math.sqrt(q.shape[-1]))
    w, cw = L.softmax_forward(s, mask)
    return w @ v, (q, k, v, w, cw)


def attention_backward(dout, cache):
    q, k, v, w, cw = cache
    dv = w.swapaxes(-1, -2) @ dout
    ds = L.softmax_backward(dout @ v.swapaxes(-1, -2), cw) * q.dtype.type(1 / math.sqrt(q.shape[-1]))
    dq, dk = ds @ k, ds.swapaxes(-1, -2) @ q
    return dq, dk.reshape(k.shape) if dk.shape == k.shape else dk.sum(axis=tuple(range(dk.ndim - k.ndim))), dv

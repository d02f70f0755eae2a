"""Attention whose backward draws a fresh dropout mask instead of the forward's."""
import math

from attn import layers as L


def attention_forward(q, k, v, mask=None, dropout=0.0, rng=None):
    s = (q @ k.swapaxes(-1, -2)) * q.dtype.type(1 / math.sqrt(q.shape[-1]))
    w, cw = L.softmax_forward(s, mask)
    keep = None
    if dropout and rng is not None:
        keep = (rng.random(w.shape, dtype=w.dtype) >= dropout).astype(w.dtype) / w.dtype.type(1 - dropout)
    wd = w if keep is None else w * keep
    return wd @ v, (q, k, v, w, wd, cw, dropout, rng)


def attention_backward(dout, cache):
    q, k, v, w, wd, cw, p, rng = cache
    dv = wd.swapaxes(-1, -2) @ dout
    dw = dout @ v.swapaxes(-1, -2)
    if p and rng is not None:
        dw = dw * (rng.random(w.shape, dtype=w.dtype) >= p).astype(w.dtype) / w.dtype.type(1 - p)
    ds = L.softmax_backward(dw, cw) * q.dtype.type(1 / math.sqrt(q.shape[-1]))
    return ds @ k, ds.swapaxes(-1, -2) @ q, dv

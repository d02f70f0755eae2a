"""Subtracts the maximum of the whole array, not of each row (masks and fully masked rows
handled right): a row far below the global maximum underflows to zeros. Only the hard
examples (logits of 1e4) show it; the final profile runs them whatever its seed."""
import numpy as np


def softmax_forward(x, mask=None):
    if mask is not None:
        x = np.where(mask, x, -np.inf)
    finite = x[np.isfinite(x)]
    e = np.exp(x - (finite.max() if finite.size else 0.0))
    s = e.sum(axis=-1, keepdims=True)
    y = np.where(s > 0, e / np.where(s > 0, s, 1), 0).astype(x.dtype)
    return y, y


def softmax_backward(dout, cache):
    y = cache
    return y * (dout - (dout * y).sum(axis=-1, keepdims=True))

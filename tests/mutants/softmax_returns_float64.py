"""Softmax that computes in float64 whatever its input: float32 in, float64 out."""
from attn import backend as B
from attn.layers.softmax import SoftmaxCache, softmax_backward  # noqa: F401


def softmax_forward(x, mask=None):
    xp = B.get_array_module(x)
    x = x.astype(xp.float64)
    if mask is not None:
        x = xp.where(mask, x, xp.finfo(x.dtype).min)
    e = xp.exp(x - x.max(axis=-1, keepdims=True))
    y = e / e.sum(axis=-1, keepdims=True)
    if mask is not None:
        y = xp.where(mask, y, 0.0)
    return y, SoftmaxCache(y)

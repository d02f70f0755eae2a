"""Right in float64, zeros in float32 (of the right dtype)."""
from attn import backend as B


def softmax_forward(x, mask=None):
    xp = B.get_array_module(x)
    if x.dtype == xp.float32:
        return xp.zeros_like(x), None
    if mask is not None:
        x = xp.where(mask, x, -xp.inf)
    m = x.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    e = xp.exp(x - m)
    s = e.sum(axis=-1, keepdims=True)
    y = xp.where(s > 0, e / xp.where(s > 0, s, 1.0), 0.0)
    return y, y


def softmax_backward(dy, y):
    return y * (dy - (dy * y).sum(axis=-1, keepdims=True))

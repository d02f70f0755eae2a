"""Dropout without the 1/(1-p) scale of the kept units."""
from attn.layers.dropout import DropoutCache, dropout_backward  # noqa: F401


def dropout_forward(x, p, rng=None):
    if p == 0.0 or rng is None:
        return x, DropoutCache(None)
    mask = (rng.random(x.shape, dtype=x.dtype) >= p).astype(x.dtype)         # * 1/(1-p) missing
    return x * mask, DropoutCache(mask)

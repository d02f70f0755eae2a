"""Dropout whose backward draws a fresh mask instead of reusing the forward's."""
from typing import NamedTuple


class Cache(NamedTuple):
    rng: object
    p: float
    shape: tuple
    dtype: object


def dropout_forward(x, p, rng=None):
    if p == 0.0 or rng is None:
        return x, Cache(None, p, x.shape, x.dtype)
    mask = (rng.random(x.shape, dtype=x.dtype) >= p).astype(x.dtype) / (1.0 - p)
    return x * mask, Cache(rng, p, x.shape, x.dtype)


def dropout_backward(dout, cache):
    if cache.rng is None:
        return dout
    mask = (cache.rng.random(cache.shape, dtype=cache.dtype) >= cache.p).astype(cache.dtype) / (1.0 - cache.p)
    return dout * mask

"""Inverted dropout (section 5.4, "Residual Dropout").

Training keeps each unit with probability ``1 - p`` and scales the kept ones by
``1 / (1 - p)``, so the expectation is unchanged and inference needs no rescale.
Each call draws a fresh mask from ``rng``: two call sites never share one.
"""
from __future__ import annotations

from typing import NamedTuple


class DropoutCache(NamedTuple):
    """Kept for backward: the scaled mask (``0`` or ``1/(1-p)``), or None when dropout was off."""
    mask: object


def dropout_forward(x, p: float, rng=None):
    """Inputs: x (any shape); p in [0, 1); rng a :class:`attn.backend.DeviceRNG`, or None for
    evaluation. With ``p == 0`` or ``rng is None`` this is the identity.

    Returns: out (same shape as x), cache.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    if p == 0.0 or rng is None:
        return x, DropoutCache(None)
    keep = rng.random(x.shape, dtype=x.dtype) >= p
    mask = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - p))
    return x * mask, DropoutCache(mask)


def dropout_backward(dout, cache: DropoutCache):
    """Forward was ``out = x * mask``, so ``dx = dout * mask`` (the same mask)."""
    return dout if cache.mask is None else dout * cache.mask

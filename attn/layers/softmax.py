"""Softmax over the last axis with an optional boolean mask (padding, look-ahead)."""
from __future__ import annotations

from typing import NamedTuple

from .. import backend as B


class SoftmaxCache(NamedTuple):
    """Kept for backward: the output ``y`` alone (the backward needs nothing else)."""
    y: object


def softmax_forward(x, mask=None):
    """Inputs: x (..., K) logits; mask None or a bool array broadcastable to x,
    True where a position may receive weight.

    Returns: y (..., K), cache. Rows sum to one over their unmasked positions,
    masked positions are exactly 0, and a fully masked row is all zeros (never NaN).

    Masked logits are replaced by the dtype's most negative finite value (not a
    magic -1e4, which a logit of magnitude 1e4 would beat); subtracting the row
    maximum keeps exp() from overflowing; the mask is applied again to the output
    so that a fully masked row, which would come out uniform, gives zeros.
    """
    xp = B.get_array_module(x)
    if mask is not None:
        x = xp.where(mask, x, xp.finfo(x.dtype).min)
    e = xp.exp(x - x.max(axis=-1, keepdims=True))
    y = e / e.sum(axis=-1, keepdims=True)
    if mask is not None:
        y = xp.where(mask, y, y.dtype.type(0))
    return y, SoftmaxCache(y)


def softmax_backward(dy, cache: SoftmaxCache):
    """Forward was ``y_i = exp(x_i) / sum_j exp(x_j)``, whose Jacobian is
    ``diag(y) - y y^T``; applied to ``dy`` without building it:
    ``dx = y * (dy - sum(dy * y))``. Masked positions have y = 0, so dx = 0 there.
    """
    y = cache.y
    return y * (dy - (dy * y).sum(axis=-1, keepdims=True))

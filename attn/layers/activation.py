"""ReLU, the non-linearity of the position-wise feed-forward network (section 3.3)."""
from __future__ import annotations

from typing import NamedTuple


class ReluCache(NamedTuple):
    """Kept for backward: the boolean map of positive inputs."""
    positive: object


def relu_forward(x):
    """``out = max(x, 0)``. Returns: out (same shape), cache."""
    positive = x > 0
    return x * positive, ReluCache(positive)


def relu_backward(dout, cache: ReluCache):
    """Forward was ``out = x * (x > 0)``, so ``dx = dout * (x > 0)``."""
    return dout * cache.positive

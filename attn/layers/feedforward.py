"""Position-wise feed-forward network (section 3.3): ``FFN(x) = max(0, x W1 + b1) W2 + b2``."""
from __future__ import annotations

from typing import NamedTuple

from .activation import relu_backward, relu_forward
from .dropout import dropout_backward, dropout_forward
from .linear import linear_backward, linear_forward


class FeedForwardCache(NamedTuple):
    """The caches of the two linear maps, the ReLU, and the optional ReLU dropout."""
    lin1: object
    relu: object
    drop: object
    lin2: object


def feed_forward_forward(x, w1, b1, w2, b2, dropout: float = 0.0, rng=None):
    """Inputs: x (..., D); w1 (D, F); b1 (F,); w2 (F, D); b2 (D,); dropout on the
    hidden activations (0 in the paper; tensor2tensor's "relu dropout").

    Returns: out (..., D), cache.
    """
    h, c1 = linear_forward(x, w1, b1)          # (..., F)
    a, cr = relu_forward(h)
    a, cd = dropout_forward(a, dropout, rng)
    out, c2 = linear_forward(a, w2, b2)        # (..., D)
    return out, FeedForwardCache(c1, cr, cd, c2)


def feed_forward_backward(dout, cache: FeedForwardCache):
    """Backward through the four steps in reverse.

    Returns: dx (..., D), dw1, db1, dw2, db2.
    """
    da, dw2, db2 = linear_backward(dout, cache.lin2)
    da = dropout_backward(da, cache.drop)
    dh = relu_backward(da, cache.relu)
    dx, dw1, db1 = linear_backward(dh, cache.lin1)
    return dx, dw1, db1, dw2, db2

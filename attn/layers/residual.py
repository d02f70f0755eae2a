"""A sub-layer in its residual connection, "Add & Norm" (section 3.1, post-norm):

    out = LayerNorm(x + Sublayer(x))

with the position-wise feed-forward network as the sub-layer (the model wraps its
attention sub-layers the same way, see ``attn.model``). The residual ``x + ...`` is
what lets the gradient reach early layers undiminished: ``x`` reaches the sum by two
paths, so its gradient is the sum of two terms.
"""
from __future__ import annotations

from typing import NamedTuple

from .feedforward import feed_forward_backward, feed_forward_forward
from .layernorm import layer_norm_backward, layer_norm_forward


class ResidualCache(NamedTuple):
    """The caches of the feed-forward network and of the layer norm."""
    ffn: object
    norm: object


def residual_ffn_forward(x, w1, b1, w2, b2, gamma, beta, eps: float = 1e-5):
    """Inputs: x (..., D); w1 (D, F); b1 (F,); w2 (F, D); b2 (D,); gamma, beta (D,).

    Returns: out (..., D) = ``layer_norm(x + FFN(x))``, cache.
    """
    f, cf = feed_forward_forward(x, w1, b1, w2, b2)           # (..., D)
    out, cn = layer_norm_forward(x + f, gamma, beta, eps)
    return out, ResidualCache(cf, cn)


def residual_ffn_backward(dout, cache: ResidualCache):
    """Forward was ``out = LN(z)`` with ``z = x + FFN(x)``. The norm's backward gives
    ``dz``; ``x`` reaches ``z`` through the skip path (``dz`` itself) and through the
    network (its backward of ``dz``), so ``dx = dz + FFN_backward(dz)``.

    Returns: dx, dw1, db1, dw2, db2, dgamma, dbeta.
    """
    dz, dgamma, dbeta = layer_norm_backward(dout, cache.norm)
    dx_ffn, dw1, db1, dw2, db2 = feed_forward_backward(dz, cache.ffn)
    return dz + dx_ffn, dw1, db1, dw2, db2, dgamma, dbeta

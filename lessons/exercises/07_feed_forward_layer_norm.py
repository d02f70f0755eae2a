"""Exercise for lesson 7: ReLU, the feed-forward network, layer norm, and Add & Norm.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/07_feed_forward_layer_norm.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

Every layer this file asks for is graded; one whose body still raises NotImplementedError
is "not implemented yet" (``--layer layer_norm`` grades one).
Each forward returns ``(out, cache)`` (the cache is yours); each backward returns the
gradients in the order the forward took its inputs. ``xp = B.get_array_module(x)``.
The library's layers are at hand as ``L.linear_forward``, ``L.dropout_forward``, ... (imported
as a module, so that attn-check grades only what you write here).
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401
from attn import layers as L  # noqa: F401  (L.linear_forward, L.dropout_forward, ...: the library's)


def relu_forward(x):
    """``out = max(x, 0)``. Returns: out (same shape as x), cache."""
    raise NotImplementedError


def relu_backward(dout, cache):
    """The gradient of ``max(x, 0)``: derive it (which array decides where it passes?). Returns: dx."""
    raise NotImplementedError


def feed_forward_forward(x, w1, b1, w2, b2):
    """``FFN(x) = max(0, x W1 + b1) W2 + b2`` (equation 2); ``L.linear_forward`` does the affine maps.

    Inputs: x (..., D); w1 (D, F); b1 (F,); w2 (F, D); b2 (D,). Returns: out (..., D), cache.

    Dropout comes in lesson 12. The paper drops each sub-layer's *output*, before the residual
    addition (section 5.4), which belongs to the Add & Norm, not here. The library's
    feed-forward can also drop its hidden units (``TransformerConfig.relu_dropout``, the
    "relu dropout" of tensor2tensor, not in the paper's text): to be graded on it, add
    ``dropout=0.0, rng=None`` and apply ``L.dropout_forward`` after the ReLU.
    """
    raise NotImplementedError


def feed_forward_backward(dout, cache):
    """The forward's steps in reverse.

    Returns: dx (..., D), dw1, db1, dw2, db2.
    """
    raise NotImplementedError


def layer_norm_forward(x, gamma, beta, eps=1e-5):
    """Normalise each row of the last axis, then scale and shift:

        mean = mean(x),  var = mean((x - mean)**2)    (biased: divide by D)
        xhat = (x - mean) / sqrt(var + eps),  out = gamma * xhat + beta

    Inputs: x (..., D); gamma (D,); beta (D,). Returns: out (..., D), cache.
    """
    raise NotImplementedError


def layer_norm_backward(dout, cache):
    """The gradients of the layer norm: derive them. The mean and the variance both depend on
    every x of the row, so dx has more than the direct term; gamma and beta are shared by every
    row. Lesson 8, section 2 derives them (equations 8.3 and 8.4): do this after lesson 8, or
    derive them first.

    Returns: dx (..., D), dgamma (D,), dbeta (D,).
    """
    raise NotImplementedError


def residual_ffn_forward(x, w1, b1, w2, b2, gamma, beta, eps=1e-5):
    """Add & Norm around the feed-forward network (section 3.1): ``out = LayerNorm(x + FFN(x))``.

    Inputs: x (..., D); w1 (D, F); b1 (F,); w2 (F, D); b2 (D,); gamma, beta (D,).
    Returns: out (..., D), cache.
    """
    raise NotImplementedError


def residual_ffn_backward(dout, cache):
    """The norm's backward, then the addition: by how many paths does x reach the sum?

    Returns: dx, dw1, db1, dw2, db2, dgamma, dbeta.
    """
    raise NotImplementedError

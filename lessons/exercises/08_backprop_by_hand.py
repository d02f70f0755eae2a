"""Exercise for lesson 8: three backward passes by hand.

The forwards are the library's (imported below); write the backwards, which receive the
library's caches, then grade them:

    attn-check lessons/exercises/08_backprop_by_hand.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

attn-check compares your gradients with the library's and with float64 central
differences, and checks the invariants (rows of a softmax's dx sum to zero, ...).

The caches you get:
    softmax_forward     -> SoftmaxCache(y)                          y (..., K) the output
    layer_norm_forward  -> LayerNormCache(xhat, rstd, gamma)        xhat (..., D), rstd (..., 1) = 1/sqrt(var + eps)
    attention_forward   -> AttentionCache(q, k, v, weights, drop, scale)
                           weights (..., Tq, Tk) before dropout; drop.mask None or the scaled
                           dropout mask; scale = 1/sqrt(d_k)
"""
from __future__ import annotations

from attn.layers import attention_forward, layer_norm_forward, softmax_forward  # noqa: F401


def softmax_backward(dy, cache):
    """Forward was ``y_i = exp(x_i) / sum_j exp(x_j)`` over the last axis: derive dx.

    Inputs: dy (..., K). Returns: dx (..., K).
    """
    raise NotImplementedError


def layer_norm_backward(dout, cache):
    """Forward was ``out = gamma * xhat + beta``, ``xhat = (x - mean) * rstd``,
    ``rstd = 1/sqrt(var + eps)``, mean and var over the row: derive the gradients.

    Inputs: dout (..., D). Returns: dx (..., D), dgamma (D,), dbeta (D,).
    """
    raise NotImplementedError


def attention_backward(dout, cache):
    """Forward was ``out = drop(w) @ v``, ``w = softmax(s)``, ``s = q @ k^T * scale``: derive
    the gradients, step by step in reverse.

    Inputs: dout (..., Tq, Dv). Returns: dq, dk, dv (shapes of q, k, v).
    """
    raise NotImplementedError

"""The gated feed-forward network of Llama and its successors, SwiGLU (Shazeer, 2020,
"GLU Variants Improve Transformer"):

    FFN_SwiGLU(x) = (SiLU(x W) * (x V)) W2,        SiLU(a) = a * sigmoid(a)

One path (x V) is gated element by element by the other (SiLU(x W)). It has three
matrices where the paper's network has two, so at the same parameter count its hidden
width is two thirds of the paper's d_ff (:func:`swiglu_width`). Like Llama's, it has no biases.
"""
from __future__ import annotations

from typing import NamedTuple

from .. import backend as B
from .dropout import dropout_backward, dropout_forward
from .linear import linear_backward, linear_forward


def swiglu_width(d_ff: int, multiple_of: int = 1) -> int:
    """The hidden width F' that gives SwiGLU's three (D, F') matrices the parameters of the
    paper's two (D, d_ff) ones: ``3 D F' = 2 D d_ff``, so ``F' = 2 d_ff / 3``, rounded to
    the nearest multiple of ``multiple_of`` (Llama rounds up to 256)."""
    if d_ff < 1 or multiple_of < 1:
        raise ValueError(f"swiglu_width: d_ff and multiple_of must be positive, got {d_ff}, {multiple_of}")
    return max(multiple_of, int(round(2 * d_ff / 3 / multiple_of)) * multiple_of)


def silu(a):
    """``a * sigmoid(a)``, and the sigmoid, without overflow for large ``|a|``."""
    xp = B.get_array_module(a)
    s = 0.5 * (1 + xp.tanh(0.5 * a))      # sigmoid(a) = (1 + tanh(a/2)) / 2, never exp of a large number
    return a * s, s


class SwigluCache(NamedTuple):
    """Kept for backward: the three products' caches, the gate's pre-activation ``a = x W``,
    its sigmoid, the value path ``b = x V`` and the hidden dropout's cache."""
    lin_w: object
    lin_v: object
    a: object
    sig: object
    b: object
    drop: object
    lin_2: object


def swiglu_forward(x, w, v, w2, dropout: float = 0.0, rng=None):
    """Inputs: x (..., D); w (D, F); v (D, F); w2 (F, D); dropout on the gated hidden
    activations, as the paper's network has on its ReLU's.

    Returns: out (..., D), cache.
    """
    if w.shape != v.shape:
        raise ValueError(f"swiglu: w {tuple(w.shape)} and v {tuple(v.shape)} must have the same shape (D, F)")
    a, cw = linear_forward(x, w)              # (..., F) the gate's pre-activation
    b, cv = linear_forward(x, v)              # (..., F) the value path
    g, sig = silu(a)
    h, cd = dropout_forward(g * b, dropout, rng)
    out, c2 = linear_forward(h, w2)           # (..., D)
    return out, SwigluCache(cw, cv, a, sig, b, cd, c2)


def swiglu_backward(dout, cache: SwigluCache):
    """Forward was ``out = (silu(a) * b) W2`` with ``a = x W``, ``b = x V``, so with
    ``dh = dout W2^T``: ``db = dh * silu(a)``, ``da = dh * b * silu'(a)`` where
    ``silu'(a) = s (1 + a (1 - s))``, ``s = sigmoid(a)``; x reaches the output by both
    products, so ``dx = da W^T + db V^T``.

    Returns: dx (..., D), dw (D, F), dv (D, F), dw2 (F, D).
    """
    a, s, b = cache.a, cache.sig, cache.b
    dh, dw2, _ = linear_backward(dout, cache.lin_2)
    dh = dropout_backward(dh, cache.drop)
    db = dh * (a * s)
    da = dh * b * (s * (1 + a * (1 - s)))
    dx_w, dw, _ = linear_backward(da, cache.lin_w)
    dx_v, dv, _ = linear_backward(db, cache.lin_v)
    return dx_w + dx_v, dw, dv, dw2

"""Linear layer: ``out = x @ w + b`` over any leading batch dimensions."""
from __future__ import annotations

from typing import NamedTuple

from ._checks import check_float, check_last_dim


class LinearCache(NamedTuple):
    """Kept for backward: the input ``x`` (..., Din) and the weight ``w`` (Din, Dout)."""
    x: object
    w: object


def linear_forward(x, w, b=None):
    """Affine map of the last axis.

    Inputs: x (..., Din); w (Din, Dout); b (Dout,) or None.
    Returns: out (..., Dout), cache.
    """
    check_float("linear", x=x, w=w, b=b)
    if w.ndim != 2:
        raise ValueError(f"linear: w must be 2-D (Din, Dout), got shape {tuple(w.shape)}")
    check_last_dim("linear", "x", x, w.shape[0], f"w has shape {tuple(w.shape)}")
    if b is not None and b.shape != (w.shape[1],):
        raise ValueError(f"linear: b has shape {tuple(b.shape)}, expected ({w.shape[1]},) to match w {tuple(w.shape)}")
    # A 2-D matmul on the flattened batch is one BLAS call, faster than a batched matmul.
    out = (x.reshape(-1, w.shape[0]) @ w).reshape(*x.shape[:-1], w.shape[1])
    if b is not None:
        out += b
    return out, LinearCache(x, w)


def linear_backward(dout, cache: LinearCache):
    """Forward was ``out = x @ w + b``, so
    ``dx = dout @ w.T``, ``dw = x.T @ dout`` (summed over the batch), ``db = sum(dout)``.

    Returns: dx (..., Din), dw (Din, Dout), db (Dout,).
    """
    x, w = cache
    d2 = dout.reshape(-1, w.shape[1])                     # (N, Dout)
    dx = (d2 @ w.T).reshape(x.shape)                      # (..., Din)
    dw = x.reshape(-1, w.shape[0]).T @ d2                 # (Din, Dout)
    db = d2.sum(axis=0)                                   # (Dout,)
    return dx, dw, db

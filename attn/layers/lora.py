"""A low-rank adapter on a frozen linear map, LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation
of Large Language Models"):

    out = x W + (alpha / r) (x A) B,        A (D_in, r), B (r, D_out), r much smaller than D

W stays as trained; only A and B learn: ``r (D_in + D_out)`` numbers instead of ``D_in D_out``.
B starts at zero, so at initialisation the adapted map is the base map to the last bit, and
A starts random, so that B's first gradient ``(alpha/r) (x A)^T dout`` is not zero. ``alpha/r``
keeps the update's size from depending on the rank chosen (the paper's section 4.1).

The project writes a linear map ``x @ w`` with ``w`` (D_in, D_out) (:mod:`attn.layers.linear`),
so ``a`` and ``b`` are the paper's A and B transposed (the paper's ``W x + B A x`` with W
(D_out, D_in)). After training the adapter merges into the weight: ``w + (alpha/r) a @ b``
(:func:`lora_merge`), and a merged model costs nothing at inference.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

from .. import backend as B
from ._checks import check_float, check_last_dim


def _check(x, w, a, b, alpha) -> None:
    check_float("lora", x=x, w=w, a=a, b=b)
    if w.ndim != 2 or a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"lora: w, a and b must be 2-D, got shapes {tuple(w.shape)}, {tuple(a.shape)}, "
                         f"{tuple(b.shape)}")
    if a.shape[0] != w.shape[0] or b.shape != (a.shape[1], w.shape[1]) or a.shape[1] < 1:
        raise ValueError(f"lora: with w {tuple(w.shape)} (D_in, D_out), a must be (D_in, r) and b (r, D_out) with "
                         f"r >= 1, got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if x is not None:
        check_last_dim("lora", "x", x, w.shape[0], f"w has shape {tuple(w.shape)}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
        raise ValueError(f"lora: alpha must be a positive number, got {alpha!r}")


class LoraCache(NamedTuple):
    """Kept for backward: the input ``x`` (..., D_in), the three matrices (the frozen ``w`` for
    dx alone), ``h = x a`` (..., r) and the scale ``alpha / r``."""
    x: object
    w: object
    a: object
    b: object
    h: object
    scale: float


def lora_forward(x, w, a, b, alpha: float):
    """Inputs: x (..., D_in); w (D_in, D_out) the frozen weight; a (D_in, r); b (r, D_out);
    alpha, the adapter's scale (the update is multiplied by ``alpha / r``).

    Returns: out (..., D_out), cache.
    """
    _check(x, w, a, b, alpha)
    Din, Dout, r = w.shape[0], w.shape[1], a.shape[1]
    scale = x.dtype.type(alpha / r)
    x2 = x.reshape(-1, Din)                                # (N, D_in)
    h = x2 @ a                                             # (N, r): the narrow path
    out = x2 @ w + scale * (h @ b)                         # (N, D_out); with b = 0 exactly x @ w
    return out.reshape(*x.shape[:-1], Dout), LoraCache(x, w, a, b, h, scale)


def lora_backward(dout, cache: LoraCache):
    """Forward was ``out = x w + s h b`` with ``h = x a``, ``s = alpha / r``. With
    ``dh = s dout b^T`` (the narrow path's gradient): ``db = s h^T dout``, ``da = x^T dh``, and x
    reaches the output by both paths, ``dx = dout w^T + dh a^T``. The frozen w gets no gradient
    (none is computed: that is the saving), and neither da nor db depends on w.

    Returns: dx (..., D_in), da (D_in, r), db (r, D_out).
    """
    x, w, a, b, h, s = cache
    d2 = dout.reshape(-1, w.shape[1])                      # (N, D_out)
    dh = s * (d2 @ b.T)                                    # (N, r)
    db = s * (h.T @ d2)                                    # (r, D_out)
    da = x.reshape(-1, w.shape[0]).T @ dh                  # (D_in, r)
    dx = d2 @ w.T + dh @ a.T                               # (N, D_in)
    return dx.reshape(x.shape), da, db


def lora_merge(w, a, b, alpha: float):
    """The adapted weight ``w + (alpha / r) a @ b`` (D_in, D_out): ``x @ lora_merge(...)`` is
    the adapter's output up to rounding, and with b = 0 it is w itself. w is not changed."""
    _check(None, w, a, b, alpha)
    return w + w.dtype.type(alpha / a.shape[1]) * (a @ b)


def lora_init(d_in: int, d_out: int, rank: int, seed: int = 0, dtype="float32"):
    """A new adapter's (a, b) on the host: a (d_in, rank) Gaussian of standard deviation
    ``1 / sqrt(d_in)`` (so x a has the size of x's entries), b (rank, d_out) zeros."""
    if not all(isinstance(n, int) and n >= 1 for n in (d_in, d_out, rank)):
        raise ValueError(f"lora_init: d_in, d_out and rank must be positive integers, got {d_in}, {d_out}, {rank}")
    a = B.host_rng(seed).standard_normal((d_in, rank)) / d_in ** 0.5
    return a.astype(dtype), B.host.zeros((rank, d_out), dtype=dtype)

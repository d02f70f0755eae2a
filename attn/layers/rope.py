"""Rotary positions, RoPE (Su et al., 2021, "RoFormer"): instead of adding a position
vector to the embeddings, rotate each query and key by an angle that grows with its
position, so that the score of a query at m and a key at n depends only on m - n.

A head of size Dh is split into Dh/2 pairs of features; pair i at position m is turned
by the angle ``m * theta_i`` with ``theta_i = base^(-2i/Dh)`` (``base`` = 10000, as in the
paper and Llama). Seen as a complex number ``z = x_a + i x_b``, the rotation is a product:

    rope(z)_m = z * exp(i m theta)        so     <rope(q)_m, rope(k)_n> = Re(q conj(k) exp(i (m - n) theta))

The pairing is the "half split" of Llama's, GPT-NeoX's and Hugging Face's code: feature
``i`` is paired with ``i + Dh/2``. RoFormer and GPT-J pair neighbours ``(2i, 2i + 1)``
instead; the two are the same rotation after a fixed permutation of a head's features, so
a model trained with one is the other's with the columns of W_q and W_k permuted.
"""
from __future__ import annotations

from typing import NamedTuple

from .. import backend as B
from ._checks import check_float


def rope_angles(positions, head_size: int, base: float = 10000.0):
    """The rotation of every position, computed on the host in float64.

    Inputs: positions, integer array (T,) (or any shape); head_size Dh, even; base of the
    angles' geometric progression.
    Returns: cos, sin, host float64 arrays of shape positions.shape + (Dh/2,), holding
    ``cos(pos * base^(-2i/Dh))`` and its sine.
    """
    if head_size < 2 or head_size % 2:
        raise ValueError(f"rope: the head size must be even and at least 2 (pairs of features), got {head_size}")
    if not base > 1:
        raise ValueError(f"rope: base must be greater than 1, got {base}")
    np = B.host
    pos = np.asarray(B.to_host(positions), dtype=np.float64)[..., None]        # (..., 1)
    theta = base ** (-np.arange(0, head_size, 2, dtype=np.float64) / head_size)  # (Dh/2,)
    angle = pos * theta                                                          # (..., Dh/2)
    return np.cos(angle), np.sin(angle)


class RopeCache(NamedTuple):
    """Kept for backward: the cosines and sines the forward turned by (no input is needed:
    the backward of a rotation is the rotation back)."""
    cos: object
    sin: object


def rope_forward(x, positions=None, base: float = 10000.0):
    """Rotate each pair ``(x_i, x_{i+Dh/2})`` of the last axis by its position's angle.

    Inputs: x (..., T, Dh), Dh even; positions None (0..T-1) or integers (T,), e.g. the
    offset of a decoding step; base of the angles.
    Returns: out (..., T, Dh) with ``out_a = x_a cos - x_b sin``, ``out_b = x_a sin + x_b cos``
    (a = the first half of the head, b = the second), cache.
    """
    check_float("rope", x=x)
    if x.ndim < 2:
        raise ValueError(f"rope: x must be (..., T, Dh), got shape {tuple(x.shape)}")
    T, Dh = x.shape[-2:]
    xp = B.get_array_module(x)
    if positions is None:
        positions = B.host.arange(T)
    if tuple(positions.shape) != (T,):
        raise ValueError(f"rope: positions has shape {tuple(positions.shape)}, expected ({T},) for x {tuple(x.shape)}")
    cos, sin = (xp.asarray(a.astype(x.dtype)) for a in rope_angles(positions, Dh, base))   # (T, Dh/2)
    return _rotate(x, cos, sin), RopeCache(cos, sin)


def rope_backward(dout, cache: RopeCache):
    """Forward was ``out = R x`` with R a rotation of each pair, so ``dx = R^T dout``: the
    same pairs turned back by the same angles (``sin`` negated).

    Returns: dx (shape of dout).
    """
    return _rotate(dout, cache.cos, -cache.sin)


def _rotate(x, cos, sin):
    """Each pair (x_a, x_b) of the last axis turned by (cos, sin): (..., T, Dh)."""
    h = x.shape[-1] // 2
    xa, xb = x[..., :h], x[..., h:]
    xp = B.get_array_module(x)
    return xp.concatenate([xa * cos - xb * sin, xa * sin + xb * cos], axis=-1)

"""Token embedding (section 3.4): a row lookup, scaled by ``sqrt(d_model)`` in the model."""
from __future__ import annotations

from typing import NamedTuple

from .. import backend as B
from ._checks import check_ids


class EmbeddingCache(NamedTuple):
    """Kept for backward: the ids, the table's shape and dtype, and the scale."""
    ids: object
    shape: tuple
    dtype: object
    scale: float


def embedding_forward(ids, W, scale: float = 1.0):
    """Inputs: ids (...) integers in [0, V); W (V, D); scale a float.

    Returns: out (..., D) = ``W[ids] * scale``, cache.
    Raises IndexError for ids outside [0, V) (CuPy would wrap them silently).
    """
    if W.ndim != 2:
        raise ValueError(f"embedding: W must be 2-D (V, D), got shape {tuple(W.shape)}")
    check_ids("embedding", "ids", ids, W.shape[0])
    out = W[ids]
    if scale != 1.0:
        out *= W.dtype.type(scale)
    return out, EmbeddingCache(ids, W.shape, W.dtype, scale)


def embedding_backward(dout, cache: EmbeddingCache):
    """Forward was ``out = W[ids] * scale``, so row ``v`` of dW is ``scale`` times the
    sum of ``dout`` over every position holding ``v``. Repeated ids must accumulate,
    which plain ``dW[ids] += g`` does not do: hence scatter-add.

    Returns: dW (V, D).
    """
    ids, shape, dtype, scale = cache
    xp = B.get_array_module(dout)
    dW = xp.zeros(shape, dtype=dtype)
    g = dout.reshape(-1, shape[1])
    if scale != 1.0:
        g = g * dtype.type(scale)
    B.scatter_add(dW, ids.reshape(-1), g)
    return dW

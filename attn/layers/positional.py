"""Positional encodings (section 3.5): the paper's sinusoids, and a learned table.

    PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

Both are added to the (scaled) token embeddings; the sinusoidal table has no
parameters, the learned one is a (max_len, D) parameter.
"""
from __future__ import annotations

from typing import NamedTuple

from .. import backend as B


def sinusoidal_table(max_len: int, d_model: int, dtype="float32"):
    """The paper's table, computed on the host in float64 then cast.

    Returns: (max_len, d_model) host array. Column ``2i`` holds the sine and
    ``2i+1`` the cosine of ``pos / 10000^(2i/d_model)``.
    """
    if max_len < 1 or d_model < 1:
        raise ValueError(f"sinusoidal_table: max_len and d_model must be positive, got {max_len}, {d_model}")
    np = B.host
    pos = np.arange(max_len, dtype=np.float64)[:, None]          # (L, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]  # (1, ceil(D/2))
    angle = pos / np.power(10000.0, two_i / d_model)              # (L, ceil(D/2))
    pe = np.zeros((max_len, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return pe.astype(dtype)


class PositionalCache(NamedTuple):
    """Kept for backward: the table's shape and how many positions were used."""
    shape: tuple
    T: int


def positional_forward(x, table):
    """Inputs: x (B, T, D); table (L, D) with L >= T, on x's device or on the host (as
    :func:`sinusoidal_table` returns it: its first T rows are then moved to x's device).

    Returns: out (B, T, D) = ``x + table[:T]``, cache.
    """
    T = x.shape[-2]
    if table.ndim != 2 or table.shape[1] != x.shape[-1]:
        raise ValueError(f"positional: table has shape {tuple(table.shape)}, x has {tuple(x.shape)}; "
                         f"their last dimensions must agree")
    if T > table.shape[0]:
        raise ValueError(f"positional: sequence length {T} exceeds the positional table's "
                         f"{table.shape[0]} positions (raise max_len)")
    rows = table[:T]
    xp = B.get_array_module(x)
    if B.get_array_module(rows) is not xp:        # a host table beside a device x (or the reverse)
        rows = B.to_host(rows) if xp is B.host else xp.asarray(rows)
    return x + rows, PositionalCache(table.shape, T)


def positional_backward(dout, cache: PositionalCache):
    """Forward was ``out = x + table[:T]``, so ``dx = dout`` and the first T rows of
    ``dtable`` are ``dout`` summed over the batch (the rest are zero).

    Returns: dx (B, T, D), dtable (L, D). A sinusoidal table has no parameter: ignore dtable.
    """
    xp = B.get_array_module(dout)
    dtable = xp.zeros(cache.shape, dtype=dout.dtype)
    dtable[: cache.T] = dout.reshape(-1, cache.T, cache.shape[1]).sum(axis=0)
    return dout, dtable

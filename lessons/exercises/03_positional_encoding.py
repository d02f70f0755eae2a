"""Exercise for lesson 3: positional encoding.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/03_positional_encoding.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

Every function this file asks for is graded; one whose body still raises NotImplementedError
is "not implemented yet". ``B.host`` is NumPy (the table is built on the
host); ``xp = B.get_array_module(x)`` is the array library of x (NumPy or CuPy).
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def sinusoidal_table(max_len, d_model, dtype="float32"):
    """The paper's table (section 3.5), computed in float64 on the host, then cast to dtype:

        PE[pos, 2i]   = sin(pos / 10000^(2i / d_model))
        PE[pos, 2i+1] = cos(pos / 10000^(2i / d_model))

    Columns 2i and 2i+1 share one angle. d_model may be odd (the last column is a sine).

    Returns: (max_len, d_model) host array of dtype ``dtype``.
    """
    raise NotImplementedError


def positional_forward(x, table):
    """Add the first T rows of the table to every sentence: ``out = x + table[:T]``.

    Inputs: x (B, T, D); table (L, D) with L >= T.
    Returns: out (B, T, D), cache.
    """
    raise NotImplementedError


def positional_backward(dout, cache):
    """The gradients of ``out = x + table[:T]``: derive them (every sentence of the batch
    adds the same rows; the table has L rows, not T).

    Inputs: dout (B, T, D). Returns: dx (B, T, D), dtable (L, D).
    """
    raise NotImplementedError

"""Exercise for lesson 32: int8 weights, a matrix quantised a row (an output channel) at a time.

Write the body below (replace the ``raise NotImplementedError``), then grade it:

    attn-check lessons/exercises/int8.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

``xp = B.get_array_module(w)`` is NumPy (or CuPy on a GPU). The grader compares your matrix
with the library's and holds it to the bound of lesson 32: every number within half a step of
its original, ``|w - w_hat| <= scale / 2``; ``w_hat`` is an integer q in [-127, 127] times the
row's scale; a row of zeros stays zero; ``-w`` gives ``-w_hat``.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def int8_round_trip(w):
    """``w`` (R, N) quantised to int8 a row at a time and dequantised: the numbers an int8
    model computes with.

    Each row has its own scale, ``max|row| / 127``: q = ``round(w / scale)``, clipped to
    [-127, 127] (the range is symmetric: -128 is never used), and the result is ``q * scale``.
    A row of zeros has scale 0: its q are 0 (divide by 1 there, not by 0).

    Inputs: w (R, N) floats.
    Returns: w_hat (R, N), of w's dtype.
    """
    raise NotImplementedError

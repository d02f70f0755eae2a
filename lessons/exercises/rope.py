"""Exercise for lesson 26: rotary positions, RoPE (Su et al., 2021).

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/rope.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

``xp = B.get_array_module(x)`` is NumPy (or CuPy on a GPU); ``B.to_host(positions)`` brings
the positions to the host.

Keep the input's dtype, as the grader checks it: your output and your gradients must have the
dtype of the library's on the same inputs (float64 in the gradient checks), and your forward runs
again on float32 inputs, where the output must stay float32 ("has dtype ..., expected ..." names
the array that did not). So no ``float()`` or ``astype`` to another precision, constants as
``x.dtype.type(c)``, new arrays with ``dtype=x.dtype``; the angles may be computed in
float64 on the host, then cast to ``x.dtype``.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def rope_forward(x, positions=None, base=10000.0):
    """Turn each pair of a head's features by an angle that grows with the position.

    Pair feature i with feature i + Dh/2 (the "half split" of Llama's code), i = 0 .. Dh/2 - 1.
    At position m the pair (a, b) becomes (a cos - b sin, a sin + b cos) of the angle
    m * theta_i, with theta_i = base ** (-2 i / Dh).

    Inputs: x (..., T, Dh), Dh even; positions None (0, 1, ..., T-1) or integers (T,); base.
    Returns: out (..., T, Dh), cache.
    """
    raise NotImplementedError


def rope_backward(dout, cache):
    """The gradient of the forward. The forward multiplies every pair by a rotation matrix R:
    what is the gradient of ``R x`` with respect to x, and which rotation is ``R`` transposed?

    Returns: dx (..., T, Dh).
    """
    raise NotImplementedError

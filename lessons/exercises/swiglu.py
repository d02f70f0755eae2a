"""Exercise for lesson 26: the SwiGLU feed-forward network (Shazeer, 2020).

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/swiglu.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

``xp = B.get_array_module(x)`` is NumPy (or CuPy on a GPU).

Keep the input's dtype, as the grader checks it: your output and your gradients must have the
dtype of the library's on the same inputs (float64 in the gradient checks), and your forward runs
again on float32 inputs, where the output must stay float32 ("has dtype ..., expected ..." names
the array that did not). So no ``float()`` or ``astype`` to another precision, constants as
``x.dtype.type(c)``, new arrays with ``dtype=x.dtype``.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def swiglu_forward(x, w, v, w2):
    """``out = (SiLU(x @ w) * (x @ v)) @ w2`` with ``SiLU(a) = a * sigmoid(a)``, over any leading
    axes of x. No biases.

    Inputs: x (..., D); w (D, F); v (D, F); w2 (F, D).
    Returns: out (..., D), cache.
    """
    raise NotImplementedError


def swiglu_backward(dout, cache):
    """The gradients of the forward. Each path is the other's factor (the product rule), SiLU's
    derivative needs the sigmoid, and x feeds two products.

    Returns: dx (..., D), dw (D, F), dv (D, F), dw2 (F, D).
    """
    raise NotImplementedError

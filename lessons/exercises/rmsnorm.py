"""Exercise for lesson 26: RMSNorm (Zhang and Sennrich, 2019), the norm of the modern block.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/rmsnorm.py

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


def rmsnorm_forward(x, gamma, eps=1e-6):
    """Layer norm without the mean and without the shift: divide each row of the last axis by
    its root mean square, ``sqrt(mean(x**2) + eps)``, then multiply by ``gamma``.

    Inputs: x (..., D); gamma (D,); eps added inside the square root.
    Returns: out (..., D), cache.
    """
    raise NotImplementedError


def rmsnorm_backward(dout, cache):
    """The gradients of the forward. The root mean square depends on every x of its row: how
    many terms does dx have, and which of layer norm's is gone with the mean?

    Returns: dx (..., D), dgamma (D,).
    """
    raise NotImplementedError

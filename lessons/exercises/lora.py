"""Exercise: LoRA, a low-rank adapter on a frozen linear map (Hu et al., 2021).

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/lora.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

The frozen weight w (D_in, D_out) maps x as the project's linear layer does, ``x @ w``; the
adapter adds ``(alpha / r) * ((x @ a) @ b)`` with a (D_in, r) and b (r, D_out), the paper's A
and B transposed. Only a and b learn: the backward returns no gradient for w.

Keep the input's dtype, as the grader checks it: your output and your gradients must have the
dtype of the library's on the same inputs (float64 in the gradient checks), and your forward runs
again on float32 inputs, where the output must stay float32 ("has dtype ..., expected ..." names
the array that did not). So no ``float()`` or ``astype`` to another precision, constants as
``x.dtype.type(c)``, new arrays with ``dtype=x.dtype``.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def lora_forward(x, w, a, b, alpha):
    """``out = x @ w + (alpha / r) * ((x @ a) @ b)`` with ``r = a.shape[1]``, over any leading
    axes of x. With b = 0 (a new adapter) the output must be the frozen map's to the last bit.

    Inputs: x (..., D_in); w (D_in, D_out), frozen; a (D_in, r); b (r, D_out); alpha a number.
    Returns: out (..., D_out), cache.
    """
    raise NotImplementedError


def lora_backward(dout, cache):
    """The gradients of the trained inputs. x reaches the output by two paths; the frozen w
    gets no gradient, and it steers neither da nor db.

    Returns: dx (..., D_in), da (D_in, r), db (r, D_out).
    """
    raise NotImplementedError


def lora_merge(w, a, b, alpha):
    """The adapted weight as one matrix, ``w + (alpha / r) * (a @ b)`` (D_in, D_out), so that
    ``x @ lora_merge(w, a, b, alpha)`` is the adapter's output. A new array: w is not changed.
    """
    raise NotImplementedError

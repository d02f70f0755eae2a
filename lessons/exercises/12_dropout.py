"""Exercise for lesson 12: inverted dropout (section 5.4, "Residual Dropout").

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/12_dropout.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

``xp = B.get_array_module(x)`` is NumPy (or CuPy on a GPU).
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def dropout_forward(x, p, rng=None):
    """Inverted dropout: keep each unit with probability ``1 - p`` (where
    ``rng.random(x.shape, dtype=x.dtype) >= p``) and scale the kept ones by ``1/(1-p)``, so
    the expectation is unchanged and inference needs no rescale. The identity when ``p == 0``
    or ``rng is None`` (evaluation).

    Inputs: x (any shape); p in [0, 1); rng an ``attn.backend.DeviceRNG`` or None.
    Returns: out (same shape), cache.
    """
    raise NotImplementedError


def dropout_backward(dout, cache):
    """The gradient of the forward with respect to x. The mask was random: which mask must
    the backward use, and where does it come from?

    Returns: dx (same shape as dout).
    """
    raise NotImplementedError

"""Exercise for lesson 11: the regularisers of section 5.4, dropout and label smoothing.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/11_training_recipe.py

``xp = B.get_array_module(x)`` is NumPy (or CuPy on a GPU).
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def dropout_forward(x, p, rng=None):
    """Inverted dropout: keep each unit with probability ``1 - p`` (where
    ``rng.random(x.shape, dtype=x.dtype) >= p``) and scale the kept ones by ``1/(1-p)``, so
    the expectation is unchanged. The identity when ``p == 0`` or ``rng is None`` (evaluation).

    Inputs: x (any shape); p in [0, 1); rng an ``attn.backend.DeviceRNG`` or None.
    Returns: out (same shape), cache.
    """
    raise NotImplementedError


def dropout_backward(dout, cache):
    """Forward was ``out = x * mask`` (mask 0 or 1/(1-p)): ``dx = dout * mask``, the same mask.

    Returns: dx (same shape as dout).
    """
    raise NotImplementedError


def cross_entropy(logits, targets, smoothing=0.0, pad_id=0):
    """Label-smoothed cross-entropy averaged over the real (non-padding) targets, with its
    gradient. The target distribution is ``q = (1 - eps) * onehot(y) + eps / V`` (eps =
    smoothing), so per token ``loss = -(1 - eps) log p_y - eps * mean_v log p_v`` with
    ``log p = log_softmax(logits)`` (subtract the row maximum first). Targets equal to
    ``pad_id`` contribute nothing (``pad_id=None``: none ignored).

    Inputs: logits (..., V) float; targets (...) integer ids in [0, V).
    Returns: (loss, dlogits): loss a 0-d array (0 if there are no real targets), dlogits of
    the logits' shape = ``(softmax(logits) - q) / n_real`` on real targets, 0 on padding.
    """
    raise NotImplementedError

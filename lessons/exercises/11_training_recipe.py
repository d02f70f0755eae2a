"""Exercise for lesson 11: label-smoothed cross-entropy (section 5.4), with its gradient.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/11_training_recipe.py

``xp = B.get_array_module(x)`` is NumPy (or CuPy on a GPU).
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


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

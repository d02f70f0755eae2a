"""Exercise for lesson 11: label-smoothed cross-entropy (section 5.4) with its gradient, the
warm-up learning-rate schedule and Adam (section 5.3).

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/11_training_recipe.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

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
    Returns: (loss, dlogits): loss a 0-d array (0 if there are no real targets), dlogits the
    gradient of the loss with respect to the logits (derive it: softmax and cross-entropy
    together have a short gradient), of the logits' shape.
    """
    raise NotImplementedError


def noam_lr(step, d_model, warmup_steps, factor=1.0):
    """The learning rate of section 5.3 at optimizer step ``step`` (1-based):

        lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

    Returns: a float.
    """
    raise NotImplementedError


def adam_step(params, grads, m, v, t, lr, beta1=0.9, beta2=0.98, eps=1e-9):
    """One Adam update (Kingma & Ba, with the paper's betas and epsilon as defaults) at step
    ``t`` (1-based) with learning rate ``lr``: both moments as running averages of the
    gradient and its square, each corrected for its start at zero, then the update
    ``p - lr * m_hat / (sqrt(v_hat) + eps)``.

    Inputs: params, grads, m, v: dicts of arrays keyed alike (m and v start as zeros).
    Returns: (new params, new m, new v), three new dicts; change nothing in place.
    attn-check runs a few steps from zero moments, carrying your state from step to step.
    """
    raise NotImplementedError

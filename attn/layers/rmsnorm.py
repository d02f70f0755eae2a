"""RMS normalisation (Zhang and Sennrich, 2019): layer norm without the mean and the shift.
Each row is divided by its root mean square, then scaled; the modern blocks use it in place of
layer norm (cheaper: one reduction per row instead of two)."""
from __future__ import annotations

from typing import NamedTuple

from ._checks import check_float, check_last_dim


class RMSNormCache(NamedTuple):
    """Kept for backward: the normalised input ``xhat``, ``rrms = 1/sqrt(mean(x**2) + eps)``
    per row, and the gain ``gamma``."""
    xhat: object
    rrms: object
    gamma: object


def rmsnorm_forward(x, gamma, eps: float = 1e-6):
    """Divide each row of the last axis by its root mean square, then scale.

    Inputs: x (..., D); gamma (D,); eps added inside the square root.
    Returns: out (..., D) = ``gamma * x / sqrt(mean(x**2) + eps)``, cache.
    """
    check_float("rmsnorm", x=x, gamma=gamma)
    check_last_dim("rmsnorm", "gamma", gamma, x.shape[-1], f"x has shape {tuple(x.shape)}")
    rrms = 1.0 / ((x * x).mean(axis=-1, keepdims=True) + x.dtype.type(eps)) ** 0.5
    xhat = x * rrms
    return xhat * gamma, RMSNormCache(xhat, rrms, gamma)


def rmsnorm_backward(dout, cache: RMSNormCache):
    """Forward was ``out = gamma * xhat`` with ``xhat = x * rrms``, so ``dgamma = sum(dout * xhat)``
    over all rows, and with ``g = dout * gamma``, as ``rrms`` depends on every x of the row
    (``d rrms / d x_j = -rrms**3 x_j / D``): ``dx = rrms * (g - xhat * mean(g * xhat))``
    (the mean over the row). Layer norm's without its ``- mean(g)`` term, the mean's.

    Returns: dx (..., D), dgamma (D,).
    """
    xhat, rrms, gamma = cache
    D = xhat.shape[-1]
    g = dout * gamma
    dx = rrms * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dgamma = (dout * xhat).reshape(-1, D).sum(axis=0)
    return dx, dgamma

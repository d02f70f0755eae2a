"""Layer normalisation (Ba et al., 2016), applied after every residual sub-layer."""
from __future__ import annotations

from typing import NamedTuple

from ._checks import check_float, check_last_dim


class LayerNormCache(NamedTuple):
    """Kept for backward: the normalised input ``xhat``, ``rstd = 1/sqrt(var + eps)``
    per row, and the gain ``gamma``. The mean is not needed again."""
    xhat: object
    rstd: object
    gamma: object


def layer_norm_forward(x, gamma, beta, eps: float = 1e-5):
    """Normalise each row of the last axis to zero mean and unit (biased) variance,
    then scale and shift.

    Inputs: x (..., D); gamma (D,); beta (D,); eps added inside the square root.
    Returns: out (..., D) = ``gamma * (x - mean) / sqrt(var + eps) + beta``, cache.
    """
    check_float("layer_norm", x=x, gamma=gamma, beta=beta)
    check_last_dim("layer_norm", "gamma", gamma, x.shape[-1], f"x has shape {tuple(x.shape)}")
    check_last_dim("layer_norm", "beta", beta, x.shape[-1], f"x has shape {tuple(x.shape)}")
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)           # biased, as the paper's reference
    rstd = 1.0 / (var + x.dtype.type(eps)) ** 0.5
    xhat = xc * rstd
    return xhat * gamma + beta, LayerNormCache(xhat, rstd, gamma)


def layer_norm_backward(dout, cache: LayerNormCache):
    """Forward was ``out = gamma * xhat + beta`` with ``xhat = (x - mean) * rstd``, so
    ``dgamma = sum(dout * xhat)``, ``dbeta = sum(dout)`` over all rows, and with
    ``g = dout * gamma`` the mean and the variance both depend on every x of the row:
    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` (means over the row).

    Returns: dx (..., D), dgamma (D,), dbeta (D,).
    """
    xhat, rstd, gamma = cache
    D = xhat.shape[-1]
    g = dout * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dgamma = (dout * xhat).reshape(-1, D).sum(axis=0)
    dbeta = dout.reshape(-1, D).sum(axis=0)
    return dx, dgamma, dbeta

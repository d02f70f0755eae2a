"""Layer-norm backward without the mean term: forgets that the mean depends on every x."""
from attn.layers.layernorm import layer_norm_forward  # noqa: F401


def layer_norm_backward(dout, cache):
    xhat, rstd, gamma = cache
    D = xhat.shape[-1]
    g = dout * gamma
    dx = rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))          # - mean(g) missing
    return dx, (dout * xhat).reshape(-1, D).sum(axis=0), dout.reshape(-1, D).sum(axis=0)

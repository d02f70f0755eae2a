"""Layer norm with the unbiased variance (divides by D - 1, as x.var(ddof=1) or torch.var do)."""
from attn.layers.layernorm import LayerNormCache, layer_norm_backward  # noqa: F401


def layer_norm_forward(x, gamma, beta, eps=1e-5):
    D = x.shape[-1]
    xc = x - x.mean(axis=-1, keepdims=True)
    var = (xc * xc).sum(axis=-1, keepdims=True) / max(D - 1, 1)
    rstd = 1.0 / (var + eps) ** 0.5
    xhat = xc * rstd
    return xhat * gamma + beta, LayerNormCache(xhat, rstd, gamma)

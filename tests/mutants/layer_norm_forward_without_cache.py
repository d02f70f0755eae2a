"""A forward that returns only its output, no cache."""
from attn.layers.layernorm import layer_norm_backward  # noqa: F401
from attn.layers.layernorm import layer_norm_forward as _library


def layer_norm_forward(x, gamma, beta, eps=1e-5):
    out, _ = _library(x, gamma, beta, eps)
    return out

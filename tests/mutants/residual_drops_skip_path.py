"""Add & Norm backward that drops the skip path: dx = FFN backward of dz, without dz itself."""
from attn.layers.feedforward import feed_forward_backward
from attn.layers.layernorm import layer_norm_backward
from attn.layers.residual import residual_ffn_forward  # noqa: F401


def residual_ffn_backward(dout, cache):
    dz, dgamma, dbeta = layer_norm_backward(dout, cache.norm)
    dx_ffn, dw1, db1, dw2, db2 = feed_forward_backward(dz, cache.ffn)
    return dx_ffn, dw1, db1, dw2, db2, dgamma, dbeta                           # dz + dx_ffn

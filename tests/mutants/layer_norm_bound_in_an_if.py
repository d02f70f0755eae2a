"""The library's layer norm under names bound by assignment inside an ``if`` block (not a
``def``): a file of any name has every library name it binds withheld, however bound."""
from attn import layers as L

if True:
    layer_norm_forward = lambda x, gamma, beta, eps=1e-5: L.layer_norm_forward(x, gamma, beta, eps)  # noqa: E731
    layer_norm_backward = lambda dout, cache: L.layer_norm_backward(dout, cache)  # noqa: E731

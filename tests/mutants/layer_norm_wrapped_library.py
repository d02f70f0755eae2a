"""The library's own layer norm behind a wrapper of the learner's (defined here, so its
module and file are the learner's: only the call into the library's own gives it away)."""
from attn import layers as L


def layer_norm_forward(x, gamma, beta, eps=1e-5):
    return L.layer_norm_forward(x, gamma, beta, eps)


def layer_norm_backward(dout, cache):
    return L.layer_norm_backward(dout, cache)

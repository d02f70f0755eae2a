"""Dropout backward that multiplies the upstream gradient in place (dout *= mask): the
caller's dout changes, and in a network whose dout feeds two paths (a residual) the
other path then sees the masked gradient."""
from attn.layers.dropout import dropout_forward  # noqa: F401


def dropout_backward(dout, cache):
    if cache.mask is not None:
        dout *= cache.mask
    return dout

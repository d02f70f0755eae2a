"""Exercise 7's layer norm with a backward and no forward of its own (the library's,
re-exported): exercise 7 gives no forward, so the layer fails."""
from attn.layers import layer_norm_forward  # noqa: F401


def layer_norm_backward(dout, cache):
    return dout, dout.sum(axis=0), dout.sum(axis=0)

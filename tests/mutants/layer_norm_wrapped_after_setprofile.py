"""The library's own layer norm behind a wrapper, with the profiler switched off first
(``sys.setprofile(None)``), as a file would try against a grader that traced its calls."""
import sys

from attn import layers as L

sys.setprofile(None)


def layer_norm_forward(x, gamma, beta, eps=1e-5):
    sys.setprofile(None)
    return L.layer_norm_forward(x, gamma, beta, eps)


def layer_norm_backward(dout, cache):
    sys.setprofile(None)
    return L.layer_norm_backward(dout, cache)

"""Attention backward forgetting the 1/sqrt(d_k) of the scores."""
from attn.layers.attention import attention_forward  # noqa: F401
from attn.layers.dropout import dropout_backward
from attn.layers.softmax import SoftmaxCache, softmax_backward


def attention_backward(dout, cache):
    q, k, v, w, cd, scale = cache
    wd = w if cd.mask is None else w * cd.mask
    dv = wd.swapaxes(-1, -2) @ dout
    dw = dropout_backward(dout @ v.swapaxes(-1, -2), cd)
    ds = softmax_backward(dw, SoftmaxCache(w))                                  # * scale missing
    return ds @ k, ds.swapaxes(-1, -2) @ q, dv

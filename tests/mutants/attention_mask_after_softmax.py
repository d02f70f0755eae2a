"""Attention that masks the weights after the softmax instead of the scores before it."""
import math

from attn import backend as B
from attn.layers.attention import AttentionCache, attention_backward  # noqa: F401
from attn.layers.dropout import dropout_forward
from attn.layers.softmax import softmax_forward


def attention_forward(q, k, v, mask=None, dropout=0.0, rng=None):
    xp = B.get_array_module(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    w, _ = softmax_forward((q @ k.swapaxes(-1, -2)) * scale)
    if mask is not None:
        w = xp.where(mask, w, 0.0)
    wd, cd = dropout_forward(w, dropout, rng)
    return wd @ v, AttentionCache(q, k, v, w, cd, scale)

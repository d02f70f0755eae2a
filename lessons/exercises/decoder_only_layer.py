"""Exercise for lesson 24: the decoder-only layer (GPT's block), forward and backward, graded
against ``attn.model``'s decoder layer of a decoder-only config (``n_encoder_layers=0``).

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/decoder_only_layer.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

The layer is the paper's decoder layer without its middle sub-layer (there is no encoder, so
no cross-attention): masked self-attention, then the position-wise feed-forward network, each
in the paper's post-norm Add & Norm, ``LayerNorm(x + sublayer(x))``, no dropout. The look-ahead
mask is the layer's own: ``M.causal_mask(T)`` (position i sees positions 0..i).

Build on the library's layers (``L.multi_head_attention_forward``, ``L.layer_norm_forward``,
``L.feed_forward_forward`` and their backwards) or on your own from the earlier exercises.
Parameters come in a dict keyed ``self_attn.w_q, self_attn.b_q, ..., self_attn.w_o,
self_attn.b_o`` (D x D and D), ``norm1.gamma, norm1.beta``, ``ffn.w1, ffn.b1, ffn.w2, ffn.b2``,
``norm2.gamma, norm2.beta``; the backward returns their gradients in a dict keyed the same way.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401
from attn import layers as L  # noqa: F401
from attn import masks as M  # noqa: F401


def decoder_only_layer_forward(x, params, n_heads, eps=1e-6):
    """``h = LayerNorm1(x + SelfAttention(x, x, causal_mask(T)))``, ``out = LayerNorm2(h + FFN(h))``.

    Inputs: x (B, T, D); params keyed as the module's docstring says; n_heads; eps of both
    layer norms. A later position must never change an earlier position's output.
    Returns: out (B, T, D), cache.
    """
    raise NotImplementedError


def decoder_only_layer_backward(dout, cache):
    """Inputs: dout (B, T, D). Returns: dx (B, T, D), grads (a dict keyed like params).

    x reaches the output by more than one path: every one sends its gradient back.
    """
    raise NotImplementedError

"""Exercise for lesson 9: an encoder layer, a decoder layer, and the whole Transformer,
forward and backward, graded against ``attn.model.Transformer``.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/the_whole_model.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

Build on the library's layers (``L.multi_head_attention_forward``, ``L.layer_norm_forward``,
``L.feed_forward_forward``, ``L.embedding_forward``, ``L.positional_forward``,
``L.sinusoidal_table``, and their backwards) and masks (``M.padding_mask``,
``M.decoder_mask``), or on your own from the earlier exercises. The model is the paper's
base architecture without dropout: post-norm Add & Norm, sinusoidal positions, and one
embedding matrix shared by the source, the target and the output projection.

Parameters come in dicts, keyed as in ``attn.model`` (``self_attn.w_q``, ``norm1.gamma``,
``ffn.w1``, ...); a backward returns the parameters' gradients in a dict keyed the same way.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401
from attn import layers as L  # noqa: F401
from attn import masks as M  # noqa: F401


def encoder_layer_forward(x, mask, params, n_heads, eps=1e-6):
    """``h = LayerNorm1(x + SelfAttention(x, x, mask))``, ``out = LayerNorm2(h + FFN(h))``.

    Inputs: x (B, S, D); mask (B, 1, 1, S) bool or None; params with the keys
    ``self_attn.w_q, self_attn.b_q, ..., self_attn.w_o, self_attn.b_o`` (D x D and D),
    ``norm1.gamma, norm1.beta``, ``ffn.w1, ffn.b1, ffn.w2, ffn.b2``, ``norm2.gamma, norm2.beta``;
    n_heads; eps of both layer norms.
    Returns: out (B, S, D), cache.
    """
    raise NotImplementedError


def encoder_layer_backward(dout, cache):
    """Inputs: dout (B, S, D). Returns: dx (B, S, D), grads (a dict keyed like params)."""
    raise NotImplementedError


def decoder_layer_forward(x, memory, src_mask, tgt_mask, params, n_heads, eps=1e-6):
    """Three sub-layers, each as ``LayerNorm(x + sublayer(x))``: self-attention over x with
    ``tgt_mask`` (keys ``self_attn.*``, ``norm1.*``); cross-attention with queries from x and
    keys and values from ``memory``, with ``src_mask`` (``cross_attn.*``, ``norm2.*``); the
    feed-forward network (``ffn.*``, ``norm3.*``).

    Inputs: x (B, T, D); memory (B, S, D) the encoder's output; src_mask (B, 1, 1, S);
    tgt_mask (B, 1, T, T). Returns: out (B, T, D), cache.
    """
    raise NotImplementedError


def decoder_layer_backward(dout, cache):
    """Inputs: dout (B, T, D). Returns: dx (B, T, D), dmemory (B, S, D), grads (a dict)."""
    raise NotImplementedError


def transformer_forward(src, tgt_in, params, n_heads, eps=1e-6):
    """The whole model (section 3), as ``attn.model.Transformer.forward`` with dropout off:

        E = params["embedding.weight"]                      (V, D), shared three ways
        x = E[src] * sqrt(D) + PE[:S]                       then encoder layers 0, 1, ... (keys
                                                            ``encoder.{i}.<layer key>``)
        y = E[tgt_in] * sqrt(D) + PE[:T]                    then decoder layers ``decoder.{i}.*``,
                                                            with the encoder's output as memory
        logits = y @ E^T                                    (B, T, V)

    with PE the sinusoidal table, ``src_mask = padding_mask(src)`` and
    ``tgt_mask = decoder_mask(tgt_in)``. The numbers of layers are those in params.

    Inputs: src (B, S), tgt_in (B, T) ids padded with 0. Returns: logits (B, T, V), cache.
    """
    raise NotImplementedError


def transformer_backward(dlogits, cache):
    """Inputs: dlogits (B, T, V). Returns: grads, a dict keyed like params. The embedding
    matrix is used in three places: its gradient collects all three."""
    raise NotImplementedError

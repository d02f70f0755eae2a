"""Layers as pairs of plain functions: ``*_forward(...) -> (out, cache)`` and
``*_backward(dout, cache) -> gradients`` in the order the forward took its inputs."""
from .activation import relu_backward, relu_forward
from .attention import (attention_backward, attention_forward, attention_weights, grouped_query_attention_backward,
                        grouped_query_attention_forward, merge_heads, multi_head_attention_backward,
                        multi_head_attention_forward, split_heads)
from .dropout import dropout_backward, dropout_forward
from .embedding import embedding_backward, embedding_forward
from .flash_attention import flash_attention_backward, flash_attention_forward, key_tiles
from .feedforward import feed_forward_backward, feed_forward_forward
from .layernorm import layer_norm_backward, layer_norm_forward
from .linear import linear_backward, linear_forward
from .lora import lora_backward, lora_forward, lora_init, lora_merge
from .positional import positional_backward, positional_forward, sinusoidal_table
from .rope import rope_angles, rope_backward, rope_forward
from .residual import residual_ffn_backward, residual_ffn_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward
from .softmax import softmax_backward, softmax_forward
from .swiglu import silu, swiglu_backward, swiglu_forward, swiglu_width
from .recurrent import rnn_backward, rnn_forward, rnn_step_backward, rnn_step_forward

from ._checks import check_ids  # noqa: F401  (the token-id check the loss and the fast engine share;
                                #  not a layer, so not in __all__, the layers the book's API page lists)

__all__ = [n for n in dir() if n.endswith(("_forward", "_backward"))] + [
    "attention_weights", "merge_heads", "split_heads", "sinusoidal_table", "rope_angles", "silu", "swiglu_width",
    "lora_merge", "lora_init"]

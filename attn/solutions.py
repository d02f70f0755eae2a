"""The library's own answer to every ``attn-check`` exercise, under the names the
exercises use.

The layers are :mod:`attn.layers`, the masks :mod:`attn.masks` and the loss
:mod:`attn.loss`, re-exported. What the library has only as part of something larger
(an encoder layer inside :class:`attn.model.Transformer`, an Adam step inside
:class:`attn.optim.Adam`) is written here as a plain function *by calling that larger
thing*, so that an exercise is graded against the code the library runs.
``attn-check --timings`` grades this module.
"""
from __future__ import annotations

from .layers import *  # noqa: F401,F403
from .layers import merge_heads, sinusoidal_table, split_heads  # noqa: F401
from .loss import cross_entropy  # noqa: F401
from .masks import causal_mask, decoder_mask, padding_mask  # noqa: F401

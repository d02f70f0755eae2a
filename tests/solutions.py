"""The library's own layers under their own names: the solutions to every exercise.
``attn-check tests/solutions.py`` must pass every layer (tests/test_check.py)."""
from attn.layers import *  # noqa: F401,F403
from attn.layers import merge_heads, sinusoidal_table, split_heads  # noqa: F401
from attn.loss import cross_entropy  # noqa: F401
from attn.masks import causal_mask, padding_mask  # noqa: F401

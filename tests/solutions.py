"""The library's own answer to every exercise, under the exercises' names:
``attn-check --allow-library tests/solutions.py`` must pass every layer, and without
``--allow-library`` fail every one as a re-export (tests/test_check.py)."""
from attn.grader.solutions import *  # noqa: F401,F403
from attn.grader.solutions import merge_heads, sinusoidal_table, split_heads  # noqa: F401
from attn.loss import cross_entropy  # noqa: F401
from attn.masks import causal_mask, padding_mask  # noqa: F401
from attn.quantize import int8_round_trip  # noqa: F401
from attn.speculative import speculative_accept  # noqa: F401

"""The library's own layer norm, re-exported as if it were the learner's."""
from attn.layers import layer_norm_backward, layer_norm_forward  # noqa: F401

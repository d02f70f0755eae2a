"""Positional backward that takes the table's gradient from the first sentence only."""
from attn import backend as B
from attn.layers.positional import positional_forward  # noqa: F401


def positional_backward(dout, cache):
    dtable = B.get_array_module(dout).zeros(cache.shape, dtype=dout.dtype)
    dtable[: cache.T] = dout.reshape(-1, cache.T, cache.shape[1])[0]          # .sum(axis=0) missing
    return dout, dtable

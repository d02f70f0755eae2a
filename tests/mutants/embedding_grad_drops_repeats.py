"""Embedding backward with dW[ids] += g: a repeated id keeps only one of its gradients."""
from attn import backend as B
from attn.layers.embedding import embedding_forward  # noqa: F401


def embedding_backward(dout, cache):
    ids, shape, dtype, scale = cache
    dW = B.get_array_module(dout).zeros(shape, dtype=dtype)
    dW[ids.reshape(-1)] += dout.reshape(-1, shape[1]) * scale
    return dW

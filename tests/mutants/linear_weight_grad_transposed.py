"""Linear backward with the weight gradient's product transposed: dw = dout.T @ x."""
from attn.layers.linear import linear_forward  # noqa: F401


def linear_backward(dout, cache):
    x, w = cache
    d2 = dout.reshape(-1, w.shape[1])
    x2 = x.reshape(-1, w.shape[0])
    return (d2 @ w.T).reshape(x.shape), d2.T @ x2, d2.sum(axis=0)

"""A correct layer-norm forward and no backward: forward only, not complete."""


def layer_norm_forward(x, gamma, beta, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    xhat = (x - mean) / (var + x.dtype.type(eps)) ** 0.5
    return gamma * xhat + beta, None

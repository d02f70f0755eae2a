"""A layer norm with eps outside the square root, and a backward that is right for the
forward the learner wrote (rstd from the cache): the forward is the bug."""


def layer_norm_forward(x, gamma, beta, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    sd = var ** 0.5
    xhat = (x - mean) / (sd + x.dtype.type(eps))
    return gamma * xhat + beta, (x - mean, sd, xhat, gamma, eps)


def layer_norm_backward(dout, cache):
    xc, sd, xhat, gamma, eps = cache
    D = xc.shape[-1]
    g = dout * gamma
    den = sd + eps
    # xhat = xc / (sd + eps), d sd / d x = xc / (D sd)
    dsd = -(g * xc).sum(axis=-1, keepdims=True) / den ** 2
    dxc = g / den + dsd * xc / (D * (sd + (sd == 0)))
    dx = dxc - dxc.mean(axis=-1, keepdims=True)
    return dx, (dout * xhat).reshape(-1, D).sum(axis=0), dout.reshape(-1, D).sum(axis=0)

"""A backward that reads what the last forward left in a global, not its own cache."""
_last = {}


def layer_norm_forward(x, gamma, beta, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / (var + x.dtype.type(eps)) ** 0.5
    xhat = (x - mean) * rstd
    _last.update(xhat=xhat, rstd=rstd, gamma=gamma)
    return gamma * xhat + beta, None


def layer_norm_backward(dout, cache):
    xhat, rstd, gamma = _last["xhat"], _last["rstd"], _last["gamma"]
    g = dout * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    D = xhat.shape[-1]
    return dx, (dout * xhat).reshape(-1, D).sum(axis=0), dout.reshape(-1, D).sum(axis=0)

"""A learner's answer to lessons/exercises/rmsnorm.py, written from its docstrings: attn-check
must pass it."""


def rmsnorm_forward(x, gamma, eps=1e-6):
    rrms = 1.0 / ((x * x).mean(axis=-1, keepdims=True) + x.dtype.type(eps)) ** 0.5
    xhat = x * rrms
    return gamma * xhat, (xhat, rrms, gamma)


def rmsnorm_backward(dout, cache):
    xhat, rrms, gamma = cache
    g = dout * gamma
    dx = rrms * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    D = xhat.shape[-1]
    return dx, (dout * xhat).reshape(-1, D).sum(axis=0)

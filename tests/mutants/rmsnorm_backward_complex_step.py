"""An RMSNorm whose backward is the complex-step derivative of its own forward: exact to
rounding, and nothing derived."""
import numpy as np


def rmsnorm_forward(x, gamma, eps=1e-6):
    r = np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return x / r * gamma, (x, gamma, eps)


def rmsnorm_backward(dout, cache):
    x, gamma, eps = cache
    grads = []
    for a in (x, gamma):
        g = np.zeros(a.shape)
        for i in np.ndindex(a.shape):
            z = [x.astype(complex), gamma.astype(complex)]
            z[a is gamma][i] += 1e-30j
            g[i] = (rmsnorm_forward(z[0], z[1], eps)[0].imag / 1e-30 * dout).sum()
        grads.append(g.astype(a.dtype))
    return tuple(grads)

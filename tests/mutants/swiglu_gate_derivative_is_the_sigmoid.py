"""SwiGLU whose backward takes SiLU's derivative to be the sigmoid alone (the product rule forgotten)."""
from attn import backend as B


def swiglu_forward(x, w, v, w2):
    xp = B.get_array_module(x)
    a, b = x @ w, x @ v
    s = 1 / (1 + xp.exp(-a))
    h = a * s * b
    return h @ w2, (x, w, v, w2, a, b, s, h)


def swiglu_backward(dout, cache):
    x, w, v, w2, a, b, s, h = cache
    D, F = w.shape
    dh = dout @ w2.T
    da = dh * b * s
    db = dh * a * s
    x2, da2, db2 = x.reshape(-1, D), da.reshape(-1, F), db.reshape(-1, F)
    dw2 = h.reshape(-1, F).T @ dout.reshape(-1, D)
    return da @ w.T + db @ v.T, x2.T @ da2, x2.T @ db2, dw2

"""LoRA whose backward leaves alpha/r out of b's gradient."""


def lora_forward(x, w, a, b, alpha):
    s = x.dtype.type(alpha / a.shape[1])
    h = x @ a
    return x @ w + s * (h @ b), (x, w, a, b, h, s)


def lora_backward(dout, cache):
    x, w, a, b, h, s = cache
    D, r = a.shape
    dh = s * (dout @ b.T)
    da = x.reshape(-1, D).T @ dh.reshape(-1, r)
    db = h.reshape(-1, r).T @ dout.reshape(-1, b.shape[1])
    return dout @ w.T + dh @ a.T, da, db


def lora_merge(w, a, b, alpha):
    return w + w.dtype.type(alpha / a.shape[1]) * (a @ b)

"""Adam without the bias correction of its moments (m and v used as they are)."""


def adam_step(params, grads, m, v, t, lr, beta1=0.9, beta2=0.98, eps=1e-9):
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        new_m[k] = beta1 * m[k] + (1 - beta1) * g
        new_v[k] = beta2 * v[k] + (1 - beta2) * g * g
        new_p[k] = p - lr * new_m[k] / (new_v[k] ** 0.5 + eps)
    return new_p, new_m, new_v

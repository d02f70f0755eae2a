"""A learner's answer to the schedule and Adam of lessons/exercises/11_training_recipe.py,
written from their docstrings: attn-check must pass it."""


def noam_lr(step, d_model, warmup_steps, factor=1.0):
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def adam_step(params, grads, m, v, t, lr, beta1=0.9, beta2=0.98, eps=1e-9):
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        new_m[k] = beta1 * m[k] + (1 - beta1) * g
        new_v[k] = beta2 * v[k] + (1 - beta2) * g * g
        m_hat = new_m[k] / (1 - beta1 ** t)
        v_hat = new_v[k] / (1 - beta2 ** t)
        new_p[k] = p - lr * m_hat / (v_hat ** 0.5 + eps)
    return new_p, new_m, new_v

"""Adam with the paper's settings and its warm-up schedule (section 5.3), gradient clipping.

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

rises linearly for ``warmup_steps`` steps, then decays with the inverse square
root of the step number. Adam uses beta1 = 0.9, beta2 = 0.98, epsilon = 1e-9.

A run with a budget may end with a *cooldown* (not in the paper): over the last
``cooldown`` fraction of the budget the rate falls linearly to zero,

    lrate * min(1, (1 - progress) / cooldown),    progress = budget used, 0 to 1

so that the run ends on weights the noise of large steps no longer moves
(:func:`cooldown_scale`; the trainer tells the optimizer its progress before each step).
"""
from __future__ import annotations


from . import backend as B
from .quantize import refuse_training


def noam_lr(step: int, d_model: int, warmup_steps: int, factor: float = 1.0) -> float:
    """The learning rate of section 5.3 at optimizer step ``step`` (1-based)."""
    if step < 1:
        raise ValueError(f"noam_lr: step is 1-based, got {step}")
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def cooldown_scale(progress: float, cooldown: float) -> float:
    """The factor the cooldown puts on the rate: 1 until the last ``cooldown`` fraction of the
    budget, then falling linearly to 0 at its end (``progress`` 1); 1 always for ``cooldown`` 0."""
    if not 0.0 <= cooldown <= 1.0:
        raise ValueError(f"cooldown_scale: cooldown must be in [0, 1], got {cooldown!r}")
    if cooldown == 0.0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / cooldown))


def clip_grad_norm(grads: dict, max_norm: float, sync: bool = True):
    """Scale every gradient in place so that their global L2 norm is at most
    ``max_norm``. Returns the norm before clipping: a Python float (one host sync), or
    with ``sync=False`` a 0-d array on the device, the decision to scale taken there too
    (the same numbers: a gradient that is not clipped is multiplied by exactly 1)."""
    xp = B.get_array_module(next(iter(grads.values())))
    total = xp.sqrt(sum((g.astype(xp.float64) ** 2).sum() for g in grads.values()))
    if not sync:
        if max_norm > 0:
            scale = xp.where(total > max_norm, max_norm / (total + 1e-6), 1.0)      # 0-d, float64
            for g in grads.values():
                g *= scale.astype(g.dtype)
        return total
    norm = float(total)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads.values():
            g *= g.dtype.type(scale)
    return norm


class Adam:
    """Adam (Kingma & Ba) with bias correction, updating ``params`` in place.

    The learning rate comes from the schedule at every step; ``step`` counts
    optimizer steps and advances exactly once per :meth:`step` call. With ``cooldown`` > 0
    the rate is also scaled by :func:`cooldown_scale` of the progress last given to
    :meth:`set_progress` (none given: 1).
    """

    def __init__(self, params: dict, d_model: int, warmup_steps: int = 4000, lr_factor: float = 1.0,
                 betas=(0.9, 0.98), eps: float = 1e-9, lr: float | None = None, cooldown: float = 0.0):
        refuse_training(params, "Adam")
        self.params = params
        self.d_model, self.warmup_steps, self.lr_factor = d_model, warmup_steps, lr_factor
        self.cooldown, self.scale = cooldown, cooldown_scale(0.0, cooldown)
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.fixed_lr = lr                     # a constant rate instead of the schedule, if given
        self.t = 0
        self.m = {k: B.get_array_module(v).zeros_like(v) for k, v in params.items()}
        self.v = {k: B.get_array_module(v).zeros_like(v) for k, v in params.items()}

    def set_progress(self, progress: float) -> None:
        """The fraction of the run's budget used (0 to 1), before a step: it sets the cooldown's factor."""
        self.scale = cooldown_scale(progress, self.cooldown)

    def lr(self, step: int | None = None) -> float:
        """The rate of step ``step`` (default: the coming one), at the cooldown's present factor."""
        step = self.t + 1 if step is None else step
        if self.fixed_lr is not None:
            return self.fixed_lr * self.scale
        return noam_lr(step, self.d_model, self.warmup_steps, self.lr_factor) * self.scale

    def step(self, grads: dict, clip: float = 0.0) -> float:
        """One update with the learning rate of the coming step. Returns that rate.
        ``clip`` > 0: the gradients' global norm is first clipped to it in place
        (:func:`clip_grad_norm`, decided on the device: no host sync)."""
        if clip:
            clip_grad_norm(grads, clip, sync=False)
        missing = [k for k in self.params if k not in grads]
        if missing:
            raise KeyError(f"Adam.step: no gradient for {missing[:5]}{'...' if len(missing) > 5 else ''}")
        lr = self.lr(self.t + 1)
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        c1, c2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        for k, p in self.params.items():
            g, m, v = grads[k], self.m[k], self.v[k]
            dt = p.dtype.type
            m *= dt(b1)
            m += dt(1.0 - b1) * g
            v *= dt(b2)
            v += dt(1.0 - b2) * (g * g)
            # p -= lr * m_hat / (sqrt(v_hat) + eps), with m_hat = m/c1, v_hat = v/c2
            p -= dt(lr / c1) * m / (B.get_array_module(v).sqrt(v / dt(c2)) + dt(self.eps))
        return lr

    def state_arrays(self) -> dict:
        out = {f"adam.m/{k}": v for k, v in self.m.items()}
        out.update({f"adam.v/{k}": v for k, v in self.v.items()})
        return out

    def load_state(self, arrays: dict, t: int) -> None:
        """Restore moments (from :meth:`state_arrays` names, on the host) and the step count."""
        for k in self.params:
            for name, store in (("adam.m", self.m), ("adam.v", self.v)):
                key = f"{name}/{k}"
                if key not in arrays:
                    raise KeyError(f"optimizer state has no {key}")
                store[k] = B.to_device(arrays[key], self.params[k].dtype)
        self.t = int(t)


def schedule_curve(steps, d_model: int, warmup_steps: int, factor: float = 1.0):
    """The schedule over a range of steps, as a list (for plots)."""
    return [noam_lr(s, d_model, warmup_steps, factor) for s in steps]

"""FastAdam: :class:`attn.optim.Adam` done in place: over the fast model's arena in one
update (one kernel launch on CuPy), or parameter by parameter on any other dict."""
from __future__ import annotations

import math

from ... import backend as B
from ...optim import Adam, clip_grad_norm
from ..core.arena import Arena
from ..core.dispatch import ops_for
from ..gpu.stepmem import outside_step
from ..core.threads import THREADS, default_workers


class FastAdam(Adam):
    """:class:`attn.optim.Adam` with the same update done in place, rearranged but equal in exact
    arithmetic::

        m += (1 - b1) * (g - m)          # m = b1 m + (1 - b1) g
        v = b2 v + (1 - b2) g^2
        p -= (lr * sqrt(c2) / c1) * m / (sqrt(v) + eps * sqrt(c2))   # = lr m_hat / (sqrt(v_hat) + eps)

    Over an arena (a :class:`attn.fast.FastTransformer`'s ``params``) the moments are the arena's
    ``m`` and ``v`` and the step is one update of the four flat buffers, reading ``grads`` (another
    dict of gradients is copied there first); otherwise one parameter after another."""

    #: Threads for the update over an arena (NumPy): None = :func:`default_workers`.
    threads: int | None = None

    #: Elements of the arena one NumPy pass of the update takes at a time.
    SLICE = 1 << 17

    def __init__(self, params: dict, d_model: int, warmup_steps: int = 4000, lr_factor: float = 1.0,
                 betas=(0.9, 0.98), eps: float = 1e-9, lr: float | None = None, cooldown: float = 0.0):
        self.arena = Arena.find(params)
        super().__init__(params if self.arena is None else {}, d_model, warmup_steps, lr_factor, betas, eps,
                         lr, cooldown)
        if self.arena is not None:                   # Adam's settings; the moments are the arena's
            self.params = params
            self.arena.m[...] = 0
            self.arena.v[...] = 0
            self.m, self.v = self.arena.views(self.arena.m), self.arena.views(self.arena.v)

    def load_state(self, arrays: dict, t: int) -> None:
        """As :meth:`Adam.load_state`; over an arena the moments are copied into it."""
        if self.arena is None:
            return super().load_state(arrays, t)
        for k in self.params:
            for name, store in (("adam.m", self.m), ("adam.v", self.v)):
                key = f"{name}/{k}"
                if key not in arrays:
                    raise KeyError(f"optimizer state has no {key}")
                store[k][...] = B.to_device(arrays[key], self.params[k].dtype)
        self.t = int(t)
        self._device_count = None              # made again from t at the next step

    def count_step(self) -> float:
        """The host's half of a step over an arena on the GPU: count it (``t``, for the schedule
        shown, the checkpoint and the snapshots) and return its learning rate. The device counts
        too (:meth:`apply_step`), so a step captured as a CUDA graph
        (:class:`attn.fast.gpu.graph.GraphedTrainStep`) calls this before every replay."""
        return self._consts()[0]

    def apply_step(self, clip: float = 0.0) -> None:
        """The device's half: the update of the whole arena in one ``adam_flat`` launch (one
        ``sumsq_partial`` more with ``clip``), which makes the step's learning rate and bias
        corrections from the step count it keeps on the device and advances it."""
        a = self.arena
        count = getattr(self, "_device_count", None)
        if count is None:      # the steps taken before this one: t was counted by count_step
            with outside_step():               # kept between steps: never from a step's memory
                count = self._device_count = a.xp.asarray(B.host.array([self.t - 1], dtype=B.host.int64))
        fixed = None if self.fixed_lr is None else self.fixed_lr * self.scale       # the cooldown's factor rides
        schedule = (self.lr_factor * self.scale, fixed, self.d_model, self.warmup_steps,  # in the launch's scalars
                    self.beta1, self.beta2, self.eps)
        ops_for(a.xp).adam_flat_(a.params, a.grads, a.m, a.v, count, schedule, max_norm=clip)

    def _consts(self):
        lr = self.lr(self.t + 1)
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        c1, c2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        return lr, (1.0 - b1, b2, 1.0 - b2, self.eps * math.sqrt(c2), lr * math.sqrt(c2) / c1)

    def step(self, grads: dict, clip: float = 0.0) -> float:
        missing = [k for k in self.params if k not in grads]
        if missing:
            raise KeyError(f"Adam.step: no gradient for {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if self.arena is not None:
            return self._step_arena(grads, clip)
        if clip:
            clip_grad_norm(grads, clip, sync=False)
        lr, consts = self._consts()
        buf = None
        for k, p in self.params.items():
            xp = B.get_array_module(p)
            if buf is None or buf.size < p.size or buf.dtype != p.dtype:
                buf = xp.empty(max(p.size, 1 if buf is None else buf.size), dtype=p.dtype)
            ops_for(xp).adam_(p, grads[k], self.m[k], self.v[k], consts, buf[:p.size].reshape(p.shape))
        return lr

    def _step_arena(self, grads: dict, clip: float) -> float:
        a = self.arena
        for k, view in a.grad_views.items():          # not the fast backward's own: copy them in
            if grads[k] is not view:
                view[...] = grads[k]
        xp = a.xp
        if xp is not B.host:
            lr = self.count_step()
            self.apply_step(clip)
            return lr
        if clip:
            # NumPy: the norm in float64 (as attn.optim.clip_grad_norm), a slice at a time
            g = a.grads
            chunk = 1 << 20
            total = math.sqrt(sum(float(xp.dot(c, c)) for c in
                                  (g[i:i + chunk].astype(xp.float64) for i in range(0, g.size, chunk))))
            if total > clip:
                g *= g.dtype.type(clip / (total + 1e-6))
        lr, consts = self._consts()
        n = a.size
        k = max(1, min(self.threads or default_workers(), -(-n // self.SLICE)))
        ops = ops_for(xp)
        bounds = [n * i // k for i in range(k + 1)]

        def update(lo, hi):
            # slices of SLICE elements: the update's five passes over one run in cache
            t = xp.empty(min(self.SLICE, hi - lo), dtype=a.dtype)
            for i in range(lo, hi, self.SLICE):
                j = min(hi, i + self.SLICE)
                ops.adam_(a.params[i:j], a.grads[i:j], a.m[i:j], a.v[i:j], consts, t[:j - i])
        THREADS.run([lambda lo=lo, hi=hi: update(lo, hi) for lo, hi in zip(bounds, bounds[1:])])
        return lr

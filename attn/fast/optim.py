"""FastAdam: :class:`attn.optim.Adam` done in place, split over threads on NumPy."""
from __future__ import annotations

import math

from .. import backend as B
from ..optim import Adam
from .dispatch import ops_for
from .threads import _THREADS, default_workers

class FastAdam(Adam):
    """:class:`attn.optim.Adam` with the same update done in place: one scratch buffer
    per thread instead of five temporaries per parameter, and the parameters split
    over :func:`default_workers` threads on NumPy (ufuncs release the GIL). The update is rearranged but
    equal in exact arithmetic::

        m += (1 - b1) * (g - m)          # m = b1 m + (1 - b1) g
        v = b2 v + (1 - b2) g^2
        p -= (lr * sqrt(c2) / c1) * m / (sqrt(v) + eps * sqrt(c2))   # = lr m_hat / (sqrt(v_hat) + eps)
    """

    #: Threads for the update (NumPy): None = :func:`default_workers`.
    threads: int | None = None

    def step(self, grads: dict) -> float:
        missing = [k for k in self.params if k not in grads]
        if missing:
            raise KeyError(f"Adam.step: no gradient for {missing[:5]}{'...' if len(missing) > 5 else ''}")
        lr = self.lr(self.t + 1)
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        c1, c2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        consts = (1.0 - b1, b2, 1.0 - b2, self.eps * math.sqrt(c2), lr * math.sqrt(c2) / c1)
        keys = list(self.params)
        first = next(iter(self.params.values()))
        k = 1 if B.is_device_array(first) else min(self.threads or default_workers(), len(keys))
        if k > 1:
            # k groups of about equal size, largest parameters first
            keys.sort(key=lambda name: -self.params[name].size)
            groups, sizes = [[] for _ in range(k)], [0] * k
            for name in keys:
                j = sizes.index(min(sizes))
                groups[j].append(name)
                sizes[j] += self.params[name].size
            _THREADS.run([lambda ks=ks: self._update(ks, grads, consts) for ks in groups])
        else:
            self._update(keys, grads, consts)
        return lr

    def _update(self, keys, grads, consts):
        buf = None
        for k in keys:
            p, g, m, v = self.params[k], grads[k], self.m[k], self.v[k]
            xp = B.get_array_module(p)
            if buf is None or buf.size < p.size or buf.dtype != p.dtype:
                buf = xp.empty(max(p.size, 1 if buf is None else buf.size), dtype=p.dtype)
            ops_for(xp).adam_(p, g, m, v, consts, buf[:p.size].reshape(p.shape))

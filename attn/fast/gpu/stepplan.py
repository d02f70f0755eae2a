"""The step memory's plan: where in the slab each of a step's arrays lies, from their lifetimes
(docs/GPU.md, "What a step asks of a GPU"). :class:`Trace` records when each of a step's requests
was freed (in requests made so far); :func:`plan` gives every request an offset, greedy by size and
best fit, so that no two arrays alive at once overlap. The same step at the same shapes asks and
frees in the same order, so one plan serves the next steps."""
from __future__ import annotations

import weakref

from ... import backend as B

np = B.host

#: A lifetime that has not ended when the step did (what the step returns): to the end.
FOREVER = np.iinfo(np.int64).max


class Trace:
    """When each of one step's requests was freed: ``died[i]``, how many requests had been made
    when request ``i``'s array was freed (:data:`FOREVER` while alive)."""

    def __init__(self, died=()):
        self.died, self.closed = list(died), False

    def add(self, mem) -> None:
        """The step's next request, whose memory is ``mem``: its death is noted when ``mem`` is freed."""
        self.died.append(FOREVER)
        weakref.finalize(mem, self._freed, len(self.died) - 1)

    def _freed(self, i: int) -> None:
        if not self.closed:
            self.died[i] = len(self.died)

    def close(self) -> None:
        """The step ended: what is freed later lived to the end."""
        self.closed = True


def peak_live(sizes, died) -> int:
    """The most bytes alive at once, for requests born in order and freed at ``died``."""
    n = len(sizes)
    if not n:
        return 0
    delta = np.zeros(n + 1, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    delta[:n] += sizes
    ends = np.minimum(np.asarray(died, dtype=np.int64), n)
    np.subtract.at(delta, ends, sizes)
    return int(np.cumsum(delta)[:n].max())


class Plan:
    """``offsets[i]`` of request ``i`` (of ``sizes[i]`` bytes, freed at ``died[i]``) in a slab of
    ``size`` bytes, and the step's ``peak`` of live bytes. The step memory notes on it the step
    keys it was checked against (``verified``), and whether a step asked for what it did not
    expect (``stale``: the next step at its key is traced again)."""

    def __init__(self, sizes, offsets, size: int, peak: int, died=()):
        self.sizes, self.offsets, self.size, self.peak = tuple(sizes), tuple(offsets), int(size), int(peak)
        self.died = tuple(died)
        self.verified: set = set()
        self.stale = False

    def __len__(self):
        return len(self.sizes)


def plan(sizes, died) -> Plan:
    """Offsets for requests of ``sizes`` born in order (request ``i`` at time ``i``) and freed at
    ``died``: two requests share bytes only when their lifetimes ``[i, died[i])`` do not overlap.
    Greedy by size (largest first), each at the best-fitting gap (the smallest that holds it,
    lowest first) among the offsets of the placed requests whose lifetimes overlap its own."""
    n = len(sizes)
    size = np.asarray(sizes, dtype=np.int64)
    born = np.arange(n, dtype=np.int64)
    end = np.maximum(np.asarray(died, dtype=np.int64), born + 1)
    offsets = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i in sorted(range(n), key=lambda j: (-int(size[j]), j)):
        live = placed & (born < end[i]) & (born[i] < end)
        lo, hi = offsets[live], offsets[live] + size[live]
        order = np.argsort(lo, kind="stable")
        best, best_gap, top = None, None, 0
        for a, b in zip(lo[order].tolist(), hi[order].tolist()):
            gap = a - top
            if gap >= size[i] and (best_gap is None or gap < best_gap):
                best, best_gap = top, gap
            top = max(top, b)
        offsets[i] = top if best is None else best
        placed[i] = True
    total = int((offsets + size).max()) if n else 0
    return Plan(sizes, offsets.tolist(), total, peak_live(sizes, died), died)

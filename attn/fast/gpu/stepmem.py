"""Step memory: every array a training step makes, served from one device slab at the same
addresses every step, so that the step can be captured as a CUDA graph; docs/GPU.md ("What a
step asks of a GPU") tells how and gives the numbers. Inside :meth:`StepMemory.step` this is the
allocator, whoever allocates, at offsets planned by lifetimes (:mod:`attn.fast.gpu.stepplan`), one
plan per :func:`bucket` of step keys. What outlives a step is made inside :func:`outside_step`."""
from __future__ import annotations

import collections
import contextlib
import os
import weakref

from ... import backend as B
from .stepplan import Trace
from .stepplan import plan as make_plan

#: Fill the slab with 0xFF bytes at the start of every step (a debug mode: one launch a step).
POISON = os.environ.get("ATTN_POISON_STEP_MEMORY", "") not in ("", "0")

#: Every request is rounded up to this many bytes (cuBLAS and vector loads want 256-byte
#: alignment; CUDA's own allocations have it).
ALIGN = 256

#: The largest slab with the slabs kept for graphs, as a fraction of the device's memory: a step
#: that needs more keeps its slab and takes the rest from the pool (it cannot be captured then).
LIMIT_FRACTION = 0.5

#: Plans kept per step memory, the least recently used dropped first.
MAX_PLANS = 64

#: Whether models get a step memory (:meth:`StepMemory.of`); :mod:`attn.fast.gpu.fallback` switches it
#: off where its probe fails, and a model whose ``_step_memory`` is False has none.
ENABLED = True

#: The step memory whose allocator is in place, or None.
_active = None

#: Every step memory alive (what :func:`held_bytes` adds up).
_all = weakref.WeakSet()


def held_bytes() -> int:
    """Bytes of device memory every live step memory holds (its slab and the slabs graphs keep):
    what a memory hook on the pool does not see once the slabs are made."""
    return sum(m.capacity + sum(int(s.nbytes) for s in m._retired) for m in list(_all))


class StepMemory:
    """One slab of device memory serving every allocation made inside :meth:`step`, at offsets
    planned by lifetimes (``planned=False``: each at the next free byte). A planned step checks that
    no two live arrays overlap (pairs of requests that would, in :attr:`overlapping`) where ``check``
    is set, else the first at each exact key. The last step's counts: :attr:`allocations` (served by
    the slab), :attr:`overflows` (by the pool), :attr:`demand` (bytes asked for, aligned) and
    :attr:`last_outcome`: "planned", "traced" (for a plan) or "spilled" (past its plan's bytes: a
    request the plan did not expect, its key then traced again, or a plan over :attr:`limit`, the
    largest slab, :attr:`over_limit`). :attr:`capacity` is the slab's bytes; :attr:`last_plan`
    the last plan made."""

    def __init__(self, xp, planned: bool = True, check: bool = False):
        if xp is B.host:
            raise TypeError("StepMemory: a slab of device memory needs CuPy; NumPy has no step memory")
        self.xp, self.planned, self.check = xp, bool(planned), bool(check)
        self.slab = self._base = None          # the slab, and its MemoryPointer
        self.capacity = self.demand = self.allocations = self.overflows = self.steps = self.plans_made = 0
        self.limit = int(LIMIT_FRACTION * xp.cuda.Device().mem_info[1])
        self.over_limit = False
        self.overlapping: list = []
        self.last_plan = self.last_outcome = self._step_key = None
        self.outcomes: collections.Counter = collections.Counter()
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._retired: list = []           # replaced slabs that kept graphs were captured on (and write to)
        self._pins: dict = {}              # id(slab) -> kept graphs captured on it
        self._pressure: list = []          # weak methods that drop graphs to make room (on_pressure)
        self._device = xp.cuda.Device().id        # given to UnownedMemory: no CUDA call to look it up
        self._piece = piece_class(xp)
        _all.add(self)

    @classmethod
    def of(cls, owner) -> "StepMemory | None":
        """``owner``'s step memory (made on first use and kept on it), or None where its
        arrays are NumPy's (``owner.xp``) or the step memory is switched off."""
        mem = getattr(owner, "_step_memory", None)
        if mem is False or not ENABLED:                # switched off (attn.fast.gpu.fallback, or for the owner)
            return None
        if mem is None:
            xp = getattr(owner, "xp", B.host)
            if xp is B.host or not hasattr(getattr(xp, "cuda", None), "using_allocator"):
                return None
            mem = owner._step_memory = cls(xp)
        return mem

    def malloc(self, size: int):
        """The allocator of a step (:meth:`_planned`). A request of no bytes (a zero-size array's)
        takes nothing and is not one of the plan's."""
        if int(size) == 0:
            return self.xp.cuda.MemoryPointer(self._piece(0, 0, None, self._device), 0)
        n = -(-int(size) // ALIGN) * ALIGN
        self.demand += n
        return self._planned(size, n)

    def _planned(self, size: int, n: int):
        """Request ``self._i`` (``size`` bytes, ``n`` aligned): at its plan's offset while each request
        fits the plan, else (or unplanned) at the slab's next free byte, then from the pool."""
        i = self._i
        self._i = i + 1
        self._sizes.append(n)
        if i == 0 and self.planned:
            self._choose(n)
        if self._mode == "plan":
            plan = self._plan
            if i < len(plan) and n <= plan.sizes[i]:
                p = self._base + plan.offsets[i]
                if self._live is not None:
                    p = self._checked(p, i, plan.offsets[i], plan.sizes[i])
                if p is not None:
                    self.allocations += 1
                    return p
                self._diverted = True
            self._mode, self._offset = "bump", plan.size      # a request it did not expect
        if self._offset + n <= self.capacity:
            p = self._base + self._offset
            self._offset += n
            self.allocations += 1
            owner = self.slab
        else:
            self.overflows += 1
            p = owner = self._outer(size)
        if self._mode != "trace":
            return p
        mem = self._piece(p.ptr, n if owner is self.slab else int(size), owner, self._device)  # kept by its views
        self._trace.add(mem)
        return self.xp.cuda.MemoryPointer(mem, 0)

    def _choose(self, first: int) -> None:
        """At a step's first request: the plan for its key's :func:`bucket` (without a key, for its
        first request's size) if the slab holds it; checked at an exact key met for the first time."""
        self._key = ("key", bucket(self._step_key)) if self._step_key is not None else (None, first)
        plan = self._plans.get(self._key)
        if plan is None or plan.stale:
            self._mode, self._trace, self._stale = "trace", Trace(), plan
        elif plan.size <= self.capacity:
            self._mode, self._plan = "plan", plan
            self._plans.move_to_end(self._key)
            if self._live is None and self._step_key not in plan.verified \
                    and not self.xp.cuda.get_current_stream().is_capturing():   # (a capture replays it as it is)
                self._live = {}
        else:
            self._mode = "bump"                        # over the limit: what fits, then the pool

    def _checked(self, p, i: int, offset: int, n: int):
        """A checked step's request ``i`` at ``p``, watched while alive; None where it would overlap
        an array still alive (noted in :attr:`overlapping`): it is served past the plan's bytes."""
        live = self._live
        clash = [(j, i) for j, (o, m) in live.items() if o < offset + n and offset < o + m]
        if clash:
            self.overlapping += clash
            return None
        mem = self._piece(p.ptr, n, self.slab, self._device)
        live[i] = (offset, n)
        weakref.finalize(mem, live.pop, i, None)
        return self.xp.cuda.MemoryPointer(mem, 0)

    def _after(self, outer) -> None:
        """At a step's end: its outcome counted, a checked key noted as safe for its plan, and a trace
        made the plan for its key (each request as large as the largest its key's steps asked for)."""
        trace, self._trace = self._trace, None
        if not self.planned:
            if self.demand > self.capacity:
                self._grow(outer, self.demand)
            return
        if not self._i:
            return
        outcome = self.last_outcome = {"plan": "planned", "trace": "traced"}.get(self._mode, "spilled")
        self.outcomes[outcome] += 1
        plan = self._plan
        if outcome == "planned" and self._live is not None:
            plan.verified.add(self._step_key)
        if outcome == "spilled" and plan is not None:
            if self._diverted or len(self._sizes) != len(plan):
                plan.stale = True                      # other lifetimes, or other requests: traced again
                return
            trace, self._stale = Trace(plan.died), plan    # the same requests, some larger: same lifetimes
        elif outcome != "traced":
            return
        trace.close()
        sizes, old = self._sizes, self._stale
        if old is not None and len(old) == len(sizes):
            sizes = [max(a, b) for a, b in zip(old.sizes, sizes)]
        plan = self._plans[self._key] = self.last_plan = make_plan(sizes, trace.died)
        self._plans.move_to_end(self._key)
        self.plans_made += 1
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        if plan.size > self.capacity:
            self._grow(outer, plan.size)

    @contextlib.contextmanager
    def step(self, key=None):
        """The ``with`` of one step: every allocation inside it from the slab (0xFF bytes first with
        :data:`POISON`); ``key`` (any hashable: the input shapes, say) picks the plan."""
        global _active
        if _active is not None:
            raise RuntimeError("StepMemory.step: a step is already in progress (steps do not nest)")
        outer = self.xp.cuda.get_allocator()
        if POISON and self.slab is not None:
            self.slab.fill(255)
        self._offset = self.demand = self.allocations = self.overflows = self._i = 0
        self._mode = self._plan = self._trace = self._stale = None
        self._sizes, self._diverted = [], False
        self._live = {} if self.check else None
        self.steps += 1
        self._step_key, self._outer, _active = key, outer, self
        try:
            with self.xp.cuda.using_allocator(self.malloc):
                yield self
        finally:
            _active = None
            self._after(outer)

    def pin(self):
        """A graph was captured on the slab: keep it when a larger one replaces it (the graph's
        replays write there) until :meth:`unpin`. Returns the slab, which ``unpin`` takes."""
        self._pins[id(self.slab)] = self._pins.get(id(self.slab), 0) + 1
        return self.slab

    def unpin(self, slab) -> None:
        """A graph captured on ``slab`` (what :meth:`pin` returned) was dropped: once no kept graph
        is on it, a replaced slab goes back to the pool, and the slab in use is let go when replaced."""
        n = self._pins.pop(id(slab), 0) - 1
        if n > 0:
            self._pins[id(slab)] = n
        else:
            self._retired = [s for s in self._retired if s is not slab]

    @property
    def _pinned(self) -> bool:
        """Whether a kept graph was captured on the slab in use."""
        return self.slab is not None and id(self.slab) in self._pins

    def on_pressure(self, release) -> None:
        """``release()`` (a bound method, held weakly) drops its graphs on this step memory when a
        slab would not fit in :attr:`limit` beside the slabs kept for graphs."""
        self._pressure.append(weakref.WeakMethod(release))

    def kept_bytes(self) -> int:
        """Bytes of the slabs kept for graphs: those replaced, and the one in use if a graph is on it."""
        return sum(int(s.nbytes) for s in self._retired) + (self.capacity if self._pinned else 0)

    def _grow(self, outer, nbytes: int) -> None:
        """A slab of ``nbytes`` from ``outer`` unless over :attr:`limit` with the slabs kept for graphs
        (every graph dropped first where they leave no room); the slab replaced is kept if pinned."""
        if nbytes + self.kept_bytes() > self.limit:
            for release in [r() for r in self._pressure]:
                if release is not None:
                    release()
            self._pressure = [r for r in self._pressure if r() is not None]
        if nbytes + self.kept_bytes() > self.limit:
            self.over_limit = True
            return
        if self.slab is not None and self._pinned:
            self._retired.append(self.slab)
        self.slab = None                               # the old one goes back before the new one is made
        with self.xp.cuda.using_allocator(outer):
            self.slab = self.xp.empty((nbytes,), dtype=B.host.uint8)
        self._base, self.capacity = self.slab.data, nbytes

    def stats(self) -> dict:
        """The last step's counts and the slab's size (bytes)."""
        return {"allocations": self.allocations, "overflows": self.overflows, "demand_bytes": self.demand,
                "slab_bytes": self.capacity, "retired_slabs": len(self._retired), "kept_bytes": self.kept_bytes(),
                "over_limit": self.over_limit,
                "peak_live_bytes": self.last_plan.peak if self.last_plan is not None else self.demand,
                "plans_made": self.plans_made, "steps_planned": self.outcomes["planned"],
                "steps_traced": self.outcomes["traced"], "steps_spilled": self.outcomes["spilled"]}


def bucket(key):
    """The plan key of a step key: every integer in it (a shape's dimensions) rounded up to a power
    of two, so that the dozens of batch shapes of a run of token-count batches share a handful of
    plans (each request as large as the largest its bucket's steps asked for)."""
    if isinstance(key, tuple):
        return tuple(bucket(k) for k in key)
    if isinstance(key, int) and not isinstance(key, bool) and key > 0:
        return 1 << (key - 1).bit_length()
    return key


def outside_step():
    """A ``with`` in which allocations come from the allocator in place before the step (for
    what the engine makes on first use and keeps between steps); nothing outside a step."""
    mem = _active
    if mem is None:
        return contextlib.nullcontext()
    return mem.xp.cuda.using_allocator(mem._outer)


def in_slab(address: int) -> bool:
    """Whether ``address`` lies in the slab of the step in progress (so the same step at the same
    shapes finds its array there again: what a kernel may key a cache by)."""
    mem = _active
    return mem is not None and mem.slab is not None and mem._base.ptr <= address < mem._base.ptr + mem.capacity


def step_token():
    """Which step is in progress, None outside any: what a cache of arrays made in a step's memory
    keys them by, since the next step hands the same bytes out again."""
    mem = _active
    return None if mem is None else (mem, mem.steps)


def in_step() -> bool:
    """Whether a step's allocator is in place."""
    return _active is not None


_PIECES: dict = {}


def piece_class(xp):
    """``xp.cuda.UnownedMemory`` as a Python class (one per array module), which a step's request is
    wrapped in so that a weak reference can tell when the request's last array is gone."""
    if xp.__name__ not in _PIECES:
        class StepPiece(xp.cuda.UnownedMemory):
            """A step's request: the slab's bytes at an offset, kept alive by every view of them."""
        _PIECES[xp.__name__] = StepPiece
    return _PIECES[xp.__name__]

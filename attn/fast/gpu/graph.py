"""A step captured once as a CUDA graph and replayed: one launch from the host for all of a
step's kernels (docs/GPU.md, "Capturing the step as a CUDA graph", tells what it asks of a step):
:class:`CapturedStep` for any function, every capture in thread-local mode inside
:class:`CaptureGuard`; :class:`GraphedTrainStep`, the fast engine's training step through it;
:func:`survey` lists what a capture would refuse (on the CuPy stand-in)."""
from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter, OrderedDict
from typing import Callable, NamedTuple

from ... import backend as B

#: The stream capture mode of every capture: ``cudaStreamCaptureModeThreadLocal`` (1). Relaxed,
#: CuPy's default, lets even a ``cudaMalloc`` through; global refuses other threads' calls too.
CAPTURE_MODE_NAME = "streamCaptureModeThreadLocal"

#: How far a replayed step may be from the eager one on a GPU: the embeddings' gradient is a
#: scatter-add whose float atomics sum a token's rows in whatever order the threads arrive (a few
#: units of 2^-24, relative, apart), which Adam carries into the parameters at the learning rate's
#: scale. Every other sum (the two-stage reductions, the products) runs in a fixed order.
REPLAY_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def held_parameters(model):
    """The parameters of a fast ``model`` that a replayed step is held to equal an eager step's
    (:data:`REPLAY_TOLERANCE`), on the host as one flat array: all but the key biases that change no
    loss (docs/GPU.md: every cross-attention's, and the self-attentions' but with rotary positions)."""
    views = model.arena.views(model.arena.params)
    rope = model.block.positions.rotary
    return B.host.concatenate([B.to_host(v).ravel() for name, v in views.items()
                               if not (name.endswith(".b_k") and (not rope or ".cross_attn." in name))])


class CaptureError(RuntimeError):
    """A step could not be captured: the message names the operation and where it was asked for."""


_NOT_THE_ASKER = ("/cupy/", "/cupyx/", "/cupy_backends/", "/fakecupy/", "/fast/gpu/graph.py",
                  "/fast/gpu/stepmem.py", "/contextlib.py")


def _where() -> str:
    """``file:line function`` of the innermost frame outside CuPy and this module: who asked."""
    f = sys._getframe(1)
    while f is not None and any(k in f.f_code.co_filename for k in _NOT_THE_ASKER):
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename
    for root in ("/attn/", "/tests/", "/lessons/"):
        if root in path:
            path = path[path.rindex(root) + 1:]
            break
    return f"{path}:{f.f_lineno} {f.f_code.co_name}"


class CaptureGuard:
    """``with CaptureGuard(xp, memory) as guard: <capture>``; then :attr:`reasons` lists why the
    graph must not be kept (empty: it may). Watches the memory pool (a memory hook counting what
    it hands out, and its bytes before and after), the step memory's overflows, and host syncs
    (``cupyx.allow_synchronize(False)`` for the ``with``)."""

    def __init__(self, xp, memory=None):
        self.xp, self.memory = xp, memory
        self.reasons: list = []
        self.allocations: list = []           # (bytes, where) of each pool allocation seen

    def __enter__(self):
        xp = self.xp
        self._pool = xp.get_default_memory_pool()
        self._total = self._pool.total_bytes()
        self._overflows = self.memory.overflows if self.memory is not None else 0
        guard = self

        class _Watch(xp.cuda.MemoryHook):
            name = "attn-capture-guard"

            def malloc_postprocess(self, **kw):
                guard.allocations.append((int(kw.get("mem_size", kw.get("size", 0))), _where()))
            alloc_postprocess = malloc_postprocess
        with contextlib.ExitStack() as stack:        # the hook is never left registered where this raises
            stack.enter_context(_Watch())
            try:
                cupyx = B._cupyx()
            except ImportError:
                cupyx = None
            if hasattr(cupyx, "allow_synchronize"):
                with warnings.catch_warnings():      # CuPy warns that it is deprecated, at every capture
                    warnings.filterwarnings("ignore", message="cupyx.allow_synchronize", category=UserWarning)
                    stack.enter_context(cupyx.allow_synchronize(False))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc):
        self._stack.close()
        if self.allocations:
            n = sum(b for b, _ in self.allocations)
            self.reasons.append(f"{len(self.allocations)} allocation(s) of {n} bytes from the memory pool during "
                                f"the capture (first at {self.allocations[0][1]}): the graph would keep "
                                "addresses the pool hands out again")
        total = self._pool.total_bytes()
        if total > self._total and not self.allocations:
            self.reasons.append(f"the memory pool grew by {total - self._total} bytes during the capture")
        if self.memory is not None and self.memory.overflows > self._overflows:
            self.reasons.append(f"the step memory overflowed: {self.memory.overflows - self._overflows} request(s) "
                                "served by the memory pool during the capture")
        return False


#: Captures tried per input shape before it runs eagerly for good: a refusal may be transient
#: (the first call at the plan's addresses still making what the kernels keep per address, say).
CAPTURE_TRIES = 3

#: Input shapes a :class:`CapturedStep` keeps (each its buffers and at most one graph), the least
#: recently called dropped first with its graph and its hold on the slab the graph writes to:
#: a run over many batch shapes keeps at most this many graphs and the slabs under them.
MAX_GRAPHS = 16


class _Entry:
    """What :class:`CapturedStep` keeps for one input shape: its buffers, eager calls until the
    next capture is tried, captures refused, its graph and the step memory's slab it writes to."""

    def __init__(self, static: list, warmup: int):
        self.static, self.wait, self.refused, self.graph, self.out = static, warmup, 0, None, None
        self.slab = None


class CapturedStep:
    """``fn(*inputs)`` captured as a CUDA graph per input shape and replayed (docs/GPU.md): eager
    for the first ``warmup`` calls at a shape, captured on the next, replayed after, returning the
    same arrays every time (read them before the next call); NumPy inputs: ``fn`` every time. Each
    call copies ``inputs`` (host arrays where ``xp`` is given) into buffers the graph reads, and runs
    in ``memory`` (a :class:`attn.fast.gpu.stepmem.StepMemory`). A refused capture runs eagerly, its
    reason in :attr:`refusals`, and is tried again after ``warmup`` more calls, until
    :data:`CAPTURE_TRIES` refusals (``strict=True`` raises :class:`CaptureError`). :attr:`graphs`
    counts the captures, :attr:`dropped` the graphs dropped (:data:`MAX_GRAPHS`, :meth:`release`)."""

    def __init__(self, fn: Callable, *, warmup: int = 1, memory=None, xp=None, strict: bool = False):
        if warmup < 1:
            raise ValueError(f"CapturedStep: warmup must be at least 1 (the eager call that allocates what the "
                             f"step keeps), got {warmup}")
        self.fn, self.warmup, self.xp, self.memory, self.strict = fn, int(warmup), xp, memory, bool(strict)
        self._entries: OrderedDict = OrderedDict()      # input shape key -> _Entry, least recently called first
        self.graphs = self.dropped = 0
        if memory is not None:
            memory.on_pressure(self.release)
        self.refusals: dict = {}

    def __call__(self, *inputs):
        xp = self.xp or B.get_array_module(*inputs)
        if xp is B.host:
            return self.fn(*inputs)
        key = tuple((a.shape, a.dtype.str) for a in inputs)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry([xp.empty(a.shape, dtype=a.dtype) for a in inputs], self.warmup)
            while len(self._entries) > MAX_GRAPHS:
                self._drop(self._entries.popitem(last=False)[1])
        self._entries.move_to_end(key)
        for buffer, a in zip(entry.static, inputs):           # outside the graph
            if B.is_device_array(a):
                buffer[...] = a                               # one device copy
            else:
                buffer.set(B.host.ascontiguousarray(a))       # one host-to-device transfer
        if entry.graph is None and (entry.wait > 0 or entry.refused >= CAPTURE_TRIES):
            entry.wait -= 1
            with self._in_step(key):
                return self.fn(*entry.static)
        if entry.graph is None:
            try:
                with self._in_step(key):
                    entry.graph, entry.out = capture_step(xp, self.fn, entry.static, self.memory)
            except CaptureError as e:
                if self.strict:
                    raise
                self.refusals[key] = str(e)
                entry.refused += 1
                entry.wait = self.warmup                 # eager calls, then the capture is tried again
                with self._in_step(key):                 # the capture ran nothing: the step, eagerly
                    return self.fn(*entry.static)
            self.refusals.pop(key, None)
            if self.memory is not None:
                entry.slab = self.memory.pin()        # the graph's addresses are in this slab
            self.graphs += 1
        entry.graph.launch(stream=xp.cuda.get_current_stream())
        return entry.out

    @property
    def kept(self) -> int:
        """Graphs kept now (at most :data:`MAX_GRAPHS`)."""
        return sum(e.graph is not None for e in self._entries.values())

    def release(self) -> None:
        """Drop every graph (each shape is captured again, after ``warmup`` eager calls): the step
        memory needs the room their slabs take."""
        for entry in self._entries.values():
            self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        if entry.graph is None:
            return
        entry.graph = entry.out = None
        entry.wait = self.warmup
        if entry.slab is not None:
            self.memory.unpin(entry.slab)
        entry.slab = None
        self.dropped += 1

    def _in_step(self, key):
        return self.memory.step(key) if self.memory is not None else contextlib.nullcontext()


def capture_mode(xp) -> int:
    """:data:`CAPTURE_MODE_NAME`'s value in ``xp``'s CUDA runtime."""
    return int(getattr(xp.cuda.runtime, CAPTURE_MODE_NAME, 1))


def capture_step(xp, fn, args, memory=None):
    """(graph, what fn returned) of ``fn(*args)`` captured on a stream of its own, in
    :func:`capture_mode`, inside a :class:`CaptureGuard`; :class:`CaptureError` with the reason
    where it fails or the guard refuses it."""
    main = xp.cuda.get_current_stream()
    stream = xp.cuda.Stream(non_blocking=True)
    stream.wait_event(main.record())            # the capture follows the work already queued
    guard = CaptureGuard(xp, memory)
    with stream:
        with guard:
            stream.begin_capture(mode=capture_mode(xp))
            try:
                out = fn(*args)
            except BaseException as e:
                try:                            # a GPU invalidates the capture: ending it raises too
                    stream.end_capture()
                except Exception:               # noqa: BLE001 (the cause is e, raised below)
                    pass
                raise CaptureError(f"CapturedStep: the step cannot be captured as a CUDA graph: {e}") from e
            graph = stream.end_capture()
    if guard.reasons:
        del graph, out
        raise CaptureError("CapturedStep: the capture is refused (the step runs eagerly): " + "; ".join(guard.reasons))
    return graph, out


class Refusal(NamedTuple):
    """One operation a capture would refuse: its kind ("pool allocation", "CuPy matmul",
    "cuRAND", "host sync", "host transfer"), what it was, and where attn asked for it."""
    kind: str
    what: str
    where: str


def survey(fn: Callable, xp) -> list:
    """Every operation of ``fn()`` that a capture would refuse, as :class:`Refusal` s, on the
    CuPy stand-in ``xp`` (the real CuPy raises at the first; this runs ``fn`` to its end, for
    real before the capture's effects are undone: call it where a step may be taken)."""
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:                                # current, as in a capture: cuBLAS is set to it
        stream.begin_capture(survey=True)
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return [Refusal(*r) for r in graph.refused]


def summarise(refusals: list) -> dict:
    """{kind: count} of :func:`survey`'s refusals, most frequent first."""
    return dict(Counter(r.kind for r in refusals).most_common())


class _SeedOnDevice:
    """A captured step's random numbers: dropout's kernels read its seed from ``device_seed``
    (:meth:`attn.fast.gpu.kernels.CupyOps.dropout_mask`), a buffer of the graph each call refreshes."""

    def __init__(self, buffer):
        self.device_seed = buffer


class GraphedTrainStep:
    """:func:`attn.train.train_step` for the fast engine on a GPU, each step one CUDA graph launch
    (docs/GPU.md, "The training step, captured"): the batch padded to its bucket and its ids checked
    on the host, the optimizer's step counted there (:meth:`attn.fast.training.optim.FastAdam.count_step`),
    then forward, loss, backward and Adam through a :class:`CapturedStep` with ``warmup`` eager steps
    per shape. Returns ``(loss, lr)`` as ``train_step`` does (with ``copy_loss=False`` the graph's
    loss, valid until the next call); the masks are ``train_step``'s given ``B.DeviceRNG(seed)``."""

    def __init__(self, model, opt, label_smoothing: float, clip: float = 0.0, loss_fn=None, *,
                 warmup: int = 2):
        from ..training.loss import cross_entropy
        if getattr(opt, "arena", None) is None or not hasattr(opt, "apply_step"):
            raise TypeError("GraphedTrainStep: the optimizer must be attn.fast.FastAdam over the model's arena "
                            f"(got {type(opt).__name__})")
        self.model, self.opt, self.smoothing, self.clip = model, opt, label_smoothing, clip
        self.loss_fn = loss_fn or (lambda logits, targets, eps: cross_entropy(
            logits, targets, eps, inplace=True, validate=False, check_finite=False))
        from .stepmem import StepMemory
        self.captured = CapturedStep(self._device_step, warmup=warmup, memory=StepMemory.of(model),
                                     xp=opt.arena.xp)

    def __call__(self, batch, seed: int, copy_loss: bool = True):
        from ...data import pad_to_bucket
        from ..training.loop import check_batch
        batch = pad_to_bucket(batch)
        check_batch(self.model, batch, "GraphedTrainStep")
        host_seed = B.host.array([int(seed) & (2 ** 64 - 1)], dtype=B.host.uint64)
        lr = self.opt.count_step()
        loss = self.captured(*(B.to_host(a) for a in (batch.src, batch.tgt_in, batch.tgt_out)), host_seed)
        return (loss.copy() if copy_loss else loss), lr

    def _device_step(self, src, tgt_in, tgt_out, seed):
        logits, cache = self.model.forward(src, tgt_in, _SeedOnDevice(seed))
        loss, dlogits = self.loss_fn(logits, tgt_out, self.smoothing)
        del logits
        self.model.backward(dlogits, cache)          # into the arena's gradients, which Adam reads
        del cache, dlogits
        self.opt.apply_step(self.clip)
        return loss

    @property
    def graphs(self) -> int:
        """Graphs captured so far (one per batch shape)."""
        return self.captured.graphs

    @property
    def refusals(self) -> dict:
        """{batch shape: why its capture was refused} (those shapes run eagerly)."""
        return self.captured.refusals

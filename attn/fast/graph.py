"""A step captured once as a CUDA graph and replayed: one launch from the host for all of a
step's kernels.

A training step of ``toy-bench`` is some hundreds of kernel launches, each a few microseconds of
the host's time (Python, CuPy, the driver) for a few microseconds of the GPU's: the GPU waits on
the host. A CUDA graph records the launches once, on a capturing stream, and replays them with
one call. What a graph replays is exactly what was recorded, so a step can be captured only if

* every array it reads or writes lives at the same address from one call to the next (its
  inputs are copied into buffers the graph owns; nothing is taken from CuPy's memory pool while
  the stream captures, since the pool would hand those addresses out again: what the step makes
  comes from a :class:`attn.fast.stepmem.StepMemory`, one slab at the same addresses every
  step, given as ``memory``);
* every number that changes between calls (the learning rate, the step count, dropout's key)
  is read from device memory by the kernels, never passed as a host scalar (a host scalar is
  recorded by value and replayed as it was);
* nothing in it waits for the device or copies to or from the host, and it makes no call that
  CuPy refuses during a capture (its own ``matmul``, which calls cuBLAS; ``cupy.random``).

:class:`CapturedStep` runs a function eagerly for its first ``warmup`` calls at an input shape
(real calls: a training step is taken), captures it on the next call at that shape and replays
the graph from then on, one graph per input shape. :func:`survey` lists what in a function a
capture would refuse (on the CuPy stand-in, which notes every refusal instead of raising at the
first); ``python -m attn.bench --counts`` prints it for the training step.

On NumPy there is nothing to capture: :class:`CapturedStep` calls the function.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, NamedTuple

from .. import backend as B


class CaptureError(RuntimeError):
    """A step could not be captured: the message names the operation and where it was asked for."""


class _Entry:
    """What :class:`CapturedStep` keeps for one input shape."""

    def __init__(self, static: list):
        self.static, self.calls, self.graph, self.out = static, 0, None, None


class CapturedStep:
    """``fn(*inputs)`` captured as a CUDA graph per input shape and replayed.

    ``inputs`` are device arrays, or host arrays where ``xp`` (CuPy) is given; each call copies
    them into buffers of their shape that the graph reads (a host array straight from the host:
    one transfer, no device copy after it; the caller's arrays may change or go), runs ``fn`` eagerly for the first
    ``warmup`` calls at a shape (they allocate what the step keeps and compile the kernels),
    captures it on the next and replays it from then on. Returns what ``fn`` returned: after a
    capture, the same arrays every time, refreshed by every replay (read them before the next
    call). ``capture=False`` (or NumPy inputs) calls ``fn`` every time.
    """

    def __init__(self, fn: Callable, *, warmup: int = 1, capture: bool = True, memory=None, xp=None):
        if warmup < 1:
            raise ValueError(f"CapturedStep: warmup must be at least 1 (the eager call that allocates what the "
                             f"step keeps), got {warmup}")
        self.fn, self.warmup, self.capture, self.xp = fn, int(warmup), bool(capture), xp
        #: the :class:`attn.fast.stepmem.StepMemory` every eager and captured call runs in (its
        #: slab grows after an eager call that needed more, so the capture finds it large enough)
        self.memory = memory
        self._entries: dict = {}
        #: graphs captured so far (one per input shape)
        self.graphs = 0

    def __call__(self, *inputs):
        xp = self.xp or B.get_array_module(*inputs)
        if not self.capture or xp is B.host:
            return self.fn(*inputs)
        key = tuple((a.shape, a.dtype.str) for a in inputs)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry([xp.empty(a.shape, dtype=a.dtype) for a in inputs])
        for buffer, a in zip(entry.static, inputs):           # outside the graph
            if B.is_device_array(a):
                buffer[...] = a                               # one device copy
            else:
                buffer.set(B.host.ascontiguousarray(a))       # one host-to-device transfer
        if entry.graph is None and entry.calls < self.warmup:
            entry.calls += 1
            with self._in_step():
                return self.fn(*entry.static)
        if entry.graph is None:
            with self._in_step():
                entry.graph, entry.out = _capture(xp, self.fn, entry.static)
            if self.memory is not None:
                self.memory.pin()                     # the graph's addresses are in this slab
            self.graphs += 1
        entry.graph.launch(stream=xp.cuda.get_current_stream())
        return entry.out

    def _in_step(self):
        return self.memory.step() if self.memory is not None else contextlib.nullcontext()


def _capture(xp, fn, args):
    """(graph, what fn returned) of ``fn(*args)`` captured on a stream of its own."""
    main = xp.cuda.get_current_stream()
    stream = xp.cuda.Stream(non_blocking=True)
    stream.wait_event(main.record())            # the capture follows the work already queued
    with stream:
        stream.begin_capture()
        try:
            out = fn(*args)
        except BaseException as e:
            try:                                # a GPU invalidates the capture: ending it raises too
                stream.end_capture()
            except Exception:                   # noqa: BLE001 (the cause is e, raised below)
                pass
            raise CaptureError(f"CapturedStep: the step cannot be captured as a CUDA graph: {e}") from e
        graph = stream.end_capture()
    return graph, out


class Refusal(NamedTuple):
    """One operation a capture would refuse: its kind ("pool allocation", "CuPy matmul",
    "cuRAND", "host sync", "host transfer"), what it was, and where attn asked for it."""
    kind: str
    what: str
    where: str


def survey(fn: Callable, xp) -> list:
    """Every operation of ``fn()`` that a capture would refuse, as :class:`Refusal` s, on the
    CuPy stand-in ``xp`` (the real CuPy raises at the first; this runs ``fn`` to its end).
    ``fn`` runs for real before the capture's effects are undone, so call it where a step may
    be taken."""
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


# --------------------------------------------------------------------------- the training step


class _SeedOnDevice:
    """The random numbers of a captured step: dropout's kernels read the step's seed from
    ``device_seed`` (see :meth:`attn.fast.kernels.CupyOps.dropout_mask`), a buffer of the graph
    that each call refreshes."""

    def __init__(self, buffer):
        self.device_seed = buffer


class GraphedTrainStep:
    """:func:`attn.train.train_step` for the fast engine on a GPU, each step one CUDA graph launch.

    ``step(batch, seed)`` pads the batch to its bucket (:func:`attn.data.pad_to_bucket`: a
    graph replays one shape, and a bucket's batches share one), checks its ids on the host,
    counts the optimizer's step on the host (:meth:`attn.fast.optim.FastAdam.count_step`), and
    runs forward, label-smoothed cross-entropy, backward and Adam through a
    :class:`CapturedStep`: eagerly for the first ``warmup`` batches of a shape, captured on the
    next and replayed from then on. Two eager steps by default: the first takes its memory from
    the pool and sizes the step memory's slab; the second runs in the slab, at the addresses the
    graph will keep, and so makes what the kernels keep per address (the batched products'
    pointer arrays, :meth:`attn.fast.kernels.CupyOps._gemm_pointers`), which the graph then
    reads instead of making them on every replay. What changes between steps reaches the graph through
    device memory: the batch and the dropout seed are copied into the graph's buffers, and
    Adam's step count (hence its learning rate and bias corrections) lives on the device.
    Returns ``(loss, lr)`` as ``train_step`` does: the loss a 0-d device array of its own (the
    graph's is rewritten by the next replay), or with ``copy_loss=False`` the graph's own,
    valid until the next call.

    Dropout's masks are those of ``train_step`` given ``B.DeviceRNG(seed)`` and the padded
    batch, so a run with graphs computes what the eager run on padded batches computes.
    """

    def __init__(self, model, opt, label_smoothing: float, clip: float = 0.0, loss_fn=None, *,
                 length_multiple: int = 8, row_multiple: int = 16, warmup: int = 2):
        from .loss import cross_entropy
        if getattr(opt, "arena", None) is None or not hasattr(opt, "apply_step"):
            raise TypeError("GraphedTrainStep: the optimizer must be attn.fast.FastAdam over the model's arena "
                            f"(got {type(opt).__name__})")
        self.model, self.opt, self.smoothing, self.clip = model, opt, label_smoothing, clip
        self.loss_fn = loss_fn or (lambda logits, targets, eps: cross_entropy(
            logits, targets, eps, inplace=True, validate=False, check_finite=False))
        self.length_multiple, self.row_multiple = length_multiple, row_multiple
        from .stepmem import StepMemory
        self.captured = CapturedStep(self._device_step, warmup=warmup, memory=StepMemory.of(model),
                                     xp=opt.arena.xp)

    def __call__(self, batch, seed: int, copy_loss: bool = True):
        from ..data import pad_to_bucket
        from ..layers._checks import check_ids
        cfg = self.model.config
        batch = pad_to_bucket(batch, self.length_multiple, self.row_multiple)
        for name, V in (("src", cfg.vocab_size), ("tgt_in", cfg.target_vocab_size),
                        ("tgt_out", cfg.target_vocab_size)):
            check_ids("GraphedTrainStep", f"batch.{name}", B.to_host(getattr(batch, name)), V)
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

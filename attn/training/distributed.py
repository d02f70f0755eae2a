"""Data parallelism: several processes train one model exactly as one process would.

    mpiexec -n 2 attn-train ...                  # two processes on one machine's cores
    mpiexec -n 8 attn-train --backend cupy ...   # one process per GPU, gradients over NCCL

The paper trained on eight GPUs, each batch of about 25,000 source and 25,000 target tokens
split across them (section 5.2). Here likewise ``--max-tokens`` is the *global* batch: every
rank makes the same batches from the same seed and keeps its share of each, a contiguous block
of its sentences (:meth:`MPIGroup.share`). After the backward the ranks' gradients are
**summed** (:meth:`MPIGroup.all_reduce`), and what they sum is each rank's gradient weighted by
its share of the batch's target tokens:

    loss = (1/N) sum over the N real target tokens of the batch
         = sum over ranks r of (n_r / N) * (the mean over rank r's n_r tokens)

so rank r scales its local gradient (a mean over its own tokens) by ``n_r / N`` and the sum is
the one-process gradient. Averaging the ranks' means instead (a mean all-reduce) weighs a token
of rank r by ``1 / (ranks * n_r)``, wrong whenever the ranks hold different numbers of tokens,
as they do. The loss travels in the same buffer as the gradients, and each rank's target
tokens beside it (their sum, the batch's, shows that the shares cover it): one all-reduce per step.

Dropout's random numbers are keyed by the position in the global batch, not by the rank: each
rank asks the step's random stream for the whole batch's numbers and keeps its own rows
(:class:`RowsOf`), so N ranks draw exactly what one process draws with one worker thread (the
fast path's threads draw from per-thread streams; with one BLAS thread per rank, the default,
each rank runs one). The price is that every rank generates the whole batch's masks, except
where the masks are drawn by no one: a counter-based dropout (the fast engine's on CuPy) keys each
element by its index in the global batch, which :meth:`RowsOf.place` gives it, so a rank computes its
own rows alone.

Before any work every rank's settings (the :class:`attn.training.config.TrainConfig`, but for
:data:`PER_PROCESS_FIELDS`) must equal rank 0's (:meth:`MPIGroup.check_same_settings`), and
before the first step every rank hashes its parameters and the hashes must agree
(:meth:`MPIGroup.check_same_parameters`). Rank 0 alone logs, evaluates and writes; every other
rank follows its decisions (:meth:`MPIGroup.agree`), so all stop at the same step, and an
interrupted run's checkpoint is the one a single process would have written: ``--resume``
works with any number of ranks.

**The gradient buffer is the arena.** A model with a ``gradient_arena`` (:mod:`attn.engine`; the
fast engine's, what ``attn-train`` uses) writes its gradients into one flat buffer laid out in the
order its backward finishes them (reverse layer order, last layer first), with a slot of two elements past them
for the loss and the tokens; :meth:`FlatGrads.over` all-reduces that buffer in place, in buckets
of whole stages (a layer, the cross-attention K|V block of all layers: no fused block is cut,
nothing is copied either way). The backward announces each stage as it finishes it
(``backward(..., ready=)``), and a bucket goes out as soon as its last stage is
announced, while the backward computes the layers before it (:class:`BucketFeed`, as PyTorch's
DDP does). The readable reference model's gradients are separate arrays: :class:`FlatGrads`
packs them into a buffer of its own in the same order, each bucket as soon as the backward
(which fills a ``grads`` dict it is given) is past it.
The transports: NumPy arrays go through MPI (mpi4py) in place, bucket by bucket with
non-blocking all-reduces; CuPy arrays through NCCL (``cupy.cuda.nccl``, its unique id made by
rank 0 and broadcast over MPI, as llm.c does), or through MPI staged via the host where NCCL
is absent (``ATTN_ALLREDUCE=mpi`` forces that).

One process (no ``mpiexec``, or ``mpiexec -n 1``) never imports mpi4py: :func:`group` returns
:class:`Single`, whose methods change nothing.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time

from .. import backend as B
from ..data import Batch
from .. import engine as engines
from ..engine import LOSS, SLOT, TOKENS
from ..masks import PAD_ID

#: Environment variables that MPI launchers set to the number of processes started.
LAUNCHER_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
#: Threads variables that, when any is set, leave the BLAS threads as the user asked.
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: Bytes per all-reduce bucket (PyTorch's DDP uses 25 MB).
BUCKET_BYTES = 25 * 2 ** 20
#: The settings the processes of one run may hold apart: they change no number (only rank 0 writes
#: into its ``out`` and draws a progress bar). Every other setting must be the same on every rank.
PER_PROCESS_FIELDS = ("out", "quiet")


class DistributedError(RuntimeError):
    """The processes of a data-parallel run disagree, or MPI/NCCL cannot be used."""


def launched_size() -> int:
    """How many processes the MPI launcher started (1 when none did)."""
    for name in LAUNCHER_SIZE:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def group():
    """The data-parallel group of this process: :class:`Single` for one process, else an
    :class:`MPIGroup` over ``MPI.COMM_WORLD`` (mpi4py is imported only then)."""
    if launched_size() <= 1:
        return Single()
    try:
        from mpi4py import MPI
    except ImportError:
        raise DistributedError(f"attn-train was started by an MPI launcher with {launched_size()} processes, "
                               "but mpi4py is not installed: pip install 'attn[mpi]'") from None
    return MPIGroup(MPI.COMM_WORLD)


# --------------------------------------------------------------------------- one process

class Single:
    """One process: its share is the whole batch, and nothing needs agreeing on."""
    size, rank, master, transport = 1, 0, True, "none"

    def use_backend(self, transport: str | None = None) -> None:
        pass

    def share(self, batch: Batch, rng=None, model=None):
        return batch, rng, 1.0

    def all_reduce(self, loss, grads: dict, weight: float):
        return loss, grads

    def backward(self, model, dlogits, cache, loss, weight: float):
        return loss, model.backward(dlogits, cache)

    def broadcast(self, value):
        return value

    def agree(self, stop_reason, interrupted: bool):
        return stop_reason

    def barrier(self) -> None:
        pass

    def check_same_parameters(self, params: dict) -> None:
        pass

    def check_same_settings(self, settings: dict) -> None:
        pass

    def say(self, message: str) -> None:
        print(message, file=sys.stderr)

    def abort(self, code: int) -> None:
        pass


# --------------------------------------------------------------------------- several

def rows_of(n_rows: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous block ``[lo, hi)`` of ``n_rows`` sentences split ``size`` ways."""
    return n_rows * rank // size, n_rows * (rank + 1) // size


def share_of(batch: Batch, size: int, rank: int):
    """Rank ``rank``'s sentences of ``batch`` (padded to the batch's lengths, so every array has
    the shape one process would cut them from) and its weight, its real target tokens over the
    batch's. A rank left with no sentence (a batch of fewer sentences than ranks) gets a copy of
    the first with weight 0: it computes a gradient that counts for nothing.

    Returns (the share as a :class:`attn.data.Batch`, its first row in the batch, the rows of the
    batch, the weight)."""
    n = batch.src.shape[0]
    lo, hi = rows_of(n, size, rank)
    weight_zero = hi == lo
    if weight_zero:
        lo, hi = 0, 1
    np = B.host
    src, tgt_in, tgt_out = (np.ascontiguousarray(a[lo:hi]) for a in (batch.src, batch.tgt_in, batch.tgt_out))
    n_tgt = int(np.count_nonzero(tgt_out != PAD_ID))
    mine = Batch(src, tgt_in, tgt_out, int(np.count_nonzero(src != PAD_ID)), n_tgt)
    weight = 0.0 if weight_zero else n_tgt / max(batch.n_tgt_tokens, 1)
    return mine, lo, n, weight


class RowsOf:
    """The random numbers one process would draw for a whole batch, this share's sentences of them.

    Every draw the models make for dropout has one axis of sentences: the first for arrays of
    the batch's sentences (B, ...), positions (B*T, ...) or heads (B, H, ...), the second for
    attention weights a model keeps keys-first (Tk, B, H, Tq): its ``keys_first``. Asked for an
    array whose sentence axis is ``k`` times this share's ``hi - lo`` sentences, this draws the
    array for all ``rows`` sentences from the step's stream, as one process would, and
    returns this share's part of that axis, ``[lo*k, hi*k)``. ``keys_first`` says which
    layout 4-D draws have (the model's ``keys_first``, :mod:`attn.engine`).

    A counter-based generator draws nothing: it asks :meth:`place` where this share's
    elements sit in the whole batch's array, and keys each element by that index (the fast engine's
    CuPy dropout, ``dropout_hash``), so this share gets its rows of one process's masks without
    making the others'."""

    def __init__(self, rng, lo: int, hi: int, rows: int, keys_first: bool = False):
        self.rng, self.lo, self.hi, self.rows, self.keys_first = rng, lo, hi, rows, keys_first
        self.seed = rng.seed

    def place(self, shape) -> tuple:
        """Where this share's array of ``shape`` (C order) sits in the whole batch's: ``(base,
        run, skip)``, its element i being the whole's ``base + i + (i // run) * skip``. The
        share's sentences hold ``C`` elements each below the sentence axis, so its elements
        come in runs of ``run = n * C`` (one run when the sentence axis is the first), the
        first at ``base = lo * C``, each ``skip = (rows - n) * C`` before the next."""
        whole, _ = self._whole(shape)
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        axis = 1 if self.keys_first and len(shape) == 4 else 0
        per_sentence = 1
        for s in shape[axis:]:
            per_sentence *= int(s)
        n = self.hi - self.lo
        C = per_sentence // n
        return self.lo * C, n * C, (0 if axis == 0 else (self.rows - n) * C)

    def _whole(self, shape):
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        axis = 1 if self.keys_first and len(shape) == 4 else 0
        n = self.hi - self.lo
        if len(shape) <= axis or shape[axis] % n:
            raise DistributedError(f"dropout drew an array of shape {shape}, whose sentence axis ({axis}) is not "
                                   f"a multiple of this rank's {n} sentences: it cannot be cut from the whole "
                                   "batch's draw")
        k = shape[axis] // n
        whole = shape[:axis] + (self.rows * k,) + shape[axis + 1:]
        return whole, (slice(None),) * axis + (slice(self.lo * k, self.hi * k),)

    def random(self, shape, dtype="float32"):
        whole, mine = self._whole(shape)
        return self.rng.random(whole, dtype)[mine]

    def random_uint16(self, shape):
        whole, mine = self._whole(shape)
        return self.rng.random_uint16(whole)[mine]


def reverse_layer_order(names) -> list[str]:
    """Parameter names in the order the backward finishes their gradients: the last layer's
    first, the tied embedding (whose gradient is complete only at the very end) last."""
    return list(reversed(list(names)))


class FlatGrads:
    """The gradients of every parameter in one contiguous buffer, then a slot of two for the
    loss and the target tokens: one all-reduce carries everything a step sums.

    :attr:`flat` holds the gradients in the order the backward finishes them (reverse layer
    order) and, in its last two elements, the loss and the token count; :attr:`views` are the
    parameters' gradients as views of it (what goes to the optimizer after the all-reduce).
    :attr:`buckets` are ``(start, stop)`` slices of about :data:`BUCKET_BYTES` in that order,
    the last one holding the slot; :attr:`bucket_names` the parameters of each (the arena's
    stages for :meth:`over`). ``pack_bucket(i, grads, weight)`` makes bucket ``i`` hold
    ``weight * grads``, ``pack_loss(loss, weight, tokens)`` fills the slot.

    Two kinds: ``FlatGrads(params)`` owns its buffer, and packing copies a ``grads`` dict into
    it (the reference model's gradients are separate arrays); ``FlatGrads.over(arena)`` *is*
    a model's gradient arena, which the backward has written in that order already, so
    packing scales it in place and nothing is copied either way.
    """

    def __init__(self, params: dict, bucket_bytes: int = BUCKET_BYTES):
        first = next(iter(params.values()))
        xp = B.get_array_module(first)
        self.names = reverse_layer_order(params)
        self.offsets, total = {}, 0
        for k in self.names:
            self.offsets[k] = total
            total += params[k].size
        self.size = total
        self.flat = xp.zeros(total + SLOT, dtype=first.dtype)                   # (P + 2,)
        self.views = {k: self.flat[o:o + params[k].size].reshape(params[k].shape) for k, o in self.offsets.items()}
        self.buckets, self.bucket_names, start, names = [], [], 0, []
        for k in self.names:
            end = self.offsets[k] + params[k].size
            names.append(k)
            if (end - start) * first.dtype.itemsize >= bucket_bytes:
                self.buckets.append((start, end))
                self.bucket_names.append(names)
                start, names = end, []
        self.buckets.append((start, total + SLOT))                               # the loss travels last
        self.bucket_names.append(names)
        self.arena = None

    @classmethod
    def over(cls, arena, bucket_bytes: int = BUCKET_BYTES) -> "FlatGrads":
        """The :class:`FlatGrads` that is a model's gradient arena (:mod:`attn.engine`): its
        ``grad_buffer`` (the gradients in the order the backward finishes them, then the
        slot) all-reduced in place, in buckets of whole stages of ``arena.layout.stages``
        (a layer, the cross-attention K|V block of all layers, ...: nothing is cut out of a
        fused block), so that a bucket goes out as soon as the backward announces its last
        stage (``backward(..., ready=)``)."""
        self = cls.__new__(cls)
        self.arena, self.size = arena, arena.size
        self.flat, self.views = arena.grad_buffer, arena.grad_views
        self.names = list(arena.layout.stages)                   # stages (in the buffer's order), not parameters
        self.offsets = {}
        itemsize = arena.dtype.itemsize
        self.buckets, self.bucket_names, start, names = [], [], 0, []
        for stage, (_, stop) in arena.layout.stages.items():
            names.append(stage)
            if (stop - start) * itemsize >= bucket_bytes:
                self.buckets.append((start, stop))
                self.bucket_names.append(names)
                start, names = stop, []
        self.buckets.append((start, self.size + SLOT))
        self.bucket_names.append(names)
        return self

    @property
    def nbytes(self) -> int:
        return int(self.flat.size * self.flat.dtype.itemsize)

    def pack_bucket(self, i: int, grads: dict, weight: float) -> None:
        w = self.flat.dtype.type(weight)
        if self.arena is not None:                  # the gradients are there already: scale them
            start, stop = self.buckets[i]
            self.flat[start:min(stop, self.size)] *= w
            return
        xp = B.get_array_module(self.flat)
        missing = [k for k in self.bucket_names[i] if k not in grads]
        if missing:
            raise KeyError(f"all_reduce: no gradient for {missing[:5]}")
        for k in self.bucket_names[i]:
            xp.multiply(grads[k], w, out=self.views[k])

    def pack_loss(self, loss, weight: float, tokens: int = 0) -> None:
        """The slot: ``weight * loss`` and this rank's target tokens (summed: the batch's)."""
        self.flat[self.size + LOSS:self.size + LOSS + 1] = loss.reshape(1) * self.flat.dtype.type(weight)
        self.flat[self.size + TOKENS:self.size + TOKENS + 1] = tokens

    def loss(self):
        """The summed loss, a 0-d array of its own (the buffer is reused next step)."""
        return self.flat[self.size + LOSS:self.size + LOSS + 1].copy().reshape(())

    def tokens(self):
        """The summed target tokens (a 0-d array of its own): the global batch's, when every
        rank put its own (a check that the shares cover the batch once, with no host sync)."""
        return self.flat[self.size + TOKENS:self.size + TOKENS + 1].copy().reshape(())


class BucketFeed(dict):
    """What a backward fills as it goes, which all-reduces each bucket of a :class:`FlatGrads`
    as soon as the backward is past it, while the backward computes the layers before it (the
    backward finishes the layers in reverse order, the buckets' order). The last bucket (the
    embeddings, and the slot with the loss) goes when the backward has returned:
    :meth:`MPIGroup.backward` sends it.

    Two ways to be told: a backward with a gradient arena calls :meth:`ready` with its end of what
    is final; a backward that fills a ``grads`` dict it is given (the reference model) is given
    this dict, and when a gradient of a later bucket arrives and every gradient of an earlier
    bucket is there, that bucket is final."""

    def __init__(self, group: "MPIGroup", fg: FlatGrads, weight: float):
        super().__init__()
        self.group, self.fg, self.weight = group, fg, weight
        self.bucket_of = {k: i for i, names in enumerate(fg.bucket_names) for k in names}
        self.launched = 0                    # buckets sent so far (in order)
        self.launched_during_backward = 0

    def ready(self, stop: int) -> None:
        """``fg.flat[:stop]`` is final: send every bucket that ends there or before (the last
        bucket waits for the loss)."""
        last = len(self.fg.buckets) - 1
        while self.launched < last and self.fg.buckets[self.launched][1] <= stop:
            self._send()
        self.launched_during_backward = self.launched

    def __setitem__(self, name, g):
        super().__setitem__(name, g)
        reached = self.bucket_of.get(name, 0)
        last = len(self.fg.buckets) - 1
        while (self.launched < min(reached, last)
               and all(k in self for k in self.fg.bucket_names[self.launched])):
            self._send()
        self.launched_during_backward = self.launched

    def _send(self) -> None:
        self.fg.pack_bucket(self.launched, self, self.weight)
        self.group._launch(self.launched)
        self.launched += 1


def settings_apart(settings: list[dict], ignore=PER_PROCESS_FIELDS) -> str | None:
    """Where the ranks' settings (``TrainConfig.to_dict()``, rank 0's first) differ from rank 0's,
    in words naming each field and both values, or None when they agree (``ignore`` aside)."""
    apart = []
    for rank, mine in enumerate(settings[1:], start=1):
        fields = sorted(k for k in set(mine) | set(settings[0])
                        if k not in ignore and mine.get(k) != settings[0].get(k))
        if fields:
            apart.append(f"rank {rank} has " + ", ".join(
                f"{k} {mine.get(k)!r} (rank 0: {settings[0].get(k)!r})" for k in fields))
    if not apart:
        return None
    return ("the processes were started with different settings, which would train together in silence: "
            + "; ".join(apart) + ": start every process with the same flags")


def parameter_digest(params: dict) -> str:
    """SHA-256 of every parameter's name, shape, dtype and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        a = B.to_host(params[name])
        h.update(f"{name}{a.shape}{a.dtype}".encode())
        h.update(B.host.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class MPIGroup(Single):
    """Ranks ``0 .. size-1`` of an MPI communicator training one model (see the module docstring)."""

    def __init__(self, comm):
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.master = self.rank == 0
        self.transport = "mpi"
        self.bucket_bytes = BUCKET_BYTES
        self._flat = None
        self._nccl = None
        self._stream = None
        self._requests = []
        self.tokens = 0                       # this rank's target tokens in the step's batch (share)
        self.summed_tokens = None             # every rank's, summed by the last all-reduce (0-d array)
        self.comm_seconds = 0.0               # host seconds in the all-reduce calls, waiting included
        self.timing = False                   # True: wait for NCCL at the end of each all-reduce (to time it)
        self.launched_during_backward = 0     # buckets the last backward sent before it returned
        if not any(os.environ.get(v) for v in THREAD_VARIABLES):
            B.blas_threads(1)               # one core per rank: a rank's BLAS threads would fight the others

    def use_backend(self, transport: str | None = None) -> None:
        """After the backend is chosen: on CuPy, this rank's GPU (its rank among the ranks of its
        machine) and the transport, ``transport`` or ``$ATTN_ALLREDUCE`` (auto: NCCL where CuPy
        has it, else MPI staged through the host; mpi; nccl)."""
        self._flat, self._stream = None, None
        self.transport = "mpi"
        if B.get_backend() != "cupy":
            return
        cp = B.xp()
        local = self.comm.Split_type(_mpi().COMM_TYPE_SHARED).Get_rank()
        n_gpus = cp.cuda.runtime.getDeviceCount()
        cp.cuda.Device(local % max(n_gpus, 1)).use()
        choice = transport or os.environ.get("ATTN_ALLREDUCE", "auto")
        if choice not in ("auto", "mpi", "nccl"):
            raise DistributedError(f"ATTN_ALLREDUCE must be auto, mpi or nccl, got {choice!r}")
        nccl = getattr(cp.cuda, "nccl", None)
        if choice == "nccl" and nccl is None:
            raise DistributedError("ATTN_ALLREDUCE=nccl, but this CuPy has no cupy.cuda.nccl "
                                   "(pip install nvidia-nccl-cu12)")
        if choice != "mpi" and nccl is not None:
            uid = nccl.get_unique_id() if self.master else None
            uid = self.comm.bcast(uid, root=0)                 # the NCCL bootstrap travels over MPI
            self._nccl = nccl.NcclCommunicator(self.size, uid, self.rank)
            self.transport = "nccl"
        else:
            self.transport = "mpi-staged"

    def share(self, batch: Batch, rng=None, model=None):
        """This rank's sentences of the global ``batch``, the random numbers one process would
        draw for them (for ``model``'s layout of them), and their weight (their target tokens
        over the batch's)."""
        mine, lo, rows, weight = share_of(batch, self.size, self.rank)
        self.tokens = mine.n_tgt_tokens if weight else 0
        if rng is not None:
            rng = RowsOf(rng, lo, lo + mine.src.shape[0], rows, keys_first=engines.keys_first(model))
        return mine, rng, weight

    def flat_grads(self, params: dict, arena=None) -> FlatGrads:
        """The reused gradient buffer (made at the first step): ``arena``'s own (a model's
        ``gradient_arena``) when given, else one of :class:`FlatGrads`'s own."""
        if self._flat is None or self._flat.arena is not arena:
            self._flat = FlatGrads(params, self.bucket_bytes) if arena is None else \
                FlatGrads.over(arena, self.bucket_bytes)
        return self._flat

    def all_reduce(self, loss, grads: dict, weight: float):
        """The sum over ranks of ``weight * (loss, grads)``: the one-process loss and gradients
        of the whole batch. Returns (loss, grads as views of the reused buffer)."""
        fg = self.flat_grads(grads)
        for i in range(len(fg.buckets)):
            fg.pack_bucket(i, grads, weight)
        fg.pack_loss(loss, weight, self.tokens)
        for i in range(len(fg.buckets)):
            self._launch(i)
        return self._finish()

    def backward(self, model, dlogits, cache, loss, weight: float):
        """``model.backward`` with the all-reduce of :meth:`all_reduce` overlapped: each bucket
        is sent as soon as the backward is past it (:class:`BucketFeed`). A model with a
        ``gradient_arena`` (:mod:`attn.engine`) announces its stages as it finishes them
        (``ready``), and the arena is all-reduced in place; the reference
        :class:`attn.model.Transformer` fills a ``grads`` dict it is given. Returns (loss, grads)
        as :meth:`all_reduce` does (with an arena, the arena's own views)."""
        arena = engines.gradient_arena(model)
        fg = self.flat_grads(model.params, arena)
        feed = BucketFeed(self, fg, weight)
        if arena is not None:
            model.backward(dlogits, cache, ready=feed.ready)
        else:
            model.backward(dlogits, cache, grads=feed)
        self.launched_during_backward = feed.launched_during_backward
        fg.pack_loss(loss, weight, self.tokens)
        for i in range(feed.launched, len(fg.buckets)):
            fg.pack_bucket(i, feed, weight)
            self._launch(i)
        return self._finish()

    def _launch(self, i: int) -> None:
        """Start the all-reduce of bucket ``i`` (packed): NCCL on a stream of its own that waits
        for the computation so far; MPI non-blocking; staged through the host: at the end."""
        fg = self._flat
        t0 = time.perf_counter()
        start, stop = fg.buckets[i]
        part = fg.flat[start:stop]
        if self.transport == "nccl":
            cp = B.xp()
            nccl = cp.cuda.nccl
            if self._stream is None:
                self._stream = cp.cuda.Stream(non_blocking=True)
            ready = cp.cuda.Event()
            ready.record(cp.cuda.get_current_stream())      # the bucket's gradients are packed
            self._stream.wait_event(ready)
            kind = {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}[str(part.dtype)]
            self._nccl.allReduce(part.data.ptr, part.data.ptr, part.size, kind, nccl.NCCL_SUM, self._stream.ptr)
        elif self.transport == "mpi":
            MPI = _mpi()
            self._requests.append(self.comm.Iallreduce(MPI.IN_PLACE, part, op=MPI.SUM))
        self.comm_seconds += time.perf_counter() - t0

    def _finish(self):
        """Wait for every bucket; returns (loss, gradient views)."""
        fg = self._flat
        t0 = time.perf_counter()
        if self.transport == "nccl":
            cp = B.xp()
            done = cp.cuda.Event()
            done.record(self._stream)
            cp.cuda.get_current_stream().wait_event(done)   # Adam waits for the sums; the host does not
            if self.timing:
                done.synchronize()
        elif self.transport == "mpi-staged":
            host = B.to_host(fg.flat)               # one copy to the host and one back: no CUDA-aware MPI needed
            self.comm.Allreduce(_mpi().IN_PLACE, host, op=_mpi().SUM)
            fg.flat[...] = B.to_device(host)
        else:
            _mpi().Request.Waitall(self._requests)
            self._requests = []
        self.comm_seconds += time.perf_counter() - t0
        self.summed_tokens = fg.tokens()
        return fg.loss(), fg.views

    def broadcast(self, value):
        return self.comm.bcast(value, root=0)

    def agree(self, stop_reason, interrupted: bool):
        """Rank 0's decision to stop (its clock, its step count), or "interrupted" if any rank
        was interrupted: every rank leaves the loop at the same step."""
        decisions = self.comm.allgather((stop_reason, bool(interrupted)))
        reason = decisions[0][0]
        if reason is None and any(flag for _, flag in decisions):
            reason = "interrupted"
        return reason

    def barrier(self) -> None:
        self.comm.Barrier()

    def check_same_parameters(self, params: dict) -> str:
        """Every rank's parameters hash the same, or a :class:`DistributedError` naming the ranks."""
        digest = parameter_digest(params)
        digests = self.comm.allgather(digest)
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        if odd:
            raise DistributedError(f"the parameters of rank(s) {odd} differ from rank 0's before the first step "
                                   "(same seed, same code and same checkpoint on every rank?)")
        return digest

    def check_same_settings(self, settings: dict) -> None:
        """Every rank's settings equal rank 0's (:func:`settings_apart`), or a :class:`DistributedError`
        naming the ranks, the fields and their values."""
        problem = settings_apart(self.comm.allgather(settings))
        if problem:
            raise DistributedError(problem)

    def say(self, message: str) -> None:
        if self.master:
            print(message, file=sys.stderr)

    def abort(self, code: int) -> None:
        """End every rank (one rank's error would leave the others waiting at the next all-reduce)."""
        self.comm.Abort(code)


def _mpi():
    from mpi4py import MPI
    return MPI

"""The measurements as callables: our fast and readable training steps, forward passes and
decodes, and PyTorch's twins of each, built once per run."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

from .. import backend as B
from ..fast import cross_entropy as fast_cross_entropy
from ..fast.engine import FastEngine
from ..fast.gpu.stepmem import StepMemory
from ..loss import cross_entropy
from ..masks import PAD_ID
from ..model import Transformer
from ..optim import Adam, noam_lr
from ..precision import Precision
from .flops import gemm_replay, model_flops
from .presets import BOS_ID, EOS_ID, BenchConfig, decode_batch, make_batch, model_config
from .twin import _torch_decode, match_precision, torch_adam, torch_autocast, torch_loss, torch_transformer

#: The engine measured against PyTorch (:mod:`attn.engine`).
FAST = FastEngine()


def _no_eos(model: Transformer) -> Transformer:
    """The same model (shared parameters) whose projection never lets EOS win, so that a
    decoding benchmark generates exactly the asked-for number of tokens."""
    base = type(model)

    class NoEOS(base):
        def project(self, h, out=None):          # out=: a decoding step's logits buffer (attn.fast on CuPy)
            out = super().project(h) if out is None else super().project(h, out=out)
            out[..., EOS_ID] = self.xp.finfo(out.dtype).min
            return out

    return NoEOS(model.config, dtype=model.dtype, params=model.params)


@dataclass
class Work:
    """One measurement: our callable, PyTorch's (or None), and how to count it."""
    name: str
    ours: object
    torch: object = None
    tokens: int = 0
    flops: int = 0
    repeats: int = 5
    warmup: int = 2
    extra: dict = field(default_factory=dict)
    replay: object = None           # the step's matmuls alone, timed in the same rotation
    phases: dict = field(default_factory=dict)     # side -> a step timed by phase (see phase_timer)


def _marker(where: str):
    """(mark, between, wait) for a phase timer: ``mark()`` records the moment, ``wait(last)``
    waits until the last mark has passed, and then ``between(a, b)`` gives the seconds between
    two marks.

    On the CPU a mark is ``time.perf_counter()``. On a GPU the host only issues work, so a mark
    is a CUDA event recorded on the stream (``cupy.cuda.Event``, or ``torch.cuda.Event`` for
    PyTorch's side): the times are the device's, and the only wait is for the last event."""
    if where == "cupy":
        cp = B.xp()

        def mark():
            ev = cp.cuda.Event()
            ev.record()
            return ev

        def between(a, b):
            return cp.cuda.get_elapsed_time(a, b) / 1e3
        return mark, between, lambda last: last.synchronize()
    if where == "torch":
        import torch

        def mark():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def between(a, b):
            return a.elapsed_time(b) / 1e3
        return mark, between, lambda last: last.synchronize()
    return time.perf_counter, lambda a, b: b - a, lambda last: None


def phase_timer(step, where: str = "numpy"):
    """A callable that runs ``step(clock)`` once and returns {phase: seconds} in order: ``clock(name)``
    marks the start of a phase, which lasts until the next mark (the last until ``step`` returns).
    ``where`` says how a moment is taken (see :func:`_marker`): ``"numpy"`` (the host clock),
    ``"cupy"`` or ``"torch"`` (CUDA events, for work on a GPU)."""
    mark, between, wait = _marker(where)

    def run():
        marks = []

        def clock(name):
            marks.append((name, mark()))
        step(clock)
        marks.append(("", mark()))
        wait(marks[-1][1])
        out = {}
        for (name, t0), (_, t1) in zip(marks, marks[1:]):
            out[name] = out.get(name, 0.0) + between(t0, t1)
        return out
    run.where = where
    return run


def _no_clock(name):
    pass


def build_work(bc: BenchConfig, which, backend: str, with_torch: bool, sync, torch_sync=None,
               device="cpu", repeats=None, warmup=None, with_ours: bool = True, precision: str | None = None):
    """The measurements as :class:`Work` items (model, optimizer and batch built once).

    ``precision`` (``--precision``, :mod:`attn.precision`) is the fast engine's, and PyTorch runs at
    the same (:func:`attn.bench.twin.match_precision`; None: fp32, PyTorch at CuPy's own, which
    ``CUPY_TF32=1`` makes tf32); the readable model multiplies in float32. Decoding is timed at
    float32 on both sides.

    ``with_ours=False`` (the PyTorch worker) builds PyTorch's side alone: attn's models, and the
    matmul replay (drawn lazily in any case, see :func:`attn.bench.flops.gemm_replay`), are then
    never built, and each item's ``ours`` is None. attn's readable model is built only where
    ``train_step_reference`` or ``forward_reference`` is measured."""
    s = _setup(bc, which, backend, with_torch, sync, torch_sync, device, repeats, warmup, with_ours, precision)
    decoders = [w for w in which if w.startswith(("greedy", "beam"))]
    work = _training(s, which) + _forwards(s, which) + (_decoding(s, decoders, repeats) if decoders else [])
    return _inject_failure(work)


@dataclass
class _Setup:
    """What the measurements of one run share, built once by :func:`_setup`: the benchmark's
    config and the model's, the batch (on the host and the device) and its tokens, the runs and
    warm-ups of each measurement (``R``, ``W``), how to wait for each side's device, attn's models
    (``fast``; ``ref``, the readable one, where measured) with their optimizers and generators in
    ``state``, and PyTorch's side (``torch``, the module; ``tmodel``, its optimizer ``topt``, the
    batch as tensors ``tbatch``). ``precision`` is PyTorch's, as :func:`match_precision` set it."""
    bc: BenchConfig
    cfg: object
    backend: str
    device: str
    sync: object
    torch_sync: object
    R: int
    W: int
    with_ours: bool
    with_torch: bool
    precision: str | None
    host: tuple                     # (src, tgt_in, tgt_out) as NumPy arrays
    batch: tuple                    # the same on the device
    n_tokens: int
    fast: object = None
    ref: object = None
    memory: object = None
    state: dict = field(default_factory=dict)
    torch: object = None
    tmodel: object = None
    topt: object = None
    adam_kind: str = ""
    autocast: object = None
    tbatch: tuple = ()

    @property
    def on_gpu(self) -> bool:
        return self.backend == "cupy"


def _setup(bc: BenchConfig, which, backend: str, with_torch: bool, sync, torch_sync, device, repeats, warmup,
           with_ours: bool, precision: str | None) -> _Setup:
    """The models, optimizers and batch every measurement of :func:`build_work` shares."""
    host = make_batch(bc)
    src_h, _, tgt_out_h = host
    s = _Setup(bc, model_config(bc), backend, device, sync, torch_sync, repeats or bc.repeats,
               bc.warmup if warmup is None else warmup, with_ours, with_torch, precision, host,
               tuple(B.to_device(a) for a in host), int((src_h != PAD_ID).sum() + (tgt_out_h != PAD_ID).sum()))
    if with_ours:
        _build_ours(s, any(w in which for w in ("train_step_reference", "forward_reference")))
    if with_torch:
        import torch
        s.torch = torch
        s.precision = match_precision(torch, precision)       # PyTorch's products at attn's precision
        s.autocast = torch_autocast(torch, s.precision, device)
        s.tmodel = torch_transformer(s.cfg, device)
        s.topt, s.adam_kind = torch_adam(s.tmodel)
        s.tbatch = tuple(torch.as_tensor(a, device=device) for a in host)
    s.state = {"fast_opt": FAST.optimizer(s.fast) if with_ours else None,
               "ref_opt": Adam(s.ref.params, s.cfg.d_model, s.cfg.warmup_steps) if s.ref is not None else None,
               "fast_rng": B.DeviceRNG(1), "ref_rng": B.DeviceRNG(1)}
    # On CuPy every array the step makes comes from the model's step memory (one slab, the same
    # addresses every step: attn.fast.gpu.stepmem), as in attn-train; the loss returned lives there
    # until the next step begins.
    s.memory = StepMemory.of(s.fast) if with_ours else None
    return s


def _build_ours(s: _Setup, wants_ref: bool) -> None:
    """attn's fast model (at ``s.precision``) and, where ``wants_ref``, its readable one."""
    s.ref = Transformer(s.cfg, seed=0) if wants_ref else None
    # On a GPU the batch is checked once here; inside the timed step nothing waits for the device.
    s.fast = FAST.model(s.cfg, seed=0, precision=Precision.of(s.precision or "fp32"), check_ids=not s.on_gpu)
    if s.on_gpu:
        from ..layers import check_ids
        for a in s.batch:
            check_ids("bench", "batch", a, s.cfg.vocab_size)


def _fast_step(s: _Setup):
    """attn's fast training step, timed by phase when given a clock (:func:`phase_timer`)."""
    fast, (src, tgt_in, tgt_out), state = s.fast, s.batch, s.state
    in_step = s.memory.step if s.memory is not None else contextlib.nullcontext

    def fast_step(clock=_no_clock):
        fast.phase_clock = None if clock is _no_clock else clock
        try:
            with in_step():
                logits, cache = fast.forward(src, tgt_in, state["fast_rng"])
                clock("loss")
                loss, d = fast_cross_entropy(logits, tgt_out, s.cfg.label_smoothing, check_finite=False,
                                             inplace=True, validate=not s.on_gpu)
                grads = fast.backward(d, cache)
                clock("optimizer")
                state["fast_opt"].step(grads)
                del logits, cache, d, grads
            s.sync()
        finally:
            fast.phase_clock = None
        return loss
    fast_step.step_memory = s.memory
    return fast_step


def _ref_step(s: _Setup):
    """attn's readable training step."""
    src, tgt_in, tgt_out = s.batch

    def ref_step():
        logits, cache = s.ref.forward(src, tgt_in, s.state["ref_rng"])
        loss, d = cross_entropy(logits, tgt_out, s.cfg.label_smoothing, check_finite=False)
        s.state["ref_opt"].step(s.ref.backward(d, cache))
        s.sync()
        return loss
    return ref_step


def _torch_step(s: _Setup):
    """PyTorch's training step, timed by phase when given a clock (:func:`phase_timer`)."""
    tmodel, topt, cfg, state = s.tmodel, s.topt, s.cfg, s.state
    t_src, t_in, t_out = s.tbatch

    def torch_step(clock=_no_clock):
        tmodel.train()
        with s.autocast:
            if clock is _no_clock:
                logits = tmodel(t_src, t_in)
            else:                                # the same calls as tmodel.forward, phase by phase
                clock("forward: embeddings, encoder")
                memory, src_mask = tmodel.encode(t_src)
                clock("forward: decoder")
                h = tmodel.decode(t_in, memory, src_mask)
                clock("forward: output projection")
                logits = tmodel.project(h)
            clock("loss")
            loss = torch_loss(logits, t_out, cfg.label_smoothing)
        clock("backward (autograd, all layers)")
        topt.zero_grad(set_to_none=True)
        loss.backward()
        clock("optimizer")
        for g in topt.param_groups:
            g["lr"] = noam_lr(state.setdefault("torch_t", 1), cfg.d_model, cfg.warmup_steps)
        state["torch_t"] += 1
        topt.step()
        s.torch_sync()
        return loss
    return torch_step


def _training(s: _Setup, which) -> list:
    """The training steps measured: attn's fast step (by phase too), the same captured as a CUDA
    graph (on a GPU), and the readable step; each against PyTorch's step."""
    bc, cfg, R, W = s.bc, s.cfg, s.R, s.W
    fast_step = _fast_step(s) if s.with_ours else None
    torch_step = _torch_step(s) if s.with_torch else None
    flops = model_flops(cfg, bc.batch, bc.src_len, bc.tgt_len, True)
    extra = {"torch_adam": s.adam_kind, "torch_precision": s.precision} if s.with_torch else {}
    work = []
    if "train_step" in which:
        replay = gemm_replay(cfg, bc.batch, bc.src_len, bc.tgt_len, B.xp(), s.sync, True) if s.with_ours else None
        phases = {"ours": phase_timer(fast_step, s.backend)} if s.with_ours else {}
        if s.with_torch:
            phases["torch"] = phase_timer(torch_step, "torch" if s.device != "cpu" else "numpy")
        work.append(Work("train_step", fast_step, torch_step, s.n_tokens, flops, R, W, dict(extra), replay, phases))
    if "train_step_graph" in which and s.on_gpu:
        work.append(Work("train_step_graph", _graph_step(s) if s.with_ours else None, torch_step, s.n_tokens,
                         flops, R, max(W, 3), dict(extra)))    # two eager calls and the capture: untimed
    if "train_step_reference" in which:
        work.append(Work("train_step_reference", _ref_step(s) if s.with_ours else None, torch_step, s.n_tokens,
                         flops, max(2, R // 2), max(1, W // 2), dict(extra)))
    return work


def _graph_step(s: _Setup):
    """The fast step captured as a CUDA graph and replayed (attn-train --cuda-graph), as the
    trainer runs it: the batch sent from the host and its ids checked there every step."""
    from ..data import Batch
    src_h, tgt_in_h, tgt_out_h = s.host
    gfast = FAST.model(s.cfg, seed=0, precision=Precision.of(s.precision or "fp32"), check_ids=False)
    graphed = FAST.captured_step(gfast, FAST.optimizer(gfast), s.cfg.label_smoothing, 0.0, FAST.loss(trusted=True))
    gbatch = Batch(src_h, tgt_in_h, tgt_out_h, int((src_h != PAD_ID).sum()), int((tgt_out_h != PAD_ID).sum()))

    def graph_step():
        loss = graphed(gbatch, 1)[0]
        s.sync()
        return loss
    return graph_step


def _forwards(s: _Setup, which) -> list:
    """The forward passes measured (logits of the batch, no gradient): the fast model's and the
    readable one's, each against PyTorch's."""
    bc, cfg, R, W = s.bc, s.cfg, s.R, s.W
    src, tgt_in, _ = s.batch
    flops = model_flops(cfg, bc.batch, bc.src_len, bc.tgt_len, False)

    def timed(forward):
        def f():
            out = forward(src, tgt_in)
            s.sync()
            return out
        return f

    def torch_fwd():
        s.tmodel.eval()
        with s.torch.no_grad(), s.autocast:
            out = s.tmodel(*s.tbatch[:2])
        s.torch_sync()
        return out

    theirs = torch_fwd if s.with_torch else None
    work = []
    if "forward" in which:
        replay = gemm_replay(cfg, bc.batch, bc.src_len, bc.tgt_len, B.xp(), s.sync, False) if s.with_ours else None
        work.append(Work("forward", timed(s.fast.logits) if s.with_ours else None, theirs, s.n_tokens, flops, R, W,
                         replay=replay))
    if "forward_reference" in which:
        work.append(Work("forward_reference", timed(lambda a, b: s.ref.forward(a, b, None)[0]) if s.with_ours
                         else None, theirs, s.n_tokens, flops, max(2, R // 2), max(1, W // 2)))
    return work


def _decoding(s: _Setup, names: list, repeats) -> list:
    """The decoders measured (greedy and beam search, with and without the key/value cache), on a
    model that never ends a sentence early, against PyTorch's."""
    from .. import decode as D
    from ..data import BOS, EOS, PAD
    if (PAD, BOS, EOS) != (PAD_ID, BOS_ID, EOS_ID):
        raise RuntimeError(f"attn.data's PAD/BOS/EOS {(PAD, BOS, EOS)} differ from the bench's")
    bc = s.bc
    dmodel = _no_eos(s.fast) if s.with_ours else None
    dsrc_h = decode_batch(bc)
    dsrc = B.to_device(dsrc_h)
    steps = bc.decode_steps
    td_src = s.torch.as_tensor(dsrc_h, device=s.device) if s.with_torch else None
    work = []
    for name in names:
        cached = name.endswith("_cached")
        K = bc.beam if name.startswith("beam") else 1

        def ours(cached=cached, K=K):
            if K == 1:
                r = D.greedy_decode(dmodel, dsrc, max_len=steps, use_cache=cached)
            else:
                r = D.beam_search(dmodel, dsrc, beam_size=K, max_len=steps, use_cache=cached)
            s.sync()
            return r

        def theirs(cached=cached, K=K):
            s.tmodel.eval()
            r = _torch_decode(s.tmodel, td_src, steps, K, cached)
            s.torch_sync()
            return r
        # Recomputing the prefix costs tens of seconds per run at toy-bench size: no warm-up
        # (the cached runs before it did the first-call work), two runs for greedy, one for beam.
        reps, warm = (s.R, 1) if cached else ((repeats or (2 if K == 1 else 1)), 0)
        work.append(Work(name, ours if s.with_ours else None, theirs if s.with_torch else None,
                         bc.decode_batch * steps, 0, reps, warm,
                         {"beam": K, "decode_steps": steps, "decode_batch": bc.decode_batch}))
    return work


#: The environment variable naming a measurement whose runs raise (attn's side): how the GPU
#: report's dry run proves that one failing measurement leaves every other row in place.
INJECT_FAILURE = "ATTN_BENCH_INJECT_FAILURE"


def _inject_failure(work: list) -> list:
    name = os.environ.get(INJECT_FAILURE, "")
    for w in work:
        if w.name == name and w.ours is not None:
            def fail(name=name):
                raise RuntimeError(f"injected failure in {name} ({INJECT_FAILURE})")
            w.ours = fail
    return work

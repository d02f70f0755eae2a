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
from ..fast.stepmem import StepMemory
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
    cfg = model_config(bc)
    xp = B.xp()
    src_h, tgt_in_h, tgt_out_h = make_batch(bc)
    src, tgt_in, tgt_out = (B.to_device(a) for a in (src_h, tgt_in_h, tgt_out_h))
    n_tokens = int((src_h != PAD_ID).sum() + (tgt_out_h != PAD_ID).sum())
    flops_train = model_flops(cfg, bc.batch, bc.src_len, bc.tgt_len, True)
    flops_fwd = model_flops(cfg, bc.batch, bc.src_len, bc.tgt_len, False)
    R = repeats or bc.repeats
    W = bc.warmup if warmup is None else warmup

    on_gpu = backend == "cupy"
    wants_ref = with_ours and any(w in which for w in ("train_step_reference", "forward_reference"))
    ref = Transformer(cfg, seed=0) if wants_ref else None
    # On a GPU the batch is checked once here; inside the timed step nothing waits for the device.
    fast = FAST.model(cfg, seed=0, precision=Precision.of(precision or "fp32"), check_ids=not on_gpu) \
        if with_ours else None
    if on_gpu and with_ours:
        from ..layers import check_ids
        for a in (src, tgt_in, tgt_out):
            check_ids("bench", "batch", a, cfg.vocab_size)
    tmodel = topt = None
    if with_torch:
        import torch
        precision = match_precision(torch, precision)       # PyTorch's products at attn's precision
        autocast = torch_autocast(torch, precision, device)
        tmodel = torch_transformer(cfg, device)
        topt, adam_kind = torch_adam(tmodel)
        t_src, t_in, t_out = (torch.as_tensor(a, device=device) for a in (src_h, tgt_in_h, tgt_out_h))
    state = {"fast_opt": FAST.optimizer(fast) if with_ours else None,
             "ref_opt": Adam(ref.params, cfg.d_model, cfg.warmup_steps) if ref is not None else None,
             "fast_rng": B.DeviceRNG(1), "ref_rng": B.DeviceRNG(1)}
    eps = cfg.label_smoothing

    # On CuPy every array the step makes comes from the model's step memory (one slab, the same
    # addresses every step: attn.fast.stepmem), as in attn-train; the loss returned lives there
    # until the next step begins.
    memory = StepMemory.of(fast) if with_ours else None
    in_step = memory.step if memory is not None else contextlib.nullcontext

    def fast_step(clock=_no_clock):
        fast.phase_clock = None if clock is _no_clock else clock
        try:
            with in_step():
                logits, cache = fast.forward(src, tgt_in, state["fast_rng"])
                clock("loss")
                loss, d = fast_cross_entropy(logits, tgt_out, eps, check_finite=False, inplace=True,
                                             validate=not on_gpu)
                grads = fast.backward(d, cache)
                clock("optimizer")
                state["fast_opt"].step(grads)
                del logits, cache, d, grads
            sync()
        finally:
            fast.phase_clock = None
        return loss
    fast_step.step_memory = memory

    def ref_step():
        logits, cache = ref.forward(src, tgt_in, state["ref_rng"])
        loss, d = cross_entropy(logits, tgt_out, eps, check_finite=False)
        state["ref_opt"].step(ref.backward(d, cache))
        sync()
        return loss

    def torch_step(clock=_no_clock):
        tmodel.train()
        with autocast:
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
            loss = torch_loss(logits, t_out, eps)
        clock("backward (autograd, all layers)")
        topt.zero_grad(set_to_none=True)
        loss.backward()
        clock("optimizer")
        for g in topt.param_groups:
            g["lr"] = noam_lr(state.setdefault("torch_t", 1), cfg.d_model, cfg.warmup_steps)
        state["torch_t"] += 1
        topt.step()
        torch_sync()
        return loss

    def fwd(model):
        def f():
            out = model.forward(src, tgt_in, None)[0]
            sync()
            return out
        return f

    def torch_fwd():
        import torch
        tmodel.eval()
        with torch.no_grad(), autocast:
            out = tmodel(t_src, t_in)
        torch_sync()
        return out

    work = []
    extra_train = {"torch_adam": adam_kind, "torch_precision": precision} if with_torch else {}
    replay_train = gemm_replay(cfg, bc.batch, bc.src_len, bc.tgt_len, xp, sync, True) if with_ours else None
    replay_fwd = gemm_replay(cfg, bc.batch, bc.src_len, bc.tgt_len, xp, sync, False) if with_ours else None
    if not with_ours:
        fast_step = ref_step = None
    if "train_step" in which:
        phases = {"ours": phase_timer(fast_step, backend)} if with_ours else {}
        if with_torch:
            phases["torch"] = phase_timer(torch_step, "torch" if device != "cpu" else "numpy")
        work.append(Work("train_step", fast_step, torch_step if with_torch else None, n_tokens, flops_train,
                         R, W, dict(extra_train), replay_train, phases))
    if "train_step_graph" in which and on_gpu:
        # The same step captured as a CUDA graph and replayed (attn-train --cuda-graph), as the
        # trainer runs it: the batch sent from the host and its ids checked there every step.
        graph_step = None
        if with_ours:
            from ..data import Batch
            gfast = FAST.model(cfg, seed=0, precision=Precision.of(precision or "fp32"), check_ids=False)
            graphed = FAST.captured_step(gfast, FAST.optimizer(gfast), eps, 0.0, FAST.loss(trusted=True))
            gbatch = Batch(src_h, tgt_in_h, tgt_out_h, int((src_h != PAD_ID).sum()), int((tgt_out_h != PAD_ID).sum()))

            def graph_step():
                loss = graphed(gbatch, 1)[0]
                sync()
                return loss
        work.append(Work("train_step_graph", graph_step, torch_step if with_torch else None, n_tokens, flops_train,
                         R, max(W, 3), dict(extra_train)))    # two eager calls and the capture: untimed
    if "train_step_reference" in which:
        work.append(Work("train_step_reference", ref_step, torch_step if with_torch else None, n_tokens,
                         flops_train, max(2, R // 2), max(1, W // 2), dict(extra_train)))
    def fast_logits():
        out = fast.logits(src, tgt_in)
        sync()
        return out

    if "forward" in which:
        work.append(Work("forward", fast_logits if with_ours else None, torch_fwd if with_torch else None, n_tokens, flops_fwd, R, W,
                         replay=replay_fwd))
    if "forward_reference" in which:
        work.append(Work("forward_reference", fwd(ref) if with_ours else None, torch_fwd if with_torch else None, n_tokens, flops_fwd,
                         max(2, R // 2), max(1, W // 2)))

    dec_names = [w for w in which if w.startswith(("greedy", "beam"))]
    if dec_names:
        from .. import decode as D
        from ..data import BOS, EOS, PAD
        if (PAD, BOS, EOS) != (PAD_ID, BOS_ID, EOS_ID):
            raise RuntimeError(f"attn.data's PAD/BOS/EOS {(PAD, BOS, EOS)} differ from the bench's")
        dmodel = _no_eos(fast) if with_ours else None
        dsrc_h = decode_batch(bc)
        dsrc = B.to_device(dsrc_h)
        steps = bc.decode_steps
        gen_tokens = bc.decode_batch * steps
        if with_torch:
            td_src = torch.as_tensor(dsrc_h, device=device)
        for name in dec_names:
            cached = name.endswith("_cached")
            K = bc.beam if name.startswith("beam") else 1

            def ours(cached=cached, K=K):
                if K == 1:
                    r = D.greedy_decode(dmodel, dsrc, max_len=steps, use_cache=cached)
                else:
                    r = D.beam_search(dmodel, dsrc, beam_size=K, max_len=steps, use_cache=cached)
                sync()
                return r

            def theirs(cached=cached, K=K):
                tmodel.eval()
                r = _torch_decode(tmodel, td_src, steps, K, cached)
                torch_sync()
                return r
            # Recomputing the prefix costs tens of seconds per run at toy-bench size: no warm-up
            # (the cached runs before it did the first-call work), two runs for greedy, one for beam.
            reps, warm = (R, 1) if cached else ((repeats or (2 if K == 1 else 1)), 0)
            work.append(Work(name, ours if with_ours else None, theirs if with_torch else None, gen_tokens, 0, reps, warm,
                             {"beam": K, "decode_steps": steps, "decode_batch": bc.decode_batch}))
    return _inject_failure(work)


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

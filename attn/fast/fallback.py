"""A run on a GPU always trains: each of the fast engine's advanced features probed once at the
start, on a tiny step, against the plain CuPy path; one that fails or disagrees is switched off,
with one line naming it, and the run goes on without it.

The plain path is the fast engine's eager step at fp32 with CuPy's own ``matmul`` and CuPy's
memory pool: the kernels and nothing else. Against its losses over a few steps of a tiny model
(the same weights, batches and dropout seeds), in this order:

* ``cuBLAS through ctypes`` (:data:`attn.fast.cublas.DIRECT`): the products on attn's own cuBLAS
  handle. Off: CuPy's ``matmul`` (then no captured step, and fp32);
* ``step memory`` (:data:`attn.fast.stepmem.ENABLED`): every array of a step from one planned
  slab. Off: CuPy's pool (then no captured step);
* ``captured step`` (``--cuda-graph``): the step captured as a CUDA graph and replayed, against
  eager steps on the same padded batches. Off: eager steps;
* the ``--precision`` asked (bf16 or tf32): within :data:`PRECISION_RTOL` of fp32's losses. Off:
  fp32.

A feature agrees where every loss is within :data:`attn.fast.graph.REPLAY_TOLERANCE` of the plain
path's (what float atomics allow). ``attn-train --backend cupy --reference`` (the readable model)
needs none of them: the last resort, which ran on an H100 before.

On the CuPy stand-in the probes run only where :data:`ON_STAND_IN` is set (the tests, which break
a feature and watch it switched off); NumPy has nothing to probe.
"""
from __future__ import annotations

import contextlib
import dataclasses

from .. import backend as B

#: Whether the probes run on the CuPy stand-in too (the tests set it); on a GPU they always run.
ON_STAND_IN = False

#: How far a tiny step's loss at bf16 or tf32 may be from fp32's (relative).
PRECISION_RTOL = 0.02

#: Steps each probe takes.
STEPS = 3


def tiny_config():
    """The tiny model every probe trains (and the GPU report's preflight)."""
    from ..model import TransformerConfig
    return TransformerConfig(vocab_size=23, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1, n_decoder_layers=1,
                             dropout=0.1, label_smoothing=0.1, max_len=32, warmup_steps=8)


def _batches():
    from ..data import _pad_batch, pad_to_bucket
    rng = B.host.random.default_rng(0)
    return [pad_to_bucket(_pad_batch([(rng.integers(4, 23, rng.integers(1, 7)).tolist(),
                                       rng.integers(4, 23, rng.integers(1, 7)).tolist()) for _ in range(6)]))
            for _ in range(STEPS)]


@contextlib.contextmanager
def _set(module, name: str, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def _losses(precision: str = "fp32", direct=None, memory=None, graph: bool = False) -> list:
    """The tiny model's losses over :data:`STEPS` steps with the features given (``direct``,
    ``memory``: None for the switches as they are)."""
    from .. import engine
    from .loop import train_step
    from . import cublas, stepmem
    from .graph import GraphedTrainStep
    from ..precision import Precision
    eng, cfg = engine.get("fast"), tiny_config()
    direct = cublas.DIRECT if direct is None else direct
    memory = stepmem.ENABLED if memory is None else memory
    with _set(cublas, "DIRECT", direct), _set(stepmem, "ENABLED", memory):
        model = eng.model(cfg, seed=0, precision=Precision.of(precision), check_ids=False)
        opt, loss_fn = eng.optimizer(model), eng.loss(trusted=True)
        if graph:
            step = GraphedTrainStep(model, opt, cfg.label_smoothing, 1.0, loss_fn)
            losses = [float(step(b, i)[0]) for i, b in enumerate(_batches())]
            if step.graphs != 1:
                raise RuntimeError(f"the step was not captured: {step.refusals}")
            return losses
        return [float(train_step(model, opt, b, B.DeviceRNG(i), cfg.label_smoothing, 1.0, loss_fn)[0])
                for i, b in enumerate(_batches())]


def _disagreement(got: list, want: list, rtol=None) -> str | None:
    """Why ``got`` (losses) is not ``want`` within the replay tolerance (or ``rtol``), or None."""
    from .graph import REPLAY_TOLERANCE
    rtol = REPLAY_TOLERANCE["rtol"] if rtol is None else rtol
    for i, (g, w) in enumerate(zip(got, want)):
        if not abs(g - w) <= REPLAY_TOLERANCE["atol"] + rtol * abs(w):
            return f"step {i}'s loss {g!r}, the plain path's {w!r}"
    return None


def _probe(run, want, rtol=None) -> str | None:
    """Why a feature is switched off (``run()`` or ``want()`` raised, or their losses disagree),
    or None."""
    try:
        return _disagreement(run(), want(), rtol)
    except Exception as e:                  # noqa: BLE001 (a feature that fails in any way is switched off)
        return f"{type(e).__name__}: {e}"[:300]


def settle(config, say):
    """On a GPU (or the stand-in with :data:`ON_STAND_IN`), the fast engine's features probed as
    the module says: returns ``config`` with ``cuda_graph`` and ``precision`` as they can run, the
    process-wide switches set, and one line through ``say`` for each feature switched off. A run
    on NumPy is returned as it is."""
    from . import cublas, stepmem
    if B.get_backend() != "cupy" or (B.xp().__name__ != "cupy" and not ON_STAND_IN):
        return config
    plain = _losses(direct=False, memory=False)
    off = {}
    why = _probe(lambda: _losses(memory=False), lambda: plain)
    if why:
        off["cuBLAS through ctypes"], cublas.DIRECT = why, False
    why = _probe(lambda: _losses(), lambda: plain)
    if why:
        off["step memory"], stepmem.ENABLED = why, False
    cuda_graph, precision = config.cuda_graph, config.precision
    if cuda_graph and (not cublas.DIRECT or not stepmem.ENABLED):
        off["captured step"], cuda_graph = "it needs cuBLAS through ctypes and the step memory", False
    elif cuda_graph:
        why = _probe(lambda: _losses(graph=True), _losses)
        if why:
            off["captured step"], cuda_graph = why, False
    if precision != "fp32":
        why = ("it needs cuBLAS through ctypes" if not cublas.DIRECT
               else _probe(lambda: _losses(precision), _losses, PRECISION_RTOL))
        if why:
            off[f"--precision {precision}"], precision = why, "fp32"
    for feature, reason in off.items():
        say(f"attn-train: {feature} is switched off for this run: its probe on this device failed ({reason}); "
            "the run goes on without it")
    return dataclasses.replace(config, cuda_graph=cuda_graph, precision=precision)

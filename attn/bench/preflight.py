"""The GPU report's ``preflight`` part: the riskiest paths of the fast engine on real CuPy, each a
PASS or FAIL line with a figure, in a few minutes, before any part that takes longer.

``python -m attn.bench.preflight`` runs every check of :data:`CHECKS` in order in this process
(the CuPy backend: a GPU, or the stand-in under ``fakecupy.child_env``), each isolated (one that
raises is a FAIL with the error, and the next still runs), and prints for each one JSON line
(``{"check", "ok", "figure", "seconds"}``, what :mod:`attn.bench.gpu_report` reads) and one
``PASS``/``FAIL`` line on standard error. It exits 1 if any failed.

What each check shows, and why it is among the first things a GPU must show:

* ``kernels``: every kernel of the one ``RawModule`` compiled by NVRTC for this GPU (the compile
  time: the first process pays it, the others read CuPy's kernel cache);
* ``tiny step``: one training step of a tiny model, its loss finite;
* ``unowned memory``: a weak reference to an ``UnownedMemory`` fires only after the last view of
  an array over it has gone (what the step memory learns lifetimes from);
* ``capture mode``: the thread-local capture mode's value in CuPy's runtime;
* ``pool in capture``: a pool allocation inside a thread-local capture is refused (by CUDA or by
  attn's guard), never kept by a graph;
* ``guard sync``: the guard refuses a host sync;
* ``one libcublas``: the process maps one ``libcublas`` (attn's ctypes calls and CuPy's the same);
* ``cublas views``: attn's products on strided views equal ``cupy.matmul``;
* ``bf16``, ``tf32``: the products against their definitions (tf32 may run as float32: a
  permission, not a promise);
* ``checked plan``: eager steps on a checked plan equal the unplanned allocator's, no two live
  arrays sharing bytes;
* ``captured step``: the captured step equals eager steps within
  :data:`attn.fast.gpu.graph.REPLAY_TOLERANCE`;
* ``plan split``: how eager steps of varying shapes split between planned, traced and spilled.
"""
from __future__ import annotations

import json
import math
import sys
import time
import weakref

from .. import backend as B

#: (name, function) of every check, in the order they run.
CHECKS: list = []


def check(name: str):
    """Register ``f(ctx) -> figure`` as the check ``name`` (it raises where it fails)."""
    def register(f):
        CHECKS.append((name, f))
        return f
    return register


def _batch(rng, rows: int, lo: int, hi: int, pad: bool = True):
    from ..data import _pad_batch, pad_to_bucket
    pairs = [(rng.integers(4, 23, rng.integers(lo, hi)).tolist(), rng.integers(4, 23, rng.integers(lo, hi)).tolist())
             for _ in range(rows)]
    batch = _pad_batch(pairs)
    return pad_to_bucket(batch) if pad else batch


def _fast(ctx, seed: int = 5, memory=None):
    """A fast model of the toy config, its optimizer and loss (``memory``: its step memory)."""
    from .. import engine
    eng = engine.get("fast")
    model = eng.model(ctx["cfg"], seed=seed, check_ids=False)     # (the trainer checks them on the host)
    if memory is not None:
        model._step_memory = memory
    return model, eng.optimizer(model), eng.loss(trusted=True)


def _close(got, want, what: str) -> float:
    """The largest relative difference of ``got`` from ``want`` (host arrays), checked against
    :data:`attn.fast.gpu.graph.REPLAY_TOLERANCE` (what float atomics allow)."""
    from ..fast.gpu.graph import REPLAY_TOLERANCE
    np = B.host
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    bad = np.abs(got - want) > REPLAY_TOLERANCE["atol"] + REPLAY_TOLERANCE["rtol"] * np.abs(want)
    if bad.any():
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} values differ beyond {REPLAY_TOLERANCE}")
    return float((np.abs(got - want) / np.maximum(np.abs(want), 1e-30)).max())


@check("kernels")
def _kernels(ctx):
    from ..fast.core.dispatch import ops_for
    from ..fast.gpu.kernels import NAME_EXPRESSIONS
    t0 = time.perf_counter()
    ops = ops_for(ctx["cp"])
    for name in NAME_EXPRESSIONS:
        ops.function(name)
    return f"{len(NAME_EXPRESSIONS)} kernels compiled (or read from CuPy's cache) in {time.perf_counter() - t0:.1f} s"


@check("tiny step")
def _tiny_step(ctx):
    from ..fast.training.loop import train_step
    model, opt, loss_fn = _fast(ctx)
    t0 = time.perf_counter()
    loss, _ = train_step(model, opt, _batch(B.host.random.default_rng(0), 6, 1, 7), B.DeviceRNG(0),
                         ctx["cfg"].label_smoothing, 1.0, loss_fn)
    value = float(loss)
    if not math.isfinite(value):
        raise AssertionError(f"the loss is {value}")
    return f"CuPy {ctx['cp'].__version__}: loss {value:.3f} in {time.perf_counter() - t0:.2f} s"


@check("unowned memory")
def _unowned(ctx):
    from ..fast.gpu.stepmem import piece_class
    cp = ctx["cp"]
    base = cp.zeros(1024, dtype=B.host.uint8)
    piece = piece_class(cp)(base.data.ptr + 256, 512, base, cp.cuda.Device().id)
    fired = []
    weakref.finalize(piece, fired.append, 1)
    a = cp.ndarray((128,), dtype=B.host.float32, memptr=cp.cuda.MemoryPointer(piece, 0))
    del piece
    view = a[10:20]
    del a
    early = bool(fired)
    del view
    if early or not fired:
        raise AssertionError("the weak reference fired " + ("while a view was alive" if early else "never"))
    return "fired after the last view, not before"


@check("capture mode")
def _capture_mode(ctx):
    from ..fast.gpu.graph import CAPTURE_MODE_NAME, capture_mode
    value = getattr(ctx["cp"].cuda.runtime, CAPTURE_MODE_NAME)
    if value != 1 or capture_mode(ctx["cp"]) != 1:
        raise AssertionError(f"{CAPTURE_MODE_NAME} is {value}, cudaStreamCaptureModeThreadLocal is 1")
    return f"{CAPTURE_MODE_NAME} = {value}"


@check("pool in capture")
def _pool_in_capture(ctx):
    from ..fast.gpu.graph import CaptureError, capture_step
    cp = ctx["cp"]
    x = cp.ones(1024, dtype=B.host.float32)
    y = x + 1                                   # a block of that size cached in the pool
    del y
    try:
        capture_step(cp, lambda a: a + 1, [x])
    except CaptureError as e:
        return "refused: " + str(e).split(": ", 1)[-1][:120]
    raise AssertionError("a capture allocating from the pool was kept")


@check("guard sync")
def _guard_sync(ctx):
    from ..fast.gpu.graph import CaptureGuard
    x = ctx["cp"].ones(4, dtype=B.host.float32)
    try:
        with CaptureGuard(ctx["cp"]):
            float(x.sum())
    except Exception as e:                      # noqa: BLE001 (CuPy's DeviceSynchronized, or CUDA's)
        return f"refused: {type(e).__name__}"
    raise AssertionError("a host sync inside the guard went through")


@check("one libcublas")
def _one_libcublas(ctx):
    import os
    import re

    from ..fast.core.dispatch import ops_for
    cp = ctx["cp"]
    a = cp.ones((8, 8), dtype=cp.float32)
    ops_for(cp).mm(a, a), cp.matmul(a, a)              # both have loaded the cuBLAS they call
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({os.path.realpath(p) for p in re.findall(r"(/\S*libcublas\.so\S*)", fh.read())})
    except OSError as e:
        return f"not known here ({e})"
    if len(paths) > 1:
        raise AssertionError(f"{len(paths)} libcublas mapped: {', '.join(paths)}")
    if not paths and "fakecupy" not in cp.__version__:
        raise AssertionError("no libcublas mapped after a product of attn's and one of CuPy's")
    return paths[0] if paths else "none mapped (the stand-in)"


def _operands(rng, *shapes):
    return [rng.standard_normal(s).astype(B.host.float32) for s in shapes]


@check("cublas views")
def _cublas_views(ctx):
    from ..fast.core.dispatch import ops_for
    cp, rng = ctx["cp"], B.host.random.default_rng(3)
    a, b, x = (cp.asarray(v) for v in _operands(rng, (64, 96), (64, 48), (2, 3, 16, 40)))
    worst = 0.0
    for args, product, what in (((a[:, 16:80], b), ops_for(cp).mm, "mm of a column slice"),
                                ((a.T[:48], a[:, :40]), ops_for(cp).mm, "mm of a transpose"),
                                ((x, x.swapaxes(-1, -2)), ops_for(cp).bmm, "bmm with a swapped view")):
        ra, rb = (cp.asnumpy(v) for v in args)
        for got, whose in ((product(*args), "attn's"), (cp.matmul(*args), "cupy.matmul's")):
            worst = max(worst, _within_bound(cp.asnumpy(got), ra, rb, f"{what}: {whose}"))
    return ("three products on views, attn's and cupy.matmul's, within float32 accumulation's bound of the "
            f"exact product (at most {worst:.2f} of it)")


def _share(got, ra, rb) -> float:
    """The largest error of ``got`` from the exact product of ``ra`` and ``rb``, as a fraction of
    float32 accumulation's bound."""
    np = B.host
    ra, rb = ra.astype(np.float64), rb.astype(np.float64)
    bound = ra.shape[-1] * 2.0 ** -24 * (np.abs(ra) @ np.abs(rb)) + 1e-30
    return float((np.abs(got.astype(np.float64) - ra @ rb) / bound).max())


def _within_bound(got, ra, rb, what: str) -> float:
    """:func:`_share`, raising where it is over 1. Two products of one sum in different orders may
    differ by twice the bound, so each is held against the exact product, not against the other."""
    share = _share(got, ra, rb)
    if share > 1:
        raise AssertionError(f"{what} product is {share:.2f} times float32 accumulation's bound from the exact one")
    return share


def _bound(got, ra, rb) -> bool:
    """Whether ``got`` is within float32 accumulation's bound of the exact product of ``ra`` and ``rb``."""
    return _share(got, ra, rb) <= 1


@check("bf16")
def _bf16(ctx):
    from ..fast.core.dispatch import ops_for
    from ..precision import round_bf16
    cp = ctx["cp"]
    a, b = _operands(B.host.random.default_rng(4), (64, 128), (128, 48))
    got = cp.asnumpy(ops_for(cp, "bf16").mm(cp.asarray(a), cp.asarray(b))).astype(B.host.float32)
    if not _bound(got, round_bf16(a), round_bf16(b)):
        raise AssertionError("the bf16 product is not the product of the operands rounded to bf16")
    return "the product of the operands rounded to bf16, summed in float32"


@check("tf32")
def _tf32(ctx):
    from ..fast.core.dispatch import ops_for
    from ..precision import round_tf32
    cp = ctx["cp"]
    a, b = _operands(B.host.random.default_rng(5), (64, 128), (128, 48))
    got = cp.asnumpy(ops_for(cp, "tf32").mm(cp.asarray(a), cp.asarray(b)))
    truncated = [(x.view(B.host.uint32) & B.host.uint32(0xFFFFE000)).view(B.host.float32) for x in (a, b)]
    for name, (ra, rb) in (("TF32 (to nearest)", (round_tf32(a), round_tf32(b))),
                           ("TF32 (toward zero)", truncated), ("float32 (TF32 not taken)", (a, b))):
        if _bound(got, ra, rb):
            return f"the product is {name}'s"
    raise AssertionError("the tf32 product is neither TF32's nor float32's")


@check("checked plan")
def _checked_plan(ctx):
    from ..fast.gpu.stepmem import StepMemory
    from ..fast.training.loop import train_step
    cp, rng = ctx["cp"], B.host.random.default_rng(6)
    memories = StepMemory(cp, planned=True, check=True), StepMemory(cp, planned=False)
    runs = [_fast(ctx, memory=m) for m in memories]
    worst = 0.0
    for step in range(4):
        batch = _batch(rng, 6, 1, 7)
        losses = [float(train_step(m, o, batch, B.DeviceRNG(step), ctx["cfg"].label_smoothing, 1.0, f)[0])
                  for m, o, f in runs]
        worst = max(worst, _close([losses[0]], [losses[1]], f"step {step}'s loss"))
    planned, bump = memories
    if planned.overlapping:
        raise AssertionError(f"live arrays shared bytes: {planned.overlapping[:5]}")
    return (f"4 steps equal (largest relative difference {worst:.1e}); slab {planned.capacity / 2 ** 20:.2f} MB "
            f"planned, {bump.capacity / 2 ** 20:.2f} MB unplanned")


@check("captured step")
def _captured(ctx):
    from ..fast.gpu.graph import GraphedTrainStep, held_parameters
    from ..fast.training.loop import train_step
    rng = B.host.random.default_rng(7)
    (m1, o1, f1), (m2, o2, f2) = _fast(ctx), _fast(ctx)
    graphed = GraphedTrainStep(m2, o2, ctx["cfg"].label_smoothing, 1.0, f2)
    worst = 0.0
    for step in range(5):
        batch = _batch(rng, 6, 1, 7)
        eager = float(train_step(m1, o1, batch, B.DeviceRNG(step), ctx["cfg"].label_smoothing, 1.0, f1)[0])
        worst = max(worst, _close([float(graphed(batch, step)[0])], [eager], f"step {step}'s loss"))
    worst = max(worst, _close(held_parameters(m2), held_parameters(m1), "the parameters"))
    if graphed.graphs != 1:
        raise AssertionError(f"{graphed.graphs} graphs captured, not 1: {graphed.refusals}")
    return f"5 steps, 1 graph, equal to eager (largest relative difference {worst:.1e})"


@check("plan split")
def _plan_split(ctx):
    from ..fast.gpu.stepmem import StepMemory
    from ..fast.training.loop import train_step
    rng = B.host.random.default_rng(8)
    model, opt, loss_fn = _fast(ctx)
    seen, shapes = [], set()
    for step in range(16):                    # 8 sentences of 9 to 15 tokens: one bucket, many shapes
        batch = _batch(rng, 8, 8, 15, pad=False)
        shapes.add((batch.src.shape, batch.tgt_in.shape))
        train_step(model, opt, batch, B.DeviceRNG(step), ctx["cfg"].label_smoothing, 1.0, loss_fn)
        seen.append(StepMemory.of(model).last_outcome)
    late = seen[8:]
    split = ", ".join(f"{k} {seen.count(k)}" for k in ("planned", "traced", "spilled"))
    if "traced" in late or late.count("planned") < 6:
        raise AssertionError(f"the steps do not settle on a plan: {split}; in order {[o[0] for o in seen]}")
    return f"16 steps of {len(shapes)} shapes: {split}"


def run(out=sys.stdout, err=sys.stderr) -> list:
    """Every check in order: a JSON line each on ``out``, a PASS/FAIL line on ``err``; the rows."""
    B.set_backend("cupy")
    from ..fast.gpu.fallback import tiny_config
    ctx = {"cp": B.xp(), "cfg": tiny_config()}
    rows = []
    for name, f in CHECKS:
        t0 = time.perf_counter()
        try:
            figure, ok = f(ctx), True
        except Exception as e:                  # noqa: BLE001 (each check isolated: the next still runs)
            figure, ok = f"{type(e).__name__}: {e}"[:400], False
        row = {"check": name, "ok": ok, "figure": figure, "seconds": round(time.perf_counter() - t0, 2)}
        rows.append(row)
        print(json.dumps(row), file=out, flush=True)
        print(f"{'PASS' if ok else 'FAIL'}  {name:<16} {figure}", file=err, flush=True)
    return rows


def main() -> int:
    return 0 if all(r["ok"] for r in run()) else 1


if __name__ == "__main__":
    sys.exit(main())

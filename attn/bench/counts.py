"""What a training step and a decoding step ask of a GPU, counted on any machine.

On a GPU the small presets are bound by how many kernels a step launches, not by its
arithmetic. This module counts, for the benchmark's own measurements (:mod:`attn.bench.work`)
run on the CuPy stand-in (``tests/fakecupy``: NumPy dressed as CuPy, which reports each
operation as CuPy would run it), in a steady-state step after a warm-up:

* **kernel launches by kind**: elementwise kernels, reductions, attn's own RawKernels,
  cuBLAS products, copies (device to device, including the copies CuPy's ``matmul`` makes of
  operands cuBLAS cannot take as they are, and host transfers), cuRAND draws, and sorts or
  scans (several kernels in CuPy, counted as one); the training step's launches also by phase
  (``optimizer`` is Adam);
* **bytes moved**: each launch's operands and results, read once and written once (a lower
  bound on the memory traffic), at the preset's batch;
* **host synchronisations**: every device-to-host transfer or explicit synchronisation;
* **memory-pool allocations**: every array the step takes from CuPy's memory pool (cheap,
  but an allocation from the pool cannot be captured in a CUDA graph, and each is some
  bookkeeping on the host), and apart from them the **step memory**'s: the arrays the
  training step makes inside :class:`attn.fast.gpu.stepmem.StepMemory` (one slab, the same
  addresses every step), with the slab's size;
* **what a CUDA graph capture of the training step would refuse** (:func:`attn.fast.gpu.graph.survey`):
  pool allocations, CuPy's own ``matmul`` (cuBLAS through CuPy), cuRAND draws, host transfers
  and syncs, by kind and by the line of attn that asked for them. The step can be captured and
  replayed (``attn.fast.gpu.graph.CapturedStep``) once none is left.

Launch, sync and allocation counts do not depend on the batch (the same kernels run on
bigger arrays), so each measurement is counted at two small batches (quick even for ``base``),
checked to agree, and the bytes are scaled to the preset's batch (they are affine in it). The
two batches also feed :func:`fixed_grid_kernels`, the lint that flags a RawKernel whose grid
stays the same while its work grows with the batch (a kernel that cannot fill a bigger GPU).

``python -m attn.bench --counts [--preset NAME] [--json]`` prints them; ``tests/test_counts.py``
holds the budgets.
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from .. import backend as B
from .presets import BENCH_PRESETS, BenchConfig

#: What the GPU engine is to reach, printed beside the counts: a steady-state training step with
#: one Adam launch, no host synchronisation and no allocation from the memory pool on every
#: preset, and at most 300 launches on ``toy-bench`` (PyTorch's eager step makes about 420).
TARGETS = {"optimizer_launches": 1, "syncs": 0, "pool_allocations": 0}
LAUNCH_TARGETS = {"toy-bench": 300}

#: The measurements counted: the fast training step and cached decoding.
COUNTED = ("train_step", "greedy_cached", "beam_cached")

#: The two batches each measurement is counted at.
BATCHES = (2, 4)


class CountsError(RuntimeError):
    """The counts cannot be taken here (the stand-in is missing, or counts disagree)."""


def stand_in():
    """The CuPy stand-in, ``tests/fakecupy`` of this checkout (it is a test fixture, not part of
    the installed package): imported from the repository beside the package."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    if not (tests / "fakecupy" / "__init__.py").is_file():
        raise CountsError(f"the CuPy stand-in is not at {tests / 'fakecupy'}: counting needs attn's source "
                          "checkout (pip install -e .), not an installed wheel")
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    import fakecupy
    return fakecupy


class Tally:
    """The stand-in's tracer (``fakecupy.cupy.tracer``): launches by kind, by operation and by
    phase, bytes, allocations, and every RawKernel launch's grid and work."""

    def __init__(self):
        self.kinds: Counter = Counter()
        self.ops: Counter = Counter()          # (kind, name) -> launches
        self.phases: Counter = Counter()       # phase -> launches
        self.phase = "forward: before the first layer"
        self.bytes = 0
        self.allocations = 0                   # from the memory pool
        self.allocated_bytes = 0
        self.step_memory_allocations = 0       # from a step memory's slab
        self.slab_bytes = 0                    # the slab's size after the step (set by count_at)
        self.peak_live_bytes = 0               # the most bytes of the step's arrays alive at once (count_at)
        self.host_seconds = 0.0                # the untraced step's median wall time (count_at)
        self.raw: list = []                    # (kernel, grid blocks, threads per block, work) in launch order

    def mark(self, phase: str) -> None:
        """The benchmark's phase clock: launches from here on count for ``phase``."""
        self.phase = phase

    def __call__(self, kind, name, inputs, outputs, info):
        fresh = info.get("fresh", ())
        self.allocations += len(fresh)
        self.allocated_bytes += sum(a.nbytes for a in fresh)
        self.step_memory_allocations += len(info.get("step_memory", ()))
        if kind == "alloc":
            return
        self.kinds[kind] += 1
        self.ops[(kind, name)] += 1
        self.phases[self.phase] += 1
        self.bytes += sum(a.nbytes for a in inputs) + sum(a.nbytes for a in outputs)
        if kind == "raw":
            blocks = threads = 1
            for g in info["grid"]:
                blocks *= int(g)
            for t in info["block"]:
                threads *= int(t)
            self.raw.append((name, blocks, threads, int(info["work"])))

    @property
    def launches(self) -> int:
        return sum(self.kinds.values())


@contextlib.contextmanager
def _on_the_stand_in():
    """The stand-in selected as attn's CuPy for the block; the previous selection restored."""
    fc = stand_in()
    saved = (B._current, B._xp, B.cupy_modules)
    try:
        fc.install()
        B.set_backend("cupy")
        yield fc
    finally:
        fc.cupy.tracer = None
        B._current, B._xp, B.cupy_modules = saved


def _count_once(fc, call, clock: bool = False) -> tuple:
    """Run ``call`` with a fresh :class:`Tally` as the tracer. Returns (tally, syncs, sync kinds)."""
    tally = Tally()
    with fc.counting() as syncs:
        fc.cupy.tracer = tally
        try:
            call(tally.mark) if clock else call()
        finally:
            fc.cupy.tracer = None
    return tally, syncs.n, syncs.kinds


#: Untimed runs before a counted one: the first training step is traced (its arrays come from the
#: pool, their lifetimes give the step memory its plan and the slab its size); the second asks
#: for one array less (the benchmark keeps its dropout generator, whose seed the first step made
#: in its own memory), so its sizes leave the plan and the third is traced again; the fourth is
#: the first at the plan's addresses and makes what the kernels keep per address
#: (:meth:`attn.fast.gpu.kernels.Products._gemm_pointers`); the fifth is a steady-state step.
STEADY_AFTER = 4
#: Untimed runs before a counted decoding run (decoding runs in no step memory).
DECODE_STEADY_AFTER = 2


def count_at(bc: BenchConfig, which=COUNTED, warmup: int = STEADY_AFTER, precision: str = "fp32",
             host_time: bool = False) -> dict:
    """{measurement: (Tally, syncs, sync kinds)} for one configuration, on the stand-in, after
    ``warmup`` untimed runs of each; the fast engine's products at ``precision``. ``host_time``:
    the training step's host time measured too (:func:`_host_seconds`, :data:`HOST_RUNS` more
    steps; the tally's ``host_seconds``, else 0)."""
    from .work import build_work

    def nothing():
        pass
    out = {}
    with _on_the_stand_in() as fc:
        for w in build_work(bc, list(which), "cupy", False, nothing, nothing, "cuda", repeats=1, warmup=0,
                            precision=precision):
            for _ in range(warmup if w.name == "train_step" else min(warmup, DECODE_STEADY_AFTER)):
                w.ours()
            if w.name == "train_step":
                out[w.name] = _count_once(fc, w.ours, clock=True)      # fast_step(clock): phases too
                memory = getattr(w.ours, "step_memory", None)
                out[w.name][0].slab_bytes = memory.capacity if memory is not None else 0
                out[w.name][0].peak_live_bytes = memory.stats()["peak_live_bytes"] if memory is not None else 0
                out[w.name][0].host_seconds = _host_seconds(w.ours) if host_time else 0.0
            else:
                out[w.name] = _count_once(fc, w.ours)
    return out


#: Timed runs of the steady-state step whose median is its host time (no tracer).
HOST_RUNS = 5


def _host_seconds(step) -> float:
    """The median host time of ``step()`` on the stand-in, untraced: its wall time less what the
    stand-in spent doing the device's work (the kernels' twins, cuBLAS's products; the stand-in's
    ``device_seconds``). What is left is attn's Python and the stand-in's CuPy around each launch
    (its elementwise kernels still compute in NumPy, on the smallest counted batch: an upper
    bound of the host time a GPU's launches cost)."""
    import time
    fcp = stand_in().cupy
    times = []
    for _ in range(HOST_RUNS):
        d0, t0 = fcp.device_seconds[0], time.perf_counter()
        step()
        times.append(time.perf_counter() - t0 - (fcp.device_seconds[0] - d0))
    return sorted(times)[len(times) // 2]


#: Elements per thread above which a kernel with a fixed grid is a finding (below it, a kernel
#: at its one-block floor on a tiny batch is not).
LOOP_PER_THREAD = 8


def fixed_grid_kernels(small: list, large: list) -> list:
    """The lint: RawKernel launches (``(kernel, blocks, threads per block, work)`` in launch
    order, at a small and a larger batch) whose work grew while their grid did not, and whose
    threads loop over more than :data:`LOOP_PER_THREAD` elements each at the larger batch: a
    kernel that cannot fill a bigger GPU (layer norm's ``colsum_prod`` gives each of D threads
    a whole column of B*T rows). Returns one dict per kernel flagged: ``kernel``, ``blocks``,
    ``work_small``, ``work_large``."""
    flagged = {}
    by_small, by_large = {}, {}
    for rows, into in ((small, by_small), (large, by_large)):
        for name, blocks, threads, work in rows:
            into.setdefault(name, []).append((blocks, threads, work))
    for name in by_small:
        for (b1, _, w1), (b2, t2, w2) in zip(by_small[name], by_large.get(name, [])):
            if w2 > w1 and b2 <= b1 and w2 > LOOP_PER_THREAD * b2 * t2 and name not in flagged:
                flagged[name] = {"kernel": name, "blocks": b1, "work_small": w1, "work_large": w2}
    return list(flagged.values())


def _scale(v_small: float, v_large: float, b_small: int, b_large: int, b: int) -> float:
    """An affine quantity at batch ``b`` from its values at two batches."""
    return v_small + (b - b_small) * (v_large - v_small) / (b_large - b_small)


def measure_counts(preset: str = "toy-bench", which=COUNTED, batches=BATCHES, bc: BenchConfig | None = None,
                   precision: str = "fp32", block: str = "paper") -> list:
    """The counts of ``preset``'s training step and decoding steps, as one result row each
    (``name`` ``counts_<measurement>``) plus one ``counts_lint`` row. Decoding rows are per
    generated position. ``precision``: the fast engine's products (``--precision``; the launch
    target is fp32's, of the paper's block). ``block``: the name of ``bc``'s block (``--block``),
    written beside the preset's name in the rows."""
    bc = bc or BENCH_PRESETS[preset]
    label = preset if block == "paper" else f"{preset}, {block} block"
    b1, b2 = batches
    at = {b: count_at(replace(bc, batch=b, decode_batch=b), which, precision=precision, host_time=b == b1)
          for b in (b1, b2)}                    # the host time is reported at the smaller batch
    rows = []
    for name in which:
        (t1, s1, k1), (t2, s2, k2) = at[b1][name], at[b2][name]
        if (t1.kinds, t1.allocations, s1) != (t2.kinds, t2.allocations, s2):
            raise CountsError(f"{name}: the counts differ between batches {b1} and {b2} ({dict(t1.kinds)}, "
                              f"{t1.allocations} allocations, {s1} syncs against {dict(t2.kinds)}, "
                              f"{t2.allocations}, {s2}): a loop whose length depends on the batch")
        train = name.startswith("train")
        per = 1 if train else bc.decode_steps
        batch = bc.batch if train else bc.decode_batch
        row = {"name": f"counts_{name}", "preset": label, "precision": precision,
               "per": "training step" if train else "generated position",
               "launches": t2.launches / per, "launches_by_kind": {k: v / per for k, v in sorted(t2.kinds.items())},
               "syncs": s2 / per, "sync_kinds": k2, "pool_allocations": t2.allocations / per,
               "pool_allocated_mb": _scale(t1.allocated_bytes, t2.allocated_bytes, b1, b2, batch) / per / 2**20,
               "step_memory_allocations": t2.step_memory_allocations / per,
               "slab_mb": _scale(t1.slab_bytes, t2.slab_bytes, b1, b2, batch) / 2**20,
               "peak_live_mb": _scale(t1.peak_live_bytes, t2.peak_live_bytes, b1, b2, batch) / 2**20,
               "host_us_per_launch": (getattr(t1, "host_seconds", 0.0) / max(1, t1.launches) / per * 1e6
                                      if train else None),
               "bytes_moved_mb": _scale(t1.bytes, t2.bytes, b1, b2, batch) / per / 2**20,
               "batch": batch, "counted_at_batches": [b1, b2],
               "top_operations": [[k, n, c / per] for (k, n), c in t2.ops.most_common(12)]}
        if train:
            row["launches_by_phase"] = dict(t2.phases)
            row["optimizer_launches"] = t2.phases.get("optimizer", 0)
            row["targets"] = dict(TARGETS, **({"launches": LAUNCH_TARGETS[preset]}
                                              if preset in LAUNCH_TARGETS and precision == "fp32"
                                              and block == "paper" else {}))
        rows.append(row)
    if "train_step" in which:
        rows.append(capture_survey(replace(bc, batch=b2), label, precision))
    flagged = {}
    for name in which:
        for f in fixed_grid_kernels(at[b1][name][0].raw, at[b2][name][0].raw):
            flagged.setdefault(f["kernel"], f)
    rows.append({"name": "counts_lint", "preset": label, "fixed_grid_kernels": list(flagged.values()),
                 "what": "RawKernels whose grid stays the same while their work grows with the batch"})
    return rows


def capture_survey(bc: BenchConfig, preset: str, precision: str = "fp32") -> dict:
    """The ``counts_capture`` row: what a capture of a steady-state training step would refuse
    (:func:`attn.fast.gpu.graph.survey` on the stand-in), by kind and by place."""
    from ..fast.gpu.graph import summarise, survey
    from .work import build_work

    def nothing():
        pass
    with _on_the_stand_in() as fc:
        (w,) = build_work(bc, ["train_step"], "cupy", False, nothing, nothing, "cuda", repeats=1, warmup=0,
                          precision=precision)
        for _ in range(STEADY_AFTER):
            w.ours()
        found = survey(w.ours, fc.cupy)
    places = Counter((r.kind, r.where) for r in found)
    return {"name": "counts_capture", "preset": preset, "refused": summarise(found), "total": len(found),
            "places": [[k, where, n] for (k, where), n in places.most_common(8)],
            "what": "operations a CUDA graph capture of the training step refuses"}


def _blocks(n: int) -> str:
    return f"{n} block" + ("" if n == 1 else "s")


def print_counts(rows: list, out=None) -> None:
    """The counts as a table, with the targets beside the training step's."""
    out = out or sys.stdout
    for r in rows:
        if r["name"] == "counts_capture":
            print(f"capture ({r['what']}): " + (", ".join(f"{k} {n}" for k, n in r["refused"].items())
                                                 if r["total"] else "none (target none)"), file=out)
            for k, where, n in r["places"][:4]:
                print(f"  {n:4d} {k:<16} {where}", file=out)
            continue
        if r["name"] == "counts_lint":
            ks = r["fixed_grid_kernels"]
            print(f"lint ({r['what']}): " + (", ".join(
                f"{k['kernel']} ({_blocks(k['blocks'])} for work {k['work_small']} and {k['work_large']})"
                for k in ks) if ks else "none"), file=out)
            continue
        t = r.get("targets", {})
        what = r["name"].replace("counts_", "")

        def tgt(key, fmt="{}"):
            return f"   (target {'<= ' if key == 'launches' else ''}{fmt.format(t[key])})" if key in t else ""
        at = f", {r['precision']}" if r.get("precision", "fp32") != "fp32" else ""
        print(f"{what} ({r['preset']}{at}, per {r['per']}):", file=out)
        print(f"  launches           {r['launches']:10.1f}{tgt('launches')}", file=out)
        for k, v in r["launches_by_kind"].items():
            print(f"    {k:<16} {v:10.1f}", file=out)
        if "optimizer_launches" in r:
            print(f"  of which Adam      {r['optimizer_launches']:10d}{tgt('optimizer_launches')}", file=out)
        print(f"  host syncs         {r['syncs']:10.1f}{tgt('syncs')}", file=out)
        if r.get("host_us_per_launch"):
            print(f"  host time          {r['host_us_per_launch']:10.1f}   us per launch of the eager step (host_us_per_launch; "
                  f"the stand-in at batch {r['counted_at_batches'][0]}, twins included: an upper bound)", file=out)
        print(f"  pool allocations   {r['pool_allocations']:10.1f}{tgt('pool_allocations')}"
              f"  ({r['pool_allocated_mb']:.1f} MB)", file=out)
        if r.get("step_memory_allocations"):
            print(f"  step memory        {r['step_memory_allocations']:10.1f}   allocations from one slab of "
                  f"{r['slab_mb']:.1f} MB (slab_mb; planned by lifetimes, the same addresses every step), its "
                  f"arrays' peak {r['peak_live_mb']:.1f} MB alive at once (peak_live_mb)", file=out)
        print(f"  bytes moved        {r['bytes_moved_mb']:10.1f} MB at batch {r['batch']}", file=out)
        print("  most launched: " + "; ".join(f"{n} ({k}) {c:g}" for k, n, c in r["top_operations"][:6]), file=out)


def print_counts_markdown(rows: list, out=None) -> None:
    """The counts as Markdown: one row per measurement, the launches by kind, and the lint."""
    out = out or sys.stdout
    kinds = ("elementwise", "reduction", "raw", "matmul", "copy", "random", "sort")
    print("| " + " | ".join(["preset", "measurement", "per", "launches", *kinds, "Adam", "syncs",
                             "pool allocations", "MB moved"]) + " |", file=out)
    print("|---|---|---|" + "---:|" * (len(kinds) + 5), file=out)
    for r in rows:
        if r["name"] in ("counts_lint", "counts_capture"):
            continue
        by = r["launches_by_kind"]
        cells = [r["preset"], r["name"].replace("counts_", ""), r["per"], f"{r['launches']:g}",
                 *(f"{by.get(k, 0):g}" for k in kinds), f"{r['optimizer_launches']:g}" if "optimizer_launches" in r
                 else "", f"{r['syncs']:g}", f"{r['pool_allocations']:g}", f"{r['bytes_moved_mb']:,.0f}"]
        print("| " + " | ".join(cells) + " |", file=out)
        if r.get("targets"):
            t = r["targets"]
            print("| " + " | ".join([r["preset"], "target", r["per"], f"{t['launches']}" if "launches" in t else "",
                                     *("" for _ in kinds), f"{t['optimizer_launches']}", f"{t['syncs']}",
                                     f"{t['pool_allocations']}", ""]) + " |", file=out)
    for r in rows:
        if r["name"] == "counts_train_step":
            print(f"\n{r['preset']}, the training step's most launched: " + "; ".join(
                f"{n} ({k}) {c:g}" for k, n, c in r["top_operations"][:8]) + ".", file=out)
            if r.get("step_memory_allocations"):
                print(f"\n{r['preset']}, the training step's step memory: {r['step_memory_allocations']:g} "
                      f"allocations from one slab of {r['slab_mb']:.1f} MB at batch {r['batch']} (planned by "
                      f"lifetimes: its arrays' peak alive at once is {r['peak_live_mb']:.1f} MB).", file=out)
    for r in rows:
        if r["name"] == "counts_capture":
            print(f"\n{r['preset']}: {r['what']}: " + (", ".join(f"{k} {n}" for k, n in r["refused"].items())
                                                           if r["total"] else "none") + ".", file=out)
    for r in rows:
        if r["name"] == "counts_lint":
            ks = r["fixed_grid_kernels"]
            print(f"\n{r['preset']}: {r['what']}: " + (", ".join(
                f"`{k['kernel']}` ({_blocks(k['blocks'])} for a work of {k['work_small']:,} and {k['work_large']:,} "
                "elements)" for k in ks) if ks else "none") + ".", file=out)

"""Timing: warm-up, then the frameworks' runs alternated; device synchronisation."""
from __future__ import annotations

import sys
import time

from .. import backend as B
from .work import Work


def _progress(msg: str, quiet: bool):
    if not quiet:
        print(f"[attn.bench] {msg}", file=sys.stderr, flush=True)


def ready(f) -> None:
    """Build what ``f`` builds on its first call (the matmul replay's operands) before it is timed."""
    if getattr(f, "built", True) is False:
        f.build()


def time_work(w: Work, settle: float, quiet: bool, replay: bool = True) -> dict:
    """Both frameworks in this process ("interleaved"): warm up both sides, then alternate
    timed runs (ours, PyTorch, ours, ...), and the step's matmul replay when ``replay``.
    Returns {"ours": [...], "torch": [...], "matmul": [...]} seconds."""
    fns = [("ours", w.ours)] + ([("torch", w.torch)] if w.torch is not None else [])
    fns += [("matmul", w.replay)] if replay and w.replay is not None else []
    for _, f in fns:
        ready(f)
    for _ in range(w.warmup):
        for _, f in fns:
            f()
    times = {k: [] for k, _ in fns}
    for r in range(w.repeats):
        for k, f in fns:
            if settle:
                time.sleep(settle)            # let the other library's idle threads stop spinning
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
        last = ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items())
        _progress(f"{w.name} (interleaved): run {r + 1}/{w.repeats}: {last}", quiet)
    return times


def _syncs(backend: str, with_torch: bool):
    """Device synchronisation for timing (no-ops on the CPU) and PyTorch's device."""
    if backend == "cupy":
        cp = B.xp()

        def sync():
            cp.cuda.Device().synchronize()
        device = "cuda"
    else:
        def sync():
            pass
        device = "cpu"
    tsync = sync
    if with_torch and device == "cuda":
        import torch

        def tsync():
            torch.cuda.synchronize()
    return sync, tsync, device

"""Peak memory of one step, measured in child processes (see :mod:`attn.bench`)."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from .. import backend as B
from .presets import _bench_config
from .timing import _progress, _syncs
from .work import build_work

def _rss_kb(field_name: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field_name} in /proc/self/status")


class _PeakMeter:
    """Peak memory growth of a callable on the current backend (see the module docstring)."""

    def __init__(self, backend: str, framework: str):
        self.backend, self.framework = backend, framework

    def __call__(self, f) -> dict:
        out = {}
        if self.backend == "cupy":
            if self.framework == "torch":
                import torch
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                f()
                torch.cuda.synchronize()
                out["peak_memory_mb"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            else:
                cp = B.xp()
                hook = _cupy_peak_hook(cp)
                cp.cuda.Device().synchronize()
                with hook:
                    f()
                    cp.cuda.Device().synchronize()
                from ..fast.gpu.stepmem import held_bytes
                step = held_bytes()          # the step memory: made before the hook, used by every step
                out["peak_memory_mb"] = (hook.peak + step) / 2 ** 20
                out["step_memory_mb"] = step / 2 ** 20
            return out
        import tracemalloc
        traced = self.framework == "attn"
        if traced and not tracemalloc.is_tracing():
            tracemalloc.start()
            f()                       # a call under tracing first: tracing's own first-call allocations
        gc.collect()                  # garbage of earlier calls (either framework's) is not in the base
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            base = _rss_kb("VmRSS")
            if traced:
                tracemalloc.reset_peak()
                t0 = tracemalloc.get_traced_memory()[0]
            f()
            out["peak_memory_mb"] = (_rss_kb("VmHWM") - base) / 1024
        except OSError:
            out["peak_memory_mb"] = None
            if traced:
                tracemalloc.reset_peak()
                t0 = tracemalloc.get_traced_memory()[0]
                f()
        if traced:
            out["tracemalloc_peak_mb"] = (tracemalloc.get_traced_memory()[1] - t0) / 2 ** 20
        return out


def _cupy_peak_hook(cp):
    """A CuPy memory hook recording the peak of bytes handed out by the pool during its ``with``."""
    class Peak(cp.cuda.MemoryHook):
        name = "attn-bench-peak"

        def __init__(self):
            super().__init__()
            self.used = self.peak = 0
            self.live = {}                   # pointer -> bytes of the blocks handed out during the with

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            self.live[mem_ptr] = mem_size
            self.used += mem_size
            self.peak = max(self.peak, self.used)

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            self.used -= self.live.pop(mem_ptr, 0)      # a block handed out before the hook: not counted
    return Peak()


#: Most extra warm-up calls of a training step on CuPy before its peak is measured: until its
#: step memory runs it on a plan (a step traced, or spilled past its plan into the pool, would
#: count the pool's blocks on top of the slab).
SETTLE_CALLS = 6


def _settle(f) -> None:
    """Call ``f`` until its step memory (``f.step_memory``, where it has one) ran a step on a plan
    with nothing from the pool, at most :data:`SETTLE_CALLS` times."""
    memory = getattr(f, "step_memory", None)
    for _ in range(SETTLE_CALLS if memory is not None else 0):
        if memory.last_outcome == "planned" and memory.overflows == 0:
            return
        f()


def _memory_child(args) -> None:
    """``--_memory-child attn|torch``: measure every requested measurement's peak, print JSON."""
    bc = _bench_config(args)
    framework = args._memory_child
    with_torch = framework == "torch"
    sync, tsync, device = _syncs(args.backend, with_torch)
    work = build_work(bc, args.only, args.backend, with_torch, sync, tsync, device, with_ours=not with_torch,
                      precision=args.precision)
    meter = _PeakMeter(args.backend, framework)
    result = {}
    for w in work:
        if w.name.endswith("_reference") and with_torch:
            continue
        if w.name.endswith("_uncached") and not args.memory_all:
            continue
        f = w.torch if with_torch else w.ours
        if f is None:
            continue
        if not w.name.startswith(("greedy", "beam")):
            f()
            f()                           # warm-up: optimizer state and first-call allocations exist
            _settle(f)                    # and the step memory's plan holds
        result[w.name] = meter(f)
        memory = getattr(f, "step_memory", None)
        if memory is not None:
            result[w.name]["step_memory_outcome"] = memory.last_outcome
    print(json.dumps(result))


def memory_command(args, framework: str) -> list:
    """The command of the memory child for ``framework``: the parent's preset, block, precision,
    backend, measurements and threads, so that it measures the step the parent times."""
    cmd = [sys.executable, "-m", "attn.bench", "--_memory-child", framework, "--preset", args.preset,
           "--block", args.block, "--backend", args.backend, "--only", ",".join(args.only)]
    if args.precision:
        cmd += ["--precision", args.precision]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.memory_all:
        cmd += ["--memory-all"]
    return cmd


def measure_memory(args, framework: str, quiet: bool) -> dict:
    """Run a child process for one framework; {measurement: {peak_memory_mb, ...}} or {}."""
    cmd = memory_command(args, framework)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    _progress(f"peak memory ({framework}) in a child process", quiet)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    except subprocess.TimeoutExpired:
        return {}
    if r.returncode != 0:
        _progress(f"memory child for {framework} failed:\n{r.stderr[-2000:]}", quiet)
        return {}
    return json.loads(r.stdout.strip().splitlines()[-1])

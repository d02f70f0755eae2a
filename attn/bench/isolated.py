"""Each framework timed in a process of its own.

In one process, NumPy's OpenBLAS threads and PyTorch's OpenMP threads live side by side; a
library's idle threads spin for a while after each call and can slow the other one, and not
necessarily both alike (one run on an AMD EPYC machine timed PyTorch's toy-bench step at
nearly twice what the same step takes alone). So the benchmark also runs each framework in a
worker process of its own, started with the same thread count: the attn worker never imports
PyTorch, and the PyTorch worker starts NumPy's OpenBLAS with one thread
(``OPENBLAS_NUM_THREADS=1``) and never calls it. The parent hands the two workers their runs
in turn (attn, PyTorch, attn, ...), sleeping ``settle`` seconds before each so that the other
process's threads have gone back to sleep, and the workers time each run themselves.

The protocol is one JSON object per line: the worker prints ``{"ready": true, "info": {...}}``
once its measurements are built, then answers each ``{"name": ..., "side": "ours" | "torch" |
"matmul"}`` with ``{"seconds": ...}`` (or ``{"error": ...}``); an empty line or end of input
ends it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback

from .. import backend as B
from ..fast import keep_freed_memory
from .presets import _bench_config
from .timing import _progress, _syncs, ready


def _worker_args(args, framework: str) -> list:
    cmd = [sys.executable, "-m", "attn.bench", "--_worker", framework, "--preset", args.preset,
           "--backend", args.backend, "--only", ",".join(args.only)]
    for k in ("threads", "batch", "src_len", "tgt_len", "decode_batch", "decode_steps", "beam"):
        v = getattr(args, k, None)
        if v is not None:
            cmd += ["--" + k.replace("_", "-"), str(v)]
    if args.return_freed_memory:
        cmd += ["--return-freed-memory"]
    if getattr(args, "precision", None):
        cmd += ["--precision", args.precision]
    if getattr(args, "block", "paper") != "paper":
        cmd += ["--block", args.block]
    return cmd


def torch_info() -> dict:
    """PyTorch's version, threads and the BLAS it was built with (``torch.__config__``)."""
    import torch
    info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "torch_float32_matmul_precision": torch.get_float32_matmul_precision(),
            "torch_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32)}
    try:
        cfg = torch.__config__.show()
        for key in ("BLAS_INFO", "LAPACK_INFO"):
            m = re.search(key + r"=([^,\s]+)", cfg)
            if m:
                info["torch_" + key.lower()] = m.group(1)
        mkl = [ln.strip(" -") for ln in cfg.splitlines() if "Math Kernel Library" in ln]
        if mkl:
            info["torch_mkl"] = mkl[0]
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:            # an unusual build: the version and threads are enough
        pass
    return info


def worker_main(args) -> None:
    """``--_worker attn|torch``: build one framework's measurements, then run them on request."""
    from .work import build_work
    framework = args._worker
    B.set_backend(args.backend)
    with_torch = framework == "torch"
    threads = None
    if args.backend == "numpy" and not with_torch and args.threads:
        threads = B.blas_threads(args.threads)
    if with_torch:
        import torch
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if not args.return_freed_memory:
        keep_freed_memory()
    sync, tsync, device = _syncs(args.backend, with_torch)
    bc = _bench_config(args)
    # Each worker builds its own framework's side alone (the replay of the step's matmuls is
    # drawn on the device at its first run, in the attn worker).
    work = {w.name: w for w in build_work(bc, args.only, args.backend, with_torch, sync, tsync, device,
                                          with_ours=not with_torch, precision=getattr(args, "precision", None))}
    info = {"pid": os.getpid(), "framework": framework, "blas_threads": B.blas_threads(), "blas": B.blas_info()}
    if with_torch:
        info.update(torch_info())
    out = sys.stdout
    print(json.dumps({"ready": True, "info": info}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        try:
            w = work[req["name"]]
            if req["side"].startswith("phases:"):
                phases = w.phases[req["side"].split(":", 1)[1]]()
                reply = {"seconds": sum(phases.values()), "phases": phases}
            else:
                f = {"ours": w.ours, "torch": w.torch, "matmul": w.replay}[req["side"]]
                ready(f)
                t0 = time.perf_counter()
                f()
                reply = {"seconds": time.perf_counter() - t0}
        except Exception:
            reply = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps(reply), file=out, flush=True)


class Worker:
    """One framework's worker process (see the module docstring)."""

    def __init__(self, args, framework: str):
        env = dict(os.environ)
        if framework == "torch":
            env["OPENBLAS_NUM_THREADS"] = "1"        # NumPy's OpenBLAS starts no threads beside PyTorch
        self.framework = framework
        self.proc = subprocess.Popen(_worker_args(args, framework), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        self.info = self._read()["info"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"attn.bench: the {self.framework} worker exited (status {code}) "
                               "before answering; its error is above on stderr")
        return json.loads(line)

    def request(self, name: str, side: str) -> dict:
        self.proc.stdin.write(json.dumps({"name": name, "side": side}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        if "error" in r:
            raise RuntimeError(f"attn.bench: {name} ({side}) failed in the {self.framework} worker:\n{r['error']}")
        return r

    def run(self, name: str, side: str) -> float:
        return self.request(name, side)["seconds"]

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def time_isolated(workers: dict, w, settle: float, quiet: bool, replay: bool = True) -> dict:
    """Warm up, then alternate timed runs between the workers ({"ours": Worker, "torch": Worker
    or absent}); the attn worker also replays the step's matmuls when ``replay``. Returns
    {"ours": [...], "torch": [...], "matmul": [...]} seconds."""
    sides = [("ours", workers["ours"], "ours")]
    if "torch" in workers and w.torch is not None:
        sides.append(("torch", workers["torch"], "torch"))
    if replay and w.replay is not None:
        sides.append(("matmul", workers["ours"], "matmul"))
    for _ in range(w.warmup):
        for _, wk, side in sides:
            wk.run(w.name, side)
    times = {k: [] for k, _, _ in sides}
    for r in range(w.repeats):
        for k, wk, side in sides:
            if settle:
                time.sleep(settle)        # the other process's idle threads go back to sleep
            times[k].append(wk.run(w.name, side))
        last = ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items())
        _progress(f"{w.name} (isolated): run {r + 1}/{w.repeats}: {last}", quiet)
    return times


def time_phases(w, runs: int, settle: float, quiet: bool, workers: dict | None = None) -> list:
    """The training step by phase: ``runs`` phase-timed steps per framework (in the workers when
    given, taking turns, else in this process), the median of each phase. Returns
    [{"phase", "seconds", "torch_seconds"}] in the order the phases ran (ours first, then
    PyTorch's own)."""
    import statistics
    sides = [s for s in ("ours", "torch") if s in w.phases and (workers is None or s in workers)]
    got = {s: [] for s in sides}
    for r in range(runs):
        for side in sides:
            if settle:
                time.sleep(settle)
            if workers is None:
                got[side].append(w.phases[side]())
            else:
                got[side].append(workers[side].request(w.name, "phases:" + side)["phases"])
    _progress(f"{w.name}: {runs} phase-timed steps per framework", quiet)
    order: list = []
    for side in sides:                  # ours in order; a phase only PyTorch has goes before the next shared one
        names = list(got[side][0])
        for i, phase in enumerate(names):
            if phase not in order:
                later = [order.index(n) for n in names[i + 1:] if n in order]
                order.insert(min(later) if later else len(order), phase)
    rows = {phase: {"phase": phase, "seconds": None, "torch_seconds": None} for phase in order}
    for side in sides:
        key = "seconds" if side == "ours" else "torch_seconds"
        for phase in got[side][0]:
            rows[phase][key] = statistics.median(run.get(phase, 0.0) for run in got[side])
    return list(rows.values())

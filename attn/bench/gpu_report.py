"""``python -m attn.bench --gpu-report DIR``: what a GPU run must show, in one command.

For whoever is lent a GPU for ten minutes. In order, each step a child process with a time
limit, its output kept in ``DIR/logs``:

1. **the test suite on real CuPy** (``ATTN_BACKEND=cupy python -m pytest -q``, on 8 workers where
   pytest-xdist is installed, the files only a GPU can fail first: :data:`FIRST_TESTS`), stopped
   at its time limit if it runs over: the counts of passed, failed and skipped tests, and the
   failures by name. Meanwhile, on the CPU, the counts of
   :mod:`attn.bench.counts` for ``toy-bench`` and ``base`` (the stand-in needs no GPU, and the
   suite's timings are not reported, so sharing the CPU costs nothing that matters);
2. **the benchmark against PyTorch on the same GPU** (``python -m attn.bench --backend cupy --json``
   for ``toy-bench``, ``small`` and ``base``, each framework in its own worker process, phases
   timed with CUDA events, PyTorch at attn's precision);
3. **a 3-minute toy training** (``attn-train --backend cupy --minutes 3``): test BLEU and tokens/s;

then one Markdown page (``DIR/REPORT.md``) and one JSON file (``DIR/report.json``): the device
and versions, the suite's result, each measurement's seconds for attn and PyTorch with the
counted launches, syncs and allocations beside them, the step by phase, the training run,
the counts against their targets, and every command with its exit status and seconds.

Without a usable GPU it stops at once, saying why. ``--dry-run`` runs the same pipeline on the
CuPy stand-in, cheaply (one small test file, the ``quick`` preset, a 2-step training): it proves
that the report is assembled, not any figure in it.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import backend as B
from .timing import _progress

#: (preset, measurements, seconds allowed) of the benchmark step. The limits of all steps add up
#: to 580 s, so that the report ends within 10 minutes whatever runs over.
BENCH_PLAN = (("toy-bench", "train_step,train_step_graph,train_step_reference,forward,greedy_cached,beam_cached", 105),
              ("small", "train_step,train_step_graph,forward,greedy_cached", 55),
              ("base", "train_step,forward", 105))
#: Timed runs and warm-up runs per measurement (the benchmark prints its rows only at the end,
#: so a preset that runs over its limit reports nothing: fewer runs than a full benchmark's).
BENCH_RUNS = ("--repeats", "5", "--warmup", "2")
#: Seconds for the suite, and the training's minutes and seconds allowed (evaluation included).
SUITE_SECONDS = 75
TRAIN_MINUTES, TRAIN_SECONDS = 3, 240
#: The tests that only a GPU can fail run first (pytest collects a file once), then the rest, until
#: the suite's time limit: without pytest-xdist the whole suite takes longer than the report has.
FIRST_TESTS = ("tests/test_fast.py", "tests/test_kernels.py", "tests/test_host_syncs.py", "tests/test_layers.py",
               "tests/test_model.py", "tests/test_decode.py", "tests/test_loss.py", "tests/test_optim.py")
#: The presets whose counts are taken (during the suite, on the CPU), and their time limit.
COUNT_PRESETS, COUNT_SECONDS = ("toy-bench", "base"), 400


class GpuReportError(RuntimeError):
    """The report cannot be made here (no usable GPU)."""


def _python(*args) -> list:
    return [sys.executable, *args]


class _Step:
    """One child process of the report: started, then waited for within its time limit (its
    whole process group is ended at the limit, the benchmark's workers with it)."""

    def __init__(self, name: str, cmd: list, env: dict, limit: float, logs: Path):
        self.name, self.cmd, self.limit = name, cmd, limit
        self.log = logs / f"{name}.log"
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, cwd=Path(__file__).resolve().parents[2])

    def wait(self) -> dict:
        left = max(1.0, self.limit - (time.perf_counter() - self.t0))
        timed_out = False
        try:
            out, _ = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                out, _ = self.proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                out, _ = self.proc.communicate()
        self.log.write_text(out or "")
        return {"name": self.name, "command": " ".join(["python", *self.cmd[1:]]),
                "returncode": self.proc.returncode, "seconds": round(time.perf_counter() - self.t0, 1),
                "limit_seconds": self.limit, "timed_out": timed_out, "log": str(self.log), "output": out or ""}


def _json_rows(text: str) -> list:
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def suite_summary(output: str, timed_out: bool) -> dict:
    """pytest's result from its ``-q -rfE`` output: counts by outcome (from the last summary
    line, or from the progress characters where the run was stopped) and the failures."""
    import re
    counts = {}
    last = [ln for ln in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    if last:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", last[-1]):
            counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
    else:                                        # stopped: count the progress characters so far
        prog = "".join(m.group(1) for m in re.finditer(r"^([.FEsxX]+)\s*(?:\[\s*\d+%\])?\s*$", output, re.M))
        for ch, what in ((".", "passed"), ("F", "failed"), ("E", "error"), ("s", "skipped")):
            if prog.count(ch):
                counts[what] = prog.count(ch)
    failures = [ln.split(" ", 1)[1].split(" - ")[0] for ln in output.splitlines()
                if ln.startswith(("FAILED ", "ERROR "))]
    return {"counts": counts, "failures": failures, "stopped_at_time_limit": timed_out}


def _device_info(env: dict) -> dict:
    """The GPU and the versions, from a child process on the report's backend."""
    code = ("import json, platform, numpy, attn.backend as B; B.set_backend('cupy'); cp = B.xp(); "
            "p = cp.cuda.runtime.getDeviceProperties(0); "
            "info = dict(gpu=p['name'].decode(), cupy=cp.__version__, numpy=numpy.__version__, "
            "cuda_runtime=cp.cuda.runtime.runtimeGetVersion(), cuda_driver=cp.cuda.runtime.driverGetVersion(), "
            "python=platform.python_version())\n"
            "try:\n import torch; info.update(torch=torch.__version__, torch_cuda=torch.version.cuda)\n"
            "except Exception: pass\n"
            "print(json.dumps(info))")
    r = subprocess.run(_python("-c", code), env=env, capture_output=True, text=True, timeout=120)
    rows = _json_rows(r.stdout)
    return rows[-1] if rows else {"error": r.stderr[-500:]}


def _commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parents[2])
        return r.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def gpu_report(out: Path, dry_run: bool = False, quiet: bool = False) -> dict:
    """Run the report into ``out``; returns it (also written as ``report.json`` and ``REPORT.md``).

    Raises :class:`GpuReportError` at once where no GPU is usable (unless ``dry_run``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if dry_run:
        from .counts import stand_in
        env = stand_in().child_env(env)            # every child process runs on the CuPy stand-in
    else:
        if B.cupy_modules is not None:
            raise GpuReportError("--gpu-report measures a GPU, and the CuPy stand-in is selected in this process; "
                                 "--gpu-report DIR --dry-run runs the pipeline on the stand-in")
        try:
            B.set_backend("cupy")
        except B.BackendError as e:
            raise GpuReportError(f"--gpu-report measures a GPU, and none is usable here: {e.reason}. "
                                 "Run it where `python -c \"import cupy; cupy.zeros(1)\"` works, or check the "
                                 "pipeline on the CuPy stand-in with --gpu-report DIR --dry-run.") from None
        env["ATTN_BACKEND"] = "cupy"
    out = Path(out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"name": "gpu_report", "dry_run": dry_run, "commit": _commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "host": platform.node(), "device": _device_info(env), "steps": []}

    def say(msg):
        _progress(f"gpu report ({time.perf_counter() - started:5.0f} s): {msg}", quiet)

    # 1. the suite, with the counts on the CPU beside it
    count_presets = ("quick",) if dry_run else COUNT_PRESETS
    counting = [_Step(f"counts-{p}", _python("-m", "attn.bench", "--counts", "--json", "--quiet", "--preset", p),
                      env, 120 if dry_run else COUNT_SECONDS, logs) for p in count_presets]
    suite_cmd = _python("-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider")
    try:
        import xdist  # noqa: F401  (optional: the suite on 8 workers)
        suite_cmd += ["-n", "8"]
    except ImportError:
        pass
    suite_cmd += ["tests/test_text.py"] if dry_run else [*FIRST_TESTS, "tests"]
    say("the test suite on " + ("the CuPy stand-in" if dry_run else "the GPU") + " (and the counts on the CPU)")
    suite = _Step("suite", suite_cmd, env, 60 if dry_run else SUITE_SECONDS, logs).wait()
    report["suite"] = suite_summary(suite["output"], suite["timed_out"])
    report["steps"].append(suite)

    # 2. the benchmark, preset by preset (a dry run: the quick preset, once)
    report["bench"] = {}
    plan = (("quick", "train_step,forward,greedy_cached", 120),) if dry_run else BENCH_PLAN
    for preset, only, limit in plan:
        cmd = _python("-m", "attn.bench", "--backend", "cupy", "--json", "--quiet", "--no-interleaved")
        cmd += ["--preset", preset, "--only", only]
        cmd += ["--no-torch", "--no-memory", "--repeats", "1", "--warmup", "1"] if dry_run else list(BENCH_RUNS)
        say(f"the benchmark, {preset}")
        step = _Step(f"bench-{preset}", cmd, env, limit, logs).wait()
        report["steps"].append(step)
        report["bench"][preset] = _json_rows(step["output"])

    # 3. a 3-minute toy training
    train_dir = out / "train"
    cmd = _python("-m", "attn.train", "--backend", "cupy", "--out", str(train_dir), "--overwrite", "--quiet")
    if dry_run:
        cmd += ["--steps", "2", "--minutes", "0", "--d-model", "16", "--heads", "2", "--d-ff", "32", "--layers", "1",
                "--bleu-sentences", "5", "--average", "0", "--eval-every", "2"]
    else:
        cmd += ["--minutes", str(TRAIN_MINUTES)]
    say("training the toy translator" + (" for 2 steps" if dry_run else f" for {TRAIN_MINUTES} minutes"))
    step = _Step("train", cmd, env, 180 if dry_run else TRAIN_SECONDS, logs).wait()
    report["steps"].append(step)
    metrics = train_dir / "metrics.json"
    report["train"] = json.loads(metrics.read_text()) if metrics.is_file() else None

    # the counts, taken meanwhile
    report["counts"] = {}
    for c in counting:
        step = c.wait()
        report["steps"].append(step)
        report["counts"][step["name"].split("-", 1)[1]] = _json_rows(step["output"])
    report["seconds"] = round(time.perf_counter() - started, 1)
    for s in report["steps"]:
        s.pop("output")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "REPORT.md").write_text(render_markdown(report))
    say(f"written {out / 'REPORT.md'} and {out / 'report.json'}")
    return report


def _f(x, fmt="{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def render_markdown(report: dict) -> str:
    """The report as one Markdown page."""
    d = report["device"]
    lines = ["# attn on a GPU: the report", ""]
    if report["dry_run"]:
        lines += ["**Dry run on the CuPy stand-in** (`--dry-run`): the pipeline, not a GPU's figures.", ""]
    lines += [f"{report['date']}, commit {report.get('commit') or '-'}, {report['seconds']:.0f} s in all. "
              f"Device: {d.get('gpu', '-')}; CuPy {d.get('cupy', '-')}, CUDA runtime {d.get('cuda_runtime', '-')} "
              f"(driver {d.get('cuda_driver', '-')}), NumPy {d.get('numpy', '-')}, PyTorch {d.get('torch', '-')} "
              f"(CUDA {d.get('torch_cuda', '-')}), Python {d.get('python', '-')}.", ""]
    s = report["suite"]
    c = s["counts"]
    lines += ["## The test suite on the GPU", "",
              f"`ATTN_BACKEND=cupy {report['steps'][0]['command']}`: " + (", ".join(f"{n} {k}" for k, n in c.items()) or "no result")
              + (" (stopped at its time limit)" if s["stopped_at_time_limit"] else "") + ".", ""]
    lines += [f"* failed: `{f}`" for f in s["failures"][:30]] + ([""] if s["failures"] else [])
    counted = {}
    for preset, rows in report.get("counts", {}).items():
        for r in rows:
            counted[(preset, r["name"].replace("counts_", ""))] = r
    lines += ["## attn against PyTorch on the same GPU", "",
              "Seconds per run (median, each framework in a worker process of its own); beside each, what "
              "the stand-in counts for attn's side (launches, host syncs and pool allocations per training "
              "step, or per generated position).", ""]
    for preset, rows in report.get("bench", {}).items():
        meas = [r for r in rows if "seconds_per_step" in r and r.get("name") not in ("machine", "matmul")]
        lines += [f"### {preset}", ""]
        if not meas:
            lines += ["No measurement (see the step's log).", ""]
            continue
        lines += ["| measurement | attn s | PyTorch s | attn / PyTorch | launches | syncs | pool allocations |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in meas:
            k = counted.get((preset, r["name"]))
            lines.append(f"| {r['name']} | {_f(r['seconds_per_step'])} | {_f(r.get('torch_seconds_per_step'))} | "
                         f"{_f(r.get('ratio'), '{:.2f}')} | {_f(k and k['launches'], '{:g}')} | "
                         f"{_f(k and k['syncs'], '{:g}')} | {_f(k and k['pool_allocations'], '{:g}')} |")
        lines.append("")
        for r in meas:
            if r.get("matmul_seconds_per_step"):
                lines.append(f"{r['name']}: its matrix products alone take {r['matmul_seconds_per_step']:.4f} s "
                             f"({r.get('fraction_of_matmul_rate', 0):.0%} of the step).")
            if r.get("phases"):
                lines += ["", f"{r['name']} by phase (CUDA events, ms):", "",
                          "| phase | attn | PyTorch |", "|---|---:|---:|"]
                lines += [f"| {p['phase']} | {_f(p['seconds'] and p['seconds'] * 1e3, '{:.2f}')} | "
                          f"{_f(p['torch_seconds'] and p['torch_seconds'] * 1e3, '{:.2f}')} |" for p in r["phases"]]
                lines.append("")
        lines.append("")
    t = report.get("train")
    lines += ["## Training the toy translator", ""]
    train_cmd = next((st["command"] for st in report["steps"] if st["name"] == "train"), "")
    if t:
        lines += [f"`{train_cmd.replace('python -m attn.train', 'attn-train')}`: test BLEU {t.get('test_bleu', 0):.2f}, "
                  f"{t.get('steps')} steps, {t.get('tokens_per_second', 0):,.0f} tokens/s, backend "
                  f"{t.get('backend')}.", ""]
    else:
        lines += ["No metrics.json (see the step's log).", ""]
    lines += ["## Counts against their targets", "",
              "| preset | launches per step | Adam launches | host syncs | pool allocations | MB moved | "
              "fixed-grid kernels | a capture refuses |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for preset, rows in report.get("counts", {}).items():
        by = {r["name"]: r for r in rows}
        r, lint, cap = by.get("counts_train_step"), by.get("counts_lint", {}), by.get("counts_capture", {})
        if r is None:
            continue
        tg = r.get("targets", {})

        def vs(key, fmt="{:g}"):
            return fmt.format(r[key]) + (f" (target {tg[key]})" if key in tg else "")
        lines.append(f"| {preset} | {vs('launches')} | {vs('optimizer_launches')} | {vs('syncs')} | "
                     f"{vs('pool_allocations')} | {r['bytes_moved_mb']:.0f} | "
                     f"{', '.join(k['kernel'] for k in lint.get('fixed_grid_kernels', [])) or 'none'} | "
                     f"{', '.join(f'{k} {n}' for k, n in cap.get('refused', {}).items()) or 'nothing'} |")
    lines += ["", "## Commands", "", "| step | command | exit | seconds |", "|---|---|---:|---:|"]
    for st in report["steps"]:
        lines.append(f"| {st['name']} | `{st['command']}` | {st['returncode']}"
                     f"{' (time limit)' if st['timed_out'] else ''} | {st['seconds']:.0f} |")
    return "\n".join(lines) + "\n"

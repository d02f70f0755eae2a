"""``python -m attn.bench --gpu-report DIR``: what a GPU run must show, part by part.

For a GPU machine that runs a command for at most ten minutes. The report is made of parts
(``--part``, :data:`PARTS`; all of them, in order, by default), each a list of tasks, and each
task one child process with a time limit, its output kept in ``DIR/logs``:

* ``preflight``: the riskiest paths first, in minutes (:mod:`attn.bench.preflight`: the kernels'
  compile, a tiny step, the step memory's weak references and plans, the capture mode and guard,
  cuBLAS on views, bf16 and tf32, the captured step against eager), one PASS/FAIL line each;
* ``suite``: the test suite on real CuPy (the files only a GPU can fail first:
  :data:`FIRST_TESTS`), and beside it, on the CPU, the counts of :mod:`attn.bench.counts` for
  ``toy-bench`` and ``base`` (the suite is not timed, so sharing the CPU costs nothing that matters);
* ``bench``: every measurement of :data:`BENCH_PLAN` against PyTorch, one child process each;
* ``precision``: the training step at ``--precision bf16`` and ``tf32``, PyTorch at the same;
* ``base``: the ``base`` preset's measurements and precisions (a part of its own, to fit);
* ``graph``: the captured step (``train_step_graph``, what ``attn-train --cuda-graph`` runs) at
  fp32 and bf16, its two eager calls and its capture among the warm-up runs, never timed;
* ``train``: ``attn-train`` for 3 minutes, and with ``--cuda-graph`` for 2;
* ``memory``: the training step's peak GPU memory, attn's (the step memory's slab included) beside
  PyTorch's, each in a child process of its own;
* ``attention``: one attention alone, plain, tiled and PyTorch's;
* ``tensor-cores``: the tensor-core attention (never run on a GPU before it) against its NumPy
  twins, then timed against PyTorch's SDPA in bf16 at T = 1,024 to 8,192 (:mod:`attn.bench.tensor_cores`).

**Every measurement is isolated**: a task that fails, raises or runs past its limit is one row
that says what failed and why (the last lines of its output), and every other row is still
there. ``DIR/report.json`` and ``DIR/REPORT.md`` are rewritten as each task finishes, so a report
cut short keeps what was done. A part's limits, with the report's own children before it and a
kill's grace per task (:func:`part_limits`), add up to less than :data:`PART_SECONDS` (checked by
the tests), so each part ends well inside 10 minutes whatever runs over; only the suite part runs two things at once (the counts, on the CPU, beside the
untimed suite): nothing runs beside a timing. Before anything, a **preflight** lists what is
missing (:data:`NEEDED`); a task that needs it is a row saying so, not a failure.

Without a usable GPU it stops at once, saying why. ``--dry-run`` runs the same parts on the CuPy
stand-in, cheaply (one small test file, the ``quick`` preset, a 2-step training on the first
:data:`DRY_PAIRS` pairs of each split of the toy corpus): it proves that
the report is assembled and survives a failing task, not any figure in it.
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
from dataclasses import dataclass, field
from pathlib import Path

from .. import backend as B
from .machine import commit
from .timing import _progress

#: The parts, in the order ``--part all`` runs them.
PARTS = ("preflight", "suite", "bench", "base", "precision", "graph", "train", "memory", "attention", "tensor-cores")
#: The most one part may take (seconds, :func:`part_limits`): under the 600 s a command may run on
#: a lent machine, with room for the report's own start.
PART_SECONDS = 560
#: Seconds allowed to each of the report's own children before any part (what is installed, the
#: device and versions), and to a task's process group between SIGTERM and SIGKILL.
CHILD_SECONDS, KILL_GRACE = 30, 5
#: Seconds for the ``preflight`` part (:mod:`attn.bench.preflight`: the kernels' cold compile, then
#: a dozen small checks).
PREFLIGHT_SECONDS = 420
#: (preset, measurement, seconds allowed) of the ``bench`` part (the ``base`` preset's: of the
#: ``base`` part), each a child process.
BENCH_PLAN = (("toy-bench", "train_step", 60), ("toy-bench", "train_step_reference", 50),
              ("toy-bench", "forward", 40), ("toy-bench", "greedy_cached", 50), ("toy-bench", "beam_cached", 50),
              ("small", "train_step", 60), ("small", "forward", 40), ("small", "greedy_cached", 50),
              ("base", "train_step", 90), ("base", "forward", 60))
#: (preset, precision, seconds allowed) of the ``precision`` part (the ``base`` preset's: of the
#: ``base`` part): the training step.
PRECISION_PLAN = (("toy-bench", "bf16", 60), ("toy-bench", "tf32", 60), ("small", "bf16", 75),
                  ("small", "tf32", 75), ("base", "bf16", 110), ("base", "tf32", 110))
#: (preset, precision, seconds allowed) of the ``graph`` part: ``train_step_graph``.
GRAPH_PLAN = (("toy-bench", "fp32", 75), ("toy-bench", "bf16", 75), ("small", "fp32", 90), ("small", "bf16", 90))
#: (preset, framework, seconds allowed) of the ``memory`` part: the training step's peak.
MEMORY_PLAN = (("toy-bench", "attn", 50), ("toy-bench", "torch", 50), ("small", "attn", 60), ("small", "torch", 60),
               ("base", "attn", 90), ("base", "torch", 90))
#: Seconds allowed to the ``attention`` part's one task: ``--attention`` (one attention alone, plain,
#: tiled and PyTorch's, T = 128 to 8,192).
ATTENTION_SECONDS = 240
#: Seconds allowed to the ``tensor-cores`` part's one task (:mod:`attn.bench.tensor_cores`: the
#: tensor-core attention's kernels against their twins, then timed against PyTorch's SDPA in bf16).
TENSOR_CORES_SECONDS = 420
#: Timed runs and warm-up runs per measurement (three warm-ups: the captured step's two eager
#: calls and its capture are all untimed).
BENCH_RUNS = ("--repeats", "5", "--warmup", "3")
#: Seconds for the suite; the counts' presets and seconds (beside the suite).
SUITE_SECONDS = 240
COUNT_PLAN = (("toy-bench", 100), ("base", 200))
#: Pairs of each split of the toy corpus (train, val, test) the dry run's trainings read: its
#: validation and final test translation then decode that many sentences, not the corpus's 1,000.
DRY_PAIRS = 200
#: (minutes, seconds allowed) of the eager training and of the ``--cuda-graph`` one.
TRAIN_PLAN = ((3, 240), (2, 180))
TRAIN_MINUTES, TRAIN_SECONDS = TRAIN_PLAN[0]
#: The tests that only a GPU can fail run first (pytest collects a file once), then the rest, until
#: the suite's time limit.
FIRST_TESTS = ("tests/test_fast.py", "tests/test_fast_decoding.py", "tests/test_kernels.py", "tests/test_graph.py",
               "tests/test_stepmem.py", "tests/test_host_syncs.py", "tests/test_cublas.py", "tests/test_precision.py",
               "tests/test_layers.py", "tests/test_model.py", "tests/test_decode.py", "tests/test_loss.py",
               "tests/test_optim.py")
#: What the parts need beyond attn: module -> the parts that cannot run without it (CuPy is
#: checked before the preflight: without it nothing runs).
NEEDED = {"pytest": ("suite",), "hypothesis": ("suite",), "torch": ("memory-torch",), "tqdm": ("train",),
          "sacrebleu": ("train",)}


class GpuReportError(RuntimeError):
    """The report cannot be made here (no usable GPU, or an unknown part)."""


@dataclass
class Task:
    """One child process of the report, and what its row says."""
    part: str
    name: str
    cmd: list
    limit: float
    kind: str                                 # suite, counts, bench, memory, train
    info: dict = field(default_factory=dict)  # preset, measurement, precision, framework
    needs: tuple = ()
    beside: bool = False                      # started with the next task and waited for at the part's end
    env: dict = field(default_factory=dict)   # added to the report's environment


def _python(*args) -> list:
    return [sys.executable, *args]


def _bench_cmd(preset: str, only: str, dry_run: bool, torch: bool, precision: str | None = None) -> list:
    cmd = _python("-m", "attn.bench", "--backend", "cupy", "--json", "--quiet", "--no-interleaved", "--no-memory",
                  "--preset", preset, "--only", only)
    cmd += ["--repeats", "1", "--warmup", "3"] if dry_run else list(BENCH_RUNS)
    if precision:
        cmd += ["--precision", precision]
    return cmd + ([] if torch else ["--no-torch"])


def plan(dry_run: bool = False, torch: bool = True) -> dict:
    """{part: [Task]}: the GPU's plan, or with ``dry_run`` the stand-in's (the quick preset, one
    run each, no PyTorch). ``torch``: whether PyTorch is there to compare with."""
    torch = torch and not dry_run
    parts = {p: [] for p in PARTS}
    parts["preflight"].append(Task("preflight", "preflight", _python("-m", "attn.bench.preflight"),
                                   120 if dry_run else PREFLIGHT_SECONDS, "preflight"))
    suite = _python("-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider")
    suite += ["tests/test_text.py"] if dry_run else [*FIRST_TESTS, "tests"]
    for preset, limit in ((("quick", 120),) if dry_run else COUNT_PLAN):
        parts["suite"].append(Task("suite", f"counts-{preset}", _python("-m", "attn.bench", "--counts", "--json",
                                   "--quiet", "--preset", preset), limit, "counts", {"preset": preset}, beside=True))
    parts["suite"].append(Task("suite", "suite", suite, 60 if dry_run else SUITE_SECONDS, "suite",
                               needs=("pytest", "hypothesis")))
    bench = (("quick", "train_step", 60), ("quick", "forward", 60)) if dry_run else BENCH_PLAN
    for preset, m, limit in bench:
        part = "base" if preset == "base" else "bench"
        parts[part].append(Task(part, f"bench-{preset}-{m}", _bench_cmd(preset, m, dry_run, torch), limit,
                                "bench", {"preset": preset, "measurement": m, "precision": "fp32"}))
    for preset, prec, limit in ((("quick", "bf16", 60),) if dry_run else PRECISION_PLAN):
        part = "base" if preset == "base" else "precision"
        parts[part].append(Task(part, f"precision-{preset}-{prec}", _bench_cmd(preset, "train_step", dry_run, torch,
                                                                                prec), limit, "bench",
                                {"preset": preset, "measurement": "train_step", "precision": prec}))
    for preset, prec, limit in ((("quick", "fp32", 90),) if dry_run else GRAPH_PLAN):
        parts["graph"].append(Task("graph", f"graph-{preset}-{prec}",
                                   _bench_cmd(preset, "train_step_graph", dry_run, torch, prec), limit, "bench",
                                   {"preset": preset, "measurement": "train_step_graph", "precision": prec}))
    for i, (minutes, limit) in enumerate(((0, 120), (0, 120)) if dry_run else TRAIN_PLAN):
        graph = i == 1
        cmd = _python("-m", "attn.train", "--backend", "cupy", "--overwrite", "--quiet")
        cmd += ["--cuda-graph"] if graph else []
        if dry_run:
            cmd += ["--steps", "2", "--minutes", "0", "--d-model", "16", "--heads", "2", "--d-ff", "32", "--layers",
                    "1", "--bleu-sentences", "5", "--average", "0", "--eval-every", "2"]
        else:
            cmd += ["--minutes", str(minutes)]
        name = "train-cuda-graph" if graph else "train"
        parts["train"].append(Task("train", name, cmd, limit, "train", {"cuda_graph": graph},
                                   needs=("tqdm", "sacrebleu")))
    mem = (("quick", "attn", 90),) if dry_run else MEMORY_PLAN
    for preset, fw, limit in mem:
        cmd = _python("-m", "attn.bench", "--_memory-child", fw, "--preset", preset, "--backend", "cupy",
                      "--only", "train_step")
        parts["memory"].append(Task("memory", f"memory-{preset}-{fw}", cmd, limit, "memory",
                                    {"preset": preset, "measurement": "train_step", "framework": fw},
                                    needs=("torch",) if fw == "torch" else ()))
    cmd = _python("-m", "attn.bench", "--backend", "cupy", "--attention", "--json", "--quiet")
    cmd += ["--lengths", "16,40", "--repeats", "1"] if dry_run else ["--repeats", "5"]
    parts["attention"].append(Task("attention", "attention", cmd + ([] if torch else ["--no-torch"]),
                                   60 if dry_run else ATTENTION_SECONDS, "attention"))
    cmd = _python("-m", "attn.bench.tensor_cores", "--json") + (["--dry-run"] if dry_run else [])
    parts["tensor-cores"].append(Task("tensor-cores", "tensor-cores", cmd + ([] if torch else ["--no-torch"]),
                                      90 if dry_run else TENSOR_CORES_SECONDS, "tensor-cores"))
    return parts


def part_limits(parts: dict) -> dict:
    """{part: the most seconds it may take}: the report's own children before it, the limits of
    its tasks one after another (those started beside the next ones: the longest of them) and
    each task's grace between SIGTERM and SIGKILL."""
    def most(tasks):
        beside = [t.limit for t in tasks if t.beside]
        return (2 * CHILD_SECONDS + sum(t.limit for t in tasks if not t.beside) + max(beside, default=0)
                + KILL_GRACE * len(tasks))
    return {p: most(tasks) for p, tasks in parts.items()}


def preflight(env: dict) -> dict:
    """What the parts need, checked in a child process with the report's environment:
    {"have": {module: version}, "missing": {module: why}, "torch_cuda": bool}."""
    code = ("import importlib, json\nhave, missing = {}, {}\n"
            f"for m in {sorted(NEEDED) + ['xdist']!r}:\n"
            " try:\n  mod = importlib.import_module(m); have[m] = str(getattr(mod, '__version__', '?'))\n"
            " except Exception as e:\n  missing[m] = f'{type(e).__name__}: {e}'[:200]\n"
            "cuda = False\n"
            "if 'torch' in have:\n"
            " import torch\n cuda = bool(torch.cuda.is_available())\n"
            "print(json.dumps({'have': have, 'missing': missing, 'torch_cuda': cuda}))")
    out, why = _child_json(code, env)
    if out is None:
        out = {"have": {}, "missing": {"python": why[-300:]}, "torch_cuda": False}
    out["missing"].pop("xdist", None)        # optional: the suite on 8 workers where it is there
    return out


class _Child:
    """A task's child process: started, then waited for within its limit (its whole process
    group is ended at the limit, the benchmark's workers with it)."""

    def __init__(self, task: Task, env: dict, logs: Path):
        self.task, self.log = task, logs / f"{task.name}.log"
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(task.cmd, env={**env, **task.env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     cwd=Path(__file__).resolve().parents[2])

    def wait(self) -> dict:
        left = max(1.0, self.task.limit - (time.perf_counter() - self.t0))
        timed_out = False
        try:
            out, _ = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                out, _ = self.proc.communicate(timeout=KILL_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                out, _ = self.proc.communicate()
        self.log.write_text(out or "")
        return {"returncode": self.proc.returncode, "seconds": round(time.perf_counter() - self.t0, 1),
                "timed_out": timed_out, "output": out or ""}


def _json_rows(text: str) -> list:
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def _why(output: str) -> str:
    """The reason a child failed: its last error line (a traceback's last line), else its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error:" in ln or "Exception" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


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


def task_row(task: Task, run: dict, report: dict) -> dict:
    """The row of one finished task: its status ("ok", "failed", "time limit"), why where it is
    not ok, what it measured, and the command with its exit status and seconds."""
    out = run["output"]
    row = {"part": task.part, "name": task.name, **task.info, "command": " ".join(["python", *task.cmd[1:]]),
           "returncode": run["returncode"], "seconds": run["seconds"], "limit_seconds": task.limit,
           "timed_out": run["timed_out"]}
    ok = run["returncode"] == 0 and not run["timed_out"]
    if task.kind == "preflight":
        row["checks"] = [r for r in _json_rows(out) if "check" in r]
        ok = ok and bool(row["checks"]) and all(r["ok"] for r in row["checks"])
        if row["checks"] and not ok and not run["timed_out"]:
            out = "; ".join(f"{r['check']}: {r['figure']}" for r in row["checks"] if not r["ok"]) or out
    elif task.kind == "suite":
        row["suite"] = suite_summary(out, run["timed_out"])
        ok = bool(row["suite"]["counts"])          # a suite with failures still reports its counts
    elif task.kind == "counts":
        row["rows"] = _json_rows(out)
        ok = ok and any(r.get("name") == "counts_train_step" for r in row["rows"])
    elif task.kind == "bench":
        found = [r for r in _json_rows(out) if r.get("name") == task.info["measurement"] and "seconds_per_step" in r]
        row["result"] = found[0] if found else None
        ok = ok and bool(found)
    elif task.kind == "attention":
        row["rows"] = [r for r in _json_rows(out) if r.get("name") == "attention"]
        ok = ok and bool(row["rows"])
    elif task.kind == "tensor-cores":
        row["rows"] = [r for r in _json_rows(out) if str(r.get("name", "")).startswith("tensor_cores_")]
        ok = ok and any(r["name"] == "tensor_cores_time" for r in row["rows"])
    elif task.kind == "memory":
        rows = _json_rows(out)
        row["result"] = rows[-1].get(task.info["measurement"]) if rows else None
        ok = ok and row["result"] is not None
    elif task.kind == "train":
        metrics = Path(task.cmd[task.cmd.index("--out") + 1]) / "metrics.json" if "--out" in task.cmd else None
        row["result"] = json.loads(metrics.read_text()) if metrics is not None and metrics.is_file() else None
        ok = ok and row["result"] is not None
    row["status"] = "ok" if ok else ("time limit" if run["timed_out"] else "failed")
    if not ok:
        row["why"] = (f"ran past its limit of {task.limit:g} s" if run["timed_out"]
                      else f"exit {run['returncode']}: {_why(out)}")
    return row


def _skipped(task: Task, why: str) -> dict:
    return {"part": task.part, "name": task.name, **task.info, "command": " ".join(["python", *task.cmd[1:]]),
            "status": "skipped", "why": why, "returncode": None, "seconds": 0.0, "limit_seconds": task.limit,
            "timed_out": False}


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
    out, why = _child_json(code, env)
    return out if out is not None else {"error": why[-500:]}


def _child_json(code: str, env: dict) -> tuple:
    """Run ``python -c code`` in a child with ``env``: (the last JSON line it printed, None), or
    (None, why not: the error, or the end of its standard error)."""
    try:
        r = subprocess.run(_python("-c", code), env=env, capture_output=True, text=True, timeout=CHILD_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    rows = _json_rows(r.stdout)
    return (rows[-1], None) if rows else (None, r.stderr)


def _environment(dry_run: bool) -> dict:
    from ..engine import names
    if "fast" not in names():
        raise GpuReportError(f"attn is not installed in this Python ({sys.executable}): the 'fast' engine's entry "
                             "point is missing, so every check of it would fail. Install it with this Python's pip: "
                             "`python -m pip install --no-deps --no-build-isolation -e .` from the checkout.")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if dry_run:
        from .counts import stand_in
        return stand_in().child_env(env)            # every child process runs on the CuPy stand-in
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
    return env


def gpu_report(out: Path, dry_run: bool = False, quiet: bool = False, parts=None, inject_failure: str | None = None,
               tasks: dict | None = None) -> dict:
    """Run the report's ``parts`` (all of :data:`PARTS` by default) into ``out``; returns it, also
    written as ``report.json`` and ``REPORT.md`` after the preflight and after every task.

    ``inject_failure``: a task's name whose measurement raises (the benchmark's
    :data:`attn.bench.work.INJECT_FAILURE`): the dry run's proof that one failure leaves every
    other row. ``tasks``: the plan (:func:`plan`'s), for tests. Raises :class:`GpuReportError`
    at once where no GPU is usable (unless ``dry_run``) or a part is unknown."""
    parts = list(PARTS if parts in (None, "all", ["all"]) else ([parts] if isinstance(parts, str) else parts))
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise GpuReportError(f"--part: unknown part(s) {', '.join(unknown)} (choose from {', '.join(PARTS)}, or all)")
    env = _environment(dry_run)
    out = Path(out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    pre = preflight(env)
    torch_ok = "torch" in pre["have"] and (pre["torch_cuda"] or dry_run)
    tasks = tasks if tasks is not None else plan(dry_run, torch_ok)
    report = {"name": "gpu_report", "dry_run": dry_run, "commit": commit(), "parts": parts,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "host": platform.node(), "device": _device_info(env), "preflight": pre,
              "limits": part_limits({p: tasks[p] for p in parts}), "rows": [], "seconds": 0.0}
    written = _Written(report, out, started, quiet)
    if pre["missing"]:
        written.say("missing: " + ", ".join(f"{m} ({why})" for m, why in pre["missing"].items()))
    written.write()
    for part in parts:
        _run_part(part, tasks[part], written, env, logs, torch_ok, inject_failure)
    written.say(f"written {out / 'REPORT.md'} and {out / 'report.json'}")
    return report


@dataclass
class _Written:
    """The report as it grows, written into ``out`` (``report.json``, ``REPORT.md``) after every row."""
    report: dict
    out: Path
    started: float
    quiet: bool

    def write(self) -> None:
        from .gpu_report_md import render_markdown
        self.report["seconds"] = round(time.perf_counter() - self.started, 1)
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2))
        (self.out / "REPORT.md").write_text(render_markdown(self.report))

    def say(self, msg: str) -> None:
        _progress(f"gpu report ({time.perf_counter() - self.started:5.0f} s): {msg}", self.quiet)

    def add(self, row: dict) -> None:
        self.report["rows"].append(row)
        self.write()


def _dry_corpus(folder: Path) -> Path:
    """``folder`` holding the first :data:`DRY_PAIRS` lines of each file of the toy corpus."""
    from ..data import TOY_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for f in sorted(TOY_DIR.glob("*.*")):
        if f.stem in ("train", "val", "test"):
            lines = f.read_text(encoding="utf-8").splitlines(keepends=True)[:DRY_PAIRS]
            (folder / f.name).write_text("".join(lines), encoding="utf-8")
    return folder


def _run_part(part: str, tasks: list, written: _Written, env: dict, logs: Path, torch_ok: bool,
              inject_failure: str | None) -> None:
    """One part's tasks in turn, each in its child process (those ``beside`` the others running
    alongside, their rows last); a task whose modules are missing is a skipped row."""
    from .work import INJECT_FAILURE
    missing = written.report["preflight"]["missing"]
    beside = []
    for task in tasks:
        lacking = [m for m in task.needs if m in missing or (m == "torch" and not torch_ok)]
        if lacking:
            written.add(_skipped(task, "missing: " + ", ".join(lacking)))
            continue
        if task.kind in ("train",) and "--out" not in task.cmd:
            task.cmd += ["--out", str(written.out / task.name)]
        if task.kind == "train" and written.report["dry_run"] and "--data" not in task.cmd:
            task.cmd += ["--data", str(_dry_corpus(written.out / "corpus"))]
        if inject_failure == task.name:
            task.env[INJECT_FAILURE] = task.info.get("measurement", "")
        written.say(f"{part}: {task.name} (at most {task.limit:g} s)")
        child = _Child(task, env, logs)
        if task.beside:
            beside.append(child)
            continue
        written.add(task_row(task, child.wait(), written.report))
    for child in beside:
        written.add(task_row(child.task, child.wait(), written.report))

"""``python -m attn.bench --gpu-report DIR`` (:mod:`attn.bench.gpu_report`).

* Without a GPU it stops at once with a message that says why and offers ``--dry-run``.
* ``--dry-run`` runs every part on the CuPy stand-in (a small test file, the quick preset, a
  2-step training, the counts, peak memory) with one measurement made to fail: that row says
  what failed and why, and every other row is still there.
* A task past its limit, or needing what the preflight found missing, is a row; the report is
  written after every task; each part's limits add up to under 10 minutes.
* The suite's result is read from pytest's output, also when the run was stopped at its limit.
"""
from __future__ import annotations

import json
import sys
import time

import pytest

import attn.backend as B
from attn.bench import gpu_report as G
from attn.bench.gpu_report_md import render_markdown


def test_without_a_gpu_it_stops_at_once_and_says_why(tmp_path, monkeypatch, capsys):
    from attn.bench.cli import main
    monkeypatch.setattr(B, "cupy_modules", None)           # the real CuPy (or none), not the stand-in
    saved = (B._current, B._xp)
    if B.cupy_available():
        pytest.skip("a GPU is usable here: this checks the machine without one")
    t0 = time.perf_counter()
    try:
        assert main(["--gpu-report", str(tmp_path / "r")]) == 2
    finally:
        B._current, B._xp = saved
    assert time.perf_counter() - t0 < 30
    err = capsys.readouterr().err
    assert err.startswith("attn.bench: error: --gpu-report measures a GPU, and none is usable here: ") and \
        "--dry-run" in err, err
    assert not (tmp_path / "r").exists()


def test_without_attns_engines_registered_it_stops_at_once_and_says_how_to_install(tmp_path, monkeypatch):
    """attn installed by another Python's pip (or not at all) has no entry points: every check of
    the fast engine would fail, so the report refuses before any part, naming the fix."""
    import attn.engine
    monkeypatch.setattr(attn.engine, "names", lambda: ["reference"])
    with pytest.raises(G.GpuReportError, match=r"not installed in this Python .*python -m pip install"):
        G.gpu_report(tmp_path / "r", dry_run=True, quiet=True)
    assert not (tmp_path / "r").exists()


def test_the_preflights_bound_refuses_a_product_off_by_more_than_float32_allows():
    """The preflight's ``cublas views`` holds each product to float32 accumulation's bound of the
    exact product: the exact product passes, NumPy's float32 product passes within it, and one
    wrong in a single entry by a thousandth of the largest is refused."""
    import numpy as np
    from attn.bench.preflight import _within_bound
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((8, 64)).astype(np.float32), rng.standard_normal((64, 5)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert _within_bound(exact, a, b, "exact") == 0.0
    assert _within_bound(a @ b, a, b, "float32") <= 1.0
    wrong = exact.copy()
    wrong[3, 2] += 1e-3 * np.abs(exact).max()
    with pytest.raises(AssertionError, match="times float32 accumulation's bound"):
        _within_bound(wrong, a, b, "wrong")


def test_the_stand_in_is_no_gpu(tmp_path):
    from conftest import selected_backend
    with selected_backend("fakecupy"):
        with pytest.raises(G.GpuReportError, match="stand-in"):
            G.gpu_report(tmp_path, quiet=True)


def test_a_dry_run_with_a_failing_measurement_keeps_every_other_row(tmp_path):
    """The whole report on the stand-in, one measurement made to raise: that row says what failed
    and why, every other part and row is there, and the page and the JSON agree."""
    report = G.gpu_report(tmp_path / "r", dry_run=True, quiet=True, inject_failure="bench-quick-forward")
    assert (tmp_path / "r" / "report.json").is_file() and (tmp_path / "r" / "REPORT.md").is_file()
    assert json.loads((tmp_path / "r" / "report.json").read_text()) == report
    assert report["dry_run"] and report["device"]["gpu"].startswith("fakecupy") and not report["preflight"]["missing"]
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["preflight", "suite", "counts-quick", "bench-quick-train_step", "bench-quick-forward",
                          "precision-quick-bf16", "graph-quick-fp32", "train", "train-cuda-graph", "memory-quick-attn",
                          "attention", "tensor-cores"]
    bad = rows.pop("bench-quick-forward")
    assert bad["status"] == "failed" and "injected failure in forward" in bad["why"], bad
    assert all(r["status"] == "ok" for r in rows.values()), [(r["name"], r.get("why")) for r in rows.values()]
    assert rows["suite"]["suite"]["counts"]["passed"] >= 10 and not rows["suite"]["suite"]["failures"]
    checks = {c["check"]: c for c in rows["preflight"]["checks"]}
    assert len(checks) == 13 and all(c["ok"] for c in checks.values()), checks
    assert "1 graph, equal to eager" in checks["captured step"]["figure"]
    assert rows["bench-quick-train_step"]["result"]["seconds_per_step"] > 0
    assert {p["phase"] for p in rows["bench-quick-train_step"]["result"]["phases"]} >= {"loss", "optimizer"}
    assert rows["precision-quick-bf16"]["result"]["seconds_per_step"] > 0
    assert rows["graph-quick-fp32"]["result"]["seconds_per_step"] > 0
    assert rows["train"]["result"]["steps"] == 2 and rows["train-cuda-graph"]["result"]["backend"] == "cupy"
    mem = rows["memory-quick-attn"]["result"]
    assert mem["step_memory_mb"] > 0 and mem["peak_memory_mb"] >= mem["step_memory_mb"]
    md = (tmp_path / "r" / "REPORT.md").read_text()
    for heading in ("# attn on a GPU: the report", "Dry run on the CuPy stand-in", "## What is installed",
                    "## Preflight: the riskiest paths first", "PASS  captured step",
                    "## The test suite on the GPU", "## attn against PyTorch", "## At bf16 and tf32",
                    "## The captured step", "## Training the toy translator", "## Peak GPU memory", "## Commands"):
        assert heading in md, heading
    counts = {r["name"]: r for r in rows["counts-quick"]["rows"]}
    launches = counts["counts_train_step"]["launches"]
    assert f"| quick | train_step | fp32 | {rows['bench-quick-train_step']['result']['seconds_per_step']:.4f} | - | - | " \
           f"{launches:g} | 0 | 0 | ok |" in md
    assert "| quick | forward | fp32 | - | - | - | - | - | - | **failed**: exit 1: RuntimeError: injected failure" in md
    assert [r["T"] for r in rows["attention"]["rows"]] == [16, 40]
    assert "## One attention alone" in md and "| 40 | " in md
    tc = rows["tensor-cores"]["rows"]
    assert [r["name"] for r in tc] == ["tensor_cores_twin"] + ["tensor_cores_time"] * 2 and tc[0]["ok"]
    assert all(r["commit"] == report["commit"] for r in tc)
    assert "## The tensor-core attention: against its twins" in md and "| 64 | True | " in md
    assert "12 rows, 11 ok: bench-quick-forward failed." in md


def _tiny(tmp_path):
    """A plan of three small tasks: one that runs past its limit, one that prints a row, one that
    needs a module the preflight says is missing."""
    row = json.dumps({"name": "forward", "seconds_per_step": 0.5})
    return {p: [] for p in G.PARTS} | {"bench": [
        G.Task("bench", "slow", [sys.executable, "-c", "import time; time.sleep(60)"], 1, "bench",
               {"preset": "p", "measurement": "forward", "precision": "fp32"}),
        G.Task("bench", "fine", [sys.executable, "-c", f"print({row!r})"], 30, "bench",
               {"preset": "p", "measurement": "forward", "precision": "fp32"})],
        "memory": [G.Task("memory", "needs-torch", [sys.executable, "-c", "raise SystemExit(1)"], 30, "memory",
                          {"preset": "p", "measurement": "train_step", "framework": "torch"}, needs=("torch",))]}


def test_a_task_past_its_limit_or_missing_what_it_needs_is_a_row(tmp_path, monkeypatch):
    monkeypatch.setattr(G, "preflight", lambda env: {"have": {}, "missing": {"torch": "ModuleNotFoundError: torch"},
                                                     "torch_cuda": False})
    written = []
    real = G._Child.wait

    def wait(self):                               # the report on disk before each task ends
        written.append(json.loads((tmp_path / "r" / "report.json").read_text())["rows"])
        return real(self)
    monkeypatch.setattr(G._Child, "wait", wait)
    t0 = time.perf_counter()
    report = G.gpu_report(tmp_path / "r", dry_run=True, quiet=True, parts=["bench", "memory"], tasks=_tiny(tmp_path))
    assert time.perf_counter() - t0 < 45
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["slow"]["status"] == "time limit" and "limit of 1 s" in rows["slow"]["why"]
    assert rows["fine"]["status"] == "ok" and rows["fine"]["result"]["seconds_per_step"] == 0.5
    assert rows["needs-torch"]["status"] == "skipped" and rows["needs-torch"]["why"] == "missing: torch"
    assert [len(w) for w in written] == [0, 1]    # written after every task, not only at the end
    md = (tmp_path / "r" / "REPORT.md").read_text()
    assert "* missing: `torch` (ModuleNotFoundError: torch)" in md and "**time limit**" in md
    with pytest.raises(G.GpuReportError, match="unknown part"):
        G.gpu_report(tmp_path / "s", dry_run=True, quiet=True, parts=["benchmarks"])


def test_the_suite_result_is_read_from_pytest_output():
    done = "....F..s\nFAILED tests/test_x.py::test_a - AssertionError: no\n1 failed, 6 passed, 1 skipped in 3.2s\n"
    assert G.suite_summary(done, False) == {"counts": {"failed": 1, "passed": 6, "skipped": 1},
                                            "failures": ["tests/test_x.py::test_a"], "stopped_at_time_limit": False}
    stopped = "........F.s.. [ 10%]\n....\n"
    got = G.suite_summary(stopped, True)
    assert got["counts"] == {"passed": 15, "failed": 1, "skipped": 1} and got["stopped_at_time_limit"]


def test_each_part_fits_in_ten_minutes():
    """The limits of each part's tasks, with the report's own children before them and a kill's
    grace per task, add up to under 600 s (a lent machine's limit per command), on the GPU's plan
    and the dry run's; every measurement is a task of its own; the preflight comes first."""
    assert G.PART_SECONDS < 600 and G.PARTS[0] == "preflight" and G.PREFLIGHT_SECONDS <= 8 * 60
    tasks = [G.Task("bench", "a", [], 100, "bench"), G.Task("suite", "b", [], 50, "counts", beside=True),
             G.Task("suite", "c", [], 70, "counts", beside=True)]
    assert G.part_limits({"x": tasks}) == {"x": 2 * G.CHILD_SECONDS + 100 + 70 + 3 * G.KILL_GRACE}
    for dry in (False, True):
        limits = G.part_limits(G.plan(dry_run=dry))
        assert set(limits) == set(G.PARTS) and all(0 < v <= G.PART_SECONDS for v in limits.values()), limits
    parts = G.plan()
    assert {t.info["measurement"] for t in parts["bench"]} >= {"train_step", "forward", "greedy_cached"}
    assert {(t.info["preset"], t.info["precision"]) for t in parts["precision"] + parts["base"]} >= {
        ("toy-bench", "bf16"), ("base", "tf32")}
    assert all(t.info["measurement"] == "train_step_graph" and "--warmup" in t.cmd for t in parts["graph"])
    assert any("--cuda-graph" in t.cmd for t in parts["train"])
    assert G.TRAIN_SECONDS >= G.TRAIN_MINUTES * 60 + 30
    assert sum(t.beside for ts in parts.values() for t in ts) == len(G.COUNT_PLAN)     # only the counts run beside


def test_the_page_says_what_is_missing():
    """A stopped suite, a failed measurement and a training without metrics are said so on the
    page, not left out."""
    report = {"dry_run": False, "date": "d", "commit": None, "seconds": 600.0, "device": {"gpu": "G"},
              "parts": ["preflight", "suite", "bench", "train"],
              "limits": {"preflight": 485, "suite": 340, "bench": 550, "train": 420},
              "preflight": {"have": {"pytest": "9"}, "missing": {}},
              "rows": [{"part": "preflight", "name": "preflight", "command": "python -m attn.bench.preflight",
                        "returncode": 1, "timed_out": False, "seconds": 30.0, "limit_seconds": 420,
                        "status": "failed", "why": "exit 1: tf32: AssertionError: neither",
                        "checks": [{"check": "kernels", "ok": True, "figure": "52 kernels in 61.0 s", "seconds": 61},
                                   {"check": "tf32", "ok": False, "figure": "AssertionError: neither", "seconds": 1}]},
                       {"part": "suite", "name": "suite", "command": "python -m pytest -q", "returncode": -15,
                        "timed_out": True, "seconds": 90.0, "limit_seconds": 240, "status": "ok",
                        "suite": {"counts": {"passed": 3, "failed": 1}, "failures": ["tests/test_a.py::test_b"],
                                  "stopped_at_time_limit": True}},
                       {"part": "bench", "name": "bench-base-forward", "preset": "base", "measurement": "forward",
                        "precision": "fp32", "command": "python -m attn.bench", "returncode": 1, "timed_out": False,
                        "seconds": 9.0, "limit_seconds": 60, "status": "failed", "why": "exit 1: CUDARuntimeError",
                        "result": None},
                       {"part": "train", "name": "train", "command": "python -m attn.train", "returncode": 1,
                        "timed_out": False, "seconds": 9.0, "limit_seconds": 240, "status": "failed",
                        "why": "exit 1: boom", "result": None}]}
    md = render_markdown(report)
    assert "PASS  kernels          52 kernels in 61.0 s\nFAIL  tf32             AssertionError: neither" in md
    assert "3 passed, 1 failed (stopped at its time limit)" in md and "* failed: `tests/test_a.py::test_b`" in md
    assert "| base | forward | fp32 | - | - | - | - | - | - | **failed**: exit 1: CUDARuntimeError |" in md
    assert "no metrics.json (**failed**: exit 1: boom" in md
    assert "| suite | `python -m pytest -q` | -15 (time limit) | 90 | 240 | ok |" in md


def test_every_json_the_report_writes_names_its_commit(tmp_path, monkeypatch):
    """report.json (and the benchmark's machine row) carry ``git rev-parse HEAD`` of the checkout;
    outside a checkout, "unknown"."""
    import subprocess
    from attn.bench import machine
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                          cwd=machine.CHECKOUT).stdout.strip()
    monkeypatch.setattr(G, "preflight", lambda env: {"have": {}, "missing": {}, "torch_cuda": False})
    plan = {p: [] for p in G.PARTS} | {"bench": _tiny(tmp_path)["bench"][1:]}
    G.gpu_report(tmp_path / "r", dry_run=True, quiet=True, parts=["bench"], tasks=plan)
    assert json.loads((tmp_path / "r" / "report.json").read_text())["commit"] == head
    assert machine.machine_info()["commit"] == head
    monkeypatch.setattr(machine, "CHECKOUT", tmp_path)
    assert machine.commit() == "unknown" and machine.machine_info()["commit"] == "unknown"

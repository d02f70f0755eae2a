"""``python -m attn.bench --gpu-report DIR`` (:mod:`attn.bench.gpu_report`).

* Without a GPU it stops at once with a message that says why and offers ``--dry-run``.
* ``--dry-run`` runs the whole pipeline on the CuPy stand-in (a small test file, the quick
  preset, a 2-step training, the counts) and assembles the Markdown page and the JSON file:
  the counts sit beside the timings, every command is listed with its exit status.
* The suite's result is read from pytest's output, also when the run was stopped at its limit.
"""
from __future__ import annotations

import json
import time

import pytest

import attn.backend as B
from attn.bench import gpu_report as G


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


def test_the_stand_in_is_no_gpu(tmp_path):
    from conftest import selected_backend
    with selected_backend("fakecupy"):
        with pytest.raises(G.GpuReportError, match="stand-in"):
            G.gpu_report(tmp_path, quiet=True)


def test_a_dry_run_assembles_the_whole_report(tmp_path):
    report = G.gpu_report(tmp_path / "r", dry_run=True, quiet=True)
    assert (tmp_path / "r" / "report.json").is_file() and (tmp_path / "r" / "REPORT.md").is_file()
    assert json.loads((tmp_path / "r" / "report.json").read_text()) == report
    assert report["dry_run"] and report["device"]["gpu"].startswith("fakecupy")
    assert report["suite"]["counts"]["passed"] >= 10 and not report["suite"]["failures"]
    assert [s["name"] for s in report["steps"]] == ["suite", "bench-quick", "train", "counts-quick"]
    assert all(s["returncode"] == 0 and not s["timed_out"] for s in report["steps"]), report["steps"]
    bench = {r["name"]: r for r in report["bench"]["quick"]}
    assert bench["machine"]["backend"] == "cupy" and bench["train_step"]["seconds_per_step"] > 0
    assert {p["phase"] for p in bench["train_step"]["phases"]} >= {"loss", "optimizer"}
    assert report["train"]["steps"] == 2 and report["train"]["backend"] == "cupy"
    counts = {r["name"]: r for r in report["counts"]["quick"]}
    md = (tmp_path / "r" / "REPORT.md").read_text()
    for heading in ("# attn on a GPU: the report", "Dry run on the CuPy stand-in", "## The test suite on the GPU",
                    "### quick", "## Training the toy translator", "## Counts against their targets", "## Commands"):
        assert heading in md, heading
    launches = counts["counts_train_step"]["launches"]
    assert f"| train_step | {bench['train_step']['seconds_per_step']:.4f} | - | - | {launches:g} | 0 |" in md
    assert f"{counts['counts_train_step']['optimizer_launches']:g} (target 1)" in md
    assert "| suite | `python -m pytest -q" in md and "| train | `python -m attn.train --backend cupy" in md


def test_the_suite_result_is_read_from_pytest_output():
    done = "....F..s\nFAILED tests/test_x.py::test_a - AssertionError: no\n1 failed, 6 passed, 1 skipped in 3.2s\n"
    assert G.suite_summary(done, False) == {"counts": {"failed": 1, "passed": 6, "skipped": 1},
                                            "failures": ["tests/test_x.py::test_a"], "stopped_at_time_limit": False}
    stopped = "........F.s.. [ 10%]\n....\n"
    got = G.suite_summary(stopped, True)
    assert got["counts"] == {"passed": 15, "failed": 1, "skipped": 1} and got["stopped_at_time_limit"]


def test_the_plan_fits_in_ten_minutes():
    total = G.SUITE_SECONDS + sum(limit for _, _, limit in G.BENCH_PLAN) + G.TRAIN_SECONDS
    assert total <= 590 and G.TRAIN_SECONDS >= G.TRAIN_MINUTES * 60 + 30
    assert [p for p, _, _ in G.BENCH_PLAN] == ["toy-bench", "small", "base"] and set(G.COUNT_PRESETS) == {"toy-bench",
                                                                                                        "base"}


def test_the_page_says_what_is_missing():
    """A stopped suite, a benchmark that measured nothing and a training without metrics are
    said so on the page, not left out."""
    report = {"dry_run": False, "date": "d", "commit": None, "seconds": 600.0, "device": {"gpu": "G"},
              "suite": {"counts": {"passed": 3, "failed": 1}, "failures": ["tests/test_a.py::test_b"],
                        "stopped_at_time_limit": True},
              "bench": {"base": [{"name": "machine"}]}, "train": None, "counts": {},
              "steps": [{"name": "suite", "command": "python -m pytest -q", "returncode": -15, "timed_out": True,
                         "seconds": 90.0}]}
    md = G.render_markdown(report)
    assert "3 passed, 1 failed (stopped at its time limit)" in md and "* failed: `tests/test_a.py::test_b`" in md
    assert "### base\n\nNo measurement (see the step's log)." in md and "No metrics.json" in md
    assert "| suite | `python -m pytest -q` | -15 (time limit) | 90 |" in md

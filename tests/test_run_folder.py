"""One run at a time in an ``--out`` folder: a second run, fresh, ``--overwrite`` or ``--resume``, is
refused in one line naming the first while it lives; a resumed run averages no snapshot taken
after its checkpoint's step."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attn import backend as B
from attn.checkpoint import load_npz
from attn.train import main
from attn.training.checkpoints import LOCK_FILE
from attn.training.config import TrainConfigError, config_from_argv
from test_train import TINY, run_train, write_corpus

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _numpy_backend():
    B.set_backend("numpy")
    yield


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_first(tmp_path, capsys):
    data = write_corpus(tmp_path)
    out = tmp_path / "run"
    flags = ["--data", str(data), *TINY, "--backend", "numpy", "--out", str(out)]
    first = subprocess.Popen([sys.executable, "-m", "attn.train", *flags, "--steps", "100000", "--eval-every", "2"],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.npz").exists():          # the first run is training and has written
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.2)
        for extra in ([], ["--overwrite"], ["--resume"]):
            capsys.readouterr()
            assert main([*flags, "--steps", "4", *extra]) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and f"--out {out} is in use by another attn-train run (process {first.pid} on " \
                in lines[0], lines
    finally:
        first.send_signal(signal.SIGTERM)                   # it saves its checkpoint and ends
        first.communicate(timeout=120)
    assert first.returncode == 143
    assert not (out / LOCK_FILE).exists()
    step = load_npz(out / "checkpoint.npz")[1]["step"]
    assert main([*flags, "--resume", "--steps", str(step + 2)]) == 0      # free again once it ended


def test_a_killed_run_holds_nothing(tmp_path):
    out = tmp_path / "run"
    code = ("import sys, time; from attn.training.checkpoints import hold_out\n"
            f"with hold_out({str(out)!r}):\n    print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TrainConfigError, match=f"process {holder.pid} on"):
            run_train(tmp_path, "--steps", "2", "--out", str(out))
    finally:
        holder.kill()
        holder.wait()
    assert run_train(tmp_path, "--steps", "2", "--eval-every", "2", "--out", str(out))["steps"] == 2


def test_a_resumed_run_averages_no_snapshot_from_after_its_checkpoint(tmp_path):
    """A run killed after snapshots it took past its last checkpoint: resumed with fewer steps than
    the killed session reached, it averages its own snapshots only."""
    out = tmp_path / "run"
    flags = ["--average", "3", "--snapshot-every", "2", "--out", str(out)]
    run_train(tmp_path, "--steps", "4", "--eval-every", "4", *flags)
    snaps = out / "snapshots"
    for later in (6, 8):                        # what the killed session wrote after its checkpoint at step 4
        shutil.copy(snaps / "step-00000004.npz", snaps / f"step-{later:08d}.npz")
    run_train(tmp_path, "--steps", "6", "--eval-every", "6", "--resume", *flags)
    _, meta = load_npz(out / "averaged.npz")
    assert meta["averaged"] == ["step-00000002.npz", "step-00000004.npz", "step-00000006.npz"]


def test_an_empty_out_is_refused():
    with pytest.raises(TrainConfigError, match="out .--out. must be a path, not empty"):
        config_from_argv(["--out", ""])


def test_a_run_stopped_during_its_test_takes_the_test_on_resume(tmp_path, monkeypatch):
    """Ctrl-C while the test set is translated used to lose the metrics for good: the checkpoint
    had met its budget, and --resume refused to go on."""
    import attn.training.evaluation as evaluation
    out = tmp_path / "run"
    scored = evaluation.evaluate_translations

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(evaluation, "evaluate_translations", interrupted)
    stopped = run_train(tmp_path, "--steps", "4", "--eval-every", "4", "--out", str(out))
    assert stopped["interrupted"] and stopped["exit_status"] == 130 and stopped["steps"] == 4
    assert not (out / "metrics.json").exists()
    monkeypatch.setattr(evaluation, "evaluate_translations", scored)
    metrics = run_train(tmp_path, "--steps", "4", "--resume", "--out", str(out))
    assert metrics["steps"] == 4 and metrics["stop"] == "reached --steps 4" and (out / "metrics.json").exists()
    assert len(load_npz(out / "checkpoint.npz")[0]["history/train_loss"]) == 4          # no step more
    with pytest.raises(TrainConfigError, match="already reached --steps 4"):
        run_train(tmp_path, "--steps", "4", "--resume", "--out", str(out))              # tested: nothing owed

"""The suite's closing report (``tests/conftest.py``) holds whether the tests run in one process or
in pytest-xdist's workers (the README's command runs ``-n auto``): a sentinel a test ended fails
the run, and every worker's gradient checks reach the summary line."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CHECKS = '''
import numpy as np
from attn import testing

def _square(x):
    return x * x, x

def _square_bwd(dout, x):
    return 2 * x * dout

def test_one_check():
    testing.check_gradients("square", _square, _square_bwd, {"x": np.linspace(-1, 1, 5)}, "x")

def test_another_check():
    testing.check_gradients("square", _square, _square_bwd, {"x": np.linspace(1, 2, 4)}, "x")
'''

KILLS = '''
import os
from conftest import SENTINELS

def test_ends_a_sentinel():
    os.killpg(SENTINELS["this user's"].pid, 9)     # the inner session's own, started by its conftest
    SENTINELS["this user's"].wait()
'''


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]), MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--rootdir", str(folder), *args, str(folder)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def _suite(tmp_path: Path, kills: bool) -> Path:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_checks.py").write_text(CHECKS)
    if kills:
        (tmp_path / "test_kills.py").write_text(KILLS)
    return tmp_path


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two workers"])
def test_every_gradient_check_reaches_the_closing_line(tmp_path, workers):
    pytest.importorskip("xdist")
    proc = _run(_suite(tmp_path, kills=False), *workers)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "over 2 checks (2 argument gradients)" in proc.stdout, proc.stdout


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two workers"])
def test_a_sentinel_a_test_ended_fails_the_run(tmp_path, workers):
    pytest.importorskip("xdist")
    proc = _run(_suite(tmp_path, kills=True), *workers)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout, proc.stdout               # every test passed, and yet the run fails
    assert "a test signalled processes it did not start" in proc.stdout, proc.stdout

"""Every lesson runs in its quick mode and passes its own final check."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs(lesson, tmp_path):
    env = dict(os.environ, ATTN_QUICK="1", ATTN_LESSONS_OUT=str(tmp_path), MPLBACKEND="Agg",
               PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, str(lesson)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{lesson.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert list(tmp_path.glob("*.png")), f"{lesson.name} saved no figure into ATTN_LESSONS_OUT"


def test_lessons_exist():
    assert len(LESSONS) >= 1

"""Every lesson runs in its quick mode and passes its own final check; one runs as a notebook."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
NOTEBOOK_LESSON = ROOT / "lessons" / "06_multi_head_attention.py"     # quick, and it draws a figure


def _env(out: Path) -> dict:
    return dict(os.environ, ATTN_QUICK="1", ATTN_LESSONS_OUT=str(out), MPLBACKEND="Agg", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs(lesson, tmp_path):
    from attn.book import executed_lesson
    nb = executed_lesson(lesson)    # the book's build (tests/test_book.py runs first) executed this very code
    if nb is not None:              # with this library and data: read its result instead of running it again
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
        assert not [o for o in outputs if o.get("output_type") == "error"], f"{lesson.name} raised in the book"
        text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
        assert "Check passed" in text, f"{lesson.name} did not pass its check in the book:\n{text[-3000:]}"
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{lesson.name} showed no figure in the book"
        return
    proc = subprocess.run([sys.executable, str(lesson)], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{lesson.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert list(tmp_path.glob("*.png")), f"{lesson.name} saved no figure into ATTN_LESSONS_OUT"


def test_lessons_exist():
    assert len(LESSONS) >= 18, [p.name for p in LESSONS]
    assert [int(p.name[:2]) for p in LESSONS] == list(range(1, len(LESSONS) + 1)), "lessons are numbered 01, 02, ..."


def test_lesson_runs_as_a_notebook(tmp_path, monkeypatch):
    """jupytext turns the percent-format script into a notebook; nbclient executes it headless in a
    Jupyter kernel, started from lessons/ (not the root); its figure must come out inline."""
    jupytext = pytest.importorskip("jupytext", reason="jupytext is in the test extra")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is in the test extra")
    pytest.importorskip("ipykernel", reason="ipykernel is in the test extra")
    nb = jupytext.read(NOTEBOOK_LESSON)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert len(code_cells) >= 3 and any(c.cell_type == "markdown" for c in nb.cells)
    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MPLBACKEND")                  # the kernel's own default: inline
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "lessons")}})
    client.execute()
    outputs = [o for c in code_cells for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "Check passed" in text, text[-2000:]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, "the notebook showed no figure inline"
    assert list(tmp_path.glob("*.png")), "the notebook did not save its figure"


def test_lesson_output_dir_is_anchored_at_the_repository_root(tmp_path, monkeypatch):
    from attn.plot import lesson_output_dir
    monkeypatch.delenv("ATTN_LESSONS_OUT", raising=False)
    for cwd in (tmp_path, ROOT / "lessons", ROOT):
        monkeypatch.chdir(cwd)
        assert lesson_output_dir() == ROOT / "lessons" / "out"
    ignored = subprocess.run(["git", "check-ignore", "-q", "lessons/out/x.png"], cwd=ROOT)
    if ignored.returncode != 128:                     # 128: not a git checkout (an sdist); nothing to check
        assert ignored.returncode == 0, "lessons/out/ must be ignored by git"
    monkeypatch.setenv("ATTN_LESSONS_OUT", str(tmp_path / "elsewhere"))
    assert lesson_output_dir() == tmp_path / "elsewhere" and (tmp_path / "elsewhere").is_dir()

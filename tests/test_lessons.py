"""Every lesson runs in its quick mode and passes its own final check; one runs as a notebook.

The lessons whose arrays can reach the device run a second time on the CuPy stand-in
(``tests/fakecupy``, loaded in the child process by :func:`fakecupy.child_env` with
``ATTN_BACKEND=cupy``), so that a lesson mixing host and device arrays fails here as it would
on a GPU: those that build on the model, the trainer, the decoder, the fast path or move arrays
themselves, and do not pin NumPy (``B.set_backend("numpy")``). The others call the layers on
host arrays, which stay on the host whatever the backend (run on the stand-in, they make no
device operation at all), so a second run would cost CI time and prove nothing."""
from __future__ import annotations

import ast
import os
import re
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


#: What puts a lesson's arrays on the selected backend's device.
_REACHES_THE_DEVICE = ("from attn.model import", "from attn.train import", "from attn.decode import",
                       "from attn.fast", "to_device", "DeviceRNG")
#: The lessons whose arrays follow ATTN_BACKEND (see the module docstring).
ON_THE_STAND_IN = [p for p in LESSONS if any(k in p.read_text(encoding="utf-8") for k in _REACHES_THE_DEVICE)
                   and 'set_backend("numpy")' not in p.read_text(encoding="utf-8")]


def _run_lesson(lesson: Path, env: dict, out: Path, where: str):
    proc = subprocess.run([sys.executable, str(lesson)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{lesson.name} failed{where}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert list(out.glob("*.png")), f"{lesson.name} saved no figure into ATTN_LESSONS_OUT"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs(lesson, tmp_path):
    from attn.site.book import executed_lesson
    # The book's build (tests/test_book.py runs first) executed this very code with this library
    # and data, on NumPy: read its result instead of running the lesson again.
    nb = executed_lesson(lesson) if os.environ.get("ATTN_BACKEND", "numpy") == "numpy" else None
    if nb is not None:
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
        assert not [o for o in outputs if o.get("output_type") == "error"], f"{lesson.name} raised in the book"
        text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
        assert "Check passed" in text, f"{lesson.name} did not pass its check in the book:\n{text[-3000:]}"
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{lesson.name} showed no figure in the book"
        return
    _run_lesson(lesson, _env(tmp_path), tmp_path, "")           # on ATTN_BACKEND's choice (numpy by default)


#: The lessons that train a model in quick mode: they ask attn.plot.quick_steps for how long.
TRAINING = [p for p in LESSONS if "quick_steps(" in p.read_text(encoding="utf-8")]


@pytest.mark.parametrize("lesson", TRAINING, ids=[p.stem for p in TRAINING])
def test_lesson_passes_with_a_weak_model(lesson, tmp_path):
    """ATTN_QUICK_WEAK=1 trains a tenth of quick mode's steps: a bad model, as a machine whose
    BLAS sums in another order may train one where this one trains a good one. The lesson's
    figures and checks must hold for it too (they assert nothing about a quick model's
    quality). Skipped when the suite already runs weakened (the other tests do this)."""
    if os.environ.get("ATTN_QUICK_WEAK") == "1":
        pytest.skip("the whole suite runs with ATTN_QUICK_WEAK=1")
    _run_lesson(lesson, dict(_env(tmp_path), ATTN_QUICK_WEAK="1"), tmp_path, " with ATTN_QUICK_WEAK=1")


def test_the_lessons_that_train_are_found():
    names = {p.name[:2] for p in TRAINING}
    assert {"01", "14", "17", "25"} <= names, sorted(names)


@pytest.mark.parametrize("lesson", ON_THE_STAND_IN, ids=[p.stem for p in ON_THE_STAND_IN])
def test_lesson_runs_on_the_cupy_stand_in(lesson, tmp_path):
    import fakecupy
    _run_lesson(lesson, fakecupy.child_env(_env(tmp_path)), tmp_path, " on the CuPy stand-in (ATTN_BACKEND=cupy)")


def test_a_child_process_runs_on_the_stand_in(tmp_path):
    """What the lessons' child processes see: ``import cupy`` is the stand-in, and attn selects it."""
    import fakecupy
    code = "import attn.backend as B; print(B.get_backend(), B.xp().__name__, B.xp().ones(2).sum().get())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=fakecupy.child_env(_env(tmp_path)),
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["cupy", "fakecupy.cupy", "2.0"], proc.stderr[-2000:]
    assert ROOT / "lessons" / "09_the_whole_model.py" in ON_THE_STAND_IN, [p.name for p in ON_THE_STAND_IN]


# What a reader of the lessons cannot open: numbered sources ("seed 002", "file 001") and "the
# study notes". A lesson that corrects a common misreading quotes it and says where such claims are
# found ("blog posts often write ..."), in its own words.
UNREADABLE_SOURCES = re.compile(r"seeds?[ _]?0\d\d?(?!\d)|\bfile[ _]?0\d\d?(?!\d)|study notes|\bthe notes\b|\bnotes'|"
                                r"\bthe seeds'", re.IGNORECASE)


def test_lessons_cite_only_what_a_reader_can_open():
    files = LESSONS + [ROOT / "lessons" / "README.md"]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if UNREADABLE_SOURCES.search(line)]
    assert not hits, "lessons refer to sources a reader cannot open:\n" + "\n".join(hits)


def test_the_unreadable_sources_pattern_catches_what_it_should():
    for bad in ("Seed 002 writes W_i^O", "the study notes' table", "file 001 says", "SEED_002_BIG = 1",
                "as the notes write", "the notes' example", "the seeds' table", "seed003"):
        assert UNREADABLE_SOURCES.search(bad), bad
    for ok in ("over three seeds", "the runs' seeds' spread", "seed=0", "SEEDS = [0, 1, 2]", "data seed 7",
               "footnotes", "rng seed 1234"):
        assert not UNREADABLE_SOURCES.search(ok), ok


def test_lessons_use_public_names_only():
    """A lesson imports attn's public modules (attn.layers, not attn.layers.softmax), no private
    name, and reads attention weights through attn.layers.attention_weights or
    Transformer.attention_weights, not through a cache's inner fields."""
    bad = []
    for p in LESSONS:
        text = p.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text, str(p))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attn"):
                parts = node.module.split(".")
                if parts[:2] == ["attn", "layers"] and len(parts) > 2 or any(x.startswith("_") for x in parts):
                    bad.append(f"{p.name}:{node.lineno}: from {node.module} import ...")
                bad += [f"{p.name}:{node.lineno}: {a.name}" for a in node.names if a.name.startswith("_")]
        for i, line in enumerate(text.splitlines(), 1):
            if re.search(r"\.attn\.(weights|q|k|v)\b|\.lin_[qkvo]\b|\.soft\.y\b|\.sub\.attn\b", line):
                bad.append(f"{p.name}:{i}: {line.strip()}")
    assert not bad, "lessons reach into the library's internals:\n" + "\n".join(bad)


def test_lessons_exist():
    assert len(LESSONS) >= 18, [p.name for p in LESSONS]
    assert [int(p.name[:2]) for p in LESSONS] == list(range(1, len(LESSONS) + 1)), "lessons are numbered 01, 02, ..."


def _number(words: str) -> int:
    """ "Twenty-eight" -> 28 (the numbers a lesson count is written in)."""
    units = "one two three four five six seven eight nine".split()
    tens = {"twenty": 20, "thirty": 30, "forty": 40}
    parts = words.lower().split("-")
    return tens[parts[0]] + (units.index(parts[1]) + 1 if len(parts) > 1 else 0)


def test_the_lessons_readme_counts_and_times_every_lesson():
    """lessons/README.md said twenty-six lessons when there were 28, and its timing table stopped at 21."""
    text = (ROOT / "lessons" / "README.md").read_text(encoding="utf-8")
    assert _number(text.split()[2]) == len(LESSONS), text.split("\n")[2]
    quick = text[text.index("| lesson | quick: wall s"):]
    quick = quick[:quick.index("\n\n")]
    timed = [line.split("|")[1].strip() for line in quick.splitlines()[2:] if not line.startswith("| all")]
    assert timed == [p.stem for p in LESSONS], sorted(set(p.stem for p in LESSONS) - set(timed))


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

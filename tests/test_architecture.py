"""The architecture, enforced: the import-linter contracts in setup.cfg hold, every part of the
package is in one of the three layers they name, docs/ARCHITECTURE.md draws those layers as
they are, no module of the project (attn/, its tests, lessons and scripts) is longer than one
person reads in a sitting, no function of attn/ longer than a screen, and the readable
training step is read in few files."""
from __future__ import annotations

import ast
import configparser
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attn"

#: The most lines a module of the project may have: attn/'s, and the lessons', tests' and scripts'.
MAX_LINES = 800
#: The folders that hold the project's Python.
SOURCES = ("attn", "tests", "lessons", "benchmarks", "docs", "data", "book", "web")
#: What runs write beside it (.gitignore's): copies and outputs, not the project's modules.
OUTPUTS = ("tests/out", "book/lessons", "lessons/out", "benchmarks/out")
#: The most lines a function of the course may have, its signature and docstring included.
MAX_FUNCTION_LINES = 60
#: The most files of attn/ that the readable training step runs in, outside attn/layers/ and in all.
MAX_STEP_FILES, MAX_STEP_FILES_WITH_LAYERS = 7, 17


def _lines(value: str) -> list[str]:
    return [v.strip() for v in value.split() if v.strip()]


def layers() -> dict[str, set[str]]:
    """The three layers as setup.cfg's contracts name them: {"course", "engine", "tools"} -> the
    parts (``attn.model``, ``attn.fast``, ...)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    course = cfg["importlinter:contract:course"]
    engine = cfg["importlinter:contract:engine"]
    return {"course": set(_lines(course["source_modules"])),
            "engine": set(_lines(engine["source_modules"])),
            "tools": set(_lines(engine["forbidden_modules"]))}


def parts() -> set[str]:
    """Every module and sub-package directly under attn/."""
    found = {f"attn.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    found |= {f"attn.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    return found


def test_the_import_contracts_hold(capsys):
    """``lint-imports``: the course imports no engine and no tool (directly or through another
    module), the engine no tool, the grader neither the benchmarks nor the site."""
    from importlinter.cli import lint_imports
    code = lint_imports(config_filename=str(ROOT / "setup.cfg"), no_cache=True, no_logo=True)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "BROKEN" not in out and "KEPT" in out


def test_every_part_of_the_package_is_in_one_layer():
    named = layers()
    where = {}
    for layer, names in named.items():
        for name in names:
            assert name not in where, f"{name} is in both the {where[name]} and the {layer} layer (setup.cfg)"
            where[name] = layer
    assert parts() - set(where) == set(), "parts of attn/ in no layer of setup.cfg's contracts: add them"
    assert set(where) - parts() == set(), "layers of setup.cfg name parts that do not exist"


def test_the_map_draws_the_layers_as_the_contracts_name_them():
    """docs/ARCHITECTURE.md's drawing has a row per layer (``course``, ``engine``, ``tools``, maybe
    over several lines) naming its parts as paths under attn/ (``model``, ``layers/``)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    drawing = re.search(r"<!-- layers -->\n```\n(.*?)```", text, re.S)
    assert drawing, "docs/ARCHITECTURE.md has no drawing of the layers (a fenced block after <!-- layers -->)"
    drawn, layer = {}, None
    for line in drawing.group(1).splitlines():
        if "▼" in line:                                   # the arrow between two layers
            continue
        head, _, rest = line.partition("│")
        first = head.split()[0] if head.split() else ""
        if first in ("course", "engine", "tools"):
            layer = first
            head = head[len(head) - len(head.lstrip()) + len(first):]
        if layer is None or not head.strip():
            continue
        drawn.setdefault(layer, set()).update("attn." + w.rstrip("/") for w in head.split())
    assert drawn == layers()


def modules() -> list[Path]:
    """Every Python file of the project, in attn/ and beside it."""
    outputs = [ROOT / o for o in OUTPUTS]
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py")
                  if not any(o in p.parents for o in outputs))


def test_the_modules_are_found():
    found = modules()
    assert PACKAGE / "model.py" in found and ROOT / "tests" / "fakecupy" / "cupy.py" in found
    assert {p.relative_to(ROOT).parts[0] for p in found} >= {"attn", "tests", "lessons", "benchmarks", "docs"}


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_longer_than_a_sitting(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES}): split it by its seams"


def function_lengths(path: Path) -> list[tuple[int, str, int]]:
    """(line, name, lines) of every function and method in ``path``, nested ones included, its
    signature, decorators excluded, and docstring counted."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((node.lineno, node.name, node.end_lineno - node.lineno + 1))
    return found


def long_functions(root: Path, paths: list[Path], limit: int) -> list[str]:
    """The functions of ``paths`` over ``limit`` lines, as ``path:line name N lines`` with the path
    relative to ``root``."""
    return [f"{path.relative_to(root).as_posix()}:{line} {name} {n} lines"
            for path in paths for line, name, n in function_lengths(path) if n > limit]


def test_no_function_of_the_package_is_longer_than_a_screen():
    """A reader takes each function of attn/ in whole, the engine, the grader and the benchmarks'
    included: a longer one is split into named steps. No exceptions."""
    files = sorted(PACKAGE.rglob("*.py"))
    long = long_functions(ROOT, files, MAX_FUNCTION_LINES)
    assert len(files) > 100
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines, to split into named steps:\n"
                      + "\n".join(long))


def test_the_function_check_names_each_offender(tmp_path):
    """The check above, on a file with a short function, one of exactly the limit, a long one and
    a long method nested in a class."""
    lines = [f"    x{i} = {i}" for i in range(61)]
    body, at_limit, method = "\n".join(lines), "\n".join(lines[:59]), "\n".join("    " + x for x in lines)
    path = tmp_path / "attn" / "m.py"
    path.parent.mkdir()
    path.write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n\n\ndef limit():\n{at_limit}\n\n\n"
                    f"class C:\n    def method(self):\n{method}\n", encoding="utf-8")
    assert long_functions(tmp_path, [path], MAX_FUNCTION_LINES) == ["attn/m.py:5 long 62 lines",
                                                                    "attn/m.py:132 method 62 lines"]


class _Updated(Exception):
    """Raised after the first return of Adam's update: the step traced is over."""


def test_the_readable_step_is_followed_in_few_files(tmp_path, monkeypatch):
    """``attn-train --reference`` on a toy corpus, traced from ``main`` to the return of the first
    :meth:`attn.optim.Adam.step`: the files of attn/ that a reader follows are those of the
    functions that call :func:`attn.train.train_step` (``main`` down to the loop) and of every
    function that runs from ``train_step``'s call to Adam's return (forward, loss, backward,
    clipping, Adam). Preparing the run (corpus, vocabulary, model) comes before and is not counted.

    Outside attn/layers/ that is train, model, block, loss, optim, backend and masks; inside, the module
    of each layer the model composes (one module per layer: docs/ARCHITECTURE.md) and their
    shared checks."""
    import attn
    import attn.optim
    from attn.train import main
    package = Path(attn.__file__).parent
    for split in ("train", "val", "test"):
        (tmp_path / f"{split}.xx").write_text("the red cat\na big dog\n", encoding="utf-8")
        (tmp_path / f"{split}.yy").write_text("le chat rouge\nun grand chien\n", encoding="utf-8")
    followed, stepping = set(), []

    def profile(frame, event, arg):
        if event != "call":
            return
        if not stepping and frame.f_code.co_name == "train_step" and frame.f_code.co_filename.endswith("train.py"):
            stepping.append(True)
            caller = frame.f_back
            while caller is not None:                   # main ... run_loop: the way to the step
                followed.add(caller.f_code.co_filename)
                caller = caller.f_back
        if stepping:
            followed.add(frame.f_code.co_filename)

    update = attn.optim.Adam.step

    def step_then_stop(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        sys.setprofile(None)
        raise _Updated(out)
    monkeypatch.setattr(attn.optim.Adam, "step", step_then_stop)
    sys.setprofile(profile)
    try:
        with pytest.raises(_Updated):
            main(["--reference", "--data", str(tmp_path), "--src", "xx", "--tgt", "yy", "--d-model", "16",
                  "--heads", "2", "--d-ff", "32", "--layers", "1", "--steps", "1", "--warmup", "5", "--minutes", "0",
                  "--bleu-sentences", "0", "--average", "0", "--quiet", "--out", str(tmp_path / "run")])
    finally:
        sys.setprofile(None)
    files = sorted(str(Path(f).relative_to(package)) for f in followed if Path(f).is_relative_to(package))
    outside = [f for f in files if not f.startswith("layers")]
    assert "train.py" in files and "optim.py" in files and "model.py" in files, files
    assert len(outside) <= MAX_STEP_FILES, f"the readable step runs in {outside} outside attn/layers/"
    assert len(files) <= MAX_STEP_FILES_WITH_LAYERS, f"the readable step runs in {len(files)} files: {files}"


# ----------------------------------------------------------------------------- the fast engine's rooms

FAST = PACKAGE / "fast"


def fast_packages() -> list[Path]:
    """attn/fast and every sub-package below it."""
    return sorted(p.parent for p in FAST.rglob("__init__.py"))


def unmapped(package: Path) -> list[str]:
    """The modules and sub-packages of ``package`` that its map (the first paragraph of its
    ``__init__``'s docstring) does not name as ``name``; the map itself when it is too short to
    say what the room holds and serves."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    first = doc.split("\n\n")[0]
    if len(first.split()) < 40:
        return [f"its map (the docstring's first paragraph) is {len(first.split())} words: {first!r}"]
    rooms = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    rooms |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    return sorted(r for r in rooms if f"``{r}``" not in first)


def private_exports(root: Path, paths: list[Path]) -> list[str]:
    """``path:line name`` of every module-level private name (one leading underscore) that ``paths``
    take from a module of attn.fast (``from .ops import _Ops``, ``from attn.fast.x import _y``), or
    list in an ``__all__``; the paths relative to ``root``, which holds attn/."""
    found = []
    for path in paths:
        package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
        text = path.read_text(encoding="utf-8")
        if "fast" not in package and "fast" not in text and "__all__" not in text:
            continue                                # nothing of attn.fast to take, no __all__
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                if module == "attn.fast" or module.startswith("attn.fast."):
                    found += [f"{path.relative_to(root).as_posix()}:{node.lineno} {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                  and isinstance(node.value, (ast.List, ast.Tuple))):
                found += [f"{path.relative_to(root).as_posix()}:{node.lineno} {e.value}" for e in node.value.elts
                          if isinstance(e, ast.Constant) and str(e.value).startswith("_")]
    return found


def test_each_room_of_the_fast_engine_has_a_map_naming_its_modules():
    """attn/fast and each of its sub-packages open with a paragraph that names every module and
    sub-package it holds, and say what they serve."""
    packages = fast_packages()
    assert {"core", "training", "decoding", "gpu"} <= {p.name for p in packages}
    missing = {str(p.relative_to(ROOT)): unmapped(p) for p in packages}
    assert not any(missing.values()), f"rooms of attn/fast whose map leaves out: {missing}"


def test_the_fast_engine_exports_no_private_name():
    """No module of attn/ takes a private name from attn.fast, and no ``__all__`` of attn.fast lists
    one: what another module needs is public."""
    found = private_exports(ROOT, sorted(PACKAGE.rglob("*.py")))
    assert not found, f"private names taken from attn.fast or listed in an __all__: {found}"
    import attn.fast
    assert not [n for n in attn.fast.__all__ if n.startswith("_") or not hasattr(attn.fast, n)]


def test_the_room_checks_name_what_they_find(tmp_path):
    """The two checks above, on a planted room: a map that leaves a module out, and an import of
    a private name from attn.fast."""
    room = tmp_path / "room"
    room.mkdir()
    words = " ".join(["word"] * 40)
    (room / "__init__.py").write_text(f'"""``kept`` and {words}.\n\nThe ``dropped`` module."""\n')
    (room / "kept.py").write_text("")
    (room / "dropped.py").write_text("from attn.fast.core.ops import _Ops\nfrom .x import _fine\n")
    assert unmapped(room) == ["dropped"]
    planted = tmp_path / "attn" / "fast" / "core" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from .ops import _Ops, Ops\nfrom ...model import _private\n__all__ = ['_Ops']\n")
    user = tmp_path / "attn" / "bench" / "user.py"
    user.parent.mkdir()
    user.write_text("from ..fast.gpu.graph import _capture\nfrom attn.fast import _THREADS\n")
    assert private_exports(tmp_path, [planted, user]) == [
        "attn/fast/core/planted.py:1 _Ops", "attn/fast/core/planted.py:3 _Ops",
        "attn/bench/user.py:1 _capture", "attn/bench/user.py:2 _THREADS"]

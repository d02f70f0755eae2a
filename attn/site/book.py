"""Build the course as a book: every lesson executed into a static website.

``python -m attn.site.book`` runs Sphinx on ``book/`` (myst-nb reads each
``lessons/NN_*.py`` through jupytext and executes it in quick mode) and writes
the site to ``build/book/html/``: open ``build/book/html/index.html``, or serve
the folder. Warnings are errors, so a lesson whose check fails, a broken
reference or a figure that does not come out fails the build.

Executed lessons are cached (jupyter-cache) under
``build/book/jupyter_cache/<library hash>/``: a rebuild re-executes a lesson
only when its code cells changed, and every lesson when the library
(``attn/``, but for ``attn/site/``, which no lesson runs) or the data (``data/``)
changed, because their hash names the cache.
Needs the ``book`` extra: ``pip install -e ".[book]"``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "book"
HTML = BUILD / "html"
DOCTREES = BUILD / "doctrees"
LESSONS_OUT = BUILD / "lessons-out"           # where the lessons write figures and runs during the build
SCREENSHOTS = BUILD / "screenshots"           # tests/test_book.py saves one per page here


#: Set to lesson numbers (``ATTN_BOOK_ONLY="14 27"``), the book is built with those lessons
#: only, and tests/test_book.py tests their pages only: a page's tests without executing every
#: lesson. Unset, every lesson.
ONLY_ENV = "ATTN_BOOK_ONLY"


def lesson_files(root: Path = ROOT) -> list[Path]:
    """The lessons in reading order: ``lessons/NN_*.py``, sorted by their number (those
    ``$ATTN_BOOK_ONLY`` names, when it is set)."""
    lessons = sorted((root / "lessons").glob("[0-9][0-9]_*.py"), key=lambda p: (int(p.name[:2]), p.name))
    only = {int(n) for n in os.environ.get(ONLY_ENV, "").replace(",", " ").split()}
    return [p for p in lessons if not only or int(p.name[:2]) in only]


#: Parts of the library that no lesson runs: changing them re-executes no lesson. ``attn/site/``
#: (this module, the export for the page, the browser driver) is the book's and the page's own
#: room; no lesson and no module of the course imports it (tests/test_book.py checks).
NOT_RUN_BY_LESSONS = ("attn/site",)


#: The environment variables a lesson's output depends on, with the value the build uses
#: when one is unset: the weak quick model, the BLAS's threads and kernel, and the figures'
#: phone renderings (``ATTN_PHONE_FIGURES=0`` builds the book without them, as a phone saw it before).
OUTPUT_ENV = (("ATTN_QUICK_WEAK", ""), ("OPENBLAS_NUM_THREADS", "1"), ("OPENBLAS_CORETYPE", ""),
              ("ATTN_PHONE_FIGURES", "1"))


def library_hash(root: Path = ROOT) -> str:
    """A short hash of everything a lesson's output depends on besides its own code:
    the library's sources (``attn/**``, but for NOT_RUN_BY_LESSONS), the data (``data/**``)
    and the environment variables of OUTPUT_ENV."""
    h = hashlib.sha256()
    h.update("".join(f"{k}={os.environ.get(k, unset)}\0" for k, unset in OUTPUT_ENV).encode())
    skip = [root / name for name in NOT_RUN_BY_LESSONS]
    files = sorted(p for d in ("attn", "data") for p in (root / d).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
                   and not any(p == s or s in p.parents for s in skip))
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_path(root: Path = ROOT) -> Path:
    """The jupyter-cache folder the build uses for the current library."""
    return root / "build" / "book" / "jupyter_cache" / library_hash(root)


def build_environment() -> dict:
    """The environment the lessons execute in: quick mode, this checkout's ``attn`` first
    on the path, figures inline (no ``MPLBACKEND``) and drawn for a phone too, and their files
    under the build."""
    env = dict(os.environ, ATTN_QUICK="1", ATTN_LESSONS_OUT=str(LESSONS_OUT), PYTHONUNBUFFERED="1",
               ATTN_PHONE_FIGURES=os.environ.get("ATTN_PHONE_FIGURES", "1"),    # attn.plot: a phone's rendering too
               OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("MPLBACKEND", None)          # the kernel's default, inline: figures become image outputs
    env.pop("ATTN_CHECKPOINT", None)     # lessons 17 and 18 use the model lesson 14 trained in this build
    return env


def executed_lesson(lesson: Path):
    """The notebook the book's build executed from ``lesson``'s current code with the current
    library, from the cache, or None when no build has (jupyter-cache keeps only runs that
    raised nothing). tests/test_lessons.py uses it so that CI runs each lesson once."""
    path = cache_path()
    if not (path / "global.db").is_file():
        return None
    try:
        import jupytext
        from jupyter_cache import get_cache
    except ImportError:
        return None
    cache = get_cache(str(path))
    nb = jupytext.reads(lesson.read_text(encoding="utf-8"), fmt="py:percent")    # as the book reads it
    try:
        record = cache.match_cache_notebook(nb)        # matched on the code cells' sources
    except KeyError:
        return None
    return cache.get_cache_bundle(record.pk).nb


#: The line of ``book/api/layers.md`` after which :func:`api_layers_page` writes the sections.
API_MARKER = "<!-- The sections below are written from attn.testing.registry by book/conf.py. -->"


def api_layers_page(text: str) -> str:
    """``book/api/layers.md`` with its sections after :data:`API_MARKER` written from the layer
    registry: one per module of :mod:`attn.layers` that holds a registered layer, in the order
    of the registrations (the order the lessons meet them), then the package's other modules."""
    import importlib
    import pkgutil

    import attn.layers
    from attn.testing import LAYERS
    modules = []
    for layer in LAYERS.values():
        if layer.library.startswith("attn.layers"):
            library = importlib.import_module(layer.library)
            modules += [getattr(library, f).__module__ for f in layer.functions]
    modules += sorted(f"attn.layers.{m.name}" for m in pkgutil.iter_modules(attn.layers.__path__)
                      if not m.name.startswith("_"))
    sections = [f"## `{m}`\n\n```{{eval-rst}}\n.. automodule:: {m}\n   :members:\n   :member-order: bysource\n```\n"
                for m in dict.fromkeys(modules)]
    return text[:text.index(API_MARKER) + len(API_MARKER)] + "\n\n" + "\n".join(sections)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attn.site.book",
        description="Build the lessons into a website (build/book/html/), each executed in quick mode. "
                    "Sphinx's warnings are errors: a lesson that fails fails the build. Executed lessons "
                    "are cached: a rebuild re-runs only the lessons whose code changed (all of them when "
                    "attn/ or data/ changed).")
    parser.add_argument("--clean", action="store_true",
                        help="delete build/book/ first (the cache of executed lessons too): a cold build")
    parser.add_argument("-j", "--jobs", default="2",
                        help="how many lessons execute at once (Sphinx's parallel reading): a number or "
                             "'auto', one per CPU (default 2; each is one process of one BLAS thread)")
    args = parser.parse_args(argv)
    try:
        from sphinx.cmd.build import build_main
    except ImportError:
        parser.error("Sphinx is not installed: pip install -e \".[book]\"")
    if not (ROOT / "book" / "conf.py").is_file():
        parser.error(f"no book sources at {ROOT / 'book'}: run from a checkout of attn")
    if args.clean and BUILD.exists():
        shutil.rmtree(BUILD)
    os.environ.update(build_environment())
    for name in ("MPLBACKEND", "ATTN_CHECKPOINT"):
        os.environ.pop(name, None)
    # -T: an error's whole traceback on the screen, a parallel reader's too, not only in a temporary log
    code = build_main(["-b", "html", "-W", "--keep-going", "-T", "-j", str(args.jobs), "-d", str(DOCTREES),
                       str(ROOT / "book"), str(HTML)])
    if code == 0:
        print(f"The book is in {HTML}: open {HTML / 'index.html'}")
    return code


if __name__ == "__main__":
    sys.exit(main())

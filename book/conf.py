"""Sphinx configuration of the book: the lessons executed into a website.

Build it with ``python -m attn.site.book`` (see attn/site/book.py); ``sphinx-build book build/book/html``
works too, with the same settings, because everything the build needs is set here.

The lessons stay where they are (``lessons/NN_*.py``): the build links each into
``book/lessons/`` (git-ignored, rebuilt from the glob on every build, so a lesson added or
renamed appears without editing anything here), and myst-nb reads the percent-format
scripts through jupytext and executes them in quick mode, cached.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import sys
from pathlib import Path

BOOK = Path(__file__).resolve().parent
ROOT = BOOK.parent
sys.path.insert(0, str(ROOT))

from attn.site import book as attn_book  # noqa: E402

os.environ.update(attn_book.build_environment())
for _name in ("MPLBACKEND", "ATTN_CHECKPOINT"):
    os.environ.pop(_name, None)


def _link_lessons() -> list[str]:
    """Make ``book/lessons/`` hold one symbolic link per lesson, and nothing else."""
    folder = BOOK / "lessons"
    folder.mkdir(exist_ok=True)
    lessons = attn_book.lesson_files(ROOT)
    names = {p.name for p in lessons}
    for p in folder.iterdir():
        if p.name not in names or not p.is_symlink():
            p.unlink()
    for p in lessons:
        link = folder / p.name
        target = os.path.relpath(p, folder)
        if not (link.is_symlink() and os.readlink(link) == target):
            link.unlink(missing_ok=True)
            link.symlink_to(target)
    return [p.stem for p in lessons]


LESSON_STEMS = _link_lessons()


def _write_api_page() -> None:
    """``api/layers.md``'s sections from the layer registry, where they are not already so."""
    page = BOOK / "api" / "layers.md"
    text = page.read_text(encoding="utf-8")
    if attn_book.api_layers_page(text) != text:
        page.write_text(attn_book.api_layers_page(text), encoding="utf-8")


_write_api_page()


def _drop_stale_caches() -> None:
    """Delete the caches of executed lessons made with another library than this one."""
    current = attn_book.cache_path(ROOT)
    if current.parent.is_dir():
        for other in current.parent.iterdir():
            if other.is_dir() and other != current:
                shutil.rmtree(other)


_drop_stale_caches()

project = "attn"
author = "the attn authors"
copyright = "the attn authors, MIT License"
html_title = "attn: Attention Is All You Need, by hand"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
# MathJax 3 served from the site itself, not a CDN: its files come from the PyPI package
# sphinx-mathjax-offline and are copied into _static/mathjax/ (by _copy_mathjax below rather
# than by loading the package as an extension, which Sphinx would then read in serial only).
mathjax_path = "mathjax/tex-chtml.js"
exclude_patterns = ["conf.py", "_build", "**/__pycache__", "**/.ipynb_checkpoints"]

# The lessons: percent-format Python read by jupytext, executed in quick mode, cached.
nb_custom_formats = {".py": ["jupytext.reads", {"fmt": "py:percent"}]}
nb_execution_mode = "cache"
nb_execution_cache_path = str(attn_book.cache_path(ROOT))
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 1800                  # seconds per cell: a training cell under load takes minutes
nb_execution_in_temp = False                 # run from lessons/ beside the file, as a notebook server would
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# The API reference: autodoc reads the docstrings (derivations included); napoleon reads
# numpydoc sections, and attn's "Inputs" and "Returns" blocks.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_custom_sections = [("Inputs", "params_style"), ("Outputs", "returns_style")]

html_theme = "sphinx_book_theme"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
html_context = {"default_mode": "light"}     # the theme logs a console error when no mode is set
html_static_path = ["_static"]
html_css_files = ["attn.css"]                # a wider column, wrapping code, the fonts (Korean too)
html_js_files = ["attn-fit.js"]              # wide output tables shrink to the page's width
html_last_updated_fmt = None


def _write_redirects(app, exc) -> None:
    """One page per old lesson name (``lessons/renumbered.json``) that sends the reader to
    the lesson's page under its new name."""
    if exc is not None or app.builder.name != "html":
        return
    mapping = json.loads((ROOT / "lessons" / "renumbered.json").read_text(encoding="utf-8"))
    every = {p.stem for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py")}     # ATTN_BOOK_ONLY or not
    for old, new in mapping.items():
        if old.startswith("_") or old in every:
            continue
        if new not in every:
            raise RuntimeError(f"lessons/renumbered.json maps {old!r} to {new!r}, which is not a lesson "
                               f"(lessons: {', '.join(sorted(every))})")
        if new not in LESSON_STEMS:          # a build of some lessons only (ATTN_BOOK_ONLY)
            continue
        page = Path(app.outdir) / "lessons" / f"{old}.html"
        page.write_text(
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            f"<title>Moved: {new}</title>\n"
            f"<link rel=\"canonical\" href=\"{new}.html\">\n"
            f"<meta http-equiv=\"refresh\" content=\"0; url={new}.html\">\n"
            "</head><body>\n"
            f"<p>This lesson is now <a href=\"{new}.html\">{new}</a>: the lessons were renumbered "
            "in reading order.</p>\n</body></html>\n", encoding="utf-8")


_IMG = re.compile(r'<img alt="[^"]*" src="(\.\./_images/[0-9a-f]+\.png)" />')


def _png_text(path: Path) -> dict:
    """The text chunks of a PNG (where attn.plot stores a figure's alt text and text size)."""
    from PIL import Image, PngImagePlugin
    PngImagePlugin.MAX_TEXT_CHUNK = max(PngImagePlugin.MAX_TEXT_CHUNK, 64 * 2**20)    # the phone rendering
    PngImagePlugin.MAX_TEXT_MEMORY = max(PngImagePlugin.MAX_TEXT_MEMORY, 128 * 2**20)
    with Image.open(path) as im:
        return dict(getattr(im, "text", {}) or {})


def _phone_copy(png: Path, meta: dict) -> str:
    """Write the phone rendering a figure's PNG carries (``attn:phone``, attn.plot draws it) beside
    it as ``<name>-phone.png``, and drop it from the figure's own file, which a wide screen loads.
    Returns the phone copy's file name ("" when the figure has none)."""
    import base64
    from PIL import Image, PngImagePlugin
    phone = png.with_name(png.stem + "-phone.png")
    if "attn:phone" not in meta:                 # none, refused, or a page before this one took it out
        return phone.name if phone.is_file() and "attn:phone-refused" not in meta else ""
    phone.write_bytes(base64.b64decode(meta["attn:phone"]))
    info = PngImagePlugin.PngInfo()
    for key, value in meta.items():
        if key != "attn:phone":
            info.add_text(key, value)
    with Image.open(png) as im:
        im.load()
    im.save(png, pnginfo=info)
    return phone.name


def _figure_html(page: Path, src: str) -> str:
    """A figure of a lesson page: its alt text and the size of its smallest text
    (``data-text-px``, pixels of the image, which tests/test_book.py checks) from its PNG, a link
    that opens it at full size, and at phone widths its phone rendering (one panel a row, drawn
    for the column), shown at two image pixels a CSS pixel, with that rendering's text size."""
    png = (page.parent / src).resolve()
    meta = _png_text(png)
    phone = _phone_copy(png, meta)
    attr = lambda key: html.escape(meta.get(key, ""), quote=True)      # noqa: E731
    alt = html.escape(meta.get("Description", "a figure of the lesson"), quote=True)
    img = f'<img alt="{alt}" src="{src}" data-text-px="{attr("attn:text-px")}"'
    if not phone:
        return f'<a class="attn-figure" href="{src}" title="open the figure at full size">{img} /></a>'
    phone_src = src.rsplit("/", 1)[0] + "/" + phone
    return (f'<a class="attn-figure" href="{src}" title="open the figure at full size"><picture>'
            f'<source media="(max-width: 600px)" srcset="{phone_src} 2x" />'
            f'{img} data-phone-src="{phone}" data-phone-text-px="{attr("attn:phone-text-px")}" /></picture></a>')


def _figures_open_full_size(app, exc) -> None:
    """Every figure of a lesson page as :func:`_figure_html` writes it."""
    if exc is not None or app.builder.name != "html":
        return
    out = Path(app.outdir)
    for page in sorted((out / "lessons").glob("*.html")):
        text = page.read_text(encoding="utf-8")
        new = _IMG.sub(lambda m: _figure_html(page, m.group(1)), text)
        if new != text:
            page.write_text(new, encoding="utf-8")


def _mathjax_files() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.origin:
        raise RuntimeError("MathJax's files come from the package sphinx-mathjax-offline: "
                           "pip install -e \".[book]\"")
    return Path(spec.origin).parent / "static" / "mathjax"


def _copy_mathjax(app, exc) -> None:
    if exc is None and app.builder.name == "html":
        from sphinx.util.fileutil import copy_asset
        copy_asset(str(_mathjax_files()), str(Path(app.outdir) / "_static" / "mathjax"))


def _copy_web(app, exc) -> None:
    """The web page (``web/``: the page, its modules and the exported toy model) into the
    site's ``web/``, where ``book/web.md`` frames it: the built book carries the page, and a
    reader who serves the book has it offline. (Not ``html_extra_path``, which copies a
    folder's contents to the site's root, where the page's ``index.html`` would replace the
    book's.)"""
    if exc is None and app.builder.name == "html":
        if not (ROOT / "web" / "index.html").is_file():
            raise RuntimeError(f"book/web.md frames the web page, but {ROOT / 'web' / 'index.html'} does not exist")
        target = Path(app.outdir) / "web"
        if target.exists():
            shutil.rmtree(target)            # a file deleted from web/ leaves the site too
        shutil.copytree(ROOT / "web", target, ignore=shutil.ignore_patterns(".*", "__pycache__"))


def setup(app):
    # The library's hash is part of the environment: when attn/ or data/ change, Sphinx
    # re-reads every lesson, and the cache named by the new hash re-executes them.
    app.add_config_value("attn_library_hash", "", "env")
    app.config.attn_library_hash = attn_book.library_hash(ROOT)
    _mathjax_files()                 # fail early, with the command that installs it
    app.connect("build-finished", _copy_mathjax)
    app.connect("build-finished", _write_redirects)
    app.connect("build-finished", _copy_web)
    app.connect("build-finished", _figures_open_full_size)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

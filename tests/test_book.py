"""The book (``python -m attn.site.book``) builds with every lesson executed, and every page works
in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright from PyPI,
never a downloaded browser) opens each page from a server on 127.0.0.1 and checks that every
image loaded, the maths rendered, the console stayed clean, a lesson page shows its check's
output, and no request left 127.0.0.1. A screenshot of each page goes to
``build/book/screenshots/``.

The build runs once per session (a fixture). It executes every lesson in quick mode, so each
lesson's run is checked here, from the build's cache (attn.site.book.executed_lesson), and
tests/test_lessons.py runs the lessons itself only where the book does not."""
from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from attn.site import book  # noqa: E402

LESSONS = book.lesson_files(ROOT)
CHROMIUM = os.environ.get("ATTN_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHECK_OUTPUT = "Check passed"                 # what every lesson's last check prints when it passes


def _missing_toolchain() -> str | None:
    for module, extra in (("sphinx", "book"), ("myst_nb", "book"), ("sphinx_book_theme", "book"),
                          ("jupytext", "book"), ("sphinx-mathjax-offline", "book")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e \".[{extra}]\")"
    return None


@pytest.fixture(scope="session")
def built_book() -> Path:
    """Build the book once per session (cached: a rebuild executes only what changed)."""
    missing = _missing_toolchain()
    if missing:
        pytest.skip(missing)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, "-m", "attn.site.book"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, f"python -m attn.site.book failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return book.HTML


@pytest.fixture(scope="session")
def site(built_book):
    """The built site served over HTTP on 127.0.0.1 (a free port); yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(built_book))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


# Module-scoped: Playwright's sync API allows one running instance per thread, and
# tests/test_web.py starts its own after this module.
@pytest.fixture(scope="module")
def browser():
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed (pip install -e \".[browser]\")")
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set ATTN_CHROMIUM)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class PageReport:
    """What a browser saw while loading one page."""

    def __init__(self):
        self.console_errors: list[str] = []
        self.outside: list[str] = []          # requests to anywhere but 127.0.0.1, blocked
        self.failed: list[str] = []           # requests to 127.0.0.1 that failed or answered >= 400


_IMAGES = """() => Array.from(document.images).map(img => ({src: img.currentSrc || img.src,
    complete: img.complete, width: img.naturalWidth}))"""
_MATH = """() => ({
    source: document.querySelectorAll('.math, span.math, div.math').length,
    rendered: document.querySelectorAll('mjx-container').length,
    errors: Array.from(document.querySelectorAll('mjx-merror, mjx-container [data-mjx-error]'))
        .map(e => e.getAttribute('data-mjx-error') || e.textContent).slice(0, 5),
    unrendered: Array.from(document.querySelectorAll('.math')).filter(e =>
        !e.querySelector('mjx-container') && /\\\\\\(|\\\\\\[|\\$\\$/.test(e.textContent))
        .map(e => e.textContent.slice(0, 80)).slice(0, 5),
})"""


_LAYOUT = """() => ({
    overflowing: Array.from(document.querySelectorAll('div.cell_input pre, div.cell_output pre, div.highlight pre'))
        .filter(e => e.scrollWidth > e.clientWidth + 1)
        .map(e => `${e.scrollWidth} > ${e.clientWidth} px: ${e.innerText.split('\\n').sort((a, b) => b.length - a.length)[0].slice(0, 90)}`),
    body: parseFloat(getComputedStyle(document.querySelector('article p') || document.body).fontSize),
    gutters: Array.from(document.querySelectorAll('div.math mjx-mtable[side] > mjx-table')).map(t => {
        const box = t.closest('div.math');
        return Math.round(t.getBoundingClientRect().left - box.getBoundingClientRect().left + box.scrollLeft);
    }),
    tableCells: Array.from(document.querySelectorAll('article table td, article table th')).map(c => {
        const s = getComputedStyle(c), r = document.createRange(), line = parseFloat(s.lineHeight) || 1.5 * parseFloat(s.fontSize);
        r.selectNodeContents(c);
        return {text: c.innerText.trim().slice(0, 60), lines: Math.round(r.getBoundingClientRect().height / line),
                width: Math.round(c.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight))};
    }),
    column: (() => { const a = document.querySelector('article') || document.body, s = getComputedStyle(a);
                     return a.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight); })(),
    figures: Array.from(document.querySelectorAll('img')).filter(i => i.src.includes('/_images/')).map(i => {
        const phone = !!i.dataset.phoneSrc && (i.currentSrc || i.src).endsWith(i.dataset.phoneSrc);
        const link = i.closest('a');
        return {src: i.src.split('/').pop(), shownSrc: (i.currentSrc || i.src).split('/').pop(), alt: i.alt, phone,
                scrolls: !!link && link.classList.contains('attn-wide'),
                textPx: parseFloat((phone ? i.dataset.phoneTextPx : i.dataset.textPx) || 'NaN'),
                shown: i.getBoundingClientRect().width, natural: i.naturalWidth,
                link: link ? link.getAttribute('href') : null};
    }),
})"""
MIN_TEXT_PX = 9.0                             # the smallest text a figure may show on the page, CSS pixels
#: A table cell taller than this many lines at 390 px is a paragraph squeezed into a column a few
#: words wide (another column took the width): the table wants shorter cells, or fewer columns.
MOST_TABLE_CELL_LINES = 6

#: What a reader cannot reach or read: the page scrolling sideways; an equation whose
#: content starts left of its box (no scrolling reaches it) or ends right of it where the box
#: does not scroll; a wrapped line of code whose continuation starts left of the line's code.
_CUT = r"""() => {
    const W = document.documentElement.clientWidth, out = {page: document.documentElement.scrollWidth - W,
                                                           maths: [], indents: []};
    const scrolled = (e) => {             // inside a box that scrolls sideways (a wide table's)
        for (let a = e.parentElement; a && a !== document.body; a = a.parentElement)
            if (['auto', 'scroll'].includes(getComputedStyle(a).overflowX)) return true;
        return false;
    };
    for (const box of document.querySelectorAll('div.math, span.math')) {
        const m = box.querySelector('mjx-container > mjx-math');
        if (!m) continue;
        const b = box.getBoundingClientRect(), r = m.getBoundingClientRect();
        const scrolls = ['auto', 'scroll'].includes(getComputedStyle(box).overflowX);
        const reach = b.left + (scrolls ? box.scrollWidth : box.clientWidth);
        if (r.left < b.left - 1 || r.right > reach + 1 || (b.right > W + 1 && !scrolled(box)))
            out.maths.push(`${box.textContent.trim().slice(0, 60)}: maths ${Math.round(r.left)}..`
                           + `${Math.round(r.right)} px, its box ${Math.round(b.left)}..${Math.round(b.right)} px,`
                           + ` reaching ${Math.round(reach)}`);
    }
    const blockOf = (n, pre) => { for (let e = n.parentElement; e && e !== pre; e = e.parentElement)
        if (getComputedStyle(e).display === 'block') return e; return pre; };
    for (const pre of document.querySelectorAll('div.highlight pre')) {
        if (pre.closest('.cell_output')) continue;
        const lines = [];                    // each source line: [text node, start, end] pieces
        let line = null, block = null;
        const walk = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT);
        for (let n = walk.nextNode(); n; n = walk.nextNode()) {
            if (blockOf(n, pre) !== block) { block = blockOf(n, pre); lines.push(line = []); }
            let start = 0;
            n.textContent.split('\n').forEach((part, i) => {
                if (i > 0) lines.push(line = []);
                line.push([n, start, start + part.length]);
                start += part.length + 1;
            });
        }
        for (const pieces of lines) {
            const text = pieces.map(([n, a, b]) => n.textContent.slice(a, b)).join('');
            const first = text.search(/\S/);
            if (first < 0) continue;
            let at = first, firstRect = null;
            for (const [n, a, b] of pieces) {
                if (at < b - a) { const r = document.createRange(); r.setStart(n, a + at); r.setEnd(n, a + at + 1);
                                  firstRect = r.getBoundingClientRect(); break; }
                at -= b - a;
            }
            for (const [n, a, b] of pieces) {
                const r = document.createRange(); r.setStart(n, a); r.setEnd(n, b);
                const below = firstRect.top + firstRect.height / 2;
                const bad = Array.from(r.getClientRects()).find(q => q.width > 0 && q.top > below
                                                                 && q.left < firstRect.left - 1);
                if (bad) { out.indents.push(`${text.slice(0, 70)}: a continuation at ${Math.round(bad.left)} px, `
                                            + `the line's code at ${Math.round(firstRect.left)} px`); break; }
            }
        }
    }
    return out;
}"""


def visit(browser, url: str, screenshot: Path | None, act=None, width: int = 1280, full_page: bool = True):
    """Open ``url`` in a fresh context that lets no request leave 127.0.0.1; wait for the
    images and for MathJax; then ``act(page)``, if given, whose result joins the facts as
    ``facts["act"]``; return (page facts, PageReport). The page is closed after."""
    report = PageReport()
    context = browser.new_context(viewport={"width": width, "height": 900 if width > 600 else 844},
                                  service_workers="block")

    def route(r):
        host = urlsplit(r.request.url).hostname
        if r.request.url.startswith(("data:", "blob:", "about:")) or host == "127.0.0.1":
            r.continue_()
        else:
            report.outside.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.on("console", lambda m: report.console_errors.append(f"{m.text} ({m.location.get('url', '')})")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: report.console_errors.append(f"uncaught: {e}"))
    page.on("request", lambda r: None if urlsplit(r.url).hostname in ("127.0.0.1", None)
            or r.url.startswith(("data:", "blob:", "about:")) or r.url in report.outside
            else report.outside.append(r.url))
    page.on("requestfailed", lambda r: report.failed.append(f"{r.url} ({r.failure})")
            if urlsplit(r.url).hostname == "127.0.0.1" else None)
    page.on("response", lambda r: report.failed.append(f"{r.url} (HTTP {r.status})") if r.status >= 400 else None)
    try:
        page.goto(url, wait_until="load")
        page.wait_for_load_state("networkidle")
        page.wait_for_function("() => Array.from(document.images).every(i => i.complete)", timeout=30_000)
        if page.evaluate("() => !!document.querySelector('.math')"):
            page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                                   timeout=30_000)
            page.evaluate("() => MathJax.startup.promise")
        facts = {"url": page.url, "title": page.title(), "images": page.evaluate(_IMAGES),
                 "text": page.evaluate("() => document.body.innerText"),
                 "math": page.evaluate(_MATH),
                 "outputs": page.evaluate("() => Array.from(document.querySelectorAll('.cell_output'))"
                                          ".map(e => e.innerText).join('\\n')"),
                 "layout": page.evaluate(_LAYOUT), "cut": page.evaluate(_CUT), "width": width}
        if act is not None:
            facts["act"] = act(page)
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=full_page)
    finally:
        context.close()
    return facts, report


def unused_phone_fetches(failed: list[str], facts: dict) -> list[str]:
    """The failures that are a phone rendering's fetch cancelled (net::ERR_ABORTED) on a page
    wider than a phone that shows none of them: harmless to a reader (the wide figures are
    shown), and seen only on a loaded machine, for a few pages of a full run. Any other failure,
    and any at a phone's width or on a page showing a phone rendering, still counts."""
    if facts["width"] <= 600 or any(i["src"].endswith("-phone.png") for i in facts["images"]):
        return []
    return [f for f in failed if f.endswith("-phone.png (net::ERR_ABORTED)")]


def test_only_unused_cancelled_phone_fetches_are_forgiven():
    aborted, missing = "http://127.0.0.1:1/_images/a-phone.png (net::ERR_ABORTED)", "http://127.0.0.1:1/b.png (HTTP 404)"
    wide = {"width": 1280, "images": [{"src": "http://127.0.0.1:1/_images/a.png"}]}
    assert unused_phone_fetches([aborted, missing], wide) == [aborted]
    assert unused_phone_fetches([aborted], {**wide, "width": 390}) == []
    assert unused_phone_fetches([aborted], {**wide, "images": [{"src": "http://127.0.0.1:1/_images/c-phone.png"}]}) == []


def assert_page_works(facts: dict, report: PageReport, name: str) -> None:
    assert not report.outside, f"{name}: requests left 127.0.0.1 (blocked): {report.outside}"
    failed = [f for f in report.failed if f not in unused_phone_fetches(report.failed, facts)]
    assert not failed, f"{name}: requests failed: {failed}"
    assert not report.console_errors, f"{name}: console errors: {report.console_errors}"
    broken = [i["src"] for i in facts["images"] if not (i["complete"] and i["width"] > 0)]
    assert not broken, f"{name}: images that did not load: {broken}"
    math = facts["math"]
    assert not math["errors"], f"{name}: MathJax errors: {math['errors']}"
    assert not math["unrendered"], f"{name}: maths left as TeX: {math['unrendered']}"
    if math["source"]:
        assert math["rendered"] >= math["source"], f"{name}: {math['source']} maths, {math['rendered']} rendered"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_ran_in_the_book(lesson, built_book):
    """The build executed this very code with this library and data in quick mode, on NumPy:
    nothing raised, the lesson's last check passed, and it showed a figure."""
    nb = book.executed_lesson(lesson)
    assert nb is not None, f"{lesson.name}: the book's build left no executed notebook of it in its cache"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"], f"{lesson.name} raised in the book"
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert CHECK_OUTPUT in text, f"{lesson.name} did not pass its check in the book:\n{text[-3000:]}"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{lesson.name} showed no figure in the book"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_page(lesson, site, browser):
    facts, report = visit(browser, f"{site}lessons/{lesson.stem}.html", book.SCREENSHOTS / f"{lesson.stem}.png")
    assert_page_works(facts, report, lesson.name)
    title = re.search(r"^# # (.+)$", lesson.read_text(encoding="utf-8"), re.M)
    assert title and title.group(1).startswith(f"Lesson {int(lesson.name[:2])}: "), \
        f"{lesson.name}: its first markdown cell must open with '# Lesson {int(lesson.name[:2])}: <title>'"
    assert facts["title"].startswith(title.group(1).split(":")[0] + ":"), (facts["title"], title.group(1))
    assert CHECK_OUTPUT in facts["outputs"], f"{lesson.name}: no '{CHECK_OUTPUT}' in the page's outputs"
    figures = [i for i in facts["images"] if "/_images/" in i["src"]]
    assert figures, f"{lesson.name}: the page shows no figure (attn.plot.show_figure shows them inline)"
    assert_nothing_cut_off(facts, lesson.name)


def assert_readable(facts: dict, name: str) -> None:
    """At any width: the page does not scroll sideways, every display equation can be read
    whole (inside its box, or by scrolling the box), and wrapped code keeps its indentation."""
    cut, width = facts["cut"], facts["width"]
    assert cut["page"] <= 1, f"{name}: the page scrolls sideways by {cut['page']} px at {width} px"
    assert not cut["maths"], f"{name}: display maths cut off at {width} px: {cut['maths'][:4]}"
    assert not cut["indents"], f"{name}: wrapped code lines that lose their indent at {width} px: {cut['indents'][:4]}"


def assert_nothing_cut_off(facts: dict, name: str) -> None:
    """At 1280 px no code or output block scrolls sideways, and every figure's smallest text
    shows at MIN_TEXT_PX or more, has alt text that is not a file name, and opens full size."""
    assert_readable(facts, name)
    layout = facts["layout"]
    assert not layout["overflowing"], f"{name}: blocks that scroll sideways at 1280 px: {layout['overflowing']}"
    for f in layout["figures"]:
        assert f["alt"] and not re.fullmatch(r"[./\w-]*\.png", f["alt"]), f"{name}: {f['src']} has no alt text"
        assert f["link"] and f["link"].endswith(f["src"]), f"{name}: {f['src']} does not open full size"
        assert f["textPx"] == f["textPx"], f"{name}: {f['src']} was not saved by attn.plot (no text size)"
        shown = f["textPx"] * min(1.0, f["shown"] / f["natural"])
        assert shown >= MIN_TEXT_PX, (f"{name}: {f['src']} ({f['alt'][:60]}) shows its smallest text at "
                                      f"{shown:.1f} px, under {MIN_TEXT_PX}")


def figures_on_a_phone(layout: dict) -> dict:
    """Each figure of a page at a phone's width, sorted: served its phone rendering (attn.plot
    drew it for the column) or not; wider than the article's column (it scrolls sideways in its
    own box, or runs off the page), a phone rendering shown wider than its own pixels (stretched),
    or with its smallest text (the size the figure was drawn with, attn.plot records it, times
    the scale it is shown at) under the body text's size. A figure wider than the column either
    scrolls in its own box (one whose phone rendering attn.plot refused) or runs off."""
    body, column = layout["body"], layout["column"]
    found = {"figures": [], "phone rendering": [], "wider than the column": [], "scrolling in its box": [],
             "running off": [], "stretched": [], "text under the body's": []}
    for f in layout["figures"]:
        found["figures"].append(f["src"])
        what = f"{f['shownSrc']} ({f['alt'][:50]})"
        if f["phone"]:
            found["phone rendering"].append(what)
        if f["shown"] > column + 1:
            found["wider than the column"].append(f"{what}: {f['shown']:.0f} px in a {column:.0f} px column")
            found["scrolling in its box" if f["scrolls"] and not f["phone"] else "running off"].append(what)
        if f["phone"] and f["shown"] > f["natural"] + 0.5:         # a refused one may be, to keep its text readable
            found["stretched"].append(f"{what}: {f['natural']} px image shown {f['shown']:.0f} px wide")
        text = f["textPx"] * f["shown"] / f["natural"]
        if not text >= body - 0.5:
            found["text under the body's"].append(f"{what}: {text:.1f} px, the body's {body:.1f} px")
    return found


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_page_on_a_phone(lesson, site, browser):
    """At 390 px (a phone) every lesson reads: no sideways scrolling of the page, every display
    equation whole or scrolling in its own box, wrapped code under its own indentation, no table
    cell squeezed into a column a few words wide, every figure within the column, never stretched
    beyond its own pixels, its smallest text at least the body text's size, and a link to its
    full size. A screenshot goes to
    build/book/screenshots/<lesson>-390.png; the counts are printed (pytest -s shows them)."""
    facts, report = visit(browser, f"{site}lessons/{lesson.stem}.html",
                          book.SCREENSHOTS / f"{lesson.stem}-390.png", width=390)
    assert_page_works(facts, report, lesson.name + " at 390 px")
    assert_readable(facts, lesson.name)
    layout = facts["layout"]
    for f in layout["figures"]:
        assert f["link"] and f["link"].endswith(f["src"]), f"{lesson.name}: {f['src']} does not open full size"
    squeezed = [c for c in layout["tableCells"] if c["lines"] > MOST_TABLE_CELL_LINES]
    assert not squeezed, (f"{lesson.name}: table cells squeezed into a narrow column on a phone (more than "
                          f"{MOST_TABLE_CELL_LINES} lines): {squeezed[:3]}")
    gutters = [g for g in layout["gutters"] if g > 2]
    assert not gutters, f"{lesson.name}: numbered equations start {gutters} px right of their box on a phone"
    found = figures_on_a_phone(layout)
    print(f"{lesson.stem} at 390 px (column {layout['column']:.0f} px, body text {layout['body']:.1f} px): "
          + ", ".join(f"{len(v)} {k}" for k, v in found.items()))
    wrong = [f"{k}: {v}" for k, v in found.items() if k in ("running off", "stretched", "text under the body's") and v]
    assert not wrong, f"{lesson.name}: figures that do not read on a phone:\n" + "\n".join(wrong)


def test_no_figure_of_a_lesson_overlaps_its_own_text(built_book):
    """Every figure a lesson page shows was saved by attn.plot, which measured the extents of
    its texts with matplotlib's renderer (attn.plot.text_overlaps) and stored the pairs that
    overlap in the PNG: there are none."""
    from PIL import Image
    seen, overlapping = 0, []
    for page in sorted((built_book / "lessons").glob("*.html")):
        for src in sorted(set(re.findall(r'<img alt="[^"]*" src="(\.\./_images/[0-9a-f]+\.png)"',
                                         page.read_text(encoding="utf-8")))):
            with Image.open((page.parent / src).resolve()) as im:
                text = dict(getattr(im, "text", {}) or {})
            assert "attn:overlaps" in text, f"{page.name}: {src} was not saved by attn.plot.show_figure"
            assert "attn:phone-overlaps" in text, f"{page.name}: {src} has no phone rendering (attn.plot)"
            assert "attn:phone-refused" in text or not text["attn:phone-overlaps"], f"{src}: served overlapping on a phone"
            seen += 1
            if text["attn:overlaps"]:
                overlapping.append(f"{page.stem}: {text.get('Description', src)[:70]}: {text['attn:overlaps'][:300]}")
    assert seen >= len(LESSONS), f"only {seen} figures on {len(LESSONS)} lesson pages"
    assert not overlapping, "figures whose texts overlap:\n" + "\n".join(overlapping)


def test_the_overlap_check_sees_overlapping_texts():
    """attn.plot.text_overlaps finds two titles that run into each other and a label on a
    tick label, and nothing in a figure laid out with room to spare."""
    from matplotlib.figure import Figure
    from attn.plot import text_overlaps
    fig = Figure(figsize=(5, 2))
    for ax in fig.subplots(1, 3):
        ax.set_title("a title far wider than its panel")
    assert len(text_overlaps(fig)) == 2
    fig = Figure(figsize=(3, 3))
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([0, 1], [0, 1])
    ax.text(0.0, 0.0, "on the tick labels", transform=ax.transAxes, ha="center", va="top", fontsize=14)
    assert any("on the tick labels" in pair for pair in text_overlaps(fig)), text_overlaps(fig)
    fig = Figure(figsize=(8, 3), layout="constrained")
    for ax in fig.subplots(1, 2):
        ax.plot([0, 1], [0, 1])
        ax.set_title("short")
        ax.set_xlabel("x")
    assert text_overlaps(fig) == []


#: What a page must never show: where the book was built (a path of the build machine), a
#: Path's repr. (Machines' homes and temporary folders, and this checkout wherever it is.)
_MACHINE = re.compile(r"PosixPath\(|WindowsPath\(|(?<![\w.])/(?:home|root|tmp|Users|work|private|var/folders)/")


def test_no_page_shows_the_build_machine(built_book):
    offenders = []
    for page in sorted(built_book.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        for hit in [str(ROOT)] if str(ROOT) in text else []:
            offenders.append(f"{page.relative_to(built_book)}: {hit}")
        if page.parent.name == "lessons":
            offenders += [f"{page.relative_to(built_book)}: ...{text[max(0, m.start() - 40):m.end() + 40]}..."
                          for m in _MACHINE.finditer(text)][:3]
    assert not offenders, "pages that show the build machine's paths:\n" + "\n".join(offenders[:20])


def test_a_phone_sees_the_point_of_lesson_4s_tables(site, browser):
    """At 390 px (a phone) lesson 4's tables keep their columns on screen: the [pad] column,
    their point, is visible without scrolling. Screenshots of the page at 1280 and 390 px go to
    build/book/screenshots/book-1280.png and book-390.png (docs/ keeps a copy of each)."""
    lesson = next((p for p in LESSONS if p.name.startswith("04_")), None)
    if lesson is None:
        pytest.skip(f"lesson 4 is not in this build (${book.ONLY_ENV})")
    url = f"{site}lessons/{lesson.stem}.html"
    visit(browser, url, book.SCREENSHOTS / "book-1280.png", full_page=False)

    def pad_column(page):
        return page.evaluate("""() => {
            const pre = Array.from(document.querySelectorAll('div.cell_output pre'))
                .find(e => e.innerText.includes('[pad]') && e.innerText.includes('step 4'));
            pre.scrollIntoView({block: 'center'});
            const node = Array.from(pre.childNodes).find(n => n.textContent.includes('step 4'));
            const text = node.textContent, header = text.indexOf('Educatio', text.indexOf('step 4'));
            const rect = (word) => {
                const at = text.indexOf(word, header), range = document.createRange();
                range.setStart(node, at); range.setEnd(node, at + word.length);
                return range.getBoundingClientRect();
            };
            const first = rect('Educatio'), pad = rect('[pad]');
            return {right: pad.right, width: window.innerWidth, scroll: pre.scrollWidth - pre.clientWidth,
                    font: parseFloat(getComputedStyle(pre).fontSize), oneLine: Math.abs(pad.top - first.top) < 2};
        }""")
    facts, report = visit(browser, url, book.SCREENSHOTS / "book-390.png", act=pad_column, width=390,
                          full_page=False)
    assert_page_works(facts, report, lesson.name + " at 390 px")
    seen = facts["act"]
    assert seen["scroll"] <= 1 and seen["right"] <= seen["width"], f"[pad] is off screen on a phone: {seen}"
    assert seen["oneLine"], f"lesson 4's table wraps on a phone, losing its columns: {seen}"
    assert seen["font"] >= 8, f"lesson 4's tables shrink to {seen['font']} px on a phone"


def test_front_page_lists_every_lesson_in_order(site, browser, built_book):
    facts, report = visit(browser, site, book.SCREENSHOTS / "index.png")
    assert_page_works(facts, report, "index.html")
    html = (built_book / "index.html").read_text(encoding="utf-8")
    positions = [html.find(f'href="lessons/{p.stem}.html"') for p in LESSONS]
    assert all(i >= 0 for i in positions), [p.stem for p, i in zip(LESSONS, positions) if i < 0]
    assert positions == sorted(positions), "the front page lists the lessons out of order"
    assert "python -m attn.site.book" in facts["text"] and "pip install -e" in facts["text"]


def test_every_other_page(site, browser, built_book):
    """The pages that are not lessons (the API reference, the index, search) and that are not
    redirects: every one loads cleanly."""
    lesson_pages = {f"lessons/{p.stem}.html" for p in LESSONS}
    pages = sorted(p.relative_to(built_book).as_posix() for p in built_book.rglob("*.html")
                   if not p.relative_to(built_book).as_posix().startswith("_")
                   and 'http-equiv="refresh"' not in p.read_text(encoding="utf-8"))
    others = [p for p in pages if p not in lesson_pages and p != "index.html"]
    assert "api/layers.html" in others and "search.html" in others, others
    for page in others:
        facts, report = visit(browser, site + page, book.SCREENSHOTS / (page.replace("/", "_")[:-5] + ".png"))
        assert_page_works(facts, report, page)


def test_the_web_page_translates_inside_the_book(site, browser, built_book):
    """book/web.md frames the page of web/, which the build copies into the site (book/conf.py):
    inside the book the page loads the shipped model from the site, and typing a sentence
    translates it token for token as attn does in NumPy, with every head drawn; no request
    leaves 127.0.0.1 and the console stays clean (tests/test_web.py proves the numbers)."""
    from attn.evaluate import translate
    from attn.site.export import load_export
    for path in (ROOT / "web").rglob("*"):
        if path.is_file():
            copy = built_book / "web" / path.relative_to(ROOT / "web")
            assert copy.is_file() and copy.read_bytes() == path.read_bytes(), f"the site's copy of {path} differs"
    model, vocab, doc = load_export(ROOT / "web" / "model")
    sentence = doc["sentences"][1]
    expected = translate(model, vocab, [sentence])[0].tgt_tokens + ["</s>"]

    def type_a_sentence(page):
        assert page.get_attribute("#open-web-page", "href") == "web/index.html"
        frame = page.locator("iframe#web-page").element_handle().content_frame()
        frame.wait_for_function("() => ['ready', 'error'].includes(document.body.dataset.state)", timeout=60_000)
        assert frame.evaluate("document.body.dataset.state") == "ready", frame.inner_text("#model-info")
        frame.fill("#source", sentence[:-1])
        frame.wait_for_function("() => document.body.dataset.state === 'done'")
        frame.evaluate("window.attnTiming = null")
        frame.type("#source", sentence[-1])
        frame.wait_for_function("() => document.body.dataset.state === 'done' && window.attnTiming")
        return {"tokens": frame.locator("#output .tok").all_inner_texts(),
                "maps": frame.locator(".maps canvas").count(), "url": frame.url}

    facts, report = visit(browser, site + "web.html", book.SCREENSHOTS / "web_in_the_book.png", act=type_a_sentence)
    assert_page_works(facts, report, "web.html")
    seen = facts["act"]
    assert seen["url"] == site + "web/index.html"
    assert seen["tokens"] == expected, (sentence, seen["tokens"], expected)
    cfg = model.config
    assert seen["maps"] == (cfg.n_encoder_layers + 2 * cfg.n_decoder_layers) * cfg.n_heads


def test_api_reference_shows_every_layer_with_its_derivation(built_book):
    html = (built_book / "api" / "layers.html").read_text(encoding="utf-8")
    modules = sorted(p.stem for p in (ROOT / "attn" / "layers").glob("*.py") if not p.stem.startswith("_"))
    missing = [m for m in modules if f'id="module-attn.layers.{m}"' not in html]
    assert not missing, f"book/api/layers.md does not document attn.layers.{missing}"
    import attn.layers
    for name in attn.layers.__all__:
        assert f'id="attn.layers.' in html and re.search(rf'id="attn\.layers\.\w+\.{name}"', html), name
    assert "Jacobian" in html            # softmax_backward's derivation, from its docstring


def test_old_lesson_names_redirect_to_the_new_pages(site, browser, built_book):
    import json
    mapping = json.loads((ROOT / "lessons" / "renumbered.json").read_text(encoding="utf-8"))
    current = {p.stem for p in LESSONS}
    moved = {old: new for old, new in mapping.items() if not old.startswith("_") and old not in current}
    assert moved
    for old, new in moved.items():
        facts, report = visit(browser, f"{site}lessons/{old}.html", None)
        assert not report.outside and not report.console_errors, (old, report.outside, report.console_errors)
        assert facts["url"].endswith(f"/lessons/{new}.html"), (old, facts["url"])


def test_the_site_needs_nothing_from_outside(built_book):
    """Belt and braces for the browser's check: no page or script names a CDN for MathJax,
    and MathJax's own files are in the site."""
    assert (built_book / "_static" / "mathjax" / "tex-chtml.js").is_file()
    for page in built_book.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        for src in re.findall(r'<(?:script|link)[^>]+(?:src|href)="([^"]+)"', text):
            assert not urlsplit(src).netloc, f"{page.relative_to(built_book)} loads {src}"


def test_a_lesson_whose_check_fails_fails_the_build(tmp_path):
    """A copy of the project with two tiny lessons, the second of which fails its check:
    python -m attn.site.book exits non-zero and names the lesson; the first lesson's page is fine."""
    missing = _missing_toolchain()
    if missing:
        pytest.skip(missing)
    shutil.copytree(ROOT / "attn", tmp_path / "attn", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "book", tmp_path / "book", ignore=shutil.ignore_patterns("lessons", "__pycache__"))
    (tmp_path / "web").symlink_to(ROOT / "web")           # the page the book frames (book/web.md)
    (tmp_path / "data").mkdir()
    (tmp_path / "lessons").mkdir()
    (tmp_path / "lessons" / "renumbered.json").write_text('{"_about": "none renamed"}', encoding="utf-8")
    cell = "# %% [markdown]\n# # Lesson {n}: {what}\n#\n# Text.\n\n# %%\nx = {x}\nassert x == 1, 'the check fails'\n" \
           "print('Check passed')\n"
    (tmp_path / "lessons" / "01_passes.py").write_text(cell.format(n=1, what="passes", x=1), encoding="utf-8")
    (tmp_path / "lessons" / "02_fails.py").write_text(cell.format(n=2, what="fails", x=2), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "attn.site.book", "-j", "1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "02_fails" in log and "the check fails" in log, log[-3000:]
    assert "build succeeded" not in log


def _imports(path: Path, package: str) -> set[str]:
    """The modules a Python file imports (relative imports resolved against ``package``)."""
    import ast
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def test_no_lesson_and_no_module_of_the_course_imports_the_site():
    """attn/site/ (the book, the export for the page, the browser driver) is a room of its own:
    the course never imports it, which is why a change there re-executes no lesson."""
    offenders = []
    for path in sorted((ROOT / "attn").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[:2] == ("attn", "site"):
            continue
        package = ".".join(parts if path.name == "__init__.py" else parts[:-1])
        if any(m == "attn.site" or m.startswith("attn.site.") for m in _imports(path, package)):
            offenders.append(path.relative_to(ROOT).as_posix())
    for path in sorted((ROOT / "lessons").rglob("*.py")):
        if any(m == "attn.site" or m.startswith("attn.site.") for m in _imports(path, "")):
            offenders.append(path.relative_to(ROOT).as_posix())
    assert not offenders, f"these import attn.site, which the course must not: {offenders}"


def test_a_failed_build_shows_its_cause_not_only_a_temporary_log(monkeypatch):
    """A failed parallel build said "Sphinx parallel build error" and left the cause in a temporary
    log: the build asks Sphinx for the whole traceback (-T), which prints a parallel reader's too."""
    pytest.importorskip("sphinx")
    import sphinx.cmd.build
    seen = []
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(sphinx.cmd.build, "build_main", lambda argv: seen.append(argv) or 1)
    assert book.main(["-j", "2"]) == 1
    args = sphinx.cmd.build.get_parser().parse_args(seen[0])
    assert args.traceback and args.jobs == 2 and args.keep_going


def test_a_change_in_attn_site_re_executes_no_lesson(tmp_path):
    """The cache of executed lessons is named by a hash of attn/ and data/ but for attn/site/."""
    for name, text in (("attn/model.py", "x = 1\n"), ("attn/site/book.py", "y = 1\n"),
                       ("attn/site/browser.py", "z = 1\n"), ("data/toy/train.en", "a\n")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    before = book.library_hash(tmp_path)
    (tmp_path / "attn" / "site" / "browser.py").write_text("z = 2\n", encoding="utf-8")
    (tmp_path / "attn" / "site" / "export.py").write_text("w = 1\n", encoding="utf-8")
    assert book.library_hash(tmp_path) == before
    (tmp_path / "attn" / "model.py").write_text("x = 2\n", encoding="utf-8")
    assert book.library_hash(tmp_path) != before


def test_a_weak_model_or_another_blas_is_cached_apart(tmp_path, monkeypatch):
    """A build with ATTN_QUICK_WEAK=1, or another number of BLAS threads or another BLAS
    kernel, executes the lessons again instead of reusing the outputs of another setting."""
    for name in ("ATTN_QUICK_WEAK", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE"):
        monkeypatch.delenv(name, raising=False)
    before = book.library_hash(tmp_path)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")               # the build's default
    assert book.library_hash(tmp_path) == before
    for name, value in (("ATTN_QUICK_WEAK", "1"), ("OPENBLAS_NUM_THREADS", "2"), ("OPENBLAS_CORETYPE", "Haswell")):
        monkeypatch.setenv(name, value)
        assert book.library_hash(tmp_path) != before, name

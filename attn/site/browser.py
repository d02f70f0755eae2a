"""The page in ``web/`` served locally and opened in headless Chromium: what the browser tests
(``tests/test_web.py``, ``tests/test_book.py``) use, and the page's speed measured
(``python -m attn.site.browser measure``: the time from a keystroke to the last token, and the
bytes the page transfers on load).

Chromium is the system's (Debian's ``chromium`` package), driven by Playwright from PyPI
through ``executable_path``: no browser is ever downloaded. The flags keep a headless
Chromium from reaching for the network (background updates, sync, QUIC), which a closed
machine would leave it waiting on.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import statistics
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: The page and its modules, in a source checkout.
WEB_DIR = Path(__file__).resolve().parents[2] / "web"

CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    """The system Chromium (``$ATTN_CHROMIUM``, else ``chromium`` on the PATH), or None."""
    found = os.environ.get("ATTN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return found if found and Path(found).exists() else None


def missing() -> str | None:
    """Why the browser cannot run here (a sentence), or None when it can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install -e '.[browser]')"
    if chromium_path() is None:
        return "no system Chromium (apt-get install chromium; set ATTN_CHROMIUM to another binary)"
    return None


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Files under ``directory``, plus each mount ``{"/prefix/": folder}`` at its prefix; quiet.

    A request that would leave its folder (a ``..`` component, plain or percent-encoded, an
    absolute path after a mount's prefix, a symbolic link that points outside) is answered
    404: the server shows the page's files and the mounted models, nothing else on the disk.
    """
    mounts: dict = {}

    def translate_path(self, path):
        """The file for a URL path, or None when the path leaves the folder it names."""
        path = unquote(path.split("?", 1)[0].split("#", 1)[0], errors="surrogatepass")
        root, rest = Path(self.directory), path
        for prefix, folder in self.mounts.items():
            if path.startswith(prefix):
                root, rest = Path(folder), path[len(prefix):]
                break
        if rest.startswith("/") and root == Path(self.directory):
            rest = rest[1:]                               # the site's own root: "/x" is "x" under it
        parts = rest.split("/")
        if rest.startswith("/") or "\\" in rest or any(p in ("..", ".") for p in parts):
            return None                                   # absolute after a mount, or climbing out
        target = root.joinpath(*[p for p in parts if p])
        try:
            if not target.resolve().is_relative_to(root.resolve()):
                return None                               # a symbolic link that points outside
        except (OSError, RuntimeError):
            return None
        return str(target) + ("/" if path.endswith("/") else "")

    def send_head(self):
        if self.translate_path(self.path) is None:
            self.send_error(404, "File not found")
            return None
        return super().send_head()

    def end_headers(self):
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(directory=WEB_DIR, mounts: dict | None = None):
    """Serve ``directory`` on 127.0.0.1 at a free port in a thread; yields the base URL
    (``http://127.0.0.1:PORT/``) and stops the server on exit."""
    handler = type("Handler", (_Handler,), {"mounts": dict(mounts or {})})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def chromium():
    """A headless system Chromium under Playwright; yields the Browser."""
    from playwright.sync_api import sync_playwright
    path = chromium_path()
    if path is None:
        raise RuntimeError(missing())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


# --------------------------------------------------------------------------- the speed of the page

#: The issue's target: keystroke to the last token of a ten-word sentence, on two cores.
TARGET_MS = 200.0
WORDS = 10


def word_count(sentence: str) -> int:
    """Words: the whitespace-separated pieces with a letter or digit in them (not ``.``)."""
    return sum(1 for piece in sentence.split() if re.search(r"\w", piece))


def ten_word_sentence(sentences: list[str]) -> str:
    """The first of ``sentences`` (the model's test sentences) with ten words."""
    for sentence in sentences:
        if word_count(sentence) == WORDS:
            return sentence
    raise ValueError(f"none of the model's {len(sentences)} test sentences has {WORDS} words: pass --sentence")


def _guarded_context(chromium, problems: list[str]):
    """A fresh context (empty cache) that lets no request leave 127.0.0.1 and records, in
    ``problems``, every request it blocked and every error the page's console or code raised."""
    context = chromium.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")

    def route(r):
        url = r.request.url
        if url.startswith(("data:", "blob:")) or urlsplit(url).hostname == "127.0.0.1":
            r.continue_()
        else:
            problems.append(f"blocked a request leaving 127.0.0.1: {url}")
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.on("console", lambda m: problems.append(f"console error: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
    return context, page


def _wait_ready(page, problems):
    page.wait_for_function("() => ['ready', 'error'].includes(document.body.dataset.state)", timeout=120_000)
    if page.evaluate("document.body.dataset.state") != "ready":
        problems.append("the page did not load its model: " + page.inner_text("#model-info"))


def page_weight(chromium, url: str, web_dir: Path = WEB_DIR) -> dict:
    """Load the page once in a fresh context and list every request it makes until it is
    ready (model loaded, the first test sentence translated): the file, its type, the
    response body's bytes as transferred (Chromium's count, after any compression), the
    response headers' bytes and the Content-Encoding."""
    problems: list[str] = []
    context, page = _guarded_context(chromium, problems)
    finished = []
    page.on("requestfinished", lambda r: finished.append(r))
    try:
        page.goto(url)
        _wait_ready(page, problems)
        rows = []
        for request in finished:
            if urlsplit(request.url).hostname != "127.0.0.1":
                continue                                  # data: URLs move no bytes
            response = request.response()
            sizes = request.sizes()
            path = urlsplit(request.url).path.lstrip("/") or "index.html"
            on_disk = web_dir / path
            rows.append({"file": path, "type": request.resource_type, "status": response.status,
                         "bytes": sizes["responseBodySize"], "header_bytes": sizes["responseHeadersSize"],
                         "content_encoding": response.headers.get("content-encoding", ""),
                         "bytes_on_disk": on_disk.stat().st_size if on_disk.is_file() else None})
    finally:
        context.close()
    if problems:
        raise RuntimeError("loading the page went wrong: " + "; ".join(problems))
    kinds = list(dict.fromkeys(r["type"] for r in rows))       # document, stylesheet, script, fetch: as first seen
    rows.sort(key=lambda r: (kinds.index(r["type"]), r["file"]))   # the modules arrive in any order: sort them
    model = [r for r in rows if r["file"].startswith("model/")]
    return {"requests": rows, "total_bytes": sum(r["bytes"] for r in rows),
            "header_bytes": sum(r["header_bytes"] for r in rows),
            "model_bytes": sum(r["bytes"] for r in model), "model_included": bool(model),
            "compressed": any(r["content_encoding"] not in ("", "identity") for r in rows)}


# The keydown of the timed key, seen first (capture on window): the keystroke's own time stamp.
_KEYDOWN_JS = """() => { window.attnTiming = null; window.attnKeydown = null;
  window.addEventListener("keydown", (e) => { window.attnKeydown = e.timeStamp; }, { capture: true, once: true }); }"""


def keystroke_to_last_token(chromium, url: str, sentence: str, repeats: int, delay_ms: float,
                            progress=None) -> dict:
    """Type ``sentence`` into the page key by key, ``delay_ms`` apart, as a user would; when
    the page has translated all but the last key, press it and take the time from that key's
    keydown to the animation frame that paints the last token (``window.attnTiming.endedAt``,
    in the page's own clock), ``repeats`` times, in one page (the first translation on load
    warmed it, as it does for a reader). Also the page's computing time (encoder and decoding
    steps), its drawing time (the tokens and every heatmap), the animation frames it waited
    for (one per token shown as it comes when decoding is slower than a frame, and the last)
    and the output tokens."""
    problems: list[str] = []
    context, page = _guarded_context(chromium, problems)
    runs = []
    try:
        page.goto(url)
        _wait_ready(page, problems)
        source_tokens = None
        for i in range(repeats):
            if problems:
                break
            page.fill("#source", "")
            page.wait_for_function("() => document.body.dataset.state === 'done'")
            page.click("#source")
            page.keyboard.type(sentence[:-1], delay=delay_ms)
            page.wait_for_function("() => document.body.dataset.state === 'done'", timeout=120_000)
            page.evaluate(_KEYDOWN_JS)
            page.keyboard.type(sentence[-1])
            page.wait_for_function("() => document.body.dataset.state === 'done' && window.attnTiming !== null",
                                   timeout=120_000)
            timing = page.evaluate("({...window.attnTiming, keydown: window.attnKeydown})")
            if page.input_value("#source") != sentence:
                problems.append(f"the page's input reads {page.input_value('#source')!r}, not the sentence typed")
            source_tokens = timing["sourceTokens"]
            ms = timing["endedAt"] - timing["keydown"]
            runs.append({"ms": ms, "compute_ms": timing["computeMs"], "draw_ms": timing["drawMs"],
                         "rest_ms": ms - timing["computeMs"] - timing["drawMs"], "frames": timing["frames"],
                         "page_ms": timing["ms"]})
            if progress:
                progress(i + 1, repeats, runs[-1]["ms"])
        tokens = page.locator("#output .tok").all_inner_texts()
    finally:
        context.close()
    if problems:
        raise RuntimeError("timing the page went wrong: " + "; ".join(problems))

    def summary(key):
        values = [r[key] for r in runs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}

    return {"sentence": sentence, "words": word_count(sentence), "source_tokens": source_tokens,
            "output_tokens": tokens, "repeats": repeats, "type_delay_ms": delay_ms,
            "keystroke_to_last_token_ms": summary("ms"), "compute_ms": summary("compute_ms"),
            "draw_ms": summary("draw_ms"), "rest_ms": summary("rest_ms"), "frames": summary("frames"),
            "page_ms": summary("page_ms")}


def measure(repeats: int = 9, sentence: str | None = None, delay_ms: float = 100.0, progress=None) -> dict:
    """Serve web/, open it in the system's headless Chromium, and measure the page's weight and
    its time from keystroke to last token (see page_weight and keystroke_to_last_token)."""
    from ..bench.machine import machine_info
    info = machine_info()
    machine = {k: info.get(k) for k in ("cpu_model", "cpu_count", "usable_cpus", "platform")}
    machine["load_average_before"] = info.get("load_average")
    meta = json.loads((WEB_DIR / "model" / "model.json").read_text(encoding="utf-8"))
    sentence = sentence or ten_word_sentence(meta["sentences"])
    with serve(WEB_DIR) as url, chromium() as browser:
        weight = page_weight(browser, url)
        timing = keystroke_to_last_token(browser, url, sentence, repeats, delay_ms, progress)
        version = browser.version
    try:
        machine["load_average_after"] = os.getloadavg()
    except OSError:
        pass
    median = timing["keystroke_to_last_token_ms"]["median"]
    return {"chromium": version, "chromium_path": chromium_path(), "machine": machine,
            "model": {"config": meta["config"], "weights_dtype": meta["weights"]["dtype"]},
            "target_ms": TARGET_MS, "within_target": median < TARGET_MS, **timing, "page_weight": weight}


def _ms(x: float) -> str:
    return f"{x:.1f}"


def render_markdown(result: dict) -> str:
    """The measurement as Markdown: what ran where, the timings against the target, and the
    page's weight file by file."""
    return "\n".join(_what_ran(result) + _timings(result) + _page_weight(result["page_weight"]))


def _what_ran(result: dict) -> list[str]:
    """The heading, the machine, the model and the sentence typed."""
    m, cfg = result["machine"], result["model"]["config"]
    loads = lambda key: ", ".join(f"{x:.2f}" for x in m[key]) if m.get(key) else "unknown"   # noqa: E731
    return [
        "### The page in the browser: keystroke to last token, and its weight",
        "",
        f"Headless Chromium {result['chromium']} ({result['chromium_path']}) on {m['cpu_model']}, "
        f"{m.get('usable_cpus', m['cpu_count'])} usable CPUs (load average {loads('load_average_before')} before, "
        f"{loads('load_average_after')} after). The shipped toy model: d_model {cfg['d_model']}, "
        f"{cfg['n_encoder_layers']}+{cfg['n_decoder_layers']} layers, {cfg['n_heads']} heads, "
        f"{result['model']['weights_dtype']} weights; greedy decoding.",
        "",
        f"Sentence: \"{result['sentence']}\" ({result['words']} words, {result['source_tokens']} source tokens "
        f"with `</s>`), typed key by key {result['type_delay_ms']:g} ms apart; once the page has translated "
        f"all but the last key, the last key is timed from its keydown to the animation frame that paints "
        f"the last token; {result['repeats']} repeat{'s' if result['repeats'] != 1 else ''}.",
        "",
        f"Output ({len(result['output_tokens'])} tokens): `{' '.join(result['output_tokens'])}`",
        "",
    ]


def _timings(result: dict) -> list[str]:
    """The table of times (keystroke to last token and its parts) and the verdict on the target."""
    key, compute, draw, rest, page = (result[k] for k in ("keystroke_to_last_token_ms", "compute_ms", "draw_ms",
                                                          "rest_ms", "page_ms"))
    frames = result["frames"]["median"]
    median = key["median"]
    verdict = "within" if result["within_target"] else "over"
    return [
        "| ms | median | min | max |",
        "|---|---:|---:|---:|",
        f"| keystroke to last token | {_ms(median)} | {_ms(key['min'])} | {_ms(key['max'])} |",
        f"| of which computing (encoder, decoding steps) | {_ms(compute['median'])} | {_ms(compute['min'])} "
        f"| {_ms(compute['max'])} |",
        f"| of which drawing (tokens, every heatmap) | {_ms(draw['median'])} | {_ms(draw['min'])} "
        f"| {_ms(draw['max'])} |",
        f"| the rest: waiting for the frames that paint ({frames:g}, the median), the browser's own work "
        f"| {_ms(rest['median'])} | {_ms(rest['min'])} | {_ms(rest['max'])} |",
        f"| the page's own figure (from the input event) | {_ms(page['median'])} | {_ms(page['min'])} "
        f"| {_ms(page['max'])} |",
        "",
        f"Target: under {TARGET_MS:g} ms on two cores. Median {_ms(median)} ms: {verdict} the target.",
        "",
    ]


def _page_weight(w: dict) -> list[str]:
    """The table of every request until the page is ready, its total, and what the total counts."""
    lines = [
        f"Page weight: every request the page makes until it is ready (model loaded, first sentence "
        f"translated), in a fresh browser context:",
        "",
        "| file | type | bytes transferred | Content-Encoding |",
        "|---|---|---:|---|",
    ]
    for r in w["requests"]:
        lines.append(f"| `{r['file']}` | {r['type']} | {r['bytes']:,} | {r['content_encoding'] or 'none'} |")
    share = 100 * w["model_bytes"] / w["total_bytes"] if w["total_bytes"] else 0.0
    lines += [
        f"| **total, {len(w['requests'])} requests** | | **{w['total_bytes']:,}** | |",
        "",
        f"Response bodies only; the response headers add {w['header_bytes']:,} bytes. The model "
        + (f"is included: `model/` is {w['model_bytes']:,} bytes, {share:.1f}% of the total. "
           if w["model_included"] else "is not included. ")
        + ("The server compresses responses." if w["compressed"] else
           "The server (Python's http.server, as `python -m http.server` serves it) does not compress: "
           "these are the files' sizes."),
    ]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attn.site.browser",
        description="The web page (web/) in the system's headless Chromium, driven by Playwright "
                    "(never a downloaded browser).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    m = commands.add_parser(
        "measure", help="time the page from a keystroke to the last token, and weigh it",
        description="Serve web/ on 127.0.0.1, open it in headless Chromium (the system's: $ATTN_CHROMIUM, "
                    "else chromium on the PATH) and measure, with the shipped toy model: (a) the time from "
                    "a keystroke to the last token for a ten-word sentence, typed key by key as a user "
                    "would, the last key timed from its keydown to the animation frame that paints the "
                    f"last token (median, min and max of --repeats), split into the page's computing, its "
                    f"drawing and the rest, against the target of {TARGET_MS:g} ms on two cores; (b) the "
                    f"page's weight: the bytes of every response until the page is ready, file by file, "
                    f"and whether they came compressed. Prints Markdown with the CPU, the load average and "
                    f"Chromium's version (progress on stderr); --json for JSON. No request may leave "
                    f"127.0.0.1, and a console error fails the run. The figures depend on the machine and "
                    f"its load: quote them with both.")
    m.add_argument("--repeats", type=int, default=9, metavar="N",
                   help="how many times the last key is timed (default 9; 1 for a quick check)")
    m.add_argument("--sentence", metavar="TEXT",
                   help="the sentence typed (default: the first of the model's test sentences with ten words)")
    m.add_argument("--type-delay", type=float, default=100.0, metavar="MS",
                   help="milliseconds between keys while typing (default 100, a quick typist)")
    m.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="print the result as JSON instead of Markdown; with FILE, print Markdown and write "
                        "the JSON to FILE")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.sentence is not None and len(args.sentence.strip()) < 2:
        parser.error(f"--sentence needs at least two characters (the last one is the timed key), "
                     f"not {args.sentence!r}")
    why = missing()
    if why:
        print(f"python -m attn.site.browser: cannot run the browser: {why}", file=sys.stderr)
        return 2

    def progress(i, n, ms):
        print(f"\rtiming the last key: {i}/{n} ({ms:.1f} ms)", end="\n" if i == n else "", file=sys.stderr,
              flush=True)

    sentence = args.sentence.strip() if args.sentence else None
    result = measure(args.repeats, sentence, args.type_delay, progress)
    if args.json == "-":
        print(json.dumps(result, indent=1))
    else:
        print(render_markdown(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

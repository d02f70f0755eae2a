"""The page in ``web/`` served locally and opened in headless Chromium: what the browser tests
(``tests/test_web.py``) and the speed measurement (``benchmarks/web_speed.py``) share.

Chromium is the system's (Debian's ``chromium`` package), driven by Playwright from PyPI
through ``executable_path``: no browser is ever downloaded. The flags keep a headless
Chromium from reaching for the network (background updates, sync, QUIC), which a closed
machine would leave it waiting on.
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import threading
from pathlib import Path

#: The page and its modules, in a source checkout.
WEB_DIR = Path(__file__).resolve().parent.parent / "web"

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
    """Files under ``directory``, plus each mount ``{"/prefix/": folder}`` at its prefix; quiet."""
    mounts: dict = {}

    def translate_path(self, path):
        for prefix, folder in self.mounts.items():
            if path.startswith(prefix):
                rest = path[len(prefix):].split("?", 1)[0].split("#", 1)[0]
                return str(Path(folder) / rest)
        return super().translate_path(path)

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

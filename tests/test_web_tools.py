"""The page's tools beside the page: the test server the browser tests load it from, which
serves nothing outside its folders, and ``python -m attn.site.browser measure``, the speed
command that times typing to the last token and weighs what the page loads.

Without Playwright or a system Chromium the speed command's test skips, saying which is
missing; the server's and the argument tests run anyway.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn.site import browser
from attn.site.export import load_export
from attn.text import tokenize

ROOT = Path(__file__).resolve().parents[1]
TOY_MODEL = ROOT / "web" / "model"
MISSING = browser.missing()
#: The modules of lm.html (a language model writing), which index.html does not load.
WRITING_PAGE = {"lm-app.js", "lm.js"}
needs_browser = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


# --------------------------------------------------------------------------- the test server (no browser)

def test_the_test_server_refuses_paths_that_leave_its_folders(tmp_path):
    """``browser.serve`` answers 404 to any path that leaves web/ or a mount: ``..`` (plain or
    percent-encoded), an absolute path after a mount's prefix, a symbolic link pointing out."""
    import http.client
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the browser\n", encoding="utf-8")
    mount = tmp_path / "mount"
    (mount / "sub").mkdir(parents=True)
    (mount / "sub" / "ok.txt").write_text("served\n", encoding="utf-8")
    (mount / "out").symlink_to(secret)
    (mount / "outdir").symlink_to(tmp_path, target_is_directory=True)
    (mount / "inside").symlink_to(mount / "sub" / "ok.txt")
    up = "/".join([".."] * (len(secret.parts) + 2))

    def get(port, path):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", path)                     # sent as written: no client normalises it
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    with browser.serve(browser.WEB_DIR, {"/_test/m/": mount}) as url:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        assert get(port, "/_test/m/sub/ok.txt") == (200, b"served\n")
        assert get(port, "/_test/m/inside") == (200, b"served\n")      # a link that stays inside
        assert get(port, "/index.html")[0] == get(port, "/attn/model.js")[0] == 200
        refused = [f"/_test/m/{up}{secret}", f"/_test/m/sub/../../{secret.name}", f"/_test/m/{secret}",
                   f"/_test/m//{secret}", "/_test/m/" + "/".join(["%2e%2e"] * 12) + str(secret),
                   "/_test/m/out", "/_test/m/outdir/secret.txt", f"/{up}{secret}", f"/{up}/etc/hostname",
                   f"//{secret}", "/%2E%2E/%2e%2e/etc/hostname", f"/_test/m/..%2f..%2f{secret.name}"]
        for path in refused:
            status, body = get(port, path)
            assert status == 404 and b"not for the browser" not in body, (path, status, body[:80])


# --------------------------------------------------------------------------- the speed command

@needs_browser
def test_the_speed_command_in_quick_mode(tmp_path):
    """``python -m attn.site.browser measure`` with one repeat: the structure of what it prints and
    writes, the tokens it saw (NumPy's), and the page's weight, which is deterministic: every
    file the page loads, at its size on disk (the server does not compress). No time is asserted."""
    import os
    import subprocess
    import sys
    out = tmp_path / "speed.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, "-m", "attn.site.browser", "measure", "--repeats", "1", "--type-delay", "5",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result, text = json.loads(out.read_text(encoding="utf-8")), proc.stdout
    model, vocab, doc = load_export(TOY_MODEL)
    sentence = result["sentence"]
    assert sentence in doc["sentences"] and result["words"] == browser.word_count(sentence) == 10
    assert result["source_tokens"] == len(tokenize(sentence)) + 1
    from attn.evaluate import translate
    assert result["output_tokens"] == translate(model, vocab, [sentence])[0].tgt_tokens + ["</s>"]
    assert result["frames"]["median"] >= 1                     # at least the frame that paints the last token
    for key in ("keystroke_to_last_token_ms", "compute_ms", "draw_ms", "rest_ms", "frames", "page_ms"):
        s = result[key]
        assert len(s["runs"]) == result["repeats"] == 1 and s["median"] == s["min"] == s["max"], (key, s)
    parts = sum(result[k]["median"] for k in ("compute_ms", "draw_ms", "rest_ms"))
    assert parts == pytest.approx(result["keystroke_to_last_token_ms"]["median"])
    assert result["target_ms"] == browser.TARGET_MS
    assert result["within_target"] == (result["keystroke_to_last_token_ms"]["median"] < browser.TARGET_MS)
    assert result["chromium"] and result["machine"]["cpu_model"]

    weight = result["page_weight"]
    on_disk = {p.relative_to(browser.WEB_DIR).as_posix(): p.stat().st_size
               for p in [browser.WEB_DIR / "index.html", browser.WEB_DIR / "style.css", *browser.WEB_DIR.glob("*.js"),
                         *browser.WEB_DIR.glob("attn/*.js"), *browser.WEB_DIR.glob("model/*")]
               if p.name not in WRITING_PAGE}
    seen = {r["file"]: r["bytes"] for r in weight["requests"]}
    assert not WRITING_PAGE & {Path(f).name for f in seen}, "the translator's page loads the writing page's modules"
    assert seen == on_disk, "the page loads other files than web/'s, or not at their size on disk"
    assert len(weight["requests"]) == len(on_disk), "a file was requested twice"
    assert weight["total_bytes"] == sum(on_disk.values())
    assert weight["model_bytes"] == on_disk["model/model.json"] + on_disk["model/weights.bin"]
    assert weight["model_included"] and not weight["compressed"]
    assert all(r["status"] == 200 and r["content_encoding"] == "" for r in weight["requests"])

    # The Markdown printed: the machine, the browser, the sentence, the target, every file.
    assert browser.render_markdown(result) + "\n" == text
    for expected in (f"Headless Chromium {result['chromium']}", result["machine"]["cpu_model"], f'"{sentence}"',
                     "| keystroke to last token |", f"Target: under {browser.TARGET_MS:g} ms on two cores",
                     f"**{weight['total_bytes']:,}**", "does not compress"):
        assert expected in text, expected
    for file, size in on_disk.items():
        assert f"| `{file}` |" in text and f"| {size:,} |" in text, file


def test_the_speed_command_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        browser.main(["measure", "--repeats", "0"])
    assert exit_.value.code == 2 and "--repeats must be at least 1, not 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has 10 words"):
        browser.ten_word_sentence(["too short ."])

"""A teacher runs attn-check as themselves: every attempt of issue 39 (a cheating or careless
class) gets the right verdict with nothing leaked, whether the grader runs as root (CI) or as
an unprivileged user (``nobody``, reached by dropping root's user with setpriv).

One hostile class is graded once per user (the expensive part); the tests read its table,
its reports and what it left behind. Its grades.html and similarity.html are then opened in
Chromium: nothing runs."""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from attn.grader import bubblewrap

ROOT = Path(__file__).resolve().parents[1]
BWRAP, _, NO_BWRAP_WHY = bubblewrap.available()
EX7 = "07_feed_forward_layer_norm.py"
GOOD = "def relu_forward(x):\n    return x * (x > 0), x > 0\n\n\ndef relu_backward(dout, cache):\n    return dout * cache\n"
PWN = "window.__pwned=1"
#: learner folder -> its exercise 7 (relu only: the rest of the exercise is missing, fast).
NAMES = {"ann": GOOD, "=cmd|' -c calc'!A0": GOOD, "+1+1": GOOD, "@SUM(1)": GOOD, "-2": GOOD,
         f"javascript:{PWN}": GOOD, f"<img src=x onerror={PWN}>": GOOD}
FORGES = ("def relu_forward(x):\n    raise ValueError('no\\nrelu                   PASS     0.01 s  (1 run)\\n"
          "\\x1b[2J1 of 1 passed')\n")
NAN = "import numpy as np\n\n\ndef relu_forward(x):\n    return x * np.nan, x > 0\n"


def _unprivileged() -> list[str] | None:
    """The command prefix that runs a command as nobody from root: setpriv, inside a bubblewrap
    that shows a Python under /root to nobody (read-only); None where that cannot be had."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or not setpriv or not BWRAP:
        return None
    prefix = Path(sys.base_prefix).resolve()
    outer = [BWRAP, "--dev-bind", "/", "/"]
    if str(prefix).startswith("/root/"):
        outer += ["--perms", "0755", "--tmpfs", "/root"]
        for parent in reversed(prefix.parents[:-2]):             # /root/.pyenv, /root/.pyenv/versions, ...
            outer += ["--perms", "0755", "--dir", str(parent)]
        outer += ["--ro-bind", str(prefix), str(prefix)]
    return outer + ["--", setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


def _hostile_class(base: Path, secret: Path, home: Path) -> Path:
    folder = base / "class"
    for name, text in NAMES.items():
        (folder / name).mkdir(parents=True)
        (folder / name / EX7).write_text(text)
    key = base / "answer-key"                                # the teacher's, outside the class folder
    key.mkdir()
    (key / EX7).write_text(GOOD)
    for learner, make in (("linker", lambda p: p.symlink_to(folder / "ann" / EX7)),
                          ("answers", lambda p: p.symlink_to(ROOT / "tests" / "answers" / "05_masks.py")),
                          ("fifo", lambda p: os.mkfifo(p)), ("zero", lambda p: p.symlink_to("/dev/zero")),
                          ("noext", lambda p: p.symlink_to(key / "relu-without-suffix"))):
        (folder / learner).mkdir()
        make(folder / learner / (EX7 if learner != "answers" else "05_masks.py"))
    (key / "relu-without-suffix").write_text(GOOD)
    (folder / "keyholder").symlink_to(key, target_is_directory=True)
    backward = "\n\ndef relu_backward(dout, cache):\n    return dout * cache\n"
    for learner, text in (("forger", FORGES), ("nan", NAN), ("snoop", _snoop(secret, home))):
        (folder / learner).mkdir()
        (folder / learner / EX7).write_text(text + backward)
    (folder / "shm").mkdir()                                 # exercise 6 saves the given layer norm, 7 loads it
    (folder / "shm" / "06_multi_head_attention.py").write_text(
        "import inspect\nfrom attn import layers as L\n\nfor d in ('/dev/shm', '/tmp'):\n"
        "    open(d + '/attn_ln.py', 'w').write(inspect.getsource(L.layernorm))\n")
    (folder / "shm" / EX7).write_text(GOOD + "\nimport sys\nsys.path[:0] = ['/dev/shm', '/tmp']\ntry:\n"
                                      "    from attn_ln import layer_norm_forward, layer_norm_backward  # noqa\n"
                                      "except ImportError:\n    pass\n")
    for p in [base, *base.rglob("*")]:
        if not p.is_symlink() and not stat.S_ISFIFO(p.lstat().st_mode):
            p.chmod(0o755 if p.is_dir() else 0o644)
    return folder


def _snoop(secret: Path, home: Path) -> str:
    """A file that reads the teacher's private file, writes into their home and into the
    grader's source, and reports what it managed."""
    grader = ROOT / "attn" / "grader" / "child.py"
    return f'''import os


def relu_forward(x):
    got = []
    try:
        got.append(open({str(secret)!r}).read())
    except OSError:
        pass
    for target in ({str(home / "planted")!r}, {str(grader)!r}):
        try:
            with open(target, "a") as f:
                f.write("# planted")
            got.append("wrote " + target)
        except OSError:
            pass
    raise ValueError("got " + repr(got))
'''


@pytest.fixture(scope="module", params=["root", "nobody"])
def graded(request):
    """(the user, the class's folder, the report folder, attn-check's output, the secret, home,
    the grader's source digest before) for the hostile class graded as that user."""
    if not BWRAP:
        pytest.skip(f"no sandbox here: {NO_BWRAP_WHY}")
    prefix = [] if request.param == "root" or os.geteuid() != 0 else _unprivileged()   # unprivileged already
    if request.param == "root" and os.geteuid() != 0:
        pytest.skip("the tests run as an unprivileged user here: the other parameter covers it")
    if prefix is None:
        pytest.skip("no way here to run attn-check as another user (needs root, setpriv and bubblewrap)")
    base = Path(tempfile.mkdtemp(prefix="attn-hostile-"))
    base.chmod(0o755)
    home = base / "teacher-home"
    home.mkdir(mode=0o700)
    secret = home / "private.txt"
    secret.write_text("TEACHER-SECRET-MARKER\n")
    secret.chmod(0o600)
    folder = _hostile_class(base, secret, home)
    out = base / "reports"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    child_py = (ROOT / "attn" / "grader" / "child.py").read_bytes()
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(out), HYPOTHESIS_STORAGE_DIRECTORY=str(out / ".h"))
    proc = subprocess.run(prefix + [sys.executable, "-m", "attn.grader", "--class", str(folder), "--out", str(out),
                                    "--examples", "2", "--timeout", "5", "--jobs", "2", "--similarity"],
                          capture_output=True, text=True, env=env, cwd=out, timeout=600)
    yield request.param, folder, out, proc.stdout + proc.stderr, secret, home, child_py
    shutil.rmtree(base, ignore_errors=True)


def _rows(out: Path) -> dict:
    rows = {}
    for r in csv.DictReader(open(out / "grades.csv", encoding="utf-8")):
        rows.setdefault(r["learner"], []).append(r)
    return rows


def test_the_class_finishes_with_a_row_for_every_link_fifo_and_device(graded):
    user, folder, out, text, *_ = graded
    rows = _rows(out)
    assert "attn-check --class" in text and (out / "grades.html").is_file(), text
    refused = {"linker": "a symbolic link", "answers": "a symbolic link", "fifo": "a FIFO", "zero": "a symbolic link",
               "noext": "a symbolic link", "keyholder": "a symbolic link, not a learner's folder"}
    for learner, why in refused.items():
        assert [r["status"] for r in rows[learner]] == ["error"] and why in rows[learner][0]["error"], rows[learner]
        assert rows[learner][0]["score"] == "0"
    relu = {learner: next(r for r in rs if r["layer"] == "relu") for learner, rs in rows.items()
            if any(r["layer"] == "relu" for r in rs)}
    assert relu["ann"]["status"] == "pass" and relu["shm"]["status"] == "pass", relu
    shm_ln = next(r for r in rows["shm"] if r["layer"] == "layer_norm")
    assert shm_ln["status"] == "fail", shm_ln                 # nothing exercise 6 left reached exercise 7
    assert not list(Path("/dev/shm").glob("attn_ln.py"))


def test_nothing_leaks_and_nothing_is_written_outside(graded):
    user, folder, out, text, secret, home, child_py = graded
    everything = text + "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()
                                and p.suffix in (".txt", ".json", ".csv", ".html"))
    assert "TEACHER-SECRET-MARKER" not in everything
    assert not (home / "planted").exists() and (ROOT / "attn" / "grader" / "child.py").read_bytes() == child_py
    snoop = next(r for r in _rows(out)["snoop"] if r["layer"] == "relu")
    assert snoop["status"] == "fail" and "raised ValueError: got []" in snoop["error"], snoop
    report = (out / "snoop" / "07_feed_forward_layer_norm.txt").read_text()
    assert f"sandbox: bubblewrap {bubblewrap.available()[1]}; user nobody" in report, report


def test_reports_cannot_be_turned(graded):
    user, folder, out, text, *_ = graded
    raw = (out / "grades.csv").read_text(encoding="utf-8")
    for row in csv.reader(raw.splitlines()):
        assert all(not cell or cell[0] not in "=+-@\t\r" for cell in row), row
    rows = _rows(out)
    for name in ("'=cmd|' -c calc'!A0", "'+1+1", "'@SUM(1)", "'-2"):
        assert name in rows, sorted(rows)
    html = (out / "grades.html").read_text(encoding="utf-8")
    assert "href='javascript" not in html and "<img src=x" not in html
    assert "href='./javascript%3Awindow.__pwned%3D1/07_feed_forward_layer_norm.txt'" in html
    for p in out.rglob("*.json"):
        json.loads(p.read_text(), parse_constant=lambda c: pytest.fail(f"{p}: {c} is not JSON"))
    nan = next(r for r in rows["nan"] if r["layer"] == "relu")
    assert nan["status"] == "fail"
    forged = (out / "forger" / "07_feed_forward_layer_norm.txt").read_text()
    assert "\nrelu                   PASS" not in forged and "\x1b" not in forged, forged
    assert "          | relu                   PASS" in forged, forged
    if (out / "similarity.html").is_file():
        page = (out / "similarity.html").read_text(encoding="utf-8")
        assert "<img src=x" not in page and "&lt;img src=x onerror=" in page


def test_opening_the_hostile_class_pages_runs_nothing(graded):
    from attn.site import browser
    user, folder, out, *_ = graded
    if user != "root" and os.geteuid() == 0:
        pytest.skip("the pages are the same for either user: opened once")
    if browser.missing():
        pytest.skip(browser.missing())
    with browser.chromium() as chromium:
        page = chromium.new_context().new_page()
        dialogs = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        for name in ("grades.html", "similarity.html"):
            if not (out / name).is_file():
                continue
            page.goto((out / name).as_uri())
            page.wait_for_load_state("load")
            assert page.evaluate("window.__pwned") is None, name
            for i in range(page.locator("a").count()):
                page.goto((out / name).as_uri())
                page.locator("a").nth(i).click()
                page.wait_for_load_state("load")
                assert page.url.startswith("file://") and page.evaluate("window.__pwned") is None, page.url
    assert not dialogs


def test_a_forged_pass_line_is_quoted_in_gradescopes_output_too(tmp_path):
    (tmp_path / "relu.py").write_text(FORGES + "\n\ndef relu_backward(dout, cache):\n    return dout * cache\n")
    proc = subprocess.run([sys.executable, "-m", "attn.grader", str(tmp_path / "relu.py"), "--examples", "2",
                           "--gradescope", str(tmp_path / "results.json")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    results = json.loads((tmp_path / "results.json").read_text())
    lines = results["tests"][0]["output"].splitlines()
    assert proc.returncode == 1 and results["score"] == 0, proc.stdout
    assert not any(ln.startswith("relu") and "PASS" in ln for ln in lines[1:]), lines
    assert any(ln.startswith("          | relu                   PASS") for ln in lines), lines
    assert "\x1b" not in results["tests"][0]["output"]


def test_similarity_counts_the_librarys_share_and_flags_executed_blobs():
    """A paste of four library files is mostly the library's (each alone is a small part of
    it); a compressed copy that is executed is flagged, and so is one split in pieces and run
    by an exec looked up by a string."""
    pytest.importorskip("copydetect")
    import base64
    import io
    import zlib
    from attn.grader.similarity import _library_sources, executed_blobs, similarity_report
    pasted = "\n".join(p.read_text() for p in _library_sources()[:4])
    blob = base64.b64encode(zlib.compress(pasted.encode())).decode()
    packed = f"import base64, zlib\nexec(zlib.decompress(base64.b64decode('{blob}')))\n"
    pieces = "".join(f"    '{blob[i:i + 100]}',\n" for i in range(0, len(blob), 100))
    split = ("import base64 as b, zlib as z\nP = [\n" + pieces + "]\nf = vars(__import__('bu' + 'iltins'))['ex' + 'ec']"
             "\nf(z.decompress(b.b64decode(''.join(P))))\n")
    rot = "import codecs\nrun = __builtins__['eval']\nrun(codecs.decode(S, 'rot13'))\n"
    subs = [{"learner": who, "exercise": "07_feed_forward_layer_norm", "file": f"{who}/{EX7}",
             "source": (text, "")} for who, text in (("paster", pasted), ("packer", packed), ("ann", GOOD))]
    out = io.StringIO()
    page = Path(tempfile.mkdtemp()) / "similarity.html"
    rows = similarity_report(subs, page, out)
    assert any(b == "the library's own source" and a == f"paster/{EX7}" and sim > 0.9 for sim, a, b in rows), rows
    assert f"runs a blob: packer/{EX7} line 2: calls exec()" in out.getvalue(), out.getvalue()
    flagged = set(executed_blobs(split))
    n = split.count("\n")
    assert {f"line {n - 1}: builds the name exec from pieces", f"line {n}: b64decode() unpacks encoded data",
            f"line 3: literals of {len(blob):,} characters without a space in all (a blob, whole or in pieces?)"
            } <= flagged, flagged
    assert {"line 2: reaches __builtins__, where exec and eval are looked up by a string", "line 2: names eval in a "
            "string", "line 3: decodes with the rot13 codec"} <= set(executed_blobs(rot)), executed_blobs(rot)
    assert not executed_blobs(GOOD)
    shutil.rmtree(page.parent)


def test_the_attempts_among_the_mutants_fail_as_nobody_too(tmp_path):
    """tests/test_check.py grades issue 39's mutants as root; here, as nobody."""
    from test_check import CAUGHT_AS
    prefix = _unprivileged() if os.geteuid() == 0 else []       # unprivileged already
    if prefix is None or not BWRAP:
        pytest.skip("no way here to run attn-check as another user (needs root, setpriv and bubblewrap)")
    work = Path(tempfile.mkdtemp(prefix="attn-mutants-"))
    work.chmod(0o777)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(work))
    try:
        for name in ("relu_forks_300", "relu_fills_dev_shm", "relu_looks_for_the_answer", "layer_norm_bound_in_an_if"):
            shutil.copy(ROOT / "tests" / "mutants" / f"{name}.py", work)
            layer, blame, pattern, extra = CAUGHT_AS[name]
            proc = subprocess.run(prefix + [sys.executable, "-m", "attn.grader", str(work / f"{name}.py"), *extra,
                                            "--examples", "3"], capture_output=True, text=True, env=env, cwd=work,
                                  timeout=300)
            assert proc.returncode == 1 and re.search(pattern, proc.stdout), proc.stdout + proc.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_the_final_seed_is_in_nothing_a_learner_sees(tmp_path):
    """A table recorded at home for the final seed would pass final grading: the seed is in no
    report of a file (results.json, JSON, JUnit, HTML, the text) nor of a class's learner."""
    seed = "424273157"                          # long enough to turn up in no hash, time or duration
    (tmp_path / "relu.py").write_text(GOOD)
    (tmp_path / "class" / "ann").mkdir(parents=True)
    (tmp_path / "class" / "ann" / EX7).write_text(GOOD)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    one = subprocess.run([sys.executable, "-m", "attn.grader", str(tmp_path / "relu.py"), "--examples", "2",
                          "--seed", seed, "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"),
                          "--gradescope", str(tmp_path / "results.json"), "--html", str(tmp_path / "html")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stdout + one.stderr
    assert json.loads((tmp_path / "r.json").read_text())["final"] is True
    cls = subprocess.run([sys.executable, "-m", "attn.grader", "--class", str(tmp_path / "class"), "--examples", "2",
                          "--jobs", "1", "--seed", seed], capture_output=True, text=True, env=env, timeout=300)
    assert cls.returncode == 0, cls.stdout + cls.stderr
    shown = [tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "results.json", *(tmp_path / "html").iterdir(),
             *(tmp_path / "class" / "attn-check" / "ann").iterdir()]
    assert len(shown) >= 6
    for path in shown:
        assert seed.encode() not in path.read_bytes(), path
    assert seed not in one.stdout


RAISES = ("def relu_forward(x):\n    raise ValueError('\\x1b[31mred\\x00nul \\udce9 \\x07 \\ufffe')\n\n\n"
          "def relu_backward(dout, cache):\n    return dout * cache\n")


def test_reports_hold_control_characters_and_text_that_is_not_utf8(tmp_path):
    (tmp_path / "relu.py").write_text(RAISES)
    proc = subprocess.run([sys.executable, "-m", "attn.grader", str(tmp_path / "relu.py"), "--examples", "2",
                           "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"),
                           "--gradescope", str(tmp_path / "results.json"), "--html", str(tmp_path / "html")],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    from xml.etree import ElementTree
    case = ElementTree.parse(tmp_path / "r.xml").getroot().find("testsuite/testcase")
    assert case.get("name") == "relu" and "raised ValueError" in case.find("failure").get("message")
    assert "\\x1b[31mred\\x00nul" in case.find("failure").text
    assert json.loads((tmp_path / "r.json").read_text())["layers"][0]["status"] == "fail"
    assert json.loads((tmp_path / "results.json").read_text())["score"] == 0
    page = (tmp_path / "html" / "index.html").read_text(encoding="utf-8")
    assert "\\x1b[31mred" in page and "\x1b" not in page and "\x00" not in page


def _unquote(cell: str) -> str:
    """A grades.csv cell as the learner wrote it: the one quote before it taken off (TEACHING.md)."""
    return cell[1:] if cell.startswith("'") else cell


def test_a_class_of_odd_names_finishes_with_its_table(tmp_path):
    folder = tmp_path / "class"
    names = ["grades.csv", "grades.html", "'+cmd", "+cmd", "000123", "1e5", "ann"]
    for name in names + [os.fsdecode(b"l\xe9a")]:
        (folder / name).mkdir(parents=True)
        (folder / name / EX7).write_text(GOOD)
    (folder / "raiser").mkdir()
    (folder / "raiser" / EX7).write_text(RAISES)
    proc = subprocess.run([sys.executable, "-m", "attn.grader", "--class", str(folder), "--examples", "2",
                           "--jobs", "2"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
    out = folder / "attn-check"
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert (out / "grades.csv").is_file() and (out / "grades.html").is_file()
    rows = list(csv.DictReader(open(out / "grades.csv", encoding="utf-8", newline="")))
    relu = {_unquote(r["learner"]): r for r in rows if r["layer"] == "relu"}
    assert set(relu) == set(names) | {"l\\xe9a", "raiser"}, sorted(relu)
    assert all(relu[n]["status"] == "pass" for n in names + ["l\\xe9a"]), relu
    assert relu["raiser"]["status"] == "fail" and "\x1b" not in relu["raiser"]["error"]
    for cell in (r[k] for r in rows for k in ("learner", "error")):
        assert not cell or cell[0] not in "=+-@\t\r0123456789", cell
    assert (out / "_grades.csv" / "07_feed_forward_layer_norm.txt").is_file()
    assert os.path.isfile(os.path.join(os.fsencode(out), b"l\xe9a", b"07_feed_forward_layer_norm.txt"))
    page = (out / "grades.html").read_text(encoding="utf-8")
    assert "href='./l%E9a/07_feed_forward_layer_norm.txt'" in page and "href='./_grades.csv/07" in page


def test_a_file_named_on_the_command_line_that_is_a_link_is_refused(tmp_path):
    """A single-file submission that links to an answer elsewhere is not graded as the learner's."""
    (tmp_path / "answer-without-suffix").write_text(GOOD)
    (tmp_path / "relu.py").symlink_to(tmp_path / "answer-without-suffix")
    proc = subprocess.run([sys.executable, "-m", "attn.grader", str(tmp_path / "relu.py"), "--examples", "2",
                           "--gradescope", str(tmp_path / "results.json")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert proc.returncode == 2 and "a symbolic link" in proc.stdout, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "results.json").read_text())["score"] == 0

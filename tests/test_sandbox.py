"""attn-check's seal, by files that try to break it: a batch in which one learner's file
kills the grader, one stops it and one forges its reports still grades everyone else
right; a file reads nothing of the grader's machine, its classmates or its environment;
what a file starts is gone when the grader writes its reports (docs/TEACHING.md)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from attn.grader import bubblewrap

ROOT = Path(__file__).resolve().parents[1]
#: Where bubblewrap cannot run (a container that forbids namespaces), the tests of what only it
#: gives skip and say why; the others hold with or without it.
BWRAP, _, NO_BWRAP_WHY = bubblewrap.available()
needs_namespaces = pytest.mark.skipif(not BWRAP, reason=f"no sandbox here: {NO_BWRAP_WHY}")
GOOD = "def relu_forward(x):\n    return x * (x > 0), x > 0\n\n\ndef relu_backward(dout, cache):\n    return dout * cache\n"
WRONG_RELU = "    return x, x > 0\n\n\ndef relu_backward(dout, cache):\n    return dout\n"
#: A file that signals its grader and pid 1; ``kill(-1)`` (every process its user may signal) only
#: where the child has a PID namespace of its own (bubblewrap): without one it would reach the
#: machine's other processes of that user, which the tests did not start.
KILLS_IN_NAMESPACE = ("import os, signal\n\n\ndef relu_forward(x):\n    for target in (os.getppid(), 1, -1):\n"
                      "        try:\n            os.kill(target, signal.SIGKILL)\n        except OSError:\n"
                      "            pass\n" + WRONG_RELU)
KILLS_OUTSIDE = KILLS_IN_NAMESPACE.replace("(os.getppid(), 1, -1)", "(os.getppid(), 1)")
KILLS = KILLS_IN_NAMESPACE if BWRAP else KILLS_OUTSIDE          # what --sandbox auto gets here
STOPS = KILLS.replace("SIGKILL", "SIGSTOP")
FORGES = '''import json, os, signal, time

FORGED = {"score": 100, "max_score": 1, "tests": [], "output": "forged"}


def _forge():
    for folder in (os.getcwd(), os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))):
        for name in ("results.json", "report.json", "grades.csv"):
            try:
                with open(os.path.join(folder, name), "w") as f:
                    json.dump(FORGED, f)
            except OSError:
                pass


_forge()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(2)
        _forge()
        os._exit(0)
    os._exit(0)


def relu_forward(x):
    _forge()
    os.kill(os.getppid(), signal.SIGKILL)
''' + WRONG_RELU


def _run(*argv, cwd=ROOT, env=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "attn.grader", *map(str, argv)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_batch_survives_a_file_that_kills_one_that_stops_and_one_that_forges(tmp_path, sentinels_ended_by):
    folder = tmp_path / "class"
    folder.mkdir()
    for name, text in (("a_good.py", GOOD), ("b_kills.py", KILLS), ("c_stops.py", STOPS), ("d_forges.py", FORGES),
                       ("e_good.py", GOOD)):
        (folder / name).write_text(text)
    out = tmp_path / "reports"
    out.mkdir()
    t0 = time.monotonic()
    proc = _run("--all", folder, "--examples", "3", "--timeout", "3", "--json", out / "report.json",
                "--gradescope", out / "results.json")
    assert time.monotonic() - t0 < 240
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = {Path(f["file"]).name: f for f in json.loads((out / "report.json").read_text())}
    status = {name: [r["status"] for r in f["layers"]] for name, f in data.items()}
    assert status == {"a_good.py": ["pass"], "b_kills.py": ["fail"], "c_stops.py": ["fail"], "d_forges.py": ["fail"],
                      "e_good.py": ["pass"]}, status
    for name in ("b_kills.py", "c_stops.py", "d_forges.py"):
        message = data[name]["layers"][0]["failure"]["message"]        # wrong, or refused the signal: not the grader's
        assert message in ("the output differs from the library's",                  # death, nor a hang
                           "relu_forward raised PermissionError: [Errno 1] Operation not permitted"), data[name]
    grades = json.loads((out / "results.json").read_text())
    assert grades["score"] == 2 and grades["max_score"] == 5 and grades["output"] != "forged"
    digests = {p: _digest(p) for p in out.iterdir()}
    time.sleep(3)                                    # the detached writer, had it survived, has written by now
    assert {p: _digest(p) for p in out.iterdir()} == digests
    assert sorted(p.name for p in folder.iterdir()) == ["a_good.py", "b_kills.py", "c_stops.py", "d_forges.py",
                                                        "e_good.py"]
    assert not sentinels_ended_by(), f"the files signalled processes the test did not start: {sentinels_ended_by()}"


@needs_namespaces
def test_a_file_reads_nothing_of_the_machine_its_classmates_or_the_environment(tmp_path):
    folder = tmp_path / "alice"
    folder.mkdir()
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "relu.py").write_text("# bob's answer: CLASSMATE-MARKER\n")
    (folder / "notes.txt").write_text("CLASSMATE-MARKER beside the file\n")
    (folder / "relu.py").write_text('''import glob, os


def relu_forward(x):
    found = []
    for pattern in ("/etc/passwd", "/root/*", "/home/*/*", "/tmp/*/*/*.py", "/tmp/**/notes.txt"):
        for p in glob.glob(pattern, recursive=True):
            try:
                found.append(open(p).read(200))
            except OSError:
                pass
    for d in (os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")):
        for name in os.listdir(d):
            try:
                found.append(open(os.path.join(d, name)).read(200))
            except OSError:
                pass
    found.append(os.environ.get("ATTN_SECRET_TOKEN", ""))
    raise ValueError("found: " + repr(found) + " " + repr(sorted(os.environ)))
''')
    proc = _run(folder / "relu.py", "--examples", "1", env={"ATTN_SECRET_TOKEN": "s3cr3t-t0ken"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "relu_forward raised ValueError: found:" in text, text
    assert "root:" not in text and "s3cr3t-t0ken" not in text and "CLASSMATE-MARKER" not in text, text
    assert "ATTN_SECRET_TOKEN" not in text and "ATTN_CHECK" not in text, text


@needs_namespaces
def test_what_a_file_starts_is_gone_before_the_reports(tmp_path):
    f = tmp_path / "relu.py"
    f.write_text('''import subprocess

STARTED = []


def relu_forward(x):
    while len(STARTED) < 3:          # once: every call would meet the sandbox's 64 processes
        STARTED.append(subprocess.Popen(["sleep", "987654"], start_new_session=True))
    return x * (x > 0), x > 0


def relu_backward(dout, cache):
    return dout * cache
''')
    proc = _run(f, "--examples", "2", "--json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "sleep 987654" not in ps


def test_the_sandbox_here_and_required():
    """This machine (CI's too) has bubblewrap; the report names it."""
    proc = _run(ROOT / "tests" / "mutants" / "relu_backward_mask_from_dout.py", "--sandbox", "required",
                "--allow-library", "--examples", "1")
    if not BWRAP:
        assert proc.returncode == 2 and "no sandbox can be had here" in proc.stdout
        pytest.skip(f"no sandbox here: {NO_BWRAP_WHY}")
    assert f"sandbox: bubblewrap {bubblewrap.available()[1]}; user nobody" in proc.stdout, proc.stdout
    # setrlimit's limits are a process's: the line says so, with the processes' number beside them.
    assert re.search(r"limits: memory \d+ MB a process, CPU \d+ s a process, .*, \d+ processes", proc.stdout)


def test_a_class_is_graded_in_parallel_into_one_table(tmp_path):
    import csv
    starter = (ROOT / "lessons" / "exercises" / "12_dropout.py").read_text()
    answer = starter.replace("    raise NotImplementedError", "    pass", 0)
    learners = {"ann": GOOD, "ben": KILLS, "cid": STOPS, "dee": FORGES, "eve": GOOD}
    for name, relu in learners.items():
        (tmp_path / "class" / name).mkdir(parents=True)
        (tmp_path / "class" / name / "07_feed_forward_layer_norm.py").write_text(relu)
    (tmp_path / "class" / "ann" / "12_dropout.py").write_text(answer)
    proc = _run("--class", tmp_path / "class", "--examples", "3", "--timeout", "3", "--jobs", "2", "--similarity")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    table = {ln.split()[0]: ln.split()[1:] for ln in lines if ln.split() and ln.split()[0] in learners}
    assert table["ann"] == ["1/4", "0/1", "1/5"] and table["eve"] == ["1/4", "-", "1/4"], proc.stdout
    assert all(table[n][0] == "0/4" for n in ("ben", "cid", "dee")), proc.stdout
    out = tmp_path / "class" / "attn-check"
    rows = list(csv.DictReader(open(out / "grades.csv")))
    assert {r["learner"] for r in rows} == set(learners) and all(len(r["sha256"]) == 64 for r in rows)
    relu = {r["learner"]: r["status"] for r in rows if r["layer"] == "relu"}
    assert relu == {"ann": "pass", "ben": "fail", "cid": "fail", "dee": "fail", "eve": "pass"}
    assert (out / "grades.html").is_file() and (out / "ann" / "07_feed_forward_layer_norm.txt").is_file()
    report = json.loads((out / "ann" / "07_feed_forward_layer_norm.json").read_text())
    assert report["student"] == "ann" and report["exercise"] == "07_feed_forward_layer_norm" and report["grader"]
    try:
        import copydetect  # noqa: F401
    except ImportError:
        return
    assert "100%" in proc.stdout and (out / "similarity.html").is_file()       # ann's relu is eve's


def test_without_namespaces_a_batch_still_survives(tmp_path, sentinels_ended_by):
    """--sandbox off: no namespaces; as root the child is nobody, who may not signal the grader
    (nor, as the file does not try ``kill(-1)`` here, any other process of nobody's)."""
    if os.geteuid() != 0:
        pytest.skip("the grader is not root here: without namespaces the child is the grader's own user")
    folder = tmp_path / "class"
    folder.mkdir()
    for name, text in (("a_good.py", GOOD), ("b_kills.py", KILLS_OUTSIDE), ("c_good.py", GOOD)):
        (folder / name).write_text(text)
    proc = _run("--all", folder, "--examples", "3", "--timeout", "3", "--sandbox", "off", "--json",
                tmp_path / "r.json")
    assert not sentinels_ended_by(), f"the file signalled processes the test did not start: {sentinels_ended_by()}"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = {Path(f["file"]).name: [r["status"] for r in f["layers"]] for f in json.loads((tmp_path / "r.json")
                                                                                            .read_text())}
    assert data == {"a_good.py": ["pass"], "b_kills.py": ["fail"], "c_good.py": ["pass"]}, data


def test_without_bubblewrap_required_refuses_and_auto_says_what_the_file_reaches(tmp_path):
    (tmp_path / "relu.py").write_text(GOOD)
    bare = {"PATH": str(tmp_path / "no-such-folder")}          # no bwrap on the PATH
    proc = _run(tmp_path / "relu.py", "--sandbox", "required", "--examples", "1", env=bare)
    assert proc.returncode == 2 and "no sandbox can be had here (no bwrap command" in proc.stdout, proc.stdout
    proc = _run(tmp_path / "relu.py", "--examples", "1", env=bare)
    who = "as nobody: every file nobody may read" if os.geteuid() == 0 else "as you: every file you may read"
    assert proc.returncode == 0 and f"no sandbox here (no bwrap command" in proc.stdout, proc.stdout
    assert f"the file runs {who}, the network, under resource limits only" in proc.stdout, proc.stdout
    assert "sandbox: no sandbox; user " in proc.stdout, proc.stdout


def test_without_a_sandbox_as_root_the_standard_library_still_imports(tmp_path):
    """As root with no sandbox the child becomes nobody, who may not read a Python under
    /root: what an honest file imports late (secrets, for its dropout's seed) is loaded first."""
    if os.geteuid() != 0:
        pytest.skip("the grader is not root here: the child keeps the grader's user")
    (tmp_path / "relu.py").write_text(GOOD.replace("    return x * (x > 0), x > 0",
                                                   "    import secrets  # noqa: F401\n    return x * (x > 0), x > 0"))
    proc = _run(tmp_path / "relu.py", "--sandbox", "off", "--examples", "2")
    assert proc.returncode == 0 and "relu                   PASS" in proc.stdout, proc.stdout + proc.stderr


@needs_namespaces
def test_the_kernel_holds_the_childs_tmp_and_dev_shm_to_their_size(tmp_path):
    """bubblewrap mounts them with a size: a write past it fails at once, between two of the
    grader's looks at what they hold."""
    script = ("for d in /tmp /dev/shm; do head -c 3000000 /dev/zero > $d/fill 2>/dev/null && echo $d whole || "
              "echo $d full; done")
    cmd = bubblewrap.command([], tmp_path, work_mb=2) + ["/bin/sh", "-c", script]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split("\n")[:2] == ["/tmp full", "/dev/shm full"], (proc.stdout, proc.stderr)


@pytest.mark.parametrize("what, signum", [("file", 15), ("file", 2), ("class", 15)])   # 15: SIGTERM (`timeout`)
def test_a_grader_ended_by_a_signal_leaves_nothing_in_tmp(tmp_path, what, signum):
    """What the grader stages (the library's modules the child sees, the copy of the file, the
    child's output) goes when a signal ends it. Its TMPDIR is the test's own: other graders
    running beside it leave theirs in /tmp."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o755)
    tmp.chmod(0o755)
    slow = "import time\n\n\ndef relu_forward(x):\n    time.sleep(120)\n" + WRONG_RELU
    (tmp_path / "relu.py").write_text(slow)
    for learner in ("ann", "ben"):
        (tmp_path / "class" / learner).mkdir(parents=True)
        (tmp_path / "class" / learner / "07_feed_forward_layer_norm.py").write_text(slow)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp))
    graded = [tmp_path / "relu.py"] if what == "file" else ["--class", tmp_path / "class", "--jobs", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "attn.grader", *map(str, graded), "--timeout", "200"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp.glob("attn-check-work-*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert list(tmp.glob("attn-check-work-*")), "the grader never started its child"
        time.sleep(3)                                   # the child is in relu_forward's sleep by now
        proc.send_signal(signum)
        proc.wait(timeout=30)                           # a class's workers too: not when their calls time out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert sorted(p.name for p in tmp.iterdir()) == []


def test_without_a_sandbox_the_working_folder_is_the_graders_alone(tmp_path):
    """--sandbox off: the copy of the learner's file is in a folder no other user may enter
    (the child, nobody under root, goes in before it becomes nobody)."""
    from attn.grader.sandbox import Sandbox
    (tmp_path / "relu.py").write_text(GOOD + "\n\ndef where():\n    raise ValueError('here')\n")
    box = Sandbox(tmp_path / "relu.py", mode="off")
    try:
        assert "relu_forward" in box.start()
        st = os.stat(box._work)
        assert (st.st_mode & 0o777, st.st_uid) == (0o700, os.geteuid())
    finally:
        box.cleanup()
    proc = _run(tmp_path / "relu.py", "--sandbox", "off", "--examples", "2")
    assert proc.returncode == 0 and "relu                   PASS" in proc.stdout, proc.stdout + proc.stderr
    (tmp_path / "relu.py").write_text("def relu_forward(x):\n    raise ValueError('mine')\n" + WRONG_RELU[21:])
    proc = _run(tmp_path / "relu.py", "--sandbox", "off", "--examples", "2")
    assert f"where:    {tmp_path / 'relu.py'}:2 in relu_forward" in proc.stdout, proc.stdout + proc.stderr


KEYCTL = '''import ctypes, platform

NUMBERS = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]


def relu_forward(x):
    libc = ctypes.CDLL(None, use_errno=True)
    add_key, keyctl = NUMBERS
    got = [libc.syscall(add_key, b"user", b"left-by-a-learner", b"x", 1, -3),   # into the session keyring
           libc.syscall(keyctl, 0, -3, 0)]                                      # KEYCTL_GET_KEYRING_ID of @s
    if got != [-1, -1] or ctypes.get_errno() != 1:
        return x, x > 0                                                         # a wrong answer: it got through
    return x * (x > 0), x > 0


def relu_backward(dout, cache):
    return dout * cache
'''


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="the keyring filter knows x86_64 and "
                    "aarch64")
@pytest.mark.parametrize("sandbox, user", [("auto", "root"), ("off", "root"), ("auto", "nobody")])
def test_the_kernels_keyrings_are_refused(tmp_path, sandbox, user):
    """Keyrings are no namespace: add_key and keyctl get EPERM, and the file still passes,
    graded by root and by an ordinary user (nobody, by setpriv; bubblewrap then makes a user
    namespace)."""
    from test_sandbox_attempts import _unprivileged
    prefix = _unprivileged() if user == "nobody" and os.geteuid() == 0 else []
    if prefix is None or user == "root" and os.geteuid() != 0:
        pytest.skip(f"cannot grade as {user} here")
    work = Path(tempfile.mkdtemp(prefix="attn-keyring-"))          # nobody's to read: not under pytest's 0700
    work.chmod(0o777)
    try:
        (work / "relu.py").write_text(KEYCTL)
        env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(work))
        proc = subprocess.run(prefix + [sys.executable, "-m", "attn.grader", str(work / "relu.py"), "--sandbox",
                                        sandbox, "--examples", "2"], capture_output=True, text=True, env=env,
                              cwd=work, timeout=300)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0 and "relu                   PASS" in proc.stdout, proc.stdout + proc.stderr


FORKS_ONCE = ("import os\n\n\ndef relu_forward(x):\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n"
              "    os.waitpid(pid, 0)\n    return x * (x > 0), x > 0\n\n\ndef relu_backward(dout, cache):\n"
              "    return dout * cache\n")


def test_a_file_that_starts_a_process_passes_when_its_user_runs_many(tmp_path):
    """The kernel's process limit counts every process of the child's user (nobody as root,
    the teacher's user otherwise): the child's 64 are counted on top of those it runs already,
    so honest code that starts a process passes on a machine where that user runs 70."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to start processes as nobody")
    import numpy as np
    from attn.grader.sandbox import Sandbox
    path = tmp_path / "relu.py"
    path.write_text(FORKS_ONCE)
    box = Sandbox(path)
    sleepers = [subprocess.Popen(["sleep", "120"], user=65534, group=65534, extra_groups=[],
                                 stdin=subprocess.DEVNULL) for _ in range(70)]
    try:
        assert "relu_forward" in box.start()
        out, _ = box.call("relu_forward", (np.array([-1.0, 2.0]),))
    finally:
        box.cleanup()
        for p in sleepers:                                  # ours alone, by the pid each was given
            p.kill()
            p.wait()
    assert out.tolist() == [0.0, 2.0]

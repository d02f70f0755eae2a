"""The grader's side of the child process that runs a learner's file (the other side is
:mod:`attn.grader.child`): starting it sealed off, one call at a time under a time limit,
what a call that hangs, exits, crashes or floods its output becomes, and ending it with
everything it started before the grader writes a report."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import backend as B
from . import bubblewrap
from .child import NOBODY
from .library import GIVEN_ONLY, LIBRARY, child_policy, is_array, manifest_for
from .results import DEFAULT_TIMEOUT, MAX_OUTPUT, Failure, Fatal, LoadError, NotImplementedYet
from .wire import ENTERED, Arr, Channel, Handle, Rng, WireError, XpRef

np = B.host

#: The child's resource limits (``--memory`` changes the first), and the wall time a layer and
#: a file may take in all (every call of the layer's examples; every layer of the file).
LIMITS = {"memory_mb": 4096, "cpu_s": 900, "file_mb": 16, "processes": 64, "work_mb": 64, "layer_s": 60,
          "file_s": 600}
#: The child's whole environment.
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
             "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}
#: The largest learner's file attn-check reads.
MAX_SOURCE = 1 << 20


def read_source(path: Path) -> tuple[str, str]:
    """The learner's file, read once: a regular file (never through a link, to an answer key
    or a classmate's file), at most MAX_SOURCE bytes. Returns (its text, its bytes' SHA-256);
    raises LoadError."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        why = "a symbolic link (attn-check reads regular files only)" if e.errno == errno.ELOOP else e.strerror
        raise LoadError(f"cannot read {path}: {why}", "") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise LoadError(f"cannot read {path}: not a regular file (attn-check reads regular files only)", "")
        data = f.read(MAX_SOURCE + 1)
    if len(data) > MAX_SOURCE:
        raise LoadError(f"cannot read {path}: larger than {MAX_SOURCE:,} bytes", "")
    return data.decode("utf-8", errors="replace"), hashlib.sha256(data).hexdigest()


def processes_of(uid: int) -> int:
    """How many processes the user ``uid`` runs now (their real user): the kernel's process
    limit counts them all, so the child's 64 are counted on top of them."""
    n = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            with open(status, encoding="ascii", errors="replace") as f:
                uids = next((line.split()[1] for line in f if line.startswith("Uid:")), None)
        except OSError:                 # gone meanwhile
            continue
        n += uids == str(uid)
    return n


def describe(got: dict) -> str:
    """One line: the sandbox a child got."""
    limits = got.get("limits") or []
    return "; ".join([got.get("sandbox") or "no sandbox", f"user {got.get('user') or '?'}",
                      f"files: {got.get('files') or '?'}", "limits: " + (", ".join(limits) or "none")])


def limits_line(limits: dict, got: list, timeout: float, boxed: bool) -> list[str]:
    """The limits in words: the kernel's the child set (``got``), and the grader's own. Memory
    and CPU time are each process's (setrlimit's; no cgroup holds the sandbox as a whole): a
    child that starts others may hold the processes' number times as much."""
    words = {"as": f"memory {limits['memory_mb']} MB a process", "cpu": f"CPU {limits['cpu_s']} s a process",
             "fsize": f"file size {limits['file_mb']} MB", "nproc": f"{limits['processes']} processes",
             "core": "no core dumps"}
    out = [words[g] for g in got if g in words]
    if boxed:
        out.append(f"/tmp and /dev/shm {limits['work_mb']} MB")
    return out + [f"wall time {timeout:g} s a call, {limits['layer_s']:g} s a layer, {limits['file_s']:g} s a file"]


def _signal_name(rc: int) -> str:
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"
    meaning = {"SIGSEGV": "segmentation fault", "SIGABRT": "abort", "SIGBUS": "bus error",
               "SIGFPE": "floating-point exception", "SIGILL": "illegal instruction", "SIGKILL": "killed",
               "SIGXCPU": "its CPU time limit", "SIGXFSZ": "its file size limit"}
    return f"{name}, {meaning[name]}" if name in meaning else name


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def _pdeathsig() -> None:
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class Sandbox:
    """The child process that runs the learner's file (see :mod:`attn.grader.child`).

    :meth:`call` sends one call and waits for its answer, at most ``timeout`` seconds (less
    where the layer's or the file's time is nearly spent), watching the child's output and
    what it writes into its /tmp and /dev/shm; if the child dies, hangs, floods or fills
    them, it is killed, the call raises :class:`Fatal`, and the next call starts a fresh
    child. ``mode``: "auto" (bubblewrap where it can be had), "off" (none; the nobody user
    still, as root). ``source``: the file's text, read once (by :func:`read_source` if not
    given)."""

    def __init__(self, path: Path, timeout: float = DEFAULT_TIMEOUT, reference: bool = False,
                 max_output: int = MAX_OUTPUT, exercise: str | None = None, mode: str = "auto",
                 memory_mb: int | None = None, source: str | None = None, layer_s: float | None = None):
        self.path, self.timeout, self.reference, self.max_output = Path(path), timeout, reference, max_output
        self.exercise, self.mode = exercise, mode
        self.source = source
        self.limits = dict(LIMITS, **({"memory_mb": memory_mb} if memory_mb else {}))
        if layer_s:
            self.limits.update(layer_s=layer_s, file_s=layer_s * LIMITS["file_s"] / LIMITS["layer_s"])
        self.proc = None
        self.found: dict = {}
        self.got: dict = {}
        self.calls = 0
        self._rng_ids: dict = {}
        self._out = tempfile.NamedTemporaryFile(prefix="attn-check-", suffix=".out", delete=False)
        self._out.close()
        self._work = None
        self.boxed = False
        self._sources: dict = {}
        self.withheld: set = set()
        self.file_t0 = self.layer_t0 = None

    # -- lifetime

    def _command(self, policy: dict, copy: Path) -> tuple[list, dict, str]:
        """(the command before the child's ``-c``, its environment's PYTHONPATH and
        ATTN_CHECK_CONFIG's part that says where things are)."""
        modules = ""
        if B.get_backend() == "cupy" and B.cupy_modules is not None:
            modules = ",".join(m.__name__ for m in B.cupy_modules)
        if self.boxed:
            binds, self._sources = bubblewrap.stage(policy)
            prefix = bubblewrap.command(binds, copy.parent, self.limits["work_mb"]) + [bubblewrap.executable()]
            where = {"file": f"{bubblewrap.INSIDE['file']}/{copy.name}", "work": "/tmp/attn-check-work",
                     "sandbox": bubblewrap.name(),
                     "files": "read-only, Python's standard library, NumPy, the grader's child and the copy of the "
                              "file (the library's modules the exercise gives come through the pipe, what it asks "
                              "for withheld); writable, its own /tmp and /dev/shm, gone with it"}
            return prefix, dict(where, pythonpath=f"{bubblewrap.INSIDE['lib']}:{bubblewrap.INSIDE['site']}"), modules
        paths = [str(Path(B.__file__).resolve().parents[1])]
        if modules:
            paths += [str(Path(sys.modules[m.__name__.split(".")[0]].__file__).resolve().parents[1])
                      for m in B.cupy_modules]
        paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        who = "nobody" if os.geteuid() == 0 else "the grader's own user"
        where = {"file": str(copy), "work": f"{self._work}/run", "sandbox": "",
                 "files": f"every file {who} can read (no sandbox)"}
        return [sys.executable], dict(where, pythonpath=os.pathsep.join(paths)), modules

    def start(self) -> dict:
        """Start the child and import the file there. Returns {name: origin} of the
        library's names the file defines; raises LoadError or Fatal."""
        if self.source is None:
            self.source = read_source(self.path)[0]
        self.file_t0 = self.file_t0 or time.monotonic()
        policy = child_policy(manifest_for(self.path, self.exercise), self.source, self.reference)
        self.withheld = set(policy["withhold"])
        self.boxed = self.mode != "off" and bool(bubblewrap.available()[0])
        self._work = tempfile.mkdtemp(prefix="attn-check-work-")      # 0700: the grader's alone
        copy = Path(self._work) / "file" / self.path.name
        copy.parent.mkdir(mode=0o755)
        copy.write_text(self.source, encoding="utf-8")
        copy.chmod(0o644)
        prefix, where, modules = self._command(policy, copy)
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        cfg = {"fds": [req_r, ans_w], "file": where["file"], "shown": str(self.path), "work": where["work"],
               "sandbox": where["sandbox"], "files": where["files"], "backend": B.get_backend(),
               "reference": self.reference, "policy": policy, "env": CLEAN_ENV,
               "names": sorted(n for n in LIBRARY if n not in GIVEN_ONLY), **self.limits,
               "processes_before": processes_of(NOBODY if os.geteuid() == 0 else os.getuid()),
               "piped": sorted(self._sources)}
        env = dict(CLEAN_ENV, ATTN_CHECK_CONFIG=json.dumps(cfg), ATTN_CHECK_CUPY_MODULES=modules,
                   PYTHONPATH=where["pythonpath"], PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
        out = open(self._out.name, "ab")
        try:
            self.proc = subprocess.Popen(prefix + ["-s", "-c", "from attn.grader.child import main; main()"],
                                         env=env, pass_fds=(req_r, ans_w), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=out, cwd=self._work, start_new_session=True,
                                         preexec_fn=_pdeathsig)
        finally:
            out.close()
            os.close(req_r)
            os.close(ans_w)
        self.requests = Channel(req_w)
        self.answers = Channel(ans_r, patience=30.0)
        if self._sources:
            self.requests.send(("sources", {m: list(v) for m, v in self._sources.items()}))
        answer = self._wait("importing the file", self.timeout + 30.0)
        if answer[0] == "import_failed":
            self.close()
            raise LoadError(self.show(answer[1]), self.show(answer[2]))
        if answer[0] != "loaded" or not isinstance(answer[1], dict) or not isinstance(answer[2], dict):
            self.close()
            raise LoadError("the child's first answer was not what attn-check asked for")
        self.found, self.got = answer[1], answer[2]
        self.got["sandbox"] = where["sandbox"]
        self.got["limits"] = limits_line(self.limits, self.got.get("limits") or [], self.timeout, self.boxed)
        return self.found

    def _inner(self) -> list[int]:
        """The pids of bubblewrap's children (the first process of the child's PID namespace)."""
        return _children(self.proc.pid)

    def close(self, patient: bool = False) -> None:
        """End the child and everything it started: its PID namespace (all of it) or its
        session, and wait until they are gone. ``patient``: the grading is over, the child
        may end of itself first (closing its pipes ends it; its CPU time is then counted as
        the grader's children's)."""
        if self.proc is not None:
            for conn in (self.requests, self.answers):
                conn.close()
            if patient:
                try:
                    self.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            self._kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None
        if self._work:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def cleanup(self) -> None:
        self.close(patient=True)
        try:
            os.unlink(self._out.name)
        except OSError:
            pass

    # -- output

    def _out_size(self) -> int:
        try:
            return os.path.getsize(self._out.name)
        except OSError:
            return 0

    def output_tail(self, start: int = 0, lines: int = 6) -> list[str]:
        with open(self._out.name, "rb") as f:
            f.seek(max(start, self._out_size() - 20_000))
            text = f.read().decode("utf-8", "replace")
        return [ln for ln in text.splitlines() if ln.strip()][-lines:]

    def show(self, text: str) -> str:
        """``text`` with the learner's file as it was named on the command line, not resolved."""
        if not text:
            return text
        for copy in self._copies():
            text = text.replace(copy, str(self.path))
        return text

    def _copies(self) -> list[str]:
        """Where the child sees its copy of the file."""
        return [f"/tmp/attn-check-work/{self.path.name}", f"{bubblewrap.INSIDE['file']}/{self.path.name}",
                f"{ENTERED}/{self.path.name}"] + (
            [f"{self._work}/run/{self.path.name}", f"{self._work}/file/{self.path.name}"] if self._work else [])

    def _learner_line(self, start: int) -> str:
        """The learner's innermost line in the traceback the child's faulthandler wrote."""
        with open(self._out.name, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
        block = text.split("Current thread")[-1] if "Current thread" in text else text
        hits = re.findall(r'File "([^"]+)", line (\d+) in (\w+)', block)
        mine = [h for h in hits if h[0] in self._copies()]
        if not mine:
            return ""
        file, line, fn = mine[0]                       # faulthandler lists the innermost frame first
        try:
            src = (self.source or "").splitlines()[int(line) - 1].strip()
        except IndexError:
            src = ""
        return self.show(f"{file}:{line} in {fn}: {src}")

    # -- one call

    def _kill(self):
        for pid in self._inner() if self.proc.poll() is None else []:     # the namespace's first process:
            try:                                                          # the kernel ends the rest
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for target in (self.proc.pid,):
            try:
                os.killpg(target, signal.SIGKILL)
            except OSError:
                pass

    def _work_used(self) -> int:
        """Bytes the child holds in its /tmp and /dev/shm (memory: they are tmpfs)."""
        used = 0
        for pid in self._inner():
            for folder in ("tmp", "dev/shm"):
                try:
                    if os.stat(f"/proc/{pid}/root/{folder}").st_dev == os.stat(f"/{folder}").st_dev:
                        continue                    # bubblewrap has not mounted the child's own yet
                    st = os.statvfs(f"/proc/{pid}/root/{folder}")
                    used += (st.f_blocks - st.f_bfree) * st.f_frsize
                except OSError:
                    pass
        return used

    def _wait(self, what: str, limit: float, start_size: int | None = None, spent: str = ""):
        start_size = self._out_size() if start_size is None else start_size
        t0, watched = time.monotonic(), 0.0
        while True:
            try:
                if self.answers.poll(0.02):
                    answer = self.answers.recv()
                    if not (isinstance(answer, tuple) and answer and isinstance(answer[0], str)):
                        raise WireError("an answer that is not one")
                    return answer
            except (EOFError, OSError):
                pass
            except (WireError, TimeoutError) as e:
                self.close()
                raise Fatal(Failure("integrity", f"{what} sent the grader something that is not plain data ({e})",
                                    look="your functions return arrays, numbers, strings and tuples, lists or "
                                         "dicts of them; nothing else crosses to the grader"))
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                if self.boxed and rc > 128:             # bubblewrap exits 128 + the signal that ended the child
                    rc = 128 - rc
                time.sleep(0.05)
                loc = self._learner_line(start_size)
                did = (f"crashed the interpreter ({_signal_name(rc)})" if rc < 0
                       else f"ended the process with exit status {rc} (os._exit, or a crash)")
                fatal = [ln.strip() for ln in self.output_tail(start_size, 50) if ln.startswith("Fatal Python error")]
                self.close()
                raise Fatal(Failure("integrity", f"{what} {did}", where=loc,
                                    look="your functions run in a child process that nothing may end: no "
                                         "os._exit, no sys.exit, no memory access through ctypes",
                                    symptom=fatal[0] if fatal else ""))
            size = self._out_size()
            if size - start_size > self.max_output:
                self._stop_and_dump()
                loc = self._learner_line(start_size)
                self.close()
                raise Fatal(Failure("integrity", f"{what} printed more than {self.max_output:,} bytes: output "
                                    "flooding", where=loc,
                                    look="a print inside a loop? remove debugging output before grading"))
            if self.boxed and time.monotonic() - watched > 0.2:
                watched = time.monotonic()
                if self._work_used() > self.limits["work_mb"] << 20:
                    self._stop_and_dump()
                    loc = self._learner_line(start_size)
                    self.close()
                    raise Fatal(Failure("integrity", f"{what} wrote more than {self.limits['work_mb']} MB into "
                                        "/tmp and /dev/shm", where=loc,
                                        look="nothing needs files: keep arrays in memory, and return them"))
            if time.monotonic() - t0 > limit:
                self._stop_and_dump()
                loc = self._learner_line(start_size)
                self.close()
                if spent:
                    raise Fatal(Failure("integrity", f"{what}: {spent}", where=loc,
                                        look="a call that sleeps or loops until just before the time limit, many "
                                             "times over"))
                raise Fatal(Failure("integrity", f"{what} did not return within {limit:g} s: an endless loop?",
                                    where=loc, look="a loop whose condition never changes (while True), or a "
                                    "recursion without a base case; --timeout changes the limit"))

    def _stop_and_dump(self):
        """Ask the child's faulthandler for a traceback (where it was), then kill it."""
        size = self._out_size()
        python = [c for p in self._inner() for c in _children(p)] if self.boxed else [self.proc.pid]
        for pid in python:                      # bubblewrap's first process runs Python as its child
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0 and not self._dumped(size):   # a flood grows the output anyway:
            time.sleep(0.02)                                              # wait for the traceback itself
        time.sleep(0.05)
        self._kill()

    def _dumped(self, start: int) -> bool:
        """Whether the faulthandler's traceback has appeared in the child's output past ``start``."""
        with open(self._out.name, "rb") as f:
            f.seek(start)
            text = f.read()
        return b"most recent call first" in text or b"Current thread" in text

    def pack(self, v):
        if isinstance(v, Handle):
            return v
        if isinstance(v, B.DeviceRNG):
            key = id(v)
            if key not in self._rng_ids:
                self._rng_ids[key] = (v, len(self._rng_ids) + 1)
            return Rng(v.seed, self._rng_ids[key][1])
        if v is B.xp() or v is np:
            return XpRef()
        if is_array(v):
            return Arr(np.array(B.to_host(v)), B.get_backend() == "cupy" and B.is_device_array(v))
        if type(v) in (tuple, list):
            return type(v)(self.pack(x) for x in v)
        if isinstance(v, tuple) and hasattr(type(v), "_fields"):
            return type(v)(*(self.pack(x) for x in v))
        if type(v) is dict:
            return {k: self.pack(x) for k, x in v.items()}
        return v

    def unpack(self, v):
        if isinstance(v, Arr):
            return B.to_device(v.host) if v.device or B.get_backend() == "numpy" else v.host
        if type(v) in (tuple, list):
            return type(v)(self.unpack(x) for x in v)
        if isinstance(v, tuple) and hasattr(type(v), "_fields"):
            return type(v)(*(self.unpack(x) for x in v))
        if type(v) is dict:
            return {k: self.unpack(x) for k, x in v.items()}
        return v

    def begin_layer(self) -> None:
        """A layer's grading starts: its time is counted from here."""
        self.layer_t0 = time.monotonic()

    def _time_left(self, most: float | None = None) -> tuple[float, str]:
        """(the seconds the next request may take, at ``most`` (a call's limit by default),
        what is spent when the layer's or the file's time is less than that); raises Fatal when
        that time is spent."""
        now, left, spent = time.monotonic(), most or self.timeout, ""
        for t0, budget, what in ((self.layer_t0, self.limits["layer_s"], "layer"),
                                 (self.file_t0, self.limits["file_s"], "file")):
            if t0 is not None and budget - (now - t0) < left:
                left, spent = budget - (now - t0), f"the {what}'s {budget:g} s are spent"
        if left <= 0:
            raise Fatal(Failure("integrity", spent, look="a call that sleeps or loops until just before the time "
                                                         "limit, many times over"))
        return left, spent

    def reset(self) -> None:
        self._rng_ids.clear()
        if self.proc is not None:
            self.requests.send(("reset",))

    def perturbed(self, name: str, args, where: tuple, idx, h: float, given: bool = False) -> list:
        """Central differences' calls, in one request: ``name(*args)`` with the entry ``i`` of the
        array at ``where`` (an argument's index, then a key where that argument is a dict) moved
        by ``+h``, then by ``-h``, for each ``i`` of ``idx``. The arguments cross once; the child
        perturbs its own copy for each call, as the grader would have. Returns each call's
        first element (the output); raises as :meth:`call` does."""
        if self.proc is None:
            self.start()
        n = 2 * len(idx)
        limit, spent = self._time_left(self.timeout * max(1, n))
        self.calls += n
        start = self._out_size()
        self.requests.send(("perturb", name, [self.pack(a) for a in args], given, list(where),
                            [int(i) for i in idx], float(h)))
        answer = self._wait(f"{name}", limit, start, spent)
        if answer[0] == "ok" and len(answer) == 3 and isinstance(answer[1], list) and len(answer[1]) == n:
            return [self.unpack(r) for r in answer[1]]
        self._raise(name, answer)

    def _raise(self, name: str, answer):
        """What an answer that is not a result becomes."""
        if answer[0] == "todo":
            raise NotImplementedYet(answer[1])
        if answer[0] == "raised":
            kind, message, where, raiser = answer[1:]
            raise _Raised(kind, message, self.show(where), raiser)
        raise Fatal(Failure("integrity", f"{name}'s answer was not what attn-check asked for"))

    def call(self, name: str, args, given: bool = False):
        """Run ``name(*args)`` in the child. Returns its result; raises _Raised,
        NotImplementedYet, or Fatal."""
        if self.proc is None:
            self.start()
        limit, spent = self._time_left()
        self.calls += 1
        packed = [self.pack(a) for a in args]
        start = self._out_size()
        self.requests.send(("call", name, packed, given))
        answer = self._wait(f"{name}", limit, start, spent)
        if answer[0] != "ok" or len(answer) != 3 or not isinstance(answer[2], list):
            self._raise(name, answer)
        _, result, modified = answer
        for item in modified:                   # what the call did to its inputs, for check_unchanged
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                    and 0 <= item[0] < len(args) and isinstance(item[1], Arr)):
                raise Fatal(Failure("integrity", f"{name}'s answer was not what attn-check asked for"))
            a, new = args[item[0]], item[1].host
            if is_array(a) and tuple(a.shape) == new.shape:
                a[...] = B.to_device(new) if B.is_device_array(a) else new
        return self.unpack(result)


class _Raised(Exception):
    def __init__(self, kind, message, where, raiser):
        super().__init__(message)
        self.kind, self.message, self.where, self.raiser = kind, message, where, raiser


class Remote:
    """A learner's function (or a forward the exercise gives), called in the child."""

    def __init__(self, sandbox: Sandbox, name: str, given: bool = False):
        self.sandbox, self.name, self.given = sandbox, name, given

    def __call__(self, *args):
        return self.sandbox.call(self.name, args, self.given)

    def perturbed(self, args, where: tuple, idx, h: float) -> list:
        """The outputs central differences need, in one request (:meth:`Sandbox.perturbed`)."""
        return self.sandbox.perturbed(self.name, args, where, idx, h, self.given)

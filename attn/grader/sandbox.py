"""The grader's side of the child process that runs a learner's file (the other side is
:mod:`attn.grader.child`): starting it, one call at a time under a time limit, and what
a call that hangs, exits, crashes or floods its output becomes."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

from .. import backend as B
from .child import Arr, Handle, Rng, XpRef, is_array
from .results import DEFAULT_TIMEOUT, MAX_OUTPUT, Failure, Fatal, LoadError, NotImplementedYet

np = B.host


def _signal_name(rc: int) -> str:
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"
    meaning = {"SIGSEGV": "segmentation fault", "SIGABRT": "abort", "SIGBUS": "bus error",
               "SIGFPE": "floating-point exception", "SIGILL": "illegal instruction", "SIGKILL": "killed"}
    return f"{name}, {meaning[name]}" if name in meaning else name


class Sandbox:
    """The child process that runs the learner's file (see :mod:`attn.grader.child`).

    :meth:`call` sends one call and waits for its answer, at most ``timeout`` seconds,
    watching the child's output; if the child dies, hangs or floods, it is killed, the
    call raises :class:`Fatal`, and the next call starts a fresh child."""

    def __init__(self, path: Path, timeout: float = DEFAULT_TIMEOUT, reference: bool = False,
                 max_output: int = MAX_OUTPUT):
        self.path, self.timeout, self.reference, self.max_output = Path(path), timeout, reference, max_output
        self.proc = None
        self.found: dict = {}
        self.calls = 0
        self._rng_ids: dict = {}
        self._out = tempfile.NamedTemporaryFile(prefix="attn-check-", suffix=".out", delete=False)
        self._out.close()

    # -- lifetime

    def start(self) -> dict:
        """Start the child and import the file there. Returns {name: origin} of the
        library's names the file defines; raises LoadError or Fatal."""
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        package_root = str(Path(B.__file__).resolve().parents[1])
        paths = [package_root]
        modules = ""
        if B.get_backend() == "cupy" and B.cupy_modules is not None:
            modules = ",".join(m.__name__ for m in B.cupy_modules)
            paths += [str(Path(sys.modules[m.__name__.split(".")[0]].__file__).resolve().parents[1])
                      for m in B.cupy_modules]
        env = dict(os.environ, ATTN_CHECK_FDS=f"{req_r},{ans_w}", ATTN_CHECK_FILE=str(self.path.resolve()),
                   ATTN_CHECK_BACKEND=B.get_backend(), ATTN_CHECK_REFERENCE="1" if self.reference else "0",
                   ATTN_CHECK_CUPY_MODULES=modules,
                   PYTHONPATH=os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(
                       os.pathsep) if p]),
                   PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
        out = open(self._out.name, "ab")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", "from attn.grader.child import main; main()"], env=env,
                                         pass_fds=(req_r, ans_w), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=out, cwd=str(self.path.resolve().parent), start_new_session=True)
        finally:
            out.close()
            os.close(req_r)
            os.close(ans_w)
        self.requests = Connection(req_w, readable=False)
        self.answers = Connection(ans_r, writable=False)
        answer = self._wait("importing the file", self.timeout + 30.0)
        if answer[0] == "import_failed":
            self.close()
            raise LoadError(self.show(answer[1]), self.show(answer[2]))
        self.found = answer[1]
        return self.found

    def close(self) -> None:
        if self.proc is not None:
            for conn in (self.requests, self.answers):
                conn.close()
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
            self.proc.wait()
            self.proc = None

    def cleanup(self) -> None:
        self.close()
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
        return text.replace(str(self.path.resolve()), str(self.path)) if text else text

    def _learner_line(self, start: int) -> str:
        """The learner's innermost line in the traceback the child's faulthandler wrote."""
        target = str(self.path.resolve())
        with open(self._out.name, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
        block = text.split("Current thread")[-1] if "Current thread" in text else text
        hits = re.findall(r'File "([^"]+)", line (\d+) in (\w+)', block)
        mine = [h for h in hits if str(Path(h[0]).resolve()) == target]
        if not mine:
            return ""
        file, line, fn = mine[0]                       # faulthandler lists the innermost frame first
        try:
            src = Path(file).read_text(encoding="utf-8", errors="replace").splitlines()[int(line) - 1].strip()
        except (OSError, IndexError):
            src = ""
        return self.show(f"{file}:{line} in {fn}: {src}")

    # -- one call

    def _kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass

    def _wait(self, what: str, limit: float, start_size: int | None = None):
        start_size = self._out_size() if start_size is None else start_size
        t0 = time.monotonic()
        while True:
            try:
                if self.answers.poll(0.02):
                    return self.answers.recv()
            except (EOFError, OSError):
                pass
            if self.proc.poll() is not None:
                rc = self.proc.returncode
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
            if time.monotonic() - t0 > limit:
                self._stop_and_dump()
                loc = self._learner_line(start_size)
                self.close()
                raise Fatal(Failure("integrity", f"{what} did not return within {limit:g} s: an endless loop?",
                                    where=loc, look="a loop whose condition never changes (while True), or a "
                                    "recursion without a base case; --timeout changes the limit"))

    def _stop_and_dump(self):
        """Ask the child's faulthandler for a traceback (where it was), then kill it."""
        size = self._out_size()
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
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
        if type(v) is dict:
            return {k: self.pack(x) for k, x in v.items()}
        return v

    def unpack(self, v):
        if isinstance(v, Arr):
            return B.to_device(v.host) if v.device or B.get_backend() == "numpy" else v.host
        if type(v) in (tuple, list):
            return type(v)(self.unpack(x) for x in v)
        if type(v) is dict:
            return {k: self.unpack(x) for k, x in v.items()}
        return v

    def reset(self) -> None:
        self._rng_ids.clear()
        if self.proc is not None:
            self.requests.send(("reset",))

    def call(self, name: str, args, given: bool = False):
        """Run ``name(*args)`` in the child. Returns its result; raises _Raised,
        NotImplementedYet, _Twin, or Fatal."""
        if self.proc is None:
            self.start()
        self.calls += 1
        packed = [self.pack(a) for a in args]
        start = self._out_size()
        self.requests.send(("call", name, packed, given))
        answer = self._wait(f"{name}", self.timeout, start)
        if answer[0] == "todo":
            raise NotImplementedYet(answer[1])
        if answer[0] == "raised":
            kind, message, where, raiser = answer[1:]
            raise _Raised(kind, message, self.show(where), raiser)
        _, result, modified, twin = answer
        if twin:
            raise _Twin(name, twin)
        for i, new in modified.items():         # what the call did to its inputs, for check_unchanged
            a = args[i]
            if is_array(a) and tuple(a.shape) == new.shape:
                a[...] = B.to_device(new) if B.is_device_array(a) else new
        return self.unpack(result)


class _Raised(Exception):
    def __init__(self, kind, message, where, raiser):
        super().__init__(message)
        self.kind, self.message, self.where, self.raiser = kind, message, where, raiser


class _Twin(Exception):
    def __init__(self, name, called):
        super().__init__(name)
        self.name, self.called = name, called


class Remote:
    """A learner's function (or a forward the exercise gives), called in the child."""

    def __init__(self, sandbox: Sandbox, name: str, given: bool = False):
        self.sandbox, self.name, self.given = sandbox, name, given

    def __call__(self, *args):
        return self.sandbox.call(self.name, args, self.given)

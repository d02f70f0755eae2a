"""``attn-check``: grade your own layers with the checks that prove the library's.

    attn-check PATH.py [--layer NAME ...] [--examples N] [--timeout S] [--hint 1|2|3]
    attn-check --all DIR
    attn-check PATH.py --json FILE --junit FILE --gradescope FILE --html DIR

The learner's file is never imported here: a child process (:mod:`attn.check_child`)
imports it and runs its functions one call at a time, each under a time limit
(``--timeout``), its output to a file whose size is watched. A call that hangs, exits
(``sys.exit``, ``os._exit``), raises ``KeyboardInterrupt``, crashes the interpreter or
floods its output is a failure that names the function and what it did. Everything
that decides a grade (hypothesis' examples, the library's results, every comparison)
stays in this process.

The child reports which of the library's names (:data:`attn.check_child.LIBRARY`) the
file defines, and where each was defined. A function that is the library's own (by
identity, module or file), or that calls the library's own function of its name, is a
failure: "re-exports the library's". A forward the exercise gives (exercise 8 imports
the library's forwards and asks for the backwards) is used, not graded.

For every layer the file defines, on examples hypothesis draws
(:data:`attn.testing.LAYERS`; hard inputs included):

1. **the forward**, on every example first: an exception, a result that is not
   ``(out, cache)``, an input modified in place, a wrong shape or dtype, NaN, the
   layer's invariants, the output against the library's, float32 in and out;
2. **the backward**, only once the forward passed: the same structural checks, each
   gradient against the library's, then against float64 central differences of the
   learner's own forward, and the backward invariants. When the forward is wrong, its
   backward is graded only against central differences of the learner's own forward,
   and the report says that the forward is the thing to fix;
3. **dropout**, for a layer that takes it: ``p = 0`` and inference (``rng=None``) are the
   identity; over many draws of one seeded generator the kept fraction is ``1 - p`` and
   kept units are scaled by ``1/(1-p)``; the backward uses the forward's mask.

Hypothesis shrinks a failure to the smallest example it can find; the report shows it,
which check and which gradient failed, the relative error, the first entries that
differ, what the difference looks like, and a hint at the level asked for
(``--hint 1`` the symptom, ``2`` where to look, ``3`` the formula). The exit status is 0
only when every graded function passed.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, reject, seed, settings
from hypothesis.errors import Flaky

from . import backend as B
from .check_child import Arr, Handle, Rng, XpRef, is_array, library_function
from .gradcheck import numerical_gradient, rel_error
from .testing import DROPOUT_PROBES, LAYERS, XP, Built, Example, Fresh, InvariantError, Layer, reference

DEFAULT_EXAMPLES = 20
EXAMPLE_SEED = 20170612     # hypothesis' seed: the same examples on every run (the paper's arXiv date)
DEFAULT_TIMEOUT = 10.0      # seconds per call: a correct layer on these sizes takes milliseconds
MAX_OUTPUT = 200_000        # bytes a file may print over one call
FORWARD_TOL = 1e-8          # relative error of an output against the library's (float64)
GRADIENT_TOL = 1e-6         # relative error of a gradient against the library's or central differences
NOISE_FLOOR = 1e-8         # absolute difference from central differences that is rounding, not a bug
SPOT_CHECK = 24             # entries per input where central differences are taken (all of a smaller input)

np = B.host


class NotImplementedYet(Exception):
    """The learner's function raised NotImplementedError (an untouched starter)."""

    def __init__(self, function: str):
        super().__init__(function)
        self.function = function
        self.example = None


class Failure(Exception):
    """One failed check, with what the report needs to explain it.

    ``look`` says where to look (``--hint 2``); ``hint`` gives the formula (``--hint 3``).
    ``arrays``: (yours, expected) host arrays of a failed comparison, for the HTML report."""

    def __init__(self, check: str, message: str, hint: str = "", error: float | None = None,
                 entries: list | None = None, symptom: str = "", where: str = "", tol: float | None = None,
                 look: str = "", arrays=None):
        super().__init__(message)
        self.tol = tol
        self.check, self.message, self.hint, self.look = check, message, hint, look
        self.error, self.entries, self.symptom, self.where = error, entries or [], symptom, where
        self.arrays = arrays
        self.example: Example | None = None
        self.blame = ""
        self.fatal = False


class Fatal(BaseException):
    """A call that ended the child process (a hang, an exit, a crash, a flood of output).
    A BaseException, so that hypothesis stops at once instead of shrinking through
    restarts: the example that did it is reported as it is."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure
        failure.fatal = True


class _Todo(BaseException):
    """Carries NotImplementedYet out of hypothesis without shrinking (a BaseException)."""

    def __init__(self, todo: NotImplementedYet):
        super().__init__(todo.function)
        self.todo = todo


class LoadError(Exception):
    """The learner's file could not be imported (the message says why, ``where`` where)."""

    def __init__(self, message: str, where: str = ""):
        super().__init__(message)
        self.where = where

# ----------------------------------------------------------------------------- the child process


def _signal_name(rc: int) -> str:
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"
    meaning = {"SIGSEGV": "segmentation fault", "SIGABRT": "abort", "SIGBUS": "bus error",
               "SIGFPE": "floating-point exception", "SIGILL": "illegal instruction", "SIGKILL": "killed"}
    return f"{name}, {meaning[name]}" if name in meaning else name


class Sandbox:
    """The child process that runs the learner's file (see :mod:`attn.check_child`).

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
            self.proc = subprocess.Popen([sys.executable, "-c", "from attn.check_child import main; main()"], env=env,
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


# ----------------------------------------------------------------------------- calling learner code


def _call(fn, name: str, check: str, *args):
    """Call a learner's function; what it raises becomes a Failure (or NotImplementedYet)."""
    try:
        return fn(*args)
    except _Raised as e:
        look = "read the message and the line above; the example shows the shapes that triggered it"
        if e.kind in ("SystemExit", "KeyboardInterrupt"):
            look = "a graded function must return its result: no sys.exit, no KeyboardInterrupt, no exit()"
        elif not e.where and e.kind == "TypeError":
            look = f"{name} must take the library's arguments: {_signature(name)}"
        raise Failure(check, f"{name} {e.message}", where=e.where, look=look) from None
    except _Twin as e:
        raise Failure("integrity", f"{e.name} calls the library's own answer, {e.called}",
                      look="attn-check grades your code: write the body yourself (calling the library's other "
                           "layers where the exercise allows it is fine)") from None
    except Fatal as e:
        e.failure.check = check if e.failure.check == "integrity" else e.failure.check
        raise


def _signature(name: str) -> str:
    import inspect
    try:
        return name + str(inspect.signature(library_function(name)))
    except (KeyError, TypeError, ValueError):
        return name


def _typename(x) -> str:
    return x.type_name if isinstance(x, Handle) else type(x).__name__


class _Args:
    """An example's arguments on the device: ``arrays`` are the ones the forward reads
    (perturbed in place by the numerical gradient); :meth:`call` makes a fresh rng and
    the namespace each time. ``drop``: argument names left out of the learner's call."""

    def __init__(self, ex: Example, dtype=None, drop=()):
        pairs = [(n, v) for n, v in ex.args if not n.startswith("_") and n not in drop]
        self.names = [n for n, _ in pairs]
        self.host = [v for _, v in pairs]
        self.arrays = [self._dev(v, dtype) for v in self.host]

    @staticmethod
    def _dev(v, dtype):
        if isinstance(v, np.ndarray):
            a = v.copy()
            if dtype is not None and a.dtype.kind == "f":
                a = a.astype(dtype)
            return B.to_device(a)
        if type(v) is dict:
            return {k: _Args._dev(x, dtype) for k, x in v.items()}
        return v

    def call(self, sandbox: "Sandbox | None" = None) -> list:
        """The arguments of one call; a :class:`Built` one made by the library here, or in
        ``sandbox``'s child for the learner's call."""
        return [B.DeviceRNG(v.seed) if isinstance(v, Fresh) else B.xp() if v is XP else
                (sandbox.call(v.function, v.args, given=True) if sandbox else library_function(v.function)(*v.args))
                if isinstance(v, Built) else v for v in self.arrays]

    def index(self, name: str) -> int:
        return self.names.index(name)

    def check_unchanged(self, fn_name: str, check: str, extra=()):
        items = list(zip(self.names, self.host, self.arrays)) + list(extra)
        for name, h, a in items:
            pairs = ([(f"{name}[{k!r}]", h[k], a[k]) for k in h] if type(h) is dict else [(name, h, a)])
            for label, hh, aa in pairs:
                if isinstance(hh, np.ndarray) and is_array(aa):
                    now = B.to_host(aa)
                    if now.shape != hh.shape or not np.array_equal(now.astype(hh.dtype), hh):
                        raise Failure(check, f"{fn_name} modified its input {label} in place",
                                      look="compute into new arrays (x = x - m, not x -= m; dout * mask, not dout "
                                           "*= mask): the caller still needs its arrays, a residual connection "
                                           "reads them again")

# ----------------------------------------------------------------------------- comparing


def _symptom(g, w) -> str:
    """A recognisable shape of the difference between ``g`` (yours) and ``w`` (expected)."""
    if not np.issubdtype(w.dtype, np.floating) or not np.isfinite(g).all():
        return ""
    if not g.any() and w.any():
        return "yours is all zeros: a whole term or path is missing"
    ww = float((w * w).sum())
    if ww > 0:
        c = float((g * w).sum()) / ww
        if abs(c - 1) > 1e-6 and rel_error(g, c * w) < 1e-7:
            if abs(c + 1) < 1e-6:
                return "yours is the expected with the opposite sign"
            return f"yours is {c:.6g} times the expected: a scale factor is missing or extra"
    if g.ndim >= 2 and g.shape[-1] == g.shape[-2] and g.shape[-1] > 1 and rel_error(g.swapaxes(-1, -2), w) < 1e-7:
        return "yours is the transpose of the expected: a transposed product"
    return ""


def _entries(g, w, k: int = 4) -> list:
    """The first ``k`` entries (C order) where ``g`` and ``w`` differ: (index, yours, expected)."""
    if np.issubdtype(w.dtype, np.floating):
        bad = ~(np.abs(g - w) <= 1e-9 + 1e-7 * np.abs(w))
    else:
        bad = g != w
    return [(tuple(int(i) for i in idx), g[tuple(idx)], w[tuple(idx)]) for idx in np.argwhere(bad)[:k]]


def _compare(check: str, what: str, got, want, tol: float, hint: str, look: str = "") -> None:
    """Raise a Failure unless ``got`` has ``want``'s shape and dtype and is close to it."""
    g, w = B.to_host(got), B.to_host(want)
    if g.shape != w.shape:
        transposed = g.ndim >= 2 and g.shape[:-2] + g.shape[-2:][::-1] == w.shape
        raise Failure(check, f"{what} has shape {g.shape}, expected {w.shape}", hint, look=look,
                      symptom="the last two axes are swapped: a transposed product" if transposed else "")
    if g.dtype != w.dtype:
        raise Failure(check, f"{what} has dtype {g.dtype}, expected {w.dtype}",
                      look="keep the input's dtype: no float() / astype to another precision, constants as "
                      "x.dtype.type(c), new arrays with dtype=x.dtype")
    if np.issubdtype(w.dtype, np.floating):
        bad = ~np.isfinite(g) & np.isfinite(w)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise Failure(check, f"{what} has {g[i]} at {i} where the library's is finite ({w[i]:.6g})", hint,
                          look="NaN or inf: exp of a large logit (subtract the row maximum first), a -inf mask "
                               "fill, or 0/0 on a fully masked row", entries=_entries(g, w), arrays=(g, w))
        err = rel_error(g, w) if g.size else 0.0
    else:
        err = float((g != w).sum())
        tol = 0.0
    if err > tol:
        raise Failure(check, f"{what} differs from the library's", hint, error=err if w.dtype.kind == "f" else None,
                      entries=_entries(g, w), symptom=_symptom(g, w), tol=tol, look=look, arrays=(g, w))


def _check_output(check: str, what: str, out, want) -> None:
    if not is_array(out):
        raise Failure(check, f"{what} is a {_typename(out)}, expected an array of shape {tuple(want.shape)}",
                      look="return the array itself")
    if B.get_array_module(out) is not B.get_array_module(want):
        raise Failure(check, f"{what} is a {B.get_array_module(out).__name__} array, expected "
                             f"{B.get_array_module(want).__name__}",
                      look="use xp = attn.backend.get_array_module(x) instead of numpy, so the layer runs on CuPy too")


# ----------------------------------------------------------------------------- one example of each kind


def _run_invariants(layer: Layer, functions: dict, ex: Example, check: str = "invariant") -> None:
    if layer.invariants is None:
        return
    try:
        layer.invariants(functions, ex)
    except InvariantError as e:
        raise Failure(check, str(e), look=e.hint) from None
    except (NotImplementedYet, Failure):
        raise
    except Exception as e:      # the learner's result was not what the invariant could work with
        raise Failure(check, f"{type(e).__name__} while checking an invariant: {e}",
                      look="the example shows the inputs; the result of your function had an unexpected type "
                           "or shape") from None


class _Wrapped:
    """A learner's function as the invariants call it: its failures name the function."""

    def __init__(self, fn, name):
        self.fn, self.name = fn, name

    def __call__(self, *args):
        return _call(self.fn, self.name, "invariant", *args)


def _grad_items(layer, wrt, grads, ref_grads, args, bname):
    """(label, hint key, yours, expected, the input array) for every gradient, dict inputs
    (a block's parameters) one entry per key."""
    items = []
    for name, g, rg in zip(wrt, grads, ref_grads):
        x = args.arrays[args.index(name)]
        if type(x) is dict:
            if not isinstance(g, dict):
                raise Failure("backward", f"{bname} returned a {_typename(g)} for d{name}, expected a dict keyed "
                                          f"like {name}", look="return the gradients in a dict with the parameters' "
                                          "names: grads[name] has the shape of params[name]")
            missing = [k for k in x if k not in g]
            if missing:
                raise Failure("backward", f"d{name} has no gradient for {', '.join(missing[:4])}"
                                          + (" ..." if len(missing) > 4 else ""),
                              look="every parameter gets a gradient; a parameter used in several places gets "
                                   "the sum of its paths")
            items += [(f"d{name}[{k!r}]", f"d{k}" if f"d{k}" in layer.hints or f"d{k}" in layer.where
                       else "d" + k.split(".")[-1], g[k], rg[k], x[k]) for k in x]
        else:
            items.append((f"d{name}", "d" + name, g, rg, x))
    return items


def _hints(layer: Layer, key: str) -> tuple[str, str]:
    return layer.where.get(key, ""), layer.hints.get(key, "")


def check_pair(layer: Layer, impl: dict, ex: Example, phase: str = "all", drop=()) -> None:
    """One example of a forward/backward pair.

    ``phase``: ``"forward"`` (structure, invariants, the library's output, float32),
    ``"backward"`` (the forward passed: every gradient against the library's and against
    central differences of the learner's forward, the backward invariants) or
    ``"self"`` (the forward is wrong: the backward against central differences of the
    learner's own forward only)."""
    fname, bname = layer.functions
    ref_f, ref_b = reference(layer.name)
    fwd, bwd = impl[fname], impl.get(bname)
    if drop and any(ex.get(n) for n in ("dropout",) if n in dict(ex.args)):
        reject()                                        # dropout deferred: examples without it only
    args = _Args(ex, drop=drop)
    ref_out, ref_cache = ref_f(*_Args(ex).call())
    res = _call(fwd, fname, "forward", *args.call())
    if not (isinstance(res, tuple) and len(res) == 2):
        got = f"a tuple of {len(res)}" if isinstance(res, tuple) else f"a {_typename(res)}"
        raise Failure("forward", f"{fname} returned {got}, expected (out, cache)",
                      look="return the output and a cache, `return out, cache`: backward gets only dout and "
                           "the cache")
    out, cache = res
    _check_output("forward", "the output", out, ref_out)
    args.check_unchanged(fname, "forward")
    look, formula = _hints(layer, "forward")
    _compare("forward", "the output", out, ref_out, np.inf, formula, look)          # shape, dtype, NaN
    if phase == "forward":
        _run_invariants(layer, {fname: _Wrapped(fwd, fname)}, ex)
        if ex.compare:
            _compare("forward", "the output", out, ref_out, FORWARD_TOL, formula, look)
        a32 = _Args(ex, "float32", drop=drop)
        r32 = ref_f(*_Args(ex, "float32").call())[0]
        o32 = _call(fwd, fname, "float32", *a32.call())
        if isinstance(o32, tuple) and len(o32) == 2 and is_array(o32[0]) and o32[0].dtype != r32.dtype:
            raise Failure("float32", f"with float32 inputs the output is {o32[0].dtype}, expected {r32.dtype}",
                          look="keep the input's dtype: constants as x.dtype.type(c), new arrays with "
                               "dtype=x.dtype")
        return
    if bwd is None:
        return
    dout_host = B.host_rng(ex.seed).standard_normal(tuple(ref_out.shape)).astype(B.to_host(ref_out).dtype)
    dout = B.to_device(dout_host.copy())
    ref_grads = ref_b(B.to_device(dout_host.copy()), ref_cache)
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    grads = _call(bwd, bname, "backward", dout, cache)
    wrt = ex.wrt
    if not isinstance(grads, tuple):
        grads = (grads,) if len(wrt) == 1 else grads
    if not isinstance(grads, tuple) or len(grads) != len(wrt):
        n = len(grads) if isinstance(grads, tuple) else 1
        raise Failure("backward", f"{bname} returned {n} value(s), expected {len(wrt)}: "
                                  + ", ".join("d" + w for w in wrt),
                      look="return one gradient per input of the forward, in the forward's order")
    args.check_unchanged(bname, "backward", [("dout", dout_host, dout)])
    items = _grad_items(layer, wrt, grads, ref_grads, args, bname)
    for label, key, g, rg, _ in items:
        _check_output("backward", label, g, rg)
        _compare("backward", label, g, rg, np.inf, *_hints(layer, key)[::-1])
    if phase == "backward":
        if ex.compare:
            for label, key, g, rg, _ in items:
                try:
                    _compare("backward", f"gradient {label}", g, rg, GRADIENT_TOL, *_hints(layer, key)[::-1])
                except Failure as f:
                    if layer.explain is not None:
                        f.symptom = layer.explain(label, g, rg, ex, dout_host) or f.symptom
                    raise
        _run_invariants(layer, {fname: _Wrapped(fwd, fname), bname: _Wrapped(bwd, bname)}, ex)
    if ex.gradcheck:
        spot = SPOT_CHECK if len(items) <= 12 else 3
        for label, key, g, _, x in items:
            idx = _spot(x.size, ex.seed, spot)
            num = numerical_gradient(lambda: float(B.to_host((_call(fwd, fname, "forward", *args.call())[0]
                                                              * dout).sum())), x, indices=idx)
            gh, nh = B.to_host(g).reshape(-1)[idx], B.to_host(num).reshape(-1)[idx]
            err = rel_error(gh, nh)
            # Entries of a tiny gradient carry the central difference's rounding noise (about
            # ulp(sum(out * dout)) / h) at full weight: an absolute floor far above it, far below a bug.
            if not err <= GRADIENT_TOL and not np.abs(gh - nh).max() <= NOISE_FLOOR:
                where = f" (at flat indices {idx.tolist()} of {x.size})" if len(idx) < x.size else ""
                look, formula = _hints(layer, key)
                raise Failure("backward", f"gradient {label} disagrees with central differences of your forward"
                              + where, formula, error=err, entries=_entries(gh, nh), symptom=_symptom(gh, nh),
                              tol=GRADIENT_TOL, look=look, arrays=(gh, nh))


def check_function(layer: Layer, impl: dict, ex: Example, phase: str = "all", drop=()) -> None:
    """A plain function (a table, a reshape, a mask, a schedule): its result against the library's."""
    (name,) = layer.functions
    ref_fn = reference(layer.name)[0]
    args = _Args(ex)
    want = ref_fn(*_Args(ex).call())
    got = _call(impl[name], name, "output", *args.call(getattr(impl[name], "sandbox", None)))
    if B.is_device_array(want):
        _check_output("output", "the result", got, want)
    args.check_unchanged(name, "output")
    look, formula = _hints(layer, name)
    if layer.compare is not None:
        try:
            layer.compare(got, want, ex)
        except InvariantError as e:
            raise Failure("output", str(e), formula, look=e.hint or look) from None
        _run_invariants(layer, {name: _Wrapped(impl[name], name)}, ex)
        return
    _compare("output", "the result", got, want, np.inf, formula, look)
    _run_invariants(layer, {name: _Wrapped(impl[name], name)}, ex)
    _compare("output", "the result", got, want, FORWARD_TOL, formula, look)


def check_loss(layer: Layer, impl: dict, ex: Example, phase: str = "all", drop=()) -> None:
    """``(loss, dlogits)``: both against the library's, dlogits against central differences of the loss."""
    (name,) = layer.functions
    fn, ref_fn = impl[name], reference(layer.name)[0]
    args = _Args(ex)
    ref_loss, ref_d = ref_fn(*_Args(ex).call())
    res = _call(fn, name, "loss", *args.call())
    if not (isinstance(res, tuple) and len(res) == 2):
        raise Failure("loss", f"{name} returned {_typename(res)}, expected (loss, dlogits)",
                      look="the loss and its gradient come out together: `return loss, dlogits`")
    loss, d = res
    args.check_unchanged(name, "loss")
    look, formula = _hints(layer, "dlogits")
    _check_output("loss", "dlogits", d, ref_d)
    _compare("loss", "dlogits", d, ref_d, np.inf, formula, look)
    try:
        lv = float(B.to_host(loss))
    except Exception:
        raise Failure("loss", f"the loss is a {_typename(loss)} of shape {getattr(loss, 'shape', '?')}, "
                              "expected one number", look="average over the real tokens to a 0-d array") from None
    _run_invariants(layer, {name: _Wrapped(fn, name)}, ex)
    rv = float(B.to_host(ref_loss))
    if not abs(lv - rv) <= FORWARD_TOL * (abs(rv) + 1e-12):
        raise Failure("loss", f"the loss is {lv!r}, the library's {rv!r}", layer.hints.get(name, ""),
                      error=abs(lv - rv) / (abs(rv) + abs(lv) + 1e-300), tol=FORWARD_TOL,
                      look=layer.where.get(name, ""))
    _compare("loss", "dlogits", d, ref_d, GRADIENT_TOL, formula, look)
    if ex.gradcheck:
        x = args.arrays[0]
        idx = _spot(x.size, ex.seed)
        num = numerical_gradient(lambda: float(B.to_host(_call(fn, name, "loss", *args.call())[0])), x, indices=idx)
        gh, nh = B.to_host(d).reshape(-1)[idx], B.to_host(num).reshape(-1)[idx]
        err = rel_error(gh, nh)
        if not err <= GRADIENT_TOL:
            spot = f" (at flat indices {idx.tolist()} of {x.size})" if len(idx) < x.size else ""
            raise Failure("loss", "dlogits disagrees with central differences of your loss" + spot, formula,
                          error=err, entries=_entries(gh, nh), symptom=_symptom(gh, nh), tol=GRADIENT_TOL,
                          look=look, arrays=(gh, nh))


def _spot(size: int, seed: int, k: int = SPOT_CHECK):
    """Flat indices where central differences are taken: every entry of a small input,
    ``k`` random ones of a larger one (the whole gradient is compared with the library's
    anyway; the spot check keeps a layer's check at seconds)."""
    if size <= k:
        return np.arange(size)
    return np.sort(B.host_rng(seed).choice(size, k, replace=False))


def check_steps(layer: Layer, impl: dict, ex: Example, phase: str = "all", drop=()) -> None:
    """An optimizer step, a few times from zero moments: the learner's state carried from
    step to step, compared after every step with the library's carried the same way."""
    (name,) = layer.functions
    ref_fn = reference(layer.name)[0]
    d = dict(ex.args)
    dev = lambda tree: {k: B.to_device(v.copy()) for k, v in tree.items()}        # noqa: E731
    params = dev(d["params"])
    zeros = {k: B.to_device(np.zeros_like(v)) for k, v in d["params"].items()}
    mine, ref = (params, dict(zeros), dict(zeros)), (dev(d["params"]), dict(zeros), dict(zeros))
    look, formula = _hints(layer, name)
    for t, (grads, lr) in enumerate(zip(d["grads"], d["lrs"]), start=1):
        g = dev(grads)
        res = _call(impl[name], name, "output", mine[0], g, mine[1], mine[2], t, lr, d["beta1"], d["beta2"],
                    d["eps"])
        ref = ref_fn(ref[0], dev(grads), ref[1], ref[2], t, lr, d["beta1"], d["beta2"], d["eps"])
        if not (isinstance(res, tuple) and len(res) == 3 and all(isinstance(x, dict) for x in res)):
            raise Failure("output", f"{name} returned a {_typename(res)}, expected (params, m, v), three dicts",
                          formula, look="return the new parameters and both moments, each a dict keyed like params")
        for what, got, want in zip(("the parameters", "m", "v"), res, ref):
            for k in want:
                if k not in got:
                    raise Failure("output", f"step {t}: {what} have no {k!r}", formula, look=look)
                try:
                    _compare("output", f"step {t} (lr {lr:g}): {what}[{k!r}]", got[k], want[k], FORWARD_TOL,
                             formula, look)
                except Failure as f:
                    if what == "the parameters" and t == 1:
                        f.symptom = f.symptom or ("already wrong at the first step, where the bias correction "
                                                  "matters most")
                    raise
        mine = res


CHECKS = {"pair": check_pair, "function": check_function, "loss": check_loss, "steps": check_steps}

#: A share of --examples for the checks whose examples cost most (a whole model's
#: central differences): a whole-model check stays under a minute.
EXAMPLE_SHARE = {"encoder_layer": 0.5, "decoder_layer": 0.5, "transformer": 0.25}

# ----------------------------------------------------------------------------- dropout, graded


class _MaskRNG:
    """A generator whose ``random`` reproduces a given keep-mask (1 where kept, 0 where
    dropped): the library's layer run with it drops exactly what the learner's did."""

    def __init__(self, keep):
        self.keep = keep

    def random(self, shape, dtype="float32"):
        return B.to_device(np.where(self.keep.reshape(shape), 1.0, 0.0).astype(dtype))


DROPOUT_DRAWS = 8          # forward calls with one generator


def check_dropout(layer: Layer, impl: dict, seed: int = 0) -> None:
    """Dropout of a layer that takes ``dropout``/``p`` and ``rng``: the identity at ``p = 0``
    and at inference (``rng=None``); over :data:`DROPOUT_DRAWS` calls with one seeded
    generator, kept units scaled by ``1/(1-p)``, the kept fraction ``1 - p`` within five
    standard deviations, a new mask at every call; the backward of the first call (after
    the others) equal to the library's backward with that call's mask."""
    fname, bname = layer.functions
    ref_f, ref_b = reference(layer.name)
    fwd, bwd = impl[fname], impl.get(bname)
    probe = DROPOUT_PROBES[layer.name]
    dev = lambda args: [B.to_device(a) if isinstance(a, np.ndarray) else a for a in args]      # noqa: E731
    base_args, shown = probe(0.0, None)
    base = B.to_host(ref_f(*dev(base_args))[0])                     # the output without dropout
    for p, rng, what in ((0.0, B.DeviceRNG(seed), "p = 0 with a generator"),
                         (0.5, None, "inference: p = 0.5 with rng=None")):
        args, shown = probe(p, rng)
        got = _call(fwd, fname, "dropout", *dev(args))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Failure("dropout", f"{fname} returned a {_typename(got)}, expected (out, cache)")
        try:
            _compare("dropout", f"the output ({what})", got[0], B.to_device(base), FORWARD_TOL, "",
                     "with p == 0, or rng None (evaluation), dropout must leave everything as it is")
        except Failure as f:
            f.setup = shown + [f"dropout: {what}"]
            raise
    p = 0.5
    rng = B.DeviceRNG(seed)
    outs, caches = [], []
    for _ in range(DROPOUT_DRAWS):
        args, shown = probe(p, rng)
        res = _call(fwd, fname, "dropout", *dev(args))
        if not (isinstance(res, tuple) and len(res) == 2):
            raise Failure("dropout", f"{fname} returned a {_typename(res)}, expected (out, cache)")
        outs.append(B.to_host(res[0]))
        caches.append(res[1])
    setup = shown + [f"p = {p}, one rng = attn.backend.DeviceRNG({seed}) for {DROPOUT_DRAWS} calls"]

    def fail(message, look, formula=""):
        f = Failure("dropout", message, formula, look=look)
        f.setup = setup
        return f

    if any(o.shape != base.shape for o in outs):
        raise fail(f"the output has shape {outs[0].shape}, expected {base.shape}", "dropout keeps the shape")
    kept = [o != 0 for o in outs]
    n = sum(k.size for k in kept)
    frac = sum(int(k.sum()) for k in kept) / n
    ratios = np.concatenate([o[k] / base[k] for o, k in zip(outs, kept)])
    if frac == 1.0:
        raise fail(f"no unit was dropped in {DROPOUT_DRAWS} calls with p = {p}: the dropout argument is ignored",
                   "with p > 0 and an rng, draw a mask from rng at every call (rng.random(shape) >= p) and "
                   "apply it", layer.hints.get("dropout", ""))
    if not np.allclose(ratios, 1 / (1 - p), rtol=1e-9, atol=0):
        raise fail(f"kept units are {float(np.median(ratios)):.6g} times their value without dropout, expected "
                   f"1/(1-p) = {1 / (1 - p):.6g}", "inverted dropout scales the kept units by 1/(1-p), so that "
                   "inference needs no rescale")
    sigma = math.sqrt(p * (1 - p) / n)
    if abs(frac - (1 - p)) > 5 * sigma:
        raise fail(f"a fraction {frac:.4f} of {n} units was kept over {DROPOUT_DRAWS} calls, expected "
                   f"{1 - p} (within {5 * sigma:.4f})", "p is the probability of dropping a unit: keep where "
                   "rng.random(shape) >= p")
    if all(np.array_equal(kept[0], k) for k in kept[1:]):
        raise fail(f"all {DROPOUT_DRAWS} calls with one generator dropped the same units",
                   "draw a new mask from rng at every call; never keep one between calls")
    if bwd is None:
        return
    args, shown = probe(p, rng)
    dout_host = B.host_rng(seed + 1).standard_normal(outs[0].shape)
    d = [_MaskRNG(kept[0]) if isinstance(a, B.DeviceRNG) else a for a in dev(args)]
    _, ref_cache = ref_f(*d)
    ref_grads = ref_b(B.to_device(dout_host), ref_cache)
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    grads = _call(bwd, bname, "dropout", B.to_device(dout_host.copy()), caches[0])
    grads = grads if isinstance(grads, tuple) else (grads,)
    names = [n for n, _ in _probe_wrt(layer)]
    for name, g, rg in zip(names, grads, ref_grads):
        try:
            _compare("dropout", f"d{name} of the first of {DROPOUT_DRAWS} calls", g, rg, GRADIENT_TOL,
                     layer.hints.get("dropout_backward", ""),
                     "the backward must use the mask its own forward drew, kept in that call's cache: not a "
                     "new draw, not the last call's mask")
        except Failure as f:
            f.setup = setup + ["backward: of the first call's cache, after all eight forwards"]
            raise


def _probe_wrt(layer: Layer):
    return {"dropout": [("x", 0)], "attention": [("q", 0), ("k", 1), ("v", 2)],
            "feed_forward": [(n, i) for i, n in enumerate(("x", "w1", "b1", "w2", "b2"))],
            "multi_head_attention": [(n, i) for i, n in enumerate(("x_q", "x_kv", "w_q", "b_q", "w_k", "b_k",
                                                                    "w_v", "b_v", "w_o", "b_o"))]}[layer.name]

# ----------------------------------------------------------------------------- grading a layer


class Result:
    """How one layer did: ``status`` is "pass", "fail", "todo" (not implemented yet) or
    "incomplete" (a forward without its backward). ``blame``: the function to fix."""

    def __init__(self, layer: str, status: str, seconds: float, examples: int, detail=None, note: str = "",
                 blame: str = "", also: str = "", functions=()):
        self.layer, self.status, self.seconds, self.examples = layer, status, seconds, examples
        self.detail, self.note, self.blame, self.also = detail, note, blame, also
        self.functions = tuple(functions)
        self.forward_first = False          # the forward failed and the backward waits for it


def _run(layer: Layer, sandbox: Sandbox, fn, examples: int):
    """Hypothesis over the layer's examples with ``fn(ex)``; returns (runs, the failure or None)."""
    count = [0]
    examples = max(1, round(examples * EXAMPLE_SHARE.get(layer.name, 1.0)))

    # A fixed seed, not derandomize (which seeds from this function's source): the same
    # examples for every file and every version of the grader.
    @settings(max_examples=examples, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, verbosity=Verbosity.quiet,
              phases=(Phase.explicit, Phase.generate, Phase.shrink))
    @seed(EXAMPLE_SEED)
    @given(layer.examples)
    def run(ex):
        count[0] += 1
        sandbox.reset()
        try:
            fn(ex)
        except Failure as e:
            e.example = ex
            raise
        except NotImplementedYet as e:          # nothing to shrink: stop at once
            raise _Todo(e) from None
        except Fatal as e:
            e.failure.example = ex
            raise

    try:
        run()
        return count[0], None
    except _Todo as e:
        return count[0], e.todo
    except (Failure, NotImplementedYet) as e:
        return count[0], e
    except Fatal as e:
        return count[0], e.failure
    except Flaky as e:
        inner = next((x for x in getattr(e, "exceptions", ()) if isinstance(x, (Failure, NotImplementedYet))), None)
        return count[0], inner or Failure("repeatability", "the same input gave different results on two calls",
                                          look="an unseeded random number, or state kept between calls (globals, "
                                               "attributes)")
    except Exception as e:      # a bug of attn-check's own: say so, without a traceback for the learner
        return count[0], Failure("attn-check", f"attn-check itself failed: {type(e).__name__}: {e}",
                                 look="not your code's fault: please report it with this file")


def _attach_outputs(layer: Layer, impl: dict, f: Failure, drop=()) -> None:
    """For the HTML report: the learner's output and the library's on the failing example,
    where the failure (an invariant, say) did not already compare them."""
    if f.arrays is not None or f.example is None or f.fatal:
        return
    try:
        ref_f = reference(layer.name)[0]
        want = B.to_host(ref_f(*_Args(f.example).call())[0])
        got = impl[layer.functions[0]](*_Args(f.example, drop=drop).call())
        got = B.to_host(got[0] if isinstance(got, tuple) else got)
        if got.shape == want.shape and want.dtype.kind == "f":
            f.arrays = (got, want)
            if not f.entries:
                f.entries = _entries(got, want)
            if f.error is None and not np.array_equal(got, want):
                f.error = rel_error(got, want)
            f.outputs_agree = not f.entries
    except (Exception, Fatal):
        pass


def grade(layer: Layer, impl: dict, sandbox: Sandbox, examples: int = DEFAULT_EXAMPLES, given_forward: bool = False,
          forward_only: bool = False, drop=()) -> Result:
    """Grade one layer: its forward first (every example), then its backward (against the
    library's if the forward passed, against central differences of the learner's own
    forward if not), then its dropout."""
    t0 = time.perf_counter()
    check = CHECKS[layer.kind]
    names = [n for n in layer.functions if n in impl and not (given_forward and n == layer.functions[0])]

    def result(status, runs, detail=None, note="", blame="", also=""):
        return Result(layer.name, status, time.perf_counter() - t0, runs, detail, note, blame, also, names)

    note = ""
    if drop:
        note = (f"dropout not graded: {layer.functions[0]} takes no dropout argument (lesson 12 teaches it; add "
                "`dropout=0.0, rng=None` then)")
    if layer.kind != "pair":
        runs, err = _run(layer, sandbox, lambda ex: check(layer, impl, ex), examples)
        if err is None:
            return result("pass", runs, note=note)
        if isinstance(err, NotImplementedYet):
            return result("todo", runs, err, note)
        return result("fail", runs, err, note, blame=layer.functions[0])
    fname, bname = layer.functions
    has_bwd = bname in impl
    runs = 0
    forward_failure = None
    if not given_forward:
        n, err = _run(layer, sandbox, lambda ex: check_pair(layer, impl, ex, "forward", drop), examples)
        runs += n
        if isinstance(err, NotImplementedYet):
            return result("todo", runs, err, note)
        if err is not None:
            forward_failure = err
            err.blame = fname
    if forward_failure is not None and forward_failure.check == "attn-check":
        return result("fail", runs, forward_failure, note)
    if forward_failure is not None:
        _attach_outputs(layer, impl, forward_failure, drop)
        also = ""
        if has_bwd and forward_failure.check != "integrity" and not forward_failure.message.startswith(fname + " "):
            n, err = _run(layer, sandbox, lambda ex: check_pair(layer, impl, ex, "self", drop), examples)
            runs += n
            if isinstance(err, NotImplementedYet):
                also = f"{bname}: not implemented yet"
            elif err is None:
                also = (f"{bname} agrees with central differences of your own forward (it was not compared with "
                        "the library's, whose forward differs from yours): fix the forward, then run this again")
            else:
                also = (f"{bname} also disagrees with central differences of your own forward: {err.message}"
                        + (f" (relative error {err.error:.3g})" if err.error is not None else ""))
        r = result("fail", runs, forward_failure, note, blame=fname, also=also)
        r.forward_first = has_bwd and forward_failure.check != "integrity"
        return r
    if not has_bwd:
        n = f"forward only: {bname} is not defined, gradients not checked"
        if forward_only:
            return result("pass", runs, note="; ".join(x for x in (n, note) if x))
        return result("incomplete", runs, note="; ".join(x for x in (n + " (--forward-only accepts that)", note)
                                                          if x))
    n, err = _run(layer, sandbox, lambda ex: check_pair(layer, impl, ex, "backward", drop), examples)
    runs += n
    if isinstance(err, NotImplementedYet):
        return result("todo", runs, err, note)
    if err is not None:
        blame = fname if err.check in ("forward", "float32") else bname
        err.blame = blame
        return result("fail", runs, err, note, blame=blame)
    if layer.name in DROPOUT_PROBES and not drop:
        sandbox.reset()
        try:
            check_dropout(layer, impl)
        except Fatal as e:
            e.failure.blame = fname
            return result("fail", runs, e.failure, note, blame=fname)
        except NotImplementedYet as e:
            return result("todo", runs, e, note)
        except Failure as f:
            blame = bname if "backward" in f.look or f.message.startswith("d") else fname
            f.blame = blame
            return result("fail", runs, f, note, blame=blame)
        runs += DROPOUT_DRAWS + 3
    if given_forward:
        note = "; ".join(x for x in (f"{fname} is the library's, as the exercise gives it: {bname} graded", note) if x)
    return result("pass", runs, note=note)

# ----------------------------------------------------------------------------- the report


def _describe(v) -> str:
    if isinstance(v, np.ndarray):
        s = f"{v.shape} {v.dtype}"
        if v.size <= 12:
            s += "  " + np.array2string(v, precision=4, separator=", ", max_line_width=10**6).replace("\n", "")
        return s
    if isinstance(v, Fresh):
        return f"attn.backend.DeviceRNG({v.seed}), the same mask on every call"
    if isinstance(v, Built):
        return f"attn.solutions.{v.function}{v.args if len(v.args) != 1 else '(' + repr(v.args[0]) + ')'}"
    if type(v) is list and v and not isinstance(v[0], (int, float, str)):
        return f"a list of {len(v)}: [{_describe(v[0])}" + (", ...]" if len(v) > 1 else "]")
    if type(v) is dict:
        return "{" + ", ".join(f"{k}: {_describe(x)}" for k, x in list(v.items())[:3]) + (
            f", ... ({len(v)} entries)}}" if len(v) > 3 else "}")
    return repr(v)


def _fmt(x) -> str:
    return f"{x:.6g}" if isinstance(x, (float, np.floating)) else str(x)


LABELS = {"pass": "PASS", "fail": "FAIL", "todo": "not implemented yet", "incomplete": "INCOMPLETE"}


def failure_lines(r: Result, hint_level: int = 1) -> list[str]:
    """The indented lines under a layer's status line."""
    lines = []
    if r.note:
        lines.append(f"note: {r.note}")
    if r.status == "todo":
        lines.append(f"{r.detail.function} raises NotImplementedError: write its body, then run this again")
        return lines
    if r.status != "fail":
        return lines
    f: Failure = r.detail
    if r.blame:
        fix = f"fix {r.blame}"
        if r.forward_first:
            fix += " first: the forward is wrong, and a backward is only graded against the library's once its " \
                   "forward is right"
        lines.append(f"blame:    {fix}")
    lines.append(f"check:    {f.check}: {f.message}")
    if f.where:
        lines.append(f"where:    {f.where}")
    setup = getattr(f, "setup", None)
    if setup:
        lines.append("example:  " + setup[0])
        lines += [" " * 10 + s for s in setup[1:]]
    elif f.example is not None:
        lines.append("example:  the smallest hypothesis found" + (" (the call that ended the process)"
                                                                 if f.fatal else ""))
        for name, v in f.example.args:
            if not name.startswith("_"):
                lines.append(f"              {name} = {_describe(v)}")
        if f.check == "backward" or (f.check == "invariant" and r.blame != r.functions[0]):
            lines.append(f"              dout = standard normal of the output's shape, attn.backend.host_rng("
                         f"{f.example.seed})")
    if f.error is not None:
        lines.append(f"error:    relative error {f.error:.3g}" + (f" (tolerance {f.tol:g})" if f.tol else ""))
    if getattr(f, "outputs_agree", False):
        lines.append("output:   yours equals the library's on these inputs: only the inputs the invariant "
                     "describes show the bug")
    if f.entries:
        if f.check == "invariant":
            lines.append("output:   yours and the library's on this example")
        lines.append(f"entries:  {'index':<14} {'yours':>14} {'expected':>14}")
        for idx, a, b in f.entries:
            lines.append(f"          {str(idx):<14} {_fmt(a):>14} {_fmt(b):>14}")
    if f.symptom:
        lines.append(f"looks like: {f.symptom}")
    if hint_level >= 2 and f.look:
        lines.append(f"look at:  {f.look}")
    if hint_level >= 3 and f.hint:
        lines.append(f"formula:  {f.hint}")
    if hint_level < 3 and (f.look if hint_level < 2 else f.hint):
        lines.append(f"hint:     attn-check --hint {hint_level + 1} says "
                     + ("where to look" if hint_level < 2 else "the formula"))
    if r.also:
        lines.append(f"backward: {r.also}")
    return lines


def report(r: Result, out=sys.stdout, hint_level: int = 1) -> None:
    w = out.write
    runs = ("not run" if not r.examples else
            f"{r.examples} run{'s' * (r.examples != 1)}" + (", shrinking included" if r.status == "fail" else ""))
    w(f"{r.layer:<22} {LABELS[r.status]:<6} {r.seconds:6.2f} s  ({runs})\n")
    for line in failure_lines(r, hint_level):
        w(f"    {line}\n")


def summary(results: list[Result]) -> str:
    passed = sum(r.status == "pass" for r in results)
    todo = sum(r.status == "todo" for r in results)
    incomplete = sum(r.status == "incomplete" for r in results)
    failed = len(results) - passed - todo - incomplete
    total = sum(r.seconds for r in results)
    return (f"{passed} of {len(results)} passed" + (f", {todo} not implemented yet" if todo else "")
            + (f", {incomplete} incomplete" if incomplete else "") + (f", {failed} failed" if failed else "")
            + f" ({total:.1f} s)")

# ----------------------------------------------------------------------------- grading a file


class FileReport:
    """Everything about one file: ``status`` is the exit status (0 all passed, 1 a layer did
    not, 2 nothing could be graded), ``error`` why nothing could be."""

    def __init__(self, path: Path):
        self.path, self.results, self.status, self.error, self.header = path, [], 2, "", ""
        self.backend, self.examples, self.hint = B.get_backend(), DEFAULT_EXAMPLES, 1


def _layer_table() -> str:
    return "\n".join(f"  {n:<22} {', '.join(layer.functions)}" for n, layer in LAYERS.items())


def _reexport(layer: Layer, name: str, origin: dict) -> Result:
    f = Failure("integrity", f"{name} is the library's own ({origin['defined']}), re-exported: attn-check grades "
                             "your code", look="write the body yourself; import the library as a module (from attn "
                             "import layers as L) only to call its other layers")
    return Result(layer.name, "fail", 0.0, 0, f, blame=name, functions=(name,))


def grade_file(path: Path, layers=None, examples: int = DEFAULT_EXAMPLES, timeout: float = DEFAULT_TIMEOUT,
               forward_only: bool = False, allow_library: bool = False, out=None, hint_level: int = 1) -> FileReport:
    """Grade every layer ``path`` defines (or those named in ``layers``), printing the text
    report to ``out`` as it goes."""
    rep = FileReport(path)
    rep.examples, rep.hint = examples, hint_level
    w = (out.write if out is not None else (lambda s: None))
    sandbox = Sandbox(path, timeout, allow_library)
    try:
        try:
            found = sandbox.start()
        except LoadError as e:
            rep.error = f"could not import {path}: {e}" + (f"\n    where: {e.where}" if e.where else "")
            return rep
        except Fatal as e:
            rep.error = f"could not import {path}: {e.failure.message}" + (
                f"\n    where: {e.failure.where}" if e.failure.where else "")
            return rep
        plan, imported = [], []
        for name, layer in LAYERS.items():
            present = [n for n in layer.functions if n in found]
            if not present or (layers and name not in layers):
                continue
            lib = [n for n in present if found[n]["library"] and not allow_library]
            if layer.kind != "pair":
                plan.append((layer, _reexport(layer, present[0], found[present[0]]) if lib else
                             {present[0]: Remote(sandbox, present[0])}, False, ()))
                continue
            fname, bname = layer.functions
            if bname in lib:
                plan.append((layer, _reexport(layer, bname, found[bname]), False, ()))
            elif bname in present:
                given_fwd = fname not in present or fname in lib
                impl = {fname: Remote(sandbox, fname, given=given_fwd), bname: Remote(sandbox, bname)}
                plan.append((layer, impl, given_fwd, _deferred(layer, found.get(fname), given_fwd)))
            elif fname in lib:
                imported.append(fname)
            else:
                plan.append((layer, {fname: Remote(sandbox, fname)}, False, _deferred(layer, found[fname], False)))
        if layers:
            missing = [n for n in layers if n not in {layer.name for layer, *_ in plan}]
            if missing:
                rep.error = (f"{path} defines no function of {', '.join(missing)} (looked for "
                             + "; ".join(", ".join(LAYERS[n].functions) for n in missing) + ")")
                return rep
        if not plan:
            rep.error = f"{path} defines no gradable function"
            if imported:
                rep.error += (f": {', '.join(imported)} {'is' if len(imported) == 1 else 'are'} the library's own, "
                              "imported, not written here")
            rep.error += f". Names it looks for:\n{_layer_table()}"
            return rep
        rep.header = (f"attn-check {path}: {len(plan)} layer{'s' * (len(plan) != 1)}, {examples} examples each, "
                      f"backend {B.get_backend()}" + (", the library's own functions allowed" if allow_library else ""))
        w(rep.header + "\n")
        for layer, impl, given_fwd, drop in plan:
            if isinstance(impl, Result):
                r = impl
            else:
                r = grade(layer, impl, sandbox, examples, given_fwd, forward_only, drop)
            if out is not None:
                report(r, out, hint_level)
                out.flush()
            rep.results.append(r)
        w(summary(rep.results) + "\n")
        rep.status = 0 if all(r.status == "pass" for r in rep.results) else 1
        return rep
    finally:
        sandbox.cleanup()


def _deferred(layer: Layer, origin: dict | None, given_fwd: bool) -> tuple:
    """("dropout", "rng") when the learner's forward takes no dropout argument although the
    library's does (the starters before lesson 12 leave it out); () otherwise."""
    if given_fwd or origin is None or layer.name not in DROPOUT_PROBES or layer.name == "dropout":
        return ()
    params = origin.get("params") or []
    return () if "dropout" in params or not params else ("dropout", "rng")

# ----------------------------------------------------------------------------- reports for teachers


def _jsonable(v):
    if isinstance(v, (np.generic,)):
        return v.item()
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


def result_dict(r: Result, hint_level: int = 3) -> dict:
    d = {"layer": r.layer, "status": r.status, "seconds": round(r.seconds, 3), "runs": r.examples,
         "functions": list(r.functions), "note": r.note, "blame": r.blame, "backward": r.also}
    f = r.detail
    if r.status == "todo":
        d["failure"] = {"check": "not implemented yet", "message": f"{f.function} raises NotImplementedError"}
    elif isinstance(f, Failure):
        d["failure"] = {
            "check": f.check, "message": f.message, "where": f.where, "error": f.error, "tolerance": f.tol,
            "entries": [{"index": list(i), "yours": _jsonable(a), "expected": _jsonable(b)} for i, a, b in f.entries],
            "looks_like": f.symptom, "look_at": f.look, "formula": f.hint,
            "example": ({n: _describe(v) for n, v in f.example.args if not n.startswith("_")}
                        if f.example is not None and not getattr(f, "setup", None) else None),
            "setup": getattr(f, "setup", None)}
    return d


def write_json(reports: list[FileReport], path: Path) -> None:
    files = [{"file": str(rep.path), "exit_status": rep.status, "error": rep.error, "backend": rep.backend,
              "examples": rep.examples, "layers": [result_dict(r) for r in rep.results]} for rep in reports]
    Path(path).write_text(json.dumps(files[0] if len(files) == 1 else files, indent=2) + "\n", encoding="utf-8")


def write_junit(reports: list[FileReport], path: Path) -> None:
    q = html.escape
    parts = ['<?xml version="1.0" encoding="UTF-8"?>', "<testsuites>"]
    for rep in reports:
        cases = rep.results or []
        failures = sum(r.status != "pass" for r in cases) + (1 if rep.error else 0)
        parts.append(f'  <testsuite name="{q(str(rep.path))}" tests="{max(len(cases), 1)}" failures="{failures}" '
                     f'time="{sum(r.seconds for r in cases):.3f}">')
        if rep.error:
            parts.append(f'    <testcase classname="attn-check" name="{q(rep.path.name)}"><failure message="'
                         f'{q(rep.error.splitlines()[0])}">{q(rep.error)}</failure></testcase>')
        for r in cases:
            parts.append(f'    <testcase classname="attn-check.{q(rep.path.stem)}" name="{q(r.layer)}" '
                         f'time="{r.seconds:.3f}">')
            if r.status != "pass":
                text = "\n".join(failure_lines(r, rep.hint))
                msg = {"todo": "not implemented yet", "incomplete": "incomplete"}.get(
                    r.status, r.detail.message if isinstance(r.detail, Failure) else r.status)
                parts.append(f'      <failure type="{r.status}" message="{q(msg)}">{q(text)}</failure>')
            elif r.note:
                parts.append(f"      <system-out>{q(r.note)}</system-out>")
            parts.append("    </testcase>")
        parts.append("  </testsuite>")
    parts.append("</testsuites>")
    Path(path).write_text("\n".join(parts) + "\n", encoding="utf-8")


def write_gradescope(reports: list[FileReport], path: Path) -> None:
    """Gradescope's ``results.json``: one test per layer, worth one point, passed or not."""
    tests, output = [], []
    for rep in reports:
        if rep.error:
            tests.append({"name": rep.path.name, "score": 0, "max_score": 1, "status": "failed",
                          "output": rep.error})
        for r in rep.results:
            text = "\n".join([f"{r.layer}: {LABELS[r.status]}"] + failure_lines(r, rep.hint))
            tests.append({"name": f"{rep.path.stem}: {r.layer}", "score": 1 if r.status == "pass" else 0,
                          "max_score": 1, "status": "passed" if r.status == "pass" else "failed", "output": text})
        output.append(rep.header or rep.error.splitlines()[0])
    Path(path).write_text(json.dumps({"score": sum(t["score"] for t in tests),
                                      "max_score": sum(t["max_score"] for t in tests),
                                      "output": "\n".join(output), "tests": tests}, indent=2) + "\n",
                          encoding="utf-8")


def _heatmaps(f: Failure, png: Path) -> bool:
    """Yours, expected and their difference, side by side, as one PNG. False without matplotlib."""
    if f.arrays is None:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    yours, want = (np.asarray(a, dtype=np.float64) for a in f.arrays)
    grid = lambda a: a.reshape(1, -1) if a.ndim < 2 else a.reshape(-1, a.shape[-1])     # noqa: E731
    panels = [("yours", grid(yours)), ("expected", grid(want)), ("yours - expected", grid(yours - want))]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    lo, hi = float(min(yours.min(), want.min())), float(max(yours.max(), want.max()))
    d = float(np.abs(yours - want).max()) or 1.0
    for ax, (title, a) in zip(axes, panels):
        diff = "-" in title               # one scale for yours and expected; the difference centred on 0
        im = ax.imshow(a, cmap="RdBu_r" if diff else "viridis", vmin=-d if diff else lo, vmax=d if diff else hi,
                       aspect="auto", interpolation="nearest")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_title(title)
        ax.set_xlabel("last axis")
        ax.set_ylabel("rows (leading axes flattened)")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def write_html(reports: list[FileReport], folder: Path) -> Path:
    """``index.html`` in ``folder``: a table of every layer, and for each failure its report
    beside heatmaps of the learner's output, the expected output and their difference."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    q = html.escape
    body = ["<!doctype html><meta charset='utf-8'><title>attn-check report</title>",
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:left}"
            ".pass{color:#070}.fail,.incomplete{color:#b00}.todo{color:#777}pre{background:#f6f6f6;padding:8px}"
            ".case{display:flex;gap:1em;align-items:flex-start}</style>", "<h1>attn-check report</h1>"]
    for k, rep in enumerate(reports):
        body.append(f"<h2>{q(str(rep.path))}</h2>")
        if rep.error:
            body.append(f"<pre class='fail'>{q(rep.error)}</pre>")
            continue
        body.append(f"<p>{q(rep.header)}</p><table><tr><th>layer</th><th>status</th><th>seconds</th>"
                    "<th>blame</th></tr>")
        for r in rep.results:
            body.append(f"<tr><td><a href='#f{k}-{q(r.layer)}'>{q(r.layer)}</a></td><td class='{r.status}'>"
                        f"{q(LABELS[r.status])}</td><td>{r.seconds:.2f}</td><td>{q(r.blame)}</td></tr>")
        body.append("</table>")
        for r in rep.results:
            if r.status == "pass":
                continue
            body.append(f"<h3 id='f{k}-{q(r.layer)}'>{q(r.layer)}: {q(LABELS[r.status])}</h3>")
            text = "\n".join(failure_lines(r, 3))
            img = ""
            if isinstance(r.detail, Failure):
                png = folder / f"{k:02d}-{rep.path.stem}-{r.layer}.png"
                if _heatmaps(r.detail, png):
                    img = f"<img src='{q(png.name)}' alt='yours, expected, difference'>"
            body.append(f"<div class='case'><pre>{q(text)}</pre>{img}</div>")
    index = folder / "index.html"
    index.write_text("\n".join(body) + "\n", encoding="utf-8")
    return index

# ----------------------------------------------------------------------------- command line


def _all(folder: Path, args, out) -> tuple[int, list[FileReport]]:
    """Grade every exercise file of ``folder``; print a table of what is done."""
    files = sorted(p for p in Path(folder).glob("*.py") if not p.name.startswith("_"))
    if not files:
        out.write(f"attn-check: {folder} holds no .py file\n")
        return 2, []
    reports = []
    progress = sys.stderr.isatty()
    for i, p in enumerate(files, start=1):
        if progress:
            sys.stderr.write(f"\rattn-check --all: {i}/{len(files)} {p.name[:40]:<40}")
            sys.stderr.flush()
        reports.append(grade_file(p, None, args.examples, args.timeout, args.forward_only, args.allow_library,
                                  None, args.hint))
    if progress:
        sys.stderr.write("\r" + " " * 70 + "\r")
    out.write(f"attn-check --all {folder}: {len(files)} file{'s' * (len(files) != 1)}, {args.examples} examples "
              "per layer\n")
    out.write(f"{'exercise':<34} {'state':<16} {'passed':>7}  not yet done\n")
    done = 0
    for rep in reports:
        rs = rep.results
        passed = sum(r.status == "pass" for r in rs)
        if rep.error:
            state, detail = "cannot grade", rep.error.splitlines()[0][:60]
        elif passed == len(rs):
            state, detail = "done", ""
            done += 1
        elif all(r.status == "todo" for r in rs):
            state, detail = "not started", ""
        else:
            state = "in progress" if not any(r.status == "fail" for r in rs) else "failing"
            detail = ", ".join(f"{r.layer} (fix {r.blame})" if r.status == "fail" and r.blame else
                               f"{r.layer} ({LABELS[r.status].lower()})" for r in rs if r.status != "pass")
        out.write(f"{rep.path.name:<34} {state:<16} {passed:>3}/{len(rs):<3}  {detail}\n")
    out.write(f"{done} of {len(files)} exercises done\n")
    return (0 if done == len(files) else 1), reports


def timings(examples: int, out) -> int:
    """Grade the library's own functions (every layer) and print each check's seconds."""
    from . import solutions
    rep = grade_file(Path(solutions.__file__), None, examples, DEFAULT_TIMEOUT, False, True, None)
    if rep.error:
        out.write(f"attn-check: {rep.error}\n")
        return 2
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out.write(f"seconds per check at {examples} examples (the library's own functions, backend "
              f"{B.get_backend()}, {os.cpu_count()} CPU cores visible, load average {load:.1f} at the end: "
              "a loaded machine is slower)\n")
    for r in rep.results:
        out.write(f"  {r.layer:<22} {r.seconds:7.2f} s  {LABELS[r.status]}\n")
    out.write(f"  {'total':<22} {sum(r.seconds for r in rep.results):7.2f} s\n")
    return rep.status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attn-check", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Grade your own layers against attn's: the same hypothesis examples, gradient checks "
                    "and invariants that prove the library's layers.",
        epilog=(
            "Write the functions of a layer in PATH.py under the library's names (start from a file in\n"
            "lessons/exercises/), then run `attn-check PATH.py`. Only the layers the file defines are checked.\n"
            "Your file runs in a child process, each call under a time limit: a call that hangs, exits,\n"
            "crashes or floods its output fails, naming the function. For each layer, hypothesis draws\n"
            "examples (hard ones included: logits of 1e4, fully masked rows, repeated ids, padding); the\n"
            "forward is graded first on all of them (exceptions, NaN, shapes, dtypes, inputs modified in\n"
            "place, invariants, the library's output); then the backward, against the library's and against\n"
            "float64 central differences of your forward. If the forward is wrong, the report blames it, and\n"
            "the backward is only checked against central differences of your own forward. Layers with\n"
            "dropout are graded over many draws: the kept fraction, the 1/(1-p) scale, the backward's mask.\n"
            "A failure shows the smallest failing example, the check, the relative error, the first entries\n"
            "that differ and what the difference looks like; --hint 2 adds where to look, --hint 3 the\n"
            "formula. A function that still raises NotImplementedError is 'not implemented yet'. A forward\n"
            "without its backward is INCOMPLETE unless --forward-only. The library's own functions,\n"
            "re-exported, fail; a forward an exercise gives (exercise 8 imports the library's) is used, not\n"
            "graded.\n\n"
            "For teachers: --json, --junit, --gradescope (results.json, a point per layer) and --html DIR\n"
            "write reports; --all DIR grades every file of a folder and prints which exercises are done.\n\n"
            "Exit status: 0 when every graded layer passes, 1 when one fails, is incomplete or not\n"
            "implemented yet, 2 when the file cannot be loaded or defines nothing gradable.\n\n"
            "Layers and the names attn-check looks for:\n" + _layer_table()))
    p.add_argument("path", type=Path, nargs="?", help="your Python file, e.g. lessons/exercises/05_masks.py")
    p.add_argument("--all", type=Path, metavar="DIR", help="grade every .py file in DIR and print a table of "
                   "which exercises are done")
    p.add_argument("--layer", action="append", choices=list(LAYERS), metavar="NAME",
                   help="check only this layer (repeatable); default: every layer the file defines")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, metavar="N",
                   help=f"hypothesis examples per layer (default {DEFAULT_EXAMPLES}; more finds rarer bugs, slower)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds one call of your function may take (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--hint", type=int, choices=(1, 2, 3), default=1,
                   help="how much a failure tells: 1 the symptom (default), 2 where to look, 3 the formula")
    p.add_argument("--forward-only", action="store_true",
                   help="accept a forward without its backward as complete")
    p.add_argument("--allow-library", action="store_true",
                   help="accept the library's own functions (checks attn-check itself on tests/solutions.py)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    p.add_argument("--junit", type=Path, metavar="FILE", help="also write a JUnit XML report (one test per layer)")
    p.add_argument("--gradescope", type=Path, metavar="FILE",
                   help="also write Gradescope's results.json (one point per layer)")
    p.add_argument("--html", type=Path, metavar="DIR", help="also write an HTML report with heatmaps of each "
                   "failure (yours, expected, difference) into DIR")
    p.add_argument("--timings", action="store_true", help="print the seconds each check takes on the library's "
                   "own functions at --examples, and exit")
    p.add_argument("--backend", choices=["numpy", "cupy"], default="numpy",
                   help="array backend to run on (default numpy; cupy needs a GPU)")
    return p


def main(argv=None, out=None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    if args.examples < 1:
        out.write("attn-check: --examples must be at least 1\n")
        return 2
    if not args.timeout > 0:
        out.write("attn-check: --timeout must be positive\n")
        return 2
    try:
        B.set_backend(args.backend)
    except B.BackendError as e:
        out.write(f"attn-check: {e}\n")
        return 2
    if args.timings:
        return timings(args.examples, out)
    if args.all is not None:
        if not args.all.is_dir():
            out.write(f"attn-check: {args.all}: no such folder\n")
            return 2
        status, reports = _all(args.all, args, out)
    else:
        if args.path is None:
            out.write("attn-check: give a file to grade (or --all DIR); --help explains\n")
            return 2
        if not args.path.is_file():
            out.write(f"attn-check: {args.path}: no such file\n")
            return 2
        rep = grade_file(args.path, args.layer, args.examples, args.timeout, args.forward_only, args.allow_library,
                         out, args.hint)
        if rep.error:
            out.write(f"attn-check: {rep.error}\n")
        status, reports = rep.status, [rep]
    if args.json:
        write_json(reports, args.json)
    if args.junit:
        write_junit(reports, args.junit)
    if args.gradescope:
        write_gradescope(reports, args.gradescope)
    if args.html:
        write_html(reports, args.html)
    return status


def console() -> int:
    """The command: :func:`main`, quiet when its output is piped into a command that stops
    reading (``attn-check FILE | head``)."""
    try:
        return main()
    except BrokenPipeError:
        sys.stderr.close()
        return 1


if __name__ == "__main__":
    sys.exit(console())

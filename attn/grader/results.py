"""What every part of the grader shares: its settings (examples, tolerances, time
limits), the failures a check raises, and the records of how a layer and a file did."""
from __future__ import annotations

import hashlib
from pathlib import Path

from .. import backend as B
from ..testing import Example

DEFAULT_EXAMPLES = 20
EXAMPLE_SEED = 20170612     # hypothesis' seed: the same examples on every run (the paper's arXiv date)
DEFAULT_TIMEOUT = 10.0      # seconds per call: a correct layer on these sizes takes milliseconds
MAX_OUTPUT = 200_000        # bytes a file may print over one call
FLOAT32_TOL = 1e-4          # relative error of a float32 output against the library's float32 one
FORWARD_TOL = 1e-8          # relative error of an output against the library's (float64)
GRADIENT_TOL = 1e-6         # relative error of a gradient against the library's or central differences
NOISE_FLOOR = 1e-8         # absolute difference from central differences that is rounding, not a bug
SPOT_CHECK = 24             # entries per input where central differences are taken (all of a smaller input)


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
        self.ambiguous = False          # the example fits more than one typical mistake
        self.explicit = False           # the example is one of the layer's explicit examples, not shrunk


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


class Result:
    """How one layer did: ``status`` is "pass", "fail", "todo" (not implemented yet) or
    "incomplete" (a forward without its backward). ``blame``: the function to fix."""

    def __init__(self, layer: str, status: str, seconds: float, examples: int, detail=None, note: str = "",
                 blame: str = "", also: str = "", functions=()):
        self.layer, self.status, self.seconds, self.examples = layer, status, seconds, examples
        self.detail, self.note, self.blame, self.also = detail, note, blame, also
        self.functions = tuple(functions)
        self.forward_first = False          # the forward failed and the backward waits for it
        self.part = ""                      # a part of this composite failed first


class FileReport:
    """Everything about one file: ``status`` is the exit status (0 all passed, 1 a layer did
    not, 2 nothing could be graded), ``error`` why nothing could be."""

    def __init__(self, path: Path):
        self.path, self.results, self.status, self.error, self.header = path, [], 2, "", ""
        self.backend, self.examples, self.hint = B.get_backend(), DEFAULT_EXAMPLES, 1
        self.exercise, self.sandbox, self.seed, self.sha256 = "", "", None, ""


def plain(text: str, indent: str = "    | ") -> str:
    """Text that may hold a learner's (an exception's message, a line of their file) made safe
    to print among the grader's lines: control characters shown as escapes (no terminal
    sequences, no carriage return), every line after the first indented under ``indent``, so
    that nothing a learner writes can stand as a line of the grader's own."""
    lines = str(text).replace("\r\n", "\n").split("\n")
    clean = ["".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in ln) for ln in lines]
    return ("\n" + indent).join(clean)


def grader_version() -> str:
    """The package's version and a digest of the grader's own source."""
    try:
        from importlib.metadata import version
        v = version("attn")
    except Exception:
        v = "unknown"
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.read_bytes())
    return f"{v}+{h.hexdigest()[:12]}"

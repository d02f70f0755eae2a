"""The other side of ``attn-check``: the child process that runs a learner's code.

:mod:`attn.grader` never imports a learner's file. It starts this module in a child
process (``python -c "from attn.grader.child import main; main()"``) and asks it, over a pipe, to call one function
at a time; everything the grader decides (hypothesis' examples, the library's results,
every comparison) stays in the grader's process, where nothing the learner writes can
reach it. What the learner's code can do is confined to this process: loop forever (the
grader kills it after its time limit), exit or crash the interpreter (the grader sees
the process end), print without end (its output goes to a file whose size the grader
watches), raise anything (``SystemExit`` and ``KeyboardInterrupt`` included: reported
as what the function did).

The protocol (:class:`multiprocessing.connection.Connection` messages, pickled):

``("call", name, args, given)``
    call the learner's ``name`` (or, with ``given``, the library's own: a forward an
    exercise provides) on ``args``. Arrays travel as :class:`Arr` (host copies, moved to
    the selected backend here); random generators as :class:`Rng` (one generator per id
    for the example, so repeated calls continue its stream); anything else the learner
    returns that is not an array, a number, a string, None or a plain tuple / list /
    dict of those stays here and travels as a :class:`Handle`.
``("reset",)``
    forget the handles and generators of the last example.

Answers: ``("ok", result, modified, twin)`` (``modified``: index -> new value of each
array argument the call changed in place; ``twin``: the library function the call ran
that it may not, its own namesake or :data:`TWINS`), ``("raised", kind, message, where, raiser)`` or
``("todo", raiser)`` (the body still raises ``NotImplementedError``).
"""
from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import inspect
import os
import re
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

from .. import backend as B

np = B.host

#: Where the library's own implementation of each gradable name lives ("module:function").
#: attn-check compares the learner's functions with these, and refuses them re-exported.
LIBRARY = {n: f"attn.layers:{n}" for n in (
    "linear_forward", "linear_backward", "relu_forward", "relu_backward", "dropout_forward",
    "dropout_backward", "embedding_forward", "embedding_backward", "positional_forward",
    "positional_backward", "sinusoidal_table", "softmax_forward", "softmax_backward",
    "layer_norm_forward", "layer_norm_backward", "feed_forward_forward", "feed_forward_backward",
    "residual_ffn_forward", "residual_ffn_backward", "attention_forward", "attention_backward",
    "split_heads", "merge_heads", "multi_head_attention_forward", "multi_head_attention_backward",
    "rnn_step_forward", "rnn_step_backward", "rnn_forward", "rnn_backward")}
LIBRARY.update({"cross_entropy": "attn.loss:cross_entropy", "causal_mask": "attn.masks:causal_mask",
                "padding_mask": "attn.masks:padding_mask", "decoder_mask": "attn.masks:decoder_mask"})
LIBRARY.update({n: f"attn.grader.solutions:{n}" for n in (
    "luong_attention_forward", "luong_attention_backward", "encoder_layer_forward", "encoder_layer_backward",
    "decoder_layer_forward", "decoder_layer_backward", "transformer_forward", "transformer_backward",
    "adam_step", "greedy_decode", "beam_search", "average_checkpoints", "learn_merges", "decoding_model")})
LIBRARY["noam_lr"] = "attn.optim:noam_lr"
#: Names the grader builds arguments with (``given`` calls), never looked for in a learner's file.
GIVEN_ONLY = {"decoding_model"}


#: Besides its own name, the library code an exercise's function may not call: the larger
#: thing attn.grader.solutions builds that exercise's answer from.
TWINS = {
    "encoder_layer_forward": ("attn.model:Transformer._residual_fwd", "attn.model:Transformer.encode"),
    "encoder_layer_backward": ("attn.model:Transformer._residual_bwd", "attn.model:Transformer.backward"),
    "decoder_layer_forward": ("attn.model:Transformer._residual_fwd", "attn.model:Transformer.decode"),
    "decoder_layer_backward": ("attn.model:Transformer._residual_bwd", "attn.model:Transformer.backward"),
    "transformer_forward": ("attn.model:Transformer.forward", "attn.model:Transformer.encode"),
    "transformer_backward": ("attn.model:Transformer.backward",),
    "adam_step": ("attn.optim:Adam.step",),
    "greedy_decode": ("attn.decode:greedy_decode",),
    "beam_search": ("attn.decode:beam_search",),
    "learn_merges": ("attn.bpe:learn_merges",),
}


def _resolve(spec: str):
    module, attr = spec.split(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def twin_codes(name: str) -> dict:
    """code object -> "module.function" of the library code ``name`` may not call."""
    out = {}
    for spec in (LIBRARY[name],) + TWINS.get(name, ()):
        code = getattr(_resolve(spec), "__code__", None)
        if code is not None:
            out[code] = spec.replace(":", ".")
    return out


def library_function(name: str):
    """The library's own function called ``name`` (the solution attn-check grades against)."""
    module, attr = LIBRARY[name].split(":")
    return getattr(importlib.import_module(module), attr)


class Arr(NamedTuple):
    """An array in transit: its host copy, and whether it lives on the device."""
    host: object
    device: bool


class Rng(NamedTuple):
    """A random generator in transit: ``attn.backend.DeviceRNG(seed)``, one per ``uid``."""
    seed: int
    uid: int


class Handle(NamedTuple):
    """An object that stays in the child (a cache, a generator the learner returned)."""
    uid: int
    type_name: str

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


class XpRef(NamedTuple):
    """The selected backend's array namespace."""


_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim") and not isinstance(a, type)


def where(tb, learner_file: str) -> str:
    """'file:line in function: source' of the innermost frame in the learner's file."""
    if not learner_file:
        return ""
    target = Path(learner_file).resolve()
    frames = [f for f in traceback.extract_tb(tb) if Path(f.filename).resolve() == target]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


class _Child:
    def __init__(self, path: str, reference: bool):
        self.path, self.reference = path, reference
        self.module = None
        self.handles: dict[int, object] = {}
        self.rngs: dict[int, object] = {}

    # -- transit

    def unpack(self, v):
        if isinstance(v, Arr):
            return B.to_device(v.host.copy()) if v.device else v.host.copy()
        if isinstance(v, Rng):
            if v.uid not in self.rngs:
                self.rngs[v.uid] = B.DeviceRNG(v.seed)
            return self.rngs[v.uid]
        if isinstance(v, Handle):
            return self.handles[v.uid]
        if isinstance(v, XpRef):
            return B.xp()
        if type(v) in (tuple, list):
            return type(v)(self.unpack(x) for x in v)
        if type(v) is dict:
            return {k: self.unpack(x) for k, x in v.items()}
        return v

    def pack(self, v):
        if isinstance(v, _PLAIN) or isinstance(v, np.generic):
            return v
        if is_array(v):
            device = B.get_backend() == "cupy" and B.is_device_array(v)
            try:
                return Arr(np.array(B.to_host(v)), device)
            except Exception:
                pass
        if type(v) in (tuple, list):
            return type(v)(self.pack(x) for x in v)
        if type(v) is dict and all(isinstance(k, str) for k in v):
            return {k: self.pack(x) for k, x in v.items()}
        uid = len(self.handles) + 1
        self.handles[uid] = v
        return Handle(uid, type(v).__name__)

    # -- calls

    def load(self):
        name = "attn_check_" + re.sub(r"\W", "_", Path(self.path).stem)
        spec = importlib.util.spec_from_file_location(name, self.path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        folder = str(Path(self.path).parent.resolve())
        sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        finally:
            if folder in sys.path:
                sys.path.remove(folder)
        self.module = module
        found = {}
        for n in LIBRARY:
            if n in GIVEN_ONLY:
                continue
            fn = getattr(module, n, None)
            if callable(fn):
                found[n] = self.origin(n, fn)
        return found

    def origin(self, name: str, fn) -> dict:
        """Who wrote ``fn``: the learner, or the library (by identity, by its module, by its file)."""
        lib = library_function(name)
        code = getattr(fn, "__code__", None)
        file = getattr(code, "co_filename", None) or ""
        package = str(Path(B.__file__).resolve().parent)
        module = getattr(fn, "__module__", "") or ""
        from_library = (fn is lib or module == "attn" or module.startswith("attn.")
                        or (file and str(Path(file).resolve()).startswith(package + os.sep)))
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        defined = f"{module}.{getattr(fn, '__qualname__', name)}"
        if file:
            shown = str(Path(file).resolve())
            if shown.startswith(package + os.sep):          # the library's files as attn/...
                shown = os.path.relpath(shown, str(Path(package).parent))
            defined += f", {shown}:{getattr(code, 'co_firstlineno', '?')}"
        return {"library": bool(from_library), "defined": defined, "params": params}

    def call(self, name: str, args, given: bool):
        fn = library_function(name) if given else getattr(self.module, name)
        real = [self.unpack(a) for a in args]
        before = {i: np.array(B.to_host(a)) for i, a in enumerate(real) if is_array(a)}
        twin = []
        if not given and not self.reference:
            codes = twin_codes(name)

            def tracer(frame, event, arg):
                if event == "call" and frame.f_code in codes:
                    twin.append(codes[frame.f_code])
            sys.setprofile(tracer)
            threading.setprofile(tracer)           # threads the call starts are traced too
        try:
            res = fn(*real)
        except NotImplementedError as e:
            frames = traceback.extract_tb(e.__traceback__)
            return ("todo", frames[-1].name if frames else name)
        except BaseException as e:       # SystemExit and KeyboardInterrupt are findings too
            frames = traceback.extract_tb(e.__traceback__)
            if isinstance(e, SystemExit):
                kind, message = "SystemExit", f"called sys.exit({e.code!r})"
            elif isinstance(e, KeyboardInterrupt):
                kind, message = "KeyboardInterrupt", "raised KeyboardInterrupt"
            else:
                kind, message = type(e).__name__, f"raised {type(e).__name__}: {e}"
            return ("raised", kind, message, where(e.__traceback__, self.path),
                    frames[-1].name if frames else name)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        modified = {}
        for i, h in before.items():
            now = np.array(B.to_host(real[i]))
            if now.shape != h.shape or not np.array_equal(now, h, equal_nan=h.dtype.kind in "fc"):
                modified[i] = now
        return ("ok", self.pack(res), modified, twin[0] if twin else "")


def _install_cupy_modules():
    """The CuPy the grader's process uses (real, or a stand-in it installed), found the same way here."""
    names = os.environ.get("ATTN_CHECK_CUPY_MODULES", "")
    if names:
        B.cupy_modules = tuple(importlib.import_module(n) for n in names.split(","))


def _die_with_the_grader() -> None:
    """On Linux, ask the kernel to kill this process when the grader's ends: a learner's
    endless loop must not outlive a grader killed with SIGKILL."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)                       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_the_grader()
    fd_in, fd_out = (int(x) for x in os.environ["ATTN_CHECK_FDS"].split(","))
    requests, answers = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    faulthandler.register(signal.SIGUSR1, all_threads=False)     # the grader asks where a hang is
    _install_cupy_modules()
    B.set_backend(os.environ.get("ATTN_CHECK_BACKEND", "numpy"))
    child = _Child(os.environ["ATTN_CHECK_FILE"], os.environ.get("ATTN_CHECK_REFERENCE") == "1")
    try:
        answers.send(("loaded", child.load()))
    except BaseException as e:
        if isinstance(e, SyntaxError):
            answers.send(("import_failed", f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}", ""))
        elif isinstance(e, SystemExit):
            answers.send(("import_failed", f"importing it called sys.exit({e.code!r})",
                          where(e.__traceback__, child.path)))
        else:
            answers.send(("import_failed", f"{type(e).__name__}: {e}", where(e.__traceback__, child.path)))
        return
    while True:
        try:
            msg = requests.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "reset":
            child.handles.clear()
            child.rngs.clear()
            continue
        _, name, args, given = msg
        try:
            answer = child.call(name, args, given)
            answers.send(answer)
        except Exception as e:          # a result that cannot travel: say so rather than hang
            answers.send(("raised", "attn-check", f"its result could not be sent back: {type(e).__name__}: {e}",
                          "", name))


if __name__ == "__main__":
    main()

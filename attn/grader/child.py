"""The other side of ``attn-check``: the child process that runs a learner's code.

:mod:`attn.grader` never imports a learner's file. It starts this module in a child
process and asks it, over a pipe, to call one function at a time; everything that decides
a grade (hypothesis' examples, the library's results, every comparison) stays in the
grader's process. Only plain data crosses the pipe (:mod:`attn.grader.wire`: JSON and raw
array bytes, validated on arrival; never pickle).

Before the learner's file is imported, the child seals itself (:func:`confine`): the
library modules its exercise gives are loaded with the names it asks for withheld (a
stand-in that raises in their place), every other module of ``attn`` is unloaded and
refused by an import hook, it becomes ``nobody`` when it is root, works in an empty folder
of its own and sets its resource limits. It reports what it got. The files it can read at
all are what bubblewrap binds (:mod:`attn.grader.bubblewrap`).

The protocol: requests ``("call", name, args, given)`` (call the learner's ``name``, or
with ``given`` a forward the exercise gives, on ``args``), ``("perturb", name, args, given,
where, indices, h)`` (central differences' calls, :meth:`_Child.perturbed`) and ``("reset",)``; answers
``("loaded", found, sandbox)``, ``("import_failed", message, where)``, ``("ok", result,
modified)``, ``("raised", kind, message, where, raiser)``, ``("todo", raiser)``.
Arrays travel as :class:`~attn.grader.wire.Arr`; anything the learner returns that is
not plain data stays here as a :class:`~attn.grader.wire.Handle`.
"""
from __future__ import annotations

import faulthandler
import gc
import importlib
import importlib.abc
import importlib.util
import inspect
import json
import os
import re
import resource
import signal
import sys
import traceback
from pathlib import Path

from .. import backend as B
from .wire import ENTERED, Arr, Channel, Handle, Rng, XpRef

np = B.host

_PLAIN = (int, float, complex, bool, str, bytes, type(None))
NOBODY = 65534
#: The standard library a learner's file may import, loaded before the child becomes nobody.
PRELOAD = ("math", "cmath", "itertools", "functools", "collections", "heapq", "bisect", "dataclasses", "typing",
           "copy", "operator", "random", "statistics", "time", "queue", "threading", "types", "glob", "json",
           "string", "textwrap", "warnings", "contextlib", "abc", "enum", "numbers", "fractions", "decimal",
           "secrets", "hashlib", "re", "struct", "array", "unicodedata", "pprint")


def is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim") and not isinstance(a, type)


def where(tb, learner_file: str) -> str:
    """'file:line in function: source' of the innermost frame in the learner's file."""
    if not learner_file:
        return ""
    target = os.path.realpath(learner_file)
    frames = [f for f in traceback.extract_tb(tb) if os.path.realpath(f.filename) == target]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"

# ----------------------------------------------------------------------------- the seal


class Withheld:
    """What stands in the library's module for a function the exercise asks for."""

    __attn_withheld__ = True

    def __init__(self, module: str, name: str, answering: bool = False):
        self.module, self.name, self.answering = module, name, answering
        self.__name__ = self.__qualname__ = name
        self.__module__ = "attn-check"

    def __call__(self, *args, **kwargs):
        if self.answering:
            raise RuntimeError(f"{self.module}.{self.name} is withheld while attn-check grades this exercise: it "
                               "would hand in the answer the exercise asks you to write from the smaller layers")
        raise RuntimeError(
            f"{self.module}.{self.name} is withheld while attn-check grades {self.name}: "
            "the exercise asks you to write it")

    def __repr__(self) -> str:
        return f"<{self.module}.{self.name}, withheld by attn-check>"


class Refuse(importlib.abc.MetaPathFinder):
    """An import hook: the library's modules the exercise does not give cannot be imported."""

    def __init__(self, allowed):
        self.allowed = tuple(allowed)

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "attn" or not fullname.startswith("attn."):
            return None
        if "*" in self.allowed or any(fullname == a or fullname.startswith(a + ".") for a in self.allowed):
            return None
        raise ImportError(f"{fullname} is not available to the file attn-check grades: the exercise gives "
                          "NumPy, attn.backend" + "".join(f", {a}" for a in self.allowed if a != "attn.backend")
                          + " and nothing else of the library", name=fullname)


class Piped(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The library's modules the grader sent through the pipe ({module: (package?, source)}),
    compiled in memory: under bubblewrap no file of theirs is in the child. Gone, with their
    text, once the given modules are loaded (:func:`_load_piped`)."""

    def __init__(self, sources: dict):
        self.sources = sources

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.sources:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=bool(self.sources[fullname][0]))

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        code = compile(self.sources[module.__name__][1], f"<attn-check: {module.__name__}>", "exec")
        exec(code, module.__dict__)


def _load_piped(requests) -> None:
    """Receive the given modules' sources, import every one of them, and forget the text."""
    msg = requests.recv()
    if not (isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "sources" and isinstance(msg[1], dict)):
        raise RuntimeError("attn-check's child expected the library's sources first")
    finder = Piped(msg[1])
    sys.meta_path.insert(0, finder)
    try:
        for name in sorted(finder.sources):
            importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        finder.sources.clear()
        del msg


def _load_given(policy: dict) -> dict:
    """Import what the exercise gives, withhold what it asks for; returns the given
    forwards (name -> function) the grader may call."""
    gives, withhold = policy["gives"], set(policy["withhold"])
    if gives == ["*"]:
        return {"*": True}
    for module in gives:
        importlib.import_module(module)
    forwards = {}
    for name in policy["forwards"]:
        if name == "decoding_model":
            from .built import decoding_model
            forwards[name] = decoding_model
        else:
            mod = importlib.import_module("attn.layers")
            forwards[name] = getattr(mod, name)
    for key, mod in list(sys.modules.items()):
        if not (key == "attn" or key.startswith("attn.")) or mod is None:
            continue
        for name in withhold:
            if name in vars(mod):
                setattr(mod, name, Withheld(key, name, name in policy.get("answering", ())))
    return forwards


def _unload(policy: dict) -> None:
    """Forget every module of ``attn`` the exercise does not give (they stay loaded where the
    given ones use them), and the submodule attributes that would reach them."""
    gives = ["attn.backend"] + list(policy["gives"])
    if policy["gives"] == ["*"]:
        return
    keep = lambda k: k == "attn" or any(k == g or k.startswith(g + ".") for g in gives)      # noqa: E731
    for key in list(sys.modules):
        if (key.startswith("attn.")) and not keep(key):
            parent, _, leaf = key.rpartition(".")
            if parent in sys.modules and getattr(sys.modules[parent], leaf, None) is sys.modules[key]:
                try:
                    delattr(sys.modules[parent], leaf)
                except AttributeError:
                    pass
            del sys.modules[key]
    for key in policy.get("block", []):
        sys.modules.pop(key, None)
    gc.collect()


def _libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True)


def _limits(cfg: dict) -> list:
    got = []
    for name, value in (("RLIMIT_AS", cfg["memory_mb"] << 20), ("RLIMIT_CPU", cfg["cpu_s"]),
                        ("RLIMIT_FSIZE", cfg["file_mb"] << 20), ("RLIMIT_CORE", 0),
                        ("RLIMIT_NPROC", cfg["processes"] + cfg.get("processes_before", 0) if cfg.get("nproc")
                         else None)):
        if value is None or not hasattr(resource, name):
            continue
        limit = getattr(resource, name)
        try:
            hard = resource.getrlimit(limit)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (value, value))
            got.append(name[7:].lower())
        except (ValueError, OSError):
            pass
    return got


#: The kernel's keyrings are no namespace bubblewrap unshares: add_key, request_key and keyctl,
#: per architecture (its AUDIT_ARCH and their numbers), are refused with EPERM.
KEY_SYSCALLS = {"x86_64": (0xC000003E, (248, 249, 250)), "aarch64": (0xC00000B7, (217, 218, 219))}


def _refuse_keyrings() -> bool:
    """Install a seccomp filter (after PR_SET_NO_NEW_PRIVS) that answers the keyring system
    calls EPERM and lets every other through; on x86_64 x32's calls are refused too. False
    where it cannot be had (another architecture, no seccomp)."""
    import ctypes
    import platform
    arch, calls = KEY_SYSCALLS.get(platform.machine(), (None, ()))
    if arch is None:
        return False
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06              # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    refuse, allow = 0x00050000 | 1, 0x7FFF0000              # SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ALLOW
    tests = ([(jge, 0x40000000)] if arch == 0xC000003E else []) + [(jeq, nr) for nr in calls]
    n = len(tests)
    prog = [(ld, 0, 0, 4), (jeq, 0, n + 1, arch), (ld, 0, 0, 0)]       # seccomp_data: nr at 0, arch at 4
    prog += [(op, n - i, 0, k) for i, (op, k) in enumerate(tests)]   # a match jumps to the refusal
    prog += [(ret, 0, 0, allow), (ret, 0, 0, refuse)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(prog))(*prog)
    fprog = Prog(len(prog), filters)
    libc = _libc()
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) == 0            # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _become_nobody() -> None:
    """Root (bubblewrap's child as root, or no sandbox) becomes nobody, every capability gone;
    the standard library it may need is loaded first (Python's folders may not be nobody's to
    read where no sandbox binds them: a Python under /root)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def confine(cfg: dict, source: str, name: str) -> tuple[str, dict]:
    """Seal this process before the learner's file runs: the nobody user, an empty working
    folder with the file's copy in it, the limits. Returns the copy's path and what was got."""
    got = {"user": "", "files": cfg["files"], "limits": []}
    try:
        _libc().prctl(38, 1, 0, 0, 0)                      # PR_SET_NO_NEW_PRIVS
    except (OSError, AttributeError):
        pass
    work = Path(cfg["work"])
    root = os.geteuid() == 0
    entered = root and not cfg["sandbox"]
    if entered:        # in the grader's own folder (0700): entered before nobody could not, then by its cwd
        work.mkdir(mode=0o700, exist_ok=True)
        os.chown(work, NOBODY, NOBODY)
        os.chdir(work)
        work = Path(ENTERED)
    if root:
        _become_nobody()
        got["user"] = "nobody"
    else:
        got["user"] = "nobody" if os.geteuid() == NOBODY else f"uid {os.geteuid()} (the grader's own user)"
    if not entered:
        work.mkdir(mode=0o700, exist_ok=True)
        os.chdir(work)
    copy = work / name
    copy.write_text(source, encoding="utf-8")
    os.environ.clear()
    os.environ.update(cfg["env"])
    os.environ["HOME"] = str(work)
    got["limits"] = _limits(dict(cfg, nproc=cfg["sandbox"] or root))
    _refuse_keyrings()
    return str(copy), got

# ----------------------------------------------------------------------------- the calls


class _Child:
    def __init__(self, path: str, reference: bool, shown: str = ""):
        self.path, self.reference, self.shown = path, reference, shown or path
        self.module = None
        self.handles: dict[int, object] = {}
        self.rngs: dict[int, object] = {}
        self.forwards: dict = {}

    def show(self, text: str) -> str:
        return text.replace(self.path, self.shown) if text else text

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
        if isinstance(v, tuple):
            return type(v)(*(self.unpack(x) for x in v))
        if type(v) is dict:
            return {k: self.unpack(x) for k, x in v.items()}
        return v

    def pack(self, v, depth: int = 0):
        if depth > 32:
            return self._handle(v)
        if isinstance(v, _PLAIN) and type(v) in _PLAIN:
            return v
        if isinstance(v, np.generic) and v.dtype.kind in "biufc":
            return v
        if is_array(v):
            device = B.get_backend() == "cupy" and B.is_device_array(v)
            try:
                host = np.array(B.to_host(v))
                if host.dtype.kind in "biufc":
                    return Arr(host, device)
            except Exception:
                pass
        if type(v) in (tuple, list):
            return type(v)(self.pack(x, depth + 1) for x in v)
        if type(v) is dict and all(type(k) is str for k in v):
            return {k: self.pack(x, depth + 1) for k, x in v.items()}
        return self._handle(v)

    def _handle(self, v):
        uid = len(self.handles) + 1
        self.handles[uid] = v
        return Handle(uid, type(v).__name__)

    def load(self, names):
        name = "attn_check_" + re.sub(r"\W", "_", Path(self.path).stem)
        spec = importlib.util.spec_from_file_location(name, self.path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        self.module = module
        found = {}
        for n in names:
            fn = getattr(module, n, None)
            if callable(fn):
                found[n] = self.origin(n, fn)
        return found

    def origin(self, name: str, fn) -> dict:
        """Who wrote ``fn``: the learner (defined in the file), or not (the library's, a
        withheld stand-in, something imported)."""
        code = getattr(fn, "__code__", None)
        file = getattr(code, "co_filename", None) or ""
        module = getattr(fn, "__module__", "") or ""
        withheld = getattr(fn, "__attn_withheld__", False) is True
        mine = (not withheld and code is not None and module == self.module.__name__
                and os.path.realpath(file) == os.path.realpath(self.path))
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        defined = f"{module}.{getattr(fn, '__qualname__', name)}"
        if withheld:
            defined = f"{fn.module}.{name}"
        elif file:
            defined += f", {self.show(file)}:{getattr(code, 'co_firstlineno', '?')}"
        return {"library": not mine, "defined": str(defined), "params": [str(p) for p in params]}

    def call(self, name: str, args, given: bool, nudge=None):
        if given:
            fn = self.forwards.get(name)
            if fn is None and "*" in self.forwards:
                from .built import decoding_model
                fn = decoding_model if name == "decoding_model" else getattr(importlib.import_module("attn.layers"),
                                                                               name, None)
            if fn is None:
                return ("raised", "attn-check", f"{name} is not given by this exercise", "", name)
        else:
            fn = getattr(self.module, name)
        real = [self.unpack(a) for a in args] if nudge is None else self._nudged(args, *nudge)
        before = {i: np.array(B.to_host(a)) for i, a in enumerate(real) if is_array(a) and nudge is None}
        watch = _ForwardWatch(self._forward_of(name)) if nudge is None and not given else None
        try:
            with watch or _NoWatch():
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
            return ("raised", str(kind), self.show(str(message)), self.show(where(e.__traceback__, self.path)),
                    str(frames[-1].name if frames else name))
        if watch is not None and watch.refused():
            return ("raised", "attn-check", watch.message(name), self.show(watch.where), name)
        if nudge is not None:                   # central differences need the output alone
            return ("ok", self.pack(res[0] if type(res) in (tuple, list) and res else res), [])
        modified = []
        for i, h in before.items():
            now = np.array(B.to_host(real[i]))
            if now.shape != h.shape or not np.array_equal(now, h, equal_nan=h.dtype.kind in "fc"):
                if now.dtype.kind in "biufc":
                    modified.append([i, Arr(now, False)])
        return ("ok", self.pack(res), modified)

    def _forward_of(self, name: str):
        """The forward a backward called ``name`` belongs to (the learner's, or the one the
        exercise gives), or None."""
        if not name.endswith("_backward"):
            return None
        forward = name[:-len("_backward")] + "_forward"
        return getattr(self.module, forward, None) or self.forwards.get(forward)

    def _nudged(self, args, where, i: int, step: float) -> list:
        """``args`` unpacked afresh (new arrays, a new generator for each Rng, as a call's own
        arguments have), the flat entry ``i`` of the array at ``where`` moved by ``step``."""
        saved, self.rngs = self.rngs, {}
        try:
            real = [self.unpack(a) for a in args]
        finally:
            self.rngs = saved
        x = real[where[0]]
        for key in where[1:]:
            x = x[key]
        flat = x.reshape(-1)
        old = flat[i].item()
        flat[i] = old + step
        return real

    def perturbed(self, name: str, args, given: bool, where, idx, h: float):
        """``name`` on ``args`` with the entry ``i`` of the array at ``where`` moved by ``+h``,
        then ``-h``, for each ``i`` of ``idx`` (central differences): ("ok", [each result's
        first element], []), or the first call's answer that is not "ok"."""
        outs = []
        for i in idx:
            for step in (h, -h):
                answer = self.call(name, args, given, (where, i, step))
                if answer[0] != "ok":
                    return answer
                outs.append(answer[1])
        return ("ok", outs, [])


class _NoWatch:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _ForwardWatch:
    """Counts, while a backward runs, the calls of its forward (its code object, or a copy
    of its bytecode) and whether one had a complex argument: a backward that evaluates the
    forward again and again (finite differences) or on complex inputs (the complex step)
    takes the derivative numerically instead of deriving it. One call, on the forward's own
    inputs, is a recomputation and allowed."""

    def __init__(self, forward):
        code = getattr(forward, "__code__", None)
        self.code, self.name = code, getattr(forward, "__name__", "the forward")
        self.calls, self.complex, self.where, self.off = 0, False, "", False
        self.hook = self._hook                  # one bound method: getprofile() is it while on

    def __enter__(self):
        if self.code is not None:
            import threading
            self.saved = sys.getprofile(), threading.getprofile()
            sys.setprofile(self.hook)
            threading.setprofile(self.hook)
        return self

    def __exit__(self, *exc):
        if self.code is not None:
            import threading
            self.off = sys.getprofile() is not self.hook
            sys.setprofile(self.saved[0])
            threading.setprofile(self.saved[1])
        return False

    def _hook(self, frame, event, arg):
        if event != "call" or not (frame.f_code is self.code or frame.f_code.co_code == self.code.co_code):
            return
        self.calls += 1
        self.complex = self.complex or any(is_array(v) and getattr(v.dtype, "kind", "") == "c"
                                           or isinstance(v, complex) for v in frame.f_locals.values())
        caller = frame.f_back
        if not self.where and caller is not None:
            self.where = f"{caller.f_code.co_filename}:{caller.f_lineno} in {caller.f_code.co_name}"

    def refused(self) -> bool:
        return self.off or self.calls > 1 or self.complex

    def message(self, name: str) -> str:
        if self.off:
            return ("turned off attn-check's watch on what a backward calls (sys.setprofile): a backward is "
                    "graded with it on")
        how = f"{self.calls} time{'s' * (self.calls != 1)}" + (", with complex arguments" if self.complex else "")
        return (f"evaluated its forward {self.name} {how}: a backward is derived (the chain rule through the "
                "forward's cache), not the derivative of the forward taken numerically (the complex step, finite "
                "differences)")


def _install_cupy_modules():
    """The CuPy the grader's process uses (real, or a stand-in it installed), found the same way here."""
    names = os.environ.get("ATTN_CHECK_CUPY_MODULES", "")
    if names:
        B.cupy_modules = tuple(importlib.import_module(n) for n in names.split(","))


def _die_with_the_grader() -> None:
    """On Linux, ask the kernel to kill this process when its parent ends."""
    try:
        _libc().prctl(1, signal.SIGKILL)                       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_the_grader()
    try:
        os.setsid()                                            # a session of its own, nothing of the grader's
    except OSError:
        pass
    cfg = json.loads(os.environ["ATTN_CHECK_CONFIG"])
    fd_in, fd_out = cfg["fds"]
    requests, answers = Channel(fd_in), Channel(fd_out)
    faulthandler.register(signal.SIGUSR1, all_threads=False)     # the grader asks where a hang is
    _install_cupy_modules()
    B.set_backend(cfg["backend"])
    policy = cfg["policy"]
    try:
        with open(cfg["file"], encoding="utf-8", errors="replace") as f:
            source = f.read()
    except OSError as e:
        answers.send(("import_failed", f"cannot read the file: {e.strerror}", ""))
        return
    if cfg.get("piped"):
        _load_piped(requests)
    forwards = _load_given(policy)
    _unload(policy)
    copy, got = confine(cfg, source, Path(cfg["file"]).name)
    sys.meta_path.insert(0, Refuse(["attn.backend"] + policy["gives"]))
    child = _Child(copy, cfg["reference"], cfg["shown"])
    child.forwards = forwards
    names = cfg["names"]
    del cfg, source, policy, forwards
    try:
        answers.send(("loaded", child.load(names), got))
    except BaseException as e:
        if isinstance(e, SyntaxError):
            answers.send(("import_failed", child.show(f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}"), ""))
        elif isinstance(e, SystemExit):
            answers.send(("import_failed", f"importing it called sys.exit({e.code!r})",
                          child.show(where(e.__traceback__, child.path))))
        else:
            answers.send(("import_failed", child.show(f"{type(e).__name__}: {e}"),
                          child.show(where(e.__traceback__, child.path))))
        return
    while True:
        try:
            msg = requests.recv()
        except (EOFError, OSError):     # the grading is over: end here, with no interpreter teardown
            os._exit(0)                 # (the learner's atexit handlers and finalizers do not run)
        if msg[0] == "reset":
            child.handles.clear()
            child.rngs.clear()
            continue
        _, name, args, given, *rest = msg
        try:
            answers.send(child.call(name, args, given) if msg[0] == "call" else child.perturbed(name, args, given,
                                                                                               *rest))
        except Exception as e:          # a result that cannot travel: say so rather than hang
            answers.send(("raised", "attn-check", f"its result could not be sent back: {type(e).__name__}: {e}",
                          "", name))


if __name__ == "__main__":
    main()

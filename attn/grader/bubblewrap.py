"""The sandbox a learner's file runs in: bubblewrap (``bwrap``, what Flatpak uses; Debian's
``bubblewrap`` package), never namespaces of attn-check's own making.

Why bubblewrap: it is small, kept up by the Flatpak project, runs the same for an ordinary
user (in a user namespace of its own) and for root, drops every capability, gives the child
its own ``/dev``, ``/dev/shm``, ``/proc`` and ``/tmp``, ends the child with the grader
(``--die-with-parent``) and starts it in a session of its own (``--new-session``). nsjail
does as much but is not packaged by Debian; a wheel that bundles either would have to be
trusted as a binary.

What the child can read is only what :func:`command` binds, read-only: the system's shared
libraries (``/usr``, with every ``site-packages`` and ``dist-packages`` hidden under an
empty folder), Python's own folders (hidden the same way), NumPy's package, the library's
modules the exercise gives (:func:`stage`: a copy in which every name the exercise asks
for is a stand-in that raises; the library's solutions, the grader, the tests are never
there, however attn was installed) and the copy of the learner's file. The child can
write only into its own ``/tmp`` and ``/dev/shm``, which end with it.

Root and an ordinary user differ in one step: bubblewrap starts as root with only the
capabilities to change user, and the child becomes ``nobody`` before the file is read; an
ordinary user's child is ``nobody`` of its own user namespace from the start. Either way
the kernel counts its processes against its own limit (root's processes are never counted).
"""
from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from multiprocessing.util import Finalize
from pathlib import Path

from .. import backend as B

#: Where the child sees each thing bound into it.
INSIDE = {"lib": "/attn-check/lib", "site": "/attn-check/site", "file": "/attn-check/file"}
#: Top-level folders of the system that hold its programs and shared libraries.
SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: The user the child runs as.
NOBODY = 65534


@functools.lru_cache(maxsize=None)
def available() -> tuple[str, str, str]:
    """(bwrap's path, its version, "") where bubblewrap runs here, or ("", "", why not)."""
    if sys.platform != "linux":
        return "", "", f"bubblewrap needs Linux, not {sys.platform}"
    exe = shutil.which("bwrap")
    if exe is None:
        return "", "", "no bwrap command (install Debian's bubblewrap package)"
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout.split()
        r = subprocess.run(_isolation(exe) + ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                                              "--size", str(1 << 20), "--tmpfs", "/tmp", "true"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", "", f"bwrap failed: {e}"
    if r.returncode != 0:
        return "", "", ("bwrap failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
                        + " (the sandbox sizes its tmpfs with --size: bubblewrap 0.8 or later)")
    return exe, " ".join(version[-1:]), ""


def name() -> str:
    """The sandbox, in words: "bubblewrap 0.8.0"."""
    exe, version, _ = available()
    return f"bubblewrap {version}" if exe else ""


def _isolation(exe: str) -> list[str]:
    """Every namespace bubblewrap can give, every capability dropped (as root, all but the two
    the child needs to become nobody)."""
    args = [exe, "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if os.geteuid() == 0:
        return args + ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                       "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return args + ["--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]


def _real(p) -> str:
    return os.path.realpath(p)


def _under(p: str, folders) -> bool:
    return any(p == f or p.startswith(f.rstrip("/") + "/") for f in folders)


def _site_folders() -> list[str]:
    """Every folder Python installs packages into, here (attn may be one of them)."""
    found = set(site.getsitepackages()) | {site.getusersitepackages()}
    found |= {p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))}
    for pattern in ("lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages",
                    "local/lib/python3*/site-packages", "local/lib/python3*/dist-packages"):
        found |= {str(p) for p in Path("/usr").glob(pattern)}
    return sorted({_real(p) for p in found if os.path.isdir(p)})


def python_binds() -> list[str]:
    """bwrap's arguments for the system's libraries and Python (its standard library, never a
    folder of installed packages)."""
    args = []
    for top in SYSTEM:
        p = "/" + top
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    bound = ["/usr"]
    paths = sysconfig.get_paths()
    for p in sorted({_real(sys.base_prefix), _real(paths["stdlib"]), _real(paths["platstdlib"]),
                     os.path.dirname(_real(executable()))}):
        if os.path.isdir(p) and not _under(p, bound):
            parents = [str(a) for a in reversed(Path(p).parents) if str(a) != "/"]
            for a in parents:                   # nobody may pass through them (a Python under /root)
                args += ["--perms", "0755", "--dir", a]
            args += ["--ro-bind", p, p]
            bound.append(p)
    for p in _site_folders():
        if _under(p, bound):
            args += ["--tmpfs", p, "--remount-ro", p]
    return args


def executable() -> str:
    """The Python the child runs: the base interpreter (a virtual environment's packages are
    none of the child's business)."""
    return getattr(sys, "_base_executable", "") or sys.executable


def site_binds() -> list[str]:
    """NumPy's package (and the shared libraries its wheel brings), and the CuPy the grader
    uses, each bound alone under /attn-check/site."""
    folders = [Path(B.host.__file__).resolve().parent]
    if B.get_backend() == "cupy" and B.cupy_modules is not None:
        for m in B.cupy_modules:
            top = sys.modules[m.__name__.split(".")[0]]
            f = Path(top.__file__).resolve()
            folders.append(f.parent if f.name == "__init__.py" else f)
    args = []
    for f in folders:
        for p in (f, f.with_name(f.name + ".libs")):
            if p.exists():
                args += ["--ro-bind", str(p), f"{INSIDE['site']}/{p.name}"]
    return args


def command(library: list, file_folder: Path, work_mb: int = 64) -> list[str]:
    """The command that runs the child (its Python's command line follows it): ``library`` is
    :func:`stage`'s binds; its /tmp and /dev/shm hold at most ``work_mb`` MB each (memory:
    tmpfs), which the kernel enforces."""
    exe, _, why = available()
    if not exe:
        raise RuntimeError(why)
    folders = ["/etc", "/attn-check", INSIDE["site"], INSIDE["lib"]]     # bubblewrap makes them 0700 otherwise
    return (_isolation(exe) + [a for f in folders for a in ("--perms", "0755", "--dir", f)]
            + python_binds() + site_binds()
            + library + ["--ro-bind", str(file_folder), INSIDE["file"],
               "--dev", "/dev", "--perms", "01777", "--size", str(work_mb << 20), "--tmpfs", "/dev/shm",
               "--proc", "/proc", "--perms", "01777", "--size", str(work_mb << 20), "--tmpfs", "/tmp",
               "--remount-ro", "/", "--chdir", "/tmp", "--"])

# ----------------------------------------------------------------------------- the library's modules, staged


_STAGED: dict = {}


def _loaded_modules(modules: tuple) -> dict:
    """{module: its file} of the library, for every module importing ``modules`` loads (asked
    of a fresh interpreter: this one has loaded much more)."""
    root = str(Path(B.__file__).resolve().parents[1])
    code = ("import importlib, json, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "print(json.dumps({k: getattr(v, '__file__', None) for k, v in sys.modules.items() "
            "if k == 'attn' or k.startswith('attn.')}))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": root, "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-s", "-c", code, *modules], capture_output=True, text=True, env=env,
                       timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"attn-check could not list the modules {', '.join(modules)} load: "
                           + (r.stderr.strip().splitlines() or ["?"])[-1])
    return {k: v for k, v in json.loads(r.stdout.splitlines()[-1]).items() if v}


@functools.lru_cache(maxsize=1)
def _boot() -> dict:
    """The modules that start the child (importing attn.grader.child): files in its folder."""
    return _loaded_modules(("attn.grader.child",))


def withheld_source(source: str, names) -> str:
    """``source`` with each top-level function called one of ``names`` replaced by one that
    raises (same line numbers for everything else)."""
    names = set(names)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    lines = source.splitlines()
    for node in reversed(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            stub = [f"def {node.name}(*args, **kwargs):",
                    f"    raise RuntimeError('{node.name} is withheld while attn-check grades it')"]
            lines[first - 1:node.end_lineno] = stub + [""] * (node.end_lineno - first + 1 - len(stub))
    return "\n".join(lines) + "\n"


def stage(policy: dict) -> tuple[list[str], dict]:
    """bwrap's arguments that bind the ``attn`` package as the child may see it, and the
    sources the grader sends it through the pipe. On disk only what starts the child (the
    package's ``__init__``, the backend, the child and the wire); the modules the exercise
    gives (and what they import) travel as {module: (package?, source)}, each name it asks
    for a stand-in that raises, and are compiled in memory: no file of theirs is there to
    read. (A copy per policy, kept for this process's life.) The whole package for the
    library's own functions (``--allow-library``), nothing sent."""
    root = Path(B.__file__).resolve().parents[1]
    if policy["gives"] == ["*"]:
        return ["--ro-bind", str(root / "attn"), INSIDE["lib"] + "/attn"], {}
    folder, sources = _staged(policy, root)
    return ["--ro-bind", str(folder), INSIDE["lib"]], sources


def _staged(policy: dict, root: Path) -> tuple[Path, dict]:
    modules = ("attn.grader.child",) + tuple(m for m in policy["gives"] if m != "*")
    if "decoding_model" in policy["forwards"]:
        modules += ("attn.grader.built",)
    key = (modules, tuple(policy["withhold"]), tuple(policy["block"]))
    if key in _STAGED and _STAGED[key][0].is_dir():
        return _STAGED[key]
    folder = Path(tempfile.mkdtemp(prefix="attn-check-lib-"))
    # At the process's end, a worker of --class's pool included (where atexit does not run):
    Finalize(None, shutil.rmtree, args=(str(folder), True), exitpriority=0)
    boot, sources = _boot(), {}
    for module, file in sorted(_loaded_modules(modules).items()):
        src = Path(file).resolve()
        if module in policy["block"] or not _under(str(src), [str(root)]):
            continue
        text = withheld_source(src.read_text(encoding="utf-8"), policy["withhold"])
        if module not in boot:
            sources[module] = (src.name == "__init__.py", text)
            continue
        target = folder / src.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    for p in [folder, *folder.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    _STAGED[key] = folder, sources
    return folder, sources

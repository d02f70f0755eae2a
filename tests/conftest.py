"""Shared test configuration: hypothesis profiles, the ``backend`` fixture, and a
closing line that reports the largest gradient-check error of the session.

Hypothesis profiles (choose with ``HYPOTHESIS_PROFILE=<name>``)
---------------------------------------------------------------
``ci`` (default)
    15 examples per test, derandomised (the same examples on every run, so a
    CI failure reproduces locally), no example database, no deadline.
``dev``
    50 random examples per test, failures kept in ``.hypothesis/`` and replayed.
``thorough``
    300 random examples per test: run it before a release or after touching a
    backward pass (a few minutes).

``pytest --hypothesis-show-statistics`` prints how many examples each test ran.

Backends
--------
Tests that take the ``backend`` fixture run once per array backend: ``numpy`` always, and
``cupy``: on real CuPy where :func:`attn.backend.cupy_available` says a GPU is usable, and
on the CuPy stand-in (``tests/fakecupy``: NumPy dressed as CuPy, see there) everywhere
else, so the CuPy copy of every test runs on every machine. ``ATTN_BACKEND`` narrows it:
``numpy`` runs NumPy alone; ``cupy`` real CuPy alone (a machine without a usable GPU is
an error, not a skip, so a GPU run cannot pass by testing nothing); ``fakecupy`` the
stand-in alone. The header of the run says which one the ``cupy`` copies used.
Tests build their arrays on the host and move them with ``attn.backend.to_device``,
and compare results after ``attn.backend.to_host``.
"""
from __future__ import annotations

import contextlib
import functools
import os

import pytest
from hypothesis import HealthCheck, settings

import attn.backend as B
import fakecupy
from attn import testing

# Function-scoped fixtures (``backend``) are fine across examples: they only select the
# backend, which no example changes. Generating a few hundred floats is not "too slow".
# The model-gradient tests reject models over a cost cap on purpose; which derandomised
# draws come first depends on what ran before, so alone (``ATTN_BACKEND=cupy``) they could
# trip the "filters too much" check though the same test passes beside its numpy copy.
_SUPPRESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much]

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_SUPPRESS)
settings.register_profile("dev", max_examples=50, deadline=None, print_blob=True,
                          suppress_health_check=_SUPPRESS)
settings.register_profile("thorough", max_examples=300, deadline=None, print_blob=True,
                          suppress_health_check=_SUPPRESS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


#: ATTN_BACKEND as the run began.
_ENV = os.environ.get("ATTN_BACKEND", "").strip().lower()
if _ENV == "fakecupy":
    # attn does not know the test-only name: the stand-in is installed and selected as "cupy"
    # for every test (as ATTN_BACKEND=cupy selects CuPy), and the commands that tests start
    # in child processes run on NumPy (a test that wants its child on the stand-in gives it
    # fakecupy.child_env(), as the lessons' test does).
    fakecupy.install()
    B.set_backend("cupy")
    os.environ["ATTN_BACKEND"] = "numpy"


def _requested_backends() -> list[str]:
    """The backends the ``backend`` fixture runs over, from ``ATTN_BACKEND``."""
    if _ENV in ("numpy", "cupy", "fakecupy"):
        return [_ENV]
    return ["numpy", "cupy"]          # unset or "auto": NumPy and CuPy (real, or the stand-in)


@functools.lru_cache(maxsize=None)
def _cupy_available() -> bool:
    return B.cupy_available()


def _why_no_cupy() -> str:
    try:
        B._import_cupy()
    except B.BackendError as e:
        return e.reason
    return ""


def _stand_in_for(name: str) -> bool:
    """Whether the ``cupy``/``fakecupy`` copy of a test runs on the stand-in."""
    if name == "fakecupy":
        return True
    if name != "cupy" or _cupy_available():
        return False
    if _ENV == "cupy":
        B.set_backend("cupy")        # raises BackendError saying what is missing and how to fix it
    return True


@contextlib.contextmanager
def selected_backend(name: str):
    """Select ``numpy``, ``cupy`` (real CuPy, or the stand-in where no GPU is usable) or
    ``fakecupy`` for a block; the previous selection (and stand-in state) is restored after."""
    saved = (B._current, B._xp, B.cupy_modules)
    try:
        if _stand_in_for(name):
            fakecupy.install()
            name = "cupy"
        yield B.set_backend(name)
    finally:
        B._current, B._xp, B.cupy_modules = saved


@pytest.fixture(params=_requested_backends())
def backend(request):
    """Select an array backend for one test and yield its namespace (``xp``).

    The previous selection is restored afterwards, so tests do not leak a choice.
    """
    with selected_backend(request.param) as xp:
        yield xp


@pytest.fixture
def cupy():
    """CuPy selected as the backend for the test: real CuPy where a GPU is usable, else the
    stand-in (tests/fakecupy), which runs each kernel's NumPy twin in place of its CUDA."""
    with selected_backend("cupy") as cp:
        yield cp


def _machine_line() -> str:
    """The CPU, OpenBLAS's kernel for it and the versions that decide numbers and examples: what
    a report of a run on another machine must say."""
    import platform
    from importlib.metadata import PackageNotFoundError, version
    from attn.backend import blas_info
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = blas_info()
    kernel = f"OpenBLAS kernel {info['corename']}" if "corename" in info else info.get("build", "BLAS unknown")
    forced = f" (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']})" if os.environ.get("OPENBLAS_CORETYPE") else ""

    def v(name):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} absent"
    return f"machine: {cpu}, {kernel}{forced}; " + ", ".join(v(n) for n in ("numpy", "hypothesis", "matplotlib"))


def pytest_report_header(config):
    lines = [_machine_line()]
    names = _requested_backends()
    if "fakecupy" in names or ("cupy" in names and not _cupy_available()
                               and _ENV != "cupy"):
        why = _why_no_cupy()
        return lines + [f"attn backends: {', '.join(names)}; CuPy tests run on the stand-in tests/fakecupy"
                        + (f" (real CuPy: {why})" if why else "")]
    return lines + [f"attn backends: {', '.join(names)}" + ("; CuPy on a GPU" if "cupy" in names else "")]


@pytest.fixture
def torch():
    """PyTorch, the reference implementation, or a skip where it is not installed."""
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e .[ref])")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Close with the worst gradient-check error of the session, if any checks ran, whether the
    sentinels outlived the suite, and the machine line (which ``-q`` drops from the header).
    Under pytest-xdist the workers' records arrive through :func:`pytest_testnodedown`."""
    line = testing.gradient_summary()
    if line:
        terminalreporter.write_sep("-", "gradient checks")
        terminalreporter.write_line(line)
    for text in _SENTINELS_KILLED:
        terminalreporter.write_line(text, red=True)
    terminalreporter.write_line(_machine_line())


# --------------------------------------------------------------------------- sentinels

#: Processes the suite starts before its first test and that no test may end: one of this user's
#: and, as root, one of user nobody (whom the grader's children run as) in a PID namespace of its
#: own, as another grader's sandboxed child would be. A test that signals what it did not start
#: (``kill(-1)`` from a child without a namespace) ends them; the run then fails.
SENTINELS: dict = {}
_SENTINELS_KILLED: list = []


def _start_sentinels() -> dict:
    import shutil
    import subprocess
    sleeper = ["sleep", "864213"]                  # a program every user may run
    started = {"this user's": subprocess.Popen(sleeper, start_new_session=True, stdin=subprocess.DEVNULL)}
    if os.geteuid() == 0:
        nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        unshare = ["unshare", "--pid", "--fork"] if shutil.which("unshare") else []
        if shutil.which("setpriv"):
            for cmd in ([*unshare, *nobody, *sleeper], [*nobody, *sleeper]):
                proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
                try:
                    proc.wait(timeout=0.5)            # a namespace refused here: try without it
                except subprocess.TimeoutExpired:
                    started["nobody's"] = proc
                    break
    return started


def sentinels_ended() -> list[str]:
    """The sentinels that have ended, by whose they are (empty while all live)."""
    return [who for who, proc in SENTINELS.items() if proc.poll() is not None]


def pytest_sessionstart(session):
    SENTINELS.update(_start_sentinels())


def pytest_sessionfinish(session, exitstatus):
    dead = sentinels_ended()
    for who, proc in SENTINELS.items():
        if proc.poll() is None:
            os.killpg(proc.pid, 9)                 # ours: started by pytest_sessionstart
            proc.wait()
    if dead:
        _SENTINELS_KILLED.append(f"a test signalled processes it did not start: the sentinel(s) {', '.join(dead)} "
                                 "ended during the run")
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:                   # a pytest-xdist worker: the controller reports
        workeroutput["attn_sentinels_killed"] = list(_SENTINELS_KILLED)
        workeroutput["attn_gradient_errors"] = [list(e) for e in testing.GRADIENT_ERRORS]
        workeroutput["attn_gradient_checks"] = testing.GRADIENT_CHECKS[0]
    if _SENTINELS_KILLED:
        session.exitstatus = 1


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller, as a worker ends: its gradient checks join the session's summary
    and a sentinel it saw end fails the run (the controller's :func:`pytest_sessionfinish` runs
    after every worker is down)."""
    out = getattr(node, "workeroutput", {}) or {}
    _SENTINELS_KILLED.extend(f"[{node.gateway.id}] {text}" for text in out.get("attn_sentinels_killed", ()))
    testing.GRADIENT_ERRORS.extend(tuple(e) for e in out.get("attn_gradient_errors", ()))
    testing.GRADIENT_CHECKS[0] += out.get("attn_gradient_checks", 0)


@pytest.fixture
def sentinels_ended_by():
    """``check()``: the sentinels that have ended so far (see :data:`SENTINELS`), for a test that
    must not signal what it did not start; the run fails at its end too."""
    return sentinels_ended

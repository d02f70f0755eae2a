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
Tests that take the ``backend`` fixture run once per array backend: ``numpy``
always, ``cupy`` where :func:`attn.backend.cupy_available` says a GPU is usable
(skipped with a reason otherwise). ``ATTN_BACKEND=numpy`` or ``ATTN_BACKEND=cupy``
runs them on that backend alone; with ``ATTN_BACKEND=cupy`` a machine without a
usable GPU is an error, not a skip, so a GPU run cannot pass by testing nothing.
Tests build their arrays on the host and move them with ``attn.backend.to_device``,
and compare results after ``attn.backend.to_host``.
"""
from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, settings

import attn.backend as B
from attn import testing

# Function-scoped fixtures (``backend``) are fine across examples: they only select the
# backend, which no example changes. Generating a few hundred floats is not "too slow".
_SUPPRESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_SUPPRESS)
settings.register_profile("dev", max_examples=50, deadline=None, print_blob=True,
                          suppress_health_check=_SUPPRESS)
settings.register_profile("thorough", max_examples=300, deadline=None, print_blob=True,
                          suppress_health_check=_SUPPRESS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _requested_backends() -> list[str]:
    """The backends the ``backend`` fixture runs over, from ``ATTN_BACKEND``."""
    env = os.environ.get("ATTN_BACKEND", "").strip().lower()
    if env in ("numpy", "cupy"):
        return [env]
    return ["numpy", "cupy"]          # unset or "auto": every backend this machine has


@functools.lru_cache(maxsize=None)
def _cupy_available() -> bool:
    return B.cupy_available()


@pytest.fixture(params=_requested_backends())
def backend(request):
    """Select an array backend for one test and yield its namespace (``xp``).

    The previous selection is restored afterwards, so tests do not leak a choice.
    """
    name = request.param
    if name == "cupy" and not _cupy_available():
        if os.environ.get("ATTN_BACKEND", "").strip().lower() == "cupy":
            B.set_backend("cupy")    # raises BackendError saying what is missing and how to fix it
        pytest.skip("CuPy not installed or no usable GPU")
    saved = (B._current, B._xp)
    xp = B.set_backend(name)
    try:
        yield xp
    finally:
        B._current, B._xp = saved


@pytest.fixture
def torch():
    """PyTorch, the reference implementation, or a skip where it is not installed."""
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e .[ref])")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Close with the worst gradient-check error of the session, if any checks ran."""
    line = testing.gradient_summary()
    if line:
        terminalreporter.write_sep("-", "gradient checks")
        terminalreporter.write_line(line)

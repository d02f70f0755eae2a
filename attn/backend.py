"""The one place that knows about NumPy and CuPy.

Every other module in ``attn`` asks this one for the array namespace of its
inputs (``xp = get_array_module(x)``) and for the few operations the two
libraries spell differently: moving arrays to and from the host, scatter-add,
and random numbers. A test fails if any other module imports NumPy or CuPy.

Choosing a backend
------------------
``ATTN_BACKEND=numpy|cupy|auto`` in the environment, or :func:`set_backend` from
a program. ``auto`` picks CuPy only where it imports *and* a GPU is usable.
"""
from __future__ import annotations

import os
import threading
from types import ModuleType

import numpy as np

#: The host array library. Modules that work on the host (data loading,
#: plotting, checkpoint files) use ``backend.host`` instead of importing NumPy.
host = np

_BACKENDS = ("numpy", "cupy", "auto")
_current: str | None = None
_xp: ModuleType | None = None


class BackendError(RuntimeError):
    """The requested array backend cannot be used on this machine. ``reason`` says why in a
    few words (what ``auto`` reports when it falls back to NumPy)."""

    def __init__(self, message: str, reason: str = "", cupy_missing: bool = False):
        super().__init__(message)
        self.reason = reason or message
        self.cupy_missing = cupy_missing       # CuPy is simply not installed (nothing to report for auto)


#: Why the last ``set_backend("auto")`` chose NumPy (None where it chose CuPy, or no ``auto``).
auto_fallback_reason: str | None = None
#: Whether that reason is worth a line: CuPy is installed (or broken) but cannot be used. ``auto``
#: on a machine without CuPy is what it is for, and says nothing.
_auto_fallback_notable = False


#: Where CuPy comes from: ``None`` imports the real ``cupy`` and ``cupyx``. The test suite's
#: CuPy stand-in (``tests/fakecupy``, ``ATTN_BACKEND=fakecupy``) puts its look-alike modules
#: here as ``(cupy, cupyx)``; nothing in ``attn`` sets it.
cupy_modules: tuple | None = None


def _cupy():
    if cupy_modules is not None:
        return cupy_modules[0]
    import cupy  # noqa: F401  (only backend.py may import it)
    return cupy


def _cupyx():
    if cupy_modules is not None:
        return cupy_modules[1]
    import cupyx
    return cupyx


def _import_cupy():
    """Import CuPy and check that a GPU is usable; raise a clear BackendError if not."""
    try:
        cupy = _cupy()
    except Exception as e:  # ImportError, or a broken CUDA install raising anything
        why = f"CuPy is not installed or fails to import ({type(e).__name__}: {e})"
        missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in ("cupy", "cupyx")
        raise BackendError(
            f"ATTN_BACKEND=cupy was asked for, but {why}. Install it with `pip install -e .[gpu]` "
            "(or the cupy-cudaXXx wheel matching your CUDA), or use ATTN_BACKEND=numpy.", why, missing
        ) from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        if n < 1:
            raise RuntimeError("no CUDA device found")
        cupy.zeros(1).sum().item()  # a real round trip: driver, context, a kernel
    except Exception as e:
        why = f"no GPU is usable ({type(e).__name__}: {e})"
        raise BackendError(
            f"ATTN_BACKEND=cupy was asked for and CuPy imports, but {why}. Check `nvidia-smi` and the CUDA "
            "driver, or use ATTN_BACKEND=numpy.", f"CuPy imports, but {why}"
        ) from None
    return cupy


def cupy_available() -> bool:
    """True where CuPy imports and a GPU is usable."""
    try:
        _import_cupy()
        return True
    except BackendError:
        return False


def set_backend(name: str) -> ModuleType:
    """Select the array backend: ``"numpy"``, ``"cupy"`` or ``"auto"``.

    Returns the array namespace. Raises :class:`BackendError` if CuPy is asked
    for and cannot be used, and ``ValueError`` for an unknown name. ``"auto"`` never warns:
    where it chose NumPy although CuPy is installed, :func:`auto_fallback_notice` says why, for
    a command to print in its own words.
    """
    global _current, _xp, auto_fallback_reason, _auto_fallback_notable
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    if name == "auto":
        try:
            _xp, _current, auto_fallback_reason, _auto_fallback_notable = _import_cupy(), "cupy", None, False
        except BackendError as e:
            _xp, _current, auto_fallback_reason = np, "numpy", e.reason
            _auto_fallback_notable = not e.cupy_missing
        return _xp
    _xp = _import_cupy() if name == "cupy" else np
    _current, auto_fallback_reason, _auto_fallback_notable = name, None, False
    return _xp


def auto_fallback_notice() -> str | None:
    """Why ``auto`` chose NumPy, where a user would want to know: CuPy is installed but cannot be
    used (no GPU, a broken CUDA install). None where ``auto`` chose CuPy, was not asked for, or
    found no CuPy installed. A command prints it as one quiet line in its own words, without the
    CUDA error itself (:func:`describe` keeps it, for the trainer's header)."""
    if get_backend() == "numpy" and auto_fallback_reason and _auto_fallback_notable:
        return f"using NumPy: {auto_fallback_reason.split(' (')[0]} on this machine (--backend numpy: no notice)"
    return None


def describe() -> str:
    """The selected backend in a few words, for a command's first line: ``cupy``, ``numpy``, or
    ``numpy (auto: <why not CuPy>)`` where CuPy is installed but unusable."""
    name = get_backend()
    if name == "numpy" and auto_fallback_reason and _auto_fallback_notable:
        return f"numpy (auto: {auto_fallback_reason})"
    return name


def get_backend() -> str:
    """Name of the selected backend (``"numpy"`` or ``"cupy"``), choosing it from
    ``ATTN_BACKEND`` (default ``numpy``) on first use."""
    if _current is None:
        set_backend(os.environ.get("ATTN_BACKEND", "numpy").strip().lower() or "numpy")
    return _current  # type: ignore[return-value]


def xp() -> ModuleType:
    """The array namespace of the selected backend (``numpy`` or ``cupy``)."""
    get_backend()
    return _xp  # type: ignore[return-value]


def get_array_module(*arrays) -> ModuleType:
    """The namespace (``numpy`` or ``cupy``) that the given arrays live in.

    Like ``cupy.get_array_module``, but it works where CuPy is not installed.
    """
    for a in arrays:
        if is_device_array(a):
            return _cupy()
    return np


def is_device_array(a) -> bool:
    """True for a CuPy array."""
    if cupy_modules is not None and isinstance(a, cupy_modules[0].ndarray):
        return True
    return type(a).__module__.startswith("cupy")


def to_host(a):
    """A NumPy array with the contents of ``a`` (a no-op for NumPy arrays)."""
    if is_device_array(a):
        return a.get()
    return np.asarray(a)


def to_device(a, dtype=None):
    """``a`` as an array of the selected backend (optionally cast to ``dtype``); None stays None
    (a decoder-only model's batch has no source)."""
    if a is None:
        return None
    arr = xp().asarray(a)
    if dtype is not None and arr.dtype != dtype:
        arr = arr.astype(dtype)
    return arr


def to_float(a) -> float:
    """A Python float from a 0-d array (the only host sync a training step needs)."""
    return float(to_host(a))


def bfloat16():
    """The bfloat16 dtype that CuPy 14 gives bf16 arrays (``ml_dtypes.bfloat16``), or
    :class:`BackendError` saying which package is missing. (``attn.precision`` works on the
    float32 bits and needs it nowhere else.)"""
    try:
        import ml_dtypes
    except ImportError:
        raise BackendError("bfloat16 arrays need the ml_dtypes package (pip install ml_dtypes), through which "
                           "CuPy 14 supports them", reason="ml_dtypes is not installed") from None
    return np.dtype(ml_dtypes.bfloat16)


def scatter_add(target, ids, values) -> None:
    """``target[ids] += values`` in place, accumulating repeated ids.

    Plain ``target[ids] += values`` keeps only one contribution per repeated id;
    NumPy spells the accumulating form ``np.add.at`` and CuPy ``cupyx.scatter_add``.

    Inputs
    ------
    target : (V, D) array
    ids : (N,) integer array of rows in ``[0, V)``
    values : (N, D) array
    """
    if is_device_array(target):
        _cupyx().scatter_add(target, ids, values)
    else:
        np.add.at(target, np.asarray(ids).ravel(), values)


def host_rng(seed: int) -> np.random.Generator:
    """A seeded host random generator (PCG64). Initial weights are drawn with it
    on the host, then moved, so both backends start from identical numbers."""
    return np.random.default_rng(seed)


#: The thread's cuRAND generator per CuPy module (``by_module``: name -> (generator, a weak
#: reference to the DeviceRNG using it)).
_CURAND = threading.local()


class DeviceRNG:
    """Seeded random numbers drawn on the selected backend's device (dropout masks).

    On NumPy this is a ``numpy.random.Generator``; on CuPy a
    ``cupy.random.RandomState``. The stream differs between backends, which is
    fine for dropout; reproducibility within a backend comes from the seed.

    The trainer makes one a step. On CuPy, cuRAND's generator is made at the first draw, not
    before (the fast engine's dropout reads only :attr:`seed`, so its steps make none), and one
    generator serves every DeviceRNG of a thread in turn, seeded again for each (the numbers of
    a new ``cupy.random.RandomState(seed)``): making and destroying a cuRAND generator may wait
    for the device, and a destructor may run while a stream captures a graph. A DeviceRNG
    drawing while an earlier one that drew is still alive gets a generator of its own.
    """

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._cupy = get_backend() == "cupy"
        self._gen = None if self._cupy else np.random.default_rng(self.seed)

    def _curand(self):
        """This DeviceRNG's CuPy generator (see the class docstring)."""
        if self._gen is None:
            import weakref
            cp = xp()
            shared, owner = getattr(_CURAND, "by_module", {}).get(cp.__name__, (None, None))
            if shared is not None and owner() is None:
                shared.seed(self.seed)                     # what RandomState(seed) does after making one
                self._gen = shared
            else:
                self._gen = cp.random.RandomState(self.seed)
            if shared is None or self._gen is shared:
                _CURAND.by_module = {**getattr(_CURAND, "by_module", {}), cp.__name__: (self._gen, weakref.ref(self))}
        return self._gen

    def random(self, shape, dtype="float32"):
        """Uniform numbers in ``[0, 1)`` of the given shape and dtype."""
        if self._cupy:
            return self._curand().random_sample(shape, dtype=dtype)
        dt = np.dtype(dtype)
        if dt in (np.float32, np.float64):
            return self._gen.random(shape, dtype=dt)
        return self._gen.random(shape).astype(dt)

    def random_uint16(self, shape):
        """Uniform integers in ``[0, 65536)`` as uint16, for cheap dropout masks (the
        fast path of :mod:`attn.fast`). On NumPy four of them come from each 64-bit
        draw of a separate SFC64 stream seeded from ``seed``, about three times
        cheaper than :meth:`random` per element; the reference path never uses it."""
        n = 1
        for s in (shape if isinstance(shape, tuple) else (shape,)):
            n *= int(s)
        if self._cupy:
            return self._curand().randint(0, 1 << 16, size=n, dtype="uint16").reshape(shape)
        if getattr(self, "_bits", None) is None:
            self._bits = np.random.SFC64(np.random.SeedSequence([self.seed, 0x5eed]))
        return self._bits.random_raw((n + 3) // 4).view(np.uint16)[:n].reshape(shape)


# --------------------------------------------------------------------------- BLAS threads

_OPENBLAS = []      # [(ctypes library, get, set)] once looked up; [None] if there is none


def _openblas():
    """The OpenBLAS that NumPy loaded, as (get_num_threads, set_num_threads), or None.

    Found the way threadpoolctl finds it: the shared objects mapped into this process."""
    if not _OPENBLAS:
        found = None
        try:
            import ctypes
            import re
            with open("/proc/self/maps") as fh:
                paths = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", fh.read())))
            for path in paths:
                lib = ctypes.CDLL(path)
                for prefix, suffix in (("openblas", ""), ("scipy_openblas", "64_"), ("openblas", "64_")):
                    get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                    put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                    if get is not None and put is not None:
                        found = (get, put, lib, prefix, suffix, path)
                        break
                if found:
                    break
        except Exception:       # no /proc, no ctypes, an unusual build: unknown, not an error
            found = None
        _OPENBLAS.append(found)
    return _OPENBLAS[0]


def blas_threads(set_to: int | None = None) -> int | None:
    """NumPy's BLAS (OpenBLAS) threads, setting them first if ``set_to`` is given.
    Returns None where the BLAS is not OpenBLAS or cannot be reached."""
    ob = _openblas()
    if ob is None:
        return None
    if set_to is not None:
        ob[1](int(set_to))
    return int(ob[0]())


def blas_info() -> dict:
    """What NumPy's BLAS is at run time, as threadpoolctl would report it: for OpenBLAS its
    configuration string (version, build options), the kernel chosen for this CPU
    (``corename``, e.g. ``Haswell``), its threads and file; else the build's name from
    ``numpy.show_config``."""
    info: dict = {}
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info["build"] = f"{blas.get('name')} {blas.get('version')}"
    except Exception:       # older NumPy: no dict mode
        pass
    ob = _openblas()
    if ob is not None:
        import ctypes
        _get, _put, lib, prefix, suffix, path = ob
        info.update(library="openblas", threads=int(_get()), path=path)
        for key in ("corename", "config"):
            f = getattr(lib, f"{prefix}_get_{key}{suffix}", None)
            if f is not None:
                f.restype = ctypes.c_char_p
                info[key] = f().decode(errors="replace").strip()
    return info

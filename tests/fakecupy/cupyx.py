"""The ``cupyx`` look-alike of the stand-in: ``scatter_add`` and ``allow_synchronize``."""
from __future__ import annotations

import contextlib
import warnings

import numpy as np

from .cupy import DeviceSynchronized, _unwrap, _wrap_index, _index_component, ndarray, transfers

__all__ = ["scatter_add", "allow_synchronize", "DeviceSynchronized"]


def scatter_add(a, slices, value):
    """``a[slices] += value`` accumulating repeated indices, as ``cupyx.scatter_add``; an
    integer-array index out of range wraps, as CuPy's indexing does."""
    if not isinstance(a, ndarray):
        raise TypeError(f"cupyx.scatter_add: a must be a device array, got {type(a).__name__}")
    target = a._a
    def indices():          # as the kernel reads them when it runs (a replay: the memory's values then)
        idx = _index_component(slices)
        if isinstance(idx, tuple):
            return tuple(_wrap_index(_index_component(k), n) for k, n in zip(idx, target.shape))
        return _wrap_index(idx, target.shape[0])
    idx = indices()
    v = _unwrap(value, "cupyx.scatter_add")
    np.add.at(target, idx, v)
    from . import cupy as _cp
    if _cp._capturing is not None:
        _cp._record(lambda: np.add.at(target, indices(), v))
    if _cp.tracer is not None:
        _cp._report("elementwise", "scatter_add", (v, idx), target, True)


@contextlib.contextmanager
def allow_synchronize(allow: bool):
    """Inside ``with allow_synchronize(False)``, any device->host transfer raises
    :class:`DeviceSynchronized` (as CuPy does for implicit synchronisation). Entering it warns,
    as CuPy's does since v10 (deprecated), with CuPy's words (so warnings made errors raise)."""
    warnings.warn("cupyx.allow_synchronize will be removed in future releases as it is not possible to "
                  "reliably detect synchronizations.")
    before = transfers.allowed
    transfers.allowed = bool(allow)
    try:
        yield
    finally:
        transfers.allowed = before

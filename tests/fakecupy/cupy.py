"""The ``cupy`` look-alike of the stand-in (see ``fakecupy/__init__.py`` for what it promises).

A device array is an :class:`ndarray` holding a NumPy array; every operation unwraps its
arguments, runs NumPy, and wraps the result. What CuPy does differently is done here:
host arrays are refused, scalars come back as 0-d device arrays, integer-array indices wrap,
and every way to the host is counted (or refused inside ``cupyx.allow_synchronize(False)``).

This module is ``cupy`` itself: the state every part shares (the tracer, the capture under
way, the allocator, the streams' order), transfers, creating arrays and NumPy's other names.
The parts live beside it and read that state here: ``capture`` (stream capture, allocators,
reports), ``arrays`` (:class:`ndarray`, wrapping, indexing), ``runtime`` (devices, streams,
events, pools), ``cublas`` (the GEMMs and ``cupy.cuda``) and ``kernels`` (``RawModule``);
every name of theirs is re-exported, so ``cupy.X`` reaches it as it would in CuPy.
"""
from __future__ import annotations

import builtins
import contextlib
import os
from collections import Counter

import numpy as np

from .streams import ReadBeforeRunError  # noqa: F401 (cupy.ReadBeforeRunError, the stand-in's)

__version__ = "0.0.0+fakecupy (NumPy " + np.__version__ + ")"

# --------------------------------------------------------------------------- transfers

class DeviceSynchronized(RuntimeError):
    """Raised (as ``cupyx.DeviceSynchronized``) by a transfer inside ``allow_synchronize(False)``."""


class _Transfers:
    """Every device -> host transfer (and explicit synchronisation) since the import, by kind."""

    def __init__(self):
        self.n = 0
        self.kinds: Counter = Counter()
        self.allowed = True

    def record(self, kind: str) -> None:
        if not self.allowed:
            raise DeviceSynchronized(
                f"fakecupy: a device->host transfer ({kind}) inside cupyx.allow_synchronize(False)")
        self.n += 1
        self.kinds[kind] += 1


#: The global count. Read it through :func:`counting`.
transfers = _Transfers()


class TransferCounter:
    """What :func:`counting` yields: the transfers since the ``with`` began."""

    def __init__(self):
        self._n0, self._k0 = transfers.n, Counter(transfers.kinds)

    @property
    def n(self) -> int:
        return transfers.n - self._n0

    @property
    def kinds(self) -> dict:
        now = Counter(transfers.kinds)
        now.subtract(self._k0)
        return {k: v for k, v in now.items() if v}

    def __repr__(self):
        return f"TransferCounter(n={self.n}, kinds={self.kinds})"


@contextlib.contextmanager
def counting():
    """``with counting() as c: ...``; then ``c.n`` transfers happened, ``c.kinds`` by kind."""
    yield TransferCounter()


def _sync(kind: str, a: np.ndarray | None = None, read: np.ndarray | None = None, stream=None) -> None:
    """Count a transfer (or synchronisation); to the tracer, a transfer is a device -> host copy
    (of ``a``, where the whole array is copied). In the asynchronous mode the copy (of ``a``, or
    of part of ``read``) is a launch on the current stream, which the host then waits for."""
    _refuse_in_capture(f"a device->host transfer or synchronisation ({kind})", "host sync")
    transfers.record(kind)
    if _order is not None and kind != "synchronize":
        _order.host_read(kind, a if a is not None else read, None if stream is None else stream.ptr)
    if tracer is not None and kind != "synchronize":
        tracer("copy", "device->host", [] if a is None else [a], [], {"fresh": [], "direction": "d2h"})

# --------------------------------------------------------------------------- tracing

#: Set to a callable to see every kernel launch, copy and allocation as CuPy would make it:
#: ``tracer(kind, name, inputs, outputs, info)``, with ``kind`` one of :data:`KINDS`, ``name``
#: the operation, ``inputs`` and ``outputs`` the NumPy arrays read and written, and ``info`` a
#: dict (``fresh``: the outputs newly allocated from the memory pool; ``step_memory``: those
#: placed in memory from an allocator other than the pool's; ``grid``, ``block`` for a
#: RawKernel; ``direction`` for a host transfer). ``attn.bench.counts`` sets it; None costs one
#: test per operation.
tracer = None

#: What a traced event is, as CuPy would run it: an elementwise kernel, a reduction, one of
#: attn's RawKernels, a cuBLAS product, a copy (device to device, or a host transfer), a cuRAND
#: draw, a sort or scan (CuPy launches several kernels for one), or an allocation alone.
KINDS = ("elementwise", "reduction", "raw", "matmul", "copy", "random", "sort", "alloc")

_REDUCTIONS = frozenset({"sum", "max", "min", "amax", "amin", "mean", "argmax", "argmin", "any", "all", "var",
                         "std", "prod", "nansum", "nanmax", "nanmin", "count_nonzero", "norm", "linalg.norm",
                         "average", "logsumexp", "reduce"})
_SORTS = frozenset({"sort", "argsort", "partition", "argpartition", "unique", "lexsort", "cumsum", "cumprod",
                    "accumulate", "nonzero", "flatnonzero", "argwhere", "compress", "extract"})
_MATMULS = frozenset({"matmul", "dot", "tensordot", "einsum", "inner", "vdot"})
_COPIES = frozenset({"copy", "ascontiguousarray", "asfortranarray", "concatenate", "stack", "hstack", "vstack",
                     "copyto", "tile", "array"})
_ALLOC_ONLY = frozenset({"empty", "empty_like"})


# --------------------------------------------------------------------------- stream capture

#: The capture in progress (a :class:`_Capture`), or None. While a stream captures, every
#: operation still runs here (the stand-in cannot defer NumPy), is recorded so that
#: :meth:`Graph.launch` can run it again, and ``end_capture`` puts every device array back as it
#: was before the capture (those made during it are filled with NaN), so a capture has no
#: effect on memory, as on a GPU. What CUDA or CuPy refuse during a capture raises
#: :class:`StreamCaptureError`: a host transfer or synchronisation, a cuRAND draw, and CuPy's
#: own ``matmul`` (CuPy refuses cuBLAS calls it makes while the stream captures). An allocation
#: from the memory pool is *not* refused, in any capture mode, as on a GPU, where the pool serves
#: it from the free blocks of the capturing stream, with no CUDA call for the mode to refuse (CuPy's
#: default mode, relaxed, would not refuse even a ``cudaMalloc``; the global and thread-local modes
#: do: :func:`_malloc_refused`). It is recorded (:attr:`_Capture.pool_allocations`),
#: the pool's byte counts grow by it (the graph keeps the block) and memory hooks see it; the
#: graph keeps an address the pool will hand out again, and nothing but the capturer's own
#: check (attn's guard, :mod:`attn.fast.gpu.graph`) stops it. A survey notes it as a refusal.
_capturing = None


from .capture import (  # noqa: E402,F401 (cupy.X, as attn and the tests reach them)
    Graph, StreamCaptureError, _Capture, _PerThread, _allocated, _arrays, _caller, _copied_for_cublas,
    _fresh_results, _get_allocator, _into, _live_roots, _place, _placed, _poison, _pool_block, _raw_malloc,
    _record, _record_result, _refuse_in_capture, _report, _report_matmul, _root, _set_allocator, _state,
    _update_allocator, _using_allocator, capture_allocations_allowed, in_step_memory)


_tls = _PerThread()


# --------------------------------------------------------------------------- allocators

#: The allocator of ``cupy.cuda.set_allocator`` (None: the memory pool's ``malloc``), for every
#: thread (a thread's ``cupy.cuda.using_allocator`` comes first: :class:`_PerThread`), and how
#: many times it was set (each thread's state is worked out again after).
_global_allocator = None
_generation = 0
#: id -> weak reference of every array whose memory an allocator has handed out pieces of.
_allocator_roots: dict = {}


# --------------------------------------------------------------------------- wrapping

_PLAIN = frozenset({int, float, bool, str, type(None), slice, type(Ellipsis), np.dtype, complex})


#: Functions whose result size depends on the data: CuPy reads a count back from the device.
_DATA_DEPENDENT = {"nonzero", "flatnonzero", "argwhere", "unique", "compress", "extract"}

# --------------------------------------------------------------------------- the array

#: CUDA runtime calls made on the host's behalf that cost a round trip to the driver, by name
#: (``UnownedMemory`` without a device id: ``cudaPointerGetAttributes``).
runtime_calls: dict = {"pointerGetAttributes": 0}


#: The memory whose address was taken (``a.data``): id of the NumPy array owning it -> (a weak
#: reference to that array, its first byte, one past its last). cuBLAS calls resolve device pointers against it (the stand-in's
#: device memory is NumPy memory, so a pointer is a NumPy data address).
_EXPOSED: dict = {}


from .arrays import (  # noqa: E402,F401 (cupy.X, as attn and the tests reach them)
    MemoryPointer, UnownedMemory, _Flags, _Ufunc, _args, _binary, _expose, _exposed_memory, _fast_method,
    _function, _host_refused, _index_component, _inplace, _on_memory, _out_result, _prepare_index,
    _report_ufunc, _ufunc, _unary, _unwrap, _wrap, _wrap_index, ndarray)


for _name in ("reshape", "astype", "sum", "max", "min", "mean", "transpose", "swapaxes", "any", "all", "ravel",
              "argmax", "view", "fill", "squeeze", "var", "std", "prod", "cumsum", "clip", "dot", "repeat"):
    setattr(ndarray, _name, _fast_method(_name))

# --------------------------------------------------------------------------- creating arrays

def asarray(a, dtype=None, order=None, blocking=False):
    """Host data -> a device array (a copy); a device array is returned as it is."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    _refuse_in_capture("a host->device copy (cupy.asarray of host data)", "host transfer")
    r = np.array(_unwrap(a, "cupy.asarray", allow_host=True), dtype=dtype, order=order or "K", copy=True)
    r = _placed(r)
    if tracer is not None:
        tracer("copy", "host->device", [], [r], dict(_allocated([r] if r.size else []), direction="h2d"))
    return ndarray._of(r)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
    if isinstance(obj, ndarray):
        src = obj._a
        r = np.array(src, dtype=dtype, copy=copy, order=order, ndmin=ndmin)
        if _state().placing:
            r = _place(r, (src,))
        if _capturing is not None:
            r = _record_result("cupy.array", r, (src,), lambda: src)
        if tracer is not None:
            _report("auto", "array", (obj._a,), r)
        return ndarray._of(r)
    _refuse_in_capture("a host->device copy (cupy.array of host data)", "host transfer")
    r = np.array(_unwrap(obj, "cupy.array", allow_host=True), dtype=dtype, copy=True, order=order, ndmin=ndmin)
    r = _placed(r)
    if tracer is not None:
        tracer("copy", "host->device", [], [r], dict(_allocated([r] if r.size else []), direction="h2d"))
    return ndarray._of(r)


asanyarray = asarray


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    """Device -> host (counted); host data is returned as a NumPy array."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out)
    return np.asarray(a, order=order)


def get_array_module(*args):
    import fakecupy.cupy as cp
    return cp if any(isinstance(a, ndarray) for a in args) else np


def take(a, indices, axis=None, out=None):
    """As ``numpy.take``, but out-of-range indices wrap (CuPy has no ``mode='raise'``)."""
    a_ = _unwrap(a, "cupy.take")
    idx = np.asarray(_index_component(indices))
    n = a_.size if axis is None else a_.shape[axis]
    widx, o = _wrap_index(idx, n), _unwrap(out, "cupy.take")
    r = np.take(a_, widx, axis=axis, out=o)
    if _state().placing and o is None:
        r = _place(r, (a_,))
    if _capturing is not None:
        def compute(out=None):       # the indices read when the kernel runs
            return np.take(a_, _wrap_index(idx, n), axis=axis, out=out)
        if o is not None:
            _record(lambda: compute(o))
        else:
            r = _record_result("cupy.take", r, (a_,), compute)
    if tracer is not None:
        _report("elementwise", "take", (a_, idx), r, out is not None)
    return _out_result(out, r)


def take_along_axis(a, indices, axis):
    a_ = _unwrap(a, "cupy.take_along_axis")
    idx = _unwrap(indices, "cupy.take_along_axis")
    n = a_.size if axis is None else a_.shape[axis]
    r = np.take_along_axis(a_, _wrap_index(idx, n), axis=axis)
    if _state().placing:
        r = _place(r, (a_, idx))
    if _capturing is not None:
        r = _record_result("cupy.take_along_axis", r, (a_, idx),
                           lambda: np.take_along_axis(a_, _wrap_index(idx, n), axis=axis))
    if tracer is not None:
        _report("elementwise", "take_along_axis", (a_, idx), r)
    return _wrap(r)


# dtypes and constants are NumPy's own, as in CuPy
dtype, finfo, iinfo = np.dtype, np.finfo, np.iinfo
newaxis, inf, nan, pi, e = np.newaxis, np.inf, np.nan, np.pi, np.e
for _name in ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "intp",
              "float16", "float32", "float64", "complex64", "complex128", "integer", "floating", "number",
              "generic", "signedinteger", "unsignedinteger", "complexfloating", "inexact", "half", "single",
              "double", "longlong", "ulonglong", "byte", "ubyte", "short", "ushort", "intc", "uintc"):
    globals()[_name] = getattr(np, _name)
globals()["bool"] = np.bool_     # cupy.bool, as numpy.bool (so the code here spells Python's builtins.bool)

_NOT_FUNCTIONS = {"asarray", "array"}


#: The wrappers of NumPy's names that are also Python's builtins (any, sum, max...), kept apart:
#: in the module's globals they would hide the builtins from the stand-in's own code.
_SHADOWING: dict = {}


def __getattr__(name):
    """Any other NumPy function or ufunc, taking and giving device arrays."""
    if name.startswith("_"):
        raise AttributeError(name)
    if name in _SHADOWING:
        return _SHADOWING[name]
    obj = getattr(np, name, None)
    if isinstance(obj, np.ufunc):
        w = _Ufunc(obj)
    elif callable(obj) and not isinstance(obj, type):
        w = _function(name, obj)
    else:
        raise AttributeError(f"module 'fakecupy.cupy' has no attribute {name!r}")
    (_SHADOWING if hasattr(builtins, name) else globals())[name] = w
    return w


class _Namespace:
    """``cupy.linalg`` and the like: NumPy's sub-module on device arrays."""

    def __init__(self, module, name):
        self._module, self._name = module, name

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        obj = getattr(self._module, name)
        if not callable(obj) or isinstance(obj, type):
            return obj
        w = _function(f"{self._name}.{name}", obj)
        setattr(self, name, w)
        return w


linalg = _Namespace(np.linalg, "linalg")

# --------------------------------------------------------------------------- random

def _drawn(name: str, a: np.ndarray) -> "ndarray":
    """A random draw's result on the device: one cuRAND launch (and the memory for it)."""
    _refuse_in_capture(f"cupy.random's {name} (cuRAND, through CuPy)", "cuRAND")
    a = _placed(a)
    if tracer is not None:
        tracer("random", name, [], [a], _allocated([a] if a.size else []))
    return ndarray._of(a)


class _Random:
    """``cupy.random``: a seeded RandomState whose draws are device arrays."""

    class RandomState:
        """``cupy.random.RandomState``: each one a cuRAND generator (counted in :attr:`made`: CuPy
        makes one with ``curand.createGenerator`` and destroys it when it goes); ``seed`` starts
        its numbers again as a new one's."""
        #: generators made so far
        made = 0

        def __init__(self, seed=None):
            type(self).made += 1
            self.seed(seed)

        def seed(self, seed=None):
            self._g = np.random.Generator(np.random.PCG64(seed))

        def random_sample(self, size=None, dtype=float):
            dt = np.dtype(dtype)
            if dt not in (np.float32, np.float64):
                raise TypeError(f"cupy.random.RandomState.random_sample: dtype must be float32 or float64, got {dt}")
            return _drawn('random_sample', np.asarray(self._g.random(size, dtype=dt)))

        def randint(self, low, high=None, size=None, dtype=int):
            return _drawn('randint', np.asarray(self._g.integers(low, high, size=size, dtype=dtype)))

        def standard_normal(self, size=None, dtype=float):
            return _drawn('standard_normal', np.asarray(self._g.standard_normal(size, dtype=np.dtype(dtype))))

        def normal(self, loc=0.0, scale=1.0, size=None, dtype=float):
            return _drawn('normal', np.asarray(self._g.normal(loc, scale, size)).astype(dtype))

        def uniform(self, low=0.0, high=1.0, size=None, dtype=float):
            return _drawn('uniform', np.asarray(self._g.uniform(low, high, size)).astype(dtype))

    def __init__(self):
        self._default = self.RandomState(0)

    def seed(self, seed=None):
        self._default = self.RandomState(seed)

    def random(self, size=None, dtype=float):
        return self._default.random_sample(size, dtype)

    random_sample = random


random = _Random()

# --------------------------------------------------------------------------- cuda

#: ``runtime.streamPerThread`` (``cudaStreamPerThread``): the handle of every thread's own default stream
PER_THREAD_STREAM = 2


from .runtime import (  # noqa: E402,F401 (cupy.X, as attn and the tests reach them)
    Device, Event, MemoryHook, MemoryPool, Stream, _Nccl, _Runtime, _current_stream, _current_stream_ptr,
    _malloc_refused, asynchronous, get_default_memory_pool, get_default_pinned_memory_pool, get_elapsed_time)


Stream.null = Stream(null=True)
#: ``cudaStreamPerThread``: each thread's own default stream, blocking as the streams it makes
#: (the asynchronous mode keeps one per thread: :meth:`fakecupy.streams.Order.key`).
Stream.ptds = Stream(ptds=True)
#: Whether a thread that made no stream current launches on ``Stream.ptds`` (CuPy reads
#: ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM`` at import, as here).
_PTDS = os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")


#: The asynchronous mode's order of launches (a :class:`fakecupy.streams.Order`), or None.
_order = None


_POOL, _PINNED_POOL = MemoryPool(), MemoryPool()


from .cublas import (  # noqa: E402,F401 (cupy.X, as attn and the tests reach them)
    _Cublas, _Cuda, _DeviceModule, _DirectCublas, _Matrices, _bf16_values, _device_scalar, _device_time,
    _device_words, _host_scalar, _int, _memory_at, _spans)


cuda = _Cuda()
_Cuda.cublas, _Cuda.device = _Cublas, _DeviceModule

# --------------------------------------------------------------------------- kernels

#: Seconds spent doing what the device would (the kernels' twins, cuBLAS's products), summed:
#: a step's wall time less this is the host's time to issue its work.
device_seconds = [0.0]

#: Set to a ``numpy.random.Generator`` to run every kernel's blocks in an order drawn from it
#: (:attr:`KernelLaunch.order`), as a GPU may: the race check of the kernels whose blocks
#: depend on one another (the two-stage reductions' last block, the ticket counters).
race = None


_CTYPE_DTYPES = {"float": np.float32, "double": np.float64, "int": np.int32, "long long": np.int64,
                 "unsigned int": np.uint32, "unsigned long long": np.uint64, "bool": np.bool_,
                 "unsigned char": np.uint8, "unsigned short": np.uint16, "short": np.int16}


from .kernels import (  # noqa: E402,F401 (cupy.X, as attn and the tests reach them)
    Driver, KernelLaunch, RawKernel, RawModule, _kernel_signatures, _twins)
_Cuda.driver = Driver


if __import__("os").environ.get("FAKECUPY_ASYNC") == "1":       # a whole run in the asynchronous mode
    _WHOLE_RUN = asynchronous()                                   # (kept: a generator closed would end it)
    _WHOLE_RUN.__enter__()

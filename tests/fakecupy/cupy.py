"""The ``cupy`` look-alike of the stand-in (see ``fakecupy/__init__.py`` for what it promises).

A device array is an :class:`ndarray` holding a NumPy array; every operation unwraps its
arguments, runs NumPy, and wraps the result. What CuPy does differently is done here:
host arrays are refused, scalars come back as 0-d device arrays, integer-array indices wrap,
and every way to the host is counted (or refused inside ``cupyx.allow_synchronize(False)``).
"""
from __future__ import annotations

import builtins
import contextlib
import math
import operator
import os
import re
import sys
import threading
import time
import weakref
from collections import Counter

import numpy as np

from . import pool as _pool
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
#: check (attn's guard, :mod:`attn.fast.graph`) stops it. A survey notes it as a refusal.
_capturing = None

class _PerThread(threading.local):
    """What CuPy keeps per thread: the allocator of ``using_allocator`` (``allocator``), the
    memory hooks in their ``with`` (``hooks``), the current stream (``stream``: None until the
    thread makes one current, :func:`_current_stream`) and those its ``with stream:`` blocks will
    restore (``entered``), and from the allocator, hooks and stream, and the global allocator, the
    allocator new arrays are placed by (``step_allocator``: None for the pool's) and whether they
    go through :func:`_place` at all (``placing``). Another thread starts with none of them (so
    a worker thread inside a step memory's ``with`` allocates from the pool, and launches on the
    default stream whatever stream the thread that started it has made current, as on a GPU)."""
    allocator = None
    hooks: tuple = ()
    stream = None
    step_allocator = None
    placing = False
    generation = -1

    def __init__(self):
        self.entered = []


_tls = _PerThread()


class StreamCaptureError(RuntimeError):
    """An operation CUDA or CuPy does not permit while a stream captures a graph."""


def _refuse_in_capture(what: str, kind: str = "") -> None:
    """Raise :class:`StreamCaptureError` for ``what`` during a capture; a survey
    (``begin_capture(survey=True)``) notes it instead and goes on."""
    if _capturing is not None:
        _capturing.refuse(what, kind or what)


def _caller() -> str:
    """``file:line function`` of the first frame outside the stand-in: who asked for the operation."""
    import sys
    f = sys._getframe(2)
    while f is not None and "fakecupy" in f.f_code.co_filename:
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename
    for root in ("/attn/", "/tests/", "/lessons/"):
        if root in path:
            path = path[path.rindex(root) + 1:]
            break
    return f"{path}:{f.f_lineno} {f.f_code.co_name}"


def _record(redo, stream: int | None = None) -> None:
    """During a capture: keep ``redo`` (a function that runs the operation just run again, into
    the same memory) for the graph. An operation on another stream (another thread's, whose
    current stream is its own, or this thread's inside a ``with`` of another) is refused: on a GPU
    it runs at once, outside the graph, which the stand-in, undoing everything at the end of the
    capture, cannot do beside it. ``stream``: the handle it was launched on (None: the current
    stream's)."""
    ptr = _current_stream().ptr if stream is None else int(stream)
    if ptr != _capturing.stream.ptr:
        raise StreamCaptureError(
            f"fakecupy: an operation on {'the null stream' if ptr == 0 else f'stream {ptr:#x}'} "
            f"(thread {threading.current_thread().name!r}) while stream {_capturing.stream.ptr:#x} captures: on a "
            "GPU it runs at once, outside the graph (the current stream is per thread); the stand-in cannot run "
            f"it beside a capture ({_caller()})")
    _capturing.ops.append(redo)


def _fresh_results(r, inputs, empty: bool = False) -> list:
    """The NumPy arrays of result ``r`` that share no memory with ``inputs``: new memory (and,
    with ``empty``, the new arrays of no elements, whose memory CuPy asks its allocator for too)."""
    ins = _arrays(inputs, [])
    return [a for a in _arrays(r, []) if (a.size or (empty and a.base is None and not any(a is i for i in ins)))
            and not any(np.may_share_memory(a, i) for i in ins)]


def _record_result(name: str, r, inputs, compute):
    """During a capture: the operation ``name`` gave ``r``; ``compute()`` gives it again. New
    memory in ``r`` is an allocation (refused unless :func:`capture_allocations_allowed`); the
    replay copies ``compute()`` into ``r``. Returns ``r`` with NumPy scalars made 0-d arrays
    (what the caller must wrap, so that the replay writes the device array it gave out)."""
    if isinstance(r, np.generic):
        r = np.asarray(r)
    elif isinstance(r, tuple):
        r = tuple(np.asarray(v) if isinstance(v, np.generic) else v for v in r)
    fresh = _fresh_results(r, inputs)
    pooled = [a for a in fresh if not in_step_memory(a)]     # an allocator's memory is the graph's to keep
    if pooled:
        nbytes = sum(a.nbytes for a in pooled)
        what = (f"{name} allocates {nbytes} bytes from the memory pool (give it out=, or allocate before the "
                "capture)")
        if _capturing.survey:
            _capturing.refuse(what, "pool allocation")
        else:
            _capturing.pool_allocated(what, pooled)
    if not fresh:
        if r is None or not _arrays(r, []):
            _record(compute)
        return r                    # a view: nothing to run again
    _record(lambda: _into(r, compute()))
    return r


def _into(r, v) -> None:
    if isinstance(r, tuple):
        for a, b in zip(r, v):
            _into(a, b)
    elif isinstance(r, np.ndarray):
        np.copyto(r, v, casting="unsafe")


def capture_allocations_allowed() -> bool:
    """Whether an allocation during a capture comes from somewhere the graph may keep: an
    allocator set with ``cupy.cuda.using_allocator`` (or ``set_allocator``) that is not the
    memory pool's, such as attn's step memory. (Its own fallback to the pool is still refused:
    :func:`_record_result` refuses every new array that is not in allocator-given memory.)"""
    return _capturing is not None and _state().step_allocator is not None


# --------------------------------------------------------------------------- allocators

#: The allocator of ``cupy.cuda.set_allocator`` (None: the memory pool's ``malloc``), for every
#: thread (a thread's ``cupy.cuda.using_allocator`` comes first: :class:`_PerThread`), and how
#: many times it was set (each thread's state is worked out again after).
_global_allocator = None
_generation = 0
#: id -> weak reference of every array whose memory an allocator has handed out pieces of.
_allocator_roots: dict = {}


def _update_allocator() -> None:
    """This thread's placing allocator: the current allocator when it is not the memory pool's
    (every new device array is then placed in the memory it returns, a view of the array that
    memory belongs to, so memory handed out twice is shared for real, as on a GPU); and whether
    new arrays are placed at all (such an allocator, or a memory hook listening: it hears every
    allocation from the pool, and every free)."""
    t = _tls
    a = t.allocator if t.allocator is not None else _global_allocator
    t.step_allocator = None if a is None or a == _POOL.malloc else a
    t.placing = t.step_allocator is not None or len(t.hooks) > 0 or _current_stream().ptr != 0
    t.generation = _generation


def _state() -> _PerThread:
    """This thread's allocator state, up to date."""
    t = _tls
    if t.generation != _generation:
        _update_allocator()
    return t


def _pool_block(a: np.ndarray) -> np.ndarray:
    """``a``, new memory from the pool: its block taken from the current stream's arena (or a
    ``cudaMalloc``: :mod:`fakecupy.pool`) and given back when the last array on it goes; every
    memory hook told of its allocation now and of its free then (the block rounded up to 512
    bytes, as CuPy's pool rounds it)."""
    hooks = list(_tls.hooks)
    if not a.nbytes:
        return a
    block = _POOL.hand_out(a.nbytes)
    if not hooks and block is None:
        return a
    if block is None:
        ptr, size = a.__array_interface__["data"][0], _pool.rounded(a.nbytes)
    else:
        ptr, size = block.ptr, block.size
    for hook in hooks:
        hook.malloc_preprocess(device_id=0, size=a.nbytes, mem_size=size)
        hook.malloc_postprocess(device_id=0, size=a.nbytes, mem_size=size, mem_ptr=ptr, pmem_id=ptr)

    def freed():
        for hook in hooks:
            if hook in _tls.hooks:                # (the freeing thread's hooks, as CuPy's)
                hook.free_preprocess(device_id=0, mem_size=size, mem_ptr=ptr, pmem_id=ptr)
                hook.free_postprocess(device_id=0, mem_size=size, mem_ptr=ptr, pmem_id=ptr)
        if block is not None:
            _POOL.give_back(block)
    weakref.finalize(_root(a), freed)
    return a


def _root(a: np.ndarray) -> np.ndarray:
    """The NumPy array owning ``a``'s memory (through the :class:`UnownedMemory` an array placed in
    allocator-wrapped memory keeps alive)."""
    while True:
        b = a.base
        if isinstance(b, np.ndarray):
            a = b
        elif isinstance(b, UnownedMemory) and b._root is not None:
            a = b._root
        else:
            return a


def in_step_memory(a: np.ndarray) -> bool:
    """Whether ``a`` lies in memory an allocator other than the pool handed out."""
    root = _root(a)
    ref = _allocator_roots.get(id(root))
    return ref is not None and ref() is root


def _place(r, inputs):
    """The result ``r`` of an operation with its new arrays (those sharing no memory with
    ``inputs``) moved into memory from the current allocator, as CuPy allocates them: each
    one asks the allocator for its bytes and, given allocator memory, becomes a view of it
    holding the same values; given pool memory, stays as it is. NumPy scalars come back as
    0-d arrays (CuPy's 0-d device arrays are allocations too)."""
    alloc = _state().step_allocator or _POOL.malloc
    if isinstance(r, np.generic):
        r = np.asarray(r)
    elif isinstance(r, tuple):
        r = tuple(np.asarray(v) if isinstance(v, np.generic) else v for v in r)
    fresh = {id(a) for a in _fresh_results(r, inputs, empty=True)}      # zero-size ones too, as CuPy asks
    if not fresh:
        return r

    def moved(a):
        if isinstance(a, tuple):
            return tuple(moved(v) for v in a)
        if isinstance(a, list):
            return [moved(v) for v in a]
        if not isinstance(a, np.ndarray) or id(a) not in fresh:
            return a
        mp = alloc(a.nbytes)
        mem = getattr(mp, "mem", None)
        if isinstance(mem, UnownedMemory):            # memory the allocator wrapped: arrays keep it alive
            if mem._root is None:
                mem._attach(_pool_block(a) if mem.size else a)     # the pool's: the new array's own memory
                return mem._view(0, a.shape, a.dtype)
            if mp._offset + a.nbytes > mem._offset + mem.size:
                raise ValueError(f"fakecupy: the allocator returned {mem._offset + mem.size - mp._offset} bytes "
                                 f"for a request of {a.nbytes}")
            root = mem._root
            ref = _allocator_roots.get(id(root))
            if ref is None or ref() is not root:
                _allocator_roots[id(root)] = weakref.ref(root)
            v = mem._view(mp._offset - mem._offset, a.shape, a.dtype)
            v[...] = a
            return v
        root = getattr(mp, "_root", None)
        if root is None:
            return _pool_block(a)                     # the allocator gave memory from the pool
        if mp._offset + a.nbytes > root.nbytes:
            raise ValueError(f"fakecupy: the allocator returned {root.nbytes - mp._offset} bytes for a request "
                             f"of {a.nbytes}")
        ref = _allocator_roots.get(id(root))
        if ref is None or ref() is not root:          # (an id is used again once its array has gone)
            _allocator_roots[id(root)] = weakref.ref(root)
        v = np.ndarray(a.shape, a.dtype, buffer=root, offset=mp._offset)
        v[...] = a
        return v
    return moved(r)


def _placed(a: np.ndarray) -> np.ndarray:
    """A new array made without a result to compare (``ndarray(shape)``, a random draw, a copy
    from the host): placed as :func:`_place` places results."""
    return a if not _state().placing else _place(a, ())


def _using_allocator(allocator=None):
    """``cupy.cuda.using_allocator``: the thread's allocator inside the ``with``."""
    @contextlib.contextmanager
    def scope():
        previous = _tls.allocator
        _tls.allocator = _raw_malloc if allocator is None else allocator
        _update_allocator()
        try:
            yield
        finally:
            _tls.allocator = previous
            _update_allocator()
    return scope()


def _set_allocator(allocator=None) -> None:
    global _global_allocator, _generation
    if _tls.allocator is not None:
        raise ValueError("Can't change the global allocator inside `using_allocator` context manager")
    _global_allocator = _raw_malloc if allocator is None else allocator
    _generation += 1


def _get_allocator():
    a = _tls.allocator if _tls.allocator is not None else _global_allocator
    return _POOL.malloc if a is None else a


def _raw_malloc(size: int) -> "MemoryPointer":
    """``cupy.cuda.memory._malloc``: memory straight from the device, which the stand-in, like
    the pool, does not track (a new NumPy array)."""
    return MemoryPointer(None)


def _live_roots() -> dict:
    """id -> the NumPy array that owns the memory of every live device array."""
    import gc
    roots = {}
    for obj in gc.get_objects():
        if type(obj) is ndarray:
            a = _root(obj._a)
            roots[id(a)] = a
    return roots


class _Capture:
    def __init__(self, stream, survey: bool, mode: int):
        self.stream, self.ops, self.survey, self.mode = stream, [], survey, mode
        self.thread = threading.get_ident()
        #: (kind, what, caller) of every refused operation of a survey
        self.refused: list = []
        #: (what, caller) of every allocation from the memory pool (recorded, not refused)
        self.pool_allocations: list = []
        self.before = {i: (a, a.copy()) for i, a in _live_roots().items() if a.flags.writeable}

    def refuse(self, what: str, kind: str) -> None:
        if not self.survey:
            raise StreamCaptureError(f"operation not permitted when stream is capturing: {what} "
                                     f"(at {_caller()})")
        self.refused.append((kind, what, _caller()))

    @staticmethod
    def allocations_ok() -> bool:
        return False

    def pool_allocated(self, what: str, arrays: list) -> None:
        """A pool allocation during the capture: recorded (the pool counted its block and told
        the hooks as the array was made; the graph's operations keep the array, so the block)."""
        self.pool_allocations.append((what, _caller()))

    def undo(self) -> None:
        for a, saved in self.before.values():
            np.copyto(a, saved)
        for i, a in _live_roots().items():
            if i not in self.before and a.flags.writeable and a.size:
                _poison(a)


def _poison(a: np.ndarray) -> None:
    if a.dtype.kind in "fc":
        a.fill(np.nan)
    elif a.dtype.kind in "iu":
        a.fill(np.iinfo(a.dtype).max)
    elif a.dtype.kind == "b":
        a.fill(True)


class Graph:
    """``cupy.cuda.Graph``: what a stream captured. :meth:`launch` runs the captured operations
    again, in order, on the memory they were captured with and with the scalars they were
    given then (a host number that changes later does not change the graph)."""

    def __init__(self, ops, refused=()):
        self._ops = tuple(ops)
        #: what a survey found that a capture refuses: (kind, what, caller) each
        self.refused = list(refused)

    def launch(self, stream=None):
        if self.refused:
            raise StreamCaptureError(f"fakecupy: this graph was a survey with {len(self.refused)} refused "
                                     "operations; it cannot be launched")
        if _capturing is not None:
            raise StreamCaptureError("fakecupy: launching a graph while a stream captures is not modelled")
        for op in self._ops:
            op()
        if _order is not None:
            _order.graph_launched(self, (_current_stream() if stream is None else stream).ptr)
        if tracer is not None:
            tracer("graph", "graph launch", [], [], {"fresh": [], "operations": len(self._ops)})

    def __len__(self):
        return len(self._ops)


def _arrays(x, out: list) -> list:
    """The NumPy arrays in x (recursively through tuples and lists), appended to out."""
    if isinstance(x, np.ndarray):
        out.append(x)
    elif isinstance(x, ndarray):
        out.append(x._a)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _arrays(v, out)
    return out


def _report(kind: str, name: str, inputs, result, out_given: bool = False, **info) -> None:
    """Report one operation to the tracer. ``kind`` "auto": a view of an input is no launch
    (nothing reported), anything else a kernel of the kind its name says (elementwise unless
    it is a known reduction, sort, product, copy or bare allocation)."""
    ins, outs = _arrays(inputs, []), _arrays(result, [])
    fresh = [] if out_given else [r for r in outs if r.size and not any(np.may_share_memory(r, i) for i in ins)]
    if kind == "auto":
        if outs and not fresh and not out_given:
            return                                          # a view: no kernel, no memory
        base = name.rsplit(".", 1)[-1]
        kind = ("reduction" if base in _REDUCTIONS or name in _REDUCTIONS else "sort" if base in _SORTS
                else "matmul" if base in _MATMULS else "copy" if base in _COPIES
                else "alloc" if base in _ALLOC_ONLY else "elementwise")
        if kind == "matmul":
            return _report_matmul(name, inputs, result, out_given)
    info.update(_allocated(fresh))
    tracer(kind, name, ins, outs, info)


def _allocated(fresh: list, temporary: bool = False) -> dict:
    """The tracer's ``fresh`` (new arrays from the memory pool) and ``step_memory`` (new arrays
    in memory an allocator other than the pool handed out) of an operation's new arrays.
    ``temporary``: CuPy's own scratch (a product's operand copies), which the current
    allocator serves (the stand-in only counts it)."""
    step_allocator = _state().step_allocator
    if not _allocator_roots and step_allocator is None:
        return {"fresh": fresh}
    if temporary:
        return {"fresh": fresh, "step_memory": []} if step_allocator is None else {"fresh": [], "step_memory": fresh}
    mine = [a for a in fresh if in_step_memory(a)]
    return {"fresh": [a for a in fresh if not in_step_memory(a)], "step_memory": mine}


def _copied_for_cublas(a: np.ndarray, batched: bool) -> bool:
    """Whether CuPy's ``matmul`` copies operand ``a`` before cuBLAS sees it (CuPy 13/14,
    ``cupy/_core/_routines_linalg.pyx``): a batched product (an operand of more than two
    dimensions) makes every operand C-contiguous (``ascontiguousarray``), so a head view or a
    transposed batch is copied; a plain product (``dot``) takes a C- or Fortran-contiguous
    matrix (a transposed one) as it is and copies any other view."""
    if a.size <= 1:
        return False
    if batched:
        return not a.flags.c_contiguous
    return not (a.flags.c_contiguous or a.flags.f_contiguous)


def _report_matmul(name: str, inputs, result, out_given: bool) -> None:
    """A product as CuPy runs it: a copy of each operand cuBLAS is not given as it is, the
    GEMM, and, where ``out`` is not C-contiguous, the product into a new array copied into it."""
    operands = _arrays(inputs, [])[:2]
    batched = max((a.ndim for a in operands), default=0) > 2
    for a in operands:
        if _copied_for_cublas(a, batched):
            tracer("copy", "matmul operand copy", [a], [a], _allocated([a], temporary=True))
    outs = _arrays(result, [])
    fresh = [] if out_given else [r for r in outs if not any(np.may_share_memory(r, i) for i in operands)]
    if out_given and outs and not outs[0].flags.c_contiguous:
        tracer("matmul", name, operands, outs, _allocated(outs, temporary=True))
        tracer("copy", "matmul out= copy", outs, outs, {"fresh": []})
        return
    tracer("matmul", name, operands, outs, _allocated(fresh))


# --------------------------------------------------------------------------- wrapping


def _host_refused(where: str, x) -> TypeError:
    return TypeError(f"Unsupported type {type(x)} in {where}: a host numpy.ndarray cannot take part in a "
                     "device operation (move it with cupy.asarray first)")


_PLAIN = frozenset({int, float, bool, str, type(None), slice, type(Ellipsis), np.dtype, complex})


def _unwrap(x, where: str, allow_host: bool = False):
    """Device arrays -> their NumPy arrays, recursively through lists, tuples and dicts;
    a host ``numpy.ndarray`` raises TypeError unless ``allow_host``."""
    t = type(x)
    if t is ndarray:
        return x._a
    if t in _PLAIN:
        return x
    if isinstance(x, np.ndarray):
        if allow_host:
            return x
        raise _host_refused(where, x)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, where, allow_host) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v, where, allow_host) for k, v in x.items()}
    return x


def _args(args, where: str) -> list:
    """``_unwrap`` of a call's positional arguments, with a fast path for the usual ones."""
    out = []
    for a in args:
        t = type(a)
        if t is ndarray:
            out.append(a._a)
        elif t in _PLAIN or (t is not np.ndarray and isinstance(a, np.generic)):
            out.append(a)
        else:
            out.append(_unwrap(a, where))
    return out


def _wrap(r):
    """NumPy results -> device arrays; NumPy scalars -> 0-d device arrays (as CuPy returns)."""
    if type(r) is np.ndarray:
        obj = ndarray.__new__(ndarray)
        obj._a = r
        return obj
    if isinstance(r, np.ndarray):
        return ndarray._of(r)
    if isinstance(r, np.generic):
        return ndarray._of(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    if isinstance(r, list):
        return [_wrap(v) for v in r]
    return r


def _out_result(out, r):
    """A call with ``out=`` returns the device array(s) it was given, as CuPy and NumPy do."""
    if out is None:
        return _wrap(r)
    if isinstance(out, ndarray):
        return out
    if isinstance(out, tuple) and len(out) == 1 and isinstance(out[0], ndarray):
        return out[0]
    return _wrap(r)


def _ufunc(uf: np.ufunc, method: str, inputs, kwargs):
    where = f"cupy.{uf.__name__}" + ("" if method == "__call__" else f".{method}")
    if method == "at":
        a, idx = inputs[0], inputs[1]
        rest = _unwrap(tuple(inputs[2:]), where)
        target = _unwrap(a, where)
        def wrapped():     # the indices as the kernel reads them when it runs (a replay: the memory's values then)
            return _wrap_index(_index_component(idx), target.shape[0] if target.ndim else 0)
        getattr(uf, "at")(target, wrapped(), *rest)
        if _capturing is not None:
            _record(lambda: getattr(uf, "at")(target, wrapped(), *rest))
        if tracer is not None:
            _report("elementwise", f"{uf.__name__}.at", (target, rest), target, True)
        return None
    args = _args(inputs, where)
    if _capturing is not None and uf is np.matmul:
        _refuse_in_capture("CuPy's matmul calls cuBLAS through CuPy, which refuses while the stream captures",
                          "CuPy matmul")
    if not kwargs:
        r = uf(*args) if method == "__call__" else getattr(uf, method)(*args)
        if _state().placing:
            r = _place(r, args)
        if _capturing is not None:
            f = uf if method == "__call__" else getattr(uf, method)
            r = _record_result(where, r, args, lambda: f(*args))
        if tracer is not None:
            _report_ufunc(uf, method, args, r, False)
        return _wrap(r)
    kw = _unwrap(kwargs, where)
    r = getattr(uf, method)(*args, **kw) if method != "__call__" else uf(*args, **kw)
    if _state().placing and kw.get("out") is None:
        r = _place(r, args)
    if _capturing is not None:
        f = uf if method == "__call__" else getattr(uf, method)
        if kw.get("out") is not None:
            _record(lambda: f(*args, **kw))
        else:
            r = _record_result(where, r, args, lambda: f(*args, **kw))
    if tracer is not None:
        _report_ufunc(uf, method, args, r, kwargs.get("out") is not None)
    return _out_result(kwargs.get("out"), r)


def _report_ufunc(uf, method: str, args, r, out_given: bool) -> None:
    if uf is np.matmul:
        return _report_matmul("matmul", args, r, out_given)
    kind = {"reduce": "reduction", "accumulate": "sort"}.get(method, "elementwise")
    _report(kind, uf.__name__ if method == "__call__" else f"{uf.__name__}.{method}", args, r, out_given)


class _Ufunc:
    """``cupy.exp`` and friends: a NumPy ufunc that takes device arrays only."""

    def __init__(self, uf: np.ufunc):
        self._uf = uf
        self.__name__ = uf.__name__
        self.nin, self.nout = uf.nin, uf.nout

    def __call__(self, *args, **kwargs):
        return _ufunc(self._uf, "__call__", args, kwargs)

    def reduce(self, *args, **kwargs):
        return _ufunc(self._uf, "reduce", args, kwargs)

    def accumulate(self, *args, **kwargs):
        return _ufunc(self._uf, "accumulate", args, kwargs)

    def outer(self, *args, **kwargs):
        return _ufunc(self._uf, "outer", args, kwargs)

    def at(self, *args, **kwargs):
        return _ufunc(self._uf, "at", args, kwargs)

    def __repr__(self):
        return f"<fakecupy ufunc '{self.__name__}'>"


#: Functions whose result size depends on the data: CuPy reads a count back from the device.
_DATA_DEPENDENT = {"nonzero", "flatnonzero", "argwhere", "unique", "compress", "extract"}


def _function(name: str, f):
    def call(*args, **kwargs):
        where = f"cupy.{name}"
        a, k = _args(args, where), (_unwrap(kwargs, where) if kwargs else kwargs)
        if name in _DATA_DEPENDENT or (name == "where" and len(args) == 1):
            _sync(f"{name} (result size depends on the data)")
        if _capturing is not None and name in _MATMULS:
            _refuse_in_capture(f"cupy.{name} calls cuBLAS through CuPy, which refuses while the stream captures",
                              "CuPy matmul")
        r = f(*a, **k)
        if _state().placing and k.get("out") is None:
            r = _place(r, (a, list(k.values())))
        if _capturing is not None:
            if k.get("out") is not None:
                _record(lambda: f(*a, **k))
            else:
                r = _record_result(where, r, (a, list(k.values())), lambda: f(*a, **k))
        if tracer is not None:
            _report("auto", name, (a, list(k.values())), r, k.get("out") is not None)
        return _out_result(kwargs.get("out"), r)
    call.__name__ = name
    call.__qualname__ = name
    call.__doc__ = f"fakecupy: numpy.{name} on device arrays."
    return call

# --------------------------------------------------------------------------- indexing


def _index_component(k):
    """One component of an index: device arrays unwrap; host integer arrays and lists are
    sent to the device as CuPy does; ints, slices, None and Ellipsis stay."""
    if isinstance(k, ndarray):
        return k._a
    if isinstance(k, (np.ndarray, list)):
        return np.asarray(k)
    return k


def _wrap_index(k, n: int):
    """CuPy wraps out-of-range integer-array indices: ``ids % n``."""
    if isinstance(k, np.ndarray) and k.dtype.kind in "iu" and n > 0:
        return np.mod(k, n)
    return k


def _prepare_index(key, shape):
    """An index for NumPy with CuPy's semantics. Returns (index, has_bool_mask)."""
    comps = [_index_component(k) for k in (key if isinstance(key, tuple) else (key,))]

    def consumes(k):
        if k is None or k is Ellipsis:
            return 0
        if isinstance(k, np.ndarray) and k.dtype == bool:
            return max(k.ndim, 1)
        return 1
    explicit = sum(consumes(k) for k in comps)
    out, axis, has_mask = [], 0, False
    for k in comps:
        if k is Ellipsis:
            axis += max(len(shape) - explicit, 0)
            out.append(k)
            continue
        if isinstance(k, np.ndarray) and k.dtype == bool and k.ndim > 0:
            has_mask = True
        if axis < len(shape):
            k = _wrap_index(k, shape[axis])
        out.append(k)
        axis += consumes(k)
    return tuple(out), has_mask

# --------------------------------------------------------------------------- the array


class _Flags:
    def __init__(self, a: np.ndarray):
        self.c_contiguous = a.flags.c_contiguous
        self.f_contiguous = a.flags.f_contiguous
        self.owndata = a.flags.owndata

    def __getitem__(self, name):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[name]


class MemoryPointer:
    """``a.data``: where the array's memory begins (``ptr``), in the memory it belongs to (the
    NumPy array owning it; None for memory the stand-in does not track, the pool's).
    ``pointer + n`` is ``n`` bytes further in the same memory, as in CuPy. Taking it makes the
    array's memory reachable by address (:func:`_exposed_memory`), as device memory is to cuBLAS."""

    def __init__(self, a: "np.ndarray | UnownedMemory | None", offset: int = 0):
        self.device_id, self.mem = 0, None
        if isinstance(a, UnownedMemory):                  # cupy.cuda.MemoryPointer(mem, offset)
            self.mem, self._root = a, a._root
            self._offset, self.ptr = a._offset + int(offset), a.ptr + int(offset)
            return
        if a is None:
            self._root, self._offset, self.ptr = None, 0, 0
            return
        _expose(a)
        root = _root(a)
        base = root.__array_interface__["data"][0]
        self._root = root
        self._offset = a.__array_interface__["data"][0] - base + int(offset)
        self.ptr = base + self._offset

    def __add__(self, n: int) -> "MemoryPointer":
        if self._root is None:
            raise TypeError("fakecupy: offsets into untracked memory are not modelled")
        p = MemoryPointer.__new__(MemoryPointer)
        p.device_id, p._root, p._offset, p.ptr = 0, self._root, self._offset + int(n), self.ptr + int(n)
        p.mem = self.mem
        return p


#: CUDA runtime calls made on the host's behalf that cost a round trip to the driver, by name
#: (``UnownedMemory`` without a device id: ``cudaPointerGetAttributes``).
runtime_calls: dict = {"pointerGetAttributes": 0}


class UnownedMemory:
    """``cupy.cuda.UnownedMemory(ptr, size, owner, device_id=-1)``: ``size`` bytes at ``ptr`` that ``owner`` (a
    device array, or a ``MemoryPointer``, the pool's included) keeps. Every array placed in it
    (through ``MemoryPointer(mem, offset)``), and every view of those, keeps it alive, as CuPy's
    arrays keep their memory object: so a weak reference to it says when the last is gone (what
    attn's step memory watches to learn an array's lifetime). Memory the stand-in does not track
    (the pool's) becomes the first array placed in it. Without ``device_id`` CuPy asks the runtime
    for the pointer's device (``cudaPointerGetAttributes``): counted in :data:`runtime_calls`."""

    def __init__(self, ptr: int, size: int, owner, device_id: int = -1):
        if device_id < 0:            # CuPy asks the runtime which device the pointer is on
            runtime_calls["pointerGetAttributes"] += 1
            device_id = 0
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, device_id
        root = None
        if isinstance(owner, ndarray):
            root = _root(owner._a)
        elif isinstance(owner, MemoryPointer):
            root = owner._root
        self._root = root
        self._offset = 0 if root is None else self.ptr - root.__array_interface__["data"][0]
        if root is not None and not 0 <= self._offset <= root.nbytes - self.size:
            raise ValueError(f"fakecupy: UnownedMemory of {self.size} bytes at {self.ptr:#x} lies outside its owner")

    def _attach(self, a: np.ndarray) -> None:
        """Untracked memory (the pool's): ``a``, the first array placed in it, is that memory."""
        self._root, self._offset, self.ptr = a, 0, a.__array_interface__["data"][0]

    @property
    def __array_interface__(self):
        return {"shape": (self.size,), "typestr": "|u1", "version": 3,
                "data": (self._root.__array_interface__["data"][0] + self._offset, False)}

    def _view(self, offset: int, shape, dtype) -> np.ndarray:
        """An array of ``shape`` at ``offset`` in this memory, keeping it alive (its base)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return np.asarray(self)[offset:offset + nbytes].view(dtype).reshape(shape)


#: The memory whose address was taken (``a.data``): id of the NumPy array owning it -> a weak
#: reference to that array. cuBLAS calls resolve device pointers against it (the stand-in's
#: device memory is NumPy memory, so a pointer is a NumPy data address).
_EXPOSED: dict = {}


def _expose(a: np.ndarray) -> None:
    import weakref
    a = _root(a)
    if a.size and id(a) not in _EXPOSED:
        key = id(a)
        _EXPOSED[key] = weakref.ref(a, lambda _r, key=key: _EXPOSED.pop(key, None))


def _exposed_memory() -> list:
    """(first byte, one past the last, owner) of every live array whose address was taken."""
    out = []
    for ref in list(_EXPOSED.values()):
        a = ref()
        if a is not None:
            lo, hi = np.lib.array_utils.byte_bounds(a)
            out.append((lo, hi, a))
    return out


def _binary(uf, reflected=False):
    def op(self, other):
        t = type(other)
        if _capturing is not None and uf is np.matmul:
            _refuse_in_capture("CuPy's matmul (a @ b) calls cuBLAS through CuPy, which refuses while the stream "
                              "captures", "CuPy matmul")
        if t is ndarray:
            x, y = (other._a, self._a) if reflected else (self._a, other._a)
            r = uf(x, y)
            if _state().placing:
                r = _place(r, (x, y))
            if _capturing is not None:
                r = _record_result(f"cupy.{uf.__name__}", r, (x, y), lambda: uf(x, y))
            if tracer is not None:
                _report_ufunc(uf, "__call__", (other._a, self._a) if reflected else (self._a, other._a), r, False)
            return _wrap(r)
        if t in _PLAIN:
            x, y = (other, self._a) if reflected else (self._a, other)
            r = uf(x, y)
            if _state().placing:
                r = _place(r, (self._a,))
            if _capturing is not None:
                r = _record_result(f"cupy.{uf.__name__}", r, (self._a,), lambda: uf(x, y))
            if tracer is not None:
                _report_ufunc(uf, "__call__", (self._a,), r, False)
            return _wrap(r)
        if isinstance(other, np.ndarray):
            raise _host_refused(f"cupy.{uf.__name__}", other)
        if not isinstance(other, (ndarray, np.generic, int, float, complex, builtins.bool)):
            return NotImplemented
        args = (other, self) if reflected else (self, other)
        return _ufunc(uf, "__call__", args, {})
    return op


def _inplace(uf):
    def op(self, other):
        if isinstance(other, np.ndarray):
            raise _host_refused(f"cupy.{uf.__name__}", other)
        o = _unwrap(other, f"cupy.{uf.__name__}")
        a = self._a
        uf(a, o, out=a)
        if _capturing is not None:
            _record(lambda: uf(a, o, out=a))
        if tracer is not None:
            _report("elementwise", uf.__name__, (self._a, o), self._a, True)
        return self
    return op


def _unary(uf):
    def op(self):
        a = self._a
        r = uf(a)
        if _state().placing:
            r = _place(r, (a,))
        if _capturing is not None:
            r = _record_result(f"cupy.{uf.__name__}", r, (a,), lambda: uf(a))
        if tracer is not None:
            _report("elementwise", uf.__name__, (self._a,), r)
        return _wrap(r)
    return op


def _on_memory(memptr: "MemoryPointer", shape, dtype, strides=None) -> np.ndarray:
    """A NumPy array of ``shape`` over the memory ``memptr`` points at (``ndarray(memptr=)``),
    keeping its memory object alive; an error where it does not fit in that memory."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    strides = tuple(strides) if strides is not None else None
    extent = (max((n - 1) * abs(st) for n, st in zip(shape, strides)) + dtype.itemsize if strides
              else int(np.prod(shape, dtype=np.int64)) * dtype.itemsize) if all(shape) else 0
    mem = memptr.mem
    if isinstance(mem, UnownedMemory):
        start = memptr._offset - mem._offset
        if start < 0 or start + extent > mem.size:
            raise ValueError(f"fakecupy: an array of {extent} bytes at offset {start} does not fit in the "
                             f"{mem.size} bytes of its memory")
        flat = np.asarray(mem)[start:start + max(extent, 0)]          # a view whose base keeps mem alive
    else:
        root = memptr._root
        if memptr._offset + extent > root.nbytes:
            raise ValueError(f"fakecupy: an array of {extent} bytes at offset {memptr._offset} does not fit in "
                             f"the {root.nbytes} bytes of its memory")
        flat = root.reshape(-1).view(np.uint8)[memptr._offset:memptr._offset + extent]
    if strides is None:
        return flat.view(dtype).reshape(shape) if extent else np.empty(shape, dtype)
    return np.lib.stride_tricks.as_strided(flat.view(dtype), shape, strides)


class ndarray:
    """A device array of the stand-in: a NumPy array that refuses to be one implicitly."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 1000

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        """A new array, or with ``memptr`` one over the memory it points at, as CuPy's: the array
        keeps that memory (its ``UnownedMemory``, or the array owning it) alive, and writes there."""
        if memptr is not None and memptr._root is not None:
            self._a = _on_memory(memptr, shape, dtype, strides)
            return
        self._a = _placed(np.empty(shape, dtype=dtype, order=order))
        if tracer is not None:
            _report("alloc", "ndarray", (), self._a)

    @classmethod
    def _of(cls, a: np.ndarray) -> "ndarray":
        obj = cls.__new__(cls)
        obj._a = a
        return obj

    # ---- the ways to the host (each one counted)

    def get(self, stream=None, order="C", out=None, blocking=True):
        _sync("get", self._a, stream=stream)
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        """Host -> device copy into this array."""
        _refuse_in_capture("a host->device copy (ndarray.set)", "host transfer")
        self._a[...] = np.asarray(arr)
        if tracer is not None:
            tracer("copy", "host->device", [], [self._a], {"fresh": [], "direction": "h2d"})

    def item(self, *args):
        _sync("item", read=self._a)
        return self._a.item(*args)

    def tolist(self):
        _sync("tolist", read=self._a)
        return self._a.tolist()

    def __float__(self):
        _sync("float", read=self._a)
        return float(self._a)

    def __int__(self):
        _sync("int", read=self._a)
        return int(self._a)

    def __complex__(self):
        _sync("complex", read=self._a)
        return complex(self._a)

    def __bool__(self):
        _sync("bool", read=self._a)
        return builtins.bool(self._a)

    def __index__(self):
        _sync("index", read=self._a)
        return operator.index(self._a)

    def __repr__(self):
        _sync("repr", read=self._a)
        return repr(self._a).replace("array(", "fakecupy.array(", 1)

    def __str__(self):
        _sync("str", read=self._a)
        return str(self._a)

    def __format__(self, spec):
        _sync("format", read=self._a)
        return format(self._a.item() if self._a.ndim == 0 else self._a, spec)

    def __contains__(self, value):
        _sync("contains", read=self._a)
        return value in self._a

    # ---- what CuPy refuses

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        import fakecupy.cupy as cp
        # numpy.linalg.norm -> cupy.linalg.norm, as CuPy looks a function up by its module too
        space = cp.linalg if func.__module__.endswith("linalg") else cp
        try:
            f = getattr(space, func.__name__)
        except AttributeError:
            return NotImplemented
        return f(*args, **kwargs)

    # ---- attributes

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: MemoryPointer(self._a))
    T = property(lambda self: ndarray._of(self._a.T))
    device = property(lambda self: Device(0))

    @shape.setter
    def shape(self, value):
        self._a.shape = value

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (ndarray._of(self._a[i]) if self._a.ndim > 1 else ndarray._of(self._a[i:i + 1].reshape(()))
                for i in range(len(self._a)))

    def __getattr__(self, name):
        # Everything else an ndarray has, on device arrays; never NumPy's conversion hooks.
        if name.startswith("__") or name in ("ctypes",):
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if callable(attr):
            if name == "take":
                return lambda indices, axis=None, out=None, mode=None: take(self, indices, axis=axis, out=out)
            if name in ("nonzero",):
                _sync("nonzero (result size depends on the data)")

            def method(*args, **kwargs):
                where = f"cupy.ndarray.{name}"
                a = _args(args, where)
                k = _unwrap(kwargs, where) if kwargs else {}
                r = attr(*a, **k)
                if _state().placing and k.get("out") is None:
                    r = _place(r, (self._a, a, list(k.values())))
                if _capturing is not None:
                    if k.get("out") is not None:
                        _record(lambda: attr(*a, **k))
                    else:
                        r = _record_result(where, r, (self._a, a, list(k.values())), lambda: attr(*a, **k))
                if tracer is not None:
                    _report("auto", name, (self._a, a, list(k.values())), r, k.get("out") is not None)
                return _out_result(kwargs.get("out"), r) if kwargs else _wrap(r)
            return method
        return _wrap(attr)

    def copy(self, order="C"):
        src = self._a
        r = src.copy(order=order)
        if _state().placing:
            r = _place(r, ())
        if _capturing is not None:
            r = _record_result("cupy.ndarray.copy", r, (), lambda: src)
        if tracer is not None:
            _report("copy", "copy", (self._a,), r)
        return ndarray._of(r)

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    # ---- indexing

    def __getitem__(self, key):
        idx, has_mask = _prepare_index(key, self._a.shape)
        if has_mask:
            _sync("boolean-mask indexing (result size depends on the data)")
        src = self._a
        r = src[idx]
        if isinstance(r, np.generic):            # an element: a 0-d view of it, as CuPy's
            r = src[(idx if isinstance(idx, tuple) else (idx,)) + (Ellipsis,)]
        if _state().placing and isinstance(r, np.ndarray):
            r = _place(r, (src,))
        if _capturing is not None and isinstance(r, np.ndarray):
            shape = src.shape
            r = _record_result("cupy.ndarray.__getitem__", r, (src,), lambda: src[_prepare_index(key, shape)[0]])
        if tracer is not None and isinstance(r, np.ndarray):     # a scalar index is a 0-d view
            _report("auto", "getitem (advanced index)", (self._a,), r)
        return _wrap(r)

    def __setitem__(self, key, value):
        idx, _ = _prepare_index(key, self._a.shape)
        if isinstance(value, np.ndarray):
            whole = idx in ((slice(None),), (Ellipsis,))
            if not whole:
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill "
                                 "(fakecupy, as CuPy: only a[:] = host_array copies from the host)")
            _refuse_in_capture("a host->device copy (a[:] = host_array)", "host transfer")
            self._a[idx] = value
            if tracer is not None:
                tracer("copy", "host->device", [], [self._a], {"fresh": [], "direction": "h2d"})
            return
        v = _unwrap(value, "cupy.ndarray.__setitem__")
        target = self._a
        target[idx] = v
        if _capturing is not None:
            _record(lambda: target.__setitem__(_prepare_index(key, target.shape)[0], v))
        if tracer is not None:
            # a copy kernel from an array, a fill from a scalar; it writes the indexed region
            # (the whole array where the index is an integer array: a scatter)
            basic = all(isinstance(k, (int, np.integer, slice, type(None), type(Ellipsis))) for k in idx)
            _report("copy" if isinstance(v, np.ndarray) and v.ndim else "elementwise", "setitem", (v,),
                    self._a[idx] if basic else self._a, True)

    # ---- arithmetic

    __add__, __radd__, __iadd__ = _binary(np.add), _binary(np.add, True), _inplace(np.add)
    __sub__, __rsub__, __isub__ = _binary(np.subtract), _binary(np.subtract, True), _inplace(np.subtract)
    __mul__, __rmul__, __imul__ = _binary(np.multiply), _binary(np.multiply, True), _inplace(np.multiply)
    __truediv__, __rtruediv__, __itruediv__ = (_binary(np.true_divide), _binary(np.true_divide, True),
                                               _inplace(np.true_divide))
    __floordiv__, __rfloordiv__, __ifloordiv__ = (_binary(np.floor_divide), _binary(np.floor_divide, True),
                                                  _inplace(np.floor_divide))
    __mod__, __rmod__, __imod__ = _binary(np.remainder), _binary(np.remainder, True), _inplace(np.remainder)
    __pow__, __rpow__, __ipow__ = _binary(np.power), _binary(np.power, True), _inplace(np.power)
    __matmul__, __rmatmul__ = _binary(np.matmul), _binary(np.matmul, True)
    __and__, __rand__, __iand__ = _binary(np.bitwise_and), _binary(np.bitwise_and, True), _inplace(np.bitwise_and)
    __or__, __ror__, __ior__ = _binary(np.bitwise_or), _binary(np.bitwise_or, True), _inplace(np.bitwise_or)
    __xor__, __rxor__, __ixor__ = _binary(np.bitwise_xor), _binary(np.bitwise_xor, True), _inplace(np.bitwise_xor)
    __lshift__, __rshift__ = _binary(np.left_shift), _binary(np.right_shift)
    __lt__, __le__, __gt__, __ge__ = _binary(np.less), _binary(np.less_equal), _binary(np.greater), \
        _binary(np.greater_equal)
    __eq__, __ne__ = _binary(np.equal), _binary(np.not_equal)
    __neg__, __pos__, __abs__, __invert__ = _unary(np.negative), _unary(np.positive), _unary(np.absolute), \
        _unary(np.invert)
    __hash__ = None

    def __imatmul__(self, other):
        raise TypeError("In-place matrix multiplication is not supported by CuPy; use a @ b")

def _fast_method(name):
    """The ndarray method ``name`` on device arrays, without going through ``__getattr__``."""
    where = f"cupy.ndarray.{name}"

    def method(self, *args, **kwargs):
        f = getattr(self._a, name)
        a = _args(args, where)
        if _capturing is not None and name == "dot":
            _refuse_in_capture("cupy.ndarray.dot calls cuBLAS through CuPy, which refuses while the stream captures",
                              "CuPy matmul")
        if not kwargs:
            r = f(*a)
            if _state().placing and name != "fill":
                r = _place(r, (self._a, a))
            if _capturing is not None:
                if name == "fill":
                    _record(lambda: f(*a))
                else:
                    r = _record_result(where, r, (self._a, a), lambda: f(*a))
            if tracer is not None:
                _report("elementwise" if name == "fill" else "auto", name, (self._a, a), self._a if name == "fill"
                        else r, name == "fill")
            return _wrap(r)
        k = _unwrap(kwargs, where)
        r = f(*a, **k)
        if _state().placing and k.get("out") is None:
            r = _place(r, (self._a, a, list(k.values())))
        if _capturing is not None:
            if k.get("out") is not None:
                _record(lambda: f(*a, **k))
            else:
                r = _record_result(where, r, (self._a, a, list(k.values())), lambda: f(*a, **k))
        if tracer is not None:
            _report("auto", name, (self._a, a, list(k.values())), r, k.get("out") is not None)
        return _out_result(kwargs.get("out"), r)
    method.__name__ = name
    return method


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


def __getattr__(name):
    """Any other NumPy function or ufunc, taking and giving device arrays."""
    if name.startswith("_"):
        raise AttributeError(name)
    obj = getattr(np, name, None)
    if isinstance(obj, np.ufunc):
        w = _Ufunc(obj)
    elif callable(obj) and not isinstance(obj, type):
        w = _function(name, obj)
    else:
        raise AttributeError(f"module 'fakecupy.cupy' has no attribute {name!r}")
    globals()[name] = w
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


class Device:
    """The one device of the stand-in."""

    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        if self.id != 0:
            raise ValueError(f"fakecupy has one device (0), not {self.id}")

    def synchronize(self):
        _sync("synchronize")
        if _order is not None:
            _order.synchronized()

    def use(self):
        return self

    @property
    def mem_info(self):
        return (1 << 34, 1 << 34)

    @property
    def compute_capability(self):
        return "90"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


#: ``runtime.streamPerThread`` (``cudaStreamPerThread``): the handle of every thread's own default stream
PER_THREAD_STREAM = 2


class Stream:
    null = ptds = None
    #: the next stream's handle: each stream has one of its own, never used again (an ``id`` may
    #: be, and the memory pool keeps a free-block arena per handle: :mod:`fakecupy.pool`)
    _handles = iter(range(0x5000_0000, 1 << 62, 0x100))

    #: handle -> stream, of the streams alive (the asynchronous mode asks which are blocking)
    _made: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.ptr = 0 if null else PER_THREAD_STREAM if ptds else next(Stream._handles)
        self.non_blocking = bool(non_blocking)
        Stream._made[self.ptr] = self

    def begin_capture(self, mode=None, *, survey: bool = False):
        """Record what follows into a graph (see :data:`_capturing`) in ``mode`` (a
        ``runtime.streamCaptureMode*``; None: relaxed, CuPy's default). ``survey`` (the stand-in
        only): note every operation a capture would refuse (:attr:`Graph.refused`) instead of
        raising at the first."""
        global _capturing
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if _capturing is not None:
            raise RuntimeError("fakecupy: a stream is already capturing")
        mode = _Runtime.streamCaptureModeRelaxed if mode is None else int(mode)
        if mode not in (_Runtime.streamCaptureModeGlobal, _Runtime.streamCaptureModeThreadLocal,
                        _Runtime.streamCaptureModeRelaxed):
            raise ValueError(f"fakecupy: unknown stream capture mode {mode}")
        _capturing = _Capture(self, survey, mode)

    def end_capture(self) -> Graph:
        global _capturing
        if _capturing is None or _capturing.stream is not self:
            raise RuntimeError("fakecupy: end_capture on a stream that is not capturing")
        capture, _capturing = _capturing, None
        capture.undo()
        graph = Graph(capture.ops, capture.refused)
        graph.pool_allocations = capture.pool_allocations
        if _order is not None:
            _order.end_capture(capture, graph)
        return graph

    def is_capturing(self) -> bool:
        return _capturing is not None and _capturing.stream is self

    def record(self, event=None):
        """An event recorded on this stream (here all work is done when a call returns)."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def synchronize(self):
        _sync("synchronize")
        if _order is not None:
            _order.synchronized(self.ptr)

    def wait_event(self, event):
        """Work queued later waits for ``event`` (the asynchronous mode keeps the order: :data:`_order`)."""
        if _order is not None:
            _order.waited(self.ptr, event)

    def use(self):
        """This thread's current stream is this one (until another ``use`` or ``with``)."""
        _tls.stream = self
        _update_allocator()
        return self

    def __enter__(self):
        _tls.entered.append(_current_stream())
        return self.use()

    def __exit__(self, *exc):
        _tls.entered.pop().use()
        return False


Stream.null = Stream(null=True)
#: ``cudaStreamPerThread``: each thread's own default stream, blocking as the streams it makes
#: (the asynchronous mode keeps one per thread: :meth:`fakecupy.streams.Order.key`).
Stream.ptds = Stream(ptds=True)
#: Whether a thread that made no stream current launches on ``Stream.ptds`` (CuPy reads
#: ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM`` at import, as here).
_PTDS = os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")


def _current_stream() -> Stream:
    """``cupy.cuda.get_current_stream()``: the stream this thread made current last (``use``,
    or the innermost ``with stream:`` it is in), as CuPy keeps it per thread; in a thread that
    has made none current, the null stream (``Stream.ptds`` with :data:`_PTDS`)."""
    s = _tls.stream
    if s is not None:
        return s
    return Stream.ptds if _PTDS else Stream.null


#: The asynchronous mode's order of launches (a :class:`fakecupy.streams.Order`), or None.
_order = None


@contextlib.contextmanager
def asynchronous():
    """``with asynchronous():`` each launch is queued on its stream and has run only once the host
    or its stream waited for it: a read of a result before that raises
    :class:`fakecupy.streams.ReadBeforeRunError` (see :mod:`fakecupy.streams`). It is the tracer
    while on (a tracer set before it is still told everything)."""
    global _order, tracer
    from .streams import Order
    if _order is not None:
        yield _order
        return
    previous = tracer
    _order = tracer = Order(sys.modules[__name__], previous)
    try:
        yield _order
    finally:
        _order, tracer = None, previous


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()
        if _order is not None:
            _order.recorded(self, (_current_stream() if stream is None else stream).ptr)

    def synchronize(self):
        _sync("synchronize")
        if _order is not None:
            _order.event_done(self)


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events."""
    return (end._t - start._t) * 1e3


class MemoryHook:
    """``cupy.cuda.MemoryHook``: while one is registered (its ``with``, in this thread: CuPy's
    hooks are per thread, as its ``using_allocator``), every device array made
    from the pool is an allocation it hears of (``malloc_pre/postprocess``, the block rounded to
    512 bytes as CuPy's pool rounds it), and its free when the last array on that memory goes
    (``free_pre/postprocess``), as CuPy tells its hooks; memory from another allocator is not the
    pool's, and a hook does not hear of it."""
    name = "MemoryHook"

    def __enter__(self):
        _tls.hooks = _tls.hooks + (self,)
        _update_allocator()
        return self

    def __exit__(self, *exc):
        _tls.hooks = tuple(h for h in _tls.hooks if h is not self)
        _update_allocator()
        return False

    def malloc_preprocess(self, **kwargs):
        pass

    def malloc_postprocess(self, **kwargs):
        pass

    def free_preprocess(self, **kwargs):
        pass

    def free_postprocess(self, **kwargs):
        pass


def _current_stream_ptr() -> int:
    return _current_stream().ptr


def _malloc_refused(size: int) -> None:
    """A ``cudaMalloc`` of the pool now: refused from the capturing thread in the global and
    thread-local capture modes (from any thread in global mode), as CUDA refuses it."""
    c = _capturing
    if c is None or c.mode == _Runtime.streamCaptureModeRelaxed:
        return
    if c.mode == _Runtime.streamCaptureModeGlobal or c.thread == threading.get_ident():
        c.refuse(f"cudaMalloc of {size} bytes by the memory pool, whose arena for the current stream holds no free "
                 "block of that size (a block freed on another stream is not handed to this one)", "pool allocation")


class MemoryPool(_pool.MemoryPool):
    """``cupy.cuda.MemoryPool``: free blocks per stream (:mod:`fakecupy.pool`)."""

    def __init__(self, allocator=None):
        super().__init__(_current_stream_ptr, _malloc_refused)


_POOL, _PINNED_POOL = MemoryPool(), MemoryPool()


def get_default_memory_pool():
    return _POOL


def get_default_pinned_memory_pool():
    return _PINNED_POOL


class _Runtime:
    CUDARuntimeError = RuntimeError
    CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14      # cudaDataType (as _Cublas's)
    streamCaptureModeGlobal, streamCaptureModeThreadLocal, streamCaptureModeRelaxed = 0, 1, 2
    streamPerThread = PER_THREAD_STREAM

    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def getDeviceProperties(device):
        return {"name": b"fakecupy (NumPy stand-in)", "totalGlobalMem": 1 << 34, "major": 9, "minor": 0,
                "multiProcessorCount": 1, "maxThreadsPerBlock": 1024, "sharedMemPerBlock": 48 << 10}

    @staticmethod
    def runtimeGetVersion():
        return 12000

    @staticmethod
    def driverGetVersion():
        return 12000

    @staticmethod
    def deviceSynchronize():
        _sync("synchronize")
        if _order is not None:
            _order.synchronized()


class _Nccl:
    """``cupy.cuda.nccl``: NCCL's all-reduce as attn.training.distributed calls it.

    A communicator of one rank copies the send buffer to the receive buffer; one of several
    ranks needs the ranks to be MPI processes (``mpiexec``) and all-reduces over MPI's
    ``COMM_WORLD``, after checking that every rank was given the same unique id (what rank 0's
    broadcast must ensure). Buffers are device pointers (``a.data.ptr``), as in NCCL; the
    stand-in's device memory is host memory, so no transfer is counted."""
    NCCL_SUM = 0
    NCCL_FLOAT32, NCCL_FLOAT64 = 7, 8
    _DTYPES = {7: np.float32, 8: np.float64}

    @staticmethod
    def get_unique_id():
        import os
        return tuple(int(b) - 128 for b in os.urandom(128))      # NCCL's: 128 signed chars

    class NcclCommunicator:
        def __init__(self, ndev: int, commId, rank: int):
            self.ndev, self.rank_id, self._mpi = int(ndev), int(rank), None
            if self.ndev > 1:
                from mpi4py import MPI
                comm = MPI.COMM_WORLD
                if comm.Get_size() != self.ndev or comm.Get_rank() != self.rank_id:
                    raise RuntimeError(f"fakecupy nccl: rank {rank} of {ndev}, but MPI has rank "
                                       f"{comm.Get_rank()} of {comm.Get_size()}")
                if len(set(comm.allgather(tuple(commId)))) != 1:
                    raise RuntimeError("fakecupy nccl: the ranks were given different unique ids")
                self._mpi = (MPI, comm)

        def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int):
            import ctypes
            if op != _Nccl.NCCL_SUM:
                raise NotImplementedError("fakecupy nccl: only NCCL_SUM")
            dtype = np.dtype(_Nccl._DTYPES[datatype])

            def at(ptr):
                return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype=dtype)
            send, recv = at(sendbuf), at(recvbuf)
            if _order is not None:               # (not a kernel the tracer counts: the asynchronous mode's order)
                n = count * dtype.itemsize
                _order.launch(int(stream), "NCCL all-reduce", _spans(sendbuf, n), _spans(recvbuf, n))
            if self._mpi is None:
                if sendbuf != recvbuf:
                    recv[...] = send
                return
            MPI, comm = self._mpi
            comm.Allreduce(MPI.IN_PLACE if sendbuf == recvbuf else send, recv, op=MPI.SUM)


def _spans(ptr: int, n: int) -> list:
    """[(owner, first byte, one past the last)] of the ``n`` bytes at device address ``ptr``, in
    the memory whose address was taken (none where it is not such memory)."""
    return [(owner, ptr - lo, ptr - lo + n) for lo, hi, owner in _exposed_memory() if lo <= ptr < hi]


def _device_time(f):
    """``f``, its time added to :data:`device_seconds` (the device's work, not the host's)."""
    import functools

    @functools.wraps(f)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            device_seconds[0] += time.perf_counter() - t0
    return timed


class _Cublas:
    """``cupy.cuda.cublas`` (``cupy_backends.cuda.libs.cublas``): the GEMMs attn calls, with
    CuPy 14's signatures and cuBLAS's constants, computed with NumPy exactly as cuBLAS defines
    them (column-major: ``C = alpha op(A) op(B) + beta C`` with ``op(X)`` X or X^T, element
    (i, j) of a stored matrix at ``X + (i + j * ld) * itemsize``; C not read when beta is 0).

    Pointers are device addresses (``a.data.ptr``, here NumPy data addresses). Every matrix a
    call touches, and every pointer array of the batched calls, must lie inside one live device
    array whose address was taken: a wrong ld, stride or pointer raises :class:`CUBLASError`
    instead of reading what lies there. ``alpha`` and ``beta`` are host pointers (the pointer
    mode, host by default, as cuBLAS's) and are read when the call is made, as cuBLAS does; the
    pointer arrays and matrices are read when the work runs, so a captured call replays on what
    memory holds then. During a capture the handle must be on the capturing stream
    (``setStream``): work on another stream is not captured on a GPU.

    As in CuPy, these wrappers refuse every call while a stream captures (each first sets the
    handle's stream, and CuPy's ``setStream`` raises ``NotImplementedError('calling cuBLAS API
    during stream capture is currently unsupported')``); :class:`_DirectCublas`, the library
    called without CuPy (``attn.fast.cublas``), does not.

    The Ex GEMMs (``gemmEx``, ``gemmStridedBatchedEx``) take each matrix's storage type and the
    compute type: bf16 A and B (16-bit patterns, a uint16 array here) into fp32 C, summed in
    float32 from the operands' exact values; all fp32 (an sgemm, TF32 under the handle's TF32
    math mode as sgemm's) or all fp64. Other combinations are ``CUBLAS_STATUS_NOT_SUPPORTED``."""

    #: False for the library called directly (no CuPy wrapper in between)
    _through_cupy = True

    CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_OP_C = 0, 1, 2
    CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE = 0, 1
    CUBLAS_DEFAULT_MATH, CUBLAS_TENSOR_OP_MATH, CUBLAS_PEDANTIC_MATH, CUBLAS_TF32_TENSOR_OP_MATH = 0, 1, 2, 3
    #: cudaDataType (library_types.h; CuPy has them in ``cupy_backends.cuda.api.runtime``), the
    #: storage types of the Ex GEMMs' matrices
    CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
    #: cublasComputeType_t and cublasGemmAlgo_t (cublas_api.h)
    CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F = 68, 77, 70
    CUBLAS_GEMM_DEFAULT, CUBLAS_GEMM_DEFAULT_TENSOR_OP = -1, 99
    HANDLE = 0x5EED0001

    class CUBLASError(RuntimeError):
        pass

    #: handle -> [stream, pointer mode, math mode]
    _state = {HANDLE: [0, 0, 0, None]}     # stream, pointer mode, math mode, workspace

    @classmethod
    def _handle(cls, handle):
        st = cls._state.get(handle)
        if st is None:
            raise cls.CUBLASError(f"CUBLAS_STATUS_NOT_INITIALIZED: {handle!r} is not a cuBLAS handle")
        return st

    @classmethod
    def _cupy_refuses(cls, name):
        if _capturing is not None and cls._through_cupy:
            _refuse_in_capture(f"cupy.cuda.cublas.{name}: calling cuBLAS API during stream capture is currently "
                               "unsupported (CuPy's wrappers refuse; attn.fast.cublas calls the library directly)",
                               "CuPy cuBLAS")

    @classmethod
    def setStream(cls, handle, stream):
        cls._cupy_refuses("setStream")
        cls._handle(handle)[0] = _int(stream, "stream", 64, unsigned=True)

    @classmethod
    def getStream(cls, handle):
        return cls._handle(handle)[0]

    @classmethod
    def setPointerMode(cls, handle, mode):
        if mode not in (0, 1):
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: pointer mode {mode!r}")
        cls._handle(handle)[1] = int(mode)

    @classmethod
    def getPointerMode(cls, handle):
        return cls._handle(handle)[1]

    @staticmethod
    def tf32_taken(m: int, n: int, k: int) -> bool:
        """Whether a GEMM allowed TF32 takes it: TF32 math mode is a permission, not a promise
        (cuBLAS's heuristics run small products on float32 SIMT kernels); here products of fewer
        than 2^16 multiply-adds stay float32."""
        return m * n * k >= 1 << 16

    @classmethod
    def setMathMode(cls, handle, mode):
        """The handle's math mode: with ``CUBLAS_TF32_TENSOR_OP_MATH`` the single-precision GEMMs
        large enough (:meth:`tf32_taken`) read their operands as TF32 (here rounded to 10 stored significand bits, to nearest even,
        by :func:`attn.precision.round_tf32`) and sum in float32; the others as they are."""
        cls._cupy_refuses("setMathMode")
        if int(mode) & ~0x10 not in (0, 1, 2, 3):
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: math mode {mode!r}")
        cls._handle(handle)[2] = int(mode)

    @classmethod
    def getMathMode(cls, handle):
        return cls._handle(handle)[2]

    # ---- the GEMMs (CuPy 14's argument lists)

    @classmethod
    def sgemm(cls, handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        cls._gemm("sgemm", np.float32, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, 0), ("B", B, ldb, 0), ("C", C, ldc, 0), 1, False)

    @classmethod
    def dgemm(cls, handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        cls._gemm("dgemm", np.float64, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, 0), ("B", B, ldb, 0), ("C", C, ldc, 0), 1, False)

    @classmethod
    def sgemmStridedBatched(cls, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
                            beta, C, ldc, strideC, batchCount):
        cls._gemm("sgemmStridedBatched", np.float32, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, strideA), ("B", B, ldb, strideB), ("C", C, ldc, strideC), batchCount, False)

    @classmethod
    def dgemmStridedBatched(cls, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
                            beta, C, ldc, strideC, batchCount):
        cls._gemm("dgemmStridedBatched", np.float64, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, strideA), ("B", B, ldb, strideB), ("C", C, ldc, strideC), batchCount, False)

    @classmethod
    def sgemmBatched(cls, handle, transa, transb, m, n, k, alpha, Aarray, lda, Barray, ldb, beta, Carray, ldc,
                     batchCount):
        cls._gemm("sgemmBatched", np.float32, handle, transa, transb, m, n, k, alpha, beta,
                  ("Aarray", Aarray, lda, None), ("Barray", Barray, ldb, None), ("Carray", Carray, ldc, None),
                  batchCount, True)

    @classmethod
    def dgemmBatched(cls, handle, transa, transb, m, n, k, alpha, Aarray, lda, Barray, ldb, beta, Carray, ldc,
                     batchCount):
        cls._gemm("dgemmBatched", np.float64, handle, transa, transb, m, n, k, alpha, beta,
                  ("Aarray", Aarray, lda, None), ("Barray", Barray, ldb, None), ("Carray", Carray, ldc, None),
                  batchCount, True)

    # ---- the mixed-precision GEMMs: each matrix's storage type and the compute type are arguments

    #: (Atype, Btype, Ctype, computeType) -> the storage dtypes of A, B, C and the compute dtype
    #: (that of alpha and beta): the combinations modelled. bf16 matrices hold 16-bit patterns
    #: (uint16 in device memory), read as the float32 they are the top half of.
    _EX_TYPES = {(14, 14, 0, 68): ((np.uint16, np.uint16, np.float32), np.float32),     # bf16 x bf16 -> fp32
                 (0, 0, 0, 68): ((np.float32,) * 3, np.float32),                      # an sgemm
                 (1, 1, 1, 70): ((np.float64,) * 3, np.float64)}                      # a dgemm
    _TYPE_NAMES = {0: "CUDA_R_32F", 1: "CUDA_R_64F", 2: "CUDA_R_16F", 14: "CUDA_R_16BF",
                   68: "CUBLAS_COMPUTE_32F", 77: "CUBLAS_COMPUTE_32F_FAST_TF32", 70: "CUBLAS_COMPUTE_64F"}

    @classmethod
    def _ex_types(cls, name, Atype, Btype, Ctype, computeType, algo):
        """The storage dtypes and the compute dtype of an Ex GEMM's type arguments; a
        combination not modelled, or an algo other than the default ones, is cuBLAS's
        ``CUBLAS_STATUS_NOT_SUPPORTED`` (what it answers for combinations it lacks)."""
        cls._cupy_refuses(name)                     # CuPy's wrapper sets the stream before anything
        types = tuple(_int(t, w, 32) for t, w in ((Atype, "Atype"), (Btype, "Btype"), (Ctype, "Ctype"),
                                                  (computeType, "computeType")))
        algo = _int(algo, "algo", 32)
        got = cls._EX_TYPES.get(types)
        if got is None:
            named = ", ".join(f"{w} {cls._TYPE_NAMES.get(t, t)}"
                              for t, w in zip(types, ("Atype", "Btype", "Ctype", "computeType")))
            raise cls.CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: {name}: {named} (the stand-in models bf16 x bf16 "
                                  "-> fp32, fp32 and fp64, with the compute type of their precision)")
        if algo not in (cls.CUBLAS_GEMM_DEFAULT, cls.CUBLAS_GEMM_DEFAULT_TENSOR_OP):
            raise cls.CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: {name}: algo {algo} (the stand-in models "
                                  "CUBLAS_GEMM_DEFAULT and CUBLAS_GEMM_DEFAULT_TENSOR_OP)")
        return got

    @classmethod
    def gemmEx(cls, handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
               computeType, algo):
        dtypes, dtype = cls._ex_types("gemmEx", Atype, Btype, Ctype, computeType, algo)
        cls._gemm("gemmEx", dtype, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, 0), ("B", B, ldb, 0), ("C", C, ldc, 0), 1, False, dtypes=dtypes)

    @classmethod
    def gemmStridedBatchedEx(cls, handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
                             strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
        dtypes, dtype = cls._ex_types("gemmStridedBatchedEx", Atype, Btype, Ctype, computeType, algo)
        cls._gemm("gemmStridedBatchedEx", dtype, handle, transa, transb, m, n, k, alpha, beta,
                  ("A", A, lda, strideA), ("B", B, ldb, strideB), ("C", C, ldc, strideC), batchCount, False,
                  dtypes=dtypes)

    # ---- what they compute

    @classmethod
    @_device_time
    def _gemm(cls, name, dtype, handle, transa, transb, m, n, k, alpha, beta, A, B, C, count, arrays, dtypes=None):
        """One GEMM call, checked and run. ``dtype`` is the compute type (alpha's and beta's, and
        the sums'); ``dtypes`` the storage dtypes of A, B and C (all ``dtype`` when not given):
        uint16 is bf16 patterns, read as the float32 values they are the top half of. Lengths,
        strides and alignment are in each matrix's own elements."""
        cls._cupy_refuses(name)
        dtypes = tuple(np.dtype(d) for d in (dtypes or (dtype,) * 3))
        stream, mode, math, workspace = cls._handle(handle)
        if _capturing is not None and not cls._through_cupy and workspace is None:
            _refuse_in_capture(f"cuBLAS {name} in its default workspace during a capture (cublasSetStream puts a "
                               "handle back on it: set the workspace again after it)", "cuBLAS default workspace")
        tf32 = dtype == np.float32 and math & ~0x10 == cls.CUBLAS_TF32_TENSOR_OP_MATH    # read at the call
        tf32 = tf32 and cls.tf32_taken(_int(m, "m", 32), _int(n, "n", 32), _int(k, "k", 32))
        ta, tb = (_int(t, f"trans{w}", 32) for t, w in ((transa, "a"), (transb, "b")))
        m, n, k, count = (_int(v, w, 32) for v, w in ((m, "m"), (n, "n"), (k, "k"), (count, "batchCount")))
        if ta not in (0, 1, 2) or tb not in (0, 1, 2):
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: {name}: transa {ta}, transb {tb}")
        if min(m, n, k, count) < 0:
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: {name}: m {m}, n {n}, k {k}, batchCount {count}")
        # the stored shapes (rows, columns) of A, B and C: op(A) is m x k, op(B) k x n, C m x n
        shapes = {"A": (m, k) if ta == 0 else (k, m), "B": (k, n) if tb == 0 else (n, k), "C": (m, n)}
        specs = []
        for (what, ptr, ld, stride), key in zip((A, B, C), "ABC"):
            ld = _int(ld, f"ld{key.lower()}", 32)
            rows, cols = shapes[key]
            if ld < max(1, rows):
                raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: {name}: ld{key.lower()} {ld} < max(1, {rows}) "
                                      f"(the rows of the stored {key}, {rows} x {cols})")
            stride = None if stride is None else _int(stride, f"stride{key}", 64)
            specs.append((what, _int(ptr, what, 64, unsigned=True), ld, stride, rows, cols))
        if _capturing is not None and stream != _capturing.stream.ptr:
            _refuse_in_capture(f"cuBLAS {name} on stream {stream:#x}, not the capturing stream (setStream first)",
                               "cuBLAS off the capturing stream")
        if mode == cls.CUBLAS_POINTER_MODE_HOST:
            a_s, b_s = (_host_scalar(p, dtype, w) for p, w in ((alpha, "alpha"), (beta, "beta")))
            def scalars():
                return a_s, b_s
        else:
            def scalars():                   # device pointers: read when the work runs
                return tuple(_device_scalar(p, dtype, w) for p, w in ((alpha, "alpha"), (beta, "beta")))

        def run():
            if m == 0 or n == 0 or count == 0:
                return [np.empty(0, dt) for dt in dtypes]
            al, be = scalars()
            ops = []
            for (what, ptr, ld, stride, rows, cols), dt in zip(specs, dtypes):
                ptrs = (_device_words(ptr, count, f"{name} {what}") if arrays
                        else ptr + np.arange(count, dtype=np.int64) * (stride * dt.itemsize))
                ops.append(_Matrices(ptrs, rows, cols, ld, dt, f"{name} {what}"))
            a, b, c = ops
            spans[:] = [a.spans() + b.spans(), c.spans()]
            for x, which in ((a, "A"), (b, "B")):
                if c.overlaps(x):               # cuBLAS reads and writes as it goes: the result is undefined
                    raise cls.CUBLASError(f"fakecupy cublas {name}: C shares memory with {which} (cuBLAS does "
                                          "not allow aliasing: the result would be undefined)")
            sa, sb = a.read(), b.read()         # as stored (bf16: 16-bit patterns)
            ra, rb = (_bf16_values(x) if x.dtype == np.uint16 else x for x in (sa, sb))
            if tf32:
                from attn.precision import round_tf32
                ra, rb = round_tf32(ra), round_tf32(rb)
            opa = ra if ta == 0 else ra.transpose(0, 2, 1)
            opb = rb if tb == 0 else rb.transpose(0, 2, 1)
            r = np.matmul(opa, opb) if k else np.zeros((count, m, n), dtype=dtype)
            if al != 1:
                r *= dtype(al)
            if be != 0:
                r += dtype(be) * c.read()
            c.write(r)
            return [sa, sb, r]                  # what was read and written (the tracer's bytes)

        spans = [[], []]                        # (owner, first byte, past the last) read, written
        touched = run()
        if _capturing is not None:
            _record(run, stream)
        if tracer is not None:
            tracer("matmul", f"cublas {name}", touched[:2], touched[2:], {"fresh": [], "stream": stream,
                                                                          "read_at": spans[0], "written_at": spans[1]})


class _Matrices:
    """``count`` stored matrices (rows x cols, column-major with leading dimension ``ld``) at
    device addresses ``ptrs``: each inside one live device array, else :class:`_Cublas.CUBLASError`."""

    def __init__(self, ptrs, rows, cols, ld, dtype, what):
        item = np.dtype(dtype).itemsize
        ptrs = np.asarray(ptrs, dtype=np.int64)
        extent = ((cols - 1) * ld + rows) * item if rows and cols else 0
        self.shape, self.dtype, self.arrays = (rows, cols), np.dtype(dtype), []
        self._extent = extent
        self._parts = []                    # (indices into the batch, element view of the owner, offsets)
        left = np.ones(len(ptrs), dtype=bool)
        if extent == 0:
            return
        for lo, hi, owner in _exposed_memory():
            inside = left & (ptrs >= lo) & (ptrs + extent <= hi)
            if not inside.any():
                continue
            if (lo % item) or ((ptrs[inside] - lo) % item).any():
                raise _Cublas.CUBLASError(f"fakecupy cublas {what}: a pointer not aligned to {item} bytes")
            mem = _memory_at(lo, (hi - lo) // item, self.dtype)
            self._parts.append((np.flatnonzero(inside), mem, (ptrs[inside] - lo) // item, owner))
            self.arrays.append(owner)
            left &= ~inside
            if not left.any():
                break
        if left.any():
            i = int(np.flatnonzero(left)[0])
            raise _Cublas.CUBLASError(
                f"fakecupy cublas {what}: matrix {i} of {len(ptrs)}, {rows} x {cols} (column-major, ld {ld}) at "
                f"{int(ptrs[i]):#x}, {extent} bytes, is not inside any live device array")
        rr, cc = np.arange(rows), np.arange(cols)
        self._cell = rr[:, None] + cc[None, :] * ld                     # (rows, cols) element offsets
        self._n = len(ptrs)

    def addresses(self) -> np.ndarray:
        """The device address of every element these matrices touch (sorted)."""
        item = self.dtype.itemsize
        found = [mem.__array_interface__["data"][0] + (off[:, None, None] + self._cell).ravel() * item
                 for _, mem, off, _ in self._parts]
        return np.sort(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)

    def overlaps(self, other: "_Matrices") -> bool:
        """Whether a byte of these matrices is a byte of ``other``'s (their spans first: the usual
        answer, no; then element by element)."""
        mine, theirs = self.addresses(), other.addresses()
        a, b = self.dtype.itemsize, other.dtype.itemsize
        if not mine.size or not theirs.size or mine[-1] + a <= theirs[0] or theirs[-1] + b <= mine[0]:
            return False
        g = math.gcd(a, b)                       # compare in units of g bytes
        units = [(x[:, None] + np.arange(0, w, g)).ravel() for x, w in ((mine, a), (theirs, b))]
        return np.intersect1d(*units).size > 0

    def spans(self) -> list:
        """(owner, first byte, one past the last) in each array these matrices lie in."""
        item = self.dtype.itemsize
        return [(owner, int(off.min()) * item, int(off.max()) * item + self._extent)
                for _, _, off, owner in self._parts]

    def read(self):
        out = np.empty((self._n,) + self.shape, dtype=self.dtype)
        for idx, mem, off, _ in self._parts:
            out[idx] = mem[off[:, None, None] + self._cell]
        return out

    def write(self, r):
        for idx, mem, off, _ in self._parts:
            mem[off[:, None, None] + self._cell] = r[idx]


def _bf16_values(h: np.ndarray) -> np.ndarray:
    """bf16 16-bit patterns (uint16) as the float32 values they are the top half of (exact)."""
    return (h.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _memory_at(address: int, n: int, dtype) -> np.ndarray:
    """The n elements of ``dtype`` at a device address (NumPy memory here), writable."""
    import ctypes
    return np.frombuffer((ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(address), dtype=dtype)


def _device_words(ptr: int, count: int, what: str) -> np.ndarray:
    """The ``count`` 64-bit pointers of a device pointer array at ``ptr``."""
    m = _Matrices([ptr], count, 1, max(count, 1), np.uint64, f"{what} (pointer array)")
    return m.read().reshape(-1).astype(np.int64) if count else np.empty(0, np.int64)


def _host_scalar(ptr, dtype, what: str):
    """A scalar at a host address (pointer mode host), read now."""
    import ctypes
    ptr = _int(ptr, what, 64, unsigned=True)
    if not ptr:
        raise _Cublas.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: {what} is a null pointer")
    return np.frombuffer((ctypes.c_char * np.dtype(dtype).itemsize).from_address(ptr), dtype=dtype)[0].copy()


def _device_scalar(ptr, dtype, what: str):
    return _Matrices([_int(ptr, what, 64, unsigned=True)], 1, 1, 1, dtype, what).read().reshape(())[()]


def _int(v, what: str, bits: int, unsigned: bool = False) -> int:
    """An argument CuPy's Cython wrapper converts to a C integer of ``bits`` bits (a pointer:
    ``size_t``, unsigned)."""
    if isinstance(v, (builtins.bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"fakecupy cublas: {what} must be an integer, got {type(v).__name__} {v!r}")
    v = int(v)
    low, high = (0, 1 << bits) if unsigned else (-(1 << (bits - 1)), 1 << (bits - 1))
    if not low <= v < high:
        raise OverflowError(f"fakecupy cublas: {what} = {v} does not fit in {bits} bits")
    return v


class _DirectCublas(_Cublas):
    """libcublas called directly (what :func:`attn.fast.cublas.direct_cublas` gives on the
    stand-in, in place of the library bound through ctypes): the same calls as :class:`_Cublas`,
    not refused during a capture, and handles of the caller's own (``create``) with a workspace
    (``setWorkspace``: a device buffer the handle works in, so that cuBLAS allocates nothing
    during a capture)."""
    _through_cupy = False
    _next = [0x5EED1000]

    @classmethod
    def create(cls) -> int:
        handle = cls._next[0] = cls._next[0] + 1
        cls._state[handle] = [0, 0, 0, None]
        return handle

    @classmethod
    def setStream(cls, handle, stream):
        """As cuBLAS's: the handle goes back to cuBLAS's default workspace."""
        super().setStream(handle, stream)
        cls._handle(handle)[3] = None

    @classmethod
    def setWorkspace(cls, handle, workspace, size):
        cls._handle(handle)
        size = _int(size, "workspaceSizeInBytes", 64, unsigned=True)
        ptr = _int(workspace, "workspace", 64, unsigned=True)
        if size and not any(lo <= ptr and ptr + size <= hi for lo, hi, _ in _exposed_memory()):
            raise cls.CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: setWorkspace: {size} bytes at {ptr:#x} lie in no "
                                  "live device array")
        cls._handle(handle)[3] = (ptr, size)

    @classmethod
    def gemmBatchedEx(cls, handle, transa, transb, m, n, k, alpha, Aarray, Atype, lda, Barray, Btype, ldb, beta,
                      Carray, Ctype, ldc, batchCount, computeType, algo):
        """cublasGemmBatchedEx (the C API's argument order, as CuPy names the others): in
        libcublas, so here, but not among CuPy 14's wrappers (``cupy.cuda.cublas`` has gemmEx
        and gemmStridedBatchedEx only)."""
        dtypes, dtype = cls._ex_types("gemmBatchedEx", Atype, Btype, Ctype, computeType, algo)
        cls._gemm("gemmBatchedEx", dtype, handle, transa, transb, m, n, k, alpha, beta,
                  ("Aarray", Aarray, lda, None), ("Barray", Barray, ldb, None), ("Carray", Carray, ldc, None),
                  batchCount, True, dtypes=dtypes)


class _DeviceModule:
    """``cupy.cuda.device``: the current device's cuBLAS handle."""
    Device = Device

    @staticmethod
    def get_cublas_handle():
        return _Cublas.HANDLE


class _Cuda:
    Device, Stream, Event, MemoryHook, MemoryPool, Graph = Device, Stream, Event, MemoryHook, MemoryPool, Graph
    nccl = _Nccl
    cublas = None                   # set below: _Cublas
    device = None                   # set below: _DeviceModule
    get_elapsed_time = staticmethod(get_elapsed_time)
    runtime = _Runtime()
    MemoryPointer = MemoryPointer
    UnownedMemory = UnownedMemory
    using_allocator = staticmethod(_using_allocator)
    set_allocator = staticmethod(_set_allocator)
    get_allocator = staticmethod(_get_allocator)

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def get_current_stream():
        return _current_stream()

    @staticmethod
    def get_cublas_handle():
        return _Cublas.HANDLE

    @staticmethod
    def direct_cublas():
        """The stand-in's libcublas for :func:`attn.fast.cublas.direct_cublas` (not CuPy API)."""
        return _DirectCublas


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


class KernelLaunch:
    """How a kernel was launched: what its NumPy twin receives first."""

    def __init__(self, name, grid, block, shared_mem):
        self.name, self.grid, self.block, self.shared_mem = name, grid, block, shared_mem
        #: the order the launch's blocks run in (flat indices, x fastest), where :data:`race`
        #: is set; None: the twin may run them as it likes. A twin whose kernel's blocks talk to
        #: each other (a two-stage reduction, a ticket counter) runs them one by one in it.
        self.order = None

    @property
    def threads(self) -> int:
        return int(np.prod(self.block))

    @property
    def blocks(self) -> int:
        return int(np.prod(self.grid))


_CTYPE_DTYPES = {"float": np.float32, "double": np.float64, "int": np.int32, "long long": np.int64,
                 "unsigned int": np.uint32, "unsigned long long": np.uint64, "bool": np.bool_,
                 "unsigned char": np.uint8, "unsigned short": np.uint16, "short": np.int16}


def _kernel_signatures(code: str) -> dict:
    """name -> (template parameter or None, [(C type, is pointer, parameter name, is const)]) of
    every ``__global__`` function in ``code``."""
    sigs = {}
    pattern = r"(?:template\s*<\s*typename\s+(\w+)\s*>\s*)?__global__\s+void\s+(\w+)\s*\(([^)]*)\)"
    for m in re.finditer(pattern, code):
        tparam, name, params = m.group(1), m.group(2), m.group(3)
        plist = []
        for p in (s.strip() for s in params.split(",") if s.strip()):
            const = re.search(r"\bconst\b", p) is not None
            p = re.sub(r"\b(const|__restrict__)\b", " ", p)
            ptr = "*" in p
            p = p.replace("*", " ")
            words = p.split()
            plist.append((" ".join(words[:-1]), ptr, words[-1], const))
        sigs[name] = (tparam, plist)
    return sigs


def _twins() -> dict:
    """The NumPy twins of attn's kernels, by kernel name: ``attn.fast.kernels.NUMPY_TWINS``."""
    import importlib
    for mod in ("attn.fast.kernels", "attn.kernels"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, "NUMPY_TWINS"):
            return m.NUMPY_TWINS
    raise RuntimeError("fakecupy: attn's kernels module has no NUMPY_TWINS to run kernels with")


class RawKernel:
    """One kernel of a :class:`RawModule`. Calling it checks the launch as a GPU would
    (block and shared-memory limits, every argument's type against the kernel's C
    signature, device arrays only) and then runs the kernel's NumPy twin in its place."""

    MAX_THREADS, MAX_SHARED = 1024, 48 << 10

    def __init__(self, name, signature, targ, twin):
        self.name, self._sig, self._targ, self._twin = name, signature, targ, twin

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        tparam, params = self._sig
        if not (isinstance(grid, tuple) and isinstance(block, tuple) and 1 <= len(grid) <= 3
                and 1 <= len(block) <= 3):
            raise TypeError(f"{self.name}: grid and block must be tuples of 1 to 3 ints, got {grid!r}, {block!r}")
        for v in grid + block:
            if not isinstance(v, (int, np.integer)) or isinstance(v, (builtins.bool, np.bool_)) or v < 1:
                raise ValueError(f"{self.name}: grid and block sizes must be positive ints, got {grid!r}, {block!r}")
        if int(np.prod(block)) > self.MAX_THREADS:
            raise ValueError(f"{self.name}: {int(np.prod(block))} threads per block, at most {self.MAX_THREADS}")
        if not 0 <= int(shared_mem) <= self.MAX_SHARED:
            raise ValueError(f"{self.name}: shared_mem {shared_mem} bytes, at most {self.MAX_SHARED}")
        if not isinstance(args, tuple) or len(args) != len(params):
            raise TypeError(f"{self.name}: the kernel takes {len(params)} arguments "
                            f"({', '.join(p[2] for p in params)}), got {len(args) if isinstance(args, tuple) else args!r}")
        host_args = []
        for a, (ctype, ptr, pname, _) in zip(args, params):
            ctype = self._targ if ctype == tparam else ctype
            want = _CTYPE_DTYPES.get(ctype)
            if want is None:
                raise TypeError(f"{self.name}: fakecupy does not know the C type {ctype!r} of {pname}")
            if ptr:
                if isinstance(a, np.ndarray):
                    raise _host_refused(f"kernel {self.name} argument {pname}", a)
                if not isinstance(a, ndarray):
                    raise TypeError(f"{self.name}: argument {pname} ({ctype}*) must be a device array, "
                                    f"got {type(a).__name__}")
                if a.dtype != want:
                    raise TypeError(f"{self.name}: argument {pname} is {ctype}*, but the array's dtype is "
                                    f"{a.dtype}")
                host_args.append(a._a)
            else:
                # CuPy passes a NumPy scalar with its own width; a Python int or float would be
                # passed as 64 bits and silently misread by a kernel expecting int or float.
                if not isinstance(a, np.generic) or a.dtype != want:
                    raise TypeError(f"{self.name}: argument {pname} is {ctype}, so it must be a numpy.{np.dtype(want)} "
                                    f"scalar, got {type(a).__name__} {a!r}")
                host_args.append(a)
        launch = KernelLaunch(self.name, tuple(int(v) for v in grid), tuple(int(v) for v in block), int(shared_mem))
        if race is not None:
            launch.order = tuple(race.permutation(launch.blocks).tolist())
        t0 = time.perf_counter()
        self._twin(launch, *host_args)
        device_seconds[0] += time.perf_counter() - t0
        if _capturing is not None:
            twin = self._twin
            _record(lambda: twin(launch, *host_args), None if stream is None else stream.ptr)
        if tracer is not None:
            arrays = [a for a in host_args if isinstance(a, np.ndarray)]
            written = [a for a, p in zip(host_args, params) if p[1] and not p[3]]     # its non-const pointers
            tracer("raw", self.name.split("<")[0], arrays, [],
                   {"fresh": [], "grid": launch.grid, "block": launch.block, "written": written,
                    "stream": None if stream is None else stream.ptr,
                    "work": max((a.size for a in arrays), default=0)})


class RawModule:
    """``cupy.RawModule``: CUDA source and the kernels named in ``name_expressions``. The
    source is only read for the kernels' signatures (``tests/test_kernels.py`` compiles it
    with NVRTC); each kernel runs as its NumPy twin (see :class:`RawKernel`)."""

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None:
            raise ValueError("fakecupy.RawModule: pass the source as code=")
        self.code, self.options = code, tuple(options)
        self.name_expressions = tuple(name_expressions or ())
        self._sigs = _kernel_signatures(code)

    def get_function(self, name: str) -> RawKernel:
        m = re.fullmatch(r"(\w+)\s*(?:<\s*([\w ]+?)\s*>)?", name)
        if m is None:
            raise ValueError(f"fakecupy.RawModule.get_function: cannot read the name {name!r}")
        base, targ = m.group(1), m.group(2)
        if base not in self._sigs:
            raise KeyError(f"no __global__ function {base!r} in the module's source")
        if self._sigs[base][0] is not None:
            if targ is None or name not in self.name_expressions:
                raise KeyError(f"template kernel {name!r} was not named in name_expressions "
                               f"{self.name_expressions} (NVRTC would not instantiate it)")
        twins = _twins()
        if base not in twins:
            raise KeyError(f"kernel {base!r} has no NumPy twin in attn's kernels module")
        return RawKernel(name, self._sigs[base], targ, twins[base])


if __import__("os").environ.get("FAKECUPY_ASYNC") == "1":       # a whole run in the asynchronous mode
    _WHOLE_RUN = asynchronous()                                   # (kept: a generator closed would end it)
    _WHOLE_RUN.__enter__()

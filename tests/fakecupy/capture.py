"""What an operation records and where its memory comes from: stream capture (an operation
captured for a graph, what a capture refuses, :class:`Graph`), the allocators (the pool, step
memory, what a capture may allocate) and the reports every operation makes to the tracer.
Part of :mod:`fakecupy.cupy`, which re-exports every name; its state lives there.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import numpy as np

from . import cupy as _c
from . import pool as _pool


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


class StreamCaptureError(RuntimeError):
    """An operation CUDA or CuPy does not permit while a stream captures a graph."""


def _refuse_in_capture(what: str, kind: str = "") -> None:
    """Raise :class:`StreamCaptureError` for ``what`` during a capture; a survey
    (``begin_capture(survey=True)``) notes it instead and goes on."""
    if _c._capturing is not None:
        _c._capturing.refuse(what, kind or what)


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
    ptr = _c._current_stream().ptr if stream is None else int(stream)
    if ptr != _c._capturing.stream.ptr:
        raise StreamCaptureError(
            f"fakecupy: an operation on {'the null stream' if ptr == 0 else f'stream {ptr:#x}'} "
            f"(thread {threading.current_thread().name!r}) while stream {_c._capturing.stream.ptr:#x} captures: on a "
            "GPU it runs at once, outside the graph (the current stream is per thread); the stand-in cannot run "
            f"it beside a capture ({_caller()})")
    _c._capturing.ops.append(redo)


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
        if _c._capturing.survey:
            _c._capturing.refuse(what, "pool allocation")
        else:
            _c._capturing.pool_allocated(what, pooled)
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
    return _c._capturing is not None and _state().step_allocator is not None


def _update_allocator() -> None:
    """This thread's placing allocator: the current allocator when it is not the memory pool's
    (every new device array is then placed in the memory it returns, a view of the array that
    memory belongs to, so memory handed out twice is shared for real, as on a GPU); and whether
    new arrays are placed at all (such an allocator, or a memory hook listening: it hears every
    allocation from the pool, and every free)."""
    t = _c._tls
    a = t.allocator if t.allocator is not None else _c._global_allocator
    t.step_allocator = None if a is None or a == _c._POOL.malloc else a
    t.placing = t.step_allocator is not None or len(t.hooks) > 0 or _c._current_stream().ptr != 0
    t.generation = _c._generation


def _state() -> _PerThread:
    """This thread's allocator state, up to date."""
    t = _c._tls
    if t.generation != _c._generation:
        _update_allocator()
    return t


def _pool_block(a: np.ndarray) -> np.ndarray:
    """``a``, new memory from the pool: its block taken from the current stream's arena (or a
    ``cudaMalloc``: :mod:`fakecupy.pool`) and given back when the last array on it goes; every
    memory hook told of its allocation now and of its free then (the block rounded up to 512
    bytes, as CuPy's pool rounds it)."""
    hooks = list(_c._tls.hooks)
    if not a.nbytes:
        return a
    block = _c._POOL.hand_out(a.nbytes)
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
            if hook in _c._tls.hooks:                # (the freeing thread's hooks, as CuPy's)
                hook.free_preprocess(device_id=0, mem_size=size, mem_ptr=ptr, pmem_id=ptr)
                hook.free_postprocess(device_id=0, mem_size=size, mem_ptr=ptr, pmem_id=ptr)
        if block is not None:
            _c._POOL.give_back(block)
    weakref.finalize(_root(a), freed)
    return a


def _root(a: np.ndarray) -> np.ndarray:
    """The NumPy array owning ``a``'s memory (through the :class:`UnownedMemory` an array placed in
    allocator-wrapped memory keeps alive)."""
    while True:
        b = a.base
        if isinstance(b, np.ndarray):
            a = b
        elif isinstance(b, _c.UnownedMemory) and b._root is not None:
            a = b._root
        else:
            return a


def in_step_memory(a: np.ndarray) -> bool:
    """Whether ``a`` lies in memory an allocator other than the pool handed out."""
    root = _root(a)
    ref = _c._allocator_roots.get(id(root))
    return ref is not None and ref() is root


def _place(r, inputs):
    """The result ``r`` of an operation with its new arrays (those sharing no memory with
    ``inputs``) moved into memory from the current allocator, as CuPy allocates them: each
    one asks the allocator for its bytes and, given allocator memory, becomes a view of it
    holding the same values; given pool memory, stays as it is. NumPy scalars come back as
    0-d arrays (CuPy's 0-d device arrays are allocations too)."""
    alloc = _state().step_allocator or _c._POOL.malloc
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
        if isinstance(mem, _c.UnownedMemory):            # memory the allocator wrapped: arrays keep it alive
            if mem._root is None:
                mem._attach(_pool_block(a) if mem.size else a)     # the pool's: the new array's own memory
                return mem._view(0, a.shape, a.dtype)
            if mp._offset + a.nbytes > mem._offset + mem.size:
                raise ValueError(f"fakecupy: the allocator returned {mem._offset + mem.size - mp._offset} bytes "
                                 f"for a request of {a.nbytes}")
            root = mem._root
            ref = _c._allocator_roots.get(id(root))
            if ref is None or ref() is not root:
                _c._allocator_roots[id(root)] = weakref.ref(root)
            v = mem._view(mp._offset - mem._offset, a.shape, a.dtype)
            v[...] = a
            return v
        root = getattr(mp, "_root", None)
        if root is None:
            return _pool_block(a)                     # the allocator gave memory from the pool
        if mp._offset + a.nbytes > root.nbytes:
            raise ValueError(f"fakecupy: the allocator returned {root.nbytes - mp._offset} bytes for a request "
                             f"of {a.nbytes}")
        ref = _c._allocator_roots.get(id(root))
        if ref is None or ref() is not root:          # (an id is used again once its array has gone)
            _c._allocator_roots[id(root)] = weakref.ref(root)
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
        previous = _c._tls.allocator
        _c._tls.allocator = _raw_malloc if allocator is None else allocator
        _update_allocator()
        try:
            yield
        finally:
            _c._tls.allocator = previous
            _update_allocator()
    return scope()


def _set_allocator(allocator=None) -> None:
    if _c._tls.allocator is not None:
        raise ValueError("Can't change the global allocator inside `using_allocator` context manager")
    _c._global_allocator = _raw_malloc if allocator is None else allocator
    _c._generation += 1


def _get_allocator():
    a = _c._tls.allocator if _c._tls.allocator is not None else _c._global_allocator
    return _c._POOL.malloc if a is None else a


def _raw_malloc(size: int) -> _c.MemoryPointer:
    """``cupy.cuda.memory._malloc``: memory straight from the device, which the stand-in, like
    the pool, does not track (a new NumPy array)."""
    return _c.MemoryPointer(None)


def _live_roots() -> dict:
    """id -> the NumPy array that owns the memory of every live device array."""
    import gc
    roots = {}
    for obj in gc.get_objects():
        if type(obj) is _c.ndarray:
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
        if _c._capturing is not None:
            raise StreamCaptureError("fakecupy: launching a graph while a stream captures is not modelled")
        for op in self._ops:
            op()
        if _c._order is not None:
            _c._order.graph_launched(self, (_c._current_stream() if stream is None else stream).ptr)
        if _c.tracer is not None:
            _c.tracer("graph", "graph launch", [], [], {"fresh": [], "operations": len(self._ops)})

    def __len__(self):
        return len(self._ops)


def _arrays(x, out: list) -> list:
    """The NumPy arrays in x (recursively through tuples and lists), appended to out."""
    if isinstance(x, np.ndarray):
        out.append(x)
    elif isinstance(x, _c.ndarray):
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
        kind = ("reduction" if base in _c._REDUCTIONS or name in _c._REDUCTIONS else "sort" if base in _c._SORTS
                else "matmul" if base in _c._MATMULS else "copy" if base in _c._COPIES
                else "alloc" if base in _c._ALLOC_ONLY else "elementwise")
        if kind == "matmul":
            return _report_matmul(name, inputs, result, out_given)
    info.update(_allocated(fresh))
    _c.tracer(kind, name, ins, outs, info)


def _allocated(fresh: list, temporary: bool = False) -> dict:
    """The tracer's ``fresh`` (new arrays from the memory pool) and ``step_memory`` (new arrays
    in memory an allocator other than the pool handed out) of an operation's new arrays.
    ``temporary``: CuPy's own scratch (a product's operand copies), which the current
    allocator serves (the stand-in only counts it)."""
    step_allocator = _state().step_allocator
    if not _c._allocator_roots and step_allocator is None:
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
            _c.tracer("copy", "matmul operand copy", [a], [a], _allocated([a], temporary=True))
    outs = _arrays(result, [])
    fresh = [] if out_given else [r for r in outs if not any(np.may_share_memory(r, i) for i in operands)]
    if out_given and outs and not outs[0].flags.c_contiguous:
        _c.tracer("matmul", name, operands, outs, _allocated(outs, temporary=True))
        _c.tracer("copy", "matmul out= copy", outs, outs, {"fresh": []})
        return
    _c.tracer("matmul", name, operands, outs, _allocated(fresh))

"""The device array: wrapping NumPy's results and refusing host arrays, ufuncs and functions
on device arrays, CuPy's indexing (indices that wrap), :class:`ndarray` and the memory it
exposes (:class:`MemoryPointer`, :class:`UnownedMemory`).
Part of :mod:`fakecupy.cupy`, which re-exports every name; its state lives there.
"""
from __future__ import annotations

import builtins
import operator

import numpy as np

from . import cupy as _c


def _host_refused(where: str, x) -> TypeError:
    return TypeError(f"Unsupported type {type(x)} in {where}: a host numpy.ndarray cannot take part in a "
                     "device operation (move it with cupy.asarray first)")


def _unwrap(x, where: str, allow_host: bool = False):
    """Device arrays -> their NumPy arrays, recursively through lists, tuples and dicts;
    a host ``numpy.ndarray`` raises TypeError unless ``allow_host``."""
    t = type(x)
    if t is ndarray:
        return x._a
    if t in _c._PLAIN:
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
        elif t in _c._PLAIN or (t is not np.ndarray and isinstance(a, np.generic)):
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
        if _c._capturing is not None:
            _c._record(lambda: getattr(uf, "at")(target, wrapped(), *rest))
        if _c.tracer is not None:
            _c._report("elementwise", f"{uf.__name__}.at", (target, rest), target, True)
        return None
    args = _args(inputs, where)
    if _c._capturing is not None and uf is np.matmul:
        _c._refuse_in_capture("CuPy's matmul calls cuBLAS through CuPy, which refuses while the stream captures",
                          "CuPy matmul")
    if not kwargs:
        r = uf(*args) if method == "__call__" else getattr(uf, method)(*args)
        if _c._state().placing:
            r = _c._place(r, args)
        if _c._capturing is not None:
            f = uf if method == "__call__" else getattr(uf, method)
            r = _c._record_result(where, r, args, lambda: f(*args))
        if _c.tracer is not None:
            _report_ufunc(uf, method, args, r, False)
        return _wrap(r)
    kw = _unwrap(kwargs, where)
    r = getattr(uf, method)(*args, **kw) if method != "__call__" else uf(*args, **kw)
    if _c._state().placing and kw.get("out") is None:
        r = _c._place(r, args)
    if _c._capturing is not None:
        f = uf if method == "__call__" else getattr(uf, method)
        if kw.get("out") is not None:
            _c._record(lambda: f(*args, **kw))
        else:
            r = _c._record_result(where, r, args, lambda: f(*args, **kw))
    if _c.tracer is not None:
        _report_ufunc(uf, method, args, r, kwargs.get("out") is not None)
    return _out_result(kwargs.get("out"), r)


def _report_ufunc(uf, method: str, args, r, out_given: bool) -> None:
    if uf is np.matmul:
        return _c._report_matmul("matmul", args, r, out_given)
    kind = {"reduce": "reduction", "accumulate": "sort"}.get(method, "elementwise")
    _c._report(kind, uf.__name__ if method == "__call__" else f"{uf.__name__}.{method}", args, r, out_given)


class _Ufunc:
    """``cupy.exp`` and friends: a NumPy ufunc that takes device arrays only."""

    def __init__(self, uf: np.ufunc):
        self._uf = uf
        self.__name__ = uf.__name__
        self.nin, self.nout = uf.nin, uf.nout

    def __call__(self, *args, **kwargs):
        return _c._ufunc(self._uf, "__call__", args, kwargs)

    def reduce(self, *args, **kwargs):
        return _c._ufunc(self._uf, "reduce", args, kwargs)

    def accumulate(self, *args, **kwargs):
        return _c._ufunc(self._uf, "accumulate", args, kwargs)

    def outer(self, *args, **kwargs):
        return _c._ufunc(self._uf, "outer", args, kwargs)

    def at(self, *args, **kwargs):
        return _c._ufunc(self._uf, "at", args, kwargs)

    def __repr__(self):
        return f"<fakecupy ufunc '{self.__name__}'>"


def _function(name: str, f):
    def call(*args, **kwargs):
        where = f"cupy.{name}"
        a, k = _args(args, where), (_unwrap(kwargs, where) if kwargs else kwargs)
        if name in _c._DATA_DEPENDENT or (name == "where" and len(args) == 1):
            _c._sync(f"{name} (result size depends on the data)")
        if _c._capturing is not None and name in _c._MATMULS:
            _c._refuse_in_capture(f"cupy.{name} calls cuBLAS through CuPy, which refuses while the stream captures",
                              "CuPy matmul")
        r = f(*a, **k)
        if _c._state().placing and k.get("out") is None:
            r = _c._place(r, (a, list(k.values())))
        if _c._capturing is not None:
            if k.get("out") is not None:
                _c._record(lambda: f(*a, **k))
            else:
                r = _c._record_result(where, r, (a, list(k.values())), lambda: f(*a, **k))
        if _c.tracer is not None:
            _c._report("auto", name, (a, list(k.values())), r, k.get("out") is not None)
        return _out_result(kwargs.get("out"), r)
    call.__name__ = name
    call.__qualname__ = name
    call.__doc__ = f"fakecupy: numpy.{name} on device arrays."
    return call


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
        root = _c._root(a)
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
            _c.runtime_calls["pointerGetAttributes"] += 1
            device_id = 0
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, device_id
        root = None
        if isinstance(owner, ndarray):
            root = _c._root(owner._a)
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


def _expose(a: np.ndarray) -> None:
    import weakref
    a = _c._root(a)
    if a.size and id(a) not in _c._EXPOSED:
        key = id(a)
        lo, hi = np.lib.array_utils.byte_bounds(a)          # a root's bytes stay where they are
        _c._EXPOSED[key] = (weakref.ref(a, lambda _r, key=key: _c._EXPOSED.pop(key, None)), lo, hi)


def _exposed_memory() -> list:
    """(first byte, one past the last, owner) of every live array whose address was taken."""
    out = []
    for ref, lo, hi in list(_c._EXPOSED.values()):
        a = ref()
        if a is not None:
            out.append((lo, hi, a))
    return out


def _binary(uf, reflected=False):
    def op(self, other):
        t = type(other)
        if _c._capturing is not None and uf is np.matmul:
            _c._refuse_in_capture("CuPy's matmul (a @ b) calls cuBLAS through CuPy, which refuses while the stream "
                              "captures", "CuPy matmul")
        if t is ndarray:
            x, y = (other._a, self._a) if reflected else (self._a, other._a)
            r = uf(x, y)
            if _c._state().placing:
                r = _c._place(r, (x, y))
            if _c._capturing is not None:
                r = _c._record_result(f"cupy.{uf.__name__}", r, (x, y), lambda: uf(x, y))
            if _c.tracer is not None:
                _report_ufunc(uf, "__call__", (other._a, self._a) if reflected else (self._a, other._a), r, False)
            return _wrap(r)
        if t in _c._PLAIN:
            x, y = (other, self._a) if reflected else (self._a, other)
            r = uf(x, y)
            if _c._state().placing:
                r = _c._place(r, (self._a,))
            if _c._capturing is not None:
                r = _c._record_result(f"cupy.{uf.__name__}", r, (self._a,), lambda: uf(x, y))
            if _c.tracer is not None:
                _report_ufunc(uf, "__call__", (self._a,), r, False)
            return _wrap(r)
        if isinstance(other, np.ndarray):
            raise _host_refused(f"cupy.{uf.__name__}", other)
        if not isinstance(other, (ndarray, np.generic, int, float, complex, builtins.bool)):
            return NotImplemented
        args = (other, self) if reflected else (self, other)
        return _c._ufunc(uf, "__call__", args, {})
    return op


def _inplace(uf):
    def op(self, other):
        if isinstance(other, np.ndarray):
            raise _host_refused(f"cupy.{uf.__name__}", other)
        o = _unwrap(other, f"cupy.{uf.__name__}")
        a = self._a
        uf(a, o, out=a)
        if _c._capturing is not None:
            _c._record(lambda: uf(a, o, out=a))
        if _c.tracer is not None:
            _c._report("elementwise", uf.__name__, (self._a, o), self._a, True)
        return self
    return op


def _unary(uf):
    def op(self):
        a = self._a
        r = uf(a)
        if _c._state().placing:
            r = _c._place(r, (a,))
        if _c._capturing is not None:
            r = _c._record_result(f"cupy.{uf.__name__}", r, (a,), lambda: uf(a))
        if _c.tracer is not None:
            _c._report("elementwise", uf.__name__, (self._a,), r)
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
        self._a = _c._placed(np.empty(shape, dtype=dtype, order=order))
        if _c.tracer is not None:
            _c._report("alloc", "ndarray", (), self._a)

    @classmethod
    def _of(cls, a: np.ndarray) -> "ndarray":
        obj = cls.__new__(cls)
        obj._a = a
        return obj

    # ---- the ways to the host (each one counted)

    def get(self, stream=None, order="C", out=None, blocking=True):
        _c._sync("get", self._a, stream=stream)
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        """Host -> device copy into this array."""
        _c._refuse_in_capture("a host->device copy (ndarray.set)", "host transfer")
        self._a[...] = np.asarray(arr)
        if _c.tracer is not None:
            _c.tracer("copy", "host->device", [], [self._a], {"fresh": [], "direction": "h2d"})

    def item(self, *args):
        _c._sync("item", read=self._a)
        return self._a.item(*args)

    def tolist(self):
        _c._sync("tolist", read=self._a)
        return self._a.tolist()

    def __float__(self):
        _c._sync("float", read=self._a)
        return float(self._a)

    def __int__(self):
        _c._sync("int", read=self._a)
        return int(self._a)

    def __complex__(self):
        _c._sync("complex", read=self._a)
        return complex(self._a)

    def __bool__(self):
        _c._sync("bool", read=self._a)
        return builtins.bool(self._a)

    def __index__(self):
        _c._sync("index", read=self._a)
        return operator.index(self._a)

    def __repr__(self):
        _c._sync("repr", read=self._a)
        return repr(self._a).replace("array(", "fakecupy.array(", 1)

    def __str__(self):
        _c._sync("str", read=self._a)
        return str(self._a)

    def __format__(self, spec):
        _c._sync("format", read=self._a)
        return format(self._a.item() if self._a.ndim == 0 else self._a, spec)

    def __contains__(self, value):
        _c._sync("contains", read=self._a)
        return value in self._a

    # ---- what CuPy refuses

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _c._ufunc(ufunc, method, inputs, kwargs)

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
    device = property(lambda self: _c.Device(0))

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
                return lambda indices, axis=None, out=None, mode=None: _c.take(self, indices, axis=axis, out=out)
            if name in ("nonzero",):
                _c._sync("nonzero (result size depends on the data)")

            def method(*args, **kwargs):
                where = f"cupy.ndarray.{name}"
                a = _args(args, where)
                k = _unwrap(kwargs, where) if kwargs else {}
                r = attr(*a, **k)
                if _c._state().placing and k.get("out") is None:
                    r = _c._place(r, (self._a, a, list(k.values())))
                if _c._capturing is not None:
                    if k.get("out") is not None:
                        _c._record(lambda: attr(*a, **k))
                    else:
                        r = _c._record_result(where, r, (self._a, a, list(k.values())), lambda: attr(*a, **k))
                if _c.tracer is not None:
                    _c._report("auto", name, (self._a, a, list(k.values())), r, k.get("out") is not None)
                return _out_result(kwargs.get("out"), r) if kwargs else _wrap(r)
            return method
        return _wrap(attr)

    def copy(self, order="C"):
        src = self._a
        r = src.copy(order=order)
        if _c._state().placing:
            r = _c._place(r, ())
        if _c._capturing is not None:
            r = _c._record_result("cupy.ndarray.copy", r, (), lambda: src)
        if _c.tracer is not None:
            _c._report("copy", "copy", (self._a,), r)
        return ndarray._of(r)

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    # ---- indexing

    def __getitem__(self, key):
        idx, has_mask = _prepare_index(key, self._a.shape)
        if has_mask:
            _c._sync("boolean-mask indexing (result size depends on the data)")
        src = self._a
        r = src[idx]
        if isinstance(r, np.generic):            # an element: a 0-d view of it, as CuPy's
            r = src[(idx if isinstance(idx, tuple) else (idx,)) + (Ellipsis,)]
        if _c._state().placing and isinstance(r, np.ndarray):
            r = _c._place(r, (src,))
        if _c._capturing is not None and isinstance(r, np.ndarray):
            shape = src.shape
            r = _c._record_result("cupy.ndarray.__getitem__", r, (src,), lambda: src[_prepare_index(key, shape)[0]])
        if _c.tracer is not None and isinstance(r, np.ndarray):     # a scalar index is a 0-d view
            _c._report("auto", "getitem (advanced index)", (self._a,), r)
        return _wrap(r)

    def __setitem__(self, key, value):
        idx, _ = _prepare_index(key, self._a.shape)
        if isinstance(value, np.ndarray):
            whole = idx in ((slice(None),), (Ellipsis,))
            if not whole:
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill "
                                 "(fakecupy, as CuPy: only a[:] = host_array copies from the host)")
            _c._refuse_in_capture("a host->device copy (a[:] = host_array)", "host transfer")
            self._a[idx] = value
            if _c.tracer is not None:
                _c.tracer("copy", "host->device", [], [self._a], {"fresh": [], "direction": "h2d"})
            return
        v = _unwrap(value, "cupy.ndarray.__setitem__")
        target = self._a
        target[idx] = v
        if _c._capturing is not None:
            _c._record(lambda: target.__setitem__(_prepare_index(key, target.shape)[0], v))
        if _c.tracer is not None:
            # a copy kernel from an array, a fill from a scalar; it writes the indexed region
            # (the whole array where the index is an integer array: a scatter)
            basic = all(isinstance(k, (int, np.integer, slice, type(None), type(Ellipsis))) for k in idx)
            _c._report("copy" if isinstance(v, np.ndarray) and v.ndim else "elementwise", "setitem", (v,),
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
        if _c._capturing is not None and name == "dot":
            _c._refuse_in_capture("cupy.ndarray.dot calls cuBLAS through CuPy, which refuses while the stream captures",
                              "CuPy matmul")
        if not kwargs:
            r = f(*a)
            if _c._state().placing and name != "fill":
                r = _c._place(r, (self._a, a))
            if _c._capturing is not None:
                if name == "fill":
                    _c._record(lambda: f(*a))
                else:
                    r = _c._record_result(where, r, (self._a, a), lambda: f(*a))
            if _c.tracer is not None:
                _c._report("elementwise" if name == "fill" else "auto", name, (self._a, a), self._a if name == "fill"
                        else r, name == "fill")
            return _wrap(r)
        k = _unwrap(kwargs, where)
        r = f(*a, **k)
        if _c._state().placing and k.get("out") is None:
            r = _c._place(r, (self._a, a, list(k.values())))
        if _c._capturing is not None:
            if k.get("out") is not None:
                _c._record(lambda: f(*a, **k))
            else:
                r = _c._record_result(where, r, (self._a, a, list(k.values())), lambda: f(*a, **k))
        if _c.tracer is not None:
            _c._report("auto", name, (self._a, a, list(k.values())), r, k.get("out") is not None)
        return _out_result(kwargs.get("out"), r)
    method.__name__ = name
    return method

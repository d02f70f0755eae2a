"""What crosses the pipe between the grader and its child: plain data only, never pickle.

A message is one frame: an 8-byte header (the JSON's length, the number of blobs), the
JSON text, then each blob as its 8-byte length and its bytes. Arrays travel as
``{"$": "array", "dtype", "shape", "blob"}`` and their raw bytes; tuples, named tuples,
handles (objects that stay in the child), generators and the array namespace as tagged
JSON objects. :func:`decode` validates everything it reads: a dtype outside
:data:`DTYPES`, a shape that disagrees with its bytes, a tag it does not know, nesting or
sizes over the limits are a :class:`WireError`, never an object built from the learner's
bytes. This module imports only the standard library and NumPy: the child imports it
before anything of the learner's runs.
"""
from __future__ import annotations

import collections
import json
import os
import select
import struct
import time
from typing import NamedTuple

from .. import backend as B

np = B.host

#: The dtypes an array may have on the wire.
DTYPES = frozenset(np.dtype(t).str for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128"))
MAX_BYTES = 1 << 30         # one message, all blobs together
MAX_DEPTH = 64
MAX_ITEMS = 1_000_000       # JSON values in one message
_HEADER = struct.Struct("<QQ")
_LEN = struct.Struct("<Q")

#: The child's working folder by its own cwd, where a path from / would cross the grader's
#: private folder, which nobody may not enter (no sandbox, as root).
ENTERED = "/proc/self/cwd"


class WireError(Exception):
    """A message that is not what the protocol allows."""


class Arr(NamedTuple):
    """An array in transit: its host copy, and whether it lives on the device."""
    host: object
    device: bool


class Rng(NamedTuple):
    """A random generator in transit: ``attn.backend.DeviceRNG(seed)``, one per ``uid``."""
    seed: int
    uid: int


class Handle(NamedTuple):
    """An object that stays in the child (a cache, a generator the learner returned)."""
    uid: int
    type_name: str

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


class XpRef(NamedTuple):
    """The selected backend's array namespace."""


_NAMED: dict = {}


def _named(type_name: str, fields: tuple):
    """A named tuple class of this name and these fields (the library's caches, rebuilt)."""
    key = (type_name, fields)
    if key not in _NAMED:
        _NAMED[key] = collections.namedtuple(type_name, fields)
    return _NAMED[key]


def _is_named(v) -> bool:
    return isinstance(v, tuple) and type(v) is not tuple and isinstance(getattr(type(v), "_fields", None), tuple)


def encode(v) -> tuple[bytes, list]:
    """``v`` as (JSON bytes, blobs). Raises WireError for what plain data cannot carry."""
    blobs: list = []

    def enc(x, depth=0):
        if depth > MAX_DEPTH:
            raise WireError("nested too deeply")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int) and type(x) in (int, bool):
            return x
        if type(x) is float:
            return {"$": "float", "v": repr(x)}
        if type(x) is complex:
            return {"$": "complex", "re": repr(x.real), "im": repr(x.imag)}
        if type(x) is bytes:
            blobs.append(x)
            return {"$": "bytes", "blob": len(blobs) - 1}
        if isinstance(x, Arr):
            a = np.asarray(x.host)
            if not a.flags.c_contiguous:
                a = a.copy(order="C")
            if a.dtype.str not in DTYPES:
                raise WireError(f"an array of dtype {a.dtype} cannot travel")
            blobs.append(a.tobytes())
            return {"$": "array", "dtype": a.dtype.str, "shape": list(a.shape), "blob": len(blobs) - 1,
                    "device": bool(x.device)}
        if isinstance(x, np.generic):
            return {"$": "scalar", "v": enc(Arr(np.asarray(x), False), depth + 1)}
        if isinstance(x, Handle):
            return {"$": "handle", "uid": int(x.uid), "type": str(x.type_name)}
        if isinstance(x, Rng):
            return {"$": "rng", "seed": int(x.seed), "uid": int(x.uid)}
        if isinstance(x, XpRef):
            return {"$": "xp"}
        if _is_named(x):
            return {"$": "named", "type": type(x).__name__, "fields": list(type(x)._fields),
                    "items": [enc(i, depth + 1) for i in x]}
        if type(x) is tuple:
            return {"$": "tuple", "items": [enc(i, depth + 1) for i in x]}
        if type(x) is list:
            return [enc(i, depth + 1) for i in x]
        if type(x) is dict:
            if not all(type(k) is str for k in x):
                raise WireError("a dict with keys that are not strings cannot travel")
            return {"$": "dict", "items": {k: enc(i, depth + 1) for k, i in x.items()}}
        raise WireError(f"a {type(x).__name__} cannot travel")

    text = json.dumps(enc(v), allow_nan=False, separators=(",", ":")).encode("utf-8")
    return text, blobs


def _float(s) -> float:
    if not isinstance(s, str) or len(s) > 40:
        raise WireError("a float that is not a float")
    try:
        return float(s)
    except ValueError:
        raise WireError("a float that is not a float") from None


def decode(text: bytes, blobs: list):
    """The value of a frame, validated (see the module's docstring)."""
    try:
        tree = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"not JSON: {e}") from None
    return _Decoder(blobs).value(tree)


class _Decoder:
    """One frame's decoding: counts the values it meets (at most :data:`MAX_ITEMS`, nested at most
    :data:`MAX_DEPTH` deep), hands out each blob at most once, and reads a tagged object by its
    tag's method in :data:`_TAGS`."""

    def __init__(self, blobs: list):
        self.blobs, self.count, self.used = blobs, 0, set()

    def blob(self, i) -> bytes:
        if type(i) is not int or not 0 <= i < len(self.blobs) or i in self.used:
            raise WireError("a blob reference out of range")
        self.used.add(i)
        return self.blobs[i]

    def value(self, x, depth: int = 0):
        self.count += 1
        if depth > MAX_DEPTH or self.count > MAX_ITEMS:
            raise WireError("a message nested too deeply or too large")
        if x is None or isinstance(x, (bool, str, int)):
            return x
        if isinstance(x, list):
            return [self.value(i, depth + 1) for i in x]
        if not isinstance(x, dict):
            raise WireError(f"a bare {type(x).__name__}")
        tag = x.get("$")
        read = _TAGS.get(tag) if isinstance(tag, str) else None
        if read is None:
            raise WireError(f"an unknown tag {tag!r}")
        return read(self, x, depth)

    def float_(self, x: dict, depth: int) -> float:
        return _float(x.get("v"))

    def complex_(self, x: dict, depth: int) -> complex:
        return complex(_float(x.get("re")), _float(x.get("im")))

    def bytes_(self, x: dict, depth: int) -> bytes:
        return bytes(self.blob(x.get("blob")))

    def array(self, x: dict, depth: int) -> Arr:
        dtype, shape = x.get("dtype"), x.get("shape")
        if dtype not in DTYPES:
            raise WireError(f"an array of dtype {dtype!r}")
        if (not isinstance(shape, list) or len(shape) > 32
                or not all(type(n) is int and 0 <= n for n in shape)):
            raise WireError("an array with a shape that is not a shape")
        data = self.blob(x.get("blob"))
        size = 1
        for n in shape:
            size *= n
        if size * np.dtype(dtype).itemsize != len(data):
            raise WireError(f"an array of shape {tuple(shape)} and dtype {np.dtype(dtype)} with "
                            f"{len(data)} bytes")
        a = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
        return Arr(a, x.get("device") is True)

    def scalar(self, x: dict, depth: int):
        a = self.value(x.get("v"), depth + 1)
        if not isinstance(a, Arr) or a.host.ndim != 0:
            raise WireError("a scalar that is not one")
        return a.host[()]

    def handle(self, x: dict, depth: int) -> Handle:
        uid, name = x.get("uid"), x.get("type")
        if type(uid) is not int or not isinstance(name, str) or len(name) > 200:
            raise WireError("a handle that is not one")
        return Handle(uid, name)

    def rng(self, x: dict, depth: int) -> Rng:
        seed, uid = x.get("seed"), x.get("uid")
        if type(seed) is not int or type(uid) is not int:
            raise WireError("a generator that is not one")
        return Rng(seed, uid)

    def xp(self, x: dict, depth: int) -> XpRef:
        return XpRef()

    def tuple_(self, x: dict, depth: int) -> tuple:
        items = x.get("items")
        if not isinstance(items, list):
            raise WireError("a tuple that is not one")
        return tuple(self.value(i, depth + 1) for i in items)

    def named(self, x: dict, depth: int):
        name, fields, items = x.get("type"), x.get("fields"), x.get("items")
        if (not isinstance(name, str) or not name.isidentifier() or not isinstance(fields, list)
                or not isinstance(items, list) or len(fields) != len(items)
                or not all(isinstance(f, str) and f.isidentifier() and not f.startswith("_") for f in fields)
                or len(set(fields)) != len(fields)):
            raise WireError("a named tuple that is not one")
        return _named(name, tuple(fields))(*(self.value(i, depth + 1) for i in items))

    def dict_(self, x: dict, depth: int) -> dict:
        items = x.get("items")
        if not isinstance(items, dict):
            raise WireError("a dict that is not one")
        return {k: self.value(i, depth + 1) for k, i in items.items()}


#: How :class:`_Decoder` reads each tag ``"$"`` of the frame; any other tag is refused.
_TAGS = {"float": _Decoder.float_, "complex": _Decoder.complex_, "bytes": _Decoder.bytes_,
         "array": _Decoder.array, "scalar": _Decoder.scalar, "handle": _Decoder.handle, "rng": _Decoder.rng,
         "xp": _Decoder.xp, "tuple": _Decoder.tuple_, "named": _Decoder.named, "dict": _Decoder.dict_}


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Channel:
    """One direction of the pipe, on a raw file descriptor: :meth:`send` and :meth:`recv`.
    A frame goes out in one write and comes in through a buffer (a call's many small
    arrays are not a system call each)."""

    def __init__(self, fd: int, max_bytes: int = MAX_BYTES, patience: float | None = None):
        self.fd, self.max_bytes, self.patience = fd, max_bytes, patience
        self.closed = False
        self._buffer = bytearray()

    def send(self, v) -> None:
        text, blobs = encode(v)
        parts = [_HEADER.pack(len(text), len(blobs)), text]
        for b in blobs:
            parts += [_LEN.pack(len(b)), b]
        _write_all(self.fd, b"".join(parts))

    def _read(self, n: int, deadline: float | None) -> bytes:
        """The next ``n`` bytes: what the buffer holds, then as much as the pipe has."""
        while len(self._buffer) < n:
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0 or not select.select([self.fd], [], [], wait)[0]:
                    raise TimeoutError("a message stopped half-way")
            chunk = os.read(self.fd, min(max(n - len(self._buffer), 1 << 16), 1 << 20))
            if not chunk:
                raise EOFError("the pipe closed")
            self._buffer += chunk
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    def recv(self):
        """The next message. With ``patience``, a message that has begun must end within that
        many seconds (a child that writes half a frame and stops cannot hang the grader)."""
        deadline = None if self.patience is None else time.monotonic() + self.patience
        read = lambda n: self._read(n, deadline)        # noqa: E731
        n, k = _HEADER.unpack(read(_HEADER.size))
        if n > self.max_bytes or k > MAX_ITEMS:
            raise WireError(f"a message of {n} bytes and {k} blobs")
        text = read(n)
        blobs, total = [], n
        for _ in range(k):
            (m,) = _LEN.unpack(read(_LEN.size))
            total += m
            if total > self.max_bytes:
                raise WireError(f"a message over {self.max_bytes} bytes")
            blobs.append(read(m))
        return decode(text, blobs)

    def poll(self, timeout: float) -> bool:
        if self._buffer:
            return True
        r, _, _ = select.select([self.fd], [], [], timeout)
        return bool(r)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                os.close(self.fd)
            except OSError:
                pass

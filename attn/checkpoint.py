"""Writing and reading ``.npz`` files atomically, with no pickling.

A file holds named arrays plus one JSON document (``__meta__``) for everything
that is not an array (the config, the schedule step, the data position). It is
written to a temporary file in the same folder, flushed to disk, then renamed
over the old one: a crash or Ctrl-C mid-write leaves the previous file intact,
and a temporary file that a hard kill leaves behind (``.NAME.*.tmp``) is removed
by :func:`remove_stale_temporaries` when the next run starts.

Reading trusts nothing in the file: every array's header is checked against the
bytes the archive really holds before anything is allocated, so a damaged or
hostile file is a one-line :class:`CheckpointError`, never a traceback or a
request for terabytes.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import zipfile
from pathlib import Path

from . import backend as B


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, or does not fit the model."""


#: What an ``.npz`` archive (a zip file) starts with: a member, or an empty archive's end record.
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
#: A deflated member expands to at most about this many times its size (deflate's limit is 1032).
MAX_DEFLATE_RATIO = 1100


def file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file (0666 less the umask); temporary files
    are made 0600, and the finished file gets this one, so checkpoints and exports agree."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path, write, mode: int | None = None) -> Path:
    """Write a file through ``write(f)`` (``f`` a binary file) to a temporary file beside ``path``,
    flush it to disk and rename it over ``path``: a reader sees the old file or the new one, never
    part of one. ``mode`` defaults to :func:`file_mode`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path, text: str) -> Path:
    """:func:`write_atomic` for UTF-8 text (``config.json``, ``metrics.json``, ...)."""
    data = text.encode("utf-8")
    return write_atomic(path, lambda f: f.write(data))


def remove_stale_temporaries(folder, names) -> list[Path]:
    """Remove the temporary files (``.NAME.*.tmp``) that a killed writer of ``folder/NAME`` left;
    returns those removed."""
    removed = []
    for name in names:
        for tmp in Path(folder).glob(f".{name}.*.tmp"):
            if tmp.is_file():
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
    return removed


def save_npz(path, arrays: dict, meta: dict) -> Path:
    """Write ``arrays`` (name -> NumPy or CuPy array) and ``meta`` (JSON-able) to ``path`` atomically."""
    payload = {k: B.to_host(v) for k, v in arrays.items()}
    payload["__meta__"] = B.host.array(json.dumps(meta, sort_keys=True))
    return write_atomic(path, lambda f: B.host.savez(f, **payload))


def _what_it_is(head: bytes) -> str:
    """What a file that is not an ``.npz`` archive seems to be, from its first bytes."""
    if head.startswith(b"\x93NUMPY"):
        return "it is a single .npy array, not an .npz archive"
    if head[:1] == b"\x80":
        return "it is a pickle file, which attn never loads (unpickling an untrusted file can run any code)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"it starts with the bytes {head[:8]!r}"
    return f"it looks like text (it starts with {text[:16]!r})"


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo):
    """One array of the archive, its header checked against the bytes the member holds."""
    np = B.host
    fmt = np.lib.format
    name = info.filename
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise ValueError(f"member {name} is compressed with method {info.compress_type}, which attn does not read")
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size \
            or info.file_size > MAX_DEFLATE_RATIO * info.compress_size + 1024:
        raise ValueError(f"member {name} claims {info.file_size} bytes but stores {info.compress_size}")
    with zf.open(info) as f:
        version = fmt.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"member {name} is an .npy file of version {version}, which attn does not read")
        read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran_order, dtype = read_header(f)
        if dtype.hasobject:
            raise ValueError(f"member {name} holds pickled Python objects, which attn never loads "
                             "(unpickling an untrusted file can run any code)")
        claimed = math.prod(shape) * dtype.itemsize
        held = info.file_size - f.tell()
        if claimed != held:
            raise ValueError(f"member {name} claims shape {shape} of {dtype} ({claimed:,} bytes) "
                             f"but holds {held:,} bytes")
        buf = bytearray(claimed)
        if f.readinto(buf) != claimed:
            raise EOFError(f"member {name} ends early")
    a = np.frombuffer(buf, dtype=dtype)
    return a.reshape(shape[::-1]).T if fortran_order else a.reshape(shape)


def load_npz(path) -> tuple[dict, dict]:
    """Read a file written by :func:`save_npz`. Returns (arrays on the host, meta).

    Raises CheckpointError naming the file if it is missing, truncated or corrupt. Memory is
    bounded by the file's size: no header can ask for more than the file holds.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder, not a file")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror})") from None
    if any(magic.startswith(head) for magic in ZIP_MAGIC):      # the start of an archive, and no more
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt (it ends after {len(head)} bytes)")
    if not head.startswith(ZIP_MAGIC):
        raise CheckpointError(f"checkpoint {path} is not an .npz archive: {_what_it_is(head)}")
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            names = [i.filename for i in infos]
            bad = [n for n in names if not n.endswith(".npy")] or sorted({n for n in names if names.count(n) > 1})
            if bad:
                raise ValueError(f"member {bad[0]!r} is not one array")
            arrays = {i.filename[:-len(".npy")]: _read_member(zf, i) for i in infos}
    except MemoryError:
        raise
    except Exception as e:
        # A damaged zip raises BadZipFile, EOFError or ValueError, but also NotImplementedError
        # (a flipped compression field), RuntimeError (a flipped "encrypted" flag) or zlib.error.
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    if "__meta__" not in arrays:
        raise CheckpointError(f"checkpoint {path} has no __meta__ record: not written by attn")
    meta = arrays.pop("__meta__")
    try:
        if meta.shape != () or meta.dtype.kind != "U":
            raise ValueError(f"it is a {meta.dtype} array of shape {meta.shape}, not one string")
        meta = json.loads(str(meta))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable __meta__ record ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path} has a __meta__ record that is not a JSON object: {meta!r:.80}")
    return arrays, meta

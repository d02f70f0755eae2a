"""Writing and reading ``.npz`` files atomically, with no pickling.

A file holds named arrays plus one JSON document (``__meta__``) for everything
that is not an array (the config, the schedule step, the data position). It is
written to a temporary file in the same folder, flushed to disk, then renamed
over the old one: a crash or Ctrl-C mid-write leaves the previous file intact,
and a temporary file that a hard kill leaves behind (``.NAME.*.tmp``) is removed
by :func:`remove_stale_temporaries` when the next run starts.

Reading trusts nothing in the file: the members' names and the sizes the archive
declares are checked before anything is decompressed (against a total budget,
and, where the reader says what it expects, against the names and bytes its
config implies), and every array's header against the bytes the member really
holds before anything is allocated, so a damaged or hostile file is a one-line
:class:`CheckpointError`, never a traceback or a request for terabytes.
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
#: The most bytes the arrays of one archive may expand to, all members together, unless the reader
#: says otherwise (:func:`load_npz`'s ``max_bytes``): the paper's big model with Adam's moments in
#: float64 is under 6 GiB.
MAX_NPZ_BYTES = 16 * 2**30
#: The most bytes the ``__meta__`` record (config, vocabulary, evaluations) may have.
MAX_META_BYTES = 256 * 2**20


class _Refused(Exception):
    """What a member of an archive may not be, in words (reported as the file's problem)."""


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


def _check_members(infos: list, max_bytes: int) -> None:
    """The archive's members as the central directory declares them, before any is decompressed:
    one ``.npy`` array each under a name of its own, a method attn reads, a size its compressed
    bytes can hold, ``__meta__`` at most :data:`MAX_META_BYTES`, all together at most ``max_bytes``."""
    names = [i.filename for i in infos]
    bad = [n for n in names if not n.endswith(".npy")] or sorted({n for n in names if names.count(n) > 1})
    if bad:
        raise ValueError(f"member {bad[0]!r} is not one array")
    for info in infos:
        name = info.filename
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ValueError(f"member {name} is compressed with method {info.compress_type}, which attn does not read")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size \
                or info.file_size > MAX_DEFLATE_RATIO * info.compress_size + 1024:
            raise ValueError(f"member {name} claims {info.file_size:,} bytes but stores {info.compress_size:,}")
        if name == "__meta__.npy" and info.file_size > MAX_META_BYTES:
            raise _Refused(f"member {name} claims {info.file_size:,} bytes, more than the "
                           f"{MAX_META_BYTES:,} a record of settings may have")
    total = sum(i.file_size for i in infos)
    if total > max_bytes:
        raise _Refused(f"its arrays claim {total:,} bytes, more than the {max_bytes:,} this reader allows")


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo):
    """One array of the archive, its header checked against the bytes the member holds."""
    np = B.host
    fmt = np.lib.format
    name = info.filename
    with zf.open(info) as f:
        version = fmt.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"member {name} is an .npy file of version {version}, which attn does not read")
        read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        try:
            shape, fortran_order, dtype = read_header(f)
        except ValueError as e:         # NumPy's words would suggest allow_pickle=True
            if "max_header_size" not in str(e):
                raise
            raise ValueError(f"member {name} has an .npy header over 10,000 bytes, "
                             "more than an array's needs") from None
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


def _parse_meta(path: Path, meta) -> dict:
    try:
        if meta.shape != () or meta.dtype.kind != "U":
            raise ValueError(f"it is a {meta.dtype} array of shape {meta.shape}, not one string")
        meta = json.loads(str(meta))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable __meta__ record ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path} has a __meta__ record that is not a JSON object: {meta!r:.80}")
    return meta


def load_npz(path, expect=None, max_bytes: int = MAX_NPZ_BYTES) -> tuple[dict, dict]:
    """Read a file written by :func:`save_npz`. Returns (arrays on the host, meta).

    Raises CheckpointError naming the file if it is missing, truncated, corrupt or larger than
    allowed. Memory is bounded by the file's size and by ``max_bytes``, the most its arrays may
    expand to all together, checked before anything is decompressed. ``expect(meta, sizes)``, if
    given, says what the reader takes once the ``__meta__`` record (read first) and the sizes the
    other members declare (``{name: bytes}``, names without ``.npy``) are known: a dict from those
    names to True (read) or False (left unread); it raises CheckpointError for what it refuses,
    and a member it leaves out is refused too.
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
            _check_members(infos, max_bytes)
            members = {i.filename[:-len(".npy")]: i for i in infos}
            if "__meta__" not in members:
                raise CheckpointError(f"checkpoint {path} has no __meta__ record: not written by attn")
            meta = _parse_meta(path, _read_member(zf, members.pop("__meta__")))
            try:
                wanted = ({name: True for name in members} if expect is None else
                          expect(meta, {name: info.file_size for name, info in members.items()}))
            except CheckpointError as e:
                raise CheckpointError(f"checkpoint {path}: {e}") from None
            unknown = sorted(set(members) - set(wanted))
            if unknown:
                raise _Refused(f"member {unknown[0]!r} is not one this reader takes"
                               + (f" (nor are {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
            arrays = {name: _read_member(zf, info) for name, info in members.items() if wanted[name]}
    except (MemoryError, CheckpointError):
        raise
    except _Refused as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    except Exception as e:
        # A damaged zip raises BadZipFile, EOFError or ValueError, but also NotImplementedError
        # (a flipped compression field), RuntimeError (a flipped "encrypted" flag) or zlib.error.
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    return arrays, meta

"""Writing and reading ``.npz`` files atomically, with no pickling.

A file holds named arrays plus one JSON document (``__meta__``) for everything
that is not an array (the config, the schedule step, the data position). It is
written to a temporary file in the same folder, flushed to disk, then renamed
over the old one: a crash or Ctrl-C mid-write leaves the previous file intact.
"""
from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

from . import backend as B


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, or does not fit the model."""


def save_npz(path, arrays: dict, meta: dict) -> Path:
    """Write ``arrays`` (name -> NumPy or CuPy array) and ``meta`` (JSON-able) to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {k: B.to_host(v) for k, v in arrays.items()}
    payload["__meta__"] = B.host.array(json.dumps(meta, sort_keys=True))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            B.host.savez(f, **payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def load_npz(path) -> tuple[dict, dict]:
    """Read a file written by :func:`save_npz`. Returns (arrays on the host, meta).

    Raises CheckpointError naming the file if it is missing, truncated or corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        z = B.host.load(path, allow_pickle=False)
        if not hasattr(z, "files"):       # a bare .npy file loads as one array, not as an archive
            raise zipfile.BadZipFile("a single .npy array, not an .npz archive")
        with z:
            arrays = {k: z[k] for k in z.files}
    except MemoryError:
        raise
    except Exception as e:
        # A damaged zip raises BadZipFile, EOFError or ValueError, but also NotImplementedError
        # (a flipped compression field) or RuntimeError (a flipped "encrypted" flag).
        reason = f"{type(e).__name__}: {e}"
        if "pickle" in str(e).lower():
            # NumPy's message advises loading the file with pickle: never relay that for a file
            # we could not read, since unpickling an untrusted file can run any code.
            reason = ("it is not an .npz archive of plain arrays but holds pickled Python objects, "
                      "which attn never loads")
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({reason})") from None
    if "__meta__" not in arrays:
        raise CheckpointError(f"checkpoint {path} has no __meta__ record: not written by attn")
    try:
        meta = json.loads(str(arrays.pop("__meta__")))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable __meta__ record ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path} has a __meta__ record that is not a JSON object: {meta!r:.80}")
    return arrays, meta

"""Export a trained model for the browser: ``attn-export CHECKPOINT DIR``.

    attn-export runs/toy/averaged.npz web/models/mine --sentences data/toy/test.en
    python -m http.server -d web        # then open http://127.0.0.1:8000/?model=models/mine

writes a folder of two files that the page in ``web/`` (plain JavaScript, no build step) reads:

``DIR/model.json``
    the format's name and version, the configuration (the fields of
    :class:`attn.model.TransformerConfig`), the vocabulary exactly as checkpoints
    store it (a list of tokens, or ``{"itos": [...], "bpe": {"alphabet", "merges"}}``),
    the special ids, a few example sentences, and the index of the weights: for each
    parameter its dotted name, its byte offset into the binary file and its shape.
``DIR/weights.bin``
    every parameter, one after the other in the index's order, row-major,
    little-endian IEEE float32 (or float16 with ``--float16``: half the bytes; or, with
    ``--int8``, every matrix as signed bytes with a float32 scale per output channel
    (:mod:`attn.quantize`) and every vector in float32: about a quarter of the bytes).

The folder is written beside ``DIR`` and renamed into place, so a reader never sees the
model of one export with the weights of another; a folder that already holds an export is
replaced only when asked (``--overwrite``). What an export that was killed left beside ``DIR``
(a hidden ``.DIR.xxxxxxxx.new`` or ``.old`` folder) the next export removes.

Nothing in either file is executable or pickled: JSON and raw numbers. The format
is described in ``docs/WEB_FORMAT.md``; :func:`load_export` reads it back into a
:class:`attn.model.Transformer`, which is how the tests compare the page with NumPy.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .. import backend as B
from ..checkpoint import CheckpointError, write_atomic
from ..evaluate import MAX_SOURCE_TOKENS, MAX_SOURCE_TOKENS_LIMIT
from ..model import MAX_LEN_LIMIT  # noqa: F401  (the format's bound: a config over it is refused as it is read)

#: The format's name and version, the first thing a reader checks.
FORMAT = "attn-web-1"
MODEL_FILE = "model.json"
WEIGHTS_FILE = "weights.bin"
#: Bytes per number of each storage type; both little-endian IEEE 754. An ``int8`` export holds
#: its matrices as one byte a number (with float32 scales) and its vectors as float32.
DTYPES = {"float32": 4, "float16": 2, "int8": 1}

EXAMPLES = """\
examples:
  attn-export runs/toy/averaged.npz web/models/mine
  attn-export runs/toy/averaged.npz web/models/mine --float16 --sentences data/toy/test.en --max-sentences 100
  attn-export runs/toy/averaged.npz web/models/mine --overwrite     # replace the export there
  python -m http.server -d web     # then open http://127.0.0.1:8000/?model=models/mine
"""


class ExportError(ValueError):
    """An exported model folder is missing, incomplete, or not in this format."""


def export_model(model, vocab, out_dir, dtype: str = "float32", sentences=(), source: str = "",
                 max_source_tokens: int = MAX_SOURCE_TOKENS, overwrite: bool = False,
                 char: bool = False, context: int | None = None) -> dict:
    """Write ``model`` (a :class:`attn.model.Transformer`) and ``vocab`` (a :class:`attn.data.Vocab`)
    to ``out_dir``. Returns the JSON document written to ``model.json``.

    ``dtype`` is the storage type of the weights, ``"float32"``, ``"float16"`` (values
    outside float16's range are an error, not silently infinite) or ``"int8"`` (every matrix
    quantised a channel at a time, :func:`attn.quantize.quantize_matrix`, or as the model holds it
    if its params are already an :class:`attn.quantize.Int8Params`). ``sentences`` are
    example source sentences the page offers in a list. ``max_source_tokens`` is the most
    tokens the page lets a sentence have (its end mark included; at most
    :data:`attn.evaluate.MAX_SOURCE_TOKENS_LIMIT`, and the model's ``max_len`` bounds it too),
    written as ``model.json``'s ``max_source_tokens``.

    A decoder-only model (``n_encoder_layers=0``, a language model of ``attn-train --task lm``) is
    written with ``model.json``'s ``language_model``: ``char`` (its vocabulary is characters, else
    words or BPE pieces of lines ended by EOS, :func:`attn.data.encode_text`) and ``context``, the
    most positions it reads (default its ``max_len``), as ``attn-generate`` reads them.

    The two files are written into a new folder beside ``out_dir`` that then takes its place
    (:func:`_swap_in`). An ``out_dir`` that holds an export is an :class:`ExportError` unless
    ``overwrite``; one that holds anything else is always one.
    """
    if dtype not in DTYPES:
        raise ValueError(f"export_model: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if isinstance(max_source_tokens, bool) or not isinstance(max_source_tokens, int) \
            or not 2 <= max_source_tokens <= MAX_SOURCE_TOKENS_LIMIT:
        raise ValueError(f"export_model: max_source_tokens must be an integer from 2 to {MAX_SOURCE_TOKENS_LIMIT:,}, "
                         f"got {max_source_tokens!r}")
    if len(vocab) != model.config.target_vocab_size:
        raise ValueError(f"export_model: the vocabulary has {len(vocab)} tokens, "
                         f"the model {model.config.target_vocab_size}")
    out_dir, started = Path(out_dir), time.time()
    _check_destination(out_dir, overwrite)
    tensors, chunks, offset = (_int8_weights if dtype == "int8" else _weights)(model, dtype)
    max_source_tokens = min(max_source_tokens, model.config.max_len)     # no longer than it was trained on
    lm = _language_model(model.config, char, context)
    doc = {
        "format": FORMAT,
        "config": model.config.to_dict(),
        "vocab": vocab.to_json(),
        "specials": {"pad": 0, "bos": 1, "eos": 2, "unk": 3},
        "max_source_tokens": max_source_tokens,
        "sentences": [str(s) for s in sentences],
        "source": source,
        "weights": {"file": WEIGHTS_FILE, "dtype": dtype, "byte_order": "little", "bytes": offset,
                    "tensors": tensors},
        **({"language_model": lm} if lm else {}),
    }
    text = (json.dumps(doc, ensure_ascii=False, indent=1) + "\n").encode("utf-8")
    _remove_stale(out_dir, started)
    _swap_in(out_dir, {WEIGHTS_FILE: b"".join(chunks), MODEL_FILE: text})
    return doc


def _language_model(cfg, char: bool, context: int | None) -> dict | None:
    """model.json's ``language_model`` for a decoder-only ``cfg`` (None for a translator), checked."""
    if cfg.n_encoder_layers:
        return None
    context = cfg.max_len if context is None else context
    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= cfg.max_len:
        raise ValueError(f"export_model: context must be an integer from 1 to the model's max_len "
                         f"({cfg.max_len}), got {context!r}")
    return {"char": bool(char), "context": context}


def _weights(model, dtype: str) -> tuple[list, list, int]:
    """``model``'s parameters as ``dtype`` little-endian bytes, each checked (its shape the config's,
    finite, within float16's range for float16): (the index of tensors, the chunks of bytes, their
    length in all)."""
    np = B.host
    from ..model import parameter_shapes
    tensors, chunks, offset = [], [], 0
    for name, shape in parameter_shapes(model.config).items():
        a = B.to_host(model.params[name]).astype(np.float64)
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"export_model: parameter {name} has shape {a.shape}, the config says {shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"export_model: parameter {name} holds NaN or infinite values")
        if dtype == "float16" and np.abs(a).max(initial=0.0) > float(np.finfo(np.float16).max):
            raise ValueError(f"export_model: parameter {name} has values beyond float16's range "
                             f"(|x| up to {np.abs(a).max():.4g}); export it as float32")
        raw = a.astype("<f4" if dtype == "float32" else "<f2").tobytes()
        tensors.append({"name": name, "offset": offset, "shape": list(shape)})
        chunks.append(raw)
        offset += len(raw)
    return tensors, chunks, offset


def _int8_weights(model, dtype: str = "int8") -> tuple[list, list, int]:
    """``model``'s matrices as int8 bytes, each followed by its float32 scales (its index entry has
    ``scales``, their byte offset, and ``axis``, 0 for one scale a row and 1 a column), and its vectors
    as float32; every tensor starts on a multiple of 4 bytes: (the index, the chunks, their length)."""
    np = B.host
    from ..model import parameter_shapes
    from ..quantize import Int8Params, quantize_matrix
    tensors, chunks, offset = [], [], 0
    for name, shape in parameter_shapes(model.config).items():
        if isinstance(model.params, Int8Params) and name in model.params.quantized:
            q, scale = (B.to_host(a) for a in model.params.quantized[name])
        else:
            a = B.to_host(model.params[name]).astype(np.float32)
            if tuple(a.shape) != tuple(shape) or not np.isfinite(a).all():
                raise ValueError(f"export_model: parameter {name} has shape {a.shape} (the config says {shape}) "
                                 "or holds NaN or infinite values")
            if a.ndim != 2:
                raw = a.astype("<f4").tobytes()
                tensors.append({"name": name, "offset": offset, "shape": list(shape)})
                chunks.append(raw)
                offset += len(raw)
                continue
            q, scale = quantize_matrix(name, a)
        raw = q.astype(np.int8).tobytes() + bytes(-q.size % 4)              # pad: the scales start aligned
        scales = scale.astype("<f4").tobytes()
        tensors.append({"name": name, "offset": offset, "shape": list(shape), "scales": offset + len(raw),
                        "axis": 0 if scale.shape[1] == 1 else 1})
        chunks += [raw, scales]
        offset += len(raw) + len(scales)
    return tensors, chunks, offset


def _check_destination(out_dir: Path, overwrite: bool) -> None:
    """An ExportError unless ``out_dir`` is new, an empty folder, or an export that ``overwrite``
    allows replacing."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} is a file, not a folder")
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    others = [n for n in held if n not in (MODEL_FILE, WEIGHTS_FILE)]
    if others:
        raise ExportError(f"{out_dir} holds other files than an export ({', '.join(others[:5])}): an export "
                          f"replaces its whole folder, so give it a folder of its own")
    if held and not overwrite:
        raise ExportError(f"{out_dir} already holds an export ({', '.join(held)}): pass --overwrite to replace "
                          f"it, or choose another folder")


def _remove_stale(out_dir: Path, started: float) -> None:
    """Remove the folders that an export killed while it wrote (``.DIR.xxxxxxxx.new``) or swapped
    (``.DIR.xxxxxxxx.old``) left beside ``out_dir``: those last changed before ``started``, this
    export's start (one being written now is newer)."""
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.[a-z0-9_]{{8}}\.(new|old)")
    if not out_dir.parent.is_dir():
        return
    for p in out_dir.parent.iterdir():
        try:
            if pattern.fullmatch(p.name) and not p.is_symlink() and p.is_dir() and p.stat().st_mtime < started:
                shutil.rmtree(p)
        except OSError:
            pass                                        # gone already, or not ours to remove: leave it


def _swap_in(out_dir: Path, files: dict) -> None:
    """Write ``files`` (name -> bytes) into a new folder beside ``out_dir`` and rename it into place
    (over an empty ``out_dir`` in one step; an old export is first renamed aside, then removed),
    so that a reader finds both old files, both new ones, or none, never a mixed pair."""
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".new", dir=parent))
    old = None
    try:
        for name, data in files.items():
            write_atomic(new / name, lambda f, data=data: f.write(data))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(new, 0o777 & ~umask)             # mkdtemp's 0700 would hide the folder from a web server
        if out_dir.is_dir() and any(out_dir.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=parent))
            os.replace(out_dir, old / "export")
        os.replace(new, out_dir)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        if old is not None and (old / "export").is_dir() and not out_dir.exists():
            os.replace(old / "export", out_dir)                 # put the previous export back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def export_checkpoint(checkpoint, out_dir, dtype: str = "float32", sentences=(),
                      max_source_tokens: int = MAX_SOURCE_TOKENS, overwrite: bool = False, adapter=None) -> dict:
    """Export a checkpoint written by ``attn-train`` (its config, vocabulary and parameters), with
    ``adapter``'s LoRA adapters merged into its weights if given."""
    from ..translate import load_translator
    model, vocab = load_translator(checkpoint, adapter)
    char, context = False, None
    if not model.config.n_encoder_layers:               # a language model: how attn-generate reads it
        from ..generate import load_language_model
        _, _, char, context = load_language_model(Path(checkpoint))
        context = min(context, model.config.max_len)
    return export_model(model, vocab, out_dir, dtype, sentences, source=Path(checkpoint).name,
                        max_source_tokens=max_source_tokens, overwrite=overwrite, char=char, context=context)


def load_export(out_dir):
    """Read an exported folder back: ``(Transformer on the host in float32, Vocab, the model.json document)``.

    The parameters are exactly the numbers the page computes with (float16 ones widened
    to float32, which is exact). Raises :class:`ExportError` naming the file and the problem.
    """
    from ..data import DataError, Vocab
    from ..model import Transformer, TransformerConfig, parameter_shapes
    out_dir = Path(out_dir)
    meta_path, bin_path = out_dir / MODEL_FILE, out_dir / WEIGHTS_FILE
    doc = _read_model_json(out_dir, meta_path, bin_path)
    try:
        cfg = TransformerConfig.from_dict(doc["config"])
        vocab = Vocab.from_json(doc["vocab"])
        weights = doc["weights"]
        dtype, tensors, size = weights["dtype"], weights["tensors"], weights["bytes"]
        index = {t["name"]: (t["offset"], tuple(t["shape"]), t.get("scales"), t.get("axis")) for t in tensors}
    except (KeyError, TypeError, ValueError, AttributeError, DataError) as e:
        raise ExportError(f"{meta_path}: unreadable config, vocabulary or weights index "
                          f"({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ExportError(f"{meta_path}: weights dtype {dtype!r:.40} is not one of {sorted(DTYPES)}")
    limit = doc.get("max_source_tokens", MAX_SOURCE_TOKENS)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 2 <= limit <= MAX_SOURCE_TOKENS_LIMIT:
        raise ExportError(f"{meta_path}: max_source_tokens must be an integer from 2 to {MAX_SOURCE_TOKENS_LIMIT:,}, "
                          f"got {limit!r:.40}")
    examples = doc.get("sentences", [])
    if not isinstance(examples, list) or not all(isinstance(x, str) for x in examples):
        raise ExportError(f"{meta_path}: sentences must be a list of strings")
    _check_language_model(meta_path, cfg, doc.get("language_model"))
    on_disk = bin_path.stat().st_size
    if on_disk != size:
        raise ExportError(f"{bin_path} has {on_disk} bytes, {meta_path} says {size!r:.40}")
    expected = parameter_shapes(cfg)
    if set(index) != set(expected):
        raise ExportError(f"{meta_path}: the weights index does not fit the config: missing "
                          f"{sorted(set(expected) - set(index))}, unexpected {sorted(set(index) - set(expected))}")
    params = _read_weights(meta_path, bin_path, expected, index, dtype)
    if len(vocab) != cfg.target_vocab_size:
        raise ExportError(f"{meta_path}: the vocabulary has {len(vocab)} tokens, the model {cfg.target_vocab_size}")
    return Transformer(cfg, dtype="float32", params=params), vocab, doc


def _check_language_model(meta_path: Path, cfg, lm) -> None:
    """An ExportError unless ``lm`` (model.json's ``language_model``) is what export_model writes
    for ``cfg``: {"char": bool, "context": 1..max_len} for a decoder-only model, absent otherwise."""
    if cfg.n_encoder_layers:
        if lm is not None:
            raise ExportError(f"{meta_path}: language_model is given, but the model is a translator "
                              f"(n_encoder_layers {cfg.n_encoder_layers})")
        return
    ok = isinstance(lm, dict) and set(lm) == {"char", "context"} and isinstance(lm["char"], bool) \
        and isinstance(lm["context"], int) and not isinstance(lm["context"], bool) and 1 <= lm["context"] <= cfg.max_len
    if not ok:
        raise ExportError(f"{meta_path}: a decoder-only model needs language_model {{\"char\": true or false, "
                          f"\"context\": 1 to max_len ({cfg.max_len})}}, got {json.dumps(lm)[:60]}")


def _read_model_json(out_dir: Path, meta_path: Path, bin_path: Path) -> dict:
    """``model.json``'s document, once both files are there and it is JSON of this format."""
    for p in (meta_path, bin_path):
        if not p.is_file():
            raise ExportError(f"{p} does not exist: is {out_dir} a folder written by attn-export?")
    try:
        doc = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ExportError(f"{meta_path} is not readable JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ExportError(f"{meta_path}: format {doc.get('format') if isinstance(doc, dict) else doc!r:.40}, "
                          f"expected {FORMAT!r}")
    return doc


def _read_weights(meta_path: Path, bin_path: Path, expected: dict, index: dict, dtype: str) -> dict:
    """Each parameter of ``expected`` (name -> shape) read from ``bin_path`` where ``index`` (name ->
    (offset, shape, scales, axis)) says, checked (its shape, its bytes inside the file, finite) and
    widened to float32 on the device (an int8 matrix dequantised, ``q * scale`` in float32)."""
    np = B.host
    raw = bin_path.read_bytes()
    params = {}
    for name, shape in expected.items():
        offset, found, scales, axis = index[name]
        if found != tuple(shape):
            raise ExportError(f"{meta_path}: {name} has shape {list(found)}, the config says {list(shape)}")
        if dtype == "int8" and len(shape) == 2:
            params[name] = B.to_device(_read_int8(meta_path, bin_path, raw, name, shape, offset, scales, axis))
            continue
        n = int(np.prod(shape)) * (4 if dtype == "int8" else DTYPES[dtype])         # int8 exports' vectors: float32
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= len(raw) - n:
            raise ExportError(f"{meta_path}: {name} at offset {offset!r:.40} runs past the end of {bin_path}")
        a = np.frombuffer(raw, dtype="<f2" if dtype == "float16" else "<f4", count=int(np.prod(shape)),
                          offset=offset)
        if not np.isfinite(a).all():
            raise ExportError(f"{bin_path}: {name} holds NaN or infinite numbers")
        params[name] = B.to_device(a.astype(np.float32).reshape(shape))
    return params


def _read_int8(meta_path: Path, bin_path: Path, raw: bytes, name: str, shape, offset, scales, axis):
    """An int8 matrix of ``shape`` at ``offset`` and its float32 scales at ``scales`` (one a row for
    ``axis`` 0, a column for 1), checked (inside the file, 4-byte aligned, finite non-negative scales),
    dequantised to float32 on the host."""
    np = B.host
    n = int(np.prod(shape))
    if isinstance(axis, bool) or axis not in (0, 1):
        raise ExportError(f"{meta_path}: {name} has axis {axis!r:.40}, expected 0 (a scale a row) or 1 (a column)")
    channels = shape[axis]
    for what, at, size in (("", offset, n), (" scales", scales, 4 * channels)):
        if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= len(raw) - size or at % 4:
            raise ExportError(f"{meta_path}: {name}{what} at offset {at!r:.40} runs past the end of {bin_path} "
                              "or is not a multiple of 4")
    q = np.frombuffer(raw, dtype=np.int8, count=n, offset=offset).reshape(shape)
    s = np.frombuffer(raw, dtype="<f4", count=channels, offset=scales).astype(np.float32)
    if not (np.isfinite(s).all() and (s >= 0).all()):
        raise ExportError(f"{bin_path}: {name}'s scales hold NaN, infinite or negative numbers")
    return q.astype(np.float32) * s.reshape((channels, 1) if axis == 0 else (1, channels))


def _read_sentences(path, limit: int) -> list[str]:
    from ..data import _read_lines
    lines = [line.strip() for line in _read_lines(path)]
    return [s for s in lines if s][:limit] if limit else [s for s in lines if s]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attn-export",
        description="Export a checkpoint written by attn-train for the browser page in web/: DIR/model.json "
                    "(configuration, vocabulary, example sentences, the index of the weights) and "
                    "DIR/weights.bin (the parameters, little-endian float32 or float16). No pickle, nothing "
                    "executable; the format is docs/WEB_FORMAT.md.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                   help="a checkpoint written by attn-train, e.g. runs/toy/averaged.npz")
    p.add_argument("out", type=Path, metavar="DIR", help="the folder to write model.json and weights.bin to")
    p.add_argument("--adapter", type=Path, metavar="FILE",
                   help="LoRA adapters written by attn-train --lora (OUT/adapter.npz), merged into CHECKPOINT's "
                        "weights: the page runs the adapted model at the base model's cost")
    p.add_argument("--float16", action="store_true",
                   help="store the weights as float16 (half the bytes; the page widens them to float32)")
    p.add_argument("--int8", action="store_true",
                   help="store every matrix as int8 with a float32 scale per output channel, the vectors as "
                        "float32 (about a quarter of float32's bytes; the page dequantises them as it loads)")
    p.add_argument("--sentences", type=Path, metavar="FILE",
                   help="source sentences, one per line, that the page offers to pick from, "
                        "e.g. --sentences data/toy/test.en")
    p.add_argument("--max-sentences", type=int, default=100, metavar="N",
                   help="keep the first N of --sentences (default 100; 0: all)")
    p.add_argument("--max-length", type=int, default=MAX_SOURCE_TOKENS, metavar="N",
                   help=f"the most tokens the page lets a sentence have, its end mark included (default "
                        f"{MAX_SOURCE_TOKENS}, at most {MAX_SOURCE_TOKENS_LIMIT:,} and the model's max_len; "
                        "model.json's max_source_tokens): attention's memory and time grow with the square of "
                        "the length")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the export that DIR already holds (without it, that is an error)")
    return p


def _backend_problem() -> str | None:
    """Why the backend that $ATTN_BACKEND names cannot be used, in one line, or None."""
    try:
        B.get_backend()
    except B.BackendError as e:
        return str(e)
    except ValueError:
        return f"ATTN_BACKEND must be numpy, cupy or auto, got {os.environ.get('ATTN_BACKEND')!r}"
    return None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ..data import DataError
    problem = _backend_problem()
    if problem:
        print(f"attn-export: error: {problem}", file=sys.stderr)
        return 2
    if args.max_sentences < 0:
        print(f"attn-export: error: --max-sentences must be at least 0, got {args.max_sentences}", file=sys.stderr)
        return 2
    if not 2 <= args.max_length <= MAX_SOURCE_TOKENS_LIMIT:
        print(f"attn-export: error: --max-length must be from 2 to {MAX_SOURCE_TOKENS_LIMIT:,}, got {args.max_length}",
              file=sys.stderr)
        return 2
    try:
        _check_destination(args.out, args.overwrite)          # before reading anything
        sentences = _read_sentences(args.sentences, args.max_sentences) if args.sentences else []
        if args.float16 and args.int8:
            raise ValueError("--float16 and --int8 are two storage types: give one")
        dtype = "int8" if args.int8 else "float16" if args.float16 else "float32"
        doc = export_checkpoint(args.checkpoint, args.out, dtype, sentences,
                                max_source_tokens=args.max_length, overwrite=args.overwrite, adapter=args.adapter)
    except (CheckpointError, DataError, ValueError) as e:
        print(f"attn-export: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"attn-export: error: cannot write {args.out}: {e}", file=sys.stderr)
        return 2
    cfg = doc["config"]
    print(f"attn-export: wrote {args.out / MODEL_FILE} and {args.out / WEIGHTS_FILE} "
          f"({doc['weights']['bytes']:,} bytes, {doc['weights']['dtype']}; {len(doc['weights']['tensors'])} "
          f"tensors; d_model {cfg['d_model']}, {cfg['n_encoder_layers']}+{cfg['n_decoder_layers']} layers, "
          f"{cfg['n_heads']} heads; {len(doc['sentences'])} example sentences)")
    fp32 = 4 * sum(math.prod(t["shape"]) for t in doc["weights"]["tensors"])
    print(f"attn-export: weights.bin {doc['weights']['bytes']:,} bytes; in float32 it would be {fp32:,} "
          f"({doc['weights']['bytes'] / fp32:.3f} of it)")
    if lm := doc.get("language_model"):
        print(f"attn-export: a language model ({'characters' if lm['char'] else 'words or BPE pieces'}, context "
              f"{lm['context']}): open lm.html?model=... to generate with it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

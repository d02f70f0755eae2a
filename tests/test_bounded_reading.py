"""Small files cost small memory: a checkpoint's members are checked by name and declared size
before anything is decompressed, a config's size before anything is allocated, and NaN weights are
refused; each under a 2 GB ``ulimit -v``, in one line."""
from __future__ import annotations

import functools
import io
import json
import os
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from attn.checkpoint import CheckpointError, load_npz, save_npz
from attn.data import Vocab
from attn.model import Transformer, TransformerConfig
from attn.model_files import model_members

ROOT = Path(__file__).resolve().parents[1]
ONE_GB = 2**30


def deflated_zeros(header: bytes, n: int):
    """(payload, crc, size): raw deflate of ``header`` and ``n`` zero bytes (a multiple of 16 MiB) in
    about n/1000 bytes, one compressed block of 16 MiB repeated (each ends in a full flush, so the
    copies join), without compressing n bytes."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(header) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(bytes(2**24)) + c.flush(zlib.Z_FULL_FLUSH)
    crc, zeros = zlib.crc32(header), bytes(2**24)
    for _ in range(n // 2**24):
        crc = zlib.crc32(zeros, crc)
    return head + block * (n // 2**24) + c.flush(zlib.Z_FINISH), crc, len(header) + n


def npy_bomb(shape=(ONE_GB // 4,)):
    """An .npy member of float32 zeros of ``shape`` (1 GB), as (method, payload, crc, size)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return (zipfile.ZIP_DEFLATED, *deflated_zeros(header.getvalue(), 4 * int(np.prod(shape))))


def rewrite(path: Path, replace: dict) -> Path:
    """A copy of ``path`` (an .npz) beside it, written by hand with the members of ``replace`` (name:
    (method, payload, crc, size)) put in or replaced: a zip of stored members plus the given ones."""
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: (zipfile.ZIP_STORED, zf.read(i), i.CRC, i.file_size) for i in zf.infolist()}
    entries.update(replace)
    out, central = bytearray(), bytearray()
    for name, (method, payload, crc, size) in entries.items():
        n, offset = name.encode(), len(out)
        out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0x21, crc, len(payload), size, len(n), 0)
        out += n + payload
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0x21, crc, len(payload), size,
                               len(n), 0, 0, 0, 0, 0, offset) + n
    out += central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(central),
                                 len(out), 0)
    copy = path.with_name(f"{path.stem}-{len(list(path.parent.glob('*.npz')))}.npz")
    copy.write_bytes(bytes(out))
    return copy


@pytest.fixture
def checkpoint(tmp_path):
    vocab = Vocab.build([["a", "b", "c", "."]])
    cfg = TransformerConfig(vocab_size=len(vocab), d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                            n_decoder_layers=1)
    model = Transformer(cfg, seed=0)
    return model.save(tmp_path / "checkpoint.npz", extra_meta={"vocab": vocab.to_json()},
                      extra_arrays={"history/train_loss": np.ones(3)})


def translate_in_2gb(checkpoint, *args):
    """``attn-translate`` under ``ulimit -v 2000000`` (2 GB of address space)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATTN_BACKEND": "numpy", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = f"ulimit -v 2000000 && exec {sys.executable} -m attn.translate --checkpoint \"$0\" \"$@\""
    return subprocess.run(["bash", "-c", cmd, str(checkpoint), *(args or ["a b ."])], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def refused(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attn-translate: error: checkpoint"), r.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_a_1gb_bomb_in_a_megabyte_is_refused_before_it_is_decompressed(checkpoint):
    bomb = npy_bomb()
    assert len(bomb[1]) < 1.1e6 and bomb[3] > ONE_GB
    refused(translate_in_2gb(rewrite(checkpoint, {"junk.npy": bomb})), "'junk' is not part of a model")
    refused(translate_in_2gb(rewrite(checkpoint, {"param/embedding.weight.npy": bomb})),
            "its arrays claim 1,07", "more than the", "its config implies")


def test_a_bomb_in_what_a_translator_leaves_unread_costs_nothing(checkpoint):
    checkpoint = rewrite(checkpoint, {"history/train_loss.npy": npy_bomb()})
    r = translate_in_2gb(checkpoint)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stderr[-2000:]
    with pytest.raises(CheckpointError, match="its arrays claim .* more than the .* its config implies"):
        load_npz(checkpoint, expect=functools.partial(model_members, optimizer=True))     # what --resume reads


def test_a_config_of_1e8_layers_is_refused_naming_the_field(checkpoint, tmp_path):
    with zipfile.ZipFile(checkpoint) as zf:
        meta = json.loads(str(np.load(io.BytesIO(zf.read("__meta__.npy")))))
    meta["config"]["n_encoder_layers"] = 10**8
    path = tmp_path / "deep.npz"
    np.savez(path, __meta__=np.array(json.dumps(meta)))
    refused(translate_in_2gb(path), "n_encoder_layers = 100,000,000", "parameters", "more than")


def test_a_max_len_of_1e9_is_refused_before_its_table_is_built(checkpoint, tmp_path):
    """A sinusoidal table has no parameters, so no count bounds it: at 10**9 positions the table alone
    would take gigabytes, built as the model first runs. The config refuses it as it is read."""
    arrays, meta = load_npz(checkpoint)
    path = save_npz(tmp_path / "long.npz", arrays, {**meta, "config": {**meta["config"], "max_len": 10**9}})
    refused(translate_in_2gb(path), "max_len must be at most 8,192", "1,000,000,000")
    with pytest.raises(ValueError, match="max_len must be at most 8,192"):
        TransformerConfig(vocab_size=5, d_model=8, n_heads=2, d_ff=16, max_len=8193)


def test_nan_or_infinite_weights_are_refused(checkpoint, tmp_path):
    for bad in (np.nan, np.inf):
        model = Transformer.load(checkpoint)
        model.params["encoder.0.ffn.w1"][1, 2] = bad
        _, meta = load_npz(checkpoint)
        path = model.save(tmp_path / "bad.npz", extra_meta={"vocab": meta["vocab"]})
        refused(translate_in_2gb(path), "encoder.0.ffn.w1 holds NaN or infinite numbers")


def test_an_npy_header_over_10kb_is_one_line_without_pickling_advice(checkpoint):
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (8,), }" + b" " * 20000 + b"\n"
    data = b"\x93NUMPY\x02\x00" + struct.pack("<I", len(header)) + header + bytes(32)
    line = refused(translate_in_2gb(rewrite(checkpoint, {"param/encoder.0.ffn.b2.npy": (
        zipfile.ZIP_STORED, data, zlib.crc32(data), len(data))})), "header over 10,000 bytes")
    assert "pickle" not in line


@pytest.mark.parametrize("fields", [{}, {"norm_position": "pre", "positional": "learned", "share_embeddings": False,
                                         "tgt_vocab_size": 70}, {"ffn": "swiglu", "positional": "rope", "kv_heads": 2},
                                    {"n_encoder_layers": 3, "n_decoder_layers": 1, "d_ff": 48}])
def test_the_parameter_count_is_what_the_shapes_hold(fields):
    import math
    from attn.model import parameter_count, parameter_shapes
    cfg = TransformerConfig(**{"vocab_size": 50, "d_model": 32, "n_heads": 4, "d_ff": 64, "n_encoder_layers": 2,
                               "n_decoder_layers": 2, **fields})
    assert parameter_count(cfg) == sum(math.prod(shape) for shape in parameter_shapes(cfg).values())

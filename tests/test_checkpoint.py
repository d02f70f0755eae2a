"""Saving and loading: a round trip changes nothing; a file that does not fit, is cut short, or is
not a checkpoint at all is a CheckpointError that says what is wrong and names the file; a crash
mid-write leaves the previous checkpoint intact; either backend reads what the other wrote."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import pickle
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn.backend as B
import attn.checkpoint as ckpt
from attn.checkpoint import CheckpointError, load_npz, save_npz
from attn.model import Transformer, TransformerConfig, parameter_shapes
from attn.optim import Adam
from conftest import selected_backend

CFG = TransformerConfig(vocab_size=9, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=2, n_decoder_layers=1,
                        dropout=0.0, max_len=10)
SRC = np.array([[1, 2, 3, 4, 0], [5, 6, 0, 0, 0]])
TGT = np.array([[1, 7, 8, 0], [1, 2, 3, 4]])

VARIANTS = {
    "shared": {},
    "separate-learned-pre": dict(share_embeddings=False, tgt_vocab_size=11, positional="learned", norm_position="pre"),
}


def logits_of(model: Transformer) -> np.ndarray:
    return B.to_host(model.forward(B.to_device(SRC), B.to_device(TGT))[0])


def host_params(model: Transformer) -> dict:
    return {k: B.to_host(v) for k, v in model.params.items()}


def assert_same_model(a: Transformer, b: Transformer):
    assert a.config == b.config
    assert list(a.params) == list(b.params)
    for k in a.params:
        assert a.params[k].dtype == b.params[k].dtype, k
        np.testing.assert_array_equal(B.to_host(a.params[k]), B.to_host(b.params[k]), err_msg=k)


@contextlib.contextmanager
def backend_selected(name: str):
    """Select a backend for a block, restoring the previous one after."""
    saved = (B._current, B._xp)
    B.set_backend(name)
    try:
        yield
    finally:
        B._current, B._xp = saved

# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_keeps_every_parameter_and_every_logit(backend, tmp_path, variant, dtype):
    cfg = dataclasses.replace(CFG, **VARIANTS[variant])
    model = Transformer(cfg, seed=4, dtype=dtype)
    path = model.save(tmp_path / "sub" / "model.npz")                  # folders are created
    assert path.is_file() and os.listdir(path.parent) == ["model.npz"]  # no temporary file left
    loaded = Transformer.load(path)
    assert_same_model(model, loaded)
    assert all(B.get_array_module(p) is backend for p in loaded.params.values())
    np.testing.assert_array_equal(logits_of(loaded), logits_of(model))
    assert_same_model(Transformer.load(path, config=cfg), model)       # the matching config is accepted


def test_the_file_is_plain_arrays_and_json(backend, tmp_path):
    """Readable without attn and without pickle: named arrays plus one JSON record."""
    path = Transformer(CFG, seed=1).save(tmp_path / "m.npz", extra_meta={"step": 12})
    with np.load(path, allow_pickle=False) as z:
        names = set(z.files)
        meta = json.loads(str(z["__meta__"]))
        w = z["param/encoder.0.self_attn.w_q"]
    assert names == {"__meta__"} | {f"param/{k}" for k in parameter_shapes(CFG)}
    assert meta["config"] == CFG.to_dict() and meta["step"] == 12 and meta["format"] == "attn-checkpoint-1"
    assert w.shape == (8, 8) and w.dtype == np.float32


def test_loading_never_unpickles(tmp_path, monkeypatch):
    """Loading reads the arrays' bytes itself, never through pickle, and a file holding a pickled
    (object) array is refused."""
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was called")

    path = Transformer(CFG).save(tmp_path / "m.npz")
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    Transformer.load(path)
    monkeypatch.undo()

    evil = tmp_path / "evil.npz"
    np.savez(evil, __meta__=np.array(json.dumps({"config": CFG.to_dict()})),
             **{"param/embedding.weight": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(CheckpointError, match=rf"{evil}.*(?i:pickle)"):
        Transformer.load(evil)


def test_extra_arrays_and_meta_ride_along_and_optimizer_state_resumes(backend, tmp_path):
    """What a trainer stores beside the model (Adam's moments, the step) comes back as it went in;
    the model ignores it, and training resumed from it continues exactly."""
    model = Transformer(CFG, seed=2, dtype="float64")
    opt = Adam(model.params, CFG.d_model, warmup_steps=3)
    grads = [{k: B.to_device(np.random.default_rng(i).standard_normal(v.shape)) for k, v in model.params.items()}
             for i in range(4)]
    for g in grads[:2]:
        opt.step(g)
    path = model.save(tmp_path / "m.npz", extra_arrays=opt.state_arrays(), extra_meta={"step": opt.t})
    arrays, meta = load_npz(path)
    assert meta["step"] == 2 and set(opt.state_arrays()) <= set(arrays)
    resumed = Transformer.load(path)
    opt2 = Adam(resumed.params, CFG.d_model, warmup_steps=3)
    opt2.load_state(arrays, meta["step"])
    for g in grads[2:]:
        opt.step(g)
        opt2.step(g)
    assert_same_model(resumed, model)

# ----------------------------------------------------------------------------- files that do not fit


def test_a_different_config_is_refused_listing_every_difference(tmp_path):
    path = Transformer(CFG).save(tmp_path / "m.npz")
    wanted = dataclasses.replace(CFG, d_ff=16, dropout=0.3)
    with pytest.raises(CheckpointError) as info:
        Transformer.load(path, config=wanted)
    msg = str(info.value)
    assert str(path) in msg
    assert "d_ff: expected 16, file has 12" in msg and "dropout: expected 0.3, file has 0.0" in msg
    assert "d_model" not in msg                                          # only what differs


def _write(path, arrays: dict, cfg: TransformerConfig = CFG, **meta):
    return save_npz(path, arrays, {"format": "attn-checkpoint-1", "config": cfg.to_dict(), **meta})


def test_missing_extra_and_misshapen_parameters_are_listed(tmp_path):
    arrays = {f"param/{k}": v for k, v in host_params(Transformer(CFG)).items()}
    del arrays["param/decoder.0.ffn.b1"]
    arrays["param/decoder.7.ffn.b1"] = np.zeros(12, np.float32)
    arrays["param/encoder.1.norm2.gamma"] = np.ones(9, np.float32)
    arrays["adam.m/whatever"] = np.zeros(3)                              # non-parameter arrays are fine
    path = _write(tmp_path / "bad.npz", arrays)
    with pytest.raises(CheckpointError) as info:
        Transformer.load(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "missing decoder.0.ffn.b1" in msg
    assert "unexpected decoder.7.ffn.b1" in msg
    assert "encoder.1.norm2.gamma has shape (9,), expected (8,)" in msg
    assert "whatever" not in msg


@pytest.mark.parametrize("meta, match", [
    ({}, "holds no model config"),
    ({"config": {**CFG.to_dict(), "d_model": 7}}, "invalid config.*d_model"),
    ({"config": {**CFG.to_dict(), "colour": "red"}}, "invalid config.*colour"),
    ({"config": [1, 2]}, "invalid config"),
])
def test_a_missing_or_invalid_config_is_refused(tmp_path, meta, match):
    path = save_npz(tmp_path / "m.npz", {}, meta)
    with pytest.raises(CheckpointError, match=match):
        Transformer.load(path)

# ----------------------------------------------------------------------------- damaged files


@pytest.fixture(scope="module")
def good_bytes(tmp_path_factory) -> bytes:
    """A small checkpoint's bytes (NumPy backend)."""
    with backend_selected("numpy"):
        path = Transformer(CFG, seed=9).save(tmp_path_factory.mktemp("good") / "m.npz")
    return path.read_bytes()


@given(fraction=st.floats(0.0, 1.0, exclude_max=True))
def test_a_truncated_file_is_refused_naming_it(tmp_path, good_bytes, fraction):
    path = tmp_path / "cut.npz"
    path.write_bytes(good_bytes[: int(fraction * len(good_bytes))])
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is truncated or corrupt"):
        Transformer.load(path)


@given(data=st.data())
def test_a_flipped_byte_is_refused_or_harmless(tmp_path, good_bytes, data):
    """One damaged byte anywhere: a CheckpointError, or (a timestamp, a version field) the very same model."""
    i = data.draw(st.integers(0, len(good_bytes) - 1), label="offset")
    bit = data.draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 255]), label="xor")
    damaged = bytearray(good_bytes)
    damaged[i] ^= bit
    path = tmp_path / "flipped.npz"
    path.write_bytes(bytes(damaged))
    try:
        model = Transformer.load(path)
    except CheckpointError as e:
        assert str(path) in str(e)
    else:
        with backend_selected("numpy"):
            assert_same_model(model, Transformer(CFG, seed=9))


ZIP_DAMAGE = {
    # (offset from the first central-directory record, from the first local header, new 16-bit value);
    # the zip format's general-purpose flags sit at +8 / +6, the compression method at +10 / +8.
    "encrypted flag": [("central", 8, 0x0001), ("local", 6, 0x0001)],          # RuntimeError in zipfile
    "patched-data flag": [("central", 8, 0x0020)],                              # NotImplementedError
    "unknown compression": [("central", 10, 99), ("local", 8, 99)],            # NotImplementedError
    "deflate on stored data": [("central", 10, 8), ("local", 8, 8)],           # bad CRC
    "bzip2 on stored data": [("central", 10, 12), ("local", 8, 12)],           # OSError
}


@pytest.mark.parametrize("damage", list(ZIP_DAMAGE))
def test_damaged_zip_records_are_refused_naming_the_file(tmp_path, good_bytes, damage):
    """Damage that a random byte rarely hits, but that zipfile reports with exceptions other than
    BadZipFile (RuntimeError, NotImplementedError, OSError)."""
    data = bytearray(good_bytes)
    start = {"central": data.index(b"PK\x01\x02"), "local": data.index(b"PK\x03\x04")}
    for record, offset, value in ZIP_DAMAGE[damage]:
        data[start[record] + offset: start[record] + offset + 2] = value.to_bytes(2, "little")
    path = tmp_path / "damaged.npz"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is truncated or corrupt"):
        Transformer.load(path)


@pytest.mark.parametrize("content", [
    b"", b"hello, world\n", bytes(range(256)) * 4, b"PK\x03\x04" + b"\x00" * 100,
    b"\x93NUMPY",
])
def test_a_garbage_file_is_refused_naming_it(tmp_path, content):
    path = tmp_path / "garbage.npz"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is (truncated or corrupt|not an .npz archive)"):
        Transformer.load(path)


@pytest.mark.parametrize("content, says", [
    (b"the old friend laughed .\n", "it looks like text"), (pickle.dumps({"a": 1}), "pickle file"),
    (b"\x89PNG\r\n\x1a\n", "starts with the bytes"), (b"\x93NUMPY\x01\x00", "single .npy array"),
])
def test_a_file_that_is_no_archive_is_named_for_what_it_is(tmp_path, content, says):
    """A text file is not said to hold pickled objects: the message says what the file seems to be."""
    path = tmp_path / "model.npz"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is not an .npz archive: .*{says}") as e:
        load_npz(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content", [b"hello, world\n" * 20, pickle.dumps({"a": 1}), "object"])
def test_corrupt_checkpoint_errors_do_not_advise_unpickling(tmp_path, content):
    """NumPy's own message suggests allow_pickle=True or pickle.load(); ours must not pass that on."""
    path = tmp_path / "bad.npz"
    if content == "object":
        np.savez(path, __meta__=np.array("{}"), x=np.array([{"a": 1}], dtype=object))
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is (truncated or corrupt|not an .npz)") as e:
        load_npz(path)
    assert "allow_pickle" not in str(e.value) and "pickle.load" not in str(e.value), str(e.value)


def test_other_npy_and_npz_files_are_refused(tmp_path):
    npy = tmp_path / "array.npz"
    with open(npy, "wb") as f:
        np.save(f, np.arange(5))                                          # a lone .npy array
    with pytest.raises(CheckpointError, match=f"checkpoint {npy} is not an .npz archive.*npy"):
        Transformer.load(npy)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, w=np.zeros(3))                                      # an archive, but not ours
    with pytest.raises(CheckpointError, match=f"checkpoint {foreign} has no __meta__"):
        Transformer.load(foreign)
    for bad_meta, match in (("{not json", "unreadable __meta__"), ("[1, 2]", "not a JSON object")):
        p = tmp_path / "meta.npz"
        np.savez(p, __meta__=np.array(bad_meta))
        with pytest.raises(CheckpointError, match=f"checkpoint {p} has .*{match}"):
            Transformer.load(p)


def test_a_nonexistent_path_is_refused_naming_it(tmp_path):
    path = tmp_path / "nowhere" / "model.npz"
    with pytest.raises(CheckpointError, match=f"checkpoint {path} does not exist"):
        Transformer.load(path)
    with pytest.raises(CheckpointError, match="is a folder, not a file"):
        Transformer.load(tmp_path)                                        # a folder is not a checkpoint

# ----------------------------------------------------------------------------- atomic writes


class Crash(Exception):
    pass


def _crash_partway(file, **arrays):
    """Stand-in for np.savez: write a real archive's first half, then fail (disk full, power cut)."""
    file.write(b"PK\x03\x04 half an archive")
    raise Crash("disk full")


@pytest.mark.parametrize("where", ["savez", "fsync", "replace", "interrupt"])
def test_a_crash_mid_write_leaves_the_previous_checkpoint_and_no_temporary_file(backend, tmp_path, monkeypatch,
                                                                               where):
    old = Transformer(CFG, seed=1)
    path = old.save(tmp_path / "model.npz")
    before = path.read_bytes()
    new = Transformer(CFG, seed=2)

    if where == "savez":
        monkeypatch.setattr(B.host, "savez", _crash_partway)
    elif where == "fsync":
        monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (_ for _ in ()).throw(Crash("I/O error")))
    elif where == "replace":
        monkeypatch.setattr(ckpt.os, "replace", lambda a, b: (_ for _ in ()).throw(Crash("rename failed")))
    else:                                                                 # Ctrl-C while writing
        def interrupted(file, **arrays):
            file.write(b"PK")
            raise KeyboardInterrupt
        monkeypatch.setattr(B.host, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt if where == "interrupt" else Crash):
        new.save(path)
    monkeypatch.undo()

    assert os.listdir(tmp_path) == ["model.npz"], "a temporary file was left behind"
    assert path.read_bytes() == before
    assert_same_model(Transformer.load(path), old)
    new.save(path)                                                        # and the next save works
    assert_same_model(Transformer.load(path), new)
    assert os.listdir(tmp_path) == ["model.npz"]


def test_a_crash_on_the_first_save_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(B.host, "savez", _crash_partway)
    with pytest.raises(Crash):
        Transformer(CFG).save(tmp_path / "model.npz")
    assert os.listdir(tmp_path) == []

# ----------------------------------------------------------------------------- across backends and dtypes


@pytest.mark.parametrize("writer, reader", [("numpy", "cupy"), ("cupy", "numpy")])
def test_a_checkpoint_written_on_one_backend_loads_on_the_other(tmp_path, writer, reader):
    """``cupy`` is real CuPy on a GPU and the stand-in (tests/fakecupy) elsewhere."""
    with selected_backend(writer):
        model = Transformer(CFG, seed=6, dtype="float64")
        path = model.save(tmp_path / "m.npz")
        expected = logits_of(model)
        params = host_params(model)
    with selected_backend(reader):
        loaded = Transformer.load(path)
        assert all(B.get_array_module(p) is B.xp() for p in loaded.params.values())
        for k, v in params.items():
            np.testing.assert_array_equal(B.to_host(loaded.params[k]), v, err_msg=k)
        np.testing.assert_allclose(logits_of(loaded), expected, rtol=1e-10, atol=1e-12)


# A Python process in which CuPy cannot be imported at all (as on a machine without it).
_NO_CUPY = """
import json, sys
sys.modules["cupy"] = sys.modules["cupyx"] = None          # `import cupy` raises ImportError
import numpy as np
import attn.backend as B
from attn.checkpoint import load_npz, save_npz
from attn.model import Transformer, TransformerConfig
from attn.optim import Adam
assert B.set_backend("auto") is np and not B.cupy_available()
SRC, TGT = np.array({src}), np.array({tgt})
path = sys.argv[2]
if sys.argv[1] == "write":
    model = Transformer(TransformerConfig(**json.loads(sys.argv[3])), seed=4, dtype="float64")
    opt = Adam(model.params, 8, 4)
    opt.step({{k: np.full(v.shape, 0.5) for k, v in model.params.items()}})
    save_npz(path, {{**model.state_arrays(), **opt.state_arrays()}},
             {{"format": "attn-checkpoint-1", "config": model.config.to_dict(), "step": opt.t}})
arrays, meta = load_npz(path)
model = Transformer.from_arrays(arrays, meta)
assert all(type(a) is np.ndarray for a in arrays.values())
print(json.dumps({{"logits": model.forward(SRC, TGT)[0].tolist(), "step": meta["step"],
                  "moments": {{k: v.tolist() for k, v in arrays.items() if k.startswith("adam.")}}}}))
""".format(src=SRC.tolist(), tgt=TGT.tolist())


def _run_without_cupy(*args) -> dict:
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "ATTN_BACKEND": "numpy"}
    r = subprocess.run([sys.executable, "-c", _NO_CUPY, *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_checkpoint_written_from_cupy_arrays_loads_with_numpy_alone(tmp_path):
    """Written from device arrays (real CuPy on a GPU, the stand-in elsewhere), read in a process
    where CuPy cannot even be imported: the file holds plain NumPy arrays and JSON, nothing pickled."""
    with selected_backend("cupy"):
        model = Transformer(CFG, seed=5, dtype="float64")
        opt = Adam(model.params, 8, 4)
        opt.step({k: B.xp().full(v.shape, 0.25) for k, v in model.params.items()})
        assert all(B.is_device_array(v) for v in {**model.state_arrays(), **opt.state_arrays()}.values())
        path = save_npz(tmp_path / "gpu.npz", {**model.state_arrays(), **opt.state_arrays()},
                        {"format": "attn-checkpoint-1", "config": CFG.to_dict(), "step": opt.t})
        expected = logits_of(model)
        moments = {k: B.to_host(v) for k, v in opt.state_arrays().items()}
    got = _run_without_cupy("read", path)
    assert got["step"] == 1
    np.testing.assert_allclose(np.array(got["logits"]), expected, rtol=1e-12, atol=1e-12)
    assert set(got["moments"]) == set(moments)
    for k, v in moments.items():
        np.testing.assert_array_equal(np.array(got["moments"][k]), v, err_msg=k)


def test_a_checkpoint_written_without_cupy_loads_onto_cupy_arrays(tmp_path):
    """The reverse: a NumPy-only process writes, the device (CuPy or the stand-in) reads."""
    path = tmp_path / "cpu.npz"
    written = _run_without_cupy("write", path, json.dumps(CFG.to_dict()))
    with selected_backend("cupy"):
        arrays, meta = load_npz(path)
        model = Transformer.from_arrays(arrays, meta)
        assert all(B.is_device_array(p) for p in model.params.values())
        opt = Adam(model.params, 8, 4)
        opt.load_state(arrays, meta["step"])
        assert opt.t == 1 and all(B.is_device_array(m) for m in opt.m.values())
        np.testing.assert_allclose(logits_of(model), np.array(written["logits"]), rtol=1e-12, atol=1e-12)
        for k, v in opt.state_arrays().items():
            np.testing.assert_array_equal(B.to_host(v), np.array(written["moments"][k]), err_msg=k)


def test_float32_file_loads_as_float64_on_request(backend, tmp_path):
    model = Transformer(CFG, seed=3, dtype="float32")
    path = model.save(tmp_path / "m.npz")
    wide = Transformer.load(path, dtype="float64")
    assert wide.dtype == np.float64
    for k, p in model.params.items():
        assert wide.params[k].dtype == np.float64
        np.testing.assert_array_equal(B.to_host(wide.params[k]), B.to_host(p).astype(np.float64))
    np.testing.assert_allclose(logits_of(wide), logits_of(model), rtol=1e-4, atol=1e-4)
    assert logits_of(wide).dtype == np.float64
    assert Transformer.load(path).dtype == np.float32                     # by default, the file's dtype

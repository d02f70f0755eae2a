"""attn-export's folder: written whole and swapped into place, never overwritten unasked, its
sentence limit recorded for the page, and every mistake one line."""
from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from attn.checkpoint import file_mode, load_npz, save_npz
from attn.data import Vocab
from attn.model import Transformer, TransformerConfig
from attn.site import export as E
from attn.site.export import ExportError, export_model, load_export, main

VOCAB = Vocab(["<pad>", "<s>", "</s>", "<unk>", "a", "b", "c", "."])


def tiny(seed=0, **kw):
    cfg = TransformerConfig(vocab_size=len(VOCAB), d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                            n_decoder_layers=1, **kw)
    return Transformer(cfg, seed=seed)


def test_an_export_is_not_overwritten_unasked(tmp_path):
    out = tmp_path / "m"
    export_model(tiny(0), VOCAB, out)
    with pytest.raises(ExportError, match=f"{out} already holds an export .*--overwrite"):
        export_model(tiny(1), VOCAB, out)
    assert np.array_equal(load_export(out)[0].params["embedding.weight"], tiny(0).params["embedding.weight"])
    export_model(tiny(1), VOCAB, out, overwrite=True)
    assert np.array_equal(load_export(out)[0].params["embedding.weight"], tiny(1).params["embedding.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]          # no folder left beside it
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="holds other files than an export \\(notes.txt\\)"):
        export_model(tiny(1), VOCAB, out, overwrite=True)


def test_a_failed_swap_leaves_the_previous_export_whole(tmp_path, monkeypatch):
    out = tmp_path / "m"
    export_model(tiny(0), VOCAB, out)
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(b)
        if len(calls) == 4:          # two files written, the old export moved aside: the swap itself fails
            raise OSError(28, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(E.os, "replace", replace)
    with pytest.raises(OSError):
        export_model(tiny(1), VOCAB, out, overwrite=True)
    monkeypatch.undo()
    assert np.array_equal(load_export(out)[0].params["embedding.weight"], tiny(0).params["embedding.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_files_and_folder_get_the_modes_a_plain_write_would(tmp_path):
    out = tmp_path / "m"
    export_model(tiny(), VOCAB, out)
    umask = 0o777 & ~(stat.S_IMODE(out.stat().st_mode))
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for name in ("model.json", "weights.bin"):
        assert stat.S_IMODE((out / name).stat().st_mode) == file_mode()


def test_the_sentence_limit_is_in_model_json(tmp_path):
    doc = export_model(tiny(), VOCAB, tmp_path / "a", max_source_tokens=200)
    assert doc["max_source_tokens"] == 200 == json.loads((tmp_path / "a" / "model.json").read_text())["max_source_tokens"]
    assert export_model(tiny(positional="learned", max_len=40), VOCAB, tmp_path / "b")["max_source_tokens"] == 40
    assert export_model(tiny(max_len=60), VOCAB, tmp_path / "c")["max_source_tokens"] == 60    # trained on no more
    assert load_export(tmp_path / "a")[2]["max_source_tokens"] == 200
    with pytest.raises(ValueError, match="max_source_tokens must be an integer from 2 to 4,096"):
        export_model(tiny(), VOCAB, tmp_path / "d", max_source_tokens=10**9)
    path = tmp_path / "a" / "model.json"
    for bad in ("lots", 10**9):
        path.write_text(json.dumps({**json.loads(path.read_text()), "max_source_tokens": bad}))
        with pytest.raises(ExportError, match="max_source_tokens must be an integer from 2 to 4,096"):
            load_export(tmp_path / "a")


@pytest.mark.parametrize("case", ["file", "exists", "length", "not_utf8"])
def test_every_mistake_is_one_line(tmp_path, capsys, case):
    ckpt = tiny().save(tmp_path / "c.npz", extra_meta={"vocab": VOCAB.to_json()})
    out, flags = tmp_path / "out", []
    if case == "file":
        out.write_text("x")
        ckpt = tmp_path / "missing.npz"            # the destination is checked first
    elif case == "exists":
        export_model(tiny(), VOCAB, out)
    elif case == "length":
        flags = ["--max-length", "1"]
    else:
        (tmp_path / "s.txt").write_bytes(b"a b\n\xff\n")
        flags = ["--sentences", str(tmp_path / "s.txt")]
    assert main([str(ckpt), str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attn-export: error:"), err
    assert {"file": "is a file, not a folder", "exists": "--overwrite", "length": "--max-length",
            "not_utf8": "not valid UTF-8"}[case] in err[0]
    assert main([str(ckpt), str(out), "--overwrite"]) == (0 if case in ("exists", "length", "not_utf8") else 2)


def test_the_later_block_is_exported_and_an_older_export_still_loads(tmp_path):
    later = tiny(3, norm_position="pre", norm_kind="rms", positional="rope", ffn="swiglu", kv_heads=1)
    doc = export_model(later, VOCAB, tmp_path / "later")
    back, _, _ = load_export(tmp_path / "later")
    assert back.config == later.config and doc["config"]["kv_heads"] == 1
    assert {t["name"]: t["shape"] for t in doc["weights"]["tensors"]}["decoder.0.self_attn.w_k"] == [8, 4]
    for name, p in later.params.items():
        assert np.array_equal(back.params[name], p), name
    export_model(tiny(4), VOCAB, tmp_path / "old")     # written before the later block's fields existed:
    path = tmp_path / "old" / "model.json"           # the defaults, the paper's block, fill them in
    old = json.loads(path.read_text())
    for field in ("norm_kind", "ffn", "kv_heads", "rope_base"):
        del old["config"][field]
    path.write_text(json.dumps(old))
    assert load_export(tmp_path / "old")[0].config == tiny(4).config


@pytest.mark.parametrize("env", ["cupy", "gpu"])
def test_an_unusable_backend_is_one_line(tmp_path, capsys, monkeypatch, env):
    """CuPy imports but no GPU is usable (or $ATTN_BACKEND names no backend): one line, no traceback."""
    import attn.backend as B

    def no_gpu():
        raise B.BackendError("ATTN_BACKEND=cupy was asked for and CuPy imports, but no GPU is usable "
                             "(CUDARuntimeError: CUDA driver version is insufficient)")

    ckpt = tiny().save(tmp_path / "c.npz", extra_meta={"vocab": VOCAB.to_json()})
    monkeypatch.setattr(B, "_import_cupy", no_gpu)
    monkeypatch.setattr(B, "_current", None)
    monkeypatch.setattr(B, "_xp", None)
    monkeypatch.setenv("ATTN_BACKEND", env)
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attn-export: error: ATTN_BACKEND"), err
    assert {"cupy": "no GPU is usable", "gpu": "must be numpy, cupy or auto, got 'gpu'"}[env] in err[0]
    assert not (tmp_path / "out").exists()


def test_a_max_len_the_page_cannot_build_a_table_for_is_refused(tmp_path, capsys):
    """The page builds a table of max_len positions as it loads: at 10**6 it took 16 s, at 10**8 it
    failed. A config over the bound is refused as it is read: by attn-export from a checkpoint, and by
    load_export from an exported model.json, naming the field and the bound."""
    assert export_model(tiny(max_len=E.MAX_LEN_LIMIT), VOCAB, tmp_path / "ok")["config"]["max_len"] == 8192
    ckpt = tiny().save(tmp_path / "c.npz", extra_meta={"vocab": VOCAB.to_json()})
    arrays, meta = load_npz(ckpt)
    save_npz(ckpt, arrays, {**meta, "config": {**meta["config"], "max_len": 10**8}})
    assert main([str(ckpt), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_len must be at most 8,192" in err[0] and "100,000,000" in err[0], err
    assert not (tmp_path / "b").exists()
    path = tmp_path / "ok" / "model.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "config": {**doc["config"], "max_len": 10**6}}))
    with pytest.raises(ExportError, match="max_len must be at most 8,192"):
        load_export(tmp_path / "ok")


def test_the_folders_a_killed_export_left_are_removed_by_the_next(tmp_path):
    """A killed attn-export leaves its hidden .m.xxxxxxxx.new (or .old) folder beside m: the next
    export removes those older than itself, never one that is newer (being written now) or another name."""
    import time
    stale = [tmp_path / ".m.abcd_123.new", tmp_path / ".m.zz9yx8wv.old"]
    kept = [tmp_path / ".m.fresh123.new", tmp_path / ".mine.abcd1234.new", tmp_path / ".m.notes"]
    for d in stale + kept:
        d.mkdir()
        (d / "model.json").write_text("{}")
    (stale[1] / "export").mkdir()
    hour_ago, soon = time.time() - 3600, time.time() + 3600
    for d in stale + kept[1:]:
        os.utime(d, (hour_ago, hour_ago))
    os.utime(kept[0], (soon, soon))                      # newer than the export: one being written now
    export_model(tiny(), VOCAB, tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m"] + [d.name for d in kept])

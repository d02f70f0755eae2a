"""``attn-train --task lm``: a language model trained on a text by the translator's loop, with its
metrics, checkpoints and ``--resume``; ``attn-generate`` on what it wrote; the flags' errors."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

import attn.backend as B
from attn.checkpoint import load_npz
from attn.data import DataError
from attn.training.config import TrainConfigError, config_from_argv
from attn.train import main, train

TEXT = "".join(f"{w} said the {v} to the {n}.\n" for w in ("ann", "bob", "cy") for v in ("cat", "dog")
               for n in ("king", "sea", "moon")) * 12
SMALL = ["--task", "lm", "--char", "--context", "16", "--batch", "4", "--d-model", "16", "--heads", "2",
         "--d-ff", "32", "--layers", "1", "--minutes", "0", "--warmup", "10", "--quiet", "--backend", "numpy"]


@pytest.fixture(autouse=True)
def _numpy_backend():
    B.set_backend("numpy")
    yield


def _text(tmp_path, gz=False):
    path = tmp_path / ("text.txt.gz" if gz else "text.txt")
    path.write_bytes(gzip.compress(TEXT.encode()) if gz else TEXT.encode())
    return path


def lm(tmp_path, out, *extra, gz=False):
    return train(config_from_argv(["--text", str(_text(tmp_path, gz)), *SMALL, "--out", str(tmp_path / out), *extra]))


def test_a_language_model_trains_on_a_gzipped_text_and_writes_the_translators_files(tmp_path):
    metrics = lm(tmp_path, "run", "--steps", "40", "--eval-every", "20", gz=True)
    out = tmp_path / "run"
    assert {"checkpoint.npz", "config.json", "metrics.jsonl", "metrics.json", "loss.png"} <= {p.name for p in out.iterdir()}
    assert metrics == json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 40 and metrics["train_seconds"] > 0 and metrics["task"] == "lm"
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [20, 40]
    assert metrics["val_loss"] == evals[-1]["val_loss"] < evals[0]["val_loss"] < np.log(metrics["vocab_size"])
    assert metrics["val_bpc"] == pytest.approx(metrics["val_loss"] / np.log(2))
    _, meta = load_npz(out / "checkpoint.npz")
    assert meta["config"]["n_encoder_layers"] == 0 and meta["args"]["context"] == 16


def test_a_resumed_run_repeats_the_uninterrupted_runs_losses(tmp_path):
    lm(tmp_path, "whole", "--steps", "8", "--eval-every", "4")
    lm(tmp_path, "cut", "--steps", "4", "--eval-every", "4")
    train(config_from_argv(["--resume", "--out", str(tmp_path / "cut"), "--steps", "8", "--quiet"]))
    whole, cut = (load_npz(tmp_path / r / "checkpoint.npz")[0]["history/train_loss"] for r in ("whole", "cut"))
    assert len(whole) == 8
    np.testing.assert_array_equal(whole, cut)


def test_bpe_pieces_when_char_is_not_asked(tmp_path):
    metrics = train(config_from_argv(["--text", str(_text(tmp_path)), *[a for a in SMALL if a != "--char"],
                                      "--vocab-size", "700", "--steps", "2", "--out", str(tmp_path / "bpe")]))
    assert metrics["vocab"] == "bpe" and "val_bpc" not in metrics and metrics["val_ppl"] > 1


def test_attn_generate_continues_the_prompt_and_a_seed_reproduces_it(tmp_path, capsys):
    from attn.generate import main as generate
    lm(tmp_path, "run", "--steps", "4")
    capsys.readouterr()
    ck = str(tmp_path / "run" / "checkpoint.npz")
    texts = []
    for seed in ("3", "3"):
        assert generate(["--checkpoint", ck, "--prompt", "ann said", "--max-tokens", "40", "--seed", seed,
                         "--top-k", "5", "--temperature", "0.8"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("ann said") and len(texts[0]) == len("ann said") + 40 + 1
    assert generate(["--checkpoint", ck, "--prompt", "ann", "--stop", "e", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.rstrip("\n").count("e") <= 1
    assert generate(["--checkpoint", ck, "--prompt", "ANN"]) == 2
    assert "--prompt" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--text", "x.txt"], "text"), (["--context", "8"], "context"), (["--preset", "shakespeare_char"], "preset"),
    (["--task", "lm", "--context", "1"], "context"), (["--task", "lm", "--precision", "bf16"], "precision"),
    (["--task", "poem"], "task")])
def test_a_language_models_flags_are_refused_where_they_do_not_apply(argv, flag):
    with pytest.raises((TrainConfigError, SystemExit)) as info:
        config_from_argv(argv)
    assert isinstance(info.value, SystemExit) or f"--{flag}" in str(info.value)


def test_a_text_shorter_than_a_window_is_refused_naming_context(tmp_path):
    with pytest.raises(DataError, match="--context 1000"):
        lm(tmp_path, "run", "--steps", "1", "--context", "1000")


def test_the_command_line_trains_a_language_model(tmp_path, capsys):
    assert main(["--text", str(_text(tmp_path)), *SMALL, "--steps", "2", "--out", str(tmp_path / "cli")]) == 0
    assert "attn-generate --checkpoint" in capsys.readouterr().out


def test_the_shipped_text_is_tiny_shakespeare_as_data_readme_says():
    """data/README.md's figures are the file's: its checksum, bytes, lines and characters."""
    import hashlib
    import re
    from attn.training.config import DEFAULT_TEXT
    raw = gzip.decompress(DEFAULT_TEXT.read_bytes())
    readme = (DEFAULT_TEXT.parent.parent / "README.md").read_text()
    assert hashlib.sha256(raw).hexdigest() in readme
    lines = raw.count(b"\n")
    assert f"{len(raw):,} bytes" in readme and f"{lines:,} lines" in readme
    assert re.search(rf"\b{len(set(raw))} distinct characters", readme)


def test_the_shakespeare_char_preset_is_nanogpts_cpu_recipe():
    """4 layers, 4 heads, width 128, context 64, batch 12, no dropout, characters, a peak rate of 1e-3."""
    from attn.optim import Adam
    from attn.model import Transformer
    config = config_from_argv(["--task", "lm", "--preset", "shakespeare_char"]).with_recipe()
    model = config.model_config(69)
    assert (model.n_encoder_layers, model.n_decoder_layers, model.n_heads, model.d_model, model.dropout) == (0, 4, 4, 128, 0)
    assert (config.context, config.batch, config.char) == (64, 12, True)
    opt = Adam(Transformer(model).params, model.d_model, model.warmup_steps, lr_factor=config.lr_factor)
    assert opt.lr(model.warmup_steps) == pytest.approx(1e-3, rel=0.01)

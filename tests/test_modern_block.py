"""The block of later models (RMSNorm, rotary positions, SwiGLU, grouped-query attention, pre-norm) as
options of the whole model: trained by attn-train, checkpointed, averaged, resumed and decoded
with greedy and beam search by either engine, exported to the page (tests/test_web_later_block.py).
Its gradients, invariants and cached decoding are drawn with every other option in
tests/test_model.py."""
from __future__ import annotations

import numpy as np
import pytest

from attn import engine as engines
from attn.checkpoint import load_npz
from attn.data import Vocab
from attn.evaluate import translate
from attn.model import Transformer, TransformerConfig
from attn.site.export import load_export, main as export_main
from attn.train import train
from attn.training.config import TrainConfigError, config_from_argv
from test_train import TINY, write_corpus

LATER = ["--positional", "rope", "--ffn", "swiglu", "--kv-heads", "1", "--norm", "pre", "--norm-kind", "rms"]


def test_attn_train_trains_averages_resumes_and_decodes_the_later_block(tmp_path, capsys):
    data, out = write_corpus(tmp_path), tmp_path / "run"
    common = ["--data", str(data), *TINY, "--backend", "numpy", "--out", str(out), "--eval-every", "4",
              *LATER, "--average", "2", "--snapshot-every", "2"]
    config = config_from_argv([*common, "--steps", "4"])
    assert config.engine == "fast"                  # the fast engine trains it: nothing to say
    metrics = train(config)
    assert "readable engine" not in capsys.readouterr().err
    arrays, meta = load_npz(out / "checkpoint.npz")
    cfg = TransformerConfig.from_dict(meta["config"])
    assert (cfg.positional, cfg.ffn, cfg.kv_heads, cfg.norm_position, cfg.norm_kind) == ("rope", "swiglu", 1, "pre", "rms")
    assert arrays["param/encoder.0.self_attn.w_k"].shape == (32, 16)         # one key/value head of two
    assert "param/encoder.0.ffn.w3" in arrays and "param/src_pos.weight" not in arrays
    assert "param/encoder.0.norm1.gamma" in arrays and "param/encoder.0.norm1.beta" not in arrays
    assert (out / "averaged.npz").is_file() and metrics["steps"] == 4

    config = config_from_argv([*common, "--steps", "6", "--resume"])
    assert train(config, given={"steps", "resume", "out"})["steps"] == 6

    model = Transformer.load(out / "checkpoint.npz")
    vocab = Vocab.from_json(load_npz(out / "checkpoint.npz")[1]["vocab"])
    for beam in (1, 3):
        outputs = translate(model, vocab, ["a b c", "c b"], beam_size=beam)
        assert len(outputs) == 2 and all(isinstance(o.text, str) for o in outputs)

    assert export_main([str(out / "averaged.npz"), str(tmp_path / "page"), "--float16"]) == 0     # for the page
    page, _, _ = load_export(tmp_path / "page")
    averaged = Transformer.load(out / "averaged.npz")
    assert page.config == averaged.config
    for name, p in averaged.params.items():
        assert np.array_equal(page.params[name], p.astype(np.float16).astype(np.float32)), name


def test_the_fast_engine_makes_the_later_block():
    cfg = TransformerConfig.preset("toy", vocab_size=20, ffn="swiglu", kv_heads=2)
    assert engines.get("fast").model(cfg).config.ffn == "swiglu"


def test_the_fast_engines_flags_apply_to_the_later_block(tmp_path):
    assert config_from_argv(["--ffn", "swiglu", "--precision", "bf16"]).precision == "bf16"
    assert config_from_argv(["--positional", "rope"]).engine == "fast"
    assert config_from_argv(["--positional", "rope", "--reference"]).engine == "reference"
    with pytest.raises(TrainConfigError, match="kv_heads"):
        config_from_argv(["--kv-heads", "0"])

"""Files written before a config field was renamed still load, and compute what they computed.

``tests/fixtures/old_format/`` holds a checkpoint (``Transformer.save`` with a vocabulary, as
``attn-train`` writes it) and a page export (``attn-export``'s ``export_model``) of a tiny
pre-norm model, written at commit 07e96a6, when ``TransformerConfig.norm_position`` was called
``norm``; ``outputs.json`` records the readable model's logits and greedy decoding, and the fast
engine's logits, as that commit computed them. The old key maps to the new in one place,
``attn.model.renamed_fields``, which ``TransformerConfig.from_dict`` and ``TrainConfig.from_dict``
call; the page does the same in ``checkConfig`` (``web/attn/model.js``, tests/test_web.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attn import model as M
from attn.decode import greedy_decode
from attn.fast.model import FastTransformer
from attn.model import Transformer, TransformerConfig, renamed_fields
from attn.site.export import load_export
from attn.training.config import TrainConfig, config_from_argv, resumed_config
from attn.translate import load_translator

OLD = Path(__file__).resolve().parent / "fixtures" / "old_format"
RECORDED = json.loads((OLD / "outputs.json").read_text())
SRC, TGT_IN = np.array(RECORDED["src"]), np.array(RECORDED["tgt_in"])


def _close(got, key):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.array(RECORDED[key]), rtol=1e-5, atol=1e-6,
                               err_msg=key)


def test_the_fixtures_are_in_the_old_format():
    doc = json.loads((OLD / "export" / "model.json").read_text())
    assert doc["config"]["norm"] == "pre" and "norm_position" not in doc["config"]
    assert (OLD / "checkpoint.npz").stat().st_size < 32_000


def test_an_old_checkpoint_loads_and_computes_what_it_did():
    model = Transformer.load(OLD / "checkpoint.npz")
    assert model.config.norm_position == "pre"
    _close(model.forward(SRC, TGT_IN)[0], "logits")
    assert greedy_decode(model, SRC, max_len=8).tokens == RECORDED["greedy"]
    translator, vocab = load_translator(OLD / "checkpoint.npz")       # attn-translate's reader
    assert translator.config == model.config and len(vocab) == model.config.vocab_size


def test_the_fast_engine_loads_an_old_checkpoint():
    fast = FastTransformer.load(OLD / "checkpoint.npz")
    assert fast.config.norm_position == "pre"
    _close(fast.forward(SRC, TGT_IN)[0], "fast_logits")


def test_an_old_page_export_loads_and_computes_what_it_did():
    model, vocab, doc = load_export(OLD / "export")
    assert model.config == Transformer.load(OLD / "checkpoint.npz").config
    _close(model.forward(SRC, TGT_IN)[0], "logits")


def test_without_the_renaming_the_old_files_are_refused(monkeypatch):
    """The guard broken: the old key is then an unknown field."""
    monkeypatch.setattr(M, "RENAMED_FIELDS", {})
    with pytest.raises(ValueError, match=r"unknown fields \['norm'\]"):
        TransformerConfig.from_dict({"norm": "pre"})


def test_the_old_key_maps_to_the_new_in_configs_read_from_files():
    assert TransformerConfig.from_dict({"norm": "pre"}) == TransformerConfig(norm_position="pre")
    assert TransformerConfig.from_dict({"norm_position": "pre"}).norm_position == "pre"
    with pytest.raises(ValueError, match="both 'norm' .*'norm_position'"):
        TransformerConfig.from_dict({"norm": "pre", "norm_position": "pre"})
    assert renamed_fields({"a": 1, "norm": "post"}, "x") == {"a": 1, "norm_position": "post"}
    assert TrainConfig.from_dict({"norm": "pre"}).norm_position == "pre"      # a run's config.json "train"
    old_run = {k: v for k, v in TrainConfig(norm_position="pre").to_dict().items() if k != "norm_position"}
    resumed = resumed_config(TrainConfig(resume=True), {**old_run, "norm": "pre"}, given={"resume"})
    assert resumed.norm_position == "pre"             # a run saved before the rename resumes as it was


@pytest.mark.parametrize("flag", ["--norm-position", "--norm"])
def test_both_flags_choose_where_the_norm_sits(flag):
    assert config_from_argv([flag, "pre"]).norm_position == "pre"
    assert config_from_argv([]).norm_position is None

"""LoRA on the model (attn.lora) and its commands: a new adapter changes no output to the last
bit, the model's adapter gradients agree with central differences, training moves the adapters
and never the frozen weights, and attn-train --resume-from --lora, attn-translate --adapter and
attn-export --adapter agree with the merged model. (The layer itself, attn.layers.lora, is
checked through its registration: tests/test_registry.py.)"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest

import attn.backend as B
from attn.checkpoint import CheckpointError
from attn.data import EOS, Vocab
from attn.evaluate import translate_sentences
from attn.gradcheck import numerical_gradient, rel_error
from attn.lora import Adapter, LoraModel, load_adapter, parse_targets
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig
from attn.optim import Adam
from attn.train import TrainConfig, train
from attn.training.config import TrainConfigError, config_from_argv
from attn.translate import load_translator

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["a", "b", "c", "d", "e", "."]
LATER = dict(norm_position="pre", norm_kind="rms", positional="rope", ffn="swiglu", kv_heads=1, qk_norm=True)


def tiny(dtype="float64", **block):
    cfg = TransformerConfig(vocab_size=len(WORDS) + 4, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                            n_decoder_layers=1, dropout=0.0, attention_dropout=0.0, relu_dropout=0.0, **block)
    return Transformer(cfg, seed=3, dtype=dtype)


def batch(seed=0, V=10):
    r = np.random.default_rng(seed)
    return r.integers(3, V, (2, 4)), r.integers(3, V, (2, 5)), r.integers(3, V, (2, 5))


@pytest.mark.parametrize("block", [{}, LATER], ids=["paper", "later"])
def test_a_new_adapter_changes_no_output_to_the_last_bit(block):
    base = tiny("float32", **block)
    src, tgt_in, _ = batch()
    adapted = LoraModel(base, Adapter(4, ("q", "k", "v", "o")), seed=1)
    assert np.array_equal(B.to_host(adapted.forward(src, tgt_in)[0]), B.to_host(base.forward(src, tgt_in)[0]))


@pytest.mark.parametrize("block", [{}, LATER], ids=["paper", "later"])
def test_the_models_adapter_gradients_agree_with_central_differences(block):
    adapted = LoraModel(tiny(**block), Adapter(2, ("q", "v", "o"), alpha=3.0), seed=1)
    r = np.random.default_rng(1)
    for k in adapted.params:                             # a trained adapter: b no longer zero
        adapted.params[k] = adapted.params[k] + 0.3 * r.standard_normal(adapted.params[k].shape)
    src, tgt_in, tgt_out = batch(2)
    loss, dlogits = cross_entropy(adapted.forward(src, tgt_in)[0], tgt_out, 0.0)
    grads = adapted.backward(dlogits, adapted.forward(src, tgt_in)[1])
    assert sorted(grads) == sorted(adapted.params)

    def f():
        return cross_entropy(adapted.forward(src, tgt_in)[0], tgt_out, 0.0)[0]
    for name in [k for k in adapted.params if ".0." in k][::3]:
        idx = r.choice(adapted.params[name].size, 4, replace=False)
        num = numerical_gradient(f, adapted.params[name], indices=idx)
        err = rel_error(grads[name].reshape(-1)[idx], num.reshape(-1)[idx])
        assert err < 1e-6, f"{name}: relative error {err:.2e}"


def test_training_moves_the_adapters_and_never_the_frozen_weights():
    base = tiny("float32")
    frozen = {k: B.to_host(v).copy() for k, v in base.params.items()}
    adapted = LoraModel(base, Adapter(2), seed=1)
    opt = Adam(adapted.params, base.config.d_model, lr=1e-2)
    src, tgt_in, tgt_out = batch(3)
    losses = []
    for _ in range(15):
        logits, cache = adapted.forward(src, tgt_in)
        loss, dlogits = cross_entropy(logits, tgt_out, 0.0)
        losses.append(float(loss))
        opt.step(adapted.backward(dlogits, cache))
    assert losses[-1] < losses[0]
    assert all(np.array_equal(B.to_host(base.params[k]), v) for k, v in frozen.items()), "a frozen weight changed"
    assert all(B.to_host(v).any() for k, v in adapted.params.items() if k.endswith("lora_b")), "b never moved"
    merged = adapted.merged()
    assert np.allclose(B.to_host(merged.forward(src, tgt_in)[0]), B.to_host(adapted.forward(src, tgt_in)[0]))


def test_the_adapter_is_a_part_of_the_block_s_attentions():
    cfg = tiny().config
    assert list(Adapter(2).weights(cfg)) == ["encoder.0.self_attn.w_q", "encoder.0.self_attn.w_v",
                                             "decoder.0.self_attn.w_q", "decoder.0.self_attn.w_v",
                                             "decoder.0.cross_attn.w_q", "decoder.0.cross_attn.w_v"]
    lm = TransformerConfig(vocab_size=10, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=0, n_decoder_layers=2)
    assert list(Adapter(1, ("o",)).weights(lm)) == ["decoder.0.self_attn.w_o", "decoder.1.self_attn.w_o"]
    assert Adapter(2).shapes(cfg)["decoder.0.cross_attn.w_v.lora_b"] == (2, 8)
    for bad in ("q,x", "", "q,q"):
        with pytest.raises(ValueError, match="--lora-targets"):
            parse_targets(bad)


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A tiny base checkpoint and a LoRA run of three steps on a tiny corpus from it."""
    root = tmp_path_factory.mktemp("lora")
    vocab = Vocab.build([WORDS])
    base = tiny("float32")
    base.params["embedding.weight"][EOS] *= 3.0              # outputs end before the length limit
    ckpt = base.save(root / "base" / "checkpoint.npz", extra_meta={"vocab": vocab.to_json()})
    r = np.random.default_rng(0)
    for split, n in (("train", 24), ("val", 4), ("test", 4)):
        lines = [" ".join(r.choice(WORDS[:5], r.integers(2, 5))) + " ." for _ in range(n)]
        (root / f"{split}.en").write_text("\n".join(lines) + "\n")
        (root / f"{split}.tk").write_text("\n".join(line[::-1].strip() for line in lines) + "\n")
    out = root / "ft"
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        metrics = train(TrainConfig(data=root, resume_from=ckpt, lora=2, lora_targets="q,v,o", reference=True,
                                    steps=3, eval_every=2, bleu_sentences=2, out=out, quiet=True, max_tokens=64))
    return ckpt, out, {**metrics, "stderr": said.getvalue()}


def test_attn_train_saves_the_adapter_alone_and_states_its_size(finetuned, capsys):
    ckpt, out, metrics = finetuned
    base, _ = load_translator(ckpt)
    total = sum(v.size for v in base.params.values())
    assert metrics["steps"] == 3 and metrics["trained_parameters"] == 2 * 3 * 3 * (8 + 8)
    assert metrics["trained_fraction"] == pytest.approx(metrics["trained_parameters"] / total)
    assert metrics["adapter_bytes"] == 4 * metrics["trained_parameters"]
    assert 0 < metrics["train_seconds"] <= metrics["wall_seconds"]      # the steps' time, within the run's
    with np.load(out / "adapter.npz") as f:
        assert sorted(f.files) == sorted(["__meta__"] + [f"lora/{k}" for k in Adapter(2, ("q", "v", "o"))
                                                         .shapes(base.config)])
    assert json.loads((out / "metrics.json").read_text())["after"]["val_loss"] == metrics["after"]["val_loss"]
    assert (f"adapter: {metrics['trained_parameters']:,} parameters" in metrics["stderr"]
            and f"{metrics['adapter_bytes']:,} bytes of numbers, {(out / 'adapter.npz').stat().st_size:,} bytes in"
            in metrics["stderr"]), metrics["stderr"]


def test_translate_and_export_take_the_adapter_merged(finetuned, tmp_path, capsys):
    from attn.site.export import export_checkpoint, load_export
    from attn.translate import main
    ckpt, out, _ = finetuned
    base, vocab = load_translator(ckpt)
    merged = load_adapter(out / "adapter.npz", base).merged()
    assert any(not np.array_equal(B.to_host(merged.params[k]), B.to_host(base.params[k])) for k in base.params)
    want = translate_sentences(merged, vocab, ["a b c ."])[0]
    assert main(["--checkpoint", str(ckpt), "--adapter", str(out / "adapter.npz"), "--backend", "numpy",
                 "a b c ."]) == 0
    assert capsys.readouterr().out.strip() == want
    export_checkpoint(ckpt, tmp_path / "web", adapter=out / "adapter.npz")
    exported = load_export(tmp_path / "web")[0]
    assert all(np.array_equal(B.to_host(exported.params[k]), B.to_host(merged.params[k])) for k in merged.params)


def test_an_adapter_on_another_checkpoint_is_refused(finetuned, tmp_path):
    ckpt, out, _ = finetuned
    other = Transformer(TransformerConfig(vocab_size=10, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1,
                                          n_decoder_layers=1), dtype="float32")
    with pytest.raises(CheckpointError, match="another config"):
        load_adapter(out / "adapter.npz", other)
    with pytest.raises(CheckpointError, match="not a LoRA adapter"):
        load_adapter(ckpt, other)


@pytest.mark.parametrize("argv, words", [
    (["--lora", "4"], "--lora.*give --resume-from"),
    (["--resume-from", "{ckpt}"], "--resume-from.*add --reference"),
    (["--resume-from", "{ckpt}", "--reference", "--resume"], "--resume-from.*not with --resume"),
    (["--resume-from", "{missing}", "--reference"], "--resume-from.*checkpoint file"),
    (["--lora-targets", "q,z"], "--lora-targets"),
    (["--lora", "0"], "--lora.*positive"),
])
def test_fine_tuning_flags_are_refused_naming_the_flag(finetuned, tmp_path, argv, words):
    ckpt = finetuned[0]
    argv = [a.format(ckpt=ckpt, missing=tmp_path / "none.npz") for a in argv]
    with pytest.raises(TrainConfigError, match=words):
        config_from_argv(argv)


def test_the_transfer_benchmark_splits_tatoeba_german_first_by_german_sentence(tmp_path):
    """benchmarks/lora_transfer.py's splits: German -> English, line-aligned, every translation of a
    German sentence in one split (Tatoeba's English<TAB>German, several English for one German)."""
    spec = importlib.util.spec_from_file_location("lora_transfer", ROOT / "benchmarks" / "lora_transfer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [(f"English {i} {j}.", f"Deutsch {i}.") for i in range(60) for j in range(1 + i % 3)]
    (tmp_path / "deu.txt").write_text("".join(f"{en}\t{de}\tCC-BY\n" for en, de in rows), encoding="utf-8")
    counts = module.write_splits(tmp_path / "deu.txt", tmp_path / "out")
    split = {s: list(zip(*[(tmp_path / "out" / f"{s}.{lang}").read_text(encoding="utf-8").splitlines()
                           for lang in ("de", "en")])) for s in ("train", "val", "test")}
    assert {s: len(p) for s, p in split.items()} == counts and sum(counts.values()) == len(rows)
    assert sorted(p for s in split.values() for p in s) == sorted((de, en) for en, de in rows)
    held = {de for s in ("val", "test") for de, _ in split[s]}
    assert held and not held & {de for de, _ in split["train"]}

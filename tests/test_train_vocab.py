"""The trainer with either vocabulary: ``--vocab {word,bpe} --vocab-size N``, the merges
inside the checkpoint (and the averaged model), ``attn-translate`` with them, resuming,
old checkpoints without merges, and the scores metrics.json records."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn import backend as B
from attn.checkpoint import load_npz
from attn.data import Vocab
from attn.evaluate import translate_sentences
from attn.model import Transformer, TransformerConfig
from attn.train import TrainConfig, train
from attn.training.config import DEFAULT_BPE_SIZE, TrainConfigError, config_from_argv
from attn.training.prepare import build_vocab
from attn.translate import load_translator, main as translate_main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "real_text.tsv"
PAIRS = [("Tom's car costs 3.5 million.", "Toms Auto kostet 3,5 Millionen."),
         ("The students' books.", "Die Bücher der Schüler."),
         ("We sold 1,000 tickets!", "Wir haben 1.000 Karten verkauft!"),
         ("\"Don't go,\" she said.", "„Geh nicht“, sagte sie.")]
TINY = dict(src="en", tgt="de", average=0, d_model=32, heads=2, d_ff=64, layers=1, max_tokens=128, warmup=30,
            minutes=0, bleu_sentences=0, quiet=True, backend="numpy")


STEPS = 300            # twice what memorising the four pairs took with one BLAS: another's sums take longer


def write_corpus(folder: Path, pairs=PAIRS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val", "test"):
        (folder / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
        (folder / f"{split}.de").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return folder


@pytest.fixture(autouse=True)
def _numpy_backend():
    saved = (B._current, B._xp)
    B.set_backend("numpy")
    yield
    B._current, B._xp = saved


def test_a_bpe_run_learns_exact_text_and_carries_its_merges(tmp_path, capsys):
    """Overfit four real sentences with BPE: the translations are the references, character
    for character (digits, apostrophes, quotes), and score 100."""
    out = tmp_path / "run"
    metrics = train(TrainConfig(data=write_corpus(tmp_path / "data"), out=out, vocab="bpe", vocab_size=580,
                                steps=STEPS, dropout=0.0, label_smoothing=0.0, lr_factor=1.0, eval_every=STEPS,
                                **TINY))
    assert metrics["vocab"] == "bpe" and metrics["vocab_size"] == 580
    assert metrics["test_bleu"] == pytest.approx(100.0) and metrics["test_chrf"] == pytest.approx(100.0)
    final = json.loads((out / "metrics.json").read_text())
    assert "tok:13a" in final["sacrebleu"]["bleu"] and "nc:6" in final["sacrebleu"]["chrf"]
    assert "test_bleu_lc" in final
    err = capsys.readouterr()
    assert "chrF" in err.out and "BPE merges" in err.err

    _, meta = load_npz(out / "checkpoint.npz")
    assert set(meta["vocab"]) == {"itos", "bpe"} and meta["vocab"]["bpe"]["merges"]
    model, vocab = load_translator(out / "checkpoint.npz")
    assert vocab.bpe is not None and len(vocab) == 580
    assert translate_sentences(model, vocab, [s for s, _ in PAIRS]) == [t for _, t in PAIRS]
    assert (out / "test_translations.txt").read_text(encoding="utf-8").splitlines() == [t for _, t in PAIRS]
    assert translate_main(["--checkpoint", str(out / "checkpoint.npz"), "--backend", "numpy", PAIRS[2][0]]) == 0
    assert capsys.readouterr().out.splitlines() == [PAIRS[2][1]]


def test_the_averaged_model_and_a_resumed_run_keep_the_merges(tmp_path):
    data, out = write_corpus(tmp_path / "data"), tmp_path / "run"
    cfg = dict(TINY, average=2)
    train(TrainConfig(data=data, out=out, vocab="bpe", vocab_size=600, steps=4, snapshot_every=2,
                      eval_every=2, **{k: v for k, v in cfg.items()}))
    _, first = load_translator(out / "checkpoint.npz")
    _, averaged = load_translator(out / "averaged.npz")
    assert averaged == first and averaged.bpe is not None
    train(TrainConfig(data=data, out=out, vocab="bpe", vocab_size=600, steps=6, snapshot_every=2,
                      eval_every=2, resume=True, **cfg))
    _, meta = load_npz(out / "checkpoint.npz")
    assert meta["step"] == 6 and Vocab.from_json(meta["vocab"]) == first
    with pytest.raises(TrainConfigError, match="--vocab-size 700"):      # the saved run's vocabulary stays
        train(TrainConfig(data=data, out=out, vocab="bpe", vocab_size=700, steps=8, snapshot_every=2,
                          eval_every=2, resume=True, **cfg))


def test_an_old_checkpoint_without_merges_still_loads_and_translates(tmp_path):
    """Checkpoints written before BPE hold the vocabulary as a plain list: a word vocabulary."""
    vocab = Vocab.build([["the", "red", "cat", "le", "chat", "rouge", "."]])
    cfg = TransformerConfig(vocab_size=len(vocab), d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                            n_decoder_layers=1)
    path = Transformer(cfg, seed=0).save(tmp_path / "old.npz", extra_meta={"vocab": list(vocab.itos)})
    model, loaded = load_translator(path)
    assert loaded == vocab and loaded.bpe is None
    assert translate_main(["--checkpoint", str(path), "--backend", "numpy", "the red cat ."]) == 0


def test_word_vocabulary_is_the_default_and_vocab_size_caps_it():
    assert TrainConfig().with_recipe().vocab == "word" and TrainConfig().vocab_size is None
    assert TrainConfig(preset="small").with_recipe().vocab == "bpe"          # the recipe for real text
    pairs = [("a a a b", "c c d"), ("a b e", "c")]
    assert len(build_vocab(pairs)) == 4 + 5
    assert build_vocab(pairs, kind="word", size=6).itos[4:] == ["a", "c"]
    bpe = build_vocab([("lower lowest", "newer newest")] * 3, kind="bpe", size=525)
    assert len(bpe) == 525 and bpe.bpe is not None
    assert len(build_vocab([("lower lowest", "newer newest")] * 3, kind="bpe")) <= DEFAULT_BPE_SIZE


def test_vocab_flags(tmp_path):
    cfg = config_from_argv(["--vocab", "bpe", "--vocab-size", "16000"])
    assert (cfg.vocab, cfg.vocab_size) == ("bpe", 16000)
    with pytest.raises(SystemExit):
        config_from_argv(["--vocab", "chars"])
    with pytest.raises(TrainConfigError, match=r"vocab_size \(--vocab-size\)"):
        TrainConfig(vocab="bpe", vocab_size=100)
    with pytest.raises(TrainConfigError, match=r"vocab \(--vocab\)"):
        TrainConfig(vocab="chars")
    with pytest.raises(TrainConfigError, match="characters alone need"):     # the text has more characters
        train(TrainConfig(data=write_corpus(tmp_path / "data"), out=tmp_path / "run", vocab="bpe",
                          vocab_size=520, steps=1, **TINY))
    assert TrainConfig(vocab="word", vocab_size=100).vocab_size == 100


def test_a_pair_too_long_for_max_len_is_left_out_before_bpe_is_learned(tmp_path, capsys):
    """A 1 MB word could never fit a training sentence: it is left out before the vocabulary is
    learned (it took minutes to learn and encode), and said so in one line."""
    import random
    word = "".join(random.Random(0).choices("abcdefghij", k=10**6))
    data = write_corpus(tmp_path / "data")
    with open(data / "train.en", "a", encoding="utf-8") as en, open(data / "train.de", "a", encoding="utf-8") as de:
        en.write(word + "\n")
        de.write("ein Wort .\n")
    out = tmp_path / "run"
    train(TrainConfig(data=data, out=out, vocab="bpe", vocab_size=700, steps=1, **TINY))
    assert "left out 1 training pair(s) longer than 127 tokens (--max-len) before learning the vocabulary" \
        in capsys.readouterr().err
    vocab = Vocab.from_json(load_npz(out / "checkpoint.npz")[1]["vocab"])
    assert not any(set(s.lstrip("#")) <= set("abcdefghij") and len(s.lstrip("#")) > 8 for s in vocab.itos)

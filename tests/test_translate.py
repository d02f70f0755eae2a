"""The ``attn-translate`` command, text-level translation, corpus BLEU and the attention figure.

A tiny random model saved with a vocabulary stands in for a trained checkpoint:
the command's contract (one line out per sentence in, arguments or standard
input, exit code 2 and a clear message for problems the user can fix) does not
depend on the translations being good.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import attn.backend as B
from attn.data import EOS, Vocab, tokenize
from attn.evaluate import (MAX_SOURCE_TOKENS_LIMIT, corpus_bleu, evaluate_bleu, source_ids, translate,
                           translate_sentences)
from attn.model import Transformer, TransformerConfig
from attn.plot import plot_attention
from attn.translate import attention_paths, main

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["a", "b", "c", "d", "e", "."]
PNG = b"\x89PNG\r\n\x1a\n"


def tiny(seed=3):
    vocab = Vocab.build([WORDS])
    cfg = TransformerConfig(vocab_size=len(vocab), d_model=8, n_heads=2, d_ff=16,
                            n_encoder_layers=1, n_decoder_layers=1)
    model = Transformer(cfg, seed=seed, dtype="float64")
    model.params["embedding.weight"][EOS] *= 3.0        # so that outputs end before the length limit
    return model, vocab


@pytest.fixture
def checkpoint(tmp_path):
    model, vocab = tiny()
    return model.save(tmp_path / "run" / "checkpoint.npz", extra_meta={"vocab": vocab.to_json()})


@pytest.fixture
def restore_backend():
    """``main`` selects a backend; put the previous choice back afterwards."""
    saved = (B._current, B._xp)
    yield
    B._current, B._xp = saved


def run_cli(*args, stdin=None):
    env = {**os.environ, "ATTN_BACKEND": "numpy", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "attn.translate", *map(str, args)], input=stdin,
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


# --------------------------------------------------------------------------- the command, as a user runs it

def test_cli_translates_arguments(checkpoint):
    r = run_cli("--checkpoint", checkpoint, "a b c", "d e .", "zz unknown a")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3
    model, vocab = tiny()
    assert lines == translate_sentences(model, vocab, ["a b c", "d e .", "zz unknown a"])


def test_cli_reads_standard_input_one_sentence_per_line(checkpoint):
    r = run_cli("--checkpoint", checkpoint, "--beam", "3", stdin="a b\n\nc d e .\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")[:-1]
    assert len(lines) == 3                        # an empty line in, a line out: the alignment holds
    model, vocab = tiny()
    assert lines == translate_sentences(model, vocab, ["a b", "", "c d e ."], beam_size=3)


def test_cli_missing_checkpoint_exits_2_naming_it(tmp_path):
    missing = tmp_path / "nowhere" / "checkpoint.npz"
    r = run_cli("--checkpoint", missing, "a b")
    assert r.returncode == 2
    assert str(missing) in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


# --------------------------------------------------------------------------- the command, in process

def test_help_explains_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--checkpoint", "--beam", "--alpha", "--attention", "--backend"):
        assert flag in out
    assert "attn-translate --checkpoint" in out      # an example


def test_the_help_quotes_lengths_within_the_limit_and_the_default_backend_is_attn_train_s(monkeypatch):
    """--max-length's help said "at most 4,096" and then quoted the cost at 10,000; the default backend
    was auto where attn-train's (and every other command's) is numpy."""
    import re
    from attn.training.config import build_parser as train_parser
    from attn.translate import build_parser
    helps = {a.dest: a.help for a in build_parser()._actions}
    lengths = [int(n.replace(",", "")) for n in re.findall(r"\bat ([\d,]+)", helps["max_length"])]
    assert lengths and max(lengths) <= MAX_SOURCE_TOKENS_LIMIT, helps["max_length"]
    monkeypatch.delenv("ATTN_BACKEND", raising=False)
    assert build_parser().get_default("backend") == "numpy"
    assert "$ATTN_BACKEND or numpy" in {a.dest: a.help for a in train_parser()._actions}["backend"]


def test_attention_figure_one_and_several(checkpoint, tmp_path, capsys, restore_backend):
    png = tmp_path / "figs" / "att.png"
    assert main(["--checkpoint", str(checkpoint), "--backend", "numpy", "--attention", str(png), "a b c"]) == 0
    assert png.read_bytes()[:8] == PNG
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main(["--checkpoint", str(checkpoint), "--backend", "numpy", "--beam", "2",
                 "--attention", str(png), "a b", "c d e ."]) == 0
    for p in (tmp_path / "figs" / "att-1.png", tmp_path / "figs" / "att-2.png"):
        assert p.read_bytes()[:8] == PNG
    assert attention_paths(Path("x/att.png"), 1) == [Path("x/att.png")]


@pytest.mark.parametrize("problem", ["corrupt", "no_vocab", "wrong_vocab", "bad_config"])
def test_bad_checkpoints_exit_2(tmp_path, capsys, restore_backend, problem):
    path = tmp_path / "checkpoint.npz"
    model, vocab = tiny()
    if problem == "corrupt":
        path.write_bytes(b"this is not a zip file")
    elif problem == "no_vocab":
        model.save(path)
    elif problem == "wrong_vocab":
        model.save(path, extra_meta={"vocab": vocab.to_json()[:-1]})
    else:
        arrays = {k: v for k, v in model.state_arrays().items() if "ffn" not in k}
        from attn.checkpoint import save_npz
        save_npz(path, arrays, {"config": model.config.to_dict(), "vocab": vocab.to_json()})
    assert main(["--checkpoint", str(path), "--backend", "numpy", "a b"]) == 2
    err = capsys.readouterr()
    assert err.out == ""
    assert err.err.startswith("attn-translate: error:") and str(path) in err.err


def test_unusable_backend_exits_2(checkpoint, capsys, restore_backend):
    if B.cupy_available():
        pytest.skip("CuPy is usable here: --backend cupy is not an error")
    assert main(["--checkpoint", str(checkpoint), "--backend", "cupy", "a"]) == 2
    assert "CuPy" in capsys.readouterr().err


# --------------------------------------------------------------------------- translation and BLEU

def test_translate_restores_input_order_across_sorted_batches():
    model, vocab = tiny()
    sentences = ["a b c d e . a", "b", "c d", "e e e e", "", "a . b", "zz"]
    alone = [translate_sentences(model, vocab, [s])[0] for s in sentences]
    assert translate_sentences(model, vocab, sentences, batch_size=3) == alone
    assert translate_sentences(model, vocab, sentences, beam_size=2, batch_size=2) == \
        [translate_sentences(model, vocab, [s], beam_size=2)[0] for s in sentences]


def test_source_ids_use_unk_and_end_with_eos():
    _, vocab = tiny()
    ids = source_ids(vocab, tokenize("a zz ."))
    assert ids == [vocab.stoi["a"], 3, vocab.stoi["."], EOS]
    (t,) = translate(*tiny(), ["a zz ."], with_attention=True)
    assert t.src_tokens == ["a", "zz", ".", "</s>"]
    assert t.attention.shape == (len(t.tgt_tokens), 4)


def test_corpus_bleu():
    text = ["the old friend did not think that the bird will carry the girl .", "he carries red girls ."]
    assert corpus_bleu(text, text) == pytest.approx(100.0)
    assert corpus_bleu(["x y z w"], ["a b c d"]) == pytest.approx(0.0)
    assert corpus_bleu([], []) == 0.0
    with pytest.raises(ValueError, match="2 hypotheses but 1"):
        corpus_bleu(text, text[:1])


def test_evaluate_bleu_returns_score_and_hypotheses():
    model, vocab = tiny()
    pairs = [("a b", "c d ."), ("e", "a")]
    bleu, hyps = evaluate_bleu(model, vocab, pairs)
    assert 0.0 <= bleu <= 100.0
    assert hyps == translate_sentences(model, vocab, ["a b", "e"])


def test_plot_attention_checks_the_shape(tmp_path):
    w = B.host.full((2, 3), 1 / 3)
    assert plot_attention(w, ["a", "b", "</s>"], ["x", "y"], tmp_path / "a.png", title="t").read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        plot_attention(w, ["a", "b"], ["x", "y"], tmp_path / "b.png")


def _translate_auto(checkpoint, prelude=""):
    env = {k: v for k, v in os.environ.items() if k != "ATTN_BACKEND"}
    env["PYTHONPATH"] = str(ROOT)
    code = f"{prelude}import sys; from attn.translate import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "--checkpoint", str(checkpoint), "--backend", "auto", "a b"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_auto_on_a_cpu_only_install_says_nothing_about_cupy(checkpoint):
    r = _translate_auto(checkpoint, prelude="import sys; sys.modules['cupy'] = None; ")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert r.stderr == ""


def test_auto_with_cupy_but_no_gpu_says_so_in_one_line(checkpoint):
    """CuPy installed, no GPU usable: one line in the command's words, not a Python warning with a path."""
    try:
        import cupy  # noqa: F401
    except Exception as e:
        pytest.skip(f"cupy-cuda12x is not installed ({type(e).__name__}); CI installs it with .[gpu-ci]")
    if B.cupy_modules is None and B.cupy_available():
        pytest.skip("a GPU is usable here: this checks the machine without one")
    r = _translate_auto(checkpoint)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("attn-translate: using NumPy: CuPy imports, but no GPU is usable"), \
        r.stderr
    assert "Warning" not in r.stderr and ".py" not in r.stderr
    assert "Error" not in r.stderr and "cuda" not in r.stderr.lower(), r.stderr     # a notice, not the driver's error


# --------------------------------------------------------------------------- bounded input, one line per mistake

def _one_line_error(r, *words):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("attn-translate: error:"), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_a_sentence_over_the_limit_is_refused_in_one_line_before_any_work(checkpoint):
    r = run_cli("--checkpoint", checkpoint, stdin="a .\n" + "a b c " * 100 + "\n")
    _one_line_error(r, "line 2", "301 tokens", "256", "--max-length")      # the tiny model's max_len: 256
    r = run_cli("--checkpoint", checkpoint, "--max-length", "20", "a b . " + "a b c " * 10 + ". c .")
    _one_line_error(r, "line 1, sentence 2 of 3,", "32 tokens", "limit of 20")
    assert run_cli("--checkpoint", checkpoint, "--max-length", "40", "a b c " * 10).returncode == 0


def _alone(model, vocab, sentences):
    """The translations of sentences one by one, joined as a line of them comes out."""
    return " ".join(t.text for t in translate(model, vocab, sentences))


def test_three_sentences_on_a_line_are_three_translations_on_one_line(checkpoint):
    model, vocab = tiny()
    sentences = ["a b c .", "d e !", "a a a a ?"]
    (joined,) = translate(model, vocab, [" ".join(sentences)])
    assert joined.text == _alone(model, vocab, sentences)
    assert joined.attention is None and joined.src_tokens.count(vocab.itos[EOS]) == 3
    (as_tokens,) = translate(model, vocab, [tokenize(" ".join(sentences))])       # tokens: one sentence, as cut
    assert as_tokens.src_tokens.count(vocab.itos[EOS]) == 1 and as_tokens.attention is None
    r = run_cli("--checkpoint", checkpoint, stdin=" ".join(sentences) + "\nd e .\n")
    assert r.returncode == 0 and r.stdout.split("\n") == [joined.text, _alone(model, vocab, ["d e ."]), ""]


def test_a_text_of_900_sentences_on_one_line_is_translated_sentence_by_sentence():
    """908 sentences, 5,000 tokens, in a single line: each translated, none packed with another."""
    import random
    model, vocab = tiny()
    rng = random.Random(0)
    sentences = [" ".join(rng.choices(WORDS[:5], k=rng.randint(1, 9))) + " ." for _ in range(908)]
    (joined,) = translate(model, vocab, [" ".join(sentences)], batch_size=256)
    assert joined.src_tokens.count(vocab.itos[EOS]) == 908                # every sentence in, with its end mark
    assert joined.text == _alone(model, vocab, sentences)


def test_a_learned_table_bounds_the_limit_too():
    vocab = Vocab.build([WORDS])
    cfg = TransformerConfig(vocab_size=len(vocab), d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                            n_decoder_layers=1, positional="learned", max_len=6)
    model = Transformer(cfg, seed=1)
    with pytest.raises(ValueError, match="limit of 6"):
        translate(model, vocab, ["a b c d e a b"])
    assert len(translate(model, vocab, ["a b c d e a b"], max_source_tokens=None)[0].src_tokens) == 6


def test_an_empty_line_translates_to_an_empty_line(checkpoint):
    r = run_cli("--checkpoint", checkpoint, stdin="a b\n\n   \nc .\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[1:3] == ["", ""]
    (t,) = translate(*tiny(), [""], with_attention=True)
    assert t.text == "" and t.tgt_tokens == [] and t.attention.shape == (0, 0)


def test_input_that_is_not_utf8_is_one_line_naming_the_line(checkpoint):
    env = {**os.environ, "ATTN_BACKEND": "numpy", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "attn.translate", "--checkpoint", str(checkpoint)],
                       input=b"a b\n\xff\xfe c\n", capture_output=True, env=env, cwd=ROOT, timeout=120)
    r = subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())
    _one_line_error(r, "standard input line 2 is not valid UTF-8")
    r = subprocess.run([sys.executable, "-m", "attn.translate", "--checkpoint", str(checkpoint), b"a \xff"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    _one_line_error(r, "sentence argument 1 is not valid UTF-8")


@pytest.mark.parametrize("flags, words", [
    (["--alpha", "nan"], ["--alpha must be a number between 0 and 10"]),
    (["--alpha", "inf"], ["--alpha must be a number between 0 and 10"]),
    (["--beam", "2", "--alpha", "1000"], ["--alpha must be a number between 0 and 10", "got 1000"]),
    (["--beam", "0"], ["--beam must be between 1 and"]),
    (["--beam", "1000000000"], ["--beam must be between 1 and"]),
    (["--batch-size", "0"], ["--batch-size must be at least 1"]),
    (["--max-length", "1"], ["--max-length must be between 2", "4,096"]),
    (["--max-length", "100000000"], ["--max-length must be between 2", "got 100000000"]),
    (["--attention", "x.txt"], ["--attention x.txt", ".txt is not an image format"]),
    (["--attention", "/proc/att.png"], ["cannot write into /proc"]),
])
def test_every_flag_out_of_range_is_one_line(checkpoint, flags, words):
    _one_line_error(run_cli("--checkpoint", checkpoint, *flags, "a b"), *words)


def test_an_unknown_backend_in_the_environment_is_one_line(checkpoint):
    env = {**os.environ, "ATTN_BACKEND": "gpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "attn.translate", "--checkpoint", str(checkpoint), "a b"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    _one_line_error(r, "ATTN_BACKEND must be numpy, cupy or auto", "'gpu'")


def test_cupy_asked_for_without_a_usable_gpu_is_one_line(checkpoint, capsys, monkeypatch, restore_backend):
    def no_gpu():
        raise B.BackendError("ATTN_BACKEND=cupy was asked for and CuPy imports, but no GPU is usable "
                             "(CUDARuntimeError: CUDA driver version is insufficient)")

    monkeypatch.setattr(B, "_import_cupy", no_gpu)
    monkeypatch.setenv("ATTN_BACKEND", "cupy")
    assert main(["--checkpoint", str(checkpoint), "a b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attn-translate: error: ATTN_BACKEND=cupy was asked for"), err


def test_why_no_attention_figure_is_drawn_is_said_truly(tmp_path, capsys, restore_backend):
    """An empty input, an empty translation, a line cut into sentences: each says its own reason."""
    model, vocab = tiny(seed=0)
    model.params["embedding.weight"][EOS] *= 40          # its first word is the end mark: an empty translation
    ckpt = model.save(tmp_path / "c.npz", extra_meta={"vocab": vocab.to_json()})
    cases = {"a b c": "its translation is empty", "": "it is empty",
             "a b . c d .": "it was cut into sentences translated one by one"}
    for sentence, why in cases.items():
        assert main(["--checkpoint", str(ckpt), "--backend", "numpy", "--attention", str(tmp_path / "att.png"),
                     sentence]) == 0
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"attn-translate: no attention figure {tmp_path / 'att.png'}: {why}"], (sentence, err)


def test_a_text_file_as_checkpoint_is_said_to_be_text(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("the old friend laughed .\n")
    r = run_cli("--checkpoint", text, "a b")
    _one_line_error(r, str(text), "not an .npz archive", "looks like text")
    assert "pickle" not in r.stderr


# --------------------------------------------------------------------------- streaming standard input

def _next_within(it, seconds=30):
    """``next(it)``, or a test failure when it waits longer than ``seconds`` (it read too far ahead)."""
    import threading
    box = []

    def step():
        try:
            box.append(next(it))
        except Exception as e:          # handed to the test's thread
            box.append(e)
    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"no batch within {seconds} s: the reader waits for more input than it needs"
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def test_standard_input_is_read_lazily_a_bounded_batch_at_a_time():
    from attn.translate import stdin_batches

    class Endless:                                  # a stream without end and without a file descriptor
        def __iter__(self):
            n = 0
            while True:
                n += 1
                yield f"a b {n} .\n".encode()

    batches = stdin_batches(Endless(), 4)
    assert _next_within(batches) == (1, ["a b 1 .", "a b 2 .", "a b 3 .", "a b 4 ."])
    assert _next_within(batches)[0] == 5
    r, w = os.pipe()                                # a pipe whose writer is still writing
    with os.fdopen(r, "rb", buffering=0) as reader, os.fdopen(w, "wb", buffering=0) as writer:
        writer.write("\ufeffa b .\nc d .\ne".encode())
        batches = stdin_batches(reader, 64)
        assert _next_within(batches) == (1, ["a b .", "c d ."])   # now, not when 64 lines or the end come
        writer.write(b" .\nd .\n")
        assert _next_within(batches) == (3, ["e .", "d ."])
        writer.write(b"a .\n\xff\n")
        with pytest.raises(ValueError, match="line 6 is not valid UTF-8"):   # before its batch is translated
            _next_within(batches)


def test_a_run_folder_translates_with_the_model_its_test_used(checkpoint, capsys, restore_backend):
    """The README translated with averaged.npz where the run had tested its last model (the average's
    validation loss was higher) and printed checkpoint.npz: the run's folder now names the one tested."""
    import json
    folder = checkpoint.parent
    other, vocab = tiny(seed=5)
    other.save(folder / "averaged.npz", extra_meta={"vocab": vocab.to_json()})
    sentence = "a b c d ."
    last, average = (_alone(m, vocab, [sentence]) for m in (tiny()[0], other))
    assert last != average
    for metrics, expected in ((None, last), ({"averaged_checkpoints": 5}, average),
                              ({"averaged_checkpoints": 1}, last)):
        if metrics is not None:
            (folder / "metrics.json").write_text(json.dumps(metrics))
        assert main(["--checkpoint", str(folder), "--backend", "numpy", sentence]) == 0
        assert capsys.readouterr().out == expected + "\n", metrics


def test_a_line_over_1_mib_is_refused_as_it_is_read(checkpoint):
    """A line is held and tokenised whole: one of 100 MB without a sentence end took a minute and
    4 GB before its token count refused it. Now it is refused when it grows past 1 MiB, as read from
    a pipe and from a stream without a file descriptor, naming the line."""
    import io
    import time
    from attn.translate import MAX_LINE_BYTES, stdin_batches
    long_line = "a b " * (MAX_LINE_BYTES // 4 + 1)
    t = time.perf_counter()
    r = run_cli("--checkpoint", checkpoint, stdin="a .\n" + long_line + long_line)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "attn-translate: error: standard input line 2 is longer than 1 MiB: put each sentence (or each "
        "paragraph) on a line of its own; a sentence may have at most --max-length tokens"], r.stderr
    assert time.perf_counter() - t < 60
    batches = stdin_batches(io.BytesIO(f"a .\n{long_line}\n".encode()), 1)
    assert next(batches) == (1, ["a ."])
    with pytest.raises(ValueError, match="line 2 is longer than 1 MiB"):
        next(batches)
    assert list(stdin_batches(io.BytesIO(("a " * (MAX_LINE_BYTES // 2)).encode()), 1))[0][1][0].count("a") \
        == MAX_LINE_BYTES // 2                                                  # at the bound: read


def test_translations_come_out_before_the_input_ends_and_stay_on_interrupt(checkpoint):
    import select
    import signal
    env = {**os.environ, "ATTN_BACKEND": "numpy", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "attn.translate", "--checkpoint", str(checkpoint)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        model, vocab = tiny()
        for line in ["a b .", "c d e ."]:
            p.stdin.write(line.encode() + b"\n")
            p.stdin.flush()
            assert select.select([p.stdout], [], [], 120)[0], "no translation while standard input is open"
            assert p.stdout.readline().decode().rstrip("\n") == _alone(model, vocab, [line])
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert out == b"" and err.decode().splitlines() == [
        "attn-translate: interrupted; the translations of the first 2 lines were written"]


def test_one_decoding_object_says_how_to_decode():
    """translate, translate_sentences and evaluate_translations take a Decoding, or its fields by name."""
    from attn.decode import Decoding
    from attn.evaluate import evaluate_translations
    model, vocab = tiny()
    lines = ["a b c", "d e ."]
    beam = Decoding(beam_size=3, alpha=0.0, no_repeat_ngram=2)
    assert translate_sentences(model, vocab, lines, beam) == translate_sentences(model, vocab, lines, beam_size=3,
                                                                                 alpha=0.0, no_repeat_ngram=2)
    assert evaluate_translations(model, vocab, list(zip(lines, lines)), beam)[1] == translate_sentences(
        model, vocab, lines, beam)
    (t,) = translate(model, vocab, ["a b"], Decoding(with_attention=True))
    assert t.attention.shape[0] == len(t.tgt_tokens) and t.attention.shape[1] >= 1
    with pytest.raises(TypeError, match="translate: give a Decoding or its settings \\(beam_size\\), not both"):
        translate(model, vocab, lines, beam, beam_size=2)
    with pytest.raises(ValueError, match="Decoding: beam_size must be a positive integer, got 0"):
        Decoding(beam_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        beam.beam_size = 4

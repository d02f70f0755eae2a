"""End-to-end: the trainer learns, resumes exactly, survives Ctrl-C, and its command explains itself."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from attn import backend as B
from attn.checkpoint import load_npz
from attn.evaluate import translate_sentences
from attn.loss import cross_entropy
from attn.model import Transformer
from attn.data import DataError, Vocab
from attn.train import TrainConfig, main, train
from attn.training.config import TrainConfigError, config_from_argv
from attn.training.evaluation import evaluate_loss

ROOT = Path(__file__).resolve().parents[1]

PAIRS = [("the red cat sleeps", "le chat rouge dort"),
         ("a big dog runs", "un grand chien court"),
         ("the small bird sings", "le petit oiseau chante"),
         ("a red dog sleeps", "un chien rouge dort"),
         ("the big cat runs", "le grand chat court"),
         ("a small cat sings", "un petit chat chante")]


def write_corpus(folder: Path, pairs=PAIRS):
    for split in ("train", "val", "test"):
        (folder / f"{split}.xx").write_text("\n".join(s for s, _ in pairs) + "\n", encoding="utf-8")
        (folder / f"{split}.yy").write_text("\n".join(t for _, t in pairs) + "\n", encoding="utf-8")
    return folder


TINY = ["--src", "xx", "--tgt", "yy", "--average", "0", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--layers", "1",
        "--max-tokens", "64", "--warmup", "30", "--minutes", "0", "--bleu-sentences", "0", "--quiet"]


def run_train(tmp_path, *extra):
    (tmp_path / "data").mkdir(exist_ok=True)
    data = write_corpus(tmp_path / "data")
    return train(config_from_argv(["--data", str(data), *TINY, "--backend", "numpy", *extra]))


@pytest.fixture(autouse=True)
def _numpy_backend():
    B.set_backend("numpy")
    yield


def test_tiny_model_overfits_to_exact_translations(tmp_path):
    out = tmp_path / "run"
    metrics = run_train(tmp_path, "--steps", "200", "--dropout", "0", "--label-smoothing", "0",
                        "--eval-every", "100", "--out", str(out), "--lr-factor", "1")
    _, meta = load_npz(out / "checkpoint.npz")
    model = Transformer.load(out / "checkpoint.npz")
    vocab = Vocab.from_json(meta["vocab"])
    hyps = translate_sentences(model, vocab, [s for s, _ in PAIRS])
    assert hyps == [t for _, t in PAIRS]
    assert metrics["test_bleu"] == pytest.approx(100.0)
    for name in ("checkpoint.npz", "config.json", "metrics.jsonl", "metrics.json", "loss.png"):
        assert (out / name).is_file(), name
    final = json.loads((out / "metrics.json").read_text())
    for key in ("test_bleu", "val_loss", "steps", "train_seconds", "tokens_per_second", "backend"):
        assert key in final
    assert final["steps"] == 200


def test_resume_reproduces_the_uninterrupted_losses(tmp_path):
    run_train(tmp_path, "--steps", "12", "--eval-every", "6", "--out", str(tmp_path / "straight"))
    run_train(tmp_path, "--steps", "5", "--eval-every", "6", "--out", str(tmp_path / "split"))
    run_train(tmp_path, "--steps", "12", "--eval-every", "6", "--out", str(tmp_path / "split"), "--resume")
    a, _ = load_npz(tmp_path / "straight" / "checkpoint.npz")
    b, _ = load_npz(tmp_path / "split" / "checkpoint.npz")
    assert len(a["history/train_loss"]) == 12
    np.testing.assert_array_equal(a["history/train_loss"], b["history/train_loss"])
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_the_last_step_and_exits_with_the_shells_status(tmp_path, sig, status):
    """Ctrl-C and SIGTERM (a scheduler, timeout) save a checkpoint of the step they interrupted, long
    before the next evaluation would have, exit 128 + the signal's number and say how to resume;
    the run resumes from that very step."""
    (tmp_path / "data").mkdir()
    data = write_corpus(tmp_path / "data")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "attn.train", "--data", str(data), *TINY, "--steps", "100000",
           "--eval-every", "100000", "--out", str(out), "--backend", "numpy"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "training pairs" in proc.stderr.readline()          # said as the loop begins
    time.sleep(1.0)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, stderr
    stopped = re.search(r"stopped by (\w+) after (\d+) steps.*resume with: attn-train --resume --out (\S+)", stderr)
    assert stopped and stopped[1] == signal.Signals(sig).name and stopped[3] == str(out), stderr
    arrays, meta = load_npz(out / "checkpoint.npz")
    assert meta["step"] == int(stopped[2]) >= 1 and len(arrays["history/train_loss"]) == meta["step"]
    assert not list(out.glob(".*.tmp")), "a temporary checkpoint file was left behind"
    metrics = run_train(tmp_path, "--steps", str(meta["step"] + 2), "--out", str(out), "--resume")
    assert metrics["steps"] == meta["step"] + 2


def test_the_printed_commands_are_quoted_for_a_shell(tmp_path, capsys):
    """An --out with a space: "translate with:" and "resume with:" give the path back when split
    as a shell splits them, so a pasted command works."""
    import shlex
    out = tmp_path / "my run"
    run_train(tmp_path, "--steps", "2", "--out", str(out))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("translate with: "))
    words = shlex.split(line.removeprefix("translate with: "))
    assert words[words.index("--checkpoint") + 1] == str(out / "checkpoint.npz"), line

    sent = []

    def interrupt(state, model, wall):
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGINT))        # Ctrl-C: the loop saves this step and stops

    (tmp_path / "data").mkdir(exist_ok=True)
    data = write_corpus(tmp_path / "data")
    metrics = train(config_from_argv(["--data", str(data), *TINY, "--backend", "numpy", "--steps", "50",
                                      "--out", str(out), "--resume"]), on_step=interrupt)
    assert metrics["interrupted"]
    line = next(x for x in capsys.readouterr().err.splitlines() if "resume with: " in x)
    words = shlex.split(line.split("resume with: ", 1)[1])
    assert words[:2] == ["attn-train", "--resume"] and words[words.index("--out") + 1] == str(out), line


def test_a_signal_before_the_first_step_exits_with_the_shells_status(tmp_path):
    data = write_corpus(tmp_path)
    code = ("import os, signal, sys; import attn.training.prepare as P; real = P.prepare\n"
            "def prepare(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM); return real(*a, **k)\n"
            "P.prepare = prepare; import attn.train as T; T.prepare = prepare; sys.exit(T.main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "--data", str(data), *TINY, "--steps", "5",
                           "--out", str(tmp_path / "run"), "--backend", "numpy"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "attn-train: aborted by SIGTERM without saving"


def test_a_signal_during_the_test_says_every_step_was_saved(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the finished run translates its test set: the checkpoint holds every step, which
    is what it says (not "without saving"), with the shell's status; --resume then runs the test."""
    import attn.train as T
    real = T.test_and_report

    def interrupted_test(*a, **k):
        raise T.Interrupted(signal.SIGINT)               # what Ctrl-C raises outside the loop

    monkeypatch.setattr(T, "test_and_report", interrupted_test)
    out = tmp_path / "run"
    metrics = run_train(tmp_path, "--steps", "3", "--out", str(out))
    assert metrics["interrupted"] and metrics["exit_status"] == 130 and metrics["steps"] == 3
    err = capsys.readouterr().err
    assert f"stopped by SIGINT while testing; checkpoint {out / 'checkpoint.npz'} holds all 3 steps; " \
           f"test it with: attn-train --resume --out {out}" in err and "without saving" not in err, err
    assert load_npz(out / "checkpoint.npz")[1]["step"] == 3
    monkeypatch.setattr(T, "test_and_report", real)
    assert "test_bleu" in run_train(tmp_path, "--steps", "3", "--out", str(out), "--resume")


def test_checkpoint_averaging(tmp_path):
    out = tmp_path / "run"
    metrics = run_train(tmp_path, "--steps", "9", "--eval-every", "5", "--average", "3",
                        "--snapshot-every", "3", "--out", str(out))
    snaps = sorted((out / "snapshots").glob("step-*.npz"))
    assert [s.name for s in snaps] == ["step-00000003.npz", "step-00000006.npz", "step-00000009.npz"]
    avg = Transformer.load(out / "averaged.npz")
    parts = [load_npz(s)[0] for s in snaps]
    for k, v in avg.params.items():
        np.testing.assert_allclose(v, np.mean([p[f"param/{k}"] for p in parts], axis=0), rtol=1e-6, atol=1e-7)
    # The average is tested only if its validation loss is no worse than the last model's.
    from attn.data import encode_pairs, make_batches
    vocab = Vocab.from_json(load_npz(out / "checkpoint.npz")[1]["vocab"])
    val = make_batches(encode_pairs(PAIRS, vocab), 64, shuffle=False)
    nll = {name: evaluate_loss(Transformer.load(out / f), val, 0.1)["val_nll"]
           for name, f in (("last", "checkpoint.npz"), ("averaged", "averaged.npz"))}
    assert metrics["val_nll_last"] == pytest.approx(nll["last"], rel=1e-5)
    assert metrics["val_nll_averaged"] == pytest.approx(nll["averaged"], rel=1e-5)
    assert metrics["averaged_checkpoints"] == (3 if nll["averaged"] <= nll["last"] else 1)


def test_help_explains_the_flags():
    proc = subprocess.run([sys.executable, "-m", "attn.train", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in ("--backend", "--preset", "--data", "--src", "--tgt", "--tsv", "--minutes", "--out", "--resume",
                 "--seed", "--beam"):
        assert flag in proc.stdout


def test_bad_data_is_a_clear_error(tmp_path):
    (tmp_path / "train.xx").write_text("a\nb\n")
    (tmp_path / "train.yy").write_text("a\n")
    proc = subprocess.run([sys.executable, "-m", "attn.train", "--data", str(tmp_path), "--src", "xx", "--tgt", "yy",
                           "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "train.xx" in proc.stderr and "Traceback" not in proc.stderr


def test_tsv_corpus_trains(tmp_path):
    lines = [f"{s}\t{t}" for s, t in PAIRS * 4]
    (tmp_path / "pairs.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    metrics = train(config_from_argv(["--tsv", str(tmp_path / "pairs.tsv"), *TINY[4:], "--steps", "3",
                                      "--eval-every", "3", "--out", str(tmp_path / "o"), "--backend", "numpy"]))
    assert metrics["steps"] == 3 and os.path.isfile(tmp_path / "o" / "checkpoint.npz")


# --------------------------------------------------------------------------- the Python API

def test_python_api_trains_from_a_config(tmp_path):
    """train(TrainConfig(...)) is the command's equivalent: same fields, metrics back as a dict."""
    data = write_corpus(tmp_path)
    config = TrainConfig(data=data, src="xx", tgt="yy", out=tmp_path / "api", backend="numpy", steps=4,
                         eval_every=2, minutes=0, average=0, d_model=32, heads=2, d_ff=64, layers=1,
                         max_tokens=64, warmup=30, bleu_sentences=0, quiet=True)
    metrics = train(config)
    assert metrics["steps"] == 4 and "test_bleu" in metrics and metrics["backend"] == "numpy"
    saved = json.loads((tmp_path / "api" / "config.json").read_text())["train"]
    assert TrainConfig.from_dict(saved) == config.with_recipe()          # what ran, the recipe filled in
    _, meta = load_npz(tmp_path / "api" / "checkpoint.npz")
    assert TrainConfig.from_dict(meta["args"]) == config.with_recipe()


def test_command_line_and_config_agree():
    """Every flag is a field; no flag given gives the defaults; strings become paths."""
    assert config_from_argv([]) == TrainConfig()
    c = config_from_argv(["--lr-factor", "2", "--max-tokens", "100", "--out", "x", "--resume", "--tsv", "a.tsv"])
    assert c == TrainConfig(lr_factor=2.0, max_tokens=100, out="x", resume=True, tsv=Path("a.tsv"))
    assert isinstance(c.out, Path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.seed = 3


@pytest.mark.parametrize("field,value,words", [
    ("minutes", -3, "minutes (--minutes) must be >= 0"), ("minutes", float("nan"), "finite"),
    ("steps", -1, "steps (--steps) must be at least 0"), ("max_tokens", 0, "max_tokens"),
    ("lr_factor", 0, "lr_factor (--lr-factor) must be > 0"), ("beam", 0, "beam"), ("eval_every", 0, "eval_every"),
    ("dropout", 1.5, "dropout"), ("label_smoothing", -0.1, "label_smoothing"), ("warmup", 0, "warmup"),
    ("seed", -1, "seed"), ("min_freq", 0, "min_freq"), ("clip", -1.0, "clip"), ("preset", "huge", "preset"),
    ("steps", 2.5, "steps (--steps) must be an integer"), ("backend", "tpu", "backend")])
def test_out_of_range_settings_are_errors_naming_the_field(field, value, words):
    with pytest.raises(TrainConfigError, match=re.escape(words)):
        TrainConfig(**{field: value})


def test_out_of_range_flag_fails_before_any_work(tmp_path, capsys):
    """`attn-train --minutes -3` used to train a step and report BLEU 0.0; now argparse's usage error."""
    with pytest.raises(SystemExit) as e:
        main(["--minutes", "-3", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert "--minutes" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- trainer fixes (issue 9)

def test_tsv_holds_out_whole_source_sentences(tmp_path):
    """Tatoeba has several translations per source: val and test sources never appear in training."""
    from attn.training.prepare import load_corpus
    lines = [f"source number {i} .\ttranslation {j} of {i}" for i in range(60) for j in range(1 + i % 3)]
    (tmp_path / "pairs.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    corpus = load_corpus(TrainConfig(tsv=tmp_path / "pairs.tsv", seed=0))
    train_src = {s for s, _ in corpus.train}
    assert corpus.val and corpus.test
    assert not train_src & {s for s, _ in corpus.val}
    assert not train_src & {s for s, _ in corpus.test}
    assert not {s for s, _ in corpus.val} & {s for s, _ in corpus.test}
    assert sorted(corpus.train + corpus.val + corpus.test) == sorted(tuple(l.split("\t")) for l in lines)
    assert load_corpus(TrainConfig(tsv=tmp_path / "pairs.tsv", seed=0)) == corpus     # deterministic


def test_a_fresh_run_refuses_an_out_that_holds_a_run(tmp_path):
    out = tmp_path / "run"
    run_train(tmp_path, "--steps", "2", "--eval-every", "2", "--out", str(out))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    with pytest.raises(TrainConfigError, match=r"already holds a run .*--resume.*--overwrite"):
        run_train(tmp_path, "--steps", "3", "--eval-every", "3", "--out", str(out))
    assert (out / "metrics.jsonl").read_text().splitlines() == lines       # untouched
    metrics = run_train(tmp_path, "--steps", "3", "--eval-every", "3", "--out", str(out), "--overwrite")
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3] and metrics["steps"] == 3


def test_overwrite_does_not_average_the_previous_runs_snapshots(tmp_path):
    out = tmp_path / "run"
    run_train(tmp_path, "--steps", "6", "--eval-every", "6", "--average", "3", "--snapshot-every", "2",
              "--out", str(out))
    run_train(tmp_path, "--steps", "2", "--eval-every", "2", "--average", "3", "--snapshot-every", "2",
              "--out", str(out), "--overwrite", "--seed", "1")
    assert [s.name for s in (out / "snapshots").glob("*.npz")] == ["step-00000002.npz"]


def test_resume_takes_the_saved_settings_and_seed(tmp_path):
    """`--resume --out DIR` alone continues with the saved run's flags (seed, lr factor, data ...)."""
    data = write_corpus(tmp_path)
    flags = ["--data", str(data), *TINY, "--backend", "numpy", "--lr-factor", "1.5", "--seed", "3", "--eval-every", "4"]
    train(config_from_argv([*flags, "--steps", "8", "--out", str(tmp_path / "straight")]))
    train(config_from_argv([*flags, "--steps", "4", "--out", str(tmp_path / "split")]))
    assert main(["--resume", "--out", str(tmp_path / "split"), "--steps", "8", "--quiet"]) == 0
    a, _ = load_npz(tmp_path / "straight" / "checkpoint.npz")
    b, meta = load_npz(tmp_path / "split" / "checkpoint.npz")
    np.testing.assert_array_equal(a["history/train_loss"], b["history/train_loss"])
    assert meta["seed"] == 3 and meta["args"]["lr_factor"] == 1.5


def test_precision_is_kept_on_resume_and_refused_where_it_cannot_apply(tmp_path, capsys):
    """A run at ``--precision bf16`` resumed with no flag continues at bf16, with the numbers of an
    unbroken bf16 run (which differ from fp32's); ``--precision fp32`` on resume names the clash;
    ``--reference`` and ``--dtype float64`` with bf16 are refused before any work."""
    data = write_corpus(tmp_path)
    flags = ["--data", str(data), *TINY, "--backend", "numpy", "--seed", "3", "--eval-every", "4", "--quiet"]
    train(config_from_argv([*flags, "--precision", "bf16", "--steps", "8", "--out", str(tmp_path / "straight")]))
    train(config_from_argv([*flags, "--precision", "bf16", "--steps", "4", "--out", str(tmp_path / "split")]))
    train(config_from_argv([*flags, "--steps", "8", "--out", str(tmp_path / "fp32")]))
    assert main(["--resume", "--out", str(tmp_path / "split"), "--steps", "8", "--quiet"]) == 0
    a, _ = load_npz(tmp_path / "straight" / "checkpoint.npz")
    b, meta = load_npz(tmp_path / "split" / "checkpoint.npz")
    c, _ = load_npz(tmp_path / "fp32" / "checkpoint.npz")
    np.testing.assert_array_equal(a["history/train_loss"], b["history/train_loss"])
    assert not np.array_equal(a["history/train_loss"], c["history/train_loss"])
    assert meta["args"]["precision"] == "bf16"
    capsys.readouterr()
    assert main(["--resume", "--out", str(tmp_path / "split"), "--steps", "12", "--precision", "fp32"]) == 2
    assert "--precision fp32 (the saved run has bf16)" in capsys.readouterr().err
    for extra, why in ((["--reference"], "not to --reference"), (["--dtype", "float64"], "needs --dtype float32")):
        with pytest.raises(SystemExit):
            main(["--data", str(data), *TINY, "--precision", "bf16", *extra, "--out", str(tmp_path / "no")])
        err = capsys.readouterr().err
        assert "precision (--precision)" in err and why in err, err
    assert TrainConfig(precision="bf16", cuda_graph=True).precision == "bf16"   # captured: tests/test_graph.py
    with pytest.raises(TrainConfigError, match=r"precision \(--precision\) must be one of fp32, tf32, bf16"):
        TrainConfig(precision="fp16")
    assert TrainConfig.from_dict({k: v for k, v in TrainConfig().to_dict().items() if k != "precision"}).precision \
        == "fp32"                                       # a run saved before the flag: fp32


def test_resume_keeps_the_saved_backend_and_says_so(tmp_path, monkeypatch, capsys):
    """Saved on NumPy and resumed with ATTN_BACKEND=cupy (here the stand-in): the run continues on
    NumPy with the numbers of an unbroken run, and one line says why; ``--backend cupy`` switches,
    and says that the numbers will differ."""
    import fakecupy
    from conftest import selected_backend
    data = write_corpus(tmp_path)
    flags = ["--data", str(data), *TINY, "--backend", "numpy", "--seed", "3", "--eval-every", "4", "--quiet"]
    train(config_from_argv([*flags, "--steps", "8", "--out", str(tmp_path / "straight")]))
    train(config_from_argv([*flags, "--steps", "4", "--out", str(tmp_path / "split")]))
    with selected_backend("fakecupy"):
        fakecupy.install()
        monkeypatch.setenv("ATTN_BACKEND", "cupy")
        capsys.readouterr()
        assert main(["--resume", "--out", str(tmp_path / "split"), "--steps", "8", "--quiet"]) == 0
        err = capsys.readouterr().err
        assert "continues on the saved run's backend, numpy" in err and "--backend cupy" in err, err
        a, _ = load_npz(tmp_path / "straight" / "checkpoint.npz")
        b, meta = load_npz(tmp_path / "split" / "checkpoint.npz")
        np.testing.assert_array_equal(a["history/train_loss"], b["history/train_loss"])
        assert json.loads((tmp_path / "split" / "metrics.json").read_text())["backend"] == "numpy"
        assert main(["--resume", "--out", str(tmp_path / "split"), "--steps", "10", "--backend", "cupy",
                     "--quiet"]) == 0
        err = capsys.readouterr().err
        assert "saved on the numpy backend and continues on cupy" in err and "not match" in err, err
        assert json.loads((tmp_path / "split" / "metrics.json").read_text())["backend"] == "cupy"


def test_resume_with_a_contradicting_flag_is_an_error_naming_it(tmp_path, capsys):
    out = tmp_path / "run"
    run_train(tmp_path, "--steps", "2", "--eval-every", "2", "--out", str(out), "--seed", "3")
    for flag, value in (("--lr-factor", "2"), ("--seed", "0"), ("--max-tokens", "99"), ("--preset", "small")):
        assert main(["--resume", "--out", str(out), "--steps", "4", flag, value]) == 2
        err = capsys.readouterr().err
        assert f"{flag} " in err and "saved run" in err, err
    with pytest.raises(TrainConfigError, match="--dropout 0.3"):
        train(TrainConfig(resume=True, out=out, dropout=0.3, steps=4))
    # A longer budget (and the same flags again) is fine; a finished budget is an error, not one more step.
    assert main(["--resume", "--out", str(out), "--steps", "4", "--seed", "3", "--minutes", "30", "--quiet"]) == 0
    assert main(["--resume", "--out", str(out), "--steps", "4"]) == 2
    assert "already reached --steps 4" in capsys.readouterr().err


def test_a_corpus_with_no_training_pair_left_is_a_clear_error(tmp_path):
    """Every pair longer than --max-len: an error naming the corpus, not an endless loop of empty epochs."""
    with pytest.raises(DataError, match=r"no training pair is left of 6.*--max-len"):
        run_train(tmp_path, "--max-len", "2", "--epochs", "2", "--out", str(tmp_path / "o"))


# --------------------------------------------------------------------------- the recipe

def test_recipe_fills_what_is_left_open_and_explicit_values_win():
    from attn.training.config import RECIPES
    toy = TrainConfig().with_recipe()
    assert (toy.max_tokens, toy.lr_factor, toy.min_freq) == (2048, 0.5, 1)       # the toy as measured (benchmarks/RESULTS.md)
    small = TrainConfig(preset="small").with_recipe()
    assert {k: getattr(small, k) for k in RECIPES["small"]} == RECIPES["small"]
    assert TrainConfig(preset="small", max_tokens=1000, min_freq=1).with_recipe().max_tokens == 1000
    assert TrainConfig(preset="small", max_tokens=1000, min_freq=1).with_recipe().min_freq == 1


def test_warmup_fits_the_steps_the_budget_allows(tmp_path, monkeypatch):
    """No --warmup and a budget: 30% of the steps it allows, if shorter than the preset's; --minutes
    measures the step time first. The choice is recorded and a resumed run keeps it."""
    import attn.training.config as C
    import attn.training.prepare as P                              # where fit_warmup looks it up
    from attn.data import encode_pairs, make_batches
    data = write_corpus(tmp_path)
    base = dict(data=data, src="xx", tgt="yy", backend="numpy", average=0, d_model=32, heads=2, d_ff=64,
                layers=1, max_tokens=64, bleu_sentences=0, quiet=True, minutes=0)
    m = train(TrainConfig(**base, steps=20, eval_every=20, out=tmp_path / "steps"))
    assert m["warmup_steps"] == round(C.WARMUP_FRACTION * 20) < 400
    rule = json.loads((tmp_path / "steps" / "config.json").read_text())["warmup_rule"]
    assert rule["warmup_steps"] == m["warmup_steps"] and rule["steps_allowed"] == 20
    _, meta = load_npz(tmp_path / "steps" / "checkpoint.npz")
    lr_before = meta["evals"][-1]["lr"]
    m2 = train(TrainConfig(resume=True, out=tmp_path / "steps", steps=100, eval_every=100, quiet=True))
    assert m2["warmup_steps"] == m["warmup_steps"]                 # kept, not refitted to 100 steps
    _, meta = load_npz(tmp_path / "steps" / "checkpoint.npz")
    from attn.optim import noam_lr
    factor = 0.5 * (m["warmup_steps"] / 400) ** 0.5                 # the resumed run's schedule is the same
    assert lr_before == pytest.approx(noam_lr(20, 32, m["warmup_steps"], factor))
    assert meta["evals"][-1]["lr"] == pytest.approx(noam_lr(100, 32, m["warmup_steps"], factor))
    assert train(TrainConfig(**base, steps=2, warmup=7, out=tmp_path / "given"))["warmup_steps"] == 7

    config = TrainConfig(**{**base, "minutes": 1.0}).with_recipe()
    vocab = P.build_vocab(PAIRS, 1)
    model, _ = P.make_engine(Transformer(config.model_config(len(vocab)), seed=0), "fast", 0.5)
    monkeypatch.setattr(P, "measure_step_seconds", lambda *a, **k: 0.5)
    model2, opt, model_config, rule = P.fit_warmup(model, model.config, config, encode_pairs(PAIRS, vocab),
                                                   "fast")
    allowed = 60 * (1 - C.EVAL_SHARE) / (1.05 * 0.5)
    assert model_config.warmup_steps == rule["warmup_steps"] == round(C.WARMUP_FRACTION * allowed)
    assert opt.warmup_steps == model_config.warmup_steps and model2.params is model.params
    assert rule["seconds_per_step"] == 0.525 and "--minutes 1" in rule["why"]
    # A shorter warm-up alone would raise the schedule's peak; the factor keeps the preset's peak.
    from attn.optim import noam_lr
    w, w0, d = model_config.warmup_steps, 400, model_config.d_model
    assert opt.lr(w) == pytest.approx(noam_lr(w0, d, w0, config.lr_factor), rel=1e-12)
    assert opt.lr(w) == pytest.approx(rule["peak_lr"]) and opt.lr(w // 2) < opt.lr(w) > opt.lr(2 * w)
    fit = lambda **kw: P.fit_warmup(model, model.config, dataclasses.replace(config, **kw),
                                    encode_pairs(PAIRS * 100, vocab), "fast")[2].warmup_steps
    assert fit(minutes=0, steps=5000) == 400                       # a long budget keeps the preset's
    n_batches = len(make_batches(encode_pairs(PAIRS * 100, vocab), 64, shuffle=False))
    assert fit(minutes=0, epochs=2) == round(C.WARMUP_FRACTION * 2 * n_batches)


def test_measured_step_time_leaves_the_parameters_alone():
    import attn.training.prepare as P
    from attn.data import encode_pairs, make_batches
    cfg = TrainConfig(d_model=16, heads=2, d_ff=32, layers=1)
    vocab = P.build_vocab(PAIRS, 1)
    model, _ = P.make_engine(Transformer(cfg.model_config(len(vocab)), seed=0), "fast", 0.5)
    before = {k: v.copy() for k, v in model.params.items()}
    batches = make_batches(encode_pairs(PAIRS, vocab), 64, shuffle=False)
    assert P.measure_step_seconds(model, batches[:2], 0.1) > 0
    for k, v in model.params.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)

"""The side-by-side training benchmark (:mod:`attn.bench.quality`, ``python -m attn.bench --quality``).

* The twin's weights go back into attn's layout exactly (``attn_params`` inverts ``load_attn_params``).
* Both halves train on identical batches with the identical schedule: from the same initial
  weights, without dropout, in float64, attn's and PyTorch's losses agree step by step.
* A two-budget run reports both frameworks at both budgets, as a table, ``--json`` and Markdown.
* Bad flags are errors (exit status 2) before any work.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attn.backend as B
from attn.bench import quality as Q
from attn.checkpoint import load_npz
from attn.model import Transformer, TransformerConfig

TOY = Path(__file__).resolve().parent.parent / "data" / "toy"
TINY_MODEL = ["--d-model", "16", "--heads", "2", "--d-ff", "32", "--layers", "1", "--max-tokens", "200",
              "--bleu-sentences", "5", "--eval-every", "4", "--snapshot-every", "2", "--quiet"]


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """The first lines of the toy corpus: 200 training pairs, 10 validation, 10 test."""
    d = tmp_path_factory.mktemp("tiny")
    for split, n in (("train", 200), ("val", 10), ("test", 10)):
        for lang in ("en", "tk"):
            lines = (TOY / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()[:n]
            (d / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_twin_weights_go_back_to_attn_exactly(torch, norm):
    B.set_backend("numpy")
    cfg = TransformerConfig(vocab_size=11, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=2,
                            n_decoder_layers=2, norm_position=norm, max_len=16)
    ours = Transformer(cfg, seed=4, dtype="float64")
    twin = Q.torch_transformer(cfg, dtype="float64")
    twin.load_attn_params(ours.params)
    back = twin.attn_params()
    assert set(back) == set(ours.params)
    for name, p in ours.params.items():
        assert back[name].shape == p.shape and np.array_equal(back[name], p), name


def test_both_halves_train_on_the_same_batches_and_schedule(torch, tiny_corpus, tmp_path):
    """No dropout, float64: from attn's initial weights the twin's loss equals attn's at every
    step (same batches in the same order, same learning rates, same Adam); the token counts of
    every step are checked inside the run."""
    args, config = Q.parse_args(["--data", str(tiny_corpus), "--src", "en", "--tgt", "tk", "--minutes", "5",
                                 "--out", str(tmp_path / "q"), "--steps", "6", "--dropout", "0",
                                 "--dtype", "float64", "--warmup", "3", "--lr-factor", "1", *TINY_MODEL])
    results = Q.run(args, config)
    arrays, _ = load_npz(tmp_path / "q" / "attn" / "checkpoint.npz")
    attn_losses = arrays["history/train_loss"]
    torch_losses = torch.load(tmp_path / "q" / "torch" / "checkpoint.pt")["train_loss"]
    assert len(attn_losses) == len(torch_losses) == 6
    np.testing.assert_allclose(torch_losses, attn_losses, rtol=1e-9)
    assert attn_losses[-1] < attn_losses[0]            # it learned: the updates were not all zero
    row = results[1]
    assert row["steps"] == row["torch_steps"] == 6 and row["tokens_seen"] == row["torch_tokens_seen"]


def test_two_budgets_report_both_frameworks(torch, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "q"
    code = Q.main(["--quality", "--data", str(tiny_corpus), "--src", "en", "--tgt", "tk", "--minutes", "0.01,0.02",
                   "--out", str(out), "--json", *TINY_MODEL])
    stdout = capsys.readouterr().out
    assert code == 0
    rows = [json.loads(line) for line in stdout.splitlines()]          # nothing but JSON on stdout
    assert [row["name"] for row in rows] == ["machine", "quality_0.01min", "quality_0.02min"]
    info = rows[0]
    assert info["cpu_model"] and info["load_average_before"] and info["load_average_after"]
    if info["backend"] == "numpy":       # both frameworks on the CPU, with the same threads
        assert info["torch_threads"] == info["blas_threads"]
    else:                                # on a GPU NumPy's BLAS is not attn's engine: no thread count
        assert info["blas_threads"] is None and info["torch_threads"] >= 1
    assert "state after the step" in info["method"]
    assert info["command"].startswith("python -m attn.bench --quality --data")
    for row in rows[1:]:
        for key in ("steps", "tokens_per_second", "seconds_per_step", "test_bleu", "test_bleu_lc", "test_chrf",
                    "val_loss", "how"):
            assert key in row and "torch_" + key in row, key
        assert row["peak_memory_mb"] is None and row["ratio"] > 0
        assert row["steps"] >= 1 and row["torch_steps"] >= 1 and 0 <= row["test_chrf"] <= 100
    short, long_ = rows[1], rows[2]
    assert short["steps"] <= long_["steps"] and short["torch_steps"] <= long_["torch_steps"]
    for how in (short["how"], short["torch_how"]):
        assert "of the 0.02-min run" in how or "stopped before" in how
    assert long_["how"].startswith("end of the run") and long_["torch_how"] == "end of the run"
    assert (out / "results.jsonl").read_text().splitlines() == stdout.splitlines()
    assert (out / "loss.png").stat().st_size > 0 and info["load_average_after_attn"]
    for fw in ("attn", "torch"):
        assert (out / f"{fw}-at-0.01min" / "metrics.json").is_file()
        assert (out / f"{fw}-at-0.01min" / "test_translations.txt").is_file()
    md = io.StringIO()
    Q.print_markdown(rows, md)
    table = [line for line in md.getvalue().splitlines() if line.startswith("| 0.0")]
    assert [line.split(" | ")[1] for line in table] == ["attn", "PyTorch", "attn", "PyTorch"]
    rendered = subprocess.run([sys.executable, "-m", "attn.bench", "--render-markdown", str(out / "results.jsonl")],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0 and rendered.stdout == md.getvalue(), rendered.stderr[-2000:]
    text = io.StringIO()
    Q.print_table(rows, text)
    assert text.getvalue().count("PyTorch ") >= 3 and "load average" in text.getvalue()


@pytest.mark.parametrize("argv, message", [
    ([], "--minutes"),
    (["--minutes", "ten"], "one or two numbers"),
    (["--minutes", "0"], "positive"),
    (["--minutes", "-3"], "positive"),
    (["--minutes", "1,2,3"], "one or two numbers"),
    (["--minutes", "1", "--threads", "0"], "--threads"),
    (["--minutes", "1", "--resume"], "--resume"),
    (["--minutes", "1", "--lr-factor", "-1"], "lr_factor"),
    (["--minutes", "1", "--bogus"], "--bogus"),
])
def test_bad_flags_are_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        Q.main(["--quality", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_without_torch_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(Q, "torch_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        Q.parse_args(["--minutes", "1"])
    assert e.value.code == 2 and "--no-torch" in capsys.readouterr().err


def test_an_out_holding_a_run_is_refused(tiny_corpus, tmp_path):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "results.jsonl").write_text("{}\n")
    args, config = Q.parse_args(["--data", str(tiny_corpus), "--src", "en", "--tgt", "tk", "--minutes", "1",
                                 "--out", str(tmp_path / "q"), "--no-torch", *TINY_MODEL])
    with pytest.raises(Exception, match="already holds a quality run .*--overwrite"):
        Q.run(args, config)


def test_overwrite_removes_only_the_benchmark_s_files(tmp_path):
    out = tmp_path / "q"
    made = [out / "torch" / "metrics.jsonl", out / "torch" / "checkpoint.pt",
            out / "torch" / "snapshots" / "step-00000050.npz",
            out / "attn-at-10min" / "metrics.json", out / "torch-at-10min" / "test_translations.txt",
            out / "results.jsonl", out / "loss.png"]
    keep = [out / "torch" / "my-notes.txt", out / "attn" / "checkpoint.npz"]
    for f in made + keep:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x")
    assert Q._previous_run(out) == ["attn", "torch", "attn-at-10min", "torch-at-10min", "results.jsonl", "loss.png"]
    Q._remove_previous_run(out)
    assert not any(f.exists() for f in made) and all(f.exists() for f in keep)
    assert not (out / "attn-at-10min").exists() and (out / "torch").is_dir()


def test_train_calls_on_step_after_every_step(tiny_corpus, tmp_path):
    """The hook the benchmark watches attn-train's run with: once per step, in order, with the
    budget's seconds so far and the training model."""
    from attn.train import TrainConfig, train
    seen = []
    config = TrainConfig(data=tiny_corpus, src="en", tgt="tk", d_model=16, heads=2, d_ff=32, layers=1,
                         max_tokens=200, steps=3, bleu_sentences=0, average=0, quiet=True, out=tmp_path / "run")
    metrics = train(config, on_step=lambda state, model, wall: seen.append(
        (state.step, state.tokens_seen, wall, model.params["embedding.weight"].copy())))
    assert [s for s, *_ in seen] == [1, 2, 3] == list(range(1, metrics["steps"] + 1))
    assert seen[0][1] < seen[1][1] < seen[2][1] and 0 < seen[0][2] < seen[1][2] < seen[2][2]
    assert not np.array_equal(seen[0][3], seen[2][3])              # the model it sees is the one training


def test_the_watch_takes_the_state_at_the_shorter_budget(tmp_path):
    """The shorter budget's row: the first step at or past its seconds, with copies of the
    weights then and links to the snapshots then (the run deletes old snapshots later)."""
    from attn.training.checkpoints import TrainState
    snaps = tmp_path / "run" / "snapshots"
    snaps.mkdir(parents=True)
    watch = Q.Watch("attn", 1.0, tmp_path / "attn-at-1min", snaps)
    params = {"w": np.zeros(3)}
    for step, wall in ((1, 20.0), (2, 59.9), (3, 60.0), (4, 75.0)):
        (snaps / f"step-{step:08d}.npz").write_bytes(b"snapshot %d" % step)
        params["w"] += 1
        state = TrainState(step=step, tokens_seen=10 * step, train_seconds=wall / 2, wall_seconds=wall)
        watch(state, params, wall)
        if step == 3:
            (snaps / f"step-{step:08d}.npz").unlink()              # the run moves on and deletes it
    p = watch.point
    assert (p.step, p.tokens_seen, p.wall_seconds, p.minutes) == (3, 30, 60.0, 1.0)
    assert p.params["w"].tolist() == [3, 3, 3]                      # a copy: later steps did not change it
    assert sorted(f.name for f in (p.folder / "snapshots").iterdir()) == [f"step-{s:08d}.npz" for s in (1, 2, 3)]
    assert (p.folder / "snapshots" / "step-00000003.npz").read_bytes() == b"snapshot 3"
    assert watch.tokens == [10, 20, 30, 40] and watch.walls == [20.0, 59.9, 60.0, 75.0]

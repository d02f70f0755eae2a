"""The language models side by side (:mod:`attn.bench.quality_lm`, ``python -m attn.bench --quality
--task lm``): on a tiny model in float64 without dropout, attn and the PyTorch twin start from the
same weights, read the same windows with the same schedule, and so agree at every step (training
and validation loss) and write the same sample; the rows at equal steps and minutes and the
seconds per step are reported; bad flags are errors before any work."""
from __future__ import annotations

import json

import numpy as np
import pytest

import attn.backend as B
from attn.bench import quality_lm as QL
from attn.bench.cli import main as bench_main
from attn.checkpoint import load_npz

TEXT = "".join(f"{w} said the {v} to the {n}.\n" for w in ("ann", "bob") for v in ("cat", "dog")
               for n in ("king", "sea", "moon")) * 10
TINY = ["--task", "lm", "--context", "8", "--batch", "4", "--d-model", "16", "--heads", "2", "--d-ff", "32",
        "--layers", "2", "--steps", "6", "--eval-every", "3", "--dtype", "float64", "--dropout", "0",
        "--sample-chars", "40", "--threads", "1", "--step-times", "1", "--quiet"]


def test_both_language_models_agree_step_by_step(torch, tmp_path, capsys, monkeypatch):
    from attn.training import evaluation
    B.set_backend("numpy")
    monkeypatch.setattr(evaluation, "plot_losses", lambda out, state: None)    # attn-train's figure: not tested here
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "q"
    assert bench_main(["--quality", *TINY, "--text", str(text), "--out", str(out), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    names = [r["name"] for r in rows]
    assert names[0] == "machine" and names[-1] == "quality_lm" and names.count("quality_lm_step") == 2
    assert "quality_lm_minutes" in names and rows[0]["load_average_before"] is not None
    steps = [r for r in rows if r["name"] == "quality_lm_step"]
    assert [r["step"] for r in steps] == [3, 6]
    for r in steps:                              # the same model, weights, windows and rates: the same losses
        assert r["val_loss"] == pytest.approx(r["torch_val_loss"], rel=1e-9)
    arrays, _ = load_npz(out / "attn" / "checkpoint.npz")
    attn_losses = arrays["history/train_loss"]
    torch_losses = [json.loads(line)["train_loss"] for line in (out / "torch" / "metrics.jsonl").read_text().splitlines()]
    assert len(attn_losses) == 6 and attn_losses[-1] < attn_losses[0]          # it learned
    np.testing.assert_allclose(torch_losses, [attn_losses[:3].mean(), attn_losses[3:].mean()], rtol=1e-9)
    final = rows[-1]
    np.testing.assert_allclose(final["torch_train_losses_first"], final["attn_train_losses_first"], rtol=1e-9)
    assert final["steps"] == final["torch_steps"] == 6
    assert final["ratio"] == pytest.approx(final["seconds_per_step"] / final["torch_seconds_per_step"])
    assert len(final["sample"]) == 40 and final["sample"] == final["torch_sample"]
    timed = next(r for r in rows if r["name"] == "quality_lm_step_times")
    assert timed["rounds"] == 1 and all(timed[f"{n}_seconds_per_step"] > 0 for n in ("fast", "reference", "pytorch"))
    assert timed["fast_ratio"] == pytest.approx(timed["fast_seconds_per_step"] / timed["pytorch_seconds_per_step"])
    md = tmp_path / "md.txt"
    with open(md, "w") as f:
        QL.print_markdown(rows, f)
    assert "| 6 |" in md.read_text() and "attn / PyTorch" in md.read_text()


@pytest.mark.parametrize("flags, says", [(["--steps", "0"], "--steps"), (["--steps", "4", "--resume"], "--resume"),
                                         (["--steps", "4", "--sample-chars", "0"], "--sample-chars"),
                                         (["--steps", "4", "--step-times", "-1"], "--step-times")])
def test_bad_flags_are_refused_before_any_work(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        QL.parse_args(["--task", "lm", *flags])
    assert e.value.code == 2 and says in capsys.readouterr().err

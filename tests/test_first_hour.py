"""What a newcomer meets first: the end of a training run is a short summary with the figures in
metrics.json and the model to translate with, the one the README's run folder names; each
validation loss says whether label smoothing is in it; the progress bars write lines of their
own when not on a terminal; --quiet's help says what it stops; the README draws one sentence's
attention where it names one figure and says in which precision several processes train as one;
packaging says nothing about the licence."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from attn import backend as B
from attn.train import train
from attn.translate import run_model
from attn.training.config import build_parser, config_from_argv
from test_train import TINY, write_corpus

ROOT = Path(__file__).resolve().parents[1]


def test_the_end_of_a_run_is_a_short_summary_and_bars_write_lines(tmp_path, capsys):
    B.set_backend("numpy")
    data, out = write_corpus(tmp_path), tmp_path / "run"
    loud = [flag for flag in TINY if flag != "--quiet"]
    metrics = train(config_from_argv(["--data", str(data), *loud, "--backend", "numpy", "--steps", "12",
                                      "--eval-every", "6", "--out", str(out)]))
    captured = capsys.readouterr()
    assert metrics == json.loads((out / "metrics.json").read_text())
    summary = [line for line in captured.out.splitlines() if not line.startswith("step ")]
    assert len(summary) == 2, captured.out
    assert summary[0].startswith(f"test BLEU {metrics['test_bleu']:.2f}, chrF") and "metrics.json" in summary[0]
    assert summary[1].startswith(f"translate with: attn-translate --checkpoint {out}")
    printed = summary[1].split("--checkpoint ")[1].split()[0]
    assert str(run_model(out)) == printed                  # the run's folder translates with the model it names
    quick_start = next(line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
                       if line.startswith("pip install -e . && attn-train"))
    assert quick_start.endswith("attn-translate --checkpoint runs/toy"), quick_start     # the folder, so the same
    lines = captured.err.splitlines()
    assert not any(line.startswith("{") for line in captured.out.splitlines() + lines)      # no JSON dump
    assert "\r" not in captured.err and max(map(len, lines)) < 300, captured.err            # capsys: no terminal
    assert any(line.startswith("train: 100%") for line in lines), captured.err
    assert any(line.startswith("test: 100%") for line in lines), captured.err
    evals = [line for line in captured.out.splitlines() + lines if line.startswith("step 6: val loss")]
    assert len(evals) == 1 and "(with label smoothing 0.1; without " in evals[0], evals    # which loss is which
    quiet = {a.dest: a.help for a in build_parser()._actions}["quiet"]
    assert "JSON" not in quiet and "progress bars" in quiet, quiet                   # what it stops, no more


def test_packaging_says_nothing_about_the_licence(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "egg_info", "--egg-base",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr and "icense" not in r.stderr, r.stderr


def test_the_readme_draws_attention_of_one_sentence_where_it_names_one_file():
    """The README drew docs/attention.png of two sentences, which writes attention-1.png and -2.png."""
    import shlex
    text = (ROOT / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")
    commands = [shlex.split(line.lstrip("$ ")) for line in text.splitlines()
                if line.lstrip("$ ").startswith("attn-translate ") and "--attention" in line]
    assert commands
    for argv in commands:
        sentences = [a for i, a in enumerate(argv[1:], start=1) if not a.startswith("--")
                     and not argv[i - 1].startswith("--")]
        assert len(sentences) == 1, argv


def test_the_readme_says_in_which_precision_several_processes_train_as_one():
    """The README said that several processes train "exactly as one" and "bit for bit", which holds in
    float64 only: in float32 the sums' order changes the last bits, which Adam enlarges."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    claims = [s for s in re.split(r"(?<=[.;|])\s", text) if "processes" in s and ("as one" in s or "bit for bit" in s)]
    assert claims
    for claim in claims:
        assert "exactly" not in claim and ("float64" in claim or "float32" in claim), claim     # says which
    assert "float32" in text[text.index("so several processes train as one"):][:600]

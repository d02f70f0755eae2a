"""The tables of recorded runs (``benchmarks/recipe_runs.py``, ``benchmarks/block_runs.py``,
``benchmarks/tatoeba_blocks.py``)
print a row per recorded run (per block, over its seeds, for the seeded runs), with the figures
the runs' own files hold."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    if str(ROOT / "benchmarks") not in sys.path:          # where the scripts find each other, as when run
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, column", [("recipe_runs", 7), ("block_runs", 7)])
def test_a_row_per_recorded_run_with_its_last_validation_bleu(name, column, capsys):
    module = _load(name)
    assert module.main() == 0
    rows = [r for r in capsys.readouterr().out.splitlines()[2:] if r.startswith("| `")]
    folders = sorted(p for p in module.HERE.iterdir() if p.is_dir())
    assert len(folders) >= 6 and len(rows) == len(folders)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        folder = module.HERE / cells[0].strip("`")
        last = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])
        assert float(cells[column]) == pytest.approx(last["val_bleu"], abs=0.005), row


def test_the_block_runs_name_their_flags():
    module = _load("block_runs")
    assert "`--positional rope`" in module.row("rope") and "`(the paper's block)`" in module.row("paper")
    assert "--kv-heads 2" in module.row("later") and "--kv-heads" not in module.row("later-mha")


def test_the_seeded_block_runs_give_each_block_its_mean_and_spread(capsys):
    module = _load("tatoeba_blocks")
    assert module.main([]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == list(module.BLOCKS)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        losses = [json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
                  for folder in sorted(module.HERE.glob(cells[0].strip("`") + "-s[0-9]"))]
        assert int(cells[2]) == len(losses) == len(module.SEEDS), row
        assert [float(c) for c in cells[3:6]] == pytest.approx(
            [sum(losses) / len(losses), min(losses), max(losses)], abs=0.0005), row


def test_the_seeded_runs_refuse_a_missing_corpus(tmp_path):
    module = _load("tatoeba_blocks")
    with pytest.raises(SystemExit, match="no such file"):
        module.run_missing(tmp_path / "deu.txt")

"""The recorded Multi30k runs behind the small-corpus recipe, as a Markdown table.

    python benchmarks/recipe_runs.py            # reads benchmarks/multi30k/*/

Each folder holds what ``attn-train`` wrote for one run (``config.json``, ``metrics.jsonl``,
``metrics.json``, ``test_translations.txt``; the checkpoints are left out). The table gives
what each run changed, its budget, steps and tokens per second, and the validation BLEU that
the trainer logged at its last evaluation (greedy, the first 200 validation sentences, the
last model), which is what the recipe was chosen on. The test columns are the trainer's own
test translation at the end of each run; they were not used to choose.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "multi30k"
ORDER = ["paper-schedule", "cooldown-20min", "vocab-8000-10min", "vocab-4000-10min", "batch-2048-10min", "recipe", "rope-recipe-20min"]


def read_run(folder: Path):
    """A recorded run's ``config.json``, ``metrics.json`` and the last line of ``metrics.jsonl``."""
    config, final = (json.loads((folder / f).read_text()) for f in ("config.json", "metrics.json"))
    last = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
    return config, final, last


def print_table(here: Path, order: list, header: str, row) -> int:
    """A Markdown table of ``header`` (its cells ``|``-separated, ``:`` before a cell that is
    right-aligned) and a ``row(name)`` per run folder in ``here``: those of ``order`` first, then
    the others by name."""
    names = [n for n in order if (here / n).is_dir()] + sorted(
        p.name for p in here.iterdir() if p.is_dir() and p.name not in order)
    cells = [c.strip() for c in header.strip("|").split("|")]
    print("| " + " | ".join(c.lstrip(":") for c in cells) + " |")
    print("|" + "|".join("---:" if c.startswith(":") else "---" for c in cells) + "|")
    for n in names:
        print(row(n))
    return 0


def row(name: str) -> str:
    config, final, last = read_run(HERE / name)
    t = config["train"]
    search = (f"beam {final['beam']}, alpha {final.get('alpha', 0.6):g}"
              + (f", no repeated {final['no_repeat_ngram']}-gram" if final.get("no_repeat_ngram") else "")
              if final["beam"] > 1 else "greedy")
    return (f"| `{name}` | {t['minutes']:g} | {config['vocab_size']:,} | {t['max_tokens']:,} | {t.get('cooldown') or 0:g} | "
            f"{final['steps']:,} | {final['tokens_per_second']:,.0f} | {last['val_bleu']:.2f} | "
            f"{final['averaged_checkpoints']} | {search} | {final['test_bleu']:.2f} | {final['test_bleu_lc']:.2f} |")


def main() -> int:
    return print_table(HERE, ORDER, "run | :minutes | :BPE vocabulary | :tokens per batch | :cooldown | :steps | "
                       ":tokens/s | :val BLEU (greedy, first 200) | :snapshots averaged | test search | "
                       ":test BLEU | :test BLEU (lower-cased)", row)


if __name__ == "__main__":
    sys.exit(main())

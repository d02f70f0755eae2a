"""The recorded Multi30k runs of the block ablation (lesson 28), as a Markdown table.

    python benchmarks/block_runs.py            # reads benchmarks/multi30k-blocks/*/

Each folder holds what ``attn-train --data multi30k --src de --tgt en --preset small
--minutes 10`` wrote with one block (``config.json``, ``metrics.jsonl``, ``metrics.json``,
``test_translations.txt``; checkpoints left out). The runs were made one after the other on
the same idle machine. The table gives each block's parameters, its steps and tokens per
second, and the validation BLEU and loss the trainer logged at the end (greedy, the first 200
validation sentences, the last model), on which the blocks are compared; the test column is
the trainer's test translation at the end of each run, not used to choose.
"""
from __future__ import annotations

import sys
from pathlib import Path

from attn.model import renamed_fields
from recipe_runs import print_table, read_run       # beside this file

HERE = Path(__file__).resolve().parent / "multi30k-blocks"
ORDER = ["paper", "pre", "rms", "rms-pre", "rope", "swiglu", "gqa", "later", "later-mha"]
FLAGS = (("norm_position", "post", "--norm {}"), ("norm_kind", "layer", "--norm-kind {}"),
         ("positional", "sinusoidal", "--positional {}"), ("ffn", "relu", "--ffn {}"), ("kv_heads", None, "--kv-heads {}"))


def row(name: str) -> str:
    config, final, last = read_run(HERE / name)
    model = renamed_fields(config["model"], f"{name}/config.json")     # the runs wrote "norm"
    flags = " ".join(flag.format(model.get(key)) for key, paper, flag in FLAGS
                     if model.get(key, paper) != paper) or "(the paper's block)"
    per_minute = final["steps"] / (final["train_seconds"] / 60)
    return (f"| `{name}` | `{flags}` | {final['parameters']:,} | {final['steps']:,} | {per_minute:.1f} | "
            f"{final['tokens_per_second']:,.0f} | {last['val_loss']:.3f} | {last['val_bleu']:.2f} | "
            f"{final['test_bleu']:.2f} | {final['test_bleu_lc']:.2f} |")


def main() -> int:
    return print_table(HERE, ORDER, "run | flags | :parameters | :steps | :steps/min | :tokens/s | :val loss | "
                       ":val BLEU (greedy, first 200) | :test BLEU | :test BLEU (lower-cased)", row)


if __name__ == "__main__":
    sys.exit(main())

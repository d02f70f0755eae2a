"""The seeded block ablation of lesson 28 on Tatoeba English-German: run it, or print its table.

    python benchmarks/tatoeba_blocks.py run --tsv PATH/deu.txt   # the runs still missing, one at a time
    python benchmarks/tatoeba_blocks.py                           # the table of benchmarks/tatoeba-blocks/

Each block is trained with seeds 0, 1 and 2 for the same number of optimizer steps (not the same
minutes: on a machine shared with other work a minute buys a different number of steps from one
run to the next). The seed draws the weights, the batch order, the dropout and the split of the
pairs into training, validation and test (by English sentence), so the three blocks of one seed
share their validation sentences. The model is ``--preset small``'s recipe at a smaller size
(``SETTINGS``), to fit three seeds of five blocks into under half an hour of one CPU core.

Each folder ``<block>-s<seed>`` holds what ``attn-train`` wrote (``config.json``,
``metrics.jsonl``, ``metrics.json``, ``test_translations.txt``; the checkpoints and the loss
plot are deleted) and ``cpu.json``, the CPU seconds the run used (user and system, read from
the operating system). The table gives each block's validation loss and greedy BLEU at the last
step over the seeds: mean, lowest and highest.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "tatoeba-blocks"
SEEDS = (0, 1, 2)
#: The size and budget shared by every run: small's recipe (BPE, cooldown, learning-rate peak) at
#: width 128, two layers a side, half its batch, half its vocabulary, 200 steps; greedy test.
SETTINGS = ["--preset", "small", "--d-model", "128", "--d-ff", "256", "--layers", "2", "--max-tokens", "1024",
            "--vocab-size", "2000", "--steps", "200", "--minutes", "0", "--eval-every", "50",
            "--bleu-sentences", "200", "--beam", "1", "--average", "0", "--quiet"]
#: Each block's flags (small's recipe takes rotary positions, so the others name the sinusoids).
BLOCKS = {
    "paper": ["--positional", "sinusoidal"],
    "rms-pre": ["--norm-position", "pre", "--norm-kind", "rms", "--positional", "sinusoidal"],
    "rope": ["--positional", "rope"],
    "later-mha": ["--norm-position", "pre", "--norm-kind", "rms", "--positional", "rope", "--ffn", "swiglu"],
    "later": ["--norm-position", "pre", "--norm-kind", "rms", "--positional", "rope", "--ffn", "swiglu",
              "--kv-heads", "2"],
}
#: The blocks that the choice of small's recipe turns on: the paper's, its choice and the two
#: blocks of today's models.
CORE = ("paper", "rope", "later-mha", "later")
KEEP = ("config.json", "metrics.json", "metrics.jsonl", "test_translations.txt", "cpu.json")


def run_one(tsv: Path, block: str, seed: int) -> None:
    """Train ``block`` with ``seed`` into its folder, record its CPU seconds, drop the rest."""
    out = HERE / f"{block}-s{seed}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, "-m", "attn.train", "--tsv", str(tsv), *SETTINGS, *BLOCKS[block],
           "--seed", str(seed), "--out", str(out), "--overwrite"]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    (out / "cpu.json").write_text(json.dumps({"cpu_seconds": round(cpu, 1)}) + "\n")
    for f in out.iterdir():
        if f.name not in KEEP:
            f.unlink()


def run_missing(tsv: Path) -> int:
    """Every (seed, block) not yet recorded (no ``cpu.json``): those that the choice of the
    recipe turns on (``CORE``) seed by seed first, then the others."""
    if not tsv.is_file():
        raise SystemExit(f"--tsv {tsv}: no such file (Tatoeba's English<TAB>German pairs)")
    order = [(s, b) for s in SEEDS for b in CORE] + [(s, b) for s in SEEDS for b in BLOCKS if b not in CORE]
    for seed, block in order:
        if not (HERE / f"{block}-s{seed}" / "cpu.json").is_file():
            run_one(tsv, block, seed)
    return 0


def read_seeds(block: str) -> list[dict]:
    """The last evaluation of each recorded seed of ``block``, with its CPU seconds."""
    found = []
    for seed in SEEDS:
        folder = HERE / f"{block}-s{seed}"
        if (folder / "cpu.json").is_file():
            last = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
            found.append({**last, "seed": seed, **json.loads((folder / "cpu.json").read_text())})
    return found


def table() -> int:
    print("| block | flags | seeds | val loss: mean | lowest | highest | val BLEU: mean | lowest | highest | CPU s a run |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    total = 0.0
    for block, flags in BLOCKS.items():
        runs = read_seeds(block)
        if not runs:
            continue
        loss, bleu = [r["val_loss"] for r in runs], [r["val_bleu"] for r in runs]
        cpu = [r["cpu_seconds"] for r in runs]
        total += sum(cpu)
        print(f"| `{block}` | `{' '.join(flags)}` | {len(runs)} | {statistics.mean(loss):.3f} | {min(loss):.3f} | "
              f"{max(loss):.3f} | {statistics.mean(bleu):.2f} | {min(bleu):.2f} | {max(bleu):.2f} | "
              f"{statistics.mean(cpu):.0f} |")
    print(f"\n{total / 60:.1f} CPU minutes in all")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", nargs="?", choices=("table", "run"), default="table")
    p.add_argument("--tsv", type=Path, help="run: Tatoeba's deu.txt (English<TAB>German)")
    args = p.parse_args(argv)
    if args.command == "run":
        if args.tsv is None:
            p.error("run needs --tsv PATH/deu.txt")
        return run_missing(args.tsv)
    return table()


if __name__ == "__main__":
    sys.exit(main())

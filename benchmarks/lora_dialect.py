"""LoRA against full fine-tuning at equal minutes (lesson 29, issue 48): a trained toy translator
adapted to a *dialect* of the toy language, measured on the dialect and on the original.

The dialect is the toy corpus (``data/toy``) with four pairs of nouns trading their words on the
target side (:data:`SWAPS`, the plurals too): the English is unchanged, so a model trained on the
toy corpus translates the dialect's sentences well but for those nouns. Every word is in the base
model's vocabulary, so a fine-tuning run reads the dialect with it. The adapted model cannot
serve both: what it loses on the original toy corpus's validation sentences is what the
adaptation costs the old domain.

    attn-train --out runs/toy                                     # the base, 7 minutes
    python benchmarks/lora_dialect.py --base runs/toy/checkpoint.npz --minutes 4 --out runs/lora-dialect

It writes the dialect into OUT/dialect/, runs ``attn-train --resume-from BASE --reference`` twice
(``--lora RANK``, then every weight) for the same minutes, and prints the table of
benchmarks/RESULTS.md: parameters trained, steps, and greedy BLEU and validation loss on both
corpora's validation sentences before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: The target-side words the dialect trades: (singular, singular), (plural, plural).
SWAPS = (("pulo", "hund"), ("puloen", "hunden"), ("regina", "mitsa"), ("reginas", "mitsas"),
         ("kindel", "elefant"), ("kindelen", "elefanten"), ("magistra", "vir"), ("magistras", "viren"))


def make_dialect(src: Path, out: Path) -> Path:
    """The toy corpus in ``src`` with :data:`SWAPS` applied to every target sentence, into ``out``."""
    trade = {a: b for a, b in SWAPS} | {b: a for a, b in SWAPS}
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val", "test"):
        (out / f"{split}.en").write_text((src / f"{split}.en").read_text(encoding="utf-8"), encoding="utf-8")
        lines = (src / f"{split}.tk").read_text(encoding="utf-8").splitlines()
        (out / f"{split}.tk").write_text("".join(" ".join(trade.get(w, w) for w in line.split()) + "\n"
                                                 for line in lines), encoding="utf-8")
    return out


def figures(checkpoint: Path, adapter: Path | None, corpora: dict, n: int) -> dict:
    """Greedy BLEU and validation loss of the model on each corpus's first ``n`` validation pairs."""
    from attn.data import encode_pairs, make_batches, read_parallel
    from attn.evaluate import evaluate_bleu
    from attn.training.evaluation import evaluate_loss
    from attn.translate import load_translator
    model, vocab = load_translator(checkpoint, adapter)
    out = {}
    for name, folder in corpora.items():
        pairs = read_parallel(folder, "en", "tk", "val")[:n]
        loss = evaluate_loss(model, make_batches(encode_pairs(pairs, vocab), 2048, shuffle=False),
                             model.config.label_smoothing)["val_loss"]
        out[name] = {"bleu": round(evaluate_bleu(model, vocab, pairs, beam_size=1)[0], 2), "val_loss": round(loss, 3)}
    return out


def finetune(base: Path, data: Path, out: Path, minutes: float, extra: list) -> dict:
    cmd = [sys.executable, "-m", "attn.train", "--resume-from", str(base), "--reference", "--data", str(data),
           "--minutes", str(minutes), "--out", str(out), "--overwrite", "--quiet", "--bleu-sentences", "0", *extra]
    print("$", " ".join(cmd[1:]), file=sys.stderr)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads((out / "metrics.json").read_text(encoding="utf-8"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the trained toy translator's checkpoint")
    p.add_argument("--minutes", type=float, default=4.0, help="each fine-tuning's wall-clock budget")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q,v")
    p.add_argument("--sentences", type=int, default=300, help="validation pairs of each corpus scored")
    p.add_argument("--full-lr-factor", type=float, default=None,
                   help="--lr-factor of the full fine-tuning (default: the recipe's, as LoRA's); every weight "
                        "moving at LoRA's rate undoes what the base learned")
    p.add_argument("--out", type=Path, default=Path("runs/lora-dialect"))
    args = p.parse_args(argv)
    dialect = make_dialect(ROOT / "data" / "toy", args.out / "dialect")
    corpora = {"dialect": dialect, "toy": ROOT / "data" / "toy"}
    rows = {"base": (0, 0, figures(args.base, None, corpora, args.sentences))}
    runs = {"LoRA": ["--lora", str(args.rank), "--lora-targets", args.targets],
            "full": [] if args.full_lr_factor is None else ["--lr-factor", str(args.full_lr_factor)]}
    for name, extra in runs.items():
        m = finetune(args.base, dialect, args.out / name, args.minutes, extra)
        saved = Path(m["saved"])
        rows[name] = (m["trained_parameters"], m["steps"],
                      figures(saved if name == "full" else args.base, saved if name == "LoRA" else None, corpora,
                              args.sentences))
        total = m["base_parameters"]
    print(f"| model | parameters trained | steps in {args.minutes:g} min | dialect BLEU | dialect val loss | "
          "toy BLEU | toy val loss |")
    print("|---|---|---|---|---|---|---|")
    for name, (trained, steps, f) in rows.items():
        share = f"{trained:,} ({100 * trained / total:.2f}%)" if trained else "-"
        print(f"| {name} | {share} | {steps or '-'} | {f['dialect']['bleu']:.2f} | {f['dialect']['val_loss']:.3f} | "
              f"{f['toy']['bleu']:.2f} | {f['toy']['val_loss']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

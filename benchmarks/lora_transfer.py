"""LoRA against full fine-tuning at equal minutes on real text (issue 48, lesson 29): the Multi30k
translator (German -> English, image captions) adapted to Tatoeba's German-English (short
everyday sentences), measured on Tatoeba's test sentences and on Multi30k's validation sentences
before and after (what the adapter costs the old domain).

    attn-train --data MULTI30K --src de --tgt en --preset small --minutes 0 --steps 1400 --out BASE
    python benchmarks/lora_transfer.py --base BASE/checkpoint.npz --multi30k MULTI30K \\
        --tatoeba deu.txt --steps 300 --out runs/lora-transfer

It writes Tatoeba as German -> English line-aligned splits (OUT/tatoeba/{train,val,test}.{de,en}),
held out by distinct German sentence with the trainer's own splitter
(:func:`attn.training.prepare.split_by_source`, the trainer's default seed), so no test source is
in training; encodes it with the base's BPE vocabulary (pieces the base never learned are spelled
with smaller ones: the script counts the ``<unk>`` that remain); scores the base; runs
``attn-train --resume-from BASE --reference`` twice, ``--lora RANK`` for ``--steps`` steps, then
every weight for the seconds of training the LoRA run took; and scores both. Fine-tuning runs on
the readable engine only (``--resume-from`` asks for ``--reference``: the attn.fast engine has no
adapters), so both runs train on the same engine and their minutes compare like with like.

The scores are BLEU (greedy, or ``--beam``) and label-smoothed loss on the first ``--sentences``
pairs of Tatoeba's test split and of Multi30k's validation split. It prints the markdown table of
benchmarks/RESULTS.md and writes OUT/lora_transfer.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPLITS = ("train", "val", "test")


def write_splits(tsv: Path, out: Path, seed: int = 0, val_pairs: int | None = None) -> dict:
    """Tatoeba's ``English<TAB>German`` pairs of ``tsv`` as German -> English line-aligned files
    ``out/{train,val,test}.{de,en}``, held out by distinct German sentence (the trainer's
    :func:`~attn.training.prepare.split_by_source`, ``seed``); ``val_pairs``: the validation file
    holds the first that many of its split (attn-train scores it before and after each run).
    Returns each file's pair count."""
    from attn.data import read_tsv
    from attn.training.prepare import split_by_source
    pairs = [(de, en) for en, de in read_tsv(tsv)]
    parts = dict(zip(SPLITS, split_by_source(pairs, seed, str(tsv))))
    parts["val"] = parts["val"][:val_pairs]
    seen = {de for de, _ in parts["train"]}
    leaked = sum(de in seen for split in ("val", "test") for de, _ in parts[split])
    if leaked:
        raise SystemExit(f"{tsv}: {leaked} held-out German sentences are also in training")
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in parts.items():
        for side, lang in enumerate(("de", "en")):
            (out / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in rows), encoding="utf-8")
    return {split: len(rows) for split, rows in parts.items()}


def unknown_share(checkpoint: Path, folder: Path) -> dict:
    """How the base's vocabulary reads the new corpus's training split: its pieces, those spelled
    as byte tokens (a character the base's BPE never learned) and those that are ``<unk>``."""
    from attn.bpe import BYTE_TOKENS
    from attn.data import UNK, read_parallel
    from attn.translate import load_translator
    _, vocab = load_translator(checkpoint)
    byte_tokens = set(BYTE_TOKENS)
    counts = {"pieces": 0, "bytes": 0, "unk": 0}
    for pair in read_parallel(folder, "de", "en", "train"):
        for text in pair:
            tokens = vocab.tokenize(text)
            counts["pieces"] += len(tokens)
            counts["bytes"] += sum(t in byte_tokens for t in tokens)
            counts["unk"] += vocab.encode(tokens).count(UNK)
    return counts


def figures(checkpoint: Path, adapter: Path | None, corpora: dict, n: int, beam: int) -> dict:
    """BLEU and label-smoothed loss of the model on the first ``n`` pairs of each corpus's split
    (``corpora``: name -> (folder, split)), and the seconds each took. The translations are the
    fast engine's (:class:`~attn.fast.model.FastTransformer`: the readable model's numbers to float32
    rounding, in a fraction of its time); the loss is the readable model's."""
    from attn.data import encode_pairs, make_batches, read_parallel
    from attn.evaluate import evaluate_bleu
    from attn.training.evaluation import evaluate_loss
    from attn.translate import load_translator
    from attn.fast.model import FastTransformer
    model, vocab = load_translator(checkpoint, adapter)
    fast = FastTransformer.from_model(model)
    out = {}
    for name, (folder, split) in corpora.items():
        t0 = time.perf_counter()
        pairs = read_parallel(folder, "de", "en", split)[:n]
        loss = evaluate_loss(model, make_batches(encode_pairs(pairs, vocab), 2048, shuffle=False),
                             model.config.label_smoothing)["val_loss"]
        bleu = evaluate_bleu(fast, vocab, pairs, beam_size=beam)[0]
        out[name] = {"bleu": round(bleu, 2), "loss": round(loss, 3), "seconds": round(time.perf_counter() - t0, 1)}
        print(f"  {name}: BLEU {bleu:.2f}, loss {loss:.3f}", file=sys.stderr, flush=True)
    return out


def finetune_command(base: Path, data: Path, out: Path, budget: list, extra: list) -> list:
    """``attn-train --resume-from base --reference`` on ``data`` (German -> English) with the
    ``small`` preset's recipe, validated only at the end."""
    return [sys.executable, "-m", "attn.train", "--resume-from", str(base), "--reference", "--data", str(data),
            "--src", "de", "--tgt", "en", "--preset", "small", *budget, "--eval-every", "1000000",
            "--out", str(out), "--overwrite", "--quiet", "--bleu-sentences", "0", *extra]


def run_together(commands: dict) -> dict:
    """Run the ``commands`` (name -> argv) at once; each one's metrics.json, by name."""
    for cmd in commands.values():
        print("$ attn-train", " ".join(cmd[3:]), file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    running = {name: subprocess.Popen(cmd, cwd=ROOT, env=env) for name, cmd in commands.items()}
    failed = [name for name, proc in running.items() if proc.wait() != 0]
    if failed:
        raise SystemExit(f"the fine-tuning run(s) {', '.join(failed)} failed (see above)")
    return {name: json.loads((Path(cmd[cmd.index("--out") + 1]) / "metrics.json").read_text(encoding="utf-8"))
            for name, cmd in commands.items()}


def fine_tune_both(args, tatoeba: Path) -> dict:
    """The LoRA run and the full fine-tuning: with ``--minutes``, side by side for those minutes
    each; else LoRA for ``--steps``, then every weight for the seconds its steps took."""
    common = ["--seed", str(args.seed), "--max-tokens", str(args.max_tokens)]
    lora = ["--lora", str(args.rank), "--lora-targets", args.targets, "--lr-factor", str(args.lr_factor), *common] \
        + ([] if args.alpha is None else ["--lora-alpha", str(args.alpha)])
    full = ["--lr-factor", str(args.full_lr_factor), *common]
    if args.minutes:
        budget = ["--minutes", str(args.minutes), "--steps", "0"]
        return run_together({"lora": finetune_command(args.base, tatoeba, args.out / "lora", budget, lora),
                             "full": finetune_command(args.base, tatoeba, args.out / "full", budget, full)})
    done = run_together({"lora": finetune_command(args.base, tatoeba, args.out / "lora",
                                                  ["--steps", str(args.steps), "--minutes", "0"], lora)})
    minutes = done["lora"]["train_seconds"] / 60
    return done | run_together({"full": finetune_command(args.base, tatoeba, args.out / "full",
                                                         ["--minutes", f"{minutes:.4f}", "--steps", "0"], full)})


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the Multi30k translator's checkpoint (German -> English)")
    p.add_argument("--multi30k", type=Path, required=True, help="the folder of Multi30k's {train,val,test}.{de,en}[.gz]")
    p.add_argument("--tatoeba", type=Path, required=True, help="Tatoeba's English<TAB>German file (deu.txt)")
    p.add_argument("--steps", type=int, default=300,
                   help="the LoRA run's optimizer steps; the full fine-tuning then runs for the seconds they took")
    p.add_argument("--minutes", type=float, default=None,
                   help="instead of --steps: both runs side by side, each for these minutes (on a shared machine "
                        "both then train under the same load)")
    p.add_argument("--max-tokens", type=int, default=1024, help="the fine-tuning batches' tokens (--max-tokens)")
    p.add_argument("--val-pairs", type=int, default=300,
                   help="Tatoeba validation pairs that attn-train scores before and after each run")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q,v", help="the projections adapted (--lora-targets)")
    p.add_argument("--alpha", type=float, default=None, help="--lora-alpha (default: attn-train's, 2 x rank)")
    p.add_argument("--lr-factor", type=float, default=1.0,
                   help="the LoRA run's --lr-factor (its rate: this times the peak of the base's schedule)")
    p.add_argument("--full-lr-factor", type=float, default=0.1,
                   help="the full fine-tuning's --lr-factor (every weight at the adapter's rate undoes the base: "
                        "benchmarks/RESULTS.md, the toy dialect)")
    p.add_argument("--sentences", type=int, default=500, help="pairs of each corpus scored")
    p.add_argument("--beam", type=int, default=1, help="beam size of the BLEU translations (1: greedy)")
    p.add_argument("--seed", type=int, default=0, help="the split's and the runs' seed (attn-train's default)")
    p.add_argument("--out", type=Path, default=Path("runs/lora-transfer"))
    args = p.parse_args(argv)
    for name in ("base", "tatoeba"):
        if not getattr(args, name).is_file():
            p.error(f"--{name} {getattr(args, name)}: no such file")
    if not args.multi30k.is_dir():
        p.error(f"--multi30k {args.multi30k}: no such folder")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    record = {"load_average_start": load_average(), "command": " ".join(sys.argv), "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    print(f"load average at start: {record['load_average_start']}", file=sys.stderr, flush=True)
    tatoeba = args.out / "tatoeba"
    record["tatoeba_pairs"] = write_splits(args.tatoeba, tatoeba, args.seed, args.val_pairs)
    record["tatoeba_pieces"] = unknown_share(args.base, tatoeba)
    print(f"Tatoeba German -> English: {record['tatoeba_pairs']} pairs; base vocabulary: "
          f"{record['tatoeba_pieces']['pieces']:,} training pieces, {record['tatoeba_pieces']['bytes']:,} of them byte "
          f"tokens, {record['tatoeba_pieces']['unk']} <unk>",
          file=sys.stderr, flush=True)
    corpora = {"tatoeba": (tatoeba, "test"), "multi30k": (args.multi30k, "val")}
    print("base:", file=sys.stderr)
    rows = {"base": {"scores": figures(args.base, None, corpora, args.sentences, args.beam)}}
    runs = fine_tune_both(args, tatoeba)
    for name, metrics in runs.items():
        saved = Path(metrics["saved"])
        print(f"{name}:", file=sys.stderr)
        scores = figures(saved if name == "full" else args.base, saved if name == "lora" else None, corpora,
                         args.sentences, args.beam)
        rows[name] = {"scores": scores, "metrics": metrics}
    record.update(rows=rows, load_average_end=load_average())
    print(f"load average at end: {record['load_average_end']}", file=sys.stderr)
    (args.out / "lora_transfer.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(table(rows, args))
    return 0


def table(rows: dict, args) -> str:
    """The markdown table: what trained, its size, steps and minutes, and the scores."""
    total = rows["lora"]["metrics"]["base_parameters"]
    lora = rows["lora"]["metrics"]
    alpha = lora.get("lora_alpha")
    names = {"base": "base (Multi30k)",
             "lora": f"LoRA rank {args.rank} on {args.targets} (alpha {alpha:g}), --lr-factor {args.lr_factor:g}",
             "full": f"full fine-tuning, --lr-factor {args.full_lr_factor:g}"}
    decoding = "greedy" if args.beam == 1 else f"beam {args.beam}"
    lines = [f"| model | parameters trained | bytes saved | steps | training minutes | Tatoeba test BLEU ({decoding}) "
             "| Tatoeba test loss | Multi30k val BLEU | Multi30k val loss |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        s, m = row["scores"], row.get("metrics")
        trained = f"{m['trained_parameters']:,} ({100 * m['trained_parameters'] / total:.2f}%)" if m else "-"
        size = f"{m['saved_bytes']:,}" if m else "-"
        steps, mins = (str(m["steps"]), f"{m['train_seconds'] / 60:.1f}") if m else ("-", "-")
        lines.append(f"| {names[name]} | {trained} | {size} | {steps} | {mins} | {s['tatoeba']['bleu']:.2f} | "
                     f"{s['tatoeba']['loss']:.3f} | {s['multi30k']['bleu']:.2f} | {s['multi30k']['loss']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""The decoding settings of a trained run, compared on its validation split.

    python benchmarks/decoding_sweep.py runs/multi30k --beam 1,4 --alpha 0.6,1.0 --no-repeat 0,3,4

Rebuilds the run's splits from ``RUN/config.json`` as ``attn-train`` held them out, loads the
model the run tested (``averaged.npz`` where ``train()`` chose the average of its last
snapshots, else ``checkpoint.npz``), translates the **validation** sources once per setting
(beam size x length penalty x blocked n-gram size; ``--alpha`` matters to beam search only)
and prints one JSON object per setting: BLEU (sacreBLEU on the raw references), lower-cased
BLEU, chrF, how many translations repeat one of their own word 4-grams, and seconds. The
test split is left alone (``--split test`` reads it, once the setting is chosen).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn import backend as B  # noqa: E402
from attn.evaluate import corpus_scores, translate_sentences  # noqa: E402
from attn.train import TrainConfig  # noqa: E402
from attn.training.prepare import load_corpus  # noqa: E402
from attn.translate import load_translator  # noqa: E402


def numbers(kind):
    return lambda text: [kind(x) for x in text.split(",")]


def repeats_a_4gram(text: str) -> bool:
    words = text.split()
    grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    return len(grams) != len(set(grams))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="an attn-train output folder")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--beam", type=numbers(int), default=[1, 4], help="beam sizes, e.g. 1,4")
    p.add_argument("--alpha", type=numbers(float), default=[0.6], help="length penalties, e.g. 0.6,1.0")
    p.add_argument("--no-repeat", type=numbers(int), default=[0], help="blocked n-gram sizes, e.g. 0,3")
    p.add_argument("--checkpoint", type=Path, help="this checkpoint instead of the one the run tested")
    args = p.parse_args(argv)
    B.set_backend("numpy")
    config = TrainConfig.from_dict(json.loads((args.run / "config.json").read_text())["train"])
    pairs = getattr(load_corpus(config), args.split)
    ckpt = args.checkpoint
    if ckpt is None:
        metrics = json.loads((args.run / "metrics.json").read_text())
        ckpt = args.run / ("averaged.npz" if metrics.get("averaged_checkpoints", 1) > 1 else "checkpoint.npz")
    model, vocab = load_translator(ckpt)
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    for k, alpha, n in itertools.product(args.beam, args.alpha, args.no_repeat):
        if k == 1 and alpha != args.alpha[0]:
            continue                                    # greedy search has no length penalty
        t0 = time.perf_counter()
        hyps = translate_sentences(model, vocab, sources, beam_size=k, alpha=alpha, max_source_tokens=None,
                                   no_repeat_ngram=n)
        s = corpus_scores(hyps, refs)
        print(json.dumps({"checkpoint": str(ckpt), "split": args.split, "sentences": len(pairs), "beam": k,
                          "alpha": alpha if k > 1 else None, "no_repeat_ngram": n, "bleu": round(s.bleu, 2),
                          "bleu_lc": round(s.bleu_lc, 2), "chrf": round(s.chrf, 2),
                          "repeating_4gram": sum(map(repeats_a_4gram, hyps)),
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

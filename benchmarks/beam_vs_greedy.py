"""Greedy decoding against beam search on a trained run's own test split.

    PYTHONPATH=. python benchmarks/beam_vs_greedy.py runs/tatoeba [--beam 4] [--limit 1000]

Reads ``RUN/config.json`` to rebuild the test split exactly as ``attn-train`` held it out,
translates its sources with the model the run tested (``averaged.npz`` where ``train()`` chose
the average of the last snapshots, else ``checkpoint.npz``) greedily and with beam K, and prints one JSON object per search:
BLEU (sacreBLEU on the text, cased and lower-cased), chrF, and seconds; then one object
comparing the searches on beam search's own objective, log P / lp (section 6.1): on how
many sentences the beam output scores below greedy's (beam search is a heuristic, so this
can happen; the stopping rule of ``attn.decode.beam_search`` removes one cause of it).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn import backend as B  # noqa: E402
from attn.decode import EXTRA_LENGTH, length_penalty  # noqa: E402
from attn.evaluate import translate  # noqa: E402
from attn.train import TrainConfig  # noqa: E402
from attn.training.prepare import load_corpus  # noqa: E402
from attn.translate import load_translator  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="an attn-train output folder")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--limit", type=int, default=0, help="only the first N test pairs (0: all)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.getLogger("sacrebleu").setLevel(logging.ERROR)
    import sacrebleu
    B.set_backend("numpy")
    config = TrainConfig.from_dict(json.loads((args.run / "config.json").read_text())["train"])
    test = load_corpus(config).test
    test = test[:args.limit] if args.limit else test
    # The model the run tested: the average of its last snapshots where train() chose it, else the last one.
    metrics = json.loads((args.run / "metrics.json").read_text())
    ckpt = args.run / ("averaged.npz" if metrics.get("averaged_checkpoints", 1) > 1 else "checkpoint.npz")
    model, vocab = load_translator(ckpt)
    refs = [t for _, t in test]
    results = {}
    for k in (1, args.beam):
        t0 = time.perf_counter()
        out = translate(model, vocab, [s for s, _ in test], beam_size=k, alpha=args.alpha)
        seconds = time.perf_counter() - t0
        hyps = [t.text for t in out]
        results[k] = out
        print(json.dumps({"checkpoint": str(ckpt), "search": "greedy" if k == 1 else f"beam {k}",
                          "sentences": len(test),
                          "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                          "bleu_lowercase": round(sacrebleu.corpus_bleu(hyps, [refs], lowercase=True).score, 2),
                          "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2),
                          "seconds": round(seconds, 1)}), flush=True)

    def objective(t: "Translation", n_src: int) -> float:
        ended = len(t.tgt_tokens) < n_src + EXTRA_LENGTH      # stopped by EOS, which counts in |Y|
        return t.score / length_penalty(len(t.tgt_tokens) + ended, args.alpha)

    worse = better = 0
    for g, b in zip(results[1], results[args.beam]):
        n_src = len(g.src_tokens)                   # source positions, the appended EOS included
        margin = b.score - objective(g, n_src)
        worse += margin < -1e-6
        better += margin > 1e-6
    print(json.dumps({"comparison": f"beam {args.beam} vs greedy on log P / lp", "beam_better": better,
                      "beam_worse": worse, "same": len(test) - better - worse}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

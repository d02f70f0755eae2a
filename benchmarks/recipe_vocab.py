"""What a vocabulary costs and misses, for the small preset on a tab-separated corpus.

    PYTHONPATH=. python benchmarks/recipe_vocab.py [--tsv ../shared/corpora/tatoeba-en-de/deu.txt] word:2 bpe:8000

For each ``word:MIN_FREQ`` or ``bpe:SIZE``: the vocabulary's size and CPU seconds to build it,
tokens per training pair, the share of test-target tokens that are <unk>, batches per epoch at
4,096 tokens, and CPU seconds per training step (attn.fast, median of 3 after 1 untimed; CPU
time rather than wall time, so that other work on a shared machine distorts it less). One JSON
object per vocabulary. This is how attn.training.config.RECIPES chose BPE for ``small``/``base``.
"""
import argparse, json, os, statistics, sys, time, warnings
from functools import partial
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.simplefilter("ignore")
from attn import backend as B
from attn.data import UNK, encode_pairs, make_batches
from attn.fast import cross_entropy as fce
from attn.model import Transformer
from attn.fast.training.loop import train_step
from attn.train import TrainConfig
from attn.training.prepare import build_vocab, load_corpus, make_engine
p = argparse.ArgumentParser(description="vocabulary cost for the small preset")
p.add_argument("--tsv", type=Path, default=Path(__file__).resolve().parents[2] / "shared/corpora/tatoeba-en-de/deu.txt")
p.add_argument("vocabs", nargs="+", help="word:MIN_FREQ or bpe:SIZE")
args = p.parse_args()
B.set_backend("numpy")
corpus = load_corpus(TrainConfig(tsv=args.tsv))
for spec in args.vocabs:
    kind, n = spec.split(":")
    t0 = time.process_time()
    vocab = build_vocab(corpus.train, int(n), "word") if kind == "word" else build_vocab(corpus.train, 1, "bpe", int(n))
    build_s = time.process_time() - t0
    enc = encode_pairs(corpus.train, vocab, max_len=255)
    test = encode_pairs(corpus.test, vocab)
    unk = sum(t.count(UNK) for _, t in test) / sum(len(t) for _, t in test)
    per_pair = statistics.mean(len(s) + len(t) for s, t in enc)
    batches = make_batches(enc, 4096, shuffle=True, seed=0)
    cfg = TrainConfig(preset="small").model_config(len(vocab))
    model, opt = make_engine(Transformer(cfg, seed=0), "fast", 0.5)
    cpu = []
    for i, b in enumerate(batches[:4]):
        c0 = time.process_time()
        loss, _ = train_step(model, opt, b, B.DeviceRNG(i), 0.1, 0.0, partial(fce, inplace=True))
        B.to_float(loss)
        if i:
            cpu.append(time.process_time() - c0)
    step_cpu = statistics.median(cpu)
    print(json.dumps({"vocab": spec, "size": len(vocab), "build_cpu_s": round(build_s, 1),
                      "tokens_per_pair": round(per_pair, 2), "test_target_unk": round(unk, 4),
                      "batches_per_epoch": len(batches), "cpu_s_per_step": round(step_cpu, 2),
                      "cpu_s_per_epoch": round(step_cpu * len(batches)), "load1": os.getloadavg()[0]}), flush=True)

"""``python -m attn.bench.vocab --tsv FILE``: byte-pair encoding (:mod:`attn.bpe`) learned on a
tab-separated corpus and timed, and vocabularies compared on held-out sentences: tokens per
sentence and unknown tokens, for word vocabularies and BPE of each size asked for.
"""
from __future__ import annotations

import argparse
import random
import sys

from ..bpe import BYTE_TOKENS, count_tokens, time_learning
from ..data import SPECIALS, DataError, Vocab, read_tsv
from ..text import normalize, tokenize


def _split_by_source(pairs, held_out: int, seed: int):
    """Hold out ``held_out`` distinct source sentences with all their translations."""
    sources = sorted({s for s, _ in pairs})
    random.Random(seed).shuffle(sources)
    test = set(sources[:held_out])
    return [p for p in pairs if p[0] not in test], [p for p in pairs if p[0] in test]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attn.bench.vocab",
        description="Learn byte-pair merges on a tab-separated corpus (source<TAB>target per line, both "
                    "languages together), time the learning, and compare vocabularies: tokens per sentence "
                    "and unknown tokens on held-out sentences, for word vocabularies and BPE of each size.",
        epilog="examples:\n"
               "  python -m attn.bench.vocab --tsv ../shared/corpora/tatoeba-en-de/deu.txt --merges 10000\n"
               "  python -m attn.bench.vocab --tsv deu.txt --vocab-size 8000 16000",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tsv", required=True, help="tab-separated sentence pairs, e.g. deu.txt from Tatoeba")
    p.add_argument("--vocab-size", type=int, nargs="*", default=[], metavar="N",
                   help="BPE vocabulary sizes to learn (specials and the 512 byte tokens included)")
    p.add_argument("--merges", type=int, nargs="*", default=[], metavar="M",
                   help="numbers of merges to learn (default, with no --vocab-size either: 10000)")
    p.add_argument("--held-out", type=int, default=1000, metavar="K",
                   help="distinct source sentences held out (with all their translations) to measure on")
    p.add_argument("--limit", type=int, default=0, metavar="N",
                   help="use only the first N training pairs (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out split (default 0)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        pairs = read_tsv(args.tsv)
    except DataError as e:
        print(f"python -m attn.bench.vocab: error: {e}", file=sys.stderr)
        return 2
    if any(n < len(SPECIALS) + len(BYTE_TOKENS) + 1 for n in args.vocab_size) or any(m < 0 for m in args.merges):
        print(f"python -m attn.bench.vocab: error: --vocab-size must be at least {len(SPECIALS) + len(BYTE_TOKENS) + 1}, "
              f"--merges at least 0", file=sys.stderr)
        return 2
    train, test = _split_by_source(pairs, args.held_out, args.seed)
    if args.limit:
        train = train[:args.limit]
    texts = [s for s, _ in train] + [t for _, t in train]
    print(f"{args.tsv}: {len(pairs)} pairs; training on {len(train)}, measuring on {len(test)} held-out pairs "
          f"({args.held_out} distinct sources)")

    def per_sentence(tokenize_fn, side):
        return sum(len(tokenize_fn(p[side])) for p in test) / max(len(test), 1)

    counts = count_tokens(texts)
    header = (f"{'vocabulary':<26s} {'size':>6s} {'merges':>7s} {'learn s':>8s} {'cpu s':>6s} {'src tok/sent':>13s} "
              f"{'tgt tok/sent':>13s} {'V x tgt tok':>12s} {'held-out <unk>':>15s}")
    print("\n" + header)

    def row(label, size, merges, seconds, cpu, tokenize_fn, unk, note=""):
        src, tgt = per_sentence(tokenize_fn, 0), per_sentence(tokenize_fn, 1)
        print(f"{label:<26s} {size:6d} {merges:>7s} {seconds:>8s} {cpu:>6s} {src:13.2f} {tgt:13.2f} "
              f"{size * tgt / 1000:11.1f}k {unk:15.2%}{note}")

    held_out_words = [t for p in test for side in p for t in tokenize(side)]
    for min_freq in (1, 2):
        words = {t for t, n in counts.items() if n >= min_freq}
        unk = sum(t not in words for t in held_out_words) / max(len(held_out_words), 1)
        row(f"words, min-freq {min_freq}", len(SPECIALS) + len(words), "-", "-", "-", tokenize, unk)
    settings = [("merges", m) for m in args.merges] + [("size", n) for n in args.vocab_size]
    if not settings:
        settings = [("merges", 10_000)]
    for kind, n in settings:
        if kind == "merges":
            timing = time_learning(texts, n)
        else:
            timing = time_learning(texts, max_symbols=n - len(SPECIALS) - len(BYTE_TOKENS))
        bpe = timing.bpe
        lossless = all(bpe.decode(bpe.encode(side)) == normalize(side) for p in test for side in p)
        vocab = Vocab(SPECIALS + tuple(bpe.vocabulary()), bpe=bpe)
        pieces = [t for p in test for side in p for t in bpe.encode(side)]
        unk = sum(t not in vocab for t in pieces) / max(len(pieces), 1)
        row(f"BPE, {n} merges" if kind == "merges" else f"BPE, vocab-size {n}", len(vocab),
            str(len(bpe.merges)), f"{timing.learn_seconds:.2f}", f"{timing.learn_cpu_seconds:.2f}", bpe.encode, unk,
            f"   (counting words {timing.count_seconds:.2f} s; held-out round trip exact: {lossless})")
    print("\nlearn s: wall-clock seconds to learn the merges from the word counts, one core of this machine; "
          "cpu s: the CPU seconds of that (what a quiet machine's wall clock would show); "
          "tok/sent: tokens per held-out sentence (the model's sequence length); V x tgt tok: vocabulary size "
          "times target tokens per sentence, what the output projection, softmax and loss cost per sentence")
    return 0


if __name__ == "__main__":
    sys.exit(main())

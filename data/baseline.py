"""Word-by-word dictionary baseline for the toy corpus: what lookup alone scores.

The dictionary is learned from the training pairs, with no knowledge of the
grammar: IBM Model 1 (Brown et al., 1993; a few EM iterations, with a NULL
source word) gives translation probabilities t(tk word | en word); each tk word
of each training pair is aligned to its most probable English word; and each
English word is then translated by the tk word most often aligned to it, or by
nothing if it is most often left unaligned ("a", "does", "he").

The test set is translated word by word in English order and scored with
sacrebleu's corpus BLEU on detokenised text, as attn.evaluate scores the models.

Usage::

    python data/baseline.py                    # prints the test BLEU
    python data/baseline.py --show 5           # and a few translations
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

import sacrebleu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attn.data import detokenize, read_parallel  # noqa: E402

TOY_DIR = Path(__file__).resolve().parent / "toy"
NULL = "<null>"


def ibm1(pairs: list[tuple[list[str], list[str]]], iterations: int = 5,
         null: bool = False) -> dict[tuple[str, str], float]:
    """IBM Model 1 translation probabilities t(f | e), f a tk word, e an English word
    (or NULL, with ``null=True``)."""
    t: dict[tuple[str, str], float] = defaultdict(lambda: 1.0)  # uniform start
    for _ in range(iterations):
        count: dict[tuple[str, str], float] = defaultdict(float)
        total: dict[str, float] = defaultdict(float)
        for en, tk in pairs:
            en = [NULL] + en if null else en
            for f in tk:
                probs = [t[(f, e)] for e in en]
                z = sum(probs)
                for e, p in zip(en, probs):
                    count[(f, e)] += p / z
                    total[e] += p / z
        t = defaultdict(float, {(f, e): c / total[e] for (f, e), c in count.items()})
    return t


def learn_dictionary(pairs: list[tuple[list[str], list[str]]], iterations: int = 5,
                     null: bool = False) -> dict[str, str | None]:
    """English word -> the tk word most often aligned to it (None: most often unaligned)."""
    t = ibm1(pairs, iterations, null)
    aligned: dict[str, Counter] = defaultdict(Counter)
    for en, tk in pairs:
        src = [NULL] + en  # with null=False, t(f | NULL) is 0 and nothing aligns to it
        links: dict[int, list[str]] = defaultdict(list)
        for f in tk:
            links[max(range(len(src)), key=lambda j: t[(f, src[j])])].append(f)
        for j, e in enumerate(en, start=1):
            aligned[e].update(links[j] or [None])
    # most frequent; ties broken alphabetically (None last) so the result is deterministic
    return {e: min(c, key=lambda f: (-c[f], f is None, f or "")) for e, c in aligned.items()}


def translate(tokens: list[str], dictionary: dict[str, str | None]) -> list[str]:
    """Word by word, English order; unknown words are copied."""
    out = []
    for w in tokens:
        f = dictionary.get(w, w)
        if f is not None:
            out.append(f)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Dictionary baseline BLEU on the toy corpus")
    p.add_argument("--data", type=Path, default=TOY_DIR)
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="tk")
    p.add_argument("--iterations", type=int, default=5, help="IBM Model 1 EM iterations")
    p.add_argument("--null", action="store_true", help="give IBM Model 1 a NULL source word")
    p.add_argument("--show", type=int, default=0, metavar="N", help="print N example translations")
    args = p.parse_args(argv)
    train = [(s.split(), t.split()) for s, t in read_parallel(args.data, args.src, args.tgt, "train")]
    test = [(s.split(), t.split()) for s, t in read_parallel(args.data, args.src, args.tgt, "test")]
    dictionary = learn_dictionary(train, args.iterations, args.null)
    hyps = [detokenize(translate(s, dictionary)) for s, _ in test]
    refs = [detokenize(t) for _, t in test]
    for (s, _), h, r in list(zip(test, hyps, refs))[:args.show]:
        print(f"en:  {' '.join(s)}\nout: {h}\nref: {r}\n")
    bleu = sacrebleu.corpus_bleu(hyps, [refs])
    print(f"dictionary baseline, test BLEU = {bleu.score:.1f}   ({bleu})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

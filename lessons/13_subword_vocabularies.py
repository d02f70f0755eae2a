# %% [markdown]
# # Lesson 13: subword vocabularies, byte-pair encoding by hand (section 5.1)
#
# Section 5.1: "Sentences were encoded using byte-pair encoding, which has a shared
# source-target vocabulary of about 37000 tokens." Two ideas in one sentence:
#
# * **byte-pair encoding** (Sennrich et al. 2016): instead of whole words, the
#   vocabulary holds *pieces* of words, learned from the corpus by repeatedly
#   merging the most frequent pair of adjacent symbols. Frequent words become one
#   piece, rare words a few, and a word never seen is still spelled from known
#   pieces: no `<unk>`;
# * **shared source-target**: the merges are learned on both languages together,
#   so one vocabulary (one embedding matrix) serves the encoder, the decoder and the
#   output projection, which is what lets section 3.4 tie the three (lesson 9).
#
# The library's `attn.bpe` does both; this lesson redoes the first merges by hand,
# checks that the library makes the same choices, and then measures what a shared
# subword vocabulary does on the toy corpus.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import time
from collections import Counter

import numpy as np

from attn.bpe import BPE, count_tokens, learn_merges, merge_symbols, symbols_of
from attn.data import TOY_DIR, UNK, Vocab, read_parallel, tokenize
from attn.text import normalize

T0 = time.time()

# %% [markdown]
# ## 1. The merges, by hand
#
# Start from words as characters. The library marks every character after a word's
# first with `##` ("glued to the one before"), so that pieces can be joined back
# into exactly the original text: `lower` is `l ##o ##w ##e ##r`. Count every pair of
# adjacent symbols, each word weighted by how often it occurs; merge the most
# frequent pair everywhere; repeat. Ties go to the alphabetically first pair, as in
# the library.

# %%
corpus = ["low low low low low", "lower lower", "newest newest newest newest newest newest",
          "widest widest widest"]                          # Sennrich et al.'s example, as word counts
counts = count_tokens(corpus)
print("word counts:", dict(counts))
words = {w: symbols_of(w) for w in counts}
hand_merges = []
for step in range(8):
    pairs = Counter()
    for w, syms in words.items():
        for a, b in zip(syms, syms[1:]):
            pairs[a, b] += counts[w]
    best = min(pairs, key=lambda p: (-pairs[p], p))        # most frequent, then alphabetical
    hand_merges.append(best)
    new = merge_symbols(*best)
    for w, syms in words.items():                          # merge it everywhere, left to right
        out, i = [], 0
        while i < len(syms):
            if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                out.append(new); i += 2
            else:
                out.append(syms[i]); i += 1
        words[w] = out
    top = ", ".join(f"{a}+{b}: {n}" for (a, b), n in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[:3])
    print(f"merge {step + 1}: {best[0]} + {best[1]} -> {new:<8} (top pairs {top})   "
          + "  ".join(" ".join(s) for s in words.values()))
alphabet, lib_merges = learn_merges(counts, 8)
print("\nattn.bpe.learn_merges:", lib_merges)
print("by hand:              ", hand_merges)

# %% [markdown]
# After a few merges the frequent words are single pieces (`low`, `newest`), and the
# shared ending `##est` became a piece of its own because it occurs in two frequent
# words. That is the point: pieces that recur across words get a row of their own.
#
# ## 2. Encoding: unseen words, unseen characters, and no loss
#
# To encode a word, start from its characters and apply the learned merges in the
# order they were learned. A word never seen in training is spelled from known
# pieces; a character never seen becomes its UTF-8 bytes (`<0x..>` tokens, all $2^8 = 256$
# of them in the vocabulary), so nothing is ever `<unk>`. And decoding joins the
# pieces back into exactly the (normalised) text.

# %%
bpe = BPE.learn(corpus, 8)
for text in ("lowest newer", "the widest, newest", "lower löw 🙂"):
    pieces = bpe.encode(text)
    print(f"{text!r:<24} -> {pieces}\n{'':<27} decode: {bpe.decode(pieces)!r}")

# %% [markdown]
# ## 3. A shared vocabulary for the toy corpus
#
# The toy corpus's two languages share the Latin alphabet, the full stop and the
# comma, and little else. A **word** vocabulary learned on the training pairs has a
# row for every word form of either language; any test word not among them is
# `<unk>`, and the translation of that word is lost. A **BPE** vocabulary of a chosen
# size learned on both languages' training text (`Vocab.build_bpe`, what
# `attn-train --vocab bpe` uses) has no unknowns, at the price of longer sequences.
#
# The toy language has a small, closed lexicon, so a word vocabulary from a few
# thousand pairs already knows every test word; real text never stops bringing new
# words. To see the difference we also learn both kinds from only the first 100
# pairs, as a stand-in for an open vocabulary. We compare how many test tokens are
# unknown, how long the sequences get, and how many pieces the two languages share.

# %%
train = read_parallel(TOY_DIR, "en", "tk", "train")[:3000 if QUICK else 30_000]
test = read_parallel(TOY_DIR, "en", "tk", "test")[:500 if QUICK else 3000]
texts = [s for s, _ in train] + [t for _, t in train]
few = [s for s, _ in train[:100]] + [t for _, t in train[:100]]
rows = []
for label, src_texts in (("100 pairs", few), (f"{len(train)} pairs", texts)):
    v = Vocab.build([tokenize(x) for x in src_texts], min_freq=1)
    rows.append(dict(name=f"words, {label}", size=len(v), vocab=v))
    for size in (600,) if src_texts is few else ((600, 800) if QUICK else (600, 800, 1200)):
        t = time.perf_counter()
        v = Vocab.build_bpe(src_texts, size)
        rows.append(dict(name=f"BPE {size}, {label}", size=len(v), vocab=v, learn_s=time.perf_counter() - t))


def piece_set(vocab, side):
    """The vocabulary entries that one language's training text uses."""
    return {p for pair in train for p in vocab.tokenize(pair[side]) if p in vocab.stoi}


print(f"{len(train)} training pairs, {len(test)} test pairs")
print(f"{'vocabulary':<22} {'rows':>6} {'test <unk>':>11} {'pieces per word':>16} {'en-only':>8} {'tk-only':>8} "
      f"{'shared':>7} {'round trip':>11}")
for r in rows:
    v = r["vocab"]
    ids = [v.encode(v.tokenize(s)) for pair in test for s in pair]
    n_words = sum(len(tokenize(s)) for pair in test for s in pair)
    r["unk"] = sum(i == UNK for seq in ids for i in seq) / sum(map(len, ids))
    r["per_word"] = sum(map(len, ids)) / n_words
    en, tk = piece_set(v, 0), piece_set(v, 1)
    r["shared"], r["en_only"], r["tk_only"] = len(en & tk), len(en - tk), len(tk - en)
    r["lossless"] = all(" ".join(v.tokenize(s)) == " ".join(tokenize(s)) if v.bpe is None
                        else v.bpe.decode(v.tokenize(s)) == normalize(s) for pair in test for s in pair)
    print(f"{r['name']:<22} {r['size']:>6} {r['unk']:>11.2%} {r['per_word']:>16.2f} {r['en_only']:>8} "
          f"{r['tk_only']:>8} {r['shared']:>7} {str(r['lossless']):>11}")
print("learning time: " + ", ".join(f"{r['name']} {r['learn_s']:.2f} s" for r in rows if "learn_s" in r))

example = test[0][1]
for r in rows:
    if r["vocab"].bpe is not None:
        print(f"{r['name']:<22} {example!r} -> {r['vocab'].tokenize(example)}")

fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
names = [r["name"].replace(", ", "\n") for r in rows]
colors = ["tab:gray" if r["vocab"].bpe is None else "tab:blue" for r in rows]
ax[0].bar(names, [100 * r["unk"] for r in rows], color=colors)
ax[0].set_ylabel("test tokens that are <unk> (%)"); ax[0].set_title("unknown tokens")
ax[1].bar(names, [r["per_word"] for r in rows], color=colors)
ax[1].set_ylabel("tokens per word"); ax[1].set_title("the price: longer sequences")
for a in ax:
    a.tick_params(axis="x", labelsize=7)
fig.tight_layout()
show_figure(fig, "13_subwords.png")

# %% [markdown]
# Read the table (this run's): the word vocabulary from 100 pairs leaves test tokens
# unknown, word forms that never occurred in its slice (from the larger slice, the toy
# language's closed lexicon is complete); every BPE vocabulary has none, and turns
# text back into exactly itself. The smaller the BPE vocabulary, the
# more pieces per word: attention's cost grows with the square of the sequence
# length (lesson 10), so the vocabulary size trades rows of the embedding matrix
# against length. The "shared" column counts the pieces that both languages use; the
# one shared matrix holds them once, and section 3.4's tying works because source
# and target ids index the same rows.
#
# ## Check
#
# These fail if the library's BPE learned different merges than the algorithm says,
# lost text in a round trip, produced an unknown token, or mixed up the shared
# vocabulary.

# %%
assert lib_merges == hand_merges, f"attn.bpe learned {lib_merges}, the algorithm by hand {hand_merges}"
assert bpe.decode(bpe.encode("lower löw 🙂")) == normalize("lower löw 🙂"), "BPE must be lossless"
bpe_rows = [r for r in rows if r["vocab"].bpe is not None]
for r in bpe_rows:
    assert r["unk"] == 0.0 and r["lossless"], f"{r['name']}: no <unk>, and a lossless round trip"
    assert r["size"] <= int(r["name"].split()[1].rstrip(","))
assert rows[0]["unk"] > 0, "a word vocabulary from 100 pairs should miss some test words"
big_slice = [r for r in bpe_rows if not r["name"].endswith("100 pairs")]
assert big_slice[0]["per_word"] >= big_slice[-1]["per_word"], "a smaller BPE vocabulary cuts words into more pieces"
print(f"Check passed in {time.time() - T0:.1f} s: the library's merges are the hand-computed ones; BPE "
      f"vocabularies have no <unk> and round-trip exactly; the word vocabulary misses {rows[0]['unk']:.2%} of test "
      f"tokens.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. How does byte-pair encoding choose its next merge, and why does a word never
#    seen in training still get encoded without `<unk>`?
#
#    <details><summary>Answer</summary>
#
#    It counts every pair of adjacent symbols in the training words (weighted by the
#    words' counts) and merges the most frequent pair into a new symbol. A word never
#    seen is split into characters and the learned merges are applied in their order; a
#    character never seen becomes its UTF-8 bytes, which are all in the vocabulary, so
#    there is always an encoding without `<unk>`.
#
#    </details>
#
# 2. Why does the paper learn one vocabulary for both languages, and what does that
#    let section 3.4 do?
#
#    <details><summary>Answer</summary>
#
#    English and German share an alphabet and many subwords (names, numbers, cognates):
#    one vocabulary makes one embedding table for both sides, which is what lets
#    section 3.4 share one weight matrix between the two embedding layers and the
#    pre-softmax linear map.
#
#    </details>
#
# 3. What does byte fallback guarantee about encoding and decoding any text?
#
#    <details><summary>Answer</summary>
#
#    Every string can be encoded (no `<unk>`, since the $2^8 = 256$ bytes cover any text)
#    and decoding gives back exactly the text that was encoded: encoding is lossless and
#    decoding inverts it.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write byte-pair encoding's merges: learning them from a corpus and applying them
# to a word yourself. The starter `lessons/exercises/bpe.py` has the signatures, and the
# shapes and formulas in its docstrings; its bodies raise `NotImplementedError`. Fill
# them in, then grade your work:
#
#     attn-check lessons/exercises/bpe.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

# %% [markdown]
# # Lesson 16: how BLEU is computed, and Table 2's BLEU column (section 6.1)
#
# Table 2 of the paper reports the Transformer's quality as one number per language
# pair: **BLEU** (Papineni et al. 2002). On WMT 2014 English-to-German the base model
# scores 27.3 and the big model 28.4; on English-to-French, 38.1 and 41.8. Every
# translation result since has been reported the same way, and lesson 14 scored the
# toy translator with it. But what is the number?
#
# This lesson computes corpus BLEU by hand (clipped n-gram precisions, their
# geometric mean, the brevity penalty), shows that it equals sacreBLEU's (the tool
# `attn.evaluate` uses), shows why it is a *corpus* score and not an average of
# sentence scores, computes chrF (the character-level score `attn.evaluate` also
# reports), and then asks what a BLEU point means: how tokenisation and case move
# the score on the same output, and how much a test set of this size can resolve.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import logging
import math
import shutil
import textwrap
import time
from collections import Counter

import numpy as np
from matplotlib.ticker import MaxNLocator
from sacrebleu.metrics import BLEU, CHRF

from attn import backend as B
from attn.data import TOY_DIR, read_parallel, tokenize
from attn.evaluate import corpus_scores, translate_sentences
from attn.train import train
from attn.training.config import config_from_argv
from attn.translate import load_translator

B.set_backend("numpy")                                       # lessons run on the CPU
logging.getLogger("sacrebleu").setLevel(logging.ERROR)      # it warns that the toy text is pre-tokenised
T0 = time.time()

# %% [markdown]
# ## 1. The pieces, on one sentence
#
# BLEU compares a hypothesis with a reference by the **n-grams** (runs of `n` tokens,
# `n = 1 .. 4`) they share. The precision of order n is the fraction of the
# hypothesis's n-grams that occur in the reference. Plain precision is easy to game:
# a hypothesis that repeats one common word has a perfect unigram precision. So the
# count of each n-gram is **clipped** to the number of times it occurs in the
# reference (Papineni et al.'s "modified precision").

# %%
def ngrams(tokens, n):
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def stats(hyp, ref, max_n=4):
    """BLEU's sufficient statistics of one sentence pair (token lists): clipped matches and
    totals per order, hypothesis length, reference length."""
    match = [sum((ngrams(hyp, n) & ngrams(ref, n)).values()) for n in range(1, max_n + 1)]  # & takes the min
    total = [max(len(hyp) - n + 1, 0) for n in range(1, max_n + 1)]
    return np.array(match + total + [len(hyp), len(ref)], dtype=np.int64)


ref = "the cat is on the mat".split()
for hyp in ("the the the the the the the", "the cat the cat on the mat", "the cat is on the mat"):
    h = hyp.split()
    unclipped = sum(c for g, c in ngrams(h, 1).items() if g in ngrams(ref, 1))
    s = stats(h, ref)
    print(f"{hyp!r:<32} unigrams: unclipped {unclipped}/{len(h)}, clipped {s[0]}/{s[4]};  "
          f"clipped precision of orders 1-4: " + " ".join(f"{s[n]}/{s[4 + n]}" for n in range(4)))

# %% [markdown]
# The four precisions are combined by their **geometric mean**, $\exp(\sum_n \log p_n / 4)$:
# one order with no match sends it to zero, and each order counts the same however
# large its numbers. Precision alone rewards saying little: a hypothesis of only the
# words it is sure of scores high. Recall is not usable with several references, so
# BLEU instead multiplies by a **brevity penalty** when the hypothesis is shorter than
# the reference: with $c$ the hypothesis length and $r$ the reference length,
#
# $$\mathrm{BP} = \begin{cases} 1 & \text{if } c > r \\ e^{1 - r / c} & \text{otherwise} \end{cases}
#   \qquad \mathrm{BLEU} = \mathrm{BP} \cdot \exp\Big(\frac{1}{4} \sum_{n=1}^{4} \log p_n\Big)$$
#
# (times 100, by convention).
#
# ## 2. Corpus BLEU, not an average of sentences
#
# The statistics are **summed over the whole test set first**: the matches and
# totals of each order, `c` and `r` over all sentences; then the precisions, the
# mean and the penalty are computed once. A sentence whose 4-grams never match then
# costs a few 4-grams, not a zero; and a short hypothesis is penalised only if the
# whole output is short. (sacreBLEU's default also smooths an order with zero matches
# in the whole corpus, which a real test set never has: we implement it so the two
# agree everywhere.)

# %%
def bleu_from_stats(s, max_n=4):
    """Corpus BLEU (0-100) from summed statistics, with sacreBLEU's default ('exp') smoothing."""
    match, total, c, r = s[:max_n], s[max_n:2 * max_n], s[2 * max_n], s[2 * max_n + 1]
    if c == 0 or not match.any():
        return 0.0
    bp = 1.0 if c > r else math.exp(1 - r / c)
    logs, halve = [], 1.0
    for m, t in zip(match, total):
        if m == 0:                                          # 'exp' smoothing: 1 / (2^k * total)
            halve *= 2
            logs.append(math.log(1.0 / (halve * t)))
        else:
            logs.append(math.log(m / t))
    return 100 * bp * math.exp(sum(logs) / max_n)


def corpus_bleu_by_hand(hyps, refs):
    """hyps, refs: lists of token lists."""
    return bleu_from_stats(sum(stats(h, r) for h, r in zip(hyps, refs)))


# %% [markdown]
# To have something to score we train a small toy translator for a few hundred steps
# (lesson 14) and translate the test set with greedy decoding and with beam search.
# We also score two trivial systems: copying the English source, and a "hypothesis"
# that keeps only the first half of each reference, which has perfect precision and
# is caught only by the brevity penalty.

# %%
MAX_WORDS = 8 if QUICK else 14
N_TRAIN, N_TEST = (1500, 150) if QUICK else (8000, 500)
STEPS = quick_steps(700) if QUICK else 1500


def short(split, n):
    return [p for p in read_parallel(TOY_DIR, "en", "tk", split) if len(p[0].split()) <= MAX_WORDS][:n]


data_dir, run_dir = OUT / "16_data", OUT / "16_run"
shutil.rmtree(run_dir, ignore_errors=True)
splits = {"train": short("train", N_TRAIN), "val": short("val", 50), "test": short("test", N_TEST)}
data_dir.mkdir(parents=True, exist_ok=True)
for split, pairs in splits.items():
    for side, lang in ((0, "en"), (1, "tk")):
        (data_dir / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")
train(config_from_argv(["--data", os.path.relpath(data_dir), "--out", os.path.relpath(run_dir), "--backend", "numpy", "--seed", "0",
                        "--d-model", "32", "--heads", "4", "--d-ff", "64", "--layers", "1", "--dropout", "0.0",
                        "--warmup", "200", "--lr-factor", "2", "--steps", str(STEPS), "--max-tokens", "400",
                        "--eval-every", str(STEPS), "--average", "0", "--minutes", "0", "--bleu-sentences", "0",
                        "--quiet"]))
model, vocab = load_translator(run_dir / "checkpoint.npz")
test = splits["test"]
refs_text = [t for _, t in test]
systems = {"greedy": translate_sentences(model, vocab, [s for s, _ in test], beam_size=1),
           "beam 4": translate_sentences(model, vocab, [s for s, _ in test], beam_size=4),
           "copy source": [s for s, _ in test],
           "half of the reference": [" ".join(r.split()[:max(1, len(r.split()) // 2)]) for r in refs_text]}
refs = [tokenize(r) for r in refs_text]

print(f"{'system':<22} {'by hand':>8} {'sacreBLEU':>10}   precisions 1-4 (%)          BP    c / r")
hand, sacre = {}, {}
for name, hyps in systems.items():
    toks = [tokenize(h) for h in hyps]
    s = sum(stats(h, r) for h, r in zip(toks, refs))
    hand[name] = bleu_from_stats(s)
    sacre[name] = BLEU(tokenize="none").corpus_score([" ".join(t) for t in toks], [[" ".join(r) for r in refs]]).score
    prec = " ".join(f"{100 * m / t:5.1f}" for m, t in zip(s[:4], s[4:8]))
    bp = 1.0 if s[8] > s[9] else math.exp(1 - s[9] / s[8])
    print(f"{name:<22} {hand[name]:8.2f} {sacre[name]:10.2f}   {prec}   {bp:.3f}  {s[8]} / {s[9]}")
print("the first test sentence:\n  ref:    " + refs_text[0] + "\n  greedy: " + systems["greedy"][0])

# %% [markdown]
# Our numbers equal sacreBLEU's (here with `tokenize="none"`: both sides are split on
# spaces, as our token lists are). "Half of the reference" has perfect precisions and
# is held down only by the brevity penalty; copying the source shares almost no words
# with the made-up language.
#
# Now the average of sentence scores. sacreBLEU's `sentence_score` computes BLEU on
# one sentence (with smoothing, since a short sentence often has no matching 4-gram);
# the mean of those is a different number from corpus BLEU:

# %%
sent_bleu = BLEU(tokenize="none", effective_order=True)
sent_mean = {name: np.mean([sent_bleu.sentence_score(" ".join(tokenize(h)), [" ".join(r)]).score
                            for h, r in zip(hyps, refs)]) for name, hyps in systems.items()}
for name in systems:
    print(f"{name:<22} corpus BLEU {hand[name]:6.2f}   mean of sentence BLEU {sent_mean[name]:6.2f}")

# %% [markdown]
# ## 3. chrF, briefly
#
# chrF (Popović 2015) works on **characters**: the n-grams of orders `1 .. 6` of each
# sentence with the spaces removed. For each order it computes precision and recall
# (again from statistics summed over the corpus), averages them over the orders, and
# combines them as an F-score that weighs recall $\beta = 2$ times as much as
# precision: $F = (1 + \beta^2) P R / (\beta^2 P + R)$. It gives partial credit for a
# word with the right stem and the wrong ending, which word-level BLEU does not;
# `attn.evaluate` reports it next to BLEU.

# %%
def chrf_by_hand(hyps, refs, order=6, beta=2.0):
    tot = np.zeros((order, 3))                               # per order: hypothesis, reference, matches
    for h, r in zip(hyps, refs):
        h, r = "".join(h.split()), "".join(r.split())
        for n in range(1, order + 1):
            gh = Counter(h[i:i + n] for i in range(len(h) - n + 1))
            gr = Counter(r[i:i + n] for i in range(len(r) - n + 1))
            tot[n - 1] += (sum(gh.values()), sum(gr.values()), sum((gh & gr).values()))
    ok = (tot[:, 0] > 0) & (tot[:, 1] > 0)
    p, r = (tot[ok, 2] / tot[ok, 0]).mean(), (tot[ok, 2] / tot[ok, 1]).mean()
    return 0.0 if p + r == 0 else 100 * (1 + beta ** 2) * p * r / (beta ** 2 * p + r)


chrf_hand = {name: chrf_by_hand(hyps, refs_text) for name, hyps in systems.items()}
chrf_sacre = {name: CHRF().corpus_score(hyps, [refs_text]).score for name, hyps in systems.items()}
for name in systems:
    print(f"{name:<22} chrF by hand {chrf_hand[name]:6.2f}   sacreBLEU's {chrf_sacre[name]:6.2f}")

# %% [markdown]
# ## 4. Tokenisation and case: the same output, different numbers
#
# A BLEU score is only comparable with another computed the same way. The toy
# corpus is stored tokenised, a space around every mark (`... dormat .`). Real test
# sets are plain text (`... dormat.`), and how the scorer splits it decides what
# counts as a word. Below, the same greedy output and references, written as plain
# text with the first letter capitalised as in real text (our model outputs lower
# case), are scored four ways: our tokens; sacreBLEU's standard `13a` tokeniser
# (which splits the marks off again); no tokenisation at all (`dormat.` is then a
# different word from `dormat`); and `13a` on lower-cased text.


# %%
def plain(text, capitalise):
    t = text.replace(" .", ".").replace(" ,", ",")
    return t[:1].upper() + t[1:] if capitalise else t


hyp_plain = [plain(h, False) for h in systems["greedy"]]
ref_plain = [plain(r, True) for r in refs_text]
ways = {
    "our tokens (the stored text)": hand["greedy"],
    "plain text, 13a tokeniser, cased": BLEU().corpus_score(hyp_plain, [ref_plain]).score,
    "plain text, no tokeniser, cased": BLEU(tokenize="none").corpus_score(hyp_plain, [ref_plain]).score,
    "plain text, 13a tokeniser, lower-cased": BLEU(lowercase=True).corpus_score(hyp_plain, [ref_plain]).score,
}
for k, v in ways.items():
    print(f"{k:<40} BLEU {v:6.2f}")
library = corpus_scores(systems["greedy"], refs_text)
print(f"attn.evaluate.corpus_scores on the stored text: BLEU {library.bleu:.2f}  ({library.signatures['bleu']})")

# %% [markdown]
# Same output, several scores. That is why sacreBLEU prints a *signature* (above)
# saying how a score was computed, and why it scores detokenised text with its own
# tokeniser: scores computed on differently tokenised text, or with a different
# treatment of case, are not comparable (Post 2018, "A Call for Clarity in Reporting
# BLEU Scores"). The paper's numbers predate that convention and were computed on
# tokenised text, so a sacreBLEU score of a model today is not directly comparable
# with Table 2's.
#
# ## 5. What a BLEU point means
#
# A test set is a sample. To see how much a score depends on which sentences were
# drawn, resample the test set with replacement many times (the bootstrap, Koehn
# 2004) and recompute corpus BLEU from the per-sentence statistics: the spread is
# the score's uncertainty. Resampling the *same* sentences for two systems (paired
# bootstrap) says how often one beats the other.

# %%
rng = np.random.default_rng(0)
per_sent = {name: np.stack([stats(tokenize(h), r) for h, r in zip(systems[name], refs)])
            for name in ("greedy", "beam 4")}
N_BOOT = 300 if QUICK else 1000
boot = {name: [] for name in per_sent}
for _ in range(N_BOOT):
    idx = rng.integers(0, len(test), len(test))
    for name, st in per_sent.items():
        boot[name].append(bleu_from_stats(st[idx].sum(axis=0)))
boot = {k: np.array(v) for k, v in boot.items()}
lo, hi = np.percentile(boot["greedy"], [2.5, 97.5])
wins = (boot["beam 4"] > boot["greedy"]).mean()
print(f"greedy BLEU {hand['greedy']:.2f} on {len(test)} sentences; 95% of {N_BOOT} bootstrap resamples fall in "
      f"[{lo:.2f}, {hi:.2f}] (a width of {hi - lo:.2f} points)")
print(f"beam 4 {hand['beam 4']:.2f} against greedy {hand['greedy']:.2f}: beam 4 higher in {wins:.0%} of "
      "paired resamples")

# one corrected word: replace a wrong token of one hypothesis by the reference's, the first
# whose correction adds a unigram match (a wrong word that matches elsewhere in the reference,
# swapped for one already matched as often as the reference has it, would change nothing)
toks = [tokenize(h) for h in systems["greedy"]]


def corrected(j, p):
    t = list(toks[j])
    t[p] = refs[j][p]
    return t


i, k = next((j, p) for j, (h, r) in enumerate(zip(toks, refs)) if h != r and len(h) == len(r)
            for p in range(len(r)) if h[p] != r[p] and stats(corrected(j, p), r)[0] > stats(h, r)[0])
fixed = [list(t) for t in toks]
fixed[i] = corrected(i, k)
one_word = corpus_bleu_by_hand(fixed, refs) - hand["greedy"]
n_words = sum(map(len, refs))
print(f"correcting one word ({toks[i][k]!r} -> {refs[i][k]!r} in sentence {i}) of {n_words} reference tokens "
      f"raises BLEU by {one_word:.2f}")

fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
names = list(systems)
for n in range(4):
    vals = [100 * s[n] / s[4 + n] for s in (sum(stats(tokenize(h), r) for h, r in zip(systems[k_], refs))
                                            for k_ in names)]
    ax[0].barh(np.arange(len(names)) + 0.2 * n - 0.3, vals, 0.2, label=f"{n + 1}-gram")
ax[0].set_yticks(range(len(names)), ["\n".join(textwrap.wrap(k_, 11)) + f"\nBLEU {hand[k_]:.1f}" for k_ in names])
ax[0].invert_yaxis(); ax[0].set_xlabel("precision (%)"); ax[0].set_title("clipped n-gram precisions")
# the keys sit outside the panels (above the first, under the second), where a phone's narrow
# column stacks the panels without a key landing on a neighbour's title
fig.legend(*ax[0].get_legend_handles_labels(), loc="outside upper left", ncols=2, fontsize=8)
for k_, colour in (("greedy", "tab:gray"), ("beam 4", "tab:purple")):
    ax[1].hist(boot[k_], bins=30, alpha=0.6, label=k_, color=colour)
    ax[1].axvline(hand[k_], color=colour, ls=":")
ax[1].set_xlabel("corpus BLEU of a resample"); ax[1].set_ylabel("resamples")
ax[1].yaxis.set_major_locator(MaxNLocator(steps=[1, 2, 2.5, 5, 10], prune="lower"))   # no 0 in the corner
ax[1].set_title(f"bootstrap: {len(test)} sentences, {N_BOOT} resamples")
fig.legend(*ax[1].get_legend_handles_labels(), loc="outside lower right", ncols=2, fontsize=8)
fig.tight_layout(); show_figure(fig, "16_bleu.png")

# %% [markdown]
# On a test set of this size one BLEU point is well inside the noise; the WMT 2014
# test sets the paper uses have a few thousand sentences, which narrows the interval
# (it shrinks roughly like one over the square root of the number of sentences) but
# does not remove it. Differences of a few tenths, as between some rows of Table 2,
# are at the edge of what one test set can resolve.
#
# ## 6. Table 2's BLEU column and the English-French setup
#
# | model | EN-DE BLEU | EN-FR BLEU |
# |---|---|---|
# | Transformer (base model) | 27.3 | 38.1 |
# | Transformer (big) | 28.4 | 41.8 |
#
# The two columns come from different data (section 5.1):
#
# * **English-German**: WMT 2014, about 4.5 million sentence pairs, encoded with
#   byte-pair encoding into a shared source-target vocabulary of about 37000 tokens
#   (lesson 13);
# * **English-French**: WMT 2014, 36 million sentences, split into a
#   32000-token word-piece vocabulary (word pieces are a close relative of BPE:
#   the pieces are chosen to maximise the likelihood of the training text rather
#   than by merge frequency).
#
# %%
paper = {"EN-DE": dict(sentences=4.5e6, vocab=37000, base=27.3, big=28.4),
         "EN-FR": dict(sentences=36e6, vocab=32000, base=38.1, big=41.8)}
for pair, d in paper.items():
    print(f"{pair}: {d['sentences'] / 1e6:g} M training sentences, {d['vocab']:,} tokens in the vocabulary; "
          f"big - base = {d['big'] - d['base']:+.1f} BLEU")
print(f"EN-FR has {paper['EN-FR']['sentences'] / paper['EN-DE']['sentences']:.0f} times the training sentences")

# %% [markdown]
# The scores are not comparable *across* the columns: French is closer to English in
# word order and morphology, and the French set has many times the training data
# (printed above), so the same model scores far higher there. Within a column they are: the big model
# gains more than a point over the base model on each, and section 6.1 notes that the
# big English-French model used dropout 0.1 instead of 0.3. A gain of a point on
# thousands of sentences is a real difference; a gain of a point on our toy test set
# is not (the bootstrap above).
#
# ## Check
#
# These fail if our BLEU or chrF differ from sacreBLEU's, if corpus BLEU were an
# average of sentence scores, if the brevity penalty did not catch the truncated
# hypotheses, if clipping did not stop the repeated word, or if the library's
# `attn.evaluate` scored differently from the computation written out here.
#
# How far a model gets depends on its training: the trained model's BLEU against
# copying and the width of its bootstrap interval is asserted in full mode; quick mode
# trains too few steps to promise it, and its figures above are printed only.

# %%
for name in systems:
    assert abs(hand[name] - sacre[name]) < 1e-9, f"{name}: BLEU by hand {hand[name]} != sacreBLEU {sacre[name]}"
    assert abs(chrf_hand[name] - chrf_sacre[name]) < 1e-9, f"{name}: chrF {chrf_hand[name]} != {chrf_sacre[name]}"
assert abs(library.bleu - hand["greedy"]) < 1e-9, "on the stored text 13a finds our tokens: the same BLEU"
assert abs(ways["plain text, 13a tokeniser, lower-cased"] - hand["greedy"]) < 1e-9, \
    "13a on lower-cased plain text recovers our tokens"
assert any(abs(sent_mean[n] - hand[n]) > 0.5 for n in systems), "corpus BLEU is not the mean of sentence BLEU"
s_half = sum(stats(tokenize(h), r) for h, r in zip(systems["half of the reference"], refs))
assert (s_half[:4] == s_half[4:8]).all() and hand["half of the reference"] < 50, "only the brevity penalty holds it"
assert stats("the the the the the the the".split(), ref)[0] == 2, "clipping: 'the' occurs twice in the reference"
if not QUICK:                                         # what the trained model scores: full mode's claims
    assert ways["plain text, no tokeniser, cased"] < ways["plain text, 13a tokeniser, cased"] < hand["greedy"], ways
    assert hand["greedy"] > hand["copy source"] + 10 and lo < hand["greedy"] < hi and one_word > 0
    assert hi - lo > 1, f"one BLEU point is inside the noise of {len(test)} sentences: the interval is {hi - lo:.2f} wide"
assert lo <= hand["greedy"] <= hi, (lo, hand["greedy"], hi)
print(f"Check passed in {time.time() - T0:.1f} s: BLEU and chrF by hand equal sacreBLEU's on all "
      f"{len(systems)} systems; corpus BLEU {hand['greedy']:.2f} vs sentence mean {sent_mean['greedy']:.2f}; "
      f"the same output scores {min(ways.values()):.2f}-{max(ways.values()):.2f} depending on tokenisation and "
      f"case; the bootstrap interval is {hi - lo:.2f} points wide.")

# %% [markdown]
# ## Questions
#
# 1. A hypothesis repeats the reference's most frequent word as many times as the
#    reference has words. What are its clipped unigram precision and its brevity
#    penalty?
#
#    <details><summary>Answer</summary>
#
#    Its clipped unigram precision is the count of that word in the reference divided by
#    the reference's length (the matches are clipped to the reference's count). Its
#    length equals the reference's, so the brevity penalty is $\mathrm{BP} = 1$.
#
#    </details>
#
# 2. Why is corpus BLEU not the mean of the sentence BLEU scores, and which of the two
#    punishes a single sentence with no matching 4-gram harder?
#
#    <details><summary>Answer</summary>
#
#    Corpus BLEU adds up the clipped $n$-gram counts of all sentences before taking the
#    precisions and their geometric mean, and applies one brevity penalty to the total
#    lengths; the mean of sentence scores does not. A sentence with no matching 4-gram
#    has $p_4 = 0$; unsmoothed, its sentence BLEU would be 0 (a geometric mean with a
#    zero factor is zero). The `sentence_score` used above smooths a zero count, so such
#    a sentence scores low but not 0. Either way the mean of sentence BLEU punishes it
#    much harder: in corpus BLEU its missing 4-grams only lower the totals a little.
#
#    </details>
#
# 3. Two papers report BLEU scores half a point apart on the same test set. What would
#    you need to know before concluding that the first system is better?
#
#    <details><summary>Answer</summary>
#
#    How the BLEU was computed (tokenisation, casing, which tool and settings, one
#    reference or several), that the test set and preprocessing were the same, and how
#    much a score varies between training runs or seeds: half a point can be within that
#    noise. A significance test or several runs would tell.
#
#    </details>

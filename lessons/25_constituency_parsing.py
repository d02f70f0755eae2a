# %% [markdown]
# # Lesson 25: constituency parsing as translation (section 6.3, Table 4)
#
# Section 6.3 asks whether the Transformer generalises beyond translation, and
# answers with **English constituency parsing**: given a sentence, produce its
# phrase-structure tree, noun phrases inside verb phrases inside clauses. The
# output is long, and it is strongly constrained: every bracket opened must be
# closed, in order, and the tree's leaves must be exactly the sentence's words.
#
# The trick (Vinyals et al. 2015, "Grammar as a Foreign Language", which section 6.3
# follows) is to *linearise* the tree into a sequence of tokens and train an ordinary
# sequence-to-sequence model to "translate" the sentence into it:
#
#     the dog saw a cat   ->   (S (NP DT NN )NP (VP VBD (NP DT NN )NP )VP )S
#
# This lesson does it at toy scale: a small grammar generates sentences and their
# trees, the translator of lesson 14 (`attn.train`, unchanged) learns to parse them,
# and a bracket F1 computed here (the measure of Table 4) scores the result.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import random
import shutil
import time
from collections import Counter

import numpy as np

from attn import backend as B
from attn.decode import EXTRA_LENGTH
from attn.evaluate import source_ids, translate
from attn.train import train
from attn.training.config import config_from_argv
from attn.translate import load_translator

B.set_backend("numpy")                                       # lessons run on the CPU
T0 = time.time()

# %% [markdown]
# ## 1. A grammar, its trees, and their linearisation
#
# A small probabilistic grammar: a sentence `S` is a noun phrase and a verb phrase;
# a noun phrase is a determiner, perhaps an adjective, and a noun, perhaps followed
# by an `of` phrase (`NP -> NP PP`); a verb phrase is a verb with an object, or
# without one, or a verb of saying with a clause (`SBAR -> that S`, recursion), and
# perhaps a place phrase (`in`, `near`, `behind`) attached to the verb phrase.
# Attachment is decided by the preposition (`of` attaches to the noun, the others to
# the verb), so a parser *can* get every tree right, but only by reading the words:
# the tree's shape depends on which preposition occurs, and where.
#
# The linearisation writes the tree depth first: an opening bracket with the label,
# the children, a closing bracket with the label again. The leaves are the words'
# part-of-speech tags, not the words (as Vinyals et al. do, with one shared tag), so
# the output vocabulary is small and the model must also tag.

# %%
LEX = {"DT": ["the", "a"], "JJ": ["big", "small", "old", "red", "happy", "green"],
       "NN": ["dog", "cat", "man", "king", "queen", "garden", "book", "car", "house", "teacher"],
       "VT": ["saw", "found", "liked", "called", "bought"], "VI": ["slept", "sang", "laughed"],
       "VS": ["said", "thought"], "P": ["in", "near", "behind"]}


def noun_phrase(r, depth):
    kids = [("DT", r.choice(LEX["DT"]))]
    if r.random() < 0.4:
        kids.append(("JJ", r.choice(LEX["JJ"])))
    node = ("NP", kids + [("NN", r.choice(LEX["NN"]))])
    if depth < 2 and r.random() < 0.25:
        node = ("NP", [node, ("PP", [("IN", "of"), noun_phrase(r, depth + 1)])])
    return node


def verb_phrase(r, depth):
    u = r.random()
    if depth < 1 and u < 0.2:
        kids = [("VBD", r.choice(LEX["VS"])), ("SBAR", [("IN", "that"), sentence(r, depth + 1)])]
    elif u < 0.75:
        kids = [("VBD", r.choice(LEX["VT"])), noun_phrase(r, depth + 1)]
    else:
        kids = [("VBD", r.choice(LEX["VI"]))]
    if r.random() < 0.3:
        kids.append(("PP", [("IN", r.choice(LEX["P"])), noun_phrase(r, depth + 1)]))
    return ("VP", kids)


def sentence(r, depth=0):
    return ("S", [noun_phrase(r, depth), verb_phrase(r, depth)])


def words(tree):
    label, kids = tree
    return [kids] if isinstance(kids, str) else [w for k in kids for w in words(k)]


def linearise(tree):
    label, kids = tree
    if isinstance(kids, str):                                    # a pre-terminal: its tag is the leaf
        return [label]
    return [f"({label}"] + [t for k in kids for t in linearise(k)] + [f"){label}"]


r = random.Random(0)
for _ in range(3):
    t = sentence(r)
    print(" ".join(words(t)), "\n   ->", " ".join(linearise(t)))

# %% [markdown]
# ## 2. Bracket F1
#
# Parsers are scored by their **labelled brackets** (the EVALB measure behind
# Table 4): every constituent above the tags is a triple (label, first word, one past
# the last word). Precision is the fraction of the predicted constituents that are in
# the gold tree, recall the fraction of the gold constituents that were predicted,
# and F1 their harmonic mean, counted over the whole test set. Reading the triples
# back from a linearised output needs no grammar: a stack of open brackets, and a
# position that advances at every leaf. An output whose brackets do not balance
# still gets the constituents it did close.

# %%
def constituents(tokens):
    """Labelled spans (label, start, end) of a linearised tree, tolerant of bad bracketing."""
    out, stack, pos = [], [], 0
    for tok in tokens:
        if tok.startswith("("):
            stack.append((tok[1:], pos))
        elif tok.startswith(")"):
            if stack:
                label, start = stack.pop()
                out.append((label, start, pos))
        else:
            pos += 1
    return out


def well_formed(tokens, n_words):
    depth, leaves, stack = 0, 0, []
    for tok in tokens:
        if tok.startswith("("):
            stack.append(tok[1:])
        elif tok.startswith(")"):
            if not stack or stack.pop() != tok[1:]:
                return False
        else:
            leaves += 1
    return not stack and leaves == n_words


def bracket_f1(predicted, gold):
    """Corpus labelled precision, recall and F1 (%) of lists of token lists."""
    match = n_pred = n_gold = 0
    for p, g in zip(predicted, gold):
        cp, cg = Counter(constituents(p)), Counter(constituents(g))
        match += sum((cp & cg).values())
        n_pred += sum(cp.values())
        n_gold += sum(cg.values())
    prec, rec = match / max(n_pred, 1), match / max(n_gold, 1)
    return 100 * prec, 100 * rec, 200 * prec * rec / max(prec + rec, 1e-12)


gold_example = linearise(sentence(random.Random(5)))
print(" ".join(gold_example))
print("constituents:", constituents(gold_example))
print("F1 of the tree against itself:", bracket_f1([gold_example], [gold_example]))

# %% [markdown]
# ## 3. Training the translator to parse
#
# The data: sentences of at most a maximum length (printed), each with its linearised
# tree, split into training, validation and test sets with no test sentence among the
# training ones. The model is the translator of lesson 14 trained by `attn.train`:
# same code, same recipe, one shared vocabulary for the words and the tree tokens;
# only the files differ, and the learning rate: half the paper's schedule (the
# factor is printed with the command). The outputs are long and very regular, and at
# the larger rate of lesson 14 this small model settles on the most common tree
# shapes and stops reading the sentence. (The library's word tokeniser splits brackets off words, so
# the files spell `(NP` as `NP_` and `)NP` as `_NP`; the lesson converts back.)
#
# Two baselines that need no learning tell us what the F1 numbers mean: a **flat**
# parse (one `S` over all words, every word a leaf), and the gold trees' most common
# **shape** applied to every sentence of that length.

# %%
N_TRAIN, N_TEST = (3000, 150) if QUICK else (20000, 500)
MAX_WORDS = 14 if QUICK else 20
STEPS = quick_steps(900) if QUICK else 4000
r = random.Random(1)
seen, data = set(), []
while len(data) < N_TRAIN + 50 + N_TEST:
    t = sentence(r)
    w = words(t)
    if len(w) <= MAX_WORDS and " ".join(w) not in seen:
        seen.add(" ".join(w))
        data.append((w, linearise(t)))
splits = {"train": data[:N_TRAIN], "val": data[N_TRAIN:N_TRAIN + 50], "test": data[N_TRAIN + 50:]}
data_dir, run_dir = OUT / "25_data", OUT / "25_run"
shutil.rmtree(run_dir, ignore_errors=True)
data_dir.mkdir(parents=True, exist_ok=True)


def to_file(tok):
    """The library's word tokeniser splits brackets off words: "(NP" is written NP_, ")NP" _NP."""
    return tok[1:] + "_" if tok.startswith("(") else "_" + tok[1:] if tok.startswith(")") else tok


def from_file(tok):
    return "(" + tok[:-1] if tok.endswith("_") else ")" + tok[1:] if tok.startswith("_") else tok


for split, pairs in splits.items():
    (data_dir / f"{split}.words").write_text("".join(" ".join(w) + "\n" for w, _ in pairs), encoding="utf-8")
    (data_dir / f"{split}.tree").write_text("".join(" ".join(map(to_file, t)) + "\n" for _, t in pairs),
                                            encoding="utf-8")
longest_extra = max(len(t) - len(w) for w, t in data)
print(f"{len(data)} distinct sentences of at most {MAX_WORDS} words; a tree is on average "
      f"{np.mean([len(t) / len(w) for w, t in data]):.1f} times as many tokens as its sentence, "
      f"at most {longest_extra} more (the decoder's limit is input + {EXTRA_LENGTH})")

argv = ["--data", os.path.relpath(data_dir), "--src", "words", "--tgt", "tree", "--out", os.path.relpath(run_dir), "--backend", "numpy",
        "--seed", "0", "--d-model", "64", "--heads", "4", "--d-ff", "128", "--layers", "2",
        "--dropout", "0.0" if QUICK else "0.1", "--warmup", "300", "--lr-factor", "0.5", "--steps", str(STEPS),
        "--max-tokens", "800",
        "--eval-every", str(STEPS), "--average", "0", "--minutes", "0", "--bleu-sentences", "0", "--quiet"]
print("attn-train " + " ".join(argv[argv.index("--seed"):argv.index("--max-tokens") + 2]))
metrics = train(config_from_argv(argv))
model, vocab = load_translator(run_dir / "checkpoint.npz")
print(f"trained {metrics['steps']} steps in {metrics['train_seconds']:.1f} s; "
      f"validation loss {metrics['val_loss']:.3f}")

# %% [markdown]
# ## 4. Parsing the test set
#
# Decode with greedy search and with beam search. Section 6.3 used a beam of 21 and
# $\alpha = 0.3$ for parsing; a beam of that width costs more than this quick run
# should, so we use a narrower beam (printed) with the paper's $\alpha$.

# %%
BEAM = 4 if QUICK else 21
test = splits["test"]
gold = [t for _, t in test]
preds = {}
for name, beam in (("greedy", 1), (f"beam {BEAM}", BEAM)):
    out = translate(model, vocab, [w for w, _ in test], beam_size=beam, alpha=0.3)
    preds[name] = [[from_file(t) for t in o.tgt_tokens] for o in out]
preds["flat"] = [["(S"] + [t for t in g if not t.startswith(("(", ")"))] + [")S"] for g in gold]
shape_by_length = {}
for w, t in splits["train"]:
    shape_by_length.setdefault(len(w), Counter())[" ".join(t)] += 1
preds["most common shape"] = [shape_by_length[len(w)].most_common(1)[0][0].split() if len(w) in shape_by_length
                              else ["(S"] + ["NN"] * len(w) + [")S"] for w, _ in test]
scores = {name: bracket_f1(p, gold) for name, p in preds.items()}
valid = {name: np.mean([well_formed(p, len(w)) for p, (w, _) in zip(ps, test)]) for name, ps in preds.items()}
exact = {name: np.mean([p == g for p, g in zip(ps, gold)]) for name, ps in preds.items()}
print(f"{'parser':<20} {'precision':>9} {'recall':>7} {'F1':>6} {'well-formed':>12} {'exact':>6}")
for name, (p, rc, f) in scores.items():
    print(f"{name:<20} {p:9.1f} {rc:7.1f} {f:6.1f} {valid[name]:12.0%} {exact[name]:6.0%}")
for i in range(3):
    print(f"\n{' '.join(test[i][0])}\n  gold:   {' '.join(gold[i])}\n  greedy: {' '.join(preds['greedy'][i])}")

# %% [markdown]
# Where does the parser go wrong? F1 by sentence length, and by the depth of
# nesting of the gold tree:

# %%
def depth(tokens):
    d = m = 0
    for t in tokens:
        d += t.startswith("(") - t.startswith(")")
        m = max(m, d)
    return m


by_len = {}
for (w, g), p in zip(test, preds["greedy"]):
    by_len.setdefault(min(len(w) // 4 * 4, 12), []).append((p, g))
rows = sorted((k, bracket_f1([p for p, _ in v], [g for _, g in v])[2], len(v)) for k, v in by_len.items())
for k, f, n in rows:
    print(f"sentences of {k}-{k + 3} words: F1 {f:5.1f} ({n} sentences)")
depths = sorted(set(depth(g) for g in gold))
f_depth = [bracket_f1([p for p, g in zip(preds["greedy"], gold) if depth(g) == d],
                      [g for g in gold if depth(g) == d])[2] for d in depths]
print("F1 by nesting depth of the gold tree: " + ", ".join(f"depth {d}: {f:.1f}" for d, f in zip(depths, f_depth)))

fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
names = list(scores)
ax[0].bar(names, [scores[n][2] for n in names], color=["tab:blue", "tab:orange", "0.6", "0.75"])
for i, n in enumerate(names):
    ax[0].text(i, scores[n][2] + 1, f"{scores[n][2]:.1f}", ha="center")
ax[0].set_ylabel("bracket F1 (%)"); ax[0].set_ylim(0, 105)
ax[0].set_title(f"{len(test)} test sentences ({'quick' if QUICK else 'full'} mode)")
ax[1].plot(depths, f_depth, "o-")
ax[1].set_xlabel("nesting depth of the gold tree"); ax[1].set_ylabel("greedy F1 (%)")
ax[1].set_title("F1 by the gold tree's depth")
fig.tight_layout(); show_figure(fig, "25_parsing.png")

# %% [markdown]
# ## 5. The paper's setup (section 6.3) and Table 4
#
# The paper trained a 4-layer Transformer with `d_model = 1024` on the Wall Street
# Journal portion of the Penn Treebank, about 40K training sentences, and also in a
# semi-supervised setting with about 17M sentences (high-confidence parses of other
# text and the BerkeleyParser corpora). The vocabulary was 16K tokens for the WSJ-only
# setting and 32K for the semi-supervised one. It changed little else: dropout on
# attention and residuals, learning rates and beam size tuned on the development
# set, all other parameters unchanged from the English-to-German base model. At
# inference the maximum output length was input length + 300 (a tree is several
# times longer than its sentence, as above), with a beam of 21 and $\alpha = 0.3$.
#
# Table 4's results on section 23 of the WSJ, in F1: **91.3** trained on the WSJ
# only, **92.7** semi-supervised. In the paper's words, better than all previously
# reported models except the recurrent neural network grammar of Dyer et al. (91.7
# trained on the WSJ only, 93.3 as a generative model), and far above the earlier
# sequence-to-sequence parser of Vinyals et al. on the same data (88.3), without
# task-specific tuning.
#
# Our toy version shows the same mechanism: nothing in the model knows about
# brackets, yet after full mode's training its outputs are almost always well-formed
# trees with the right number of leaves, learned from examples alone, and its F1 is far
# above what a parse that ignores the sentence achieves. Quick mode trains for a few
# hundred steps only: how far its model gets (the table above) depends on the machine's
# arithmetic, and it may still write malformed trees.
#
# ## Check
#
# These fail if the F1 computation were wrong (a tree against itself, a flat parse),
# if the decoder did not read the encoder's output (two sentences, one first distribution),
# if full mode's model did not learn to parse (F1 near the baselines, malformed trees), or
# if the linearisation lost information (each tree's leaves are its sentence's tags,
# one per word).

# %%
assert bracket_f1([gold_example], [gold_example])[2] == 100.0
assert all(len([t for t in g if not t.startswith(("(", ")"))]) == len(w) for w, g in data)
assert all(well_formed(g, len(w)) for w, g in data)
flat_p, flat_r, _ = scores["flat"]
assert flat_p == 100.0 and flat_r < 50, "a flat parse's one bracket (S over everything) is always right"
f_greedy = scores["greedy"][2]
# Whatever its training made of it, the decoder reads the sentence: two test sentences give
# two distributions over the first output symbol (an untrained model's too).
first = [B.to_host(model.forward(B.to_device(np.array([source_ids(vocab, w)])), B.to_device(np.array([[1]])))[0])
         for w, _ in test[:2]]
reads = float(np.abs(first[0] - first[1]).max())
assert reads > 1e-6, "two sentences, the same first output distribution: the decoder never sees the encoder's output"
if not QUICK:                                         # how good a model is: full mode's only
    assert f_greedy > scores["most common shape"][2] + 20 and f_greedy > 70, scores
    assert valid["greedy"] > 0.8, f"only {valid['greedy']:.0%} of greedy outputs are well-formed trees"
assert 0 <= f_greedy <= 100 and 0 <= valid["greedy"] <= 1, (f_greedy, valid)
print(f"Check passed in {time.time() - T0:.1f} s: bracket F1 greedy {f_greedy:.1f}, beam "
      f"{scores[f'beam {BEAM}'][2]:.1f}, against {scores['most common shape'][2]:.1f} for the most common shape and "
      f"{scores['flat'][2]:.1f} for a flat parse; {valid['greedy']:.0%} of outputs are well-formed trees; two "
      f"sentences' first logits differ by up to {reads:.2g}"
      + (" (the model's quality is asserted in full mode only)." if QUICK else "."))

# %% [markdown]
# ## Questions
#
# 1. Why do the leaves of the linearised tree need to match the sentence's words one
#    for one, and what happens to the bracket F1 of an output with one leaf too many?
#
#    <details><summary>Answer</summary>
#
#    The tree is scored against the sentence's words by bracket spans over word
#    positions, so a linearised tree must have exactly one leaf per word to be read as a
#    tree of this sentence. With one leaf too many the output is not a well-formed tree
#    of the sentence (the lesson's table counts those), and every constituent that closes
#    after the extra leaf has its span shifted by one word, so it matches no gold
#    constituent: the F1 loses all of them, while those closed before the extra leaf
#    still count.
#
#    </details>
#
# 2. The flat parse has a perfect precision and yet a low F1. Why?
#
#    <details><summary>Answer</summary>
#
#    The flat parse has few brackets (only the whole sentence), and that bracket is in
#    every gold tree, so all its brackets are right: precision is perfect. But it finds
#    almost none of the gold brackets, so its recall is low, and F1, the harmonic mean,
#    is low too.
#
#    </details>
#
# 3. Why did the paper raise the maximum output length from input + 50 to input + 300
#    for parsing?
#
#    <details><summary>Answer</summary>
#
#    A linearised tree is much longer than its sentence: every word carries its tag and
#    the brackets open and close around phrases. An output limit of input + 50 would cut
#    long trees off before they close.
#
#    </details>

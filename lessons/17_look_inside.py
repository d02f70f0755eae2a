# %% [markdown]
# # Lesson 17: look inside a trained model (sections 3.2.3 and 4, "attention visualizations")
#
# A trained Transformer has three kinds of attention (section 3.2.3), and each one
# can be drawn as a matrix of weights, one row per query, summing to 1:
#
# * **encoder self-attention**: every source word looks at every source word;
# * **decoder self-attention**: every target position looks at itself and the
#   positions before it, never after (the look-ahead mask);
# * **encoder-decoder (cross) attention**: every target position looks at the source.
#
# The toy language reorders words: adjectives follow the noun, and the verb of a
# subordinate clause goes to its end (`data/make_toy.py`). So a
# word-by-word diagonal is *not* the right alignment, and we can see whether the
# cross-attention found the real one. We also measure it on the whole test set,
# against word links learned from the training corpus itself (section 3).
#
# **The model.** Set `ATTN_CHECKPOINT` to a checkpoint of the toy translator to look
# inside it: lesson 14's last model, `lessons/out/14_run/checkpoint.npz`, or
# `runs/toy/checkpoint.npz` from `attn-train`. Otherwise the lesson trains one with
# the readable `Transformer` (`--reference`, as lesson 14 does): in full mode
# lesson 14's 2 + 2-layer model, in quick mode a 1 + 1-layer model of width 32 on short
# sentences. `lessons/README.md` lists the measured times.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import shutil

import numpy as np

from attn import backend as B
from attn.data import BOS, EOS, PAD, TOY_DIR, read_parallel
from attn.evaluate import source_ids, translate
from attn.model import Transformer
from attn.plot import shown_path
from attn.train import train
from attn.training.config import config_from_argv
from attn.translate import load_translator

B.set_backend("numpy")
np.set_printoptions(precision=2, suppress=True, linewidth=130)

# %% [markdown]
# ## 1. A trained model

# %%
MAX_WORDS = 8 if QUICK else 25
checkpoint = os.environ.get("ATTN_CHECKPOINT")
if not checkpoint:
    data_dir, run_dir = OUT / "17_data", OUT / "17_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    sizes = (1500, 100) if QUICK else (10_000, 300)
    for split, n in zip(("train", "val"), sizes):
        pairs = [p for p in read_parallel(TOY_DIR, "en", "tk", split) if len(p[0].split()) <= MAX_WORDS][:n]
        for side, lang in ((0, "en"), (1, "tk")):
            (data_dir / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")
    shutil.copy(data_dir / "val.en", data_dir / "test.en")   # the trainer wants a test split; we use our own
    shutil.copy(data_dir / "val.tk", data_dir / "test.tk")
    if QUICK:
        size = ["--d-model", "32", "--heads", "4", "--d-ff", "64", "--layers", "1", "--dropout", "0.0",
                "--warmup", "200", "--steps", str(quick_steps(500)), "--max-tokens", "400",
                "--eval-every", str(quick_steps(500))]
    else:
        size = ["--d-model", "64", "--heads", "4", "--d-ff", "256", "--layers", "2", "--dropout", "0.1",
                "--warmup", "400", "--steps", "2000", "--max-tokens", "1500", "--eval-every", "2000"]
    train(config_from_argv(["--data", os.path.relpath(data_dir), "--out", os.path.relpath(run_dir), "--backend", "numpy",
                                     *size, "--lr-factor", "2", "--average", "0", "--minutes", "0",
                                     "--bleu-sentences", "0", "--quiet", "--reference"]))
    checkpoint = run_dir / "checkpoint.npz"
model, vocab = load_translator(checkpoint)
cfg = model.config
print(f"model from {shown_path(checkpoint)}: {cfg.n_encoder_layers} + {cfg.n_decoder_layers} layers, d_model {cfg.d_model}, "
      f"{cfg.n_heads} heads, {model.num_parameters():,} parameters")

# %% [markdown]
# ## 2. One sentence, all three attentions
#
# `we know that you like red cats .` becomes `savamos , ke mitsas rudan amas .`:
# the pronouns go (the verb ending says who), "red cats" becomes "cats red"
# (`mitsas rudan`, with agreement), and "like" moves to the end of the subordinate
# clause (`amas`). The links of the moved words, cats-mitsas, red-rudan and like-amas,
# cross. (`savamos` is "we know" in one word: it has two sources.)
#
# We run one teacher-forced forward pass (the decoder reads the reference, as in
# training) and take the weights of every attention sub-layer from the cache with
# `Transformer.attention_weights`. Row `j` of the cross-attention is the decoder
# position that *predicts* target word `j`.

# %%
en = "we know that you like red cats ."
tk = "savamos , ke mitsas rudan amas ."
gold = {"mitsas": "cats", "rudan": "red", "amas": "like"}    # the reordered target words -> their source word
src_tokens, tgt_tokens = en.split(), tk.split()
missing = [w for w in src_tokens + tgt_tokens if w not in vocab]
print("words unknown to this model:", missing or "none")
src = np.array([source_ids(vocab, src_tokens)])                                 # (1, S): ids + EOS
tgt = vocab.encode(tgt_tokens) + [EOS]
logits, cache = model.forward(src, np.array([[BOS] + tgt[:-1]]))                # no dropout
weights = Transformer.attention_weights(cache)
for name, w in weights.items():
    print(f"  {name:<22} {tuple(w.shape)}")
src_labels, tgt_labels = src_tokens + ["</s>"], tgt_tokens + ["</s>"]
dec_labels = ["<s>"] + tgt_tokens                                                # the decoder's inputs
predicted = [vocab.itos[i] for i in logits[0].argmax(-1)]
print("teacher-forced predictions:", " ".join(predicted))

# %%
L = cfg.n_decoder_layers
last = L - 1
fig, axes = plt.subplots(max(cfg.n_encoder_layers, L), 3, figsize=(16, 4.6 * max(cfg.n_encoder_layers, L)),
                         squeeze=False)
for layer in range(axes.shape[0]):
    panels = [(f"encoder.{layer}.self_attn", src_labels, src_labels, "encoder self-attention"),
              (f"decoder.{layer}.self_attn", dec_labels, dec_labels, "decoder self-attention (masked)"),
              (f"decoder.{layer}.cross_attn", src_labels, tgt_labels, "cross-attention: row j predicts word j")]
    for ax, (name, xl, yl, title) in zip(axes[layer], panels):
        if name not in weights:
            ax.axis("off"); continue
        w = weights[name][0].mean(0)                                             # heads averaged: (rows, cols)
        ax.imshow(w, cmap="viridis", vmin=0, vmax=1)
        ax.set_xticks(range(len(xl)), xl, rotation=60, ha="right"); ax.set_yticks(range(len(yl)), yl)
        ax.set_title(f"layer {layer}: {title}", fontsize=10)
        if "cross" in name:
            for j, t in enumerate(tgt_tokens):
                if t in gold:
                    ax.add_patch(plt.Rectangle((src_tokens.index(gold[t]) - 0.5, j - 0.5), 1, 1, fill=False,
                                               ec="red", lw=2))
fig.suptitle(f"'{en}' -> '{tk}'  (mean over {cfg.n_heads} heads; red boxes: the gold links)")
fig.tight_layout(); show_figure(fig, "17_attention_maps.png", dpi=100, bbox_inches="tight")

cross_last = weights[f"decoder.{last}.cross_attn"][0]                          # (H, T, S)
fig, axes = plt.subplots(1, cfg.n_heads, figsize=(4.2 * cfg.n_heads, 4.2), squeeze=False)
for h, ax in enumerate(axes[0]):
    ax.imshow(cross_last[h], cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(len(src_labels)), src_labels, rotation=60, ha="right")
    ax.set_yticks(range(len(tgt_labels)), tgt_labels if h == 0 else [""] * len(tgt_labels))
    ax.set_title(f"decoder layer {last} cross-attention, head {h}", fontsize=9)
fig.tight_layout(); show_figure(fig, "17_cross_heads.png", dpi=100)

peaks = {t: src_labels[int(cross_last.mean(0)[j].argmax())] for j, t in enumerate(tgt_tokens) if t in gold}
print("last layer, mean over heads: where each reordered word looks hardest:")
for t, s in peaks.items():
    print(f"  {t:<8} -> {s:<6} (gold: {gold[t]}) {'ok' if s == gold[t] else 'MISSED'}")

# %% [markdown]
# What to look for in `17_attention_maps.png`:
#
# * **Decoder self-attention** is lower-triangular: the upper triangle is exactly
#   zero, because the look-ahead mask sets those weights to 0 before anything else
#   happens (lesson 5). The first row, `<s>`, can only look at itself.
# * **Cross-attention** does not follow the diagonal. Look at the rows of
#   `mitsas` and `rudan`: they cross over (cats, then red), and `amas` reaches back
#   to "like" past both of them. The model learned the reordering, and its attention
#   shows where each output word comes from. (Punctuation and words without a
#   source counterpart, like the comma, often attend to the end-of-sentence token
#   or spread out: a "no-op" place to look.)
# * **Encoder self-attention** is harder to read: its job is to build context-aware
#   representations, not to align, and averaging the heads mixes patterns that each
#   head keeps apart. `17_cross_heads.png` shows the last layer's cross-attention
#   head by head: usually some heads align sharply and others do something else.
#
# The model's own translation, with beam search and the cross-attention the decoder
# used (the map `attn-translate --attention` draws with `attn.plot.plot_attention`; the
# run prints the two sentences):

# %%
result = translate(model, vocab, [en], beam_size=4, with_attention=True)[0]
print(f"beam 4: {result.text}   (reference: {tk})")
S, T = len(result.src_tokens), len(result.tgt_tokens)
fig, ax = plt.subplots(figsize=(2.0 + 0.45 * S, 1.5 + 0.4 * T))
im = ax.imshow(B.to_host(result.attention), cmap="viridis", vmin=0.0, aspect="auto", interpolation="nearest")
ax.set_xticks(range(S), result.src_tokens, rotation=90); ax.set_yticks(range(T), result.tgt_tokens)
ax.set_title("beam 4's cross-attention")
fig.colorbar(im, ax=ax, label="attention weight")
show_figure(fig, "17_cross_attention_beam.png")

# %% [markdown]
# ## 3. Alignment accuracy on the test set
#
# One sentence could be luck. Over the test set we need the right source word for
# each target word, without looking inside the corpus generator. We learn it from
# the training pairs, the way word aligners start: a word and its translation occur
# in the same sentence pairs. A tk word form `t` is linked to the English word `e`
# when `e` is in the source of at least `0.9` of the training pairs whose target has
# `t`, and no other English word is in even half of them (words in more than half
# of all sentences, like ".", do not count). A form that carries two English words
# has two candidates and is left out: `amas` comes with "you" and with a form of
# "like", `savamos` with "we" and "know". So are words with no fixed counterpart,
# such as the past marker `ba`.
#
# Then for every test target word with a link, whose English word occurs exactly
# once in the source, we ask: does the argmax of the cross-attention row that
# predicts it fall on that source word? Chance is one over the source length. The
# words that *moved* (their link crosses another link, as `mitsas`/`rudan` did
# above) are counted separately: a model that just looked along the diagonal would
# get them wrong.

# %%
from collections import Counter

lex_pairs = read_parallel(TOY_DIR, "en", "tk", "train")[:5000 if QUICK else 30_000]
c_en, c_tk, c_both = Counter(), Counter(), Counter()
for en_s, tk_s in lex_pairs:
    e_set, t_set = set(en_s.split()), set(tk_s.split())
    c_en.update(e_set); c_tk.update(t_set); c_both.update((e, t) for e in e_set for t in t_set)
everywhere = {e for e, c in c_en.items() if c > len(lex_pairs) / 2}
candidates = {}                                       # tk word -> English words beside it in half its pairs
for (e, t), c in c_both.items():
    if e not in everywhere and c_tk[t] >= 5 and c >= 0.5 * c_tk[t]:
        candidates.setdefault(t, []).append(e)
lexicon = {t: es[0] for t, es in candidates.items() if len(es) == 1 and c_both[es[0], t] >= 0.9 * c_tk[t]}
print(f"{len(lexicon)} tk word forms linked from {len(lex_pairs):,} training pairs; left out as ambiguous: "
      f"{sum(len(es) > 1 for es in candidates.values())}. For the example: "
      + ", ".join(f"{t} -> {lexicon.get(t, 'no link (' + ' / '.join(candidates.get(t, [])) + ')')}"
                  for t in tgt_tokens[:-1] if t != ","))

test = [p for p in read_parallel(TOY_DIR, "en", "tk", "test") if len(p[0].split()) <= MAX_WORDS][:150 if QUICK else 300]
H = cfg.n_heads
hits = {}                                             # (layer, head or "mean", category) -> [correct, total]
chance = {}
for en_s, tk_s in test:
    e, t = en_s.split(), tk_s.split()
    s_ids = np.array([source_ids(vocab, e)])
    t_ids = vocab.encode(t) + [EOS]
    _, c = model.forward(s_ids, np.array([[BOS] + t_ids[:-1]]))
    W = Transformer.attention_weights(c)
    links = {j: e.index(lexicon[w]) for j, w in enumerate(t) if w in lexicon and e.count(lexicon[w]) == 1}
    for j, i in links.items():
        cats = ["all linked words"]
        if any((j2 - j) * (i2 - i) < 0 for j2, i2 in links.items()):
            cats.append("words that moved (their link crosses another)")
        for cat in cats:
            ch = chance.setdefault(cat, [0.0, 0]); ch[0] += 1 / s_ids.shape[1]; ch[1] += 1
            for layer in range(L):
                a = W[f"decoder.{layer}.cross_attn"][0][:, j]                  # (H, S)
                for h in list(range(H)) + ["mean"]:
                    row = a.mean(0) if h == "mean" else a[h]
                    r = hits.setdefault((layer, h, cat), [0, 0]); r[0] += int(row.argmax() == i); r[1] += 1


def acc(layer, h, cat):
    r = hits[(layer, h, cat)]
    return r[0] / r[1]


cats = list(chance)
print(f"{len(test)} test sentences; argmax of the cross-attention on the gold source word:")
print(f"{'':<52}" + "".join(f"{'layer ' + str(l) + ' mean':>14}" for l in range(L))
      + f"{'best single head':>30}{'chance':>8}")
for cat in cats:
    best = max(((l, h) for l in range(L) for h in range(H)), key=lambda lh: acc(*lh, cat))
    print(f"{cat + ' (' + str(chance[cat][1]) + ')':<52}" + "".join(f"{acc(l, 'mean', cat):>14.0%}" for l in range(L))
          + f"{acc(*best, cat):>11.0%} (layer {best[0]} head {best[1]}){chance[cat][0] / chance[cat][1]:>8.0%}")
acc_all = acc(last, "mean", "all linked words")
chance_all = chance["all linked words"][0] / chance["all linked words"][1]

# %% [markdown]
# The last decoder layer's head-averaged cross-attention (what `greedy_decode` and
# `beam_search` return with `with_attention=True`) points at the right source word
# for the linked words, including the ones that moved, far above chance (the
# table above has this run's figures; quick mode's small model, trained for a few hundred
# steps, may be far from this). Nobody told the model about alignment: it
# is a by-product of learning to translate,
# which is why attention maps became the standard way to look inside these models.
# (With more than one decoder layer, compare the layers' columns in the table: the
# layers need not align equally well, and one of them may do something else.)
#
# Two cautions. Attention is where the model *looked*, not a proof of what it
# *used*: the value vectors, the residual stream and the other heads carry
# information too. And heads differ: for one word class a single head can beat the
# average of all heads, for another a different head does, and some heads attend to
# something else entirely, such as the end-of-sentence token. The verbs of the
# example are a good place to look: the tk verb ending encodes the person of the
# dropped subject pronoun, so a head may look at the *pronoun* ("you" for `amas`,
# "we" for `savamos`) while the others look at the verb itself. Where each head of
# the last layer looks, for this model:

# %%
for j, t in enumerate(tgt_tokens):
    if t in ("amas", "savamos"):
        print(f"  {t:<8} " + "  ".join(f"head {h} -> {src_labels[int(cross_last[h, j].argmax())]!r}"
                                       for h in range(cfg.n_heads)))

# %% [markdown]
# ## Check
#
# These fail if the library's attention were wrong: future positions leaking into
# the decoder's self-attention, weights that do not sum to 1 ($\sum_j w_{ij} \ne 1$), padding that receives
# weight, or (in full mode) a trained model whose cross-attention carries no alignment at all.

# %%
for name, w in weights.items():                       # the example sentence
    assert np.allclose(w.sum(-1), 1.0, atol=1e-5), f"{name}: attention rows must sum to 1"
    if name.startswith("decoder") and name.endswith("self_attn"):
        T = w.shape[-1]
        assert np.all(w[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0.0), \
            f"{name}: weights above the diagonal must be exactly zero"
        assert np.all(w[..., 0, 0] == 1.0), "the first decoder position can only attend to itself"
# a padded batch: two sentences of different lengths
pair_src = [source_ids(vocab, s.split()) for s in ("he sleeps .", en)]
pair_tgt = [vocab.encode(t.split()) + [EOS] for t in ("dormat .", tk)]
Sx, Tx = max(map(len, pair_src)), max(map(len, pair_tgt))
bs, bt = np.full((2, Sx), PAD), np.full((2, Tx), PAD)
for i in range(2):
    bs[i, :len(pair_src[i])] = pair_src[i]
    bt[i, :len(pair_tgt[i])] = [BOS] + pair_tgt[i][:-1]
_, cb = model.forward(bs, bt)
for name, w in Transformer.attention_weights(cb).items():
    assert np.allclose(w.sum(-1), 1.0, atol=1e-5), f"{name}: rows must sum to 1 in a padded batch"
    keys_pad = (bs if name.startswith("encoder") or "cross" in name else bt)[:, None, None, :] == PAD
    assert np.all(np.where(np.broadcast_to(keys_pad, w.shape), w, 0.0) == 0.0), f"{name}: padding got weight"
    if name.startswith("decoder") and name.endswith("self_attn"):
        assert np.all(np.triu(np.ones((Tx, Tx), bool), 1)[None, None] <= (w == 0)), f"{name}: looked ahead"
# How well the model aligns depends on how far its training got: full mode's model
# (trained above) must align far above chance, and it, or any model that translates the
# example correctly, must look at the right source words for the reordered words. Quick
# mode's small model (a few hundred steps; fewer still under ATTN_QUICK_WEAK=1) may not
# yet; for it these are only printed.
if not QUICK:
    assert acc_all > max(3 * chance_all, 0.4), \
        f"cross-attention alignment {acc_all:.0%} should be far above chance ({chance_all:.0%})"
trained_enough = result.tgt_tokens == tgt_tokens or not (QUICK or os.environ.get("ATTN_CHECKPOINT"))
if trained_enough:
    assert all(s == gold[t] for t, s in peaks.items()), f"reordered words should attend to their source: {peaks}"
print(f"Check passed: decoder self-attention is exactly zero above the diagonal, every row sums to 1, padding "
      f"gets no weight; cross-attention alignment {acc_all:.0%} vs chance {chance_all:.0%}"
      + (" (asserted far above chance in full mode only)" if QUICK else "")
      + (f"; the reordered words of the example peak on their source words." if trained_enough else
         f"; the example's reordered words peak on their source {sum(s == gold[t] for t, s in peaks.items())}"
         f" of {len(peaks)} times (not asserted for a quick-mode model that mistranslates the example)."))


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. What are the three kinds of attention in a trained Transformer, and which of
#    them can show the toy language's reordering?
#
#    <details><summary>Answer</summary>
#
#    Encoder self-attention, decoder (masked) self-attention and encoder-decoder (cross-)
#    attention. Only cross-attention connects target positions to source positions, so
#    only it can show the reordering between the two languages.
#
#    </details>
#
# 2. Why is a word-by-word diagonal not the right alignment for this corpus, and how
#    does the lesson score the cross-attention without hand-made alignments?
#
#    <details><summary>Answer</summary>
#
#    The toy language reorders words (the verb moves to the end of a subordinate clause,
#    as the lesson's figure shows), so target word $t$ does not come from source word
#    $t$. The lesson learns the dictionary of source word to target word from the
#    training pairs and checks whether the argmax of a target word's cross-attention row
#    falls on that source word, against chance.
#
#    </details>
#
# 3. Why is an attention map where the model looked, but not proof of what it used?
#
#    <details><summary>Answer</summary>
#
#    The weights say how the values were mixed, not how much the result mattered: a value
#    with a large weight may carry little the later layers use, residual connections
#    carry information around attention, and several heads and layers combine. Showing
#    what the model *used* needs an intervention: change or remove what it looked at and
#    see the output change.
#
#    </details>

# %% [markdown]
# # Lesson 24: a decoder-only language model, sampling, and the bridge to GPT
#
# The Transformer of the paper translates: an encoder reads the source, a decoder
# writes the target one token at a time, looking back at its own output through
# masked self-attention and at the source through encoder-decoder attention. Take
# the encoder away, and the cross-attention with it, and what remains is a model of
# *one* sequence: $P(y_t | y_1 \ldots y_{t-1})$, a **language model**. That is the whole
# architecture of GPT (Radford et al. 2018) and its successors: a stack of the
# paper's decoder layers without the middle sub-layer, trained to predict the next
# token of a large amount of text.
#
# This lesson takes the library's own language model (the paper's block configured without
# an encoder, `TransformerConfig(n_encoder_layers=0)`), looks at what it is made of, checks
# its backward pass against central differences, trains it on the toy language's sentences,
# and then generates text with it: greedy decoding, sampling with a temperature, and top-k
# sampling. Its layer, written from `attn.layers` by hand, is this lesson's exercise.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import math
import time
from collections import Counter

import numpy as np

from attn import backend as B
from attn.data import BOS, EOS, PAD, TOY_DIR, Vocab, read_parallel, tokenize
from attn.gradcheck import numerical_gradient, rel_error
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig
from attn.optim import Adam
from attn.sample import distribution

B.set_backend("numpy")                                       # lessons run on the CPU
T0 = time.time()

# %% [markdown]
# ## 1. The model: the decoder stack without cross-attention
#
# Input ids $y_0 \ldots y_{T-1}$ (with `y_0 = BOS`) are embedded (times $\sqrt{d_{\text{model}}}$,
# section 3.4) and get the sinusoidal positions of section 3.5. Each layer is the
# paper's decoder layer minus encoder-decoder attention: masked self-attention and
# the feed-forward network, each in a residual connection followed by layer norm
# (post-norm, as in the paper). The look-ahead mask (lesson 5) is what makes it a
# language model: position `t` sees only `y_0 .. y_t`, so its output can be trained
# to predict $y_{t+1}$ at every position of a sentence at once. The output is
# projected onto the vocabulary with the embedding matrix itself (the tied embedding
# of section 3.4), so the embedding gets gradients from both ends.
#
# In the library this is a configuration of the one block (`attn.block`): with no encoder
# there is no memory to attend to, so the block has no cross-attention part, and the decoder
# layer of `attn.model` (the translator's `decoder_layer_forward`) runs the two sub-layers
# that are left. One layer, for $x$ of shape (B, T, D):
#
# $$h = \mathrm{LayerNorm}_1(x + \mathrm{SelfAttention}(x, x, \mathit{causal}(T))), \qquad
#   \mathit{out} = \mathrm{LayerNorm}_2(h + \mathrm{FFN}(h))$$
#
# and its backward runs the same pieces in reverse: every residual connection adds the gradient
# of its skip path to that of its sub-layer, and $x$, read by the self-attention as its queries
# and as its keys and values, gets both gradients. The embedding matrix sums the gradient of the
# output projection and of the lookup. Writing that layer from `attn.layers` is the exercise at
# the end of the lesson. The parameters of a small model, and those of a translator of the same
# width, which has cross-attention (the library keeps the translator's names in both, so the
# feed-forward's norm, $\mathrm{LayerNorm}_2$ above, is `norm3`):

# %%
def language_model(V, d_model=64, n_heads=4, d_ff=128, n_layers=2, seed=0, dtype="float32"):
    """The library's decoder-only model: the paper's block with no encoder (and so no cross-attention)."""
    cfg = TransformerConfig(vocab_size=V, d_model=d_model, n_heads=n_heads, d_ff=d_ff, n_encoder_layers=0,
                            n_decoder_layers=n_layers, dropout=0.0)
    return Transformer(cfg, seed=seed, dtype=dtype)


tiny = language_model(13, d_model=8, n_heads=2, d_ff=12, n_layers=2, seed=1, dtype="float64")
layer0 = sorted({k.split(".")[2] for k in tiny.params if k.startswith("decoder.0.")})
translator_layer = sorted({k.split(".")[2] for k in Transformer(TransformerConfig(
    vocab_size=13, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=1, n_decoder_layers=1)).params
    if k.startswith("decoder.0.")})
print("the language model's parameters outside its layers:", ", ".join(k for k in tiny.params if not k.startswith("decoder.")))
print("a layer of the language model:", ", ".join(layer0))
print("a decoder layer of the translator:", ", ".join(translator_layer))

# %% [markdown]
# ## 2. Gradient check
#
# A new configuration of known layers is a new backward pass, and it is checked like every
# other: in float64, central differences of the loss with respect to every entry of
# every parameter of a tiny model, against what `backward` returns. The batch has
# padding, so the check also covers the masked keys and the ignored targets. Beside
# it, the invariant the look-ahead mask promises: a later token cannot change an
# earlier position's output.

# %%
r = np.random.default_rng(2)
ids = r.integers(4, 13, (3, 7))
ids[:, 0] = BOS
ids[1, 5:] = PAD
targets = np.concatenate([ids[:, 1:], np.full((3, 1), EOS)], axis=1)
targets[1, 4:] = PAD


def tiny_loss():
    return cross_entropy(tiny.forward(None, ids)[0], targets, 0.1)[0]


logits, cache = tiny.forward(None, ids)
_, dlogits = cross_entropy(logits, targets, 0.1)
grads = tiny.backward(dlogits, cache)
errors = {k: rel_error(grads[k], numerical_gradient(tiny_loss, v)) for k, v in tiny.params.items()}
worst = max(errors, key=errors.get)
print(f"{len(errors)} parameters, {tiny.num_parameters()} entries checked; "
      f"worst relative error {errors[worst]:.1e} ({worst})")

# The invariant the mask promises: a later token never changes an earlier position's logits.
changed = ids.copy()
changed[:, 4] = 4 + (changed[:, 4] - 3) % 9                  # another token at position 4
future_leak = float(np.abs(tiny.forward(None, changed)[0][:, :4] - logits[:, :4]).max())
print(f"changing the token at position 4 changes the logits at positions 0-3 by {future_leak:.1e}")

# %% [markdown]
# ## 3. Training on the toy language
#
# The corpus is the target side of the toy translation data (the made-up language of
# lesson 14), one sentence per line, with a word vocabulary. Every sentence becomes
# the input `BOS y_1 .. y_n` and the target `y_1 .. y_n EOS`: one forward pass
# trains all `n + 1` next-token predictions. The optimiser is the paper's (lesson 11):
# Adam with the warm-up schedule. No label smoothing here: we want the model's
# probabilities to be honest for sampling.
#
# To know what the loss means, compare with two models that need no training: a
# **unigram** model (each word's frequency, ignoring context) and a **bigram** model
# (the frequency of each word after the one before, with add-k smoothing). Perplexity
# is $\exp(\mathit{loss})$: the number of equally likely words the model is, on average, as
# uncertain as.

# %%
MAX_WORDS = 10 if QUICK else 16
N_SENT = 3000 if QUICK else 20000
STEPS = quick_steps(400) if QUICK else 2000
BATCH = 32
train_text = [t for _, t in read_parallel(TOY_DIR, "en", "tk", "train") if len(t.split()) <= MAX_WORDS][:N_SENT]
val_text = [t for _, t in read_parallel(TOY_DIR, "en", "tk", "val") if len(t.split()) <= MAX_WORDS][:300]
vocab = Vocab.build([tokenize(t) for t in train_text])
V = len(vocab)


def encode(texts):
    """Inputs (BOS + ids) and targets (ids + EOS), padded, for a list of sentences."""
    seqs = [vocab.encode(tokenize(t)) for t in texts]
    T = max(map(len, seqs)) + 1
    x, y = np.full((len(seqs), T), PAD), np.full((len(seqs), T), PAD)
    for i, s in enumerate(seqs):
        x[i, :len(s) + 1] = [BOS] + s
        y[i, :len(s) + 1] = s + [EOS]
    return x, y


train_seqs = [[BOS] + vocab.encode(tokenize(t)) + [EOS] for t in train_text]
uni = Counter(w for s in train_seqs for w in s[1:])
bi = Counter((a, b) for s in train_seqs for a, b in zip(s, s[1:]))
prev = Counter(a for s in train_seqs for a in s[:-1])
K_SMOOTH = 0.1


def baseline_ppl(texts):
    lp_uni, lp_bi, n = 0.0, 0.0, 0
    n_uni = sum(uni.values())
    for t in texts:
        s = [BOS] + vocab.encode(tokenize(t)) + [EOS]
        for a, b in zip(s, s[1:]):
            lp_uni += math.log((uni[b] + K_SMOOTH) / (n_uni + K_SMOOTH * V))
            lp_bi += math.log((bi[a, b] + K_SMOOTH) / (prev[a] + K_SMOOTH * V))
            n += 1
    return math.exp(-lp_uni / n), math.exp(-lp_bi / n)


lm = language_model(V, d_model=64, n_heads=4, d_ff=128, n_layers=2, seed=0)
opt = Adam(lm.params, d_model=64, warmup_steps=100, lr_factor=2.0)
val_x, val_y = encode(val_text)


def val_ppl():
    return math.exp(float(cross_entropy(lm.forward(None, val_x)[0], val_y, 0.0)[0]))


ppl_uni, ppl_bi = baseline_ppl(val_text)
ppl_start = val_ppl()
rng = np.random.default_rng(0)
losses, t_train = [], time.perf_counter()
for step in range(1, STEPS + 1):
    x, y = encode([train_text[j] for j in rng.integers(0, len(train_text), BATCH)])
    logits, cache = lm.forward(None, x)
    loss, dlogits = cross_entropy(logits, y, 0.0)
    opt.step(lm.backward(dlogits, cache))
    losses.append(float(loss))
t_train = time.perf_counter() - t_train
ppl_end = val_ppl()
print(f"{len(train_text)} training sentences, vocabulary {V}, model {lm.num_parameters():,} parameters; "
      f"{STEPS} steps of {BATCH} sentences in {t_train:.1f} s")
print(f"validation perplexity: untrained {ppl_start:.1f}, unigram {ppl_uni:.1f}, bigram {ppl_bi:.1f}, "
      f"the trained model {ppl_end:.2f}")

# %% [markdown]
# The untrained model's perplexity is of the order of the vocabulary's size: it
# knows nothing yet. The trained one is less uncertain than even the word-pair counts:
# the toy grammar's agreement and word order span more than two words, and masked
# self-attention sees the whole prefix.
#
# How much smaller is this model than a translator of the same width? No encoder
# stack, and each layer one attention sub-layer instead of two:

# %%
same_size = Transformer(TransformerConfig(vocab_size=V, d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2,
                                          n_decoder_layers=2))
print(f"encoder-decoder of the same width and depth: {same_size.num_parameters():,} parameters; "
      f"decoder-only: {lm.num_parameters():,}")

# %% [markdown]
# ## 4. Generating: greedy, temperature, top-k
#
# To generate, start from `BOS`, compute the distribution of the next token, choose
# one, append it, repeat until `EOS` (each step here re-runs the model on the
# prefix; lesson 15's key/value cache applies unchanged). How to choose:
#
# * **greedy**: the most probable token. Deterministic: from the same prompt it
#   always writes the same sentence;
# * **sampling with temperature $\tau$**: draw from $\mathrm{softmax}(\mathit{logits} / \tau)$. At
#   $\tau = 1$ this is the model's own distribution; at $\tau < 1$ it is sharpened
#   towards the most probable tokens, at $\tau > 1$ flattened towards uniform;
# * **top-k**: keep the `k` most probable tokens, renormalise, draw. It cuts off the
#   long tail of unlikely tokens, each rare but together likely to be hit somewhere
#   in a long text.
#
# The library's `attn.sample.distribution` applies the temperature and top-k (and top-p,
# lesson 30) to one position's logits; `attn-generate` draws from it, and so does this lesson.
#
# For each, we generate a set of sentences and measure how many are distinct, how
# many are copies of a training sentence, and what fraction of their word pairs
# never occur in the training text (a rough measure of ungrammatical output).

# %%
def generate(strategy, rng, prompt=(), tau=1.0, k=None, max_len=30):
    """One sentence: the generated ids (no BOS/EOS) and whether every draw lay within the top k."""
    seq, within_k = [BOS] + list(prompt), True
    while len(seq) < max_len:
        logits = lm.forward(None, np.array([seq]))[0][0, -1].astype(np.float64)
        logits[[PAD, BOS]] = -np.inf
        if strategy == "greedy":
            nxt = int(logits.argmax())
        else:
            prob = distribution(logits, temperature=tau, top_k=k)        # what attn-generate draws from
            nxt = int(rng.choice(len(prob), p=prob))
            within_k &= k is None or logits[nxt] >= np.sort(logits)[-k]
        if nxt == EOS:
            break
        seq.append(nxt)
    return seq[1:], within_k


train_set = set(" ".join(tokenize(t)) for t in train_text)
seen_pairs = set((a, b) for s in train_seqs for a, b in zip(s, s[1:]))
STRATEGIES = {"greedy": dict(strategy="greedy"), "tau 0.5": dict(strategy="sample", tau=0.5),
              "tau 1.0": dict(strategy="sample", tau=1.0), "tau 1.5": dict(strategy="sample", tau=1.5),
              "top-5, tau 1.0": dict(strategy="sample", tau=1.0, k=5)}
N_GEN = 25 if QUICK else 100
SEEDS = (0, 1, 2)
stats = {name: [] for name in STRATEGIES}
examples, topk_ok = {}, True
for seed in SEEDS:
    for name, kw in STRATEGIES.items():
        rng = np.random.default_rng(seed)
        sents = [generate(rng=rng, **kw) for _ in range(N_GEN)]
        topk_ok &= all(ok for _, ok in sents)
        words = [" ".join(vocab.decode(s)) for s, _ in sents]
        pairs = [(a, b) for s, _ in sents for a, b in zip([BOS] + s, s + [EOS])]
        stats[name].append(dict(distinct=len(set(words)) / N_GEN, copies=np.mean([w in train_set for w in words]),
                                unseen=np.mean([p not in seen_pairs for p in pairs]),
                                length=np.mean([len(s) for s, _ in sents])))
        examples.setdefault(name, words[:3])
print(f"{N_GEN} sentences per strategy and seed; ranges over seeds {SEEDS}")
print(f"{'strategy':<16} {'distinct':>13} {'copies of training':>19} {'unseen word pairs':>18} {'mean length':>12}")
for name, rows in stats.items():
    col = {m: (min(r[m] for r in rows), max(r[m] for r in rows)) for m in rows[0]}
    print(f"{name:<16} {col['distinct'][0]:5.0%} - {col['distinct'][1]:4.0%} {col['copies'][0]:10.0%} - "
          f"{col['copies'][1]:4.0%} {col['unseen'][0]:9.1%} - {col['unseen'][1]:5.1%} "
          f"{col['length'][0]:6.1f} - {col['length'][1]:4.1f}")
for name, ex in examples.items():
    print(f"{name}:\n    " + "\n    ".join(ex))

# %% [markdown]
# The temperature moves the model between the two failure modes of generation: too
# low, and it repeats itself (greedy writes one sentence, again and again); too high,
# and it invents word pairs the language never uses. Top-k keeps the variety of
# sampling while refusing the tail. What the temperature does to one distribution,
# the model's first word after `BOS`:

# %%
first = lm.forward(None, np.array([[BOS]]))[0][0, -1].astype(np.float64)
first[[PAD, BOS]] = -np.inf
taus = (0.25, 0.5, 1.0, 1.5, 3.0)
entropy = {}
fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
TOP = 10                                                   # the most probable words, drawn
order = np.argsort(-first)[:TOP]
for i, tau in enumerate(taus):
    p = np.exp((first - first.max()) / tau)
    p /= p.sum()
    entropy[tau] = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    ax[0].bar(np.arange(TOP) + i * 0.16 - 0.32, p[order], 0.16, label=f"tau {tau}")
ax[0].set_xticks(range(TOP)); ax[0].set_xticklabels([vocab.itos[i] for i in order], rotation=60, fontsize=8)
ax[0].set_ylabel("probability"); ax[0].set_xlabel(f"the {TOP} likeliest first words")
ax[0].set_title("the first word, by temperature")
names = list(stats)
ax[1].bar(names, [np.mean([r["unseen"] for r in stats[n]]) * 100 for n in names], color="tab:red", alpha=0.7,
          label="unseen word pairs (%)")
ax[1].plot(names, [np.mean([r["distinct"] for r in stats[n]]) * 100 for n in names], "ko-", label="distinct (%)")
ax[1].set_title(f"generated sentences (mean over {len(SEEDS)} seeds)")
ax[1].tick_params(axis="x", labelsize=8)
# the keys sit outside the panels (above the first, under the second), where a phone's narrow
# column stacks the panels without a key landing on a neighbour's title
fig.legend(*ax[0].get_legend_handles_labels(), loc="outside upper left", ncols=2, fontsize=8)
fig.legend(*ax[1].get_legend_handles_labels(), loc="outside lower right", fontsize=8)
fig.tight_layout(); show_figure(fig, "24_sampling.png")
print("entropy of the first word (nats): " + ", ".join(f"tau {t}: {e:.2f}" for t, e in entropy.items()))

# %% [markdown]
# ## 5. A prompt, and the bridge to GPT
#
# A language model continues whatever prefix it is given: the *prompt* is simply the
# first tokens of the sequence. Here, sentences that must start with `ba`, the toy
# language's past-tense marker:

# %%
rng = np.random.default_rng(0)
prompt = vocab.encode(["ba"])
for _ in range(4):
    s, _ = generate("sample", rng, prompt=prompt, tau=0.7)
    print("   ", " ".join(vocab.decode(s)))

# %% [markdown]
# GPT is this model. What changed on the way to it, and on to its successors, is
# scale and a few details: learned positions, a smoother activation than ReLU (GELU),
# sub-word vocabularies of tens of thousands of pieces (lesson 13), from GPT-2 on the
# layer norm moved to the sub-layer's input (pre-norm, `norm_position="pre"` in `attn.model`,
# which trains deep stacks more stably), and above all far more parameters and text. Nothing else is needed to
# translate with it: a model trained on text that contains translations, prompted
# with a sentence and "in French:", continues with the translation. The
# encoder-decoder of the paper separates reading the source from writing the target;
# a decoder-only model reads both as one sequence, with the source as the prompt.
#
# ## Check
#
# These fail if the decoder-only model's backward pass were wrong, if its layers kept a
# cross-attention, if the look-ahead mask let the future in, if the model did not learn
# more than word-pair statistics, if the tied embedding did not save parameters, or if
# the sampling strategies did not behave as described.
#
# How far a model gets depends on its training: that the trained model beats the
# bigram model and that a higher temperature invents more unseen pairs is asserted in
# full mode; quick mode trains too few steps to promise it, and its figures above are
# printed only.

# %%
assert errors[worst] < 1e-6, f"gradient check: {worst} has relative error {errors[worst]:.1e}"
assert future_leak == 0.0, "the look-ahead mask must keep later tokens out of earlier positions"
assert "cross_attn" not in layer0 and "cross_attn" in translator_layer, (layer0, translator_layer)
assert ppl_bi < ppl_uni < ppl_start, (ppl_start, ppl_uni, ppl_bi)
assert QUICK or ppl_end < ppl_bi, f"the trained model must beat the bigram model: {ppl_end:.2f} vs {ppl_bi:.2f}"
assert lm.num_parameters() < same_size.num_parameters()
assert all(r["distinct"] == 1 / N_GEN for r in stats["greedy"]), "greedy writes one sentence"
assert all(a < b for a, b in zip(list(entropy.values()), list(entropy.values())[1:])), "entropy rises with tau"
assert topk_ok, "top-k drew a token outside the k most probable"
low = max(r["unseen"] for r in stats["tau 0.5"])
high = min(r["unseen"] for r in stats["tau 1.5"])
assert QUICK or low < high, f"a higher temperature invents more unseen word pairs (every seed): {low:.3f} vs {high:.3f}"
assert all(min(r["distinct"] for r in stats[n]) > 1 / N_GEN for n in STRATEGIES if n != "greedy"), \
    "sampling writes more than one sentence"
print(f"Check passed in {time.time() - T0:.1f} s: gradient check {errors[worst]:.0e}; validation perplexity "
      f"{ppl_end:.2f} against bigram {ppl_bi:.1f}; at tau 0.5 at most {low:.1%} of word pairs unseen, at tau 1.5 "
      f"at least {high:.1%}.")

# %% [markdown]
# ## Questions
#
# 1. Which sub-layer of the paper's decoder layer does a decoder-only model drop, and
#    why can it not keep it?
#
#    <details><summary>Answer</summary>
#
#    Encoder-decoder (cross-) attention. A decoder-only model has no encoder, so there is
#    no memory for it to read.
#
#    </details>
#
# 2. Why does one forward pass over a sentence train every one of its next-token
#    predictions at once, and which mask makes that honest?
#
#    <details><summary>Answer</summary>
#
#    Every position predicts the next token from the tokens before it, and all positions
#    are computed in parallel in one pass, so every next-token prediction of the sentence
#    gets its loss at once. The look-ahead (causal) mask makes it honest: without it
#    position $t$ could read $y_{t+1}$, the token it must predict.
#
#    </details>
#
# 3. Greedy decoding from `BOS` always writes the same sentence. What do temperature
#    and top-k each change to avoid that, and what does each risk?
#
#    <details><summary>Answer</summary>
#
#    Temperature $\tau$ samples from $\mathrm{softmax}(\mathit{logits}/\tau)$: $\tau < 1$
#    sharpens the distribution, $\tau > 1$ flattens it; too high a temperature gives
#    incoherent text. Top-k samples only among the $k$ most probable tokens; too small a
#    $k$ brings back repetition, too large lets unlikely tokens in.
#
#    </details>

# %% [markdown]
# ## Exercise
#
# Write the language model's layer yourself, forward and backward, from the layers of
# `attn.layers` (or your own from the earlier exercises): masked self-attention and the
# feed-forward network, each in its Add & Norm, with no cross-attention:
#
# ```
# attn-check lessons/exercises/decoder_only_layer.py
# ```
#
# It is graded against the library's decoder layer of a decoder-only config, and on this
# lesson's invariant: changing later positions leaves the earlier outputs as they were, and a
# gradient at one position reaches no later input. `attn-check --hint 2` says where to look,
# `--hint 3` gives the formula; the typical mistakes it names include a look-ahead mask that
# hides each position from itself, the norm put before the sub-layer, and a gradient that
# leaves out the self-attention's keys and values path or one of the residuals' skip paths.

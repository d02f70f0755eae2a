# %% [markdown]
# # Lesson 12: dropout and regularisation (section 5.4)
#
# Section 5.4 opens "We employ three types of regularization during training", and
# then describes two: residual dropout (applied in two places, quoted below) and
# label smoothing. The count does not match the text. Residual dropout's two places
# are not two regularisers: the paper names one technique, "Residual Dropout", with
# one rate. An earlier version of the
# paper on arXiv also described dropout on the attention weights, which would make
# three; the final text no longer does. The library has that third one too, off by
# default because the final text does not ask for it:
# `TransformerConfig(attention_dropout=...)`, the `dropout` argument of lesson 4's
# `attention_forward`, applied to the weights after the softmax. Label smoothing was
# lesson 11; this lesson is about residual dropout:
#
# > **Residual Dropout** We apply dropout to the output of each sub-layer, before it
# > is added to the sub-layer input and normalized. In addition, we apply dropout to
# > the sums of the embeddings and the positional encodings in both the encoder and
# > decoder stacks. For the base model, we use a rate of `P_drop = 0.1`.
#
# So one sub-layer is `LayerNorm(x + Dropout(Sublayer(x)))`, and the stacks start
# from $\mathrm{Dropout}(\mathrm{Embedding}(\mathit{ids}) \cdot \sqrt{d_{\text{model}}} + PE)$.
#
# We look at
#
# 1. **inverted dropout** (`attn.layers.dropout_forward` / `dropout_backward`): the
#    scaling by `1/(1 - p)`, why evaluation then needs no rescale, and its backward;
# 2. **where** the paper puts it: we rebuild the encoder by hand with the same random
#    numbers and get the library's output exactly; and why another placement (on
#    the sub-layer *input*) would be a different model, worse in a toy measurement;
# 3. **what it is for**: a small corpus, a model that can memorise it, trained with
#    and without dropout and label smoothing, over several seeds.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import math
import time

import numpy as np

from attn import backend as B
from attn.data import TOY_DIR, Vocab, encode_pairs, make_batches, read_parallel, tokenize
from attn.gradcheck import check_layer
from attn.layers import (dropout_backward, dropout_forward, feed_forward_forward, layer_norm_forward,
                         multi_head_attention_forward, positional_forward, embedding_forward, sinusoidal_table)
from attn.loss import cross_entropy
from attn.masks import padding_mask
from attn.model import Transformer, TransformerConfig
from attn.optim import Adam

B.set_backend("numpy")
np.set_printoptions(precision=3, suppress=True, linewidth=130)
T0 = time.time()

# %% [markdown]
# ## 1. Inverted dropout
#
# In training, each unit is kept with probability `1 - p` and the kept ones are
# multiplied by `1/(1 - p)`: `out = x * m`, with `m = keep / (1 - p)`. The expected
# value of every unit is then `x` itself, so at evaluation time dropout is simply
# switched off (the library: `rng=None`), with no rescaling. (The original dropout
# paper scaled the *weights* by `1 - p` at test time instead; the two are equivalent
# in expectation, and the inverted form keeps inference untouched.)
#
# The backward is the forward's own mask: `dx = dout * m`. Units dropped in the
# forward pass get no gradient; the kept ones get it scaled by `1/(1 - p)`. A fresh
# mask in backward would be a different function, and the gradient check below
# would catch it.

# %%
p = 0.1
x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
out, cache = dropout_forward(x, p, B.DeviceRNG(1))
print("x[0]   ", x[0])
print("out[0] ", out[0])
print(f"kept units are scaled by 1/(1 - p) = {1 / (1 - p):.4f}: out/x on kept units =",
      np.unique(np.round(out[out != 0] / x[out != 0], 4)))
n_draws = 1000 if QUICK else 20000
mean_out = np.mean([dropout_forward(x, p, B.DeviceRNG(s))[0] for s in range(n_draws)], axis=0)
mean_err = float(np.abs(mean_out - x).max())
sd = float(np.abs(x).max()) * math.sqrt(p / (1 - p) / n_draws)           # std of the mean of the largest unit
print(f"mean over {n_draws} masks: max |E[out] - x| = {mean_err:.4f} (sampling noise ~{sd:.4f})")
eval_out, _ = dropout_forward(x, p, None)
print("evaluation (rng=None) is the identity:", np.array_equal(eval_out, x))

x64 = np.random.default_rng(2).standard_normal((3, 5))
grad_err = check_layer("dropout", lambda x: dropout_forward(x, 0.3, B.DeviceRNG(7)), dropout_backward, {"x": x64},
                       ["x"])
print("gradient check of dropout_backward (the same mask as the forward), relative error:",
      ", ".join(f"{k} {v:.1e}" for k, v in grad_err.items()))

# %% [markdown]
# ## 2. Where the paper puts it
#
# The library's `Transformer.encode(src, rng)` applies dropout with `rng` as its
# source of random numbers. We write the encoder out from the layer functions,
# putting dropout exactly where section 5.4 says (the embedding sum; each sub-layer's
# output before the residual add), and draw the masks from a generator seeded the
# same way, in the same order. If the library put dropout anywhere else, or drew a
# mask more or fewer times, the two outputs would not be equal.

# %%
cfg = TransformerConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=1,
                        dropout=0.3, max_len=32)
model = Transformer(cfg, seed=0, dtype="float64")
prm, D = model.params, cfg.d_model
src = np.array([[5, 9, 12, 7, 3, 2], [8, 4, 11, 2, 0, 0]])             # the second row is padded
src_mask = padding_mask(src)


def encoder_by_hand(src, rng):
    """The encoder with residual dropout where section 5.4 puts it."""
    x = embedding_forward(src, prm["embedding.weight"], math.sqrt(D))[0]
    x = positional_forward(x, sinusoidal_table(cfg.max_len, D, "float64"))[0]
    x = dropout_forward(x, cfg.dropout, rng)[0]                          # dropout on embedding + PE
    for i in range(cfg.n_encoder_layers):
        pre = f"encoder.{i}"
        a = multi_head_attention_forward(x, x, *[prm[f"{pre}.self_attn.{n}"] for n in
                                                 ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")],
                                         n_heads=cfg.n_heads, mask=src_mask)[0]
        a = dropout_forward(a, cfg.dropout, rng)[0]                      # the sub-layer's OUTPUT ...
        x = layer_norm_forward(x + a, prm[f"{pre}.norm1.gamma"], prm[f"{pre}.norm1.beta"], cfg.ln_eps)[0]   # ... + x
        f = feed_forward_forward(x, *[prm[f"{pre}.ffn.{n}"] for n in ("w1", "b1", "w2", "b2")])[0]
        f = dropout_forward(f, cfg.dropout, rng)[0]
        x = layer_norm_forward(x + f, prm[f"{pre}.norm2.gamma"], prm[f"{pre}.norm2.beta"], cfg.ln_eps)[0]
    return x


mem_lib, _ = model.encode(src, B.DeviceRNG(42))
mem_hand = encoder_by_hand(src, B.DeviceRNG(42))
mem_eval, _ = model.encode(src)
same_placement = float(np.abs(mem_lib - mem_hand).max())
print(f"library encoder vs the hand-written one, same random numbers: max |diff| = {same_placement:.1e}")
print(f"with dropout vs without (rng=None): max |diff| = {np.abs(mem_lib - mem_eval).max():.2f}")

# %% [markdown]
# **Input or output?** The paper's sentence says *output*, and "the sums of the
# embeddings and the positional encodings" means the one vector `embedding + PE`, not
# attention scores and not the positional encoding alone.
#
# The difference is not cosmetic. Put dropout on the sub-layer input,
# `LayerNorm(Dropout(x) + Sublayer(Dropout(x)))`, and the residual path itself is
# corrupted: the identity connection no longer carries `x` through unchanged, and
# every layer drops another fraction `p` of what the layers below computed. With the
# paper's placement the skip path is clean and only each layer's *new* contribution is
# perturbed. We measure how much of a stack's input survives through `N` layers whose
# sub-layers contribute little (as at initialisation): the correlation between the
# output and the input, for both placements.

# %%
def survival(n_layers, placement, rng, p=0.1, D=64, n=256):
    """corr(input, output) of n_layers residual blocks LN(x + s(x)) with a small random
    sub-layer s, dropout on the sub-layer output (paper) or on the block's input (misread)."""
    x0 = np.random.default_rng(5).standard_normal((n, D))
    w = np.random.default_rng(6).standard_normal((n_layers, D, D)) * 0.1 / math.sqrt(D)
    ones, zeros = np.ones(D), np.zeros(D)
    x = x0
    for i in range(n_layers):
        if placement == "paper":
            x = layer_norm_forward(x + dropout_forward(np.tanh(x @ w[i]), p, rng)[0], ones, zeros)[0]
        else:
            xd = dropout_forward(x, p, rng)[0]
            x = layer_norm_forward(xd + np.tanh(xd @ w[i]), ones, zeros)[0]
    return float(np.corrcoef(x0.ravel(), x.ravel())[0, 1])


depths = [1, 2, 4, 6, 12]
surv = {pl: [survival(N, pl, B.DeviceRNG(N)) for N in depths] for pl in ("paper", "misread")}
print("layers                        " + " ".join(f"{N:>6}" for N in depths))
for pl, label in (("paper", "dropout on sub-layer output"), ("misread", "dropout on sub-layer input ")):
    print(f"{label}  " + " ".join(f"{c:>6.3f}" for c in surv[pl]))

# %% [markdown]
# With the paper's placement the input survives almost intact through a deep stack;
# with dropout on the input, each layer multiplies in another random mask and the
# original signal fades with depth. The paper gives no reason for its placement; it
# only says where dropout goes. This toy correlation (random sub-layers that add
# little, as at initialisation) is our illustration, not the paper's argument: it
# shows one thing "before it is added to the sub-layer input" buys, that dropout
# perturbs what a layer *adds* and leaves the road that carries everything else
# clean.
#
# ## 3. What it is for: overfitting a small corpus
#
# A model with more parameters than its data has target tokens can learn the
# training set by heart. We take a small slice of the toy corpus and train the
# readable `Transformer` on it four ways: no regularisation, dropout only, label
# smoothing only, and both (the paper's recipe), with the same batches in the same
# order. Training loss and validation loss are both measured *without* dropout and
# without smoothing (plain cross-entropy), so they are comparable; the gap between
# them is overfitting. Several seeds, so that the differences come with their
# spread.

# %%
N_TRAIN, STEPS = (100, quick_steps(100)) if QUICK else (300, 1200)
SEEDS = [0] if QUICK else [0, 1, 2]
P_DROP = 0.3                                       # a small corpus needs more than the paper's 0.1
pairs = [p_ for p_ in read_parallel(TOY_DIR, "en", "tk", "train") if len(p_[0].split()) <= 8][:N_TRAIN]
val_pairs = [p_ for p_ in read_parallel(TOY_DIR, "en", "tk", "val") if len(p_[0].split()) <= 8][:200]
vocab = Vocab.build([tokenize(s) for s, _ in pairs] + [tokenize(t) for _, t in pairs])
train_enc = encode_pairs(pairs, vocab)
train_eval = make_batches(train_enc, 4000, shuffle=False)
val_batches = make_batches(encode_pairs(val_pairs, vocab), 4000, shuffle=False)
n_tgt = sum(len(t) + 1 for _, t in train_enc)
SETTINGS = {"none": (0.0, 0.0), "dropout": (P_DROP, 0.0), "label smoothing": (0.0, 0.1),
            "both": (P_DROP, 0.1)}


def mean_nll(model, batches):
    """Plain cross-entropy per target token over batches, without dropout (rng=None) and without smoothing."""
    total = n = 0
    for b in batches:
        logits, _ = model.forward(b.src, b.tgt_in)
        nll, _ = cross_entropy(logits, b.tgt_out, 0.0)
        total += float(nll) * b.n_tgt_tokens
        n += b.n_tgt_tokens
    return total / n


def overfit_run(dropout, smoothing, seed):
    cfg = TransformerConfig(vocab_size=len(vocab), d_model=32 if QUICK else 64, n_heads=4,
                            d_ff=128 if QUICK else 256, n_encoder_layers=1,
                            n_decoder_layers=1, dropout=dropout, label_smoothing=smoothing, warmup_steps=60, max_len=32)
    m = Transformer(cfg, seed=seed)
    opt = Adam(m.params, cfg.d_model, cfg.warmup_steps)
    curve, step, epoch = [], 0, 0
    while step < STEPS:
        for b in make_batches(train_enc, 500, shuffle=True, seed=seed, epoch=epoch):
            logits, c = m.forward(b.src, b.tgt_in, B.DeviceRNG(seed * 1_000_003 + step))
            loss, dlogits = cross_entropy(logits, b.tgt_out, smoothing)
            opt.step(m.backward(dlogits, c))
            step += 1
            if step % (STEPS // (3 if QUICK else 6)) == 0:
                curve.append((step, mean_nll(m, train_eval), mean_nll(m, val_batches)))
            if step == STEPS:
                break
        epoch += 1
    return dict(params=m.num_parameters(), curve=curve, train=curve[-1][1], val=curve[-1][2])


print(f"{len(pairs)} training pairs ({n_tgt:,} target tokens), {len(val_pairs)} validation pairs, "
      f"vocabulary {len(vocab)}; {STEPS} steps, seeds {SEEDS}")
runs = {name: [overfit_run(d, ls, s) for s in SEEDS] for name, (d, ls) in SETTINGS.items()}
print(f"model: {runs['none'][0]['params']:,} parameters for {n_tgt:,} training target tokens")
print(f"{'':<16} {'train NLL':>16} {'val NLL':>16} {'gap (val - train)':>20}")
summary = {}
for name, rs in runs.items():
    tr, va = np.array([r["train"] for r in rs]), np.array([r["val"] for r in rs])
    gap = va - tr
    summary[name] = dict(train=tr, val=va, gap=gap)
    rng_ = lambda a: f"{a.min():.2f}" if len(a) == 1 else f"{a.min():.2f} to {a.max():.2f}"
    print(f"{name:<16} {rng_(tr):>16} {rng_(va):>16} {rng_(gap):>20}")

fig, ax = plt.subplots(1, 2, figsize=(12, 4))
for (name, rs), color in zip(runs.items(), ("tab:red", "tab:blue", "tab:green", "k")):
    for k, r in enumerate(rs):
        st, tr, va = zip(*r["curve"])
        ax[0].plot(st, tr, "--", color=color, alpha=0.7, label=f"{name}: train" if k == 0 else None)
        ax[0].plot(st, va, "-", color=color, label=f"{name}: validation" if k == 0 else None)
ax[0].set_xlabel("step"); ax[0].set_ylabel("cross-entropy (no smoothing, no dropout)")
lo, hi = ax[0].get_ylim()
if hi > 3 * max(lo, 1e-9):                   # a log axis where the losses span a factor of 3 or more
    ax[0].set_yscale("log")
ax[0].set_title(f"{len(pairs)} training pairs: train (dashed) and validation (solid)"); ax[0].legend(fontsize=7)
ax[1].plot(depths, surv["paper"], "o-", label="dropout on the sub-layer output (paper)")
ax[1].plot(depths, surv["misread"], "s-", label="dropout on the sub-layer input (a common misreading)")
ax[1].set_xlabel("layers"); ax[1].set_ylabel("corr(stack input, stack output)"); ax[1].set_ylim(0, 1.05)
ax[1].set_title("what survives a stack of residual blocks"); ax[1].legend()
fig.tight_layout(w_pad=4)                     # room between a wide legend and the next panel's label
show_figure(fig, "12_dropout.png")

# %% [markdown]
# What the table says is this run's; the text generated below reads it out. Things
# to look for: without regularisation the training loss falls far below the
# validation loss (memorisation); dropout keeps the training loss up, since every
# step sees a thinned network, and narrows the gap; label smoothing on its own
# mostly changes how confident the model is (lesson 11), which shows in both losses.
# Whether the validation loss itself improves depends on how long you train: early
# on, dropout only slows learning down; it pays once the unregularised model has
# started to memorise. Full mode trains longer, with three seeds.

# %%
best = min(summary, key=lambda n: summary[n]["val"].mean())
print(f"mean gap: " + ", ".join(f"{n} {summary[n]['gap'].mean():.2f}" for n in summary)
      + f"; lowest mean validation loss: {best}")
print(f"dropout raised the training loss in {int((summary['dropout']['train'] > summary['none']['train']).sum())} "
      f"of {len(SEEDS)} seeds and narrowed the gap in "
      f"{int((summary['dropout']['gap'] < summary['none']['gap']).sum())} of {len(SEEDS)}.")

# %% [markdown]
# ## Check
#
# These fail if the library's dropout were wrong: a missing `1/(1 - p)` (the mean
# would shrink), a backward with a fresh mask (gradient check), dropout left on at
# evaluation, dropout in a different place than section 5.4 says (the hand-written
# encoder would differ), or (in full mode, whose models train long enough for it) a
# dropout that does not perturb training at all.

# %%
assert np.allclose(out[out != 0] / x[out != 0], 1 / (1 - p), rtol=1e-5), "kept units must scale by 1/(1-p)"
assert mean_err < 6 * sd, f"inverted dropout must keep the expectation: {mean_err:.4f} vs noise {sd:.4f}"
assert np.array_equal(eval_out, x), "evaluation must be the identity"
assert max(grad_err.values()) < 1e-6
assert same_placement < 1e-12, "the library's residual dropout is not where section 5.4 puts it"
assert surv["paper"][-1] > surv["misread"][-1] + 0.1, "dropout on the residual path should destroy more signal"
if not QUICK:                                         # trained models: full mode's claims
    assert all(summary["dropout"]["train"] > summary["none"]["train"]), "dropout must keep the training loss up"
    assert all(summary["none"]["gap"] > 0), "without regularisation the model must fit train better than validation"
print(f"Check passed in {time.time() - T0:.1f} s: dropout keeps E[x], its backward uses the forward's mask, the "
      f"library's encoder equals the paper's placement to {same_placement:.0e}; mean training loss without "
      f"dropout {summary['none']['train'].mean():.2f}, with it {summary['dropout']['train'].mean():.2f}"
      f"{' (dropout raising it is asserted in full mode only)' if QUICK else ' (raised on every seed)'}.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. Why does inverted dropout need no rescaling at evaluation time?
#
#    <details><summary>Answer</summary>
#
#    Inverted dropout divides the kept activations by the keep probability $1 - P_{drop}$
#    during training, so each activation's expected value is the same as without dropout.
#    At evaluation nothing is dropped and nothing needs scaling.
#
#    </details>
#
# 2. Where does section 5.4 apply residual dropout, and what changes if dropout is
#    put on the sub-layer's *input* instead?
#
#    <details><summary>Answer</summary>
#
#    On the output of each sub-layer, before it is added to the sub-layer's input and
#    normalised, and on the sums of the embeddings and the positional encodings. Dropout
#    on the sub-layer's *input* would also drop the residual path: the identity $x$ would
#    be damaged too, where section 5.4 leaves it intact and drops only the sub-layer's
#    contribution.
#
#    </details>
#
# 3. Section 5.4 announces three regularisers and describes two. Which two, and
#    where is the third in the library?
#
#    <details><summary>Answer</summary>
#
#    Residual dropout and label smoothing. The third, dropout on the attention weights
#    (from an earlier version of the paper), is in the library as
#    `TransformerConfig(attention_dropout=...)`, the `dropout` argument of lesson 4's
#    `attention_forward`, off by default.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write inverted `dropout`, forward and backward yourself. The starter
# `lessons/exercises/12_dropout.py` has the signatures, and the shapes and formulas in
# its docstrings; its bodies raise `NotImplementedError`. Fill them in, then grade your
# work:
#
#     attn-check lessons/exercises/12_dropout.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

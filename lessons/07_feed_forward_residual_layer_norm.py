# %% [markdown]
# # Lesson 7: feed-forward, residual connections and layer norm ("Add & Norm")
#
# Every encoder and decoder layer ends with the position-wise feed-forward network
# (section 3.3), the same two-layer MLP applied to every position separately:
#
# $$\mathrm{FFN}(x) = \max(0,\, x W_1 + b_1)\, W_2 + b_2, \qquad W_1: d_{model} \times d_{ff},\; W_2: d_{ff} \times d_{model} \tag{2}$$
#
# and every sub-layer, attention or FFN, is wrapped the same way (section 3.1):
#
# $$x \leftarrow \mathrm{LayerNorm}(x + \mathrm{Sublayer}(x)) \tag{§3.1}$$
#
# (with dropout on the sub-layer's output, section 5.4, which we leave out here).
# That is the "Add & Norm" box of Figure 1. This lesson measures what the two parts
# of it are for:
#
# 1. **Add** (the residual connection, He et al. 2016): in a deep stack of FFNs at
#    initialisation, how big is the gradient that reaches the first layer, with and
#    without it? We predict the answer with a line of algebra, then measure it with
#    the library's hand-written backward passes.
# 2. **Norm**: why *layer* norm (statistics over the features of one token) and
#    not *batch* norm (statistics over the batch) for padded sentences of different
#    lengths.
#
# Three things to read carefully in the paper:
#
# * There is **one** ReLU in the FFN, between the two linear maps; the second linear
#   map has no activation (equation 2). A ReLU at the end would make every sub-layer
#   output non-negative, and the residual stream could then only ever grow in the
#   positive direction.
# * The residual connection and layer norm are not regularisers; the paper's
#   regularisers are dropout and label smoothing (section 5.4). Add & Norm is about
#   *optimisation*: getting a usable gradient to every layer and keeping activations
#   at a stable scale, which is what part 1 measures.
# * Batch norm averages feature $k$ over the $M$ examples of the mini-batch,
#   $\mu_k = \frac{1}{M} \sum_{m=1}^{M} x_{mk}$ and
#   $\sigma_k^2 = \frac{1}{M} \sum_{m=1}^{M} (x_{mk} - \mu_k)^2$; layer norm averages over the
#   $K$ features of one example (equation 7.2). $\sigma$ is the standard deviation,
#   $\sigma^2$ the variance.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn.layers import feed_forward_backward, feed_forward_forward, layer_norm_backward, layer_norm_forward

np.set_printoptions(precision=4, suppress=True, linewidth=130)

# %% [markdown]
# ## 1. Gradient flow through a deep stack
#
# `L` blocks, each its own FFN (`d_model = 64`, `d_ff = 256`), initialised like
# `attn.model.init_params` does it: Xavier/Glorot uniform matrices, zero biases,
# layer-norm gain 1 and shift 0. Five ways to wire a block:
#
# | name | block | |
# |---|---|---|
# | plain | `x <- FFN(x)` | no Add, no Norm |
# | norm only | `x <- LN(FFN(x))` | |
# | residual only | `x <- x + FFN(x)` | |
# | post-norm | `x <- LN(x + FFN(x))` | **the paper** |
# | pre-norm | `x <- x + FFN(LN(x))` | later work (e.g. Xiong et al. 2020); lesson 9's model offers it |
#
# We push a batch of random unit-variance tokens through the stack, take a random
# upstream gradient `g` at the top (so the "loss" is `sum(out * g)`, as in a gradient
# check), run the backward passes, and record the norm of the gradient arriving at
# the *input* of every block.
#
# The residual's backward is one line: forward `y = x + F(x)` gives
# $dx = dy + dF^\top(dy)$, the upstream gradient *plus* what the sub-layer sends back.
# The `+ dy` is a path on which nothing can shrink the gradient.

# %%
D, F = 64, 256
L = 32 if QUICK else 48
rng = np.random.default_rng(0)


def xavier(shape):
    limit = np.sqrt(6.0 / (shape[0] + shape[1]))
    return rng.uniform(-limit, limit, shape)


blocks = [dict(w1=xavier((D, F)), b1=np.zeros(F), w2=xavier((F, D)), b2=np.zeros(D)) for _ in range(L)]
gamma, beta = np.ones(D), np.zeros(D)
x0 = rng.standard_normal((4, 8, D))                             # (B, T, D) tokens at the bottom
g_top = rng.standard_normal((4, 8, D))                          # upstream gradient at the top
VARIANTS = ["plain", "norm only", "residual only", "post-norm", "pre-norm"]


def stack_forward(x, kind):
    """Run the L blocks. Returns the output, per-block caches, and the activation std at every block input."""
    caches, stds = [], []
    for p in blocks:
        stds.append(x.std())
        if kind == "pre-norm":
            h, cn = layer_norm_forward(x, gamma, beta)
            f, cf = feed_forward_forward(h, **p)
            x = x + f
        else:
            f, cf = feed_forward_forward(x, **p)
            x = x + f if kind in ("residual only", "post-norm") else f
            cn = None
            if kind in ("norm only", "post-norm"):
                x, cn = layer_norm_forward(x, gamma, beta)
        caches.append((cf, cn))
    return x, caches, np.array(stds)


def stack_backward(dout, caches, kind):
    """Backward through the blocks, top to bottom. Returns |dL/dx| at every block input (bottom
    first), and dL/dx at the very bottom."""
    d, norms = dout, []
    for cf, cn in reversed(caches):
        if kind == "pre-norm":                                  # y = x + F(LN(x))
            dh, *_ = feed_forward_backward(d, cf)
            dx, _, _ = layer_norm_backward(dh, cn)
            d = d + dx
        else:                                                   # y = LN(x + F(x)), or without the LN / the x
            if cn is not None:
                d, _, _ = layer_norm_backward(d, cn)
            dx, *_ = feed_forward_backward(d, cf)
            d = d + dx if kind in ("residual only", "post-norm") else dx
        norms.append(np.linalg.norm(d))
    return np.array(norms[::-1]), d


grad, act, dx0 = {}, {}, {}
for kind in VARIANTS:
    _, caches, act[kind] = stack_forward(x0, kind)
    grad[kind], dx0[kind] = stack_backward(g_top, caches, kind)
print(f"|dL/dx| at the input of block 1, block {L // 2} and block {L} (top gradient |g| = {np.linalg.norm(g_top):.1f}):")
for kind in VARIANTS:
    gk = grad[kind]
    print(f"  {kind:<14} {gk[0]:10.3e} {gk[L // 2 - 1]:10.3e} {gk[-1]:10.3e}   bottom/top = {gk[0] / gk[-1]:.2e}")

# %% [markdown]
# Before reading anything into these numbers: are they right? Lesson 8 checks
# each layer's backward on its own; here is one check of the whole stack. For a
# random direction `u`, the directional derivative `<dL/dx_0, u>` from backward must
# equal the central difference `(L(x_0 + h u) - L(x_0 - h u)) / 2h` computed with two
# forward passes. The direction moves a single token: FFN and LN act on each
# position separately, so only that token's 32 x 256 ReLUs see the perturbation.
# (Perturb all 128 tokens and, among a million ReLUs, one is bound to sit within
# `h` of its kink, where the difference quotient is not the derivative.)

# %%
u = np.zeros_like(x0); u[0, 0] = rng.standard_normal(D)
dir_err = {}
for kind in VARIANTS:
    h = 1e-6 * np.linalg.norm(x0[0, 0]) / np.linalg.norm(u)
    Lp = (stack_forward(x0 + h * u, kind)[0] * g_top).sum()
    Lm = (stack_forward(x0 - h * u, kind)[0] * g_top).sum()
    num, ana = (Lp - Lm) / (2 * h), (dx0[kind] * u).sum()
    dir_err[kind] = abs(num - ana) / (abs(num) + abs(ana))
    print(f"  {kind:<14} <dL/dx0, u> = {ana: .6e}   central difference = {num: .6e}   rel error {dir_err[kind]:.1e}")

# %% [markdown]
# ### Predicting the numbers
#
# For one Xavier-initialised FFN block the second moment of the signal changes by a
# fixed factor, forward and (by the same argument) backward. With
# `Var(W1) = 2/(D+F)`: the pre-activation has `D * 2/(D+F)` times the input's
# variance; ReLU keeps half of the second moment; `W2` multiplies by `F * 2/(D+F)`.
# Altogether
#
# $$a = \frac{2DF}{(D+F)^2} = \frac{2 \cdot 64 \cdot 256}{320^2} = 0.32 . \tag{7.1}$$
#
# * **plain**: the gradient norm shrinks by $\sqrt{a} = \sqrt{0.32} = 0.57$ per block, so over
#   `L - 1` blocks by $a^{(L-1)/2}$: a straight line on a log plot.
# * **residual only**: `x + FFN(x)` adds the two variances, a factor `1 + a = 1 + 0.32 = 1.32`
#   per block, so the gradient *grows* by $\sqrt{1 + a}$ per block going down, and so
#   do the forward activations going up.

# %%
a = 2 * D * F / (D + F) ** 2
pred = {"plain": a ** ((L - 1) / 2), "residual only": (1 + a) ** ((L - 1) / 2)}
for kind, p in pred.items():
    meas = grad[kind][0] / grad[kind][-1]
    print(f"{kind:<14} bottom/top gradient: predicted {p:.2e}, measured {meas:.2e}")

# %%
fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
layers = np.arange(1, L + 1)
for kind in VARIANTS:
    ax[0].semilogy(layers, grad[kind], ".-", label=kind, lw=2.5 if kind == "post-norm" else 1.2)
    ax[1].semilogy(layers, act[kind], ".-", label=kind, lw=2.5 if kind == "post-norm" else 1.2)
ax[0].semilogy(layers, grad["plain"][-1] * np.sqrt(a) ** (L - layers), "k:", lw=1, label="predicted, plain")
ax[0].semilogy(layers, grad["residual only"][-1] * np.sqrt(1 + a) ** (L - layers), "k--", lw=1,
               label="predicted, residual only")
ax[0].set_xlabel("block (1 = bottom)"); ax[0].set_ylabel("|dL/dx| at the block's input")
ax[0].set_title(f"gradient at initialisation, {L} FFN blocks"); ax[0].legend(fontsize=8)
ax[1].set_xlabel("block (1 = bottom)"); ax[1].set_ylabel("std of the block's input")
ax[1].set_title("forward activations"); ax[1].legend(fontsize=8)
fig.tight_layout(); show_figure(fig, "07_gradient_flow.png")

# %% [markdown]
# Read the left panel from right (top of the stack, where the loss is) to left
# (bottom, the first layer):
#
# * **plain** falls on its predicted straight line, by many orders of magnitude: the
#   first layers receive essentially no gradient and would not learn. (The forward
#   signal, right panel, dies the same way going up.)
# * **residual only** never vanishes, but it drifts the other way, as predicted:
#   each block adds its output's variance to the stream, and nothing takes it out.
# * **norm only** holds the scale steady: each LN divides by the standard deviation
#   of what it receives, and in backward multiplies the gradient by the same `1/std`,
#   which undoes the FFN's shrinking. At initialisation that is enough.
# * **post-norm** (the paper) is flat: the residual keeps a direct path for the
#   gradient and the LN keeps the scale at 1 every layer.
# * **pre-norm** keeps the identity path untouched (no LN on it), and its stream
#   grows slowly; its gradient grows mildly towards the bottom.
#
# Initialisation is not the whole story. With LN alone, all the gradient still has
# to pass *through* every FFN's Jacobian, which training keeps changing; the
# residual's `+ dy` term passes it around them whatever they become. That is why
# the paper uses both, and why very deep models cannot do without the Add.
#
# ## 2. Layer norm, not batch norm
#
# Layer norm (Ba et al. 2016) normalises each token's vector over its own `d_model`
# features:
#
# $$\mathrm{LN}(x) = \gamma \odot \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta,
# \qquad \mu = \frac{1}{D}\sum_k x_k,\;\; \sigma^2 = \frac{1}{D}\sum_k (x_k - \mu)^2 \tag{7.2}$$
#
# Batch norm normalises each *feature* over all the tokens in the batch. For text
# that is a problem. A batch holds sentences of different lengths, padded to the
# longest; batch norm's statistics then depend on which other sentences are in the
# batch and on how much padding they bring. We take one sentence, "A" (5 tokens),
# and normalise it inside different batches: batch norm computed here with NumPy as
# a foil, in two flavours (naive, over every position including pads, and masked,
# over the real tokens only), and the library's `layer_norm_forward`.

# %%
Dn = 8
feat_mean = rng.normal(0, 2, Dn)                                 # features with their own offsets and scales,
feat_scale = rng.uniform(0.5, 3, Dn)                            # as real embeddings have


def sentence(n):
    return feat_mean + feat_scale * rng.standard_normal((n, Dn))


def pad_batch(sentences, T=None):
    """Stack sentences (n_i, D) into (B, T, D) with zero padding, and the (B, T) real-token mask."""
    T = T or max(len(s) for s in sentences)
    x = np.zeros((len(sentences), T, Dn)); valid = np.zeros((len(sentences), T), dtype=bool)
    for i, s in enumerate(sentences):
        x[i, :len(s)] = s; valid[i, :len(s)] = True
    return x, valid


def batch_norm(x, valid=None, eps=1e-5):
    """Per-feature statistics over every (sentence, position) in the batch, or only the valid ones."""
    pts = x.reshape(-1, x.shape[-1]) if valid is None else x[valid]      # (N, D)
    return (x - pts.mean(0)) / np.sqrt(pts.var(0) + eps)


A = sentence(5)
ones, zeros = np.ones(Dn), np.zeros(Dn)


def normalise_A(batch_sentences, T=None):
    """A's five normalised tokens under each method; A is always the batch's first sentence."""
    x, valid = pad_batch([A] + batch_sentences, T)
    ln, _ = layer_norm_forward(x, ones, zeros)
    return {"layer norm": ln[0, :5], "batch norm (masked)": batch_norm(x, valid)[0, :5],
            "batch norm (naive)": batch_norm(x)[0, :5]}


ref = normalise_A([])                                            # A on its own
METHODS = list(ref)

# (a) A alone, padded to longer and longer T (as when a long sentence shares the batch)
Ts = list(range(5, 41, 5))
pad_diff = {m: [np.abs(normalise_A([], T)[m] - ref[m]).max() for T in Ts] for m in METHODS}
# (b) A with different batch-mates
n_batches = 12
mates = [[sentence(int(n)) for n in rng.integers(2, 30, size=int(rng.integers(1, 6)))] for _ in range(n_batches)]
mate_diff = {m: [np.abs(normalise_A(b)[m] - ref[m]).max() for b in mates] for m in METHODS}
ln_identical = all(np.array_equal(normalise_A(b)["layer norm"], ref["layer norm"]) for b in mates) and \
    all(np.array_equal(normalise_A([], T)["layer norm"], ref["layer norm"]) for T in Ts)

print("max |change| of A's normalised tokens, compared with A normalised on its own")
print(f"  (a) A alone, padded to T = {Ts}")
for m in METHODS:
    print(f"      {m:<20} " + " ".join(f"{v:6.3f}" for v in pad_diff[m]))
print(f"  (b) A with {n_batches} different sets of batch-mates")
for m in METHODS:
    print(f"      {m:<20} " + " ".join(f"{v:6.3f}" for v in mate_diff[m]))
print("layer norm output of A bit-for-bit identical in every batch:", ln_identical)

# %%
fig, ax = plt.subplots(1, 2, figsize=(13, 4.2))
for m, style in zip(METHODS, ("o--", "s-", "^-")):
    kw = dict(lw=2.5, ms=9, mfc="none", zorder=3) if m == "layer norm" else {}   # drawn on top: it sits at 0
    ax[0].plot(Ts, pad_diff[m], style, label=m, **kw)
    ax[1].plot(range(1, n_batches + 1), mate_diff[m], style, label=m, **kw)
ax[0].set_xlabel("padded length T (A has 5 real tokens)"); ax[0].set_ylabel("max |change| of A's output")
ax[0].set_title("(a) only the padding changes"); ax[0].legend()
ax[1].set_xlabel("batch number (different batch-mates)"); ax[1].set_title("(b) only the batch-mates change")
ax[1].legend()
fig.tight_layout(); show_figure(fig, "07_layer_vs_batch_norm.png")

# %% [markdown]
# * **Naive batch norm** changes A's representation just because the batch got
#   more padding: the zero vectors drag the per-feature mean towards 0 and shrink
#   the variance. The same sentence would be encoded differently depending on the
#   longest sentence it happened to be batched with.
# * **Masked batch norm** ignores the pads, so (a) is flat at zero; but the
#   statistics still come from the *other sentences*, so A's output changes with
#   every batch in (b). At test time one would swap in running averages, so training
#   and inference would see different functions; and with small batches of long,
#   varied sentences the estimates are noisy.
# * **Layer norm** uses only the token's own `d_model` numbers: A's output is the
#   same, bit for bit, in every batch and with any padding. It works with batch
#   size 1, at training and test time alike, and on one token at a time during
#   incremental decoding. (A zero padding row normalised by LN is a zero row
#   divided by $\sqrt{\epsilon}$, zero again, so LN's output for it is
#   $\gamma \odot 0 + \beta = \beta$: not zero, but ignored downstream, since no real
#   query attends to padding and the loss skips it.)
#
# ## Check
#
# These fail if the layer-norm or feed-forward backward passes are wrong (the
# measured slopes would not match the predicted ones), if a residual stack failed
# to carry the gradient, or if `layer_norm_forward` leaked statistics across rows.

# %%
ratio_plain = grad["plain"][0] / grad["plain"][-1]
ratio_res = grad["residual only"][0] / grad["residual only"][-1]
assert max(dir_err.values()) < 1e-6, dir_err
assert grad["plain"][0] < 1e-4 * grad["post-norm"][0], "without residuals the first block's gradient should vanish"
assert grad["plain"][0] < 1e-4 * grad["residual only"][0]
assert abs(np.log10(ratio_plain / pred["plain"])) < 1.0, (ratio_plain, pred["plain"])
assert abs(np.log10(ratio_res / pred["residual only"])) < 0.5, (ratio_res, pred["residual only"])
assert 0.2 < grad["post-norm"][0] / grad["post-norm"][-1] < 5, "post-norm gradient should stay level"
assert np.allclose(act["post-norm"][1:], 1.0, atol=1e-3), "LN output should have unit std"
assert ln_identical, "layer norm's output for a sentence must not depend on its batch-mates or padding"
assert max(pad_diff["batch norm (naive)"]) > 0.1 and max(mate_diff["batch norm (masked)"]) > 0.05
assert max(pad_diff["batch norm (masked)"]) < 1e-12
print(f"Check passed: first-block gradient plain {grad['plain'][0]:.1e} vs residual {grad['residual only'][0]:.1e} "
      f"vs post-norm {grad['post-norm'][0]:.1e}; predicted slopes match; layer norm batch-independent, batch norm not.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. Why would a ReLU after the feed-forward network's second linear map be a
#    problem for the residual stream?
#
#    <details><summary>Answer</summary>
#
#    The residual stream adds the sub-layer's output to $x$; with a ReLU last, the FFN
#    could only *add* non-negative numbers, never lower a feature. Post-norm's layer norm
#    recentres each token after the sum, so the values do not simply drift upwards; but
#    the sub-layer could lower a feature only by raising all the others, and it loses
#    half of what a linear map can write into the stream.
#
#    </details>
#
# 2. In the gradient-flow experiment, why does post-norm keep the gradient at the
#    first layer at a usable size, and why is layer norm alone not enough once
#    training changes the sub-layers?
#
#    <details><summary>Answer</summary>
#
#    After each residual sum, layer norm rescales the activations to unit variance, so
#    the gradient passing back through each block is rescaled too and neither explodes
#    nor vanishes with depth. But layer norm only fixes the size of the forward
#    activations: once training changes the sub-layers, the part of the gradient that
#    passes through them changes, and it is the residual path, the identity in
#    $x + F(x)$, that keeps a direct route for the gradient to the first layer.
#
#    </details>
#
# 3. Why is layer norm, rather than batch norm, the right normalisation for padded
#    batches of sentences?
#
#    <details><summary>Answer</summary>
#
#    Batch norm normalises each feature over all the tokens of the batch, so a sentence's
#    result depends on the other sentences and on how much padding they bring. Layer norm
#    normalises each token over its own features: a token's output depends on nothing
#    else in the batch, and padding changes nothing for the real tokens.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write `relu`, the feed-forward network, `layer_norm`, and Add & Norm around the
# network (`residual_ffn`), forward and backward yourself. The starter
# `lessons/exercises/07_feed_forward_layer_norm.py` has the signatures, the shapes and
# the forward formulas in its docstrings; its bodies raise `NotImplementedError`. The
# layer norm's backward is derived in lesson 8 (section 2, equations 8.3 and 8.4): do it
# after lesson 8, or derive it first (`--layer` grades one function at a time). ReLU's
# and the network's backward need only the chain rule. Fill them in, then grade your
# work:
#
#     attn-check lessons/exercises/07_feed_forward_layer_norm.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

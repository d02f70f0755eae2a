# %% [markdown]
# # Lesson 4: scaled dot-product attention (section 3.2.1)
#
# $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}}\right) V \tag{1}$$
#
# Read it right to left as five steps, each a line of `attn.layers.attention_forward`:
#
# 1. $Q K^\top$: every query dotted with every key, a `(T_q, T_k)` table of "how well
#    does query i match key j";
# 2. divide by $\sqrt{d_k}$ (the *scaled* in the name);
# 3. mask: keys a query must not see (padding here, the future in lesson 5) get a
#    logit so negative that their weight is exactly zero;
# 4. softmax along each row: the weights are positive and sum to 1;
# 5. the output row i is the weighted average of the value rows, $\sum_j w_{ij} V_j$.
#
# We walk through an example from a slide deck on the paper that circulates online
# (a Korean-to-English toy with made-up vectors), compare every number the slides
# print with what the library computes, and then
# answer the question the paper only sketches: *why* divide by $\sqrt{d_k}$?

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import textwrap

import numpy as np

from attn import diagram
from attn.layers import attention_forward, softmax_backward, softmax_forward
from attn.masks import padding_mask

np.set_printoptions(precision=4, suppress=True, linewidth=130)


def show(title, table, rows, cols, fmt="{:8.4f}"):
    """Print a labelled table, narrow enough for a phone's screen."""
    print("\n" + textwrap.fill(title, 64))
    w = max(len(r) for r in rows) + 1
    print(" " * w + "".join(f"{c[:8]:>9}" for c in cols))
    for r, row in zip(rows, table):
        print(f"{r:<{w}}" + "".join(" " + (fmt.format(v) if np.isfinite(v) else f"{v:>8}") for v in row))


# %% [markdown]
# ## 1. The example
#
# Six English key/value vectors ("Education is most powerful weapon" and one
# padding slot) and five Korean query vectors (교육은 *gyoyugeun* "education",
# 가장 *gajang* "most", 중요한 *jungyohan* "important", 무기이다 *mugiida* "is a
# weapon", and padding), `d_model = d_k = 4`. The slides use the same matrix for K
# and V, so here `V = K`. The numbers are made up to be easy to multiply, not
# learned. We label the Korean rows by their romanisation so that figures render
# everywhere.
#
# The padding mask comes from token ids, as it will in the model: the key sequence
# has ids `[1, 2, 3, 4, 5, 0]` and 0 is `attn.masks.PAD_ID`.

# %%
keys = ["Education", "is", "most", "powerful", "weapon", "[pad]"]
queries = ["gyoyugeun", "gajang", "jungyohan", "mugiida", "[pad]"]   # 교육은 가장 중요한 무기이다 [pad]
K = np.array([[0.1, 0.2, 0.3, 0.4],
              [0.2, 0.3, 0.4, 0.5],
              [0.3, 0.4, 0.5, 0.6],
              [0.4, 0.3, 0.2, 0.1],
              [0.5, 0.4, 0.3, 0.2],
              [0.1, 0.1, 0.1, 0.1]])                                # (6, 4)
Q = K[:5].copy()                                                    # (5, 4): the slides' Q rows equal K's first four ...
Q[4] = [0.1, 0.1, 0.1, 0.1]                                         # ... and the pad row
V = K                                                               # (6, 4)
key_ids = np.array([[1, 2, 3, 4, 5, 0]])                            # (1, 6)
mask = padding_mask(key_ids)                                        # (1, 1, 1, 6): True = may attend
print("padding_mask(key_ids):", mask.astype(int).ravel(), " shape", mask.shape)
show_figure(diagram.attention_figure(d_k=K.shape[1]), "04_scaled_dot_product.png")   # the paper's Figure 2, left

# %% [markdown]
# ### Steps 1 to 4, one at a time
#
# `attention_forward` does all of this in four lines; here we take them apart.
# Steps 1 and 2 are plain matrix arithmetic, step 3 and 4 are `softmax_forward`
# with the mask, step 5 is a matrix product. At the end we call `attention_forward`
# itself and check it agrees.

# %%
d_k = Q.shape[-1]
scores = Q @ K.T                                                    # (5, 6)  step 1
scaled = scores / np.sqrt(d_k)                                      # (5, 6)  step 2
m = mask[0, 0]                                                      # (1, 6), broadcasts over the rows
masked = np.where(m, scaled, -np.inf)                               # step 3, for display only
weights, _ = softmax_forward(scaled[None, None], mask)              # steps 3+4 as the library does them
weights = weights[0, 0]                                             # (5, 6)
out_steps = weights @ V                                             # (5, 4)  step 5

show("step 1: Q K^T", scores, queries, keys)
show(f"step 2: Q K^T / sqrt(d_k) = Q K^T / {np.sqrt(d_k):g}", scaled, queries, keys)
show("step 3: masked (shown as -inf; the library uses the most negative float, see below)", masked, queries, keys)
show("step 4: softmax_forward(scaled, mask): attention weights", weights, queries, keys)
show("step 5: weights @ V: the output, one weighted average of V's rows per query", out_steps, queries,
     [f"dim {j}" for j in range(4)])

out, cache = attention_forward(Q[None, None], K[None, None], V[None, None], mask)
print("\nattention_forward gives the same output: max |diff| =", np.abs(out[0, 0] - out_steps).max())
print("row sums of the weights:", weights.sum(axis=1))
real = weights[:, :5]                                               # the five real keys
spread = (scaled[:, :5].max(axis=1) - scaled[:, :5].min(axis=1)).max()
print(f"the real keys' weights lie between {real.min():.2f} and {real.max():.2f}: in any row the scaled scores "
      f"differ by at most {spread:.2f}, and e^{spread:.2f} = {np.exp(spread):.2f} is all the softmax can prefer one "
      f"key by; the plain average of the five real value rows is ({', '.join(f'{v:.2f}' for v in V[:5].mean(0))})")

# %% [markdown]
# What to notice:
#
# * The `[pad]` **column** is exactly 0 in every row: no query takes anything from
#   the padding key, however well it matches.
# * The weights are nearly uniform: the last line printed above gives their range.
#   With `d_k = 4` and small made-up entries the scaled scores of a row differ by
#   little, and the softmax can prefer one key by at most the exponential of that
#   difference. So every output row is close to the plain average of the five real
#   value rows (printed on the same line).
# * The `[pad]` **row** (a padding query) still gets an output. The padding mask of
#   section 3.2.3 masks *keys*; whatever a padding query computes is thrown away
#   later, because the loss ignores padding targets (`attn.loss.cross_entropy`'s
#   `pad_id`).
#
# Why not literally `-inf`, as the paper and most tutorials write? Because a row whose
# keys are *all* masked would become $\exp(-\infty - (-\infty)) = \exp(\mathrm{NaN})$, and NaN spreads
# through everything downstream. The library fills with `finfo(dtype).min`, the most
# negative finite number (not a magic `-1e4`, which a large enough logit would beat)
# and then sets the masked weights to exactly 0, so a fully masked row comes out as
# zeros:

# %%
all_masked, _ = softmax_forward(scaled[None, None], np.zeros((1, 1, 1, 6), dtype=bool))
print("fully masked rows ->", all_masked[0, 0, 0], " (NaN anywhere?", bool(np.isnan(all_masked).any()), ")")
with np.errstate(invalid="ignore"):
    e = np.exp(np.full(6, -np.inf) - np.max(np.full(6, -np.inf)))
print("the same with a literal -inf ->", e / e.sum())

# %% [markdown]
# ### The slides' numbers, checked
#
# Every number the slides print, typed in as printed, compared with the library's.
# A printed number is *rounded* if it is the true value rounded to the digits shown,
# *truncated* if the digits were cut off instead (a true `2/3` printed `"0.66"` instead of `"0.67"`),
# and *wrong* otherwise.

# %%
SLIDES = {
    "Q K^T": (scores, """
0.3 0.4 0.5 0.2 0.3 0.1
0.4 0.54 0.68 0.3 0.44 0.14
0.5 0.68 0.86 0.4 0.58 0.18
0.2 0.3 0.4 0.3 0.4 0.1
0.1 0.14 0.18 0.1 0.14 0.04"""),
    "Q K^T / sqrt(d_k)": (scaled, """
0.15 0.2 0.25 0.1 0.15 0.05
0.2 0.27 0.34 0.15 0.22 0.07
0.25 0.34 0.43 0.2 0.29 0.09
0.1 0.15 0.2 0.15 0.2 0.05
0.05 0.07 0.09 0.05 0.07 0.02"""),
    "softmax (weights)": (weights, """
0.19 0.20 0.21 0.18 0.10 0
0.19 0.20 0.22 0.18 0.19 0
0.18 0.20 0.22 0.18 0.19 0
0.18 0.19 0.20 0.19 0.20 0
0.19 0.20 0.20 0.19 0.20 0"""),
    "weights @ V (output)": (out_steps, """
0.29 0.32 0.34 0.36
0.29 0.32 0.34 0.37
0.29 0.32 0.34 0.37
0.30 0.32 0.34 0.36
0.30 0.32 0.34 0.36"""),
}


def classify(printed: str, truth: float) -> str:
    d = len(printed.split(".")[1]) if "." in printed else 0
    x, unit = float(printed), 10.0 ** -d
    if abs(x - truth) <= unit / 2 + 1e-12:
        return "rounded"
    if abs(x - np.trunc(truth / unit + 1e-9) * unit) < 1e-12:
        return "truncated"
    return "WRONG"


verdicts = {}
for name, (truth, text) in SLIDES.items():
    rows = [line.split() for line in text.strip().splitlines()]
    counts = {"rounded": 0, "truncated": 0, "WRONG": 0}
    for i, row in enumerate(rows):
        for j, s in enumerate(row):
            v = classify(s, truth[i, j])
            counts[v] += 1
            verdicts[name, i, j] = v
            if v == "WRONG":
                print(f"  {name}: row {queries[i]!r}, column {(keys + ['dim'] * 4)[j] if truth.shape[1] == 6 else j}: "
                      f"printed {s}, true {truth[i, j]:.4f}")
    print(f"{name:<22} rounded {counts['rounded']:>2}, truncated {counts['truncated']:>2}, wrong {counts['WRONG']}")
slide_w = np.array([[float(v) for v in line.split()] for line in SLIDES["softmax (weights)"][1].strip().splitlines()])
(_, bad_i, bad_j), = [k for k, v in verdicts.items() if v == "WRONG"]
twin = int(np.flatnonzero(np.isclose(scaled[bad_i, :5], scaled[bad_i, bad_j]) & (np.arange(5) != bad_j))[0])
print(f"the wrong entry: {queries[bad_i]} on {keys[bad_j]!r}, printed {slide_w[bad_i, bad_j]:.2f}, true "
      f"{weights[bad_i, bad_j]:.4f}; its scaled score {scaled[bad_i, bad_j]:.2f} equals the score on {keys[twin]!r}, "
      f"whose weight the slide prints {slide_w[bad_i, twin]:.2f}; the slide's row sums to {slide_w[bad_i].sum():.2f}; "
      f"the slide's output row for {queries[bad_i]} is ({', '.join(SLIDES['weights @ V (output)'][1].split(chr(10))[bad_i + 1].split())}), "
      f"true ({', '.join(f'{v:.4f}' for v in out_steps[bad_i])})")

# %% [markdown]
# The score tables are exact. In the weights and outputs the slides often cut
# digits off rather than round (the "truncated" counts above), which is a
# presentation choice worth knowing when you compare numbers, not an error. One
# entry is an error, described in the last line printed above:
#
# * **the weight of gyoyugeun (교육은) on "weapon".** The scaled score of that pair
#   is identical to its score on "Education", so the two weights must be identical
#   too; the slide prints two different numbers, and its row does not sum to 1. The
#   slide's *output* row for gyoyugeun agrees with the true one to the digits it
#   prints, so the slide computed with the right weight and mistyped it.
#
# A good habit that catches this kind of slip at once: **every row of attention
# weights sums to 1**, and equal scores in a row get equal weights.
#
# ## 2. Why divide by sqrt(d_k)?
#
# The paper (3.2.1, footnote 4): if the components of `q` and `k` are independent
# with mean 0 and variance 1, then $q \cdot k = \sum_{i=1}^{d_k} q_i k_i$ has mean 0 and
# variance `d_k` (a sum of `d_k` independent terms, each of variance
# $\mathbb{E}[q_i^2] \mathbb{E}[k_i^2] = 1$). So the logits' spread grows like $\sqrt{d_k}$, and
# dividing by $\sqrt{d_k}$ brings their variance back to 1 whatever the head size.
# Let us measure it.

# %%
rng = np.random.default_rng(0)
dks = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
n_pairs = 10_000 if QUICK else 40_000
# One draw of 1024-dimensional q and k serves every d_k: the running sum of q_i k_i
# over the first d_k coordinates is a dot product of d_k-dimensional vectors.
dots = np.concatenate([np.cumsum(rng.standard_normal((n, 1024)) * rng.standard_normal((n, 1024)), axis=1)
                       [:, np.array(dks) - 1] for n in [5_000] * (n_pairs // 5_000)])   # (n_pairs, len(dks))
var_dot = list(dots.var(axis=0))
var_scaled = list((dots / np.sqrt(dks)).var(axis=0))
# The sample variance of n draws has relative standard error sqrt((kurtosis - 1) / n), and the
# kurtosis of q.k is 3 + 6/d_k. We accept 5 standard errors.
var_tol = [5 * np.sqrt((2 + 6 / dk) / n_pairs) for dk in dks]
print(f"{'d_k':>6} {'var(q.k)':>10} {'var/d_k':>8} {'var(q.k/sqrt(d_k))':>19} {'tolerance':>10}   ({n_pairs} pairs)")
for dk, v, vs, tol in zip(dks, var_dot, var_scaled, var_tol):
    print(f"{dk:>6} {v:>10.2f} {v / dk:>8.3f} {vs:>19.3f} {tol:>10.1%}")

# %% [markdown]
# `var(q.k) / d_k` stays at 1 (to sampling noise) from `d_k = 1` to 1024: the
# variance *is* `d_k`. After scaling it is 1 for every `d_k`.
#
# Why large logits hurt: the softmax saturates. When one logit beats the others by
# several units, the softmax is nearly one-hot, `y ~ e_j`, and its backward
# `dx = y * (dy - sum(dy * y))` is nearly zero: `y_i ~ 0` kills every entry but `j`,
# and at `j` the bracket is `dy_j - dy_j = 0`. No gradient flows back to the
# queries and keys, and learning *which* key to attend to stalls. The paper's
# phrase: "pushing the softmax function into regions where it has extremely small
# gradients".
#
# We measure it with the library's softmax pair: 32 keys, random unit-variance `q`
# and `K`, logits with and without the scale, a random upstream gradient `dy`,
# and the norm of `dx = softmax_backward(dy)`. The median over many draws (the
# mean would be dominated by the rare draw where two logits happen to tie).

# %%
n_keys, n_draws = 32, (300 if QUICK else 1500)
grad_unscaled, grad_scaled, top_unscaled, top_scaled = [], [], [], []
# Again one draw serves all d_k: the running sums of q_i K_ji over the first d_k coordinates.
all_logits = np.concatenate([np.cumsum(rng.standard_normal((n, 1, 1024)) * rng.standard_normal((n, n_keys, 1024)),
                                       axis=-1)[..., np.array(dks) - 1] for n in [150] * (n_draws // 150)])
for j, dk in enumerate(dks):
    logits = all_logits[..., j]                                     # (n_draws, 32), variance d_k
    dy = rng.standard_normal(logits.shape)
    res = []
    for z in (logits, logits / np.sqrt(dk)):
        y, c = softmax_forward(z)
        dx = softmax_backward(dy, c)
        res.append((np.median(np.linalg.norm(dx, axis=1)), np.median(y.max(axis=1))))
    (gu, tu), (gs, ts) = res
    grad_unscaled.append(gu); grad_scaled.append(gs); top_unscaled.append(tu); top_scaled.append(ts)
print(f"{'d_k':>6} {'|dx| unscaled':>14} {'|dx| scaled':>12} {'max weight unscaled':>20} {'scaled':>8}")
for row in zip(dks, grad_unscaled, grad_scaled, top_unscaled, top_scaled):
    print("{:>6} {:>14.2e} {:>12.3f} {:>20.4f} {:>8.3f}".format(*row))

# %%
fig, ax = plt.subplots(3, 1, figsize=(7.5, 12))         # one above the other: each readable on a phone
ax[0].loglog(dks, var_dot, "o-", label="var(q . k)")
ax[0].loglog(dks, var_scaled, "s-", label="var(q . k / sqrt(d_k))")
ax[0].loglog(dks, dks, "k:", lw=1, label="d_k")
ax[0].set_xlabel("d_k"); ax[0].set_ylabel("variance"); ax[0].legend(); ax[0].set_title("dot products grow like d_k")
ax[1].loglog(dks, grad_unscaled, "o-", label="softmax(q.K)  (unscaled)")
ax[1].loglog(dks, grad_scaled, "s-", label="softmax(q.K / sqrt(d_k))")
ax[1].set_xlabel("d_k"); ax[1].set_ylabel("median |dx| from softmax_backward"); ax[1].legend()
ax[1].set_title(f"gradient through the softmax ({n_keys} keys)")
im = ax[2].imshow(100 * weights, cmap="Blues", vmin=0, vmax=30)   # in %: two digits a cell, on a phone too
ax[2].set_xticks(range(6), keys, rotation=45, ha="right"); ax[2].set_yticks(range(5), queries)
for i in range(5):
    for j in range(6):
        ax[2].text(j, i, f"{100 * weights[i, j]:.0f}", ha="center", va="center", fontsize=7)
ax[2].set_title("the toy sentence's weights, % (pad: 0)")
fig.colorbar(im, ax=ax[2], fraction=0.04, label="weight (%)")
fig.tight_layout(); show_figure(fig, "04_attention_scale.png")
print("scaled / unscaled median gradient: " + ", ".join(
    f"d_k = {dk}: {grad_scaled[dks.index(dk)] / grad_unscaled[dks.index(dk)]:.0f} x" for dk in (64, 256, 512)))

# %% [markdown]
# "Dot products grow like d_k": the variance follows the dotted line `d_k` exactly; the scaled one is flat
# at 1. "Gradient through the softmax": without the scale the gradient through the softmax falls by orders
# of magnitude as `d_k` grows (the weights go one-hot: the table's "max weight"
# climbs to 1), while with the scale it does not depend on `d_k` at all, because
# the scaled logits have the same distribution for every `d_k`. How much smaller the
# unscaled gradient is at the paper's head size `d_k = 64`, at 256, and at `d_k = 512`
# (one head as wide as the base model) is printed below the figure: at 512 it is
# essentially gone. (For small `d_k` the unscaled curve sits slightly *above* the
# scaled one: a moderately peaked softmax passes more gradient than a nearly flat
# one. The scale is not there to maximise the gradient, but to keep the logits'
# spread, and so the softmax's regime, the same for every head size.) The toy
# sentence's weights, in percent: nearly uniform, with the pad column exactly 0.
#
# ## Check
#
# These fail if the library's attention is wrong: a mask that leaks weight onto the
# pad key, weights that do not sum to 1, a wrong or missing scale, a softmax whose
# backward does not saturate the way the maths says.

# %%
assert np.all(cache.weights[..., 5] == 0.0), "weight on the [pad] key must be exactly 0"
assert np.all(weights[:, 5] == 0.0)
assert np.allclose(cache.weights.sum(-1), 1.0, atol=1e-12), "attention weights must sum to 1 over the keys"
assert np.abs(out[0, 0] - out_steps).max() < 1e-15
assert np.abs(cache.weights[0, 0] - weights).max() < 1e-15
# the scale is 1/sqrt(d_k): the weights equal a plain softmax of QK^T/2 over the five real keys
ref = np.exp(scores[:, :5] / 2); ref /= ref.sum(1, keepdims=True)
assert np.abs(weights[:, :5] - ref).max() < 1e-15, "attention_forward must divide the scores by sqrt(d_k)"
assert [k for k, v in verdicts.items() if v == "WRONG"] == [("softmax (weights)", 0, 4)]
assert np.all(np.isfinite(all_masked)) and np.all(all_masked == 0), "a fully masked row must be zeros, not NaN"
for dk, v, vs, tol in zip(dks, var_dot, var_scaled, var_tol):
    assert abs(v / dk - 1) < tol and abs(vs - 1) < tol, f"var(q.k) should be d_k = {dk} (within {tol:.0%}), got {v:.2f}"
i512 = dks.index(512)
assert grad_unscaled[i512] < 1e-2 * grad_scaled[i512], "unscaled softmax gradient should vanish at large d_k"
assert max(grad_scaled) / min(grad_scaled) < 1.5, "scaled softmax gradient should not depend on d_k"
print(f"Check passed: pad weights exactly 0, rows sum to 1, var(q.k)/d_k in "
      f"[{min(np.divide(var_dot, dks)):.3f}, {max(np.divide(var_dot, dks)):.3f}], and at d_k = 512 the unscaled "
      f"softmax gradient is {grad_unscaled[i512] / grad_scaled[i512]:.1e} of the scaled one.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. If the components of `q` and `k` are independent with mean 0 and variance 1,
#    what is the variance of $q \cdot k$, and what does dividing by $\sqrt{d_k}$ do to
#    it?
#
#    <details><summary>Answer</summary>
#
#    $q \cdot k = \sum_{i=1}^{d_k} q_i k_i$ is a sum of $d_k$ independent terms of mean 0
#    and variance $\mathbb{E}[q_i^2]\mathbb{E}[k_i^2] = 1$, so its variance is $d_k$.
#    Dividing by $\sqrt{d_k}$ divides the variance by $d_k$: the scaled scores have
#    variance 1 whatever $d_k$ is.
#
#    </details>
#
# 2. Using softmax's backward as this lesson wrote it above,
#    $dx = y \odot (dy - \sum_j dy_j\, y_j)$, explain why a nearly one-hot softmax passes
#    almost no gradient back to the queries and keys.
#
#    <details><summary>Answer</summary>
#
#    When $y$ is nearly one-hot, every $y_j$ off the peak is near zero,
#    and at the peak $y_j \approx 1$ makes $dy_j - \sum dy\, y \approx dy_j - dy_j = 0$.
#    So $dx$ is near zero everywhere, and the scores, hence the queries and keys, receive
#    almost no gradient.
#
#    </details>
#
# 3. Why does the library fill masked scores with the most negative finite number
#    instead of `-inf`, and what does a fully masked row give?
#
#    <details><summary>Answer</summary>
#
#    With $-\infty$ a fully masked row computes
#    $\exp(-\infty - (-\infty)) = \exp(\mathrm{NaN})$: the row's maximum is itself
#    $-\infty$, and the NaN spreads through the model. The most negative finite number
#    keeps the arithmetic finite; the library then sets the masked outputs to exactly
#    zero, so a fully masked row gives all-zero weights (and an all-zero output), not NaN
#    and not a uniform row.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write the masked `softmax` (stable for logits of 1e4, zeros on a fully masked row)
# and scaled dot-product `attention`, forward and backward yourself. The starter
# `lessons/exercises/04_attention.py` has the signatures, the shapes, and the forward
# formulas in its docstrings; its bodies raise `NotImplementedError`. The two backward
# passes are derived in lesson 8 (sections 1 and 3): write the forwards now and the
# backwards after lesson 8, or derive them first and check yourself against it
# (`--layer` grades one function at a time). Fill them in, then grade your work:
#
#     attn-check lessons/exercises/04_attention.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

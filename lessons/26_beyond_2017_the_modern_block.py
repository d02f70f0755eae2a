# %% [markdown]
# # Lesson 26: beyond 2017, the block of today's models, every backward by hand
#
# Open the code of a language model trained since 2023 and its block is the paper's block with
# some of four parts exchanged (and, in a few, a fifth added):
#
# | the paper (2017) | today |
# |---|---|
# | sinusoids added to the embeddings (section 3.5) | **rotary positions** (RoPE, part 1): queries and keys turned by angles set by their position |
# | the ReLU network of equation 2 | **SwiGLU** (part 2): one path gates the other |
# | every head with its own keys and values | **grouped-query attention** (GQA, part 3): a key/value head per group of query heads |
# | layer norm after each sub-layer (post-norm) | a norm *before* each sub-layer (pre-norm, lesson 7), often **RMSNorm** (part 4) |
# | scores $q \cdot k / \sqrt{d_k}$ as large as the queries and keys make them | **QK-norm** (part 5; OLMo 2, Gemma 3): each head's query and key RMS-normed first |
#
# Which model took which, as their papers describe them:
#
# * **Llama 2** (Touvron et al., 2023): pre-norm RMSNorm, RoPE, SwiGLU; grouped-query attention
#   only in its 34B and 70B models, full multi-head attention in the 7B and 13B.
# * **Mistral 7B** (Jiang et al., 2023): RMSNorm, RoPE, SwiGLU and grouped-query attention.
# * **Gemma** (Gemma Team, 2024): RMSNorm and RoPE, but **GeGLU**, the same gate with GELU in place
#   of SiLU; multi-head attention in the 7B model, multi-query attention (one key/value head) in
#   the 2B.
# * **OLMo** (Groeneveld et al., 2024): RoPE and SwiGLU, full multi-head attention, and a layer
#   norm with neither gain nor bias rather than RMSNorm.
# * **Llama 3** (2024) and **Qwen2** (2024): all four, RMSNorm, RoPE, SwiGLU and grouped-query
#   attention, in every size.
#
# Each part is a forward/backward pair in `attn.layers`, derived here; RoPE, SwiGLU, grouped-query
# attention and RMSNorm are checked against central differences in float64 below, and poked at
# until the property each is used for shows.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn.gradcheck import check_layer
from attn.layers import (attention_forward, merge_heads, multi_head_attention_backward,
                         multi_head_attention_forward, relu_forward, rmsnorm_backward, rmsnorm_forward,
                         rope_angles, rope_backward, rope_forward, silu, split_heads, swiglu_backward,
                         swiglu_forward, swiglu_width)

np.set_printoptions(precision=4, suppress=True, linewidth=130)
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Rotary positions (Su et al., 2021)
#
# The paper *adds* a position's vector to its token's embedding, and every layer then has
# to untangle the two. Rotary positions instead act where positions matter, on the
# queries and keys of every attention layer. Split a head of size $d_h$ into $d_h/2$ pairs of
# features and read pair $i$ as one complex number $z_i = x_{i} + \mathrm{i}\, x_{i + d_h/2}$.
# At position $m$ it is turned by the angle $m\,\theta_i$, with the paper's geometric
# progression of frequencies:
#
# $$\mathrm{rope}(z)_{m,i} = z_{m,i}\, e^{\mathrm{i} m \theta_i}, \qquad \theta_i = \mathrm{base}^{-2i/d_h}, \qquad \mathrm{base} = 10000. \tag{26.1}$$
#
# A product with a unit complex number is a rotation, so it keeps every pair's length.
# And the score of a query at $m$ with a key at $n$ is the real part of a product in which
# the absolute positions cancel:
#
# $$\langle \mathrm{rope}(q)_m, \mathrm{rope}(k)_n \rangle = \mathrm{Re} \sum_i q_i\, \overline{k_i}\, e^{\mathrm{i}(m - n)\theta_i}. \tag{26.2}$$
#
# A query sees how far away a key is, not where the two are. In real arithmetic each pair
# $(a, b)$ becomes $(a \cos - b \sin,\; a \sin + b \cos)$: that is `rope_forward`. The pairing
# is Llama's code's "half split" (feature $i$ with feature $i + d_h/2$); RoFormer's paper pairs
# neighbours $(2i, 2i+1)$, which is the same rotation after one fixed permutation of a head's
# features.
#
# **The backward.** The forward is $y = R x$ with $R$ a rotation, a matrix whose transpose is
# its inverse. So $dx = R^\top dy$: the gradient is turned *back* by the same angles. No input
# needs to be kept for the backward, only the angles.

# %%
Dh, T = 16, 64
q, k = rng.standard_normal(Dh), rng.standard_normal(Dh)
positions = np.arange(T)
rq = rope_forward(np.tile(q, (T, 1)), positions)[0]            # (T, Dh): q placed at every position
rk = rope_forward(np.tile(k, (T, 1)), positions)[0]
scores = rq @ rk.T                                             # scores[m, n] = <rope(q)_m, rope(k)_n>
offsets = np.arange(-T + 1, T)
spread = max(np.ptp(np.diagonal(scores, off)) for off in offsets)
print(f"score of one query and one key placed at every pair of positions ({T} x {T}):")
print(f"  along each diagonal (one offset m - n) the scores differ by at most {spread:.1e}")
norm_change = np.abs(np.linalg.norm(rq, axis=1) - np.linalg.norm(q)).max()
print(f"  the query's length changes by at most {norm_change:.1e} over all positions")

x = rng.standard_normal((2, 3, T, Dh))
y, cache = rope_forward(x)
back = rope_backward(y, cache)
print(f"  rope_backward of the forward's output gives back the input to {np.abs(back - x).max():.1e}")
rope_err = check_layer("rope", lambda x: rope_forward(x, positions), rope_backward, {"x": x}, ("x",))["x"]
print(f"  gradient check (float64, central differences): relative error {rope_err:.1e}")

# %% [markdown]
# The figure shows the map of scores and, beside it, one row of it against the offset for
# three absolute positions of the query: the curves lie on top of each other. The slow
# frequencies (large $i$) turn little over a sentence, the fast ones (small $i$) many times:
# the third panel draws the angle of each pair over the positions.

# %%
fig, ax = plt.subplots(1, 3, figsize=(13, 3.8), layout="constrained")
im = ax[0].imshow(scores, cmap="RdBu_r")
ax[0].set_xlabel("key position n"); ax[0].set_ylabel("query position m")
ax[0].set_title("score(m, n): constant\nalong each diagonal")
fig.colorbar(im, ax=ax[0], shrink=0.8)
for m, style in zip((10, 30, 50), (dict(lw=4, alpha=0.35), dict(lw=1.5), dict(lw=1, ls=":", color="k"))):
    ax[1].plot(np.arange(T) - m, scores[m], **style, label=f"query at m = {m}")
ax[1].set_xlabel("offset n - m"); ax[1].set_ylabel("score"); ax[1].legend(fontsize=8)
ax[1].set_title("one query, three places:\nthe same curve")
cos, sin = rope_angles(positions, Dh)
ax[2].imshow(np.arctan2(sin, cos).T, aspect="auto", cmap="twilight")
ax[2].set_xlabel("position"); ax[2].set_ylabel("pair i"); ax[2].set_title("angle of each pair\n(fast at the top)")
show_figure(fig, "26_rope.png")

# %% [markdown]
# ## 2. SwiGLU (Shazeer, 2020)
#
# The paper's feed-forward network passes $xW_1$ through a ReLU. SwiGLU computes two
# products of the same input and lets one *gate* the other, element by element:
#
# $$\mathrm{FFN}_{\mathrm{SwiGLU}}(x) = \big(\mathrm{SiLU}(xW) \odot xV\big)\, W_2, \qquad \mathrm{SiLU}(a) = a\, \sigma(a). \tag{26.3}$$
#
# **The backward.** With $a = xW$, $b = xV$, $h = \mathrm{SiLU}(a) \odot b$ and
# $dh = dy\, W_2^\top$, the product rule gives each path the other as its factor:
# $db = dh \odot \mathrm{SiLU}(a)$ and $da = dh \odot b \odot \mathrm{SiLU}'(a)$, where
# $\mathrm{SiLU}'(a) = \sigma(a)\,(1 + a(1 - \sigma(a)))$. The input reaches the output through
# both products, so its gradient is the sum: $dx = da\, W^\top + db\, V^\top$.
#
# Three matrices instead of two: at the paper's parameter count the hidden width is $2/3$ of
# $d_{ff}$ (`swiglu_width`).

# %%
D_base, F_base = 512, 2048                         # the paper's base model
F_glu = swiglu_width(F_base)
print(f"paper's network: 2 x {D_base} x {F_base} = {2 * D_base * F_base:,} weights; "
      f"SwiGLU at width {F_glu}: 3 x {D_base} x {F_glu} = {3 * D_base * F_glu:,}")

D, F = 6, 4
xs, w, v, w2 = (rng.standard_normal(s) for s in [(3, 5, D), (D, F), (D, F), (F, D)])
glu_err = check_layer("swiglu", swiglu_forward, swiglu_backward, {"x": xs, "w": w, "v": v, "w2": w2},
                      ("x", "w", "v", "w2"))
print("gradient check (float64):", ", ".join(f"d{n} {e:.1e}" for n, e in glu_err.items()))

a = np.linspace(-6, 6, 241)
s_a, sig = silu(a)
dsilu = sig * (1 + a * (1 - sig))
h = 1e-6
num_dsilu = (silu(a + h)[0] - silu(a - h)[0]) / (2 * h)
print(f"SiLU' against central differences over [-6, 6]: largest difference {np.abs(dsilu - num_dsilu).max():.1e}")
print(f"SiLU's smallest value: {s_a.min():.4f} at a = {a[s_a.argmin()]:.2f} (a ReLU never goes below 0)")

fig, ax = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
ax[0].plot(a, relu_forward(a)[0], label="ReLU"); ax[0].plot(a, s_a, label="SiLU = a sigmoid(a)")
ax[0].set_xlabel("a"); ax[0].set_title("the activations"); ax[0].legend(fontsize=8)
ax[1].plot(a, (a > 0).astype(float), label="ReLU'"); ax[1].plot(a, dsilu, label="SiLU'")
ax[1].set_xlabel("a"); ax[1].set_title("their derivatives"); ax[1].legend(fontsize=8)
show_figure(fig, "26_swiglu.png")

# %% [markdown]
# SiLU's derivative is smooth and briefly above one; left of SiLU's minimum (printed above)
# it is negative, so there a gradient step moves the pre-activation the other way round
# than to the right of it; a ReLU's gradient is simply zero for every negative input.
#
# ## 3. Grouped-query attention (Ainslie et al., 2023)
#
# When a decoder generates, every layer keeps the keys and values of every earlier
# position: the cache grows with the length and the number of heads. Grouped-query attention
# keeps the $h$ query heads but gives the keys and values only $h_{kv}$ heads; each key/value
# head is read by a group of $h / h_{kv}$ query heads. $h_{kv} = h$ is the paper's attention,
# $h_{kv} = 1$ is multi-query attention (Shazeer, 2019).
#
# **The backward.** The forward copies key/value head $j$ to the query heads $jg, \dots, jg + g - 1$
# of its group ($g = h / h_{kv}$). A value used $g$ times receives $g$ gradients, which add up
# (the micrograd rule): the backward of the copy sums the gradients of the $g$ query heads of each
# group (inside `grouped_query_attention_backward` and `multi_head_attention_backward`).
# Everything else is the paper's backward. The figure draws, for $h = 8$ query heads, which
# key/value head each one reads:

# %%
H_fig = 8
reads = {kv: [i // (H_fig // kv) for i in range(H_fig)] for kv in (8, 4, 2, 1)}   # head i reads i // g
for kv, heads in reads.items():
    print(f"kv_heads = {kv}: query heads 0..7 read key/value heads {heads}")
fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
cmap = plt.get_cmap("tab10")
for row, (kv, heads) in enumerate(reads.items()):
    for i, j in enumerate(heads):
        ax.add_patch(plt.Rectangle((i, -row - 0.9), 0.9, 0.8, color=cmap(j)))
        ax.text(i + 0.45, -row - 0.5, f"{j}", ha="center", va="center", color="white", fontsize=11)
ax.set_xlim(-0.1, H_fig); ax.set_ylim(-len(reads) - 0.1, 0)
ax.set_xticks([i + 0.45 for i in range(H_fig)], [str(i) for i in range(H_fig)])
ax.set_yticks([-r - 0.5 for r in range(len(reads))], [f"{kv} kv heads" for kv in reads])
ax.set_aspect("equal")
ax.set_xlabel("query head")
ax.set_title("the key/value head each query head reads")
for side in ("top", "right", "left", "bottom"):
    ax.spines[side].set_visible(False)
ax.tick_params(length=0)
show_figure(fig, "26_gqa_groups.png", alt="Eight query heads in four rows, for 8, 4, 2 and 1 key/value "
            "heads: with 8 each query head reads its own; with 4, heads 0-1 read 0, 2-3 read 1 and so on; "
            "with 2, heads 0-3 read 0 and 4-7 read 1; with 1, all read key/value head 0")

# %% [markdown]
# The gradient check runs the layer with 8, 4, 2 and 1 key/value heads:

# %%
H, Dh_g, Bsz, Tg = 8, 4, 2, 5
Dg = H * Dh_g
xq = rng.standard_normal((Bsz, Tg, Dg))
rows = []
for kv in (8, 4, 2, 1):
    shapes = {"w_q": (Dg, Dg), "b_q": (Dg,), "w_k": (Dg, kv * Dh_g), "b_k": (kv * Dh_g,),
              "w_v": (Dg, kv * Dh_g), "b_v": (kv * Dh_g,), "w_o": (Dg, Dg), "b_o": (Dg,)}
    prm = {n: rng.standard_normal(s) / np.sqrt(Dg) for n, s in shapes.items()}   # unit-scale products

    def fwd(x_q, x_kv, **p):
        return multi_head_attention_forward(x_q, x_kv, **p, n_heads=H, kv_heads=kv)
    errs = check_layer(f"gqa(kv_heads={kv})", fwd, multi_head_attention_backward,
                       {"x_q": xq, "x_kv": xq.copy(), **prm}, ("x_q", "x_kv", *prm))
    rows.append((kv, H // kv, 2 * kv * Dh_g, max(errs.values())))
print(f"{'kv_heads':>8} {'group':>6} {'cache floats per position and layer':>37} {'worst gradient error':>21}")
for kv, g, per_pos, err in rows:
    print(f"{kv:>8} {g:>6} {per_pos:>37} {err:>21.1e}")

# %% [markdown]
# The cache shrinks by the group size. For the paper's base model (six decoder layers,
# $d_{model} = 512$) decoding a 100-token sentence in float32:

# %%
layers, d_model, heads, length = 6, 512, 8, 100
for kv in (8, 2, 1):
    kib = 2 * layers * length * kv * (d_model // heads) * 4 / 1024
    print(f"  kv_heads = {kv}: {kib:,.0f} KiB of keys and values per sentence")

# %% [markdown]
# ## 4. RMSNorm (Zhang and Sennrich, 2019)
#
# Layer norm without the mean and without $\beta$: each row is divided by its root mean square,
#
# $$\mathrm{RMSNorm}(x) = \gamma \odot \hat{x}, \qquad \hat{x} = x / r, \qquad r = \sqrt{\tfrac{1}{D}\textstyle\sum_j x_j^2 + \epsilon}. \tag{26.4}$$
#
# **The backward**, in three lines. With $g = \gamma \odot dy$ the gradient reaching $\hat{x}$
# (and $d\gamma = \sum_{\text{rows}} dy \odot \hat{x}$):
#
# 1. $\hat{x}_i = x_i / r$ depends on $x_j$ directly when $i = j$ and through $r$ always:
#    $dx_j = g_j / r - \sum_i g_i\, x_i / r^2 \cdot \partial r / \partial x_j$.
# 2. $r^2 = \frac{1}{D}\sum_j x_j^2 + \epsilon$ gives $\partial r / \partial x_j = x_j / (D\, r)$.
# 3. So $dx_j = \frac{1}{r}\big(g_j - \hat{x}_j \cdot \frac{1}{D}\sum_i g_i\, \hat{x}_i\big)$:
#    layer norm's backward with the mean's term gone.
#
# The cell computes line 3 by hand, compares it with `rmsnorm_backward`, and checks both against
# central differences in float64:

# %%
x_r, gamma_r = rng.standard_normal((3, 5, 8)) * 3, rng.standard_normal(8)
dy_r = rng.standard_normal(x_r.shape)
r = np.sqrt((x_r ** 2).mean(axis=-1, keepdims=True) + 1e-6)
xhat = x_r / r
g = gamma_r * dy_r
dx_by_hand = (g - xhat * (g * xhat).mean(axis=-1, keepdims=True)) / r          # line 3
y_r, cache_r = rmsnorm_forward(x_r, gamma_r)
dx_lib, dgamma_lib = rmsnorm_backward(dy_r, cache_r)
hand_err = max(np.abs(dx_by_hand - dx_lib).max(), np.abs((dy_r * xhat).sum(axis=(0, 1)) - dgamma_lib).max())
print(f"line 3 by hand against rmsnorm_backward: largest difference {hand_err:.1e}")
rms_err = check_layer("rmsnorm", rmsnorm_forward, rmsnorm_backward, {"x": x_r, "gamma": gamma_r}, ("x", "gamma"))
print("gradient check (float64, central differences):", ", ".join(f"d{n} {e:.1e}" for n, e in rms_err.items()))
scaled = np.abs(rmsnorm_forward(7.0 * x_r, gamma_r)[0] - y_r).max()
print(f"RMSNorm of 7 x: largest difference from RMSNorm of x {scaled:.1e} (scaling a row changes nothing but for epsilon)")

# %% [markdown]
# ## 5. QK-norm (OLMo 2, Gemma 3)
#
# Nothing in the paper's attention bounds a score: $q \cdot k / \sqrt{d_h}$ grows with the
# queries and keys, and a few large logits saturate a softmax, which is where large models'
# training runs have diverged. QK-norm puts an RMSNorm with a learned gain (one per feature of a
# head, shared by the heads) over each head's query and key, after the projections and before
# rotary positions: $\hat q = g_q \odot q / \mathrm{rms}(q)$, and $\hat k$ likewise. A normed
# head is $\sqrt{d_h}$ long before its gain, so by Cauchy-Schwarz, whatever the inputs,
#
# $$\frac{|\hat q \cdot \hat k|}{\sqrt{d_h}} \le \sqrt{d_h}\, \max|g_q|\, \max|g_k|, \tag{26.5}$$
#
# and rotary positions, which keep lengths, keep the bound. The backward is RMSNorm's over the
# last axis of the heads, each gain's gradient summed over sentences, positions and heads. The
# model has it in every attention with `qk_norm=True` (`attn-train --qk-norm`). Below, the
# same attention on ever larger inputs, without it and with it:

# %%
Hn, Dh_n = 4, 8
Dn = Hn * Dh_n
prm_n = {n: rng.standard_normal(s) / np.sqrt(Dn) for n, s in
         {f"{p}_{w}": ((Dn, Dn) if p == "w" else (Dn,)) for w in "qkvo" for p in "wb"}.items()}
g_q, g_k = rng.uniform(0.5, 1.5, Dh_n), rng.uniform(0.5, 1.5, Dh_n)
bound = np.sqrt(Dh_n) * np.abs(g_q).max() * np.abs(g_k).max()          # equation 26.5


layer_gap = []                             # the heads below, attended, against the library's layer


def largest_score(x, gains):
    """The largest |q . k| / sqrt(Dh) over the heads of x (B, T, D), QK-normed with ``gains`` or not."""
    q, k, v = (split_heads(x @ prm_n[f"w_{w}"] + prm_n[f"b_{w}"], Hn) for w in "qkv")
    if gains is not None:
        q, k = rmsnorm_forward(q, gains[0])[0], rmsnorm_forward(k, gains[1])[0]
    out = merge_heads(attention_forward(q, k, v)[0]) @ prm_n["w_o"] + prm_n["b_o"]
    layer = multi_head_attention_forward(x, x, **prm_n, n_heads=Hn, qk_gains=gains)[0]
    layer_gap.append(np.abs(out - layer).max() / np.abs(layer).max())
    return np.abs(q @ k.swapaxes(-1, -2)).max() / np.sqrt(Dh_n)


rows_n = [(size, *(largest_score(size * rng.standard_normal((2, 6, Dn)), g) for g in (None, (g_q, g_k))))
          for size in (1, 10, 100)]
print(f"{'input size':>10} {'largest |score|, paper':>23} {'with QK-norm':>13}   (bound 26.5: {bound:.2f})")
for size, plain, normed in rows_n:
    print(f"{size:>10} {plain:>23.2f} {normed:>13.2f}")


def qk_fwd(x_q, x_kv, g_q, g_k, **p):
    return multi_head_attention_forward(x_q, x_kv, **p, n_heads=2, qk_gains=(g_q, g_k))


small = {n: rng.standard_normal((8, 8) if n[0] == "w" else (8,)) for n in prm_n}
qk_err = max(check_layer("qk_norm attention", qk_fwd, multi_head_attention_backward,
                         {"x_q": rng.standard_normal((2, 3, 8)), "x_kv": rng.standard_normal((2, 4, 8)), **small,
                          "g_q": rng.uniform(0.5, 1.5, 4), "g_k": rng.uniform(0.5, 1.5, 4)},
                         ("x_q", "x_kv", *small, "g_q", "g_k")).values())
print(f"gradient check of attention with QK-norm (float64, every input and gain): relative error {qk_err:.1e}; "
      f"the heads above attended equal the layer's output to {max(layer_gap):.1e}")

# %% [markdown]
# ## Check

# %%
assert hand_err < 1e-12 and max(rms_err.values()) < 1e-6 and scaled < 1e-6, "RMSNorm's backward is line 3"
assert spread < 1e-10, "rotary scores must depend only on the offset"
assert norm_change < 1e-12 and np.abs(back - x).max() < 1e-12
assert rope_err < 1e-6 and max(glu_err.values()) < 1e-6 and all(r[3] < 1e-6 for r in rows)
assert abs(3 * F_glu - 2 * F_base) <= 3, "SwiGLU's width must keep the parameter count"
assert np.abs(dsilu - num_dsilu).max() < 1e-6 and s_a.min() < 0
assert all(normed <= bound * (1 + 1e-9) for _, _, normed in rows_n) and rows_n[-1][1] > bound
assert qk_err < 1e-6 and max(layer_gap) < 1e-12
print(f"Check passed: rotary scores depend on the offset alone (spread {spread:.1e}); gradient checks of "
      f"RoPE, SwiGLU, grouped-query attention and RMSNorm within "
      f"{max(rope_err, *glu_err.values(), *(r[3] for r in rows), *rms_err.values()):.1e}")
print(f"QK-norm: the largest score {max(r[2] for r in rows_n):.2f} stays within its bound {bound:.2f} at every "
      f"input size; without it {rows_n[-1][1]:.0f}")

# %% [markdown]
# ## Questions
#
# 1. Rotary positions are applied to the queries and keys but not to the values. Why?
#
#    <details><summary>Answer</summary>
#
#    The positions' job is to shape *which* keys a query attends to, and that is decided by
#    the scores alone, where equation 26.2 makes them relative. The values carry *what* is
#    read; turning them would mix each value's features by an angle that depends on where
#    the key was, which nothing in the output undoes.
#
#    </details>
#
# 2. With $h_{kv} = 1$, how many times is each key/value head's gradient added up, and where
#    does the saving of grouped-query attention show: in the training step or in decoding?
#
#    <details><summary>Answer</summary>
#
#    $h$ times, once per query head. Training still computes $h$ score matrices, so its cost
#    barely changes (the key/value projections shrink); the saving is the decoder's cache,
#    read in full at every generated token, which is $h / h_{kv}$ times smaller.
#
#    </details>

# %% [markdown]
# ## Exercise
#
# Write RMSNorm (part 4: equation 26.4 and the three lines of its backward) yourself in
# `lessons/exercises/rmsnorm.py` and grade it:
#
# ```
# attn-check lessons/exercises/rmsnorm.py
# ```
#
# Then the three layers of this lesson, each a starter with its signature and the shapes:
#
# ```
# attn-check lessons/exercises/rope.py
# attn-check lessons/exercises/swiglu.py
# attn-check lessons/exercises/grouped_query_attention.py
# ```
#
# Each is graded on the examples that prove the library's layer, hard ones included, and on
# the invariants above: a rotation keeps lengths and sees only offsets, a zero value path
# gates nothing, and grouped-query attention is the paper's attention with each group's
# key/value head repeated. `attn-check --hint 2` says where to look, `--hint 3` gives the formula.

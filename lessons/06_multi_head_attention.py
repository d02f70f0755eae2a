# %% [markdown]
# # Lesson 6: multi-head attention (section 3.2.2)
#
# $$\mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_h)\, W^O,
# \qquad \mathrm{head}_i = \mathrm{Attention}(Q W_i^Q,\, K W_i^K,\, V W_i^V) \tag{§3.2.2}$$
#
# with $W_i^Q, W_i^K \in \mathbb{R}^{d_{\text{model}} \times d_k}$, $W_i^V \in \mathbb{R}^{d_{\text{model}} \times d_v}$,
# $W^O \in \mathbb{R}^{h d_v \times d_{\text{model}}}$, and in the paper `h = 8`, `d_k = d_v = d_model / h = 64`.
# (Blog posts often write $W_i^O$, one output matrix per head. The paper has a single
# $W^O$. Its row block `i` does act on head `i` alone, since
# $\mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_h) W^O = \sum_i \mathrm{head}_i\, W^O[i d_v : (i+1) d_v,\ :]$; but the
# blocks are added up, so every output dimension mixes all the heads, and it is
# one `(h d_v, d_model)` parameter, not `h` separate layers.)
#
# Instead of one attention over `d_model`-wide vectors, `h` *smaller* attentions,
# each with its own projections, each producing its own weights: one head can look
# at the previous word while another looks at the verb. "With a single attention
# head, averaging inhibits this."
#
# This lesson shows
#
# 1. how the library runs the `h` heads without a Python loop (`split_heads` /
#    `merge_heads`), and that an explicit loop over heads gives the same numbers,
#    forward and backward;
# 2. that `h` heads of width `d_model / h` cost the same parameters and the same
#    multiply-adds as one head of full width (the paper: "the total computational
#    cost is similar to that of single-head attention with full dimensionality");
# 3. four heads, wired by hand, each attending to a different relative position at
#    the same time, something one head cannot do.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn import diagram
from attn.layers import (attention_backward, attention_forward, attention_weights, merge_heads,
                         multi_head_attention_backward, multi_head_attention_forward, sinusoidal_table, split_heads)
from attn.masks import padding_mask

np.set_printoptions(precision=4, suppress=True, linewidth=130)

# %% [markdown]
# ## 1. The reshape trick
#
# Stack the `h` matrices $W_i^Q$ side by side and you get one `(d_model, d_model)`
# matrix $W^Q = [W_1^Q | W_2^Q | \dots | W_h^Q]$. One matrix product $x W^Q$ then
# computes every head's queries at once; head `i`'s queries are the column block
# `i*d_k : (i+1)*d_k` of the result. `split_heads` turns `(B, T, D)` into
# `(B, H, T, D/H)` with a reshape (cutting the last axis into `H` blocks) and a
# transpose (moving the head axis forward), so that `attention_forward`, which works
# on any leading axes, runs all heads in one batched matmul. `merge_heads` undoes
# it, which *is* the Concat of the formula.

# %%
rng = np.random.default_rng(0)
Bsz, T, S, D, H = 2, 5, 7, 16, 4
Dh = D // H
x_q = rng.standard_normal((Bsz, T, D))                          # queries' source (e.g. the decoder)
x_kv = rng.standard_normal((Bsz, S, D))                         # keys'/values' source (e.g. the encoder)
params = {n: rng.standard_normal((D, D)) / np.sqrt(D) for n in ("w_q", "w_k", "w_v", "w_o")}
params.update({n: 0.1 * rng.standard_normal(D) for n in ("b_q", "b_k", "b_v", "b_o")})
src_ids = np.array([[5, 3, 8, 2, 9, 0, 0], [4, 4, 7, 1, 6, 2, 3]])   # the first source has 2 pads
mask = padding_mask(src_ids)                                    # (2, 1, 1, 7)
show_figure(diagram.attention_figure(n_heads=H, d_k=Dh), "06_multi_head_attention.png")   # the paper's Figure 2

q_all = x_q @ params["w_q"] + params["b_q"]                     # (B, T, D): every head's queries at once
q_heads = split_heads(q_all, H)                                 # (B, H, T, Dh)
print("x_q", x_q.shape, "-> x_q @ W_q", q_all.shape, "-> split_heads", q_heads.shape)
for i in range(H):
    cols = slice(i * Dh, (i + 1) * Dh)
    own = x_q @ params["w_q"][:, cols] + params["b_q"][cols]    # head i with its own W_i^Q: (B, T, Dh)
    print(f"  head {i}: split_heads(...)[:, {i}] == x_q @ W_q[:, {cols.start}:{cols.stop}]  "
          f"max |diff| = {np.abs(q_heads[:, i] - own).max():.1e}")
print("merge_heads(split_heads(q)) == q exactly:", np.array_equal(merge_heads(q_heads), q_all))

# %% [markdown]
# ### An explicit loop over heads, forward and backward
#
# Now the whole layer written the way the formula reads: a loop over `i`, one small
# attention per head, concatenate, project. Then the same layer from the library.

# %%
def mha_loop_forward(x_q, x_kv, p, H, mask=None):
    """MultiHead written as a loop over heads. Returns out (B, T, D) and what backward needs."""
    D = x_q.shape[-1]; Dh = D // H
    heads, caches = [], []
    for i in range(H):
        c = slice(i * Dh, (i + 1) * Dh)
        q = x_q @ p["w_q"][:, c] + p["b_q"][c]                   # (B, T, Dh) = Q W_i^Q
        k = x_kv @ p["w_k"][:, c] + p["b_k"][c]                  # (B, S, Dh) = K W_i^K
        v = x_kv @ p["w_v"][:, c] + p["b_v"][c]                  # (B, S, Dh) = V W_i^V
        m = None if mask is None else mask[:, 0]                 # (B, 1, S): no head axis here
        head, cache = attention_forward(q, k, v, m)              # (B, T, Dh)
        heads.append(head); caches.append(cache)
    concat = np.concatenate(heads, axis=-1)                      # (B, T, D) = Concat(head_1..head_h)
    return concat @ p["w_o"] + p["b_o"], (concat, caches)


def mha_loop_backward(dout, x_q, x_kv, p, H, saved):
    """Backward of the loop: each head's gradients land in its own column block."""
    concat, caches = saved
    D = x_q.shape[-1]; Dh = D // H
    g = {"w_o": concat.reshape(-1, D).T @ dout.reshape(-1, D), "b_o": dout.reshape(-1, D).sum(0)}
    for n in ("w_q", "w_k", "w_v"):
        g[n] = np.zeros((D, D))
    for n in ("b_q", "b_k", "b_v"):
        g[n] = np.zeros(D)
    dconcat = dout @ p["w_o"].T                                  # (B, T, D)
    dx_q, dx_kv = np.zeros_like(x_q), np.zeros_like(x_kv)
    for i in range(H):
        c = slice(i * Dh, (i + 1) * Dh)
        dq, dk, dv = attention_backward(dconcat[..., c], caches[i])
        for n, d, x in (("q", dq, x_q), ("k", dk, x_kv), ("v", dv, x_kv)):
            g["w_" + n][:, c] = x.reshape(-1, D).T @ d.reshape(-1, Dh)
            g["b_" + n][c] = d.reshape(-1, Dh).sum(0)
        dx_q += dq @ p["w_q"][:, c].T
        dx_kv += dk @ p["w_k"][:, c].T + dv @ p["w_v"][:, c].T
    return dx_q, dx_kv, g


order = ["w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o"]
out_lib, cache = multi_head_attention_forward(x_q, x_kv, *[params[n] for n in order], n_heads=H, mask=mask)
out_loop, saved = mha_loop_forward(x_q, x_kv, params, H, mask)
fwd_diff = np.abs(out_lib - out_loop).max()
w_diff = max(np.abs(attention_weights(cache)[:, i] - attention_weights(saved[1][i])).max() for i in range(H))

dout = rng.standard_normal(out_lib.shape)
grads_lib = multi_head_attention_backward(dout, cache)          # dx_q, dx_kv, dw_q, db_q, ..., dw_o, db_o
dx_q, dx_kv, g_loop = mha_loop_backward(dout, x_q, x_kv, params, H, saved)
grads_loop = [dx_q, dx_kv] + [g_loop[n] for n in order]
names = ["dx_q", "dx_kv"] + ["d" + n for n in order]
bwd_diff = {n: np.abs(a - b).max() for n, a, b in zip(names, grads_lib, grads_loop)}
print(f"forward:  max |library - loop| = {fwd_diff:.1e}   (attention weights per head: {w_diff:.1e})")
print("backward: max |library - loop| per gradient:")
for n, d in bwd_diff.items():
    print(f"   {n:<6} {d:.1e}")

# %% [markdown]
# Identical to the last few bits of float64 (differences of order 1e-16 come
# from the order in which BLAS adds things up, not from the maths). Two things
# are worth saying aloud:
#
# * The heads never interact between the projections: head `i`'s queries only
#   meet head `i`'s keys. So in backward, the gradient of $W^Q$ is just the
#   per-head gradients $dW_i^Q$ side by side, which is what the loop writes into
#   column block `i`.
# * The input `x_kv` feeds both keys and values, so its gradient is the sum of
#   both paths (`dx_k + dx_v`); in self-attention `x_q` is the same array again and
#   the caller adds `dx_q` as well (lesson 5 did exactly that).
#
# ## 2. Same cost as one full-width head
#
# Parameters: $W^Q, W^K, W^V, W^O$ are `(D, D)` plus biases whatever `h` is; the
# heads *partition* the columns, they do not add any. The paper's `h` separate
# `D x d_k` matrices hold exactly as many numbers: $h \cdot D \cdot (D/h) = D^2$.
#
# Multiply-adds for `n` queries and `n` keys (self-attention):
#
# | step | one head, width D | h heads, width D/h |
# |---|---|---|
# | projections Q, K, V, O | $4 n D^2$ | $4 n D^2$ (same matrices) |
# | scores $Q K^\top$ | $n^2 D$ | $h \cdot n^2 \cdot D/h = n^2 D$ |
# | weighted sum `W V` | $n^2 D$ | $h \cdot n^2 \cdot D/h = n^2 D$ |
#
# We do not count by formula, we count from shapes: of the inputs, of the weight
# matrices the layer multiplies by, and of the attention weights it returned
# (`attn.layers.attention_weights(cache)`, `(B, h, Tq, Tk)`: one table per head, which
# is how we learn how many heads ran and how wide each was).

# %%
def count_params(p, cache):
    """Weights (biases aside, 4*D in every case) two ways: the (D, D) arrays the library
    multiplied by (p, in the order w_q, b_q, ..., w_o, b_o), and the paper's h separate matrices
    per projection (W_i^Q, W_i^K: D x d_k; W_i^V: D x d_v; W^O: h*d_v x D), d_k = d_v = D/h."""
    lib = sum(w.size for w in p[0::2])
    D, h = p[0].shape[0], attention_weights(cache).shape[1]
    d_k = d_v = D // h
    paper = h * (D * d_k + D * d_k + D * d_v) + (h * d_v) * D
    return lib, paper


def count_macs(x_q, x_kv, p, cache):
    """Multiply-adds of one multi_head_attention_forward, read off the shapes of its inputs,
    its weight matrices and the attention weights it returned."""
    rows_q, rows_kv = int(np.prod(x_q.shape[:-1])), int(np.prod(x_kv.shape[:-1]))
    w_q, w_k, w_v, w_o = p[0::2]
    proj = sum(r * w.shape[0] * w.shape[1] for r, w in ((rows_q, w_q), (rows_kv, w_k), (rows_kv, w_v), (rows_q, w_o)))
    weights = attention_weights(cache)                           # (B, H, Tq, Tk)
    Bsz, h, Tq, Tk = weights.shape
    Dk, Dv = w_q.shape[1] // h, w_v.shape[1] // h                # each head's slice of the columns
    scores = Bsz * h * Tq * Tk * Dk                              # Q K^T, per head, all heads
    wsum = Bsz * h * Tq * Tk * Dv                                # weights @ V
    n_exp = weights.size                                         # softmax entries: B*H*Tq*Tk
    return proj, scores, wsum, n_exp


D_cost, n_tok = (128, 24) if QUICK else (512, 64)
x = rng.standard_normal((1, n_tok, D_cost))
pp = [rng.standard_normal((D_cost, D_cost)) if n.startswith("w") else np.zeros(D_cost) for n in order]
hs = [h for h in (1, 2, 4, 8, 16, 32, 64) if D_cost % h == 0]
rows = []
for h in hs:
    _, c = multi_head_attention_forward(x, x, *pp, n_heads=h)
    lib_w, paper_w = count_params(pp, c)
    assert lib_w == paper_w, (h, lib_w, paper_w)
    rows.append((h, D_cost // h, lib_w) + count_macs(x, x, pp, c))
print(f"self-attention, n = {n_tok} tokens, d_model = {D_cost}")
print(f"{'h':>3} {'d_k':>4} {'weights':>9} {'proj MACs':>11} {'QK^T MACs':>10} {'WV MACs':>9} "
      f"{'total MACs':>11} {'softmax entries':>16}")
for h, dk, npar, proj, sc, ws, ne in rows:
    print(f"{h:>3} {dk:>4} {npar:>9,} {proj:>11,} {sc:>10,} {ws:>9,} {proj + sc + ws:>11,} {ne:>16,}")

# %% [markdown]
# Every column but the last is constant down the table: parameters and
# multiply-adds do not depend on `h`. The last column does: each head has its own
# `n x n` weight matrix, so the softmax's `exp`s and the memory for the weights
# (kept for backward) grow as $h n^2$. For the paper's sizes that is small next to
# the $4 n d^2$ of the projections, which is why the paper says "similar", not
# "equal". On real hardware more, smaller matmuls also run less efficiently, so
# heads are not entirely free.
#
# ## 3. What heads buy: several patterns at once
#
# To see heads doing different jobs without training anything, we wire four of
# them by hand, using lesson 3's fact that a fixed rotation `M_k` maps `PE(t)` to
# `PE(t + k)`. The input is the positional encoding alone, `x_t = PE(t)`. Head `i`
# gets $W_i^K$ = "keep the 16 fastest dimensions" and $W_i^Q$ = $c \cdot M_{k_i}$
# restricted to the same dimensions, so its score is
# $c \cdot PE(t + k_i) \cdot PE(s) / \sqrt{d_k}$, largest at `s = t + k_i`: head `i` looks
# `k_i` positions away. We give the heads offsets -1, 0, +1 and +3 and let
# `multi_head_attention_forward` run them together.

# %%
def shift_matrix(k, d_model):
    """Lesson 3's block-diagonal rotation: PE(t) @ M_k = PE(t + k)."""
    M = np.zeros((d_model, d_model))
    for i, w in enumerate(1.0 / 10000.0 ** (np.arange(0, d_model, 2) / d_model)):
        c, s = np.cos(w * k), np.sin(w * k)
        M[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[c, -s], [s, c]]
    return M


Dp, Hp, Tp, sharp = 64, 4, 12, 10.0
Dhp = Dp // Hp
offsets = [-1, 0, 1, 3]
pe = sinusoidal_table(Tp, Dp, dtype="float64")[None]            # (1, 12, 64)
w_q, w_k = np.zeros((Dp, Dp)), np.zeros((Dp, Dp))
for i, k in enumerate(offsets):
    w_q[:, i * Dhp:(i + 1) * Dhp] = sharp * shift_matrix(k, Dp)[:, :Dhp]
    w_k[:, i * Dhp:(i + 1) * Dhp] = np.eye(Dp)[:, :Dhp]
eye, zero = np.eye(Dp), np.zeros(Dp)
_, cache_p = multi_head_attention_forward(pe, pe, w_q, zero, w_k, zero, eye, zero, eye, zero, n_heads=Hp)
wp = attention_weights(cache_p)[0]                              # (4, 12, 12)
hits = {}
for i, k in enumerate(offsets):
    ts = [t for t in range(Tp) if 0 <= t + k < Tp]
    hits[k] = all(wp[i, t].argmax() == t + k for t in ts)
    print(f"head {i} (offset {k:+d}): argmax key == query + {k} for every query that has one: {hits[k]}; "
          f"mean weight there {np.mean([wp[i, t, t + k] for t in ts]):.3f}")

# %%
fig = plt.figure(figsize=(12, 9))
grid = fig.add_gridspec(2, 4)                                   # one grid: the layout keeps the panels apart
for i, k in enumerate(offsets):
    a = fig.add_subplot(grid[0, i])
    a.imshow(wp[i], cmap="Blues", vmin=0, vmax=1)
    a.set_title(f"head {i}: W_Q = c*M_({k:+d})", fontsize=10)
    a.set_xlabel("key position"); a.set_ylabel("query position") if i == 0 else None
a = fig.add_subplot(grid[1, :2])
hh = [r[0] for r in rows]
a.plot(hh, [r[2] for r in rows], "o-", label="weights (parameters)")
a.plot(hh, [r[3] + r[4] + r[5] for r in rows], "s-", label="multiply-adds (total)")
a.plot(hh, [r[4] + r[5] for r in rows], "^-", label="multiply-adds in QK^T and WV")
a.plot(hh, [r[6] for r in rows], "x--", label="softmax entries (B*h*n*n)")
a.set_xscale("log", base=2); a.set_yscale("log"); a.set_xlabel("number of heads h")
a.set_title(f"cost vs h at d_model = {D_cost}, n = {n_tok}"); a.legend(fontsize=8)
a = fig.add_subplot(grid[1, 2:])
single = wp.mean(0)                                             # what averaging the four patterns looks like
a.imshow(single, cmap="Blues", vmin=0, vmax=1)
a.set_title("the four heads' weights averaged: what one head\nmixing these positions would have to do", fontsize=10)
a.set_xlabel("key position"); a.set_ylabel("query position")
fig.tight_layout(); show_figure(fig, "06_multi_head.png")

# %% [markdown]
# The four heads' panels: each has a single sharp diagonal, shifted by its own offset (rows
# near the edge, whose target position does not exist, settle on the nearest
# position there is). The
# four outputs are concatenated and $W^O$ can use all of them: "the previous word",
# "this word", "the next word" and "three words on", side by side in separate
# dimensions. The heads' weights averaged: a single head would have to spread its one softmax over
# all four positions, and its output would be their *average*, one blurred vector
# in which the four words can no longer be told apart. That is the paper's
# "averaging inhibits this". The cost against `h`: flat lines for parameters and
# multiply-adds, a rising one for the softmax entries.
#
# ## Check
#
# These fail if `split_heads`/`merge_heads` cut the dimensions in the wrong order
# (for example `reshape(B, T, Dh, H)`, which interleaves the heads), if the heads
# were mixed anywhere, or if the backward pass misroutes any gradient.

# %%
assert fwd_diff < 1e-13 and w_diff < 1e-13, f"loop and reshape disagree: {fwd_diff:.2e}, {w_diff:.2e}"
assert max(bwd_diff.values()) < 1e-12, bwd_diff
assert len({r[2] for r in rows}) == 1, "the number of weights must not depend on h"
assert len({r[3] + r[4] + r[5] for r in rows}) == 1, "multiply-adds must not depend on h"
h1 = rows[0]
assert h1[4] == n_tok * n_tok * D_cost and h1[3] == 4 * n_tok * D_cost ** 2, "counts differ from n^2 d and 4 n d^2"
assert [r[6] for r in rows] == [h * n_tok * n_tok for h in hs]
assert all(hits.values()), hits
print(f"Check passed: loop == reshape (forward {fwd_diff:.1e}, backward {max(bwd_diff.values()):.1e}); "
      f"{h1[2]:,} weights and {h1[3] + h1[4] + h1[5]:,} multiply-adds for every h in {hs}.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. Why do `h` heads of width `d_model / h` cost the same parameters and multiply-
#    adds as one head of full width? What does grow with `h`?
#
#    <details><summary>Answer</summary>
#
#    Each head projects to width $d_k = d_{\text{model}}/h$, so the $h$ heads'
#    projections together are $d_{\text{model}} \times d_{\text{model}}$ matrices, the
#    size of one full-width head's; the score and weighted-sum products cost
#    $h \cdot n^2 \cdot D/h = n^2 D$ either way. What grows with $h$ is the number of
#    attention-weight tables: the $h n^2$ weights kept for backward.
#
#    </details>
#
# 2. Is $W^O$ one matrix per head? How does head `i`'s output reach every output
#    dimension?
#
#    <details><summary>Answer</summary>
#
#    No: $W^O$ is one $h d_v \times d_{\text{model}}$ matrix. Row block $i$ of it
#    multiplies head $i$'s output, and that block has $d_{\text{model}}$ columns, so head
#    $i$ reaches every output dimension; the heads' contributions are summed there.
#
#    </details>
#
# 3. Four heads attend to four relative positions at once; what would one head have
#    to do instead, and what would its output be?
#
#    <details><summary>Answer</summary>
#
#    One head has one softmax per query: to look at four relative positions it would have
#    to spread its weight over the four, and its output would be the *average* of the
#    four values, mixed into one vector, from which the next layer cannot recover which
#    position said what. Four heads keep the four values apart until $W^O$ combines them.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write `split_heads`, `merge_heads` and multi-head attention, forward and backward
# yourself. The starter `lessons/exercises/06_multi_head_attention.py` has the
# signatures, and the shapes and formulas in its docstrings; its bodies raise
# `NotImplementedError`. Fill them in, then grade your work:
#
#     attn-check lessons/exercises/06_multi_head_attention.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

# %% [markdown]
# # Lesson 5: masks, and why the decoder needs one (sections 3.1, 3.2.3)
#
# Attention lets every query look at every key. Twice the Transformer must forbid
# some of those looks:
#
# * **Padding.** Sentences in a batch have different lengths and are padded to
#   the longest. A pad token is not a word; no query may take information from it.
#   `attn.masks.padding_mask(ids)` is True on real keys, `(B, 1, 1, S)`.
# * **The future.** The decoder is trained with the whole target sentence as input
#   (shifted right by one) and asked to predict, at every position `i`, the token
#   at `i + 1`. If position `i` could attend to position `i + 1`, it would simply
#   read the answer. Section 3.2.3: "We need to prevent leftward information flow
#   in the decoder to preserve the auto-regressive property." The look-ahead
#   (causal) mask lets position `i` see positions `0..i` only:
#   `attn.masks.causal_mask(T)`, `(1, 1, T, T)`, a lower triangle.
#   `decoder_mask(tgt_ids)` is the two combined, `(B, 1, T, T)`.
#
# A mask is a boolean array that *broadcasts* against the scores `(B, H, Tq, Tk)`:
# True where the query may attend. The softmax gives masked keys a weight of
# exactly 0 (lesson 4).
#
# This lesson draws the masks on lesson 4's example, checks the "masked attention"
# numbers that lesson 4's slide deck prints, and then proves the point of the
# look-ahead mask with an experiment: a tiny model trained to predict the next token
# of *random* sequences. Random tokens cannot be predicted, so an honest model can do
# no better than a uniform guess, loss `log V`. Without the mask the model gets
# near-zero loss anyway. It cheats.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

from typing import NamedTuple

import numpy as np

from attn.layers import (attention_backward, attention_forward, attention_weights, embedding_backward,
                         embedding_forward, linear_backward, linear_forward, positional_backward, positional_forward,
                         sinusoidal_table)
from attn.loss import cross_entropy
from attn.masks import PAD_ID, causal_mask, decoder_mask, padding_mask

np.set_printoptions(precision=4, suppress=True, linewidth=130)


def show(title, table, rows, cols, fmt="{:9.4f}"):
    print(f"\n{title}")
    w = max(len(r) for r in rows) + 1
    print(" " * w + "".join(f"{c:>10}" for c in cols))
    for r, row in zip(rows, table):
        print(f"{r:<{w}}" + "".join(" " + fmt.format(v) for v in row))


# %% [markdown]
# ## 1. The three masks on lesson 4's example
#
# Same vectors as lesson 4: six English keys (the last one padding) and five Korean
# tokens 교육은 가장 중요한 무기이다 [pad] (*gyoyugeun gajang jungyohan mugiida*),
# `d_model = 4`. Token ids: English `[1, 2, 3, 4, 5, 0]`, Korean `[1, 2, 3, 4, 0]`;
# `PAD_ID` is 0.

# %%
keys = ["Education", "is", "most", "powerful", "weapon", "[pad]"]
kor = ["gyoyugeun", "gajang", "jungyohan", "mugiida", "[pad]"]     # 교육은 가장 중요한 무기이다 [pad]
K = np.array([[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.5], [0.3, 0.4, 0.5, 0.6],
              [0.4, 0.3, 0.2, 0.1], [0.5, 0.4, 0.3, 0.2], [0.1, 0.1, 0.1, 0.1]])   # (6, 4), also V
Q = np.array([[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.5], [0.3, 0.4, 0.5, 0.6],
              [0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.1]])                         # (5, 4)
src_ids = np.array([[1, 2, 3, 4, 5, 0]])
tgt_ids = np.array([[1, 2, 3, 4, 0]])

pad_m = padding_mask(src_ids)          # (1, 1, 1, 6)
causal = causal_mask(5, np)            # (1, 1, 5, 5)
dec_m = decoder_mask(tgt_ids)          # (1, 1, 5, 5)
for name, m in (("padding_mask(src_ids)", pad_m), ("causal_mask(5)", causal), ("decoder_mask(tgt_ids)", dec_m)):
    print(f"{name:<22} shape {m.shape}\n{m[0, 0].astype(int)}")

# %% [markdown]
# `padding_mask` has a single row: it is the same for every query, and broadcasting
# copies it down the `Tq` axis. `causal_mask` has no batch information at all: the
# same triangle for every sentence. `decoder_mask` is their `&`: the triangle, with
# the column of the target's own padding removed as well.
#
# ### The slides' "masked attention" example
#
# Lesson 4's slide deck demonstrates the look-ahead mask with the *same* setting as
# its padding example: Korean queries against English keys. Row `i` may see English
# keys `0..i`, and the `[pad]` key never. We rebuild that mask from the library's
# pieces (the first five rows of a 6 x 6 triangle, `&` the English padding mask), run
# `attention_forward`, and check the printed numbers as in lesson 4.

# %%
slide_mask = causal_mask(6, np)[:, :, :5, :] & pad_m                # (1, 1, 5, 6)
out_m, cache_m = attention_forward(Q[None, None], K[None, None], K[None, None], slide_mask)
w_m = attention_weights(cache_m)[0, 0]
show("the slides' masked example: weights", w_m, kor, keys)
show("the slides' masked example: output = weights @ V", out_m[0, 0], kor, [f"dim {j}" for j in range(4)])

SLIDE_W = """1.00 0 0 0 0 0
0.48 0.51 0 0 0 0
0.30 0.33 0.36 0 0 0
0.23 0.24 0.26 0.24 0 0
0.19 0.20 0.20 0.19 0.20 0"""
SLIDE_OUT = """0.1 0.2 0.3 0.4
0.15 0.25 0.35 0.45
0.20 0.30 0.40 0.50
0.25 0.30 0.35 0.40
0.30 0.32 0.34 0.36"""


def classify(printed, truth):
    """'rounded', 'truncated' (digits cut off) or 'WRONG', as in lesson 4."""
    d = len(printed.split(".")[1]) if "." in printed else 0
    x, unit = float(printed), 10.0 ** -d
    if abs(x - truth) <= unit / 2 + 1e-12:
        return "rounded"
    if abs(x - np.trunc(truth / unit + 1e-9) * unit) < 1e-12:
        return "truncated"
    return "WRONG"


slide_wrong = []
for name, text, truth in (("weights", SLIDE_W, w_m), ("output", SLIDE_OUT, out_m[0, 0])):
    v = [[classify(s, truth[i, j]) for j, s in enumerate(line.split())] for i, line in enumerate(text.splitlines())]
    flat = sum(v, [])
    slide_wrong += [(name, i, j) for i, row in enumerate(v) for j, c in enumerate(row) if c == "WRONG"]
    print(f"the slides' masked {name}: {flat.count('rounded')} rounded, {flat.count('truncated')} truncated, "
          f"{flat.count('WRONG')} wrong")

# %% [markdown]
# The arithmetic on this slide is right (cut off rather than rounded, as before).
# The *setting* is not. The look-ahead mask belongs to the decoder's
# **self**-attention, where queries, keys and values are all the target sentence;
# position `i` of the target must not see target positions after `i`, because
# those are what it is predicting. In **encoder-decoder** attention, Korean queries
# against English keys, nothing is hidden: "every position in the decoder [may]
# attend over all positions in the input sequence" (3.2.3). The source sentence is
# given in full; that is what translation means. The slide's mask stops 교육은
# from looking at "is most powerful weapon", which a translator is entitled to
# read, and it lines up English position `i` with Korean position `i` as if the two
# sentences were aligned word by word.
#
# Here is where the look-ahead mask really goes: decoder self-attention over the
# Korean sequence, with `decoder_mask(tgt_ids)`. (Encoder-decoder attention uses
# only `padding_mask(src_ids)`, which is exactly lesson 4's computation.)
#
# A curiosity: the slides gave the four Korean words *the same vectors* as the
# first four English words, so the first four rows below coincide with the slide's
# numbers. Only the `[pad]` query row differs, and that row is thrown away anyway.

# %%
out_d, cache_d = attention_forward(Q[None, None], Q[None, None], Q[None, None], dec_m)
w_d = attention_weights(cache_d)[0, 0]
show("decoder self-attention over the Korean sequence, decoder_mask(tgt_ids)", w_d, kor, kor)

# %%
fig, ax = plt.subplots(2, 2, figsize=(8.5, 9))
ax = ax.ravel()
panels = [
    (np.broadcast_to(pad_m[0, 0], (5, 6)), kor, keys, "padding_mask(src_ids)\n(broadcast over the queries)"),
    (causal[0, 0], kor, kor, "causal_mask(5)"),
    (dec_m[0, 0], kor, kor, "decoder_mask(tgt_ids)\n= causal & target padding"),
    (w_d, kor, kor, "decoder self-attention weights\n(masked entries exactly 0)"),
]
for a, (img, rows, cols, title) in zip(ax, panels):
    is_mask = img.dtype == bool
    a.imshow(img, cmap="Greens" if is_mask else "Blues", vmin=0, vmax=1)
    a.set_xticks(range(len(cols)), cols, rotation=45, ha="right"); a.set_yticks(range(len(rows)), rows)
    a.set_xlabel("key"); a.set_title(title, fontsize=10)
    for i in range(img.shape[0]):
        for j in range(img.shape[1]):
            a.text(j, i, ("T" if img[i, j] else "F") if is_mask else f"{img[i, j]:.2f}",
                   ha="center", va="center", fontsize=8, color="black")
ax[0].set_ylabel("query"); ax[2].set_ylabel("query")
fig.tight_layout(); show_figure(fig, "05_masks.png")

# %% [markdown]
# Green is True, "may attend". Notice in the decoder mask that the `[pad]` *query*
# row is not blanked: masks remove keys, and the padding query's output is ignored
# by the loss instead. Notice too that the diagonal is always allowed: position `i`
# sees itself, so no row of a decoder mask is ever entirely False (unless position
# 0 itself is padding).
#
# ## 2. Without the look-ahead mask, the decoder cheats
#
# A deliberately tiny next-token predictor, built from the layer pairs of lessons
# 3 and 4 and a linear layer: one attention head whose queries, keys and values are
# three learned projections of the same input (self-attention; lesson 6 splits this
# into several heads):
#
# ```
# ids (B, T) ─ embedding·sqrt(D) ─ + PE ─ x ─ attention(x W_q, x W_k, x W_v, mask) ─ linear ─ logits (B, T, V)
# ```
#
# It is trained the way the decoder is trained (teacher forcing): feed tokens
# $s_0 \ldots s_{T-1}$ and ask position `t` to predict $s_{t+1}$. The data are **uniformly
# random** token sequences, fresh every step, so $s_{t+1}$ is independent of
# everything before it. The best an honest model can do is predict the uniform
# distribution, cross-entropy `log V`. We train two copies from the same
# initialisation on the same data, with and without `causal_mask`; forward and
# backward are the library's, Adam is eight lines below.

# %%
V, T, D, Bsz = 16, 8, 32, 32
steps = quick_steps(150) if QUICK else 400
table = sinusoidal_table(T, D, dtype="float64")


def init_params(seed):
    r = np.random.default_rng(seed)
    p = {"emb": r.normal(0, D ** -0.5, (V, D)),
         "w_out": r.normal(0, D ** -0.5, (D, V)), "b_out": np.zeros(V)}
    for n in "qkv":
        p["w_" + n] = r.normal(0, D ** -0.5, (D, D)); p["b_" + n] = np.zeros(D)
    return p


class Caches(NamedTuple):
    """The layers' caches, by name: emb, pos, the three projections, att (attention_forward's), out."""
    emb: object
    pos: object
    q: object
    k: object
    v: object
    att: object
    out: object


def forward(p, ids, mask):
    """ids (B, T) -> logits (B, T, V), caches."""
    e, c_emb = embedding_forward(ids, p["emb"], np.sqrt(D))          # (B, T, D)
    x, c_pos = positional_forward(e, table)                           # (B, T, D)
    q, c_q = linear_forward(x, p["w_q"], p["b_q"])                    # (B, T, D) each
    k, c_k = linear_forward(x, p["w_k"], p["b_k"])
    v, c_v = linear_forward(x, p["w_v"], p["b_v"])
    a, c_att = attention_forward(q[:, None], k[:, None], v[:, None], mask)   # (B, 1, T, D): one head
    logits, c_out = linear_forward(a[:, 0], p["w_out"], p["b_out"])   # (B, T, V)
    return logits, Caches(c_emb, c_pos, c_q, c_k, c_v, c_att, c_out)


def backward(dlogits, caches):
    """The forward in reverse; x fed the queries, the keys and the values, so its gradient is the sum."""
    g = {}
    da, g["w_out"], g["b_out"] = linear_backward(dlogits, caches.out)
    dq, dk, dv = attention_backward(da[:, None], caches.att)         # (B, 1, T, D) each
    dxq, g["w_q"], g["b_q"] = linear_backward(dq[:, 0], caches.q)
    dxk, g["w_k"], g["b_k"] = linear_backward(dk[:, 0], caches.k)
    dxv, g["w_v"], g["b_v"] = linear_backward(dv[:, 0], caches.v)
    dx, _ = positional_backward(dxq + dxk + dxv, caches.pos)         # the sinusoids have no parameters
    g["emb"] = embedding_backward(dx, caches.emb)
    return g


def train(mask, seed=0, lr=1e-2, b1=0.9, b2=0.98, eps=1e-9):
    p = init_params(seed)
    m = {k: np.zeros_like(v) for k, v in p.items()}
    s2 = {k: np.zeros_like(v) for k, v in p.items()}
    data = np.random.default_rng(1234)                                # the same batches for both runs
    losses = []
    for step in range(1, steps + 1):
        seq = data.integers(0, V, (Bsz, T + 1))                       # fresh random sequences
        logits, caches = forward(p, seq[:, :-1], mask)
        loss, dlogits = cross_entropy(logits, seq[:, 1:], pad_id=None)   # every token is real here
        g = backward(dlogits, caches)
        for k in p:                                                   # Adam (section 5.3's betas)
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            s2[k] = b2 * s2[k] + (1 - b2) * g[k] ** 2
            p[k] -= lr * (m[k] / (1 - b1 ** step)) / (np.sqrt(s2[k] / (1 - b2 ** step)) + eps)
        losses.append(float(loss))
    return p, np.array(losses)


p_masked, loss_masked = train(causal_mask(T, np))
p_open, loss_open = train(None)


def per_position_loss(p, mask, n=1024, seed=7):
    """Cross-entropy at each position on fresh held-out random sequences."""
    seq = np.random.default_rng(seed).integers(0, V, (n, T + 1))
    logits, _ = forward(p, seq[:, :-1], mask)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, seq[:, 1:, None], -1)[..., 0].mean(0)   # (T,)


pos_masked = per_position_loss(p_masked, causal_mask(T, np))
pos_open = per_position_loss(p_open, None)
print(f"log V = log {V} = {np.log(V):.4f}   ({steps} steps of Adam, batch {Bsz}, T = {T})")
print(f"training loss, mean of the last 20 steps: with mask {loss_masked[-20:].mean():.4f}, "
      f"without {loss_open[-20:].mean():.4f}")
show("held-out loss per position (position t predicts token t+1)",
     np.stack([pos_masked, pos_open]), ["with causal_mask", "without mask"], [f"t={t}" for t in range(T)])
print(f"without the mask: last position {pos_open[-1]:.2f}, divided over the {T} positions "
      f"{pos_open[-1] / T:.2f}; the other positions add {pos_open[:-1].sum() / T:.2f}")

# %% [markdown]
# With the mask the loss sits at `log V` (printed above) at every position: the model
# learned the only honest thing, that the next token is a 16-sided die. Without the
# mask every position but the last is nearly perfect. The last one, `t = 7`, has
# nothing to copy (its answer `s_8` is not in the input) and is actually *worse*
# than uniform: the cheating model is confident about the wrong thing. That last
# position is also why the unmasked *training* loss (an average over all eight
# positions) levels off near the last position's loss divided by `T` (printed above)
# instead of reaching 0.
#
# The cheating model would be useless at translation time: there the decoder
# generates one token at a time, and the token at `t + 1` does not exist yet when
# position `t` has to predict it. A model trained without the mask learned to
# depend on exactly the input it will never have.
#
# How does it cheat? Look at its attention: position `t` puts its weight on key
# `t + 1`, the token it is asked to predict.

# %%
probe = np.random.default_rng(3).integers(0, V, (1, T))
_, c_open = forward(p_open, probe, None)
_, c_mask = forward(p_masked, probe, causal_mask(T, np))
w_open = attention_weights(c_open.att)[0, 0]                           # (T, T)
w_mask = attention_weights(c_mask.att)[0, 0]
next_weight = np.array([w_open[t, t + 1] for t in range(T - 1)])       # (T-1,)
print("weight the unmasked model puts on key t+1, per query t:")
print(next_weight)
print(f"on average {next_weight.mean():.3f} (a uniform head would give {1 / T:.3f})")

fig, ax = plt.subplots(1, 3, figsize=(16, 4.3))
ax[0].plot(loss_masked, label="with causal_mask")
ax[0].plot(loss_open, label="without mask")
ax[0].axhline(np.log(V), color="k", ls=":", lw=1, label="log V (honest best)")
ax[0].set_xlabel("Adam step"); ax[0].set_ylabel("training cross-entropy"); ax[0].legend()
ax[0].set_title("next-token prediction on random sequences")
xs = np.arange(T)
ax[1].bar(xs - 0.2, pos_masked, 0.4, label="with causal_mask")
ax[1].bar(xs + 0.2, pos_open, 0.4, label="without mask")
ax[1].axhline(np.log(V), color="k", ls=":", lw=1)
ax[1].set_xlabel("position t (predicts token t+1)"); ax[1].set_ylabel("held-out loss"); ax[1].legend(fontsize=8)
ax[1].set_title("the last position has nothing to copy")
im = ax[2].imshow(w_open, cmap="Blues", vmin=0, vmax=1)
ax[2].set_xlabel("key position"); ax[2].set_ylabel("query position")
ax[2].set_title("unmasked model: query t reads key t+1")
fig.colorbar(im, ax=ax[2], fraction=0.046)
fig.tight_layout(); show_figure(fig, "05_cheating.png")

# %% [markdown]
# ### The invariant behind the mask
#
# The experiment shows the *consequence*; the property itself can be checked
# directly and exactly. With the look-ahead mask, the outputs at positions `<= t`
# are a function of the inputs at positions `<= t` only. So if we change every
# token after `t`, the logits at `0..t` must not change **at all**, not even in
# the last bit: masked weights are exactly 0, and `0 * v = 0` exactly, so the new
# values never enter the sums. Without the mask they do.

# %%
rng = np.random.default_rng(11)
base = rng.integers(0, V, (4, T))
logit_base_m, _ = forward(p_masked, base, causal_mask(T, np))
logit_base_o, _ = forward(p_open, base, None)
exact, leak = True, []
for t in range(T - 1):
    changed = base.copy()
    changed[:, t + 1:] = (base[:, t + 1:] + rng.integers(1, V, (4, T - t - 1))) % V   # every later token differs
    lm, _ = forward(p_masked, changed, causal_mask(T, np))
    lo, _ = forward(p_open, changed, None)
    exact &= bool(np.array_equal(lm[:, :t + 1], logit_base_m[:, :t + 1]))
    leak.append(np.abs(lo[:, :t + 1] - logit_base_o[:, :t + 1]).max())
print("with the mask, logits at positions <= t unchanged bit for bit, for every t:", exact)
print("without the mask, largest change of a logit at positions <= t:", np.round(leak, 3))

# %% [markdown]
# This is the same invariant the tests state for the full model ("future tokens
# never change past logits"). It is also what makes incremental decoding possible:
# because position `t`'s output never depends on later positions, a decoder that
# generates one token at a time can keep the keys and values of earlier positions
# and never recompute them.
#
# ## Check
#
# These fail if `causal_mask` lets a position see its future (or hides its own
# token), if `decoder_mask` forgets the padding, if `padding_mask` marks the wrong
# keys, or if masked weights are not exactly zero. What the two small models learned
# (the unmasked one reads the answer, the masked one settles at log V) is asserted in full
# mode; quick mode trains too few steps to count on it and prints it.

# %%
tri = np.tril(np.ones((5, 5), dtype=bool))
assert causal.shape == (1, 1, 5, 5) and np.array_equal(causal[0, 0], tri)
assert pad_m.shape == (1, 1, 1, 6) and pad_m.ravel().tolist() == [True] * 5 + [False]
assert np.array_equal(dec_m[0, 0], tri & (tgt_ids[0] != PAD_ID)[None, :])
assert np.all(w_d[~dec_m[0, 0]] == 0.0) and np.allclose(w_d.sum(-1), 1.0)
assert np.all(w_m[~slide_mask[0, 0]] == 0.0), "masked weights must be exactly zero"
assert slide_wrong == [], slide_wrong
logV = np.log(V)
assert pos_masked.min() > logV - 0.05, "an honest model cannot beat log V on random tokens"
if not QUICK:                                         # how far training got: full mode's claims
    assert abs(pos_masked.mean() - logV) < 0.05, f"masked model should stay at log V = {logV:.3f}, got {pos_masked.mean():.3f}"
    assert pos_open[:-1].mean() < 0.1 * logV, f"unmasked model should read the answer: {pos_open[:-1].mean():.3f}"
    assert loss_open[-20:].mean() < 0.5 * loss_masked[-20:].mean()
    assert next_weight.mean() > 3 / T, f"the unmasked model should read key t+1: {next_weight.mean():.3f}"
assert exact, "with the look-ahead mask, later tokens changed earlier outputs"
assert min(leak) > 1e-3, "without the mask, later tokens should change earlier outputs"
print(f"Check passed: masked loss {pos_masked.mean():.3f} ~ log V = {logV:.3f}; unmasked loss at positions "
      f"0..{T - 2} {pos_open[:-1].mean():.3f}; causality invariant exact.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. Why does a decoder trained without the look-ahead mask reach a near-zero loss
#    on random tokens, and why is its last position *worse* than a uniform guess?
#
#    <details><summary>Answer</summary>
#
#    Without the mask, position $t$ sees the very token $s_{t+1}$ it must predict (the
#    target is the input shifted by one), so it learns to copy it and the loss falls to
#    almost zero. The last position has no later input token to copy, yet the model was
#    trained to find its answer in the input: it puts its weight on a token that is not
#    the answer, and does worse than a uniform guess over the vocabulary.
#
#    </details>
#
# 2. Where does the look-ahead mask belong, and why is it wrong to apply it in
#    encoder-decoder attention?
#
#    <details><summary>Answer</summary>
#
#    In the decoder's self-attention only, where the queries and keys are the same target
#    positions and a query must not see later targets. In encoder-decoder attention the
#    keys are the source, which is known in full before decoding starts; a look-ahead
#    mask there would hide source words for no reason (and is the wrong shape when source
#    and target lengths differ).
#
#    </details>
#
# 3. Why does `padding_mask` have a single row, and why is the padding *query* row
#    not blanked?
#
#    <details><summary>Answer</summary>
#
#    The padding mask depends only on which *keys* are padding, the same for every query,
#    so one row broadcasts over all queries. A padding query's output row is computed but
#    never used: the loss ignores padding positions and no real query attends to it, so
#    blanking it would change nothing (and a fully blanked row gains nothing over a
#    harmless one).
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write `padding_mask`, the look-ahead `causal_mask` and `decoder_mask` (the two
# combined with the target's padding) yourself. The starter
# `lessons/exercises/05_masks.py` has the signatures, and the shapes and formulas in its
# docstrings; its bodies raise `NotImplementedError`. Fill them in, then grade your
# work:
#
#     attn-check lessons/exercises/05_masks.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

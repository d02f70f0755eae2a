# %% [markdown]
# # Lesson 2: attention for sequence-to-sequence (Luong et al. 2015)
#
# Lesson 1 squeezed a whole sequence into one context vector `c` and watched
# accuracy fall with length. Attention removes the squeeze: at every output step
# the decoder looks back at **all** encoder states and takes a weighted average of
# them, with weights it computes on the spot. The paper's section 1: "Attention
# mechanisms have become an integral part of compelling sequence modeling and
# transduction models ..., allowing modeling of dependencies without regard to
# their distance in the input or output sequences. In all but a few cases,
# however, such attention mechanisms are used in conjunction with a recurrent
# network." This lesson builds that conjunction; the Transformer then drops the
# recurrent network and keeps only the attention.
#
# Introductions to attention usually list the steps; in formulas, for decoder
# step `t` with decoder state `s_t` (B, H) and encoder states `h_1..h_S` (B, S, H):
#
#     1. score      e_{t,i} = s_t . h_i                     for every source position i (dot product)
#     2. weights    a_t = softmax(e_t)  over i = 1..S        (padding masked out)
#     3. context    c_t = sum_i a_{t,i} h_i                  (weighted sum)
#     4. concat     [c_t ; s_t]                              (B, 2H)
#     5. output     h~_t = tanh([c_t ; s_t] W_c + b_c),  p(y_t) = softmax(h~_t W_o + b_o)
#
# This is Luong et al.'s "global attention" with the "dot" score. Two remarks on
# how these steps are often written:
#
# * Step 1 is often written "transpose `s_t` and take the dot product with `h_t`". The
#   index is misleading: the decoder state is compared with *every* encoder state
#   `h_i`, `i = 1..S`, giving `S` scores per decoder step, not one. (In matrix form
#   for all decoder steps at once: $\mathrm{scores} = S_{\text{dec}} H_{\text{enc}}^\top$, shape (B, T, S).)
# * This recipe is Luong's, not Bahdanau's (2015, the first attention for
#   translation). Bahdanau scores with a small feed-forward net ("additive
#   attention", paper section 3.2.1), uses the *previous* state $s_{t-1}$, and
#   feeds `c_t` into the recurrence. In Luong's version the attention sits *on top*
#   of the decoder RNN and never feeds back into it, which is why, in training, we
#   can run the decoder RNN over all steps first and then attend for all steps in
#   one batched product. (Luong et al. also describe "input feeding", which feeds
#   $\tilde h_{t-1}$ back into the next step; we leave it out.)
#
# In the Transformer's vocabulary: the query is `s_t`, the keys and the values are both
# the encoder states. The Transformer's scaled dot-product attention (section
# 3.2.1) is exactly steps 1-3 with the scores divided by $\sqrt{d_k}$ and with
# learned projections making queries, keys and values different; we check that
# identity numerically below.

# %%
import os, sys
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # tiny matrices: BLAS threads only add overhead
import time
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

from typing import NamedTuple

import numpy as np

from attn.gradcheck import check_layer, numerical_gradient, rel_error
from attn.layers import (attention_forward, embedding_backward, embedding_forward, linear_backward,
                         linear_forward, rnn_backward, rnn_forward, rnn_step_forward, softmax_backward,
                         softmax_forward)
from attn.loss import cross_entropy
from attn.masks import PAD_ID

T0 = time.time()

# %% [markdown]
# ## 1. The task, as in lesson 1
#
# Reverse a random sequence of 2 to 20 tokens from 20 symbols. The same generator
# and seeds as lesson 1, so both lessons train and test on the same sequences.

# %%
BOS, N_SYM = 1, 20
V = 2 + N_SYM
L_MIN, L_MAX = 2, 20
LENGTHS = np.arange(L_MIN, L_MAX + 1)
H, D = 32, 32


def make_batch(rng, lengths):
    """Random sequences and their reversals: src, dec_in (BOS + target shifted right),
    tgt, all (B, S) ids padded with PAD_ID; mask (B, S) bool, True on real tokens."""
    lengths = np.asarray(lengths)
    S = int(lengths.max())
    mask = np.arange(S)[None, :] < lengths[:, None]
    src = np.where(mask, rng.integers(2, V, (len(lengths), S)), PAD_ID)
    tgt = np.full_like(src, PAD_ID)
    for i, L in enumerate(lengths):
        tgt[i, :L] = src[i, :L][::-1]
    dec_in = np.where(mask, np.concatenate([np.full((len(lengths), 1), BOS), tgt[:, :-1]], axis=1), PAD_ID)
    return src, dec_in, tgt, mask

# %% [markdown]
# ## 2. The attention layer, forward and backward by hand
#
# For all decoder steps at once: `s` (B, T, H) decoder states, `e` (B, S, H)
# encoder states, `src_mask` (B, S) True on real source tokens.
#
# The backward reads the forward upwards. Note the two places where an input is
# used twice, so its gradient is a *sum* of two contributions:
#
# * `s` is the query in the scores *and* half of the concatenation;
# * `e` is the key in the scores *and* the value in the weighted sum.

# %%
class LuongCache(NamedTuple):
    """Kept for backward: s, e, the attention weights ``a`` (B, T, S), the softmax's cache,
    the linear layer's cache, and the output h~ (tanh' = 1 - h~^2)."""
    s: object
    e: object
    a: object
    soft: object
    lin: object
    out: object


def luong_attention_forward(s, e, w_c, b_c, src_mask):
    """Inputs: s (B, T, H); e (B, S, H); w_c (2H, H); b_c (H,); src_mask (B, S) bool.
    Returns: h~ (B, T, H), cache. ``cache.a`` (B, T, S) are the attention weights."""
    scores = s @ e.transpose(0, 2, 1)                          # (B, T, S)   e_{t,i} = s_t . h_i
    a, c_soft = softmax_forward(scores, src_mask[:, None, :])  # (B, T, S)   pads get exactly 0
    ctx = a @ e                                                # (B, T, H)   c_t = sum_i a_ti h_i
    z, c_lin = linear_forward(np.concatenate([ctx, s], axis=-1), w_c, b_c)   # [c_t; s_t] W_c + b_c
    out = np.tanh(z)                                           # (B, T, H)
    return out, LuongCache(s, e, a, c_soft, c_lin, out)


def luong_attention_backward(dout, cache: LuongCache):
    """Forward was ``out = tanh([ctx; s] @ w_c + b_c)``, ``ctx = a @ e``,
    ``a = softmax(s @ e.T)``. So ``dz = dout * (1 - out^2)``; the linear backward splits
    into ``dctx`` and a first ``ds``; ``da = dctx @ e.T`` and ``de = a.T @ dctx``;
    ``dscores = a * (da - sum(da * a))`` (softmax backward); and the scores give
    ``ds += dscores @ e``, ``de += dscores.T @ s``.

    Returns: ds (B, T, H), de (B, S, H), dw_c (2H, H), db_c (H,)."""
    s, e, out = cache.s, cache.e, cache.out
    a = cache.a
    Hs = s.shape[-1]
    dz = dout * (1 - out * out)
    dcat, dw_c, db_c = linear_backward(dz, cache.lin)              # (B, T, 2H)
    dctx, ds = dcat[..., :Hs], dcat[..., Hs:].copy()
    da = dctx @ e.transpose(0, 2, 1)                           # (B, T, S)
    de = a.transpose(0, 2, 1) @ dctx                           # (B, S, H)   e as the values
    dscores = softmax_backward(da, cache.soft)                    # (B, T, S)   masked entries: a = 0 -> 0
    ds += dscores @ e                                          # s as the query
    de += dscores.transpose(0, 2, 1) @ s                       # e as the keys
    return ds, de, dw_c, db_c


# %% [markdown]
# **Check it.** `attn.gradcheck.check_layer` compares each gradient with central
# differences of `sum(forward(...) * dout)` for a random `dout`, in float64, and
# raises if any relative error exceeds `1e-6`. The source mask has padding, so the
# gradient that must *not* flow into padded encoder states is checked too.

# %%
rng = np.random.default_rng(0)
Bc, Tc, Sc, Hc = 2, 3, 5, 4
gc_args = {"s": rng.standard_normal((Bc, Tc, Hc)), "e": rng.standard_normal((Bc, Sc, Hc)),
           "w_c": rng.standard_normal((2 * Hc, Hc)) * 0.5, "b_c": rng.standard_normal(Hc) * 0.1,
           "src_mask": np.arange(Sc)[None, :] < np.array([[5], [3]])}
gc_errors = check_layer("luong_attention", luong_attention_forward, luong_attention_backward, gc_args,
                        ["s", "e", "w_c", "b_c"])
print("gradient check, relative errors:", ", ".join(f"{k} {v:.1e}" for k, v in gc_errors.items()))
_, gc_cache = luong_attention_forward(**gc_args)
_, de_gc, _, _ = luong_attention_backward(np.ones((Bc, Tc, Hc)), gc_cache)
de_pad = de_gc[1, 3:]                                          # row 1 has 3 real source tokens
print("gradient reaching the padded encoder states of row 1:", np.abs(de_pad).max())

# %% [markdown]
# **The same thing as the Transformer's attention.** `attn.layers.attention_forward`
# computes $\mathrm{softmax}(q k^\top / \sqrt{d_k}) v$. With $q = s \cdot \sqrt{H}$ (undoing the
# scale), `k = v = e`, and the padding mask broadcast over decoder steps, it must
# give exactly our context `c_t`.

# %%
a_ours = gc_cache.a
ctx_ours = a_ours @ gc_args["e"]
ctx_lib, c_lib = attention_forward(gc_args["s"] * np.sqrt(Hc), gc_args["e"], gc_args["e"],
                                   gc_args["src_mask"][:, None, :])
same_as_library = np.allclose(ctx_ours, ctx_lib, rtol=1e-12, atol=1e-12)
print("Luong dot attention == scaled dot-product attention with q * sqrt(d_k), k = v = e:", same_as_library)

# %% [markdown]
# ## 3. Two models on the same task
#
# Both have the same encoder and decoder RNNs as lesson 1 (`H = 32`). The
# bottleneck model predicts from the decoder state `s_t`; the attention model
# predicts from `h~_t`, which mixes in the context `c_t`. The attention model has
# one extra matrix, `attn.w_c` (2H, H): $2H^2$ more parameters, and a bias of `H`.
#
# In the backward pass, the encoder states now receive gradient from *every*
# decoder step through the attention (`de`), not only through `c` at the last
# state: each source token has a short path to each output.

# %%
def init_params(seed, attention, V=V, D=D, H=H, dtype=np.float32):
    rng = np.random.default_rng(seed)
    orth = lambda n: np.linalg.qr(rng.standard_normal((n, n)))[0]           # noqa: E731
    p = {"encoder.emb": rng.standard_normal((V, D)) * 0.3,
         "encoder.w_x": rng.standard_normal((D, H)) / np.sqrt(D),
         "encoder.w_h": orth(H), "encoder.b": np.zeros(H),
         "decoder.emb": rng.standard_normal((V, D)) * 0.3,
         "decoder.w_x": rng.standard_normal((D, H)) / np.sqrt(D),
         "decoder.w_h": orth(H), "decoder.b": np.zeros(H),
         "out.w": rng.standard_normal((H, V)) / np.sqrt(H), "out.b": np.zeros(V)}
    if attention:
        p["attn.w_c"] = rng.standard_normal((2 * H, H)) / np.sqrt(2 * H)
        p["attn.b_c"] = np.zeros(H)
    return {k: v.astype(dtype) for k, v in p.items()}


def encode(p, src, mask):
    x, c_emb = embedding_forward(src, p["encoder.emb"])                                  # (B, S, D)
    hs_enc, c_rnn = rnn_forward(x, None, p["encoder.w_x"], p["encoder.w_h"], p["encoder.b"], mask=mask)
    return hs_enc, (c_emb, c_rnn)


def loss_and_grads(p, src, dec_in, tgt, mask):
    """Teacher-forced loss and gradients; with attention if p has "attn.w_c"."""
    attention = "attn.w_c" in p
    hs_enc, (c_emb_e, c_rnn_e) = encode(p, src, mask)
    y, c_emb_d = embedding_forward(dec_in, p["decoder.emb"])
    hs_dec, c_rnn_d = rnn_forward(y, hs_enc[:, -1], p["decoder.w_x"], p["decoder.w_h"], p["decoder.b"], mask=mask)
    top = hs_dec
    if attention:
        top, c_att = luong_attention_forward(hs_dec, hs_enc, p["attn.w_c"], p["attn.b_c"], mask)
    logits, c_out = linear_forward(top, p["out.w"], p["out.b"])
    loss, dlogits = cross_entropy(logits, tgt)
    g = {}
    dtop, g["out.w"], g["out.b"] = linear_backward(dlogits, c_out)
    dhs_enc = np.zeros_like(hs_enc)
    dhs_dec = dtop
    if attention:
        dhs_dec, dhs_enc, g["attn.w_c"], g["attn.b_c"] = luong_attention_backward(dtop, c_att)
    dy, dctx, g["decoder.w_x"], g["decoder.w_h"], g["decoder.b"] = rnn_backward(dhs_dec, c_rnn_d)
    g["decoder.emb"] = embedding_backward(dy, c_emb_d)
    dhs_enc[:, -1] += dctx                                  # the context vector is still h_S
    dx, _, g["encoder.w_x"], g["encoder.w_h"], g["encoder.b"] = rnn_backward(dhs_enc, c_rnn_e)
    g["encoder.emb"] = embedding_backward(dx, c_emb_e)
    return loss, g


def greedy_decode(p, src, mask, keep_weights=False):
    """(B, S) source -> (B, S) predicted ids; with keep_weights also the (B, S, S)
    attention weights of every output step."""
    hs_enc, _ = encode(p, src, mask)
    h = hs_enc[:, -1]
    tok = np.full(src.shape[0], BOS)
    out, weights = np.zeros_like(src), []
    for t in range(src.shape[1]):
        y, _ = embedding_forward(tok, p["decoder.emb"])
        h, _ = rnn_step_forward(y, h, p["decoder.w_x"], p["decoder.w_h"], p["decoder.b"])
        top = h
        if "attn.w_c" in p:
            top, c = luong_attention_forward(h[:, None], hs_enc, p["attn.w_c"], p["attn.b_c"], mask)
            top = top[:, 0]
            weights.append(c.a[:, 0])
        logits, _ = linear_forward(top, p["out.w"], p["out.b"])
        tok = logits.argmax(axis=-1)
        out[:, t] = tok
    return (out, np.stack(weights, axis=1)) if keep_weights else out


# %% [markdown]
# A whole-model check as well: one parameter of each kind, float64, tiny sizes
# (the attention layer was checked above; this checks the wiring around it).

# %%
p64 = init_params(1, attention=True, D=3, H=4, dtype=np.float64)
for k in p64:
    p64[k] += 0.1 * np.random.default_rng(2).standard_normal(p64[k].shape)
batch64 = make_batch(np.random.default_rng(3), [3, 5, 2])
_, g64 = loss_and_grads(p64, *batch64)
model_errors = {k: rel_error(g64[k], numerical_gradient(lambda: loss_and_grads(p64, *batch64)[0], p64[k]))
                for k in ("encoder.emb", "encoder.w_h", "decoder.w_h", "attn.w_c", "out.w")}
print("whole-model gradient check, relative errors:\n " + ", ".join(f"{k} {v:.1e}" for k, v in model_errors.items()))

# %% [markdown]
# ## 4. Training both
#
# The same Adam loop, batches, seeds and number of steps for both models.

# %%
STEPS = quick_steps(300) if QUICK else 600
BATCH, LR, CLIP = 64, 3e-3, 5.0
N_EVAL = 60 if QUICK else 150


def adam_train(p, steps, seed, lr=LR, betas=(0.9, 0.98), eps=1e-9, log_every=150):
    rng = np.random.default_rng(seed)
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(v) for k, v in p.items()}
    losses = []
    for step in range(1, steps + 1):
        src, dec_in, tgt, mask = make_batch(rng, rng.integers(L_MIN, L_MAX + 1, BATCH))
        loss, g = loss_and_grads(p, src, dec_in, tgt, mask)
        norm = float(np.sqrt(sum((gk.astype(np.float64) ** 2).sum() for gk in g.values())))
        scale = min(1.0, CLIP / (norm + 1e-12))
        for k in p:
            gk = g[k] * scale
            m[k] = betas[0] * m[k] + (1 - betas[0]) * gk
            v[k] = betas[1] * v[k] + (1 - betas[1]) * gk * gk
            mhat, vhat = m[k] / (1 - betas[0] ** step), v[k] / (1 - betas[1] ** step)
            p[k] -= (lr * mhat / (np.sqrt(vhat) + eps)).astype(p[k].dtype)
        losses.append(float(loss))
        if step % log_every == 0 or step == steps:
            print(f"  step {step:4d}  loss {np.mean(losses[-log_every:]):.3f}")
    return losses


def accuracy_by_length(p, seed=123):
    rng = np.random.default_rng(seed)
    lengths = np.repeat(LENGTHS, N_EVAL)
    src, _, tgt, mask = make_batch(rng, lengths)
    hit = (greedy_decode(p, src, mask) == tgt) & mask
    return np.array([hit[lengths == L].sum() / (L * N_EVAL) for L in LENGTHS])


models = {}
for name, attention in (("bottleneck", False), ("attention", True)):
    print(f"{name}:")
    p = init_params(0, attention)
    t = time.time()
    losses = adam_train(p, STEPS, seed=1)
    models[name] = dict(params=p, losses=losses, acc=accuracy_by_length(p), seconds=time.time() - t)

print("\nlength     " + " ".join(f"{L:5d}" for L in LENGTHS))
for name, m in models.items():
    print(f"{name:<10} " + " ".join(f"{a:5.2f}" for a in m["acc"]))

# %% [markdown]
# ## 5. Where the attention looks
#
# One test sequence, decoded greedily; row `t` of the heatmap is the attention
# distribution `a_t` of output step `t` over the source positions. Output `t` of
# a reversal is source token `L-1-t`, so a model that has learned the task should
# put its weight on the **anti-diagonal**. Nobody told it where to look: the
# alignment is learned from the loss alone.

# %%
ex_rng = np.random.default_rng(7)
ex_src, _, ex_tgt, ex_mask = make_batch(ex_rng, [16])
ex_out, ex_w = greedy_decode(models["attention"]["params"], ex_src, ex_mask, keep_weights=True)
L_ex = 16
anti = ex_w[0][np.arange(L_ex), L_ex - 1 - np.arange(L_ex)]
print("source :", ex_src[0])
print("target :", ex_tgt[0])
print("output :", ex_out[0])
print("weight on the anti-diagonal, per output step:", np.round(anti, 2))


def anti_diagonal_weight(p, L=L_MAX, n=100, seed=11):
    """Average attention weight, at output step t, on source position L-1-t (the token
    wanted) and on L-1-t or its right neighbour L-t (whose state also holds it)."""
    src, _, _, mask = make_batch(np.random.default_rng(seed), [L] * n)
    _, w = greedy_decode(p, src, mask, keep_weights=True)                   # (n, L, L)
    t = np.arange(L)
    on = w[:, t, L - 1 - t]
    band = on.copy()
    band[:, 1:] += w[:, t[1:], L - t[1:]]
    return float(on.mean()), float(band.mean())


anti_mean, band_mean = anti_diagonal_weight(models["attention"]["params"])
print(f"length {L_MAX}: mean weight on the anti-diagonal {anti_mean:.2f}, on it or its right neighbour "
      f"{band_mean:.2f} (uniform attention would give {1 / L_MAX:.2f} and {2 / L_MAX:.2f})")

fig, ax = plt.subplots(2, 1, figsize=(8, 10))            # one above the other: each readable on a phone
for name, m in models.items():
    ax[0].plot(LENGTHS, m["acc"], "o-", label={"bottleneck": "one context vector (lesson 1)",
                                                  "attention": "with Luong attention"}[name])
ax[0].axhline(1 / N_SYM, color="gray", ls=":", label="chance")
ax[0].set(xlabel="sequence length", ylabel="token accuracy (greedy decoding)", ylim=(0, 1.05),
          title=f"reversal, H = {H}, {STEPS} training steps each")
ax[0].set_xticks(LENGTHS[::2])
ax[0].legend(loc="lower left")
im = ax[1].imshow(ex_w[0], cmap="viridis", vmin=0, vmax=1)
ax[1].set(xlabel="source position i (token)", ylabel="output step t (token)",
          title="attention weights a_t,i: the anti-diagonal")
ax[1].set_xticks(range(L_ex), [f"{i}\n({s})" for i, s in enumerate(ex_src[0])], fontsize=7)
ax[1].set_yticks(range(L_ex), [f"{t} ({y})" for t, y in enumerate(ex_out[0])], fontsize=7)
fig.colorbar(im, ax=ax[1], fraction=0.046)
fig.tight_layout(); show_figure(fig, "02_attention_vs_bottleneck.png")

# %% [markdown]
# **What to notice.**
#
# * The bottleneck curve falls with length as in lesson 1; the attention curve
#   stays high across all lengths, after the same number of steps with the same
#   RNNs. (Bahdanau et al.'s Figure 2 is this picture on real translation: BLEU
#   against sentence length, falling for the encoder-decoder, flat with
#   attention.) The decoder no longer needs `c` to remember the sequence: at step
#   `t` it only needs to know *where* to look, and the token is read straight from
#   the encoder state there.
# * The heatmap is an (almost) clean anti-diagonal: the model learned the
#   alignment. Such pictures are what the paper means by attention giving "more
#   interpretable models" (section 4). Early in training (the quick mode) the
#   weight is often split between source positions `L-1-t` and `L-t`: the encoder
#   reads left to right, so its state at `L-t` also remembers the token before it,
#   the one wanted, and looking there works too, less reliably.
# * Attention did not remove the recurrence. The encoder still reads the source
#   one token at a time, so an encoder state `h_i` still mixes the tokens before
#   `i`, and training still runs `S + T` dependent steps. The Transformer's step
#   is to throw the recurrence away and build the encoder and decoder from
#   attention alone (self-attention); lesson 10 compares the two kinds of layer.
#
# ## Check
#
# These fail if the hand-written attention backward is wrong (gradient check), if
# it stops being the library's scaled dot-product attention in disguise, if
# padding receives gradient, or if attention does not fix the long sequences (full
# mode; quick mode's shorter training prints these figures, asserting nothing about
# how far its models got).

# %%
long_sel = LENGTHS >= L_MAX - 3
acc_long = {name: m["acc"][long_sel].mean() for name, m in models.items()}
margin = acc_long["attention"] - acc_long["bottleneck"]
print(f"lengths {L_MAX - 3}-{L_MAX}: attention {acc_long['attention']:.2f}, bottleneck "
      f"{acc_long['bottleneck']:.2f}, margin {margin:.2f}")
assert max(gc_errors.values()) < 1e-6, gc_errors
assert max(model_errors.values()) < 1e-6, model_errors
assert np.abs(de_pad).max() == 0.0, "padded encoder states must receive no gradient through the attention"
assert same_as_library, "Luong dot attention should equal attention_forward with q scaled by sqrt(d_k)"
# Quick mode trains for fewer steps (STEPS above): whether the attention has "clicked" yet
# depends on the machine's arithmetic, so the models' quality is asserted in full mode only.
if not QUICK:
    assert margin > 0.5, f"attention should beat the bottleneck on long sequences by > 0.5: {margin:.2f}"
    assert models["attention"]["acc"].min() > 0.8, \
        f"attention should hold up at every length: {np.round(models['attention']['acc'], 2)}"
    assert band_mean > 0.7, f"attention should concentrate on the anti-diagonal: {band_mean:.2f} (uniform {2 / L_MAX})"
else:
    print(f"quick mode, not asserted: worst length {models['attention']['acc'].min():.2f}, "
          f"anti-diagonal weight {band_mean:.2f}")
print(f"Check passed in {time.time() - T0:.1f} s.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. At decoder step `t`, how many scores does Luong attention compute, and against
#    which states? What is misleading about writing the score as $s_t \cdot h_t$?
#
#    <details><summary>Answer</summary>
#
#    One score per encoder state: $S$ scores at step $t$, of the decoder state $s_t$
#    against each encoder state $h_1, \dots, h_S$. Writing $s_t \cdot h_t$ suggests one
#    score against the encoder state of the *same* index; the score is $s_t \cdot h_j$
#    for every source position $j$, and $t$ and $j$ run over different sentences.
#
#    </details>
#
# 2. Why can Luong's attention run the decoder RNN over all steps first and attend
#    afterwards, while Bahdanau's cannot?
#
#    <details><summary>Answer</summary>
#
#    Luong's attention uses the current state $s_t$, and its attentional output is not
#    fed back into the recurrence (this lesson leaves input feeding out), so all $s_t$
#    can be computed first and attended to in one matrix product. Bahdanau's scores use
#    the previous state $s_{t-1}$ and feed the context back into the next step, so each
#    step must wait for the attention of the one before.
#
#    </details>
#
# 3. Which two changes turn steps 1-3 of this lesson into the Transformer's scaled
#    dot-product attention?
#
#    <details><summary>Answer</summary>
#
#    Divide the scores by $\sqrt{d_k}$ (the scaling of equation 1), and let queries, keys
#    and values be learned projections of the states rather than the states themselves:
#    then steps 1-3 compute $\mathrm{softmax}(Q K^\top / \sqrt{d_k}) V$.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write Luong attention (the dot score, the masked softmax over the source, the
# context, the concatenation and the tanh output layer), forward and backward, yourself.
# The starter `lessons/exercises/luong_attention.py` has the signatures, and the shapes
# and formulas in its docstrings; its bodies raise `NotImplementedError`. Fill them in,
# then grade your work:
#
#     attn-check lessons/exercises/luong_attention.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

# %% [markdown]
# # Lesson 9: the whole model (section 3, section 3.4, Table 3)
#
# Lessons 3-8 built the pieces: positional encoding, attention, masks, multi-head
# attention, the feed-forward network, residual connections and layer norm, and
# their backward passes. This lesson puts them together into Figure 1 of the paper:
#
#     src ids ─ embed·√D + PE ─ [self-attn, FFN] × N ──────────────────────── memory
#     tgt ids ─ embed·√D + PE ─ [masked self-attn, cross-attn(memory), FFN] × N
#             ─ @ Eᵀ (the same embedding matrix) ─ logits
#
# 1. **Shapes.** We push a real batch of the toy corpus through the model one stage
#    at a time, printing the shape after each: embeddings, every layer, the memory,
#    the decoder, the logits. We assemble the stages ourselves from the library's
#    layer functions, and check that the result is exactly what
#    `Transformer.forward` computes.
# 2. **Parameter count.** The base model of Table 3 has "65M" parameters. We count
#    the library's parameters, derive the same number by a formula, and explain why
#    both fall short of 65M.
# 3. **Shared embeddings (section 3.4).** "We share the same weight matrix between
#    the two embedding layers and the pre-softmax linear transformation." One
#    matrix used three times gets three gradient contributions; we show that the
#    library adds all three, and how many parameters the sharing saves.
#
# Runs in a few seconds (no training).

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import math

import numpy as np

from attn import diagram
from attn.backend import to_device
from attn.data import TOY_DIR, Vocab, encode_pairs, make_batches, read_parallel, tokenize
from attn.layers import (attention_weights, embedding_forward, feed_forward_forward, layer_norm_forward,
                         multi_head_attention_forward, positional_forward, sinusoidal_table)
from attn.loss import cross_entropy
from attn.masks import decoder_mask, padding_mask
from attn.model import (Transformer, TransformerConfig, decoder_layer_forward, encoder_layer_forward, layer_params,
                        parameter_shapes)

np.set_printoptions(precision=4, suppress=True, linewidth=130)

# %% [markdown]
# ## 1. One batch, stage by stage
#
# A small model (d_model 32, 4 heads, d_ff 64, 2 + 2 layers) in float64, so that
# "the same" can mean "equal to 1e-12". The batch is four sentence pairs of the toy
# corpus, batched the way the trainer batches them (`make_batches`): the source gets
# an end-of-sentence id, the decoder input starts with `<s>`, and shorter sentences
# are padded with id 0. Like the trainer, we move the batch to the array backend's device
# (`to_device`: nothing to do on NumPy; on a GPU the ids must live where the weights do).

# %%
pairs = read_parallel(TOY_DIR, "en", "tk", "train")[:200]
vocab = Vocab.build([tokenize(s) for s, _ in pairs] + [tokenize(t) for _, t in pairs])
batch = make_batches(encode_pairs(pairs[:4], vocab), max_tokens=10_000, shuffle=False)[0]
src, tgt_in, tgt_out = (to_device(a) for a in (batch.src, batch.tgt_in, batch.tgt_out))   # as the trainer does
for s, t in pairs[:4]:
    print(f"  {s}\n    -> {t}")
print("src", src.shape, " tgt_in", tgt_in.shape, " tgt_out", tgt_out.shape, f" (vocabulary {len(vocab)})")

cfg = TransformerConfig(vocab_size=len(vocab), d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2,
                        n_decoder_layers=2, dropout=0.1, max_len=64)
model = Transformer(cfg, seed=0, dtype="float64")
p, D, H = model.params, cfg.d_model, cfg.n_heads
# The paper's Figure 1, drawn from this model's parameter names (the sub-layers, in order) and sizes:
show_figure(diagram.architecture(parameter_shapes(cfg), cfg.n_encoder_layers, cfg.n_decoder_layers,
                                 cfg.d_model, cfg.n_heads, cfg.d_ff), "09_architecture.png")

# %% [markdown]
# Now the model, written out. Each sub-layer sits in a residual connection followed
# by layer norm, `LayerNorm(x + Sublayer(x))` (section 3.1; dropout is off, as at
# evaluation time). The encoder's self-attention may look at every real source
# token (`padding_mask`, (B, 1, 1, S)); the decoder's may look only at earlier
# target positions (`decoder_mask`, (B, 1, T, T)); the decoder's cross-attention
# takes its queries from the decoder and its keys and values from the encoder's
# output, the *memory*.
#
# The last column is the root mean square of the activations: the embedding is
# multiplied by $\sqrt{d_{\text{model}}}$ (section 3.4) so that, with the library's
# initialisation (std $d_{\text{model}}^{-0.5}$), it has unit scale, the same order as the
# positional encoding it is added to (rms `1/sqrt 2`); after every layer norm the
# rms is back to 1.

# %%
stages = []                                                       # (name, shape, rms)


def show(name, a):
    stages.append((name, tuple(a.shape), float(np.sqrt(np.mean(a ** 2)))))
    print(f"  {name:<44} {str(tuple(a.shape)):<16} rms {stages[-1][2]:.3f}")


def mha(pre, xq, xkv, mask):
    names = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
    return multi_head_attention_forward(xq, xkv, *[p[f"{pre}.{n}"] for n in names], n_heads=H, mask=mask)


def ffn(pre, x):
    return feed_forward_forward(x, p[pre + ".w1"], p[pre + ".b1"], p[pre + ".w2"], p[pre + ".b2"])


def norm(pre, x):
    return layer_norm_forward(x, p[pre + ".gamma"], p[pre + ".beta"], cfg.ln_eps)[0]


E = p["embedding.weight"]                                         # (V, D): the one shared matrix
pe = sinusoidal_table(64, D, "float64")                           # (L, D)
print("encoder")
src_mask = padding_mask(src)                                      # (B, 1, 1, S)
x = embedding_forward(src, E, math.sqrt(D))[0]; show("src embedding * sqrt(d_model)", x)
x = positional_forward(x, pe)[0]; show("+ positional encoding", x)
for i in range(cfg.n_encoder_layers):
    a, c = mha(f"encoder.{i}.self_attn", x, x, src_mask)
    show(f"  layer {i} self-attention weights", attention_weights(c))   # (B, H, S, S)
    x = norm(f"encoder.{i}.norm1", x + a); show(f"  layer {i} LayerNorm(x + SelfAttn(x))", x)
    x = norm(f"encoder.{i}.norm2", x + ffn(f"encoder.{i}.ffn", x)[0]); show(f"  layer {i} LayerNorm(x + FFN(x))", x)
memory = x; show("memory (encoder output)", memory)

print("decoder")
tgt_mask = decoder_mask(tgt_in)                                   # (B, 1, T, T)
y = embedding_forward(tgt_in, E, math.sqrt(D))[0]; show("tgt embedding * sqrt(d_model)", y)
y = positional_forward(y, pe)[0]; show("+ positional encoding", y)
for i in range(cfg.n_decoder_layers):
    a, c = mha(f"decoder.{i}.self_attn", y, y, tgt_mask)
    show(f"  layer {i} masked self-attention weights", attention_weights(c))   # (B, H, T, T)
    y = norm(f"decoder.{i}.norm1", y + a); show(f"  layer {i} LayerNorm(y + MaskedSelfAttn(y))", y)
    a, c = mha(f"decoder.{i}.cross_attn", y, memory, src_mask)
    show(f"  layer {i} cross-attention weights", attention_weights(c))       # (B, H, T, S)
    y = norm(f"decoder.{i}.norm2", y + a); show(f"  layer {i} LayerNorm(y + CrossAttn(y, memory))", y)
    y = norm(f"decoder.{i}.norm3", y + ffn(f"decoder.{i}.ffn", y)[0]); show(f"  layer {i} LayerNorm(y + FFN(y))", y)
logits_hand = y @ E.T; show("logits = decoder output @ E^T", logits_hand)

logits_lib, cache = model.forward(src, tgt_in)                    # rng=None: no dropout
memory_lib = model.encode(src)[0]
diff_memory = np.abs(memory - memory_lib).max()
diff_logits = np.abs(logits_hand - logits_lib).max()
print(f"\nmax |ours - library|: memory {diff_memory:.1e}, logits {diff_logits:.1e}")

# %% [markdown]
# The library writes each layer once, as a pair of functions like every layer of
# `attn.layers`: `encoder_layer_forward(x, mask, p, cfg)` and
# `decoder_layer_forward(y, memory, src_mask, tgt_mask, p, cfg)` in `attn.model`, each with
# its `_backward`, where `p` holds the layer's parameters by their names in it
# (`layer_params(params, "encoder.0")` gives `self_attn.w_q`, ..., `norm2.beta`) and `cfg`
# says the heads, the dropout and where the norms go. `Transformer.encode` and
# `Transformer.decode` are the loops below; its backward runs the same layers' backward
# from the last to the first.

# %%
x = positional_forward(embedding_forward(src, E, math.sqrt(D))[0], pe)[0]
for i in range(cfg.n_encoder_layers):
    x, _ = encoder_layer_forward(x, src_mask, layer_params(p, f"encoder.{i}"), cfg)
y = positional_forward(embedding_forward(tgt_in, E, math.sqrt(D))[0], pe)[0]
for i in range(cfg.n_decoder_layers):
    y, _ = decoder_layer_forward(y, x, src_mask, tgt_mask, layer_params(p, f"decoder.{i}"), cfg)
print(f"the named layers: max |ours - library|: memory {np.abs(x - memory_lib).max():.1e}, "
      f"logits {np.abs(y @ E.T - logits_lib).max():.1e}")

# %% [markdown]
# Things to notice in the table:
#
# * Every layer maps `(B, S, D)` to `(B, S, D)` (and `(B, T, D)` to `(B, T, D)`):
#   that is what lets the paper stack `N = 6` identical layers and add residuals
#   around everything.
# * The only places where a different shape appears are the attention weights
#   (`(B, H, S, S)` in the encoder, `(B, H, T, T)` and `(B, H, T, S)` in the
#   decoder) and the logits, `(B, T, V)`: one score per vocabulary entry for every
#   target position, all computed in one pass. Training needs no loop over time.
# * The source and target lengths never have to agree: cross-attention is the one
#   place where the two meet, as a `T x S` matrix.
#
# The hand-written pass agrees with `Transformer.forward` to rounding, so the table
# *is* the library's model.
#
# **Two common slips in summaries of the paper, and what the code says.**
#
# * Summaries often list the decoder's three sub-layers as "masked self-attention,
#   multi-head self-attention and the FFN". The second one is not self-attention:
#   it is **encoder-decoder attention** (section 3.2.3), with queries from the
#   decoder and keys and values from the encoder's output. Its weights are a
#   `T x S` matrix, target rows against source columns (printed below), and changing
#   only the source changes its output while the decoder's first sub-layer, the
#   masked self-attention, does not notice.
# * Others say "the input embedding, the positional embedding and the
#   pre-softmax linear layer share one weight matrix". Section 3.4 shares the matrix
#   between the two embedding layers (source and target) and the pre-softmax
#   projection. The positional encoding is not a weight matrix at all: the sinusoids
#   have no parameters, and with learned positions (Table 3, row E) each stack gets
#   its own table, separate from the word embedding. The parameter names below say
#   so. (`Transformer.attention_weights(cache)` returns the same weight arrays by
#   name; lesson 17 looks at them after training.)
#
# %%
w_a = Transformer.attention_weights(cache)                        # the forward pass above
print(f"decoder layer 0, second sub-layer: weights {tuple(w_a['decoder.0.cross_attn'].shape)} = (B, H, T, S) with "
      f"T = {tgt_in.shape[1]} target and S = {src.shape[1]} source positions: encoder-decoder attention")
other_src = np.roll(src, 1, axis=0)                               # the same targets, other sentences' sources
w_b = Transformer.attention_weights(model.forward(other_src, tgt_in)[1])
self_same = np.array_equal(w_a["decoder.0.self_attn"], w_b["decoder.0.self_attn"])
cross_same = np.array_equal(w_a["decoder.0.cross_attn"], w_b["decoder.0.cross_attn"])
print(f"another source: decoder layer 0 self-attention unchanged: {self_same}; cross-attention unchanged: {cross_same}")
positional_names = {name: [k for k in parameter_shapes(TransformerConfig(vocab_size=100, d_model=8, n_heads=2,
                                                                           positional=name))
                           if "embedding" in k or "pos" in k or "generator" in k]
                    for name in ("sinusoidal", "learned")}
for name, keys in positional_names.items():
    print(f"{name:>10} positions: embedding and position parameters {keys}")
assert w_a["decoder.0.cross_attn"].shape[-1] == src.shape[1] and self_same and not cross_same
assert positional_names["sinusoidal"] == ["embedding.weight"], "sinusoids must have no parameters"

# %% [markdown]
# ## 2. Counting parameters: the base model's "65M"
#
# Per encoder layer there is one attention block (four $D \times D$ matrices $W^Q, W^K,
# W^V, W^O$ and their biases), one FFN ($D \times F$ and $F \times D$ plus biases) and two
# layer norms (a gain and a bias each). A decoder layer has a second attention block
# (cross-attention) and a third norm. The shared embedding is one $V \times D$ matrix;
# the sinusoids have no parameters.
#
# $$\begin{aligned}
# \text{attention} &= 4 (D^2 + D), \qquad \text{ffn} = 2 D F + F + D, \qquad \text{norm} = 2 D\cr
# \text{encoder layer} &= \text{attention} + \text{ffn} + 2\, \text{norm}\cr
# \text{decoder layer} &= 2\, \text{attention} + \text{ffn} + 3\, \text{norm}\cr
# \text{total} &= V D + N_{\text{enc}} \cdot \text{encoder layer} + N_{\text{dec}} \cdot \text{decoder layer}
# \end{aligned} \tag{9.1}$$

# %%
def formula(V, D, F, n_enc, n_dec, shared=True, learned_positions=0, pre_norm=False):
    attention, ffn_, norm_ = 4 * (D * D + D), 2 * D * F + F + D, 2 * D
    total = (V * D if shared else 3 * V * D) + n_enc * (attention + ffn_ + 2 * norm_) \
        + n_dec * (2 * attention + ffn_ + 3 * norm_)
    total += 2 * learned_positions * D                            # src_pos and tgt_pos tables
    total += 2 * norm_ if pre_norm else 0                         # the final norm of each stack
    return total


def count(config):
    return sum(math.prod(shape) for shape in parameter_shapes(config).values())


base = TransformerConfig()                                        # the paper's defaults, vocabulary 37000
n_base = count(base)
print(f"base model (vocabulary {base.vocab_size}, shared): library {n_base:,}   formula "
      f"{formula(base.vocab_size, 512, 2048, 6, 6):,}   paper (Table 3) 65M")


def by_component(config):
    groups = {}
    for name, shape in parameter_shapes(config).items():
        stack = name.split(".")[0]
        if stack in ("encoder", "decoder"):
            part = name.split(".")[2]
            part = {"norm1": "norms", "norm2": "norms", "norm3": "norms"}.get(part, part)
            key = f"{stack} {part}"
        else:
            key = "embedding (shared)" if name == "embedding.weight" else name
        groups[key] = groups.get(key, 0) + math.prod(shape)
    return groups


groups = by_component(base)
for k, v in groups.items():
    print(f"  {k:<22} {v:>12,}  {v / n_base:6.1%}")

# %% [markdown]
# Our count (printed above, with the formula's) falls short of the paper's 65M.
# The layers are not the difference:
# Table 3 gives the count for a dozen variants, and the layer formula predicts how
# every one of them changes. Take our layer count for each row and ask how many
# embedding rows of width `d_model` would make up the paper's number:

# %%
table3 = [  # row, d_model, d_ff, layers, heads, paper's count in millions
    ("base", 512, 2048, 6, 8, 65), ("(C) N=2", 512, 2048, 2, 8, 36), ("(C) N=4", 512, 2048, 4, 8, 50),
    ("(C) N=8", 512, 2048, 8, 8, 80), ("(C) d_model=256", 256, 2048, 6, 8, 28),
    ("(C) d_model=1024", 1024, 2048, 6, 8, 168), ("(C) d_ff=1024", 512, 1024, 6, 8, 53),
    ("(C) d_ff=4096", 512, 4096, 6, 8, 90), ("big", 1024, 4096, 6, 16, 213)]
rows = []
print(f"{'Table 3 row':<18} {'ours, V=37000':>14} {'paper':>6} {'layers only':>12} {'implied V':>10}")
for name, D_, F_, N_, H_, paper in table3:
    c = TransformerConfig(d_model=D_, d_ff=F_, n_encoder_layers=N_, n_decoder_layers=N_, n_heads=H_)
    ours = count(c)
    layers_only = ours - c.vocab_size * D_
    implied_V = (paper * 1e6 - layers_only) / D_
    rows.append((name, ours, paper, implied_V))
    print(f"{name:<18} {ours / 1e6:>13.1f}M {paper:>5}M {layers_only / 1e6:>11.1f}M {implied_V:>10,.0f}")
family = [r for r in rows if r[0] != "big"]
lo_V, hi_V = min(r[3] for r in family), max(r[3] for r in family)
assert rows[-1][3] < base.vocab_size < lo_V, "the prose below: big implies fewer rows than 37000, the base family more"
round_V = 0.5e6 / 512                                             # the paper rounds to whole millions
big_ours, big_paper = next((r[1], r[2]) for r in rows if r[0] == "big")
layers_base = n_base - base.vocab_size * 512
print(f"base family: the paper's counts imply {lo_V / 1e3:.1f}k to {hi_V / 1e3:.1f}k embedding rows (rounding to whole "
      f"millions moves each by up to +-{round_V:,.0f}); {base.vocab_size} rows give {n_base / 1e6:.1f}M. The big model: "
      f"{big_ours / 1e6:.0f}M with {base.vocab_size} rows against the paper's {big_paper}M. The gap for base is "
      f"{65 - n_base / 1e6:.1f}M parameters of the embedding; the layers' {layers_base / 1e6:.1f}M are not in question. "
      f"The shared embedding is {groups['embedding (shared)'] / n_base:.0%} of the base model.")

# %% [markdown]
# Every row of the base family points to the same answer (the line under the
# table gives the range): the paper's counts fit our layer formula plus a shared
# embedding a few thousand rows larger than the "about 37000 tokens" of
# section 5.1, and the paper's rounding to whole millions cannot explain the difference.
# The big model is the odd one out: its count implies somewhat *fewer* rows than 37000
# (the table's last line), where the base family's imply more. The paper does not
# say more, so we leave it there: the gap is parameters of the embedding matrix,
# and the layers are not in question.
#
# Note also how much of the model the embedding is (the last figure on that line).
# Without sharing it would be three such matrices, next section.
#
# ## 3. One matrix, three uses, three gradients
#
# With `share_embeddings=True` (the default) the model owns one matrix,
# `embedding.weight`, and uses it three times: to embed source ids, to embed target
# ids, and (transposed) to turn the decoder's output into logits. An untied model
# (`share_embeddings=False`) owns three: `src_embedding.weight`,
# `tgt_embedding.weight`, `generator.weight`.
#
# Build an untied model whose three matrices are copies of the tied model's one
# matrix, and everything else identical. Both compute the same logits. By the chain
# rule, the gradient with respect to the shared matrix is the *sum* of the gradients
# with respect to each use; a backward that overwrote instead of adding (`grads[k] =
# g` instead of `+=`) would keep only one of the three.

# %%
print("tied  :", [k for k in model.params if "embedding" in k or "generator" in k])
untied_cfg = TransformerConfig(**{**cfg.to_dict(), "share_embeddings": False})
untied_params = {k: v.copy() for k, v in model.params.items() if k != "embedding.weight"}
for k in ("src_embedding.weight", "tgt_embedding.weight", "generator.weight"):
    untied_params[k] = E.copy()
untied = Transformer(untied_cfg, dtype="float64", params=untied_params)
print("untied:", [k for k in untied.params if "embedding" in k or "generator" in k])

logits_t, cache_t = model.forward(src, tgt_in)
logits_u, cache_u = untied.forward(src, tgt_in)
loss_t, dlogits_t = cross_entropy(logits_t, tgt_out, cfg.label_smoothing)
loss_u, dlogits_u = cross_entropy(logits_u, tgt_out, cfg.label_smoothing)
grads_t = model.backward(dlogits_t, cache_t)
grads_u = untied.backward(dlogits_u, cache_u)
print(f"same logits: max |tied - untied| = {np.abs(logits_t - logits_u).max():.1e}; loss {float(loss_t):.4f}")

parts = {"src embedding": grads_u["src_embedding.weight"], "tgt embedding": grads_u["tgt_embedding.weight"],
         "pre-softmax projection": grads_u["generator.weight"]}
g_sum = sum(parts.values())
g_tied = grads_t["embedding.weight"]
diff_tied = np.abs(g_tied - g_sum).max()
for name, g in parts.items():
    rows_hit = int((np.abs(g).sum(axis=1) > 0).sum())
    print(f"  d/d {name:<24} norm {np.linalg.norm(g):.4f}   rows with a gradient: {rows_hit:>3} of {len(vocab)}")
print(f"  tied gradient vs the sum of the three: max |diff| = {diff_tied:.1e}")
print(f"  (vs the projection's alone: max |diff| = {np.abs(g_tied - parts['pre-softmax projection']).max():.1e})")
rows_src = set(np.unique(src).tolist()); rows_tgt = set(np.unique(tgt_in).tolist())

# %% [markdown]
# Look at the "rows with a gradient" column. The two embedding uses touch only the
# rows of the ids in the batch (a lookup's gradient is a scatter-add into those
# rows), while the projection touches *every* row: the softmax pushes down the
# score of every word that is not the target. So a rare word's vector is trained
# as an output class on every step, even in batches where it never appears as
# input, which is one reason tying helps on small data.
#
# The saving, for the base model: two `V x D` matrices.

# %%
n_untied = count(TransformerConfig(share_embeddings=False))
print(f"base model: shared {n_base:,}, untied {n_untied:,}: sharing saves {n_untied - n_base:,} "
      f"parameters ({(n_untied - n_base) / n_untied:.0%} of the untied model)")

# %%
fig, ax = plt.subplots(2, 1, figsize=(8, 10))            # one above the other: each readable on a phone
names = list(groups)
vals = [groups[k] / 1e6 for k in names]
colors = ["tab:purple" if "embedding" in k else ("tab:blue" if k.startswith("encoder") else "tab:orange")
          for k in names]
ax[0].barh(names, vals, color=colors)
ax[0].barh(["(untied: tgt embedding)", "(untied: pre-softmax)"], [groups["embedding (shared)"] / 1e6] * 2,
           color="none", edgecolor="tab:purple", hatch="//")
for i, v in enumerate(vals):
    ax[0].text(v + 0.2, i, f"{v:.1f}M", va="center", fontsize=8)
ax[0].set_xlim(0, 1.25 * max(vals)); ax[0].invert_yaxis()      # room for the labels inside the panel
ax[0].set_xlabel("parameters (millions)")
ax[0].set_title(f"base model, V = 37000 shared: {n_base / 1e6:.1f}M\n"
                f"(hatched: the two matrices sharing saves; untied {n_untied / 1e6:.1f}M)")
names3 = [r[0] for r in rows]; implied = [r[3] / 1e3 for r in rows]
ax[1].barh(names3, implied, color=["tab:gray" if n == "big" else "tab:green" for n in names3])
ax[1].axvline(37, color="k", ls="--", lw=1, label="37000, 'about 37000 tokens' (section 5.1)")
ax[1].legend(loc="upper left", fontsize=8, frameon=False, borderaxespad=0.2)   # a row of its own on a phone
for i, v in enumerate(implied):
    ax[1].text(v + 0.3, i, f"{v:.1f}k", va="center", fontsize=8)
ax[1].set_ylim(len(rows) - 0.5, -1.3); ax[1].set_xlim(0, 60)
ax[1].set_xlabel("embedding rows that make the paper's count (thousands)")
ax[1].set_title("(paper's count - library's layers) / d_model:\n"
                f"base family {lo_V / 1e3:.0f}k-{hi_V / 1e3:.0f}k rows, big model {rows[-1][3] / 1e3:.0f}k")
fig.tight_layout(); show_figure(fig, "09_parameters.png")
layer_total = sum(v for k, v in groups.items() if k.startswith(("encoder", "decoder")))
ffn_total = sum(v for k, v in groups.items() if k.endswith("ffn"))
print(f"the feed-forward networks hold {ffn_total / layer_total:.0%} of the layers' parameters")

# %% [markdown]
# The base model's bars: where its parameters live. The feed-forward networks hold
# the largest share of the layers' parameters (printed above; $2 D F = 8 D^2$ per layer,
# against $4 D^2$ per attention block); the decoder is bigger than the encoder by its
# cross-attention; layer norms are a rounding error; the shared embedding is the
# largest single matrix, and untying would add the two hatched bars. The paper's
# count against the library's layers: the rows of Table 3 the library can express, turned into the vocabulary size each
# one implies: the base family agrees on one size, the big model does not.
#
# ## Check
#
# The count is also checked for three other settings of `TransformerConfig`:
# learned positions (`positional="learned"`, one `max_len x D` table per stack,
# Table 3 row E), unequal depths, and `norm_position="pre"`, lesson 7's pre-norm wiring
# `x + Sublayer(LN(x))`, which needs one more layer norm at the top of each stack
# (nothing else normalises the last sub-layer's sum).
#
# These fail if the library's model is wrong: a parameter missing or of the wrong
# shape (the counts would not match the formula), a forward that differs from the
# paper's architecture as written out above, or a shared embedding whose gradient
# keeps only one of its three contributions.

# %%
assert n_base == formula(37000, 512, 2048, 6, 6) == 63_082_496, n_base
assert n_untied == formula(37000, 512, 2048, 6, 6, shared=False)
assert model.num_parameters() == formula(len(vocab), 32, 64, 2, 2)
assert untied.num_parameters() == formula(len(vocab), 32, 64, 2, 2, shared=False)
for extra in (dict(positional="learned", max_len=50), dict(norm_position="pre"), dict(n_encoder_layers=3, n_decoder_layers=1)):
    c = TransformerConfig(vocab_size=101, d_model=24, n_heads=3, d_ff=40, **extra)
    expected = formula(101, 24, 40, c.n_encoder_layers, c.n_decoder_layers,
                       learned_positions=c.max_len if c.positional == "learned" else 0, pre_norm=c.norm_position == "pre")
    assert count(c) == expected == Transformer(c).num_parameters(), (extra, count(c), expected)
assert diff_memory < 1e-12 and diff_logits < 1e-12, "Transformer.forward is not the model written out above"
assert logits_lib.shape == (src.shape[0], tgt_in.shape[1], len(vocab))
assert np.abs(logits_t - logits_u).max() < 1e-12
assert diff_tied < 1e-12, "the shared embedding's gradient must be the sum of its three uses"
for g in parts.values():       # each use contributes something, so dropping one would be caught
    assert np.abs(g_tied - (g_sum - g)).max() > 1e-6
assert int((np.abs(parts["pre-softmax projection"]).sum(1) > 0).sum()) == len(vocab)
assert set(np.nonzero(np.abs(parts["src embedding"]).sum(1))[0].tolist()) <= rows_src
assert set(np.nonzero(np.abs(parts["tgt embedding"]).sum(1))[0].tolist()) <= rows_tgt
print(f"Check passed: parameter counts equal the formula (base {n_base:,}; untied {n_untied:,}; learned "
      f"positions, pre-norm, unequal depths), the model written out equals Transformer.forward "
      f"({diff_logits:.0e}), and the tied gradient equals the sum of the untied three ({diff_tied:.0e}).")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. What are the decoder's three sub-layers, and which one reads the encoder's
#    output? What is the shape of its attention weights for one sentence and one head,
#    and of its parameter matrices?
#
#    <details><summary>Answer</summary>
#
#    Masked self-attention over the target, encoder-decoder (cross-) attention, and the
#    feed-forward network. Cross-attention reads the encoder's output (the memory) as its
#    keys and values. Its attention weights are $T \times S$ per sentence and head: each
#    of the $T$ target positions spreads one unit of weight over the $S$ source
#    positions (over the batch and the heads, $(B, H, T, S)$). Its parameters are the
#    same shapes as self-attention's: four $d_{\text{model}} \times d_{\text{model}}$
#    matrices $W^Q, W^K, W^V, W^O$ with their biases, whatever $T$ and $S$ are.
#
#    </details>
#
# 2. The library counts fewer parameters for the base model than Table 3's 65M.
#    Which part of the model explains the gap, and why are the layers not in
#    question?
#
#    <details><summary>Answer</summary>
#
#    The shared embedding matrix, $V \times d_{\text{model}}$. The layer formula predicts
#    how every row of Table 3 changes, and fitting each row of the base family leaves an
#    embedding of a vocabulary somewhat larger than section 5.1's, so the difference is
#    embedding rows; the layers' count agrees with every variant. (The big model's count
#    implies somewhat *fewer* rows than 37000, the table's last line: the paper does not
#    say why.)
#
#    </details>
#
# 3. The shared embedding is used three times. Which use gives a gradient to *every*
#    row, and why must the three gradients be added?
#
#    <details><summary>Answer</summary>
#
#    The output projection (the pre-softmax linear map) gives a gradient to every row:
#    the softmax's gradient reaches every vocabulary entry at every position. The two
#    embedding lookups give gradients only to the rows of tokens in the batch. The same
#    matrix is used three times, so by the chain rule its gradient is the sum of the
#    three uses' gradients.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write an encoder layer, a decoder layer, and the whole model's forward and
# backward with the tied embedding yourself. The starter
# `lessons/exercises/the_whole_model.py` has the signatures, and the shapes and formulas
# in its docstrings; its bodies raise `NotImplementedError`. Fill them in, then grade
# your work:
#
#     attn-check lessons/exercises/the_whole_model.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

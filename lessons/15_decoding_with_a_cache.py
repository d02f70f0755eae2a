# %% [markdown]
# # Lesson 15: decoding with a key/value cache, greedy and beam search (section 6.1)
#
# Training reads a whole target sentence at once (teacher forcing, with the
# look-ahead mask of lesson 5). Translating cannot: the output is not known yet.
# The decoder produces one token, appends it to its input, and runs again, until it
# produces the end-of-sentence token or reaches the paper's limit of "input length +
# 50" (section 6.1).
#
# Done naively, every step re-runs the whole decoder on the whole prefix. This
# lesson shows why that is quadratic in the output length, what a **key/value
# cache** keeps between steps so that each step runs the decoder on *one* position,
# proves that the cached decoder computes what the uncached one does (to float64
# rounding), step by step, and counts the work saved. Then the two searches of
# section 6.1 on top of the one-step decoder: greedy, and beam search with the
# length penalty.
#
# Everything below uses the readable model (`attn.model.Transformer`, lesson 9), the
# layers of `attn.layers`, and the searches of `attn.decode`.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, shown_path, quick_steps  # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import math
import shutil
import time

import numpy as np

from attn import backend as B
from attn import diagram
from attn.data import BOS, EOS, PAD, TOY_DIR, read_parallel, tokenize
from attn.decode import EXTRA_LENGTH, beam_search, greedy_decode, length_penalty
from attn.evaluate import source_ids
from attn.layers import (attention_forward, feed_forward_forward, layer_norm_forward, merge_heads,
                         sinusoidal_table, split_heads)
from attn.masks import padding_mask
from attn.model import Transformer, log_softmax
from attn.train import train
from attn.training.config import config_from_argv
from attn.translate import load_translator

B.set_backend("numpy")                                       # lessons run on the CPU
T0 = time.time()

# %% [markdown]
# ## 1. A model to decode with
#
# A cache is a matter of bookkeeping, so any model would do for the proofs; a trained
# one makes the searches worth looking at. We train a small translator (its size is
# printed below) on short sentences of the toy corpus with `attn.train.train`
# (lesson 14), briefly: a model that is good but not perfect, so that it still hesitates
# between outputs now and then, which is where beam search and greedy part ways. We then load it in float64, so that "equal" below can mean equal to
# float64's rounding error, far below float32's.

# %%
MAX_WORDS = 8 if QUICK else 14
N_TRAIN, N_TEST, N_POOL = (1500, 60, 300) if QUICK else (8000, 200, 1000)
STEPS = quick_steps(600) if QUICK else 1500


def short(split, n):
    return [p for p in read_parallel(TOY_DIR, "en", "tk", split) if len(p[0].split()) <= MAX_WORDS][:n]


data_dir, run_dir = OUT / "15_data", OUT / "15_run"
shutil.rmtree(run_dir, ignore_errors=True)
splits = {"train": short("train", N_TRAIN), "val": short("val", 50), "test": short("test", N_POOL)}
data_dir.mkdir(parents=True, exist_ok=True)
for split, pairs in splits.items():
    for side, lang in ((0, "en"), (1, "tk")):
        (data_dir / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")
argv = ["--data", os.path.relpath(data_dir), "--out", os.path.relpath(run_dir), "--backend", "numpy", "--seed", "0",
        "--d-model", "32", "--heads", "4", "--d-ff", "64", "--layers", "2", "--dropout", "0.0",
        "--warmup", "150", "--lr-factor", "1", "--steps", str(STEPS), "--max-tokens", "400",
        "--eval-every", str(STEPS), "--average", "0", "--minutes", "0", "--bleu-sentences", "0", "--quiet"]
metrics = train(config_from_argv(argv))
_, vocab = load_translator(run_dir / "checkpoint.npz")
model = Transformer.load(run_dir / "checkpoint.npz", dtype="float64")
cfg = model.config
print(f"trained {metrics['steps']} steps in {metrics['train_seconds']:.1f} s; validation loss "
      f"{metrics['val_loss']:.2f}; {cfg.n_decoder_layers} decoder layers, d_model {cfg.d_model}, "
      f"{cfg.n_heads} heads, vocabulary {len(vocab)}")

def batch_of(pairs):
    rows_ = [source_ids(vocab, tokenize(s)) for s, _ in pairs]
    ids = np.full((len(pairs), max(map(len, rows_))), PAD, dtype=np.int64)
    for i, row in enumerate(rows_):
        ids[i, :len(row)] = row
    return rows_, ids


# A model this good agrees with beam search on most sentences. To watch the two part ways,
# we decode a pool of test sentences once and keep, first, those where greedy and beam
# search (with or without the length penalty) choose differently, then others up to N_TEST.
pool = splits["test"]
_, pool_src = batch_of(pool)
pool_g = greedy_decode(model, pool_src).tokens
pool_b = beam_search(model, pool_src, beam_size=4, alpha=0.6).tokens
pool_b0 = beam_search(model, pool_src, beam_size=4, alpha=0.0).tokens
n_beam_greedy = sum(g != b for g, b in zip(pool_g, pool_b))
n_alpha = sum(b != b0 for b, b0 in zip(pool_b, pool_b0))
parting = [i for i in range(len(pool)) if not pool_g[i] == pool_b[i] == pool_b0[i]]
keep = (parting + [i for i in range(len(pool)) if i not in parting])[:N_TEST]
test = [pool[i] for i in sorted(keep)]
src_rows, src = batch_of(test)
print(f"of {len(pool)} test sentences, beam search (4 beams) and greedy part ways on {n_beam_greedy}, "
      f"the length penalty changes beam search's output on {n_alpha};\nthe {len(test)} below hold all "
      f"{min(len(parting), N_TEST)} such sentences; source lengths "
      f"{min(map(len, src_rows))}-{max(map(len, src_rows))} (with the end-of-sentence id)")

# %% [markdown]
# ## 2. Decoding without a cache: the whole prefix, every step
#
# The encoder runs once: its output, the *memory*, depends on the source alone. The
# decoder starts from `BOS`. At step `t` it has the prefix `y_0 .. y_t` (`y_0 = BOS`);
# `model.decode` runs the whole decoder stack on it (self-attention under the
# look-ahead mask, cross-attention to the memory, feed-forward, in every layer), and
# the last position's output, projected onto the vocabulary, gives the distribution
# of the next token. Greedy decoding takes its argmax and appends it.
#
# Written out in full, for one sentence:

# %%
def greedy_uncached(i, limit=None):
    """Greedy decoding of test sentence i, re-running the decoder on the whole prefix at every step.
    Returns the tokens (no BOS/EOS), the summed log-probabilities, the positions the decoder ran,
    and the number of steps."""
    s = src[i:i + 1, :len(src_rows[i])]
    mask = padding_mask(s)
    memory, _ = model.encode(s, None, mask)                   # once
    prefix, score, positions = [BOS], 0.0, 0
    limit = limit or len(src_rows[i]) + EXTRA_LENGTH          # section 6.1: input length + 50
    for t in range(limit):
        h, _, _ = model.decode(np.array([prefix]), memory, mask)   # (1, t+1, D): every position again
        positions += len(prefix)
        logp = log_softmax(model.project(h[:, -1, :]))[0]          # only the last one is used
        logp[[PAD, BOS]] = -np.inf                                  # never generated
        nxt = int(logp.argmax())
        score += logp[nxt]
        if nxt == EOS:
            break
        prefix.append(nxt)
    return prefix[1:], score, positions, t + 1


toks, score, positions, steps = greedy_uncached(0)
print(f"en:  {test[0][0]}\nref: {test[0][1]}\nout: {' '.join(vocab.decode(toks))}")
print(f"{steps} steps ({'the last one produced EOS' if len(toks) < steps else 'stopped at the length limit'}); "
      f"the decoder ran on {positions} positions in all")

# %% [markdown]
# Step `t` runs every decoder layer on `t + 1` positions, to use one of them: an
# output of `T` tokens costs `1 + 2 + ... + T = T(T + 1)/2` position-passes through
# the decoder, and each of them attends over up to `T` positions, so the attention
# alone grows like $T^3 / 3$. Nearly all of it recomputes numbers that did not
# change.
#
# ## 3. What does not change: the keys and values
#
# Look at what position `j` contributes to a later step. The look-ahead mask means
# that position `j`'s output, in every layer, depends only on positions `0 .. j`.
# Appending a token changes nothing at earlier positions: their hidden states, and so
# their **keys and values** in every layer's self-attention, are the same at every
# later step. The new position needs its own query, and the keys and values of all
# positions so far. So each decoder layer keeps:
#
# * **self-attention**: the keys and values of the positions decoded so far, shape
#   `(B, H, t, d_k)`; each step computes the new position's `k` and `v` and appends
#   them (the cache *grows*);
# * **cross-attention**: the keys and values of the memory, shape `(B, H, S, d_k)`;
#   they depend on the source alone, so they are computed *once*, before the first
#   step, and never change.
#
# The new position's query attends to all cached keys, so no look-ahead mask is
# needed: nothing in the cache lies in the future. `Transformer.start_decoding`
# builds the cross-attention part; `Transformer.decode_step` runs one position and
# returns the grown state. Here are the shapes after a few steps:

# %%
s0 = src[:1, :len(src_rows[0])]
mask0 = padding_mask(s0)
memory0, _ = model.encode(s0, None, mask0)
state = model.start_decoding(memory0, mask0)
grown = []                                                   # the cache's keys' shape after each step
for tok in [BOS] + toks[:5]:
    _, state, _ = model.decode_step(np.array([tok]), state)
    grown.append(state.self_kv[0][0].shape)
show_figure(diagram.kv_cache(grown, state.cross_kv[0][0].shape, [vocab.itos[t] for t in [BOS] + toks[:5]]),
            "15_kv_cache.png", alt=f"The key/value cache of decoder layer 0 growing one position per step, "
            f"{grown[0]} to {grown[-1]}, while the cross-attention's keys stay {state.cross_kv[0][0].shape}.")
for i, ((ck, cv), (sk, sv)) in enumerate(zip(state.cross_kv, state.self_kv)):
    print(f"decoder layer {i}: cross-attention K {ck.shape} V {cv.shape} (computed once); "
          f"self-attention K {sk.shape} V {sv.shape} (after {state.length} steps)")
per_token = 2 * cfg.n_decoder_layers * cfg.d_model
print(f"the cache grows by 2 x {cfg.n_decoder_layers} layers x d_model {cfg.d_model} = {per_token} numbers per "
      f"generated token and sentence; the base model's would grow by {2 * 6 * 512} (6 layers, d_model 512)")

# %% [markdown]
# ## 4. One cached step, by hand
#
# To see that nothing is hidden in `decode_step`, we write the step from the layers
# of `attn.layers` and the model's parameters (post-norm, as in the paper:
# `LayerNorm(x + Sublayer(x))` around each of the three sub-layers, no dropout at
# inference). The input is the new token's embedding times $\sqrt{d_{\text{model}}}$ plus the
# positional encoding of its position, exactly as in training.

# %%
def affine(x, pre, a):
    """x @ W_a + b_a of the sub-layer ``pre`` (a: q, k, v or o)."""
    return x @ model.params[f"{pre}.w_{a}"] + model.params[f"{pre}.b_{a}"]


def norm(x, name):
    return layer_norm_forward(x, model.params[name + ".gamma"], model.params[name + ".beta"], cfg.ln_eps)[0]


def my_step(token, pos, cache, cross_kv, src_mask):
    """One decoder position. token: int; pos: its position; cache: per layer (K, V) of the earlier
    positions, (1, H, pos, d_k) or None; cross_kv: per layer the memory's (K, V).
    Returns log-probabilities (V,) of the next token and the grown cache."""
    H, D = cfg.n_heads, cfg.d_model
    x = model.params["embedding.weight"][token] * math.sqrt(D)
    x = (x + sinusoidal_table(pos + 1, D, "float64")[pos])[None, None, :]        # (1, 1, D)
    new_cache = []
    for i in range(cfg.n_decoder_layers):
        pre = f"decoder.{i}"
        q, k, v = (split_heads(affine(x, pre + ".self_attn", a), H) for a in "qkv")   # (1, H, 1, d_k)
        if cache[i] is not None:                                    # append to the cached keys/values
            k, v = np.concatenate([cache[i][0], k], axis=2), np.concatenate([cache[i][1], v], axis=2)
        new_cache.append((k, v))
        o, _ = attention_forward(q, k, v)                           # one query, all past keys: no mask
        x = norm(x + affine(merge_heads(o), pre + ".self_attn", "o"), f"{pre}.norm1")
        q = split_heads(affine(x, pre + ".cross_attn", "q"), H)
        o, _ = attention_forward(q, *cross_kv[i], src_mask)          # the memory's K, V: computed once
        x = norm(x + affine(merge_heads(o), pre + ".cross_attn", "o"), f"{pre}.norm2")
        p = model.params
        f, _ = feed_forward_forward(x, p[pre + ".ffn.w1"], p[pre + ".ffn.b1"], p[pre + ".ffn.w2"], p[pre + ".ffn.b2"])
        x = norm(x + f, f"{pre}.norm3")
    return log_softmax(model.project(x[0, 0])), new_cache


# %% [markdown]
# (The positional row is the sinusoid of lesson 3, `attn.layers.sinusoidal_table`: a
# row depends on its position alone, not on the table's length.) Now step through
# the first test sentence three ways at once: by hand
# with our cache, with the library's `decode_step`, and by re-running the whole
# decoder on the prefix. At every step the three distributions must agree.

# %%
cross_kv = model.cross_attention_kv(memory0)                         # per layer, once
state = model.start_decoding(memory0, mask0)
cache = [None] * cfg.n_decoder_layers
prefix, step_err = [BOS], []
for t, tok in enumerate([BOS] + toks):
    mine, cache = my_step(tok, t, cache, cross_kv, mask0)
    lib, state, _ = model.decode_step(np.array([tok]), state)
    h, _, _ = model.decode(np.array([[BOS] + toks[:t]]), memory0, mask0)
    full = log_softmax(model.project(h[0, -1]))
    step_err.append(max(np.abs(mine - full).max(), np.abs(lib[0] - full).max()))
print("largest |difference| of log-probabilities, per step: " + " ".join(f"{e:.0e}" for e in step_err))
STEP_TOL = 1e-10

# %% [markdown]
# ## 5. Greedy decoding with the cache, over a batch
#
# `attn.decode.greedy_decode` runs one step for every sentence of a batch at once;
# a sentence that finishes leaves the batch (its rows are dropped from the cache
# with `DecodeState.select`). With `use_cache=False` it re-runs the decoder on the
# prefix as in section 2. Both must give the same tokens and the same scores, and
# the same as our one-sentence loop.

# %%
t = time.perf_counter()
g_cached = greedy_decode(model, src)
sec_cached = time.perf_counter() - t
t = time.perf_counter()
g_full = greedy_decode(model, src, use_cache=False)
sec_full = time.perf_counter() - t
hand = [greedy_uncached(i) for i in range(len(test))]
same_tokens = sum(a == b == h[0] for a, b, h in zip(g_cached.tokens, g_full.tokens, hand))
score_err = max(abs(a - b) for a, b in zip(g_cached.scores, g_full.scores))
hand_err = max(abs(a - h[1]) for a, h in zip(g_cached.scores, hand))
print(f"same tokens in all three on {same_tokens} of {len(test)} sentences; score |diff| cached vs uncached "
      f"{score_err:.1e}, vs the loop by hand {hand_err:.1e}")
print(f"time for the batch (this machine, printed, not a benchmark): cached {sec_cached:.3f} s, "
      f"uncached {sec_full:.3f} s")

# %% [markdown]
# ## 6. Counting the work saved
#
# Count multiply-adds per decoding step for one sentence, with `d = d_model`,
# `F = d_ff`, `S` source positions, `V` the vocabulary, `N` decoder layers, when the
# prefix has `t` positions:
#
# | per layer | without cache | with cache |
# |---|---|---|
# | self-attention projections q, k, v, out | $4 t d^2$ | $4 d^2$ |
# | self-attention scores and weighted sum | $2 t^2 d$ | `2 t d` |
# | cross-attention q and out projections | $2 t d^2$ | $2 d^2$ |
# | cross-attention K and V of the memory | $2 S d^2$ | `0` (done once) |
# | cross-attention scores and weighted sum | `2 t S d` | `2 S d` |
# | feed-forward | `2 t d F` | `2 d F` |
#
# plus `d V` for the output projection of the last position either way. (The
# library's uncached path recomputes the memory's keys and values at every step
# because `model.decode` takes only the memory; a careful uncached decoder would
# hoist them, which changes the constant, not the $t^2$.) Summed over an output of
# `T` tokens:

# %%
def step_cost(t, S, d, F, V, N, cached):
    """Multiply-adds of one decoding step with a prefix of t positions."""
    n = 1 if cached else t                                  # positions the decoder runs
    per_layer = 4 * n * d * d + 2 * n * t * d + 2 * n * d * d + 2 * n * S * d + 2 * n * d * F
    per_layer += 0 if cached else 2 * S * d * d
    return N * per_layer + d * V


def decode_cost(T, S, d, F, V, N, cached):
    once = 2 * S * d * d * N if cached else 0               # the cross-attention K, V: once
    return once + sum(step_cost(t, S, d, F, V, N, cached) for t in range(1, T + 1))


rows = []
for name, (d, F, V, N) in {"this toy model": (cfg.d_model, cfg.d_ff, len(vocab), cfg.n_decoder_layers),
                           "the paper's base model": (512, 2048, 37000, 6)}.items():
    for T in (10, 30, 60):
        S = T
        full, cached = decode_cost(T, S, d, F, V, N, False), decode_cost(T, S, d, F, V, N, True)
        rows.append((name, T, full, cached))
        print(f"{name:<24} T = S = {T:>3}: without cache {full:>15,} multiply-adds, with {cached:>13,}: "
              f"{full / cached:5.1f} times fewer")

# %% [markdown]
# The ratio grows with the output length: the uncached total grows like $T^2$
# (and $T^3$ in the attention scores), the cached one like `T` (and $T^2$). For
# the base model the output projection onto the 37,000-token vocabulary, the same
# either way, is a large part of each cached step, which is why its ratio is smaller.
#
# The positions each approach runs through the decoder are a count we can check
# against the loop of section 2: the uncached loop ran `T(T + 1)/2` positions for a
# `T`-step output, the cached one `T`. We also time one step of each against the
# prefix length (printed, not asserted: timings on a shared machine vary).

# %%
positions_ok = all(h[2] == h[3] * (h[3] + 1) // 2 for h in hand)
print(f"uncached positions == T(T+1)/2 for every test sentence: {positions_ok}; total "
      f"{sum(h[2] for h in hand)} positions against {sum(h[3] for h in hand)} with the cache")

lengths = list(range(1, 41 if QUICK else 81, 3))
sec_step_full, sec_step_cached = [], []
state = model.start_decoding(memory0, mask0)
t_next = 0
for L in lengths:
    while state.length < L - 1:                            # grow the cache to L - 1 positions
        _, state, _ = model.decode_step(np.array([EOS]), state)
    one, full_ = [], []                                    # every repetition timed on its own
    for _ in range(9):
        t = time.perf_counter()
        model.decode_step(np.array([EOS]), state)
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        h, _, _ = model.decode(np.full((1, L), EOS), memory0, mask0)
        model.project(h[:, -1])
        full_.append(time.perf_counter() - t)
    sec_step_cached.append(np.percentile(one, [25, 50, 75]))   # quartiles: the median and its spread
    sec_step_full.append(np.percentile(full_, [25, 50, 75]))
sec_step_cached, sec_step_full = np.array(sec_step_cached), np.array(sec_step_full)
print(f"one step, median of 9: at prefix length {lengths[0]}: cached {1e3 * sec_step_cached[0, 1]:.2f} ms, "
      f"uncached {1e3 * sec_step_full[0, 1]:.2f} ms;\nat {lengths[-1]}: cached {1e3 * sec_step_cached[-1, 1]:.2f} ms, "
      f"uncached {1e3 * sec_step_full[-1, 1]:.2f} ms")

d, F, V, N, S = cfg.d_model, cfg.d_ff, len(vocab), cfg.n_decoder_layers, s0.shape[1]
fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
Ts = np.arange(1, 81)
ax[0].plot(Ts, [decode_cost(T, S, d, F, V, N, False) for T in Ts], label="without cache")
ax[0].plot(Ts, [decode_cost(T, S, d, F, V, N, True) for T in Ts], label="with cache")
ax[0].set_xlabel("output length T"); ax[0].set_ylabel("multiply-adds for the whole output")
ax[0].set_title(f"counted: toy decoder, S = {S}"); ax[0].legend()
for q, label in ((sec_step_full, "without cache"), (sec_step_cached, "with cache")):
    ax[1].plot(lengths, 1e3 * q[:, 1], "o-", label=label + " (median)")
    ax[1].fill_between(lengths, 1e3 * q[:, 0], 1e3 * q[:, 2], alpha=0.3)
ax[1].set_xlabel("prefix length at this step"); ax[1].set_ylabel("ms per step (this machine)")
ax[1].set_title("measured: one step, median of 9, quartiles shaded"); ax[1].legend()
fig.tight_layout(); show_figure(fig, "15_cache_cost.png")

# %% [markdown]
# ## 7. Beam search
#
# Greedy commits to the best token at every step. Beam search (section 6.1: "beam
# search with a beam size of 4 and length penalty alpha = 0.6") keeps the `K` best
# partial outputs, the *beams*. At each step every beam is extended by every token;
# the candidates are ranked by their total `log P(y_1 .. y_t | X)`, and the best
# `K` survive. A candidate ending in `EOS` is a finished hypothesis; finished ones
# are ranked by GNMT's length-penalised score (Wu et al. 2016),
#
# $$\mathrm{score}(Y) = \frac{\log P(Y \mid X)}{\mathit{lp}(Y)}, \qquad
#   \mathit{lp}(Y) = \left(\frac{5 + |Y|}{6}\right)^{\alpha},$$
#
# because `log P` only falls as a sentence grows, and without the penalty search
# would prefer short outputs. With the cache, the beams of a sentence are rows of
# one batch, and keeping beam `k`'s extension means keeping row `k`'s cache:
# `DecodeState.select(parents)` reorders (and repeats) the cached keys and values.
#
# When to stop? The library's rule: keep the best `2 * K` candidates; an `EOS` among the
# first `K` finishes a hypothesis, the first `K` others are the next beams; stop when
# no live beam can beat the best finished score any more. A live beam's `log P` can
# only fall and `lp` only rise, so `log P / lp(limit)` bounds what it can reach. Here
# it is for one sentence, by hand, on `decode_step` and `select`:

# %%
def my_beam(i, K=4, alpha=0.6, trace=None):
    s = src[i:i + 1, :len(src_rows[i])]
    mask = padding_mask(s)
    memory, _ = model.encode(s, None, mask)
    state = model.start_decoding(memory, mask)
    limit = len(src_rows[i]) + EXTRA_LENGTH
    beams = [([], 0.0)]                                     # (tokens, log P), one row of the state each
    finished = []                                           # (score, tokens)
    last = np.array([BOS])
    for t in range(limit):
        logp, state, _ = model.decode_step(last, state)     # (len(beams), V)
        logp[:, [PAD, BOS]] = -np.inf
        cand = np.array([lp + logp[r] for r, (_, lp) in enumerate(beams)])          # (W, V)
        order = np.lexsort((np.arange(cand.size), -cand.ravel()))[:2 * K]          # best 2K; ties: lower id
        new = []
        for rank, f in enumerate(order):
            r, v = divmod(int(f), cand.shape[1])
            if v == EOS:
                if rank < K:                                # an EOS among the first K finishes a hypothesis
                    finished.append((cand[r, v] / length_penalty(t + 1, alpha), beams[r][0]))
            elif len(new) < K:
                new.append((r, v, cand[r, v]))
        beams = [(beams[r][0] + [v], lp) for r, v, lp in new]
        if trace is not None:                               # for the figure: (parent, token, log P) per beam
            trace.append([(r, v, lp) for r, v, lp in new])
        if t + 1 >= limit:                                  # the length limit: live beams count as finished
            finished += [(lp / length_penalty(t + 1, alpha), toks) for toks, lp in beams]
            break
        best = max((f[0] for f in finished), default=-np.inf)
        if best >= max(lp for _, lp in beams) / length_penalty(limit, alpha):
            break                                           # no live beam can still win
        state = state.select(np.array([r for r, _, _ in new]))   # the cache follows the beams
        last = np.array([v for _, v, _ in new])
    return max(finished, key=lambda f: f[0])


b_cached = beam_search(model, src, beam_size=4, alpha=0.6)
b_full = beam_search(model, src, beam_size=4, alpha=0.6, use_cache=False)
mine = [my_beam(i) for i in range(len(test))]
beam_same = sum(a == b == m[1] for a, b, m in zip(b_cached.tokens, b_full.tokens, mine))
beam_err = max(max(abs(a - b), abs(a - m[0])) for a, b, m in zip(b_cached.scores, b_full.scores, mine))
differ = [i for i in range(len(test)) if b_cached.tokens[i] != g_cached.tokens[i]]
print(f"beam 4: library cached == library uncached == by hand on {beam_same} of {len(test)} sentences "
      f"(score |diff| {beam_err:.1e})")
print(f"beam 4 and greedy choose different outputs on {len(differ)} of {len(test)} sentences")
for i in differ[:3]:
    g_text, b_text = (" ".join(vocab.decode(x.tokens[i])) for x in (g_cached, b_cached))
    print(f"  en:     {test[i][0]}\n  ref:    {test[i][1]}\n  greedy: {g_text[:70] + ' ...' * (len(g_text) > 70)}"
          f"\n  beam 4: {b_text[:70] + ' ...' * (len(b_text) > 70)}")
if differ:                                                  # the search's tree, for the shortest of them
    i = min(differ, key=lambda j: len(b_cached.tokens[j]))
    tree = []
    my_beam(i, trace=tree)
    tree = tree[:len(b_cached.tokens[i]) + 1]
    show_figure(diagram.beam_tree(tree, lambda t: vocab.itos[t], chosen=b_cached.tokens[i],
                                  greedy=g_cached.tokens[i]), "15_beam_tree.png")

# %% [markdown]
# The length penalty matters to what beam search returns. Over the test set, with
# $\alpha = 0$ (raw `log P`) and with the paper's $\alpha = 0.6$, compare the outputs'
# lengths; then one sentence's finished hypotheses (`n_best`, best first), with their
# raw `log P` and their penalised score.

# %%
b_raw = beam_search(model, src, beam_size=4, alpha=0.0)
len_raw = np.mean([len(x) for x in b_raw.tokens])
len_pen = np.mean([len(x) for x in b_cached.tokens])
n_changed = sum(a != b for a, b in zip(b_raw.tokens, b_cached.tokens))
print(f"mean output length over {len(test)} sentences: alpha = 0: {len_raw:.2f} tokens, alpha = 0.6: "
      f"{len_pen:.2f}; the penalty changes {n_changed} outputs")
i = next((j for j in range(len(test)) if b_raw.tokens[j] != b_cached.tokens[j]), 0)
print(f"en: {test[i][0]}")
for alpha, r in ((0.0, b_raw), (0.6, b_cached)):
    print(f"  alpha = {alpha}: best {' '.join(vocab.decode(r.tokens[i]))!r}")
    for toks_h, sc in r.n_best[i][:3]:
        n = len(toks_h) + 1
        print(f"    {sc:8.3f} = log P {sc * length_penalty(n, alpha):8.3f} / lp({n}) {length_penalty(n, alpha):.3f}"
              f"   {' '.join(vocab.decode(toks_h))}")

# %% [markdown]
# Without the penalty every extra token costs `log P`, and search settles for
# shorter outputs; with it, a longer hypothesis is divided by a larger `lp` and gets
# its due. (With $\alpha = 0$ the search also stops sooner: once a hypothesis has
# finished, no live beam can beat it, since `log P` only falls.)

# %% [markdown]
# ## Check
#
# These fail if the cache were wrong (a step by hand, the library's `decode_step` and
# the whole decoder on the prefix disagree), if the cached and uncached searches
# chose differently, if the library's beam search did not follow the rule written
# out above, or if the cache did not save the work counted. That beam search and the
# length penalty change this model's outputs depends on how far its training got: it is
# asserted in full mode and printed above in quick mode.

# %%
assert max(step_err) < STEP_TOL, f"cached steps differ from the full decoder by {max(step_err):.1e}"
assert same_tokens == len(test) and score_err < 1e-9 and hand_err < 1e-9, \
    f"greedy: {same_tokens}/{len(test)} equal, score differences {score_err:.1e}, {hand_err:.1e}"
assert beam_same == len(test) and beam_err < 1e-9, f"beam: {beam_same}/{len(test)} equal, |diff| {beam_err:.1e}"
assert positions_ok, "the uncached loop runs 1 + 2 + ... + T positions"
for name, T, full, cached in rows:
    assert full > cached, f"{name}, T = {T}: the cache must save work"
toy_ratios = [full / cached for name, T, full, cached in rows if name == "this toy model"]
if not QUICK:                                         # what the trained model's searches show: full mode's claims
    assert differ and n_changed, "beam and greedy, and the penalty, must make a difference"
    assert len_pen >= len_raw, f"the length penalty should lengthen outputs: {len_raw:.2f} -> {len_pen:.2f}"
assert toy_ratios == sorted(toy_ratios), "the saving grows with the output length"
print(f"Check passed in {time.time() - T0:.1f} s: cached and uncached decoding agree step by step "
      f"(|diff| <= {max(step_err):.0e}); greedy and beam search give the same outputs with and without the "
      f"cache and by hand; at T = S = 60 the toy decoder needs {toy_ratios[-1]:.1f} times fewer multiply-adds.")

# %% [markdown]
# ## Questions
#
# 1. Why may the new position's query attend to every cached key without a
#    look-ahead mask, when training needs one?
#
#    <details><summary>Answer</summary>
#
#    The cache holds only positions already produced, all earlier than the new one: there
#    is nothing later to hide. In training the whole target is present at once, so the
#    mask is what hides the later positions.
#
#    </details>
#
# 2. The cross-attention keys and values are computed once, the self-attention ones
#    grow. What would change if the decoder's self-attention were not causal (if
#    position `j` could see later positions)? Could it still be cached?
#
#    <details><summary>Answer</summary>
#
#    Every position's keys and values would depend on later tokens, so each new token
#    would change the keys and values of all earlier positions: the cache would be stale
#    after every step and all positions would have to be recomputed. Causality is what
#    lets earlier keys and values stay fixed and be cached.
#
#    </details>
#
# 3. In beam search, why must the cache be reordered with `select` after each step,
#    and why can a row appear twice in the new order?
#
#    <details><summary>Answer</summary>
#
#    After a step, the surviving hypotheses are not in the old order: the best
#    continuations may come from any beams. The cached keys and values must follow their
#    hypotheses, so the cache rows are gathered by the index of each new hypothesis's
#    parent. One parent can have two good continuations, so its row is copied to two
#    places in the new order.
#
#    </details>

# %% [markdown]
# ## Exercise
#
# Write greedy decoding and beam search on the one-step decoder yourself, and the
# checkpoint averaging of section 6.1 that lesson 14 used: the starter is
# `lessons/exercises/decoding.py`; grade it with
# `attn-check lessons/exercises/decoding.py`.

# %% [markdown]
# # Lesson 10: why self-attention (section 4, Table 1)
#
# Section 4 compares a self-attention layer with a recurrent and a convolutional
# layer, each mapping a sequence `(x_1..x_n)` to a sequence `(z_1..z_n)` of the same
# width `d`, on three counts:
#
# | layer type | complexity per layer | sequential operations | maximum path length |
# |---|---|---|---|
# | self-attention | $O(n^2 d)$ | `O(1)` | `O(1)` |
# | recurrent | $O(n d^2)$ | `O(n)` | `O(n)` |
# | convolutional (kernel `k`) | $O(k n d^2)$ | `O(1)` | `O(log_k n)` (dilated) |
# | self-attention, restricted to a neighbourhood `r` | `O(r n d)` | `O(1)` | `O(n / r)` |
#
# * **Complexity per layer**: arithmetic. Self-attention compares every position
#   with every other: $n^2$ dot products of length `d`. A recurrent layer
#   multiplies each of the `n` states by a `d x d` matrix. So self-attention is
#   cheaper when `n < d`, "which is most often the case with sentence
#   representations used by state-of-the-art models" (sentences of tens of
#   word-pieces, `d = 512`).
# * **Sequential operations**: how many steps must happen one after the other,
#   however many processors you have. A recurrent layer cannot compute `h_t`
#   before $h_{t-1}$.
# * **Maximum path length**: how many layers (or steps) a signal must cross to go
#   from one position to another, forwards or, for learning, backwards. "The
#   shorter these paths ... the easier it is to learn long-range dependencies."
#
# This lesson *measures* each column with the library's layers,
# `attn.layers.multi_head_attention_forward` and `attn.layers.rnn_forward`
# (plus a convolution built from `linear_forward`), rather than taking the table
# on faith; and looks at what common summaries of section 4 say about it.

# %%
import os, sys
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # one core: timings comparable, BLAS threads out of the way
import math
import time
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn.layers import (attention_weights, linear_forward, multi_head_attention_backward,
                         multi_head_attention_forward, rnn_backward, rnn_forward, rnn_step_forward)

T0 = time.time()
rng = np.random.default_rng(0)


def attention_params(d, rng, dtype=np.float64):
    """w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o for multi_head_attention_forward."""
    out = []
    for _ in range(4):
        out += [(rng.standard_normal((d, d)) / np.sqrt(d)).astype(dtype), np.zeros(d, dtype)]
    return out


def rnn_params(d, rng, dtype=np.float64):
    """w_x, w_h, b for rnn_forward (input width = hidden width = d)."""
    return [(rng.standard_normal((d, d)) / np.sqrt(d)).astype(dtype),
            (rng.standard_normal((d, d)) / np.sqrt(d)).astype(dtype), np.zeros(d, dtype)]


def self_attention(x, p, heads):
    return multi_head_attention_forward(x, x, *p, heads)

# %% [markdown]
# ## 1. Complexity per layer: count the multiply-adds
#
# As in lesson 6, we count from shapes: of the input, of the weight matrices the
# layer multiplies by, and of the attention weights it returned (one `n x n` table
# per head). For one sequence of `n` positions of width `d`:
#
# | | per-position projections | mixing across positions |
# |---|---|---|
# | self-attention | $W^Q, W^K, W^V, W^O$: $4 n d^2$ | scores $n^2 d$ + weighted sum $n^2 d$ |
# | recurrent | input `x_t W_x`: $n d^2$ | recurrence $h_{t-1} W_h$: $n d^2$ |
#
# Table 1's $O(n^2 d)$ for self-attention is the mixing column: the projections
# cost $O(n d^2)$, like a recurrent layer, and the table leaves them out (they are
# per-position work that any layer type has in some form). Comparing the mixing
# terms, $2 n^2 d$ against $n d^2$, self-attention is cheaper while `n < d/2`; with
# an LSTM (four gates, $4 n d^2$ for the recurrence) while `n < 2d`. Constants move
# the crossing point; the big-O statement "cheaper when `n < d`" is about the order.

# %%
def macs_attention(x, p, cache):
    """(projections, mixing) multiply-adds of one multi_head_attention_forward on x with weights
    p, read off the shapes: of x, of the four (D, D) matrices, and of the weights it returned."""
    rows = int(np.prod(x.shape[:-1]))                       # B * n positions
    proj = sum(rows * w.shape[0] * w.shape[1] for w in p[0::2])   # W^Q, W^K, W^V, W^O
    Bsz, H, Tq, Tk = attention_weights(cache).shape         # one (Tq, Tk) table per head
    Dh = x.shape[-1] // H
    mixing = Bsz * H * Tq * Tk * (Dh + Dh)                  # Q K^T and weights @ V, all heads
    return proj, mixing


def macs_rnn(x, p):
    """(input projection, recurrence) multiply-adds of one rnn_forward on x with w_x, w_h, b = p."""
    Bsz, T, Din = x.shape
    H = p[1].shape[0]
    return Bsz * T * Din * H, Bsz * T * H * H


d_count, heads = 64, 8
count_ns = [8, 16, 32, 48, 64, 96, 128, 256, 512]
counts = []
for n in count_ns:
    x = rng.standard_normal((1, n, d_count))
    pa, pr = attention_params(d_count, rng), rnn_params(d_count, rng)
    _, c_att = self_attention(x, pa, heads)
    counts.append(macs_attention(x, pa, c_att) + macs_rnn(x, pr))
counts = np.array(counts)                                   # columns: att proj, att mixing, rnn input, rnn recurrence
print(f"multiply-adds per layer, d = {d_count}")
print(f"{'n':>5} {'attn proj':>11} {'attn mixing':>12} {'rnn input':>10} {'rnn recur':>10}   mixing: attn / rnn")
for n, row in zip(count_ns, counts):
    print(f"{n:5d} {row[0]:11d} {row[1]:12d} {row[2]:10d} {row[3]:10d}   {row[1] / row[3]:6.2f}")
cross = count_ns[int(np.argmax(counts[:, 1] > counts[:, 3]))]
print(f"self-attention's mixing costs more than the recurrence from n = {cross} on (d/2 = {d_count // 2})")

# %% [markdown]
# ## 2. Time per layer
#
# Now the clock: one layer, `d = 128`, 8 heads, one sequence, NumPy on one core.
# We read the *CPU time* of this process (`time.process_time`), not the wall
# clock: on a shared machine a run longer than the scheduler's time slice waits
# while other programs hold the core, and the wall clock counts the wait. Each
# time is the fastest of several runs, the two layers timed alternately.

# %%
d_time = 128
time_ns = [32, 64, 128, 256, 512] if QUICK else [16, 32, 64, 128, 256, 512, 1024]
repeats = 5 if QUICK else 7
p_att32 = attention_params(d_time, rng, np.float32)
p_rnn32 = rnn_params(d_time, rng, np.float32)
t_att, t_rnn = [], []
for n in time_ns:
    x = rng.standard_normal((1, n, d_time)).astype(np.float32)
    self_attention(x, p_att32, heads); rnn_forward(x, None, *p_rnn32)          # warm up
    ta, tr = [], []
    for _ in range(repeats):
        t = time.process_time(); self_attention(x, p_att32, heads); ta.append(time.process_time() - t)
        t = time.process_time(); rnn_forward(x, None, *p_rnn32); tr.append(time.process_time() - t)
    t_att.append(min(ta)); t_rnn.append(min(tr))
t_att, t_rnn = np.array(t_att), np.array(t_rnn)
print(f"{'n':>5} {'self-attn ms':>13} {'recurrent ms':>13} {'rnn us/step':>12} {'attn / rnn':>11}")
for n, a, r in zip(time_ns, t_att, t_rnn):
    print(f"{n:5d} {a * 1e3:13.3f} {r * 1e3:13.3f} {r / n * 1e6:12.1f} {a / r:11.2f}")
big = np.array(time_ns) >= 64                              # fit where the work, not the overhead, dominates
slope_att, slope_rnn = (np.polyfit(np.log(np.array(time_ns)[big]), np.log(t[big]), 1)[0] for t in (t_att, t_rnn))
print(f"time grows like n^{slope_att:.2f} (self-attention) and n^{slope_rnn:.2f} (recurrent), n >= 64")

# %% [markdown]
# **What to notice.** The recurrent layer's time grows in proportion to `n`: a
# constant cost per step (the `us/step` column). Self-attention's grows faster,
# towards $n^2$, once the `n x n` score matrices dominate, and the ratio of the two
# climbs with `n`.
#
# On one core this is all there is to it: a core does one thing at a time, and the
# recurrent layer's `n` steps cost what their arithmetic costs. Parallel hardware
# changes the picture. Each recurrent step is a `(1, 128) @ (128, 128)` product,
# 16k multiply-adds: a GPU with thousands of cores finishes that in about the time
# it takes to start it, then waits for the next step, `n` times over, mostly idle.
# Self-attention hands it the whole `n x n` score matrix at once. That is the
# "sequential operations" column, and it is why the paper can say self-attention
# trains faster even where it does more arithmetic.

# %% [markdown]
# ## 3. Sequential operations: how many rounds with unlimited processors?
#
# Imagine every position had its own processor. In one *round*, each processor
# applies the layer's update to whatever its inputs currently hold. How many
# rounds until every output is right?
#
# For the recurrent layer, a round computes $h_t = \mathrm{cell}(x_t, h_{t-1})$ for all `t`
# at once, with `rnn_step_forward` on all positions stacked into one batch. We
# start with every `h_t` unknown, written as NaN. NaN is contagious: any
# arithmetic with it gives NaN, so a value is finite exactly when everything it
# depends on is known. Round 1 makes the first state known (it needs only `x_0`
# and the initial state, zeros), round 2 the second, and so on: **n rounds**, no
# matter how many processors. For
# self-attention, one call of the layer computes every output from the inputs
# alone: **one round**.

# %%
d_small = 16
p_rnn = rnn_params(d_small, rng)
p_att = attention_params(d_small, rng)


def rounds_until_known(update, shape, max_rounds):
    """Apply ``guess = update(guess)`` from an all-NaN (unknown) guess; the number of rounds
    until no output is unknown, and the final guess."""
    guess = np.full(shape, np.nan)
    for r in range(1, max_rounds + 1):
        guess = update(guess)
        if np.isfinite(guess).all():
            return r, guess
    return None, guess


def rnn_round(x, guess):
    """One parallel round of the recurrence: h_t = cell(x_t, guess_{t-1}) for every t at once."""
    Bsz, n, d = x.shape
    prev = np.concatenate([np.zeros((Bsz, 1, d)), guess[:, :-1]], axis=1)      # h_{-1} = h0 = 0
    h, _ = rnn_step_forward(x.reshape(Bsz * n, d), prev.reshape(Bsz * n, d), *p_rnn)
    return h.reshape(Bsz, n, d)


seq_ns = [1, 2, 4, 8, 16, 32, 64] if QUICK else [1, 2, 4, 8, 16, 32, 64, 128]
seq_rounds, rounds_match_rnn = {"recurrent": [], "self-attention": []}, True
for n in seq_ns:
    x = rng.standard_normal((1, n, d_small))
    r, h = rounds_until_known(lambda g: rnn_round(x, g), (1, n, d_small), 2 * n + 1)
    ref, _ = rnn_forward(x, None, *p_rnn)
    rounds_match_rnn &= bool(np.allclose(h, ref, rtol=1e-12, atol=1e-12))
    seq_rounds["recurrent"].append(r)
    r, _ = rounds_until_known(lambda g: self_attention(x, p_att, 4)[0], (1, n, d_small), 2 * n + 1)
    seq_rounds["self-attention"].append(r)
print("n                      ", seq_ns)
for k, v in seq_rounds.items():
    print(f"rounds, {k:<15}", v)
print("after n rounds the parallel recurrence equals rnn_forward:", rounds_match_rnn)

# %% [markdown]
# (One caveat, for later reading: this holds for a *nonlinear* recurrence such as
# the tanh cell. A *linear* recurrence $h_t = a_t h_{t-1} + b_t$ can be computed
# with a parallel prefix scan in `O(log n)` rounds, which is what some recent
# sequence models exploit.)
#
# ## 4. Maximum path length: how far apart are two positions?
#
# Put the poison in the input instead: make `x_0` NaN and count how many layers (or
# recurrent steps) it takes for NaN to reach the output at the *last* position,
# `n - 1`. That count is the length of the shortest path between the two ends of
# the sequence.
#
# * **Self-attention**: one layer. The last query's scores include the poisoned
#   key.
# * **Recurrent**: `n` steps: $x_0 \to h_0 \to h_1 \to \dots \to h_{n-1}$. (Rounds of the
#   parallel update from a finite guess, as above, one position per round.)
# * **Convolution**, kernel `k = 3`, causal: output `t` reads inputs `t, t-s, t-2s`
#   (`s` the dilation), built from `linear_forward` on three shifted copies.
#   Contiguous kernels (`s = 1` in every layer) reach `k - 1` positions further
#   per layer: `ceil((n-1)/(k-1))` layers, the `O(n/k)` of section 4. Dilated ones
#   ($s = 1, k, k^2, \dots$, as in ByteNet) multiply the reach by `k` per layer:
#   `ceil(log_k n)` layers, Table 1's `O(log_k n)`.

# %%
K_CONV = 3
w_conv = rng.standard_normal((K_CONV * d_small, d_small)) / np.sqrt(K_CONV * d_small)


def conv_layer(x, dilation):
    """Causal convolution: out_t = tanh([x_t, x_{t-s}, x_{t-2s}] @ w), zeros before the start."""
    Bsz, n, d = x.shape
    taps = []
    for j in range(K_CONV):
        s = min(j * dilation, n)
        taps.append(np.concatenate([np.zeros((Bsz, s, d)), x[:, :n - s]], axis=1))
    out, _ = linear_forward(np.concatenate(taps, axis=-1), w_conv, np.zeros(d))
    return np.tanh(out)


def path_length(layer, n, max_layers):
    """Layers until a NaN at input position 0 reaches output position n-1."""
    x = rng.standard_normal((1, n, d_small))
    x[0, 0] = np.nan
    h = x
    for L in range(1, max_layers + 1):
        h = layer(h, L)
        if np.isnan(h[0, -1]).any():
            return L
    return None


def rnn_path(n):
    x = rng.standard_normal((1, n, d_small))
    x[0, 0] = np.nan
    guess = np.zeros((1, n, d_small))
    for r in range(1, n + 2):
        guess = rnn_round(x, guess)
        if np.isnan(guess[0, -1]).any():
            return r
    return None


def layers_to_reach(n, reach_of_L):
    """Smallest L with reach_of_L(L) >= n - 1: the expected path length for a given reach."""
    L = 0
    while reach_of_L(L) < n - 1:
        L += 1
    return L


path_ns = [2, 3, 4, 9, 10, 27, 28, 64] if QUICK else [2, 3, 4, 8, 9, 10, 16, 27, 28, 64, 81, 82, 128]
paths = {"self-attention": [path_length(lambda h, L: self_attention(h, p_att, 4)[0], n, n) for n in path_ns],
         "recurrent": [rnn_path(n) for n in path_ns],
         "conv, contiguous": [path_length(lambda h, L: conv_layer(h, 1), n, n) for n in path_ns],
         "conv, dilated": [path_length(lambda h, L: conv_layer(h, K_CONV ** (L - 1)), n, n) for n in path_ns]}
expected = {"self-attention": [1] * len(path_ns),
            "recurrent": list(path_ns),
            "conv, contiguous": [layers_to_reach(n, lambda L: L * (K_CONV - 1)) for n in path_ns],
            "conv, dilated": [layers_to_reach(n, lambda L: K_CONV ** L - 1) for n in path_ns]}
print(f"{'n':<18}", " ".join(f"{n:4d}" for n in path_ns))
for k in paths:
    print(f"{k:<18}", " ".join(f"{v:4d}" for v in paths[k]), "  as expected:", paths[k] == expected[k])

# %% [markdown]
# **Restricted self-attention** lets each position attend only to a neighbourhood
# of size `r` "centered around the respective output position" (section 4): a
# banded mask. Blog posts often describe it differently: "cut the sentence into
# `n/r` blocks of length `r` and attend within each block". That is
# not the paper's construction, and the difference matters for this column: with
# disjoint blocks no stack of layers ever connects two blocks, so the path length
# between the first and the last position is *infinite*, not `O(n/r)`.
#
# The poison cannot show this through the layer: a masked weight is exactly 0,
# but `0 * NaN` is NaN, so NaN leaks through masked keys. We follow the mask
# itself instead: position `j` reaches position `i` in one layer if `mask[i, j]`.

# %%
R = 8


def masked_path(mask, max_layers):
    """Layers until position 0 reaches position n-1 when each layer connects j -> i where mask[i, j]."""
    reach = np.zeros(mask.shape[0], dtype=bool)
    reach[0] = True
    for L in range(1, max_layers + 1):
        reach = (mask.astype(np.float64) @ reach) > 0
        if reach[-1]:
            return L
    return None


restricted = {"banded (paper)": [], "blocks (blogs)": []}
for n in path_ns:
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    restricted["banded (paper)"].append(masked_path(np.abs(i - j) <= R // 2, n))
    restricted["blocks (blogs)"].append(masked_path(i // R == j // R, n))
expected["banded (paper)"] = [layers_to_reach(n, lambda L: L * (R // 2)) for n in path_ns]
print(f"restricted self-attention, r = {R}")
for k, v in restricted.items():
    print(f"{k:<16}", " ".join(f"{'inf' if p is None else p:>4}" for p in v))

# %% [markdown]
# ## 5. What a short path buys: gradients across distance
#
# Backpropagate from the **last** output only, and look at how much gradient
# reaches each input, against its distance from the end. The recurrent layer's
# gradient to `x_i` is a product of `n - 1 - i` step Jacobians $\mathrm{diag}(1 - h^2) W_h^\top$;
# with weights like these (spectral radius about 1, tanh' below 1) each factor
# shrinks it, and after a few dozen steps almost nothing is left: the vanishing
# gradient of lesson 1. Self-attention reaches every input through one softmax.

# %%
n_grad, d_grad = (64, 64) if QUICK else (128, 64)
xg = rng.standard_normal((1, n_grad, d_grad))
hs, c = rnn_forward(xg, None, *rnn_params(d_grad, rng))
dhs = np.zeros_like(hs)
dhs[0, -1] = rng.standard_normal(d_grad)
g_rnn = np.linalg.norm(rnn_backward(dhs, c)[0][0], axis=-1)[::-1]        # index = distance from the end
out, c = self_attention(xg, attention_params(d_grad, rng), heads)
dout = np.zeros_like(out)
dout[0, -1] = rng.standard_normal(d_grad)
gq = multi_head_attention_backward(dout, c)
g_att = np.linalg.norm((gq[0] + gq[1])[0], axis=-1)[::-1]                 # x is both query and key/value
dist = np.arange(n_grad)
near, far = slice(1, n_grad // 4), slice(3 * n_grad // 4, n_grad)       # distance 0 (itself) aside
decay_rnn = float(np.exp(np.log(g_rnn[far] + 1e-300).mean() - np.log(g_rnn[near]).mean()))
decay_att = float(np.exp(np.log(g_att[far]).mean() - np.log(g_att[near]).mean()))
print(f"gradient reaching the far quarter / the near quarter (geometric means), n = {n_grad}:")
print(f"  recurrent {decay_rnn:.1e}   self-attention {decay_att:.2f}")

# %% [markdown]
# **On the common summary.** Tutorials often sum section 4 up as "(1) self-attention
# reduces the computation per layer, (2) it parallelises, (3) its gradients do not
# vanish however long the sequence". (2) is right, and measured above. (1) holds only
# while `n < d`; past that, self-attention does *more* arithmetic (section 1's
# counts), which is exactly why the paper proposes the restricted variant for long
# sequences. (3) is true of *distance*: the plot's self-attention curve is flat. But
# gradients in a Transformer can still vanish: a saturated softmax (the reason for the
# $1/\sqrt{d_k}$ of section 3.2.1), a deep stack (residual connections and layer norm
# are there for that), and with diffuse attention each input's share is about `1/n`,
# so the signal per input thins out as `n` grows, slowly rather than exponentially.
#
# Translations of the paper sometimes gloss `O(n)` sequential operations as "the
# recurrent network takes more time". That is not what the column says: it says
# the steps cannot be *parallelised*. On one CPU core (section 2) the recurrent
# layer is not slower at all; the `n` dependent steps cost time when there are
# many processors to keep busy, a GPU's thousands of cores, and only one step's
# worth of work to give them.
#
# ## 6. The figure

# %%
fig, ax = plt.subplots(2, 2, figsize=(13, 9.5))
a = ax[0, 0]
a.loglog(time_ns, t_att * 1e3, "o-", color="C0", label="self-attention (8 heads)")
a.loglog(time_ns, t_rnn * 1e3, "s-", color="C1", label="recurrent (tanh)")
ref_n = np.array(time_ns, dtype=float)
a.loglog(ref_n, t_rnn[-1] * 1e3 * ref_n / ref_n[-1], ":", color="gray", label="slope 1 (~ n)")
a.loglog(ref_n, t_att[-1] * 1e3 * (ref_n / ref_n[-1]) ** 2, "--", color="gray", label="slope 2 (~ n^2)")
a.set(xlabel="sequence length n", ylabel="CPU ms per layer (fastest of several runs)",
      title=f"time per layer, d = {d_time}, NumPy, one core")
a.legend(fontsize=8)
a = ax[0, 1]
a.loglog(count_ns, counts[:, 1], "o-", color="C0", label="self-attention mixing (2 n^2 d)")
a.loglog(count_ns, counts[:, 3], "s-", color="C1", label="recurrence (n d^2)")
a.loglog(count_ns, counts[:, 0], ":", color="C0", label="attention projections (4 n d^2)")
a.axvline(d_count / 2, color="gray", ls="--", lw=0.8)
a.text(d_count / 2 * 1.05, counts[:, 3].min() * 2, "n = d/2", fontsize=8)
a.set(xlabel="sequence length n", ylabel="multiply-adds (counted from caches)",
      title=f"arithmetic per layer, d = {d_count}")
a.legend(fontsize=8)
a = ax[1, 0]
big_n = np.arange(2, 1025)
a.loglog(big_n, big_n, color="C1", label="recurrent: n")
a.loglog(big_n, [layers_to_reach(n, lambda L: L * (K_CONV - 1)) for n in big_n], color="C2",
         label="conv, contiguous k=3: ceil((n-1)/(k-1))")
a.loglog(big_n, [layers_to_reach(n, lambda L: K_CONV ** L - 1) for n in big_n], color="C3",
         label="conv, dilated k=3: ceil(log_k n)")
a.loglog(big_n, [layers_to_reach(n, lambda L: L * (R // 2)) for n in big_n], color="C4",
         label=f"restricted attention r={R}: ceil((n-1)/(r/2))")
a.loglog(big_n, np.ones_like(big_n), color="C0", label="self-attention: 1")
for k, color in (("self-attention", "C0"), ("recurrent", "C1"), ("conv, contiguous", "C2"), ("conv, dilated", "C3")):
    a.loglog(path_ns, paths[k], "o", color=color, ms=5)
a.loglog(path_ns, restricted["banded (paper)"], "o", color="C4", ms=5)
a.set(xlabel="sequence length n", ylabel="layers (steps) from position 0 to n-1",
      title="maximum path length (lines: formula, dots: measured)")
a.legend(fontsize=8)
a = ax[1, 1]
a.semilogy(dist, g_att, color="C0", label="self-attention")
a.semilogy(dist, g_rnn + 1e-300, color="C1", label="recurrent")
a.set(xlabel="distance from the last position", ylabel="|d out_last / d x_i|",
      title=f"gradient from the last output, n = {n_grad}", ylim=(max(1e-30, g_rnn.min() + 1e-300), None))
a.legend(fontsize=8)
for a in ax.flat:                                               # the decades only: 3x10^1 would run into 4x10^1
    a.xaxis.set_minor_formatter(plt.NullFormatter())
fig.tight_layout(); show_figure(fig, "10_why_self_attention.png")

# %% [markdown]
# Table 1 again, with our measurements in place of the orders, for `n = 64` (and
# `d = 64` in the counts). The convolution and restricted attention compute every
# output in one call of the layer, one round, as self-attention does.

# %%
i64, j64, k64 = count_ns.index(64), path_ns.index(64), seq_ns.index(64)
print(f"{'layer':<26} {'mixing MACs':>12} {'rounds':>7} {'path 0 -> n-1':>14}")
print(f"{'self-attention':<26} {counts[i64, 1]:12d} {seq_rounds['self-attention'][k64]:7d} "
      f"{paths['self-attention'][j64]:14d}")
print(f"{'recurrent':<26} {counts[i64, 3]:12d} {seq_rounds['recurrent'][k64]:7d} {paths['recurrent'][j64]:14d}")
print(f"{'convolution, dilated k=3':<26} {'':>12} {1:7d} {paths['conv, dilated'][j64]:14d}")
print(f"{'restricted attention r=8':<26} {'':>12} {1:7d} {restricted['banded (paper)'][j64]:14d}")

# %% [markdown]
# ## Check
#
# These fail if the layers do not have the shapes and dependencies Table 1 states:
# multiply-adds counted from the caches, rounds and path lengths measured by NaN
# propagation through the real layers. The timing check compares how fast the two
# times *grow* (fitted exponents of `n`), with a wide margin, never absolute times,
# so a slower or busier machine does not make it fail.

# %%
n_arr = np.array(count_ns)
assert (counts[:, 1] == 2 * n_arr ** 2 * d_count).all(), "self-attention mixing should be 2 n^2 d multiply-adds"
assert (counts[:, 3] == n_arr * d_count ** 2).all(), "the recurrence should be n d^2 multiply-adds"
assert (counts[:, 0] == 4 * n_arr * d_count ** 2).all(), "the four projections should be 4 n d^2"
assert ((counts[:, 1] <= counts[:, 3]) == (n_arr <= d_count // 2)).all(), "mixing should cost less iff n <= d/2"
assert seq_rounds["recurrent"] == seq_ns, f"a recurrent layer needs n rounds: {seq_rounds['recurrent']}"
assert seq_rounds["self-attention"] == [1] * len(seq_ns), "self-attention needs one round"
assert rounds_match_rnn, "the parallel rounds should reproduce rnn_forward exactly"
for k in paths:
    assert paths[k] == expected[k], f"path length of {k}: measured {paths[k]}, expected {expected[k]}"
assert restricted["banded (paper)"] == expected["banded (paper)"], restricted
assert all(p is None for n, p in zip(path_ns, restricted["blocks (blogs)"]) if n > R), \
    "disjoint blocks should never connect the first and the last position"
assert slope_att > slope_rnn + 0.4, \
    f"self-attention's time should grow faster in n: n^{slope_att:.2f} vs n^{slope_rnn:.2f}"
assert decay_rnn < 1e-6, f"the recurrent gradient should vanish across distance: {decay_rnn:.2e}"
assert 0.2 < decay_att < 5, f"self-attention's gradient should not depend on distance: {decay_att:.2f}"
print(f"Check passed in {time.time() - T0:.1f} s.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. With the constants counted in this lesson, for which sequence lengths is self-
#    attention's mixing cheaper than a recurrent layer's?
#
#    <details><summary>Answer</summary>
#
#    Counting the mixing terms, self-attention costs $2 n^2 d$ and a plain recurrent
#    layer $n d^2$, so self-attention is cheaper while $n < d/2$ (against an LSTM's four
#    gates, while $n < 2d$). The order-of-magnitude statement of section 4 is "cheaper
#    when $n < d$".
#
#    </details>
#
# 2. What is the maximum path length between two positions for self-attention, a
#    recurrent layer and a stack of contiguous convolutions?
#
#    <details><summary>Answer</summary>
#
#    Self-attention: $O(1)$, every position attends to every other in one layer.
#    Recurrent: $O(n)$, the signal passes through every step in between. Contiguous
#    convolutions of width $k$: $O(n/k)$ layers, or $O(\log_k n)$ with dilated
#    convolutions.
#
#    </details>
#
# 3. Why is "cut the sentence into `n/r` blocks and attend within each block" not
#    the paper's restricted self-attention, and what would it do to the path length?
#
#    <details><summary>Answer</summary>
#
#    Blocks cut the sentence so that two neighbours on either side of a boundary never
#    meet, and a position near the start of a block sees nothing to its left. The paper's
#    restricted self-attention is a window of size $r$ *centred on each position*: every
#    position sees its $r$ nearest neighbours, and the maximum path length is $O(n/r)$.
#    With blocks, positions in different blocks are never connected at all, in any number
#    of layers: the path length is infinite.
#
#    </details>

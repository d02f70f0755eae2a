# %% [markdown]
# # Lesson 27: FlashAttention, the paper's attention a tile at a time
#
# Equation 1 of the paper, $\mathrm{Attention}(Q, K, V) = \mathrm{softmax}(QK^\top / \sqrt{d_k})\,V$,
# written as lessons 4 and 8 wrote it, builds the $T_q \times T_k$ matrix of scores, turns it into
# weights and keeps the weights for the backward. Its memory grows with the square of the length:
# for one head of a sequence of 8,192 tokens, one such matrix in float32 is a quarter of a
# gigabyte, and the forward and backward hold several.
#
# FlashAttention (Dao et al., 2022) computes the same numbers a tile of queries and a tile of keys
# at a time. It never holds more than one tile of scores, keeps only the output and *one number
# per query* for the backward, and recomputes the tile's weights there. Every fast attention since
# works this way. This lesson derives it, checks it against the paper's attention in float64,
# and measures what it saves.

# %%
import os, sys
import time
import tracemalloc
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn.gradcheck import check_layer
from attn.layers import attention_backward, attention_forward, flash_attention_backward, flash_attention_forward

np.set_printoptions(precision=4, suppress=True, linewidth=130)
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. The online softmax
#
# Take one query and its scores $s_1, \dots, s_T$. The softmax of lesson 4 subtracts the largest
# score before the exponential, so that nothing overflows:
#
# $$p_j = \frac{e^{s_j - m}}{\ell}, \qquad m = \max_j s_j, \qquad \ell = \sum_j e^{s_j - m}. \tag{27.1}$$
#
# Both $m$ and $\ell$ look at every score before the first weight is known. Read the scores a
# block at a time instead and keep, after each block, the maximum $m$ of the scores seen so far and
# the sum $\ell$ of their exponentials *relative to that maximum*. A new block with scores
# $s_j$, $j \in b$, raises the maximum to $m' = \max(m, \max_{j \in b} s_j)$, and
#
# $$\ell' = e^{m - m'}\, \ell + \sum_{j \in b} e^{s_j - m'}. \tag{27.2}$$
#
# **Why the rescaling is exact.** Every term already in $\ell$ is $e^{s_i - m}$, and
# $e^{s_i - m'} = e^{s_i - m}\, e^{m - m'}$: an identity of the exponential, not an approximation.
# All the old terms are multiplied by the same factor, so their sum is too. After the last block
# $m$ is the row's maximum and $\ell$ is equation 27.1's sum, whatever the blocks were. The factor
# $e^{m - m'}$ is at most one, so nothing overflows on the way.
#
# The output is a weighted sum of values, $o = \sum_j p_j v_j = \frac{1}{\ell}\sum_j e^{s_j - m} v_j$:
# its numerator, the *accumulator* $a$, is a sum of the same kind, rescaled by the same factor,
# $a' = e^{m - m'}\, a + \sum_{j \in b} e^{s_j - m'}\, v_j$, and $o = a / \ell$ at the end. The
# backward will need one more number per query, the log of the softmax's denominator,
#
# $$\mathrm{lse} = m + \log \ell = \log \sum_j e^{s_j}. \tag{27.3}$$
#
# The table follows one query through blocks of three scores. Each key's value is one number
# here, so the accumulator is one number too (in the layer it is a vector of $d_v$). The column
# $e^{m - m'}$ is the factor that rescales $\ell$ and $a$ when the block raises the maximum, and
# is exactly one when it does not:

# %%
s = rng.standard_normal(11) * 4                  # one query's scores
vals = rng.standard_normal(11)                   # one number of value per key
block = 3
m, ell, acc = -np.inf, 0.0, 0.0
print(f"{'block':>5} {'scores':>26} {'max m':>8} {'exp(m - m_new)':>14} {'sum l':>10} {'accumulator a':>13}")
for b0 in range(0, len(s), block):
    sb, vb = s[b0:b0 + block], vals[b0:b0 + block]
    m_new = max(m, sb.max())
    factor = np.exp(m - m_new)                                      # 0 for the first block: m = -inf
    ell = factor * ell + np.exp(sb - m_new).sum()                   # equation 27.2
    acc = factor * acc + (np.exp(sb - m_new) * vb).sum()            # the output's numerator, rescaled alike
    m = m_new
    print(f"{b0 // block:>5} {np.array2string(sb, precision=2):>26} {m:>8.4f} {factor:>14.6f} {ell:>10.6f} "
          f"{acc:>13.6f}")
online_err = abs(m + np.log(ell) - np.log(np.exp(s).sum()))
p_all = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
acc_err = abs(acc / ell - p_all @ vals)
print(f"lse from the blocks {m + np.log(ell):.15f}, from all scores at once {np.log(np.exp(s).sum()):.15f}: "
      f"difference {online_err:.1e}")
print(f"o = a / l = {acc / ell:.15f}, softmax(s) . v = {p_all @ vals:.15f}: difference {acc_err:.1e}")

# %% [markdown]
# ## 2. The forward by tiles
#
# Each query's row is independent of the others, so a *tile* of queries goes through the key tiles
# together: per key tile, one product of the query tile with the key tile's transpose,
# equation 27.2 for every row at once, and the output tile accumulated. Masked scores are $-\infty$, so a
# masked key adds $e^{-\infty} = 0$. Nothing requires the tiles to divide the lengths: the last tile
# of each is shorter.
#
# **A query that may see no key.** A padded query, or a key tile wholly masked for a row, gives a
# block whose scores are all $-\infty$. Before any key is seen $m = -\infty$, and such a block leaves
# the maximum there, $m' = -\infty$: equation 27.2 taken literally asks for $e^{m - m'} =
# e^{-\infty - (-\infty)}$ and $e^{s_j - m'} = e^{-\infty - (-\infty)}$, and $-\infty - (-\infty)$ is
# NaN in floating point. One NaN in $\ell$ stays there for every later block. So the code
# subtracts a *reference* maximum, $m'$ where it is finite and $0$ where it is still $-\infty$
# (`m_ref` in `attn/layers/flash_attention.py`): then the factor is $e^{-\infty - 0} = 0$ and every
# masked term $e^{-\infty - 0} = 0$, so $\ell$ and $a$ stay exactly $0$; the first block with a
# visible key gets a finite maximum and goes on as equation 27.2 says. A row that ends with
# $\ell = 0$ saw no key: its output is set to zero, as the paper's attention gives (lesson 5),
# and its log-sum-exp to $+\infty$, so that the backward's recomputed weights
# $e^{S - \mathrm{lse}}$ are $0$ there too. The cell runs both on a row whose first block is
# masked and on a row that sees nothing:

# %%
def online(scores, block, reference):
    """Equation 27.2 block by block; reference(m_new) is the maximum the exponentials subtract."""
    m, ell = -np.inf, 0.0
    with np.errstate(invalid="ignore"):                             # -inf - (-inf): NaN, said once
        for b0 in range(0, len(scores), block):
            m_new = max(m, scores[b0:b0 + block].max())
            ref = reference(m_new)
            ell = np.exp(m - ref) * ell + np.exp(scores[b0:b0 + block] - ref).sum()
            m = m_new
    return m, ell


literal, guarded = (lambda m_new: m_new), (lambda m_new: 0.0 if m_new == -np.inf else m_new)
first_masked = np.concatenate([np.full(3, -np.inf), s[3:]])        # the first block: three masked keys
all_masked = np.full(6, -np.inf)
print(f"{'row':>28} {'as written: (m, l)':>22} {'with m_ref: (m, l)':>24}")
for name, row in (("first block masked", first_masked), ("every key masked", all_masked)):
    (m_a, l_a), (m_b, l_b) = online(row, 3, literal), online(row, 3, guarded)
    print(f"{name:>28} {f'({m_a:.3f}, {l_a:.3f})':>22} {f'({m_b:.3f}, {l_b:.3f})':>24}")
nan_as_written = np.isnan(online(first_masked, 3, literal)[1])
guarded_err = abs(np.log(online(first_masked, 3, guarded)[1]) + online(first_masked, 3, guarded)[0]
                  - np.log(np.exp(s[3:]).sum()))
row_mask = np.ones((1, 4, 5), dtype=bool)
row_mask[0, 2] = False                                              # query 2 may see no key
o_m, c_m = flash_attention_forward(*(rng.standard_normal((1, n, 3)) for n in (4, 5, 5)), row_mask, 2, 2)
print(f"the layer, query 2 of 4 seeing no key: output row {o_m[0, 2]}, lse {c_m.lse[0, 2]}; "
      f"the other rows' lse {np.array2string(c_m.lse[0, [0, 1, 3]], precision=3)}")

# %% [markdown]
# `flash_attention_forward(q, k, v, mask, q_tile, k_tile, causal)` in `attn.layers` takes the
# paper's attention's arguments and returns its output to round-off. Here it is against
# `attention_forward` in float64, on a padded batch and with the look-ahead mask, with tile sizes
# that divide the length and tile sizes that do not:

# %%
Bsz, H, T, Dh = 2, 2, 23, 8
q, k, v = (rng.standard_normal((Bsz, H, T, Dh)) for _ in range(3))
pad = np.arange(T)[None, :] < np.array([T, T - 7])[:, None]          # the second sentence: 7 padded keys
pad = pad[:, None, None, :]                                          # (B, 1, 1, T)
look_ahead = np.tril(np.ones((T, T), dtype=bool))
print(f"{'q_tile':>6} {'k_tile':>6} {'mask':>20} {'largest |flash - paper|':>24}")
forward_err = 0.0
for q_tile, k_tile in ((1, 1), (4, 4), (5, 7), (8, 3), (T, T)):
    for name, mask, causal in (("padding", pad, False), ("padding + causal", pad, True)):
        want = attention_forward(q, k, v, pad & look_ahead if causal else pad)[0]
        got = flash_attention_forward(q, k, v, mask, q_tile, k_tile, causal)[0]
        forward_err = max(forward_err, np.abs(got - want).max())
        print(f"{q_tile:>6} {k_tile:>6} {name:>20} {np.abs(got - want).max():>24.1e}")

# %% [markdown]
# ## 3. The backward from D
#
# Write $S = QK^\top / \sqrt{d_k}$ for the scaled scores, $P = \mathrm{softmax}(S)$ for the weights
# and $O = PV$. Throughout this lesson $dS$ is the gradient of the loss with respect to the
# *scaled* scores $S$. Lesson 8's backward is
#
# $$dV = P^\top dO, \qquad dP = dO\, V^\top, \qquad dS_{ij} = P_{ij}\Big(dP_{ij} - \sum_k P_{ik}\, dP_{ik}\Big). \tag{27.4}$$
#
# The tiled forward kept neither $P$ nor $S$. Two facts bring them back a tile at a time.
# First, equation 27.3 gives every weight from its own score and its row's log-sum-exp:
# $P_{ij} = e^{S_{ij} - \mathrm{lse}_i}$, so a tile of $P$ is one product $Q_i K_j^\top$ away.
# Second, the sum in equation 27.4 runs over the whole row, which no tile sees, but it is a
# number that does not need $P$ at all:
#
# $$\sum_k P_{ik}\, dP_{ik} = \sum_k P_{ik}\, dO_i \cdot v_k = dO_i \cdot \sum_k P_{ik}\, v_k = dO_i \cdot O_i =: D_i. \tag{27.5}$$
#
# $D = \mathrm{rowsum}(dO \circ O)$ costs one pass over the output. Then, per tile:
# $P = e^{S - \mathrm{lse}}$, $dV_j \mathrel{+}= P^\top dO_i$, $dS = P \circ (dO_i V_j^\top - D_i)$, the
# same $dS$ as equation 27.4's, and since $S = QK^\top / \sqrt{d_k}$,
# $dQ_i \mathrel{+}= dS\, K_j / \sqrt{d_k}$ and $dK_j \mathrel{+}= dS^\top Q_i / \sqrt{d_k}$. (The code's
# `ds` is $dS / \sqrt{d_k}$, the gradient of the unscaled product $Q_i K_j^\top$: it multiplies by
# $1/\sqrt{d_k}$ once per tile instead of twice.) The price is one product more than the paper's
# backward: the scores are computed again.

# %%
out, cache = flash_attention_forward(q, k, v, pad, 5, 7, True)
dout = rng.standard_normal(out.shape)
paper = attention_forward(q, k, v, pad & look_ahead)[1]
w = paper.weights                                                    # the weights the tiles never hold
dP = dout @ v.swapaxes(-1, -2)
D_err = np.abs((w * dP).sum(axis=-1) - (dout * out).sum(axis=-1)).max()
print(f"rowsum(P * dP) from the whole weights against rowsum(dO * O): largest difference {D_err:.1e}")
print(f"the cache holds {cache.out.size + cache.lse.size:,} floats beyond the inputs; the paper's attention "
      f"keeps {w.size:,} weights")

grads_err = max(np.abs(a - b).max() for a, b in zip(flash_attention_backward(dout, cache),
                                                     attention_backward(dout, paper)))
print(f"dq, dk, dv of the tiles against the paper's backward: largest difference {grads_err:.1e}")
small = {n: x[:, :1, :12, :4] for n, x in (("q", q), ("k", k), ("v", v))}   # one head, 12 tokens, 4 features
small_pad = (np.arange(12)[None, :] < np.array([12, 8])[:, None])[:, None, None, :]   # 4 padded keys
flash_errs = check_layer("flash_attention",
                         lambda q, k, v: flash_attention_forward(q, k, v, small_pad, 5, 7, True),
                         flash_attention_backward, small, ("q", "k", "v"))
print("gradient check (float64, central differences, one head of 12 tokens, tiles of 5 and 7):",
      ", ".join(f"d{n} {e:.1e}" for n, e in flash_errs.items()))

# %% [markdown]
# ## 4. The tiles the look-ahead mask hides
#
# With the look-ahead mask, query $i$ sees keys $0, \dots, i$. A key tile whose first key comes
# after the *last* query of a query tile holds nothing that tile may see: its scores are never
# computed, in the forward or the backward. (Comparing with the tile's *first* query instead skips
# keys the later queries see: one of the exercise's broken variants.) The figure draws the tiles of
# a short sequence as the layer walks them: `key_tiles`, the function the forward and the backward
# ask which key tiles a query tile reads, says which are computed; inside a computed tile that
# crosses the diagonal, the scores above it are computed and then masked.

# %%
from attn.layers import key_tiles

T_g, tile_g = 24, 4
grid = np.zeros((T_g, T_g))                            # 0: tile skipped, never computed
for i0 in range(0, T_g, tile_g):
    for j0, j1 in key_tiles(i0, i0 + tile_g, T_g, tile_g, True, 0):
        for i in range(i0, i0 + tile_g):
            grid[i, j0:j1] = np.where(np.arange(j0, j1) <= i, 2, 1)   # 2: seen; 1: computed, then masked
n_grid = (T_g // tile_g) ** 2
skipped_g = flash_attention_forward(np.zeros((T_g, 1)), np.zeros((T_g, 1)), np.zeros((T_g, 1)), None,
                                    tile_g, tile_g, causal=True)[1].skipped
drawn_skipped = int((grid.reshape(T_g // tile_g, tile_g, T_g // tile_g, tile_g) == 0).all(axis=(1, 3)).sum())
print(f"T = {T_g}, tiles of {tile_g}: the forward skipped {skipped_g} of {n_grid} tiles, the figure draws "
      f"{drawn_skipped} skipped")

from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
colours = ["#eeeeee", "#f4a259", "#2a6f97"]
fig, ax = plt.subplots(figsize=(5.2, 5.2), layout="constrained")
ax.imshow(grid, cmap=ListedColormap(colours), vmin=0, vmax=2, interpolation="nearest")
for edge in np.arange(0, T_g + 1, tile_g) - 0.5:
    ax.axhline(edge, color="black", lw=1.2)
    ax.axvline(edge, color="black", lw=1.2)
ax.set_xticks(range(0, T_g, tile_g)); ax.set_yticks(range(0, T_g, tile_g))
ax.set_xlabel("key j"); ax.set_ylabel("query i")
ax.set_title(f"look-ahead mask: {skipped_g} of {n_grid} tiles skipped")
fig.legend(handles=[Patch(color=c, label=n) for c, n in zip(colours, ("tile skipped", "computed, masked",
                                                                       "computed, seen"))],
           loc="outside lower center", ncol=1, frameon=False)
show_figure(fig, "27_causal_tiles.png", alt=f"A {T_g} by {T_g} grid of queries against keys in tiles of "
            f"{tile_g}: the {skipped_g} tiles above the diagonal are skipped, the diagonal tiles are computed "
            f"with their upper part masked, the tiles below are computed whole")

# %% [markdown]
# Counted for longer sequences, almost half the tiles go:

# %%
for T_c, tile in ((64, 16), (1024, 128), (8192, 128)):
    x = np.zeros((T_c, 1))
    n_tiles = (-(-T_c // tile)) ** 2
    skipped = flash_attention_forward(x, x, x, None, tile, tile, causal=True)[1].skipped
    print(f"T = {T_c:>5}, tiles of {tile:>3}: {skipped:>5,} of {n_tiles:>5,} tiles skipped "
          f"({skipped / n_tiles:.1%})")

# %% [markdown]
# ## 5. The cost: memory, measured
#
# NumPy reports every array it allocates to Python's `tracemalloc`, so the peak of the memory
# traced while one forward and one backward run is what the attention itself needed: its
# temporaries, its cache, its output and its gradients (the inputs were made before tracing
# started). One head of 64 features, float32, lengths doubling from 128 (to 8,192 in full mode, a
# quarter of that in quick mode); the tiles are of 128 queries and 128 keys. The last column is one $T \times T$ float32 matrix, computed, for
# scale.

# %%
Dh_m, tile_m = 64, 128
lengths = [128 * 2 ** i for i in range(5 if QUICK else 7)]         # 128 .. 2048 or 8192


def plain(q, k, v, dout):
    out, cache = attention_forward(q, k, v)
    return attention_backward(dout, cache)


def tiled(q, k, v, dout):
    out, cache = flash_attention_forward(q, k, v, None, tile_m, tile_m)
    return flash_attention_backward(dout, cache)


def peak_mib(step, T):
    """The peak of the memory traced while ``step`` runs forward and backward at length T."""
    q, k, v, dout = (rng.standard_normal((T, Dh_m)).astype(np.float32) for _ in range(4))
    tracemalloc.start()
    step(q, k, v, dout)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


memory = {T: (peak_mib(plain, T), peak_mib(tiled, T)) for T in lengths}
print(f"{'T':>6} {'paper (MiB)':>12} {'tiled (MiB)':>12} {'ratio':>7} {'one T x T matrix (MiB)':>23}")
for T_m, (mp, mt) in memory.items():
    print(f"{T_m:>6} {mp:>12.2f} {mt:>12.2f} {mp / mt:>7.1f} {T_m * T_m * 4 / 2**20:>23.2f}")
T_ratio = 4096 if 4096 in memory else lengths[-1]
ratio = memory[T_ratio][0] / memory[T_ratio][1]
print(f"at T = {T_ratio} the tiled attention needs {ratio:.0f} times less memory than the paper's")

# %% [markdown]
# ## 6. Where the time goes
#
# The same operations, timed (the machine that built this page may have been shared: compare the
# rows with each other, not with another machine). The paper's attention runs a few large
# products and writes and reads its large matrices between them; the tiled one runs the same
# products in pieces, one Python step per tile, and its backward computes the scores once more.
# Which of the two weighs more on a CPU with NumPy, the table below says for the machine that
# built this page; small tiles lose, as the rows of a tile of 32 show, because they pay the
# Python step many times. The tiled
# attention's win in time is on a GPU, where memory traffic rather than arithmetic bounds
# attention: the $T \times T$ matrix never goes to the GPU's main memory and back, and each tile
# stays in the fast memory beside the arithmetic units.

# %%
def timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


rows = []
for T_t, tile in [(512, 128)] + ([] if QUICK else [(2048, 128), (4096, 128)]) + [(1024, 32), (1024, 512)]:
    q_t, k_t, v_t, do_t = (rng.standard_normal((T_t, Dh_m)).astype(np.float32) for _ in range(4))
    (_, c_p), f_p = timed(attention_forward, q_t, k_t, v_t)
    _, b_p = timed(attention_backward, do_t, c_p)
    (_, c_t), f_t = timed(flash_attention_forward, q_t, k_t, v_t, None, tile, tile)
    _, b_t = timed(flash_attention_backward, do_t, c_t)
    rows.append((T_t, tile, f_p, b_p, f_t, b_t))
print(f"{'T':>5} {'tile':>5} {'paper fwd s':>12} {'paper bwd s':>12} {'tiled fwd s':>12} {'tiled bwd s':>12}")
for T_t, tile, f_p, b_p, f_t, b_t in rows:
    print(f"{T_t:>5} {tile:>5} {f_p:>12.4f} {b_p:>12.4f} {f_t:>12.4f} {b_t:>12.4f}")
products = {"paper": (2, 4), "tiled": (2, 5)}            # T x T x Dh products in forward, backward
print(f"exp(s) overflows float32 past s = {np.log(np.finfo(np.float32).max):.1f}, "
      f"float64 past s = {np.log(np.finfo(np.float64).max):.1f}")
print("products of T x T x Dh multiply-adds: " + ", ".join(f"{n} {f} forward + {b} backward"
                                                          for n, (f, b) in products.items()))

# %% [markdown]
# The figure draws the measured peaks against the length on logarithmic axes, where a power law
# is a straight line: the paper's attention climbs with the slope of $T^2$, the tiled one with the
# slope of $T$.

# %%
from matplotlib.ticker import NullFormatter

fig, ax = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
ax[0].loglog(lengths, [memory[t][0] for t in lengths], "o-", label="paper's attention")
ax[0].loglog(lengths, [memory[t][1] for t in lengths], "s-", label=f"tiled, tiles of {tile_m}")
ax[0].loglog(lengths, [t * t * 4 / 2**20 for t in lengths], "k:", lw=1, label="one T x T float32 matrix")
ax[0].set_xlabel("length T"); ax[0].set_ylabel("peak memory, MiB (measured)")
ax[0].set_title("forward + backward, one head of 64, float32"); ax[0].legend(fontsize=8)
labels = [f"T={r[0]}\ntile {r[1]}" for r in rows]
xs = np.arange(len(rows))
ax[1].bar(xs - 0.2, [r[2] + r[3] for r in rows], 0.4, label="paper's attention")
ax[1].bar(xs + 0.2, [r[4] + r[5] for r in rows], 0.4, label="tiled")
ax[1].set_xticks(xs, labels, fontsize=8); ax[1].set_yscale("log")
ax[1].set_ylabel("forward + backward, s"); ax[1].set_title("time on this CPU (NumPy)"); ax[1].legend(fontsize=8)
for a in (ax[0].xaxis, ax[0].yaxis, ax[1].yaxis):   # minor labels (3x10^2 beside 4x10^2) crowd a decade
    a.set_minor_formatter(NullFormatter())
ax[0].set_xticks(lengths, [str(t) for t in lengths])
show_figure(fig, "27_flash_memory.png")

# %% [markdown]
# ## Check

# %%
assert online_err < 1e-12 and acc_err < 1e-12, "the online softmax must give the row's log-sum-exp and output"
assert nan_as_written and guarded_err < 1e-12, "equation 27.2 as written gives NaN after a masked block; m_ref not"
assert not o_m[0, 2].any() and c_m.lse[0, 2] == np.inf and np.isfinite(c_m.lse[0, [0, 1, 3]]).all()
assert skipped_g == drawn_skipped, "the figure must skip the tiles the forward skips"
assert forward_err < 1e-12 and grads_err < 1e-12 and D_err < 1e-12
assert max(flash_errs.values()) < 1e-6
assert ratio >= 10, f"at T = {T_ratio} the tiled attention must need ten times less memory, not {ratio:.1f}"
slope = np.polyfit(np.log(lengths[-3:]), np.log([memory[t][0] for t in lengths[-3:]]), 1)[0]
assert slope > 1.8, f"the paper's attention's memory must grow as T^2, slope {slope:.2f}"
print(f"Check passed: the tiled attention equals the paper's to {max(forward_err, grads_err):.1e} in float64, "
      f"gradient check within {max(flash_errs.values()):.1e}, {ratio:.0f} times less memory at T = {T_ratio}")

# %% [markdown]
# ## Questions
#
# 1. Could the online softmax skip the running maximum, summing $e^{s_j}$ directly and dividing at
#    the end?
#
#    <details><summary>Answer</summary>
#
#    In exact arithmetic yes; in floating point no. $e^{s}$ overflows float32 once a score passes
#    the first value printed above, and float64 past the second; subtracting the maximum keeps
#    every exponent at most zero. It is the same reason lesson 4's softmax subtracts the row's
#    maximum, and the rescaling of equation 27.2 is what lets the maximum change as the tiles
#    arrive.
#
#    </details>
#
# 2. The backward recomputes the scores, one product more than the paper's. Why is that still the
#    faster choice on a GPU?
#
#    <details><summary>Answer</summary>
#
#    Storing the weights would write a $T \times T$ matrix to the GPU's main memory in the forward
#    and read it back in the backward. Each of its entries takes part in only $d_k$ multiply-adds,
#    far fewer than a GPU can do in the time it moves those bytes, so moving the matrix costs more
#    than recomputing it from $Q$ and $K$, which are only $T \times d_k$ and are read anyway.
#
#    </details>

# %% [markdown]
# ## Exercise
#
# Write the tiled forward and backward yourself, from the starter's signatures and shapes:
#
# ```
# attn-check lessons/exercises/flash_attention.py
# ```
#
# It is graded on the examples that prove the library's: tile sizes that do not divide the
# lengths, padding, the causal flag, queries that may see no key, and scores large enough to
# overflow without the running maximum. Its invariants are this lesson's: the tiles change
# nothing, `causal=True` is the look-ahead mask given as a mask, and a cache made of tuples,
# lists or dicts holds no array with a number for every query and key. `attn-check --hint 2`
# says where to look, `--hint 3` gives the formula.

# %% [markdown]
# ## 8. On the tensor cores: FlashAttention-2 in bf16
#
# The tiles above are NumPy's. On a GPU, `attn/fast/gpu/kernels/flash_mma.py` runs the same algorithm
# on the tensor cores, which multiply small matrices of 16-bit numbers and add the products in
# float32: bf16 (or fp16) $Q$, $K$, $V$, float32 running maxima, sums and outputs. The unit of
# work is one instruction, `mma.sync.m16n8k16`: a warp of 32 threads multiplies a $16 \times 16$
# block of $Q$ by a $16 \times 8$ block of $K^\top$ into a $16 \times 8$ block of scores. No
# thread holds a whole row. Lane $l$ holds four of the 128 scores, in rows $g = \lfloor l/4 \rfloor$
# and $g + 8$, columns $2t$ and $2t + 1$ with $t = l \bmod 4$; the four lanes of a *quad* share
# a row. So the online softmax of equation 27.2 runs in registers: each lane takes the maximum of
# its own columns, two shuffles between the lanes of the quad give the row's, and $P$ never goes
# through memory. Before $P V$, $P$ is rounded to bf16 (the tensor cores read 16 bits), which is
# the one rounding a float32 tiled attention does not have. A block of four warps owns 64 queries,
# 16 each, and streams the key tiles through shared memory, reading the next one (`cp.async`)
# while the warps multiply the present one. The backward keeps the lesson's split: one block per
# key tile sums dK and dV over every query, and dQ is a pass of its own, so no two blocks ever
# add into the same number.
#
# The operands reach the warp by `ldmatrix`: eight lanes name the addresses of eight rows of 16
# bytes, and the rows come back spread over the lanes as the instruction wants them. Shared
# memory has 32 banks of 4 bytes, and the eight rows are read at once only if they start on
# different banks. A row of $d_k = 64$ bf16 values is 128 bytes, a multiple of the 32 banks'
# width: unpadded, all eight rows start on bank 0, and the read takes eight turns. Padding each
# row by 16 bytes spreads them over eight banks, four apart. The cell prints both, and the figure
# shows them.

# %%
def banks(row_bytes, rows=8):
    """The bank (of 32, 4 bytes each) that each of ``rows`` rows ``row_bytes`` apart starts on."""
    return [(r * row_bytes // 4) % 32 for r in range(rows)]

d_k, PAD = 64, 8                              # bf16 values a row, and the pad (16 bytes)
unpadded, padded = banks(2 * d_k), banks(2 * (d_k + PAD))
print("rows 128 bytes apart start on banks", unpadded)
print("rows 144 bytes apart start on banks", padded)

lane = np.zeros((16, 8), dtype=int)           # which lane of the warp holds each score of a 16 x 8 block
for l in range(32):
    g, t = l // 4, l % 4
    lane[[g, g, g + 8, g + 8], [2 * t, 2 * t + 1, 2 * t, 2 * t + 1]] = l
per_lane = np.bincount(lane.ravel(), minlength=32)

fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.3, 1.3]})
for w in range(4):                            # warp w owns queries 16 w .. 16 w + 15 of the block's tile
    axes[0].axhspan(16 * w, 16 * w + 16, color=plt.cm.Pastel1(w))
    axes[0].text(32, 16 * w + 8, f"warp {w}", ha="center", va="center")
axes[0].set(xlim=(0, 64), ylim=(64, 0), xticks=[0, 64], yticks=[0, 16, 32, 48, 64], title="a block's 64 x 64 scores",
            xlabel="key", ylabel="query")
axes[1].imshow(lane % 4, cmap="tab10", vmin=0, vmax=9, aspect="auto", interpolation="nearest")   # a colour per t = l mod 4: its columns
for r, c in [(0, 0), (0, 1), (8, 0), (8, 1)]:     # lane 0's four scores
    axes[1].text(c, r, "0", ha="center", va="center")
axes[1].set(xticks=[0, 7], yticks=[0, 8, 15], title="an mma block: lane 0's 4 scores", xlabel="key (colour: l mod 4)",
            ylabel="query (rows l/4, l/4 + 8)")
for i, (name, b) in enumerate((("rows 128 B apart", unpadded), ("rows 144 B apart (padded)", padded))):
    axes[2].scatter(b, np.arange(8) + 0.15 * i, s=60, label=name, marker="os"[i])
axes[2].set(xlim=(-1, 32), xticks=[0, 8, 16, 24], yticks=[0, 7], xlabel="bank of the row's first 4 bytes",
            ylabel="row ldmatrix reads", title="where 8 rows start")
axes[2].legend(loc="lower right", fontsize=8)
fig.tight_layout()
show_figure(fig, "27_tensor_core_tile.png",
            alt="Left: a 64 by 64 tile of scores split into four stripes of 16 queries, one per warp. Middle: a 16 by "
                "8 block of scores labelled with the lane that holds each; every lane holds four, in rows g and g + 8. "
                "Right: eight shared-memory rows 128 bytes apart all start on bank 0; 144 bytes apart they start on "
                "banks 0, 4, ..., 28.")

# %% [markdown]
# The kernel cannot run here, but its NumPy twin (`flash_mma_fwd_np`, which the tests hold to the
# kernel's order of operations) can: the tiles of 64, the float32 sums, $P$ rounded to bf16.
# Against the paper's attention in float64 on the same bf16 inputs, the error is what that one
# rounding costs.

# %%
from attn.fast.core import flash, flash_tc
from attn.fast.gpu.kernels.flash_mma import round16
from attn.fast.core.ops import Ops

T_tc = 128
q_tc, k_tc, v_tc = (rng.standard_normal((1, 2, T_tc, d_k)).astype(np.float32) for _ in range(3))
ctx_tc, _ = flash_tc.attend(Ops(np), q_tc, k_tc, v_tc, flash.KeyMask(np.ones((1, T_tc), bool), True, "bf16"),
                            1 / np.sqrt(d_k))
out_tc = ctx_tc.reshape(1, T_tc, 2, d_k).transpose(0, 2, 1, 3)
causal_mask = np.tril(np.ones((T_tc, T_tc), dtype=bool))
ref_tc, _ = attention_forward(*(round16(a, 0).astype(np.float64) for a in (q_tc, k_tc, v_tc)), causal_mask)
tc_err = np.abs(out_tc - ref_tc).max() / np.abs(ref_tc).max()
print(f"the bf16 twin against float64 at T = {T_tc}: largest error {tc_err:.1e} of the largest output "
      f"(bf16 keeps 8 significant bits: {2.0 ** -8:.1e})")

# %% [markdown]
# ## Check: the tensor-core tile

# %%
assert len(set(unpadded)) == 1 and len(set(padded)) == 8, "padding by 16 bytes must spread 8 rows over 8 banks"
assert (per_lane == 4).all(), "each of the 32 lanes holds 4 of the 128 scores of an mma block"
assert 1e-5 < tc_err < 2 ** -7, f"the bf16 twin must be off by about bf16's rounding, not {tc_err:.1e}"
print("Check passed: padded rows start on 8 banks, each lane holds 4 scores, the bf16 twin is within "
      f"{tc_err:.1e} of float64")

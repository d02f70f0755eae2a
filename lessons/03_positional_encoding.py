# %% [markdown]
# # Lesson 3: positional encoding (section 3.5)
#
# Self-attention is a weighted sum over a *set*: shuffle the input tokens and the
# outputs are shuffled the same way, nothing else changes. The model has no idea
# which word came first. Section 3.5 fixes that by *adding* a position-dependent
# vector to every token embedding, at the bottom of the encoder and decoder stacks:
#
# $$PE_{(pos,\,2i)} = \sin\!\left(pos / 10000^{2i/d_{model}}\right), \qquad
#   PE_{(pos,\,2i+1)} = \cos\!\left(pos / 10000^{2i/d_{model}}\right) \tag{§3.5}$$
#
# Read the indices carefully: column `2i` and column `2i+1` share **one** angle,
# $\mathit{pos} / 10000^{2i/d_{\text{model}}}$. The even column is its sine, the odd column its
# cosine. So the table is `d_model/2` (sine, cosine) *pairs*, each pair turning at
# its own frequency $w_i = 1 / 10000^{2i/d_{\text{model}}}$; the wavelengths $2\pi / w_i$
# form a geometric progression from $2\pi$ (i = 0) towards $10000 \cdot 2\pi$.
#
# In this lesson we
#
# 1. rebuild, with `attn.layers.sinusoidal_table`, the 16-position, `d_model = 8`
#    table that slide decks about the paper often print, and say which of their
#    printed numbers are wrong;
# 2. look at the whole table for 64 positions and `d_model = 128`;
# 3. check the paper's reason for choosing sinusoids: "for any fixed offset k,
#    $PE_{pos+k}$ can be represented as a linear function of $PE_{pos}$". We *find*
#    that linear map by least squares and see that it is a rotation that does not
#    depend on `pos`.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn.layers import positional_forward, sinusoidal_table

np.set_printoptions(precision=4, suppress=True, linewidth=130)


def show(title, table, row_labels, col_labels, fmt="{:8.4f}"):
    """Print a labelled table: the reader should be able to find any entry by name."""
    print(f"\n{title}")
    width = max(len(str(r)) for r in row_labels) + 1
    print(" " * width + "".join(f"{c:>9}" for c in col_labels))
    for r, row in zip(row_labels, table):
        print(f"{str(r):<{width}}" + "".join(" " + fmt.format(v) for v in row))


# %% [markdown]
# ## 1. The 16 x 8 table
#
# `sinusoidal_table(max_len, d_model)` computes the table on the host in float64 and
# casts it (float32 by default). We ask for float64 so that we can compare digits.
# The angle table is not something the library returns (nobody needs it but a
# reader), so we compute it here from the formula and check the library's table
# against its sine and cosine.

# %%
L, D = 16, 8
pe = sinusoidal_table(L, D, dtype="float64")                     # (16, 8)
pos = np.arange(L, dtype=np.float64)[:, None]                      # (16, 1)
col = np.arange(D)
two_i = col - col % 2                                              # 0,0,2,2,4,4,6,6: the pair's "2i"
angle = pos / 10000.0 ** (two_i / D)                               # (16, 8): equal in each pair
formula = np.where(col % 2 == 0, np.sin(angle), np.cos(angle))

cols = [f"{j}:{'sin' if j % 2 == 0 else 'cos'}" for j in range(D)]
show("pos / 10000^(2i/d_model): the angle of each column (columns 2i and 2i+1 share it)",
     angle, range(L), [f"col {j}" for j in range(D)], fmt="{:8.3f}")
show("PE = sinusoidal_table(16, 8): even columns sin(angle), odd columns cos(angle)",
     pe, range(L), cols)
print("\nlargest |library - formula| over the table:", np.abs(pe - formula).max())
slow = pe[:, D - 1]                                                # the last pair's cosine, over all 16 positions
print(f"the last pair's cosine (column {D - 1}) over {L} positions runs from {slow.max():.4f} down to {slow.min():.4f}: "
      f"its angle grows by only {angle[1, D - 1]:g} radian per position")

# %% [markdown]
# What to notice:
#
# * Row 0 is `[0, 1, 0, 1, ...]`: every angle is 0, sin 0 = 0, cos 0 = 1.
# * The first pair (columns 0, 1) turns one radian per position: it goes around the
#   circle every $2\pi$ positions. The last pair (columns 6, 7) turns a
#   thousandth of a radian per position: the line printed under the table shows
#   how little its cosine moves over the 16 positions (it barely leaves 1). Fast
#   pairs tell neighbours apart; slow pairs tell far-apart positions apart without
#   wrapping around.
#
# ### Which numbers in a widely copied table are wrong?
#
# A slide deck on the paper that circulates online, and blog posts that copy it, print
# the first six rows of both tables (angles and sin/cos). Below they are typed in
# exactly as printed there. A printed number is *right* if it is the true value
# rounded to the digits shown (so a printed `"0.9996"` for $\cos(0.03) = 0.99955$ is right); it is
# *wrong* if it is off by more than half a unit in its last digit.

# %%
SLIDES_ANGLE = """
0 0.0 0.0 0.0 0.0 0.0 0.0 0.0 0.0
1 1.0 1.0 0.1 0.1 0.01 0.01 0.001 0.001
2 2.0 2.0 0.2 0.2 0.02 0.02 0.002 0.002
3 3.0 3.0 0.3 0.3 0.03 0.03 0.003 0.003
4 4.0 4.0 0.4 0.4 0.04 0.04 0.004 0.004
5 5.0 5.0 0.5 0.5 0.05 0.05 0.005 0.005
"""
SLIDES_PE = """
0 0.0000 1.0000 0.0000 1.0000 0.0000 1.0000 0.0000 1.0000
1 0.8415 0.5403 0.0998 0.9950 0.0100 1.0000 0.0010 1.0000
2 0.9093 -0.4161 0.1987 0.9801 0.0200 0.9998 0.0020 1.0000
3 0.1411 -0.9900 0.2955 0.9553 0.0300 0.9996 0.0030 1.0000
4 -0.756 -0.6536 0.3894 0.9211 0.0400 0.9992 0.0040 1.0000
5 -0.959 0.2837 0.4794 0.8776 0.0500 0.9988 0.0050 1.0000
"""


def parse(text):
    """Rows of 'pos v0 v1 ...' -> {(pos, col): printed string}."""
    out = {}
    for line in text.strip().splitlines():
        p, *vals = line.split()
        for j, s in enumerate(vals):
            out[int(p), j] = s
    return out


def judge(printed, truth):
    """(is_right, half_unit): right if |printed - truth| <= half a unit of the last printed digit."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    half = 0.5 * 10.0 ** -decimals
    return abs(float(printed) - truth) <= half + 1e-12, half


wrong = []
for name, printed, truth in (("angle", SLIDES_ANGLE, angle), ("PE", SLIDES_PE, pe)):
    entries = parse(printed)
    bad = [(p, j, s) for (p, j), s in entries.items() if not judge(s, truth[p, j])[0]]
    print(f"the slides' {name} table: {len(entries)} printed numbers, {len(bad)} wrong")
    for p, j, s in bad:
        print(f"   PE[pos={p}, col={j}] printed {s:>8}, true value {truth[p, j]: .6f} "
              f"(= sin({angle[p, j]:g}); rounded to the digits shown: {truth[p, j]:.3f})")
        wrong.append((name, p, j, s, truth[p, j]))

# %% [markdown]
# The angle table is right: its pairs share one angle, exactly as the formula says
# (a common slip is to use `j / d_model` instead of `2i / d_model` for the odd column
# `j = 2i+1`, which would make each cosine turn slower than its sine; the slides do
# not make it). The sin/cos table is right except one entry:
#
# * **`PE[4, 0]` is printed `"-0.756"`; $\sin(4) = -0.75680$**, so $\sin(4) = -0.7568$ to the
#   four digits the other entries use, or $\sin(4) = -0.757$ to three. The slides cut the number
#   off (truncated) instead of rounding it, and dropped a digit while at it.
# * `PE[5, 0]` printed `"-0.959"` is right to three digits ($\sin(5) = -0.95892$), but it
#   too lost the fourth digit: to four digits, like its neighbours, $\sin(5) = -0.9589$.
# * The slide titles its table $\sin(\mathit{pos}/10000^{2i/d_{\text{model}}})$, but the table holds
#   both: even columns sines, odd columns cosines.
#
# A smaller example worked by hand also circulates in blog posts (`d_model = 4`,
# three words "I love you" with made-up embeddings), and it gets almost every number
# wrong. Here is what it says for position 1, next to the truth.

# %%
pe4 = sinusoidal_table(3, 4, dtype="float64")
blog_terms = ["sin(1) = 0.0001", "cos(1) = 0.0001", "sin(1/100) = 0.9999", "cos(1/10000^(0/4)) = cos(1/1000) = 0.9999"]
true_terms = ["sin(1/10000^(0/4)) = sin(1)", "cos(1/10000^(0/4)) = cos(1)",
              "sin(1/10000^(2/4)) = sin(0.01)", "cos(1/10000^(2/4)) = cos(0.01)"]
print("the blog example's PE(pos=1) with d_model = 4:")
for j in range(4):
    print(f"  col {j}: blog says {blog_terms[j]:<44} truth: {true_terms[j]:<32} = {pe4[1, j]:.4f}")

emb = np.array([[0.5, 0.6, 0.7, 0.8], [0.6, 0.7, 0.8, 0.9], [0.7, 0.8, 0.9, 1.0]])   # "I", "love", "you"
blog_sum = np.array([[0.5, 1.6, 0.7, 0.8], [0.6001, 1.6999, 0.8001, 1.8999], [0.7002, 1.7998, 0.9002, 1.9998]])
added, _ = positional_forward(emb[None], pe4)                     # (1, 3, 4): embedding + PE
show("the blog example's 'embedding + PE'", blog_sum, ["I", "love", "you"], [f"col {j}" for j in range(4)])
show("embedding + PE, computed", added[0], ["I", "love", "you"], [f"col {j}" for j in range(4)])

# %% [markdown]
# The worked example's mistakes, one by one:
#
# * $\sin(1) = 0.8415$ and $\cos(1) = 0.5403$, not `"0.0001"`. The example seems to
#   have taken the angle $1 / 10000^{0/4} = 1$ for something tiny.
# * $\sin(1/100) = 0.0100$, not `"0.9999"` (the sine of a small angle is small; it is
#   the *cosine* that is near 1).
# * Column 3 is the cosine partner of column 2, so it uses the *same* exponent
#   `2i/d_model = 2/4` and the same angle `1/100`: $\cos(0.01) = 0.99995$. The example
#   writes exponent `0/4` and then angle `"1/1000"`, two different wrong numbers.
# * The sums are wrong even where the PE is right: "I" is at position 0, whose PE is
#   `[0, 1, 0, 1]`, so it becomes `(0.5, 0.6 + 1, 0.7, 0.8 + 1)`; the example forgot the
#   last `+1`. For "love" and "you" they added the wrong PE rows.
#
# ## 2. The whole table: 64 positions, d_model = 128

# %%
big = sinusoidal_table(64, 128, dtype="float64")
fig, ax = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1.6, 1]})
im = ax[0].imshow(big, cmap="RdBu", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
ax[0].set_xlabel("dimension (even: sin, odd: cos)"); ax[0].set_ylabel("position")
ax[0].set_title("sinusoidal_table(64, 128)")
fig.colorbar(im, ax=ax[0], fraction=0.04)
sim = big @ big.T                                                  # (64, 64): PE(p) . PE(q)
im = ax[1].imshow(sim, cmap="viridis", interpolation="nearest")
ax[1].set_xlabel("position q"); ax[1].set_ylabel("position p")
ax[1].set_title("PE(p) . PE(q): depends only on p - q")
fig.colorbar(im, ax=ax[1], fraction=0.046)
fig.tight_layout(); show_figure(fig, "03_positional_heatmap.png")

# %% [markdown]
# Left (red is -1, white 0, blue +1): the first few dozen columns, the fast pairs,
# change from one position to the next; moving right the frequencies fall
# geometrically and the columns stop changing within 64 positions. There they
# alternate between a sine stuck near 0 (white) and a cosine stuck near 1 (dark
# blue): those dimensions only start to matter for much longer sequences.
# Right: the dot product of two positions' encodings. Each pair contributes
# $\sin(a)\sin(b) + \cos(a)\cos(b) = \cos(a - b)$, so $PE(p) \cdot PE(q) = \sum_i \cos(w_i (p - q))$:
# every diagonal is constant (a Toeplitz matrix), largest on the main diagonal
# (`d_model/2 = 64`). Attention scores are dot products, so this is the shape of
# "how much does position p look like position q" before any learning.
#
# ## 3. PE(pos + k) is a linear function of PE(pos)
#
# Take one pair with frequency `w`. By the angle-addition formulas
#
# $$\begin{aligned}
# \sin(w(p+k)) &= \sin(wp)\cos(wk) + \cos(wp)\sin(wk)\cr
# \cos(w(p+k)) &= \cos(wp)\cos(wk) - \sin(wp)\sin(wk)
# \end{aligned}
# \quad\Longrightarrow\quad
# [\sin, \cos](p+k) = [\sin, \cos](p)\, M_k,\;\;
# M_k = \begin{pmatrix}\cos wk & -\sin wk\cr \sin wk & \cos wk\end{pmatrix} \tag{3.1}$$
#
# `M_k` is a rotation by `wk`. It depends on the offset `k` and the frequency, **not
# on `p`**: one matrix moves every position `k` steps along. That is what the paper
# means by "linear function", and why a model might "easily learn to attend by
# relative positions": a fixed linear map (which attention's $W^Q$, $W^K$ can be)
# relates a position to its neighbour `k` away.
#
# We do not take the algebra on trust. For each frequency we stack the rows
# `[sin, cos](p)` for *all* positions p, the rows `[sin, cos](p + k)` likewise, and ask
# least squares for the best 2x2 matrix `A` with `X A ~ Y`. If a single `p`-independent
# linear map exists, the residual is rounding noise and `A` is the rotation.

# %%
D_fit = 128
N_pos = 256 if QUICK else 2048
offsets = [1, 5, 17] if QUICK else [1, 2, 5, 17, 50, 100]
table = sinusoidal_table(N_pos + max(offsets), D_fit, dtype="float64")
freqs = 1.0 / 10000.0 ** (np.arange(0, D_fit, 2) / D_fit)          # (64,): w_i

worst_resid, worst_rot = 0.0, 0.0
resid_by_k = {}
for k in offsets:
    res_k = []
    for i, w in enumerate(freqs):
        X = table[:N_pos, 2 * i:2 * i + 2]                         # (N, 2): [sin, cos](p)
        Y = table[k:N_pos + k, 2 * i:2 * i + 2]                    # (N, 2): [sin, cos](p + k)
        A, *_ = np.linalg.lstsq(X, Y, rcond=None)                  # (2, 2)
        rot = np.array([[np.cos(w * k), -np.sin(w * k)], [np.sin(w * k), np.cos(w * k)]])
        res_k.append(np.abs(X @ A - Y).max())
        worst_rot = max(worst_rot, np.abs(A - rot).max())
    resid_by_k[k] = np.array(res_k)
    worst_resid = max(worst_resid, resid_by_k[k].max())
print(f"positions fitted: {N_pos}; offsets k: {offsets}")
print(f"largest residual |X A - Y| over all pairs and offsets: {worst_resid:.2e}")
print(f"largest |A - M_k| (fitted matrix vs rotation by w*k):  {worst_rot:.2e}")

# %% [markdown]
# Here is one fitted matrix, for the fastest pair (`w = 1`) and `k = 5`, next to
# the rotation by 5 radians that the algebra predicts.

# %%
w, k = freqs[0], 5
X, Y = table[:N_pos, 0:2], table[k:N_pos + k, 0:2]
A, *_ = np.linalg.lstsq(X, Y, rcond=None)
print("fitted A (k = 5, w = 1):\n", A)
print("rotation M_5 = [[cos 5, -sin 5], [sin 5, cos 5]]:\n",
      np.array([[np.cos(5.0), -np.sin(5.0)], [np.sin(5.0), np.cos(5.0)]]))

# %% [markdown]
# The same thing for the whole vector: put the 64 rotations on the diagonal of a
# 128 x 128 block-diagonal matrix `M_k`. Then `PE[k:] = PE[:-k] @ M_k` for the whole
# table at once, one matrix for every position.

# %%
def shift_matrix(k, d_model):
    """Block-diagonal (d_model, d_model): pair i rotated by w_i * k (row-vector convention)."""
    M = np.zeros((d_model, d_model))
    for i, w in enumerate(1.0 / 10000.0 ** (np.arange(0, d_model, 2) / d_model)):
        c, s = np.cos(w * k), np.sin(w * k)
        M[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[c, -s], [s, c]]
    return M


block_err = {k: np.abs(table[:N_pos] @ shift_matrix(k, D_fit) - table[k:N_pos + k]).max() for k in offsets}
for k, e in block_err.items():
    print(f"k = {k:>3}: max |PE[p] @ M_k - PE[p+k]| over {N_pos} positions = {e:.2e}")

fig, ax = plt.subplots(figsize=(7, 3.8))
for k in offsets:
    ax.semilogy(np.arange(len(freqs)), np.maximum(resid_by_k[k], 1e-18), ".-", label=f"k = {k}")
ax.axhline(1e-12, color="gray", ls=":", lw=1)
ax.set_xlabel("pair i (frequency w_i = 10000^(-2i/128))")
ax.set_ylabel("max |X A - Y| (least squares)")
ax.set_title(f"one 2x2 map fits PE(p+k) from PE(p) at all {N_pos} positions")
ax.legend(fontsize=8); fig.tight_layout()
show_figure(fig, "03_linear_shift_residual.png")
all_resid = np.concatenate(list(resid_by_k.values()))
print(f"residuals range from {all_resid.min():.1e} to {all_resid.max():.1e}; pair 0 (angle pos / 1, an exact "
      f"integer): at most {max(r[0] for r in resid_by_k.values()):.1e}")

# %% [markdown]
# The residuals (their range is printed above) are float64 rounding, nothing else.
# Even their pattern is explained by rounding. The table is computed from the angle
# $\mathit{pos} / 10000^{2i/d_{\text{model}}}$, which is itself rounded to a relative 1e-16, so its
# sine is off by about `|angle| * 1e-16`: hundreds of times that for the fast pairs whose
# angles reach hundreds of radians, 1e-16 for the slow ones. Pair 0 is the
# exception that proves it: its angle is `pos / 1`, an exact integer. A map that
# depended on `p`, say a table that was not exactly sinusoidal, could not be fit
# by one 2x2 matrix across thousands of positions.
#
# One caution the paper leaves implicit: the map is linear in `PE(pos)` alone. The
# model never sees `PE(pos)` alone; it sees `embedding + PE`, and only learned
# projections can pull the two apart. The sinusoids make relative position *easy
# to express*; they do not guarantee it is used.
#
# ## Check
#
# These fail if `sinusoidal_table` is wrong: wrong exponent (`j/d` instead of `2i/d`),
# swapped sine/cosine, a pair that does not share its angle, a wrong base, or any
# table for which a single position-independent rotation does not move every row
# `k` steps along.

# %%
assert pe.shape == (16, 8) and big.shape == (64, 128)
assert np.abs(pe - formula).max() < 1e-15, "sinusoidal_table does not follow the paper's formula"
assert np.allclose(pe[:, 0::2] ** 2 + pe[:, 1::2] ** 2, 1.0, atol=1e-15), "columns 2i and 2i+1 do not share one angle"
assert np.allclose(pe[1], [np.sin(1), np.cos(1), np.sin(0.1), np.cos(0.1), np.sin(0.01), np.cos(0.01),
                           np.sin(0.001), np.cos(0.001)], atol=1e-15)
assert np.array_equal(sinusoidal_table(16, 8), pe.astype("float32")), "default dtype should be the float32 cast"
# Exactly one printed number in the slides' tables is wrong, the one we named.
assert [(n, p, j) for n, p, j, *_ in wrong] == [("PE", 4, 0)], wrong
assert worst_resid < 1e-11, f"PE(pos+k) is not a linear function of PE(pos): residual {worst_resid:.2e}"
assert worst_rot < 1e-8, f"the fitted map is not the rotation by w*k: {worst_rot:.2e}"
assert max(block_err.values()) < 1e-11
print("Check passed: the table matches the formula; PE(pos+k) = PE(pos) @ M_k with residual "
      f"{worst_resid:.1e}; the one wrong entry in the slides is PE[4, 0] (printed -0.756, true {np.sin(4):.4f}).")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. Which columns of the table share one angle, and what does that make of each
#    pair of columns?
#
#    <details><summary>Answer</summary>
#
#    Columns $2i$ and $2i+1$ share the angle $pos / 10000^{2i/d_{\text{model}}}$: the
#    even column is its sine, the odd its cosine. Each pair of columns is therefore a
#    point on the unit circle turning at its own frequency $w_i$ as $pos$ grows.
#
#    </details>
#
# 2. Why is `PE(pos + k)` a linear function of `PE(pos)`, and why does the matrix
#    not depend on `pos`?
#
#    <details><summary>Answer</summary>
#
#    By the angle-addition formulas (equation 3.1), each pair of $PE(pos + k)$ is the
#    pair of $PE(pos)$ rotated by the angle $w_i k$. The rotation's entries are
#    $\cos w_i k$ and $\sin w_i k$: they depend on the offset $k$ and the frequency,
#    never on $pos$, so one matrix $M_k$ serves every position.
#
#    </details>
#
# 3. What are the fast pairs good for, and what are the slow pairs good for?
#
#    <details><summary>Answer</summary>
#
#    The fast pairs (small $i$, high frequency) change a lot from one position to the
#    next, so they tell neighbours apart, but they wrap around after a few positions. The
#    slow pairs (large $i$) change little between neighbours but keep distinct values
#    over long spans, so they tell far-apart positions and coarse location apart.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write `sinusoidal_table` and the `positional` layer yourself. The starter
# `lessons/exercises/03_positional_encoding.py` has the signatures, and the shapes and
# formulas in its docstrings; its bodies raise `NotImplementedError`. Fill them in, then
# grade your work:
#
#     attn-check lessons/exercises/03_positional_encoding.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

# %% [markdown]
# # Lesson 29: LoRA, a low-rank adapter on a frozen weight
#
# A trained model meets a new domain: other sentences, another style. Fine-tuning every weight
# works, but it trains, stores and ships a whole model per domain. LoRA (Hu et al., 2021) keeps
# every trained weight frozen and learns, beside a chosen linear map, a product of two thin
# matrices:
#
# $$y = xW + \frac{\alpha}{r}\,(xA)\,B, \qquad A \in \mathbb{R}^{d_\text{in} \times r},\;
# B \in \mathbb{R}^{r \times d_\text{out}},\; r \ll d. \tag{29.1}$$
#
# The project writes a linear map as `x @ w` with `w` of shape (d_in, d_out) (lesson 1), so `a`
# and `b` here are the paper's $A$ and $B$ transposed. This lesson derives the adapter's backward,
# checks it in float64, states the invariants a reader would say aloud, and watches adapters of
# several ranks learn a change to a frozen weight.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn.gradcheck import check_layer
from attn.layers import linear_forward, lora_backward, lora_forward, lora_init, lora_merge

np.set_printoptions(precision=4, suppress=True, linewidth=130)
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. What is trained
#
# The adapter has $r\,(d_\text{in} + d_\text{out})$ numbers where the weight has
# $d_\text{in}\,d_\text{out}$. For a square map of the toy translator's width and of the base
# model's, at rank 8:

# %%
for d in (64, 512):
    r = 8
    print(f"d = {d:4d}, r = {r}: the adapter trains {r * 2 * d:6,} numbers, the weight has {d * d:8,}: "
          f"{100 * r * 2 * d / (d * d):.2f}%")

# %% [markdown]
# $B$ starts at zero and $A$ at random (`lora_init`). With $B = 0$ the second term of
# equation 29.1 is exactly zero, not merely small: a new adapter leaves the model as it was, to the last
# bit, and fine-tuning starts from the trained model's loss. $A$ must not start at zero as well:
# then $B$'s first gradient, which is $\frac{\alpha}{r}(xA)^\top \delta$ (below), would be zero
# too, and neither would ever move.
#
# The factor $\alpha / r$ keeps the size of the update from depending on the rank chosen (the
# paper's section 4.1): the sum over $r$ terms in $(xA)B$ grows with $r$, the factor shrinks
# with it, so a learning rate tuned at one rank serves the others.

# %%
d_in, d_out, r, alpha = 6, 5, 2, 4.0
x = rng.standard_normal((3, 4, d_in))
w = rng.standard_normal((d_in, d_out))
a, b = lora_init(d_in, d_out, r, seed=1, dtype="float64")
y, _ = lora_forward(x, w, a, b, alpha)
base, _ = linear_forward(x, w)
init_exact = bool(np.array_equal(y, base))
print("b starts at zero:", not b.any(), "| the adapted output equals x @ w bit for bit:", init_exact)

# %% [markdown]
# ## 2. The backward
#
# Name the narrow path $h = xA$ and the scale $s = \alpha / r$, so that $y = xW + s\,hB$. With
# the upstream gradient $\delta = \partial L / \partial y$, each product is lesson 1's linear
# layer:
#
# $$\frac{\partial L}{\partial B} = s\,h^\top \delta, \qquad
# \frac{\partial L}{\partial h} = s\,\delta B^\top, \qquad
# \frac{\partial L}{\partial A} = x^\top \frac{\partial L}{\partial h}, \qquad
# \frac{\partial L}{\partial x} = \delta W^\top + \frac{\partial L}{\partial h} A^\top. \tag{29.2}$$
#
# Three things to read off it. $W$ gets no gradient: it is frozen, and not computing
# $x^\top\delta$ (a $d_\text{in} \times d_\text{out}$ product per batch) is part of the saving.
# $W$ is frozen, not cut: $x$ still reaches the output through $xW$, so $\partial L / \partial x$
# keeps its term, and the layers below still learn where they are trained. And neither
# $\partial L / \partial A$ nor $\partial L / \partial B$ contains $W$: the adapter sits beside the
# frozen map, not after it. `lora_backward` is equation 29.2; central differences check it in
# float64 on random inputs, with $B$ no longer zero (a trained adapter):

# %%
b_trained = rng.standard_normal((r, d_out))
errs = check_layer("lora", lambda x, a, b: lora_forward(x, w, a, b, alpha), lora_backward,
                   {"x": x, "a": a, "b": b_trained}, ("x", "a", "b"))
print("relative errors:", {k: f"{v:.1e}" for k, v in errs.items()})

# %% [markdown]
# ## 3. Merged, the adapter costs nothing
#
# After training, $xW + s\,(xA)B = x\,(W + s\,AB)$: the adapter folds into one matrix of the
# weight's shape (`lora_merge`), and the adapted model runs exactly as fast as the base.
# The two sides differ only by rounding, since the products are summed in another order:

# %%
y_adapter, _ = lora_forward(x, w, a, b_trained, alpha)
merged = lora_merge(w, a, b_trained, alpha)
merge_err = float(np.abs(x @ merged - y_adapter).max())
print(f"largest difference, adapter against merged weight: {merge_err:.1e}")
w_before = w.copy()
_ = lora_backward(rng.standard_normal(y_adapter.shape), lora_forward(x, w, a, b_trained, alpha)[1])
frozen = bool(np.array_equal(w, w_before))
print("the frozen weight is unchanged by a forward and a backward:", frozen)

# %% [markdown]
# ## 4. What a rank can learn
#
# Let a frozen weight $W$ need a change $\Delta$ for a new task, and train adapters of several
# ranks on it by gradient descent on the squared error. Inputs whose columns are orthonormal
# (scaled) make the loss exactly $\lVert W + sAB - (W + \Delta) \rVert_F^2 / d_\text{out}$, so we
# know what the best rank-$r$ adapter can reach: the Eckart–Young theorem says the closest matrix
# of rank $r$ to $\Delta$ keeps its $r$ largest singular values, and the error left is the sum of
# the squares of the others.

# %%
D, N = (24, 96) if QUICK else (64, 256)
steps = 300 if QUICK else 600
W = rng.standard_normal((D, D)) / np.sqrt(D)
sigmas = np.array([3.0, 2.0, 1.0, 0.5, 0.25])                   # the change needs rank 5
U, _ = np.linalg.qr(rng.standard_normal((D, len(sigmas))))
V, _ = np.linalg.qr(rng.standard_normal((D, len(sigmas))))
delta = (U * sigmas) @ V.T
X = np.linalg.qr(rng.standard_normal((N, D)))[0] * np.sqrt(N)   # X^T X / N = I exactly
target = X @ (W + delta)
W_frozen = W.copy()

ranks, lr, curves, floors = (1, 2, 4, 8), 0.02, {}, {}
for rank in ranks:
    a_r, b_r = lora_init(D, D, rank, seed=rank, dtype="float64")
    s_alpha = 2.0 * rank                                         # alpha = 2r: the scale s = 2 at every rank
    curve = []
    for step in range(steps):
        out, cache = lora_forward(X, W, a_r, b_r, s_alpha)
        err = out - target
        curve.append(float((err ** 2).sum() / (N * D)))
        _, da, db = lora_backward(2 * err / (N * D), cache)
        a_r, b_r = a_r - lr * N * da, b_r - lr * N * db
    curves[rank] = curve
    floors[rank] = float((sigmas[rank:] ** 2).sum() / D)         # Eckart-Young: what rank r cannot reach
    print(f"rank {rank}: final loss {curve[-1]:.5f}, the best a rank-{rank} change can do {floors[rank]:.5f}, "
          f"trained {rank * 2 * D} of {D * D} numbers")
unchanged = bool(np.array_equal(W, W_frozen))

fig, ax = plt.subplots(figsize=(7, 4))
for rank in ranks:
    line, = ax.semilogy(curves[rank], label=f"rank {rank}")
    if floors[rank] > 0:
        ax.axhline(floors[rank], color=line.get_color(), ls=":", lw=1)
ax.set_xlabel("step of gradient descent")
ax.set_ylabel("squared error per output")
ax.set_title("LoRA adapters on a frozen weight; dotted: the best of each rank")
ax.legend()
show_figure(fig, "29_lora_ranks.png")

# %% [markdown]
# Each adapter falls to its rank's floor and stays there: rank 1 keeps the largest direction of
# the change, rank 2 the two largest, and the change itself has rank 5, so the adapter of rank 8
# learns it all. A real fine-tuning's change is not exactly low-rank, but the paper measured that
# the useful part of it is: their adapters of small rank matched full fine-tuning of the largest
# models they tried.
# `attn-train --resume-from CHECKPOINT --lora RANK` trains such adapters on the translator's
# attention (the queries' and values' projections by default), saves the adapter alone, and
# `attn-translate --adapter` and `attn-export --adapter` merge it into the weights.

# %% [markdown]
# ## Check

# %%
assert init_exact, "with b = 0 the adapted map must equal the frozen one to the last bit"
assert max(errs.values()) < 1e-7, f"the backward must agree with central differences: {errs}"
assert merge_err < 1e-12, "the merged weight must give the adapter's output"
assert frozen and unchanged, "the frozen weight must never change"
for rank in ranks:
    assert curves[rank][-1] < floors[rank] * 1.02 + 1e-4, \
        f"rank {rank} must reach the Eckart-Young floor {floors[rank]:.5f}, got {curves[rank][-1]:.5f}"
    assert curves[rank][-1] >= floors[rank] * (1 - 1e-9), "no rank-r change can beat the Eckart-Young floor"
print(f"Check passed: the backward within {max(errs.values()):.1e} of central differences, the merge within "
      f"{merge_err:.1e}, and each rank at its floor (rank {ranks[-1]} at {curves[ranks[-1]][-1]:.1e})")

# %% [markdown]
# ## Questions
#
# 1. Why does LoRA start $B$ at zero and $A$ at random, and not the other way round?
#
#    <details><summary>Answer</summary>
#
#    Either way the product $AB$ is zero, so the model starts unchanged. But the gradients differ.
#    With $B = 0$ and $A$ random, $B$'s gradient $s\,(xA)^\top\delta$ is not zero, so $B$ moves
#    at the first step, and $A$ follows once $B$ is no longer zero. With $A = 0$ and $B$ random, it
#    is $A$'s gradient $x^\top (s\,\delta B^\top)$ that is not zero: that works too. Only both at
#    zero fails: each gradient then contains the other matrix, and both stay zero for ever.
#
#    </details>
#
# 2. A learner's backward computes $\partial L / \partial A$ as $s\,x^\top ((\delta W^\top) A)$.
#    What is wrong, and which invariant of the exercise catches it?
#
#    <details><summary>Answer</summary>
#
#    It sends $A$'s gradient through the frozen weight, as if $A$ came after $W$. In equation 29.1
#    $A$ sits beside $W$: $x$ reaches $A$ directly, and the gradient reaching $h = xA$ comes back
#    through $B$ only. The invariant that changes $W$ and requires $\partial L / \partial A$ and
#    $\partial L / \partial B$ to stay the same catches it.
#
#    </details>

# %% [markdown]
# ## Exercise
#
# Write the adapter's forward, its backward (equation 29.2) and the merge yourself:
#
# ```
# attn-check lessons/exercises/lora.py
# ```
#
# It is graded on this lesson's invariants: with $B = 0$ the output does not change to the last
# bit whatever $A$ and $\alpha$ are, the merged weight maps $x$ as the adapter does, and the
# frozen weight steers neither gradient. `attn-check --hint 2` says where to look, `--hint 3`
# gives the formula; the typical mistakes it names include $B$'s gradient without $\alpha / r$
# and $A$'s gradient taken through the frozen weight.

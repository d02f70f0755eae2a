# %% [markdown]
# # Lesson 8: backpropagation by hand, and how to know it is right
#
# Every layer in `attn.layers` is a pair: `forward(inputs) -> (out, cache)` and
# `backward(dout, cache) -> gradients`. There is no autograd; each backward was
# derived on paper and typed in. A typo there does not crash anything. The model
# still trains, a little worse, and nobody notices. So every backward is checked
# against the one thing that cannot be wrong in the same way: the definition of
# a derivative.
#
# This lesson derives three backward passes (softmax, layer norm, scaled
# dot-product attention), checks them with `attn.gradcheck`, and then breaks each
# one the way people actually break them, to see the check catch it.
#
# ## The check
#
# A layer's output is a tensor, not a number, so we reduce it against a *random*
# upstream gradient `dout`: `L = sum(forward(x) * dout)`. Then by the chain rule
# `dL/dx` is exactly what `backward(dout, cache)` must return. The numerical
# estimate perturbs one input at a time:
#
# $$\frac{\partial L}{\partial x_i} \approx \frac{L(x + h e_i) - L(x - h e_i)}{2h} \tag{8.1}$$
#
# and `rel_error(a, b) = |a - b| / (|a| + |b|)` (Euclidean norms over all entries)
# compares the two. Why a *random* `dout`? With `dout = 1` the softmax's loss is
# $\sum_i \mathrm{softmax}(x)_i = 1$, a constant, whose gradient is zero: a backward that
# returned zeros would pass.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn.gradcheck import check_layer, numerical_gradient, numerical_gradient_of, rel_error
from attn.layers import (attention_backward, attention_forward, layer_norm_backward, layer_norm_forward,
                         multi_head_attention_backward, multi_head_attention_forward, softmax_backward,
                         softmax_forward)
from attn.masks import padding_mask

np.set_printoptions(precision=4, suppress=True, linewidth=130)
rng = np.random.default_rng(0)
results = {}                                  # (layer, argument, "correct"/"broken") -> relative error


def check_and_report(name, fwd, bwd, args, wrt, broken=False):
    """Run check_layer, print the errors, record them in ``results``. For a broken backward,
    show the AssertionError that check_layer raises, then rerun with tol=inf to get the numbers."""
    tag = "broken" if broken else "correct"
    try:
        errs = check_layer(name, fwd, bwd, args, wrt)
        print(f"{name:<34} passed: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    except AssertionError as e:
        print(f"{name:<34} FAILED, as it should:\n    AssertionError: {e}")
        errs = check_layer(name, fwd, bwd, args, wrt, tol=float("inf"))
    for k, v in errs.items():
        results[name.replace(" (broken backward)", ""), k, tag] = v


# %% [markdown]
# ## 1. Softmax
#
# Forward, along the last axis: $y_i = \exp(x_i) / \sum_j \exp(x_j)$.
#
# Differentiate the quotient: $\partial y_i / \partial x_j = y_i (\delta_{ij} - y_j)$; as a matrix, the
# Jacobian $\mathrm{diag}(y) - y y^\top$. Backward multiplies the upstream gradient by its
# transpose (it is symmetric):
#
# $$\frac{\partial L}{\partial x_j} = \sum_i \frac{\partial L}{\partial y_i}\, y_i(\delta_{ij} - y_j)
#   = y_j\Big(dy_j - \sum_i dy_i\, y_i\Big) \tag{8.2}$$
#
# so `dx = y * (dy - sum(dy * y))`: no `K x K` Jacobian is ever built. The
# subtracted term is there because every output shares one denominator: pushing
# up one logit pulls every other probability down. Masked positions have `y = 0`,
# so their gradient is 0 automatically.
#
# The classic mistake: treat softmax like an element-wise function and keep only
# the diagonal, `dx = y * dy`, dropping `- sum(dy * y)`.

# %%
n_rows = 4 if QUICK else 8
x = rng.standard_normal((n_rows, 7))
mask = np.ones((n_rows, 7), dtype=bool); mask[:, 5:] = False; mask[0, 3:] = False   # some masked logits


def softmax_backward_broken(dy, cache):
    return cache.y * dy                                          # forgot "- sum(dy * y)"


check_and_report("softmax", softmax_forward, softmax_backward, {"x": x}, ["x"])
check_and_report("softmax (masked)", softmax_forward, softmax_backward, {"x": x, "mask": mask}, ["x"])
check_and_report("softmax (broken backward)", softmax_forward, softmax_backward_broken, {"x": x}, ["x"],
                 broken=True)

# %% [markdown]
# ## 2. Layer norm
#
# Forward over the last axis (`D` features): $\mu = \mathrm{mean}(x)$, $\mathrm{var} = \mathrm{mean}((x - \mu)^2)$,
# $r = (\mathrm{var} + \epsilon)^{-1/2}$, $\hat x = (x - \mu) r$, $\mathit{out} = \gamma \cdot \hat x + \beta$.
#
# $\gamma$ and $\beta$ are easy: `dbeta = sum(dout)`, `dgamma = sum(dout * xhat)`,
# summed over every row (they are shared by all tokens). For `x`, write
# $g = \mathit{dout} \cdot \gamma = \partial L/\partial \hat x$. Each `x_k` reaches `xhat_i` three ways: directly
# (through $x_i - \mu$ when `i = k`), through the mean, and through the variance:
#
# $$\frac{\partial \mu}{\partial x_k} = \frac1D,\qquad
#   \frac{\partial\, var}{\partial x_k} = \frac{2(x_k-\mu)}{D},\qquad
#   \frac{\partial r}{\partial\, var} = -\tfrac12 r^3 \tag{8.3}$$
#
# $$\frac{\partial L}{\partial x_k} = r g_k - \frac{r}{D}\sum_i g_i
#   - (x_k-\mu)\,\frac{r^3}{D}\sum_i g_i (x_i - \mu)
#   = r\Big(g_k - \overline{g} - \hat x_k\, \overline{g\,\hat x}\Big) \tag{8.4}$$
#
# (bars are means over the row). The last term comes from the variance. Forget it,
# and you have the backward of "subtract the mean, then multiply by a constant",
# a plausible-looking formula that is wrong.

# %%
Dl = 8
args_ln = {"x": rng.standard_normal((3, 4 if QUICK else 6, Dl)) * 2 + 1,
           "gamma": rng.standard_normal(Dl), "beta": rng.standard_normal(Dl)}


def layer_norm_backward_broken(dout, cache):
    xhat, rstd = cache.xhat, cache.rstd
    g = dout * cache.gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True))            # forgot "- xhat * mean(g * xhat)"
    return dx, (dout * xhat).reshape(-1, Dl).sum(0), dout.reshape(-1, Dl).sum(0)


check_and_report("layer_norm", layer_norm_forward, layer_norm_backward, args_ln, ["x", "gamma", "beta"])
check_and_report("layer_norm (broken backward)", layer_norm_forward, layer_norm_backward_broken, args_ln,
                 ["x", "gamma", "beta"], broken=True)

# %% [markdown]
# Notice which arguments fail: only `x`. The broken version still computes `dgamma`
# and `dbeta` correctly; the check names the argument, which points straight at the
# line to fix.
#
# ## 3. Scaled dot-product attention
#
# Forward: $s = q k^\top \cdot c$ with $c = 1/\sqrt{d_k}$, $w = \mathrm{softmax}(s, \mathit{mask})$, `out = w v`.
# Backward, one line per forward line, in reverse:
#
# * `out = w v`: a matrix product, so $dv = w^\top \mathit{dout}$ and $dw = \mathit{dout} v^\top$;
# * $w = \mathrm{softmax}(s)$: `ds = w * (dw - sum(dw * w))` (section 1);
# * $s = q k^\top c$: $dq = c\, ds\, k$ and $dk = c\, ds^\top q$.
#
# That is `attention_backward`. The mistake here: dropping the scale `c` in the last
# step (it "is just a constant"). The gradients point the right way and are
# $\sqrt{d_k}$ times too big, which a learning rate might hide for a while.

# %%
Bq, Hq, Tq, Tk, dk, dv = 2, 2, 5, 6, 4, 3
ids = np.array([[3, 1, 4, 1, 5, 0], [9, 2, 6, 5, 0, 0]])       # keys with padding
args_att = {"q": rng.standard_normal((Bq, Hq, Tq, dk)), "k": rng.standard_normal((Bq, Hq, Tk, dk)),
            "v": rng.standard_normal((Bq, Hq, Tk, dv)), "mask": padding_mask(ids)}


def attention_backward_broken(dout, cache):
    q, k, v, w = cache.q, cache.k, cache.v, cache.weights                # AttentionCache's documented fields
    dvv = w.swapaxes(-1, -2) @ dout
    dw = dout @ v.swapaxes(-1, -2)
    ds = w * (dw - (dw * w).sum(-1, keepdims=True))                      # section 1's softmax backward; forgot "* scale"
    return ds @ k, ds.swapaxes(-1, -2) @ q, dvv


check_and_report("attention", attention_forward, attention_backward, args_att, ["q", "k", "v"])
check_and_report("attention (broken backward)", attention_forward, attention_backward_broken, args_att,
                 ["q", "k", "v"], broken=True)

# %% [markdown]
# Again the message names the culprits: `q` and `k` fail, `v` passes (its path
# does not go through the scale). And the number itself is a clue: it is
# `(2 - 1)/(2 + 1) = 0.333`, the relative error of a gradient exactly twice too large, and
# $\sqrt{d_k} = \sqrt{4} = 2$. A relative error of exactly 1/3 means "off by a factor
# of 2"; of 1, "one side is zero or the sign is flipped".
#
# ## 4. The key bias: a gradient that is exactly zero
#
# In multi-head attention the keys are $k = x W^K + b^K$. The score of query `q`
# against key `j` is then $q \cdot (x_j W^K) + q \cdot b^K$: the bias adds **the same
# number** $q \cdot b^K$ to every score in the row, and softmax ignores a constant shift
# of its row. So the output does not depend on $b^K$ at all and its true gradient
# is exactly 0. The analytic backward returns rounding noise around 0 (1e-16);
# the numerical one returns finite-difference noise (about `1e-16 / h`, with
# `h = 1e-6`). The ratio of two noises is meaningless, about 1, and would fail any
# tolerance. `rel_error`
# therefore falls back to the absolute difference when both norms are below
# `zero = 1e-6` (see its docstring).

# %%
Dm, Hm = 8, 2
xq, xkv = rng.standard_normal((2, 4, Dm)), rng.standard_normal((2, 5, Dm))
mha_args = {"x_q": xq, "x_kv": xkv, "n_heads": Hm, "mask": padding_mask(np.array([[1, 2, 3, 4, 0], [1, 2, 3, 4, 5]]))}
for n in "qkvo":
    mha_args["w_" + n] = rng.standard_normal((Dm, Dm)) / np.sqrt(Dm)
    mha_args["b_" + n] = rng.standard_normal(Dm)
out, cache = multi_head_attention_forward(**mha_args)
dout = rng.standard_normal(out.shape)
(dx_q, dx_kv, dw_q, db_q, dw_k, db_k,
 dw_v, db_v, dw_o, db_o) = multi_head_attention_backward(dout, cache)    # in the order of the forward's inputs
num_db_k = numerical_gradient_of(multi_head_attention_forward, mha_args, "b_k", dout)
naive = np.linalg.norm(db_k - num_db_k) / (np.linalg.norm(db_k) + np.linalg.norm(num_db_k))
fmt = {"float_kind": lambda v: f"{v: .1e}"}
print("analytic db_k: ", np.array2string(db_k, formatter=fmt))
print("numerical db_k:", np.array2string(num_db_k, formatter=fmt))
print(f"naive ratio |a-b|/(|a|+|b|) = {naive:.2f}   rel_error (falls back to |a-b|) = {rel_error(db_k, num_db_k):.1e}")
mha_wrt = ["x_q", "x_kv", "w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o"]
check_and_report("multi_head_attention", multi_head_attention_forward, multi_head_attention_backward,
                 mha_args, mha_wrt)

# %% [markdown]
# (The paper's reference code, tensor2tensor, gives its attention projections no
# bias at all. The library keeps one on every projection, as PyTorch's
# `nn.MultiheadAttention` does by default: it is harmless, the query, value and
# output biases do learn, and the key bias's gradient being zero is a fact about
# softmax, not a bug in backward.)
#
# ## 5. Why float64, and why central differences
#
# Taylor-expand around `x`: $f(x + h) = f + h f' + h^2/2 f'' + h^3/6 f''' + \dots$
#
# * forward difference `(f(x+h) - f(x))/h = f' + h/2 f'' + ...`: error `O(h)`;
# * central difference $(f(x+h) - f(x-h))/2h = f' + h^2/6 f''' + \dots$: the even
#   terms cancel, error $O(h^2)$.
#
# That is the *truncation* error, falling as `h` shrinks. The *rounding* error rises:
# `f` is only known to about $\epsilon \cdot |f|$ (machine epsilon: 1e-16 in float64, 1e-7 in
# float32), and dividing by `h` magnifies it to $\epsilon /h$. The best `h` balances the
# two: for central differences $h \sim \epsilon^{1/3}$, with errors near $\epsilon^{2/3}$: in
# float64 far below what a real bug produces. We measure it on
# the softmax, in both precisions.

# %%
def forward_difference(f, x, h):
    """One-sided (f(x + h e_i) - f(x)) / h, for comparison with the central difference."""
    grad = np.zeros_like(x); flat, gflat = x.reshape(-1), grad.reshape(-1)
    f0 = float(f())
    for i in range(flat.size):
        old = flat[i].item(); flat[i] = old + h
        gflat[i] = (float(f()) - f0) / h
        flat[i] = old
    return grad


hs = np.logspace(-12, -1, 12 if QUICK else 23)
sweep = {}
x64 = rng.standard_normal((3, 7))
dy64 = rng.standard_normal((3, 7))
for dt in ("float64", "float32"):
    xd, dyd = x64.astype(dt), dy64.astype(dt)
    y, c = softmax_forward(xd)
    analytic = softmax_backward(dyd, c).astype(np.float64)

    def f():
        return (softmax_forward(xd)[0] * dyd).sum()
    sweep[dt, "central"] = [rel_error(analytic, numerical_gradient(f, xd, h)) for h in hs]
    sweep[dt, "forward"] = [rel_error(analytic, forward_difference(f, xd, h)) for h in hs]
for key, errs in sweep.items():
    i = int(np.argmin(errs))
    print(f"{key[0]} {key[1]:<8} differences: best rel error {errs[i]:.1e} at h = {hs[i]:.0e}")

# slope of log(error) vs log(h) where truncation dominates (large h), float64
big = hs >= 1e-3
slope = {m: np.polyfit(np.log10(hs[big]), np.log10(np.array(sweep["float64", m])[big]), 1)[0]
         for m in ("central", "forward")}
print(f"float64, h >= 1e-3: error ~ h^{slope['central']:.2f} (central), h^{slope['forward']:.2f} (forward)")

# %%
fig, ax = plt.subplots(2, 1, figsize=(8, 13), height_ratios=[3, 2])   # one above the other: each readable on a phone
short = {"multi_head_attention": "mha", "softmax (masked)": "softmax+mask"}
order = sorted(results, key=lambda k: k[2] == "broken")          # correct ones first, then the broken
vals = [max(results[k], 1e-18) for k in order]                   # floor: an exact 0 still shows on a log axis
colors = ["tab:green" if t == "correct" else ("tab:red" if v > 1e-3 else "lightgray") for (_, _, t), v in
          zip(order, vals)]
ax[0].barh(range(len(order)), vals, color=colors)                # names across: they read on a phone too
ax[0].set_yticks(range(len(order)), [f"{short.get(l, l)}: {a}" for l, a, _ in order], fontsize=8)
ax[0].invert_yaxis()
for c, lab in (("tab:green", "correct backward"), ("tab:red", "broken backward"),
               ("lightgray", "broken backward, argument not affected")):
    ax[0].barh([0], [0], color=c, label=lab)
ax[0].set_xscale("log"); ax[0].axvline(1e-7, color="k", ls=":", lw=1); ax[0].axvline(1e-3, color="k", ls="--", lw=1)
ax[0].set_xlabel("relative error (check_layer)"); ax[0].legend(fontsize=8, loc="lower right")
ax[0].set_title("gradient checks in float64: passes near 1e-10, bugs near 0.1")
for (dt, m), errs in sweep.items():
    ax[1].loglog(hs, errs, "o-" if m == "central" else "s--", ms=3,
                 label=f"{dt}, {m}", color="tab:blue" if dt == "float64" else "tab:orange")
ax[1].axhline(1e-3, color="k", ls="--", lw=1)
ax[1].set_xlabel("step h"); ax[1].set_ylabel("rel_error(analytic, numerical)")
ax[1].set_title("softmax: truncation error (right) vs rounding error (left)"); ax[1].legend(fontsize=8)
fig.tight_layout(); show_figure(fig, "08_gradient_checks.png")
green = [v for (_, _, t), v in zip(order, vals) if t == "correct"]
red = [v for c, v in zip(colors, vals) if c == "tab:red"]
grey = [v for c, v in zip(colors, vals) if c == "lightgray"]
best = {dt: (min(sweep[dt, "central"]), hs[int(np.argmin(sweep[dt, "central"]))]) for dt in ("float64", "float32")}
i6 = int(np.argmin(np.abs(np.log10(hs) + 6)))                   # h = 1e-6, the library's step
margin = {dt: np.log10(min(red) / best[dt][0]) for dt in best}
print(f"correct backwards: rel errors {min(green):.0e} to {max(green):.0e}; the arguments a bug touched: "
      f"{min(red):.2f} to {max(red):.2f}; untouched arguments of broken backwards: up to {max(grey):.0e}.")
print(f"central differences bottom out at {best['float64'][0]:.0e} (h = {best['float64'][1]:.0e}) in float64 and "
      f"{best['float32'][0]:.0e} (h = {best['float32'][1]:.0e}) in float32; at the library's h = {hs[i6]:.0e} float32 "
      f"is off by {sweep['float32', 'central'][i6]:.0%}. Margin between the best estimate and the smallest bug: "
      f"{margin['float64']:.0f} orders of magnitude in float64, {margin['float32']:.0f} in float32.")

# %% [markdown]
# The gradient checks: the green bars (every argument of every correct backward) end many orders
# of magnitude short of the dotted 1e-7 line; the red ones (the arguments a broken
# backward gets wrong) reach far past the dashed 1e-3 line, and the grey ones
# (arguments whose formula the bug did not touch) stay down with the green. The
# first line printed under the figure gives the ranges. A check passes or fails by
# orders of magnitude, not by a hair: there is no need to fiddle with tolerances.
# The key bias sits down with the green too, because `rel_error` switched to the
# absolute difference for it.
#
# The softmax's error against the step `h`: going right to left, the error first falls (truncation, slope 2 for
# central and 1 for forward differences on a log-log plot, as fitted above) and
# then rises again (rounding, slope -1). The second line under the figure says where
# each precision bottoms out; `attn.gradcheck` uses `h = 1e-6`. In float32 the curve
# is shifted up and to the right: its best is far worse, and only at a large,
# hand-tuned `h`. At `h = 1e-6` the float32 estimate is off by a large fraction, so
# a *correct* backward would fail; for even smaller `h`, `x + h` rounds back to `x`
# in float32 and the estimate is exactly 0 (error 1). The margin between right and a
# gross bug shrinks by many orders of magnitude (printed), and a subtle bug (a small
# term missing, an $\epsilon$ in the wrong place) would hide in what is left. That is why
# gradient checks run in float64 while training runs in float32.
#
# ## Check
#
# These fail if any of the library's backward passes for softmax, layer norm,
# attention or multi-head attention is wrong, or if the gradient checker were too
# lax to notice the broken versions.

# %%
corr = {k: v for k, v in results.items() if k[2] == "correct"}
bad = {k: v for k, v in results.items() if k[2] == "broken"}
assert corr and all(v < 1e-7 for v in corr.values()), {k: v for k, v in corr.items() if v >= 1e-7}
assert bad[("softmax", "x", "broken")] > 1e-3
assert bad[("layer_norm", "x", "broken")] > 1e-3
assert bad[("layer_norm", "gamma", "broken")] < 1e-7 and bad[("layer_norm", "beta", "broken")] < 1e-7
assert bad[("attention", "q", "broken")] > 1e-3 and bad[("attention", "k", "broken")] > 1e-3
assert bad[("attention", "v", "broken")] < 1e-7
assert np.abs(db_k).max() < 1e-12 and naive > 1e-3, "the key bias's true gradient is zero"
assert 1.7 < slope["central"] < 2.3 and 0.8 < slope["forward"] < 1.2, slope
assert min(sweep["float64", "central"]) < 1e-9 and min(sweep["float32", "central"]) > 1e-6
assert sweep["float64", "central"][i6] < 1e-8 and sweep["float32", "central"][i6] > 1e-2
print(f"Check passed: {len(corr)} correct gradients, largest rel error {max(corr.values()):.1e}; "
      f"broken backwards caught with errors {', '.join(f'{v:.1e}' for v in bad.values() if v > 1e-3)}.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. Derive softmax's backward, `dx = y * (dy - sum(dy * y))`, without writing the
#    Jacobian.
#
#    <details><summary>Answer</summary>
#
#    With $y_i = e^{x_i}/\sum_k e^{x_k}$, a change of $x_j$ changes every $y_i$ by
#    $\partial y_i/\partial x_j = y_i(\delta_{ij} - y_j)$. Then
#    $\partial L/\partial x_j = \sum_i dy_i\, y_i(\delta_{ij} - y_j) = y_j dy_j - y_j \sum_i dy_i\, y_i$,
#    which is $dx = y \odot (dy - \sum_i dy_i y_i)$ (equation 8.2): one dot product per
#    row, no Jacobian.
#
#    </details>
#
# 2. Why is the true gradient of the key bias $b^K$ exactly zero, and how does
#    `rel_error` keep that from failing the check?
#
#    <details><summary>Answer</summary>
#
#    The bias $b^K$ adds the same number $q \cdot b^K$ to every score of a query's row,
#    and softmax ignores a constant shift of its row, so the output does not depend on
#    $b^K$ and its gradient is exactly zero. The backward returns rounding noise around 0
#    and the central difference finite-difference noise; their ratio is meaningless
#    (about 1), so `rel_error` falls back to the absolute difference when both norms are
#    below its `zero` threshold, and two near-zero gradients agree.
#
#    </details>
#
# 3. Why do gradient checks run in float64? What goes wrong with a central
#    difference in float32 at `h = 1e-6`?
#
#    <details><summary>Answer</summary>
#
#    The central difference has truncation error $O(h^2)$ and rounding error about
#    $\epsilon/h$ (machine epsilon $\epsilon$). In float64 ($\epsilon$ about 1e-16) a
#    step of 1e-6 gives errors far below the check's tolerance. In float32 ($\epsilon$
#    about 1e-7) the rounding term $\epsilon/h$ at $h = 10^{-6}$ is about a tenth: the
#    difference of two nearly equal values loses all its digits, and a correct backward
#    would fail.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write the three backward passes derived above (softmax, layer norm, attention),
# against the library's forwards and caches yourself. The starter
# `lessons/exercises/08_backprop_by_hand.py` has the signatures, and the shapes and
# formulas in its docstrings; its bodies raise `NotImplementedError`. Fill them in, then
# grade your work:
#
#     attn-check lessons/exercises/08_backprop_by_hand.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

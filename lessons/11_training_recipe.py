# %% [markdown]
# # Lesson 11: the training recipe (sections 5.3 and 5.4)
#
# The architecture is half of the paper; the other half is how it is trained. Three
# ingredients, each a few lines in the library, each easy to get subtly wrong:
#
# 1. **The learning-rate schedule** (section 5.3):
#    $\mathit{lrate} = d_{\text{model}}^{-0.5} \cdot \min(\mathit{step}^{-0.5}, \mathit{step} \cdot \mathit{warmup\_steps}^{-1.5})$, with
#    `warmup_steps = 4000`: a linear warm-up, then decay with $1/\sqrt{\mathit{step}}$.
#    (`attn.optim.noam_lr`, `schedule_curve`)
# 2. **Label smoothing** with `eps_ls = 0.1` (section 5.4): "This hurts perplexity,
#    as the model learns to be more unsure, but improves accuracy and BLEU score."
#    (`attn.loss.cross_entropy(..., smoothing=0.1)`)
# 3. **Adam** with $\beta_1 = 0.9, \beta_2 = 0.98, \epsilon = 10^{-9}$ (section 5.3), not the
#    usual $\beta_2 = 0.999, \epsilon = 10^{-8}$ of Adam's own paper (Kingma and Ba, 2015).
#    (`attn.optim.Adam`)
#
# Everything here is small arrays; no Transformer is trained (lesson 20 measures
# label smoothing on the translator itself). Runs in a few seconds.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn.loss import cross_entropy
from attn.optim import Adam, noam_lr, schedule_curve

np.set_printoptions(precision=4, suppress=True, linewidth=130)

# %% [markdown]
# ## 1. Warm-up, then inverse square root
#
# The two branches of the `min` cross where $\mathit{step}^{-0.5} = \mathit{step} \cdot w^{-1.5}$, i.e. at
# `step = w`. So the rate climbs linearly for `w` steps and peaks at exactly
# `step = warmup_steps` with the value
#
# $$\mathit{lrate}_{\max} = d_{\text{model}}^{-0.5} \cdot w^{-0.5} \tag{11.1}$$
#
# (the base model's is the warmup-4000 row below).
#
# A longer warm-up therefore means a *lower* peak, not just a later one: past its
# peak every curve with the same `d_model` joins the one curve
# $d_{\text{model}}^{-0.5} \mathit{step}^{-0.5}$ (the dotted line below), so the warm-up only decides
# where you climb onto it. $d_{\text{model}}^{-0.5}$ scales the whole schedule: a wider model
# takes smaller steps.

# %%
steps = np.arange(1, 40_001)
warmups = [1000, 4000, 8000]
curves = {w: np.array(schedule_curve(steps, 512, w)) for w in warmups}
print(f"{'warmup':>7} {'argmax step':>12} {'peak':>10} {'d^-0.5 w^-0.5':>14} {'lr at 40k':>10}")
for w, c in curves.items():
    print(f"{w:>7} {int(steps[c.argmax()]):>12} {c.max():>10.3e} {512 ** -0.5 * w ** -0.5:>14.3e} {c[-1]:>10.3e}")
toy = np.array(schedule_curve(steps[:4000], 128, 400))
print(f"a toy model (d_model 128, warmup 400): peak {toy.max():.2e} at step {int(steps[toy.argmax()])}")
base_end = curves[4000][100_000 - 1] if len(steps) >= 100_000 else 512 ** -0.5 * 100_000 ** -0.5
print(f"the base model at its last step, 100k: {base_end:.2e}, {base_end / curves[4000].max():.0%} of its peak")

# %% [markdown]
# Why warm up at all? At step 1 Adam's update has size about `lr` for *every*
# parameter, whatever its gradient (section 3 below shows why). With random
# initial weights and freshly initialised moment estimates, full-size steps in
# every direction at once easily knock a post-norm Transformer into a bad region;
# a linear ramp lets Adam's second-moment estimates settle first. (How large a
# rate suits a model depends on its size: lesson 20 trains every variant with the
# paper's factor 1, and says why one shared schedule is part of every comparison
# it makes.) The inverse-square-root decay afterwards is a slow anneal: at step
# 100k (the base model's last) the rate is still a sizeable fraction of the peak,
# $\sqrt{w / \mathit{step}}$ (printed above).
#
# The library's trainer (lesson 14) can multiply the schedule by a constant
# factor, `attn-train --lr-factor`; the shape is the paper's.
#
# **The learning rate is not trained.** It is not a parameter: equation (3) is a fixed
# function of the step number, `d_model` and `warmup_steps`, and no gradient ever
# reaches it. Below, two optimizers fed very different gradients for 50 steps
# both take step 51 at exactly the rate the formula gives.

# %%
opts = [Adam({"w": np.zeros(3)}, d_model=512, warmup_steps=4000) for _ in range(2)]
for t in range(50):
    for o, g in zip(opts, (np.ones(3), np.random.default_rng(t).standard_normal(3) * 100)):
        o.step({"w": g})
lr_after = [o.lr() for o in opts]                             # the rate of the next step, step 51
print(f"rate of step 51 after different gradients: {lr_after[0]:.6e} and {lr_after[1]:.6e}; "
      f"noam_lr(51, 512, 4000) = {noam_lr(51, 512, 4000):.6e}")
assert lr_after[0] == lr_after[1] == noam_lr(51, 512, 4000), "the schedule must depend on the step only"

# %%
fig, ax = plt.subplots(1, 2, figsize=(12, 4))
for w, c in curves.items():
    ax[0].plot(steps, c * 1e3, label=f"warmup {w}")
    ax[0].plot([w], [c.max() * 1e3], "ko", ms=4)
ax[0].plot(steps, 512 ** -0.5 * steps ** -0.5 * 1e3, "k:", lw=1, label="d^-0.5 step^-0.5")
ax[0].set_ylim(0, 1.6); ax[0].set_xlabel("step"); ax[0].set_ylabel("learning rate (x 1e-3)")
ax[0].set_title("section 5.3, d_model = 512 (dots: the peaks, at step = warmup)"); ax[0].legend()
for d in (128, 256, 512, 1024):
    ax[1].plot(steps[:20000], np.array(schedule_curve(steps[:20000], d, 4000)) * 1e3, label=f"d_model {d}")
ax[1].set_xlabel("step"); ax[1].set_ylabel("learning rate (x 1e-3)")
ax[1].set_title("warmup 4000: d_model^-0.5 scales the whole curve"); ax[1].legend()
fig.tight_layout(); show_figure(fig, "11_schedule.png")

# %% [markdown]
# ## 2. Label smoothing
#
# Instead of the one-hot target, the loss uses
#
# $$q = (1 - \epsilon_{ls})\, \mathrm{onehot}(y) + \epsilon_{ls} / V \tag{11.2}$$
#
# (Szegedy et al. 2016; the library follows the convention of PyTorch's
# `cross_entropy(label_smoothing=...)`, where the uniform part also covers the true
# class). The loss is the cross-entropy $-\sum_v q_v \log p_v$, and softmax and loss
# fuse to `dlogits = (p - q) / n_tokens`. We don't take `q` from the formula: we
# read it back out of the library's gradient, `q = p - n * dlogits`.

# %%
V, eps, y = 10, 0.1, 3
rng = np.random.default_rng(0)
logits = rng.standard_normal((1, V))
p = np.exp(logits - logits.max()); p /= p.sum()
for s in (0.0, eps):
    loss, dlogits = cross_entropy(logits, np.array([y]), smoothing=s, pad_id=None)
    q = p - 1 * dlogits                                           # n_tokens = 1
    print(f"eps = {s}: q = {q[0]}   sum {q.sum():.6f}   q[y] = {q[0, y]:.4f}   loss {float(loss):.4f}")
q_smooth = q[0]

# %% [markdown]
# The true class gets $1 - \epsilon_{ls} + \epsilon_{ls}/V$, every other class $\epsilon_{ls}/V$ (the printed
# `q[y]` and `q`).
#
# **What the model is asked to learn.** Cross-entropy against `q` is minimised by
# `p = q` (Gibbs' inequality), so a model trained with smoothing is pulled towards
# being $1 - \epsilon_{ls} + \epsilon_{ls}/V$ sure (just over $1 - \epsilon_{ls}$ for a large vocabulary), never
# fully sure: its logits stay finite. Without smoothing the optimum is `p = onehot`, which needs
# infinite logits, and the loss keeps pushing them up forever. Fit one free row of
# logits with Adam and watch:

# %%
fits = {}
for s in (0.0, eps):
    params = {"z": np.zeros((1, V))}
    opt = Adam(params, d_model=1, lr=0.1)
    for t in range(2000):
        loss, dz = cross_entropy(params["z"], np.array([y]), smoothing=s, pad_id=None)
        opt.step({"z": dz})
    z = params["z"][0]
    pz = np.exp(z - z.max()); pz /= pz.sum()
    fits[s] = (pz, float(loss), z[y] - np.delete(z, y).max())
    print(f"eps = {s}: after 2000 steps p[y] = {pz[y]:.6f}, logit margin {fits[s][2]:7.2f}, loss {float(loss):.4f}")
H_q = -(q_smooth * np.log(q_smooth)).sum()
print(f"the smoothed loss cannot go below the entropy of q: H(q) = {H_q:.4f}")
q_y, q_other = q_smooth[y], np.delete(q_smooth, y)[0]
print(f"p = q would mean p[y] = {q_y:.2f} and a margin log({q_y:.2f}/{q_other:.2f}) = {np.log(q_y / q_other):.2f}: "
      f"the smoothed fit reached p[y] = {fits[eps][0][y]:.4f}, margin {fits[eps][2]:.2f}, loss {fits[eps][1]:.4f}")

# %% [markdown]
# The smoothed fit stops at `p = q`, with the margin $\log(q[y] / q[\mathit{other}])$ and the
# loss `H(q)` (the last two lines above); the unsmoothed one is still climbing.
#
# **"Hurts perplexity, improves accuracy."** Now a classifier trained on data,
# measured on held-out data. The task: 10 classes, 16 features, Gaussian classes that
# overlap, so no model can be right every time. The model is softmax regression,
# `logits = x W + b`, which is exactly the Transformer's last step (the decoder's
# output times the embedding matrix) with fixed features. Two runs, identical except
# for $\epsilon_{ls}$. We measure on a held-out set: perplexity $\exp(\mathrm{mean}(-\log p_y))$ (*without*
# smoothing: the true labels' likelihood, the paper's PPL), accuracy, the average
# confidence `max p`, and the average entropy of `p`.

# %%
K, F, n_train, n_val = 10, 16, 3000 if QUICK else 8000, 4000
DATA_SEEDS = [1, 2, 3] if QUICK else [1, 2, 3, 4, 5]


def smoothing_experiment(data_seed):
    """Train softmax regression with eps = 0 and eps = 0.1 on one draw of the data;
    return {eps: held-out measurements}."""
    data_rng = np.random.default_rng(data_seed)
    means = data_rng.standard_normal((K, F)) * 0.75

    def sample(n):
        labels = data_rng.integers(0, K, n)
        return means[labels] + data_rng.standard_normal((n, F)), labels

    x_tr, y_tr = sample(n_train)
    x_va, y_va = sample(n_val)
    out = {}
    for s in (0.0, eps):
        params = {"w": np.zeros((F, K)), "b": np.zeros(K)}
        opt = Adam(params, d_model=1, lr=0.05)
        for t in range(quick_steps(300) if QUICK else 600):
            loss, dlog = cross_entropy(x_tr @ params["w"] + params["b"], y_tr, smoothing=s, pad_id=None)
            opt.step({"w": x_tr.T @ dlog, "b": dlog.sum(0)})        # forward was logits = x W + b
        lv = x_va @ params["w"] + params["b"]
        nll, _ = cross_entropy(lv, y_va, smoothing=0.0, pad_id=None)
        pv = np.exp(lv - lv.max(1, keepdims=True)); pv /= pv.sum(1, keepdims=True)
        out[s] = dict(ppl=float(np.exp(nll)), acc=float((pv.argmax(1) == y_va).mean()),
                      conf=float(pv.max(1).mean()), entropy=float(-(pv * np.log(pv)).sum(1).mean()),
                      maxp=pv.max(1), correct=pv.argmax(1) == y_va)
    return out


by_seed = {d: smoothing_experiment(d) for d in DATA_SEEDS}
results = by_seed[DATA_SEEDS[0]]                            # the first draw, shown in detail and in the figure
print(f"data seed {DATA_SEEDS[0]}:")
print(f"{'eps':>5} {'val perplexity':>15} {'val accuracy':>13} {'mean max p':>11} {'mean entropy':>13}")
for s, r in results.items():
    print(f"{s:>5} {r['ppl']:>15.4f} {r['acc']:>13.2%} {r['conf']:>11.3f} {r['entropy']:>13.3f}")
conf_wrong = {s: float(r["maxp"][~r["correct"]].mean()) for s, r in results.items()}
print(f"confidence on the examples it gets wrong: eps 0 {conf_wrong[0.0]:.3f}, eps 0.1 {conf_wrong[eps]:.3f}")
d_acc = np.array([100 * (r[eps]["acc"] - r[0.0]["acc"]) for r in by_seed.values()])
d_ppl = np.array([100 * (r[eps]["ppl"] / r[0.0]["ppl"] - 1) for r in by_seed.values()])
d_conf = np.array([r[eps]["conf"] - r[0.0]["conf"] for r in by_seed.values()])
print(f"\nover {len(DATA_SEEDS)} draws of the data (seeds {DATA_SEEDS[0]}-{DATA_SEEDS[-1]}), eps 0.1 against eps 0:")
print(f"  held-out perplexity  {d_ppl.min():+.2f}% to {d_ppl.max():+.2f}%   (worse in {int((d_ppl > 0).sum())} "
      f"of {len(d_ppl)})")
print(f"  held-out accuracy    {d_acc.min():+.2f} to {d_acc.max():+.2f} points   (better in {int((d_acc > 0).sum())}, "
      f"worse in {int((d_acc < 0).sum())})")
print(f"  mean confidence      {d_conf.min():+.3f} to {d_conf.max():+.3f}")

# %% [markdown]
# The smoothed model is less confident (lower `max p`, higher entropy; the
# histogram below). Not every prediction stays under $1 - \epsilon_{ls} + \epsilon_{ls}/V$: one `W` serves all inputs,
# and points far from every class boundary get large margins anyway. Its
# perplexity is worse: it was trained to spread $\epsilon_{ls} = 0.1$ of its mass over the other
# classes, and the held-out labels do not reward that. The accuracy difference is
# small and, over the several draws of the data printed above, its sign is not
# fixed, while the perplexity and confidence differences keep theirs: smoothing
# changes how sure the model is, much less which class it ranks first. That is the
# paper's "hurts perplexity" exactly; the "improves accuracy and BLEU" part needs
# more than this toy: a model big enough to be over-confident, and beam search,
# which lesson 14 uses and lesson 20 measures on the translator, with several seeds.
# Which way perplexity goes depends on whether the unsmoothed model is
# over-confident on held-out data; a well-specified model with enough data, as
# here, is not, so smoothing can only cost likelihood.

# %%
fig, ax = plt.subplots(1, 3, figsize=(15, 4))
ax[0].bar(np.arange(V) - 0.2, np.eye(V)[y], width=0.4, label="one-hot (eps = 0)")
ax[0].bar(np.arange(V) + 0.2, q_smooth, width=0.4, label="q, eps = 0.1 (from dlogits)")
ax[0].set_xticks(range(V)); ax[0].set_xlabel("class (true class y = 3)"); ax[0].set_ylabel("target probability")
ax[0].set_title("the target distribution"); ax[0].legend()
bins = np.linspace(0.1, 1.0, 37)
for s, r in results.items():
    ax[1].hist(r["maxp"], bins=bins, alpha=0.6, label=f"eps = {s}: ppl {r['ppl']:.3f}, acc {r['acc']:.1%}")
ax[1].axvline(1 - eps + eps / K, color="k", ls=":", lw=1)
ax[1].set_xlabel("max p on held-out examples (dotted: 1 - eps + eps/V)"); ax[1].set_ylabel("count")
ax[1].set_title("softmax regression: smoothing lowers confidence"); ax[1].legend(fontsize=8)
for s in (0.0, eps):
    ax[2].bar(np.arange(V) + (-0.2 if s == 0 else 0.2), fits[s][0], width=0.4, label=f"eps = {s}")
ax[2].set_xticks(range(V)); ax[2].set_yscale("log"); ax[2].set_xlabel("class")
ax[2].set_title("one row of free logits after 2000 Adam steps"); ax[2].legend()
fig.tight_layout(); show_figure(fig, "11_label_smoothing.png")

# %% [markdown]
# ## 3. Adam: $\beta_2 = 0.98$, $\epsilon = 10^{-9}$, and bias correction
#
# Adam keeps running means of the gradient and of its square,
#
# $$m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \tag{11.3}$$
#
# and steps by $lr \cdot \hat m_t / (\sqrt{\hat v_t} + \epsilon)$ with the bias-corrected
# $\hat m_t = m_t / (1 - \beta_1^t)$, $\hat v_t = v_t / (1 - \beta_2^t)$. Both averages start
# at zero, so early on they are too small; the corrections undo exactly that. At
# step 1 $\hat m_t = g$ and $\hat v_t = g^2$, so the first update is $lr \cdot g / (|g| + \epsilon)$:
# size `lr` for every parameter, whatever the scale of its gradient (hence the
# warm-up above). The paper's tiny $\epsilon = 10^{-9}$ keeps that true down to gradients
# a few times $\epsilon$; a common $\epsilon = 10^{-6}$ would already halve a gradient-1e-6 step.

# %%
lr = 1e-3
print(f"{'|g|':>8} {'first step / lr (eps 1e-9)':>28} {'(eps 1e-6)':>12}")
first_steps = {}
for scale in (1e3, 1.0, 1e-3, 1e-6):
    ratios = []
    for e in (1e-9, 1e-6):
        prm = {"w": np.zeros(4)}
        g = scale * np.array([1.0, -1.0, 0.5, -2.0])
        Adam(prm, d_model=1, lr=lr, eps=e).step({"w": g})
        ratios.append(np.abs(prm["w"]) / lr)
    first_steps[scale] = (ratios[0], np.abs(g) / (np.abs(g) + 1e-9))
    print(f"{scale:>8.0e} {str(ratios[0].round(4)):>28} {str(ratios[1].round(3)):>12}")

# %% [markdown]
# (The ratios are $|g| / (|g| + \epsilon)$: exactly 1 until the gradient is within a few
# orders of magnitude of $\epsilon$.)
#
# Without bias correction the step would be $(1 - \beta_1^t) / \sqrt{1 - \beta_2^t}$
# times the corrected one for a constant gradient: below 1 at step 1 with the
# paper's $\beta_2 = 0.98$, rising above 1 for some steps and settling at 1 after a
# hundred or so; with the common 0.999 it starts above 1 and climbs to several times
# the asked-for size before slowly coming down. Here are the first steps from the
# library (corrected) and from that formula, and where each uncorrected curve
# peaks:

# %%
prm = {"w": np.zeros(1)}
opt = Adam(prm, d_model=1, lr=lr, betas=(0.9, 0.98))
measured = []
for t in range(1, 301):
    before = prm["w"].copy()
    opt.step({"w": np.array([0.37])})
    measured.append(float(np.abs(prm["w"] - before)[0] / lr))
tt = np.arange(1, 301)
show = [0, 1, 2, 4, 9, 19, 49, 99, 299]
print("step                         ", tt[show])
print("library step / lr             ", np.array(measured)[show].round(4))
print("uncorrected, beta2 0.98       ", ((1 - 0.9 ** tt) / np.sqrt(1 - 0.98 ** tt))[show].round(3))
print("uncorrected, beta2 0.999      ", ((1 - 0.9 ** tt) / np.sqrt(1 - 0.999 ** tt))[show].round(3))
for b2 in (0.98, 0.999):
    tl = np.arange(1, 20_001)
    unc = (1 - 0.9 ** tl) / np.sqrt(1 - b2 ** tl)
    print(f"uncorrected, beta2 {b2}: step 1 at {unc[0]:.2f} x lr, largest {unc.max():.2f} x lr at step "
          f"{int(tl[unc.argmax()])}")

# %% [markdown]
# **Why 0.98 rather than 0.999.** `v` averages over about $1/(1 - \beta_2)$ steps: 50
# with 0.98, 1000 with 0.999. When the scale of the gradient changes (early in
# training it changes all the time, as the loss falls and layers wake up), `v` lags
# behind, and while it lags the steps are too big (scale up) or too small (scale
# down). A simulation: noisy gradients `g = s (0.3 + noise)` on one parameter, whose
# scale `s` jumps from 1 to 10 at step 300 and back to 1 at step 700.

# %%
n_steps = 1000
noise = np.random.default_rng(2).standard_normal(n_steps)
scale_t = np.where((np.arange(n_steps) >= 300) & (np.arange(n_steps) < 700), 10.0, 1.0)
step_sizes = {}
for b2 in (0.98, 0.999):
    prm = {"w": np.zeros(1)}
    opt = Adam(prm, d_model=1, lr=lr, betas=(0.9, b2))
    sizes = []
    for t in range(n_steps):
        before = prm["w"][0]
        opt.step({"w": np.array([scale_t[t] * (0.3 + noise[t])])})
        sizes.append(abs(prm["w"][0] - before) / lr)
    step_sizes[b2] = np.array(sizes)
print("mean |update| / lr over steps:  200-300 (before)  300-400 (after x10)  900-1000 (200 after /10)")
for b2, sz in step_sizes.items():
    print(f"  beta2 {b2:<5}              {sz[200:300].mean():>13.2f} {sz[300:400].mean():>20.2f} "
          f"{sz[900:1000].mean():>23.2f}")

# %%
fig, ax = plt.subplots(1, 2, figsize=(12, 4))
ax[0].plot(tt, measured, "-", lw=2, label="library (bias-corrected)")
ax[0].plot(tt, (1 - 0.9 ** tt) / np.sqrt(1 - 0.98 ** tt), "--", label="uncorrected, beta2 = 0.98")
ax[0].plot(tt, (1 - 0.9 ** tt) / np.sqrt(1 - 0.999 ** tt), "--", label="uncorrected, beta2 = 0.999")
ax[0].set_xscale("log")
ax[0].set_xlabel("step"); ax[0].set_ylabel("|update| / lr  (constant gradient)")
ax[0].set_title("bias correction: every step has size lr"); ax[0].set_ylim(0, 9); ax[0].legend(loc="upper right")
k = 10
for b2, sz in step_sizes.items():
    ax[1].plot(np.convolve(sz, np.ones(k) / k, mode="valid"), label=f"beta2 = {b2}")
ax[1].axvspan(300, 700, color="0.9", label="gradient scale x10")
ax[1].set_xlabel("step"); ax[1].set_ylabel(f"|update| / lr  (mean of {k} steps)")
ax[1].set_title("v averages ~1/(1 - beta2) steps: 50 (0.98) or 1000 (0.999)"); ax[1].legend()
fig.tight_layout(); show_figure(fig, "11_adam.png")

# %% [markdown]
# Left: the library's steps are exactly `lr` from the first one; without the
# correction they would be off by the factors printed above, modestly with
# $\beta_2 = 0.98$ and by several times with 0.999. Right: after the gradient scale
# jumps, the updates with $\beta_2 = 0.999$ overshoot for a long time, and after it
# drops back they stay suppressed for hundreds of steps, while with 0.98 they are
# back near their old size much sooner (the table above). Neither matters much in
# a long, steady run; in the first thousands of steps of a Transformer, when the
# gradient scale changes fast, it does.
#
# ## Check
#
# These fail if the library's schedule, loss or optimizer were wrong: a schedule
# peaking anywhere but at `warmup_steps`, or at the wrong height; a smoothed target
# that does not sum to one or gives the true class the wrong mass; smoothing that
# does not reduce confidence (on the trained classifiers: full mode; quick mode's
# shorter training prints the figures); an Adam without bias correction, or with the
# wrong betas.

# %%
for w, c in curves.items():
    assert int(steps[c.argmax()]) == w, f"the schedule must peak at step == warmup ({w})"
    assert abs(c.max() - 512 ** -0.5 * w ** -0.5) < 1e-15, "peak must be d_model^-0.5 * warmup^-0.5"
    assert np.allclose(c[:w], steps[:w] / w * c.max(), rtol=1e-12), "warm-up must be linear"
    assert np.allclose(c[w:], c.max() * np.sqrt(w / steps[w:]), rtol=1e-12), "decay must be step^-0.5"
opt = Adam({"w": np.zeros(1)}, d_model=512, warmup_steps=4000)
assert [opt.lr(t) for t in (1, 4000, 9000)] == [noam_lr(t, 512, 4000) for t in (1, 4000, 9000)]
assert abs(q_smooth.sum() - 1) < 1e-12, "the smoothed target must sum to 1"
assert abs(q_smooth[y] - (1 - eps + eps / V)) < 1e-12, "true class must get 1 - eps + eps/V"
assert np.allclose(np.delete(q_smooth, y), eps / V, atol=1e-12)
assert abs(fits[eps][0][y] - (1 - eps + eps / V)) < 1e-3 and abs(fits[eps][1] - H_q) < 1e-4
assert fits[0.0][0][y] > 0.999 and fits[0.0][2] > fits[eps][2] + 2, "unsmoothed logits must keep growing"
r0, r1 = results[0.0], results[eps]
if not QUICK:                                         # trained classifiers: full mode's claims
    assert r1["conf"] < r0["conf"] - 0.02 and r1["entropy"] > r0["entropy"], "smoothing must lower confidence"
    assert r1["ppl"] > r0["ppl"], "here smoothing must cost held-out perplexity"
    assert r1["acc"] >= r0["acc"] - 0.01, "smoothing should not cost accuracy here"
for scale, (ratio, expected) in first_steps.items():
    assert np.allclose(ratio, expected, rtol=1e-9), f"Adam's first step must be lr |g|/(|g|+eps) (|g| ~ {scale})"
assert np.allclose(measured, 1.0, rtol=1e-6), "bias-corrected steps must be lr for a constant gradient"
assert step_sizes[0.999][300:400].mean() > 1.5 * step_sizes[0.98][300:400].mean(), "beta2 0.98 must adapt faster"
assert step_sizes[0.98][900:1000].mean() > 2 * step_sizes[0.999][900:1000].mean(), "beta2 0.98 must adapt faster"
assert abs(Adam({"w": np.zeros(1)}, d_model=1).beta2 - 0.98) < 1e-15 and Adam({"w": np.zeros(1)}, d_model=1).eps == 1e-9
print(f"Check passed: schedules peak at step == warmup with d^-0.5 w^-0.5; the smoothed target sums to 1 with "
      f"q[y] = {q_smooth[y]:.2f}; smoothing: confidence {r0['conf']:.3f} -> {r1['conf']:.3f}, "
      f"perplexity {r0['ppl']:.3f} -> {r1['ppl']:.3f}, accuracy {r0['acc']:.1%} -> {r1['acc']:.1%}"
      f"{' (asserted in full mode only)' if QUICK else ''}; "
      f"Adam's steps are lr from step 1.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. At which step does the learning rate of equation (3) peak, and why does a
#    longer warm-up give a *lower* peak?
#
#    <details><summary>Answer</summary>
#
#    At $\mathit{step} = \mathit{warmup\_steps}$, where the two branches of the $\min$ in
#    equation (3) cross. The peak is $d_{\text{model}}^{-0.5} \cdot w^{-0.5}$
#    (equation 11.1): after the peak every schedule joins the same curve
#    $d_{\text{model}}^{-0.5}\mathit{step}^{-0.5}$, which falls with $\mathit{step}$, so
#    the later the warm-up ends the lower the point at which it joins.
#
#    </details>
#
# 2. With label smoothing $\epsilon_{ls}$, what target does the loss use, which probability
#    does it pull `p[y]` towards, and why do the logits stay finite?
#
#    <details><summary>Answer</summary>
#
#    The target is $q = (1 - \epsilon_{ls})\, \mathrm{onehot}(y) + \epsilon_{ls}/V$
#    (equation 11.2). The loss is lowest when $p = q$, so it pulls $p[y]$ towards
#    $1 - \epsilon_{ls} + \epsilon_{ls}/V$, not 1. Reaching probability 1 would need an
#    infinite gap between logits; reaching $q$ needs only the finite gap
#    $\log(q[y]/q[\mathit{other}])$, so the logits stay finite.
#
#    </details>
#
# 3. What does Adam's bias correction do to the first steps, and why does $\beta_2 =
#    0.98$ recover faster than 0.999 when the gradient's scale changes?
#
#    <details><summary>Answer</summary>
#
#    Both running means start at zero; the corrections divide them by $1 - \beta_1^t$ and
#    $1 - \beta_2^t$, so the first steps are full-size (at step 1 the update is
#    $\mathit{lr} \cdot g/(|g| + \epsilon)$) instead of too small or too large. $v_t$
#    averages over about $1/(1 - \beta_2)$ steps: that is 50 steps for $\beta_2 = 0.98$
#    against a thousand for 0.999, so after a change in the gradient's scale the estimate
#    catches up twenty times sooner.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write label-smoothed `cross_entropy` with its gradient, the warm-up schedule of
# equation (3), and an Adam step with bias correction yourself. The starter
# `lessons/exercises/11_training_recipe.py` has the signatures, and the shapes and
# formulas in its docstrings; its bodies raise `NotImplementedError`. Fill them in, then
# grade your work:
#
#     attn-check lessons/exercises/11_training_recipe.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

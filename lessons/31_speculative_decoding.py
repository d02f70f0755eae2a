# %% [markdown]
# # Lesson 31: speculative decoding, a small model drafts and the large one checks
#
# Decoding is sequential: each token needs a pass of the model over everything before it
# (lesson 15), and a large model's pass is slow mostly because it reads all its weights to
# produce one token. Speculative decoding (Leviathan, Kalman and Matias, 2023; Chen et al., 2023
# call it speculative sampling) lets a small *draft* model propose $k$ tokens, one at a time and
# cheaply, and the large *target* model read all $k$ in **one** pass, as training does. A rule
# then keeps a prefix of the proposals and adds one token of the target's own. The rule is
# chosen so that the output is distributed **exactly** as the target's: the draft changes how
# long decoding takes, never what it produces. This lesson derives the rule, checks it by drawing,
# and runs it on the toy translator with `attn.speculative`.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, quick_steps, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import shutil
import time

import numpy as np

from attn import backend as B
from attn import speculative as S
from attn.data import PAD, TOY_DIR, read_parallel, tokenize
from attn.decode import greedy_decode
from attn.evaluate import source_ids
from attn.model import Transformer
from attn.speculative import speculative_accept
from attn.testing.speculative import chi_square_critical
from attn.train import train
from attn.training.config import config_from_argv

B.set_backend("numpy")                                       # lessons run on the CPU
np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## 1. The rule at one position
#
# At some position the target would draw the next token from $p$, the draft from $q$ (both
# over the same vocabulary). The draft has drawn $d \sim q$. The rule:
#
# $$\text{keep } d \text{ with probability } \min\!\left(1, \frac{p(d)}{q(d)}\right);
# \quad\text{otherwise draw from}\quad r(x) = \frac{\max(0,\, p(x) - q(x))}{\sum_y \max(0,\, p(y) - q(y))}.
# \tag{31.1}$$
#
# **Why it is exact.** The token that comes out is $x$ in two ways: the draft proposed $x$ and it
# was kept, or the draft proposed something, it was rejected, and $x$ was drawn from $r$. The
# first has probability $q(x)\min(1, p(x)/q(x)) = \min(q(x), p(x))$. A rejection has probability
# $\beta = 1 - \sum_y \min(p(y), q(y))$, the mass the first way leaves over. Since
# $\min(a, b) + \max(0, a - b) = a$, summing over $y$ gives
# $\sum_y \min(p(y), q(y)) + \sum_y \max(0, p(y) - q(y)) = \sum_y p(y) = 1$, so the
# normaliser of $r$ is exactly $\beta$, and
#
# $$P(x) = \min(q(x), p(x)) + \beta\,\frac{\max(0, p(x) - q(x))}{\beta}
# = \min(p(x), q(x)) + \max(0, p(x) - q(x)) = p(x). \tag{31.2}$$
#
# Whatever the draft, the output is $p$. A good draft ($q$ close to $p$) only makes rejections
# rare: the chance of keeping the proposal is $\sum_x \min(p(x), q(x)) = 1 - \mathrm{TV}(p, q)$,
# one less the total variation distance. Two choices in equation 31.1 matter. A rejected position must not
# draw from $p$: the draft's tokens have already received their share $\min(p, q)$, and drawing
# from $p$ again would give them more. And $r$ must be normalised, or the draw from it is not a
# distribution at all.
#
# Here are $p$ and $q$ on a vocabulary of five tokens, and equation 31.2 computed term by term:

# %%
p = np.array([0.35, 0.25, 0.2, 0.15, 0.05])
q = np.array([0.1, 0.4, 0.1, 0.1, 0.3])
kept_mass = np.minimum(p, q)
beta = 1 - kept_mass.sum()
residual = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()
by_rule = kept_mass + beta * residual
print("p                    ", p)
print("q                    ", q)
print("min(p, q)            ", kept_mass, f"  sum: {kept_mass.sum():.2f} = the acceptance rate")
print("beta * residual      ", beta * residual)
print("what comes out (31.2)", by_rule)
exact_gap = float(np.abs(by_rule - p).max())
print(f"largest difference from p: {exact_gap:.1e}")

# %% [markdown]
# ## 2. Drawn, not derived
#
# `speculative_accept(p, q, drafts, u, v)` is the rule for many independent trials at once:
# trial $i$ keeps `drafts[i]` where $u_i\,q(d) < p(d)$ (so with probability $\min(1, p/q)$),
# and otherwise draws from $r$ by inverse CDF with a second uniform $v_i$. We draw the
# proposals from $q$, apply the rule, and count the tokens. Two wrong rules go through the same
# test: keeping every proposal, and drawing a rejected position from $p$. Pearson's chi-square
# statistic measures the distance of each count from what $p$ predicts; at the level below, a
# right rule exceeds the critical value in one run out of a thousand.

# %%
N = 40_000 if QUICK else 400_000
LEVEL = 0.001
draw = np.random.default_rng(0)
drafts = draw.choice(len(q), size=N, p=q)
u, v = draw.random(N), draw.random(N)
tokens = speculative_accept(p, q, drafts, u, v)
keep = u * q[drafts] < p[drafts]
always = drafts                                                   # every proposal kept
cdf_p = np.cumsum(p)
from_p = np.where(keep, drafts, np.minimum(np.searchsorted(cdf_p, v * cdf_p[-1], side="right"), len(p) - 1))


def chi2(tok):
    counts = np.bincount(tok, minlength=len(p))
    return float(((counts - N * p) ** 2 / (N * p)).sum()), counts / N


critical = chi_square_critical(len(p) - 1, LEVEL)
results = {name: chi2(tok) for name, tok in (("the rule", tokens), ("keep every proposal", always),
                                              ("rejected drawn from p", from_p))}
print(f"{N:,} trials; chi-square critical value at level {LEVEL}, {len(p) - 1} degrees of freedom: {critical:.2f}")
for name, (stat, freq) in results.items():
    print(f"  {name:22s} chi-square {stat:10.1f}  frequencies {freq}  "
          f"{'consistent with p' if stat < critical else 'NOT p'}")
rate = float((tokens == drafts).mean())
print(f"proposals kept: {rate:.4f} of the trials; sum of min(p, q) = {kept_mass.sum():.4f}")

fig, ax = plt.subplots(figsize=(8, 3.8))
x = np.arange(len(p))
width = 0.18
ax.bar(x - 1.5 * width, p, width, label="target p", color="black")
ax.bar(x - 0.5 * width, results["the rule"][1], width, label="speculative output", color="tab:green")
ax.bar(x + 0.5 * width, results["keep every proposal"][1], width, label="wrong: keep every proposal (= q)",
       color="tab:red", alpha=0.6)
ax.bar(x + 1.5 * width, results["rejected drawn from p"][1], width, label="wrong: rejected drawn from p",
       color="tab:orange", alpha=0.8)
ax.set_xticks(x)
ax.set_xlabel("token")
ax.set_ylabel("probability / frequency")
ax.set_title(f"one position, {N:,} trials: the rule's output is p")
ax.legend(fontsize=8)
show_figure(fig, "31_exact.png")

# %% [markdown]
# ## 3. Many positions in one pass
#
# The draft proposes $d_1, \dots, d_k$, each drawn from its own $q_j$ given the ones before.
# The target reads the prefix and all $k$ proposals in one pass (a causal mask lets position $j$
# see only what precedes it, lesson 5) and so has $p_1, \dots, p_{k+1}$ at once. The rule runs
# in order: keep $d_1$ or stop at a draw from $r_1$; if kept, keep $d_2$ or stop at a draw from
# $r_2$; and so on; if all $k$ are kept, $p_{k+1}$ gives one token more. Each kept token is then
# distributed as the target's given everything before it (equation 31.2 at that position, with that
# prefix), so the whole sequence is: the target's sampling, token by token. A pass of the target
# gives at least one token and at most $k + 1$. With the key/value caches of lesson 15, the
# rejected positions are forgotten from both models' caches (`DecodeState.truncate`).
#
# **Greedy decoding** is the same rule with $p$ and $q$ one-hot at their argmax: a proposal is
# kept exactly when it is the target's argmax, and $r$ is one-hot at the target's argmax. The
# output is the target's greedy output token for token, whatever the draft.
#
# If each proposal is kept with the same probability $\alpha$, independently, a pass gives
# $1 + \alpha + \dots + \alpha^k = (1 - \alpha^{k+1}) / (1 - \alpha)$ tokens on average (the
# paper's equation 1). Whether that is faster depends on what a pass of the target costs against
# $k$ steps of the draft: the paper's targets are large enough that reading $k + 1$ positions
# costs about what reading one does.

# %% [markdown]
# ## 4. On the toy translator
#
# We train a target translator and a much smaller draft (one layer each side, half the width)
# on the same short sentences of the toy corpus, briefly, with `attn.train.train` (lesson 14).

# %%
MAX_WORDS = 8
N_TEST = 20 if QUICK else 200
STEPS = quick_steps(150) if QUICK else 1500


def short(split, n):
    return [pr for pr in read_parallel(TOY_DIR, "en", "tk", split) if len(pr[0].split()) <= MAX_WORDS][:n]


data_dir = OUT / "31_data"
splits = {"train": short("train", 1500 if QUICK else 8000), "val": short("val", 40), "test": short("test", 20)}
data_dir.mkdir(parents=True, exist_ok=True)
for split, pairs in splits.items():
    for side, lang in ((0, "en"), (1, "tk")):
        (data_dir / f"{split}.{lang}").write_text("".join(pr[side] + "\n" for pr in pairs), encoding="utf-8")


def train_model(name, d_model, layers, steps):
    run = OUT / f"31_{name}"
    shutil.rmtree(run, ignore_errors=True)
    argv = ["--data", os.path.relpath(data_dir), "--out", os.path.relpath(run), "--backend", "numpy", "--seed", "0",
            "--d-model", str(d_model), "--heads", "4", "--d-ff", str(2 * d_model), "--layers", str(layers),
            "--dropout", "0.0", "--warmup", "150", "--lr-factor", "1", "--steps", str(steps), "--max-tokens", "400",
            "--eval-every", str(steps), "--average", "0", "--minutes", "0", "--bleu-sentences", "0", "--quiet"]
    metrics = train(config_from_argv(argv))
    model = Transformer.load(run / "checkpoint.npz")
    print(f"{name}: {model.config.n_encoder_layers} + {model.config.n_decoder_layers} layers, d_model "
          f"{model.config.d_model}, {model.num_parameters():,} parameters, {metrics['steps']} steps, "
          f"validation loss {metrics['val_loss']:.2f}")
    return model, run


target, target_run = train_model("target", 32 if QUICK else 64, 2, STEPS)
draft, _ = train_model("draft", 16 if QUICK else 32, 1, STEPS)

from attn.translate import load_translator
_, vocab = load_translator(target_run / "checkpoint.npz")
test_pairs = short("test", 400)[20:20 + N_TEST]
sources = [np.array([source_ids(vocab, tokenize(s))]) for s, _ in test_pairs]

# %% [markdown]
# Greedy decoding with and without the draft, one sentence at a time, for each $k$:

# %%
KS = (1, 2, 4, 8) if QUICK else tuple(range(1, 9))
t0 = time.perf_counter()
plain = [greedy_decode(target, src).tokens[0] for src in sources]
plain_seconds = time.perf_counter() - t0
n_tokens = sum(len(t) + 1 for t in plain)                     # EOS included: a pass produced it too
rows, identical = [], True
for k in KS:
    t0 = time.perf_counter()
    outs, stats = [], S.Acceptance()
    for src in sources:
        result, s = S.translate(target, draft, src, k)
        outs.append(result.tokens[0])
        stats.add(s)
    seconds = time.perf_counter() - t0
    identical &= outs == plain
    rows.append((k, stats.rate, stats.tokens / stats.rounds, n_tokens / seconds))
print(f"plain greedy: {n_tokens} tokens of {len(sources)} sentences in {plain_seconds:.2f} s, "
      f"{n_tokens / plain_seconds:.0f} tokens/s, one pass of the target a token")
print(" k  accepted  tokens/pass  predicted  tokens/s")
for k, acc, per_pass, speed in rows:
    predicted = k + 1 if acc == 1 else (1 - acc ** (k + 1)) / (1 - acc)          # 1 + acc + ... + acc^k
    print(f"{k:2d}  {acc:8.3f}  {per_pass:11.2f}  {predicted:9.2f}  {speed:8.0f}")
print("every speculative output equals the target's own greedy output:", identical)

# %%
fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
ks = [r[0] for r in rows]
ax[0].plot(ks, [r[1] for r in rows], "o-")
ax[0].set_ylabel("fraction accepted"); ax[0].set_title("proposals accepted")
ax[1].plot(ks, [r[2] for r in rows], "s--", color="tab:green")
ax[1].set_ylabel("tokens"); ax[1].set_title("tokens per target pass")
ax[2].plot(ks, [r[3] for r in rows], "o-", color="tab:purple", label="speculative")
ax[2].axhline(n_tokens / plain_seconds, color="black", ls=":", label="plain greedy")
ax[2].set_ylabel("tokens per second"); ax[2].set_title("speed (this machine, one thread)")
for panel in ax:
    panel.set_xlabel("k (proposals a round)"); panel.set_xticks(ks)
# the key sits outside the panels, under the last, where a phone's narrow column stacks the
# panels without it landing on a neighbour's title
fig.legend(*ax[2].get_legend_handles_labels(), loc="outside lower right", fontsize=8)
show_figure(fig, "31_speed_vs_k.png")

best = max(rows, key=lambda r: r[3])
ratio = best[3] / (n_tokens / plain_seconds)
print(f"fastest at k = {best[0]}: {best[3]:.0f} tokens/s against plain greedy's {n_tokens / plain_seconds:.0f}, "
      f"{ratio:.2f} times; {best[2]:.2f} tokens a pass of the target")
print("at this size speculative decoding is " + ("faster" if ratio > 1 else "slower") + " than plain greedy")

# %% [markdown]
# What the numbers say. The tokens per pass of the target rise with $k$: the target runs fewer
# passes. The acceptance rate falls: it counts every proposal of a round, those after its first
# rejection too, which the target never got to judge, so the formula of section 3 with this rate
# underestimates the tokens per pass (the column "predicted"). Fewer passes do not make much
# speed at this size, and the run above says whether they make any and at which $k$. The toy
# target is small, so a pass of it costs not much more than a step of the draft, and each round
# pays bookkeeping in Python (the caches rolled back, the proposals checked one by one). The
# paper's gains come from a target whose pass is bound by reading its weights: there $k + 1$
# positions cost about what one does, and a draft far smaller than the target costs little.
# `benchmarks/RESULTS.md` records the measurement on the translator trained on Multi30k and on
# the language model (`attn-translate --draft CHECKPOINT --speculate K`).

# %% [markdown]
# ## Check

# %%
assert exact_gap < 1e-12, "equation 31.2 must give p back"
assert results["the rule"][0] < critical, "the rule's output must pass the chi-square test against p"
assert results["keep every proposal"][0] > critical and results["rejected drawn from p"][0] > critical, \
    "the wrong rules must fail it"
assert abs(rate - kept_mass.sum()) < 5 * np.sqrt(kept_mass.sum() * (1 - kept_mass.sum()) / N), \
    "the acceptance rate must be sum min(p, q)"
assert identical, "greedy speculative decoding must give the target's own greedy output"
assert all(1 <= r[2] <= r[0] + 1 for r in rows), "a pass of the target gives 1 to k + 1 tokens"
print(f"Check passed: the output is p (chi-square {results['the rule'][0]:.1f} < {critical:.1f}), both wrong "
      f"rules fail, and greedy outputs equal the target's for k = {KS[0]} to {KS[-1]}")

# %% [markdown]
# ## Questions
#
# 1. A draft identical to the target: what is the acceptance rate, and how many tokens does a
#    pass of the target give?
#
#    <details><summary>Answer</summary>
#
#    With $q = p$, $\min(1, p(d)/q(d)) = 1$: every proposal is kept, so a pass gives $k + 1$
#    tokens. It is no faster, of course: the draft then costs as much as the target.
#
#    </details>
#
# 2. Why does the test use $u\,q(d) < p(d)$ and a second uniform $v$ for the draw after a
#    rejection, rather than reusing $u$?
#
#    <details><summary>Answer</summary>
#
#    Given that the proposal was rejected, $u$ is no longer uniform on $[0, 1)$: it is at least
#    $p(d)/q(d)$. A draw from $r$ by inverse CDF with that $u$ favours the tokens late in the
#    order, and the output is no longer $p$. A fresh uniform keeps the draw from $r$ exact.
#
#    </details>

# %% [markdown]
# ## Exercise
#
# Write the acceptance rule yourself, for many trials at once:
#
# ```
# attn-check lessons/exercises/speculative.py
# ```
#
# It is graded by what the rule guarantees rather than by the library's draws: exact facts (a
# proposal with $p(d) \ge q(d)$ is always kept; a rejected trial never draws where $p \le q$)
# and three statistical checks over many trials, each of which a right rule fails with
# probability under one in a million (a bound from Bernstein's inequality; the grader's seeds are
# fixed, so a grade is a function of the file). `attn-check --hint 2` says where to look,
# `--hint 3` gives the formula; the typical mistakes it names include keeping every proposal,
# drawing a rejected position from $p$, forgetting to normalise the residual, and reusing $u$.

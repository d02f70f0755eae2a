# %% [markdown]
# # Lesson 21: the cost of training (section 5.2, Table 2)
#
# Table 2 of the paper compares models by BLEU *and* by "training cost (FLOPs)": the
# base Transformer at 3.3·10¹⁸, the big one at 2.3·10¹⁹, against 10¹⁹-10²¹ for the
# recurrent and convolutional models before it. This lesson takes that column apart:
#
# 1. how the paper got its numbers (footnote 5): training time x number of GPUs x
#    the GPU's sustained single-precision rate, and a misprint of the big model's
#    figure that circulates in copies of Table 2;
# 2. the same cost counted from the model's *shapes*: the multiply-adds of one
#    training step, times the steps;
# 3. what a step costs on this machine, for the toy model and for `base`, measured,
#    and what that means for training `base` here.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, named_bars   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import time

import numpy as np

from attn import backend as B
from attn.bench import model_flops
from attn.data import TOY_DIR, Vocab, encode_pairs, make_batches, read_parallel, tokenize
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig, parameter_shapes
from attn.optim import Adam
from attn.train import TrainConfig

B.set_backend("numpy")
T0 = time.time()

# %% [markdown]
# ## 1. The paper's estimate
#
# Footnote 5: "We used values of 2.8, 3.7, 6.0 and 9.5 TFLOPS for K80, K40, M40 and
# P100, respectively." Section 5.2: one machine with 8 NVIDIA P100 GPUs; the base
# model trained for 100 000 steps, 12 hours; the big model for 300 000 steps, 3.5
# days. The estimate is simply time x GPUs x rate.

# %%
P100 = 9.5e12                                       # FLOP/s, the paper's footnote 5
GPUS = 8
paper_runs = {"base": dict(steps=100_000, hours=12.0, table2=3.3e18),
              "big": dict(steps=300_000, hours=3.5 * 24, table2=2.3e19)}
for name, r in paper_runs.items():
    r["flops"] = r["hours"] * 3600 * GPUS * P100
    print(f"{name:>4}: {r['hours']:5.1f} h x {GPUS} GPUs x {P100 / 1e12} TFLOPS = {r['flops']:.2e} FLOPs "
          f"(Table 2: {r['table2']:.1e}); {r['hours'] * 3600 / r['steps']:.2f} s per step")
MISPRINT_BIG = 2.3e18                               # what some copies of Table 2 in blog posts say for the big model
longer = paper_runs["big"]["hours"] / paper_runs["base"]["hours"]
print(f"the misprinted copies give the big model {MISPRINT_BIG:.1e}: {paper_runs['big']['flops'] / MISPRINT_BIG:.0f} times too "
      f"small, and less than the base model's {paper_runs['base']['flops']:.1e}, which trained {longer:.0f} times "
      f"shorter")

# %% [markdown]
# Copies of Table 2 in blog posts sometimes list the big Transformer at 2.3·10¹⁸
# (one power of ten short); the paper's Table 2 says 2.3·10¹⁹, as the arithmetic
# above confirms. A quick sanity check catches it: the
# big model trained several times longer on the same eight GPUs (the ratio is
# printed above), so its cost must be that many times the base model's, not smaller.
#
# Note what this estimate is: time x *peak* capacity. It says how many operations
# the hardware could have done, not how many the model needed. The next section
# counts the second.
#
# ## 2. The cost from the shapes
#
# Almost all the arithmetic of a Transformer is matrix multiplication, and an
# `(m, k) @ (k, n)` product costs `2 m k n` FLOPs (a multiply and an add per term).
# With `N_s = B * S` source and `N_t = B * T` target tokens in a batch:
#
# | where | products | FLOPs |
# |---|---|---|
# | encoder self-attention, per layer | $W^Q, W^K, W^V, W^O$; $Q K^\top$; weights @ `V` | $4 \cdot 2 N_s D^2 + 2 \cdot 2 B S^2 D$ |
# | encoder FFN, per layer | `W_1`, `W_2` | `2 * 2 N_s D F` |
# | decoder self-attention, per layer | as the encoder's, over `T` | $4 \cdot 2 N_t D^2 + 2 \cdot 2 B T^2 D$ |
# | cross-attention, per layer | $W^Q, W^O$ on the target; $W^K, W^V$ on the memory; `T x S` scores | $2 \cdot 2 N_t D^2 + 2 \cdot 2 N_s D^2 + 2 \cdot 2 B T S D$ |
# | decoder FFN, per layer | `W_1`, `W_2` | `2 * 2 N_t D F` |
# | output projection | decoder output @ $E^\top$ | `2 N_t D V` |
#
# (Heads do not change the count: `H` heads of width `D/H` do the work of one of
# width `D`, lesson 6.) A training step is about three times the forward pass: the
# backward of each product `C = A B` is two products of the same size, $dA = dC B^\top$
# and $dB = A^\top dC$. Layer norms, softmaxes, dropout and the optimizer add a few
# operations per number, negligible in FLOPs (though not in time on a CPU, as we
# will see).

# %%
def step_flops(cfg: TransformerConfig, Bsz: int, S: int, T: int) -> int:
    """Matmul FLOPs of one training step (3 x the forward), counted from the table above."""
    D, F, V, Le, Ld = cfg.d_model, cfg.d_ff, cfg.target_vocab_size, cfg.n_encoder_layers, cfg.n_decoder_layers
    Ns, Nt = Bsz * S, Bsz * T
    enc = 4 * 2 * Ns * D * D + 2 * 2 * Bsz * S * S * D + 2 * 2 * Ns * D * F
    dec = (4 * 2 * Nt * D * D + 2 * 2 * Bsz * T * T * D
           + 2 * 2 * Nt * D * D + 2 * 2 * Ns * D * D + 2 * 2 * Bsz * T * S * D
           + 2 * 2 * Nt * D * F)
    return 3 * (Le * enc + Ld * dec + 2 * Nt * D * V)


base = TransformerConfig.preset("base", vocab_size=37000)       # section 5.1: a shared vocabulary of about 37000
# Section 5.1: each batch held "approximately 25000 source tokens and 25000 target tokens".
# Sentence length only matters for the attention scores; we take 25 tokens a side.
L = 25
Bsz = 25000 // L
f_step = step_flops(base, Bsz, L, L)
f_bench = model_flops(base, Bsz, L, L, training=True)
print(f"base, {Bsz} pairs of {L} + {L} tokens: {f_step:.3e} FLOPs per training step "
      f"(attn.bench.model_flops: {f_bench:.3e})")
per_token = f_step / (Bsz * L)
n_base = sum(int(np.prod(shape)) for shape in parameter_shapes(base).values())
print(f"  = {per_token / 1e6:.0f} MFLOPs per target token; the rule of thumb 6 x parameters says "
      f"{6 * n_base / 1e6:.0f} ({n_base:,} parameters)")
shapes_total = f_step * paper_runs["base"]["steps"]
utilisation = shapes_total / paper_runs["base"]["flops"]
print(f"100 000 steps: {shapes_total:.2e} FLOPs from the shapes, against {paper_runs['base']['flops']:.2e} from "
      f"time x peak: the GPUs did useful matmul work at about {utilisation:.0%} of their peak rate "
      f"({shapes_total / (paper_runs['base']['hours'] * 3600 * GPUS) / 1e12:.1f} of {P100 / 1e12} TFLOPS each)")

# %% [markdown]
# The two estimates measure different things and need not agree. Counting the shapes
# gives the work the model *requires*; time x peak gives what the hardware *could*
# have done in the time. Their ratio is the fraction of peak the training run
# achieved on matrix work, printed above: a realistic figure for 2017 GPUs running
# a whole training loop (data loading, softmaxes, layer norms, communication between
# the eight GPUs all take time but few FLOPs). The paper's Table 2 uses the same
# time-x-capacity rule for every model, so the comparison between rows is fair even
# though each number is an upper bound.
#
# (The "6 x parameters" rule of thumb is the same count, written per token: each
# weight takes part in one multiply-add per token forward, two backward. It misses
# the attention scores, which grow with sentence length, and counts the embedding
# lookups, which cost no FLOPs; the tied projection does them as a matmul.)
#
# ## 3. Measured on this machine
#
# Now the same readable `Transformer` and `Adam` you studied, one training step at a
# time, on this machine's CPU: the toy model with the trainer's default batch of
# `--max-tokens` tokens from the toy corpus, and the paper's `base` model with a
# batch small enough for a CPU. We count each step's FLOPs from its shapes and divide
# by the measured time. The machine these lessons were written on is shared, so
# your numbers will differ; the lesson prints its own.

# %%
def time_steps(model, batch, repeats, smoothing=0.1):
    """Median seconds of a full training step (forward, loss, backward, Adam) after one warm-up,
    the median seconds of its Adam update alone, and the last loss."""
    opt = Adam(model.params, model.config.d_model, model.config.warmup_steps)
    times, adam = [], []
    for r in range(repeats + 1):
        t = time.perf_counter()
        logits, cache = model.forward(batch.src, batch.tgt_in, B.DeviceRNG(r))
        loss, dlogits = cross_entropy(logits, batch.tgt_out, smoothing)
        grads = model.backward(dlogits, cache)
        t_adam = time.perf_counter()
        opt.step(grads)
        times.append(time.perf_counter() - t)
        adam.append(time.perf_counter() - t_adam)
    return float(np.median(times[1:])), float(np.median(adam[1:])), float(loss)


max_tokens = TrainConfig().with_recipe().max_tokens          # the toy preset's batch size in attn-train
pairs = read_parallel(TOY_DIR, "en", "tk", "train")[:3000]
vocab = Vocab.build([tokenize(s) for s, _ in pairs] + [tokenize(t) for _, t in pairs])
toy_batch = max(make_batches(encode_pairs(pairs, vocab), max_tokens, shuffle=True, seed=0),
                key=lambda b: b.src.size)
toy_cfg = TransformerConfig.preset("toy", vocab_size=len(vocab))
toy_model = Transformer(toy_cfg, seed=0)
toy_sec, toy_adam, toy_loss = time_steps(toy_model, toy_batch, 2 if QUICK else 6)


class Batch:                                            # a random batch for base, in the shape make_batches returns
    def __init__(self, Bsz, S, T, V, seed):
        rng = np.random.default_rng(seed)
        self.src, self.tgt_in, self.tgt_out = (rng.integers(3, V, (Bsz, n)) for n in (S, T, T))


base_B, base_L = (2, 16) if QUICK else (8, 32)
t = time.perf_counter()
base_model = Transformer(base, seed=0)
base_init = time.perf_counter() - t
base_batch = Batch(base_B, base_L, base_L, base.vocab_size, 0)
base_sec, base_adam, base_loss = time_steps(base_model, base_batch, 1 if QUICK else 3)

measured = {}
for name, cfg, batch, sec, adam, model in (("toy", toy_cfg, toy_batch, toy_sec, toy_adam, toy_model),
                                           ("base", base, base_batch, base_sec, base_adam, base_model)):
    Bb, S, T = batch.src.shape[0], batch.src.shape[1], batch.tgt_in.shape[1]
    fl = step_flops(cfg, Bb, S, T)
    measured[name] = dict(params=model.num_parameters(), batch=(Bb, S, T), sec=sec, flops=fl, rate=fl / sec,
                          tokens_per_s=Bb * T / sec, adam_share=adam / sec)
    print(f"{name:>4}: {model.num_parameters():>11,} parameters, batch {Bb} x ({S} + {T}) tokens: {sec * 1e3:8.1f} ms "
          f"per step ({adam / sec:.0%} of it Adam's update), {fl / 1e9:8.2f} GFLOPs per step -> "
          f"{fl / sec / 1e9:5.1f} GFLOP/s, {Bb * T / sec:8.0f} target tokens/s")
print(f"(creating the base model's {measured['base']['params'] / 1e6:.0f}M parameters took {base_init:.1f} s)")

# %% [markdown]
# What would the paper's base run cost here? Its 100 000 steps of 25 000 target
# tokens, at the rate measured just now (the matmuls of a bigger batch run at least
# as fast per FLOP, so this is roughly right, if anything pessimistic):

# %%
days_here = shapes_total / measured["base"]["rate"] / 86400
print(f"base model, paper's schedule: {shapes_total:.2e} FLOPs / {measured['base']['rate'] / 1e9:.1f} GFLOP/s = "
      f"{days_here:,.0f} days ({days_here / 365:.1f} years) on this machine, against "
      f"{paper_runs['base']['hours'] / 24:.1f} days on 8 P100s")
print(f"one P100 at its 9.5 TFLOPS peak is {P100 / measured['base']['rate']:.0f} x this machine's measured rate")
toy_minutes = TrainConfig().minutes
print(f"the toy model in attn-train's default {toy_minutes:g} minutes, at the readable path's rate measured here "
      f"(attn-train's default fast path gets through more): about "
      f"{toy_minutes * 60 / toy_sec:,.0f} steps of {max_tokens} tokens, {toy_minutes * 60 * measured['toy']['rate']:.1e} "
      f"FLOPs: {paper_runs['base']['flops'] / (toy_minutes * 60 * measured['toy']['rate']):.1e} times less than "
      f"the paper's base run")


fig, ax = plt.subplots(1, 2, figsize=(12, 4))
names = [f"toy, {toy_minutes:g} min here", "base (paper): 12 h x 8 P100", "big (paper): 3.5 d x 8 P100"]
vals = [toy_minutes * 60 * measured["toy"]["rate"], paper_runs["base"]["flops"], paper_runs["big"]["flops"]]
ax[0].barh(range(3), vals, 0.45, color=["tab:green", "tab:blue", "tab:purple"])
ax[0].barh([1], [shapes_total], 0.45, color="none", edgecolor="k", hatch="//", label="base: counted from shapes")
ax[0].axvline(MISPRINT_BIG, color="tab:red", ls=":", label="the misprinted figure for big")
named_bars(ax[0], names)
ax[0].set_xscale("log"); ax[0].set_xlabel("training FLOPs"); ax[0].set_title("Table 2's column, and the toy")
ax[1].barh(range(3), [measured["toy"]["rate"], measured["base"]["rate"], P100], 0.45,
           color=["tab:green", "tab:blue", "0.6"])
named_bars(ax[1], ["this machine: toy", "this machine: base", "P100 peak"])
ax[1].set_xscale("log"); ax[1].set_xlabel("FLOP/s")
ax[1].set_title("rates: a step's matmul FLOPs / its time")
# the key sits outside the panels, above the first, where a phone's narrow column stacks the
# panels without it landing on the second's title
fig.legend(*ax[0].get_legend_handles_labels(), loc="outside upper left", fontsize=8)
fig.tight_layout()
show_figure(fig, "21_cost_of_training.png")

# %% [markdown]
# Neither rate is the CPU's matmul peak. Much of a step's time goes to work the FLOP
# count ignores: Python, softmaxes, layer norms, and the optimizer, which touches
# every parameter once per step however small the batch (its share of each step is
# printed above). For `base` with a CPU-sized batch that update over all its parameters is
# a large part of the step; the paper's 25 000-token batches spread it over far more
# matrix work. Both rates are far from a GPU. That gap, and the fact that attention's work
# is a few large matrix products rather than a chain of small sequential steps
# (lesson 10), is what made 12 hours on 8 GPUs enough for the paper.
#
# ## Check
#
# These fail if the FLOP count disagreed with the library's own (`attn.bench`), if
# the paper's arithmetic did not reproduce Table 2, or if a measured step was not a
# real training step (a loss that is not finite).

# %%
for cfg, shape in ((base, (Bsz, L, L)), (toy_cfg, (3, 7, 11)), (TransformerConfig.preset("small", vocab_size=900),
                                                                  (5, 13, 9))):
    assert step_flops(cfg, *shape) == model_flops(cfg, *shape, training=True), f"FLOP counts disagree for {shape}"
assert float(f"{paper_runs['base']['flops']:.1e}") == 3.3e18 and float(f"{paper_runs['big']['flops']:.1e}") == 2.3e19
# the sanity rule of section 1: same GPUs, so the costs are in the ratio of the training times;
# the misprint breaks it (cheaper than base), and is Table 2's figure divided by exactly ten
assert np.isclose(paper_runs["big"]["flops"] / paper_runs["base"]["flops"], longer), "costs must scale with time"
assert MISPRINT_BIG < paper_runs["base"]["flops"] < paper_runs["big"]["flops"]
assert np.isclose(paper_runs["big"]["table2"] / MISPRINT_BIG, 10.0), "the misprint is one power of ten short"
assert 0.05 < utilisation < 1.0, f"the counted work must fit in the time x peak estimate: {utilisation:.2f}"
assert np.isfinite(toy_loss) and np.isfinite(base_loss) and toy_sec > 0 and base_sec > 0
print(f"Check passed in {time.time() - T0:.1f} s: the shape count equals attn.bench.model_flops; Table 2's 3.3e18 and "
      f"2.3e19 reproduced; measured {measured['toy']['rate'] / 1e9:.1f} (toy) and "
      f"{measured['base']['rate'] / 1e9:.1f} (base) GFLOP/s here.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. How did the paper estimate the training cost in Table 2, and does that estimate
#    count the operations the model needed?
#
#    <details><summary>Answer</summary>
#
#    Training time multiplied by the number of GPUs and an estimate of each GPU's
#    sustained single-precision throughput (footnote 5). That counts the operations the
#    GPUs *could* do in that time, not the operations the model needed: it is an upper
#    bound for the work done.
#
#    </details>
#
# 2. Which sanity rule shows that a copy of Table 2 giving the big model less
#    compute than the base model is wrong?
#
#    <details><summary>Answer</summary>
#
#    The big model has more parameters and trains for more steps on the same number of
#    GPUs, so it needs more operations and more time: its cost must be larger. A copy
#    that gives the big model less compute than the base has its numbers swapped or
#    mistyped.
#
#    </details>
#
# 3. Why is the FLOP rate of a training step on this machine far below the machine's
#    peak, and where does the rest of the time go?
#
#    <details><summary>Answer</summary>
#
#    A training step also spends time on memory traffic, small operations and overhead
#    (the operations that do not use the machine's fast matrix units, copies, Python,
#    synchronisation), and its matrix products are small: the peak rate is reached only
#    by large matrix products.
#
#    </details>

# %% [markdown]
# # Lesson 32: int8 weights, a byte a number
#
# A trained model's weights are float32, four bytes a number. Most of what a model computes
# with does not need that precision: stored as signed bytes (int8) with one float scale per
# output channel, a matrix takes a quarter of the bytes, and the model's outputs barely move.
# This lesson quantises a matrix by hand, derives the bound on every number's error, then
# quantises the toy translator (`attn.quantize`) and measures what it costs: the outputs, the
# loss, BLEU, and the bytes of the checkpoint and of the page's download (`attn-export --int8`).

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, quick_steps, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import shutil
import subprocess

import numpy as np

from attn import backend as B
from attn.data import BOS, EOS, PAD, TOY_DIR, read_parallel, tokenize
from attn.evaluate import evaluate_translations
from attn.loss import cross_entropy
from attn.model import Transformer
from attn.quantize import (dequantize_int8, int8_round_trip, matrix_errors, quantize_int8, quantize_model,
                           save_int8)
from attn.train import train
from attn.training.config import config_from_argv
from attn.translate import load_translator

B.set_backend("numpy")                                       # lessons run on the CPU
np.set_printoptions(precision=4, suppress=True, linewidth=120)
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. One row, one scale
#
# Take one output channel's numbers, a row $w$. Symmetric quantisation maps the largest
# magnitude to the largest int8 we use, 127 (the range is kept symmetric, so $-128$ is never
# used and $-w$ quantises to $-q$):
#
# $$s = \frac{\max_j |w_j|}{127}, \qquad q_j = \operatorname{clip}\!\left(\operatorname{round}
# \frac{w_j}{s},\, -127,\, 127\right), \qquad \hat w_j = q_j\, s. \tag{32.1}$$
#
# **The bound.** Write $w_j / s = q^*_j + \delta_j$ with $q^*_j$ the nearest integer, so
# $|\delta_j| \le 1/2$. Since $|w_j| \le \max_j |w_j| = 127\,s$, we have $|w_j / s| \le 127$, so
# $|q^*_j| \le 127$ and the clip changes nothing: $q_j = q^*_j$. Then
#
# $$|w_j - \hat w_j| = |w_j - q_j s| = s\,|w_j / s - q_j| = s\,|\delta_j| \le \frac{s}{2}. \tag{32.2}$$
#
# Every number moves by at most half a step, and the step is set by the row's own largest
# number. A row of zeros has $s = 0$ and stays zero. The error can reach the bound but not pass
# it: a number exactly halfway between two steps moves by exactly $s/2$.
#
# **Why per channel.** One scale for the whole matrix would set every row's step by the largest
# number anywhere in it: a row of small numbers would then be rounded to a few steps, or to zero.
# Here is a matrix whose rows have very different sizes, quantised both ways:

# %%
W = rng.standard_normal((6, 64)) * np.array([[3.0], [1.0], [0.3], [0.1], [0.03], [0.01]])
q, scale = quantize_int8(W)
W_hat = dequantize_int8(q, scale)
err = np.abs(W - W_hat)
bound = scale / 2
ratio = (err / bound).max(axis=1)
print("q is", q.dtype, "from", int(q.min()), "to", int(q.max()))
print("scale of each row        ", scale[:, 0])
print("largest error of each row", err.max(axis=1))
print("its ratio to s / 2       ", ratio)
s_tensor = np.abs(W).max() / 127
per_tensor = np.clip(np.round(W / s_tensor), -127, 127) * s_tensor
rel_channel = err.max(axis=1) / np.abs(W).max(axis=1)
rel_tensor = np.abs(W - per_tensor).max(axis=1) / np.abs(W).max(axis=1)
distinct = [len(np.unique(np.round(W[i] / s_tensor))) for i in range(len(W))]
print("largest error over the row's largest |w|, per channel:", rel_channel)
print("                                          per tensor: ", rel_tensor)
print("distinct values the per-tensor scale leaves each row:", distinct)
print("the round trip equals attn.quantize.int8_round_trip:", bool(np.array_equal(W_hat, int8_round_trip(W))))

fig, ax = plt.subplots(figsize=(7, 3.6))
rows_ = np.arange(len(W))
ax.semilogy(rows_, rel_channel, "o-", label="one scale per row (output channel)")
ax.semilogy(rows_, rel_tensor, "s--", label="one scale for the matrix")
ax.axhline(0.5 / 127, color="grey", ls=":", label="the bound: half a step of 127")
ax.set_xlabel("row (the rows' numbers smaller and smaller)")
ax.set_ylabel("largest |w - w_hat| / max|row|")
ax.set_title("int8 error of each row")
ax.legend(fontsize=8)
show_figure(fig, "32_int8_rows.png")

# %% [markdown]
# Per channel, every row's error is within half a step of its own scale, so relative to the
# row's size it is the same for every row: at most $0.5/127$. Per tensor, the small rows are left
# with few steps (the last line above counts them), and their relative error grows as they
# shrink.
#
# Which axis is a channel: the model's linear maps compute $xW$ with $W$ of shape
# ($d_\text{in}$, $d_\text{out}$), so an output channel is a *column* of $W$ and
# `attn.quantize` gives each column its scale; an embedding table gives out a *row* per token,
# and gets a scale per row.

# %% [markdown]
# ## 2. The toy translator in int8
#
# We train a small translator on short sentences of the toy corpus, briefly (lesson 14), then
# quantise every matrix of it, the embeddings included; the vectors (biases, the norms' gains)
# stay float32. The int8 model dequantises each matrix when a layer asks for it
# (`Int8Params`), so the readable model runs it unchanged.

# %%
MAX_WORDS = 8
STEPS = quick_steps(150) if QUICK else 1500
N_TEST = 60 if QUICK else 400


def short(split, n):
    return [pr for pr in read_parallel(TOY_DIR, "en", "tk", split) if len(pr[0].split()) <= MAX_WORDS][:n]


data_dir, run = OUT / "32_data", OUT / "32_run"
splits = {"train": short("train", 1500 if QUICK else 8000), "val": short("val", 40), "test": short("test", 20)}
data_dir.mkdir(parents=True, exist_ok=True)
for split, pairs in splits.items():
    for side, lang in ((0, "en"), (1, "tk")):
        (data_dir / f"{split}.{lang}").write_text("".join(pr[side] + "\n" for pr in pairs), encoding="utf-8")
shutil.rmtree(run, ignore_errors=True)
argv = ["--data", os.path.relpath(data_dir), "--out", os.path.relpath(run), "--backend", "numpy", "--seed", "0",
        "--d-model", "32" if QUICK else "64", "--heads", "4", "--d-ff", "64" if QUICK else "128", "--layers", "2",
        "--dropout", "0.0", "--warmup", "150", "--lr-factor", "1", "--steps", str(STEPS), "--max-tokens", "400",
        "--eval-every", str(STEPS), "--average", "0", "--minutes", "0", "--bleu-sentences", "0", "--quiet"]
metrics = train(config_from_argv(argv))
model, vocab = load_translator(run / "checkpoint.npz")
int8_model = quantize_model(model)
print(f"trained {metrics['steps']} steps, {model.num_parameters():,} parameters, "
      f"{len(int8_model.params.quantized)} matrices quantised, {len(int8_model.params.vectors)} vectors kept float32")

errors = matrix_errors(model.params, int8_model.params)
worst = max(errors.items(), key=lambda kv: kv[1][2])
print(f"every matrix within its bound: the largest ratio of an error to its channel's s / 2 is "
      f"{worst[1][2]:.4f} ({worst[0]})")
for name in list(errors)[:4]:
    e, b, r = errors[name]
    print(f"  {name:40s} largest error {e:.2e}, largest s / 2 {b:.2e}")

# %% [markdown]
# What the model computes: the log-probabilities of the reference translations of held-out
# sentences (teacher forcing, as in training), at float32 and at int8; the loss is their mean
# over the tokens, without label smoothing.

# %%
test_pairs = short("test", 20 + N_TEST)[20:]
src_rows = [list(vocab.encode(tokenize(s))) + [EOS] for s, _ in test_pairs]
tgt_rows = [list(vocab.encode(tokenize(t))) for _, t in test_pairs]
S_len, T_len = max(map(len, src_rows)), max(map(len, tgt_rows)) + 1
src = np.full((len(src_rows), S_len), PAD, dtype=np.int64)
tgt_in = np.full((len(tgt_rows), T_len), PAD, dtype=np.int64)
tgt_out = np.full((len(tgt_rows), T_len), PAD, dtype=np.int64)
for i, (s, t) in enumerate(zip(src_rows, tgt_rows)):
    src[i, :len(s)] = s
    tgt_in[i, :len(t) + 1] = [BOS] + t
    tgt_out[i, :len(t) + 1] = t + [EOS]

logits = {}
losses = {}
for name, m in (("fp32", model), ("int8", int8_model)):
    lg, _ = m.forward(B.to_device(src), B.to_device(tgt_in))
    logits[name] = B.to_host(lg).astype(np.float64)
    losses[name] = float(B.to_host(cross_entropy(lg, B.to_device(tgt_out))[0]))
real = tgt_out != PAD
logit_gap = float(np.abs(logits["fp32"] - logits["int8"])[real].max())
logit_range = float(np.abs(logits["fp32"][real]).max())
same_argmax = float((logits["fp32"].argmax(-1) == logits["int8"].argmax(-1))[real].mean())
print(f"largest change of a logit: {logit_gap:.4f} (the logits reach {logit_range:.1f})")
print(f"the most probable next token is the same at {100 * same_argmax:.1f}% of the positions")
print(f"loss on {len(test_pairs)} held-out sentences: fp32 {losses['fp32']:.4f}, int8 {losses['int8']:.4f} "
      f"({losses['int8'] - losses['fp32']:+.4f})")

# %% [markdown]
# And what it translates: greedy decoding of the same sentences, scored with BLEU (lesson 16).

# %%
bleu, hyps = {}, {}
for name, m in (("fp32", model), ("int8", int8_model)):
    scores, hyps[name] = evaluate_translations(m, vocab, test_pairs)
    bleu[name] = scores.bleu
same_text = sum(a == b for a, b in zip(hyps["fp32"], hyps["int8"]))
print(f"BLEU: fp32 {bleu['fp32']:.2f}, int8 {bleu['int8']:.2f} ({bleu['int8'] - bleu['fp32']:+.2f}); "
      f"{same_text} of {len(test_pairs)} translations identical")

# %% [markdown]
# ## 3. The bytes
#
# The checkpoint: float32 parameters against int8 matrices with their scales (a float32 a
# channel) and the float32 vectors. The page: `attn-export` writes the weights the browser
# downloads, `--int8` in the same layout (`docs/WEB_FORMAT.md`), and the page dequantises them
# as it loads (`tests/test_web_int8.py` holds the page's numbers to these in a browser). The cell
# runs `attn-export` on the run's checkpoint as you would, once without `--int8` and once with it.

# %%
fp32_ckpt, int8_ckpt = OUT / "32_fp32.npz", OUT / "32_int8.npz"
model.save(fp32_ckpt)
save_int8(int8_model, int8_ckpt, {"vocab": vocab.to_json()})
sizes = {"checkpoint": (fp32_ckpt.stat().st_size, int8_ckpt.stat().st_size)}
web = {}
for dtype in ("float32", "int8"):
    folder = OUT / f"32_web_{dtype}"
    shutil.rmtree(folder, ignore_errors=True)
    flags = ["--int8"] if dtype == "int8" else []
    subprocess.run([sys.executable, "-m", "attn.site.export", str(run / "checkpoint.npz"), str(folder), *flags],
                   check=True, capture_output=True)         # attn-export CHECKPOINT DIR [--int8]
    web[dtype] = sum(f.stat().st_size for f in folder.iterdir())
sizes["page download (model.json and weights)"] = (web["float32"], web["int8"])
for what, (before, after) in sizes.items():
    print(f"{what:40s} fp32 {before:>9,} bytes, int8 {after:>9,} bytes: {after / before:.3f} of it")

# %% [markdown]
# Not exactly a quarter: each channel adds a float32 scale, and the vectors stay float32; both
# weigh less in a wider model, where a channel holds more numbers. The files also hold the
# vocabulary and the configuration, the same in both. `python -m attn.quantize CHECKPOINT OUT`
# writes an int8 checkpoint, and `benchmarks/RESULTS.md` records BLEU, the language model's loss
# and the page's bytes for the models trained on real text.

# %% [markdown]
# ## Check

# %%
assert ratio.max() <= 1 + 1e-9, "every number within half a step (equation 32.2)"
assert (rel_channel <= 0.5 / 127 + 1e-12).all(), "per channel, each row's error is within its own half step"
assert rel_tensor[-1] > rel_channel[-1], "one scale for the matrix rounds the smallest row worse"
assert worst[1][2] <= 1 + 1e-5, "every matrix of the model within its bound (float32's rounding allowed)"
assert logit_gap < 0.1 * logit_range, "int8 moves the logits by a small fraction of their size"
assert sizes["checkpoint"][1] < 0.5 * sizes["checkpoint"][0], "the int8 checkpoint is much smaller"
assert web["int8"] < 0.5 * web["float32"], "the int8 page downloads much less"
print(f"Check passed: every error within s / 2 (worst ratio {max(ratio.max(), worst[1][2]):.4f}), the logits "
      f"within {logit_gap:.4f}, the page's download {web['int8'] / web['float32']:.3f} of float32's")

# %% [markdown]
# ## Questions
#
# 1. Why is the scale $\max|w| / 127$ and not $\max|w| / 128$, when int8 reaches $-128$?
#
#    <details><summary>Answer</summary>
#
#    With 128 the largest number maps to $\pm 128$, which only the negative side can hold: a
#    positive largest number would be clipped to 127 and move by a whole step, past the bound of
#    equation 32.2. With 127 both signs fit, $-w$ quantises to $-q$, and the bound holds.
#
#    </details>
#
# 2. The cast `w.astype(np.int8)` after dividing by the scale truncates toward zero. What does
#    that do to the bound?
#
#    <details><summary>Answer</summary>
#
#    Truncation moves $w/s$ by up to a whole step (a number just under an integer goes down to the one below), so the bound becomes
#    $s$ instead of $s/2$, and the errors are biased toward zero. Round to the nearest integer
#    first, then cast.
#
#    </details>

# %% [markdown]
# ## Exercise
#
# Quantise and dequantise a matrix a row at a time yourself:
#
# ```
# attn-check lessons/exercises/int8.py
# ```
#
# It is graded against the library's round trip and the bound of equation 32.2: every number
# within half a step, the result an integer in $[-127, 127]$ times the row's scale, a row of
# zeros kept zero, $-w$ giving $-\hat w$. `attn-check --hint 2` says where to look, `--hint 3`
# gives the formula; the typical mistakes it names include one scale for the whole matrix, a
# scale per column, truncating instead of rounding, and dividing by 128.

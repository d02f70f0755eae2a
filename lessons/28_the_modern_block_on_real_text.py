# %% [markdown]
# # Lesson 28: what the block of today buys on real text
#
# Lesson 26 derived the parts that today's models exchange in the paper's block: the norm
# before the sub-layer, RMSNorm, rotary positions, SwiGLU and grouped-query attention. Each
# was checked to be *correct*. This lesson asks whether each is *better*, for the translator
# of lesson 14 on real text, with the budget a learner has: twenty-odd minutes on two CPU cores.
#
# The runs are recorded in `benchmarks/multi30k-blocks/`, one folder per run, each what
# `attn-train` wrote (checkpoints left out): Multi30k German to English (Elliott et al. 2016),
# `--preset small`, ten minutes each, one after the other on the same otherwise idle machine.
# The paper's block, each change alone, all of them together, and all but the one that cost
# the most alone:
#
# ```
# attn-train --data multi30k --src de --tgt en --preset small --minutes 10 --out runs/block-paper
# attn-train ... --norm-position pre             # the norm before each sub-layer
# attn-train ... --norm-kind rms                 # RMSNorm after each residual sum
# attn-train ... --norm-position pre --norm-kind rms   # both, as every model since 2023 has them
# attn-train ... --positional rope               # rotary positions
# attn-train ... --ffn swiglu                    # SwiGLU at 2/3 of d_ff: the same parameters
# attn-train ... --kv-heads 2                    # grouped-query attention: 2 key/value heads for 8
# attn-train ... --norm-position pre --norm-kind rms --positional rope --ffn swiglu --kv-heads 2
# attn-train ... --norm-position pre --norm-kind rms --positional rope --ffn swiglu   # all but GQA
# ```
#
# Equal minutes, not equal steps: a change that makes the step slower has to pay for itself in
# what each step learns. The choice between blocks is made on the validation split (the
# trainer's greedy BLEU on the first validation sentences, logged as it trains and at the end).
# The trainer also translates the test split once at the end of each run; this lesson reads
# the test score of the block that validation chose, and no other.

# %%
import os, sys
import json
from pathlib import Path
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

import attn
from attn.masks import padding_mask
from attn.model import Transformer, TransformerConfig

RECORDED = Path(attn.__file__).resolve().parents[1] / "benchmarks" / "multi30k-blocks"
PAPER = dict(norm_position="post", norm_kind="layer", positional="sinusoidal", ffn="relu", kv_heads=None)
LATER = dict(norm_position="pre", norm_kind="rms", positional="rope", ffn="swiglu", kv_heads=2)
BLOCKS = {  # folder: (label, what differs from the paper's block)
    "paper": ("the paper's block", {}),
    "pre": ("pre-norm", dict(norm_position="pre")),
    "rms": ("RMSNorm", dict(norm_kind="rms")),
    "rms-pre": ("pre-norm RMSNorm", dict(norm_position="pre", norm_kind="rms")),
    "rope": ("rotary positions", dict(positional="rope")),
    "swiglu": ("SwiGLU", dict(ffn="swiglu")),
    "gqa": ("2 key/value heads", dict(kv_heads=2)),
    "later": ("all of them", LATER),
    "later-mha": ("all but GQA", {**LATER, "kv_heads": None}),
}
runs = {}
for name, (label, change) in BLOCKS.items():
    folder = RECORDED / name
    config = json.loads((folder / "config.json").read_text())
    model_config = TransformerConfig.from_dict(config["model"])   # older files' names too
    recorded = {k: getattr(model_config, k) for k in PAPER}
    assert recorded == {**PAPER, **change}, f"{name}: the recorded run's block is {recorded}"
    assert config["train"]["preset"] == "small" and config["train"]["minutes"] == 10, name
    runs[name] = dict(label=label, config=config, final=json.loads((folder / "metrics.json").read_text()),
                      evals=[json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()])

# %% [markdown]
# ## 1. What each block costs: parameters, a step, the decoding cache
#
# Three of the changes alter the arithmetic. SwiGLU has three weight matrices where the ReLU
# network has two, so the trainer gives it a hidden width of $\frac{2}{3} d_{ff}$: the same
# parameters, a little less work per token. Grouped-query attention with 2 key/value heads for
# 8 query heads shrinks the key and value projections to a quarter. Rotary positions turn every
# query and key in every layer, where the sinusoids were added once, below the first layer.
#
# The parameters are counted on the model rebuilt from each run's `config.json`, and must be the
# number the trainer reported. The decoding cache (lesson 15) is measured, not computed: the
# bytes of the keys and values that the decoder holds after reading a source sentence and
# producing a translation of the same length. What each step took is the trainer's own
# clock: its steps and the seconds it trained.

# %%
SRC_LEN = TGT_LEN = 16 if QUICK else 24      # pieces: a long Multi30k caption


def decoding_cache_bytes(model: Transformer, src_len: int, tgt_len: int) -> int:
    """The bytes of keys and values a greedy decoder holds after ``tgt_len`` positions."""
    xp = model.xp
    src = xp.asarray(np.random.default_rng(0).integers(4, model.config.vocab_size, (1, src_len)))
    memory, _ = model.encode(src)
    state = model.start_decoding(memory, padding_mask(src))
    token = xp.full((1,), 2)                         # any token: the cache's size does not depend on it
    for _ in range(tgt_len):
        logp, state, _ = model.decode_step(token, state)
        token = logp.argmax(axis=-1)
    return sum(int(a.nbytes) for pair in state.cross_kv + state.self_kv for a in pair)


print(f"{'block':<20} {'parameters':>11} {'steps':>6} {'steps/min':>10} {'tokens/s':>9} {'cache KiB':>10}")
for name, r in runs.items():
    model = Transformer(TransformerConfig.from_dict(r["config"]["model"]), seed=0)
    f = r["final"]
    r["parameters"] = model.num_parameters()
    r["cache"] = decoding_cache_bytes(model, SRC_LEN, TGT_LEN)
    r["steps_per_minute"] = f["steps"] / (f["train_seconds"] / 60)
    print(f"{r['label']:<20} {r['parameters']:>11,} {f['steps']:>6,} {r['steps_per_minute']:>10.1f} "
          f"{f['tokens_per_second']:>9,.0f} {r['cache'] / 1024:>10.1f}")
print(f"(the cache after a {SRC_LEN}-piece source and {TGT_LEN} decoded pieces, float32)")

# %% [markdown]
# ## 2. Validation BLEU against the minutes
#
# Each curve is one run's validation BLEU, logged as it trained and at the end, against the
# minutes it had trained by then (evaluation time not counted). The paper's block is black, all
# the changes together red, all but grouped-query attention dashed red.

# %%
fig, ax = plt.subplots(1, 3, figsize=(18, 5.6), gridspec_kw=dict(width_ratios=[1.6, 1, 1]))
for name, r in runs.items():
    style = {"paper": dict(lw=3, color="black"), "later": dict(lw=3, color="tab:red"),
             "later-mha": dict(lw=2, color="tab:red", ls="--")}.get(name, dict(lw=1.3))
    minutes = [e["train_seconds"] / 60 for e in r["evals"]]
    ax[0].plot(minutes, [e["val_bleu"] for e in r["evals"]], marker="o", ms=3, label=r["label"], **style)
ax[0].set_xlabel("minutes of training"); ax[0].set_ylabel("val BLEU (greedy, first 200)")
ax[0].legend(loc="lower right", fontsize=9); ax[0].set_title("validation BLEU")
labels = [r["label"] for r in runs.values()]
ax[1].barh(labels, [r["steps_per_minute"] for r in runs.values()], color="tab:blue")
ax[1].set_xlabel("optimizer steps per minute"); ax[1].invert_yaxis(); ax[1].set_title("speed")
ax[2].barh(labels, [r["cache"] / 1024 for r in runs.values()], color="tab:green")
ax[2].set_xlabel(f"KiB of keys and values ({SRC_LEN}-piece source, {TGT_LEN} decoded)")
ax[2].invert_yaxis(); ax[2].set_yticklabels([]); ax[2].set_title("decoding cache")
fig.suptitle("Multi30k German-English, ten minutes each on two CPU cores")
fig.tight_layout(); show_figure(fig, "28_blocks.png")

paper = runs["paper"]
ranked = sorted(runs, key=lambda n: runs[n]["evals"][-1]["val_bleu"], reverse=True)
print(f"{'block':<20} {'val BLEU':>9} {'vs paper':>9} {'val loss':>9}")
for name in ranked:
    e = runs[name]["evals"][-1]
    print(f"{runs[name]['label']:<20} {e['val_bleu']:>9.2f} {e['val_bleu'] - paper['evals'][-1]['val_bleu']:>+9.2f} "
          f"{e['val_loss']:>9.3f}")
same_work = abs(runs["pre"]["steps_per_minute"] / paper["steps_per_minute"] - 1)
print(f"pre-norm and the paper's block: {runs['pre']['steps_per_minute']:.1f} and {paper['steps_per_minute']:.1f} "
      f"steps a minute, {100 * same_work:.0f}% apart for the same work")

# %% [markdown]
# ## 3. The choice, and the test set once
#
# Validation chooses; the test set, translated once by the trainer at the end of the chosen
# run, then says how well the choice does on sentences nothing was chosen on.

# %%
best = ranked[0]
f = runs[best]["final"]
print(f"validation chooses {runs[best]['label']}: val BLEU {runs[best]['evals'][-1]['val_bleu']:.2f} "
      f"against the paper's block's {paper['evals'][-1]['val_bleu']:.2f}")
print(f"its test BLEU {f['test_bleu']:.2f} (lower-cased {f['test_bleu_lc']:.2f}; beam {f['beam']}, alpha {f['alpha']:g}, "
      f"no repeated {f['no_repeat_ngram']}-gram), the test set translated once, at the end of its run")

# %% [markdown]
# Read the runs one change at a time.
#
# - **Rotary positions** give the largest gain of any single change, at no cost in speed. The
#   sinusoids are added to the embeddings once and every layer has to keep the token apart
#   from its position; rotary positions put the *offset* between a query and a key into their
#   score, in every layer, which is what a translator needs to relate neighbouring words.
# - **The norm before the sub-layer** gains too: the residual path from the loss to the
#   embeddings goes through no norm, so the first steps move every layer.
# - **RMSNorm** and **SwiGLU** alone barely move the validation BLEU in ten minutes: a norm
#   without its mean is a little cheaper, the gate a little different, and neither changes
#   what the model can see.
# - **Two key/value heads** alone make the step fastest of all (smaller projections, a
#   quarter of the keys and values), and the model learns much less from each step: with
#   sinusoidal positions, one reading is that the keys of every attention are squeezed into a quarter of the width
#   that carries both the word and its position. Together with rotary positions, which put
#   the positions into the scores after the projection, the same two heads cost little.
#
# How far apart two runs of the same arithmetic land says what to trust. Pre-norm does the
# paper's work per step (and two norms more), yet the two made different numbers of steps in
# the same minutes; the difference printed above is the run-to-run noise of the machine, and speed
# differences of that size mean nothing.
#
# One run per block, with one seed: differences of a BLEU point or so are within what a second
# seed could change (the periodic BLEU reads few sentences), and the validation loss,
# over all the validation sentences, is printed beside it as a steadier second opinion.

# %% [markdown]
# `attn-train --preset small` trains the block that validation chose here (its recipe,
# `attn.training.config.RECIPES["small"]`, names it; `--norm-position`, `--norm-kind`, `--positional`,
# `--ffn` and `--kv-heads` still choose any other). What it reaches in twenty minutes, the
# README's Multi30k line, is in `benchmarks/RESULTS.md`, "The block of today on Multi30k".
#
# ## Check
#
# These fail if a recorded run is not the block it is said to be, if a model rebuilt from its
# configuration does not have the parameters the trainer counted, if the decoding cache of a
# model with two key/value heads is not a quarter of the paper's (or any other block's differs
# from the paper's), if SwiGLU's width did not keep the parameters, if the preset does not
# train the block validation chose, or if the runs no longer say what the text above reads
# in them.

# %%
from attn.training.config import RECIPES

single = ["pre", "rms", "rms-pre", "rope", "swiglu", "gqa"]
val = {n: r["evals"][-1]["val_bleu"] for n, r in runs.items()}
for name, r in runs.items():
    assert r["parameters"] == r["final"]["parameters"], f"{name}: {r['parameters']:,} parameters rebuilt"
    kv, heads = r["config"]["model"].get("kv_heads") or r["config"]["model"]["n_heads"], r["config"]["model"]["n_heads"]
    assert r["cache"] * heads == paper["cache"] * kv, f"{name}: a cache of {r['cache']:,} bytes, the paper's {paper['cache']:,}"
assert runs["gqa"]["cache"] * 4 == paper["cache"]
assert abs(runs["swiglu"]["parameters"] / paper["parameters"] - 1) < 0.01
chosen = {k: RECIPES["small"].get(k) or PAPER[k] for k in PAPER}
assert chosen == {**PAPER, **BLOCKS[best][1]}, f"--preset small trains {chosen}, validation chose {best}"
assert max(single, key=val.get) == "rope", "rotary positions: the largest single gain"
assert val["pre"] > val["paper"] + 1 and max(abs(val[n] - val["paper"]) for n in ("rms", "swiglu")) < 1
assert max(single, key=lambda n: runs[n]["steps_per_minute"]) == "gqa" and min(val, key=val.get) == "gqa"
assert val["later-mha"] - val["later"] < (val["paper"] - val["gqa"]) / 3, "with rotary positions GQA costs little"
print(f"Check passed: {len(runs)} recorded runs rebuilt to their parameters; the cache of 2 key/value heads "
      f"{runs['gqa']['cache'] / 1024:.0f} KiB against {paper['cache'] / 1024:.0f}; --preset small trains "
      f"{runs[best]['label']}")

# %% [markdown]
# ## Questions
#
# 1. Why compare the blocks at equal minutes rather than at equal steps?
#
#    <details><summary>Answer</summary>
#
#    A learner's budget is time. A change that makes each step slower (or faster) changes how
#    many steps the budget buys, and that is part of what the change costs or gives: two
#    key/value heads alone made the most steps of all and still ended last. At equal steps,
#    a slow block would be compared with a fast one given extra time.
#
#    </details>
#
# 2. Grouped-query attention shrinks the decoding cache to a quarter here. When does a smaller
#    cache make decoding faster?
#
#    <details><summary>Answer</summary>
#
#    When reading the cache is a large share of a decoding step's work: long outputs, many
#    sentences decoded at once, many layers, and a GPU, whose arithmetic outruns its memory.
#    For one short caption the cache is the few hundred KiB printed above, small against the
#    weights of the projections and of the output layer that every step reads as well.
#
#    </details>
#
# 3. Each block was trained once. How would you find out whether the gap between two blocks
#    that differ by half a BLEU point is real?
#
#    <details><summary>Answer</summary>
#
#    Train each again with other seeds (`attn-train --seed`), which changes the initial
#    weights, the order of the batches and the dropout, and compare the spread of each block's
#    scores with the gap between the blocks; score more validation sentences
#    (`--bleu-sentences`), and look at the validation loss, which every sentence enters.
#
#    </details>

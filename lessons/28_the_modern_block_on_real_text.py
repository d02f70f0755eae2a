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
# what each step learns. These runs are one seed each; section 4 trains five of the blocks again
# with three seeds each, on another corpus, and section 5 says what the choice rests on. The choice between blocks is made on the validation split (the
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
from attn.training.config import RECIPES

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
# minutes it had trained by then (evaluation time not counted). Each block has its own colour:
# the paper's block is black, all the changes together red, all but grouped-query attention
# dashed cyan; the legend sits below the curves.

# %%
COLOURS = {"paper": "black", "pre": "tab:blue", "rms": "tab:orange", "rms-pre": "tab:green", "rope": "tab:purple",
           "swiglu": "tab:brown", "gqa": "tab:pink", "later": "tab:red", "later-mha": "tab:cyan"}
assert len(set(COLOURS.values())) == len(COLOURS) == len(BLOCKS), "one colour a block"
fig, ax = plt.subplots(1, 3, figsize=(18, 6.4), gridspec_kw=dict(width_ratios=[1.6, 1, 1]))
for name, r in runs.items():
    style = dict(lw=3 if name in ("paper", "later", "later-mha") else 1.5, color=COLOURS[name],
                 ls="--" if name == "later-mha" else "-")
    minutes = [e["train_seconds"] / 60 for e in r["evals"]]
    ax[0].plot(minutes, [e["val_bleu"] for e in r["evals"]], marker="o", ms=3, label=r["label"], **style)
ax[0].set_xlabel("minutes of training"); ax[0].set_ylabel("val BLEU (greedy, first 200)")
ax[0].set_title("validation BLEU")
ax[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=10, frameon=False)  # below: covers no curve
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
# ## 3. One seed's choice, and the test set once
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
last = {n: r["evals"][-1] for n, r in runs.items()}
runner_up = ranked[1]
print(f"the runner-up, {runs[runner_up]['label']}: {last[best]['val_bleu'] - last[runner_up]['val_bleu']:.2f} BLEU behind; "
      f"validation losses {last[best]['val_loss']:.3f} and {last[runner_up]['val_loss']:.3f}")
gain = {n: last["paper"]["val_loss"] - last[n]["val_loss"] for n in runs}
print(f"of pre-norm's fall in validation loss from the paper's block ({gain['pre']:.3f}), SwiGLU alone gives "
      f"{gain['swiglu'] / gain['pre']:.0%} and RMSNorm alone {gain['rms'] / gain['pre']:.0%}")

# %% [markdown]
# Read the runs one change at a time.
#
# - **Rotary positions** give the largest gain of any single change, at no cost in speed. The
#   sinusoids are added to the embeddings once and every layer has to keep the token apart
#   from its position; rotary positions put the *offset* between a query and a key into their
#   score, in every layer, which is what a translator needs to relate neighbouring words.
# - **The norm before the sub-layer** gains too: the residual path from the loss to the
#   embeddings goes through no norm, so the first steps move every layer.
# - **RMSNorm** and **SwiGLU** alone move the validation BLEU by less than a point in ten
#   minutes, but the validation loss tells them apart: SwiGLU's fell by more than half as much
#   as pre-norm's (the share printed above), RMSNorm's by much less. A gate is a different
#   function; a norm without its mean is the same one, a little cheaper.
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
# One run per block, with one seed: the lead that chose rotary positions alone over the
# runner-up is about a BLEU point, and their validation losses, over all the validation
# sentences, are equal to the third decimal (printed above). On one seed that is no lead at
# all: the periodic BLEU reads few sentences, and a second seed changes the weights, the
# batches and the dropout. Section 4 measures how much.

# %% [markdown]
# ## 4. Three seeds a block, on Tatoeba
#
# The runs in `benchmarks/tatoeba-blocks/` train five of the blocks again, each with seeds 0, 1
# and 2, on a second real corpus: Tatoeba's English-German pairs (tatoeba.org, CC-BY 2.0 FR;
# the Anki export of manythings.org, its shortest sentences), English to German. The seed draws
# the weights, the batch order, the dropout and the split of the pairs into training,
# validation and test (by English sentence, so that no test source was trained on); the blocks
# of one seed share their validation sentences and are compared seed by seed.
#
# ```
# python benchmarks/tatoeba_blocks.py run --tsv PATH/deu.txt    # the runs, one after the other
# python benchmarks/tatoeba_blocks.py                            # their table
# ```
#
# Equal steps, not equal minutes: these runs shared their two cores with other work, so a
# minute bought a different number of steps from one run to the next (the wall seconds that the
# same number of steps took are printed below); what a step costs on an idle machine is
# section 1's. The model is `--preset small`'s recipe at a smaller size and the runs are short
# (the settings are printed below), so that fifteen runs fit into well under an hour of one
# core: this measures the blocks early in training, on short sentences, which is not the
# ten-minute Multi30k run of section 2. The blocks are compared on the validation loss at the
# last step, over every validation sentence; the greedy BLEU of the first validation sentences
# is printed beside it, and so early in training it is a few points, too coarse to rank by.

# %%
SEEDED = RECORDED.parent / "tatoeba-blocks"
SEEDS = (0, 1, 2)
SEEDED_BLOCKS = ["paper", "rms-pre", "rope", "later-mha", "later"]
SHARED = ("vocab_size", "d_model", "d_ff", "layers", "max_tokens", "steps", "lr_factor", "cooldown", "preset", "tsv")
seeded = {}
for name in SEEDED_BLOCKS:
    seeded[name] = []
    for seed in SEEDS:
        folder = SEEDED / f"{name}-s{seed}"
        config = json.loads((folder / "config.json").read_text())
        recorded = {k: getattr(TransformerConfig.from_dict(config["model"]), k) for k in PAPER}
        assert recorded == {**PAPER, **BLOCKS[name][1]}, f"{folder.name}: the recorded run's block is {recorded}"
        assert config["train"]["seed"] == seed, f"{folder.name}: seed {config['train']['seed']}"
        evals = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
        final = json.loads((folder / "metrics.json").read_text())
        seeded[name].append(dict(seed=seed, config=config, evals=evals, last=evals[-1], final=final,
                                 cpu=json.loads((folder / "cpu.json").read_text())["cpu_seconds"]))
every = [r for rs in seeded.values() for r in rs]
settings = {k: every[0]["config"]["train"][k] for k in SHARED}
assert all({k: r["config"]["train"][k] for k in SHARED} == settings for r in every), "one recipe for every run"
assert all(r["final"]["steps"] == r["last"]["step"] == settings["steps"] for r in every), "equal steps"
pairs = [r["config"]["train_pairs"] for r in every]
print(f"every run: {settings['steps']} steps of --preset small at d_model {settings['d_model']}, d_ff {settings['d_ff']}, "
      f"{settings['layers']} layers a side, batches of {settings['max_tokens']:,} tokens, {settings['vocab_size']:,} BPE pieces, "
      f"{min(pairs):,} to {max(pairs):,} training pairs")
wall = [r["final"]["train_seconds"] for r in every]
print(f"the same {settings['steps']} steps took {min(wall):.0f} to {max(wall):.0f} s of training on the shared cores; "
      f"the {len(every)} runs used {sum(r['cpu'] for r in every) / 60:.0f} CPU minutes in all")


def spread(name: str, key: str) -> tuple[float, float, float]:
    """The mean, lowest and highest of ``key`` at the last step over ``name``'s seeds."""
    values = [r["last"][key] for r in seeded[name]]
    return float(np.mean(values)), min(values), max(values)


print(f"\n{'block':<20} {'val loss: mean':>15} {'lowest':>7} {'highest':>7}   {'val BLEU: mean':>14} {'lowest':>6} {'highest':>7}")
for name in SEEDED_BLOCKS:
    (lm, llo, lhi), (bm, blo, bhi) = spread(name, "val_loss"), spread(name, "val_bleu")
    print(f"{BLOCKS[name][0]:<20} {lm:>15.3f} {llo:>7.3f} {lhi:>7.3f}   {bm:>14.2f} {blo:>6.2f} {bhi:>7.2f}")

fig, ax = plt.subplots(1, 2, figsize=(14, 6.4), gridspec_kw=dict(width_ratios=[1.5, 1]))
for i, name in enumerate(SEEDED_BLOCKS):
    steps = [e["step"] for e in seeded[name][0]["evals"]]
    curves = np.array([[e["val_loss"] for e in r["evals"]] for r in seeded[name]])
    style = dict(color=COLOURS[name], ls="--" if name == "later-mha" else "-", lw=2.5 if name == "paper" else 1.8)
    ax[0].plot(steps, curves.mean(axis=0), label=BLOCKS[name][0], **style)
    ax[0].fill_between(steps, curves.min(axis=0), curves.max(axis=0), color=COLOURS[name], alpha=0.18, lw=0)
    finals = curves[:, -1]
    ax[1].scatter(finals, [i] * len(finals), color=COLOURS[name], s=30, zorder=3)
    ax[1].plot([finals.min(), finals.max()], [i, i], color=COLOURS[name], lw=2)
    ax[1].plot([finals.mean()] * 2, [i - 0.3, i + 0.3], color=COLOURS[name], lw=3)
ax[0].set_xlabel("optimizer step"); ax[0].set_ylabel("validation loss (label smoothing 0.1)")
ax[0].set_title(f"mean of {len(SEEDS)} seeds, band: lowest to highest")
ax[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=10, frameon=False)
ax[1].set_yticks(range(len(SEEDED_BLOCKS)), [BLOCKS[n][0] for n in SEEDED_BLOCKS]); ax[1].invert_yaxis()
ax[1].set_xlabel(f"validation loss at step {settings['steps']}"); ax[1].set_title("each seed a dot, the mean a bar")
fig.suptitle(f"Tatoeba English-German, {settings['steps']} steps each, {len(SEEDS)} seeds a block")
fig.tight_layout(); show_figure(fig, "28_seeds.png")

# %% [markdown]
# ## 5. What the seeds say about the choice
#
# The blocks of one seed share their sentences, so the question for two blocks is whether one
# ends lower in every seed, and by how much against the spread of each. The lines below give,
# for the pairs that the choice turns on, the difference in validation loss in each seed.

# %%
def by_seed(a: str, b: str, key: str = "val_loss") -> list[float]:
    """``a``'s ``key`` minus ``b``'s at the last step, seed by seed."""
    return [ra["last"][key] - rb["last"][key] for ra, rb in zip(seeded[a], seeded[b])]


PAIRS = [("rope", "paper"), ("rms-pre", "paper"), ("later-mha", "rope"), ("later", "later-mha")]
print(f"{'a minus b, validation loss':<45} {'seed by seed':>24} {'mean':>7}")
for a, b in PAIRS:
    d = by_seed(a, b)
    print(f"{BLOCKS[a][0] + ' minus ' + BLOCKS[b][0]:<45} {' '.join(f'{x:+7.3f}' for x in d):>24} {np.mean(d):>+7.3f}")
widest = max(spread(n, "val_loss")[2] - spread(n, "val_loss")[1] for n in SEEDED_BLOCKS)
print(f"the widest spread of one block over its seeds: {widest:.3f}")
recipe = next(n for n in SEEDED_BLOCKS if {**PAPER, **BLOCKS[n][1]} == {k: RECIPES["small"].get(k) or PAPER[k] for k in PAPER})
better = [n for n in SEEDED_BLOCKS if n != recipe and max(by_seed(n, recipe)) < 0]
print(f"--preset small trains {BLOCKS[recipe][0]}; lower in every seed: "
      + (", ".join(f"{BLOCKS[n][0]} (by {-np.mean(by_seed(n, recipe)):.3f} on average)" for n in better) or "no block"))

# %% [markdown]
# What the seeds say about the choice that section 3 made on one seed:
#
# - **Rotary positions rather than the sinusoids** hold up. On Tatoeba they end below the
#   paper's block in every seed, by more than the widest spread of any block over its seeds,
#   and they led the paper's block on Multi30k too. This part of the choice the numbers support.
# - **Rotary positions alone rather than all but GQA** do not. On Multi30k the lead was about a
#   BLEU point on one seed, with equal validation losses; on Tatoeba all but GQA ends below
#   rotary positions alone in every seed, again by more than the widest spread, while their
#   BLEU differ by less than either's spread. Early in training, on short sentences, the norm
#   before the sub-layer, RMSNorm and SwiGLU add to what rotary positions give.
# - **Two key/value heads** cost validation loss on Tatoeba in every seed against all but GQA,
#   where on Multi30k, after ten minutes, the two ended equal: grouped-query attention is
#   bought for the cache, not for the model.
#
# So the choice is stated with what it rests on. `attn-train --preset small` trains rotary
# positions (its recipe, `attn.training.config.RECIPES["small"]`, names them; `--norm-position`,
# `--norm-kind`, `--positional`, `--ffn` and `--kv-heads` choose any other block): the change that
# both corpora and every seed support. Whether it should take the pre-norm RMSNorm and SwiGLU
# too is open. The seeds say that rotary positions alone are not the better block; they were
# run on another corpus, with a smaller model, for a fraction of the steps, and they do not
# measure the recipe's own setting (Multi30k, the small model, ten minutes and more), on which
# the recipe is changed. Three seeds of the two ten-minute Multi30k runs would settle it:
#
# ```
# attn-train --data multi30k --src de --tgt en --preset small --minutes 10 --seed 1 --out runs/rope-s1
# attn-train ... --norm-position pre --norm-kind rms --ffn swiglu --seed 1 --out runs/later-mha-s1
# ```
#
# What `--preset small` reaches in twenty minutes, the README's Multi30k line, is in
# `benchmarks/RESULTS.md`, "The block of today on Multi30k", and the seeded table in "The block
# of today, three seeds on Tatoeba".
#
# ## Check
#
# These fail if a recorded run is not the block it is said to be, if a model rebuilt from its
# configuration does not have the parameters the trainer counted, if the decoding cache of a
# model with two key/value heads is not a quarter of the paper's (or any other block's differs
# from the paper's), if SwiGLU's width did not keep the parameters, if the preset does not
# train the block named above, if a seeded run is missing or was trained differently from the
# others, or if the runs no longer say what the text above reads in them.

# %%
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
assert gain["swiglu"] > gain["pre"] / 2 > gain["rms"], "SwiGLU's loss fell by more than half of pre-norm's, RMSNorm's less"
assert val["paper"] < val["later-mha"] < val[best] and last["later-mha"]["val_loss"] <= last[best]["val_loss"] + 0.005
assert len(every) == len(SEEDED_BLOCKS) * len(SEEDS) and recipe == "rope" == best
for a, b in [("rope", "paper"), ("later-mha", "rope")]:
    assert max(by_seed(a, b)) < -widest, f"{a} below {b} in every seed, by more than any spread: {by_seed(a, b)}"
bleu_gap = abs(np.mean(by_seed("later-mha", "rope", "val_bleu")))
assert bleu_gap < min(spread(n, "val_bleu")[2] - spread(n, "val_bleu")[1] for n in ("rope", "later-mha"))
assert min(by_seed("later", "later-mha")) > 0 and "later-mha" in better, "two key/value heads cost loss"
print(f"Check passed: {len(runs)} recorded runs rebuilt to their parameters; the cache of 2 key/value heads "
      f"{runs['gqa']['cache'] / 1024:.0f} KiB against {paper['cache'] / 1024:.0f}; --preset small trains "
      f"{runs[best]['label']}; {len(every)} seeded runs, {len(SEEDS)} a block")

# %% [markdown]
# ## Questions
#
# 1. Section 2 compares the blocks at equal minutes, section 4 at equal steps. Why each?
#
#    <details><summary>Answer</summary>
#
#    A learner's budget is time. A change that makes each step slower (or faster) changes how
#    many steps the budget buys, and that is part of what the change costs or gives: two
#    key/value heads alone made the most steps of all and still ended last. But minutes compare
#    blocks only when every run had the machine to itself; the seeded runs shared their cores
#    with other work, where the same steps took very different minutes, so they are compared at
#    equal steps, and what a step costs is read from the idle runs of section 1.
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
# 3. The blocks of one seed share their validation sentences. Why compare them seed by seed,
#    and what would three seeds not be enough for?
#
#    <details><summary>Answer</summary>
#
#    The split, the first batches and the initial weights move every block of a seed alike;
#    the difference between two blocks of the same seed leaves most of that out, so it varies
#    less than either block's score. If two blocks were equally good, each seed would put one
#    or the other lower as if by a coin, and one of them lower in all three seeds would happen
#    one time in four: the sign alone is weak evidence, which is why the lesson also asks that
#    the gap be larger than the spread. A gap the size of the spread needs more seeds, and more
#    validation sentences for the BLEU (`--bleu-sentences`).
#
#    </details>

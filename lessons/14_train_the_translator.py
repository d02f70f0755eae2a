# %% [markdown]
# # Lesson 14: train the translator (sections 5 and 6.1)
#
# Everything so far comes together: the model of lesson 9, the recipe of lesson 11,
# trained on the toy corpus (English -> the made-up language "tk", see
# `data/make_toy.py`: adjectives after the noun, verbs at the end of subordinate
# clauses, agreement, numbers said units-first), then used to translate with greedy
# decoding and with the paper's beam search (beam 4, length penalty $\alpha = 0.6$,
# section 6.1), and scored with BLEU. This lesson uses beam search and BLEU as tools;
# lesson 15 builds beam search (with the decoder's cache) and lesson 16 builds BLEU.
#
# We first write the training step and loop ourselves, from the model of lesson 9,
# the loss of lesson 11 and Adam; then hand the same run over to the library's
# trainer, `attn.train.train` (what the `attn-train` command runs), and check that
# it computes what our loop computed. Last, we train a second model without label
# smoothing, with our loop, and see what smoothing and beam search each do.
#
# **Runtime.** Quick mode (`ATTN_QUICK=1` or `--quick`) trains small models on short
# sentences; full mode trains larger ones on more data for longer (the sizes are
# printed below). `lessons/README.md` lists how long each took when measured, and
# the lesson prints its own training time.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import logging
import shutil

import textwrap

import numpy as np

from attn import backend as B
from attn.checkpoint import load_npz
from attn.data import BOS, EOS, PAD, TOY_DIR, Vocab, encode_pairs, make_batches, read_parallel, tokenize
from attn.decode import beam_search, greedy_decode, length_penalty
from attn.evaluate import corpus_bleu, evaluate_bleu, source_ids
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig, log_softmax
from attn.optim import Adam
from attn.plot import plot_loss_curve, shown_path
from attn.train import TrainConfig, train
from attn.training.config import config_from_argv
from attn.translate import load_translator

B.set_backend("numpy")                                       # lessons run on the CPU
logging.getLogger("sacrebleu").setLevel(logging.ERROR)      # it warns that the toy text is pre-tokenised

# %% [markdown]
# ## 1. The data
#
# The toy corpus's size is printed below. Quick mode keeps only
# short sentences (at most 8 English tokens), which still exercise most of the
# grammar: `we called the big queen .` -> `ba fonamos ka regina granda tele .` drops
# the pronoun (the verb ending `-amos` says "we"), marks the past with `ba`, moves
# the adjective behind the noun and makes it agree, and splits "call" into
# `fon- ... tele`.

# %%
MAX_WORDS = 8 if QUICK else 25
N_TRAIN, N_VAL, N_TEST = (1500, 100, 100) if QUICK else (10_000, 300, 300)


def short(split, n):
    return [p for p in read_parallel(TOY_DIR, "en", "tk", split) if len(p[0].split()) <= MAX_WORDS][:n]


full_train = read_parallel(TOY_DIR, "en", "tk", "train")
print(f"the toy corpus: {len(full_train):,} training pairs of {min(len(s.split()) for s, _ in full_train)}-"
      f"{max(len(s.split()) for s, _ in full_train)} English tokens")
data_dir = OUT / "14_data"
run_dir = OUT / "14_run"
shutil.rmtree(run_dir, ignore_errors=True)                   # a fresh run, not a --resume
splits = {"train": short("train", N_TRAIN), "val": short("val", N_VAL), "test": short("test", N_TEST)}
data_dir.mkdir(parents=True, exist_ok=True)
for split, pairs in splits.items():
    for side, lang in ((0, "en"), (1, "tk")):
        (data_dir / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")
print(", ".join(f"{k} {len(v)}" for k, v in splits.items()), "pairs in", shown_path(data_dir))
for s, t in splits["train"][:3]:
    print(f"  {s}  ->  {t}")

# %% [markdown]
# ## 2. A training loop of your own
#
# Training is six lines repeated, each from an earlier lesson:
#
# 1. **a batch**: sentence pairs of similar length, padded, about `MAX_TOKENS`
#    positions in all (section 5.1; `attn.data.make_batches`, shuffled per epoch);
# 2. **forward** through lesson 9's `Transformer`, with dropout (its masks drawn from
#    a generator seeded by the step, so a run can be repeated exactly);
# 3. **the loss**: `cross_entropy` with label smoothing (lesson 11), which also
#    returns `dlogits`;
# 4. **backward**: `Transformer.backward` returns every parameter's gradient;
# 5. **an Adam step** with the warm-up schedule (lesson 11), times a constant factor;
# 6. **log** the loss.
#
# The model is far smaller than the paper's (Table 3's base model has 6 + 6 layers
# of width 512; the toy corpus needs much less), and the warm-up is short because
# the run is short. The factor is twice the rate of section 5.3: small post-norm
# models like a large learning rate, though too large a one stalls them. (Lesson 20
# trains all its variants at the paper's factor 1, and discusses how the one
# shared schedule enters every comparison.)

# %%
if QUICK:
    D_MODEL, D_FF, LAYERS, DROPOUT, WARMUP, STEPS, MAX_TOKENS, EVAL_EVERY = 32, 64, 1, 0.0, 200, quick_steps(500), 400, quick_steps(100)
else:
    D_MODEL, D_FF, LAYERS, DROPOUT, WARMUP, STEPS, MAX_TOKENS, EVAL_EVERY = 64, 256, 2, 0.1, 400, 2000, 1500, 250
SEED, LR_FACTOR, SMOOTHING, HEADS = 0, 2.0, 0.1, 4
PROBE = 20                                   # steps of our loop checked against the library's trainer below

vocab = Vocab.build([tokenize(s) for s, _ in splits["train"]] + [tokenize(t) for _, t in splits["train"]])


def model_config(smoothing):
    return TransformerConfig.preset("toy", vocab_size=len(vocab), d_model=D_MODEL, n_heads=HEADS, d_ff=D_FF,
                                    n_encoder_layers=LAYERS, n_decoder_layers=LAYERS, dropout=DROPOUT,
                                    label_smoothing=smoothing, warmup_steps=WARMUP)


# a sentence of n tokens takes n + 1 positions (EOS on the source, BOS on the target input)
train_enc = encode_pairs(splits["train"], vocab, max_len=model_config(SMOOTHING).max_len - 1)


def train_by_hand(smoothing, steps, log_every=100):
    """Our training loop: returns the model and the loss of every step."""
    cfg = model_config(smoothing)
    model = Transformer(cfg, seed=SEED)
    opt = Adam(model.params, cfg.d_model, cfg.warmup_steps, LR_FACTOR)
    losses, step, epoch = [], 0, 0
    while step < steps:
        for batch in make_batches(train_enc, MAX_TOKENS, shuffle=True, seed=SEED, epoch=epoch):   # 1. a batch
            rng = B.DeviceRNG(SEED * 1_000_003 + step)                      # this step's dropout masks
            logits, cache = model.forward(batch.src, batch.tgt_in, rng)     # 2. forward
            loss, dlogits = cross_entropy(logits, batch.tgt_out, smoothing)  # 3. the loss
            grads = model.backward(dlogits, cache)                           # 4. backward
            lr = opt.step(grads)                                             # 5. Adam
            losses.append(float(loss))                                       # 6. log
            step += 1
            if step % log_every == 0:
                print(f"  step {step:>5}  epoch {epoch}  loss {np.mean(losses[-log_every:]):.3f}  lr {lr:.2e}")
            if step == steps:
                break
        epoch += 1
    return model, losses


print(f"vocabulary {len(vocab)} words (both languages), {len(train_enc)} training pairs")
probe_model, probe_losses = train_by_hand(SMOOTHING, PROBE, log_every=PROBE)

# %% [markdown]
# ## 3. Handing over to `attn.train`
#
# `attn.train.train` is what the `attn-train` command runs. Its step is our six
# lines; around them it adds what a real run needs: evaluation on the validation set
# every `--eval-every` steps, checkpoints to resume from, a time budget, a progress
# bar, and snapshots of the parameters for averaging. We give it the same data,
# model, seed and schedule, and pass `--reference`, so what trains is exactly what you
# studied: `attn.model.Transformer` (lesson 9) and `attn.optim.Adam` (lesson 11).
# (Without the flag, `attn-train` runs their twins from `attn.fast` instead, which
# fuse some steps and train noticeably faster; `tests/test_fast.py` proves that they
# compute the same logits, gradients and updates as the readable classes to float
# rounding.) Before anything else we check the claim: after `PROBE` steps the
# trainer's parameters must be the ones our loop computed.

# %%
data_dir.mkdir(parents=True, exist_ok=True)
argv = ["--data", os.path.relpath(data_dir), "--out", os.path.relpath(run_dir), "--backend", "numpy", "--seed", str(SEED),
        "--d-model", str(D_MODEL), "--heads", str(HEADS), "--d-ff", str(D_FF), "--layers", str(LAYERS),
        "--dropout", str(DROPOUT), "--label-smoothing", str(SMOOTHING), "--warmup", str(WARMUP),
        "--lr-factor", str(LR_FACTOR), "--steps", str(STEPS), "--max-tokens", str(MAX_TOKENS),
        "--eval-every", str(EVAL_EVERY), "--average", "5", "--snapshot-every", str(min(50, STEPS // 10)),
        "--minutes", "0", "--bleu-sentences", "0", "--quiet", "--reference"]
print(" \\\n    ".join(textwrap.wrap("attn-train " + " ".join(argv), 78, break_on_hyphens=False)))
print(f"(the toy preset's default --lr-factor: {TrainConfig().with_recipe().lr_factor:g})")
probe_diff = {}


def compare_at_probe(state, trainer_model, seconds):
    if state.step == PROBE:
        probe_diff.update({k: float(np.abs(trainer_model.params[k] - probe_model.params[k]).max())
                           for k in probe_model.params})


metrics = train(config_from_argv(argv), on_step=compare_at_probe)
print(f"after {PROBE} steps, the trainer's parameters against our loop's: largest |difference| "
      f"{max(probe_diff.values()):.1e} over {len(probe_diff)} arrays")
print(f"attn.train: {metrics['steps']} steps in {metrics['train_seconds']:.1f} s of training, "
      f"{metrics['parameters']:,} parameters; validation loss {metrics['val_loss']:.3f} (label-smoothed), "
      f"perplexity {metrics['val_ppl']:.2f}")

# %% [markdown]
# The trainer wrote `checkpoint.npz` (the model, Adam's moments, the vocabulary, the
# loss history), `metrics.jsonl` and `metrics.json`. It also kept a snapshot of the
# parameters every `--snapshot-every` steps and, at the end, averaged the last
# `--average` of them into `averaged.npz`: section 6.1, "for the base models, we used
# a single model obtained by averaging the last 5 checkpoints". The loss curve, from
# the checkpoint's history:

# %%
arrays, meta = load_npz(run_dir / "checkpoint.npz")
train_losses = [float(x) for x in arrays["history/train_loss"]]
val_points = [(e["step"], e["val_loss"]) for e in meta["evals"]]
show_figure(plot_loss_curve(train_losses, val_points, OUT / "14_loss.png",
                            title=f"toy translator ({'quick' if QUICK else 'full'} mode): label-smoothed loss"),
            "14_loss.png")
V, eps = len(meta["vocab"]), 0.1
floor = -(1 - eps + eps / V) * np.log(1 - eps + eps / V) - (V - 1) * (eps / V) * np.log(eps / V)
print(f"training loss: first step {train_losses[0]:.2f} (log V = {np.log(V):.2f}), mean of the last 50 steps "
      f"{np.mean(train_losses[-50:]):.2f}, floor H(q) = {floor:.2f}; validation "
      + ", ".join(f"{s}: {v:.2f}" for s, v in val_points))
# What this run's curve shows (quick mode trains less than full mode, so say it from the numbers):
k_ = max(1, min(50, len(train_losses) // 20))
running = {s: float(np.mean(train_losses[max(0, s - k_):s])) for s, _ in val_points}
gaps = [v - running[s] for s, v in val_points]
print(f"in this run ({'quick' if QUICK else 'full'} mode, {len(train_losses)} steps) validation loss falls from "
      f"{val_points[0][1]:.2f} to {val_points[-1][1]:.2f}; it ends "
      + (f"{gaps[-1]:.2f} above the training loss's running mean" if gaps[-1] > 0 else
         f"{-gaps[-1]:.2f} below the training loss's running mean (dropout and label smoothing act in training only)")
      + ("; the two lines cross" if min(gaps) < 0 < max(gaps) else ""))

# %% [markdown]
# The first loss is near `log V`: an untrained model spreads its probability
# roughly evenly over the vocabulary (a little above it, as the initial logits are
# not exactly uniform). It cannot go to zero: with label smoothing the floor is the
# entropy of the smoothed target, `H(q)` (lesson 11). In full mode the validation
# loss sits below the training loss: training runs with dropout, evaluation without.
#
# ## 4. Greedy decoding and beam search
#
# `attn.translate.load_translator` gives back a model and its vocabulary; we load
# the averaged model, and the last one to compare. To translate, the source is
# encoded once; the decoder then produces one token at a time, feeding each back in
# (with the keys and values of earlier positions cached: lesson 15 builds that).
#
# * **Greedy** takes the most probable token at every step.
# * **Beam search** (built in lesson 15, `attn.decode.beam_search`; here we only use it)
#   keeps the `K = 4` best partial translations, and ranks finished
#   ones by $\log P(Y \mid X) / \mathit{lp}(Y)$ with $\mathit{lp}(Y) = ((5 + |Y|) / 6)^{\alpha}$,
#   $\alpha = 0.6$ (GNMT's length penalty; without it, every extra token lowers
#   `log P`, so search would favour short outputs).

# %%
last_model, trained_vocab = load_translator(run_dir / "checkpoint.npz")
model, _ = load_translator(run_dir / "averaged.npz")             # the average of the last 5 snapshots
assert list(trained_vocab.itos) == list(vocab.itos), "the trainer built another vocabulary than ours"
test = splits["test"]
src_rows = [source_ids(vocab, tokenize(s)) for s, _ in test]
S = max(map(len, src_rows))
src = np.full((len(test), S), PAD, dtype=np.int64)
for i, row in enumerate(src_rows):
    src[i, :len(row)] = row

greedy = greedy_decode(model, src)
beam = beam_search(model, src, beam_size=4, alpha=0.6)
beam1 = beam_search(model, src, beam_size=1, alpha=0.0)


def text(ids, width=None):
    t = " ".join(vocab.decode(ids))
    return t if width is None or len(t) <= width else t[:width - 3] + "..."


for i in range(6):
    print(f"en:     {test[i][0]}\nref:    {test[i][1]}\ngreedy: {text(greedy.tokens[i])}\n"
          f"beam 4: {text(beam.tokens[i])}\n")

# %% [markdown]
# ### BLEU
#
# `attn.evaluate.evaluate_bleu` translates and scores with sacrebleu's corpus BLEU
# (lesson 16 builds BLEU and explains what it counts; here we only use the score).
# A trivial baseline: output the English source unchanged. The two languages share
# almost no words (only the full stop and the comma), so copying scores nearly zero;
# the word-by-word dictionary of `data/baseline.py` does much better, but a lookup
# cannot reorder, agree or drop words.

# %%
refs = [t for _, t in test]
bleu_copy = corpus_bleu([s for s, _ in test], refs)
bleu_greedy, hyps_greedy = evaluate_bleu(model, vocab, test, beam_size=1)
bleu_beam, hyps_beam = evaluate_bleu(model, vocab, test, beam_size=4, alpha=0.6)
exact = {name: np.mean([tokenize(h) == tokenize(r) for h, r in zip(hyps, refs)]) for name, hyps in
         (("greedy", hyps_greedy), ("beam 4", hyps_beam))}
print(f"test BLEU on {len(test)} sentences: copy the source {bleu_copy:.1f}, greedy {bleu_greedy:.1f}, "
      f"beam 4 {bleu_beam:.1f}")
print(f"exactly right: greedy {exact['greedy']:.0%}, beam 4 {exact['beam 4']:.0%}")
bleu_last, _ = evaluate_bleu(last_model, vocab, test, beam_size=1)
print(f"greedy BLEU of the last model {bleu_last:.1f}, of the average of the last 5 snapshots {bleu_greedy:.1f}")

# %% [markdown]
# The average of the last snapshots is usually at least as good as the last model:
# it smooths out the step-to-step noise that a still-large learning rate leaves in
# the weights. The two BLEU scores of this run are printed above; how much
# averaging gains varies from run to run.
#
# ### Label smoothing and search
#
# Section 6.2 reports that label smoothing "hurts perplexity, as the model learns to
# be more unsure, but improves accuracy and BLEU score". Our loop trains a second
# model, identical in everything (data, seed, batches, steps) except `smoothing=0`,
# and we translate the test set with both last models (the smoothed one is the
# trainer's last checkpoint, not the average, so that both are one model at the same
# step), greedily and with beam 4. Beside BLEU: how many sentences beam and greedy
# translate differently, the outputs' length against the references', and how sure
# each model is of the tokens greedy picks.

# %%
plain_model, plain_losses = train_by_hand(0.0, STEPS, log_every=STEPS // 5)
ref_len = sum(len(tokenize(r)) for r in refs)


def search_table(m):
    g_bleu, g_hyps = evaluate_bleu(m, vocab, test, beam_size=1)
    b_bleu, b_hyps = evaluate_bleu(m, vocab, test, beam_size=4, alpha=0.6)
    g = greedy_decode(m, src)
    done = [len(t) < len(src_rows[i]) + 50 for i, t in enumerate(g.tokens)]   # ended with EOS, not the limit
    sure = np.mean([np.exp(log_prob_under(m, i, t, d) / (len(t) + d)) for i, (t, d) in enumerate(zip(g.tokens, done))])
    return dict(greedy=g_bleu, beam=b_bleu, differ=sum(a != b for a, b in zip(g_hyps, b_hyps)),
                greedy_len=sum(len(tokenize(h)) for h in g_hyps) / ref_len,
                beam_len=sum(len(tokenize(h)) for h in b_hyps) / ref_len, sure=sure)


def log_prob_under(m, i, tokens, finished=True):
    """log P(tokens [+ EOS] | source i) under model m, by one teacher-forced forward pass."""
    tgt = list(tokens) + ([EOS] if finished else [])
    logits, _ = m.forward(np.array([src_rows[i]]), np.array([[BOS] + tgt[:-1]]))
    lp = log_softmax(logits.astype(np.float64))[0]
    return float(lp[np.arange(len(tgt)), tgt].sum())


search = {"smoothing 0.1": search_table(last_model), "no smoothing": search_table(plain_model)}
print(f"{'':<14} {'greedy BLEU':>12} {'beam 4 BLEU':>12} {'beam != greedy':>15} {'length greedy':>14} "
      f"{'length beam':>12} {'P(token), greedy':>17}")
for name, r in search.items():
    print(f"{name:<14} {r['greedy']:>12.1f} {r['beam']:>12.1f} {r['differ']:>10} of {len(test)} "
          f"{r['greedy_len']:>14.2f} {r['beam_len']:>12.2f} {r['sure']:>17.3f}")
smooth_gain = {how: search["smoothing 0.1"][how] - search["no smoothing"][how] for how in ("beam", "greedy")}
beam_gain = {name: r["beam"] - r["greedy"] for name, r in search.items()}
print(f"label smoothing changes BLEU by {smooth_gain['beam']:+.1f} with beam search, {smooth_gain['greedy']:+.1f} "
      f"with greedy decoding; beam search changes it by {beam_gain['smoothing 0.1']:+.1f} for the smoothed model, "
      f"{beam_gain['no smoothing']:+.1f} for the unsmoothed one")

# %% [markdown]
# (Lengths are the outputs' total tokens over the references'; "P(token)" is the
# geometric mean probability the model gives greedy's own tokens.)
#
# Read the table with this run's numbers (the line under it sums them up). The
# unsmoothed model is *surer* of the tokens it picks, as lesson 11 predicted: the
# smoothed one was trained to keep some probability for the other words. Beam
# search changes a handful of translations and raises BLEU for both models. Greedy
# outputs tend to run longer than the references: once greedy has started to repeat
# a token (`e e e`), it cannot go back, while beam search compares whole outputs, and
# a looping output's `log P / lp` is low. Compare the two models with beam search,
# the way the paper decodes: section 6.2's "improves ... BLEU score" is the claim.
#
# How much of this is the seed, or the machine? We trained these two models with
# other seeds while writing the lesson (change `SEED` to try): the smoothed model was
# always the less sure one and beam search never lost BLEU to greedy. Which model
# came out ahead did not hold still. With greedy decoding the lead changed sign from
# seed to seed. With beam search the smoothed model won on every seed on one
# machine, and lost with the same seed on another: the same code and
# data, but its BLAS library summed the float32 products in another order, and
# that is enough to send 500 steps of training down a different path. At this size
# the BLEU difference between the two models is within that noise: section 6.2's
# gain is a claim about large models trained to convergence, and it needs more
# than one small run to see. The check below asserts only what held on every seed
# and machine, and in quick mode nothing about the models' quality at all: a model
# trained for a few hundred steps (or a tenth of them, `ATTN_QUICK_WEAK=1`) may not
# have got far enough for any of it, and the table then shows so.
#
# Full mode trains larger models for longer, and both come close to translating this
# easy test set perfectly: then beam search and greedy decoding agree on almost
# every sentence and the BLEU differences shrink to noise (the table shows it when
# you run it). Search and smoothing matter where the model is still unsure, which is
# why quick mode stops early on purpose. The smoothed model is still the less sure
# one.
#
# ### What beam search optimises
#
# The decoders return a score per sentence: greedy the sum of the log-probabilities
# of its tokens, beam search the length-penalised `log P / lp`. We can recompute both
# from scratch with one teacher-forced forward pass per sentence (the decoder reads
# the whole output at once, as in training), which checks that incremental decoding
# with its cache computes the same probabilities as `Transformer.forward`. Then we
# put greedy's output on beam search's scale, `log P / lp`, and compare.

# %%
def log_prob(i, tokens, finished=True):
    """log P(tokens [+ EOS] | source i) by one teacher-forced forward pass."""
    tgt = list(tokens) + ([EOS] if finished else [])
    logits, _ = model.forward(np.array([src_rows[i]]), np.array([[BOS] + tgt[:-1]]))
    lp = log_softmax(logits.astype(np.float64))[0]
    return float(lp[np.arange(len(tgt)), tgt].sum())


# Section 6.1: the output may be at most "input length + 50" tokens; an output that
# reaches the limit stops without an EOS. |Y| counts the EOS when there is one.
limit = [len(r) + 50 for r in src_rows]
rescored_greedy = np.array([log_prob(i, t, len(t) < limit[i]) for i, t in enumerate(greedy.tokens)])
rescored_beam = np.array([log_prob(i, t, len(t) < limit[i]) for i, t in enumerate(beam.tokens)])
lens_g = np.array([len(t) + (len(t) < limit[i]) for i, t in enumerate(greedy.tokens)])
lens_b = np.array([len(t) + (len(t) < limit[i]) for i, t in enumerate(beam.tokens)])
beam_obj = rescored_beam / length_penalty(lens_b, 0.6)
greedy_obj = rescored_greedy / length_penalty(lens_g, 0.6)
err_g = np.abs(rescored_greedy - np.array(greedy.scores)).max()
err_b = np.abs(beam_obj - np.array(beam.scores)).max()
print(f"decoder scores vs a fresh forward pass: greedy max |diff| {err_g:.1e}, beam {err_b:.1e}")
margin = beam_obj - greedy_obj
differ = [i for i in range(len(test)) if beam.tokens[i] != greedy.tokens[i]]
print(f"beam 4 and greedy differ on {len(differ)} of {len(test)} sentences; on those, log P / lp improves by "
      f"{margin[differ].mean() if differ else 0:.3f} on average; smallest margin over all sentences "
      f"{margin.min():+.2e}")
for i in differ[:3]:
    print(f"  {test[i][0]}\n    greedy {text(greedy.tokens[i], 45)!r:<45} log P {rescored_greedy[i]:7.3f}  "
          f"/ lp {greedy_obj[i]:7.3f}\n    beam   {text(beam.tokens[i], 45)!r:<45} log P {rescored_beam[i]:7.3f}  "
          f"/ lp {beam_obj[i]:7.3f}")

# %% [markdown]
# Where the two differ, beam search usually found an output with a better
# length-penalised score, often one that does not run away into repetitions or that
# keeps a word greedy dropped. Not always a better *translation*: search finds what
# the model prefers, and a half-trained model sometimes prefers something short and
# wrong.
#
# But "beam search is never worse than greedy" is *not* a theorem. The beams are
# ranked by their raw `log P` while they grow, so greedy's prefix can fall out of the
# top `K`. When to stop matters too. Stopping a sentence as soon as it has `K`
# finished hypotheses (as many implementations do) lets a few short, unlikely ones
# (`... ne .`, "finished" the moment an EOS ranks among a step's top `K`) end the
# search while the best one, longer, is still growing. `attn.decode.beam_search`
# stops only when no live beam can still beat the best finished one: a beam's
# `log P` only falls as it grows and `lp` only rises, so `log P / lp(limit)` bounds
# what it can still reach. Here are the sentences, if any, where beam 4 lost to
# greedy on its own objective, with what a wider beam finds:

# %%
worse = [i for i in range(len(test)) if margin[i] < -1e-4]
print(f"beam 4 worse than greedy on log P / lp: {len(worse)} of {len(test)} sentences")
for i in worse[:3]:
    wide = beam_search(model, src[i:i + 1], beam_size=16, alpha=0.6)
    print(f"  {test[i][0]}\n    greedy  {text(greedy.tokens[i], 50)!r:<50} {greedy_obj[i]:7.3f}\n"
          f"    beam 4  {text(beam.tokens[i], 50)!r:<50} {beam_obj[i]:7.3f}\n"
          f"    beam 16 {text(wide.tokens[0], 50)!r:<50} {wide.scores[0]:7.3f}")

# %% [markdown]
# Such misses are rare, but when they happen they can be large, and they are why
# beam 4's BLEU can come out a little *below* greedy's on a well-trained model.
#
# **Beam size 1 is greedy** when there is no length penalty ($\alpha = 0$): with one
# beam, keeping "the best candidate" at each step is taking the argmax, and once
# greedy's output has finished, no live beam can beat it (its `log P` is already
# lower and can only fall): the tokens must be identical. (With $\alpha > 0$ one beam
# may go on past greedy's EOS to a longer output that scores better.)

# %%
same = sum(a == b for a, b in zip(beam1.tokens, greedy.tokens))
print(f"beam_search(beam_size=1) == greedy_decode on {same} of {len(test)} sentences")

fig, ax = plt.subplots(1, 3, figsize=(17, 4.2))
ax[0].bar(["copy source", "greedy", "beam 4"], [bleu_copy, bleu_greedy, bleu_beam],
          color=["tab:gray", "tab:blue", "tab:orange"])
for i, v in enumerate([bleu_copy, bleu_greedy, bleu_beam]):
    ax[0].text(i, v + 1, f"{v:.1f}", ha="center")
ax[0].set_ylabel("test BLEU"); ax[0].set_ylim(0, 120)
ax[0].set_title(f"{len(test)} test sentences ({'quick' if QUICK else 'full'} mode)")
lo = min(greedy_obj.min(), beam_obj.min()) - 0.1
ax[1].plot([lo, 0], [lo, 0], "k:", lw=1)
ax[1].scatter(greedy_obj, beam_obj, s=12, c=["tab:red" if i in differ else "tab:blue" for i in range(len(test))])
ax[1].set_xlabel("greedy: log P / lp"); ax[1].set_ylabel("beam 4: log P / lp")
ax[1].set_title("per sentence (red: outputs differ; above the line: beam better)")
xs = np.arange(2)
for k, (how, color) in enumerate((("greedy", "tab:blue"), ("beam", "tab:orange"))):
    vals = [search[name][how] for name in search]
    ax[2].bar(xs + (k - 0.5) * 0.38, vals, 0.38, color=color, label="greedy" if how == "greedy" else "beam 4")
    for x, v in zip(xs + (k - 0.5) * 0.38, vals):
        ax[2].text(x, v - 2, f"{v:.1f}", ha="center", va="top", rotation=90, fontsize=8, color="white")
ax[2].set_xticks(xs, list(search)); ax[2].set_ylim(0, 125); ax[2].legend(loc="upper center", ncol=2)   # above any bar
ax[2].set_ylabel("test BLEU"); ax[2].set_title("label smoothing and beam search (last model)")
fig.tight_layout(); show_figure(fig, "14_greedy_vs_beam.png")

# %% [markdown]
# The panel of test BLEU bars sets the two searches against copying the source. The
# scatter of log-probabilities has one point per test sentence: blue points on the diagonal
# are sentences where beam and greedy agree, red points are where they differ, nearly all
# above the line. The panel on label smoothing and beam search decodes the two last models of
# the smoothing comparison both ways. (On a wide screen the three stand side by side; on a
# phone, one under the other, in this order.)
#
# To translate your own sentences with this model:
# `attn-translate --checkpoint lessons/out/14_run/averaged.npz --beam 4 "we called the big queen ."`
# Lessons 17 and 18 look inside the *last* model of this run, `14_run/checkpoint.npz`
# (the average of snapshots is not a model that was ever trained as such): they
# reuse it when `ATTN_CHECKPOINT=lessons/out/14_run/checkpoint.npz` is set, and
# lesson 18 also finds it there by itself.
#
# ## 5. Real text in twenty minutes
#
# The toy corpus is learned to the last word in minutes. Real text is not: Multi30k's
# German-English image captions (Elliott et al. 2016) hold tens of thousands of pairs,
# and twenty minutes on two CPU cores are a few passes over them. The model is still
# improving fast when the budget ends, and the recipe for that regime is not the
# paper's, which trained for hours on eight GPUs. The runs recorded in
# `benchmarks/multi30k/` (commands and tables in `benchmarks/RESULTS.md`, "A recipe
# for a small corpus") each changed one thing, and each choice was made on the
# validation split; the test split was scored once, with the final recipe.
#
# **Fewer, more frequent pieces.** A BPE vocabulary (lesson 13) of half the size cuts
# rare words into pieces the corpus shows many times over, and the output layer, a
# third of the step's work here, shrinks with it.
#
# **Smaller batches.** Halving the tokens per batch about doubles the optimizer's
# steps in the same minutes. Far from convergence, two half-sized steps take the model
# further than one full one.
#
# **A cooldown.** The paper's rate falls with the inverse square root of the step: at
# the end of a short run it is still more than half its peak. `attn-train --cooldown F`
# lets it fall linearly to zero over the last fraction `F` of the budget
# (`attn.optim.cooldown_scale`), so that the last checkpoint is a settled one. The
# paper's remedy for the same noise, averaging the last checkpoints (section 6.1), did
# as well here; the trainer keeps whichever has the lower validation loss.
#
# **Search without loops.** A half-trained model's greedy output repeats itself where
# it is unsure ("snow snow snow"). Beam search with a stronger length penalty than the
# paper's, and blocking every token that would repeat an n-gram the hypothesis already
# holds (`no_repeat_ngram`, `attn.decode.repeated_ngrams`), remove the loops.
#
# **The block.** These runs used the paper's block. Lesson 28 measures the changes of today's
# models on the same corpus, at the same minutes, and `--preset small` trains the one that won
# there: rotary positions.

# %%
import json
from pathlib import Path

import attn
from attn.decode import repeated_ngrams
from attn.optim import cooldown_scale, noam_lr

RECORDED = Path(attn.__file__).resolve().parents[1] / "benchmarks" / "multi30k"
RUNS = {  # folder: (what changed, minutes, vocabulary, tokens per batch, cooldown)
    "vocab-8000-10min": ("before: 8,000 pieces, 4,096-token batches", 10, 8000, 4096, 0.3),
    "vocab-4000-10min": ("4,000 pieces", 10, 4000, 4096, 0.3),
    "batch-2048-10min": ("4,000 pieces, 2,048-token batches", 10, 4000, 2048, 0.3),
    "paper-schedule": ("before: the paper's schedule, greedy", 20, 8000, 4096, 0.0),
    "recipe": ("after: the small-corpus recipe", 20, 4000, 2048, 0.3),
}
runs = {}
for name, (label, minutes, vocab, tokens, cooldown) in RUNS.items():
    folder = RECORDED / name
    config = json.loads((folder / "config.json").read_text())
    train_cfg = config["train"]
    assert (train_cfg["minutes"], config["vocab_size"], train_cfg["max_tokens"], train_cfg.get("cooldown") or 0.0) == \
        (minutes, vocab, tokens, cooldown), f"{name}: the recorded run is not the one described"
    runs[name] = dict(label=label, minutes=minutes, cooldown=cooldown, warmup=config["model"]["warmup_steps"],
                      evals=[json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()],
                      final=json.loads((folder / "metrics.json").read_text()),
                      hyps=(folder / "test_translations.txt").read_text(encoding="utf-8").splitlines())


def repeats_a_4gram(text):
    words = text.split()
    grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    return len(grams) != len(set(grams))


for name, r in runs.items():
    f, e = r["final"], r["evals"][-1]
    r["loops"] = sum(map(repeats_a_4gram, r["hyps"]))
    print(f"{r['label']:<45} {r['minutes']:>2} min: {f['steps']:>5} steps, {f['tokens_per_second']:>6,.0f} tokens/s, "
          f"validation BLEU {e['val_bleu']:.1f} (greedy, first 200)")
before, after = runs["paper-schedule"], runs["recipe"]
for r in (before, after):
    f = r["final"]
    print(f"{r['label']}: test BLEU {f['test_bleu']:.1f}, lower-cased {f['test_bleu_lc']:.1f} "
          f"({'beam %d, alpha %g, no repeated %d-gram' % (f['beam'], f['alpha'], f['no_repeat_ngram']) if f['beam'] > 1 else 'greedy'}); "
          f"{r['loops']} of {len(r['hyps'])} test translations repeat a 4-gram of words")

h = np.array([[7, 8, 9, 7, 8]])                    # ... 7 8 9 7 8: a 9 now would repeat "7 8 9"
rows, banned = repeated_ngrams(h, 3)
print(f"repeated_ngrams({h.tolist()[0]}, 3) bans token {banned.tolist()} in row {rows.tolist()}")

fig, ax = plt.subplots(1, 3, figsize=(18, 5.2))
for name, color in (("paper-schedule", "tab:blue"), ("recipe", "tab:orange")):
    r = runs[name]
    n, w = r["final"]["steps"], r["warmup"]
    steps = np.arange(1, n + 1)
    lr = [noam_lr(s, 256, w, np.sqrt(w / 2000)) * cooldown_scale((s - 1) / n, r["cooldown"]) for s in steps]
    ax[0].plot(steps, lr, color=color, label=r["label"])
for k, (names, title) in enumerate(((["vocab-8000-10min", "vocab-4000-10min", "batch-2048-10min"], "10-minute runs"),
                                    (["paper-schedule", "recipe"], "20-minute runs"))):
    for name in names:
        e = runs[name]["evals"]
        ax[k + 1].plot([x["train_seconds"] / 60 for x in e], [x["val_bleu"] for x in e], "o-", label=runs[name]["label"])
    ax[k + 1].set_xlabel("minutes of training"); ax[k + 1].set_ylabel("val BLEU (greedy, first 200)")
    ax[k + 1].set_title(title); ax[k + 1].legend(loc="lower right", fontsize=9)
ax[0].set_xlabel("step"); ax[0].set_ylabel("learning rate"); ax[0].legend(fontsize=9)
ax[0].set_title("the 20-minute runs' schedules")
fig.suptitle("Multi30k German-English on two CPU cores")
fig.tight_layout(); show_figure(fig, "14_small_corpus_recipe.png")

# %% [markdown]
# The schedules' panel draws the learning rate of the two 20-minute runs, each over its own
# steps: the recipe takes about twice as many, warms up for the same share of them and cools
# down at the end. The panel of 10-minute runs holds the runs that chose the vocabulary and
# the batch size, one change at a time. The panel of 20-minute runs draws validation BLEU of
# the run before and the run after against the minutes they trained.
#
# ## Check
#
# These fail if training, decoding or scoring were broken: a trainer whose step is
# not our six lines, a model that did not learn (BLEU near the copy baseline; full
# mode: quick mode's few hundred steps make no promise of how far a model gets, and
# its figures are only printed),
# decoder scores that disagree with the model's own forward pass (a bad cache), a
# beam search whose objective is not what it claims, or a one-beam search (without
# length penalty) that is not greedy; and if label smoothing stopped making the model
# less sure (full mode), as the table of "Label smoothing and search" shows.

# %%
assert probe_diff and max(probe_diff.values()) < 1e-6, f"attn.train's first {PROBE} steps are not our loop's"
smooth, plain = search["smoothing 0.1"], search["no smoothing"]
if not QUICK:                                         # how good the trained models are: full mode's claims
    assert np.mean(train_losses[-50:]) < 0.5 * train_losses[0], "the training loss must fall"
    assert plain["sure"] > smooth["sure"] + 0.05, f"smoothing should make the model less sure: {smooth['sure']:.3f} " \
                                                  f"vs {plain['sure']:.3f} without"
    assert plain["differ"] > 0 and smooth["differ"] > 0, "beam search should change some translations"
    assert bleu_greedy > bleu_copy + 20 and bleu_greedy > 25, f"greedy BLEU {bleu_greedy:.1f} should beat copying"
    assert bleu_beam > bleu_copy + 20, f"beam BLEU {bleu_beam:.1f} should beat copying"
    # beam search is a heuristic (see above): not worse than greedy on its own objective
    # for the great majority of sentences (one bad miss can outweigh many small gains,
    # so we do not assert the average)
    assert len(worse) <= 0.05 * len(test), f"beam 4 lost to greedy on {len(worse)} of {len(test)} sentences"
assert err_g < 1e-3 and err_b < 1e-3, "decoder scores must match a teacher-forced forward pass"
assert same == len(test), "beam search with one beam must be greedy decoding"
assert banned.tolist() == [9] and rows.tolist() == [0], "repeated_ngrams must ban the token that repeats a 3-gram"
assert after["loops"] == 0 and before["loops"] > 0, "blocked 4-grams of pieces must leave no repeated 4-gram of words"
assert after["final"]["test_bleu_lc"] > before["final"]["test_bleu_lc"], "the recipe must beat the run before it"
assert np.allclose(beam1.scores, greedy.scores, rtol=0, atol=1e-4), "one beam's score (alpha 0) must be greedy's log P"
print(f"Check passed: our loop == attn.train for {PROBE} steps; label smoothing {smooth_gain['beam']:+.1f} BLEU "
      f"with beam search; beam search {beam_gain['smoothing 0.1']:+.1f} and {beam_gain['no smoothing']:+.1f}; "
      f"loss {train_losses[0]:.2f} -> "
      f"{np.mean(train_losses[-50:]):.2f}; BLEU greedy "
      f"{bleu_greedy:.1f}, beam {bleu_beam:.1f}, copying {bleu_copy:.1f}; decoder scores match forward "
      f"({max(err_g, err_b):.0e}); beam 4 >= greedy on log P / lp for {len(test) - len(worse)} of {len(test)} "
      f"sentences (mean gain {margin.mean():.3f}); beam 1 == greedy.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. Name the six lines of a training step. What does `attn.train` add around them,
#    and how did the lesson check that its step is the same?
#
#    <details><summary>Answer</summary>
#
#    A batch; the forward pass; the loss with `dlogits`; the backward pass; an Adam step
#    with the schedule; a log line. `attn.train` adds the batching by length, checkpoints
#    and their averaging, evaluation, dropout seeds per step and resuming; the lesson ran
#    its own loop and the library's from the same start and compared the results, which
#    were the same.
#
#    </details>
#
# 2. Why can a model's greedy translations run long (look at the table's lengths: in
#    this run, whose did?), and why does beam search repair much of that?
#
#    <details><summary>Answer</summary>
#
#    A greedy decoder never takes back a word: once it takes a wrong turn or misses the
#    end-of-sentence token it keeps going, repeating or adding words, until the length
#    limit (the table's lengths show which model did it in this run). Beam search keeps
#    several candidates and ranks finished ones by their whole probability, so a
#    translation that ends at the right place wins over a long one that had one likely
#    word at an early step. Beam search is built in lesson 15.
#
#    </details>
#
# 3. Why is beam search with one beam and no length penalty exactly greedy decoding,
#    but not with $\alpha > 0$?
#
#    <details><summary>Answer</summary>
#
#    With one beam the search keeps the single most probable continuation at every step,
#    which is greedy decoding, and with $\alpha = 0$ the length penalty is
#    $\mathit{lp}(Y) = 1$, so the ranking of finished hypotheses is by probability alone,
#    as greedy's. With $\alpha > 0$ the ranking divides by $\mathit{lp}(Y)$, so a
#    finished short hypothesis can lose to a longer one the greedy path would not have
#    chosen, and the outputs may differ.
#
#    </details>

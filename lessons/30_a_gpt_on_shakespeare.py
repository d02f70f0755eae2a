# %% [markdown]
# # Lesson 30: a GPT on Shakespeare
#
# Lesson 24 built the decoder-only language model and trained it on the toy language's short
# sentences. This lesson trains the same model, the library's (`n_encoder_layers=0`), on real
# text: tiny Shakespeare, one token a character, as nanoGPT's `shakespeare_char` does. It
# follows the validation loss against the minutes of training (beside the same model in
# PyTorch, where PyTorch is installed), reads what the model writes at
# each stage, shows what top-p (nucleus) sampling does to one distribution, and counts what the
# key/value cache holds for every token the model writes.
#
# Full mode trains nanoGPT's CPU shape (four layers, four heads, width 128, context 64, a batch
# of 12 windows) for a fixed number of minutes of the processor's time, as `attn-train --task lm
# --preset shakespeare_char --minutes` does with the clock's; quick mode trains a smaller model
# for a fixed number of steps, and its text is still mostly noise. The minutes are CPU minutes,
# the time this process computed (`time.process_time`), so that another program sharing the
# machine does not stretch them; with one BLAS thread they are the minutes an idle core takes.

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import math
import time

import numpy as np

from attn import backend as B
from attn.data import BOS, EOS, PAD, UNK, char_vocab, decode_text, encode_text, read_text
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig
from attn.optim import Adam
from attn.sample import Sampler, distribution, generate
from attn.training.config import DEFAULT_TEXT
from attn.training.lm import VAL_FRACTION, validate, val_batches, window_batch

B.set_backend("numpy")                                       # lessons run on the CPU
T0 = time.time()

# %% [markdown]
# ## 1. The text, one token a character
#
# The first nine tenths of the text train, the last tenth validates (nanoGPT's split). The
# vocabulary is every character the text holds, after the library's special tokens. A training
# step reads a batch of windows at random places of the training text; the model predicts every
# character of a window from those before it, so one window of length $T$ is $T$ predictions.

# %%
text = read_text(DEFAULT_TEXT)
cut = int(len(text) * (1 - VAL_FRACTION))
vocab = char_vocab(text)
train_ids = np.asarray(encode_text(text[:cut], vocab, True), dtype=np.int64)
val_ids = np.asarray(encode_text(text[cut:], vocab, True), dtype=np.int64)
V = len(vocab)
counts = np.bincount(train_ids, minlength=V).astype(np.float64)
unigram_loss = float(-(counts[counts > 0] / counts.sum() * np.log(counts[counts > 0] / counts.sum())).sum())
print(f"{DEFAULT_TEXT.name}: {len(text):,} characters, {V - 4} distinct (+4 specials); "
      f"{train_ids.size:,} train, {val_ids.size:,} validate")
print(f"a model that knows only each character's frequency: {unigram_loss:.3f} nats a character; "
      f"uniform over the vocabulary: {math.log(V):.3f}")

# %% [markdown]
# ## 2. Training: the validation loss against the minutes
#
# The model is lesson 24's, wider and deeper; the optimiser the paper's Adam with its warm-up,
# at nanoGPT's peak rate. Every few steps the lesson measures the validation loss (on an evenly
# spread set of validation windows) and writes a sample, from the same prompt and the same seed
# each time, so that what changes between the samples is the model.

# %%
if QUICK:
    D, LAYERS, HEADS, CONTEXT, BATCH = 64, 2, 4, 32, 8
    STEPS, MINUTES, N_EVALS, SAMPLE_CHARS = quick_steps(200), None, 4, 60
else:                                              # nanoGPT's shakespeare_char on a CPU
    D, LAYERS, HEADS, CONTEXT, BATCH = 128, 4, 4, 64, 12
    STEPS, MINUTES, N_EVALS, SAMPLE_CHARS = None, 6.0, 6, 200
WARMUP, PEAK_LR = 100, 1e-3
cfg = TransformerConfig(vocab_size=V, d_model=D, n_heads=HEADS, d_ff=4 * D, n_encoder_layers=0,
                        n_decoder_layers=LAYERS, dropout=0.0, max_len=CONTEXT)
model = Transformer(cfg, seed=0)
initial = {k: v.copy() for k, v in model.params.items()}
LR_FACTOR = PEAK_LR * math.sqrt(D * WARMUP)                 # section 5.3's schedule, peaking at PEAK_LR
opt = Adam(model.params, d_model=D, warmup_steps=WARMUP, lr_factor=LR_FACTOR)
val = val_batches(val_ids, CONTEXT)[: 2 if QUICK else 16]
PROMPT = "ROMEO:\n"
prompt_ids = encode_text(PROMPT, vocab, True)
BANNED = [PAD, BOS, EOS, UNK]


def sample(n, sampler=Sampler(temperature=0.8), seed=0, lm=None):
    return decode_text(generate(lm or model, prompt_ids, n, sampler, seed, banned=BANNED), vocab, True)


def attn_step(batch):
    logits, cache = model.forward(None, batch.tgt_in)
    loss, dlogits = cross_entropy(logits, batch.tgt_out, 0.0)
    opt.step(model.backward(dlogits, cache))


def attn_evaluate(step, seconds):
    return dict(step=step, minutes=seconds / 60, val_loss=validate(model, val)["val_loss"], text=sample(SAMPLE_CHARS))


def train(take_step, evaluate):
    """Steps on the same batches (the same seed) until STEPS steps or MINUTES of CPU time, evaluating
    N_EVALS times; returns the evaluations and the steps and CPU seconds trained."""
    rng = np.random.default_rng(0)
    history, step, trained, next_eval = [evaluate(0, 0.0)], 0, 0.0, (MINUTES or 0) * 60 / N_EVALS
    every = max(1, STEPS // N_EVALS) if STEPS else None
    while (STEPS and step < STEPS) or (MINUTES and trained < MINUTES * 60):
        batch = window_batch(train_ids, rng.integers(0, train_ids.size - CONTEXT, BATCH), CONTEXT)
        t = time.process_time()
        take_step(batch)
        trained += time.process_time() - t
        step += 1
        if (step % every == 0 or step == STEPS) if STEPS else trained >= next_eval:
            history.append(evaluate(step, trained))
            next_eval += (MINUTES or 0) * 60 / N_EVALS
    if history[-1]["step"] != step:
        history.append(evaluate(step, trained))
    return history, step, trained


history, step, trained = train(attn_step, attn_evaluate)
print(f"attn: {model.num_parameters():,} parameters; {step} steps of {BATCH} windows of {CONTEXT} characters "
      f"in {trained / 60:.2f} CPU minutes of training ({1000 * trained / step:.0f} ms a step)")
for h in history:
    print(f"step {h['step']:>5}  {h['minutes']:6.2f} CPU min  validation loss {h['val_loss']:.3f} "
          f"({h['val_loss'] / math.log(2):.2f} bits a character)")

# %% [markdown]
# ### Beside PyTorch
#
# Where PyTorch is installed, the same model in PyTorch (`attn.bench.twin`, the benchmark's twin:
# fused attention, autograd) trains from attn's initial weights on the same batches in the same
# order, with Adam and the same schedule, for the same budget; its validation loss is measured by
# attn's code on a copy of its weights. Without PyTorch the lesson trains attn's model alone; the
# recorded comparison, at equal steps and equal minutes, is `python -m attn.bench --quality
# --task lm`'s in `benchmarks/RESULTS.md`.

# %%
from attn.bench.twin import torch_available

torch_history = None
if torch_available():
    import torch
    from attn.bench.twin import torch_adam, torch_loss, torch_transformer
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OPENBLAS_NUM_THREADS"]))        # as many threads as NumPy's BLAS
    torch.manual_seed(0)
    twin = torch_transformer(cfg)
    twin.load_attn_params(initial)
    torch_opt, _ = torch_adam(twin, fused=False)
    schedule = Adam({}, d_model=D, warmup_steps=WARMUP, lr_factor=LR_FACTOR)

    def torch_step(batch):
        for group in torch_opt.param_groups:
            group["lr"] = schedule.lr()
        schedule.t += 1
        torch_opt.zero_grad()
        torch_loss(twin(None, torch.as_tensor(batch.tgt_in)), torch.as_tensor(batch.tgt_out), 0.0).backward()
        torch_opt.step()

    def torch_evaluate(step, seconds):
        copy = Transformer(cfg, params=twin.attn_params())
        return dict(step=step, minutes=seconds / 60, val_loss=validate(copy, val)["val_loss"],
                    text=sample(SAMPLE_CHARS, lm=copy))

    torch_history, torch_steps, torch_trained = train(torch_step, torch_evaluate)
    print(f"PyTorch {torch.__version__}: {torch_steps} steps in {torch_trained / 60:.2f} CPU minutes "
          f"({1000 * torch_trained / torch_steps:.0f} ms a step)")
    for a, t in zip(history, torch_history):
        print(f"step {t['step']:>5}  {t['minutes']:6.2f} CPU min  validation loss {t['val_loss']:.3f}"
              + (f"  (attn at the same step: {a['val_loss']:.3f})" if a["step"] == t["step"] else ""))
else:
    print("PyTorch is not installed here: attn's curve alone (benchmarks/RESULTS.md has both)")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot([h["minutes"] for h in history], [h["val_loss"] for h in history], "o-", label="attn (NumPy, by hand)")
if torch_history:
    ax.plot([h["minutes"] for h in torch_history], [h["val_loss"] for h in torch_history], "s-",
            label="PyTorch (autograd), the same model and batches")
ax.axhline(unigram_loss, color="gray", ls="--", label="character frequencies alone")
ax.set_xlabel("CPU minutes of training"); ax.set_ylabel("validation loss (nats a character)")
ax.set_title("a GPT on tiny Shakespeare"); ax.legend()
fig.tight_layout(); show_figure(fig, "30_loss_minutes.png")

# %% [markdown]
# ## 3. What the model writes at each stage
#
# The samples below continue the same prompt with the same seed and temperature after each
# evaluation. The untrained model draws characters almost uniformly; then it learns the
# characters' frequencies (spaces and vowels), then the shape of the play's text (names in
# capitals followed by a colon, line ends), then words; spelling and sense come last.

# %%
for h in history:
    print(f"--- step {h['step']}, validation loss {h['val_loss']:.3f}")
    print(PROMPT + h["text"])
if torch_history:
    print(f"--- PyTorch's model at step {torch_history[-1]['step']}, validation loss {torch_history[-1]['val_loss']:.3f}")
    print(PROMPT + torch_history[-1]["text"])

# %% [markdown]
# ## 4. What top-p does to a distribution
#
# Top-k keeps a fixed number of tokens whatever the distribution looks like. Top-p (nucleus
# sampling, Holtzman et al. 2020) keeps the **smallest set of the most probable tokens whose
# probability reaches p**, and renormalises: after a confident prefix the set is small, after
# an open one it is large. The figure is drawn from `attn.sample.distribution`, the code
# `attn-generate --top-p` draws from, on the trained model's distribution of the character
# after the prompt.

# %%
logp, _, _ = model.decode_positions(np.asarray([prompt_ids]), model.start_decoding(None, None))
after = B.to_host(logp[0, -1]).astype(np.float64)
after[BANNED] = -np.inf
full = distribution(after)
order = np.argsort(-full, kind="stable")
TOP_PS = (0.5, 0.9, 0.99)
kept = {p: distribution(after, top_p=p) for p in TOP_PS}
sizes = {p: int((q > 0).sum()) for p, q in kept.items()}
SHOW = min(sizes[TOP_PS[-1]] + 3, int((full > 0).sum()))
label = [repr(vocab.itos[i])[1:-1] for i in order]
fig, ax = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
ax[0].bar(range(SHOW), full[order[:SHOW]], color="lightgray", label="the model's distribution")
for p, color in zip(TOP_PS, ("tab:red", "tab:orange", "tab:blue")):
    ax[0].axvline(sizes[p] - 0.5, color=color, ls="--", label=f"top-p {p}: keeps {sizes[p]}")
def label_ticks(axis, n, most=14):
    """Every character's label when ``most`` fit under the panel, else every k-th (a weak model spreads
    wide); ``most`` is what a phone's narrow column fits, where the panels stand one under the other."""
    step = -(-n // most)
    axis.set_xticks(range(0, n, step)); axis.set_xticklabels(label[:n:step], fontsize=7)


label_ticks(ax[0], SHOW)
ax[0].set_ylabel("probability"); ax[0].set_title(f"the character after {PROMPT.strip()!r} and a line end")
near = min(sizes[0.9] + 4, SHOW)
ax[1].bar(np.arange(near) - 0.2, full[order[:near]], 0.4, color="lightgray", label="the model's")
ax[1].bar(np.arange(near) + 0.2, kept[0.9][order[:near]], 0.4, color="tab:orange", label="top-p 0.9, renormalised")
label_ticks(ax[1], near)
ax[1].set_title("what top-p 0.9 draws from")
# the keys sit outside the panels (above the first, under the second), where a phone's narrow
# column stacks the panels without a key landing on a neighbour's title
fig.legend(*ax[0].get_legend_handles_labels(), loc="outside upper left", fontsize=8)
fig.legend(*ax[1].get_legend_handles_labels(), loc="outside lower right", fontsize=8)
fig.tight_layout(); show_figure(fig, "30_top_p.png")
for p in TOP_PS:
    print(f"top-p {p}: keeps the {sizes[p]} most probable characters, which hold {full[kept[p] > 0].sum():.3f} "
          f"of the probability; the most probable of them now has {kept[p].max():.3f}")

# %% [markdown]
# ## 5. The key/value cache, per generated token
#
# Generating a character runs one position through the model. Each layer's self-attention
# needs the keys and values of every earlier position; the cache (lesson 15) keeps them, so
# that they are computed once. For every token the model writes, each layer adds one key and
# one value for each of its key/value heads, each $d_{\text{model}} / h$ numbers wide:
#
# $$\text{bytes per token} = 2 \cdot N \cdot h_{kv} \cdot \frac{d_{\text{model}}}{h} \cdot
#   \text{bytes per number}$$
#
# computed from the config, then measured on the cache's own arrays after the prompt and after
# a few more tokens:

# %%
per_token = 2 * cfg.n_decoder_layers * cfg.key_value_heads * (cfg.d_model // cfg.n_heads) * np.dtype(
    model.params["embedding.weight"].dtype).itemsize


def cache_bytes(state):
    return sum(k.nbytes + v.nbytes for k, v in state.self_kv if k is not None)


state = model.start_decoding(None, None)
sizes_by_length = {}
for t in prompt_ids + encode_text("What light", vocab, True):
    _, state, _ = model.decode_step(np.asarray([t]), state)
    sizes_by_length[state.length] = cache_bytes(state)
lengths = sorted(sizes_by_length)
measured = {(b - a) // (lb - la) for (la, a), (lb, b) in zip(sorted(sizes_by_length.items()),
                                                             sorted(sizes_by_length.items())[1:])}
print(f"from the config: 2 x {cfg.n_decoder_layers} layers x {cfg.key_value_heads} key/value heads x "
      f"{cfg.d_model // cfg.n_heads} numbers x {np.dtype(model.params['embedding.weight'].dtype).itemsize} bytes "
      f"= {per_token:,} bytes a token")
print(f"measured: {sizes_by_length[lengths[0]]:,} bytes after {lengths[0]} token(s), "
      f"{sizes_by_length[lengths[-1]]:,} after {lengths[-1]}: {sorted(measured)} bytes a token")
print(f"a full window of {CONTEXT} characters: {per_token * CONTEXT / 1024:.1f} KiB; the model's weights: "
      f"{model.num_parameters() * 4 / 1024:.0f} KiB")

# %% [markdown]
# The cache grows with every token, and with the number of layers and of key/value heads:
# that is what grouped-query attention (lesson 26) cuts, by sharing each key/value head among
# several query heads.
#
# ## Check
#
# These fail if the cache held another amount than the config says for each token, if top-p
# kept a set that is not the smallest whose probability reaches p, if a sample were not
# reproduced by its seed, if the cached and the uncached sampling drew different text, or if
# PyTorch's twin did not start from attn's weights. How
# good the model got is printed above and asserted only in full mode (quick mode trains too
# few steps to promise anything about it).

# %%
assert measured == {per_token}, f"the cache grows by {measured} bytes a token, the config says {per_token}"
for p, q in kept.items():
    mass = np.cumsum(full[order])
    n = sizes[p]
    assert mass[n - 1] >= p * (1 - 1e-12) and (n == 1 or mass[n - 2] < p), f"top-p {p} kept {n} tokens"
    assert np.allclose(q[order[:n]], full[order[:n]] / full[order[:n]].sum()), f"top-p {p}: not renormalised"
assert sample(40, Sampler(0.8, None, 0.9), seed=3) == sample(40, Sampler(0.8, None, 0.9), seed=3)
uncached = decode_text(generate(model, prompt_ids, 40, Sampler(0.8, None, 0.9), 3, banned=BANNED, cached=False),
                       vocab, True)
assert uncached == sample(40, Sampler(0.8, None, 0.9), seed=3), "cached and uncached sampling must agree"
assert all(np.isfinite(h["val_loss"]) for h in history)
assert torch_history is None or abs(torch_history[0]["val_loss"] - history[0]["val_loss"]) < 1e-4, \
    "PyTorch's twin must start from attn's weights: the same validation loss before training"
assert QUICK or history[-1]["val_loss"] < unigram_loss, "the trained model must beat the characters' frequencies"
print(f"Check passed in {time.time() - T0:.1f} s: {per_token:,} bytes of cache a token; top-p kept "
      f"{', '.join(str(sizes[p]) for p in TOP_PS)} characters; validation loss {history[0]['val_loss']:.3f} -> "
      f"{history[-1]['val_loss']:.3f}.")

# %% [markdown]
# ## Questions
#
# 1. Why does one window of $T$ characters give $T$ training examples, and what would go
#    wrong without the look-ahead mask?
#
#    <details><summary>Answer</summary>
#
#    Every position predicts the next character from those before it, and all positions are
#    computed in one pass, each with its own loss. Without the mask, position $t$ would read
#    character $t+1$, the one it must predict, and the loss would fall without the model
#    learning to write.
#
#    </details>
#
# 2. After "ROMEO" and a colon, the next character is nearly certain; after a space inside a
#    line it is not. How many tokens do top-k and top-p keep in each case?
#
#    <details><summary>Answer</summary>
#
#    Top-k keeps $k$ in both. Top-p keeps very few after the confident prefix (one token may
#    already hold mass p) and many after the open one: the set adapts to the distribution.
#
#    </details>
#
# 3. How would the cache's bytes per token change with two key/value heads instead of four,
#    with twice the layers, or in float16?
#
#    <details><summary>Answer</summary>
#
#    The formula is a product: half with two key/value heads, twice with twice the layers,
#    half again in float16 (two bytes a number instead of four). The weights' size does not
#    change with the length; the cache grows with every token.
#
#    </details>

# %% [markdown]
# # Lesson 1: the sequence-to-sequence bottleneck (the problem attention solves)
#
# "Attention Is All You Need" opens (section 1) with the models it replaces:
# recurrent encoder-decoders. "Recurrent models typically factor computation along
# the symbol positions of the input and output sequences ... they generate a
# sequence of hidden states $h_t$, as a function of the previous hidden state
# $h_{t-1}$ and the input for position `t`."
#
# The first such translators (Sutskever et al. 2014; Cho et al. 2014) worked like this:
#
# $$\begin{aligned}
# \text{encoder:}\quad & h_t = \tanh(x_t W_x + h_{t-1} W_h + b), \quad t = 1, \dots, S
#   && (x_t\text{: source embeddings})\cr
# \text{context:}\quad & c = h_S && \text{(one vector for the whole sentence)}\cr
# \text{decoder:}\quad & s_0 = c, \quad s_t = \tanh(y_{t-1} W'_x + s_{t-1} W'_h + b')
#   && (y_{t-1}\text{: previous target token})\cr
# \text{output:}\quad & p(y_t \mid y_{<t}, \text{source}) = \mathrm{softmax}(s_t W_o + b_o)
# \end{aligned} \tag{1.1}$$
#
# (The formulas of these lessons are written in the paper's notation; [the notation
# page](../notation.md), `book/notation.md` in the repository, maps each symbol to its
# name in the code and explains the equation numbers.)
#
# Everything the decoder knows about the source has to pass through `c`, a vector
# of fixed size `H`, however long the sentence. That is the **bottleneck**. Cho et
# al. (2014, "On the properties of neural machine translation") measured it: BLEU
# falls steadily as sentences get longer. This lesson reproduces that curve on a
# task small enough to train in seconds.
#
# Introductions to seq2seq usually say it in two lines: the context vector is
# the encoder's last hidden state and the decoder's first one, and (1) squeezing
# everything into one fixed-size vector loses information, worse for longer
# sentences; (2) recurrent networks suffer from vanishing gradients. Both are right,
# and they are two faces of one fact: the only road from a source word to an
# output word runs through every later encoder step and through `c` (lesson 10
# measures that road). One refinement: "context = the decoder's first hidden state"
# is Sutskever et al.'s design; Cho et al. also feed `c` into every decoder step.
# That helps the decoder remember `c`, but `c` itself is still one fixed-size vector.
#
# **The task.** Reverse a sequence of random tokens: `7 3 9 4 -> 4 9 3 7`. Twenty
# symbols, lengths 2 to 20. Random tokens have no structure to exploit, so the
# model must really carry every token through `c`; a guess is right 1 time in 20.
#
# What the library provides: `attn.layers.rnn_forward` / `rnn_backward` (the tanh
# recurrence and backpropagation through time, in `attn/layers/recurrent.py`),
# `embedding_*`, `linear_*`, and `attn.loss.cross_entropy`. The lesson wires them
# into a model, writes its backward pass (the layers' backwards, chained in
# reverse), checks it numerically, and trains it with a few lines of Adam.

# %%
import os, sys
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # tiny matrices: BLAS threads only add overhead
import time
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, quick_steps   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

from attn.gradcheck import numerical_gradient, rel_error
from attn.layers import (embedding_backward, embedding_forward, linear_backward, linear_forward,
                         rnn_backward, rnn_forward, rnn_step_forward)
from attn.loss import cross_entropy
from attn.masks import PAD_ID

T0 = time.time()

# %% [markdown]
# ## 1. The data
#
# Token ids: `PAD_ID = 0` pads short sequences in a batch, `BOS = 1` starts the
# decoder, `2..21` are the twenty symbols. The decoder is trained with **teacher
# forcing**: its input at step `t` is the *true* previous target token (`BOS` at
# step 0), and its output is compared with the target token at step `t`. At test
# time it feeds back its own previous guess instead (greedy decoding).
#
# Sequences in a batch have different lengths. `rnn_forward(..., mask=...)` takes
# a `(B, S)` boolean mask of real steps and *skips* the padded ones (the state
# passes through unchanged), so `hs[:, -1]` is each row's state after its own last
# real token: the context vector, whatever the padding.

# %%
BOS, N_SYM = 1, 20
V = 2 + N_SYM
L_MIN, L_MAX = 2, 20
LENGTHS = np.arange(L_MIN, L_MAX + 1)


def make_batch(rng, lengths):
    """Random sequences of the given lengths and their reversals.

    Returns src (B, S), dec_in (B, S), tgt (B, S) int ids, padded with PAD_ID to
    the longest length S, and mask (B, S) bool, True on real tokens."""
    lengths = np.asarray(lengths)
    S = int(lengths.max())
    mask = np.arange(S)[None, :] < lengths[:, None]
    src = np.where(mask, rng.integers(2, V, (len(lengths), S)), PAD_ID)
    tgt = np.full_like(src, PAD_ID)
    for i, L in enumerate(lengths):
        tgt[i, :L] = src[i, :L][::-1]
    dec_in = np.where(mask, np.concatenate([np.full((len(lengths), 1), BOS), tgt[:, :-1]], axis=1), PAD_ID)
    return src, dec_in, tgt, mask


src, dec_in, tgt, mask = make_batch(np.random.default_rng(0), [4, 7, 3])
print("src    (what the encoder reads)\n", src)
print("dec_in (teacher forcing: BOS, then the target shifted right)\n", dec_in)
print("tgt    (what the decoder must output)\n", tgt)

# %% [markdown]
# ## 2. The model, forward and backward
#
# Parameters are a dict with stable dotted names, as in the library's Transformer.
# Shapes: embeddings `(V, D)`, input weights `(D, H)`, recurrent weights `(H, H)`
# (initialised orthogonal, so a step neither grows nor shrinks the state at the
# start), output projection `(H, V)`.
#
# The backward pass is the forward read upwards, each layer's backward undoing its
# forward line. Two places need care:
#
# * the context `c = hs_enc[:, -1]` is *used twice*, as the decoder's initial state;
#   its gradient is `dh0` of the decoder, and it enters the encoder's backward as
#   the upstream gradient of its last state (all other encoder states were unused:
#   their gradient is zero);
# * the encoder never sees a loss directly. Its whole training signal arrives
#   through that one `(B, H)` gradient: the bottleneck, backwards.

# %%
H, D = 32, 32


def init_params(seed, V=V, D=D, H=H, dtype=np.float32):
    rng = np.random.default_rng(seed)
    orth = lambda n: np.linalg.qr(rng.standard_normal((n, n)))[0]           # noqa: E731
    p = {"encoder.emb": rng.standard_normal((V, D)) * 0.3,
         "encoder.w_x": rng.standard_normal((D, H)) / np.sqrt(D),
         "encoder.w_h": orth(H), "encoder.b": np.zeros(H),
         "decoder.emb": rng.standard_normal((V, D)) * 0.3,
         "decoder.w_x": rng.standard_normal((D, H)) / np.sqrt(D),
         "decoder.w_h": orth(H), "decoder.b": np.zeros(H),
         "out.w": rng.standard_normal((H, V)) / np.sqrt(H), "out.b": np.zeros(V)}
    return {k: v.astype(dtype) for k, v in p.items()}


def encode(p, src, mask):
    """Returns the encoder states hs_enc (B, S, H), the context (B, H), and the caches."""
    x, c_emb = embedding_forward(src, p["encoder.emb"])                                  # (B, S, D)
    hs_enc, c_rnn = rnn_forward(x, None, p["encoder.w_x"], p["encoder.w_h"], p["encoder.b"], mask=mask)
    return hs_enc, hs_enc[:, -1], (c_emb, c_rnn)                                         # c = h_S


def loss_and_grads(p, src, dec_in, tgt, mask):
    """Teacher-forced loss (mean cross-entropy over real target tokens) and the gradient of
    every parameter, keyed like p."""
    hs_enc, ctx, (c_emb_e, c_rnn_e) = encode(p, src, mask)
    y, c_emb_d = embedding_forward(dec_in, p["decoder.emb"])                             # (B, T, D)
    hs_dec, c_rnn_d = rnn_forward(y, ctx, p["decoder.w_x"], p["decoder.w_h"], p["decoder.b"], mask=mask)
    logits, c_out = linear_forward(hs_dec, p["out.w"], p["out.b"])                       # (B, T, V)
    loss, dlogits = cross_entropy(logits, tgt)                                           # pads ignored
    g = {}
    dhs_dec, g["out.w"], g["out.b"] = linear_backward(dlogits, c_out)
    dy, dctx, g["decoder.w_x"], g["decoder.w_h"], g["decoder.b"] = rnn_backward(dhs_dec, c_rnn_d)
    g["decoder.emb"] = embedding_backward(dy, c_emb_d)
    dhs_enc = np.zeros_like(hs_enc)
    dhs_enc[:, -1] = dctx                                   # c = hs_enc[:, -1]: its gradient goes there
    dx, _, g["encoder.w_x"], g["encoder.w_h"], g["encoder.b"] = rnn_backward(dhs_enc, c_rnn_e)
    g["encoder.emb"] = embedding_backward(dx, c_emb_e)
    return loss, g


# %% [markdown]
# **Is the backward right?** Before training anything, compare every parameter's
# gradient with central differences (`attn.gradcheck`), in float64 on a model
# small enough that the numerical gradient is instant. The batch has padding, so
# the mask's "skip this step" path is checked too.

# %%
p64 = init_params(1, V=V, D=3, H=4, dtype=np.float64)
for k in p64:                                    # break the symmetry of zero biases
    p64[k] += 0.1 * np.random.default_rng(2).standard_normal(p64[k].shape)
b_src, b_dec, b_tgt, b_mask = make_batch(np.random.default_rng(3), [3, 5, 2])
_, g64 = loss_and_grads(p64, b_src, b_dec, b_tgt, b_mask)
loss64 = lambda: loss_and_grads(p64, b_src, b_dec, b_tgt, b_mask)[0]        # noqa: E731  reads p64 as perturbed
grad_errors = {k: rel_error(g64[k], numerical_gradient(loss64, p64[k])) for k in p64}
for k, e in grad_errors.items():
    print(f"  {k:<12} relative error {e:.1e}")

# %% [markdown]
# ## 3. Training
#
# Adam (section 5.3 of the paper uses it too, with $\beta_2 = 0.98$), a constant
# learning rate, and gradient clipping: a recurrent network's gradient can explode
# when products of many `W_h` factors line up (Pascanu et al. 2013), and one bad
# step can undo training. Every batch draws fresh random sequences, so there is
# no overfitting to worry about: the data is endless.

# %%
STEPS = quick_steps(300) if QUICK else 600
BATCH, LR, CLIP = 64, 3e-3, 5.0


def adam_train(p, loss_and_grads, steps, seed, lr=LR, betas=(0.9, 0.98), eps=1e-9, log_every=100):
    """Adam on fresh random batches; returns the loss of every step."""
    rng = np.random.default_rng(seed)
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(v) for k, v in p.items()}
    losses = []
    for step in range(1, steps + 1):
        src, dec_in, tgt, mask = make_batch(rng, rng.integers(L_MIN, L_MAX + 1, BATCH))
        loss, g = loss_and_grads(p, src, dec_in, tgt, mask)
        norm = float(np.sqrt(sum((gk.astype(np.float64) ** 2).sum() for gk in g.values())))
        scale = min(1.0, CLIP / (norm + 1e-12))             # clip the global norm
        for k in p:
            gk = g[k] * scale
            m[k] = betas[0] * m[k] + (1 - betas[0]) * gk
            v[k] = betas[1] * v[k] + (1 - betas[1]) * gk * gk
            mhat, vhat = m[k] / (1 - betas[0] ** step), v[k] / (1 - betas[1] ** step)
            p[k] -= (lr * mhat / (np.sqrt(vhat) + eps)).astype(p[k].dtype)
        losses.append(float(loss))
        if step % log_every == 0 or step == steps:
            print(f"  step {step:4d}  loss {np.mean(losses[-log_every:]):.3f}  |grad| {norm:.2f}")
    return losses


params = init_params(0)
losses = adam_train(params, loss_and_grads, STEPS, seed=1)

# %% [markdown]
# ## 4. Accuracy against length
#
# Greedy decoding: start from `s_0 = c` and `BOS`, take the most likely token,
# feed it back, `L` times for a source of length `L` (the output length is known
# for this task, so there is no end-of-sentence token to learn). One step of the
# decoder is `rnn_step_forward`, the same cell `rnn_forward` unrolls. A token is
# correct if it equals the target at its position; accuracy is averaged per length.

# %%
N_EVAL = 60 if QUICK else 150


def greedy_decode_bottleneck(p, src, mask):
    """(B, S) source -> (B, S) predicted ids, feeding back each guess."""
    _, h, _ = encode(p, src, mask)
    tok = np.full(src.shape[0], BOS)
    out = np.zeros_like(src)
    for t in range(src.shape[1]):
        y, _ = embedding_forward(tok, p["decoder.emb"])
        h, _ = rnn_step_forward(y, h, p["decoder.w_x"], p["decoder.w_h"], p["decoder.b"])
        logits, _ = linear_forward(h, p["out.w"], p["out.b"])
        tok = logits.argmax(axis=-1)
        out[:, t] = tok
    return out


def accuracy_by_length(decode, p, seed=123):
    """Token accuracy for each length in LENGTHS, and the (N_EVAL, L_MAX) hit table of
    the longest length (which output positions are right)."""
    rng = np.random.default_rng(seed)
    lengths = np.repeat(LENGTHS, N_EVAL)
    src, _, tgt, mask = make_batch(rng, lengths)
    hit = (decode(p, src, mask) == tgt) & mask
    acc = np.array([hit[lengths == L].sum() / (L * N_EVAL) for L in LENGTHS])
    return acc, hit[lengths == L_MAX]


acc_bn, hits_longest = accuracy_by_length(greedy_decode_bottleneck, params)
print("length   " + " ".join(f"{L:5d}" for L in LENGTHS))
print("accuracy " + " ".join(f"{a:5.2f}" for a in acc_bn))
pos_acc = hits_longest.mean(axis=0)              # (L_MAX,) accuracy at each output position
print(f"\nlength {L_MAX}: accuracy at output position 0..{L_MAX - 1} "
      f"(position j outputs source token {L_MAX - 1}-j):")
print(" ".join(f"{a:.2f}" for a in pos_acc))

fig, ax = plt.subplots(1, 3, figsize=(15, 4))
ax[0].plot(losses, lw=0.6)
ax[0].set(xlabel="training step", ylabel="cross-entropy (teacher forcing)", title="training loss")
ax[1].plot(LENGTHS, acc_bn, "o-", label=f"RNN encoder-decoder, one context vector (H={H})")
ax[1].axhline(1 / N_SYM, color="gray", ls=":", label=f"chance (1/{N_SYM})")
ax[1].set(xlabel="sequence length", ylabel="token accuracy (greedy decoding)", ylim=(0, 1.05),
          title="the bottleneck: accuracy falls with length")
ax[1].set_xticks(LENGTHS[::2])
ax[1].legend(loc="center right")
ax[2].bar(np.arange(L_MAX), pos_acc)
ax[2].set_xticks(np.arange(0, L_MAX, 2))
ax[2].axhline(1 / N_SYM, color="gray", ls=":")
ax[2].set(xlabel=f"output position (length {L_MAX}); source position = {L_MAX - 1} - this",
          ylabel="token accuracy", ylim=(0, 1.05), title="which tokens are lost: the oldest ones")
fig.tight_layout(); show_figure(fig, "01_accuracy_vs_length.png")

# %% [markdown]
# **What to notice.**
#
# * Short sequences come out (nearly) perfect, and accuracy then falls steadily with
#   length, towards the chance line: the curve of Cho et al., on a toy. Nothing
#   about the task gets harder per token; there is just more to fit through `H`
#   numbers, and more steps for each token to survive.
# * The right panel shows *which* tokens are lost. The output is the source
#   reversed, so output position 0 is the last source token, read just before `c`
#   was formed, and it is almost always right. The last outputs need the *first*
#   source tokens, which had to survive the whole encoder: those are the ones
#   forgotten. (This is also why Sutskever et al. fed the source sentence in
#   reverse: it puts the first words of source and target close together.)
# * More training, or a bigger `H`, moves the curve to the right but does not
#   change its shape: for any fixed `H` there is a length beyond which `c` cannot
#   hold the sentence.
#
# The fix (Bahdanau et al. 2015, Luong et al. 2015) is to stop asking `c` to hold
# everything: let the decoder look back at *all* encoder states at every step. That
# is attention, lesson 2, and the first half of the Transformer's idea.
#
# ## Check
#
# These fail if the recurrent layer's backward were wrong (the gradient check and
# the training both depend on it), if the mask let padding leak into the context
# (short sequences would then fail), or if the model did not learn at all. How far a
# model gets depends on its training: the claims about the trained model are asserted in
# full mode; quick mode (fewer steps) prints them.

# %%
short, long_ = acc_bn[LENGTHS <= 4].mean(), acc_bn[LENGTHS >= L_MAX - 3].mean()
print(f"accuracy, lengths 2-4: {short:.2f};  lengths {L_MAX - 3}-{L_MAX}: {long_:.2f};  chance {1 / N_SYM:.2f}")
assert max(grad_errors.values()) < 1e-6, f"model backward disagrees with central differences: {grad_errors}"
first, last = pos_acc[:3].mean(), pos_acc[-3:].mean()
if not QUICK:                                         # what a trained model does: full mode's claims
    assert np.mean(losses[-50:]) < np.mean(losses[:20]) - 0.5, "training did not reduce the loss"
    assert short > 0.75, f"short sequences should be (almost) solved, got {short:.2f}"
    assert short - long_ > 0.3, f"accuracy should fall with length: {short:.2f} vs {long_:.2f}"
    assert long_ > 1.5 / N_SYM, f"long sequences should still beat chance: {long_:.2f}"
    assert first > last + 0.3, f"the oldest source tokens should be the ones lost: {first:.2f} vs {last:.2f}"
assert np.all(np.isfinite(losses)) and 0 <= short <= 1 and 0 <= long_ <= 1
print(f"oldest source tokens {first:.2f} vs newest {last:.2f}; loss {np.mean(losses[:20]):.2f} -> "
      f"{np.mean(losses[-50:]):.2f}" + (" (asserted in full mode only)" if QUICK else ""))
print(f"Check passed in {time.time() - T0:.1f} s.")


# %% [markdown]
# ## Questions
#
# Answer these from the lesson and what it printed:
#
# 1. Why does the recurrent encoder-decoder's accuracy fall as the sequences get
#    longer, and which tokens does it lose first? Why those?
#
#    <details><summary>Answer</summary>
#
#    Everything the decoder learns about the source must pass through the context vector
#    $c = h_S$ of fixed size `H` (equation 1.1); a longer sequence has more to fit into
#    the same numbers, and each token must survive more recurrent steps. The first source
#    tokens are lost first: the output is the source reversed, so the last outputs need
#    the tokens read longest before $c$ was formed (the right panel of the figure).
#
#    </details>
#
# 2. In Sutskever et al.'s design the context vector is the decoder's first hidden
#    state; what do Cho et al. change, and does that remove the bottleneck?
#
#    <details><summary>Answer</summary>
#
#    Cho et al. feed $c$ to *every* decoder step (and to the output layer), not only as
#    the first hidden state, so the decoder cannot forget it. It does not remove the
#    bottleneck: $c$ is still one vector of fixed size, however long the sentence.
#
#    </details>
#
# 3. Why does the task reverse *random* tokens rather than real words?
#
#    <details><summary>Answer</summary>
#
#    So that nothing about the tokens helps: the model cannot guess a token from its
#    neighbours or from a language model of real words, and every error measures what the
#    context vector lost. The task's difficulty then depends only on the length.
#
#    </details>


# %% [markdown]
# ## Exercise
#
# Now write the layers this lesson used: `linear`, `embedding` (repeated ids must
# accumulate), the tanh cell `rnn_step` and its unrolling `rnn` with backpropagation
# through time yourself. The starter `lessons/exercises/01_seq2seq.py` has the
# signatures, and the shapes and formulas in its docstrings; its bodies raise
# `NotImplementedError`. Fill them in, then grade your work:
#
#     attn-check lessons/exercises/01_seq2seq.py
#
# `attn-check` runs your functions on the examples that prove the library's layers, hard
# ones included, and prints a pass per layer or the smallest input that breaks your
# code, with a hint. `--layer NAME` grades one layer; `attn-check --help` explains the
# rest.

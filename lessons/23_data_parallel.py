# %% [markdown]
# # Lesson 23: one batch, several processes (data parallelism)
#
# "We trained our models on one machine with 8 NVIDIA P100 GPUs. [...] Each training batch
# contained a set of sentence pairs containing approximately 25000 source tokens and 25000
# target tokens" (sections 5.1 and 5.2), and "each training step took about 0.4 seconds" for
# the base model. The eight GPUs did not train eight models: each held a copy of the same
# model, computed the gradient of its *share* of the batch, and the eight gradients were
# combined into the gradient of the whole batch before every one of them took the same Adam
# step. That is data parallelism, and `attn-train` does it too:
#
#     mpiexec -n 2 attn-train ...                  # two processes, one core each
#     mpiexec -n 8 attn-train --backend cupy ...   # one process per GPU, gradients over NCCL
#
# This lesson shows the three things to get right, each checked in numbers:
#
# 1. **Sum, not mean.** The loss is a mean over the batch's real target tokens. Shares hold
#    different numbers of tokens, so the ranks' gradients must be *weighted by their token
#    counts and summed*; averaging the ranks' own means is a different, wrong gradient.
# 2. **The same random numbers.** Dropout must drop what one process would have dropped.
# 3. **What it costs.** Every step sends every gradient: a ring all-reduce, which is a
#    reduce-scatter followed by an all-gather.
#
# and ends by running two processes against one (`mpiexec -n 2`), if MPI is installed.

# %%
import os, sys, shutil, subprocess, json
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, show_figure_with_phone   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import numpy as np

import attn.backend as B
from attn import diagram
from attn.bench.parallel import counts, paper_model, ring_bytes_per_rank
from attn.gradcheck import rel_error
from attn.loss import cross_entropy
from attn.training.distributed import RowsOf, share_of
from attn.bench.parallel_check import check_batches, check_model

B.set_backend("numpy")
np.set_printoptions(precision=4, suppress=True, linewidth=130)

# %% [markdown]
# ## 1. Why the sum of gradients, and what each rank must weigh its own by
#
# Write the batch's loss as the mean over its `N` real target tokens and split the tokens
# among the ranks, `n_r` on rank `r`:
#
# $$L = \frac{1}{N} \sum_{\text{tokens}} l_t = \sum_r \frac{n_r}{N} \Big[ \frac{1}{n_r} \sum_{t \text{ on } r} l_t \Big]
#   = \sum_r \frac{n_r}{N} L_r \tag{23.1}$$
#
# Each rank computes `L_r`, the mean over its own tokens, and its gradient. The gradient of
# the batch is the sum over ranks of $(n_r / N) \nabla L_r$: weighted by token counts, then
# **summed**. The tempting alternative, average the ranks' gradients (what an all-reduce
# with "mean" gives), is $\sum_r (1/R) \nabla L_r$: it weighs a token on a rank with few tokens
# more than a token on a rank with many. Only when every rank holds the same number of real
# tokens do the two agree, and with padding-heavy batches they almost never do.
#
# Here is a batch of five sentences, the first two long and the rest short, split between
# two ranks the way `attn-train` splits it (a contiguous block of sentences each, padded to
# the batch's lengths), with every dropout on, in float64:

# %%
model, _, _ = check_model("float64", reference=True)
batch = check_batches(model.config.vocab_size)[0]
eps = model.config.label_smoothing


def grads_of(b, rng):
    logits, cache = model.forward(b.src, b.tgt_in, rng)
    loss, dlogits = cross_entropy(logits, b.tgt_out, eps)
    return float(loss), model.backward(dlogits, cache)


whole_loss, whole = grads_of(batch, B.DeviceRNG(7))
shares = []
for rank in range(2):
    mine, lo, rows, weight = share_of(batch, 2, rank)
    loss, g = grads_of(mine, RowsOf(B.DeviceRNG(7), lo, lo + mine.src.shape[0], rows))
    shares.append((mine.n_tgt_tokens, weight, loss, g))
    print(f"rank {rank}: sentences {lo}..{lo + mine.src.shape[0] - 1}, {mine.n_tgt_tokens} real target tokens "
          f"of {mine.tgt_out.size} positions, weight n_r/N = {weight:.4f}, its own mean loss {loss:.4f}")

summed = {k: sum(w * g[k] for _, w, _, g in shares) for k in whole}
averaged = {k: sum(g[k] for *_, g in shares) / 2 for k in whole}
err_sum = max(rel_error(summed[k], whole[k]) for k in whole)
err_mean = max(rel_error(averaged[k], whole[k]) for k in whole)
loss_sum = sum(w * l for _, w, l, _ in shares)
print(f"\nwhole batch in one process: loss {whole_loss:.6f}")
print(f"weighted sum of the ranks:  loss {loss_sum:.6f}, largest relative gradient error {err_sum:.1e}")
print(f"mean of the ranks' means:   loss {sum(l for _, _, l, _ in shares) / 2:.6f}, "
      f"largest relative gradient error {err_mean:.1e}")

# %% [markdown]
# The weighted sum is the one-process gradient to rounding; the mean of means is off in the
# first digits, because the short sentences' tokens counted several times as much as the long
# ones'. (`rel_error` compares norms per parameter, so the attention's key biases, whose
# gradient is zero in truth and rounding noise on both sides, do not spoil the comparison.)
#
# ## 2. The same random numbers
#
# The dropout masks above were not drawn per rank. A rank's random stream is keyed by the
# step, as one process's is, and `RowsOf` asks it for the **whole batch's** numbers and keeps
# its own sentences' part of them. So rank 1's mask for its sentences is exactly the mask one
# process draws for sentences 2, 3 and 4. Drawing per rank (a stream seeded by the rank) would
# be just as random, but the two-process run would no longer be the one-process run, and there
# would be nothing to check it against. The cost is that every rank generates the masks of
# the whole batch: a small share of a step. On a GPU `attn` pays nothing for it: its
# counter-based dropout computes each element's mask from a hash of the step's seed, the site
# and the element's index in the *global* batch, so a rank computes its own rows alone and they
# are still one process's.

# %%
whole_draw = B.DeviceRNG(3).random_uint16((5, 4, 8))
_, lo, rows, _ = share_of(batch, 2, 1)
rank1_draw = RowsOf(B.DeviceRNG(3), lo, rows, rows).random_uint16((rows - lo, 4, 8))
same_draw = bool(np.array_equal(rank1_draw, whole_draw[lo:]))
print(f"rank 1's draw for sentences {lo}..{rows - 1} equals one process's rows {lo}..{rows - 1}: {same_draw}")

# %% [markdown]
# ## 3. What it costs: a ring all-reduce
#
# After its backward every rank holds a gradient buffer of `P` numbers, and every rank needs
# the sum. The ring all-reduce (Patarasuk and Yuan 2009; what NCCL and Horovod use) cuts the
# buffer into `R` chunks and passes them around a ring of the `R` ranks twice:
#
# * **reduce-scatter**, `R - 1` rounds: each rank sends one chunk to its right neighbour,
#   which adds it to its own copy; after `R - 1` rounds rank `r` holds the full sum of chunk
#   `r + 1`;
# * **all-gather**, `R - 1` rounds: the finished chunks go around once more, each rank
#   overwriting its copy.
#
# Each rank sends `2 (R - 1)` chunks of `P / R`: `2 (R - 1) / R * P` numbers, *less than
# twice the buffer however many ranks there are*. Here it is, by hand, on four ranks:

# %%
def ring_allreduce(buffers, trace=None):
    """Sum the ranks' buffers as a ring does; returns (every rank's result, numbers each rank sent).
    ``trace``, a list, receives a copy of every rank's chunks before the first round and after each."""
    R = len(buffers)
    chunks = [np.array_split(b.astype("float64").copy(), R) for b in buffers]
    sent = [0] * R
    snap = (lambda: trace.append([[c.copy() for c in cs] for cs in chunks])) if trace is not None else (lambda: None)
    snap()
    for step in range(R - 1):                           # reduce-scatter
        outgoing = [chunks[r][(r - step) % R].copy() for r in range(R)]
        for r in range(R):
            c = (r - step) % R
            chunks[(r + 1) % R][c] += outgoing[r]
            sent[r] += outgoing[r].size
        snap()
    for step in range(R - 1):                           # all-gather
        outgoing = [chunks[r][(r + 1 - step) % R].copy() for r in range(R)]
        for r in range(R):
            c = (r + 1 - step) % R
            chunks[(r + 1) % R][c] = outgoing[r]
            sent[r] += outgoing[r].size
        snap()
    return [np.concatenate(c) for c in chunks], sent


rng = np.random.default_rng(0)
P = 1000
buffers = [rng.normal(size=P) for _ in range(4)]
results, sent = ring_allreduce(buffers)
ring_ok = all(np.allclose(res, sum(buffers), rtol=1e-13, atol=1e-13) for res in results)
print(f"4 ranks, {P} numbers each: every rank ends with the sum: {ring_ok}; each sent {sent} numbers "
      f"= 2 (R-1)/R * P = {ring_bytes_per_rank(P, 4):.0f}")

# The rounds, drawn: rank r's buffer holds 2**r, so a chunk's value names the ranks it sums (its bits).
rounds = []
ring_allreduce([np.full(4, 2.0 ** r) for r in range(4)], trace=rounds)
holds = [[[{s for s in range(4) if int(c[0]) >> s & 1} for c in cs] for cs in snap] for snap in rounds]
phases = ["before"] + [f"reduce-scatter {k}" for k in (1, 2, 3)] + [f"all-gather {k}" for k in (1, 2, 3)]


def ring_rounds_for_a_phone(snapshots, phases):
    """The rounds of ``diagram.ring_rounds`` laid out for a phone's narrow column: two rounds a row,
    each a block of the ranks' buffers (a row per rank, a cell per chunk), its text at the body's
    size; a cell summed over every rank says "all"."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
    R, per_row, gap = len(snapshots[0]), 2, 0.5
    block_h = R + 0.9
    rows = -(-(len(snapshots) + 1) // per_row)                      # and a slot for the key
    width = 0.7 + per_row * R + (per_row - 1) * gap
    fig = Figure(figsize=(3.3, 3.3 * rows * block_h / width))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.7, width - 0.7); ax.set_ylim(-rows * block_h, 0); ax.axis("off")
    for i, (snap, phase) in enumerate(zip(snapshots, phases)):
        x0, y0 = (i % per_row) * (R + gap), -(i // per_row) * block_h
        ax.text(x0, y0 - 0.45, phase, ha="left", va="center", fontsize=12)
        for r in range(R):
            y = y0 - 1.4 - r
            if i % per_row == 0:
                ax.text(-0.15, y, str(r), ha="right", va="center", fontsize=12, weight="bold")
            for c, have in enumerate(snap[r]):
                full = len(have) == R
                ax.add_patch(Rectangle((x0 + c + 0.03, y - 0.45), 0.94, 0.9, lw=0.6, ec="#333333",
                                       fc="#1d5e8c" if full else ("#a9cce3" if len(have) > 1 else "#f2f2f2")))
                ax.text(x0 + c + 0.5, y, "all" if full else "".join(map(str, sorted(have))), ha="center",
                        va="center", fontsize=12, color="white" if full else "black")
    i = len(snapshots)
    ax.text((i % per_row) * (R + gap), -(i // per_row) * block_h - 0.2,
            "a row per rank,\na cell per chunk,\nnamed by the\nranks it sums;\nall: every rank", ha="left", va="top", fontsize=12)
    fig.attn_alt = "The ring all-reduce round by round, for a phone: " + ", ".join(phases)
    return fig


show_figure_with_phone(diagram.ring_rounds(holds, phases), ring_rounds_for_a_phone(holds, phases),
                       "23_ring_rounds.png")

# %% [markdown]
# How many bytes is that for a real model, against how much arithmetic? `attn` all-reduces
# one float32 buffer holding every gradient and the step's loss, in reverse layer order (the
# last layer's gradients are finished first in the backward). For the benchmark's presets at
# two ranks, and for the paper's base model at eight:

# %%
rows_ = [counts(p, 2) for p in ("toy-bench", "vocab-16k")]
for c in rows_:
    print(f"{c['preset']:>10}: {c['parameters']:>10,} parameters, {c['allreduce_bytes'] / 1e6:6.1f} MB per step, "
          f"{c['ring_bytes_per_rank'] / 1e6:6.1f} MB sent per rank; {c['step_flops'] / 1e9:6.1f} GFLOP per step, "
          f"{c['flops_per_byte_sent']:,.0f} FLOP per byte sent")
base = paper_model(8, 0.4, 12.0)
print(f"      base: {base['parameters']:>10,} parameters, {base['allreduce_bytes'] / 1e6:6.1f} MB per step, "
      f"{base['ring_bytes_per_rank'] / 1e6:6.1f} MB sent by each of 8 ranks: {base['allreduce_seconds'] * 1e3:.0f} ms "
      f"at {base['link_gbytes_per_s']:g} GB/s, {base['allreduce_share_not_overlapped']:.0%} of a "
      f"{base['step_seconds']:g} s step if it waited for the whole backward")

ranks = np.arange(1, 17)
fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot(ranks, [ring_bytes_per_rank(base["allreduce_bytes"], int(r)) / 1e6 for r in ranks], "o-",
        label="ring: sent per rank")
ax.plot(ranks, [(r - 1) * base["allreduce_bytes"] / 1e6 for r in ranks], "--",
        label="every rank to every other")
ax.set_xlabel("ranks")
ax.set_ylabel("MB sent per rank per step")
ax.set_ylim(0, 3 * base["allreduce_bytes"] / 1e6)
ax.set_title("base model: the ring sends under twice the gradients, at any size")
ax.legend()
fig.tight_layout()
show_figure(fig, OUT / "23_ring_allreduce.png")

# %% [markdown]
# Two lessons in those numbers. First, the traffic per rank hardly grows with the ranks: what
# grows is the arithmetic each rank is spared. Second, the all-reduce costs time only if it
# waits for the whole backward: the gradients of the last layers are final long before the
# backward reaches the embeddings, so their bucket can be on the wire while the rest is still
# computed (PyTorch's DDP and `attn`'s buckets go in reverse layer order for that reason).
# On two CPU cores the picture is different: two processes share the same two cores one
# process would use with two threads; `python -m attn.bench --data-parallel 2` measures both,
# and may well show no speed-up.
#
# ## 4. Two processes against one
#
# `attn.bench.parallel_check` is the proof the test suite runs: two processes take three
# Adam steps, in float64 with every dropout on, on their shares of batches whose halves hold
# very different numbers of tokens (the third batch has one sentence: one rank gets none and
# weighs its stand-in by zero). Process 0 then takes the same steps alone on the whole
# batches and compares.

# %%
have_mpi = shutil.which("mpiexec") is not None
try:
    import mpi4py  # noqa: F401
except ImportError:
    have_mpi = False
check = None
if have_mpi:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "attn.bench.parallel_check"],
                          capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the two-process check printed nothing:\n{proc.stderr[-2000:]}"
    check = json.loads(lines[0])
    print(f"target tokens per rank in the three batches: {check['target_tokens_per_rank']}")
    print(f"largest relative differences from one process: gradients of step 1 {check['max_grad_rel']:.1e}, "
          f"losses {check['max_loss_rel']:.1e}, parameters after 3 steps {check['max_param_rel']:.1e}; "
          f"the two ranks' parameters bit for bit equal: {check['ranks_bitwise_equal']}")
else:
    print("mpi4py or mpiexec is not installed (pip install -e '.[mpi]'): the two-process run is skipped; "
          "sections 1 to 3 above ran in this process")

# %% [markdown]
# ## Check
#
# These fail if the library combined the ranks' gradients wrongly (a mean of means, or an
# unweighted sum), if a rank drew other dropout numbers than one process, if the ring did not
# sum, or if two real processes did not train exactly as one.

# %%
assert err_sum < 1e-12, f"the weighted sum of the shares' gradients must be the batch's ({err_sum:.1e})"
assert abs(loss_sum - whole_loss) < 1e-13 * abs(whole_loss), "the weighted sum of the shares' losses is the loss"
assert err_mean > 1e-3, "the mean of the ranks' means must differ here: the shares hold different token counts"
assert shares[0][0] != shares[1][0], "the example's shares must hold different numbers of tokens"
assert same_draw, "a rank must draw exactly one process's numbers for its sentences"
assert ring_ok and sent == [ring_bytes_per_rank(P, 4)] * 4, "the ring must sum, sending 2 (R-1)/R P each"
if check is not None:
    assert check["pass"] and check["ranks_bitwise_equal"], f"two processes must train as one: {check}"
print(f"Check passed: the weighted sum of the shares' gradients is the whole batch's to {err_sum:.1e} "
      f"(the mean of means is off by {err_mean:.1e}); each rank draws one process's dropout numbers; the ring "
      f"sums, sending 2 (R-1)/R of the buffer per rank"
      + (f"; two processes matched one to {check['max_grad_rel']:.1e} (gradients)" if check else "") + ".")

# %% [markdown]
# ## Questions
#
# 1. A batch of 4,000 target tokens is split between two ranks holding `3/4` and `1/4` of the
#    real tokens. By what factor does averaging the ranks' means over-weigh a token of the second
#    rank, compared with the correct gradient?
#
#    <details><summary>Answer</summary>
#
#    Averaging the ranks' means gives each rank weight 1/2; a token on the second rank
#    gets $(1/2)/(N/4) = 2/N$ instead of the correct $1/N$: it is over-weighed by a
#    factor of 2 (and a token of the first rank is under-weighed, by $2/3$).
#
#    </details>
#
# 2. Each rank sends `2 (R - 1) / R` of the buffer. Why is that the least any algorithm can
#    send when every rank must end with the sum of all `R` buffers? (Think of what each rank
#    must receive.)
#
#    <details><summary>Answer</summary>
#
#    Each rank must end with the sum, which depends on every other rank's buffer, and
#    each rank holds only its own: it must receive, directly or summed, everything from
#    the other $R - 1$ ranks. With the work spread evenly, the reduction (each rank
#    summing $1/R$ of the buffer) needs $(R-1)/R$ of the buffer in per rank, and
#    spreading the sums needs another $(R-1)/R$: $2(R-1)/R$ in all.
#
#    </details>
#
# 3. On NumPy `attn` cuts a rank's masks out of the whole batch's draw, at the price of every
#    rank drawing the whole batch's masks; on a GPU a counter-based generator draws only the
#    rank's own. Keyed by what must its counter be for the ranks to get one process's numbers,
#    and what goes wrong if it is keyed by the element's index in the rank's own array?
#
#    <details><summary>Answer</summary>
#
#    By the element's index in the *whole batch*: then each rank draws, for its own
#    elements, exactly the numbers one process would draw for them. Keyed by the index in
#    the rank's own array, every rank would draw the same masks for its first elements,
#    ranks would repeat each other's numbers, and the result would depend on the number
#    of ranks.
#
#    </details>

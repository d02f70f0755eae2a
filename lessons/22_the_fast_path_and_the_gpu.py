# %% [markdown]
# # Lesson 22: the fast path and the GPU, where the speed comes from
#
# The lessons so far trained `attn.model.Transformer`, the readable model: one
# forward/backward pair per layer, each a few lines of array code that allocate new
# arrays everywhere. `attn-train` by default trains its twin, `attn.fast.FastTransformer`,
# which computes the same numbers faster; on a GPU (CuPy) the memory-bound parts of
# the step run as hand-written CUDA kernels in `attn/fast/gpu/kernels/`. This lesson
# opens both and asks where the time of a training step goes.
#
# The tool is counting. We wrap arrays in a small NumPy subclass that records every
# operation run on them: how many (on a GPU each is roughly one **kernel launch**),
# how many bytes each reads and writes (its **passes over memory**), and how many
# floating-point operations the matrix products do. Counts are deterministic; the
# few timings below are printed for interest, never asserted (they depend on the
# machine and its load).

# %%
import os, sys
import matplotlib.pyplot as plt
from attn.plot import lesson_output_dir, show_figure, named_bars   # inline in a notebook; always saved to OUT
QUICK = os.environ.get("ATTN_QUICK") == "1" or "--quick" in sys.argv
OUT = lesson_output_dir()                     # <repository root>/lessons/out, git-ignored

import inspect
import re
import time

import numpy as np

from attn import backend as B
from attn.fast import FastTransformer, ops_for
from attn.fast import cross_entropy as fast_cross_entropy
from attn.fast.gpu import kernels
from attn.layers import layer_norm_forward
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig

B.set_backend("numpy")                                       # lessons run on the CPU
T0 = time.time()

# %% [markdown]
# ## 1. Counting what a step does
#
# `Counted` is an `ndarray` that intercepts NumPy's ufuncs (elementwise operations,
# their reductions such as `sum`, and `matmul`) and `einsum`. For each call it
# records the bytes of the arrays read and written and, for a matrix product, its
# floating-point operations (`2 M K N`: a multiply and an add per term). It does not
# see indexing (the embedding lookup) or copies such as `reshape` of a transposed
# array, so the counts are a slight undercount of the traffic, the same for both paths.

# %%
class Tally:
    def __init__(self):
        self.calls, self.read, self.written, self.flops, self.allocs, self.names = 0, 0, 0, 0, 0, []

    def add(self, name, inputs, results, fresh, flops=0):
        self.calls += 1
        self.read += sum(a.nbytes for a in inputs if isinstance(a, np.ndarray))
        self.written += sum(r.nbytes for r in results if isinstance(r, np.ndarray))
        self.allocs += fresh
        self.flops += flops
        self.names.append(name)


TALLY = Tally()


def plain(x):
    """Counted arrays (also inside lists and tuples) as plain ndarrays."""
    if isinstance(x, Counted):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(plain(i) for i in x)
    return x


class Counted(np.ndarray):
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        args = plain(inputs)
        if out is not None:
            kw["out"] = plain(out)
        res = getattr(ufunc, method)(*args, **kw)
        results = res if isinstance(res, tuple) else (res,)
        flops = 0
        if ufunc is np.matmul:                            # (..., M, K) @ (..., K, N): 2 M K N per product
            flops = 2 * int(np.size(res)) * args[0].shape[-1]
        name = ufunc.__name__ + ("" if method == "__call__" else "." + method)
        TALLY.add(name, args, results, fresh=out is None, flops=flops)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return res.view(Counted) if isinstance(res, np.ndarray) else res

    def __array_function__(self, func, types, args, kwargs):
        res = func(*plain(args), **{k: plain(v) for k, v in kwargs.items()})
        if func is np.einsum:
            TALLY.add("einsum", [a for a in plain(args) if isinstance(a, np.ndarray)], (res,),
                      fresh=kwargs.get("out") is None)
        return res.view(Counted) if isinstance(res, np.ndarray) and not isinstance(res, Counted) else res


def counted(fn):
    """Run fn() with a fresh tally; return (its result, the tally)."""
    global TALLY
    TALLY = Tally()
    return fn(), TALLY


# %% [markdown]
# ## 2. Fusion: residual and layer norm, three ways
#
# Every sub-layer of the post-norm Transformer ends in `LayerNorm(x + Sublayer(x))`
# (lesson 7). Take one such output, `N` positions of width `d_model`, and count.
#
# * **Readable** (`attn.layers.layer_norm_forward(x + s, ...)`): every line of the
#   formula is a NumPy operation that reads its inputs from memory and writes a new
#   array: the sum, the mean, the centring, the square, the variance, and so on.
# * **Fast, on NumPy** (`attn.fast.ops_for(numpy).layer_norm_`): the same arithmetic
#   with in-place operations (`x += s`, `x -= mean`, ...) and the reductions as
#   matrix-vector products. Much the same traffic, but almost no new arrays: on a CPU
#   the saving is in allocations and the memory they touch.
# * **Fast, on a GPU** (`CupyOps.layer_norm_`): the residual sum (one elementwise
#   kernel) and then one launch of the `layer_norm_fwd` kernel, in which one block of
#   threads owns one row: it reads the row, reduces it to a mean and a variance in
#   the block's shared memory, and writes `xhat` (kept for the backward pass) and the
#   output. Its loops pass over the row three times, but a row is a few kilobytes
#   that one block has just read; the traffic to the GPU's main memory is one read of
#   the row and two writes. We count that from the kernel's access pattern, as the
#   twin in section 4 does.
#
# We count bytes in units of one `N x d_model` array ("passes").

# %%
N, D = 256, 512
rng = np.random.default_rng(0)
x, s = rng.standard_normal((N, D)), rng.standard_normal((N, D))
gamma, beta = 1 + 0.1 * rng.standard_normal(D), 0.1 * rng.standard_normal(D)
xc, sc, gc, bc = (a.view(Counted) for a in (x, s, gamma, beta))
pass_bytes = N * D * x.itemsize

(readable_out, _), t_read = counted(lambda: layer_norm_forward(xc + sc, gc, bc, 1e-6))
y = xc.copy()


def fast_ln():
    global y
    y += sc
    return ops_for(np).layer_norm_(y, gc, bc, 1e-6)


(fast_out, fast_rstd), t_fast = counted(fast_ln)
gpu = dict(calls=2, read=(2 + 1) * pass_bytes, written=(1 + 2) * pass_bytes)   # add: 2 reads, 1 write;
#                                                                      kernel: 1 read, xhat and out written
ideal = dict(calls=1, read=2 * pass_bytes, written=2 * pass_bytes)     # the add inside the kernel
rows = [("readable (attn.layers)", t_read.calls, t_read.read, t_read.written, t_read.allocs),
        ("fast, NumPy (in place)", t_fast.calls, t_fast.read, t_fast.written, t_fast.allocs),
        ("fast, GPU (add + kernel)", gpu["calls"], gpu["read"], gpu["written"], None),
        ("GPU, add fused in kernel", ideal["calls"], ideal["read"], ideal["written"], None)]
print(f"residual + layer norm of {N} x {D} float64 ({pass_bytes / 1e6:.2f} MB per pass):")
print(f"{'':<32} {'launches':>8} {'passes read':>12} {'written':>8} {'new arrays':>11}")
for name, calls, rd, wr, al in rows:
    print(f"{name:<32} {calls:>8} {rd / pass_bytes:>12.2f} {wr / pass_bytes:>8.2f} {'' if al is None else al:>11}")
print("readable operations:", " ".join(t_read.names))
print("fast operations:    ", " ".join(t_fast.names))
ln_err = float(np.abs(plain(readable_out) - plain(fast_out)).max())
print(f"the two NumPy versions agree to {ln_err:.1e}")

# %% [markdown]
# A layer norm does a handful of arithmetic operations per number it touches; a GPU
# can do many more than that in the time it takes to fetch one number from its main
# memory (section 5 prints the P100's ratio, its *balance point*). So the time of
# such an operation is the time to move its
# bytes, and the only way to make it faster is to move fewer: **fusion**, doing
# several steps of the formula while the numbers are in registers or cache, instead
# of writing each intermediate out and reading it back. The passes column is the
# whole story of the GPU kernels' speed-up on these operations, and the launches
# column is the second half of section 5.
#
# ## 3. The fast path computes the same numbers
#
# Fusing, reordering and working in place change the order of floating-point
# operations, so results agree to rounding, not bit for bit. In float64 that rounding
# is tiny: build a float64 model, make its fast twin with
# `FastTransformer.from_model`, and compare one training step's loss and every
# gradient. (`tests/test_fast.py` does the same for every option: dropout, pre-norm,
# learned positions, separate embeddings.) We compare each gradient relative to the
# largest one: one kind of parameter has a gradient that is exactly zero in exact
# arithmetic, the key projections' bias `b_k`. It adds $q \cdot b_k$ to every score of a
# query alike, and the softmax does not change when all its inputs shift by the same
# amount; both paths return rounding noise there, which no per-parameter relative
# comparison could match.

# %%
cfg = TransformerConfig.preset("toy", vocab_size=500, dropout=0.0)
readable = Transformer(cfg, seed=0, dtype="float64")
fast = FastTransformer.from_model(readable)
r = np.random.default_rng(1)
src, tgt = r.integers(4, cfg.vocab_size, (16, 12)), r.integers(4, cfg.vocab_size, (16, 13))
src[:4, 9:] = 0                                                # some padding
tgt[:4, 10:] = 0


def step(model, loss_fn):
    logits, cache = model.forward(src, tgt[:, :-1])
    loss, dlogits = loss_fn(logits, tgt[:, 1:], 0.1)
    return float(loss), model.backward(dlogits, cache)


loss_r, grads_r = step(readable, cross_entropy)
loss_f, grads_f = step(fast, fast_cross_entropy)
scale = max(float(np.abs(g).max()) for g in grads_r.values())
grad_err = max(float(np.abs(grads_r[k] - grads_f[k]).max()) for k in grads_r) / scale
print(f"loss: readable {loss_r:.12f}, fast {loss_f:.12f}; largest gradient difference over {len(grads_r)} "
      f"parameters, relative to the largest gradient: {grad_err:.1e}")
b_k = max(float(np.abs(grads_r[k]).max()) for k in grads_r if k.endswith(".b_k"))
print(f"largest gradient of a key bias b_k (both paths): {b_k:.1e}, rounding noise around an exact zero")

times = {}
for name, model, fn in (("readable", Transformer(cfg, seed=0), cross_entropy),
                        ("fast", FastTransformer.from_model(Transformer(cfg, seed=0)), fast_cross_entropy)):
    step(model, fn)                                            # warm up
    t = time.perf_counter()
    for _ in range(3 if QUICK else 10):
        step(model, fn)
    times[name] = (time.perf_counter() - t) / (3 if QUICK else 10)
print(f"one float32 step of the toy model, this machine: readable {1e3 * times['readable']:.1f} ms, fast "
      f"{1e3 * times['fast']:.1f} ms (printed, not a benchmark)")

# %% [markdown]
# ## 4. A CUDA kernel and its NumPy twin
#
# No GPU is needed to read, compile or test the kernels. Each CUDA kernel in
# `attn/fast/gpu/kernels/` (a module per family of kernels, all listed once in its
# `registry.py`) has beside it a **NumPy twin**: a function that takes what the kernel
# takes (the launch's grid, block and shared memory, then the arguments, arrays
# standing for the memory the kernel's pointers point at) and computes what the kernel
# computes. The test suite compiles the CUDA source with NVRTC (the CUDA compiler as a
# library) and runs the launch code with each kernel replaced by its twin. Here is the
# layer-norm kernel, as it is in `layer_norm.py`, after the device function that
# normalises one row (in `common.py`: the fused residual + layer-norm kernel calls it too):

# %%
kernel_src = kernels.KERNELS["layer_norm_fwd"][0].strip()        # (its CUDA source, its NumPy twin)
helper_src = re.search(r"(// Layer norm of one row.*?\n}\n)", kernels.SOURCE, re.S).group(1).strip()
print(helper_src, kernel_src, sep="\n\n")

# %% [markdown]
# `blockIdx.x` is the row; the block's `blockDim.x` threads stride over the row's
# columns (thread `j` takes columns `j`, `j + blockDim.x`, ...), each keeps a
# partial sum, and `block_sum` adds the partial sums in a tree in shared memory (at
# each step half of the threads add a neighbour's value), which needs a power-of-two
# block. And its twin, the same computation as whole-array NumPy, which checks the
# launch as it goes:

# %%
print(inspect.getsource(kernels.layer_norm_fwd_np))


class Launch:
    """What a kernel launch is: a grid of blocks, a block of threads, bytes of shared memory."""

    def __init__(self, name, grid, block, shared_mem):
        self.name, self.grid, self.block, self.shared_mem = name, grid, block, shared_mem
        self.threads, self.blocks = int(np.prod(block)), int(np.prod(grid))


threads = kernels.block_size_for(D)
xk, out_k, rstd_k = x + s, np.empty_like(x), np.empty(N)
kernels.layer_norm_fwd_np(Launch("layer_norm_fwd", (N,), (threads,), threads * x.itemsize),
                          xk, out_k, rstd_k, gamma, beta, D, 1e-6)
ref_out, ref_cache = layer_norm_forward(x + s, gamma, beta, 1e-6)
twin_err = float(max(np.abs(out_k - ref_out).max(), np.abs(xk - ref_cache.xhat).max()))
print(f"a launch of {N} blocks x {threads} threads: the twin's output and xhat equal attn.layers' to {twin_err:.1e}")
refused = []
for bad in (Launch("layer_norm_fwd", (N,), (threads - 1,), threads * 8),      # not a power of two
            Launch("layer_norm_fwd", (N,), (threads,), threads * 4)):          # too little shared memory
    try:
        kernels.layer_norm_fwd_np(bad, (x + s).copy(), np.empty_like(x), np.empty(N), gamma, beta, D, 1e-6)
    except ValueError as e:
        refused.append(str(e))
print("wrong launches the twin refuses (on a GPU they would compute garbage silently):")
for e in refused:
    print("  ", e)
print(f"kernels with twins in attn/fast/gpu/kernels/: {', '.join(kernels.NUMPY_TWINS)}")

# %% [markdown]
# ## 5. What a GPU step costs
#
# A simple model of a GPU (the *roofline*): an operation takes at least as long as
# its arithmetic at the peak rate, and at least as long as its bytes at the memory
# bandwidth; each launch adds a fixed overhead, the time for the host to tell the
# GPU what to run. For the constants we take the paper's GPU, the P100: its peak from
# the paper's footnote 5, its memory bandwidth from NVIDIA's data sheet, and a
# launch overhead typical of CUDA (an assumption; it varies with the driver and the
# host).
#
# We count one float32 training step (forward, label-smoothed loss, backward; no
# Adam) on both paths, for the toy model at a small batch and for the paper's base
# model. The base model is counted at one and two sentences (of the length printed
# below): every
# count is exactly linear in the number of sentences (one constant part, the weights,
# and one part per sentence), so two counts give the step at any batch. The paper's
# batches held about 25,000 target tokens, split over 8 GPUs.

# %%
P100_FLOPS = 9.5e12          # FLOP/s, the paper's footnote 5
P100_BYTES = 732e9           # bytes/s, HBM2 bandwidth (NVIDIA Tesla P100 SXM2 data sheet)
LAUNCH_S = 5e-6              # seconds per kernel launch (assumed; a few microseconds is typical)
PAPER_STEP_S, PAPER_TOKENS, PAPER_GPUS = 0.4, 25000, 8   # section 5.2


def count_step(cfg, Bsz, T, fast_path):
    model = Transformer(cfg, seed=0)
    if fast_path:
        model = FastTransformer.from_model(model)
        model.workers = 1                                   # no thread split: one GPU's order of work
        arena = model.arena                                 # the fast path keeps its weights in one flat buffer:
        arena.params = arena.params.view(Counted)           # count that buffer, and hand the model its views
        arena.param_views = arena.views(arena.params)
        model.params.update(arena.param_views)
    else:
        model.params = {k: v.view(Counted) for k, v in model.params.items()}
    r = np.random.default_rng(2)
    src, tgt = r.integers(4, cfg.vocab_size, (Bsz, T)), r.integers(4, cfg.vocab_size, (Bsz, T + 1))
    loss_fn = fast_cross_entropy if fast_path else cross_entropy

    def run():
        logits, cache = model.forward(src, tgt[:, :-1])
        loss, dlogits = loss_fn(logits, tgt[:, 1:], 0.1)
        return model.backward(dlogits, cache)
    _, t = counted(run)
    mm = [i for i, n in enumerate(t.names) if n == "matmul"]
    return dict(calls=t.calls, bytes=t.read + t.written, flops=t.flops, matmuls=len(mm))


def roofline(c):
    compute, memory, launch = c["flops"] / P100_FLOPS, c["bytes"] / P100_BYTES, c["calls"] * LAUNCH_S
    return dict(compute=compute, memory=memory, launch=launch, total=max(compute, memory) + launch)


toy_cfg = TransformerConfig.preset("toy", vocab_size=1000, dropout=0.0)
base_cfg = TransformerConfig.preset("base", vocab_size=37000, dropout=0.0)
T_BASE = 32
paper_sentences = PAPER_TOKENS / PAPER_GPUS / T_BASE           # one GPU's share of a batch
results = {}
for path in ("readable", "fast"):
    results["toy", path] = count_step(toy_cfg, 16, 12, path == "fast")
    one, two = (count_step(base_cfg, b, T_BASE, path == "fast") for b in (1, 2))
    assert one["calls"] == two["calls"], "the number of operations does not depend on the batch"
    results["base", path] = {k: one[k] + (two[k] - one[k]) * (paper_sentences - 1) for k in one}
print(f"one GPU's share of the paper's batch: {paper_sentences:.0f} sentences of {T_BASE} tokens")
print(f"{'model, path':<16} {'launches':>8} {'GFLOP':>8} {'GB moved':>9} {'FLOP/byte':>9} "
      f"{'compute ms':>10} {'memory ms':>9} {'launch ms':>9} {'step ms':>8}")
est = {}
for (model_name, path), c in results.items():
    est[model_name, path] = e = roofline(c)
    print(f"{model_name + ', ' + path:<16} {c['calls']:>8.0f} {c['flops'] / 1e9:>8.2f} {c['bytes'] / 1e9:>9.3f} "
          f"{c['flops'] / c['bytes']:>9.1f} {1e3 * e['compute']:>10.3f} {1e3 * e['memory']:>9.3f} "
          f"{1e3 * e['launch']:>9.3f} {1e3 * e['total']:>8.2f}")
print(f"the P100's balance point: {P100_FLOPS / P100_BYTES:.0f} FLOP per byte; the paper's base step took "
      f"{PAPER_STEP_S} s")
launch_share = {k: v["launch"] / v["total"] for k, v in est.items()}
print("share of the estimated step spent launching: "
      + ", ".join(f"{m} {p} {v:.0%}" for (m, p), v in launch_share.items()))


fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
ys = np.arange(len(rows))
reads, writes = np.array([r[2] for r in rows]) / pass_bytes, np.array([r[3] for r in rows]) / pass_bytes
ax[0].barh(ys, reads, 0.45, color="0.6", label="read")
ax[0].barh(ys, writes, 0.45, left=reads, color="0.2", label="written")
named_bars(ax[0], [name for name, *_ in rows])
ax[0].set_xlabel(f"passes over a {N} x {D} array"); ax[0].set_title("residual + layer norm: memory traffic")
keys = list(est)
left = np.zeros(len(keys))
for part, color in (("compute", "tab:blue"), ("memory", "tab:orange"), ("launch", "tab:red")):
    vals = np.array([est[k][part] / (est[k]["compute"] + est[k]["memory"] + est[k]["launch"]) for k in keys])
    ax[1].barh(np.arange(len(keys)), vals, 0.45, left=left, color=color, label=part)
    left += vals
named_bars(ax[1], [f"{m}, {p}" for m, p in keys])
ax[1].set_xlabel("share of the summed estimates"); ax[1].set_title("a P100 step, estimated from the counts")
# the keys sit outside the panels (above the first, under the second), where a phone's narrow
# column stacks the panels without a key landing on a neighbour's title
fig.legend(*ax[0].get_legend_handles_labels(), loc="outside upper left", ncols=2, fontsize=8)
fig.legend(*ax[1].get_legend_handles_labels(), loc="outside lower right", ncols=2, fontsize=8)
fig.tight_layout(); show_figure(fig, "22_fast_path.png")

# %% [markdown]
# Read the table (the numbers are this run's):
#
# * For the **toy model** the arithmetic is a fraction of a millisecond on a P100,
#   and nearly all of the estimated step is launching kernels: one per operation.
#   A GPU only pays off when every launch has enough work; fusing operations helps
#   here by launching fewer kernels, not by moving fewer bytes.
# * For the **base model** at the paper's batch, the matrix products dominate:
#   their FLOP per byte is well above the P100's balance point, so they run near
#   the peak rate, and the estimate is of the order of the paper's measured step.
#   The estimate is a lower bound (every operation at its peak rate, no overlap
#   lost), and it sits below what the paper measured, which also included the
#   optimizer, the exchange of gradients between the 8 GPUs, and real kernels'
#   distance from the peak.
# * The fast path launches fewer operations and moves fewer bytes than the readable
#   one for the same arithmetic. On a GPU, the CuPy kernels of section 4 fold each
#   chain of memory-bound operations into one or two launches on top of that.
#
# ## Check
#
# These fail if the fast path computed different numbers, if the kernel's twin
# disagreed with the readable layer norm or accepted a wrong launch, or if the counts
# did not show what the prose says: fusion moves fewer bytes in fewer launches, the
# toy step is launch-bound and the base step compute-bound, and the estimate is
# below the paper's measured step.

# %%
assert ln_err < 1e-12 and twin_err < 1e-12, (ln_err, twin_err)
assert abs(loss_r - loss_f) < 1e-10 and grad_err < 1e-10 and b_k < 1e-12, (loss_r, loss_f, grad_err, b_k)
assert len(refused) == 2, refused
assert t_read.read + t_read.written > t_fast.read + t_fast.written > gpu["read"] + gpu["written"] \
    > ideal["read"] + ideal["written"], "each fusion moves fewer bytes"
assert t_read.calls > t_fast.calls > gpu["calls"] > ideal["calls"] and t_fast.allocs < t_read.allocs
for model_name in ("toy", "base"):
    r_, f_ = results[model_name, "readable"], results[model_name, "fast"]
    assert f_["calls"] < r_["calls"] and f_["bytes"] < r_["bytes"], f"{model_name}: the fast path does less"
assert launch_share["toy", "fast"] > 0.5, "the toy step on a GPU is mostly launch overhead"
base = est["base", "fast"]
assert base["compute"] > base["memory"] and launch_share["base", "fast"] < 0.2, "the base step is compute-bound"
assert PAPER_STEP_S / 10 < base["total"] < PAPER_STEP_S, "a lower bound on the measured step, of its order"
print(f"Check passed in {time.time() - T0:.1f} s: fast path equal to the readable one (relative gradient "
      f"difference {grad_err:.0e}); residual + layer norm in {t_read.calls} operations and "
      f"{(t_read.read + t_read.written) / pass_bytes:.0f} passes readable, {gpu['calls']} launches and "
      f"{(gpu['read'] + gpu['written']) / pass_bytes:.0f} passes on a GPU; estimated P100 step: toy "
      f"{1e3 * est['toy', 'fast']['total']:.2f} ms ({launch_share['toy', 'fast']:.0%} launching), base "
      f"{1e3 * base['total']:.0f} ms against the paper's {PAPER_STEP_S} s.")

# %% [markdown]
# ## Questions
#
# 1. Why does fusing the layer norm speed it up on a GPU, when it does not change the
#    number of floating-point operations?
#
#    <details><summary>Answer</summary>
#
#    Layer norm is memory-bound: each unfused step reads and writes the whole array in
#    memory to do very little arithmetic on it. Fusing does all the steps on each row in
#    one pass, reading the input once and writing the output once, so the memory traffic,
#    which is the real cost, falls.
#
#    </details>
#
# 2. The toy model's step is estimated to be mostly launch overhead. What two changes
#    to the training run would shift it towards being compute-bound?
#
#    <details><summary>Answer</summary>
#
#    Larger work per launch: bigger batches (more tokens per step) and a bigger model
#    (wider matrices), so each kernel does more arithmetic for its fixed launch cost.
#
#    </details>
#
# 3. What does a kernel's NumPy twin let the test suite check without a GPU, and what
#    can it not check?
#
#    <details><summary>Answer</summary>
#
#    That the kernel's algorithm gives the right numbers, against the plain layers, on
#    any inputs, on a machine without a GPU. It cannot check that the real GPU code
#    compiles and runs, that it uses the GPU correctly (memory, launch sizes, races), nor
#    how fast it is.
#
#    </details>

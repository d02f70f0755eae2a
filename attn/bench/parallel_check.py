"""``mpiexec -n 2 python -m attn.bench.parallel_check``: the proof that N processes train
exactly as one does.

Every rank takes the same few steps of a small model, on its share of batches that split
unevenly (long sentences in the first rows, short ones after: the halves hold very different
numbers of tokens, and the short half is mostly padding), with dropout on. Rank 0 then takes
the same steps alone, on the whole batches, each split into two parts on two threads as
attn-train's default engine splits it on two cores, and compares:

    the gradients of the first step       (relative error per parameter, attn.gradcheck.rel_error)
    the loss of every step                (relative difference)
    the parameters after the last step    (relative error per parameter, and of all as one vector,
                                           but for the key biases: see zero_in_truth)
    every rank's parameters               (bit for bit: their SHA-256 hashes)
    the target tokens the all-reduce summed (the whole batch's: the shares cover it once)

On the fast engine the buffer all-reduced is the model's own gradient arena, in place.

It prints one JSON line per case and exits with status 1 if a case misses the bounds
(:data:`BOUNDS`, for float64). ``--wrong-normalisation`` demonstrates the mistake that the sum
of gradients avoids: every rank normalises its loss by its *own* token count and the ranks'
gradients are averaged; the check then fails. ``--wrong-dropout-keys`` demonstrates why the
counter-based dropout of attn.fast on CuPy (``dropout_hash``, the default there) keys each element
by its index in the *global* batch: keyed by its index in the rank's share, each rank draws other
masks than one process does, and the check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from .. import backend as B
from .. import engine as engines
from ..data import Batch
from ..gradcheck import rel_error
from ..masks import PAD_ID
from ..model import Transformer, TransformerConfig
from ..training import distributed
from ..training.prepare import make_engine, step_loss_fn

#: The largest differences allowed in float64 (gradients of step 1, losses, parameters after the last step).
BOUNDS = {"grad": 1e-12, "loss": 1e-13, "param": 1e-10}
#: Parts the process alone splits each batch into, on threads, as attn-train does on two cores (each
#: rank takes its share in one part): the dropout masks must not depend on how the batch is cut.
ALONE_WORKERS = 2
#: Sentences per batch: the third has fewer sentences than... one rank, when there are two or more.
BATCH_SIZES = (5, 4, 1)


def check_batches(vocab_size: int, seed: int = 0) -> list[Batch]:
    """Batches whose first rows are long sentences and the rest short ones, padded to the longest."""
    rng = B.host_rng(seed)
    np = B.host
    batches = []
    for size in BATCH_SIZES:
        long_rows = size // 2
        lengths = [int(rng.integers(9, 13)) if i < long_rows else int(rng.integers(1, 3)) for i in range(size)]
        S, T = max(lengths) + 1, max(lengths) + 2
        src = np.full((size, S), PAD_ID, dtype=np.int64)
        tgt_in = np.full((size, T), PAD_ID, dtype=np.int64)
        tgt_out = np.full((size, T), PAD_ID, dtype=np.int64)
        for row, n in enumerate(lengths):
            ids = rng.integers(4, vocab_size, size=n + 1)
            src[row, :n + 1] = ids                        # n ids then an EOS stand-in (any real id)
            tgt = rng.integers(4, vocab_size, size=n + 1)
            tgt_in[row, 0] = 2
            tgt_in[row, 1:n + 2] = tgt
            tgt_out[row, :n + 1] = tgt
            tgt_out[row, n + 1] = 3
        batches.append(Batch(src, tgt_in, tgt_out, int((src != PAD_ID).sum()), int((tgt_out != PAD_ID).sum())))
    return batches


def check_model(dtype: str, reference: bool, workers: int = 1):
    """A small model with every dropout on, its optimizer and its loss; the fast engine's NumPy
    forward split into ``workers`` parts on threads (each part draws its rows of the whole
    batch's dropout), as attn-train splits it on as many cores."""
    cfg = TransformerConfig.preset("toy", vocab_size=23, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2,
                                   n_decoder_layers=2, dropout=0.1, attention_dropout=0.1, relu_dropout=0.1,
                                   label_smoothing=0.1, warmup_steps=4)
    engine = "reference" if reference else "fast"
    model, opt = make_engine(Transformer(cfg, seed=0, dtype=dtype), engine, 1.0)
    if not reference:
        model.workers = workers
        opt.threads = 1
    return model, opt, step_loss_fn(engine)


def take_steps(model, opt, loss_fn, batches, dp=None, seed: int = 0):
    """The steps; returns (losses, the first step's gradients, the parameters after the last) on the host."""
    from ..fast.training.loop import train_step
    first = {}
    step = opt.step

    def keep_first(grads, **how):
        if not first:
            first.update({k: B.to_host(g).copy() for k, g in grads.items()})
        return step(grads, **how)

    opt.step = keep_first
    losses = []
    for s, batch in enumerate(batches):
        rng = B.DeviceRNG(seed * 1_000_003 + s)
        loss, _ = train_step(model, opt, batch, rng, model.config.label_smoothing, 0.0, loss_fn, dp)
        losses.append(B.to_float(loss))
    opt.step = step
    return losses, first, {k: B.to_host(p).copy() for k, p in model.params.items()}


def zero_in_truth(grads: dict) -> set:
    """The parameters whose gradient is zero in truth: the attention key biases (a key bias
    shifts every score of a row equally, which softmax ignores). Their computed gradient is
    rounding noise (about 1e-17 in float64), which Adam divides by its own square root: each
    step moves them by about ``lr * noise / eps``, around 1e-9, in a direction that rounding
    decides. Their differences are reported (``zero_gradient_params_max_abs``), not bounded."""
    largest = max(float((g.astype("float64") ** 2).sum()) ** 0.5 for g in grads.values())
    return {k for k, g in grads.items() if float((g.astype("float64") ** 2).sum()) ** 0.5 < 1e-12 * largest}


def vector_rel(a: dict, b: dict, skip=()) -> float:
    """``|a - b| / |b|`` over the parameters (but ``skip``) as one vector."""
    diff = sum(float(((a[k].astype("float64") - b[k]) ** 2).sum()) for k in b if k not in skip)
    norm = sum(float((b[k].astype("float64") ** 2).sum()) for k in b if k not in skip)
    return (diff / norm) ** 0.5


def run_case(comm, backend: str, transport: str, reference: bool, dtype: str, wrong: bool,
             bucket_bytes: int, wrong_dropout: bool = False) -> dict:
    """One case on every rank; rank 0's comparison, the same dict on every rank."""
    B.set_backend(backend)
    dp = _group(comm, transport, bucket_bytes, wrong, wrong_dropout)
    model, opt, loss_fn = check_model(dtype, reference)
    dp.check_same_parameters(model.params)
    counter = not reference and getattr(model.ops, "counter_dropout", False)
    batches = check_batches(model.config.vocab_size)
    seen = _watch_all_reduce(dp)
    losses, grads, params = take_steps(model, opt, loss_fn, batches, dp)
    seen.losses, seen.grads, seen.params = losses, grads, params
    seen.same_on_ranks = len(set(comm.allgather(distributed.parameter_digest(params)))) == 1
    seen.tokens = [[mine.n_tgt_tokens if weight else 0 for r in range(dp.size)
                    for mine, _, _, weight in [distributed.share_of(b, dp.size, r)]] for b in batches]
    flat = dp.flat_grads(model.params, engines.gradient_arena(model))
    result = None
    if dp.master:
        result = {"backend": B.describe() if backend == "numpy" else backend, "transport": dp.transport,
                  "engine": "reference" if reference else "fast", "dtype": dtype, "processes": dp.size,
                  "alone_parts": 1 if reference else ALONE_WORKERS,
                  "normalisation": "local (wrong)" if wrong else "global",
                  "dropout": ("drawn from the step's stream" if not counter else
                              "counter-based, keyed by the index in the share (wrong)" if wrong_dropout else
                              "counter-based, keyed by the index in the global batch"),
                  "target_tokens_per_rank": seen.tokens, "buckets": len(flat.buckets),
                  "all_reduce_buffer": "the arena's own" if flat.arena is not None else "a copy",
                  **_against_alone(seen, batches, dtype, reference)}
    return comm.bcast(result, root=0)


def _group(comm, transport: str, bucket_bytes: int, wrong: bool, wrong_dropout: bool):
    """The ranks' :class:`attn.training.distributed.MPIGroup` on ``transport``, with the mistake
    a ``--wrong-*`` flag demonstrates put in."""
    dp = distributed.MPIGroup(comm)
    dp.use_backend(transport)
    dp.bucket_bytes = bucket_bytes
    if wrong:
        dp.share = lambda batch, rng=None, model=None, _share=dp.share: (*_share(batch, rng, model)[:2], 1.0 / dp.size)
    if wrong_dropout:
        def share(batch, rng=None, model=None, _share=dp.share):
            mine, rows_of, weight = _share(batch, rng, model)
            rows_of.place = lambda shape: (0, 0, 0)         # the index in the share: as if alone
            return mine, rows_of, weight
        dp.share = share
    return dp


@dataclass
class _Ranks:
    """What the ranks did: the all-reduce's device -> host ``transfers`` over all steps (None
    off the CuPy stand-in), whether each bucket went out during the backward, the target tokens
    it summed; then the steps' losses, first gradients and last parameters, whether the ranks'
    parameters agree bit for bit, and each batch's target tokens on each rank."""
    transfers: int | None = 0
    overlapped: list = field(default_factory=list)
    summed_tokens: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    same_on_ranks: bool = False
    tokens: list = field(default_factory=list)


def _watch_all_reduce(dp) -> _Ranks:
    """``dp``'s all-reduce (its ``_launch`` and ``_finish``) counted into a new :class:`_Ranks`."""
    seen = _Ranks()
    for name in ("_launch", "_finish"):      # device -> host transfers inside the all-reduce (stand-in only)
        def counted(*args, _f=getattr(dp, name)):
            before = _transfers()
            out = _f(*args)
            seen.transfers = None if before is None else seen.transfers + _transfers() - before
            if _f.__name__ == "_finish":
                seen.overlapped.append(dp.launched_during_backward)
                seen.summed_tokens.append(B.to_float(dp.summed_tokens))
            return out
        setattr(dp, name, counted)
    return seen


def _against_alone(seen: _Ranks, batches: list, dtype: str, reference: bool) -> dict:
    """The same steps in this process alone (in :data:`ALONE_WORKERS` parts), compared with the
    ranks': the differences, and whether they pass :data:`BOUNDS`."""
    model1, opt1, loss_fn1 = check_model(dtype, reference, workers=ALONE_WORKERS)
    losses1, grads1, params1 = take_steps(model1, opt1, loss_fn1, batches)
    zero = zero_in_truth(grads1)
    losses, grads, params, transfers = seen.losses, seen.grads, seen.params, seen.transfers
    result = {
        "summed_tokens": seen.summed_tokens, "batch_tokens": [b.n_tgt_tokens for b in batches],
        "max_grad_rel": max(rel_error(grads[k], grads1[k]) for k in grads1),
        "max_loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, losses1)),
        "max_param_rel": max(rel_error(params[k], params1[k]) for k in params1 if k not in zero),
        "param_vector_rel": vector_rel(params, params1, skip=zero),
        "zero_gradient_params": sorted(zero),
        "zero_gradient_params_max_abs": max((float(abs(params[k] - params1[k]).max()) for k in zero), default=0.0),
        "ranks_bitwise_equal": seen.same_on_ranks, "losses": losses,
        "all_reduce_host_transfers_per_step": transfers / len(batches) if transfers is not None else None,
        "buckets_sent_during_backward": seen.overlapped}
    result["pass"] = bool(seen.same_on_ranks and seen.summed_tokens == [float(b.n_tgt_tokens) for b in batches]
                          and result["max_grad_rel"] <= BOUNDS["grad"]
                          and result["max_loss_rel"] <= BOUNDS["loss"]
                          and result["max_param_rel"] <= BOUNDS["param"]
                          and result["param_vector_rel"] <= BOUNDS["param"])
    return result


def _transfers():
    """Device -> host transfers so far on the CuPy stand-in (None elsewhere)."""
    counter = getattr(B.xp(), "transfers", None) if B.get_backend() == "cupy" else None
    return getattr(counter, "n", None) if counter is not None else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpiexec -n N python -m attn.bench.parallel_check",
        description="N processes take a few steps of a small model on their shares of uneven batches; "
                    "process 0 takes them alone on the whole batches and compares gradients, losses and "
                    "parameters (one JSON line per case; exit status 1 if a case misses the bounds).")
    p.add_argument("--backend", nargs="+", default=["numpy"], choices=["numpy", "cupy"])
    p.add_argument("--transport", nargs="+", default=["auto"], choices=["auto", "mpi", "nccl"],
                   help="on CuPy: NCCL, or MPI staged through the host (auto: NCCL where CuPy has it)")
    p.add_argument("--engine", nargs="+", default=["fast"], choices=["fast", "reference"],
                   help="attn.fast's model, or the readable reference classes")
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--bucket-bytes", type=int, default=4096,
                   help="all-reduce bucket size (small, so the small model's gradients go in several buckets)")
    p.add_argument("--wrong-normalisation", action="store_true",
                   help="each rank normalises by its own token count and the gradients are averaged: must fail")
    p.add_argument("--wrong-dropout-keys", action="store_true",
                   help="the counter-based dropout (CuPy, fast engine) keyed by the index in each rank's share, "
                        "not in the global batch: must fail")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    ok = True
    for backend in args.backend:
        for transport in (args.transport if backend == "cupy" else ["mpi"]):
            for engine in args.engine:
                result = run_case(comm, backend, transport, engine == "reference", args.dtype,
                                  args.wrong_normalisation, args.bucket_bytes, args.wrong_dropout_keys)
                if comm.Get_rank() == 0:
                    print(json.dumps(result), flush=True)
                ok = ok and result["pass"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m attn.bench --data-parallel N``: what data parallelism costs and gains.

For each preset (``toy-bench`` and ``vocab-16k`` by default) it prints what is deterministic
first: the bytes all-reduced per step (the gradient arena: every gradient once, plus the loss
and the token count), the bytes each rank sends in a ring all-reduce (a reduce-scatter then an
all-gather: ``2 (N-1)/N`` times the buffer), and the step's matmul FLOPs, so the FLOPs per byte sent. Then it times a training step on the
preset's global batch with 1 and N processes (``mpiexec -n``), the N sharing each batch, and
reports the all-reduce's share of the step (time inside it on rank 0, waiting included).

Last, a model of the paper's setting: the ``base`` model on N ranks (8 by default, as the
paper's eight P100s), from a step time and a link bandwidth given as flags (the paper's
measured 0.4 s per step and a PCIe 3 x16 link by default): the all-reduce's time if it is not
overlapped with the backward, and the share of the step it would take.

On a machine with two cores two processes cannot be faster than one process with two threads
by much: they split the same cores, and every rank draws the whole batch's dropout numbers (on
NumPy; attn.fast's dropout on CuPy draws nothing). The figures say how large each part is.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from .. import backend as B
from ..engine import SLOT
from ..fast.core.arena import layout
from ..model import TransformerConfig, parameter_shapes
from .flops import model_flops
from .presets import BENCH_PRESETS, make_batch, model_config


def allreduce_bytes(cfg: TransformerConfig, itemsize: int = 4) -> int:
    """Bytes of the buffer all-reduced per step: attn.fast's gradient arena (every parameter's
    gradient, and the padding between its blocks, if any) and its slot for the loss and the
    token count."""
    return (layout(cfg).size + SLOT) * itemsize


def parameters(cfg: TransformerConfig) -> int:
    return sum(_size(s) for s in parameter_shapes(cfg).values())


def ring_bytes_per_rank(nbytes: int, ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``: ``N - 1`` steps
    of reduce-scatter and ``N - 1`` of all-gather, each moving ``1/N`` of the buffer."""
    return 2.0 * (ranks - 1) / ranks * nbytes


def _size(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def counts(preset: str, ranks: int) -> dict:
    """The deterministic figures of one preset at ``ranks`` processes."""
    bc = BENCH_PRESETS[preset]
    cfg = model_config(bc)
    nbytes = allreduce_bytes(cfg)
    flops = model_flops(cfg, bc.batch, bc.src_len, bc.tgt_len)
    ring = ring_bytes_per_rank(nbytes, ranks)
    return {"name": f"data_parallel_counts_{preset}", "preset": preset, "ranks": ranks,
            "parameters": parameters(cfg), "allreduce_bytes": nbytes, "ring_bytes_per_rank": ring,
            "step_flops": flops, "flops_per_rank": flops / ranks,
            "flops_per_byte_sent": (flops / ranks) / ring if ring else None,
            "batch": bc.batch, "src_len": bc.src_len, "tgt_len": bc.tgt_len}


def paper_model(ranks: int, step_seconds: float, link_gbytes: float) -> dict:
    """The base model (V 37,000 shared) on ``ranks`` GPUs: the all-reduce against a step."""
    cfg = TransformerConfig.preset("base", vocab_size=37000)
    nbytes = allreduce_bytes(cfg)
    ring = ring_bytes_per_rank(nbytes, ranks)
    seconds = ring / (link_gbytes * 1e9)
    return {"name": "data_parallel_model_base", "ranks": ranks, "parameters": parameters(cfg),
            "allreduce_bytes": nbytes, "ring_bytes_per_rank": ring, "link_gbytes_per_s": link_gbytes,
            "allreduce_seconds": seconds, "step_seconds": step_seconds,
            "allreduce_share_not_overlapped": seconds / (step_seconds + seconds),
            "step_flops_per_rank": model_flops(cfg, 400 // ranks, 64, 64)}


# --------------------------------------------------------------------------- timing (one rank)

def time_rank(preset: str, repeats: int, warmup: int, backend: str) -> dict | None:
    """Time training steps of ``preset`` on this rank's share of its batch (run under mpiexec).
    Returns rank 0's figures (None on the others)."""
    from ..data import Batch
    from ..masks import PAD_ID
    from ..model import Transformer
    from ..fast.training.loop import train_step
    from ..training import distributed
    from ..training.prepare import make_engine, step_loss_fn
    B.set_backend(backend)
    dp = distributed.group()
    dp.use_backend()
    bc = BENCH_PRESETS[preset]
    cfg = model_config(bc)
    model, opt = make_engine(Transformer(cfg, seed=0), "fast", 1.0)
    src, tgt_in, tgt_out = make_batch(bc)
    batch = Batch(src, tgt_in, tgt_out, int((src != PAD_ID).sum()), int((tgt_out != PAD_ID).sum()))
    dp.timing = True                            # NCCL: wait for the all-reduce, to time it
    loss_fn = step_loss_fn("fast")
    steps, shares = [], []
    for i in range(warmup + repeats):
        dp.barrier()
        before = getattr(dp, "comm_seconds", 0.0)
        t0 = time.perf_counter()
        loss, _ = train_step(model, opt, batch, B.DeviceRNG(i), cfg.label_smoothing, 0.0, loss_fn,
                             dp if dp.size > 1 else None)
        B.to_float(loss)
        if i >= warmup:
            steps.append(time.perf_counter() - t0)
            shares.append(getattr(dp, "comm_seconds", 0.0) - before)
    if not dp.master:
        return None
    step = statistics.median(steps)
    return {"name": f"data_parallel_step_{preset}", "preset": preset, "ranks": dp.size, "transport": dp.transport,
            "backend": B.describe(), "seconds_per_step": step,
            "tokens_per_second": (batch.n_src_tokens + batch.n_tgt_tokens) / step,
            "allreduce_seconds": statistics.median(shares), "allreduce_share": statistics.median(shares) / step,
            "repeats": repeats}


def launch(ranks: int, preset: str, repeats: int, warmup: int, backend: str) -> dict:
    """``mpiexec -n ranks`` of :func:`time_rank`; its JSON line."""
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "attn.bench.parallel", "--_rank", preset,
           "--repeats", str(repeats), "--warmup", str(warmup), "--backend", backend]
    # One process keeps its BLAS threads (every core: the fair baseline); each of N takes one.
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(lines[-1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attn.bench --data-parallel N",
        description="The bytes all-reduced per step against the step's FLOPs; a training step timed with 1 "
                    "and N processes (mpiexec) and the all-reduce's share of it; a model of N ranks for the "
                    "paper's base model. Needs mpi4py and mpiexec (pip install -e '.[mpi]') for the timing.")
    p.add_argument("--data-parallel", type=int, default=0, metavar="N", help="processes to compare with one")
    p.add_argument("--preset", nargs="+", default=["toy-bench", "vocab-16k"], choices=sorted(BENCH_PRESETS))
    p.add_argument("--quick", action="store_true", help="the tiny 'quick' preset, 1 warm-up and 2 repeats (tests)")
    p.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    p.add_argument("--repeats", type=int, default=5, help="timed steps (median; default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--no-timing", action="store_true", help="only the counts and the model (no mpiexec)")
    p.add_argument("--model-ranks", type=int, default=8, help="ranks of the base-model estimate (default 8)")
    p.add_argument("--step-seconds", type=float, default=0.4,
                   help="the base model's step time for the estimate (default 0.4: the paper's, section 5.2)")
    p.add_argument("--link-gbytes", type=float, default=12.0,
                   help="GB/s each rank sends and receives at in the ring (default 12: PCIe 3 x16)")
    p.add_argument("--json", action="store_true", help="one JSON object per result on stdout")
    p.add_argument("--_rank", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args._rank:
        result = time_rank(args._rank, args.repeats, args.warmup, args.backend)
        if result is not None:
            print(json.dumps(result), flush=True)
        return 0
    if args.data_parallel < 2:
        build_parser().error("--data-parallel N needs N >= 2 (it compares N processes with one)")
    if args.quick:
        args.preset, args.repeats, args.warmup = ["quick"], 2, 1
    rows = [counts(p, args.data_parallel) for p in args.preset]
    if not args.no_timing:
        if shutil.which("mpiexec") is None:
            print("attn.bench: error: --data-parallel times with mpiexec, which is not on PATH "
                  "(pip install -e '.[mpi]'; or --no-timing)", file=sys.stderr)
            return 2
        for p in args.preset:
            one = launch(1, p, args.repeats, args.warmup, args.backend)
            many = launch(args.data_parallel, p, args.repeats, args.warmup, args.backend)
            many["speedup"] = one["seconds_per_step"] / many["seconds_per_step"]
            rows += [one, many]
    rows.append(paper_model(args.model_ranks, args.step_seconds, args.link_gbytes))
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print_rows(rows)
    return 0


def print_rows(rows) -> None:
    for r in rows:
        if r["name"].startswith("data_parallel_counts"):
            print(f"{r['preset']}: {r['parameters']:,} parameters; {r['allreduce_bytes'] / 1e6:.2f} MB all-reduced "
                  f"per step, {r['ring_bytes_per_rank'] / 1e6:.2f} MB sent by each of {r['ranks']} ranks (ring); "
                  f"{r['step_flops'] / 1e9:.1f} GFLOP per step, {r['flops_per_byte_sent']:,.0f} FLOP per byte sent")
        elif r["name"].startswith("data_parallel_step"):
            who = f"{r['ranks']} processes ({r['transport']})" if r["ranks"] > 1 else "1 process"
            print(f"{r['preset']}, {who}: {r['seconds_per_step']:.3f} s/step, {r['tokens_per_second']:,.0f} tok/s, all-reduce "
                  f"{r['allreduce_seconds'] * 1e3:.1f} ms ({r['allreduce_share']:.0%} of the step)"
                  + (f", {r['speedup']:.2f}x one process" if "speedup" in r else ""))
        else:
            print(f"model: base ({r['parameters']:,} parameters) on {r['ranks']} ranks: "
                  f"{r['allreduce_bytes'] / 1e6:.0f} MB all-reduced, {r['ring_bytes_per_rank'] / 1e6:.0f} MB sent per "
                  f"rank, {r['allreduce_seconds'] * 1e3:.0f} ms at {r['link_gbytes_per_s']:g} GB/s against a "
                  f"{r['step_seconds']:g} s step: {r['allreduce_share_not_overlapped']:.0%} of it if not overlapped "
                  "with the backward")


if __name__ == "__main__":
    sys.exit(main())

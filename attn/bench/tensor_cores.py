"""The tensor-core attention on a GPU: ``python -m attn.bench.tensor_cores`` (the GPU report's
``tensor-cores`` part). The kernels of :mod:`attn.fast.gpu.kernels.flash_mma` compile by NVRTC but have
never run on a GPU; this is the one check that runs them, in order of risk:

1. ``tensor_cores_twin`` rows: the kernels (forward and backward) against their NumPy twins on the
   same inputs, at the tiles they are launched with, bf16 and fp16, heads of 64 and 128, causal,
   padded, grouped-query and cross-attention shapes, a query with no visible key among them; the
   largest error of the output and of each gradient as a share of the twin's largest value.
2. ``tensor_cores_time`` rows: at T = 1,024, 4,096 and 8,192 (8,192 tokens a batch, the base
   model's 8 heads of 64), causal and not, the forward and the forward+backward of the
   tensor-core attention (the float32 views packed to bf16 included), of the float32 tiled
   attention (:mod:`attn.fast.core.flash`) and of PyTorch's ``scaled_dot_product_attention`` on bf16
   tensors: the median of the repeats, timed by CUDA events, and each one's time over SDPA's.

Every row carries the commit. One JSON object a line with ``--json``; ``--dry-run`` runs it on the
CuPy stand-in at T = 64 without PyTorch (the pipeline, not a figure).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from .. import backend as B
from .machine import commit

#: (B, H, Hkv, Tq, Tk, Dh, causal, format, the sentences' key lengths) of the twin check.
TWIN_CASES = ((2, 8, 8, 300, 300, 64, True, "bf16", (300, 211)), (2, 8, 2, 257, 257, 128, True, "bf16", (257, 1)),
              (2, 4, 4, 100, 333, 64, False, "fp16", (333, 50)), (1, 4, 2, 512, 512, 128, False, "fp16", (512,)))
#: The dry run's one case (the stand-in runs the twins on both sides: the pipeline, not a check).
DRY_CASES = ((1, 2, 1, 70, 70, 64, True, "bf16", (60,)),)
#: Largest error of the kernels against their twins, as a share of the twin's largest value: the two
#: sum in other orders, and a P on the edge between two 16-bit values may round either way.
TWIN_TOLERANCE = 2e-3
#: Lengths timed, tokens a batch, heads and head size (the base model's).
LENGTHS, TOKENS, HEADS, HEAD_DIM = (1024, 4096, 8192), 8192, 8, 64


def _inputs(case, seed=0):
    Bsz, H, Hkv, Tq, Tk, Dh, causal, fmt, lengths = case
    rng = B.host.random.default_rng(seed)
    f32 = B.host.float32
    q, dout = (rng.standard_normal((Bsz, H, Tq, Dh), dtype=f32) for _ in range(2))
    k, v = (rng.standard_normal((Bsz, Hkv, Tk, Dh), dtype=f32) for _ in range(2))
    ok = B.host.arange(Tk)[None, :] < B.host.array(lengths)[:, None]
    ok[0, 0] = False                                   # causal: query 0 of sentence 0 sees no key
    return q, k, v, dout, ok


def _run(ops, case, q, k, v, dout, ok):
    """Forward and backward of the tensor-core attention on ``ops``: host out, dq, dk, dv."""
    from ..fast.core import flash, flash_tc
    Bsz, H, Hkv, Tq, Tk, Dh, causal, fmt, _ = case
    xp, scale = ops.xp, 1 / math.sqrt(Dh)
    dev = (lambda a: xp.asarray(a)) if xp is not B.host else (lambda a: a)
    ctx, cache = flash_tc.attend(ops, dev(q), dev(k), dev(v), flash.KeyMask(dev(ok), causal, fmt), scale)
    grads = [xp.empty(a.shape, dtype=B.host.float32) for a in (q, k, v)]
    flash_tc.attend_backward(ops, dev(dout.transpose(0, 2, 1, 3).reshape(Bsz * Tq, H * Dh)), cache, *grads, scale)
    out = B.to_host(ctx).reshape(Bsz, Tq, H, Dh).transpose(0, 2, 1, 3)
    return [out] + [B.to_host(g) for g in grads]


def check_twins(xp, cases=TWIN_CASES) -> list:
    """One ``tensor_cores_twin`` row per case (default :data:`TWIN_CASES`): the kernels on ``xp``
    against the twins on NumPy."""
    from ..fast.core.dispatch import ops_for
    from ..fast.core.ops import Ops
    rows = []
    for case in cases:
        inputs = _inputs(case)
        got, want = _run(ops_for(xp), case, *inputs), _run(Ops(B.host), case, *inputs)
        err = {n: float(B.host.abs(g - w).max() / max(float(B.host.abs(w).max()), 1e-30))
               for n, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
        Bsz, H, Hkv, Tq, Tk, Dh, causal, fmt, _ = case
        rows.append({"name": "tensor_cores_twin", "commit": commit(), "B": Bsz, "H": H, "Hkv": Hkv, "Tq": Tq, "Tk": Tk,
                     "Dh": Dh, "causal": causal, "format": fmt, "error": err,
                     "ok": all(e <= TWIN_TOLERANCE for e in err.values()), "tolerance": TWIN_TOLERANCE})
    return rows


def _ours(xp, T, causal, cores, tokens):
    """(forward, forward + backward) callables of the fast engine's tiled attention at T: on the
    tensor cores in ``cores`` (bf16), or the float32 kernels (None)."""
    from ..fast.core import flash, flash_tc
    from ..fast.core.dispatch import ops_for
    Bsz, scale = max(1, tokens // T), 1 / math.sqrt(HEAD_DIM)
    q, k, v, dout, ok = _inputs((Bsz, HEADS, HEADS, T, T, HEAD_DIM, causal, cores, (T,) * Bsz))
    ok[...] = True
    ops, mod = ops_for(xp), (flash_tc if cores else flash)
    q, k, v, ok = (xp.asarray(a) for a in (q, k, v, ok))
    dctx = xp.asarray(dout.transpose(0, 2, 1, 3).reshape(Bsz * T, HEADS * HEAD_DIM))
    mask = flash.KeyMask(ok, causal, cores)
    grads = [xp.empty(a.shape, dtype=B.host.float32) for a in (q, k, v)]

    def both():
        _, cache = mod.attend(ops, q, k, v, mask, scale)
        mod.attend_backward(ops, dctx, cache, *grads, scale)
    return (lambda: mod.attend(ops, q, k, v, mask, scale)), both


def _theirs(T, causal, tokens):
    """(forward, forward + backward) of PyTorch's SDPA on bf16 (B, H, T, Dh) tensors."""
    import torch
    Bsz = max(1, tokens // T)
    q, k, v = (torch.randn(Bsz, HEADS, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(Bsz, HEADS, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def both():
        sdpa(q, k, v, is_causal=causal).backward(dout)
        for t in (q, k, v):
            t.grad = None
    return (lambda: sdpa(q, k, v, is_causal=causal)), both


def _median_seconds(f, events, repeats: int) -> float:
    """The median of ``repeats`` timed calls after one warm-up, by CUDA events (``events``: a pair
    maker and the seconds between a recorded pair); on NumPy, the wall clock."""
    f()
    times = []
    for _ in range(repeats):
        start, end = events()
        start.record()
        f()
        end.record()
        end.synchronize()
        times.append(events.seconds(start, end))
    return statistics.median(times)


class _Events:
    """CuPy's or PyTorch's CUDA events."""

    def __init__(self, torch_events: bool, xp):
        self.torch, self.xp = torch_events, xp

    def __call__(self):
        if self.torch:
            import torch
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return self.xp.cuda.Event(), self.xp.cuda.Event()

    def seconds(self, start, end) -> float:
        return (start.elapsed_time(end) if self.torch else self.xp.cuda.get_elapsed_time(start, end)) / 1e3


def time_against_sdpa(xp, lengths=LENGTHS, repeats: int = 5, with_torch: bool = True, tokens: int = TOKENS) -> list:
    """One ``tensor_cores_time`` row per (length, causal): seconds of each way, forward and
    forward + backward, and their ratio to SDPA's where PyTorch is there; ``tokens`` a batch."""
    rows = []
    for T in lengths:
        for causal in (False, True):
            row = {"name": "tensor_cores_time", "commit": commit(), "T": T, "batch": max(1, tokens // T),
                   "heads": HEADS, "head_dim": HEAD_DIM, "causal": causal}
            ways = [("tc_bf16", lambda: _ours(xp, T, causal, "bf16", tokens), False),
                    ("tiled_fp32", lambda: _ours(xp, T, causal, None, tokens), False)]
            ways += [("sdpa_bf16", lambda: _theirs(T, causal, tokens), True)] if with_torch else []
            for way, make, torch_events in ways:
                fwd, both = make()
                for what, f in (("forward", fwd), ("forward_backward", both)):
                    row[f"{way}_{what}_seconds"] = _median_seconds(f, _Events(torch_events, xp), repeats)
                del fwd, both
            if with_torch:
                for way in ("tc_bf16", "tiled_fp32"):
                    for what in ("forward", "forward_backward"):
                        row[f"{way}_{what}_over_sdpa"] = row[f"{way}_{what}_seconds"] / row[f"sdpa_bf16_{what}_seconds"]
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m attn.bench.tensor_cores", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object a line")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="no PyTorch SDPA to time against")
    p.add_argument("--dry-run", action="store_true", help="on the CuPy stand-in at T = 64, without PyTorch")
    a = p.parse_args(argv)
    if B.get_backend() != "cupy":
        B.set_backend("cupy")
    xp = B.xp()
    rows = check_twins(xp, DRY_CASES if a.dry_run else TWIN_CASES)
    rows += time_against_sdpa(xp, (64,) if a.dry_run else LENGTHS, 1 if a.dry_run else a.repeats,
                              not (a.no_torch or a.dry_run), 64 if a.dry_run else TOKENS)
    for r in rows:
        print(json.dumps(r) if a.json else r, flush=True)
    bad = [r for r in rows if r["name"] == "tensor_cores_twin" and not r["ok"]]
    if bad:
        print(f"tensor_cores: {len(bad)} twin checks failed: {[r['error'] for r in bad]}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

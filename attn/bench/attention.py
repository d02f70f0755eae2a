"""Attention alone: ``python -m attn.bench --attention``. One attention's forward and backward at
lengths from 128 to 8,192, three ways in the same run: the fast engine's plain attention (the
(Tk, B, H, Tq) weights kept for the backward), its tiled attention (:mod:`attn.fast.core.flash`: on
NumPy the fused kernels' twins, on CuPy the kernels), and PyTorch's
``scaled_dot_product_attention`` on the same device. Each is timed (median of the repeats after a
warm-up) and its peak memory growth measured (the resident set's high-water mark on the CPU, with
freed memory handed back to the system so that it tracks what is live; the pool's peak on a GPU).

The inputs are those of a self-attention in the engine: q, k and v views of one (B*T, 3D)
projection, the context (B*T, D) and its gradient; B sentences of T tokens, none padding (the
padding mask is applied all the same), H heads of Dh values.
"""
from __future__ import annotations

import json
import math
import statistics
import time

from .. import backend as B
from ..model import TransformerConfig
from .memory import _PeakMeter
from .timing import _progress

#: The lengths of the default run.
LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
#: Sentences, heads and values per head of the default run (the base model's head width; four
#: heads keep the plain attention's 8,192 x 8,192 weights at 1 GiB per array on a CPU).
BATCH, HEADS, HEAD_DIM = 1, 4, 64


def _ours(T: int, tiled: bool, causal: bool, Bsz: int, H: int, Dh: int):
    """The fast engine's attention (plain or tiled) forward and backward, as a callable."""
    from ..fast import FastTransformer
    from ..fast.core import flash
    from ..fast.core.attention import mask_bias
    from ..masks import decoder_mask, padding_mask
    xp = B.xp()
    D = H * Dh
    cfg = TransformerConfig(vocab_size=8, d_model=D, n_heads=H, d_ff=8, n_encoder_layers=1, n_decoder_layers=1)
    model = FastTransformer(cfg, attention="flash" if tiled else "plain")
    rng = B.host.random.default_rng(0)
    qkv = B.to_device(rng.standard_normal((Bsz * T, 3 * D), dtype=B.host.float32))
    dctx = B.to_device(rng.standard_normal((Bsz * T, D), dtype=B.host.float32))
    ids = xp.ones((Bsz, T), dtype=xp.int64)
    mha = model.mha
    q, k, v = mha.heads(qkv, Bsz, T, 3)
    if tiled:
        mask, rows = flash.KeyMask.of(ids, causal), None
    else:
        mask, rows = mask_bias(decoder_mask(ids) if causal else padding_mask(ids), model.dtype, xp)

    def step():
        _, cache = mha.attend(q, k, v, mask, rows, None)
        dqkv = xp.empty_like(qkv)
        mha.attend_backward(dctx, cache, *mha.heads(dqkv, Bsz, T, 3))
        return dqkv
    return step


def _theirs(T: int, causal: bool, Bsz: int, H: int, Dh: int, device: str):
    """PyTorch's ``scaled_dot_product_attention`` forward and backward, as a callable."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(Bsz, H, T, Dh, generator=g).to(device).requires_grad_() for _ in range(3))
    dout = torch.randn(Bsz, H, T, Dh, generator=g).to(device)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(dout)
        for t in (q, k, v):
            t.grad = None
    return step


def _time(f, sync, repeats: int) -> float:
    f()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_mb(f, backend: str, framework: str):
    """Peak memory growth of one call: attn's on the CPU by the resident set (not tracemalloc, which
    PyTorch's allocations escape alike), on a GPU by the pool's peak; PyTorch's by its own."""
    return _PeakMeter(backend, "torch" if framework == "torch" else "rss")(f).get("peak_memory_mb")


def return_freed_memory() -> bool:
    """glibc's malloc hands blocks of 64 KiB and more back to the system as they are freed, and
    trims its heap: the resident set's high-water mark then follows the live memory."""
    from ..fast import keep_freed_memory
    return keep_freed_memory(mmap_threshold=1 << 16, trim_threshold=1 << 16)


def measure_attention(lengths=LENGTHS, repeats: int = 3, with_torch: bool = True, causal: bool = False,
                      Bsz: int = BATCH, H: int = HEADS, Dh: int = HEAD_DIM, quiet: bool = False) -> list:
    """One row per length: seconds and peak memory growth (MB) of a forward and backward of the
    plain and the tiled attention, and of PyTorch's where ``with_torch``. On the CPU the growth of
    the resident set is what was live only where freed memory goes back to the system: the
    command sets that (:func:`return_freed_memory`) for its whole process."""
    backend = B.get_backend()
    sync = (lambda: B.xp().cuda.Device().synchronize()) if backend == "cupy" else (lambda: None)
    torch_sync, device = (lambda: None), "cpu"
    if with_torch:
        import torch
        if backend == "cupy":
            torch_sync, device = torch.cuda.synchronize, "cuda"
    rows = []
    for T in lengths:
        row = {"name": "attention", "T": T, "batch": Bsz, "heads": H, "head_dim": Dh, "causal": causal,
               "backend": backend}
        ways = [("plain", lambda: _ours(T, False, causal, Bsz, H, Dh), sync, "attn"),
                ("tiled", lambda: _ours(T, True, causal, Bsz, H, Dh), sync, "attn")]
        if with_torch:
            ways.append(("torch", lambda: _theirs(T, causal, Bsz, H, Dh, device), torch_sync, "torch"))
        for way, make, s, framework in ways:
            _progress(f"attention T={T}: {way}", quiet)
            f = make()
            row[f"{way}_seconds"] = _time(f, s, repeats)
            row[f"{way}_peak_mb"] = _peak_mb(f, backend, framework)
            del f
        rows.append(row)
    return rows


def _table(rows) -> tuple:
    """The table's head and lines (strings) of ``rows``."""
    ways = [w for w in ("plain", "tiled", "torch") if f"{w}_seconds" in rows[0]] if rows else []
    head = ["T"] + [f"{w} s" for w in ways] + [f"{w} MB" for w in ways] + ["plain/tiled MB"]
    lines = []
    for r in rows:
        ratio = r["plain_peak_mb"] / r["tiled_peak_mb"] if r.get("tiled_peak_mb") else math.nan
        lines.append([f"{r['T']:,}"] + [f"{r[f'{w}_seconds']:.4f}" for w in ways]
                     + [f"{r[f'{w}_peak_mb']:.1f}" for w in ways] + [f"{ratio:.1f}"])
    return head, lines


def attention_markdown(rows) -> list:
    """The rows as a Markdown table, one string a line (benchmarks/RESULTS.md, the GPU report)."""
    head, lines = _table(rows)
    return (["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
            + ["| " + " | ".join(ln) + " |" for ln in lines])


def print_attention(rows, markdown: bool = False, as_json: bool = False) -> None:
    """The rows as a table (or Markdown, or one JSON object a line)."""
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    if markdown:
        print("\n".join(attention_markdown(rows)))
        return
    head, lines = _table(rows)
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for ln in lines:
        print("  ".join(c.rjust(w) for c, w in zip(ln, widths)))

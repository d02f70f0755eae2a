"""The command: ``python -m attn.bench`` (arguments, the run, output)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from .. import backend as B
from ..fast import keep_freed_memory
from ..precision import PRECISIONS
from .flops import measure_matmul_rate
from .machine import blas_threads, machine_info
from .memory import _memory_child, measure_memory
from .presets import BENCH_PRESETS, BLOCKS, MEASUREMENTS, _bench_config, model_config
from .report import _derived, print_markdown, print_table
from .isolated import Worker, time_isolated, time_phases, torch_info, worker_main
from .timing import _progress, _syncs, time_work
from .twin import torch_available
from .work import build_work


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m attn.bench",
        description="Time attn's training step (forward, backward, Adam), forward pass and decoding "
                    "(greedy and beam search, with and without the key/value cache) on a named "
                    "configuration; where PyTorch is installed, time the same model in PyTorch in the "
                    "same run and print ours/PyTorch. Reports seconds (median of several runs after "
                    "warm-up), tokens per second, peak memory growth of one step, model FLOPs, the "
                    "achieved FLOP rate and its fraction of this machine's float32 matmul rate "
                    "measured in the same run. Progress goes to stderr.",
        epilog="presets: " + "; ".join(f"{k}: {v.note or 'model preset ' + k}" for k, v in BENCH_PRESETS.items())
               + ". Example: python -m attn.bench --preset toy-bench --threads 2")
    _add_modes(p)
    _add_model(p)
    _add_output(p)
    _add_runs(p)
    return _checked(p, p.parse_args(argv))


def _add_modes(p: argparse.ArgumentParser) -> None:
    """The benchmark's other modes, instead of timing steps: data parallel, quality, counts,
    attention alone, the GPU report."""
    p.add_argument("--data-parallel", type=int, metavar="N",
                   help="instead: a training step with 1 and N processes (mpiexec), the bytes all-reduced per "
                        "step against its FLOPs (python -m attn.bench --data-parallel 2 --help)")
    p.add_argument("--quality", action="store_true",
                   help="instead of timing steps: train attn and the same model in PyTorch for the same "
                        "minutes on a corpus and compare test BLEU and chrF (python -m attn.bench --quality --help)")
    p.add_argument("--counts", action="store_true",
                   help="instead of timing: count what a training step and a decoding step ask of a GPU "
                        "(kernel launches by kind, bytes moved, host synchronisations, memory-pool "
                        "allocations), on the CuPy stand-in, so on any machine; with the issue's targets "
                        "and the lint of kernels whose grid does not grow with the batch (attn.bench.counts)")
    p.add_argument("--attention", action="store_true",
                   help="instead of timing steps: one attention's forward and backward alone, the fast engine's "
                        "plain and tiled (FlashAttention) and PyTorch's scaled_dot_product_attention, seconds and "
                        "peak memory at each of --lengths (attn.bench.attention)")
    p.add_argument("--lengths", default=None,
                   help="with --attention: comma-separated lengths (default 128,256,...,8192)")
    p.add_argument("--gpu-report", metavar="DIR",
                   help="on a GPU, part by part (--part), each under 10 minutes: a preflight of the riskiest paths "
                        "(PASS/FAIL each), the test suite on real CuPy with "
                        "the counts, this benchmark against PyTorch, bf16 and tf32, the captured step, a toy "
                        "training, peak memory; every measurement isolated, DIR/REPORT.md and DIR/report.json "
                        "written as each finishes (attn.bench.gpu_report); stops at once without a GPU")
    p.add_argument("--part", default="all",
                   help="with --gpu-report: the parts to run, comma-separated (preflight, suite, bench, base, "
                        "precision, graph, train, memory, attention, tensor-cores; default all, in that order; run "
                        "preflight first)")
    p.add_argument("--dry-run", action="store_true",
                   help="with --gpu-report: the same pipeline on the CuPy stand-in, cheaply (proves the report "
                        "is assembled, not its figures)")


def _add_model(p: argparse.ArgumentParser) -> None:
    """What is timed: the configuration, the backend, the precision, the block."""
    p.add_argument("--preset", default="toy-bench", choices=sorted(BENCH_PRESETS),
                   help="named configuration (default toy-bench)")
    p.add_argument("--backend", default="numpy", choices=["numpy", "cupy", "auto"],
                   help="array backend (auto: CuPy where a GPU is usable); PyTorch runs on the matching device")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="what attn's training step and forward multiply in (attn-train --precision; on NumPy "
                        "the rounding emulated), and PyTorch at the same: allow_tf32 for tf32, autocast to "
                        "bfloat16 for bf16 (default: fp32, PyTorch at CuPy's own precision)")
    p.add_argument("--block", default="paper",
                   help="the model's block, comma-separated to time each in turn in one run: paper (the "
                        "preset's), later (the preset with the later models' block, lesson 26: pre-norm, "
                        "RMSNorm, rotary positions, SwiGLU, grouped-query attention with half the key/value "
                        "heads; PyTorch's twin the same); also with --counts (default paper)")


def _add_output(p: argparse.ArgumentParser) -> None:
    """How the results are printed, and which measurements run how often."""
    p.add_argument("--json", action="store_true", help="one JSON object per measurement on stdout")
    p.add_argument("--markdown", action="store_true", help="the results as Markdown (for benchmarks/RESULTS.md)")
    p.add_argument("--quick", action="store_true",
                   help="the tiny 'quick' configuration, 1 warm-up and 2 repeats (for tests)")
    p.add_argument("--only", default=None,
                   help="comma-separated measurements (default: the preset's, most presets all): "
                        + ", ".join(MEASUREMENTS) + " (train_step_graph: the step as one CUDA graph, "
                        "attn-train --cuda-graph; with --backend cupy only)")
    p.add_argument("--repeats", type=int, help="timed runs per measurement (default per preset)")
    p.add_argument("--warmup", type=int, help="untimed runs before timing (default per preset)")


def _add_runs(p: argparse.ArgumentParser) -> None:
    """How the process runs: threads, PyTorch, memory, settling, the shapes, the settings timed."""
    p.add_argument("--threads", type=int,
                   help="BLAS threads for NumPy (OpenBLAS) and torch.set_num_threads (default: NumPy's current)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--return-freed-memory", action="store_true",
                   help="leave glibc's malloc as it is (by default the timing process keeps freed blocks "
                        "for reuse, see attn.fast.keep_freed_memory; it applies to PyTorch alike)")
    p.add_argument("--memory-all", action="store_true",
                   help="also measure the peak memory of the uncached decodes (slow)")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds to sleep before each timed run (default 0.1 with PyTorch, else 0)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    for k, h in (("batch", "sentences per training batch"), ("src_len", "source length"),
                 ("tgt_len", "target length"), ("decode_batch", "sentences decoded at once"),
                 ("decode_steps", "tokens generated per sentence"), ("beam", "beam size")):
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=int, help=h + " (default per preset)")
    p.add_argument("--no-isolated", action="store_true",
                   help="skip timing each framework in a worker process of its own")
    p.add_argument("--no-interleaved", action="store_true",
                   help="skip timing both frameworks interleaved in this process")
    p.add_argument("--no-phases", action="store_true",
                   help="skip the per-phase profile of the training step (3 extra steps per framework)")
    p.add_argument("--_memory-child", dest="_memory_child", help=argparse.SUPPRESS)
    p.add_argument("--_worker", dest="_worker", help=argparse.SUPPRESS)


def _checked(p: argparse.ArgumentParser, args):
    """``args`` with ``--quick``, ``--only`` and ``--block`` resolved, and the combinations that
    leave nothing to time refused (``p.error``)."""
    if args.quick:
        args.preset = "quick"
    if args.only is None:
        args.only = ",".join(BENCH_PRESETS[args.preset].measurements or MEASUREMENTS)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.only if s not in MEASUREMENTS]
    if unknown:
        p.error(f"unknown measurement(s) {unknown}; choose from {', '.join(MEASUREMENTS)}")
    if args.no_isolated and args.no_interleaved:
        p.error("--no-isolated and --no-interleaved leave nothing to time")
    args.blocks = [s.strip() for s in args.block.split(",") if s.strip()]
    if not args.blocks or any(b not in BLOCKS for b in args.blocks):
        p.error(f"--block {args.block!r}: choose from {', '.join(BLOCKS)} (comma-separated)")
    args.block = args.blocks[0]
    return args


def run(args) -> list[dict]:
    """Run the benchmark; returns the list of result dicts (also printed)."""
    quiet = args.quiet
    B.set_backend(args.backend)
    args.backend = B.get_backend()
    threads = blas_threads(args.threads) if args.backend == "numpy" else None
    with_torch = not args.no_torch and torch_available()
    if with_torch:
        import torch
        if args.backend == "numpy":
            torch.set_num_threads(threads or args.threads or os.cpu_count() or 1)
    bc = _bench_config(args)
    cfg = model_config(bc)
    sync, tsync, device = _syncs(args.backend, with_torch)
    # glibc keeps freed blocks for reuse (both frameworks share this process's malloc); the
    # memory children below run without it so that their resident set falls with frees.
    kept = keep_freed_memory() if not args.return_freed_memory else False
    settle = args.settle if args.settle is not None else (0.1 if with_torch else 0.0)
    info = _run_info(args, bc, cfg, threads, kept, with_torch)
    results = [info]

    _progress(f"preset {args.preset} ({args.block} block) on {args.backend} (threads {threads}); measuring the "
              "matmul rate", quiet)
    rate, peak = measure_matmul_rate(cfg, bc.batch, bc.src_len, bc.tgt_len, B.xp(), sync)
    results.append({"name": "matmul", "gflops_per_second": rate, "square_2048_gflops_per_second": peak,
                    "shapes": "the training step's (forward and backward), float32",
                    "seconds_per_step": None, "tokens_per_second": None, "peak_memory_mb": None})

    work = build_work(bc, args.only, args.backend, with_torch, sync, tsync, device,
                      repeats=args.repeats, warmup=args.warmup, precision=args.precision)
    if with_torch:
        info.update(torch_info())             # with the precision build_work set (match_precision)
    workers = _start_workers(args, threads, with_torch, info) if not args.no_isolated else {}
    try:
        for i, w in enumerate(work):
            _progress(f"[{i + 1}/{len(work)}] {w.name}", quiet)
            results.append(_time_one(args, w, workers, settle, rate, peak))
    finally:
        for wk in workers.values():
            wk.close()
    _derived(results)
    info["load_average_end_of_timing"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if not args.no_memory:
        _add_memory(args, results[2:], with_torch)
    return results


def _run_info(args, bc, cfg, threads, kept, with_torch: bool) -> dict:
    """The run's first row: the machine, the configuration and the command, the libraries."""
    info = machine_info()
    info["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info.update(backend=args.backend, preset=args.preset, block=args.block, precision=args.precision or "fp32",
                blas_threads=threads,
                malloc_keeps_freed_memory=kept,
                config=cfg.to_dict(), batch=bc.batch, src_len=bc.src_len, tgt_len=bc.tgt_len,
                command="python -m attn.bench " + " ".join(sys.argv[1:]) if sys.argv[0].endswith(os.path.join("bench", "__main__.py"))
                else None)
    if with_torch:
        info.update(torch_info())
    if args.backend == "cupy":
        cp = B.xp()
        info.update(cupy=cp.__version__, gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    return info


def _start_workers(args, threads, with_torch: bool, info: dict) -> dict:
    """The isolated worker processes, one per framework ({"ours": ..., "torch": ...}), their
    details in ``info``; those started are closed again if one fails to start."""
    _progress("starting the isolated worker processes (one per framework)", args.quiet)
    if args.threads is None and threads:
        args.threads = threads            # the workers get the thread count this process has
    workers = {}
    try:
        workers["ours"] = Worker(args, "attn")
        info["isolated_attn"] = workers["ours"].info
        if with_torch:
            workers["torch"] = Worker(args, "torch")
            info["isolated_torch"] = workers["torch"].info
    except BaseException:
        for wk in workers.values():
            wk.close()
        raise
    return workers


def _time_one(args, w, workers: dict, settle: float, rate: float, peak: float) -> dict:
    """One measurement's row: timed in the workers and interleaved here (as asked), and by phase."""
    settings = {}
    if workers:
        settings["isolated"] = time_isolated(workers, w, settle, args.quiet)
    if not args.no_interleaved:
        settings["interleaved"] = time_work(w, settle, args.quiet, replay=not workers)
    row = _row(w, settings, rate, peak, args.backend)
    if w.phases and not args.no_phases:
        row["phases"] = time_phases(w, 3, settle, args.quiet, workers or None)
        row["phases_setting"] = "isolated" if workers else "interleaved"
    return row


def _add_memory(args, rows: list[dict], with_torch: bool) -> None:
    """Each row's peak memory, measured in child processes (attn's, and PyTorch's)."""
    mem = {"attn": measure_memory(args, "attn", args.quiet)}
    if with_torch:
        mem["torch"] = measure_memory(args, "torch", args.quiet)
    for r in rows:
        m = mem["attn"].get(r["name"], {})
        r["peak_memory_mb"] = m.get("peak_memory_mb")
        if "tracemalloc_peak_mb" in m:
            r["tracemalloc_peak_mb"] = m["tracemalloc_peak_mb"]
        if with_torch:
            tm = mem.get("torch", {}).get(r["name"].replace("_reference", ""), {})
            r["torch_peak_memory_mb"] = tm.get("peak_memory_mb")


def _row(w, settings: dict, rate: float, peak: float, backend: str) -> dict:
    """One measurement's result from its timings in each setting ({"isolated": times,
    "interleaved": times}, each {"ours": [...], "torch": [...], "matmul": [...]}).

    Each setting gets ``<setting>_seconds_per_step``, ``<setting>_torch_seconds_per_step`` and
    ``<setting>_ratio`` (medians). The headline (``seconds_per_step``,
    ``torch_seconds_per_step``, ``ratio``) is the setting with the less favourable ratio
    (without PyTorch: the one where ours is slower), named in ``ratio_setting``."""
    med = statistics.median
    r = {"name": w.name, "repeats": w.repeats}
    score = {}
    for name, times in settings.items():
        ours = med(times["ours"])
        r[f"{name}_seconds_per_step"] = ours
        r[f"{name}_times"] = times["ours"]
        score[name] = ours
        if "torch" in times:
            t = med(times["torch"])
            r.update({f"{name}_torch_seconds_per_step": t, f"{name}_ratio": ours / t,
                      f"{name}_torch_times": times["torch"]})
            score[name] = ours / t
    head = max(score, key=score.get)
    times = settings[head]
    ours = med(times["ours"])
    r.update(ratio_setting=head, seconds_per_step=ours, tokens_per_second=w.tokens / ours,
             peak_memory_mb=None, times=times["ours"])
    if "torch" in times:
        t = med(times["torch"])
        r.update(torch_seconds_per_step=t, torch_tokens_per_second=w.tokens / t, ratio=ours / t,
                 torch_times=times["torch"])
    if w.flops:
        if backend == "cupy":
            r["tflops_per_second"] = w.flops / ours / 1e12
        r.update(flops_per_step=w.flops, gflops_per_second=w.flops / ours / 1e9,
                 fraction_of_best_matmul_rate=w.flops / ours / 1e9 / rate,
                 fraction_of_square_matmul_rate=w.flops / ours / 1e9 / peak)
        mm = next((s for s in settings.values() if "matmul" in s), None)
        if mm is not None:
            # the replay's median against ours in the same setting (the rotation it ran in)
            own = med(mm["ours"])
            mm_t = med(mm["matmul"])
            r.update(matmul_seconds_per_step=mm_t, matmul_gflops_per_second=w.flops / mm_t / 1e9,
                     fraction_of_matmul_rate=mm_t / own, matmul_times=mm["matmul"])
        else:
            r["fraction_of_matmul_rate"] = r["fraction_of_best_matmul_rate"]
    r.update(w.extra)
    return r


def _attention(args) -> int:
    """``--attention``: the attention-only rows (:mod:`attn.bench.attention`)."""
    from .attention import LENGTHS, measure_attention, print_attention, return_freed_memory
    B.set_backend(args.backend)
    if B.get_backend() == "numpy":
        return_freed_memory()
        if args.threads:
            blas_threads(args.threads)
    try:
        lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else list(LENGTHS)
    except ValueError:
        print(f"attn.bench: error: --lengths must be comma-separated integers, got {args.lengths!r}", file=sys.stderr)
        return 2
    with_torch = not args.no_torch and torch_available()
    if with_torch:
        import torch
        torch.set_num_threads(args.threads or blas_threads() or os.cpu_count() or 1)
    rows = measure_attention(lengths, args.repeats or 3, with_torch, quiet=args.quiet)
    print_attention(rows, markdown=args.markdown, as_json=args.json)
    return 0


def main(argv=None) -> int:
    if "--quality" in (sys.argv[1:] if argv is None else argv):     # the side-by-side training run
        from .quality import main as quality_main
        return quality_main(argv)
    if any(a.startswith("--data-parallel") for a in (sys.argv[1:] if argv is None else argv)):
        from .parallel import main as parallel_main                 # 1 and N processes, the all-reduce's share
        return parallel_main(argv)
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--render-markdown":
        return _render_saved(sys.argv[2])
    args = parse_args(argv)
    if args._memory_child:
        return _memory_child_main(args)
    if args._worker:
        worker_main(args)
        return 0
    if args.gpu_report:
        from .gpu_report import GpuReportError, gpu_report
        try:
            gpu_report(args.gpu_report, dry_run=args.dry_run, quiet=args.quiet, parts=args.part.split(","))
        except GpuReportError as e:
            print(f"attn.bench: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.dry_run:
        print("attn.bench: error: --dry-run goes with --gpu-report DIR", file=sys.stderr)
        return 2
    if args.attention:
        return _attention(args)
    if args.counts:
        return _counts(args)
    for block in args.blocks:                     # each block in turn, in this one run
        args.block = block                        # what run() and its workers read
        results = run(args)
        if len(args.blocks) > 1 and not args.json:
            print(f"\n{'### ' if args.markdown else ''}{args.preset}, the {args.block} block\n")
        if args.json:
            for r in results:
                print(json.dumps(r))
        elif args.markdown:
            print_markdown(results)
        else:
            print_table(results)
    return 0


def _render_saved(path: str) -> int:
    """``--render-markdown FILE``: re-render a saved ``--json`` run (either benchmark, or attention's)."""
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    if any(str(r.get("name", "")).startswith("quality_") for r in rows):
        from .quality import print_markdown as quality_markdown
        quality_markdown(rows)
    elif rows and all(r.get("name") == "attention" for r in rows):
        from .attention import print_attention
        print_attention(rows, markdown=True)
    else:
        print_markdown(rows)
    return 0


def _memory_child_main(args) -> int:
    """The child process that measures one framework's peak memory (:func:`measure_memory`)."""
    B.set_backend(args.backend)
    if args.backend == "numpy" and args.threads:
        blas_threads(args.threads)
    if args._memory_child == "torch":
        import torch
        torch.set_num_threads(args.threads or blas_threads() or os.cpu_count() or 1)
    _memory_child(args)
    return 0


def _counts(args) -> int:
    """``--counts``: launches, syncs and allocations of each block on the CuPy stand-in, printed."""
    from .counts import CountsError, measure_counts, print_counts, print_counts_markdown
    at = f" at {args.precision}" if args.precision not in (None, "fp32") else ""
    _progress(f"counting launches, syncs and allocations of {args.preset}{at} on the CuPy stand-in", args.quiet)
    try:
        rows = []
        for block in args.blocks:
            args.block = block                # what _bench_config reads
            rows += measure_counts(args.preset, precision=args.precision or "fp32", bc=_bench_config(args),
                                   block=block)
    except CountsError as e:
        print(f"attn.bench: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        for r in rows:
            print(json.dumps(r))
    elif args.markdown:
        print_counts_markdown(rows)
    else:
        print_counts(rows)
    return 0

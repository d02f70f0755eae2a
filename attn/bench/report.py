"""The benchmark's results as a table (terminal) or Markdown (benchmarks/RESULTS.md)."""
from __future__ import annotations

import json
import sys

from ..model import renamed_fields


def _derived(results):
    """Cache speed-ups and beam/greedy cost, on the rows they concern."""
    by = {r["name"]: r for r in results}
    for kind in ("greedy", "beam"):
        c, u = by.get(f"{kind}_cached"), by.get(f"{kind}_uncached")
        if c and u:
            c["cache_speedup"] = u["seconds_per_step"] / c["seconds_per_step"]
    g, b = by.get("greedy_cached"), by.get("beam_cached")
    if g and b:
        b["cost_vs_greedy"] = b["seconds_per_step"] / g["seconds_per_step"]


def _fmt(v, spec):
    if v is None:
        return format("-", ">" + spec.split(".")[0]) if spec[0].isdigit() else "-"
    return format(v, spec)


def _machine_line(info) -> str:
    load = info.get("load_average")
    return (f"{info.get('cpu_model')} ({', '.join(info.get('cpu_features', [])) or 'features unknown'}), "
            f"{info.get('usable_cpus', info.get('cpu_count'))} usable CPUs"
            + (f", GPU {info['gpu']}" if "gpu" in info else "")
            + (f"; load average (1/5/15 min) at the start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
               if load else "")
            + (f", after the timing {info['load_average_end_of_timing'][0]:.2f}"
               if info.get("load_average_end_of_timing") else ""))


def _software_line(info) -> str:
    torch = (f"PyTorch {info['torch']} (threads {info.get('torch_threads', '-')}, BLAS "
             f"{info.get('torch_blas_info', '?')}, CPU capability {info.get('torch_cpu_capability', '?')})"
             if "torch" in info else "PyTorch absent")
    return (f"Python {info['python']}, NumPy {info['numpy']} ({info.get('blas', '?')}, kernel "
            f"{info.get('blas_kernel', '?')}), BLAS threads {info.get('blas_threads')}, {torch}"
            + (f", CuPy {info['cupy']}" if "cupy" in info else "")
            + (", malloc keeps freed memory (both frameworks)" if info.get("malloc_keeps_freed_memory") else ""))


def _notes(r) -> list:
    notes = []
    if "cache_speedup" in r:
        notes.append(f"cache x{r['cache_speedup']:.1f}")
    if "cost_vs_greedy" in r:
        notes.append(f"{r['cost_vs_greedy']:.2f}x greedy")
    return notes


def print_table(results, out=sys.stdout):
    info, mm = results[0], results[1]
    print(f"attn.bench  preset {info['preset']}  backend {info['backend']}", file=out)
    print(f"machine: {_machine_line(info)}", file=out)
    print(f"software: {_software_line(info)}", file=out)
    if info["backend"] == "cupy":
        print(f"achieved TFLOP/s: " + ", ".join(f"{r['name']} {r['tflops_per_second']:.1f}"
                                                for r in results[2:] if "tflops_per_second" in r), file=out)
    print(f"matmul rate at the step's shapes: {mm['gflops_per_second']:.1f} GFLOP/s "
          f"(square 2048: {mm['square_2048_gflops_per_second']:.1f} GFLOP/s)", file=out)
    print("ratio = ours / PyTorch, the less favourable of 'iso' (each framework in its own process) and "
          "'intl' (both interleaved in one)", file=out)
    head = (f"{'measurement':<22}{'s/step':>9}{'tokens/s':>11}{'GFLOP/s':>9}{'%matmul':>8}{'peak MB':>9}"
            f"{'torch s':>9}{'ratio':>7}{'iso':>7}{'intl':>7}{'torch MB':>9}  notes")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in results[2:]:
        frac = r.get("fraction_of_matmul_rate")
        print(f"{r['name']:<22}{r['seconds_per_step']:>9.4f}{r['tokens_per_second']:>11.0f}"
              f"{_fmt(r.get('gflops_per_second'), '9.1f')}{_fmt(None if frac is None else 100 * frac, '7.1f')}"
              f"{'%' if frac is not None else ' '}"
              f"{_fmt(r.get('peak_memory_mb'), '9.1f')}{_fmt(r.get('torch_seconds_per_step'), '9.4f')}"
              f"{_fmt(r.get('ratio'), '7.2f')}{_fmt(r.get('isolated_ratio'), '7.2f')}"
              f"{_fmt(r.get('interleaved_ratio'), '7.2f')}{_fmt(r.get('torch_peak_memory_mb'), '9.1f')}  "
              f"{', '.join(_notes(r))}", file=out)
    _print_phases(results, out, markdown=False)


def print_markdown(results, out=sys.stdout):
    info, mm = results[0], results[1]
    print(f"- command: `{info.get('command') or 'python -m attn.bench'}`", file=out)
    print(f"- machine: {_machine_line(info)}", file=out)
    print(f"- software: {_software_line(info)}", file=out)
    block = ('norm_position', 'norm_kind', 'positional', 'ffn', 'kv_heads') if info.get('block', 'paper') != 'paper' else ()
    config = renamed_fields(info['config'], "the run's config")          # a run saved before a rename too
    print(f"- preset `{info['preset']}`: batch {info['batch']}, source {info['src_len']}, target {info['tgt_len']}, "
          f"config {json.dumps({k: config[k] for k in ('vocab_size', 'd_model', 'n_heads', 'd_ff', 'n_encoder_layers', 'n_decoder_layers', 'dropout', 'label_smoothing', *block)})}",
          file=out)
    print(f"- float32 matmul rate at the step's shapes, best of three per shape: {mm['gflops_per_second']:.1f} "
          f"GFLOP/s (square 2048: {mm['square_2048_gflops_per_second']:.1f} GFLOP/s); the table's "
          f"'% of matmul rate' is the step's matmuls replayed alone, timed in the same rotation as the step",
          file=out)
    print("- each figure is a median; 'isolated': each framework in a worker process of its own, the "
          "two taking turns; 'interleaved': both in one process, taking turns. The headline ratio "
          "(and the s/step beside it) is the less favourable of the two.", file=out)
    print(file=out)
    print("| measurement | s/step (median) | tokens/s | model GFLOP/s | % of matmul rate | peak MB | "
          "PyTorch s/step | **ratio ours/PyTorch** | isolated ratio | interleaved ratio | PyTorch peak MB | notes |",
          file=out)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|", file=out)
    for r in results[2:]:
        notes = _notes(r)
        if r.get("ratio_setting"):
            notes.append(f"headline from the {r['ratio_setting']} timing")
        if "matmul_gflops_per_second" in r:
            notes.append(f"matmul replay {r['matmul_gflops_per_second']:.1f} GFLOP/s")
        if "torch_adam" in r:
            notes.append(f"PyTorch Adam: {r['torch_adam']}")
        frac = r.get("fraction_of_matmul_rate")
        print(f"| {r['name']} | {r['seconds_per_step']:.4f} | {r['tokens_per_second']:.0f} | "
              f"{_fmt(r.get('gflops_per_second'), '.1f')} | {_fmt(None if frac is None else 100 * frac, '.1f')} | "
              f"{_fmt(r.get('peak_memory_mb'), '.1f')} | {_fmt(r.get('torch_seconds_per_step'), '.4f')} | "
              f"**{_fmt(r.get('ratio'), '.3f')}** | {_fmt(r.get('isolated_ratio'), '.3f')} | "
              f"{_fmt(r.get('interleaved_ratio'), '.3f')} | {_fmt(r.get('torch_peak_memory_mb'), '.1f')} | "
              f"{'; '.join(notes)} |", file=out)
    _print_phases(results, out, markdown=True)


def _print_phases(results, out, markdown: bool):
    """The per-phase profile of the training step, where the run has one."""
    rows = [r for r in results[2:] if r.get("phases")]
    if not rows:
        return
    phases = rows[0]["phases"]
    total = sum(p["seconds"] or 0.0 for p in phases)
    ttotal = sum(p["torch_seconds"] or 0.0 for p in phases)

    def cell(v, tot):
        return ("-", "-") if v is None else (f"{v:.4f}", f"{100 * v / tot:.0f} %" if tot else "-")
    print(file=out)
    if markdown:
        where = ("each framework in its own worker" if rows[0].get("phases_setting") == "isolated"
                 else "both in one process")
        print(f"Where the time of a training step goes ({where}, the median of 3 phase-timed steps; "
              "attn's phases as its first part (thread) sees them, so a part's wait for the other "
              "falls in the phase before the wait):", file=out)
        print(file=out)
        print("| phase | attn s | share | PyTorch s | share |", file=out)
        print("|---|---:|---:|---:|---:|", file=out)
    else:
        print(f"{'training step by phase':<36}{'attn s':>9}{'share':>7}{'torch s':>9}{'share':>7}", file=out)
    for p in phases + [{"phase": "total", "seconds": total, "torch_seconds": ttotal or None}]:
        a, ap = cell(p["seconds"], total)
        t, tp = cell(p["torch_seconds"], ttotal)
        if markdown:
            print(f"| {p['phase']} | {a} | {ap} | {t} | {tp} |", file=out)
        else:
            print(f"  {p['phase']:<34}{a:>9}{ap:>7}{t:>9}{tp:>7}", file=out)

"""The GPU report (:mod:`attn.bench.gpu_report`) as one Markdown page: every row, those that
failed with what failed and why."""
from __future__ import annotations


def _f(x, fmt="{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def _status(r: dict) -> str:
    return "ok" if r["status"] == "ok" else f"**{r['status']}**: {r.get('why', '')}".replace("|", "\\|")


def _counted(report: dict) -> dict:
    """{(preset, measurement): the counts' row} from the counts tasks."""
    out = {}
    for r in report["rows"]:
        if r["name"].startswith("counts-"):
            for c in r.get("rows", []):
                out[(r["preset"], c["name"].replace("counts_", ""))] = c
    return out


def _timings(rows: list, counted: dict) -> list:
    lines = ["| preset | measurement | precision | attn s | PyTorch s | attn / PyTorch | launches | syncs | "
             "pool allocations | status |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        m = r.get("result") or {}
        k = counted.get((r["preset"], r["measurement"])) if r.get("precision") == "fp32" else None
        lines.append(f"| {r['preset']} | {r['measurement']} | {r.get('precision', '-')} | "
                     f"{_f(m.get('seconds_per_step'))} | {_f(m.get('torch_seconds_per_step'))} | "
                     f"{_f(m.get('ratio'), '{:.2f}')} | {_f(k and k['launches'], '{:g}')} | "
                     f"{_f(k and k['syncs'], '{:g}')} | {_f(k and k['pool_allocations'], '{:g}')} | {_status(r)} |")
    lines.append("")
    for r in rows:
        m = r.get("result") or {}
        if m.get("phases"):
            lines += [f"{r['preset']} {r['measurement']} ({r.get('precision')}) by phase (CUDA events, ms):", "",
                      "| phase | attn | PyTorch |", "|---|---:|---:|"]
            lines += [f"| {p['phase']} | {_f(p['seconds'] and p['seconds'] * 1e3, '{:.2f}')} | "
                      f"{_f(p.get('torch_seconds') and p['torch_seconds'] * 1e3, '{:.2f}')} |" for p in m["phases"]]
            lines.append("")
    return lines


def _suite(rows: list) -> list:
    lines = []
    for r in rows:
        if r["name"] != "suite":
            continue
        s = r.get("suite")
        if r["status"] == "skipped" or not s:
            lines += [f"`{r['command']}`: {_status(r)}", ""]
            continue
        lines += [f"`ATTN_BACKEND=cupy {r['command']}`: "
                  + (", ".join(f"{n} {k}" for k, n in s["counts"].items()) or "no result")
                  + (" (stopped at its time limit)" if s["stopped_at_time_limit"] else "") + ".", ""]
        lines += [f"* failed: `{f}`" for f in s["failures"][:30]] + ([""] if s["failures"] else [])
    return lines


def _counts(rows: list) -> list:
    lines = ["| preset | launches per step | Adam launches | host syncs | pool allocations | MB moved | "
             "fixed-grid kernels | a capture refuses | status |", "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for row in rows:
        if not row["name"].startswith("counts-"):
            continue
        by = {r["name"]: r for r in row.get("rows", [])}
        r, lint, cap = by.get("counts_train_step"), by.get("counts_lint", {}), by.get("counts_capture", {})
        if r is None:
            lines.append(f"| {row['preset']} | - | - | - | - | - | - | - | {_status(row)} |")
            continue
        tg = r.get("targets", {})

        def vs(key, fmt="{:g}"):
            return fmt.format(r[key]) + (f" (target {tg[key]})" if key in tg else "")
        lines.append(f"| {row['preset']} | {vs('launches')} | {vs('optimizer_launches')} | {vs('syncs')} | "
                     f"{vs('pool_allocations')} | {r['bytes_moved_mb']:.0f} | "
                     f"{', '.join(k['kernel'] for k in lint.get('fixed_grid_kernels', [])) or 'none'} | "
                     f"{', '.join(f'{k} {n}' for k, n in cap.get('refused', {}).items()) or 'nothing'} | "
                     f"{_status(row)} |")
    return lines + [""]


def _train(rows: list) -> list:
    lines = []
    for r in rows:
        t = r.get("result")
        cmd = r["command"].replace("python -m attn.train", "attn-train")
        if t:
            lines += [f"`{cmd}`: test BLEU {t.get('test_bleu', 0):.2f}, {t.get('steps')} steps, "
                      f"{t.get('tokens_per_second', 0):,.0f} tokens/s, backend {t.get('backend')}.", ""]
        else:
            lines += [f"`{cmd}`: no metrics.json ({_status(r)}; see the log).", ""]
    return lines


def _memory(rows: list) -> list:
    lines = ["| preset | framework | peak MB | of it, step memory MB | status |", "|---|---|---:|---:|---|"]
    for r in rows:
        m = r.get("result") or {}
        lines.append(f"| {r['preset']} | {r['framework']} | {_f(m.get('peak_memory_mb'), '{:.1f}')} | "
                     f"{_f(m.get('step_memory_mb'), '{:.1f}')} | {_status(r)} |")
    return lines + [""]


def _attention(rows: list) -> list:
    from .attention import attention_markdown
    lines = []
    for r in rows:
        lines += attention_markdown(r["rows"]) + [""] if r.get("rows") else [f"No row: {_status(r)}", ""]
    return lines


def _tensor_cores(rows: list) -> list:
    """The twin checks (largest error of each output as a share of the twin's largest value), then
    the timings: seconds and the ratio to PyTorch's SDPA."""
    lines = []
    for r in rows:
        found = r.get("rows") or []
        twins = [t for t in found if t["name"] == "tensor_cores_twin"]
        times = [t for t in found if t["name"] == "tensor_cores_time"]
        if not found:
            lines += [f"No row: {_status(r)}", ""]
            continue
        lines += ["| B | H/Hkv | Tq | Tk | Dh | causal | format | out | dq | dk | dv | within |",
                  "|---:|---|---:|---:|---:|---|---|---:|---:|---:|---:|---|"]
        lines += [f"| {t['B']} | {t['H']}/{t['Hkv']} | {t['Tq']} | {t['Tk']} | {t['Dh']} | {t['causal']} | {t['format']} | "
                  + " | ".join(f"{t['error'][n]:.1e}" for n in ("out", "dq", "dk", "dv"))
                  + f" | {'yes' if t['ok'] else '**no**'} |" for t in twins]
        ways = ("tc_bf16", "tiled_fp32", "sdpa_bf16")
        lines += ["", "| T | causal | " + " | ".join(f"{w} fwd s | {w} fwd+bwd s" for w in ways) + " | tc/sdpa fwd+bwd |",
                  "|---:|---|" + "---:|" * (2 * len(ways) + 1)]
        for t in times:
            cells = [_f(t.get(f"{w}_{what}_seconds"), "{:.5f}") for w in ways for what in ("forward", "forward_backward")]
            lines.append(f"| {t['T']:,} | {t['causal']} | " + " | ".join(cells)
                         + f" | {_f(t.get('tc_bf16_forward_backward_over_sdpa'), '{:.2f}')} |")
        lines.append("")
    return lines


def _preflight(rows: list) -> list:
    lines = []
    for r in rows:
        checks = r.get("checks") or []
        lines += ["```"] + [f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']:<16} {c['figure']}" for c in checks] \
            + ["```", ""] if checks else [f"No check ran: {_status(r)}", ""]
    return lines


_TITLES = {"preflight": "Preflight: the riskiest paths first", "suite": "The test suite on the GPU, and the counts",
           "bench": "attn against PyTorch on the same GPU", "base": "The base preset, against PyTorch and at bf16 and tf32",
           "precision": "At bf16 and tf32, PyTorch at the same precision",
           "graph": "The captured step (train_step_graph), capture untimed",
           "train": "Training the toy translator", "memory": "Peak GPU memory of the training step",
           "attention": "One attention alone: plain, tiled (FlashAttention) and PyTorch's",
           "tensor-cores": "The tensor-core attention: against its twins, then against PyTorch's SDPA in bf16"}


def render_markdown(report: dict) -> str:
    """The report as one Markdown page: what ran so far, part by part."""
    d = report["device"]
    lines = ["# attn on a GPU: the report", ""]
    if report["dry_run"]:
        lines += ["**Dry run on the CuPy stand-in** (`--dry-run`): the pipeline, not a GPU's figures.", ""]
    lines += [f"{report['date']}, commit {report.get('commit') or '-'}, {report['seconds']:.0f} s in all; parts "
              f"{', '.join(report['parts'])}. Device: {d.get('gpu', '-')}; CuPy {d.get('cupy', '-')}, CUDA runtime "
              f"{d.get('cuda_runtime', '-')} (driver {d.get('cuda_driver', '-')}), NumPy {d.get('numpy', '-')}, "
              f"PyTorch {d.get('torch', '-')} (CUDA {d.get('torch_cuda', '-')}), Python {d.get('python', '-')}.", ""]
    pre = report.get("preflight", {})
    lines += ["## What is installed", ""]
    if pre.get("missing"):
        lines += [f"* missing: `{m}` ({why})" for m, why in pre["missing"].items()] + [""]
    else:
        lines += ["Nothing missing: " + ", ".join(f"{m} {v}" for m, v in sorted(pre.get("have", {}).items())) + ".",
                  ""]
    rows = report["rows"]
    failed = [r for r in rows if r["status"] != "ok"]
    lines += [f"{len(rows)} rows, {len(rows) - len(failed)} ok"
              + (": " + "; ".join(f"{r['name']} {r['status']}" for r in failed) if failed else "") + ".", ""]
    counted = _counted(report)
    for part in report["parts"]:
        mine = [r for r in rows if r["part"] == part]
        lines += [f"## {_TITLES[part]}", "", f"Limits add up to {report['limits'].get(part, 0):g} s.", ""]
        if not mine:
            lines += ["Not run yet.", ""]
        elif part == "preflight":
            lines += _preflight(mine)
        elif part == "suite":
            lines += _suite(mine) + _counts(mine)
        elif part in ("bench", "base", "precision", "graph"):
            lines += _timings(mine, counted)
        elif part == "train":
            lines += _train(mine)
        elif part == "memory":
            lines += _memory(mine)
        elif part == "attention":
            lines += _attention(mine)
        elif part == "tensor-cores":
            lines += _tensor_cores(mine)
    lines += ["## Commands", "", "| task | command | exit | seconds | limit | status |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | `{r['command']}` | {_f(r['returncode'], '{}')}"
                     f"{' (time limit)' if r['timed_out'] else ''} | {r['seconds']:.0f} | {r['limit_seconds']:g} | "
                     f"{r['status']} |")
    return "\n".join(lines) + "\n"

"""The reports: the text the command prints under each layer, and for teachers JSON,
JUnit XML, Gradescope's results.json and an HTML page with heatmaps of each failure."""
from __future__ import annotations

import html
import json
import math
import os
import sys
from urllib.parse import quote
from pathlib import Path

from .. import backend as B
from ..testing import Built, Fresh
from .results import Failure, FileReport, Result, grader_version, plain

np = B.host

# ----------------------------------------------------------------------------- the report


def _describe(v) -> str:
    if isinstance(v, np.ndarray):
        s = f"{v.shape} {v.dtype}"
        if v.size <= 12:
            s += "  " + np.array2string(v, precision=4, separator=", ", max_line_width=10**6).replace("\n", "")
        return s
    if isinstance(v, Fresh):
        return f"attn.backend.DeviceRNG({v.seed}), the same mask on every call"
    if isinstance(v, Built):
        return f"attn.grader.solutions.{v.function}{v.args if len(v.args) != 1 else '(' + repr(v.args[0]) + ')'}"
    if type(v) is list and v and not isinstance(v[0], (int, float, str)):
        return f"a list of {len(v)}: [{_describe(v[0])}" + (", ...]" if len(v) > 1 else "]")
    if type(v) is dict:
        return "{" + ", ".join(f"{k}: {_describe(x)}" for k, x in list(v.items())[:3]) + (
            f", ... ({len(v)} entries)}}" if len(v) > 3 else "}")
    return repr(v)


def _fmt(x) -> str:
    return f"{x:.6g}" if isinstance(x, (float, np.floating)) else str(x)


LABELS = {"pass": "PASS", "fail": "FAIL", "todo": "not implemented yet", "incomplete": "INCOMPLETE"}


def failure_lines(r: Result, hint_level: int = 1) -> list[str]:
    """The indented lines under a layer's status line."""
    lines = []
    if r.note:
        lines.append(f"note: {r.note}")
    if r.status == "todo":
        lines.append(f"{r.detail.function} raises NotImplementedError: write its body, then run this again")
        return [plain(line, " " * 10 + "| ") for line in lines]
    if r.status != "fail":
        return lines
    f: Failure = r.detail
    if r.blame:
        fix = f"fix {r.blame}"
        if r.forward_first:
            fix += " first: the forward is wrong, and a backward is only graded against the library's once its " \
                   "forward is right"
        lines.append(f"blame:    {fix}")
    lines.append(f"check:    {f.check}: {f.message}")
    if f.where:
        lines.append(f"where:    {f.where}")
    setup = getattr(f, "setup", None)
    if setup:
        lines.append("example:  " + setup[0])
        lines += [" " * 10 + s for s in setup[1:]]
    elif f.example is not None:
        lines.append("example:  " + ("one of the layer's explicit examples" if getattr(f, "explicit", False) else
                                     "the smallest hypothesis found")
                     + (" (the call that ended the process)" if f.fatal else ""))
        for name, v in f.example.args:
            if not name.startswith("_"):
                lines.append(f"              {name} = {_describe(v)}")
        if f.check == "backward" or (f.check == "invariant" and r.blame != r.functions[0]):
            lines.append(f"              dout = standard normal of the output's shape, attn.backend.host_rng("
                         f"{f.example.seed})")
    if f.error is not None:
        lines.append(f"error:    relative error {f.error:.3g}" + (f" (tolerance {f.tol:g})" if f.tol else ""))
    if getattr(f, "outputs_agree", False):
        lines.append("output:   yours equals the library's on these inputs: only the inputs the invariant "
                     "describes show the bug")
    if f.entries:
        if f.check == "invariant":
            lines.append("output:   yours and the library's on this example")
        lines.append(f"entries:  {'index':<14} {'yours':>14} {'expected':>14}")
        for idx, a, b in f.entries:
            lines.append(f"          {str(idx):<14} {_fmt(a):>14} {_fmt(b):>14}")
    if f.symptom:
        lines.append(f"looks like: {f.symptom}")
    if hint_level >= 2 and f.look:
        lines.append(f"look at:  {f.look}")
    if hint_level >= 3 and f.hint:
        lines.append(f"formula:  {f.hint}")
    if hint_level < 3 and (f.look if hint_level < 2 else f.hint):
        lines.append(f"hint:     attn-check --hint {hint_level + 1} says "
                     + ("where to look" if hint_level < 2 else "the formula"))
    if r.also:
        lines.append(f"backward: {r.also}")
    if r.part:
        lines.append(f"part:     {r.part}")
    return [plain(line, " " * 10 + "| ") for line in lines]


def report(r: Result, out=sys.stdout, hint_level: int = 1) -> None:
    w = out.write
    runs = ("not run" if not r.examples else
            f"{r.examples} run{'s' * (r.examples != 1)}" + (", shrinking included" if r.status == "fail" else ""))
    w(f"{r.layer:<22} {LABELS[r.status]:<6} {r.seconds:6.2f} s  ({runs})\n")
    for line in failure_lines(r, hint_level):
        w(f"    {line}\n")


def summary(results: list[Result]) -> str:
    passed = sum(r.status == "pass" for r in results)
    todo = sum(r.status == "todo" for r in results)
    incomplete = sum(r.status == "incomplete" for r in results)
    failed = len(results) - passed - todo - incomplete
    total = sum(r.seconds for r in results)
    return (f"{passed} of {len(results)} passed" + (f", {todo} not implemented yet" if todo else "")
            + (f", {incomplete} incomplete" if incomplete else "") + (f", {failed} failed" if failed else "")
            + f" ({total:.1f} s)")

# ----------------------------------------------------------------------------- reports for teachers


def _jsonable(v):
    if isinstance(v, (np.generic,)):
        return v.item()
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


def result_dict(r: Result, hint_level: int = 3) -> dict:
    d = {"layer": r.layer, "status": r.status, "seconds": round(r.seconds, 3), "runs": r.examples,
         "functions": list(r.functions), "note": r.note, "blame": r.blame, "backward": r.also}
    f = r.detail
    if r.status == "todo":
        d["failure"] = {"check": "not implemented yet", "message": f"{f.function} raises NotImplementedError"}
    elif isinstance(f, Failure):
        d["failure"] = {
            "check": f.check, "message": f.message, "where": f.where, "error": f.error, "tolerance": f.tol,
            "entries": [{"index": list(i), "yours": _jsonable(a), "expected": _jsonable(b)} for i, a, b in f.entries],
            "looks_like": f.symptom, "look_at": f.look if hint_level >= 2 else "",
            "formula": f.hint if hint_level >= 3 else "",
            "example": ({n: _describe(v) for n, v in f.example.args if not n.startswith("_")}
                        if f.example is not None and not getattr(f, "setup", None) else None),
            "setup": getattr(f, "setup", None)}
    return d


def _stamp(rep: FileReport) -> dict:
    """Who, what and when: the learner, the exercise, the file's hash, the grader's version."""
    import datetime
    return {"student": getattr(rep, "student", "") or Path(rep.path).absolute().parent.name,
            "exercise": rep.exercise, "sha256": rep.sha256, "grader": grader_version(), "sandbox": rep.sandbox,
            "final": rep.seed is not None, "graded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def strict(v):
    """``v`` for strict JSON: NaN and infinities (which JSON has not) become null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict(x) for x in v]
    return v


def write_json(reports: list[FileReport], path: Path) -> None:
    files = [{"file": str(rep.path), **_stamp(rep), "exit_status": rep.status, "error": rep.error,
              "backend": rep.backend, "examples": rep.examples, "hint": rep.hint,
              "layers": [result_dict(r, rep.hint) for r in rep.results]} for rep in reports]
    Path(path).write_text(json.dumps(strict(files[0] if len(files) == 1 else files), indent=2, allow_nan=False) + "\n",
                          encoding="utf-8")


def _q(text) -> str:
    """Text for XML and HTML: a learner's control characters and text that is not UTF-8 shown
    as escapes (XML 1.0 has no way to hold them), then markup escaped."""
    return html.escape(plain(text, ""))


def write_junit(reports: list[FileReport], path: Path) -> None:
    q = _q
    parts = ['<?xml version="1.0" encoding="UTF-8"?>', "<testsuites>"]
    for rep in reports:
        cases = rep.results or []
        failures = sum(r.status != "pass" for r in cases) + (1 if rep.error else 0)
        parts.append(f'  <testsuite name="{q(str(rep.path))}" tests="{max(len(cases), 1)}" failures="{failures}" '
                     f'time="{sum(r.seconds for r in cases):.3f}">')
        if rep.error:
            parts.append(f'    <testcase classname="attn-check" name="{q(rep.path.name)}"><failure message="'
                         f'{q(rep.error.splitlines()[0])}">{q(rep.error)}</failure></testcase>')
        for r in cases:
            parts.append(f'    <testcase classname="attn-check.{q(rep.path.stem)}" name="{q(r.layer)}" '
                         f'time="{r.seconds:.3f}">')
            if r.status != "pass":
                text = "\n".join(failure_lines(r, rep.hint))
                msg = {"todo": "not implemented yet", "incomplete": "incomplete"}.get(
                    r.status, r.detail.message if isinstance(r.detail, Failure) else r.status)
                parts.append(f'      <failure type="{r.status}" message="{q(msg)}">{q(text)}</failure>')
            elif r.note:
                parts.append(f"      <system-out>{q(r.note)}</system-out>")
            parts.append("    </testcase>")
        parts.append("  </testsuite>")
    parts.append("</testsuites>")
    Path(path).write_text("\n".join(parts) + "\n", encoding="utf-8")


def write_gradescope(reports: list[FileReport], path: Path) -> None:
    """Gradescope's ``results.json``: one test per layer, worth one point, passed or not."""
    tests, output = [], []
    for rep in reports:
        if rep.error:
            tests.append({"name": rep.path.name, "score": 0, "max_score": 1, "status": "failed",
                          "output": plain(rep.error)})
        for r in rep.results:
            text = "\n".join([f"{r.layer}: {LABELS[r.status]}"] + failure_lines(r, rep.hint))
            tests.append({"name": f"{rep.path.stem}: {r.layer}", "score": 1 if r.status == "pass" else 0,
                          "max_score": 1, "status": "passed" if r.status == "pass" else "failed", "output": text})
        output.append(plain(rep.header or rep.error.splitlines()[0]))
    Path(path).write_text(json.dumps(strict({"score": sum(t["score"] for t in tests),
                                             "max_score": sum(t["max_score"] for t in tests),
                                             "output": "\n".join(output), "tests": tests}), indent=2, allow_nan=False)
                          + "\n", encoding="utf-8")


def _heatmaps(f: Failure, png: Path) -> bool:
    """Yours, expected and their difference, side by side, as one PNG. False without matplotlib."""
    if f.arrays is None:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    yours, want = (np.asarray(a, dtype=np.float64) for a in f.arrays)
    grid = lambda a: a.reshape(1, -1) if a.ndim < 2 else a.reshape(-1, a.shape[-1])     # noqa: E731
    panels = [("yours", grid(yours)), ("expected", grid(want)), ("yours - expected", grid(yours - want))]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    lo, hi = float(min(yours.min(), want.min())), float(max(yours.max(), want.max()))
    d = float(np.abs(yours - want).max()) or 1.0
    for ax, (title, a) in zip(axes, panels):
        diff = "-" in title               # one scale for yours and expected; the difference centred on 0
        im = ax.imshow(a, cmap="RdBu_r" if diff else "viridis", vmin=-d if diff else lo, vmax=d if diff else hi,
                       aspect="auto", interpolation="nearest")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_title(title)
        ax.set_xlabel("last axis")
        ax.set_ylabel("rows (leading axes flattened)")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def write_html(reports: list[FileReport], folder: Path) -> Path:
    """``index.html`` in ``folder``: a table of every layer, and for each failure its report
    beside heatmaps of the learner's output, the expected output and their difference."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    q = _q
    body = ["<!doctype html><meta charset='utf-8'><title>attn-check report</title>",
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:left}"
            ".pass{color:#070}.fail,.incomplete{color:#b00}.todo{color:#777}pre{background:#f6f6f6;padding:8px}"
            ".case{display:flex;gap:1em;align-items:flex-start}</style>", "<h1>attn-check report</h1>"]
    for k, rep in enumerate(reports):
        body.append(f"<h2>{q(str(rep.path))}</h2>")
        if rep.error:
            body.append(f"<pre class='fail'>{q(rep.error)}</pre>")
            continue
        body.append(f"<p>{q(rep.header)}</p><table><tr><th>layer</th><th>status</th><th>seconds</th>"
                    "<th>blame</th></tr>")
        for r in rep.results:
            body.append(f"<tr><td><a href='#f{k}-{q(r.layer)}'>{q(r.layer)}</a></td><td class='{r.status}'>"
                        f"{q(LABELS[r.status])}</td><td>{r.seconds:.2f}</td><td>{q(r.blame)}</td></tr>")
        body.append("</table>")
        for r in rep.results:
            if r.status == "pass":
                continue
            body.append(f"<h3 id='f{k}-{q(r.layer)}'>{q(r.layer)}: {q(LABELS[r.status])}</h3>")
            text = "\n".join(failure_lines(r, rep.hint))
            img = ""
            if isinstance(r.detail, Failure):
                png = folder / f"{k:02d}-{rep.path.stem}-{r.layer}.png"
                if _heatmaps(r.detail, png):
                    img = f"<img src='./{q(quote(os.fsencode(png.name)))}' alt='yours, expected, difference'>"
            body.append(f"<div class='case'><pre>{q(text)}</pre>{img}</div>")
    index = folder / "index.html"
    index.write_text("\n".join(body) + "\n", encoding="utf-8")
    return index

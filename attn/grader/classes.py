"""``attn-check --class DIR``: a folder of learners' folders graded in parallel, one table
(``grades.csv``, ``grades.html``: learner x exercise x layer, score, seconds, the file's
hash, the grader's version) and each learner's own report beside it."""
from __future__ import annotations

import csv
import hashlib
import html
import io
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from .library import EXERCISES
from .results import grader_version


def file_hash(path: Path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def submissions(folder: Path) -> list[tuple[str, Path]]:
    """(learner, file) for every exercise file (named as a starter) in every learner's folder."""
    out = []
    for learner in sorted(p for p in Path(folder).iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        if learner.name == "attn-check":
            continue
        for f in sorted(learner.glob("*.py")):
            if f.stem in EXERCISES:
                out.append((learner.name, f))
    return out


def _grade_one(learner: str, path: str, options: dict, report_dir: str) -> dict:
    """One file, in a worker process: its rows for the table, its report written beside it."""
    from .grading import grade_file
    from .reports import write_json
    t0 = time.perf_counter()
    text = io.StringIO()
    try:
        rep = grade_file(Path(path), None, out=text, **options)
        error = rep.error
        rows = [{"layer": r.layer, "functions": " ".join(r.functions), "status": r.status,
                 "score": int(r.status == "pass"), "seconds": round(r.seconds, 3)} for r in rep.results]
        rep.student = learner
        target = Path(report_dir) / learner
        target.mkdir(parents=True, exist_ok=True)
        (target / f"{Path(path).stem}.txt").write_text(text.getvalue() + (f"attn-check: {error}\n" if error else ""),
                                                      encoding="utf-8")
        write_json([rep], target / f"{Path(path).stem}.json")
    except Exception as e:                  # a bug of the grader's own: this file, not the class
        error, rows = f"attn-check failed on this file: {type(e).__name__}: {e}", []
    return {"learner": learner, "exercise": Path(path).stem, "file": path, "sha256": file_hash(Path(path)),
            "rows": rows, "error": error.splitlines()[0] if error else "", "seconds": time.perf_counter() - t0}


def grade_class(args, out) -> int:
    folder = Path(args.class_dir)
    if not folder.is_dir():
        out.write(f"attn-check: {folder}: no such folder\n")
        return 2
    subs = submissions(folder)
    if not subs:
        out.write(f"attn-check: {folder} holds no learner's folder with an exercise file (named as a starter)\n")
        return 2
    report_dir = Path(args.out or folder / "attn-check")
    report_dir.mkdir(parents=True, exist_ok=True)
    options = {"examples": args.examples, "timeout": args.timeout, "forward_only": args.forward_only,
               "hint_level": args.hint, "sandbox_mode": "off" if args.sandbox == "off" else "auto",
               "memory_mb": args.memory, "seed": args.seed}
    t0 = time.perf_counter()
    results = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(_grade_one, learner, str(path), options, str(report_dir)): (learner, path)
                   for learner, path in subs}
        for fut in as_completed(futures):
            learner, path = futures[fut]
            try:
                results.append(fut.result())
            except Exception as e:
                results.append({"learner": learner, "exercise": path.stem, "file": str(path),
                                "sha256": file_hash(path), "rows": [], "seconds": 0.0,
                                "error": f"attn-check failed on this file: {type(e).__name__}: {e}"})
    wall = time.perf_counter() - t0
    version = grader_version()
    results.sort(key=lambda r: (r["learner"], r["exercise"]))
    _write_csv(results, report_dir / "grades.csv", version)
    _write_html(results, report_dir / "grades.html", version)
    if getattr(args, "similarity", False):
        from .similarity import similarity_report
        similarity_report(subs, report_dir / "similarity.html", out)
    exercises = sorted({r["exercise"] for r in results})
    learners = sorted({r["learner"] for r in results})
    cell = {(r["learner"], r["exercise"]): r for r in results}
    width = max(8, *(len(x) for x in learners))
    out.write(f"attn-check --class {folder}: {len(learners)} learners, {len(results)} files, {wall:.1f} s with "
              f"{args.jobs} job{'s' * (args.jobs != 1)}, grader {version}\n")
    out.write(f"{'learner':<{width}} " + " ".join(f"{e[:14]:>14}" for e in exercises) + f" {'total':>9}\n")
    for learner in learners:
        got = tot = 0
        cells = []
        for e in exercises:
            r = cell.get((learner, e))
            if r is None:
                cells.append(f"{'-':>14}")
                continue
            s, t = sum(x["score"] for x in r["rows"]), len(r["rows"]) or len(EXERCISES[e].asks)
            got, tot = got + s, tot + t
            cells.append(f"{f'{s}/{t}':>14}")
        out.write(f"{learner:<{width}} " + " ".join(cells) + f" {f'{got}/{tot}':>9}\n")
    out.write(f"table: {report_dir / 'grades.csv'}, {report_dir / 'grades.html'}; each learner's report in "
              f"{report_dir}/LEARNER/\n")
    return 0


FIELDS = ("learner", "exercise", "layer", "functions", "status", "score", "seconds", "sha256", "grader", "error")


def _table_rows(results, version):
    for r in results:
        if not r["rows"]:
            yield {"learner": r["learner"], "exercise": r["exercise"], "layer": "", "functions": "", "status": "error",
                   "score": 0, "seconds": round(r["seconds"], 3), "sha256": r["sha256"], "grader": version,
                   "error": r["error"]}
        for row in r["rows"]:
            yield dict(row, learner=r["learner"], exercise=r["exercise"], sha256=r["sha256"], grader=version,
                       error=r["error"])


def _write_csv(results, path: Path, version: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for row in _table_rows(results, version):
            w.writerow(row)


def _write_html(results, path: Path, version: str) -> None:
    q = html.escape
    body = ["<!doctype html><meta charset='utf-8'><title>attn-check: the class</title>",
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:left}"
            ".pass{color:#070}.fail,.incomplete,.error{color:#b00}.todo{color:#777}</style>",
            f"<h1>attn-check: the class</h1><p>grader {q(version)}</p><table><tr>"
            + "".join(f"<th>{q(f)}</th>" for f in FIELDS) + "</tr>"]
    for row in _table_rows(results, version):
        link = f"<a href='{q(row['learner'])}/{q(row['exercise'])}.txt'>{q(row['exercise'])}</a>"
        cells = [q(str(row[f])) if f != "exercise" else link for f in FIELDS]
        cells[FIELDS.index("sha256")] = q(row["sha256"][:16])
        body.append("<tr>" + "".join(f"<td class='{q(row['status'])}'>{c}</td>" if f == "status" else f"<td>{c}</td>"
                                     for f, c in zip(FIELDS, cells)) + "</tr>")
    body.append("</table>")
    path.write_text("\n".join(body) + "\n", encoding="utf-8")

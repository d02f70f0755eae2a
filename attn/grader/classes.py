"""``attn-check --class DIR``: a folder of learners' folders graded in parallel, one table
(``grades.csv``, ``grades.html``: learner x exercise x layer, score, seconds, the file's
hash, the grader's version) and each learner's own report beside it."""
from __future__ import annotations

import csv
import html
import io
import multiprocessing
import os
import stat
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from urllib.parse import quote

from .library import EXERCISES
from .results import LoadError, grader_version, plain
from .sandbox import read_source


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return what
    return "not a regular file"


def submissions(folder: Path) -> list[dict]:
    """Every exercise file (named as a starter) in every learner's folder, read once, before
    anything is graded: {"learner", "exercise", "file", "source": (text, sha256) or None,
    "error"}. Only regular files in real folders are read; a link, a FIFO or a device is
    refused with an error, and nothing outside ``folder`` is ever opened."""
    out = []
    for learner in sorted(os.scandir(folder), key=lambda e: e.name):
        if learner.name.startswith((".", "_")) or learner.name == "attn-check":
            continue
        kind = stat.S_IFMT(learner.stat(follow_symlinks=False).st_mode)
        if kind != stat.S_IFDIR:
            if kind != stat.S_IFREG:          # a learner's folder that is a link, a FIFO, a device
                out.append({"learner": learner.name, "exercise": "", "file": learner.path, "source": None,
                            "error": f"not graded: {_kind(kind)}, not a learner's folder"})
            continue
        for entry in sorted(os.scandir(learner.path), key=lambda e: e.name):
            stem, ext = os.path.splitext(entry.name)
            if ext != ".py" or stem not in EXERCISES:
                continue
            row = {"learner": learner.name, "exercise": stem, "file": entry.path, "source": None, "error": ""}
            mode = entry.stat(follow_symlinks=False).st_mode
            if not stat.S_ISREG(mode):
                row["error"] = f"not graded: {_kind(mode)} (attn-check reads regular files only)"
            else:
                try:
                    row["source"] = read_source(Path(entry.path))
                except LoadError as e:
                    row["error"] = f"not graded: {e}"
            out.append(row)
    return out


def _grade_one(sub: dict, options: dict, report_dir: str) -> dict:
    """One file, in a worker process: its rows for the table, its report written beside it."""
    from .grading import grade_file
    from .reports import write_json
    t0 = time.perf_counter()
    text = io.StringIO()
    learner, path = sub["learner"], sub["file"]
    try:
        rep = grade_file(Path(path), None, out=text, source=sub["source"], **options)
        error = rep.error
        rows = [{"layer": r.layer, "functions": " ".join(r.functions), "status": r.status,
                 "score": int(r.status == "pass"), "seconds": round(r.seconds, 3), "error": _why(r)}
                for r in rep.results]
        rep.student = learner
        target = learner_folder(Path(report_dir), learner)
        target.mkdir(parents=True, exist_ok=True)
        (target / f"{Path(path).stem}.txt").write_text(text.getvalue() + (f"attn-check: {error}\n" if error else ""),
                                                      encoding="utf-8", errors="backslashreplace")
        write_json([rep], target / f"{Path(path).stem}.json")
    except Exception as e:                  # a bug of the grader's own: this file, not the class
        error, rows = f"attn-check failed on this file: {type(e).__name__}: {e}", []
    return {"learner": learner, "exercise": Path(path).stem, "file": path, "sha256": sub["source"][1],
            "rows": rows, "error": error.splitlines()[0] if error else "", "seconds": time.perf_counter() - t0}


def _why(r) -> str:
    """A layer's row's error column: why it did not pass, in one line."""
    from .results import Failure
    if r.status == "pass":
        return ""
    if r.status == "todo":
        return "not implemented yet"
    if r.status == "incomplete":
        return r.note.split(";")[0]
    f = r.detail
    return plain(f"{f.check}: {f.message}" if isinstance(f, Failure) else r.status).splitlines()[0][:300]


def _end_workers(pool) -> None:
    """Send this process's workers SIGTERM (which they meet as SystemExit: their children ended,
    their folders removed) and wait for them."""
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in multiprocessing.active_children():
        worker.terminate()
    for worker in multiprocessing.active_children():
        worker.join(timeout=60)


def grade_class(args, out) -> int:
    folder = Path(args.class_dir)
    if not folder.is_dir():
        out.write(f"attn-check: {folder}: no such folder\n")
        return 2
    report_dir = Path(args.out or folder / "attn-check")
    if report_dir.is_symlink():
        out.write(f"attn-check: {report_dir} is a symbolic link: the reports go into a real folder only\n")
        return 2
    subs = submissions(folder)
    if not subs:
        out.write(f"attn-check: {folder} holds no learner's folder with an exercise file (named as a starter)\n")
        return 2
    report_dir.mkdir(parents=True, exist_ok=True)
    options = {"examples": args.examples, "timeout": args.timeout, "forward_only": args.forward_only,
               "hint_level": args.hint, "sandbox_mode": "off" if args.sandbox == "off" else "auto",
               "memory_mb": args.memory, "seed": args.seed, "layer_seconds": args.layer_time}
    t0 = time.perf_counter()
    results = [_refused(sub) for sub in subs if sub["source"] is None]
    # Every file meets the same examples: drawn here once, the workers inherit them (forked).
    from .grading import draw_for
    draw_for({sub["exercise"] for sub in subs if sub["source"]}, args.examples, args.seed)
    results += _grade_all(subs, options, report_dir, args.jobs)
    wall = time.perf_counter() - t0
    version = grader_version()
    results.sort(key=lambda r: (r["learner"], r["exercise"]))
    _write_csv(results, report_dir / "grades.csv", version)
    _write_html(results, report_dir / "grades.html", version)
    if getattr(args, "similarity", False):
        from .similarity import similarity_report
        similarity_report([s for s in subs if s["source"]], report_dir / "similarity.html", out)
    out.write(f"attn-check --class {folder}: {len({r['learner'] for r in results})} learners, {len(results)} files, "
              f"{wall:.1f} s with {args.jobs} job{'s' * (args.jobs != 1)}, grader {version}\n")
    _write_scores(results, out)
    out.write(f"table: {report_dir / 'grades.csv'}, {report_dir / 'grades.html'}; each learner's report in "
              f"{report_dir}/LEARNER/\n")
    return 0


def _grade_all(subs: list, options: dict, report_dir: Path, jobs: int) -> list:
    """Every readable submission graded by :func:`_grade_one` in ``jobs`` forked workers: their
    results, in the order they finish. A signal that ends the grader ends the workers too."""
    results = []
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(_grade_one, sub, options, str(report_dir)): sub for sub in subs if sub["source"]}
        try:
            for fut in as_completed(futures):
                sub = futures[fut]
                try:
                    results.append(fut.result())
                except Exception as e:
                    results.append(dict(_refused(sub), error=f"attn-check failed on this file: {type(e).__name__}: "
                                        f"{e}", sha256=sub["source"][1]))
        except BaseException:               # a signal ended the grader: its workers end too, cleaning up
            _end_workers(pool)
            raise
    return results


def _write_scores(results: list, out) -> None:
    """The terminal's table: a row per learner, a column per exercise (score/layers) and the
    total; then each file that was not graded, and why."""
    exercises = sorted({r["exercise"] for r in results if r["exercise"] in EXERCISES})
    learners = sorted({r["learner"] for r in results})
    cell = {(r["learner"], r["exercise"]): r for r in results}
    width = max(8, *(len(_printable(x)) for x in learners))
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
        out.write(f"{_printable(learner):<{width}} " + " ".join(cells) + f" {f'{got}/{tot}':>9}\n")
    for r in results:
        if r["error"] and not r["rows"]:
            out.write(f"{_printable(r['learner'])}/{_printable(r['exercise'] or '')}: {_printable(r['error'])}\n")


#: The table's own files in the report folder: a learner's folder of that name is written as
#: ``_NAME`` (a learner's folder whose name starts with ``_`` is never graded, so none clashes).
TABLES = ("grades.csv", "grades.html", "similarity.html")


def learner_folder(report_dir: Path, learner: str) -> Path:
    """Where a learner's own reports go in ``report_dir``."""
    return report_dir / (("_" + learner) if learner in TABLES else learner)


FIELDS = ("learner", "exercise", "layer", "functions", "status", "score", "seconds", "sha256", "grader", "error")


def _printable(text: str) -> str:
    """A learner's name or error for the terminal: no control characters (no escape sequences)."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _refused(sub: dict) -> dict:
    """A file (or a learner's folder) that was not graded: one row, its error saying why."""
    return {"learner": sub["learner"], "exercise": sub["exercise"], "file": sub["file"], "sha256": "", "rows": [],
            "seconds": 0.0, "error": sub["error"]}


def _table_rows(results, version):
    for r in results:
        if not r["rows"]:
            yield {"learner": r["learner"], "exercise": r["exercise"], "layer": "", "functions": "", "status": "error",
                   "score": 0, "seconds": round(r["seconds"], 3), "sha256": r["sha256"], "grader": version,
                   "error": r["error"]}
        for row in r["rows"]:
            yield dict(row, learner=r["learner"], exercise=r["exercise"], sha256=r["sha256"], grader=version,
                       error=row.get("error") or r["error"])


def shown(v):
    """``v``, a name read from the file system that is not UTF-8, with its bytes shown as
    escapes (``l\\xe9a``); other values as they are."""
    if not isinstance(v, str):
        return v
    try:
        return v.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return v.encode("utf-8", "backslashreplace").decode("utf-8")


def _number_like(v: str) -> bool:
    """Whether a spreadsheet's default import would read ``v`` as a number, a date or a truth
    value (``000123``, ``1e5``, ``1/2``, ``TRUE``) rather than as the text it is."""
    if v.strip().upper() in ("TRUE", "FALSE"):
        return True
    if not any(c.isdigit() for c in v):             # "nan" and "inf" are Python's floats, not a spreadsheet's
        return False
    try:
        float(v)
        return True
    except ValueError:
        return all(c.isdigit() or c in " .,:/%$()+-" for c in v)


def _cell(v):
    """A CSV cell a spreadsheet shows as text: one that would start a formula or be read as a
    number, or that starts with a quote itself, gets a quote first (so that taking one leading
    quote off any cell gives the text back)."""
    if isinstance(v, str) and (v[:1] in ("=", "+", "-", "@", "\t", "\r", "\n", "|", "%", "'") or _number_like(v)):
        return "'" + v
    return v


def _write_csv(results, path: Path, version: str) -> None:
    with open(path, "w", newline="", encoding="utf-8", errors="backslashreplace") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for row in _table_rows(results, version):
            w.writerow({k: _cell(shown(v)) for k, v in row.items()})


def _write_html(results, path: Path, version: str) -> None:
    q = html.escape
    body = ["<!doctype html><meta charset='utf-8'><title>attn-check: the class</title>",
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:left}"
            ".pass{color:#070}.fail,.incomplete,.error{color:#b00}.todo{color:#777}</style>",
            f"<h1>attn-check: the class</h1><p>grader {q(version)}</p><table><tr>"
            + "".join(f"<th>{q(f)}</th>" for f in FIELDS) + "</tr>"]
    for row in _table_rows(results, version):
        folder = learner_folder(path.parent, row["learner"])
        href = quote(os.fsencode(folder.name), safe="") + "/" + quote(row["exercise"], safe="") + ".txt"
        report = row["exercise"] and (folder / f"{row['exercise']}.txt").is_file()
        link = f"<a href='./{q(href)}'>{q(row['exercise'])}</a>" if report else q(row["exercise"])
        cells = [q(str(shown(row[f]))) if f != "exercise" else link for f in FIELDS]
        cells[FIELDS.index("sha256")] = q(row["sha256"][:16])
        body.append("<tr>" + "".join(f"<td class='{q(row['status'])}'>{c}</td>" if f == "status" else f"<td>{c}</td>"
                                     for f, c in zip(FIELDS, cells)) + "</tr>")
    body.append("</table>")
    path.write_text("\n".join(body) + "\n", encoding="utf-8", errors="backslashreplace")

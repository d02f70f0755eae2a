"""The ``attn-check`` command: its arguments, ``--all DIR``, ``--timings``, and
:func:`console`, the console script's entry point."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from .. import backend as B
from ..testing import LAYERS
from .grading import FINAL_SCALE, _layer_table, grade_file
from .library import EXERCISES
from . import bubblewrap
from .sandbox import LIMITS
from .reports import LABELS, write_gradescope, write_html, write_json, write_junit
from .results import DEFAULT_EXAMPLES, DEFAULT_TIMEOUT, FileReport

# ----------------------------------------------------------------------------- command line


def _all(folder: Path, args, out) -> tuple[int, list[FileReport]]:
    """Grade every exercise file of ``folder``; print a table of what is done."""
    files = sorted(p for p in Path(folder).glob("*.py") if not p.name.startswith("_"))
    if not files:
        out.write(f"attn-check: {folder} holds no .py file\n")
        return 2, []
    reports = []
    progress = sys.stderr.isatty()
    for i, p in enumerate(files, start=1):
        if progress:
            sys.stderr.write(f"\rattn-check --all: {i}/{len(files)} {p.name[:40]:<40}")
            sys.stderr.flush()
        reports.append(grade_file(p, None, args.examples, args.timeout, args.forward_only, args.allow_library,
                                  None, args.hint, **_options(args)))
    if progress:
        sys.stderr.write("\r" + " " * 70 + "\r")
    out.write(f"attn-check --all {folder}: {len(files)} file{'s' * (len(files) != 1)}, {args.examples} examples "
              "per layer\n")
    out.write(f"{'exercise':<34} {'state':<16} {'passed':>7}  not yet done\n")
    done = 0
    for rep in reports:
        rs = rep.results
        passed = sum(r.status == "pass" for r in rs)
        if rep.error:
            state, detail = "cannot grade", rep.error.splitlines()[0][:60]
        elif passed == len(rs):
            state, detail = "done", ""
            done += 1
        elif all(r.status == "todo" for r in rs):
            state, detail = "not started", ""
        else:
            state = "in progress" if not any(r.status == "fail" for r in rs) else "failing"
            detail = ", ".join(f"{r.layer} (fix {r.blame})" if r.status == "fail" and r.blame else
                               f"{r.layer} ({LABELS[r.status].lower()})" for r in rs if r.status != "pass")
        out.write(f"{rep.path.name:<34} {state:<16} {passed:>3}/{len(rs):<3}  {detail}\n")
    out.write(f"{done} of {len(files)} exercises done\n")
    return (0 if done == len(files) else 1), reports


def _options(args) -> dict:
    return {"exercise": args.exercise, "sandbox_mode": "off" if args.sandbox == "off" else "auto",
            "memory_mb": args.memory, "seed": args.seed, "layer_seconds": args.layer_time}


def check_sandbox(args, out) -> bool:
    """Say in one line when no sandbox can be had here, and what a learner's file can then
    reach; False when one is required."""
    if args.sandbox == "off":
        return True
    exe, _, why = bubblewrap.available()
    if exe:
        return True
    if args.sandbox == "required":
        out.write(f"attn-check: no sandbox can be had here ({why}), and --sandbox required asks for one\n")
        return False
    runs_as = "as nobody: every file nobody may read" if os.geteuid() == 0 else "as you: every file you may read"
    out.write(f"attn-check: no sandbox here ({why}): the file runs {runs_as}, the network, under resource limits "
              "only\n")
    return True


def timings(examples: int, out) -> int:
    """Grade the library's own functions (every layer) and print each check's seconds."""
    from . import solutions
    rep = grade_file(Path(solutions.__file__), None, examples, DEFAULT_TIMEOUT, False, True, None)
    if rep.error:
        out.write(f"attn-check: {rep.error}\n")
        return 2
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out.write(f"seconds per check at {examples} examples (the library's own functions, backend "
              f"{B.get_backend()}, {os.cpu_count()} CPU cores visible, load average {load:.1f} at the end: "
              "a loaded machine is slower)\n")
    for r in rep.results:
        out.write(f"  {r.layer:<22} {r.seconds:7.2f} s  {LABELS[r.status]}\n")
    out.write(f"  {'total':<22} {sum(r.seconds for r in rep.results):7.2f} s\n")
    return rep.status


#: What ``attn-check --help`` says after the options, before the table of layers.
EPILOG = (
    "Write the functions of a layer in PATH.py under the library's names (start from a file in\n"
    "lessons/exercises/), then run `attn-check PATH.py`. Only the layers the file defines are checked.\n"
    "Your file runs in a sandbox (bubblewrap: the nobody user, no network, no files but Python's,\n"
    "NumPy's and the library modules the exercise gives, its own /tmp; resource limits; the\n"
    "library's answers are not there), each call under a time limit, each layer and file under a\n"
    "budget (--layer-time): a call that hangs, exits,\n"
    "crashes or floods its output fails, naming the function. For each layer, hypothesis draws\n"
    "examples (hard ones included: logits of 1e4, fully masked rows, repeated ids, padding); the\n"
    "forward is graded first on all of them (exceptions, NaN, shapes, dtypes, inputs modified in\n"
    "place, invariants, the library's output); then the backward, against the library's and against\n"
    "float64 central differences of your forward. If the forward is wrong, the report blames it, and\n"
    "the backward is only checked against central differences of your own forward. Layers with\n"
    "dropout are graded over many draws: the kept fraction, the 1/(1-p) scale, the backward's mask.\n"
    "A failure shows the smallest failing example, the check, the relative error, the first entries\n"
    "that differ and what the difference looks like; --hint 2 adds where to look, --hint 3 the\n"
    "formula. A function that still raises NotImplementedError is 'not implemented yet'. A forward\n"
    "without its backward is INCOMPLETE unless --forward-only. The library's own functions,\n"
    "re-exported, fail; a forward an exercise gives (exercise 8 imports the library's) is used, not\n"
    "graded.\n\n"
    "A file named as a starter is graded on everything that starter asks for (--exercise NAME for\n"
    "another name): a missing or re-exported function fails.\n\n"
    "For teachers: --json, --junit, --gradescope (results.json, a point per layer) and --html DIR\n"
    "write reports; --all DIR grades every file of a folder and prints which exercises are done;\n"
    "--class DIR grades a folder of learners' folders in parallel into one table; --seed N is the\n"
    "final profile; --sandbox required refuses to grade where no sandbox can be had.\n\n"
    "Exit status: 0 when every graded layer passes, 1 when one fails, is incomplete or not\n"
    "implemented yet, 2 when the file cannot be loaded or defines nothing gradable.\n\n"
    "Layers and the names attn-check looks for:\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attn-check", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Grade your own layers against attn's: the same hypothesis examples, gradient checks "
                    "and invariants that prove the library's layers.",
        epilog=EPILOG + _layer_table())
    _add_grading(p)
    _add_reports(p)
    _add_running(p)
    _add_class(p)
    return p


def _add_grading(p: argparse.ArgumentParser) -> None:
    """What is graded: the file (or folder), its layers, how many examples, how strictly."""
    p.add_argument("path", type=Path, nargs="?", help="your Python file, e.g. lessons/exercises/05_masks.py")
    p.add_argument("--all", type=Path, metavar="DIR", help="grade every .py file in DIR and print a table of "
                   "which exercises are done")
    p.add_argument("--layer", action="append", choices=list(LAYERS), metavar="NAME",
                   help="check only this layer (repeatable); default: every layer the file defines")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, metavar="N",
                   help=f"hypothesis examples per layer (default {DEFAULT_EXAMPLES}; more finds rarer bugs, slower)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds one call of your function may take (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--hint", type=int, choices=(1, 2, 3), default=1,
                   help="how much a failure tells: 1 the symptom (default), 2 where to look, 3 the formula")
    p.add_argument("--forward-only", action="store_true",
                   help="accept a forward without its backward as complete")
    p.add_argument("--allow-library", action="store_true",
                   help="accept the library's own functions (checks attn-check itself on tests/solutions.py)")


def _add_reports(p: argparse.ArgumentParser) -> None:
    """The reports written beside the terminal's."""
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    p.add_argument("--junit", type=Path, metavar="FILE", help="also write a JUnit XML report (one test per layer)")
    p.add_argument("--gradescope", type=Path, metavar="FILE",
                   help="also write Gradescope's results.json (one point per layer)")
    p.add_argument("--html", type=Path, metavar="DIR", help="also write an HTML report with heatmaps of each "
                   "failure (yours, expected, difference) into DIR")
    p.add_argument("--timings", action="store_true", help="print the seconds each check takes on the library's "
                   "own functions at --examples, and exit")


def _add_running(p: argparse.ArgumentParser) -> None:
    """Where and how the learner's code runs: the backend, the exercise, the profile, the sandbox."""
    p.add_argument("--backend", choices=["numpy", "cupy"], default="numpy",
                   help="array backend to run on (default numpy; cupy needs a GPU)")
    p.add_argument("--exercise", choices=sorted(EXERCISES), metavar="NAME",
                   help="grade the file as this exercise (default: the starter whose file name it has): what the "
                        "exercise asks for is what is scored, whatever the file defines")
    p.add_argument("--seed", type=int, metavar="N", help="final grading: examples from this seed (one the learners "
                   f"do not know) and lengths and widths up to {FINAL_SCALE} times the defaults")
    p.add_argument("--sandbox", choices=("auto", "required", "off"), default="auto",
                   help="auto (default): bubblewrap where it can be had (else a line says what the file can then "
                        "reach), limits always; required: refuse to grade where bubblewrap cannot run; off: no "
                        "sandbox (the nobody user still, as root)")
    p.add_argument("--layer-time", type=float, default=LIMITS["layer_s"], metavar="S",
                   help=f"wall-time seconds the grading of one layer may take in all, every call together (default "
                        f"{LIMITS['layer_s']:g}); a file may take {LIMITS['file_s'] // LIMITS['layer_s']:g} times that")
    p.add_argument("--memory", type=int, metavar="MB", help=f"the child's address-space limit "
                   f"(default {LIMITS['memory_mb']} MB)")


def _add_class(p: argparse.ArgumentParser) -> None:
    """``--class``: a folder of learners' folders."""
    p.add_argument("--class", dest="class_dir", type=Path, metavar="DIR",
                   help="grade a class: DIR holds one folder per learner, each with exercise files named as "
                        "the starters; writes DIR's table (grades.csv, grades.html) and each learner's report")
    p.add_argument("--out", type=Path, metavar="DIR", help="with --class: where the table and reports go "
                   "(default DIR/attn-check)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2), metavar="N",
                   help="with --class: files graded at once")
    p.add_argument("--similarity", action="store_true", help="with --class: also a report of similar files "
                   "between learners and with the library's source (copydetect)")


def main(argv=None, out=None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    if args.examples < 1:
        out.write("attn-check: --examples must be at least 1\n")
        return 2
    if not args.timeout > 0 or not args.layer_time > 0:
        out.write(f"attn-check: --{'timeout' if not args.timeout > 0 else 'layer-time'} must be positive\n")
        return 2
    try:
        B.set_backend(args.backend)
    except B.BackendError as e:
        out.write(f"attn-check: {e}\n")
        return 2
    if args.timings:
        return timings(args.examples, out)
    if not check_sandbox(args, out):
        return 2
    if args.class_dir is not None:
        from .classes import grade_class
        return grade_class(args, out)
    if args.all is not None:
        if not args.all.is_dir():
            out.write(f"attn-check: {args.all}: no such folder\n")
            return 2
        status, reports = _all(args.all, args, out)
    else:
        if args.path is None:
            out.write("attn-check: give a file to grade (or --all DIR); --help explains\n")
            return 2
        if not args.path.is_file():
            out.write(f"attn-check: {args.path}: no such file\n")
            return 2
        rep = grade_file(args.path, args.layer, args.examples, args.timeout, args.forward_only, args.allow_library,
                         out, args.hint, **_options(args))
        if rep.error:
            out.write(f"attn-check: {rep.error}\n")
        status, reports = rep.status, [rep]
    if args.json:
        write_json(reports, args.json)
    if args.junit:
        write_junit(reports, args.junit)
    if args.gradescope:
        write_gradescope(reports, args.gradescope)
    if args.html:
        write_html(reports, args.html)
    return status


def _ended(signum, frame):
    """SIGTERM or SIGHUP (a course's ``timeout``, a closed terminal) ends the grader as an
    exception, so that its ``finally`` blocks and exit handlers run: its child ended, its
    staged library and working folders removed."""
    raise SystemExit(128 + signum)


def console() -> int:
    """The command: :func:`main`, quiet when its output is piped into a command that stops
    reading (``attn-check FILE | head``) and when a signal ends it."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _ended)
    try:
        return main()
    except BrokenPipeError:
        sys.stderr.close()
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT

"""Time every lesson, headless, and print a Markdown table (the one in lessons/README.md).

    python lessons/time_lessons.py                    # quick mode (what CI runs)
    python lessons/time_lessons.py --full --only 01 03 --timeout 120

Each lesson runs as its own process (``ATTN_QUICK=1`` for quick mode, figures into a
temporary folder, ``MPLBACKEND=Agg``, one BLAS thread). Wall time is what you wait;
CPU time (user + system of the child) is what the lesson itself used, which matters
on a shared machine where other work slows the wall clock down. A lesson that runs
past ``--timeout`` is stopped and reported as such.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_lesson(path: Path, quick: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, ATTN_LESSONS_OUT=out, MPLBACKEND="Agg", PYTHONPATH=str(ROOT),
                   OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
        env.pop("ATTN_QUICK", None)
        if quick:
            env["ATTN_QUICK"] = "1"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            status = "passed" if proc.returncode == 0 else f"FAILED ({proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"stopped after {timeout:g} s"
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return dict(lesson=path.stem, wall=wall, cpu=cpu, status=status)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="full mode instead of quick mode")
    p.add_argument("--only", nargs="*", default=None, help="lesson numbers to time (default: all)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a lesson is stopped")
    args = p.parse_args(argv)
    lessons = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    if args.only:
        lessons = [x for x in lessons if x.name[:2] in args.only]
    mode = "full" if args.full else "quick"
    print(f"| lesson | {mode}: wall s | {mode}: CPU s | |")
    print("|---|---:|---:|---|")
    total_wall = total_cpu = 0.0
    for path in lessons:
        r = time_lesson(path, not args.full, args.timeout)
        total_wall += r["wall"]
        total_cpu += r["cpu"]
        print(f"| {r['lesson']} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['status']} |", flush=True)
    print(f"| all {len(lessons)} | {total_wall:.1f} | {total_cpu:.1f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

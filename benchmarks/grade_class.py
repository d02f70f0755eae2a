"""A generated class for timing ``attn-check --class``: N learners, each with the whole
exercise set (a file named as each starter): the files of ``tests/answers/`` (correct, some
answering part of what their exercise asks), and for the seven single-layer exercises the
library's layers pasted in as the learner's own code (its relative imports made absolute).
Then grades it and prints the command's own table, its wall time, what 200 learners take at
that pace, and the machine's load (a shared machine is slower).

    python benchmarks/grade_class.py DIR --learners 50 --jobs 2 [--seed N]
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: attn/layers' modules in an order where each comes after what it imports.
LAYERS = ("_checks", "activation", "softmax", "linear", "dropout", "embedding", "positional", "layernorm",
          "feedforward", "residual", "rope", "attention", "recurrent")
PASTED = ("01_seq2seq", "03_positional_encoding", "04_attention", "06_multi_head_attention",
          "07_feed_forward_layer_norm", "08_backprop_by_hand", "12_dropout")


def pasted_layers() -> str:
    """attn/layers as one file of a learner's: its imports within attn.layers dropped, those of the
    rest of attn made absolute."""
    parts = ["from __future__ import annotations\n\nimport math\nfrom typing import NamedTuple\n\n"
             "from attn import backend as B\n"]
    for name in LAYERS:
        text = (ROOT / "attn" / "layers" / f"{name}.py").read_text(encoding="utf-8")
        text = re.sub(r"^from \.\.(\w+) import ", r"from attn.\1 import ", text, flags=re.M)
        text = re.sub(r"^from \.+\S* import \([^)]*\)\n", "", text, flags=re.M)
        text = re.sub(r"^(from \.+\S* import .*|from __future__ import .*|import math|from typing import .*)\n",
                      "", text, flags=re.M)
        parts.append(f"\n# ---- {name}\n" + text)
    return "".join(parts)


def generate(folder: Path, learners: int) -> None:
    layers = pasted_layers()
    answers = {p.stem: p.read_text(encoding="utf-8") for p in (ROOT / "tests" / "answers").glob("*.py")}
    for i in range(learners):
        learner = folder / f"learner{i:03d}"
        learner.mkdir(parents=True, exist_ok=True)
        for name in PASTED:
            (learner / f"{name}.py").write_text(layers, encoding="utf-8")
        for name, text in answers.items():
            (learner / f"{name}.py").write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="where the class is written (a new folder)")
    p.add_argument("--learners", type=int, default=50)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--seed", type=int, help="the final profile (attn-check --seed)")
    args = p.parse_args(argv)
    generate(args.folder, args.learners)
    cmd = [sys.executable, "-m", "attn.grader", "--class", str(args.folder), "--jobs", str(args.jobs)]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    rc = subprocess.call(cmd + (["--seed", str(args.seed)] if args.seed is not None else []))
    wall, used = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = used.ru_utime + used.ru_stime
    load = os.getloadavg()
    print(f"{args.learners} learners, the whole exercise set: {wall:.0f} s wall with {args.jobs} jobs, "
          f"{wall / args.learners:.1f} s a learner; 200 learners at this pace: {wall / args.learners * 200 / 60:.0f} "
          f"minutes (load average {load0[0]:.1f} at the start, {load[0]:.1f} at the end, {load[2]:.1f} over 15 "
          f"minutes, on {os.cpu_count()} cores; {cpu:.0f} s of CPU counted in all)")
    return rc


if __name__ == "__main__":
    sys.exit(main())

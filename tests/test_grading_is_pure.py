"""A grade is a function of the file, the layer, the profile and the seed alone: a file graded
first in a fresh process, and again after a hundred other gradings (other files, other layers,
hypothesis's searches and shrinks in between), gets the same report, seconds aside. The files:
a wrong BPE that only an explicit example shows, and a layer norm wrong only for the wide rows
of the final profile (a failure hypothesis draws and shrinks)."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

#: (the file's name, its source or a path to copy, attn-check's arguments beyond the file)
GRADED = [("bpe.py", "bpe: merging pairs seen once", ("--hint", "3")),
          ("wide.py", HERE / "mutants" / "layer_norm_wrong_for_wide_rows.py", ("--seed", "4242", "--hint", "3"))]
OTHERS = 100


def _steady(text: str) -> str:
    return re.sub(r"\d+\.\d+ s\b", "N s", text)


def _grade(path: Path, argv) -> str:
    from attn.grader import cli
    out = io.StringIO()
    cli.main([str(path), *argv], out=out)
    return _steady(out.getvalue())


def _others(n: int) -> None:
    """``n`` gradings of other layers' typical mistakes, in this process."""
    import numpy as np

    from attn.grader import grading
    from attn.testing import DROPOUT_PROBES, LAYERS
    from typical_mistakes import MISTAKES

    class InProcess:
        def begin_layer(self):
            pass

        def reset(self):
            pass

    cases = [(layer, m[1]) for layer, ms in MISTAKES.items() if layer not in ("bpe", "layer_norm") for m in ms]
    for i in range(n):
        layer, source = cases[i % len(cases)]
        names: dict = {}
        exec(compile(textwrap.dedent(source), f"other{i}.py", "exec"), names)
        impl = {f: names[f] for f in LAYERS[layer].functions if f in names}
        forward = impl[LAYERS[layer].functions[0]] if LAYERS[layer].functions[0] in impl else None
        drop = ()
        if layer in DROPOUT_PROBES and layer != "dropout" and forward is not None:
            import inspect
            if "dropout" not in inspect.signature(forward).parameters:
                drop = ("dropout", "rng")
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            grading.grade(LAYERS[layer], impl, InProcess(), drop=drop)


def session(tmp: Path) -> dict:
    """What the test runs in a fresh process: each file's report first, after the others with
    the drawn examples kept, and after them with every example drawn again."""
    from attn.grader import grading
    from typical_mistakes import MISTAKES

    files = []
    for name, source, argv in GRADED:
        path = tmp / name
        if isinstance(source, Path):
            path.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
        else:
            layer, mistake = source.split(": ")
            path.write_text(next(m[1] for m in MISTAKES[layer] if m[0] == mistake), encoding="utf-8")
        files.append((path, argv))
    first = [_grade(p, a) for p, a in files]
    _others(OTHERS)
    kept = [_grade(p, a) for p, a in files]
    grading.DRAWN.clear()
    drawn_again = [_grade(p, a) for p, a in files]
    return {"first": first, "kept": kept, "drawn_again": drawn_again}


def test_a_file_gets_the_same_report_first_and_after_a_hundred_others(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert "FAIL" in got["first"][0] and "FAIL" in got["first"][1], got["first"]
    for first, kept, again in zip(got["first"], got["kept"], got["drawn_again"]):
        assert kept == first
        assert again == first


if __name__ == "__main__":
    print(json.dumps(session(Path(sys.argv[1]))))

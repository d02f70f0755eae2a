"""Hints that find the mistake: for every layer an exercise asks for, a set of typical mistakes
(``tests/typical_mistakes.py``), each written as a learner would, and each must get a report
whose "looks like" (hint 1) and "look at" (hint 2) point at its own mistake, not at a
neighbour's. The mistakes are graded in this process (the sandbox has tests of its own), most
without shrinking the failing example (``SHRUNK``): a fraction of a second each, a few seconds
for attention's."""
from __future__ import annotations

import contextlib
import inspect
import io
import re
import textwrap
import warnings

import numpy as np
import pytest

import attn.backend as B
from attn.grader import cli, grading
from attn.grader.reports import report
from attn.testing import DROPOUT_PROBES, EXERCISES, LAYERS
from typical_mistakes import MISTAKES, NO_VAR, NORM

CASES = [(layer, *m) for layer, ms in MISTAKES.items() for m in ms]

#: The layers whose mistakes are graded as a learner's are, the failing example shrunk: what
#: hypothesis shrinks to must still tell their mistakes apart (layer norm's rows of 3 or more,
#: a ReLU's input of both signs). The others skip the shrinking, most of the cost of a failure.
SHRUNK = {"linear", "relu", "layer_norm", "softmax", "attention", "residual_ffn"}


class _InProcess:
    """What :func:`attn.grader.grading.grade` asks of a sandbox, for functions of this process."""

    def begin_layer(self):
        pass

    def reset(self):
        pass


@contextlib.contextmanager
def _phases(phases):
    saved, grading.PHASES = grading.PHASES, phases
    try:
        yield
    finally:
        grading.PHASES = saved


def grade_in_process(layer: str, source: str, phases):
    """Grade ``source``'s functions of ``layer`` in this process, hypothesis in ``phases``: the Result."""
    names: dict = {}
    exec(compile(textwrap.dedent(source), "mine.py", "exec"), names)
    impl = {n: names[n] for n in LAYERS[layer].functions if n in names}
    forward = impl.get(LAYERS[layer].functions[0])
    drop = ()                           # a forward without dropout (the starters before lesson 12'), as the grader
    if layer in DROPOUT_PROBES and layer != "dropout" and "dropout" not in inspect.signature(forward).parameters:
        drop = ("dropout", "rng")
    with warnings.catch_warnings(), np.errstate(all="ignore"), _phases(phases):
        warnings.simplefilter("ignore")                             # a wrong layer's overflow is no news
        return grading.grade(LAYERS[layer], impl, _InProcess(), drop=drop)


def _grade_here(layer: str, source: str) -> tuple[str, str]:
    """Grade ``source``'s functions of ``layer`` in this process: (the status, the report at hint 2)."""
    r = grade_in_process(layer, source, grading.PHASES if layer in SHRUNK else grading.PHASES[:-1])
    out = io.StringIO()
    report(r, out, 2)
    return r.status, out.getvalue()


def _grade(path, *argv) -> tuple[int, str]:
    saved = (B._current, B._xp, B.cupy_modules)
    out = io.StringIO()
    try:
        rc = cli.main([str(path), *argv], out=out)
    finally:
        B._current, B._xp, B.cupy_modules = saved
    return rc, out.getvalue()


def _line(report: str, key: str) -> str:
    m = re.search(rf"^\s+{key}\s*(.*)$", report, re.M)
    return m.group(1) if m else ""


def exercised() -> set:
    """The layers whose functions some exercise asks for."""
    asked = {name for m in EXERCISES.values() for name in m.asks}
    return {layer.name for layer in LAYERS.values() if asked & set(layer.functions)}


def test_every_exercised_layer_has_three_mistakes_or_more():
    few = {name: len(MISTAKES.get(name, ())) for name in sorted(exercised()) if len(MISTAKES.get(name, ())) < 3}
    assert not few, f"exercised layers with fewer than three typical mistakes in tests/typical_mistakes.py: {few}"


@pytest.mark.parametrize("layer, mistake, source, looks_like, look_at", CASES,
                         ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_each_mistake_gets_its_own_hint(layer, mistake, source, looks_like, look_at):
    status, text = _grade_here(layer, source)
    assert status == "fail", f"{mistake}: not caught:\n{text}"
    said = _line(text, "check:") + " | " + _line(text, "looks like:")         # what hint 1 shows
    assert re.search(looks_like, said), f"{mistake}: hint 1 misses it:\n{text}"
    assert re.search(look_at, _line(text, "look at:")), f"{mistake}: hint 2 misses it:\n{text}"


def test_a_composite_whose_part_failed_points_at_the_part(tmp_path):
    """The file's own layer norm drops the variance term, and residual_ffn uses it: hint 2 of
    residual_ffn points at the norm, not at the skip path it got right."""
    path = tmp_path / "07_feed_forward_layer_norm.py"
    own_norm = NORM.replace("{name}", "layer_norm_backward").format(dx=NO_VAR)
    path.write_text("from attn.layers import feed_forward_backward, feed_forward_forward, layer_norm_forward\n"
                    + own_norm + textwrap.dedent('''

        def residual_ffn_forward(x, w1, b1, w2, b2, gamma, beta, eps=1e-5):
            f, cf = feed_forward_forward(x, w1, b1, w2, b2)
            out, cn = layer_norm_forward(x + f, gamma, beta, eps)
            return out, (cf, cn)


        def residual_ffn_backward(dout, cache):
            cf, cn = cache
            dz, dgamma, dbeta = layer_norm_backward(dout, cn)
            dx_ffn, dw1, db1, dw2, db2 = feed_forward_backward(dz, cf)
            return dz + dx_ffn, dw1, db1, dw2, db2, dgamma, dbeta
        '''), encoding="utf-8")
    rc, report = _grade(path, "--layer", "layer_norm", "--layer", "residual_ffn", "--hint", "2",
                        "--allow-library")
    assert rc == 1, report
    residual = report[report.index("residual_ffn "):]
    look = _line(residual, "look at:")
    assert "two paths" not in look and look.startswith("layer_norm first"), residual
    assert "rstd = 1/sqrt" in look, residual

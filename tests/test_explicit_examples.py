"""Every layer's explicit examples (:mod:`attn.testing.explicit`, named by its registration)
catch every typical mistake of ``tests/typical_mistakes.py`` on their own: graded with them
alone, hypothesis drawing nothing, each mistake fails. What a grade catches then does not rest
on hypothesis's search, which changes from one version of hypothesis to the next."""
from __future__ import annotations

import contextlib
import inspect
import textwrap
import warnings

import numpy as np
import pytest
from hypothesis import Phase

from attn.grader import grading
from attn.testing import DROPOUT_PROBES, LAYERS, Example
from typical_mistakes import MISTAKES

CASES = [(layer, *m) for layer, ms in MISTAKES.items() for m in ms]


class _InProcess:
    def begin_layer(self):
        pass

    def reset(self):
        pass


@contextlib.contextmanager
def explicit_only():
    """Grading with the explicit examples alone: no draw, no shrinking, nothing drawn before."""
    saved = grading.PHASES, grading.DRAWN
    grading.PHASES, grading.DRAWN = (Phase.explicit,), {}
    try:
        yield
    finally:
        grading.PHASES, grading.DRAWN = saved


def grade_explicit(layer: str, source: str):
    names: dict = {}
    exec(compile(textwrap.dedent(source), "mine.py", "exec"), names)
    impl = {n: names[n] for n in LAYERS[layer].functions if n in names}
    forward = impl.get(LAYERS[layer].functions[0])
    drop = ()
    if layer in DROPOUT_PROBES and layer != "dropout" and "dropout" not in inspect.signature(forward).parameters:
        drop = ("dropout", "rng")
    with warnings.catch_warnings(), np.errstate(all="ignore"), explicit_only():
        warnings.simplefilter("ignore")
        return grading.grade(LAYERS[layer], impl, _InProcess(), drop=drop)


def test_every_layer_has_explicit_examples():
    bare = [name for name, layer in LAYERS.items() if not layer.explicit]
    assert not bare, f"layers without explicit examples: {bare}"
    for layer in LAYERS.values():
        assert all(isinstance(ex, Example) for ex in layer.explicit), layer.name


@pytest.mark.parametrize("layer, mistake, source, looks_like, look_at", CASES,
                         ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_the_explicit_examples_alone_catch_each_mistake(layer, mistake, source, looks_like, look_at):
    r = grade_explicit(layer, source)
    assert r.status == "fail", f"{layer}: {mistake}: not caught by the explicit examples"
    assert r.detail.check != "attn-check", f"{layer}: {mistake}: {r.detail.message}"     # the grader's own error

"""Every layer's explicit examples (:mod:`attn.testing.explicit`, named by its registration)
catch every typical mistake of ``tests/typical_mistakes.py`` on their own: graded with them
alone, hypothesis drawing nothing, each mistake fails. What a grade catches then does not rest
on hypothesis's search, which changes from one version of hypothesis to the next."""
from __future__ import annotations

import contextlib

import pytest
from hypothesis import Phase

from attn.grader import grading
from attn.testing import LAYERS, Example
from test_hints import grade_in_process
from typical_mistakes import MISTAKES

CASES = [(layer, *m) for layer, ms in MISTAKES.items() for m in ms]


@contextlib.contextmanager
def nothing_drawn_before():
    saved, grading.DRAWN = grading.DRAWN, {}
    try:
        yield
    finally:
        grading.DRAWN = saved


def grade_explicit(layer: str, source: str):
    """Grading with the explicit examples alone: no draw, no shrinking, nothing drawn before."""
    with nothing_drawn_before():
        return grade_in_process(layer, source, (Phase.explicit,))


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

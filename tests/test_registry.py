"""The layer registry (attn/testing/registry.py), read as the tests read it: every registered
forward/backward pair of the library passes its own registration (float64 gradients against
central differences on its examples, its invariants) on every backend, and the registry is
whole (each name is where it says, each manifest asks for registered names, each starter has
a manifest)."""
from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings

import attn.backend as B
from attn.testing import EXERCISES, LAYERS, XP, Example, Fresh, InvariantError, check_gradients

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [name for name, layer in LAYERS.items() if layer.kind == "pair" and layer.library.startswith("attn.layers")]


def _library(layer) -> tuple:
    module = importlib.import_module(layer.library)
    return tuple(getattr(module, f) for f in layer.functions)


def _resolved(value):
    """An example's argument for one call: a new DeviceRNG for :class:`Fresh` (the same mask at
    every call of a gradient check), the namespace for XP, a device copy of a host array."""
    if isinstance(value, Fresh):
        return B.DeviceRNG(value.seed)
    if value is XP:
        return B.xp()
    return B.to_device(value.copy()) if isinstance(value, np.ndarray) else value


@pytest.mark.parametrize("name", PAIRS)
def test_a_registered_layer_passes_its_registration(backend, name):
    layer = LAYERS[name]
    forward, backward = _library(layer)
    functions = dict(zip(layer.functions, (forward, backward)))
    checked = []

    @settings(max_examples=4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(ex=layer.examples)
    def check(ex):
        if layer.invariants is not None:
            layer.invariants(functions, ex)
        if not ex.gradcheck:
            return
        args = {k: v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v
                for k, v in ex.args if not k.startswith("_")}              # "_name": for the invariants only
        fresh = {k for k, v in args.items() if isinstance(v, (Fresh, type(XP)))}
        device = {k: v if k in fresh else _resolved(v) for k, v in args.items()}
        check_gradients(name, lambda **a: forward(**{k: _resolved(v) if k in fresh else v for k, v in a.items()}),
                        backward, device, ex.wrt, tol=1e-4, seed=ex.seed)   # near-flat rows: noisy differences
        checked.append(ex)
    for ex in layer.explicit:                      # the grader's explicit examples: the library passes them too
        check = example(ex=ex)(check)
    check()
    assert checked, f"no example of {name} checked its gradients"


def test_every_registered_name_is_where_its_registration_says():
    for layer in LAYERS.values():
        module = importlib.import_module(layer.library)
        assert all(callable(getattr(module, f, None)) for f in layer.functions), layer.name
        assert set(layer.where) <= set(layer.hints) | set(layer.where), layer.name


def test_the_books_api_page_is_written_from_the_registry():
    from attn.site.book import api_layers_page
    text = (ROOT / "book" / "api" / "layers.md").read_text(encoding="utf-8")
    assert api_layers_page(text) == text, "book/api/layers.md is stale: python -m attn.site.book rewrites it"


def test_every_manifest_asks_for_registered_names_and_every_starter_has_one():
    registered = {f for layer in LAYERS.values() for f in layer.functions}
    for manifest in EXERCISES.values():
        assert set(manifest.asks) <= registered, manifest.name
    starters = {p.stem for p in (ROOT / "lessons" / "exercises").glob("*.py")}
    assert starters == set(EXERCISES)


def test_rmsnorms_invariants_catch_a_layer_norm_in_its_place():
    """RMSNorm's registration fails what is not RMSNorm: a row's mean subtracted first."""
    layer = LAYERS["rmsnorm"]
    forward, backward = _library(layer)

    def centred(x, gamma, eps=1e-6):
        return forward(x - x.mean(axis=-1, keepdims=True), gamma, eps)
    ex = Example((("x", np.array([[1.0, 2.0, 4.0], [0.5, -1.0, 3.0]])), ("gamma", np.ones(3)), ("eps", 1e-6)),
                 ("x", "gamma"))
    with pytest.raises(InvariantError, match="scaling a row|mean square"):
        layer.invariants({"rmsnorm_forward": centred, "rmsnorm_backward": backward}, ex)

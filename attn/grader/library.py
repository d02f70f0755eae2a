"""The library's answers, on the grader's side: where each gradable name's own
implementation lives, and what a child may load for each exercise's manifest (the manifests
and the layers are registered in :mod:`attn.testing.registry`).

The child never imports this module: it is told, at its start, which of the library's
modules it may load and which names it must withhold (:mod:`attn.grader.child`)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

from ..testing.registry import EXERCISES, LAYERS, Manifest
from .wire import Handle  # noqa: F401  (the checks name it from here)

#: Where the library's own implementation of each gradable name lives ("module:function"), as
#: each layer's registration (:mod:`attn.testing.registry`) says.
LIBRARY = {f: f"{layer.library}:{f}" for layer in LAYERS.values() for f in layer.functions}
LIBRARY["decoding_model"] = "attn.grader.built:decoding_model"
#: Names the grader builds arguments with (``given`` calls), never looked for in a learner's file.
GIVEN_ONLY = {"decoding_model"}

#: Modules that hold, besides a gradable name's own function, the larger thing that answers
#: it (a Transformer's encoder layer, Adam's step, the searches): never loaded in a child
#: that is graded on that name.
ANSWERED_IN = {
    "encoder_layer_forward": ("attn.model", "attn.fast"), "encoder_layer_backward": ("attn.model", "attn.fast"),
    "decoder_layer_forward": ("attn.model", "attn.fast"), "decoder_layer_backward": ("attn.model", "attn.fast"),
    "transformer_forward": ("attn.model", "attn.fast"), "transformer_backward": ("attn.model", "attn.fast"),
    "decoder_only_layer_forward": ("attn.model", "attn.fast"),
    "decoder_only_layer_backward": ("attn.model", "attn.fast"),
    "adam_step": ("attn.optim",), "greedy_decode": ("attn.decode",), "beam_search": ("attn.decode",),
    "average_checkpoints": ("attn.train", "attn.training"),
}

#: The modules a file with no manifest may import besides attn.backend.
DEFAULT_GIVES = ("attn.layers", "attn.masks", "attn.loss")


def manifest_for(path: Path, exercise: str | None = None) -> Manifest | None:
    """The manifest of ``exercise``, or of the starter whose name ``path`` has; None for a
    file of another name (graded on what it defines)."""
    if exercise:
        return EXERCISES[exercise]
    return EXERCISES.get(Path(path).stem)


def bound_names(source: str) -> set:
    """The gradable names a file binds at its top level in any way (``def``, ``class``, an
    assignment, an import, a loop or ``with`` target, ``:=``, a ``global`` in a function; in
    an ``if``, ``try`` or loop block too), read from its syntax, never run here: every one is
    withheld from the library in its child."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            names |= {n for g in ast.walk(node) if isinstance(g, (ast.Global, ast.Nonlocal)) for n in g.names}
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.MatchAs) and node.name or isinstance(node, ast.MatchStar) and node.name:
            names.add(node.name)
        todo.extend(ast.iter_child_nodes(node))
    return names & set(LIBRARY)


def child_policy(manifest: Manifest | None, source: str, allow_library: bool) -> dict:
    """What the child may load: ``gives`` (modules importable besides attn.backend),
    ``withhold`` (names removed from them: those it asks for, and those that would answer
    them, the grouped-query exercise's multi-head attention with ``kv_heads``, for a file of
    another name as for every exercise asking for what it defines), ``block`` (modules never loaded), ``forwards``
    (the given forwards the grader may ask it to run)."""
    if allow_library:
        return {"gives": ["*"], "withhold": [], "answering": [], "block": [], "forwards": ["*"]}
    asks = set(manifest.asks) if manifest else bound_names(source)
    gives = list(manifest.gives) if manifest else list(DEFAULT_GIVES)
    block = sorted({m for n in asks for m in ANSWERED_IN.get(n, ())})
    forwards = list(manifest.given_forwards) if manifest else []
    if manifest and manifest.name == "decoding":
        forwards.append("decoding_model")
    answers = [manifest] if manifest else [m for m in EXERCISES.values() if asks & set(m.asks)]
    withhold = asks | {n for m in answers for n in m.withholds}
    return {"gives": gives, "withhold": sorted(withhold), "answering": sorted(withhold - asks), "block": block,
            "forwards": forwards}


def library_function(name: str):
    """The library's own function called ``name`` (the solution attn-check grades against)."""
    module, attr = LIBRARY[name].split(":")
    return getattr(importlib.import_module(module), attr)


def reference(layer: str) -> tuple:
    """The library's functions of a layer, in the order of ``LAYERS[layer].functions``."""
    return tuple(library_function(n) for n in LAYERS[layer].functions)


def is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim") and not isinstance(a, type)

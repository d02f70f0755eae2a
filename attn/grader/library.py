"""The library's answers, on the grader's side: where each gradable name's own
implementation lives, and each exercise's manifest (what it asks for, what it gives).

The child never imports this module: it is told, at its start, which of the library's
modules it may load and which names it must withhold (:mod:`attn.grader.child`)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import NamedTuple

from .wire import Handle  # noqa: F401  (the checks name it from here)

#: Where the library's own implementation of each gradable name lives ("module:function").
LIBRARY = {n: f"attn.layers:{n}" for n in (
    "linear_forward", "linear_backward", "relu_forward", "relu_backward", "dropout_forward",
    "dropout_backward", "embedding_forward", "embedding_backward", "positional_forward",
    "positional_backward", "sinusoidal_table", "softmax_forward", "softmax_backward",
    "layer_norm_forward", "layer_norm_backward", "feed_forward_forward", "feed_forward_backward",
    "residual_ffn_forward", "residual_ffn_backward", "attention_forward", "attention_backward",
    "split_heads", "merge_heads", "multi_head_attention_forward", "multi_head_attention_backward",
    "rnn_step_forward", "rnn_step_backward", "rnn_forward", "rnn_backward")}
LIBRARY.update({"cross_entropy": "attn.loss:cross_entropy", "causal_mask": "attn.masks:causal_mask",
                "padding_mask": "attn.masks:padding_mask", "decoder_mask": "attn.masks:decoder_mask"})
LIBRARY.update({n: f"attn.grader.solutions:{n}" for n in (
    "luong_attention_forward", "luong_attention_backward", "encoder_layer_forward", "encoder_layer_backward",
    "decoder_layer_forward", "decoder_layer_backward", "transformer_forward", "transformer_backward",
    "adam_step", "greedy_decode", "beam_search", "average_checkpoints", "learn_merges")})
LIBRARY["noam_lr"] = "attn.optim:noam_lr"
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
    "adam_step": ("attn.optim",), "greedy_decode": ("attn.decode",), "beam_search": ("attn.decode",),
    "average_checkpoints": ("attn.train", "attn.training"),
}

#: The modules a file with no manifest may import besides attn.backend.
DEFAULT_GIVES = ("attn.layers", "attn.masks", "attn.loss")


class Manifest(NamedTuple):
    """One exercise: the functions its starter asks for, in its order, the library modules
    its file may import (what it gives; the names it asks for withheld from them), and the
    forwards it gives (used, not graded, with the learner's backward)."""
    name: str
    asks: tuple
    gives: tuple = ()
    given_forwards: tuple = ()


EXERCISES = {m.name: m for m in (
    Manifest("01_seq2seq", ("linear_forward", "linear_backward", "embedding_forward", "embedding_backward",
                            "rnn_step_forward", "rnn_step_backward", "rnn_forward", "rnn_backward")),
    Manifest("03_positional_encoding", ("sinusoidal_table", "positional_forward", "positional_backward")),
    Manifest("04_attention", ("softmax_forward", "softmax_backward", "attention_forward", "attention_backward")),
    Manifest("05_masks", ("padding_mask", "causal_mask", "decoder_mask")),
    Manifest("06_multi_head_attention", ("split_heads", "merge_heads", "multi_head_attention_forward",
                                         "multi_head_attention_backward"), ("attn.layers",)),
    Manifest("07_feed_forward_layer_norm", ("relu_forward", "relu_backward", "feed_forward_forward",
                                            "feed_forward_backward", "layer_norm_forward", "layer_norm_backward",
                                            "residual_ffn_forward", "residual_ffn_backward"), ("attn.layers",)),
    Manifest("08_backprop_by_hand", ("softmax_backward", "layer_norm_backward", "attention_backward"),
             ("attn.layers",), ("softmax_forward", "layer_norm_forward", "attention_forward")),
    Manifest("11_training_recipe", ("cross_entropy", "noam_lr", "adam_step")),
    Manifest("12_dropout", ("dropout_forward", "dropout_backward")),
    Manifest("bpe", ("learn_merges",), ("attn.bpe",)),
    Manifest("decoding", ("greedy_decode", "beam_search", "average_checkpoints"), ("attn.masks", "attn.model")),
    Manifest("luong_attention", ("luong_attention_forward", "luong_attention_backward"), ("attn.layers",)),
    Manifest("the_whole_model", ("encoder_layer_forward", "encoder_layer_backward", "decoder_layer_forward",
                                 "decoder_layer_backward", "transformer_forward", "transformer_backward"),
             ("attn.layers", "attn.masks")),
)}


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
    ``withhold`` (names removed from them), ``block`` (modules never loaded), ``forwards``
    (the given forwards the grader may ask it to run)."""
    if allow_library:
        return {"gives": ["*"], "withhold": [], "block": [], "forwards": ["*"]}
    asks = set(manifest.asks) if manifest else bound_names(source)
    gives = list(manifest.gives) if manifest else list(DEFAULT_GIVES)
    block = sorted({m for n in asks for m in ANSWERED_IN.get(n, ())})
    forwards = list(manifest.given_forwards) if manifest else []
    if manifest and manifest.name == "decoding":
        forwards.append("decoding_model")
    return {"gives": gives, "withhold": sorted(asks), "block": block, "forwards": forwards}


def library_function(name: str):
    """The library's own function called ``name`` (the solution attn-check grades against)."""
    module, attr = LIBRARY[name].split(":")
    return getattr(importlib.import_module(module), attr)


def is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim") and not isinstance(a, type)

"""attn.engine: the interface the trainer and the searches talk to, its two engines, and the
course reading alone (the readable engine trains, decodes and checkpoints without attn.fast)."""
from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attn import backend as B
from attn import engine as engines
from attn.checkpoint import load_npz
from attn.masks import padding_mask
from attn.model import Transformer, TransformerConfig
from attn.precision import Precision, PrecisionError
from attn.train import train
from attn.training.config import config_from_argv
from test_train import TINY, write_corpus

ROOT = Path(__file__).resolve().parents[1]
CFG = TransformerConfig(vocab_size=19, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                        dropout=0.0, warmup_steps=4)


@pytest.fixture(autouse=True)
def _numpy_backend():
    B.set_backend("numpy")
    yield


def test_both_engines_are_found_by_name_and_an_unknown_one_is_named():
    assert {"fast", "reference"} <= set(engines.names())
    assert engines.get("reference").name == "reference" and engines.get("fast").name == "fast"
    with pytest.raises(engines.EngineError, match="no engine named 'turbo'.*fast, reference"):
        engines.get("turbo")


@pytest.mark.parametrize("name", ["reference", "fast"])
def test_an_engine_makes_what_the_interface_promises(name):
    """Model, optimizer and loss from one engine; the model answers every question the trainer,
    the data-parallel code and the searches ask (attn/engine.py's protocols)."""
    from attn.decode import BANNED, search_of
    engine = engines.get(name)
    model = engine.model(CFG, seed=3)
    opt = engine.optimizer(model, lr_factor=0.5)
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(3, 19, (2, 5)), rng.integers(3, 19, (2, 6))
    with engines.step_memory(model):
        logits, cache = model.forward(src, tgt[:, :-1])
        loss, d = engine.loss(trusted=True)(logits, tgt[:, 1:], 0.1)
        grads = model.backward(d, cache)
        opt.step(grads)
    assert set(grads) == set(model.params) and np.isfinite(float(loss))
    assert (engines.gradient_arena(model) is None) == (name == "reference")
    assert engines.keys_first(model) == (name == "fast") == isinstance(model, engines.Tuned)
    search, mask = search_of(model), src[:, None, None, :] != 0
    state = search.start(model.encode(src, None, mask)[0], mask, reserve=(2, 4))
    logp, state, _ = search.step(np.full(2, 2), state)
    info, tokens = np.empty((2, 2)), np.empty(2, dtype=np.int64)
    search.greedy_pick(logp.copy(), BANNED, info, tokens)
    assert (tokens == info[0]).all() and not set(tokens.tolist()) & set(BANNED)
    search.select(state, np.array([1, 0]), np.array([1, 0]))


def _fits(method, declared) -> list:
    """What keeps ``method`` from standing where the protocol declares ``declared``: the declared
    parameters first, by name, kind and default, then only parameters with defaults."""
    have = list(inspect.signature(method).parameters.values())
    want = list(inspect.signature(declared).parameters.values())
    problems = [f"parameter {i} is {h} where the protocol has {w}" for i, (h, w) in enumerate(zip(have, want))
                if (h.name, h.kind, h.default) != (w.name, w.kind, w.default)]
    problems += [f"lacks {w}" for w in want[len(have):]]
    problems += [f"{h} has no default" for h in have[len(want):] if h.default is h.empty and h.kind < h.VAR_POSITIONAL]
    return problems


def _protocol_methods(protocol) -> list:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")] + \
        [n for n, v in vars(protocol).items() if isinstance(v, property)]


@pytest.mark.parametrize("name", ["reference", "fast"])
def test_both_engines_satisfy_the_protocols_method_by_method(name):
    """Every method of :class:`attn.engine.Engine`, :class:`Model`, :class:`Search` and
    :class:`DecodingState` (a translator's state), with a
    signature that takes what the protocol gives; the fast model stands beside the readable one,
    not on it (no subclass either way), and is :class:`Tuned`."""
    from attn.decode import search_of
    from attn.fast import FastTransformer
    engine = engines.get(name)
    model = engine.model(CFG)
    src = B.to_device(np.asarray([[5, 6, 7]]))
    state = model.start_decoding(model.encode(src)[0], padding_mask(src))
    for protocol, obj in ((engines.Engine, engine), (engines.Model, model), (engines.Search, search_of(model)),
                          (engines.DecodingState, state)):
        for method in _protocol_methods(protocol):
            assert hasattr(obj, method), f"{type(obj).__name__} has no {method} ({protocol.__name__})"
            declared = vars(protocol)[method]
            if callable(declared):
                assert not _fits(getattr(obj, method), declared.__get__(obj)), \
                    (type(obj).__name__, method, _fits(getattr(obj, method), declared.__get__(obj)))
        for attribute in protocol.__annotations__:
            assert hasattr(obj, attribute), f"{type(obj).__name__} has no {attribute} ({protocol.__name__})"
    assert not issubclass(FastTransformer, Transformer) and not issubclass(Transformer, FastTransformer)
    assert not issubclass(type(engine), type(engines.get("fast" if name == "reference" else "reference")))
    assert isinstance(model, engines.Tuned) == (name == "fast")


def test_the_readable_model_carries_nothing_only_an_engine_asks():
    import attn.model as M
    engine_only = {"gradient_arena", "keys_first", "_decoding_params", "step_memory", "greedy_pick",
                   "beam_candidates", "search", "least_columns"}
    assert not engine_only & (set(vars(Transformer)) | set(vars(M)))
    assert list(inspect.signature(Transformer.decode).parameters) == ["self", "tgt_in", "memory", "src_mask", "rng"]
    assert list(inspect.signature(Transformer.start_decoding).parameters) == ["self", "memory", "src_mask"]
    assert list(inspect.signature(M.DecodeState.select).parameters) == ["self", "index"]


def test_precision_is_checked_once_and_kept_by_the_model():
    assert Precision.of("bf16") == Precision("bf16") and Precision.of(Precision("tf32")).name == "tf32"
    with pytest.raises(PrecisionError, match="fp32, tf32, bf16.*'fp16'"):
        Precision("fp16")
    with pytest.raises(engines.EngineError, match="precision bf16 is not one of the reference engine's"):
        engines.get("reference").model(CFG, precision=Precision("bf16"))
    fast = engines.get("fast").model(CFG, precision=Precision("bf16"))
    assert fast.precision == Precision("bf16") and not hasattr(type(fast), "precision")   # no setter


def test_the_same_weights_give_the_same_numbers_in_either_engine():
    ref = Transformer(CFG, seed=1, dtype="float64")
    fast = engines.get("fast").model(CFG, dtype="float64", params={k: v.copy() for k, v in ref.params.items()})
    src, tgt = np.array([[4, 5, 6, 0]]), np.array([[2, 7, 8]])
    np.testing.assert_allclose(fast.forward(src, tgt)[0], ref.forward(src, tgt)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("first,then", [("fast", "reference"), ("reference", "fast")])
def test_a_checkpoint_of_either_engine_resumes_in_the_other(tmp_path, first, then):
    """(A resumed run may change ``reference``: the engine that continues is the one asked for.)"""
    out, data = tmp_path / "run", write_corpus(tmp_path)
    common = ["--data", str(data), *TINY, "--backend", "numpy", "--eval-every", "3", "--out", str(out)]
    train(config_from_argv([*common, "--steps", "3", *(["--reference"] if first == "reference" else [])]))
    made = []
    real_get = engines.get
    import attn.training.prepare as P
    P.engines.get = lambda name: made.append(name) or real_get(name)
    try:
        config = dataclasses.replace(config_from_argv([*common, "--steps", "6", "--resume"]),
                                     reference=then == "reference")
        metrics = train(config, given={"steps", "resume", "out", "reference"})
    finally:
        P.engines.get = real_get
    arrays, meta = load_npz(out / "checkpoint.npz")
    assert made == [then] and meta["step"] == 6 and metrics["steps"] == 6


def test_the_course_trains_decodes_and_checkpoints_without_the_engine(tmp_path):
    """A run of the readable engine, its checkpoint and its translations, in a process in which
    nothing of attn.fast (nor of the tools) is ever imported."""
    data = write_corpus(Path(tmp_path))
    code = f"""
import sys
from attn.train import train
from attn.training.config import config_from_argv
from attn.translate import main as translate
m = train(config_from_argv({["--data", str(data), *TINY, "--backend", "numpy", "--reference", "--steps", "4",
                              "--out", str(tmp_path / "run")]!r}))
assert m["steps"] == 4, m
assert translate(["--checkpoint", {str(tmp_path / "run" / "checkpoint.npz")!r}, "the red cat sleeps"]) == 0
loaded = sorted(n for n in sys.modules if n.split(".")[:2] in
                (["attn", "fast"], ["attn", "bench"], ["attn", "grader"], ["attn", "site"], ["attn", "testing"]))
assert not loaded, loaded
print("alone")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("alone"), done.stderr[-3000:]

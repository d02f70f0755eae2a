"""attn.engine: the interface the trainer and the searches talk to, its two engines, and the
course reading alone (the readable engine trains, decodes and checkpoints without attn.fast)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attn import backend as B
from attn import engine as engines
from attn.checkpoint import load_npz
from attn.model import Transformer, TransformerConfig
from attn.precision import Precision, PrecisionError
from attn.train import config_from_argv, train
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
    the data-parallel code and the searches ask (attn/engine.py's list)."""
    engine = engines.get(name)
    model = engine.model(CFG, seed=3)
    opt = engine.optimizer(model, lr_factor=0.5)
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(3, 19, (2, 5)), rng.integers(3, 19, (2, 6))
    with model.step_memory():
        logits, cache = model.forward(src, tgt[:, :-1])
        loss, d = engine.loss(trusted=True)(logits, tgt[:, 1:], 0.1)
        grads = model.backward(d, cache)
        opt.step(grads)
    assert set(grads) == set(model.params) and np.isfinite(float(loss))
    assert (model.gradient_arena is None) == (name == "reference") and model.keys_first == (name == "fast")
    state = model.start_decoding(model.encode(src, None, src[:, None, None, :] != 0)[0],
                                 src[:, None, None, :] != 0, reserve=(2, 4))
    logp, state, _ = model.decode_step(np.full(2, 2), state)
    info, tokens = np.empty((2, 2)), np.empty(2, dtype=np.int64)
    model.greedy_pick(logp.copy(), (0, 2), info, tokens)
    assert (tokens == info[0]).all() and not set(tokens.tolist()) & {0, 2}
    state.select(np.array([1, 0]), np.array([1, 0]))


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
from attn.train import config_from_argv, train
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

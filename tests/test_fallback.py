"""The fallback (:mod:`attn.fast.gpu.fallback`), proven on the CuPy stand-in: each advanced feature of
the fast engine is probed at the start of a run against the plain CuPy path, and one that is
broken here on purpose is switched off with one line naming it, while the run trains on."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import attn.backend as B
from attn.fast.gpu import fallback, probe


@pytest.fixture
def probed(monkeypatch):
    """The stand-in selected, with the probes on (they run on a GPU only, else), and the switches
    put back after."""
    import fakecupy
    from conftest import selected_backend
    from attn.fast.gpu import cublas, stepmem
    monkeypatch.setattr(fallback, "ON_STAND_IN", True)
    monkeypatch.setattr(cublas, "DIRECT", True)
    monkeypatch.setattr(stepmem, "ENABLED", True)
    with selected_backend("fakecupy"):
        fakecupy.install()
        yield


def _config(tmp_path, *extra):
    from attn.training.config import config_from_argv
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(30)]
    (tmp_path / "pairs.tsv").write_text("\n".join("\t".join(" ".join(rng.choice(words, rng.integers(2, 8)))
                                                            for _ in range(2)) for _ in range(60)) + "\n")
    return config_from_argv(["--tsv", str(tmp_path / "pairs.tsv"), "--d-model", "8", "--heads", "2", "--d-ff", "16",
                             "--layers", "1", "--max-tokens", "64", "--minutes", "0", "--bleu-sentences", "0",
                             "--average", "0", "--backend", "cupy", "--steps", "2", "--eval-every", "1000",
                             "--out", str(tmp_path / "run"), "--quiet", *extra])


LATER = ("--norm-position", "pre", "--norm-kind", "rms", "--positional", "rope", "--ffn", "swiglu", "--kv-heads", "1")

#: Python run in the probe's child before its probes, breaking one feature there (the training
#: process is left whole: what breaks in the child is what the probes must find).
BREAKS = {
    "step memory": """
from attn.fast.gpu import stepmem
real = stepmem.StepMemory._planned
stepmem.StepMemory._planned = lambda self, size, n: (
    real(self, size, n) if self._mode is None or self._mode == "trace" else self._base)   # one address for all
""",
    "cuBLAS through ctypes": """
from attn.fast.gpu import cublas
def unloadable(xp):
    raise cublas.CublasError("attn.fast.gpu.cublas: cannot load libcublas (broken here)")
cublas.direct_cublas = unloadable
""",
    "captured step": """
from attn.fast.gpu import graph
def refused(*args, **kw):
    raise graph.CaptureError("CapturedStep: the capture is refused (broken here)")
graph.capture_step = refused
""",
    "bf16": """
from attn.fast.gpu.kernels import Bf16Products
real_mm = Bf16Products.mm
def off(self, a, b, out=None, accumulate=False):
    got = real_mm(self, a, b, out, accumulate)
    return self.xp.multiply(got, 1.5, out=got)                   # every bf16 product off by half
Bf16Products.mm = off
""",
    "fast engine": """
from attn.fast.gpu.kernels.registry import NUMPY_TWINS
real = NUMPY_TWINS["rms_norm_fwd"]
def off(launch, *args):
    real(launch, *args)
    args[2][...] *= 1.01                                          # RMSNorm's output 1 % off
NUMPY_TWINS["rms_norm_fwd"] = off
""",
    "tiled attention, dead": """
import os, signal
from attn.fast.core import flash
def dies(*args, **kw):
    os.kill(os.getpid(), signal.SIGSEGV)                         # the process dies in the kernel
flash.attend = dies
""",
    "tiled attention, sticky": """
import fakecupy.kernels as K
from attn.fast.core import flash
sticky = []
real_call = K.RawKernel.__call__
def launch(self, *args, **kw):
    if sticky:
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    return real_call(self, *args, **kw)
K.RawKernel.__call__ = launch
real_attend = flash.attend
def poisons(*args, **kw):
    sticky.append(True)                                         # every launch after this one fails
    return real_attend(*args, **kw)
flash.attend = poisons
""",
}


def _break_in_child(tmp_path, monkeypatch, broken: str) -> None:
    script = tmp_path / "probe_child.py"
    script.write_text("import sys\n" + BREAKS[broken] + "\nfrom attn.fast.gpu.probe import main\nsys.exit(main())\n")
    monkeypatch.setattr(fallback, "CHILD", [sys.executable, str(script)])


def test_every_feature_passes_its_probe_on_the_stand_in(probed, tmp_path, monkeypatch):
    """The later block (RMSNorm, rotary positions, SwiGLU, one key/value head), the tiled attention,
    the captured step and bf16 all probed, each in the child, none switched off; the request names
    every part of the run's block."""
    said, children = [], []
    real = fallback._one_child
    monkeypatch.setattr(fallback, "_one_child", lambda request, decided: children.append(request) or
                        real(request, decided))
    config = _config(tmp_path, "--cuda-graph", "--precision", "bf16", "--attention", "flash", *LATER)
    assert fallback.settle(config, said.append) == config and not said
    assert len(children) == 1 and children[0]["block"] == {
        "positional": "rope", "norm_position": "pre", "norm_kind": "rms", "ffn": "swiglu", "rope_base": 10000.0,
        "share_embeddings": True, "attention_dropout": 0.0, "grouped": True, "multi_query": True}
    assert fallback.asked(children[0]) == list(probe.ORDER)


def test_the_probes_weights_look_trained_and_the_tolerance_follows_the_precision():
    """The probe's model is not flat: its most likely token has a mean probability over one half
    (drawn weights alone give about one in four); each precision's tolerance is 4 units of
    roundoff of its products' inputs."""
    from attn.model import Transformer
    cfg = probe.probe_config(dropout=0.0)
    batch = probe.batches(1)[0]
    with _numpy():
        logits, _ = Transformer(cfg, params=probe.trained_looking(cfg)).forward(batch.src, batch.tgt_in)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    assert (p / p.sum(-1, keepdims=True)).max(-1).mean() > 0.5
    assert probe.tolerance("bf16") == 4 * 2.0 ** -8 and probe.tolerance("tf32") == 4 * 2.0 ** -11
    assert probe.tolerance("bf16", "grads") == 32 * 2.0 ** -8 and probe.tolerance("fp32") == 1e-5


@pytest.mark.parametrize("block", [None, {"positional": "rope", "norm_position": "pre", "norm_kind": "rms", "ffn": "swiglu",
                                          "grouped": True}])
def test_a_right_narrowed_step_is_within_the_tolerance_and_a_wrong_one_outside(probed, block, monkeypatch):
    """bf16 and tf32 against fp32 on the probe model: the loss and the gradients within their
    tolerance (the ratios printed); every bf16 product off by half, far outside."""
    from attn.fast.gpu.kernels import Bf16Products
    from attn.precision import Precision
    cfg = probe.probe_config(block, dropout=0.0)
    weights = probe.trained_looking(cfg)
    loss, grads = probe.one_step(cfg, weights, "fp32")
    for precision in ("bf16", "tf32"):
        got, dgot = probe.one_step(cfg, weights, precision)
        u = 2.0 ** -(Precision.of(precision).mantissa_bits + 1)
        ratios = abs(got - loss) / abs(loss) / u, np.linalg.norm(dgot - grads) / np.linalg.norm(grads) / u
        print(f"{precision}: loss {ratios[0]:.3g} u, gradients {ratios[1]:.3g} u")
        assert ratios[0] <= probe.UNITS["loss"] / 2 and ratios[1] <= probe.UNITS["grads"] / 2, ratios
        assert probe.precision_disagreement(cfg, weights, precision) is None
    real_mm = Bf16Products.mm
    monkeypatch.setattr(Bf16Products, "mm", lambda self, a, b, out=None, accumulate=False: (
        self.xp.multiply(real_mm(self, a, b, out, accumulate), 1.5, out=real_mm(self, a, b, out, accumulate))))
    assert "fp32's" in probe.precision_disagreement(cfg, weights, "bf16")


def _numpy():
    from conftest import selected_backend
    return selected_backend("numpy")


@pytest.mark.parametrize("broken, off", [
    ("step memory", ["step memory", "captured step"]),
    ("cuBLAS through ctypes", ["cuBLAS through ctypes", "captured step"]),
    ("captured step", ["captured step"]),
    ("bf16", ["--precision bf16"]),
    ("tiled attention, dead", ["the tiled attention (--attention plain instead)"]),
    ("tiled attention, sticky", ["the tiled attention (--attention plain instead)"]),
])
def test_a_feature_that_fails_its_probe_is_switched_off_and_the_run_trains(probed, tmp_path, monkeypatch, capsys,
                                                                          broken, off):
    """Each feature broken in turn in the probe's child: the step memory serving every request at
    one address (wrong losses), the ctypes cuBLAS unloadable, a capture refused, bf16 products off
    by half, the tiled attention killing the process (a signal) or leaving a sticky CUDA error
    that fails every launch after it. The run says which feature is off and why, and trains to its
    last step without it; after a sticky error the features probed after it, in a fresh child,
    stay on."""
    from attn.train import train
    _break_in_child(tmp_path, monkeypatch, broken)
    extra = {"bf16": ("--precision", "bf16")}.get(broken, ("--cuda-graph",))
    if broken.startswith("tiled"):
        extra = ("--attention", "flash", "--cuda-graph", "--precision", "bf16")
    metrics = train(_config(tmp_path, *extra))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "is switched off for this run" in ln]
    assert [ln.split(" is switched off")[0] for ln in lines] == [f"attn-train: {name}" for name in off], err
    assert metrics["steps"] == 2 and np.isfinite(metrics["val_loss"]) and metrics["backend"] == "cupy"
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["steps"] == 2
    if broken == "tiled attention, dead":
        assert "died of signal 11" in lines[0], lines
    if broken == "tiled attention, sticky":
        assert "cudaErrorIllegalAddress" in lines[0], lines


def test_a_fast_engine_that_fails_its_probe_leaves_the_readable_model_to_train(probed, tmp_path, monkeypatch,
                                                                               capsys):
    """RMSNorm's kernel 1 % off in the child: the fast engine's plain path disagrees with the
    readable model there, so the run trains the readable model (--reference) and says so."""
    from attn.train import train
    _break_in_child(tmp_path, monkeypatch, "fast engine")
    metrics = train(_config(tmp_path, *LATER))
    err = capsys.readouterr().err
    assert "attn-train: the fast engine is switched off for this run" in err and "(--reference)" in err, err
    assert metrics["steps"] == 2 and np.isfinite(metrics["val_loss"]) and metrics["backend"] == "cupy"


def test_the_reference_model_trains_on_cupy(probed, tmp_path, capsys):
    """``attn-train --backend cupy --reference``: the readable model, the last resort, which needs
    none of the fast engine's features (nothing is probed), trains on the device."""
    from attn.train import main
    _config(tmp_path)                                                # the corpus
    assert main(["--tsv", str(tmp_path / "pairs.tsv"), "--d-model", "8", "--heads", "2", "--d-ff", "16", "--layers",
                 "1", "--max-tokens", "64", "--minutes", "0", "--bleu-sentences", "0", "--average", "0", "--backend",
                 "cupy", "--steps", "2", "--eval-every", "1000", "--out", str(tmp_path / "ref"), "--quiet",
                 "--reference"]) == 0
    saved = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    assert saved["steps"] == 2 and saved["backend"] == "cupy" and "switched off" not in capsys.readouterr().err

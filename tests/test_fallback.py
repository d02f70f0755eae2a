"""The fallback (:mod:`attn.fast.fallback`), proven on the CuPy stand-in: each advanced feature of
the fast engine is probed at the start of a run against the plain CuPy path, and one that is
broken here on purpose is switched off with one line naming it, while the run trains on."""
from __future__ import annotations

import json

import numpy as np
import pytest

from attn.fast import fallback


@pytest.fixture
def probed(monkeypatch):
    """The stand-in selected, with the probes on (they run on a GPU only, else), and the switches
    put back after."""
    import fakecupy
    from conftest import selected_backend
    from attn.fast import cublas, stepmem
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


def test_every_feature_passes_its_probe_on_the_stand_in(probed, tmp_path):
    said = []
    config = _config(tmp_path, "--cuda-graph", "--precision", "bf16")
    assert fallback.settle(config, said.append) == config and not said


@pytest.mark.parametrize("broken", ["step memory", "cuBLAS through ctypes", "captured step", "bf16"])
def test_a_feature_that_fails_its_probe_is_switched_off_and_the_run_trains(probed, tmp_path, monkeypatch, capsys,
                                                                          broken):
    """Each feature broken in turn: the step memory serving every request at one address (wrong
    losses), the ctypes cuBLAS unloadable, a capture refused, bf16 products off by a factor. The
    run says which feature is off and why, and trains to its last step without it."""
    from attn.fast import cublas, stepmem
    from attn.fast import graph
    from attn.fast.kernels import Bf16CupyOps
    from attn.train import train
    if broken == "step memory":
        real = stepmem.StepMemory._planned
        monkeypatch.setattr(stepmem.StepMemory, "_planned", lambda self, size, n: (
            real(self, size, n) if self._mode is None or self._mode == "trace" else self._base))
    elif broken == "cuBLAS through ctypes":
        def unloadable(xp):
            raise cublas.CublasError("attn.fast.cublas: cannot load libcublas (broken here)")
        monkeypatch.setattr(cublas, "direct_cublas", unloadable)
    elif broken == "captured step":
        def refused(*args, **kw):
            raise graph.CaptureError("CapturedStep: the capture is refused (broken here)")
        monkeypatch.setattr(graph, "_capture", refused)
    else:
        real_mm = Bf16CupyOps.mm
        monkeypatch.setattr(Bf16CupyOps, "mm", lambda self, a, b, out=None, accumulate=False: (
            self.xp.multiply(real_mm(self, a, b, out, accumulate), 1.5, out=real_mm(self, a, b, out, accumulate))))
    metrics = train(_config(tmp_path, *(("--precision", "bf16") if broken == "bf16" else ("--cuda-graph",))))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "is switched off for this run" in ln]
    name = {"bf16": "--precision bf16"}.get(broken, broken)
    assert lines and lines[0].startswith(f"attn-train: {name} is switched off"), err
    assert metrics["steps"] == 2 and np.isfinite(metrics["val_loss"]) and metrics["backend"] == "cupy"
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["steps"] == 2
    if broken in ("step memory", "cuBLAS through ctypes"):       # and what needs it, with it
        assert any(ln.startswith("attn-train: captured step is switched off") for ln in lines), lines


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

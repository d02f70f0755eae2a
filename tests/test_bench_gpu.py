"""The benchmark's GPU paths, on the CuPy stand-in (a GPU run proves the timings themselves).

* The matmul replay is drawn lazily, on the device, and only in the attn worker: the PyTorch
  worker builds PyTorch's side alone (on ``base`` each worker took over a minute to draw
  gigabytes of host normals it never used).
* On CuPy the per-phase profile takes CUDA events (the host clock only times the issuing of
  work on a GPU) and waits once, for the last event.
* PyTorch's float32 products are set to attn's precision.
"""
from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest

import attn.backend as B
from attn.bench import flops, work as W
from attn.bench.presets import BENCH_PRESETS


def _quick_work(backend="numpy", **kw):
    return {w.name: w for w in W.build_work(BENCH_PRESETS["quick"], ["train_step", "forward", "greedy_cached"],
                                            backend, False, lambda: None, lambda: None, "cpu", **kw)}


def test_the_replay_is_drawn_at_its_first_run(monkeypatch):
    drawn = []
    real = flops._Replay.build
    monkeypatch.setattr(flops._Replay, "build", lambda self: drawn.append(self) or real(self))
    from conftest import selected_backend
    with selected_backend("numpy"):
        work = _quick_work()
        assert not drawn and not work["train_step"].replay.built
        work["train_step"].replay()
        assert len(drawn) == 1 and work["train_step"].replay.built
        work["train_step"].replay()
        assert len(drawn) == 1


def test_a_worker_builds_its_own_side_alone(monkeypatch):
    """The PyTorch side's worker (and memory child) gets no attn model and no replay; attn's
    readable model is built only where a ``_reference`` measurement is asked for."""
    from conftest import selected_backend
    from attn.model import Transformer
    built = []
    monkeypatch.setattr(W, "Transformer", lambda *a, **k: built.append(a) or Transformer(*a, **k))
    with selected_backend("numpy"):
        mine = _quick_work(with_ours=False)
        assert not built
        assert all(w.ours is None and w.replay is None for w in mine.values())
        assert "ours" not in mine["train_step"].phases
        _quick_work()
        assert not built                            # the fast model is the engine's own, no readable one
        W.build_work(BENCH_PRESETS["quick"], ["train_step_reference"], "numpy", False, lambda: None)
        assert len(built) == 1


def test_the_workers_ask_for_their_side(monkeypatch, capsys):
    """``worker_main``: the torch worker builds with ``with_ours=False``, the attn worker with it."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e .[ref])")
    from attn.bench import isolated
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)     # this process's threads stay
    seen = []
    monkeypatch.setattr(W, "build_work", lambda *a, **k: seen.append(k.get("with_ours", True)) or [])
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    for framework in ("torch", "attn"):
        args = SimpleNamespace(_worker=framework, backend="numpy", threads=1, return_freed_memory=True,
                               preset="quick", only=["train_step"], batch=None, src_len=None, tgt_len=None,
                               decode_batch=None, decode_steps=None, beam=None)
        saved = (B._current, B._xp)
        try:
            isolated.worker_main(args)
        finally:
            B._current, B._xp = saved
    assert seen == [False, True]
    assert [json.loads(line)["ready"] for line in capsys.readouterr().out.splitlines()] == [True, True]


def test_on_cupy_the_phases_are_timed_with_cuda_events(monkeypatch):
    import fakecupy
    from conftest import selected_backend
    with selected_backend("fakecupy") as cp:
        recorded = []
        real = cp.cuda.Event.record
        monkeypatch.setattr(cp.cuda.Event, "record", lambda self, stream=None: recorded.append(self) or real(self))
        step = _quick_work("cupy")["train_step"]
        assert step.phases["ours"].where == "cupy"
        step.ours()                                            # warm-up
        with fakecupy.counting() as syncs:
            phases = step.phases["ours"]()
        assert len(recorded) == len(phases) + 1 >= 5           # one event per mark, and one at the end
        assert syncs.kinds == {"synchronize": 1}               # only the last event is waited for
        assert {"loss", "optimizer"} <= set(phases) and all(t >= 0 for t in phases.values())
    with selected_backend("numpy"):
        assert _quick_work()["train_step"].phases["ours"].where == "numpy"


def test_pytorch_runs_at_attns_precision(monkeypatch):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e .[ref])")
    from conftest import selected_backend
    from attn.bench.twin import match_precision
    before = torch.get_float32_matmul_precision()
    try:
        with selected_backend("numpy"):
            monkeypatch.setenv("CUPY_TF32", "1")               # CuPy's switch: not attn's on NumPy
            assert match_precision(torch) == "fp32" and torch.get_float32_matmul_precision() == "highest"
        with selected_backend("fakecupy"):
            assert match_precision(torch) == "tf32" and torch.get_float32_matmul_precision() == "high"
            monkeypatch.setenv("CUPY_TF32", "0")
            assert match_precision(torch) == "fp32" and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before)


def test_bench_precision_runs_both_frameworks_at_it():
    """``python -m attn.bench --precision``: attn's fast engine at it, PyTorch set to match (tf32:
    ``allow_tf32``; bf16: autocast to bfloat16 around its forward and loss), and the isolated
    workers told."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e .[ref])")
    from attn.bench.cli import parse_args
    from attn.bench.isolated import _worker_args
    from attn.bench.twin import match_precision, torch_autocast
    args = parse_args(["--quick", "--precision", "bf16"])
    assert args.precision == "bf16" and _worker_args(args, "attn")[-2:] == ["--precision", "bf16"]
    assert parse_args(["--quick"]).precision is None and "--precision" not in _worker_args(parse_args(["--quick"]), "attn")
    before, before_tf32 = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    try:
        assert match_precision(torch, "tf32") == "tf32" and torch.backends.cuda.matmul.allow_tf32
        assert match_precision(torch, "bf16") == "bf16" and not torch.backends.cuda.matmul.allow_tf32
        with torch_autocast(torch, "bf16", "cpu"):
            assert (torch.ones(2, 3) @ torch.ones(3, 2)).dtype == torch.bfloat16
        with torch_autocast(torch, "fp32", "cpu"):
            assert (torch.ones(2, 3) @ torch.ones(3, 2)).dtype == torch.float32
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cuda.matmul.allow_tf32 = before_tf32


def test_the_memory_meter_counts_what_it_saw_on_a_step_whose_plan_holds():
    """The peak of a training step on CuPy (here the stand-in, whose pool tells memory hooks of
    every allocation and free, as CuPy's does): a block handed out before the meter and freed
    during it is not subtracted; and the step is measured once its step memory runs it on a plan
    (the third call, which the benchmark measured, was traced again into the pool), where it
    takes nothing from the pool."""
    from conftest import selected_backend
    from attn.bench.memory import _cupy_peak_hook, _settle
    with selected_backend("fakecupy") as cp:
        old = cp.ones(1000, dtype=np.float32)
        hook = _cupy_peak_hook(cp)
        with hook:
            del old                                            # 4,000 bytes the hook never saw handed out
            kept = cp.ones(256, dtype=np.float32) + 1          # two blocks of 1,024 bytes, one freed
        assert (hook.peak, hook.used) == (2048, 1024) and kept.size == 256
        f = _quick_work("cupy")["train_step"].ours
        f(), f()
        memory = f.step_memory
        f()
        assert memory.last_outcome != "planned" and memory.overflows > 0      # what was measured
        _settle(f)
        assert memory.last_outcome == "planned" and memory.overflows == 0
        with _cupy_peak_hook(cp) as hook:
            f()
        assert hook.peak == 0 and memory.last_outcome == "planned"


def test_the_memory_child_measures_the_precision_and_block_it_is_given(monkeypatch):
    """The memory child runs the parent's ``--precision`` and ``--block`` (it once ran fp32 and the
    paper's block whatever the parent timed): on the stand-in a bf16 step holds other bytes than
    fp32's, and the later block's other bytes than the paper's."""
    import fakecupy
    from attn.bench.cli import parse_args
    from attn.bench.memory import measure_memory, memory_command
    for k, v in fakecupy.child_env().items():
        if k in ("PYTHONPATH", "ATTN_BACKEND"):
            monkeypatch.setenv(k, v)
    got = {}
    for extra in ((), ("--precision", "bf16"), ("--block", "later")):
        args = parse_args(["--preset", "quick", "--backend", "cupy", "--only", "train_step", *extra])
        cmd = memory_command(args, "attn")
        assert all(a in cmd for a in extra) and cmd[cmd.index("--block") + 1] == args.block, cmd
        got[extra] = measure_memory(args, "attn", quiet=True)["train_step"]
    fp32, bf16, later = got.values()
    assert fp32["step_memory_outcome"] == bf16["step_memory_outcome"] == later["step_memory_outcome"] == "planned"
    assert bf16["step_memory_mb"] != fp32["step_memory_mb"] and later["step_memory_mb"] != fp32["step_memory_mb"], got

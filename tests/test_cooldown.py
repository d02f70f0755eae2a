"""The schedule's cooldown: over the last fraction of a run's budget the learning rate falls
linearly to zero (:func:`attn.optim.cooldown_scale`), on every engine and backend, following
the budget the run has used (:func:`attn.train.budget_used`), resumed runs included."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from hypothesis import given, strategies as st

import attn.backend as B
from attn.checkpoint import load_npz
from attn.fast import FastTransformer
from attn.fast.training.optim import FastAdam
from attn.model import TransformerConfig
from attn.optim import Adam, cooldown_scale, noam_lr
from attn.train import TrainConfig, budget_used, train
from attn.training.checkpoints import TrainState
from attn.training.config import TrainConfigError, config_from_argv
from test_train import TINY, run_train


@given(st.floats(0, 1), st.floats(0.01, 1))
def test_cooldown_scale_falls_linearly_to_zero_over_the_last_fraction(progress, cooldown):
    s = cooldown_scale(progress, cooldown)
    assert 0.0 <= s <= 1.0
    if progress <= 1 - cooldown:
        assert s == 1.0
    else:
        assert s == pytest.approx((1 - progress) / cooldown)
    assert cooldown_scale(1.0, cooldown) == 0.0
    assert cooldown_scale(progress, 0.0) == 1.0


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_cooldown_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="cooldown"):
        cooldown_scale(0.5, bad)
    with pytest.raises(TrainConfigError, match="--cooldown"):
        TrainConfig(cooldown=bad)


def test_adam_rate_is_the_schedule_times_the_cooldown():
    opt = Adam({}, 64, 10, 2.0, cooldown=0.5)
    assert opt.lr(20) == noam_lr(20, 64, 10, 2.0)               # no progress given: the schedule
    opt.set_progress(0.75)
    assert opt.lr(20) == pytest.approx(noam_lr(20, 64, 10, 2.0) * 0.5)
    opt.set_progress(1.0)
    assert opt.lr(20) == 0.0


CFG = TransformerConfig(vocab_size=11, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1)


@pytest.mark.parametrize("fixed", [None, 1e-3])
def test_the_fast_optimizer_cools_down_as_the_readable_one(backend, fixed):
    """On a GPU the arena's update makes its rate on the device from the step count and the
    factor of the launch: the cooldown rides in that factor, and the weights are the readable
    Adam's, step by step, across the cooldown."""
    fast = FastTransformer(CFG, seed=1, dtype="float64")
    ref = {k: B.to_device(B.to_host(v).copy()) for k, v in fast.params.items()}
    opts = [FastAdam(fast.params, CFG.d_model, 3, 1.5, lr=fixed, cooldown=0.6),
            Adam(ref, CFG.d_model, 3, 1.5, lr=fixed, cooldown=0.6)]
    rng = np.random.default_rng(0)
    rates = []
    for i in range(6):
        g = {k: B.to_device(rng.standard_normal(v.shape)) for k, v in fast.params.items()}
        rates.append([])
        for o in opts:
            o.set_progress(i / 5)
            rates[-1].append(o.step({k: v.copy() for k, v in g.items()}))
        for k in ref:
            np.testing.assert_allclose(B.to_host(fast.params[k]), B.to_host(ref[k]), rtol=1e-12, atol=1e-15,
                                       err_msg=f"step {i + 1}: {k}")
    assert [a for a, _ in rates] == [b for _, b in rates]
    assert rates[-1][0] == 0.0 and rates[1][0] > 0.0               # the last step: the rate is 0


def test_budget_used_is_the_largest_fraction():
    st_ = TrainState()
    st_.step, st_.wall_seconds, st_.epoch, st_.batch_index = 30, 60.0, 1, 5
    assert budget_used(TrainConfig(minutes=0, steps=0), st_, 10) == 0.0
    assert budget_used(TrainConfig(minutes=0, steps=120), st_, 10) == 0.25
    assert budget_used(TrainConfig(minutes=2, steps=120), st_, 10) == 0.5
    assert budget_used(TrainConfig(minutes=0, epochs=3), st_, 10) == 0.5
    assert budget_used(TrainConfig(minutes=0.5), st_, 10) == 1.0


def test_a_run_cools_down_to_its_last_step_and_resumes_mid_cooldown(tmp_path):
    """With --steps the cooldown is a function of the step: the logged rates follow it to 0 at
    the last step, and a run stopped in its cooldown and resumed repeats the unbroken run."""
    run_train(tmp_path, "--steps", "12", "--eval-every", "3", "--cooldown", "0.5", "--lr-factor", "1",
              "--out", str(tmp_path / "a"))
    logged = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    warm = 30
    for rec in logged:                      # the rate of step s was set with progress (s - 1) / 12
        want = noam_lr(rec["step"], 32, warm, 1.0) * cooldown_scale((rec["step"] - 1) / 12, 0.5)
        assert rec["lr"] == pytest.approx(want, rel=1e-12), rec
        assert rec["lr_scale"] == pytest.approx(cooldown_scale((rec["step"] - 1) / 12, 0.5))
    assert logged[-1]["step"] == 12 and logged[-1]["lr_scale"] == pytest.approx(1 / 12 / 0.5)
    assert logged[0]["lr_scale"] == 1.0
    # The same budget, stopped in its cooldown as Ctrl-C stops a run, then resumed.
    def interrupt_at_8(state, model, wall):
        if state.step == 8:
            os.kill(os.getpid(), signal.SIGINT)
    (tmp_path / "data").mkdir(exist_ok=True)
    cut = train(config_from_argv(["--data", str(tmp_path / "data"), *TINY, "--backend", "numpy", "--steps", "12",
                                  "--eval-every", "3", "--cooldown", "0.5", "--lr-factor", "1",
                                  "--out", str(tmp_path / "b")]),
                on_step=interrupt_at_8)
    assert cut["interrupted"] and cut["steps"] == 9           # the signal is seen at the next step
    run_train(tmp_path, "--steps", "12", "--eval-every", "3", "--out", str(tmp_path / "b"), "--resume")
    a, _ = load_npz(tmp_path / "a" / "checkpoint.npz")
    b, _ = load_npz(tmp_path / "b" / "checkpoint.npz")
    assert len(b["history/train_loss"]) == 12
    np.testing.assert_array_equal(a["history/train_loss"], b["history/train_loss"])


def test_the_recipes_choose_the_cooldown_and_a_captured_step_refuses_it(tmp_path):
    assert TrainConfig(preset="toy").with_recipe().cooldown == 0.0
    assert TrainConfig(preset="small").with_recipe().cooldown > 0.0
    from attn.train import _check_cuda_graph
    from attn.training.distributed import Single
    import attn.train as T
    cfg = TrainConfig(preset="small", cuda_graph=True, backend="cupy").with_recipe()
    saved = B.get_backend
    try:
        T.B.get_backend = lambda: "cupy"
        with pytest.raises(TrainConfigError, match="--cooldown 0"):
            _check_cuda_graph(cfg, Single())
        _check_cuda_graph(cfg.__class__(**{**cfg.to_dict(), "cooldown": 0.0}), Single())
    finally:
        T.B.get_backend = saved

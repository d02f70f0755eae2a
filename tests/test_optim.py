"""Adam with the paper's settings, the warm-up schedule of section 5.3, gradient clipping.

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn.backend as B
from attn.optim import Adam, clip_grad_norm, noam_lr, schedule_curve
from strategies import normals

d_models = st.integers(1, 4096)
warmups = st.integers(1, 20000)
steps = st.integers(1, 10**6)

# ----------------------------------------------------------------------------- schedule


@given(d_model=d_models, warmup=warmups, step=steps)
def test_noam_lr_is_the_papers_formula(d_model, warmup, step):
    assert noam_lr(step, d_model, warmup) == pytest.approx(
        d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5), rel=1e-15)


@given(d_model=d_models, warmup=warmups, step=steps)
def test_noam_lr_rises_linearly_peaks_at_warmup_then_decays_as_inverse_sqrt(d_model, warmup, step):
    peak = noam_lr(warmup, d_model, warmup)
    assert peak == pytest.approx(d_model ** -0.5 * warmup ** -0.5, rel=1e-12)
    lr = noam_lr(step, d_model, warmup)
    assert lr <= peak * (1 + 1e-12)
    if step <= warmup:
        assert lr == pytest.approx(peak * step / warmup, rel=1e-12)             # linear through 0
    else:
        assert lr == pytest.approx(peak * math.sqrt(warmup / step), rel=1e-12)  # inverse square root
        assert lr < noam_lr(step - 1, d_model, warmup)


@given(d_model=d_models, warmup=warmups, step=steps, factor=st.floats(0.01, 10.0))
def test_noam_lr_factor_scales_it(d_model, warmup, step, factor):
    assert noam_lr(step, d_model, warmup, factor) == pytest.approx(factor * noam_lr(step, d_model, warmup),
                                                                   rel=1e-12)


def test_noam_lr_base_model_numbers():
    # d_model 512, 4000 warm-up steps: the peak is 512^-0.5 * 4000^-0.5 = 6.988e-4 at step 4000.
    assert noam_lr(4000, 512, 4000) == pytest.approx(6.98771242e-4, rel=1e-8)
    assert noam_lr(1, 512, 4000) == pytest.approx(6.98771242e-4 / 4000, rel=1e-8)
    assert noam_lr(16000, 512, 4000) == pytest.approx(6.98771242e-4 / 2, rel=1e-8)
    assert max(range(1, 20001), key=lambda s: noam_lr(s, 512, 4000)) == 4000


@pytest.mark.parametrize("step", [0, -1])
def test_noam_lr_steps_are_one_based(step):
    with pytest.raises(ValueError, match="1-based"):
        noam_lr(step, 512, 4000)


def test_schedule_curve_is_noam_lr_over_the_steps():
    assert schedule_curve(range(1, 50), 64, 10, 2.0) == [noam_lr(s, 64, 10, 2.0) for s in range(1, 50)]

# ----------------------------------------------------------------------------- Adam


def _adam_by_hand(p0, grads, lrs, b1=0.9, b2=0.98, eps=1e-9):
    """Adam with bias correction, scalar by scalar in plain Python floats."""
    p, m, v = list(p0), [0.0] * len(p0), [0.0] * len(p0)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        for i in range(len(p)):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            m_hat = m[i] / (1 - b1 ** t)
            v_hat = v[i] / (1 - b2 ** t)
            p[i] -= lr * m_hat / (math.sqrt(v_hat) + eps)
    return p


def test_adam_matches_a_hand_computation_for_two_steps(backend):
    p0, g1, g2 = [1.0, -2.0, 0.5], [0.5, -0.1, 0.0], [0.3, 0.2, -4.0]
    d_model, warmup = 16, 2
    lr1, lr2 = noam_lr(1, d_model, warmup), noam_lr(2, d_model, warmup)
    assert (lr1, lr2) == pytest.approx((0.25 * 2 ** -1.5, 0.25 * 2 ** -0.5))
    params = {"w": B.to_device(np.array(p0))}
    opt = Adam(params, d_model=d_model, warmup_steps=warmup)
    assert (opt.beta1, opt.beta2, opt.eps) == (0.9, 0.98, 1e-9)          # the paper's (section 5.3)
    assert opt.step({"w": B.to_device(np.array(g1))}) == lr1
    # The first step moves every coordinate with a gradient by lr1 against its sign: m_hat/sqrt(v_hat) = sign(g).
    np.testing.assert_allclose(B.to_host(params["w"]), np.array(p0) - lr1 * np.sign(g1), rtol=0, atol=1e-8)
    np.testing.assert_allclose(B.to_host(params["w"]), _adam_by_hand(p0, [g1], [lr1]), rtol=1e-14, atol=0)
    assert opt.step({"w": B.to_device(np.array(g2))}) == lr2
    np.testing.assert_allclose(B.to_host(params["w"]), _adam_by_hand(p0, [g1, g2], [lr1, lr2]), rtol=1e-14, atol=0)


@given(data=st.data(), n_steps=st.integers(1, 6), fixed=st.sampled_from([None, 1e-3]))
def test_adam_matches_the_hand_computation_on_any_gradients(backend, data, n_steps, fixed):
    p0 = data.draw(normals((4,)))
    grads = [data.draw(normals((4,))) for _ in range(n_steps)]
    params = {"a": B.to_device(p0.copy())}
    opt = Adam(params, d_model=32, warmup_steps=3, lr=fixed)
    lrs = [opt.step({"a": B.to_device(g)}) for g in grads]
    assert lrs == [fixed or noam_lr(t, 32, 3) for t in range(1, n_steps + 1)]
    np.testing.assert_allclose(B.to_host(params["a"]), _adam_by_hand(p0, grads, lrs), rtol=1e-13, atol=1e-15)


def test_adam_step_counter_advances_exactly_once_per_step(backend):
    params = {"w": B.to_device(np.ones(3)), "b": B.to_device(np.zeros(2))}
    grads = {"w": B.to_device(np.ones(3)), "b": B.to_device(np.ones(2))}
    opt = Adam(params, d_model=64, warmup_steps=4)
    assert opt.t == 0 and opt.lr() == noam_lr(1, 64, 4)               # the rate of the coming step
    for t in range(1, 8):
        assert opt.step(grads) == noam_lr(t, 64, 4)
        assert opt.t == t
        assert opt.lr() == noam_lr(t + 1, 64, 4)
    with pytest.raises(KeyError, match="'b'"):
        opt.step({"w": grads["w"]})
    assert opt.t == 7                                                 # a refused step is not counted


def test_adam_updates_in_place_and_keeps_the_dtype(backend):
    w = B.to_device(np.ones((2, 3), dtype=np.float32))
    params = {"w": w}
    opt = Adam(params, d_model=8, warmup_steps=1)
    opt.step({"w": B.to_device(np.full((2, 3), 0.5, dtype=np.float32))})
    assert params["w"] is w and w.dtype == np.float32
    assert opt.m["w"].dtype == opt.v["w"].dtype == np.float32
    np.testing.assert_allclose(B.to_host(w), 1 - 8 ** -0.5, rtol=1e-6)


def test_adam_state_round_trip_continues_identically(backend):
    rng = np.random.default_rng(0)
    p0 = {"x": rng.standard_normal((3, 2)), "y": rng.standard_normal(4)}
    grads = [{k: B.to_device(rng.standard_normal(v.shape)) for k, v in p0.items()} for _ in range(5)]
    a = {k: B.to_device(v.copy()) for k, v in p0.items()}
    opt_a = Adam(a, d_model=16, warmup_steps=2)
    for g in grads:
        opt_a.step(g)
    b = {k: B.to_device(v.copy()) for k, v in p0.items()}
    opt_b = Adam(b, d_model=16, warmup_steps=2)
    for g in grads[:3]:
        opt_b.step(g)
    saved = {k: B.to_host(v) for k, v in opt_b.state_arrays().items()}
    assert set(saved) == {"adam.m/x", "adam.m/y", "adam.v/x", "adam.v/y"}
    opt_c = Adam(b, d_model=16, warmup_steps=2)                       # a fresh optimizer, as after a restart
    opt_c.load_state(saved, t=opt_b.t)
    for g in grads[3:]:
        opt_c.step(g)
    for k in p0:
        np.testing.assert_array_equal(B.to_host(b[k]), B.to_host(a[k]))
    with pytest.raises(KeyError, match="adam.v/y"):
        opt_c.load_state({k: v for k, v in saved.items() if k != "adam.v/y"}, t=3)

# ----------------------------------------------------------------------------- clipping


@given(data=st.data(), max_norm=st.floats(1e-3, 100.0))
def test_clip_grad_norm(backend, data, max_norm):
    host = {"a": data.draw(normals((3, 4), scale=data.draw(st.floats(0.01, 10.0)))), "b": data.draw(normals((5,)))}
    grads = {k: B.to_device(v.copy()) for k, v in host.items()}
    total = math.sqrt(sum(float((v ** 2).sum()) for v in host.values()))
    norm = clip_grad_norm(grads, max_norm)
    assert norm == pytest.approx(total, rel=1e-12)                    # the norm before clipping
    after = math.sqrt(sum(float((B.to_host(v) ** 2).sum()) for v in grads.values()))
    if total <= max_norm:
        for k in host:
            np.testing.assert_array_equal(B.to_host(grads[k]), host[k])   # untouched
    else:
        assert after == pytest.approx(max_norm, rel=1e-5)
        scale = B.to_host(grads["a"]).ravel()[0] / host["a"].ravel()[0]
        for k in host:                                                # one scale for every gradient
            np.testing.assert_allclose(B.to_host(grads[k]), host[k] * scale, rtol=1e-12)


def test_clip_grad_norm_off_with_a_non_positive_max(backend):
    g = {"a": B.to_device(np.array([3.0, 4.0]))}
    assert clip_grad_norm(g, 0.0) == pytest.approx(5.0)
    np.testing.assert_array_equal(B.to_host(g["a"]), [3.0, 4.0])


def test_clip_grad_norm_keeps_float32(backend):
    g = {"a": B.to_device(np.array([30.0, 40.0], dtype=np.float32))}
    assert clip_grad_norm(g, 1.0) == pytest.approx(50.0)
    assert g["a"].dtype == np.float32
    np.testing.assert_allclose(B.to_host(g["a"]), [0.6, 0.8], rtol=1e-6)

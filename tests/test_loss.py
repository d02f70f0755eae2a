"""Cross-entropy with label smoothing and padding: the fused gradient against central
differences, the formula against NLL and PyTorch, padding that contributes nothing, and
clear errors on bad input."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn.backend as B
from attn.loss import cross_entropy
from attn.masks import PAD_ID
from attn.testing import assert_cross_entropy_properties, check_gradients, floats, logits, token_ids

dev, host = B.to_device, B.to_host
smoothings = st.sampled_from([0.0, 0.1, 0.3, 0.9])


@st.composite
def problems(draw, max_exponent: int = 2, min_real: int = 1):
    """(logits (B, T, V) float64, targets (B, T) int64 with PAD_ID = 0 anywhere, at least
    ``min_real`` real targets). V >= 2 so that a real target exists."""
    Bsz, T, V = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(2, 7))
    x = draw(logits((Bsz, T, V), max_exponent))
    t = draw(token_ids((Bsz, T), V))
    if min_real and not (t != PAD_ID).any():
        t.reshape(-1)[draw(st.integers(0, t.size - 1))] = draw(st.integers(1, V - 1))
    return x, t


def log_softmax(x):
    s = x - x.max(axis=-1, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=-1, keepdims=True))


def _fused(targets, smoothing, pad_id):
    """forward/backward pair for check_layer: the loss is the output, dlogits the cache."""
    def forward(logits):
        return cross_entropy(logits, targets, smoothing, pad_id)

    def backward(dloss, dlogits):
        return dloss * dlogits
    return forward, backward


@given(problem=problems(min_real=0), smoothing=smoothings, pad_id=st.sampled_from([PAD_ID, None]))
def test_cross_entropy_gradients(backend, problem, smoothing, pad_id):
    x, t = problem
    forward, backward = _fused(dev(t), smoothing, pad_id)
    check_gradients(f"cross_entropy(smoothing={smoothing}, pad_id={pad_id})", forward, backward,
                    {"logits": dev(x)}, ("logits",))


@given(problem=problems(), pad_id=st.sampled_from([PAD_ID, None]))
def test_no_smoothing_is_the_negative_log_likelihood(backend, problem, pad_id):
    x, t = problem
    loss, _ = cross_entropy(dev(x), dev(t), 0.0, pad_id)
    real = (t != pad_id) if pad_id is not None else np.ones(t.shape, bool)
    nll = -np.take_along_axis(log_softmax(x), t[..., None], axis=-1)[..., 0]
    assert B.to_float(loss) == pytest.approx(nll[real].mean(), rel=1e-12, abs=1e-12)


@given(problem=problems(), smoothing=smoothings)
def test_smoothing_is_cross_entropy_against_the_smoothed_target(backend, problem, smoothing):
    x, t = problem
    V = x.shape[-1]
    q = np.full(x.shape, smoothing / V)
    np.put_along_axis(q, t[..., None], (1.0 - smoothing) + smoothing / V, axis=-1)
    per_token = -(q * log_softmax(x)).sum(axis=-1)
    loss, dlogits = cross_entropy(dev(x), dev(t), smoothing)
    real = t != PAD_ID
    assert B.to_float(loss) == pytest.approx(per_token[real].mean(), rel=1e-12, abs=1e-12)
    p = np.exp(log_softmax(x))
    expected = (p - q) * real[..., None] / real.sum()                      # the fused gradient
    np.testing.assert_allclose(host(dlogits), expected, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(host(dlogits).sum(axis=-1), 0.0, atol=1e-14)  # p and q both sum to one


@given(problem=problems(), smoothing=smoothings)
def test_matches_torch_cross_entropy(backend, torch, problem, smoothing):
    x, t = problem
    V = x.shape[-1]
    xt = torch.tensor(x.reshape(-1, V), dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(xt, torch.tensor(t.reshape(-1)), label_smoothing=smoothing,
                                            ignore_index=PAD_ID)
    ref.backward()
    loss, dlogits = cross_entropy(dev(x), dev(t), smoothing)
    assert B.to_float(loss) == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(host(dlogits).reshape(-1, V), xt.grad.numpy(), rtol=1e-9, atol=1e-14)


@given(problem=problems(), smoothing=smoothings, data=st.data())
def test_padding_contributes_nothing(backend, problem, smoothing, data):
    x, t = problem
    junk = data.draw(floats(x[t == PAD_ID].shape, bound=50.0))    # anything at all at padded positions
    # loss and dlogits unchanged, zero rows of dlogits at padding, every row of dlogits sums to zero
    assert_cross_entropy_properties(cross_entropy, x, t, smoothing, PAD_ID, junk)


@given(problem=problems(), smoothing=smoothings)
def test_loss_is_a_mean_over_real_tokens(backend, problem, smoothing):
    # Appending padding positions (more padding, same real tokens) changes nothing.
    x, t = problem
    x_pad = np.concatenate([x, np.zeros(x[:, :2].shape) + 7.0], axis=1)
    t_pad = np.concatenate([t, np.full(t[:, :2].shape, PAD_ID)], axis=1)
    a, b = (B.to_float(cross_entropy(dev(xx), dev(tt), smoothing)[0]) for xx, tt in ((x, t), (x_pad, t_pad)))
    assert b == pytest.approx(a, rel=1e-13)


def test_all_padding_gives_zero_loss_and_zero_gradient(backend):
    loss, dlogits = cross_entropy(dev(np.ones((2, 3, 4))), dev(np.zeros((2, 3), dtype=np.int64)), 0.1)
    assert B.to_float(loss) == 0.0
    assert not host(dlogits).any()


@given(problem=problems(max_exponent=0), smoothing=smoothings, dtype=st.sampled_from(["float32", "float64"]))
def test_stable_for_logits_of_magnitude_1e4(backend, problem, smoothing, dtype):
    x, t = problem
    x = x * 1e4                                                   # values in [-1e4, 1e4]
    loss, dlogits = cross_entropy(dev(x, dtype=dtype), dev(t), smoothing)
    assert np.isfinite(B.to_float(loss)) and np.isfinite(host(dlogits)).all()
    real = t != PAD_ID
    V = x.shape[-1]
    lp = log_softmax(x.astype(dtype).astype(np.float64))          # float64 reference on shifted logits
    per_token = -((1 - smoothing) * np.take_along_axis(lp, t[..., None], -1)[..., 0] + smoothing * lp.mean(-1))
    assert B.to_float(loss) == pytest.approx(per_token[real].mean(), rel=1e-12 if dtype == "float64" else 1e-5)
    assert V >= 2


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_loss_is_a_0d_array_on_the_device_and_keeps_the_dtype(backend, dtype):
    rng = np.random.default_rng(0)
    loss, dlogits = cross_entropy(dev(rng.standard_normal((2, 3, 5)), dtype=dtype),
                                  dev(np.array([[1, 2, 0], [4, 4, 3]])), 0.1)
    assert B.get_array_module(loss) is backend and loss.ndim == 0      # not a Python float: no host sync
    assert loss.dtype == np.dtype(dtype) and dlogits.dtype == np.dtype(dtype)
    assert dlogits.shape == (2, 3, 5)


def test_cross_entropy_rejects_bad_input(backend):
    x, t = dev(np.zeros((2, 3, 5))), dev(np.ones((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match=r"cross_entropy: logits \(2, 3, 5\) and targets \(2, 4\) must agree"):
        cross_entropy(x, dev(np.ones((2, 4), dtype=np.int64)))
    with pytest.raises(IndexError, match=r"cross_entropy: targets \(shape \(2, 3\)\) holds ids in \[1, 5\], "
                                         r"outside the vocabulary \[0, 5\)"):
        cross_entropy(x, dev(np.array([[1, 1, 1], [1, 1, 5]])))
    with pytest.raises(IndexError, match=r"cross_entropy: targets.*\[-1, 1\].*\[0, 5\)"):
        cross_entropy(x, dev(np.array([[1, 1, 1], [1, 1, -1]])))
    with pytest.raises(TypeError, match="cross_entropy: targets must be an integer array"):
        cross_entropy(x, dev(np.ones((2, 3))))
    with pytest.raises(TypeError, match="cross_entropy: logits must be floating point"):
        cross_entropy(dev(np.zeros((2, 3, 5), dtype=np.int64)), t)
    for s in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"cross_entropy: smoothing must be in \[0, 1\)"):
            cross_entropy(x, t, s)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_raise_floating_point_error(backend, bad):
    x = np.zeros((2, 3, 5))
    x[1, 2, 3] = bad
    t = dev(np.array([[1, 2, 3], [1, 2, 3]]))
    with np.errstate(invalid="ignore"):          # inf - inf is NaN: the case this test is about, not a warning
        with pytest.raises(FloatingPointError, match=r"cross_entropy: the loss is .*contain NaN or inf"):
            cross_entropy(dev(x), t)
        loss, _ = cross_entropy(dev(x), t, check_finite=False)             # opt out: no check, no host sync
    assert not np.isfinite(B.to_float(loss))

"""The tanh recurrent cell and its unrolling (backpropagation through time):
gradient checks, the invariants of skipped (padded) steps, and clear errors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import attn.backend as B
from attn.layers import rnn_backward, rnn_forward, rnn_step_backward, rnn_step_forward
from attn.testing import assert_rnn_skips_masked_steps, check_gradients, floats, normals


def bounded(shape, scale: float):
    """Seeded Gaussians of standard deviation ``scale``, clipped at two of them."""
    return normals(shape).map(lambda a: np.clip(a, -2.0, 2.0) * scale)


@st.composite
def rnn_args(draw, max_batch=3, max_len=5, max_width=4):
    """Host float64 arguments of rnn_forward: x (B, T, Din), h0 (B, H), w_x, w_h, b.

    Values keep |pre-activation| below about 4, out of tanh saturation, and h0 away from
    0: a gradient whose true size is ~1e-5 (tanh' at 5 is 2e-4; dw_h is h0 times it)
    is below what float64 central differences resolve to a relative 1e-6.
    """
    Bsz, T = draw(st.integers(1, max_batch)), draw(st.integers(1, max_len))
    Din, H = draw(st.integers(1, max_width)), draw(st.integers(1, max_width))
    h0 = draw(normals((Bsz, H)).map(lambda a: np.sign(a) * (0.1 + 0.8 * np.abs(np.tanh(a)))))
    return dict(x=draw(bounded((Bsz, T, Din), 1.0)), h0=h0,
                w_x=draw(bounded((Din, H), 0.5 / Din ** 0.5)), w_h=draw(bounded((H, H), 0.5 / H ** 0.5)),
                b=draw(bounded((H,), 0.2)))


def on_device(args: dict) -> dict:
    return {k: (B.to_device(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}


step_masks = lambda Bsz, T: hnp.arrays(np.bool_, (Bsz, T))     # noqa: E731  any pattern, all-False rows included

# ----------------------------------------------------------------------------- gradients


@given(data=st.data())
def test_rnn_step_gradients(backend, data):
    a = data.draw(rnn_args())
    args = on_device(dict(x=np.ascontiguousarray(a["x"][:, 0]), h_prev=a["h0"], w_x=a["w_x"], w_h=a["w_h"], b=a["b"]))
    check_gradients("rnn_step", rnn_step_forward, rnn_step_backward, args, ["x", "h_prev", "w_x", "w_h", "b"])


@given(data=st.data())
def test_rnn_gradients_through_time(backend, data):
    args = on_device(data.draw(rnn_args()))
    check_gradients("rnn", rnn_forward, rnn_backward, args, ["x", "h0", "w_x", "w_h", "b"])


@given(data=st.data())
def test_rnn_gradients_through_time_with_skipped_steps(backend, data):
    a = data.draw(rnn_args())
    a["mask"] = data.draw(step_masks(*a["x"].shape[:2]))
    check_gradients("rnn(mask)", rnn_forward, rnn_backward, on_device(a), ["x", "h0", "w_x", "w_h", "b"])

# ----------------------------------------------------------------------------- invariants


@given(data=st.data())
def test_rnn_is_the_step_repeated(backend, data):
    a = on_device(data.draw(rnn_args()))
    hs, _ = rnn_forward(**a)
    h = a["h0"]
    for t in range(a["x"].shape[1]):
        h, _ = rnn_step_forward(a["x"][:, t], h, a["w_x"], a["w_h"], a["b"])
        np.testing.assert_allclose(B.to_host(hs[:, t]), B.to_host(h), rtol=1e-12, atol=1e-12)


@given(data=st.data())
def test_padded_steps_change_nothing(backend, data):
    """Real tokens then padding: the final state is the state after the last real token,
    whatever the padding holds, and the padding receives no gradient."""
    a = data.draw(rnn_args())
    Bsz, T, _ = a["x"].shape
    lengths = np.array(data.draw(st.lists(st.integers(0, T), min_size=Bsz, max_size=Bsz)))
    mask = np.arange(T)[None, :] < lengths[:, None]
    # skipped steps keep the state: after a row's last real token it stays put
    assert_rnn_skips_masked_steps(rnn_forward, a["x"], a["h0"], a["w_x"], a["w_h"], a["b"], mask)
    hs, cache = rnn_forward(**on_device(a), mask=B.to_device(mask))
    hs = B.to_host(hs)
    for i, L in enumerate(lengths):                      # the same row run alone on its real prefix
        row = {k: a[k] for k in ("w_x", "w_h", "b")}
        if L:
            ref, _ = rnn_forward(B.to_device(a["x"][i:i + 1, :L]), B.to_device(a["h0"][i:i + 1]),
                                 *map(B.to_device, row.values()))
            np.testing.assert_allclose(hs[i, :L], B.to_host(ref)[0], rtol=1e-12, atol=1e-12)
    # Different pad content: not one output moves.
    x2 = a["x"].copy()
    x2[~mask] = data.draw(floats(x2[~mask].shape, bound=2.0))
    hs2, _ = rnn_forward(**on_device(dict(a, x=x2)), mask=B.to_device(mask))
    np.testing.assert_array_equal(B.to_host(hs2), hs)
    dx = B.to_host(rnn_backward(B.to_device(np.ones(hs.shape)), cache)[0])
    assert (dx[~mask] == 0).all()


def test_all_steps_skipped_keeps_the_initial_state(backend):
    rng = np.random.default_rng(0)
    a = on_device(dict(x=rng.standard_normal((2, 4, 3)), h0=rng.standard_normal((2, 5)),
                       w_x=rng.standard_normal((3, 5)), w_h=rng.standard_normal((5, 5)),
                       b=rng.standard_normal(5)))
    hs, cache = rnn_forward(**a, mask=B.to_device(np.zeros((2, 4), dtype=bool)))
    np.testing.assert_array_equal(B.to_host(hs), np.repeat(B.to_host(a["h0"])[:, None], 4, axis=1))
    dhs = rng.standard_normal((2, 4, 5))
    dx, dh0, dw_x, dw_h, db = rnn_backward(B.to_device(dhs), cache)
    np.testing.assert_allclose(B.to_host(dh0), dhs.sum(axis=1))     # every output was h0
    for g in (dx, dw_x, dw_h, db):
        assert not B.to_host(g).any()


def test_empty_sequence_returns_the_initial_state_gradient_untouched(backend):
    rng = np.random.default_rng(4)
    a = on_device(dict(x=np.zeros((2, 0, 3)), h0=rng.standard_normal((2, 5)), w_x=rng.standard_normal((3, 5)),
                       w_h=rng.standard_normal((5, 5)), b=rng.standard_normal(5)))
    hs, cache = rnn_forward(**a)
    assert hs.shape == (2, 0, 5)
    dx, dh0, dw_x, dw_h, db = rnn_backward(B.to_device(np.zeros((2, 0, 5))), cache)
    assert dx.shape == (2, 0, 3) and dh0.shape == (2, 5) and not B.to_host(dh0).any()
    assert not (B.to_host(dw_x).any() or B.to_host(dw_h).any() or B.to_host(db).any())


def test_zero_initial_state_by_default_and_dtype_kept(backend):
    rng = np.random.default_rng(1)
    x, w_x, w_h, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 4), (4, 5), (5, 5), (5,)))
    hs, _ = rnn_forward(B.to_device(x), None, *map(B.to_device, (w_x, w_h, b)))
    ref, _ = rnn_forward(*map(B.to_device, (x, np.zeros((2, 5), np.float32), w_x, w_h, b)))
    assert hs.dtype == np.float32 and hs.shape == (2, 3, 5)
    np.testing.assert_array_equal(B.to_host(hs), B.to_host(ref))


def test_gradient_vanishes_through_a_contracting_recurrence(backend):
    """Why lesson 01 needs attention: with ||w_h|| < 1 each step multiplies the gradient
    reaching x_0 by at most ||w_h|| (tanh' <= 1), so it shrinks geometrically with distance."""
    rng = np.random.default_rng(2)
    H, T = 6, 30
    q, _ = np.linalg.qr(rng.standard_normal((H, H)))
    a = on_device(dict(x=rng.standard_normal((1, T, 3)), h0=np.zeros((1, H)), w_x=rng.standard_normal((3, H)),
                       w_h=0.5 * q, b=np.zeros(H)))
    hs, cache = rnn_forward(**a)
    dhs = np.zeros((1, T, H))
    dhs[0, -1] = 1.0                                            # the gradient of the last state only
    dx = B.to_host(rnn_backward(B.to_device(dhs), cache)[0])[0]  # (T, Din)
    norms = np.linalg.norm(dx, axis=1)
    assert norms[0] <= 0.5 ** (T - 1) * norms[-1] * 10           # spectral norm 0.5 per step, T-1 steps
    assert (np.diff(norms) > 0).all()                            # monotone: further back, smaller

# ----------------------------------------------------------------------------- PyTorch


def test_matches_torch_rnn(torch):
    rng = np.random.default_rng(3)
    Bsz, T, Din, H = 3, 6, 4, 5
    x, h0 = rng.standard_normal((Bsz, T, Din)), rng.standard_normal((Bsz, H))
    w_x, w_h, b = rng.standard_normal((Din, H)) * 0.5, rng.standard_normal((H, H)) * 0.5, rng.standard_normal(H)
    dhs = rng.standard_normal((Bsz, T, H))
    ref = torch.nn.RNN(Din, H, nonlinearity="tanh", batch_first=True).double()
    with torch.no_grad():
        ref.weight_ih_l0.copy_(torch.from_numpy(w_x.T))
        ref.weight_hh_l0.copy_(torch.from_numpy(w_h.T))
        ref.bias_ih_l0.copy_(torch.from_numpy(b))
        ref.bias_hh_l0.zero_()
    tx = torch.from_numpy(x).requires_grad_()
    th0 = torch.from_numpy(h0)[None].requires_grad_()
    out, _ = ref(tx, th0)
    (out * torch.from_numpy(dhs)).sum().backward()
    hs, cache = rnn_forward(x, h0, w_x, w_h, b)
    dx, dh0, dw_x, dw_h, db = rnn_backward(dhs, cache)
    np.testing.assert_allclose(hs, out.detach().numpy(), rtol=1e-10, atol=1e-12)
    for ours, theirs in ((dx, tx.grad), (dh0, th0.grad[0]), (dw_x, ref.weight_ih_l0.grad.T),
                         (dw_h, ref.weight_hh_l0.grad.T), (db, ref.bias_ih_l0.grad)):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-9, atol=1e-12)

# ----------------------------------------------------------------------------- errors


def _good(Bsz=2, T=3, Din=4, H=5):
    return dict(x=np.zeros((Bsz, T, Din)), h0=np.zeros((Bsz, H)), w_x=np.zeros((Din, H)),
                w_h=np.zeros((H, H)), b=np.zeros(H))


@pytest.mark.parametrize("name, bad, match", [
    ("x", np.zeros((2, 4)), r"rnn: x must be 3-D"),
    ("x", np.zeros((2, 3, 6)), r"rnn: x has shape \(2, 3, 6\)"),
    ("h0", np.zeros((2, 6)), r"rnn: h0 has shape \(2, 6\)"),
    ("h0", np.zeros((3, 5)), r"rnn: h0 has shape \(3, 5\)"),
    ("w_x", np.zeros((4, 6)), r"rnn: w_x has shape \(4, 6\)"),
    ("w_h", np.zeros((5, 4)), r"rnn: w_h must be square"),
    ("b", np.zeros(4), r"rnn: b has shape \(4,\)"),
    ("mask", np.ones((2, 4), dtype=bool), r"rnn: mask must be a \(2, 3\) bool array"),
    ("mask", np.ones((2, 3)), r"rnn: mask must be a \(2, 3\) bool array"),
])
def test_rnn_rejects_bad_shapes_naming_the_argument(name, bad, match):
    args = dict(_good(), **{name: bad})
    with pytest.raises(ValueError, match=match):
        rnn_forward(**args)


def test_rnn_rejects_mixed_dtypes():
    with pytest.raises(TypeError, match=r"rnn: .*w_h float32"):
        rnn_forward(**dict(_good(), w_h=np.zeros((5, 5), np.float32)))
    with pytest.raises(TypeError, match=r"rnn: x must be a floating-point array"):
        rnn_forward(**dict(_good(), x=np.zeros((2, 3, 4), np.int64)))


@pytest.mark.parametrize("name, bad, match", [
    ("x", np.zeros((2, 3, 4)), r"rnn_step: x must be 2-D"),
    ("x", np.zeros((2, 6)), r"rnn_step: x has shape \(2, 6\)"),
    ("h_prev", np.zeros((1, 5)), r"rnn_step: h_prev has shape \(1, 5\)"),
    ("w_x", np.zeros((4, 4)), r"rnn_step: w_x has shape \(4, 4\)"),
    ("b", np.zeros((1, 5)), r"rnn_step: b has shape \(1, 5\)"),
])
def test_rnn_step_rejects_bad_shapes_naming_the_argument(name, bad, match):
    g = _good()
    args = dict(x=g["x"][:, 0], h_prev=g["h0"], w_x=g["w_x"], w_h=g["w_h"], b=g["b"])
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        rnn_step_forward(**args)

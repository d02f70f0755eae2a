"""The gradient checker itself: it must find a known derivative, measure errors sensibly,
and, above all, fail loudly on a backward pass that is only slightly wrong."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn.backend as B
from attn.gradcheck import check_layer, numerical_gradient, numerical_gradient_of, rel_error
from attn.layers import linear_backward, linear_forward
from attn.testing import floats, leading_shapes, normals


@given(x=floats(st.integers(1, 6), bound=2.0))
def test_numerical_gradient_of_cube_is_three_x_squared(backend, x):
    xd = B.to_device(x)
    num = numerical_gradient(lambda: (xd ** 3).sum(), xd)
    # The central difference of x**3 is 3x**2 + h**2 exactly (h = 1e-6), but it is taken of the
    # whole sum, whose rounding (a few eps times |f|) is divided by 2h: with x = [2, 0.0625] that is
    # ~1e-9 absolutely on the small entry's gradient, far above 1e-8 of it. So the bound is relative,
    # or absolute at h**2 plus the sum's rounding over 2h.
    atol = 2e-12 + 4 * np.finfo(np.float64).eps * float(np.abs(x ** 3).sum()) / 2e-6
    np.testing.assert_allclose(B.to_host(num), 3 * x ** 2, rtol=1e-8, atol=atol)
    np.testing.assert_array_equal(B.to_host(xd), x)             # perturbed in place, then restored


def test_numerical_gradient_at_chosen_entries_only(backend):
    rng = np.random.default_rng(1)
    a, b = B.to_device(rng.standard_normal((3, 4))), B.to_device(rng.standard_normal((3, 4)))
    full = B.to_host(numerical_gradient(lambda: (a * b).sum(), a))
    some = B.to_host(numerical_gradient(lambda: (a * b).sum(), a, indices=[0, 5, 11]))
    np.testing.assert_array_equal(some.reshape(-1)[[0, 5, 11]], full.reshape(-1)[[0, 5, 11]])
    assert not np.delete(some.reshape(-1), [0, 5, 11]).any()                   # the rest untouched: zero


def test_numerical_gradient_of_a_product_uses_the_other_factor(backend):
    rng = np.random.default_rng(0)
    a, b = B.to_device(rng.standard_normal((3, 4))), B.to_device(rng.standard_normal((3, 4)))
    assert rel_error(numerical_gradient(lambda: (a * b).sum(), a), b) < 1e-9
    assert rel_error(numerical_gradient(lambda: (a * b).sum(), b), a) < 1e-9


def test_numerical_gradient_of_a_strided_view_perturbs_the_view(backend):
    """A column block of a larger array (as the fast model's w_q is of its arena's (D, 3D)
    block): perturbed in place through the view, the rest of the array untouched after."""
    rng = np.random.default_rng(2)
    whole = B.to_device(rng.standard_normal((3, 6)))
    before = B.to_host(whole).copy()
    x, other = whole[:, 2:4], B.to_device(rng.standard_normal((3, 2)))
    assert not x.flags.c_contiguous
    g = numerical_gradient(lambda: (x * x * other).sum(), x)
    assert rel_error(g, 2 * x * other) < 1e-8
    assert np.array_equal(B.to_host(whole), before)
    gt = numerical_gradient(lambda: (whole.T * 3.0).sum(), whole.T)
    assert rel_error(gt, B.to_device(np.full((6, 3), 3.0))) < 1e-9


def test_numerical_gradient_of_reduces_against_dout(backend):
    # sum(2 * x * dout) has gradient 2 * dout.
    rng = np.random.default_rng(1)
    x, dout = B.to_device(rng.standard_normal((2, 3))), B.to_device(rng.standard_normal((2, 3)))
    g = numerical_gradient_of(lambda x: (2 * x, None), {"x": x}, "x", dout)
    assert rel_error(g, 2 * dout) < 1e-9


def test_rel_error_basics(backend):
    a = B.to_device(np.array([1.0, 2.0, 3.0]))
    assert rel_error(a, a) == 0.0
    assert rel_error(a, -a) == pytest.approx(1.0)                # opposite directions: the maximum
    assert rel_error(a, 1.01 * a) == pytest.approx(0.01 / 2.01)  # scale-free: |a - b| / (|a| + |b|)
    assert rel_error(1e6 * a, 1.01e6 * a) == pytest.approx(0.01 / 2.01)
    # Both (near) zero: the absolute difference, not a meaningless ratio of rounding noise.
    z, tiny = B.to_device(np.zeros(3)), B.to_device(np.array([1e-9, 0.0, 0.0]))
    assert rel_error(z, tiny) == pytest.approx(1e-9)
    assert rel_error(z, z) == 0.0


def test_rel_error_rejects_different_shapes(backend):
    with pytest.raises(ValueError, match="shapes differ"):
        rel_error(B.to_device(np.zeros(3)), B.to_device(np.zeros(4)))


@given(lead=leading_shapes(max_dims=2), data=st.data())
def test_check_layer_passes_a_correct_backward(backend, lead, data):
    x = data.draw(normals(lead + (3,)))
    w, b = data.draw(normals((3, 2))), data.draw(normals((2,)))
    errors = check_layer("linear", linear_forward, linear_backward,
                         {"x": B.to_device(x), "w": B.to_device(w), "b": B.to_device(b)}, ("x", "w", "b"))
    assert set(errors) == {"x", "w", "b"} and max(errors.values()) < 1e-8


def test_check_layer_fails_on_a_slightly_wrong_backward(backend):
    """dw off by 1% (a plausible bug) must fail, naming the layer and the argument."""
    def broken_backward(dout, cache):
        dx, dw, db = linear_backward(dout, cache)
        return dx, dw * 1.01, db

    rng = np.random.default_rng(2)
    args = {"x": B.to_device(rng.standard_normal((2, 3, 4))), "w": B.to_device(rng.standard_normal((4, 5))),
            "b": B.to_device(rng.standard_normal(5))}
    with pytest.raises(AssertionError, match=r"broken_linear.*\bw: ") as info:
        check_layer("broken_linear", linear_forward, broken_backward, args, ("x", "w", "b"))
    assert "x:" not in str(info.value) and "b:" not in str(info.value)   # only the broken one is named


def test_check_layer_fails_on_a_wrong_sign(backend):
    def backward(dout, cache):
        dx, dw, db = linear_backward(dout, cache)
        return dx, dw, -db

    rng = np.random.default_rng(3)
    args = {"x": B.to_device(rng.standard_normal((3, 2))), "w": B.to_device(rng.standard_normal((2, 2))),
            "b": B.to_device(rng.standard_normal(2))}
    with pytest.raises(AssertionError, match=r"linear.*\bb: "):
        check_layer("linear", linear_forward, backward, args, ("x", "w", "b"))


def test_check_layer_rejects_a_gradient_count_mismatch(backend):
    rng = np.random.default_rng(4)
    args = {"x": B.to_device(rng.standard_normal((3, 2))), "w": B.to_device(rng.standard_normal((2, 2))),
            "b": B.to_device(rng.standard_normal(2))}
    with pytest.raises(ValueError, match="3 gradients for 2 arguments"):
        check_layer("linear", linear_forward, linear_backward, args, ("x", "w"))

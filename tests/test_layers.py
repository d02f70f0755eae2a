"""Every layer in attn/layers: its backward against central differences (float64, every
input and parameter, relative error below 1e-6), the invariants a reader would state
aloud, clear errors on bad input, and float32 in, float32 out.

The strategies and invariants come from attn.testing, which attn-check grades learners with.
Arrays are drawn on the host and moved with ``to_device``, so the
same tests run on NumPy and, where a GPU is usable, on CuPy (the ``backend`` fixture).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import attn.backend as B
from attn.layers import (attention_backward, attention_forward, attention_weights, dropout_backward, dropout_forward,
                         embedding_backward, embedding_forward, feed_forward_backward, feed_forward_forward,
                         layer_norm_backward, layer_norm_forward, linear_backward, linear_forward, merge_heads,
                         multi_head_attention_backward, multi_head_attention_forward, positional_backward,
                         positional_forward, relu_backward, relu_forward, residual_ffn_backward,
                         residual_ffn_forward, sinusoidal_table, softmax_backward, softmax_forward, split_heads)
from attn.masks import causal_mask, padding_mask
from attn.testing import (assert_attention_ignores_unseen_keys, assert_causal_mask_properties,
                          assert_dropout_properties, assert_embedding_properties, assert_heads_round_trip,
                          assert_layer_norm_properties, assert_no_look_ahead, assert_padding_ignored,
                          assert_positional_properties, assert_sinusoidal_table_properties,
                          assert_softmax_properties, away_from, causal, check_gradients, dims, floats,
                          leading_shapes, logits, masks, normals, padded_ids, padding_masks, token_ids)

dev, host = B.to_device, B.to_host

# Inputs of gradient checks. A central difference cannot resolve a gradient much smaller than
# the function it differentiates: its rounding floor is about ulp(f) / (h |g|), so a relative
# error of 1e-6 needs |g| / |f| above about 1e-4. Hypothesis' edge values reach below that
# (a layer-norm row (0, 1e-5) with eps = 1, a zero key with D = 1) without anything being
# wrong, so the checks of smooth layers draw Gaussian values (``normals``), as CS231n does;
# piecewise-linear layers (relu, dropout, positional) keep hypothesis' ``floats``, and the
# invariant tests below keep them everywhere.
small_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)
seeds = st.integers(0, 2**31 - 1)


def ref_softmax(x, mask=None):
    """float64 host reference: exp of the logits shifted by the row maximum over the
    unmasked positions; masked positions and fully masked rows are 0."""
    x = np.asarray(x, dtype=np.float64)
    if mask is not None:
        x = np.where(np.broadcast_to(mask, x.shape), x, -np.inf)
    top = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(top), top, 0.0))
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)

# ============================================================================ linear


@given(lead=leading_shapes(1, 3), din=st.integers(1, 5), dout=st.integers(1, 5), data=st.data())
def test_linear_gradients(backend, lead, din, dout, data):
    x = data.draw(normals(lead + (din,)))
    w, b = data.draw(normals((din, dout))), data.draw(normals((dout,)))
    check_gradients("linear", linear_forward, linear_backward,
                    {"x": dev(x), "w": dev(w), "b": dev(b)}, ("x", "w", "b"))


@given(lead=leading_shapes(1, 3), din=st.integers(1, 4), dout=st.integers(1, 4), data=st.data())
def test_linear_computes_x_w_plus_b_over_leading_axes(backend, lead, din, dout, data):
    x, w, b = data.draw(floats(lead + (din,))), data.draw(normals((din, dout))), data.draw(normals((dout,)))
    out, _ = linear_forward(dev(x), dev(w), dev(b))
    assert out.shape == lead + (dout,)
    np.testing.assert_allclose(host(out), np.einsum("...i,io->...o", x, w) + b, rtol=1e-12, atol=1e-12)
    out_nob, _ = linear_forward(dev(x), dev(w))
    np.testing.assert_allclose(host(out_nob), np.einsum("...i,io->...o", x, w), rtol=1e-12, atol=1e-12)


def test_linear_rejects_bad_input(backend):
    x, w, b = dev(np.ones((2, 3))), dev(np.ones((3, 4))), dev(np.ones(4))
    with pytest.raises(ValueError, match=r"linear: x has shape \(2, 5\).*must be 3"):
        linear_forward(dev(np.ones((2, 5))), w, b)
    with pytest.raises(ValueError, match="linear: w must be 2-D"):
        linear_forward(x, dev(np.ones(3)), b)
    with pytest.raises(ValueError, match=r"linear: b has shape \(3,\), expected \(4,\)"):
        linear_forward(x, w, dev(np.ones(3)))
    with pytest.raises(TypeError, match="linear: x must be a floating-point array, got dtype int"):
        linear_forward(dev(np.ones((2, 3), dtype=np.int64)), w, b)
    with pytest.raises(TypeError, match="linear: arguments must share one dtype, got x float32, w float64"):
        linear_forward(dev(np.ones((2, 3), dtype=np.float32)), w, b)

# ============================================================================ relu


@given(shape=small_shapes, data=st.data())
def test_relu_gradients(backend, shape, data):
    # ReLU has no derivative at 0: keep inputs 1e-4 away from it (h is 1e-6).
    x = data.draw(away_from(shape, (0.0,), margin=1e-4))
    check_gradients("relu", relu_forward, relu_backward, {"x": dev(x)}, ("x",))


@given(x=floats(small_shapes))
def test_relu_is_max_of_x_and_zero(backend, x):
    out, _ = relu_forward(dev(x))
    np.testing.assert_array_equal(host(out), np.maximum(x, 0.0))

# ============================================================================ dropout


@given(shape=small_shapes, p=st.sampled_from([0.0, 0.1, 0.5, 0.9]), seed=seeds, data=st.data())
def test_dropout_gradients_with_a_fixed_mask(backend, shape, p, seed, data):
    # A fresh DeviceRNG with the same seed for every forward call draws the same mask.
    x = data.draw(floats(shape))
    check_gradients(f"dropout(p={p})", lambda x: dropout_forward(x, p, B.DeviceRNG(seed)), dropout_backward,
                    {"x": dev(x)}, ("x",))


@given(x=floats(small_shapes), seed=seeds)
def test_dropout_p0_and_no_rng_are_the_identity(backend, x, seed):
    xd = dev(x)
    for out, cache in (dropout_forward(xd, 0.0, B.DeviceRNG(seed)), dropout_forward(xd, 0.5, None)):
        np.testing.assert_array_equal(host(out), x)
        assert cache.mask is None
        np.testing.assert_array_equal(host(dropout_backward(xd, cache)), x)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_keeps_the_expectation(backend, p):
    n = 200_000
    out, _ = dropout_forward(dev(np.ones(n)), p, B.DeviceRNG(0))
    out = host(out)
    kept = out != 0
    np.testing.assert_allclose(out[kept], 1.0 / (1.0 - p), rtol=1e-12)     # kept units scaled by 1/(1-p)
    # Each unit is 1/(1-p) with probability 1-p: mean 1, variance p/(1-p).
    stderr = math.sqrt(p / (1.0 - p) / n)
    assert abs(out.mean() - 1.0) < 5 * stderr
    assert abs(kept.mean() - (1.0 - p)) < 5 * math.sqrt(p * (1 - p) / n)


def test_dropout_backward_reuses_the_forward_mask(backend):
    rng = np.random.default_rng(0)
    x, dout = rng.uniform(1.0, 2.0, (50, 40)), rng.standard_normal((50, 40))
    assert_dropout_properties(dropout_forward, dropout_backward, x, 0.3, 5, dout)


@given(shape=small_shapes, p=st.sampled_from([0.0, 0.1, 0.5, 0.9]), seed=seeds, data=st.data())
def test_dropout_keeps_or_scales_every_unit_and_backward_uses_the_same_mask(backend, shape, p, seed, data):
    x = data.draw(away_from(shape, (0.0,), margin=1e-3))
    assert_dropout_properties(dropout_forward, dropout_backward, x, p, seed, data.draw(normals(shape)))


def test_dropout_draws_a_fresh_mask_per_call_and_repeats_per_seed(backend):
    x = dev(np.ones((64, 64)))
    rng = B.DeviceRNG(1)
    first, second = host(dropout_forward(x, 0.5, rng)[0]), host(dropout_forward(x, 0.5, rng)[0])
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(first, host(dropout_forward(x, 0.5, B.DeviceRNG(1))[0]))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_rejects_p_outside_0_1(backend, p):
    with pytest.raises(ValueError, match=r"dropout: p must be in \[0, 1\)"):
        dropout_forward(dev(np.ones(3)), p, B.DeviceRNG(0))

# ============================================================================ embedding


@given(lead=leading_shapes(1, 2, max_side=4), V=st.integers(1, 6), D=st.integers(1, 4),
       scale=st.sampled_from([1.0, 0.5, 2.0, math.sqrt(8)]), data=st.data())
def test_embedding_gradients(backend, lead, V, D, scale, data):
    ids = dev(data.draw(token_ids(lead, V)))           # with at least one repeated id
    W = data.draw(normals((V, D)))
    check_gradients("embedding", lambda W: embedding_forward(ids, W, scale), embedding_backward,
                    {"W": dev(W)}, ("W",))


@given(lead=leading_shapes(1, 2, max_side=5), V=st.integers(1, 5), D=st.integers(1, 3),
       scale=st.sampled_from([1.0, 3.0]), data=st.data())
def test_embedding_looks_up_scaled_rows_and_accumulates_repeats(backend, lead, V, D, scale, data):
    ids, W = data.draw(token_ids(lead, V)), data.draw(normals((V, D)))
    dout = data.draw(normals(lead + (D,)))
    assert_embedding_properties(embedding_forward, embedding_backward, ids, W, scale, dout)
    out, cache = embedding_forward(dev(ids), dev(W), scale)
    dW = host(embedding_backward(dev(dout), cache))
    expected = np.zeros((V, D))
    for i, g in zip(ids.reshape(-1), dout.reshape(-1, D)):      # the obvious loop
        expected[i] += scale * g
    np.testing.assert_allclose(dW, expected, rtol=1e-12, atol=1e-12)


def test_embedding_gradient_counts_every_repeat(backend):
    W = dev(np.zeros((3, 2)))
    _, cache = embedding_forward(dev(np.array([[2, 2], [2, 0]])), W)
    dW = host(embedding_backward(dev(np.ones((2, 2, 2))), cache))
    np.testing.assert_array_equal(dW, [[1, 1], [0, 0], [3, 3]])


def test_embedding_rejects_bad_input(backend):
    W = dev(np.ones((5, 2)))
    with pytest.raises(TypeError, match="embedding: ids must be an integer array"):
        embedding_forward(dev(np.array([1.0, 2.0])), W)
    with pytest.raises(IndexError, match=r"embedding: ids \(shape \(1, 2\)\) holds ids in \[1, 5\], "
                                         r"outside the vocabulary \[0, 5\)"):
        embedding_forward(dev(np.array([[1, 5]])), W)
    with pytest.raises(IndexError, match=r"embedding: ids.*\[-1, 2\].*\[0, 5\)"):
        embedding_forward(dev(np.array([-1, 2])), W)
    with pytest.raises(ValueError, match="embedding: W must be 2-D"):
        embedding_forward(dev(np.array([1])), dev(np.ones(5)))

# ============================================================================ positional


def test_sinusoidal_table_is_the_papers_formula():
    pe = sinusoidal_table(50, 6, dtype="float64")
    assert pe.shape == (50, 6)
    np.testing.assert_array_equal(pe[0], [0, 1, 0, 1, 0, 1])                  # sin 0, cos 0
    assert pe[1, 0] == pytest.approx(math.sin(1.0), abs=1e-15)
    assert pe[1, 1] == pytest.approx(math.cos(1.0), abs=1e-15)
    assert pe[1, 2] == pytest.approx(math.sin(1.0 / 10000 ** (2 / 6)), abs=1e-15)
    assert pe[7, 5] == pytest.approx(math.cos(7.0 / 10000 ** (4 / 6)), abs=1e-15)
    for pos in (0, 3, 49):                                                    # every entry, by the formula
        for i in range(3):
            angle = pos / 10000 ** (2 * i / 6)
            assert pe[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-14)
            assert pe[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-14)


@given(L=st.integers(1, 30), D=st.integers(1, 9))
def test_sinusoidal_table_any_size(L, D):
    assert_sinusoidal_table_properties(sinusoidal_table, L, D)               # every entry, odd D included
    pe = sinusoidal_table(L, D, dtype="float64")
    assert np.isfinite(pe).all() and np.abs(pe).max() <= 1.0
    assert sinusoidal_table(L, D).dtype == np.float32                         # float32 by default


def test_sinusoidal_table_rejects_empty_sizes():
    with pytest.raises(ValueError, match="max_len and d_model must be positive"):
        sinusoidal_table(0, 4)


@given(d=dims(), extra=st.integers(0, 3), data=st.data())
def test_positional_gradients_learned_table(backend, d, extra, data):
    x, table = data.draw(floats((d.B, d.T, d.D))), data.draw(normals((d.T + extra, d.D)))
    check_gradients("positional(learned)", positional_forward, positional_backward,
                    {"x": dev(x), "table": dev(table)}, ("x", "table"))


@given(d=dims(), data=st.data())
def test_positional_sinusoidal_adds_the_table_and_passes_the_gradient_through(backend, d, data):
    x = data.draw(floats((d.B, d.T, d.D)))
    table = dev(sinusoidal_table(d.T + 2, d.D, dtype="float64"))
    check_gradients("positional(sinusoidal)", lambda x: positional_forward(x, table),
                    lambda dout, cache: positional_backward(dout, cache)[0], {"x": dev(x)}, ("x",))
    # out = x + table[:T]; dx = dout; dtable: the batch sum of dout, zero on unused positions
    assert_positional_properties(positional_forward, positional_backward, x, host(table), data.draw(normals(x.shape)))


def test_positional_takes_the_host_table_sinusoidal_table_returns(backend):
    """``sinusoidal_table`` gives a host table; beside a device ``x`` its rows move to x's device
    (the whole-model lesson adds it to a device embedding), and the reverse works too."""
    x = np.random.default_rng(0).standard_normal((2, 5, 4))
    table = sinusoidal_table(7, 4, dtype="float64")
    out, cache = positional_forward(dev(x), table)
    assert B.get_array_module(out) is B.get_array_module(dev(x))
    np.testing.assert_array_equal(host(out), x + table[:5])
    back, _ = positional_forward(x, dev(table))
    assert isinstance(back, np.ndarray) and np.array_equal(back, x + table[:5])
    dx, dtable = positional_backward(dev(np.ones_like(x)), cache)
    assert dtable.shape == (7, 4) and np.array_equal(host(dtable)[:5], np.full((5, 4), 2.0))


def test_positional_rejects_bad_input(backend):
    x = dev(np.ones((2, 5, 4)))
    with pytest.raises(ValueError, match="positional: sequence length 5 exceeds .* 3 positions"):
        positional_forward(x, dev(np.ones((3, 4))))
    with pytest.raises(ValueError, match=r"positional: table has shape \(8, 3\).*last dimensions must agree"):
        positional_forward(x, dev(np.ones((8, 3))))

# ============================================================================ softmax


@given(lead=leading_shapes(1, 3), K=st.integers(1, 6), masked=st.booleans(), data=st.data())
def test_softmax_gradients(backend, lead, K, masked, data):
    x = data.draw(floats(lead + (K,)))
    mask = dev(data.draw(masks(lead + (K,), ensure_key=data.draw(st.booleans())))) if masked else None
    check_gradients("softmax" + ("(masked)" if masked else ""), lambda x: softmax_forward(x, mask),
                    softmax_backward, {"x": dev(x)}, ("x",))


@given(lead=leading_shapes(1, 3), K=st.integers(1, 6), masked=st.booleans(), data=st.data())
def test_softmax_rows_sum_to_one_and_masked_weights_are_zero(backend, lead, K, masked, data):
    x = data.draw(logits(lead + (K,)))
    m = data.draw(masks(lead + (K,))) if masked else None                    # every row keeps a key
    assert_softmax_properties(softmax_forward, softmax_backward, x, m, data.draw(normals(x.shape)))


@given(lead=leading_shapes(1, 2), K=st.integers(1, 6), data=st.data())
def test_softmax_is_unchanged_by_a_constant_per_row(backend, lead, K, data):
    x = data.draw(floats(lead + (K,)))
    c = data.draw(floats(lead + (1,), bound=100.0))
    y, y_shift = (host(softmax_forward(dev(a))[0]) for a in (x, x + c))
    np.testing.assert_allclose(y_shift, y, rtol=1e-10, atol=1e-14)


@given(lead=leading_shapes(1, 2), K=st.integers(1, 6), masked=st.booleans(),
       dtype=st.sampled_from(["float64", "float32"]), data=st.data())
def test_softmax_is_stable_for_logits_of_magnitude_1e4(backend, lead, K, masked, dtype, data):
    x = data.draw(floats(lead + (K,), 1.0)) * 1e4
    m = data.draw(masks(lead + (K,), fully_masked_row=data.draw(st.booleans()))) if masked else None
    y = host(softmax_forward(dev(x, dtype=dtype), None if m is None else dev(m))[0])
    assert y.dtype == np.dtype(dtype) and np.isfinite(y).all()
    expected = ref_softmax(x.astype(dtype), m)                   # float64, on shifted logits
    np.testing.assert_allclose(y, expected, rtol=1e-12 if dtype == "float64" else 1e-5, atol=1e-7)


def test_softmax_mask_beats_any_logit(backend):
    # A magic -1e4 fill would lose to a real logit of -2e4; the dtype's minimum does not.
    for dtype in ("float32", "float64"):
        x, m = dev(np.array([[-2e4, 0.0, 3e4]]), dtype=dtype), dev(np.array([[True, False, False]]))
        np.testing.assert_array_equal(host(softmax_forward(x, m)[0]), [[1.0, 0.0, 0.0]])


@given(lead=leading_shapes(1, 3), K=st.integers(1, 6), data=st.data())
def test_softmax_fully_masked_row_is_zero_with_zero_gradient(backend, lead, K, data):
    x = data.draw(logits(lead + (K,)))
    m = data.draw(masks(lead + (K,), broadcast=False, fully_masked_row=True))
    # zeros on the dead row (not uniform, not NaN), no gradient to any masked logit
    assert_softmax_properties(softmax_forward, softmax_backward, x, m, data.draw(normals(x.shape)))


@pytest.mark.parametrize("T", range(1, 9))
def test_causal_mask_sees_the_past_and_itself(backend, T):
    assert_causal_mask_properties(causal_mask, T)


@given(d=dims(), data=st.data())
def test_softmax_masks_broadcast_like_padding_and_causal_masks(backend, d, data):
    x = data.draw(floats((d.B, d.H, d.T, d.T)))
    ids = dev(data.draw(padded_ids(d.B, d.T, d.V)))
    mask = causal_mask(d.T, backend) & padding_mask(ids)                     # (B, 1, T, T)
    y = host(softmax_forward(dev(x), mask)[0])
    np.testing.assert_allclose(y, ref_softmax(x, host(mask)), rtol=1e-12, atol=1e-300)
    assert not np.triu(y, k=1).any()                                          # no weight on future keys

# ============================================================================ layer norm


@given(lead=leading_shapes(1, 3), D=st.integers(1, 6), data=st.data())
def test_layer_norm_gradients(backend, lead, D, data):
    # With D = 2 every row normalises to about (-1, 1) whatever x is: dx is only about
    # eps / (var + eps)^1.5, below what a central difference resolves (see normals) unless
    # var is not much larger than eps. Those rows get a large eps and small values.
    eps = data.draw(st.sampled_from([1e-5, 1e-3, 0.1, 1.0] if D != 2 else [0.1, 1.0]))
    scale = data.draw(st.sampled_from([0.1, 1.0, 10.0] if D != 2 else [0.1, 1.0]))
    x = data.draw(normals(lead + (D,), scale))
    gamma, beta = data.draw(normals((D,))), data.draw(normals((D,)))
    check_gradients(f"layer_norm(eps={eps:g})", lambda x, gamma, beta: layer_norm_forward(x, gamma, beta, eps),
                    layer_norm_backward, {"x": dev(x), "gamma": dev(gamma), "beta": dev(beta)},
                    ("x", "gamma", "beta"))


@pytest.mark.parametrize("row", [[2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3e-3], [1.0, -1.0, 1e-3, 0.0]])
def test_layer_norm_gradients_where_eps_matters(backend, row):
    """A constant row (variance 0: only eps keeps 1/sqrt(var + eps) finite) and a variance of
    the order of eps, at the default eps."""
    x = np.array([row, [0.5, -1.0, 2.0, 0.25]])
    rng = np.random.default_rng(0)
    check_gradients("layer_norm(degenerate rows)", layer_norm_forward, layer_norm_backward,
                    {"x": dev(x), "gamma": dev(rng.standard_normal(4)), "beta": dev(rng.standard_normal(4))},
                    ("x", "gamma", "beta"))


@given(lead=leading_shapes(1, 3), D=st.integers(1, 8), eps=st.sampled_from([1e-12, 1e-5, 1e-2]), data=st.data())
def test_layer_norm_output_has_zero_mean_and_unit_variance(backend, lead, D, eps, data):
    x = data.draw(floats(lead + (D,), bound=100.0))
    assert_layer_norm_properties(layer_norm_forward, None, x, eps)


@given(lead=leading_shapes(1, 3), D=st.integers(1, 8), data=st.data())
def test_layer_norm_input_gradient_sums_to_zero_per_row(backend, lead, D, data):
    # Adding a constant to a row leaves the output alone, so dx is orthogonal to (1, ..., 1);
    # scaling a row about its mean changes it only through eps, which fixes sum(dx * xhat).
    x, gamma, dout = data.draw(floats(lead + (D,))), data.draw(normals((D,))), data.draw(normals(lead + (D,)))
    assert_layer_norm_properties(layer_norm_forward, layer_norm_backward, x, 1e-5, gamma, dout)


def test_layer_norm_rejects_bad_input(backend):
    x, g = dev(np.ones((2, 4))), dev(np.ones(4))
    with pytest.raises(ValueError, match=r"layer_norm: gamma has shape \(3,\), but its last dimension must be 4"):
        layer_norm_forward(x, dev(np.ones(3)), g)
    with pytest.raises(ValueError, match="layer_norm: beta has shape"):
        layer_norm_forward(x, g, dev(np.ones(5)))
    with pytest.raises(TypeError, match="layer_norm: x must be a floating-point array"):
        layer_norm_forward(dev(np.ones((2, 4), dtype=np.int32)), g, g)
    with pytest.raises(TypeError, match="layer_norm: arguments must share one dtype, got x float64, gamma float32"):
        layer_norm_forward(x, dev(np.ones(4), dtype="float32"), g)

# ============================================================================ feed-forward


@given(d=dims(), p=st.sampled_from([0.0, 0.0, 0.3]), seed=seeds, data=st.data())
def test_feed_forward_gradients(backend, d, p, seed, data):
    x = data.draw(normals((d.B, d.T, d.D)))
    w1, b1 = data.draw(normals((d.D, d.F))), data.draw(normals((d.F,)))
    w2, b2 = data.draw(normals((d.F, d.D))), data.draw(normals((d.D,)))
    assume(np.abs(x @ w1 + b1).min() > 1e-4)                  # ReLU's kink is not differentiable
    args = {"x": dev(x), "w1": dev(w1), "b1": dev(b1), "w2": dev(w2), "b2": dev(b2)}

    def forward(**a):     # relu dropout, the same mask every call
        return feed_forward_forward(**a, dropout=p, rng=B.DeviceRNG(seed) if p else None)
    check_gradients(f"feed_forward(dropout={p})", forward, feed_forward_backward, args, tuple(args))


@given(d=dims(), data=st.data())
def test_feed_forward_is_relu_sandwich(backend, d, data):
    x = data.draw(floats((d.B, d.T, d.D)))
    w1, b1, w2, b2 = (data.draw(normals(s)) for s in ((d.D, d.F), (d.F,), (d.F, d.D), (d.D,)))
    out, _ = feed_forward_forward(*(dev(a) for a in (x, w1, b1, w2, b2)))
    np.testing.assert_allclose(host(out), np.maximum(x @ w1 + b1, 0) @ w2 + b2, rtol=1e-12, atol=1e-12)

@given(d=dims(), eps=st.sampled_from([1e-5, 0.1, 1.0]), data=st.data())
def test_residual_ffn_gradients(backend, d, eps, data):
    # LayerNorm(x + FFN(x)): x reaches the sum by the skip path and through the network.
    if d.D == 2:
        eps = max(eps, 0.1)               # see test_layer_norm_gradients: D = 2 needs var not >> eps
    x = data.draw(normals((d.B, d.T, d.D)))
    w1, b1 = data.draw(normals((d.D, d.F))), data.draw(normals((d.F,)))
    w2, b2 = data.draw(normals((d.F, d.D))), data.draw(normals((d.D,)))
    assume(np.abs(x @ w1 + b1).min() > 1e-4)                  # ReLU's kink is not differentiable
    args = {"x": dev(x), "w1": dev(w1), "b1": dev(b1), "w2": dev(w2), "b2": dev(b2),
            "gamma": dev(data.draw(normals((d.D,)))), "beta": dev(data.draw(normals((d.D,))))}
    check_gradients(f"residual_ffn(eps={eps:g})", lambda **a: residual_ffn_forward(**a, eps=eps),
                    residual_ffn_backward, args, tuple(args))


@given(d=dims(), data=st.data())
def test_residual_ffn_is_layer_norm_of_x_plus_ffn(backend, d, data):
    x = data.draw(floats((d.B, d.T, d.D)))
    w1, b1, w2, b2, g, b = (data.draw(normals(s)) for s in ((d.D, d.F), (d.F,), (d.F, d.D), (d.D,), (d.D,), (d.D,)))
    out, _ = residual_ffn_forward(*(dev(a) for a in (x, w1, b1, w2, b2, g, b)))
    z = x + np.maximum(x @ w1 + b1, 0) @ w2 + b2
    zhat = (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(host(out), g * zhat + b, rtol=1e-10, atol=1e-10)

# ============================================================================ attention


@given(d=dims(), heads_axis=st.booleans(), masked=st.booleans(), p=st.sampled_from([0.0, 0.0, 0.2]),
       seed=seeds, data=st.data())
def test_attention_gradients(backend, d, heads_axis, masked, p, seed, data):
    lead = (d.B, d.H) if heads_axis else (d.B,)
    Dk, Dv = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    q, k, v = (data.draw(normals(lead + s)) for s in ((d.T, Dk), (d.S, Dk), (d.S, Dv)))
    mask = dev(data.draw(masks(lead + (d.T, d.S)))) if masked else None    # a real key in every row

    def forward(q, k, v):
        return attention_forward(q, k, v, mask, p, B.DeviceRNG(seed) if p else None)
    check_gradients(f"attention(masked={masked}, dropout={p})", forward, attention_backward,
                    {"q": dev(q), "k": dev(k), "v": dev(v)}, ("q", "k", "v"))


@given(d=dims(), data=st.data())
def test_attention_is_softmax_of_scaled_scores_times_v_and_ignores_masked_keys(backend, d, data):
    q, k, v = (data.draw(floats(s)) for s in ((d.B, d.T, d.D), (d.B, d.S, d.D), (d.B, d.S, d.F)))
    m = data.draw(masks((d.B, d.T, d.S), fully_masked_row=data.draw(st.booleans())))
    out, cache = attention_forward(dev(q), dev(k), dev(v), dev(m))
    w = ref_softmax(q @ k.transpose(0, 2, 1) / math.sqrt(d.D), m)
    np.testing.assert_allclose(host(cache.weights), w, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(host(out), w @ v, rtol=1e-12, atol=1e-12)
    assert (host(cache.weights)[~np.broadcast_to(m, w.shape)] == 0.0).all()     # exactly zero
    assert_attention_ignores_unseen_keys(attention_forward, q, k, v, m)       # hidden keys can hold anything


def test_attention_rejects_mismatched_shapes(backend):
    q, k, v = dev(np.ones((2, 3, 4))), dev(np.ones((2, 5, 4))), dev(np.ones((2, 5, 6)))
    with pytest.raises(ValueError, match=r"attention: q \(2, 3, 4\), k \(2, 5, 3\).*q and k need the same last"):
        attention_forward(q, dev(np.ones((2, 5, 3))), v)
    with pytest.raises(ValueError, match=r"attention: .*v \(2, 4, 6\).*k and v the same length"):
        attention_forward(q, k, dev(np.ones((2, 4, 6))))

# ============================================================================ multi-head attention


def mha_params(data, D):
    """w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o on the host, weights scaled 1/sqrt(D)."""
    out = {}
    for n in "qkvo":
        out[f"w_{n}"] = data.draw(normals((D, D), 1.0 / math.sqrt(D)))
        out[f"b_{n}"] = data.draw(normals((D,), 0.1))
    return out


def mha_loop(x_q, x_kv, p, H, mask=None):
    """The paper's formula head by head, on the host: head_i = Attention(x_q W_i^Q, x_kv W_i^K,
    x_kv W_i^V) with W_i the i-th block of Dh columns; then Concat(heads) W^O."""
    B_, Tq, D = x_q.shape
    Tk, Dh = x_kv.shape[1], D // H
    heads, weights = [], []
    m = None if mask is None else np.broadcast_to(mask, (B_, H, Tq, Tk))
    for h in range(H):
        cols = slice(h * Dh, (h + 1) * Dh)
        q = x_q @ p["w_q"][:, cols] + p["b_q"][cols]
        k = x_kv @ p["w_k"][:, cols] + p["b_k"][cols]
        v = x_kv @ p["w_v"][:, cols] + p["b_v"][cols]
        w = ref_softmax(q @ k.transpose(0, 2, 1) / math.sqrt(Dh), None if m is None else m[:, h])
        heads.append(w @ v)
        weights.append(w)
    return np.concatenate(heads, axis=-1) @ p["w_o"] + p["b_o"], np.stack(weights, axis=1)


def _self_attention(H, mask, p, seed):
    """forward(x, params) and backward for self-attention: x feeds queries, keys and values."""
    def forward(x, **params):
        return multi_head_attention_forward(x, x, **params, n_heads=H, mask=mask, dropout=p,
                                            rng=B.DeviceRNG(seed) if p else None)

    def backward(dout, cache):
        dx_q, dx_kv, *dparams = multi_head_attention_backward(dout, cache)
        return (dx_q + dx_kv, *dparams)
    return forward, backward


PARAM_NAMES = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")


@given(d=dims(), mask_kind=st.sampled_from(["none", "causal", "padding", "random"]),
       p=st.sampled_from([0.0, 0.0, 0.2]), seed=seeds, data=st.data())
def test_multi_head_self_attention_gradients(backend, d, mask_kind, p, seed, data):
    x = data.draw(normals((d.B, d.T, d.D)))
    params = mha_params(data, d.D)
    mask = {"none": None, "causal": causal(d.T),
            "padding": data.draw(padding_masks(d.B, d.T)) if mask_kind == "padding" else None,
            "random": data.draw(masks((d.B, d.H, d.T, d.T))) if mask_kind == "random" else None}[mask_kind]
    forward, backward = _self_attention(d.H, None if mask is None else dev(mask), p, seed)
    args = {"x": dev(x), **{k: dev(v) for k, v in params.items()}}
    check_gradients(f"multi_head_attention(self, H={d.H}, mask={mask_kind}, dropout={p})", forward, backward,
                    args, ("x",) + PARAM_NAMES)


@given(d=dims(), masked=st.booleans(), p=st.sampled_from([0.0, 0.0, 0.2]), seed=seeds, data=st.data())
def test_multi_head_cross_attention_gradients(backend, d, masked, p, seed, data):
    x_q, x_kv = data.draw(normals((d.B, d.T, d.D))), data.draw(normals((d.B, d.S, d.D)))
    params = mha_params(data, d.D)
    mask = dev(data.draw(padding_masks(d.B, d.S))) if masked else None

    def forward(x_q, x_kv, **params):
        return multi_head_attention_forward(x_q, x_kv, **params, n_heads=d.H, mask=mask, dropout=p,
                                            rng=B.DeviceRNG(seed) if p else None)
    args = {"x_q": dev(x_q), "x_kv": dev(x_kv), **{k: dev(v) for k, v in params.items()}}
    check_gradients(f"multi_head_attention(cross, H={d.H}, masked={masked}, dropout={p})", forward,
                    multi_head_attention_backward, args, ("x_q", "x_kv") + PARAM_NAMES)


@given(d=dims(), masked=st.booleans(), data=st.data())
def test_multi_head_reshapes_equal_a_loop_over_heads(backend, d, masked, data):
    x_q, x_kv = data.draw(floats((d.B, d.T, d.D))), data.draw(floats((d.B, d.S, d.D)))
    params = mha_params(data, d.D)
    m = data.draw(masks((d.B, d.H, d.T, d.S), fully_masked_row=data.draw(st.booleans()))) if masked else None
    out, cache = multi_head_attention_forward(dev(x_q), dev(x_kv), **{k: dev(v) for k, v in params.items()},
                                              n_heads=d.H, mask=None if m is None else dev(m))
    expected, weights = mha_loop(x_q, x_kv, params, d.H, m)
    np.testing.assert_allclose(host(out), expected, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(host(cache.attn.weights), weights, rtol=1e-11, atol=1e-300)
    if m is not None:
        assert (host(cache.attn.weights)[~np.broadcast_to(m, weights.shape)] == 0.0).all()


@given(d=dims(), data=st.data())
def test_multi_head_self_attention_with_a_causal_mask_never_looks_ahead(backend, d, data):
    x = data.draw(floats((d.B, d.T, d.D)))
    assert_no_look_ahead(multi_head_attention_forward, x, mha_params(data, d.D), d.H,
                         data.draw(st.integers(0, d.T - 1)))


@given(d=dims(), data=st.data())
def test_multi_head_cross_attention_ignores_padded_source_content(backend, d, data):
    x_q, x_kv = data.draw(floats((d.B, d.T, d.D))), data.draw(floats((d.B, d.S, d.D)))
    assert_padding_ignored(multi_head_attention_forward, x_q, x_kv, mha_params(data, d.D), d.H,
                           data.draw(padded_ids(d.B, d.S, d.V)))


@given(d=dims(), data=st.data())
def test_split_heads_gives_each_head_its_columns_and_merge_undoes_it(backend, d, data):
    assert_heads_round_trip(split_heads, merge_heads, data.draw(floats((d.B, d.T, d.D))), d.H)


def test_attention_weights_reads_either_attention_cache():
    """attn.layers.attention_weights: the public way to the weights an attention forward used."""
    rng = np.random.default_rng(0)
    x_q, x_kv = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    mask = padding_mask(np.array([[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]))
    w, b = [rng.standard_normal((8, 8)) for _ in range(4)], np.zeros(8)
    _, cache = multi_head_attention_forward(x_q, x_kv, w[0], b, w[1], b, w[2], b, w[3], b, n_heads=2, mask=mask)
    weights = attention_weights(cache)
    assert weights.shape == (2, 2, 3, 5) and np.allclose(weights.sum(-1), 1.0)
    assert np.all(weights[0, :, :, 3:] == 0.0), "masked keys get exactly zero weight"
    q, k = x_q @ w[0], x_kv @ w[1]                                 # head 0: the first 4 columns
    s = q[..., :4] @ k[..., :4].swapaxes(-1, -2) / 2.0
    s = np.where(mask[:, 0], s, -np.inf)
    ref = np.exp(s - s.max(-1, keepdims=True)); ref /= ref.sum(-1, keepdims=True)
    assert np.allclose(weights[:, 0], ref, atol=1e-12)
    _, single = attention_forward(q[:, None], k[:, None], x_kv[:, None], mask)
    assert attention_weights(single).shape == (2, 1, 3, 5)
    with pytest.raises(TypeError, match="attention_weights: expected the cache of attention_forward"):
        attention_weights((1, 2))


def test_multi_head_attention_rejects_heads_not_dividing_d_model(backend):
    D = 6
    x = dev(np.ones((1, 2, D)))
    w, b = dev(np.eye(D)), dev(np.zeros(D))
    with pytest.raises(ValueError, match="multi_head_attention: d_model 6 is not divisible by n_heads 4"):
        multi_head_attention_forward(x, x, w, b, w, b, w, b, w, b, n_heads=4)

# ============================================================================ dtypes


def _float32_cases():
    """name -> (forward, backward, host args): one small call of every layer."""
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s)            # noqa: E731
    ids = np.array([[1, 2, 2], [0, 3, 1]])
    mha = {f"{w}_{n}": r(4, 4) if w == "w" else r(4) for n in "qkvo" for w in "wb"}
    mask = causal(3)

    def mha_fwd(x, **p):
        return multi_head_attention_forward(x, x, **p, n_heads=2, mask=dev(mask), dropout=0.1, rng=B.DeviceRNG(0))
    return {
        "linear": (linear_forward, linear_backward, {"x": r(2, 3, 4), "w": r(4, 5), "b": r(5)}),
        "relu": (relu_forward, relu_backward, {"x": r(2, 3)}),
        "dropout": (lambda x: dropout_forward(x, 0.5, B.DeviceRNG(0)), dropout_backward, {"x": r(2, 3)}),
        "embedding": (lambda W: embedding_forward(dev(ids), W, 2.0), embedding_backward, {"W": r(4, 3)}),
        "positional": (positional_forward, positional_backward,
                       {"x": r(2, 3, 4), "table": sinusoidal_table(5, 4)}),
        "softmax": (lambda x: softmax_forward(x, dev(mask)), softmax_backward, {"x": r(2, 3, 3)}),
        "layer_norm": (layer_norm_forward, layer_norm_backward, {"x": r(2, 3, 4), "gamma": r(4), "beta": r(4)}),
        "feed_forward": (lambda **a: feed_forward_forward(**a, dropout=0.1, rng=B.DeviceRNG(0)),
                         feed_forward_backward, {"x": r(2, 3, 4), "w1": r(4, 6), "b1": r(6), "w2": r(6, 4),
                                                 "b2": r(4)}),
        "attention": (lambda q, k, v: attention_forward(q, k, v, dev(mask), 0.1, B.DeviceRNG(0)),
                      attention_backward, {"q": r(2, 3, 4), "k": r(2, 3, 4), "v": r(2, 3, 5)}),
        "multi_head_attention": (mha_fwd, multi_head_attention_backward, {"x": r(2, 3, 4), **mha}),
        "residual_ffn": (residual_ffn_forward, residual_ffn_backward,
                         {"x": r(2, 3, 4), "w1": r(4, 6), "b1": r(6), "w2": r(6, 4), "b2": r(4), "gamma": r(4),
                          "beta": r(4)}),
    }


@pytest.mark.parametrize("layer", list(_float32_cases()))
def test_layers_keep_float32(backend, layer):
    forward, backward, args = _float32_cases()[layer]
    args = {k: dev(v, dtype="float32") for k, v in args.items()}
    out, cache = forward(**args)
    assert out.dtype == np.float32, f"{layer}: forward gave {out.dtype}"
    grads = backward(dev(np.ones(out.shape), dtype="float32"), cache)
    for i, g in enumerate(grads if isinstance(grads, tuple) else (grads,)):
        assert g.dtype == np.float32, f"{layer}: gradient {i} is {g.dtype}"
        assert np.isfinite(host(g)).all()

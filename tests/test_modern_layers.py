"""The layers of the block that models after 2017 use (Llama, Qwen, Gemma, OLMo): rotary
positions, the SwiGLU feed-forward network and grouped-query attention. Each backward
against central differences in float64, and the invariants a reader would state aloud,
on NumPy and on CuPy (the ``backend`` fixture)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn.backend as B
from attn.layers import (multi_head_attention_backward, multi_head_attention_forward, rope_angles,
                         rope_backward, rope_forward, swiglu_backward, swiglu_forward, swiglu_width)
from attn.layers.attention import repeat_kv, sum_kv_groups
from attn.testing import causal, check_gradients, normals

dev, host = B.to_device, B.to_host
seeds = st.integers(0, 2**31 - 1)
lead_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
halves = st.integers(1, 4)          # a head of 2 * half features
lengths = st.integers(1, 6)

# ============================================================================ rotary positions


@given(lead=lead_shapes, T=lengths, half=halves, offset=st.integers(0, 50), data=st.data())
def test_rope_gradients(backend, lead, T, half, offset, data):
    x = data.draw(normals(lead + (T, 2 * half)))
    positions = np.arange(offset, offset + T)
    check_gradients("rope", lambda x: rope_forward(x, positions), rope_backward, {"x": dev(x)}, ("x",))


@given(lead=lead_shapes, T=lengths, half=halves, data=st.data())
def test_rope_keeps_every_pairs_norm(backend, lead, T, half, data):
    x = data.draw(normals(lead + (T, 2 * half)))
    out = host(rope_forward(dev(x))[0])
    pair_norms = lambda a: np.hypot(a[..., :half], a[..., half:])          # noqa: E731
    np.testing.assert_allclose(pair_norms(out), pair_norms(x), rtol=1e-12, atol=1e-12)


@given(half=halves, m=st.integers(0, 200), n=st.integers(0, 200), shift=st.integers(-200, 200),
       base=st.sampled_from([10000.0, 500000.0, 10.0]), data=st.data())
def test_rope_score_depends_only_on_the_offset(backend, half, m, n, shift, base, data):
    """<rope(q, m), rope(k, n)> = <rope(q, m + s), rope(k, n + s)>: a query and a key see how far
    apart they are, not where they are."""
    q, k = data.draw(normals((1, 2 * half))), data.draw(normals((1, 2 * half)))
    shift = max(shift, -min(m, n))

    def score(a, b):
        rq = host(rope_forward(dev(q), np.array([a]), base)[0])
        rk = host(rope_forward(dev(k), np.array([b]), base)[0])
        return float((rq * rk).sum())
    assert score(m, n) == pytest.approx(score(m + shift, n + shift), rel=1e-9, abs=1e-9)


@given(lead=lead_shapes, T=lengths, half=halves, offset=st.integers(0, 1000), data=st.data())
def test_rope_backward_is_the_inverse_rotation(backend, lead, T, half, offset, data):
    x = data.draw(normals(lead + (T, 2 * half)))
    out, cache = rope_forward(dev(x), np.arange(offset, offset + T))
    np.testing.assert_allclose(host(rope_backward(out, cache)), x, rtol=1e-12, atol=1e-12)


def test_rope_leaves_position_zero_alone_and_turns_pairs_by_position_times_theta(backend):
    x = np.random.default_rng(0).standard_normal((3, 6))
    out = host(rope_forward(dev(x), np.array([0, 1, 7]), base=100.0)[0])
    np.testing.assert_array_equal(out[0], x[0])
    theta = 100.0 ** (-np.arange(0, 6, 2) / 6)
    z = (x[:, :3] + 1j * x[:, 3:]) * np.exp(1j * np.array([0, 1, 7])[:, None] * theta)   # complex product
    np.testing.assert_allclose(out, np.concatenate([z.real, z.imag], axis=-1), rtol=1e-12, atol=1e-12)


def test_rope_half_split_is_the_interleaved_pairing_after_a_permutation(backend):
    """GPT-J and RoFormer pair (2i, 2i+1); Llama's code pairs (i, i + Dh/2): one permutation apart."""
    Dh, T = 8, 5
    x = np.random.default_rng(1).standard_normal((T, Dh))
    perm = np.concatenate([np.arange(0, Dh, 2), np.arange(1, Dh, 2)])      # interleaved -> half split
    cos, sin = rope_angles(np.arange(T), Dh)
    inter = x.copy()
    inter[:, 0::2] = x[:, 0::2] * cos - x[:, 1::2] * sin
    inter[:, 1::2] = x[:, 0::2] * sin + x[:, 1::2] * cos
    half = host(rope_forward(dev(x[:, perm]))[0])
    np.testing.assert_allclose(half, inter[:, perm], rtol=1e-12, atol=1e-12)


def test_rope_refuses_an_odd_head_and_positions_of_the_wrong_length(backend):
    with pytest.raises(ValueError, match="even"):
        rope_forward(dev(np.ones((2, 3))))
    with pytest.raises(ValueError, match="positions"):
        rope_forward(dev(np.ones((2, 4))), np.arange(3))
    with pytest.raises(TypeError, match="floating"):
        rope_forward(dev(np.ones((2, 4), dtype=np.int64)))


def test_rope_keeps_float32(backend):
    out, _ = rope_forward(dev(np.ones((2, 3, 4), dtype=np.float32)))
    assert out.dtype == np.float32

# ============================================================================ SwiGLU


@given(lead=lead_shapes, D=st.integers(1, 5), F=st.integers(1, 6), p=st.sampled_from([0.0, 0.0, 0.3]),
       seed=seeds, data=st.data())
def test_swiglu_gradients(backend, lead, D, F, p, seed, data):
    x = data.draw(normals(lead + (D,)))
    w, v, w2 = data.draw(normals((D, F))), data.draw(normals((D, F))), data.draw(normals((F, D)))

    def forward(x, w, v, w2):
        return swiglu_forward(x, w, v, w2, dropout=p, rng=B.DeviceRNG(seed) if p else None)
    check_gradients(f"swiglu(dropout={p})", forward, swiglu_backward,
                    {"x": dev(x), "w": dev(w), "v": dev(v), "w2": dev(w2)}, ("x", "w", "v", "w2"))


@given(lead=lead_shapes, D=st.integers(1, 5), F=st.integers(1, 6), data=st.data())
def test_swiglu_is_silu_of_one_path_times_the_other(backend, lead, D, F, data):
    x = data.draw(normals(lead + (D,)))
    w, v, w2 = data.draw(normals((D, F))), data.draw(normals((D, F))), data.draw(normals((F, D)))
    a = x @ w
    expected = (a / (1 + np.exp(-a)) * (x @ v)) @ w2
    out = host(swiglu_forward(dev(x), dev(w), dev(v), dev(w2))[0])
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


def test_swiglu_gate_neither_overflows_nor_gives_nan_far_from_zero(backend):
    x = np.array([[-1e4], [-100.0], [0.0], [100.0], [1e4]], dtype=np.float32)
    one = np.ones((1, 1), dtype=np.float32)
    with np.errstate(all="raise"):
        out, cache = swiglu_forward(dev(x), dev(one), dev(one), dev(one))
        dx = swiglu_backward(dev(np.ones_like(x)), cache)[0]
    np.testing.assert_allclose(host(out).ravel(), [0, 0, 0, 1e4, 1e8], rtol=1e-6)   # silu(a) * a
    assert np.isfinite(host(dx)).all()


@pytest.mark.parametrize("d_model, d_ff", [(512, 2048), (64, 256), (32, 100), (4096, 11008 * 3 // 2)])
def test_swiglu_width_keeps_the_papers_parameter_count(d_model, d_ff):
    f = swiglu_width(d_ff)
    assert abs(3 * d_model * f - 2 * d_model * d_ff) <= 3 * d_model    # within one column of each matrix
    assert swiglu_width(2048, multiple_of=256) % 256 == 0


def test_swiglu_refuses_mismatched_gate_and_value(backend):
    with pytest.raises(ValueError, match="same shape"):
        swiglu_forward(dev(np.ones((2, 3))), dev(np.ones((3, 4))), dev(np.ones((3, 5))), dev(np.ones((4, 3))))

# ============================================================================ grouped-query attention


@st.composite
def gqa_dims(draw):
    kv = draw(st.integers(1, 2))
    H = kv * draw(st.integers(1, 3))
    Dh = draw(st.integers(1, 3))
    return dict(B=draw(st.integers(1, 2)), T=draw(st.integers(1, 4)), S=draw(st.integers(1, 4)),
                H=H, kv=kv, Dh=Dh, D=H * Dh)


def gqa_params(data, D, kv_width):
    shapes = {"w_q": (D, D), "b_q": (D,), "w_k": (D, kv_width), "b_k": (kv_width,),
              "w_v": (D, kv_width), "b_v": (kv_width,), "w_o": (D, D), "b_o": (D,)}
    return {n: data.draw(normals(s)) for n, s in shapes.items()}


@given(d=gqa_dims(), self_attn=st.booleans(), p=st.sampled_from([0.0, 0.0, 0.2]), seed=seeds, data=st.data())
def test_grouped_query_attention_gradients(backend, d, self_attn, p, seed, data):
    x_q = data.draw(normals((d["B"], d["T"], d["D"])))
    params = gqa_params(data, d["D"], d["kv"] * d["Dh"])
    rng = (lambda: B.DeviceRNG(seed)) if p else (lambda: None)
    attend = dict(n_heads=d["H"], dropout=p, kv_heads=d["kv"])
    if self_attn:                   # one input read by both sides: its gradient is the sum of both
        def forward(x, **prm):
            return multi_head_attention_forward(x, x, **prm, mask=dev(causal(d["T"])), rng=rng(), **attend)

        def backward(dout, cache):
            dx_q, dx_kv, *rest = multi_head_attention_backward(dout, cache)
            return (dx_q + dx_kv, *rest)
        args, wrt = {"x": dev(x_q)}, ("x",)
    else:
        def forward(x_q, x_kv, **prm):
            return multi_head_attention_forward(x_q, x_kv, **prm, rng=rng(), **attend)
        backward = multi_head_attention_backward
        args, wrt = {"x_q": dev(x_q), "x_kv": dev(data.draw(normals((d["B"], d["S"], d["D"]))))}, ("x_q", "x_kv")
    args.update({k: dev(v) for k, v in params.items()})
    check_gradients(f"grouped_query_attention(H={d['H']}, kv_heads={d['kv']}, self={self_attn}, dropout={p})",
                    forward, backward, args, wrt + tuple(params))


@given(d=gqa_dims(), data=st.data())
def test_grouped_query_attention_is_multi_head_attention_with_each_groups_keys_shared(backend, d, data):
    """GQA equals the paper's attention whose key/value weights repeat each group's head;
    a shared head's gradient is the sum of its copies' gradients."""
    x_q, x_kv = data.draw(normals((d["B"], d["T"], d["D"]))), data.draw(normals((d["B"], d["S"], d["D"])))
    g, Dh, kv = d["H"] // d["kv"], d["Dh"], d["kv"]
    prm = gqa_params(data, d["D"], kv * Dh)
    heads = lambda w: np.repeat(w.reshape(*w.shape[:-1], kv, Dh), g, axis=-2).reshape(*w.shape[:-1], -1)  # noqa: E731
    full = {n: heads(a) if n[2] in "kv" else a for n, a in prm.items()}
    out, cache = multi_head_attention_forward(dev(x_q), dev(x_kv), **{k: dev(v) for k, v in prm.items()},
                                              n_heads=d["H"], kv_heads=kv)
    ref, ref_cache = multi_head_attention_forward(dev(x_q), dev(x_kv), **{k: dev(v) for k, v in full.items()},
                                                  n_heads=d["H"])
    np.testing.assert_allclose(host(out), host(ref), rtol=1e-11, atol=1e-12)
    dout = dev(np.random.default_rng(0).standard_normal(out.shape))
    grads = dict(zip(("x_q", "x_kv") + tuple(prm), multi_head_attention_backward(dout, cache)))
    ref_grads = dict(zip(("x_q", "x_kv") + tuple(prm), multi_head_attention_backward(dout, ref_cache)))
    for name in ("w_k", "b_k", "w_v", "b_v"):
        r = host(ref_grads[name])
        summed = r.reshape(*r.shape[:-1], kv, g, Dh).sum(axis=-2).reshape(*r.shape[:-1], -1)
        np.testing.assert_allclose(host(grads[name]), summed, rtol=1e-10, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(host(grads["x_kv"]), host(ref_grads["x_kv"]), rtol=1e-10, atol=1e-12)


def test_kv_heads_equal_to_n_heads_is_the_papers_attention_to_the_last_bit(backend):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    prm = [rng.standard_normal(s).astype(np.float32) for s in [(8, 8), (8,)] * 4]
    mha, c1 = multi_head_attention_forward(dev(x), dev(x), *map(dev, prm), n_heads=4)
    gqa, c2 = multi_head_attention_forward(dev(x), dev(x), *map(dev, prm), n_heads=4, kv_heads=4)
    assert (host(mha) == host(gqa)).all()
    dout = dev(rng.standard_normal(mha.shape).astype(np.float32))
    for a, b in zip(multi_head_attention_backward(dout, c1), multi_head_attention_backward(dout, c2)):
        assert (host(a) == host(b)).all()


def test_one_kv_head_is_multi_query_attention_every_head_reads_the_same_keys(backend):
    rng = np.random.default_rng(4)
    k = dev(rng.standard_normal((2, 1, 3, 2)))
    rep = host(repeat_kv(k, 4))
    assert rep.shape == (2, 4, 3, 2) and all((rep[:, h] == host(k)[:, 0]).all() for h in range(4))
    np.testing.assert_allclose(host(sum_kv_groups(dev(rep), 4)), 4 * host(k))


def test_kv_heads_that_do_not_divide_the_heads_or_fit_the_weights_are_refused(backend):
    x = dev(np.ones((1, 2, 8)))
    sq, sb = dev(np.ones((8, 8))), dev(np.ones(8))
    kv, kb = dev(np.ones((8, 6))), dev(np.ones(6))
    with pytest.raises(ValueError, match="kv_heads 3 must divide n_heads 4"):
        multi_head_attention_forward(x, x, sq, sb, kv, kb, kv, kb, sq, sb, n_heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="w_k has shape"):
        multi_head_attention_forward(x, x, sq, sb, sq, sb, sq, sb, sq, sb, n_heads=4, kv_heads=2)

"""FlashAttention (attn/layers/flash_attention.py): the paper's attention to round-off in
float64 for every mask and every tile size (sizes that do not divide the length included),
its gradients the paper's and central differences', on NumPy and on CuPy (the ``backend``
fixture); the causal tiles it skips counted; a cache linear in the length."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn.backend as B
from attn.layers import attention_backward, attention_forward, flash_attention_backward, flash_attention_forward
from attn.testing import check_gradients, normals

dev, host = B.to_device, B.to_host
MASKS = ("none", "padding", "causal", "padding and causal", "any")


def causal_block(Tq: int, Tk: int):
    """Query i sees keys 0 .. i + Tk - Tq: the paper's look-ahead mask when Tq = Tk."""
    return np.tril(np.ones((Tq, Tk), dtype=bool), k=Tk - Tq)


@st.composite
def problems(draw):
    """q, k, v, the mask given to flash attention, its causal flag, the same mask written out
    for the paper's attention, and the tile sizes."""
    lead = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    Tq, Tk, Dk, Dv = (draw(st.integers(1, n)) for n in (7, 7, 3, 3))
    q, k, v = (draw(normals(lead + s)) for s in ((Tq, Dk), (Tk, Dk), (Tk, Dv)))
    kind = draw(st.sampled_from(MASKS))
    mask = None
    if "padding" in kind:
        mask = draw(st.lists(st.booleans(), min_size=Tk, max_size=Tk).map(np.array)).reshape((1,) * len(lead)
                                                                                             + (1, Tk))
    elif kind == "any":             # fully masked rows included
        mask = np.array(draw(st.lists(st.booleans(), min_size=Tq * Tk, max_size=Tq * Tk))).reshape(Tq, Tk)
    causal = "causal" in kind
    full = mask
    if causal:
        full = causal_block(Tq, Tk) if mask is None else mask & causal_block(Tq, Tk)
    tiles = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    return q, k, v, mask, causal, full, tiles


@given(problem=problems(), seed=st.integers(0, 2**31 - 1))
def test_flash_attention_is_the_papers_attention_with_its_gradients(backend, problem, seed):
    q, k, v, mask, causal, full, (q_tile, k_tile) = problem
    mask_d = None if mask is None else dev(mask)
    want, plain = attention_forward(dev(q), dev(k), dev(v), None if full is None else dev(full))
    got, cache = flash_attention_forward(dev(q), dev(k), dev(v), mask_d, q_tile, k_tile, causal)
    np.testing.assert_allclose(host(got), host(want), rtol=1e-12, atol=1e-13)
    dout = np.random.default_rng(seed).standard_normal(got.shape)
    for name, g, w in zip("qkv", flash_attention_backward(dev(dout), cache), attention_backward(dev(dout), plain)):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(host(g), host(w), rtol=1e-11, atol=1e-12, err_msg=f"d{name}")
    check_gradients("flash_attention", lambda q, k, v: flash_attention_forward(q, k, v, mask_d, q_tile, k_tile, causal),
                    flash_attention_backward, {"q": dev(q), "k": dev(k), "v": dev(v)}, ("q", "k", "v"), seed=seed)


def test_a_fully_masked_row_is_zero_as_in_the_papers_attention(backend):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, 3)) for _ in range(3))
    mask = np.ones((2, 1, 5), dtype=bool)
    mask[1] = False                                      # the second sequence: every key padding
    out, cache = flash_attention_forward(dev(q), dev(k), dev(v), dev(mask), 2, 2)
    dq, dk, dv = (host(g) for g in flash_attention_backward(dev(np.ones((2, 5, 3))), cache))
    assert not host(out)[1].any() and not dq[1].any() and not dk[1].any() and not dv[1].any()
    assert np.isinf(host(cache.lse)[1]).all() and np.isfinite(host(cache.lse)[0]).all()


@given(Tq=st.integers(1, 40), extra=st.integers(0, 10), q_tile=st.integers(1, 9), k_tile=st.integers(1, 9))
def test_the_causal_tiles_skipped_are_those_wholly_above_the_diagonal(Tq, extra, q_tile, k_tile):
    """A tile is skipped exactly when the look-ahead mask hides all of it."""
    Tk = Tq + extra
    visible = causal_block(Tq, Tk)
    hidden = sum(not visible[i:i + q_tile, j:j + k_tile].any()
                 for i in range(0, Tq, q_tile) for j in range(0, Tk, k_tile))
    q, k = np.zeros((Tq, 2)), np.zeros((Tk, 2))
    assert flash_attention_forward(q, k, k, None, q_tile, k_tile, causal=True)[1].skipped == hidden
    assert flash_attention_forward(q, k, k, None, q_tile, k_tile)[1].skipped == 0


def test_eight_queries_in_tiles_of_two_skip_six_of_sixteen_tiles():
    x = np.zeros((8, 4))
    assert flash_attention_forward(x, x, x, None, 2, 2, causal=True)[1].skipped == 6    # 3 + 2 + 1


def test_the_cache_holds_one_number_per_query_beyond_the_inputs():
    """Memory linear in the length: besides q, k, v and the caller's mask, the cache holds the
    output and one log-sum-exp per query; no array of Tq x Tk."""
    Bsz, H, T, Dh = 2, 3, 64, 4
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((Bsz, H, T, Dh)) for _ in range(3))
    mask = rng.random((Bsz, 1, 1, T)) > 0.2
    _, cache = flash_attention_forward(q, k, v, mask, 16, 16, causal=True)
    given_arrays = {id(a) for a in (q, k, v, mask)}
    kept = {name: a for name, a in cache._asdict().items() if hasattr(a, "shape") and id(a) not in given_arrays}
    assert {name: a.shape for name, a in kept.items()} == {"out": (Bsz, H, T, Dh), "lse": (Bsz, H, T)}
    assert sum(a.size for a in kept.values()) == Bsz * H * T * (Dh + 1)
    _, plain = attention_forward(q, k, v, mask)
    assert plain.weights.size == Bsz * H * T * T          # what the paper's attention keeps instead


def test_float32_stays_float32():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((3, 10, 4)).astype(np.float32) for _ in range(3))
    out, cache = flash_attention_forward(q, k, v, None, 3, 4, causal=True)
    grads = flash_attention_backward(np.ones_like(out), cache)
    assert out.dtype == cache.lse.dtype == np.float32 and all(g.dtype == np.float32 for g in grads)
    want = attention_forward(q, k, v, causal_block(10, 10))[0]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args, kwargs, message", [
    (((2, 4, 3), (2, 4, 3), (2, 4, 3)), {"dropout": 0.1}, r"dropout is not supported: the backward recomputes"),
    (((2, 4, 3), (2, 4, 5), (2, 4, 3)), {}, r"q \(2, 4, 3\), k \(2, 4, 5\), v \(2, 4, 3\) do not fit"),
    (((2, 4, 3), (1, 4, 3), (1, 4, 3)), {}, r"the same leading axes"),
    (((2, 4, 3), (2, 4, 3), (2, 4, 3)), {"q_tile": 0}, r"q_tile must be a positive integer, got 0"),
    (((2, 4, 3), (2, 4, 3), (2, 4, 3)), {"k_tile": 2.5}, r"k_tile must be a positive integer, got 2.5"),
    (((2, 4, 3), (2, 4, 3), (2, 4, 3)), {"mask": np.ones((3, 1, 4), bool)}, r"mask \(3, 1, 4\) does not broadcast"),
])
def test_clear_errors(args, kwargs, message):
    q, k, v = (np.zeros(s) for s in args)
    with pytest.raises(ValueError, match=message):
        flash_attention_forward(q, k, v, **kwargs)

"""The hypothesis strategies: shapes, float64 values, masks and token ids, all drawn as
host arrays (see :mod:`attn.testing`)."""
from __future__ import annotations

import contextlib

from typing import NamedTuple

from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from .. import backend as B
from ..masks import PAD_ID

np = B.host       # strategies draw host arrays; only attn/backend.py imports NumPy

# ----------------------------------------------------------------------------- shapes


class Dims(NamedTuple):
    """One consistent set of sizes: batch B, target length T, source length S,
    d_model D, heads H (divides D), d_ff F, vocabulary V (>= 2, id 0 is padding)."""
    B: int
    T: int
    S: int
    D: int
    H: int
    F: int
    V: int


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, smallest first."""
    return [k for k in range(1, n + 1) if n % k == 0]


#: How much larger than their defaults :func:`dims` draws lengths and widths (:func:`scaled`).
SCALE = [1]


@contextlib.contextmanager
def scaled(k: int):
    """Within it, :func:`dims` draws lengths and widths up to ``k`` times their maxima: the
    grader's final profile, on shapes a learner did not try."""
    saved = SCALE[0]
    SCALE[0] = k
    try:
        yield
    finally:
        SCALE[0] = saved


@st.composite
def dims(draw, max_batch: int = 3, max_len: int = 6, max_width: int = 8, max_vocab: int = 10) -> Dims:
    """Batch 1..max_batch, lengths 1..max_len, widths 1..max_width, heads dividing D (each
    maximum times :data:`SCALE`). Shrinks towards the smallest case (everything 1, V = 2)."""
    max_len, max_width = max_len * SCALE[0], max_width * SCALE[0]
    B = draw(st.integers(1, max_batch))
    T = draw(st.integers(1, max_len))
    S = draw(st.integers(1, max_len))
    D = draw(st.integers(1, max_width))
    H = draw(st.sampled_from(divisors(D)))
    F = draw(st.integers(1, max_width))
    V = draw(st.integers(2, max_vocab))
    return Dims(B, T, S, D, H, F, V)


def leading_shapes(min_dims: int = 1, max_dims: int = 3, max_side: int = 3):
    """Shapes of 1-3 leading (batch) axes, each of size 1..max_side."""
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=1, max_side=max_side)

# ----------------------------------------------------------------------------- values


def floats(shape, bound: float = 3.0):
    """float64 arrays with hypothesis-chosen elements in [-bound, bound] (0, the
    bounds and repeated values included; no NaN, inf or subnormals)."""
    elements = st.floats(-bound, bound, allow_nan=False, allow_infinity=False,
                         allow_subnormal=False, width=64)
    return hnp.arrays(np.float64, shape, elements=elements)


def normals(shape, scale: float = 1.0):
    """float64 Gaussian arrays (standard deviation ``scale``) from a drawn seed.

    Cheaper for hypothesis than element-by-element draws and well-conditioned:
    the right thing for weight matrices, where the shape, not the values, is the
    interesting part, and for the inputs of gradient checks of smooth layers. A
    central difference cannot resolve a gradient much smaller than the function it
    differentiates (its rounding floor is about ulp(f) / (h |g|)), and hypothesis'
    edge values (a layer-norm row (0, 1e-5), a zero key) reach below that floor
    without anything being wrong; Gaussian values essentially never do.
    """
    return st.integers(0, 2**32 - 1).map(
        lambda seed: np.random.default_rng(seed).standard_normal(shape) * scale)


def away_from(shape, points=(0.0,), margin: float = 1e-3, bound: float = 3.0):
    """float64 arrays whose elements are at least ``margin`` away from each of ``points``:
    inputs for a gradient check of a function with kinks there (ReLU at 0)."""
    elements = st.floats(-bound, bound, allow_nan=False, allow_subnormal=False, width=64).filter(
        lambda v: all(abs(v - p) >= margin for p in points))
    return hnp.arrays(np.float64, shape, elements=elements)


magnitudes = st.integers(0, 4).map(lambda k: 10.0 ** k)
"""Scales 1, 10, ..., 1e4: logits of magnitude up to 1e4 must not overflow a softmax."""


@st.composite
def logits(draw, shape, max_exponent: int = 4):
    """float64 arrays of values in [-1, 1] times ``10**k`` for a drawn k in 0..max_exponent."""
    k = draw(st.integers(0, max_exponent))
    return draw(floats(shape, 1.0)) * 10.0 ** k

# ----------------------------------------------------------------------------- masks


@st.composite
def masks(draw, shape, broadcast: bool = True, ensure_key: bool = True,
          fully_masked_row: bool = False):
    """Random bool masks for scores of ``shape`` (..., Tq, Tk); True = may attend.

    broadcast
        Each axis but the last may be drawn as 1 (as padding masks (B, 1, 1, Tk)
        and look-ahead masks (1, 1, T, T) are), so the mask broadcasts.
    ensure_key
        Every row keeps at least one key (what real padding masks guarantee).
    fully_masked_row
        One row (chosen by the draw) has every key masked: the softmax must give
        zeros there, not NaN and not a uniform row.
    """
    shape = tuple(shape)
    Tk = shape[-1]
    if broadcast:
        lead = tuple(draw(st.sampled_from([1, n])) if n > 1 else 1 for n in shape[:-1])
    else:
        lead = shape[:-1]
    m = np.array(draw(hnp.arrays(np.bool_, lead + (Tk,))))
    if ensure_key:
        j = draw(st.integers(0, Tk - 1))
        m[..., j] |= ~m.any(axis=-1)
    if fully_masked_row:
        rows = m.reshape(-1, Tk)
        rows[draw(st.integers(0, rows.shape[0] - 1))] = False
    return m


@st.composite
def padding_masks(draw, B: int, Tk: int):
    """(B, 1, 1, Tk) masks of real keys followed by padding, at least one real key per row."""
    lengths = np.array(draw(st.lists(st.integers(1, Tk), min_size=B, max_size=B)))
    return (np.arange(Tk)[None, :] < lengths[:, None])[:, None, None, :]


def causal(T: int):
    """The (1, 1, T, T) look-ahead mask on the host: query i sees keys 0..i."""
    return np.tril(np.ones((T, T), dtype=bool))[None, None]

# ----------------------------------------------------------------------------- token ids


@st.composite
def token_ids(draw, shape, V: int, low: int = 0, repeats: bool = True):
    """int64 ids in [low, V) of ``shape``; with ``repeats`` (and two or more ids) the last
    id repeats the first, so gradients must accumulate over repeated rows."""
    ids = np.array(draw(hnp.arrays(np.int64, shape, elements=st.integers(low, V - 1))))
    if repeats and ids.size >= 2:
        ids.reshape(-1)[-1] = ids.reshape(-1)[0]
    return ids


@st.composite
def padded_ids(draw, B: int, T: int, V: int, min_len: int = 1):
    """(B, T) int64 ids: a real prefix of tokens in [1, V) (length min_len..T per row),
    then ``PAD_ID``. V must be at least 2."""
    ids = draw(token_ids((B, T), V, low=1, repeats=False))
    lengths = np.array(draw(st.lists(st.integers(min_len, T), min_size=B, max_size=B)))
    ids[np.arange(T)[None, :] >= lengths[:, None]] = PAD_ID
    return ids

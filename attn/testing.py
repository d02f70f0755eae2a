"""Testing tools for attn's layers, public as ``numpy.testing`` is: the hypothesis
strategies, the float64 gradient check, and each layer's invariants.

The test suite (``tests/``) and the learner's grader (``attn-check``, :mod:`attn.grader`)
both use this module, so a learner's layer is graded by exactly what proves the
library's.

Everything here draws **host** arrays; a test moves them to the backend under test
with ``attn.backend.to_device``. Sizes are tiny on purpose: a numerical gradient
costs two forward passes per input element.

Typical use, with ``st.data()`` so that later draws can depend on earlier ones::

    @given(data=st.data())
    def test_something(backend, data):
        d = data.draw(dims())                                  # B, T, S, D, H, F, V
        x = to_device(data.draw(floats((d.B, d.T, d.D))))
        mask = to_device(data.draw(masks((d.B, d.H, d.T, d.S))))

What is here
------------
shapes
    :func:`dims` (a consistent set of model dimensions, heads dividing d_model),
    :func:`leading_shapes` (1-3 batch axes), :func:`divisors`.
values (float64)
    :func:`floats` (hypothesis-chosen elements, edge values included: invariants,
    and gradient checks of piecewise-linear layers),
    :func:`normals` (seeded Gaussian arrays: weights, and inputs of gradient
    checks of smooth layers, see its docstring),
    :func:`away_from` (elements at least a margin away from a kink),
    :func:`logits` (floats times ``10**k``, k up to 4: the softmax stability check).
masks (bool, True = may attend)
    :func:`masks` (random, broadcastable, optionally with a fully masked row),
    :func:`padding_masks` (trailing padding, at least one real key per row),
    :func:`causal` (the look-ahead mask, a plain function).
token ids
    :func:`token_ids` (ids with at least one repeat), :func:`padded_ids`
    (real tokens then trailing ``PAD_ID``).
gradient checks
    :func:`check_gradients` wraps :func:`attn.gradcheck.check_layer` and records
    every relative error; :func:`gradient_summary` is the closing line the
    conftest prints ("max relative gradient error: X over N checks").
invariants
    ``assert_*`` functions that take a layer's functions (the library's, or a
    learner's) and host inputs, and raise :class:`InvariantError` (an
    AssertionError with a ``hint``) when a property a reader would state aloud
    fails: softmax rows sum to one over unmasked keys, masked weights are exactly
    zero, the future never changes the past, padding never changes real
    positions, layer norm's output has zero mean, repeated ids accumulate...
layers
    :data:`LAYERS`: for every layer of :mod:`attn.layers`, its helpers and the
    loss, and for every exercise beyond them (Luong attention, the decoder's mask,
    an encoder layer, a decoder layer, the whole Transformer, the schedule, Adam,
    greedy and beam search, checkpoint averaging, BPE merges): the names of its
    functions, a strategy of examples (hard inputs included), which invariants
    apply, and hints at two levels (where to look, the formula). :mod:`attn.grader`
    grades with it, against :mod:`attn.grader.solutions`.
dropout
    :data:`DROPOUT_PROBES`: for each layer that takes dropout, inputs on which the
    output is the tensor dropout applies to, so that the mask can be read off it.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from . import backend as B
from .gradcheck import check_layer
from .masks import PAD_ID

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


@st.composite
def dims(draw, max_batch: int = 3, max_len: int = 6, max_width: int = 8, max_vocab: int = 10) -> Dims:
    """Batch 1..max_batch, lengths 1..max_len, widths 1..max_width, heads dividing D.
    Shrinks towards the smallest case (everything 1, V = 2)."""
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

# ----------------------------------------------------------------------------- gradient checks


#: Every gradient checked this session: (layer, argument, relative error).
GRADIENT_ERRORS: list[tuple[str, str, float]] = []
#: How many times check_gradients ran (one per hypothesis example of a gradient test).
GRADIENT_CHECKS: list[int] = [0]


def check_gradients(name: str, forward, backward, args: dict, wrt, tol: float = 1e-6, **kwargs) -> dict:
    """:func:`attn.gradcheck.check_layer` (float64 central differences against a random
    upstream gradient, AssertionError naming the layer and argument), recording every
    relative error for the closing summary. Returns {argument: relative error}."""
    errors = check_layer(name, forward, backward, args, wrt, tol=tol, **kwargs)
    GRADIENT_CHECKS[0] += 1
    GRADIENT_ERRORS.extend((name, arg, err) for arg, err in errors.items())
    return errors


def gradient_summary() -> str | None:
    """"max relative gradient error: X (layer.argument) over N checks (M gradients)", or None."""
    if not GRADIENT_ERRORS:
        return None
    name, arg, worst = max(GRADIENT_ERRORS, key=lambda e: e[2])
    return (f"max relative gradient error: {worst:.3g} ({name}.{arg}) over {GRADIENT_CHECKS[0]} checks "
            f"({len(GRADIENT_ERRORS)} argument gradients)")

# ----------------------------------------------------------------------------- invariants
#
# Each takes a layer's functions (the library's, or a learner's) and host inputs, moves
# the inputs to the selected backend, and raises InvariantError with a hint naming the
# usual cause when the property fails. The tests call them with the library's layers;
# attn-check calls them with the learner's.


class InvariantError(AssertionError):
    """A property of a layer does not hold. ``hint`` names the usual cause."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _dev(a):
    """A device copy of a host array (a copy even on NumPy, so that a layer that writes
    into its input cannot change the caller's example); anything else as it is."""
    return B.to_device(a.copy()) if isinstance(a, np.ndarray) else a


def _host(a):
    return B.to_host(a)


def _out(result):
    """The output of a forward that returns (out, cache)."""
    return result[0] if isinstance(result, tuple) else result


def _first(bad) -> tuple:
    """Index of the first True entry of a boolean host array, as a tuple of ints."""
    return tuple(int(i) for i in np.argwhere(bad)[0])


def assert_softmax_properties(forward, backward, x, mask=None, dy=None) -> None:
    """Softmax over the last axis: finite and non-negative; rows sum to one over their
    unmasked keys; masked weights exactly zero; a fully masked row all zeros. With
    ``backward`` and ``dy``: rows of dx sum to zero and masked logits get no gradient."""
    y, cache = forward(_dev(x), None if mask is None else _dev(mask))
    y = _host(y)
    m = np.ones(x.shape, bool) if mask is None else np.broadcast_to(mask, x.shape)
    live = m.any(axis=-1)
    if not np.isfinite(y).all():
        raise InvariantError(f"softmax output has NaN or inf at {_first(~np.isfinite(y))} (logits up to "
                             f"{np.abs(x).max():.3g})",
                             "subtract each row's maximum before exp; fill masked logits with the dtype's "
                             "most negative finite value, not -inf (a fully masked row then gives 0/0)")
    if (y[~m] != 0).any():
        raise InvariantError(f"a masked position has weight {y[~m][y[~m] != 0][0]:.3g} at "
                             f"{_first((y != 0) & ~m)}; masked weights must be exactly 0",
                             "apply the mask to the logits before exp, and to the output again (a fully "
                             "masked row would otherwise come out uniform)")
    sums = y.sum(axis=-1)
    off = live & ~(np.abs(sums - 1.0) <= 1e-10)
    if off.any():
        i = _first(off)
        raise InvariantError(f"row {i} sums to {float(sums[i])!r} over its unmasked keys, not 1",
                             "mask the logits before normalising: zeroing weights after the softmax leaves "
                             "rows that no longer sum to one")
    if (y < 0).any():
        raise InvariantError(f"negative weight {y.min():.3g}", "weights are exp(...) / sum: never negative")
    if backward is None or dy is None:
        return
    dx = _host(backward(_dev(dy), cache))
    if (dx[~m] != 0).any():
        raise InvariantError(f"masked logit {_first((dx != 0) & ~m)} gets gradient "
                             f"{dx[(dx != 0) & ~m][0]:.3g}; it must be exactly 0",
                             "dx = y * (dy - sum(dy * y)) is 0 wherever y is 0")
    rows = np.abs(dx.sum(axis=-1))
    tol = 1e-10 * (np.abs(dy).max(axis=-1) + 1.0)
    if (rows > tol).any():
        i = _first(rows > tol)
        raise InvariantError(f"row {i} of dx sums to {dx.sum(axis=-1)[i]:.3g}; adding a constant to a row of "
                             "logits changes nothing, so every row of dx must sum to 0",
                             "dx = y * (dy - sum(dy * y, axis=-1)): the sum term (from the normalisation) "
                             "is missing")


def assert_layer_norm_properties(forward, backward, x, eps: float = 1e-5, gamma=None, dout=None) -> None:
    """With gamma = 1 and beta = 0 each row of the output has zero mean and variance
    ``var / (var + eps)``. With ``backward``, ``gamma`` and ``dout``: each row of dx
    sums to zero (the mean term) and ``sum(dx * xhat) = rstd * sum(g * xhat) * eps /
    (var + eps)`` with ``g = dout * gamma`` (the variance term)."""
    D = x.shape[-1]
    out = _host(_out(forward(_dev(x), _dev(np.ones(D)), _dev(np.zeros(D)), eps)))
    var = x.var(axis=-1)
    rstd = 1.0 / np.sqrt(var + eps)
    # The row mean is exact only up to rounding, ulp(x), which 1/sqrt(var + eps) magnifies.
    rounding = 8 * np.finfo(np.float64).eps * np.abs(x).max(axis=-1) * rstd
    mean = out.mean(axis=-1)
    if not (np.abs(mean) <= rounding + 1e-15).all():
        i = _first(np.abs(mean) > rounding + 1e-15)
        raise InvariantError(f"with gamma = 1, beta = 0, row {i} of the output has mean {mean[i]:.3g}, not 0",
                             "subtract the mean of each row over the last axis (axis=-1, keepdims=True)")
    got, want = out.var(axis=-1), var / (var + eps)
    if not (np.abs(got - want) <= 1e-8 + 1e-8 * want).all():
        i = _first(~(np.abs(got - want) <= 1e-8 + 1e-8 * want))
        raise InvariantError(f"with gamma = 1, beta = 0, row {i} of the output has variance {got[i]:.10g}, "
                             f"expected var / (var + eps) = {want[i]:.10g}",
                             "divide by sqrt(var + eps) with the biased variance (mean over D, not D - 1), "
                             "eps inside the square root")
    if backward is None or dout is None:
        return
    gamma = np.ones(D) if gamma is None else gamma
    _, cache = forward(_dev(x), _dev(gamma), _dev(np.zeros(D)), eps)
    dx = _host(backward(_dev(dout), cache)[0])
    g = dout * gamma
    scale = np.abs(dx).sum(axis=-1) + rstd * np.abs(g).sum(axis=-1)
    s = np.abs(dx.sum(axis=-1))
    if not (s <= 1e-10 * scale + 1e-300).all():
        i = _first(~(s <= 1e-10 * scale + 1e-300))
        raise InvariantError(f"row {i} of dx sums to {dx.sum(axis=-1)[i]:.3g}; adding a constant to a row "
                             "changes nothing, so every row of dx must sum to 0",
                             "the mean term is missing: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), "
                             "g = dout * gamma")
    xhat = (x - x.mean(axis=-1, keepdims=True)) * rstd[..., None]
    lhs = (dx * xhat).sum(axis=-1)
    rhs = rstd * (g * xhat).sum(axis=-1) * eps / (var + eps)
    tol = 1e-9 * rstd * np.abs(g).sum(axis=-1) * (1 + np.abs(xhat).max(axis=-1)) + 1e-300
    if not (np.abs(lhs - rhs) <= tol).all():
        i = _first(~(np.abs(lhs - rhs) <= tol))
        raise InvariantError(f"row {i}: sum(dx * xhat) is {lhs[i]:.3g}, but scaling a row about its mean "
                             f"changes the output only through eps, so it must be {rhs[i]:.3g}",
                             "the variance term is missing: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))")


def assert_embedding_properties(forward, backward, ids, W, scale: float = 1.0, dout=None) -> None:
    """``out == W[ids] * scale``; with ``backward``: dW collects every position, so its
    total is ``scale * sum(dout)`` and rows of ids that never occur get nothing."""
    out, cache = forward(_dev(ids), _dev(W), scale)
    out = _host(out)
    if out.shape != ids.shape + (W.shape[1],) or not np.allclose(out, W[ids] * scale, rtol=1e-12, atol=0):
        raise InvariantError(f"out is not W[ids] * scale (shape {out.shape}, expected {ids.shape + (W.shape[1],)})",
                             "look the rows up with W[ids], then multiply by scale")
    if backward is None or dout is None:
        return
    dW = _host(backward(_dev(dout), cache))
    total, want = dW.sum(axis=0), scale * dout.reshape(-1, W.shape[1]).sum(axis=0)
    if not np.allclose(total, want, rtol=1e-10, atol=1e-12):
        seen, counts = np.unique(ids, return_counts=True)
        raise InvariantError(f"dW sums to {total} over its rows, but scale * sum(dout) is {want}: gradient was "
                             f"lost (ids repeated: {seen[counts > 1].tolist()})",
                             "dW[ids] += g keeps only one of the repeated ids: accumulate with np.add.at "
                             "(attn.backend.scatter_add)")
    unused = np.setdiff1d(np.arange(W.shape[0]), ids)
    if dW[unused].any():
        raise InvariantError(f"rows {unused.tolist()} of dW are not zero, but those ids never occur",
                             "start dW from zeros and add into the rows of the ids that occur")


def assert_dropout_properties(forward, backward, x, p: float, seed: int, dout=None) -> None:
    """Inverted dropout: the identity with ``p == 0`` or no rng; otherwise every output is
    0 or ``x / (1 - p)``, about a fraction ``1 - p`` is kept, and backward passes ``dout``
    through the same mask. ``x`` has no zeros."""
    for rng in (None, B.DeviceRNG(seed)) if p else (None,):
        if rng is None or p == 0:
            out = _host(_out(forward(_dev(x), p, rng)))
            if not np.array_equal(out, x):
                raise InvariantError(f"dropout with p = {p} and rng = {rng} must return x unchanged",
                                     "with p == 0 or rng None (evaluation) dropout is the identity")
    if p == 0:
        return
    out, cache = forward(_dev(x), p, B.DeviceRNG(seed))
    out = _host(out)
    ratio = out / x
    kept = out != 0
    if not np.allclose(ratio[kept], 1.0 / (1.0 - p), rtol=1e-12):
        raise InvariantError(f"kept units are scaled by {ratio[kept][0]:.6g}, expected 1/(1-p) = {1 / (1 - p):.6g} "
                             f"(p = {p})", "inverted dropout scales the kept units by 1/(1-p), so that "
                             "inference needs no rescale")
    n = 20_000
    big = _host(_out(forward(_dev(np.ones(n)), p, B.DeviceRNG(seed))))
    frac = float((big != 0).mean())
    if abs(frac - (1 - p)) > 5 * math.sqrt(p * (1 - p) / n) + 1e-12:
        raise InvariantError(f"with p = {p} a fraction {frac:.4f} of {n} units was kept, expected about {1 - p}",
                             "p is the probability of dropping a unit: keep where rng.random(shape) >= p")
    if backward is None or dout is None:
        return
    dx = _host(backward(_dev(dout), cache))
    if not np.allclose(dx, dout * ratio, rtol=1e-12, atol=0):
        raise InvariantError("dx is not dout times the forward's mask (dropped units must pass no gradient, "
                             "kept ones dout / (1-p))",
                             "keep the forward's scaled mask in the cache; backward must not draw a new one")


def assert_positional_properties(forward, backward, x, table, dout=None) -> None:
    """``out == x + table[:T]``; backward passes dout through to x, and ``dtable`` holds
    dout summed over the batch in its first T rows and zeros after."""
    T = x.shape[-2]
    out, cache = forward(_dev(x), _dev(table))
    if not np.allclose(_host(out) - x, np.broadcast_to(table[:T], x.shape), rtol=0, atol=1e-12):
        raise InvariantError("out - x is not table[:T] at every batch row", "out = x + table[:T]")
    if backward is None or dout is None:
        return
    dx, dtable = backward(_dev(dout), cache)
    dx, dtable = _host(dx), _host(dtable)
    if not np.array_equal(dx, dout):
        raise InvariantError("dx is not dout", "out = x + table[:T], so dx = dout")
    if dtable[T:].any():
        raise InvariantError(f"rows {T}.. of dtable are not zero, but only the first T = {T} rows were used",
                             "dtable = zeros of the table's shape, then dtable[:T] = the batch sum of dout")
    if not np.allclose(dtable[:T], dout.reshape(-1, T, x.shape[-1]).sum(axis=0), rtol=1e-12, atol=1e-12):
        raise InvariantError("dtable[:T] is not dout summed over the batch",
                             "every sentence of the batch adds the same table: sum dout over the batch axis")


def assert_sinusoidal_table_properties(table_fn, max_len: int, d_model: int) -> None:
    """Row 0 is (0, 1, 0, 1, ...) and every entry is the paper's sin/cos of
    ``pos / 10000^(2i/d_model)``, sine in even columns, cosine in odd ones; float32 unless
    another dtype is asked for."""
    pe = _host(table_fn(max_len, d_model, "float64"))
    if pe.shape != (max_len, d_model):
        raise InvariantError(f"table has shape {pe.shape}, expected ({max_len}, {d_model})",
                             "one row per position, one column per feature")
    if _host(table_fn(max_len, d_model)).dtype != np.float32:
        raise InvariantError("sinusoidal_table(max_len, d_model) must be float32 by default",
                             "compute in float64, then return pe.astype(dtype) with dtype='float32' by default")
    want0 = np.array([0.0, 1.0] * d_model)[:d_model]
    if not np.allclose(pe[0], want0, atol=1e-15):
        raise InvariantError(f"row 0 is {pe[0].tolist()}, expected {want0.tolist()} (sin 0 = 0 in even "
                             "columns, cos 0 = 1 in odd ones)",
                             "column 2i holds the sine and column 2i+1 the cosine: sin and cos swapped?")
    pos = np.arange(max_len)[:, None]
    col = np.arange(d_model)[None, :]
    angle = pos / 10000.0 ** ((col - col % 2) / d_model)
    want = np.where(col % 2 == 0, np.sin(angle), np.cos(angle))
    if not np.allclose(pe, want, rtol=0, atol=1e-12):
        i = _first(~np.isclose(pe, want, rtol=0, atol=1e-12))
        raise InvariantError(f"PE{list(i)} is {pe[i]:.6g}, expected {want[i]:.6g}",
                             "columns 2i and 2i+1 share one angle, pos / 10000^(2i/d_model): the exponent "
                             "uses the even column index 2i, not i and not the column itself")


def assert_attention_ignores_unseen_keys(forward, q, k, v, mask) -> None:
    """Keys and values that no query may see can hold anything: the output does not change."""
    out = _host(_out(forward(_dev(q), _dev(k), _dev(v), _dev(mask))))
    shape = np.broadcast_shapes(mask.shape, q.shape[:-1] + (k.shape[-2],))
    unseen = ~np.broadcast_to(mask, shape).any(axis=-2)                      # (..., Tk)
    unseen = np.broadcast_to(unseen, k.shape[:-1])
    if not unseen.any():
        return
    k2, v2 = k.copy(), v.copy()
    k2[unseen] += 5.0
    v2[unseen] = 1e3
    out2 = _host(_out(forward(_dev(q), _dev(k2), _dev(v2), _dev(mask))))
    if not np.allclose(out2, out, rtol=1e-12, atol=1e-12):
        raise InvariantError("changing keys and values that the mask hides from every query changed the output",
                             "mask the scores before the softmax (False = may not attend), and zero those "
                             "weights exactly")


def assert_no_look_ahead(mha_forward, x, params: dict, n_heads: int, t: int, causal_fn=None) -> None:
    """Self-attention under a causal mask: changing positions after ``t`` never changes
    the outputs at positions ``0..t``. ``causal_fn(T, xp)`` builds the mask (the library's
    :func:`attn.masks.causal_mask` by default)."""
    from .masks import causal_mask
    T = x.shape[1]
    mask = (causal_fn or causal_mask)(T, B.xp())
    x2 = x.copy()
    x2[:, t + 1:] += 1.0 + np.abs(x2[:, t + 1:])
    p = {k: _dev(v) for k, v in params.items()}
    outs = [_host(_out(mha_forward(_dev(a), _dev(a), *p.values(), n_heads, mask))) for a in (x, x2)]
    if not np.allclose(outs[1][:, : t + 1], outs[0][:, : t + 1], rtol=1e-12, atol=1e-12):
        raise InvariantError(f"changing positions {t + 1}.. changed the outputs at positions 0..{t}: "
                             "the future leaks into the past",
                             "position i may see keys 0..i only: a causal mask off by one (tril with k=1, or "
                             "k=-1 which hides a position from itself), or the mask not applied to the scores")


def assert_padding_ignored(mha_forward, x_q, x_kv, params: dict, n_heads: int, src_ids) -> None:
    """Cross-attention with the source's padding mask: whatever sits at padded source
    positions, the output does not change."""
    from .masks import padding_mask
    mask = padding_mask(_dev(src_ids))
    x_kv2 = x_kv.copy()
    x_kv2[src_ids == PAD_ID] = 1e3
    p = {k: _dev(v) for k, v in params.items()}
    outs = [_host(_out(mha_forward(_dev(x_q), _dev(kv), *p.values(), n_heads, mask))) for kv in (x_kv, x_kv2)]
    if not np.allclose(outs[1], outs[0], rtol=1e-12, atol=1e-12):
        raise InvariantError("changing padded source positions changed the output: padding leaks into real "
                             "positions", "the padding mask must reach every head's scores before the softmax, and "
                             "each head must get its own columns of every position (split_heads' reshape order)")


def assert_heads_round_trip(split_fn, merge_fn, x, H: int) -> None:
    """``split_heads`` puts columns ``h*Dh..(h+1)*Dh`` of every position in head h, and
    ``merge_heads`` undoes it."""
    Bsz, T, D = x.shape
    s = _host(split_fn(_dev(x), H))
    Dh = D // H
    want = np.stack([x[:, :, h * Dh:(h + 1) * Dh] for h in range(H)], axis=1)
    if s.shape != want.shape or not np.array_equal(s, want):
        raise InvariantError(f"split_heads(x, {H})[:, h] is not x[:, :, h*Dh:(h+1)*Dh] (shape {s.shape}, "
                             f"expected {want.shape})",
                             "reshape (B, T, D) to (B, T, H, Dh), then transpose to (B, H, T, Dh); reshaping "
                             "straight to (B, H, T, Dh) mixes positions into heads")
    back = _host(merge_fn(_dev(want)))
    if back.shape != x.shape or not np.array_equal(back, x):
        raise InvariantError("merge_heads(split_heads(x)) is not x",
                             "merge_heads is the inverse: transpose (B, H, T, Dh) to (B, T, H, Dh), then reshape")


def assert_cross_entropy_properties(loss_fn, logits, targets, smoothing: float, pad_id, junk=None) -> None:
    """Every row of dlogits sums to zero (p and q both sum to one); with ``pad_id``, the
    logits at padded targets (replaced by ``junk``, or by large values) change neither the
    loss nor any gradient, and their rows of dlogits are zero."""
    loss, d = loss_fn(_dev(logits), _dev(targets), smoothing, pad_id)
    d = _host(d)
    rows = np.abs(d.sum(axis=-1))
    if not (rows <= 1e-12 * (np.abs(d).sum(axis=-1) + 1)).all():
        i = _first(~(rows <= 1e-12 * (np.abs(d).sum(axis=-1) + 1)))
        raise InvariantError(f"row {i} of dlogits sums to {d.sum(axis=-1)[i]:.3g}, not 0",
                             "dlogits = (softmax(logits) - q) / n with q = (1-eps) onehot + eps/V: both sum to one")
    if pad_id is None:
        return
    pad = targets == pad_id
    if not pad.any():
        return
    if d[pad].any():
        raise InvariantError(f"padded target {_first(pad)} has non-zero dlogits",
                             "multiply the gradient (and the loss, smoothing term included) by the mask of "
                             "real targets")
    x2 = logits.copy()
    x2[pad] = junk if junk is not None else 37.0 * (np.arange(x2[pad].size).reshape(x2[pad].shape) % 3 - 1.0)
    loss2, d2 = loss_fn(_dev(x2), _dev(targets), smoothing, pad_id)
    if abs(float(_host(loss2)) - float(_host(loss))) > 1e-12 * (1 + abs(float(_host(loss)))):
        raise InvariantError(f"changing the logits at padded targets changed the loss ({float(_host(loss)):.6g} "
                             f"-> {float(_host(loss2)):.6g})",
                             "padded targets contribute nothing: mask the whole per-token loss, the smoothing "
                             "term as well, and average over real tokens only")
    d2 = _host(d2)
    if d2[pad].any() or not np.allclose(d2[~pad], d[~pad], rtol=1e-12, atol=1e-16):
        raise InvariantError("changing the logits at padded targets changed dlogits",
                             "padded targets contribute nothing: zero their rows of dlogits, and let no real "
                             "token's gradient depend on them")


def assert_causal_mask_properties(causal_fn, T: int) -> None:
    """A (1, 1, T, T) bool mask: position i sees positions 0..i (itself included), never later ones."""
    m = _host(causal_fn(T, B.xp()))
    want = np.tril(np.ones((T, T), dtype=bool))[None, None]
    if m.shape != want.shape or m.dtype != bool:
        raise InvariantError(f"causal mask has shape {m.shape} and dtype {m.dtype}, expected {want.shape} bool",
                             "return xp.tril(xp.ones((T, T), dtype=bool))[None, None]")
    if not np.array_equal(m, want):
        i = _first(m != want)
        raise InvariantError(f"causal mask at (query {i[2]}, key {i[3]}) is {bool(m[i])}",
                             "query i sees keys 0..i, itself included: tril with the diagonal (k=0)")


def assert_rnn_skips_masked_steps(forward, x, h0, w_x, w_h, b, mask) -> None:
    """Where ``mask`` is False the state passes through unchanged: ``h_t == h_{t-1}``."""
    hs = _host(_out(forward(_dev(x), _dev(h0), _dev(w_x), _dev(w_h), _dev(b), _dev(mask))))
    prev = np.concatenate([h0[:, None], hs[:, :-1]], axis=1)
    if not np.array_equal(hs[~mask], prev[~mask]):
        i = _first(~mask & ~(hs == prev).all(axis=-1))
        raise InvariantError(f"step {i[1]} of row {i[0]} is masked, but the state changed there",
                             "h_t = where(mask[:, t, None], tanh(...), h_{t-1})")

# ----------------------------------------------------------------------------- layers, for the grader
#
# One entry per layer of attn.layers (and its helpers, the masks and the loss): the names
# of its functions, a strategy of examples (hypothesis shrinks them to the smallest that
# fails), and the invariants above that apply. attn.grader grades a learner's functions
# with these; the hard inputs (large logits, fully masked rows, repeated ids, padding)
# come from the same strategies the tests use.

seeds = st.integers(0, 2**31 - 1)
small_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)


class Fresh(NamedTuple):
    """An argument that becomes a new ``attn.backend.DeviceRNG(seed)`` at every call, so
    that a dropout mask is the same in every forward call of a gradient check."""
    seed: int


class Namespace:
    """An argument that becomes the selected backend's array namespace (``xp``)."""

    def __repr__(self) -> str:
        return "xp"


XP = Namespace()


class Example(NamedTuple):
    """One call of a layer.

    args
        ``((name, value), ...)`` in the order of the library's signature; values are host
        arrays (moved to the backend before the call), scalars, None, :class:`Fresh` or
        :data:`XP`.
    wrt
        the names whose gradients the backward returns, in its order.
    compare
        compare with the library's result (False where a correct layer may draw its
        random numbers differently: dropout with an rng).
    gradcheck
        check the backward against central differences (False on hard inputs, such as
        logits of 1e4, that a central difference cannot resolve; the backward is then
        still compared with the library's).
    seed
        seeds the random upstream gradient ``dout``.
    """
    args: tuple
    wrt: tuple = ()
    compare: bool = True
    gradcheck: bool = True
    seed: int = 0

    def get(self, name):
        return dict(self.args)[name]


class Layer(NamedTuple):
    """What the grader needs to know about one layer.

    kind
        ``"pair"`` (``*_forward -> (out, cache)``, ``*_backward(dout, cache) -> grads``),
        ``"function"`` (compared with the library's result) or ``"loss"``
        (``-> (loss, dlogits)``).
    functions
        the names a learner's file defines it under (forward first).
    examples
        a hypothesis strategy of :class:`Example`.
    invariants
        ``(functions: dict name -> callable, example) -> None``, raising
        :class:`InvariantError`; given the learner's functions where the file defines
        them and the library's otherwise.
    hints
        the formula (``attn-check --hint 3``), by ``"forward"`` (or the function's name)
        and ``"d<input>"`` for each gradient.
    where
        where to look (``--hint 2``), by the same keys.
    compare
        for a ``"function"`` whose result is not one array (a list of merges, decoded
        tokens): ``(yours, the library's, example) -> None``, raising InvariantError.
    explain
        ``(label, yours, expected, example, dout) -> str``: what a wrong gradient looks
        like, beyond what any layer's could (which path of a shared weight is missing).
    """
    name: str
    kind: str
    functions: tuple
    examples: object
    invariants: Callable | None
    hints: dict
    where: dict = {}
    compare: Callable | None = None
    explain: Callable | None = None


def _dout(ex: Example, shape):
    return B.host_rng(ex.seed).standard_normal(shape)


# -- linear, relu, dropout, embedding, positional


@st.composite
def linear_examples(draw):
    lead = draw(leading_shapes(1, 2))
    din, dout = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return Example((("x", draw(normals(lead + (din,)))), ("w", draw(normals((din, dout)))),
                    ("b", draw(normals((dout,))))), ("x", "w", "b"), seed=draw(seeds))


@st.composite
def relu_examples(draw):
    # ReLU has no derivative at 0: inputs stay 1e-4 away from it (h is 1e-6).
    return Example((("x", draw(away_from(draw(small_shapes), (0.0,), margin=1e-4))),), ("x",), seed=draw(seeds))


@st.composite
def dropout_examples(draw):
    x = draw(away_from(draw(small_shapes), (0.0,), margin=1e-3))
    p = draw(st.sampled_from([0.5, 0.1, 0.9, 0.0]))
    rng = None if draw(st.integers(0, 4)) == 0 else Fresh(draw(seeds))
    return Example((("x", x), ("p", p), ("rng", rng)), ("x",), compare=rng is None or p == 0.0, seed=draw(seeds))


def _dropout_invariants(f, ex):
    x, p, rng = ex.get("x"), ex.get("p"), ex.get("rng")
    assert_dropout_properties(f["dropout_forward"], f.get("dropout_backward"), x, p,
                              rng.seed if rng is not None else 0, _dout(ex, x.shape))


@st.composite
def embedding_examples(draw):
    lead = draw(leading_shapes(1, 2, max_side=4))
    V, D = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    ids = draw(token_ids(lead, V))                      # at least one repeated id
    return Example((("ids", ids), ("W", draw(normals((V, D))) ),
                    ("scale", draw(st.sampled_from([1.0, 2.0, math.sqrt(8)])))), ("W",), seed=draw(seeds))


def _embedding_invariants(f, ex):
    ids, W = ex.get("ids"), ex.get("W")
    assert_embedding_properties(f["embedding_forward"], f.get("embedding_backward"), ids, W, ex.get("scale"),
                                _dout(ex, ids.shape + (W.shape[1],)))


@st.composite
def positional_examples(draw):
    d = draw(dims())
    x, table = draw(floats((d.B, d.T, d.D))), draw(normals((d.T + draw(st.integers(0, 3)), d.D)))
    return Example((("x", x), ("table", table)), ("x", "table"), seed=draw(seeds))


def _positional_invariants(f, ex):
    x = ex.get("x")
    assert_positional_properties(f["positional_forward"], f.get("positional_backward"), x, ex.get("table"),
                                 _dout(ex, x.shape))


@st.composite
def sinusoidal_examples(draw):
    return Example((("max_len", draw(st.integers(1, 12))), ("d_model", draw(st.integers(1, 8))),
                    ("dtype", "float64")))


def _sinusoidal_invariants(f, ex):
    assert_sinusoidal_table_properties(f["sinusoidal_table"], ex.get("max_len"), ex.get("d_model"))

# -- softmax, layer norm, feed-forward, residual


@st.composite
def softmax_examples(draw):
    lead, K = draw(leading_shapes(1, 3)), draw(st.integers(1, 6))
    shape = lead + (K,)
    if draw(st.booleans()):          # well-conditioned: gradient check
        x = draw(normals(shape))
        mask = draw(masks(shape, ensure_key=draw(st.booleans()))) if draw(st.booleans()) else None
        return Example((("x", x), ("mask", mask)), ("x",), seed=draw(seeds))
    # hard: logits up to 1e4, fully masked rows
    x = draw(logits(shape))
    mask = draw(masks(shape, fully_masked_row=draw(st.booleans()))) if draw(st.booleans()) else None
    return Example((("x", x), ("mask", mask)), ("x",), gradcheck=False, seed=draw(seeds))


def _softmax_invariants(f, ex):
    x = ex.get("x")
    assert_softmax_properties(f["softmax_forward"], f.get("softmax_backward"), x, ex.get("mask"), _dout(ex, x.shape))


@st.composite
def layer_norm_examples(draw):
    lead, D = draw(leading_shapes(1, 3)), draw(st.integers(1, 6))
    if draw(st.booleans()):
        # With D = 2 every row normalises to about (-1, 1): dx is only about eps / (var + eps)^1.5,
        # below what a central difference resolves unless var is not much larger than eps.
        eps = draw(st.sampled_from([1e-5, 1e-3, 0.1, 1.0] if D != 2 else [0.1, 1.0]))
        x = draw(normals(lead + (D,), draw(st.sampled_from([1.0, 0.1, 10.0] if D != 2 else [1.0, 0.1]))))
        gradcheck = True
    else:                            # hard: hypothesis' values, constant rows included
        eps = draw(st.sampled_from([1e-5, 1e-2]))
        x = draw(floats(lead + (D,), bound=100.0))
        gradcheck = False
    return Example((("x", x), ("gamma", draw(normals((D,)))), ("beta", draw(normals((D,)))), ("eps", eps)),
                   ("x", "gamma", "beta"), gradcheck=gradcheck, seed=draw(seeds))


def _layer_norm_invariants(f, ex):
    x = ex.get("x")
    assert_layer_norm_properties(f["layer_norm_forward"], f.get("layer_norm_backward"), x, ex.get("eps"),
                                 ex.get("gamma"), _dout(ex, x.shape))


def _ffn_params(draw, d):
    return (("w1", draw(normals((d.D, d.F)))), ("b1", draw(normals((d.F,)))),
            ("w2", draw(normals((d.F, d.D)))), ("b2", draw(normals((d.D,)))))


@st.composite
def feed_forward_examples(draw):
    d = draw(dims())
    x = draw(normals((d.B, d.T, d.D)))
    params = _ffn_params(draw, d)
    assume(np.abs(x @ params[0][1] + params[1][1]).min() > 1e-4)      # ReLU's kink is not differentiable
    p = draw(st.sampled_from([0.0, 0.0, 0.3]))
    rng = Fresh(draw(seeds)) if p else None
    return Example((("x", x),) + params + (("dropout", p), ("rng", rng)), ("x", "w1", "b1", "w2", "b2"),
                   compare=not p, seed=draw(seeds))


@st.composite
def residual_ffn_examples(draw):
    d = draw(dims())
    x = draw(normals((d.B, d.T, d.D)))
    params = _ffn_params(draw, d)
    assume(np.abs(x @ params[0][1] + params[1][1]).min() > 1e-4)
    return Example((("x", x),) + params + (("gamma", draw(normals((d.D,)))), ("beta", draw(normals((d.D,)))),
                                           ("eps", draw(st.sampled_from([1e-5, 0.1, 1.0] if d.D != 2 else [0.1, 1.0])))),
                   ("x", "w1", "b1", "w2", "b2", "gamma", "beta"), seed=draw(seeds))

# -- attention


@st.composite
def attention_examples(draw):
    d = draw(dims())
    lead = (d.B, d.H) if draw(st.booleans()) else (d.B,)
    Dk, Dv = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    shapes = (lead + (d.T, Dk), lead + (d.S, Dk), lead + (d.S, Dv))
    if draw(st.booleans()):
        q, k, v = (draw(normals(s)) for s in shapes)
        mask = draw(masks(lead + (d.T, d.S))) if draw(st.booleans()) else None
        p = draw(st.sampled_from([0.0, 0.0, 0.2]))
        rng = Fresh(draw(seeds)) if p else None
        return Example((("q", q), ("k", k), ("v", v), ("mask", mask), ("dropout", p), ("rng", rng)),
                       ("q", "k", "v"), compare=not p, seed=draw(seeds))
    q, k, v = (draw(floats(s)) for s in shapes)            # hard: edge values, fully masked rows
    mask = draw(masks(lead + (d.T, d.S), fully_masked_row=draw(st.booleans())))
    return Example((("q", q), ("k", k), ("v", v), ("mask", mask), ("dropout", 0.0), ("rng", None)),
                   ("q", "k", "v"), gradcheck=False, seed=draw(seeds))


def _attention_invariants(f, ex):
    mask = ex.get("mask")
    if mask is not None and not ex.get("dropout"):
        assert_attention_ignores_unseen_keys(f["attention_forward"], ex.get("q"), ex.get("k"), ex.get("v"), mask)


@st.composite
def split_heads_examples(draw):
    d = draw(dims())
    return Example((("x", draw(floats((d.B, d.T, d.D)))), ("H", d.H)))


@st.composite
def merge_heads_examples(draw):
    d = draw(dims())
    return Example((("x", draw(floats((d.B, d.H, d.T, d.D // d.H)))),))


def _heads_invariants(f, ex):
    x = ex.get("x")
    if x.ndim == 3:
        assert_heads_round_trip(f["split_heads"], f.get("merge_heads", _library("merge_heads")), x, ex.get("H"))
    else:
        Bsz, H, T, Dh = x.shape
        assert_heads_round_trip(f.get("split_heads", _library("split_heads")), f["merge_heads"],
                                x.transpose(0, 2, 1, 3).reshape(Bsz, T, H * Dh), H)


MHA_PARAMS = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")


def _mha_params(draw, D):
    out = []
    for n in "qkvo":
        out.append((f"w_{n}", draw(normals((D, D), 1.0 / math.sqrt(D)))))
        out.append((f"b_{n}", draw(normals((D,), 0.1))))
    return tuple(out)


@st.composite
def multi_head_attention_examples(draw):
    d = draw(dims(max_width=6))
    kind = draw(st.sampled_from(["none", "causal", "padding", "random"]))
    S = d.T if kind == "causal" else d.S
    x_q, x_kv = draw(normals((d.B, d.T, d.D))), draw(normals((d.B, S, d.D)))
    mask = {"none": None, "causal": causal(d.T)}.get(kind)
    if kind == "padding":
        mask = draw(padding_masks(d.B, S))
    elif kind == "random":
        mask = draw(masks((d.B, d.H, d.T, S)))
    p = draw(st.sampled_from([0.0, 0.0, 0.2]))
    rng = Fresh(draw(seeds)) if p else None
    ex = Example((("x_q", x_q), ("x_kv", x_kv)) + _mha_params(draw, d.D) +
                 (("n_heads", d.H), ("mask", mask), ("dropout", p), ("rng", rng)),
                 ("x_q", "x_kv") + MHA_PARAMS, compare=not p, seed=draw(seeds))
    return ex._replace(args=ex.args + (("_t", draw(st.integers(0, d.T - 1))),
                                       ("_src", draw(padded_ids(d.B, S, max(d.V, 2))))))


def _mha_invariants(f, ex):
    fwd = f["multi_head_attention_forward"]
    params = {k: ex.get(k) for k in MHA_PARAMS}
    H = ex.get("n_heads")
    assert_no_look_ahead(fwd, ex.get("x_q"), params, H, ex.get("_t"))
    assert_padding_ignored(fwd, ex.get("x_q"), ex.get("x_kv"), params, H, ex.get("_src"))

# -- recurrent cell


@st.composite
def rnn_step_examples(draw):
    Bsz, Din, H = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return Example((("x", draw(normals((Bsz, Din)))), ("h_prev", draw(normals((Bsz, H), 0.5))),
                    ("w_x", draw(normals((Din, H), 1 / math.sqrt(Din)))), ("w_h", draw(normals((H, H), 0.5))),
                    ("b", draw(normals((H,), 0.1)))), ("x", "h_prev", "w_x", "w_h", "b"), seed=draw(seeds))


@st.composite
def rnn_examples(draw):
    Bsz, T, Din, H = (draw(st.integers(1, n)) for n in (3, 5, 3, 4))
    mask = None
    if draw(st.booleans()):
        lengths = np.array(draw(st.lists(st.integers(1, T), min_size=Bsz, max_size=Bsz)))
        mask = np.arange(T)[None, :] < lengths[:, None]
    return Example((("x", draw(normals((Bsz, T, Din)))), ("h0", draw(normals((Bsz, H), 0.5))),
                    ("w_x", draw(normals((Din, H), 1 / math.sqrt(Din)))), ("w_h", draw(normals((H, H), 0.5))),
                    ("b", draw(normals((H,), 0.1))), ("mask", mask)),
                   ("x", "h0", "w_x", "w_h", "b"), seed=draw(seeds))


def _rnn_invariants(f, ex):
    if ex.get("mask") is not None:
        assert_rnn_skips_masked_steps(f["rnn_forward"], *(ex.get(k) for k in ("x", "h0", "w_x", "w_h", "b", "mask")))

# -- loss and masks


@st.composite
def cross_entropy_examples(draw):
    Bsz, T, V = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(2, 7))
    hard = draw(st.integers(0, 3)) == 0
    x = draw(logits((Bsz, T, V), 4 if hard else 2))
    t = draw(token_ids((Bsz, T), V))
    return Example((("logits", x), ("targets", t), ("smoothing", draw(st.sampled_from([0.0, 0.1, 0.3, 0.9]))),
                    ("pad_id", draw(st.sampled_from([PAD_ID, None])))), ("logits",), gradcheck=not hard,
                   seed=draw(seeds))


def _cross_entropy_invariants(f, ex):
    assert_cross_entropy_properties(f["cross_entropy"], *(ex.get(k) for k in ("logits", "targets", "smoothing",
                                                                             "pad_id")))


@st.composite
def causal_mask_examples(draw):
    return Example((("T", draw(st.integers(1, 8))), ("xp", XP)))


@st.composite
def padding_mask_examples(draw):
    d = draw(dims())
    return Example((("ids", draw(padded_ids(d.B, d.S, d.V))), ("pad_id", PAD_ID)))


def _causal_invariants(f, ex):
    assert_causal_mask_properties(f["causal_mask"], ex.get("T"))


_HINT_RESHAPE = ("reshape (B, T, D) to (B, T, H, Dh), then transpose to (B, H, T, Dh); reshaping straight "
                 "to (B, H, T, Dh) mixes positions into heads")

LAYERS: dict[str, Layer] = {layer.name: layer for layer in [
    Layer("linear", "pair", ("linear_forward", "linear_backward"), linear_examples(), None, {
        "forward": "out = x @ w + b over the last axis (flatten the leading axes to (N, Din) first)",
        "dx": "dx = dout @ w.T",
        "dw": "dw = x.T @ dout with x and dout flattened to (N, Din) and (N, Dout): summed over every leading axis",
        "db": "db = dout summed over every axis but the last"}),
    Layer("relu", "pair", ("relu_forward", "relu_backward"), relu_examples(), None, {
        "forward": "out = max(x, 0)",
        "dx": "dx = dout * (x > 0): the mask comes from the forward's input, not from dout"}),
    Layer("dropout", "pair", ("dropout_forward", "dropout_backward"), dropout_examples(), _dropout_invariants, {
        "forward": "keep a unit where rng.random(x.shape) >= p and scale kept units by 1/(1-p); identity when "
                   "p == 0 or rng is None",
        "dx": "dx = dout * mask with the forward's scaled mask, kept in the cache (never a new draw)"}),
    Layer("embedding", "pair", ("embedding_forward", "embedding_backward"), embedding_examples(),
          _embedding_invariants, {
        "forward": "out = W[ids] * scale",
        "dW": "repeated ids must accumulate (np.add.at / attn.backend.scatter_add), and the scale applies to dW too"}),
    Layer("positional", "pair", ("positional_forward", "positional_backward"), positional_examples(),
          _positional_invariants, {
        "forward": "out = x + table[:T]",
        "dx": "out = x + table[:T], so dx = dout",
        "dtable": "dtable[:T] = dout summed over the batch axis; rows T.. are zero"}),
    Layer("sinusoidal_table", "function", ("sinusoidal_table",), sinusoidal_examples(), _sinusoidal_invariants, {
        "sinusoidal_table": "column 2i is sin(pos / 10000^(2i/d_model)), column 2i+1 the cos of the same angle"}),
    Layer("softmax", "pair", ("softmax_forward", "softmax_backward"), softmax_examples(), _softmax_invariants, {
        "forward": "subtract the row max before exp; masked logits -> the dtype's most negative finite value before "
                   "exp, masked outputs -> 0 after",
        "dx": "dx = y * (dy - sum(dy * y, axis=-1, keepdims=True))"}),
    Layer("layer_norm", "pair", ("layer_norm_forward", "layer_norm_backward"), layer_norm_examples(),
          _layer_norm_invariants, {
        "forward": "gamma * (x - mean) / sqrt(var + eps) + beta over the last axis, biased variance",
        "dx": "dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * gamma: the mean and the variance "
              "both depend on every x of the row",
        "dgamma": "dgamma = sum(dout * xhat) over every row (every axis but the last)",
        "dbeta": "dbeta = sum(dout) over every row (every axis but the last)"}),
    Layer("feed_forward", "pair", ("feed_forward_forward", "feed_forward_backward"), feed_forward_examples(), None, {
        "forward": "out = relu(x @ w1 + b1) @ w2 + b2: one ReLU, between the two linear maps",
        "dx": "backward runs the steps in reverse: linear 2, dropout, ReLU (mask from its input), linear 1",
        "dw1": "dw1 = x.T @ dh with dh the gradient after the ReLU's mask (flatten leading axes)",
        "dw2": "dw2 = a.T @ dout with a the ReLU's (dropped-out) output (flatten leading axes)"}),
    Layer("residual_ffn", "pair", ("residual_ffn_forward", "residual_ffn_backward"), residual_ffn_examples(), None, {
        "forward": "out = layer_norm(x + FFN(x)): the sub-layer's input added to its output, then the norm",
        "dx": "z = x + FFN(x) reaches x by two paths: dx = dz + (FFN's dx of dz); without dz the skip path is gone"}),
    Layer("attention", "pair", ("attention_forward", "attention_backward"), attention_examples(),
          _attention_invariants, {
        "forward": "out = softmax(q @ k.T / sqrt(d_k), mask) @ v: the mask goes into the softmax, before it "
                   "normalises",
        "dq": "ds = softmax_backward(dout @ v.T) * (1/sqrt(d_k)); dq = ds @ k: the scale of the scores applies "
              "to their gradient",
        "dk": "dk = ds.T @ q with ds already scaled by 1/sqrt(d_k)",
        "dv": "dv = weights.T @ dout (the dropped-out weights when dropout is on)"}),
    Layer("split_heads", "function", ("split_heads",), split_heads_examples(), _heads_invariants,
          {"split_heads": _HINT_RESHAPE}),
    Layer("merge_heads", "function", ("merge_heads",), merge_heads_examples(), _heads_invariants,
          {"merge_heads": "transpose (B, H, T, Dh) to (B, T, H, Dh), then reshape to (B, T, H*Dh)"}),
    Layer("multi_head_attention", "pair", ("multi_head_attention_forward", "multi_head_attention_backward"),
          multi_head_attention_examples(), _mha_invariants, {
        "forward": "project q, k, v; split_heads; attention with the mask; merge_heads; output projection. "
                   + _HINT_RESHAPE,
        "dx_kv": "x_kv feeds both the keys and the values: dx_kv = dx_k + dx_v",
        "dx_q": "split the gradient into heads the same way as the forward, attention backward, merge, then "
                "the query projection's backward"}),
    Layer("rnn_step", "pair", ("rnn_step_forward", "rnn_step_backward"), rnn_step_examples(), None, {
        "forward": "h = tanh(x @ w_x + h_prev @ w_h + b)",
        "dx": "da = dh * (1 - h**2) (tanh' from its output), then dx = da @ w_x.T",
        "dw_x": "dw_x = x.T @ da, not da.T @ x"}),
    Layer("rnn", "pair", ("rnn_forward", "rnn_backward"), rnn_examples(), _rnn_invariants, {
        "forward": "h_t = tanh(x_t @ w_x + h_{t-1} @ w_h + b), and h_t = h_{t-1} where the mask is False",
        "dx": "walking t backwards, the gradient reaching h_t is dhs[:, t] plus what step t+1 sent back "
              "(da_{t+1} @ w_h.T); then da_t = g_t * (1 - h_t**2) and dx_t = da_t @ w_x.T",
        "dh0": "walking t backwards, the gradient reaching h_t is dhs[:, t] plus what step t+1 sent back "
               "(da_{t+1} @ w_h.T)",
        "dw_h": "the weights are shared by every step: dw_h = sum over t of h_{t-1}.T @ da_t"}),
    Layer("cross_entropy", "loss", ("cross_entropy",), cross_entropy_examples(), _cross_entropy_invariants, {
        "cross_entropy": "loss = mean over real targets of -(1-eps) log p_y - eps mean_v log p_v (log-softmax with "
                         "the row max subtracted)",
        "dlogits": "dlogits = (softmax(logits) - q) / n_real, q = (1-eps) onehot + eps/V, zero rows at padding"}),
    Layer("causal_mask", "function", ("causal_mask",), causal_mask_examples(), _causal_invariants, {
        "causal_mask": "query i sees keys 0..i, itself included: tril with the diagonal, shape (1, 1, T, T)"}),
    Layer("padding_mask", "function", ("padding_mask",), padding_mask_examples(), None, {
        "padding_mask": "(ids != pad_id)[:, None, None, :], shape (B, 1, 1, S)"}),
]}


def _library(name: str):
    """The library's function called ``name`` (the solution)."""
    from .grader.child import library_function
    return library_function(name)


def reference(layer: str) -> tuple:
    """The library's functions of a layer, in the order of ``LAYERS[layer].functions``."""
    return tuple(_library(n) for n in LAYERS[layer].functions)

# ----------------------------------------------------------------------------- dropout probes
#
# For each layer that takes dropout: arguments on which the layer's output *is* the tensor
# dropout applies to (identity weights after it), every entry of it non-zero. With dropout
# each entry of the output is then 0 or its value without dropout times 1 / (1 - p), so the
# grader reads the mask off the output; the inputs before the dropout are random, so every
# gradient depends on the mask. ``probe(p, rng) -> (arguments, lines that describe them)``.


def _probe_dropout(p, rng):
    return [np.ones((64, 32)), p, rng], ["x = ones (64, 32)"]


def _probe_attention(p, rng):
    Bsz, T = 4, 16
    r = np.random.default_rng(7)
    q, k = r.standard_normal((Bsz, T, 2)), r.standard_normal((Bsz, T, 2))
    v = np.broadcast_to(np.eye(T), (Bsz, T, T)).copy()
    return [q, k, v, None, p, rng], [
        "q, k = standard normal (4, 16, 2), v = identity (4, 16, 16): the output is the attention weights"]


def _probe_feed_forward(p, rng):
    D = 32
    r = np.random.default_rng(7)
    x = r.standard_normal((4, 16, D))
    b1 = np.abs(r.standard_normal(D)) + 0.1
    return [x, np.zeros((D, D)), b1, np.eye(D), np.zeros(D), p, rng], [
        "x standard normal (4, 16, 32), w1 = 0, b1 > 0 (the hidden units), w2 = identity, b2 = 0: the output is "
        "the hidden units"]


def _probe_multi_head_attention(p, rng):
    Bsz, T = 4, 16
    r = np.random.default_rng(7)
    x_q = r.standard_normal((Bsz, T, T))
    x_kv = np.broadcast_to(np.eye(T), (Bsz, T, T)).copy()
    eye, zero = np.eye(T), np.zeros(T)
    w_q, b_q = r.standard_normal((T, T)) / 4, r.standard_normal(T) / 4
    w_k, b_k = r.standard_normal((T, T)) / 4, r.standard_normal(T) / 4
    return [x_q, x_kv, w_q, b_q, w_k, b_k, eye, zero, eye, zero, 1, None, p, rng], [
        "one head, x_q, w_q, b_q, w_k, b_k standard normal, x_kv = w_v = w_o = identity (16 x 16), b_v = b_o = 0: "
        "the output is the attention weights"]


DROPOUT_PROBES = {"dropout": _probe_dropout, "attention": _probe_attention,
                  "feed_forward": _probe_feed_forward, "multi_head_attention": _probe_multi_head_attention}

# ----------------------------------------------------------------------------- where to look (--hint 2)
#
# The second level of a hint: which step or term of the layer to look at, without the
# formula (``--hint 3`` gives that). The first level is the symptom the report shows.

_WHERE = {
    "linear": {"forward": "the affine map over the last axis, with any number of leading axes",
               "dx": "which matrix multiplies dout, and whether it is transposed",
               "dw": "which two arrays are multiplied, in which order, and the leading axes: every position "
                     "contributes to dw",
               "db": "which axes the bias gradient is summed over"},
    "relu": {"forward": "where the output is zero", "dx": "which array decides where the gradient passes"},
    "dropout": {"forward": "what happens to a kept unit, and when dropout is off",
                "dx": "which mask the backward applies, and where it comes from"},
    "embedding": {"forward": "the row lookup and the scale",
                  "dW": "what happens when an id occurs twice, and whether the scale reaches dW"},
    "positional": {"forward": "which rows of the table are added", "dx": "what the addition passes back to x",
                   "dtable": "every sentence of the batch adds the same rows: what does each row receive?"},
    "sinusoidal_table": {"sinusoidal_table": "which columns hold sines and which cosines, and the exponent of "
                                             "10000"},
    "softmax": {"forward": "large logits (overflow), masked logits, and a row whose keys are all masked",
                "dx": "each output depends on every logit of its row through the normaliser"},
    "layer_norm": {"forward": "the mean, the variance (which divisor?) and where eps goes",
                   "dx": "the mean and the variance both depend on every x of the row: two terms besides the "
                         "direct one",
                   "dgamma": "which axes dgamma is summed over, and what multiplies dout",
                   "dbeta": "which axes dbeta is summed over"},
    "feed_forward": {"forward": "the order of the steps: linear, ReLU, (dropout), linear",
                     "dx": "the steps in reverse order, the ReLU's mask from its own input",
                     "dw1": "the gradient reaching the first linear map: after the ReLU's mask",
                     "dw2": "the activation that entered the second linear map"},
    "residual_ffn": {"forward": "what is added before the norm",
                     "dx": "x reaches the output by two paths: the skip path and the network"},
    "attention": {"forward": "where the mask is applied (before or after the normalisation) and the scale of "
                             "the scores",
                  "dq": "the scale of the scores applies to their gradient too",
                  "dk": "the scale of the scores, and which side of the product k is on",
                  "dv": "which weights multiplied v in the forward (after dropout)"},
    "split_heads": {"split_heads": "the order of reshape and transpose: which columns go to which head"},
    "merge_heads": {"merge_heads": "the inverse of split_heads: transpose back before reshaping"},
    "multi_head_attention": {"forward": "split_heads: which columns of every position go to each head",
                             "dx_kv": "x_kv feeds two projections", "dx_q": "the query path, through the heads"},
    "rnn_step": {"forward": "the two products and the nonlinearity", "dx": "tanh's derivative, from its output",
                 "dw_x": "the order of the product"},
    "rnn": {"forward": "what a masked step does to the state",
            "dx": "the gradient reaching h_t comes from two places: its own output and the next step",
            "dh0": "what the first step sends back to the initial state",
            "dw_h": "the weights are shared by every step"},
    "cross_entropy": {"cross_entropy": "the smoothing term, padded targets, and what the mean is over",
                      "dlogits": "the gradient of the smoothed loss, and what it is divided by"},
    "causal_mask": {"causal_mask": "the diagonal: may a position see itself?"},
    "padding_mask": {"padding_mask": "the shape that broadcasts over heads and queries"},
}
for _name, _where in _WHERE.items():
    LAYERS[_name] = LAYERS[_name]._replace(where=_where)

# ----------------------------------------------------------------------------- the whole path: lessons 2-15
#
# Exercises beyond single layers, graded against the code the library runs
# (:mod:`attn.grader.solutions` calls attn.model, attn.optim, attn.decode and attn.bpe).


class Built(NamedTuple):
    """An argument made by ``attn.grader.solutions.<function>(*args)`` (the fixed model of the
    decoding exercise): in the grader's process for the library's call, in the child for
    the learner's."""
    function: str
    args: tuple


@st.composite
def luong_examples(draw):
    Bsz, T, S, H = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    lengths = np.array(draw(st.lists(st.integers(1, S), min_size=Bsz, max_size=Bsz)))
    mask = np.arange(S)[None, :] < lengths[:, None]
    return Example((("s", draw(normals((Bsz, T, H)))), ("e", draw(normals((Bsz, S, H)))),
                    ("w_c", draw(normals((2 * H, H), 1 / math.sqrt(2 * H)))), ("b_c", draw(normals((H,), 0.1))),
                    ("src_mask", mask)), ("s", "e", "w_c", "b_c"), seed=draw(seeds))


def _luong_invariants(f, ex):
    """Whatever sits at padded source positions, the output does not change."""
    s, e, w_c, b_c, mask = (ex.get(k) for k in ("s", "e", "w_c", "b_c", "src_mask"))
    if mask.all():
        return
    e2 = e.copy()
    e2[~mask] = 1e3
    fwd = f["luong_attention_forward"]
    outs = [_host(_out(fwd(_dev(s), _dev(x), _dev(w_c), _dev(b_c), _dev(mask)))) for x in (e, e2)]
    if not np.allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12):
        raise InvariantError("changing padded encoder states changed the output: padding leaks into the context",
                             "the source mask must reach the scores before the softmax")


@st.composite
def decoder_mask_examples(draw):
    d = draw(dims())
    return Example((("tgt_ids", draw(padded_ids(d.B, d.T, d.V))), ("pad_id", PAD_ID)))


def _block_params(draw, D, F, names):
    out = {}
    for name in names:
        if name.endswith("attn"):
            for n in "qkvo":
                out[f"{name}.w_{n}"] = draw(normals((D, D), 1.0 / math.sqrt(D)))
                out[f"{name}.b_{n}"] = draw(normals((D,), 0.1))
        elif name == "ffn":
            out.update({"ffn.w1": draw(normals((D, F), 1 / math.sqrt(D))), "ffn.b1": draw(normals((F,), 0.1)),
                        "ffn.w2": draw(normals((F, D), 1 / math.sqrt(F))), "ffn.b2": draw(normals((D,), 0.1))})
        else:
            out[f"{name}.gamma"] = 1.0 + draw(normals((D,), 0.1))
            out[f"{name}.beta"] = draw(normals((D,), 0.1))
    return out


@st.composite
def _block_dims(draw):
    """dims() for a whole block: widths 3 or 4 (with D = 2 a layer norm's output is +-1 whatever its input,
    and central differences through it stop resolving the gradients behind it)."""
    d = draw(dims(max_batch=2, max_len=4, max_width=4))
    D = draw(st.sampled_from([3, 4]))
    return d._replace(D=D, H=draw(st.sampled_from(divisors(D))), F=max(d.F, 2))


#: eps of the blocks' layer norms: large enough that central differences resolve every gradient.
BLOCK_EPS = st.sampled_from([1e-3, 0.1])


@st.composite
def encoder_layer_examples(draw):
    d = draw(_block_dims())
    mask = draw(padding_masks(d.B, d.S)) if draw(st.booleans()) else None
    params = _block_params(draw, d.D, d.F, ("self_attn", "norm1", "ffn", "norm2"))
    return Example((("x", draw(normals((d.B, d.S, d.D)))), ("mask", mask), ("params", params), ("n_heads", d.H),
                    ("eps", draw(BLOCK_EPS))), ("x", "params"), seed=draw(seeds))


@st.composite
def decoder_layer_examples(draw):
    d = draw(_block_dims())
    from .masks import decoder_mask
    tgt = draw(padded_ids(d.B, d.T, max(d.V, 2)))
    params = _block_params(draw, d.D, d.F, ("self_attn", "norm1", "cross_attn", "norm2", "ffn", "norm3"))
    return Example((("x", draw(normals((d.B, d.T, d.D)))), ("memory", draw(normals((d.B, d.S, d.D)))),
                    ("src_mask", draw(padding_masks(d.B, d.S))), ("tgt_mask", decoder_mask(tgt)),
                    ("params", params), ("n_heads", d.H), ("eps", draw(BLOCK_EPS))), ("x", "memory", "params"),
                   seed=draw(seeds))


@st.composite
def transformer_examples(draw):
    D = draw(st.sampled_from([3, 4]))
    H, F, V = draw(st.sampled_from(divisors(D))), draw(st.integers(2, 4)), draw(st.integers(4, 7))
    n_enc, n_dec = draw(st.integers(1, 2)), 1
    Bsz, S, T = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    params = {"embedding.weight": draw(normals((V, D)))}
    for i in range(n_enc):
        params.update({f"encoder.{i}.{k}": v for k, v in _block_params(
            draw, D, F, ("self_attn", "norm1", "ffn", "norm2")).items()})
    for i in range(n_dec):
        params.update({f"decoder.{i}.{k}": v for k, v in _block_params(
            draw, D, F, ("self_attn", "norm1", "cross_attn", "norm2", "ffn", "norm3")).items()})
    return Example((("src", draw(padded_ids(Bsz, S, V))), ("tgt_in", draw(padded_ids(Bsz, T, V))),
                    ("params", params), ("n_heads", H), ("eps", draw(BLOCK_EPS))), ("params",), seed=draw(seeds))


def explain_tied_embedding(label, yours, expected, ex, dout) -> str:
    """For ``embedding.weight``: which of its three gradient paths yours lacks (or counts twice)."""
    if "embedding.weight" not in label:
        return ""
    from .grader import solutions
    args = {k: B.to_device(v) if isinstance(v, np.ndarray) else
            ({n: B.to_device(a) for n, a in v.items()} if isinstance(v, dict) else v) for k, v in ex.args}
    paths = solutions.tied_embedding_paths(args["params"], args["n_heads"], args["eps"], args["src"],
                                           args["tgt_in"], B.to_device(dout))
    y, e = B.to_host(yours), B.to_host(expected)
    scale = np.abs(e).max() + 1e-300
    for name, g in paths.items():
        g = B.to_host(g)
        if np.abs(g).max() > 1e-9 * scale:
            if np.abs(y - (e - g)).max() <= 1e-7 * scale:
                return (f"yours is the expected without the path through {name}: embedding.weight is used three "
                        "times, and its gradient is the sum of all three")
            if np.abs(y - (e + g)).max() <= 1e-7 * scale:
                return f"yours counts the path through {name} twice"
    return ""


@st.composite
def noam_examples(draw):
    return Example((("step", draw(st.integers(1, 20000))), ("d_model", draw(st.sampled_from([8, 64, 256, 512]))),
                    ("warmup_steps", draw(st.sampled_from([1, 10, 400, 4000]))),
                    ("factor", draw(st.sampled_from([1.0, 2.0, 0.5])))))


@st.composite
def adam_examples(draw):
    """A few steps from zero moments: params, one gradient dict per step, and the rate of each step."""
    shapes = draw(st.lists(small_shapes, min_size=1, max_size=3))
    params = {f"p{i}": draw(normals(s)) for i, s in enumerate(shapes)}
    K = draw(st.integers(1, 4))
    grads = [{k: draw(normals(v.shape, draw(st.sampled_from([1.0, 1e-3, 100.0])))) for k, v in params.items()}
             for _ in range(K)]
    lrs = [draw(st.sampled_from([1e-3, 0.1, 0.5])) for _ in range(K)]
    beta1, beta2 = draw(st.sampled_from([(0.9, 0.98), (0.9, 0.999), (0.5, 0.9)]))
    return Example((("params", params), ("grads", grads), ("lrs", lrs), ("beta1", beta1), ("beta2", beta2),
                    ("eps", draw(st.sampled_from([1e-9, 1e-3])))))


@st.composite
def decoding_examples(draw, beam: bool):
    Bsz, S = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    args = [("model", Built("decoding_model", (draw(st.integers(0, 3)),))), ("src", draw(padded_ids(Bsz, S, 6)))]
    if beam:
        args += [("beam_size", draw(st.integers(1, 4))), ("alpha", draw(st.sampled_from([0.0, 0.6, 1.0])))]
    args.append(("max_len", draw(st.integers(1, 8))))
    return Example(tuple(args))


def compare_decoded(got, want, ex) -> None:
    """(tokens, scores): the same tokens for every sentence, scores within 1e-9."""
    if not (isinstance(got, tuple) and len(got) == 2):
        raise InvariantError(f"the result is a {type(got).__name__}, expected (tokens, scores)",
                             "return the tokens of each sentence (a list of lists of ints) and their scores")
    tokens, scores = got
    wt, ws = want
    try:
        tokens = [[int(t) for t in row] for row in tokens]
        scores = [float(s) for s in scores]
    except (TypeError, ValueError):
        raise InvariantError("tokens must be a list of lists of ids and scores a list of numbers",
                             "one row of tokens and one score per sentence") from None
    if len(tokens) != len(wt) or len(scores) != len(ws):
        raise InvariantError(f"{len(tokens)} rows of tokens and {len(scores)} scores for {len(wt)} sentences",
                             "one row of tokens and one score per sentence of src")
    for i, (a, b) in enumerate(zip(tokens, wt)):
        if a != b:
            raise InvariantError(f"sentence {i}: your tokens {a}, the library's {b}",
                                 "the stopping rule (EOS, max_len), PAD and BOS never generated, and which "
                                 "hypothesis is kept")
    for i, (a, b) in enumerate(zip(scores, ws)):
        if not abs(a - b) <= 1e-9 * (1 + abs(b)):
            raise InvariantError(f"sentence {i}: your score {a!r}, the library's {b!r} (same tokens)",
                                 "the score is the summed log-probabilities, EOS included; beam search divides "
                                 "it by the length penalty")


@st.composite
def average_examples(draw):
    shapes = draw(st.lists(small_shapes, min_size=1, max_size=3))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    ckpts = [{f"p{i}": draw(normals(s, 10.0)).astype(dtype) for i, s in enumerate(shapes)}
             for _ in range(draw(st.integers(1, 5)))]
    return Example((("checkpoints", ckpts),))


def compare_arrays_by_name(got, want, ex) -> None:
    if not isinstance(got, dict) or sorted(got) != sorted(want):
        raise InvariantError(f"the result has keys {sorted(got) if isinstance(got, dict) else type(got).__name__}, "
                             f"expected {sorted(want)}", "return a dict keyed like each checkpoint")
    for k in want:
        g, w = B.to_host(got[k]), B.to_host(want[k])
        if g.shape != w.shape or g.dtype != w.dtype:
            raise InvariantError(f"{k!r} has shape {g.shape} dtype {g.dtype}, expected {w.shape} {w.dtype}",
                                 "the mean keeps each parameter's shape and dtype")
        tol = 1e-6 if w.dtype == np.float32 else 1e-12
        if not np.allclose(g, w, rtol=tol, atol=tol * (np.abs(w).max() + 1)):
            raise InvariantError(f"{k!r} differs from the parameter-wise mean",
                                 "sum in float64, divide by the number of checkpoints, then cast back")


WORDS = st.text(alphabet="abcde", min_size=1, max_size=6)


@st.composite
def bpe_examples(draw):
    counts = draw(st.dictionaries(WORDS, st.integers(1, 6), min_size=1, max_size=8))
    return Example((("token_counts", counts), ("num_merges", draw(st.integers(0, 12)))))


def compare_merges(got, want, ex) -> None:
    try:
        got = [tuple(p) for p in got]
    except TypeError:
        raise InvariantError(f"the result is a {type(got).__name__}, expected a list of (a, b) pairs",
                             "return the merges in the order learned") from None
    want = [tuple(p) for p in want]
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if got != want:
        raise InvariantError(
            f"merge {n}: yours {got[n] if n < len(got) else '(none)'}, the library's "
            f"{want[n] if n < len(want) else '(none)'} ({len(got)} merges, expected {len(want)})",
            "the most frequent pair, counted with each word's count; ties to the alphabetically first pair; "
            "stop at num_merges or when no pair occurs twice")


LAYERS.update({layer.name: layer for layer in [
    Layer("luong_attention", "pair", ("luong_attention_forward", "luong_attention_backward"), luong_examples(),
          _luong_invariants, {
              "forward": "out = tanh([a @ e ; s] @ w_c + b_c), a = softmax(s @ e^T) with the source mask",
              "ds": "s is used twice (the query of the scores, and half of the concatenation): ds is the sum of both",
              "de": "e is used twice (the keys of the scores, and the values of the context): de is the sum"},
          {"forward": "the scores (which product), the mask, and the order of [context ; state]",
           "ds": "every place s is used", "de": "every place e is used", "dw_c": "the concatenation it multiplied"}),
    Layer("decoder_mask", "function", ("decoder_mask",), decoder_mask_examples(), None, {
        "decoder_mask": "causal_mask(T) & padding_mask(tgt_ids): (B, 1, T, T)"},
        {"decoder_mask": "both masks at once: the future and the padded keys"}),
    Layer("encoder_layer", "pair", ("encoder_layer_forward", "encoder_layer_backward"), encoder_layer_examples(),
          None, {"forward": "h = LayerNorm1(x + SelfAttn(x, x, mask)); out = LayerNorm2(h + FFN(h))",
                 "dx": "each Add & Norm: dz from the norm, then dz + (sub-layer backward of dz)"},
          {"forward": "the residual additions and the order of the two sub-layers",
           "dx": "each sub-layer's input reaches its output by two paths: the residual and the sub-layer"}),
    Layer("decoder_layer", "pair", ("decoder_layer_forward", "decoder_layer_backward"), decoder_layer_examples(),
          None, {"forward": "masked self-attention, cross-attention (queries from x, keys and values from memory, "
                            "src_mask), FFN, each as LayerNorm(x + sublayer(x))",
                 "dmemory": "memory gives the cross-attention its keys and its values: dmemory = dx_kv"},
          {"forward": "which mask each attention uses, and where the queries, keys and values come from",
           "dx": "the three residual paths", "dmemory": "the cross-attention's keys and values"}),
    Layer("transformer", "pair", ("transformer_forward", "transformer_backward"), transformer_examples(), None, {
        "forward": "logits = decoder(embed(tgt_in), encoder(embed(src))) @ E^T with E = embedding.weight, the "
                   "embeddings scaled by sqrt(d_model) plus the sinusoids",
        "dembedding.weight": "dE = (source embedding's dW) + (target embedding's dW) + dlogits^T @ h"},
        {"forward": "the scale of the embeddings, the positions, the masks (padding, look-ahead), the shared "
                    "output projection",
         "dembedding.weight": "embedding.weight is used three times: every use sends back a gradient"},
        explain=explain_tied_embedding),
    Layer("noam_lr", "function", ("noam_lr",), noam_examples(), None, {
        "noam_lr": "factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)"},
        {"noam_lr": "the two branches of the min, and the 1-based step"}),
    Layer("adam", "steps", ("adam_step",), adam_examples(), None, {
        "adam_step": "m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) "
                     "+ eps)"},
        {"adam_step": "the bias correction of both moments, and where eps goes"}),
    Layer("greedy_decode", "function", ("greedy_decode",), decoding_examples(False), None, {
        "greedy_decode": "encode, then from BOS: the most probable token at every step (PAD and BOS never), until "
                         "EOS or max_len; the score sums the chosen tokens' log-probabilities, EOS included"},
        {"greedy_decode": "the stopping rule, and the tokens banned from generation"}, compare=compare_decoded),
    Layer("beam_search", "function", ("beam_search",), decoding_examples(True), None, {
        "beam_search": "keep the K best unfinished beams by summed log-probability; a beam that ends in EOS is "
                       "finished with score logP / ((5 + len) / 6)^alpha; stop when no live beam can beat the "
                       "best finished one (or at max_len)"},
        {"beam_search": "when a sentence's search may stop: a finished hypothesis is not the end while a live "
                        "beam could still beat it"}, compare=compare_decoded),
    Layer("average_checkpoints", "function", ("average_checkpoints",), average_examples(), None, {
        "average_checkpoints": "mean over the checkpoints of each parameter, summed in float64, cast back"},
        {"average_checkpoints": "the precision of the sum and the dtype of the result"},
        compare=compare_arrays_by_name),
    Layer("bpe", "function", ("learn_merges",), bpe_examples(), None, {
        "learn_merges": "count adjacent pairs over all words, times each word's count; merge the most frequent "
                        "(ties: the alphabetically first pair) everywhere; repeat"},
        {"learn_merges": "the tie-break, the counts weighted by word frequency, and when to stop"},
        compare=compare_merges),
]})

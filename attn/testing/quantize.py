"""The registration of int8 quantisation (:mod:`attn.quantize`): a matrix quantised a row at a time
and dequantised, ``int8_round_trip(w)``, graded as a function against the library's, its examples
(rows of zeros, rows of exact multiples of their scale, halves between two steps, a negative
largest number), the invariants a reader states aloud, and the typical mistakes, read from
:data:`attn.testing.registry.LAYERS` like every other."""
from __future__ import annotations

from hypothesis import strategies as st

from .. import backend as B
from .invariants import InvariantError, _dev, _first, _host
from .layers import Example, Layer, Mistake
from .strategies import floats, normals

np = B.host

QMAX = 127


@st.composite
def int8_examples(draw):
    R, N = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["normal", "hard", "steps"]))
    if kind == "normal":
        w = draw(normals((R, N), draw(st.sampled_from([1.0, 0.02, 300.0]))))
    elif kind == "hard":                                         # hypothesis' values: zeros, repeats, extremes
        w = draw(floats((R, N), bound=100.0))
    else:                                                        # exact steps and halves between two of them
        k = np.array(draw(st.lists(st.integers(-QMAX, QMAX), min_size=R * N, max_size=R * N)), float).reshape(R, N)
        k[:, 0] = QMAX * np.where(k[:, 0] < 0, -1, 1)            # each row reaches +-127: its scale is the step
        half = np.array(draw(st.lists(st.booleans(), min_size=R * N, max_size=R * N))).reshape(R, N)
        k[:, 1:] += np.where(half[:, 1:] & (np.abs(k[:, 1:]) < QMAX), 0.5, 0.0)
        w = k * 2.0 ** draw(st.integers(-8, 4))
    if draw(st.booleans()):
        w[draw(st.integers(0, R - 1))] = 0.0                     # a row of zeros: scale 0
    return Example((("w", w),))


def _scale(w):
    return np.abs(w).max(axis=-1, keepdims=True) / QMAX


def assert_int8_properties(round_trip, w) -> None:
    """``round_trip(w)`` is within ``scale / 2`` of ``w`` (``scale = max|row| / 127``, a few of
    float64's last bits allowed); it is ``q * scale`` with q an integer in [-127, 127]; a row of
    zeros stays zero; ``-w`` gives the negated result; and ``w`` made of multiples of a power of
    two that reach +-127 of it comes back exactly."""
    w = np.asarray(w, dtype=float)
    got = _host(round_trip(_dev(w))).astype(float)
    if got.shape != w.shape:
        raise InvariantError(f"the result has shape {got.shape}, w has {w.shape}",
                             "the round trip gives back a matrix of w's shape: q * scale")
    s = _scale(w)
    err, bound = np.abs(got - w), s / 2 + 8 * np.finfo(float).eps * np.abs(w)
    if not (err <= bound).all():
        i = _first(~(err <= bound))
        raise InvariantError(f"row {i[0]}: |w - w_hat| is {err[i]:.6g} at column {i[1]}, more than half a step, "
                             f"scale / 2 = {s[i[0], 0] / 2:.6g} with scale = max|row| / 127",
                             "round w / scale to the nearest integer (not toward zero), with one scale per row")
    q = np.divide(got, s, out=np.zeros_like(got), where=s > 0)
    if not (np.abs(q - np.round(q)) <= 1e-6).all() or np.abs(q).max(initial=0) > QMAX + 1e-6:
        raise InvariantError("the result is not q * scale with q an integer in [-127, 127] and scale = max|row| "
                             "/ 127", "scale = max|row| / 127 for each row; q = clip(round(w / scale), -127, 127)")
    if (got[(s == 0)[:, 0]] != 0).any():
        raise InvariantError("a row of zeros did not stay zero (its scale is 0: divide by 1 there, or NaN appears)",
                             "a row whose max|row| is 0 has scale 0 and q = 0")
    neg = _host(round_trip(_dev(-w))).astype(float)
    if not np.array_equal(neg, -got):
        raise InvariantError("round_trip(-w) is not -round_trip(w): the quantisation is not symmetric",
                             "a symmetric range, -127..127, and rounding to the nearest integer")
    k = np.clip(np.round(w / np.where(s > 0, s, 1.0)), -QMAX, QMAX)
    k[:, :1] = QMAX                                              # each row reaches 127: the step is exactly 2**-3
    exact = k * 2.0 ** -3
    if not np.array_equal(_host(round_trip(_dev(exact))).astype(float), exact):
        raise InvariantError("a matrix of multiples of 1/8 whose rows reach 127/8 did not come back exactly",
                             "scale = max|row| / 127 is exactly the step there; q = round(w / scale)")


def int8_invariants(f, ex):
    assert_int8_properties(f["int8_round_trip"], ex.get("w"))


def _wrong(divide, scale_of):
    def wrong(ex, dout):
        w = ex.get("w")
        s = scale_of(w)
        return np.clip(divide(w / np.where(s > 0, s, 1.0)), -QMAX, QMAX) * s
    return wrong


per_tensor = _wrong(np.round, lambda w: np.abs(w).max() / QMAX + 0 * w[:, :1])
per_column = _wrong(np.round, lambda w: np.abs(w).max(axis=0, keepdims=True) / QMAX)
truncated = _wrong(np.trunc, _scale)
by_128 = _wrong(np.round, lambda w: np.abs(w).max(axis=-1, keepdims=True) / 128)


def explicit():
    """A matrix of each mistake's: rows of other scales, a negative largest number, halves."""
    w = np.array([[1.0, -0.5, 0.25, 0.126], [-40.0, 10.1, 3.3, -0.7], [0.0, 0.0, 0.0, 0.0],
                  [0.01, 0.02, -0.015, 0.005]])
    return (Example((("w", w),)), Example((("w", w[:2].T.copy()),)))


INT8 = Layer("int8", "function", ("int8_round_trip",), int8_examples(), int8_invariants, {
    "int8_round_trip": "scale = max|row| / 127 (a row at a time); q = clip(round(w / scale), -127, 127); "
                       "return q * scale (a zero row: scale 0, q 0)"},
             where={"int8_round_trip": "one scale per row (over the last axis), 127 steps each side, rounding to "
                                       "the nearest integer"}, library="attn.quantize", mistakes=(
    Mistake("int8_round_trip", per_tensor, "one scale for the whole matrix, max|w| / 127",
            "each row (output channel) has its own scale, max|row| / 127: a row of small numbers keeps its steps"),
    Mistake("int8_round_trip", per_column, "one scale per column, the max over the rows",
            "the max is over the last axis, the row's own numbers: max(axis=-1, keepdims=True)"),
    Mistake("int8_round_trip", truncated, "w / scale truncated toward zero (a cast to int8), not rounded",
            "round to the nearest integer before the cast: truncating moves a number by up to a whole step"),
    Mistake("int8_round_trip", by_128, "scale = max|row| / 128: the largest number does not come back",
            "127 steps each side (the range is symmetric, -128 unused): scale = max|row| / 127")),
             explicit=explicit())

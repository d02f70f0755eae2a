"""Naming the mistake: what a wrong result is, where the comparison says which.

A wrong result is often one a learner commonly writes, or the right gradient with a term left
out, counted twice or given the wrong sign, or with a factor missing or extra. Each layer's
registration lists them (:attr:`attn.testing.Layer.mistakes`: a :class:`~attn.testing.Mistake`,
a :class:`~attn.testing.Term`, a :class:`~attn.testing.Factor`, each with the text of its
hints); here they are computed on the failing example and compared with the learner's result:
one it equals, the combination of terms that yours minus the expected is, the factor that
yours over the expected is, and the report names it (hint 1) and where it comes from (hint 2),
instead of a scale factor or nothing."""
from __future__ import annotations

from .. import backend as B
from ..gradcheck import rel_error
from ..testing import Built, Example, Factor, Layer, Mistake, Term
from .library import library_function
from .results import Failure

np = B.host


def _fit(d, terms):
    """Coefficients c with ``d == sum(c_k * terms_k)`` to rounding, or None."""
    A = np.stack([np.broadcast_to(t, d.shape).reshape(-1) for t in terms], axis=1)
    if np.linalg.matrix_rank(A) < A.shape[1]:
        return None
    c = np.linalg.lstsq(A, d.reshape(-1), rcond=None)[0]
    return c if rel_error(A @ c, d.reshape(-1)) < 1e-7 else None


def _how(c: float) -> str:
    if abs(c + 1) < 1e-6:
        return "is missing"
    if abs(c - 1) < 1e-6:
        return "is counted twice"
    if abs(c + 2) < 1e-6:
        return "has the wrong sign"
    return f"has {1 + c:.4g} times its weight"


def _same(yours, value) -> bool:
    """Whether ``yours`` is ``value``: arrays to rounding (a size-1 value broadcast), numbers
    to rounding, dicts key by key, anything else exactly."""
    if B.is_device_array(yours) or B.is_device_array(value):
        yours, value = B.to_host(yours), B.to_host(value)
    if type(value) is dict:
        return type(yours) is dict and yours.keys() == value.keys() and all(_same(yours[k], value[k]) for k in value)
    if type(value) in (list, tuple):
        return (type(yours) in (list, tuple) and len(yours) == len(value)
                and all(_same(a, b) for a, b in zip(yours, value)))
    if isinstance(value, np.ndarray):
        if not isinstance(yours, np.ndarray) or (yours.shape != value.shape and (value.size != 1 or
                                                                                  value.ndim > yours.ndim)):
            return False
        value = np.broadcast_to(value, yours.shape)
        if value.dtype != yours.dtype and value.dtype.kind == "f":     # another precision: another mistake
            return False
        if value.dtype.kind != "f" or yours.dtype.kind != "f":
            return bool(np.array_equal(yours, value))
        nan = np.isnan(value)
        if nan.any():                   # a mistake that makes NaN: the same NaN, the rest to rounding
            return bool(np.array_equal(nan, np.isnan(yours))) and rel_error(yours[~nan], value[~nan]) < 1e-7
        return rel_error(yours, value) < 1e-7
    if isinstance(value, float):
        return isinstance(yours, (int, float, np.number)) and abs(yours - value) <= 1e-9 * (1 + abs(value))
    try:
        return bool(yours == value)
    except Exception:                   # a comparison the types do not support: not this mistake
        return False


def mistakes_made(layer: Layer, result: str, yours, ex: Example, dout=None) -> list:
    """The typical mistakes of ``layer``'s registration whose ``result`` (``"forward"``, a
    gradient's key, a function's name) equals ``yours`` on ``ex``."""
    made = []
    if any(isinstance(v, Built) for _, v in ex.args):           # the example's model, made here
        ex = ex._replace(args=tuple((n, library_function(v.function)(*v.args) if isinstance(v, Built) else v)
                                    for n, v in ex.args))
    for m in _of(layer, Mistake, result):
        try:
            value = m.wrong(ex, dout)[result] if isinstance(m.result, tuple) else m.wrong(ex, dout)
        except Exception:               # a mistake this example cannot show (a shape it does not fit)
            continue
        if _same(yours, value):
            made.append(m)
    return made


def name_mistake(f: Failure, layer: Layer, result: str, yours, ex: Example, dout=None) -> bool:
    """Say in ``f`` which typical mistake ``yours`` shows: hint 1 what it is, hint 2 where to
    look. Two or more at once mark ``f`` ambiguous: the grader looks for an example that tells
    them apart (:func:`attn.grader.grading._run`). True if any was found."""
    made = mistakes_made(layer, result, yours, ex, dout)
    if made:
        f.symptom = "yours is " + " or ".join(m.looks for m in made) + (
            " (this example cannot tell them apart)" if len(made) > 1 else "")
        f.look = made[0].look if len(made) == 1 else f.look
        f.ambiguous = len(made) > 1
    return bool(made)


def diagnose(f: Failure, layer: Layer, key: str, g, w, ex: Example, dout) -> bool:
    """Name the mistake, the term or the factor that makes the gradient ``g`` (yours) differ
    from ``w`` (expected) in ``f``'s symptom (hint 1) and where it comes from in ``f.look``
    (hint 2), where the comparison says which. True if one was named."""
    if g.shape != w.shape or not np.isfinite(g).all() or w.dtype.kind != "f":
        return False
    if name_mistake(f, layer, key, g, ex, dout):
        return True
    terms = []
    for t in _of(layer, Term, key):
        try:
            value = t.value(ex, dout)
            value = value[key] if isinstance(t.result, tuple) else value
        except Exception:               # an example the term cannot be computed on (dropout): not this one
            continue
        if np.abs(value).max() > 0:
            terms.append((t, value))
    c = _fit(g - w, [v for _, v in terms]) if terms else None
    if c is not None:
        wrong = [(t, ck) for (t, _), ck in zip(terms, c) if abs(ck) > 1e-6]
        if wrong:
            f.symptom = "yours is the expected where " + " and ".join(f"{t.name} {_how(ck)}" for t, ck in wrong)
            f.look = "; ".join(t.look for t, _ in wrong)
            return True
    ww = float((w * w).sum())
    ratio = float((g * w).sum()) / ww if ww > 0 else 0.0
    if ww > 0 and rel_error(g, ratio * w) < 1e-7:
        for factor in _of(layer, Factor, key):
            s, name = factor.value(ex), factor.name
            name = name.format(inverse=f"{1 / s:.6g}") if "{inverse}" in name else name
            if factor.has and abs(ratio * s - 1) < 1e-6:
                f.symptom = f"yours is {ratio:.6g} times the expected: the factor {name} is missing"
            elif abs(ratio - s) < 1e-6:
                f.symptom = f"yours is {ratio:.6g} times the expected: " + (
                    f"the factor {name} is applied twice" if factor.has else f"the factor {name}")
            else:
                continue
            f.look = factor.look or f.look
            return True
    return False


def _of(layer: Layer, kind, key: str) -> list:
    """The entries of ``kind`` (Mistake, Term, Factor) of ``layer``'s registration for the result ``key``."""
    return [m for m in layer.mistakes if isinstance(m, kind)
            and key in (m.result if isinstance(m.result, tuple) else (m.result,))]

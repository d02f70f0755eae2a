"""Naming the mistake: what a wrong result is, where the comparison says which.

A wrong result is often one a learner commonly writes (each layer's registration lists them:
:attr:`attn.testing.Layer.mistakes`, the text of each hint with it), or the right gradient
with a term left out, counted twice or given the wrong sign. For the layers whose backward the
lessons derive by hand, the terms of the right gradient are computed here from the example;
if yours minus the expected is exactly a combination of them, the report names which (hint 1)
and where that term comes from (hint 2), instead of a scale factor or nothing."""
from __future__ import annotations

import math
from typing import NamedTuple

from .. import backend as B
from ..gradcheck import rel_error
from ..testing import Built, Example, Layer
from .library import library_function
from .results import Failure

np = B.host


class Term(NamedTuple):
    """One term of a correct gradient, computed on the example: ``expected`` contains it."""
    name: str
    value: object
    look: str


def _layer_norm_terms(x, gamma, eps, dout, where: str = "") -> list:
    """The two terms of layer norm's dx besides the direct ``rstd * g``."""
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xhat, g = (x - mean) * rstd, dout * gamma
    return [Term(f"{where}the mean term -rstd * mean(g)", -rstd * g.mean(axis=-1, keepdims=True) + 0 * x,
                 f"{where}the mean of the row depends on every x of the row: its gradient takes mean(g) from "
                 "every entry"),
            Term(f"{where}the variance term -rstd * xhat * mean(g * xhat)", -rstd * xhat * (g * xhat).mean(
                axis=-1, keepdims=True), f"{where}rstd = 1/sqrt(var + eps) depends on every x of the row too: it "
                "is not a constant of the backward")]


def _softmax_term(y, dy) -> Term:
    return Term("the normaliser's term -y * sum(dy * y)", -y * (dy * y).sum(axis=-1, keepdims=True),
                "each output depends on every logit of its row through the normaliser (the sum in the "
                "denominator), not only on its own logit")


def _terms(layer: str, label: str, ex: Example, dout) -> list:
    """The terms of the library's gradient ``label`` on ``ex`` that a learner may leave out."""
    lib = library_function
    if layer == "layer_norm" and label == "dx":
        return _layer_norm_terms(ex.get("x"), ex.get("gamma"), ex.get("eps"), dout)
    if layer == "softmax" and label == "dx":
        return [_softmax_term(B.to_host(lib("softmax_forward")(ex.get("x"), ex.get("mask"))[0]), dout)]
    if layer == "residual_ffn" and label == "dx":
        x, eps, gamma = ex.get("x"), ex.get("eps"), ex.get("gamma")
        f, cf = lib("feed_forward_forward")(*(ex.get(n) for n in ("x", "w1", "b1", "w2", "b2")))
        _, cn = lib("layer_norm_forward")(x + f, gamma, ex.get("beta"), eps)
        dz = lib("layer_norm_backward")(dout, cn)[0]
        through = lambda t: t + lib("feed_forward_backward")(t, cf)[0]          # noqa: E731  z's gradient to x
        norm = [t._replace(value=through(t.value)) for t in _layer_norm_terms(x + f, gamma, eps, dout,
                                                                               "the layer norm's ")]
        return [Term("the skip path's dz", dz, "x reaches z = x + FFN(x) by two paths: the skip path passes dz "
                                              "to x unchanged")] + norm
    if layer == "attention" and label in ("dq", "dk") and not ex.get("dropout"):
        q, k, v = ex.get("q"), ex.get("k"), ex.get("v")
        w = B.to_host(lib("attention_forward")(q, k, v, ex.get("mask"))[1].weights)
        t = _softmax_term(w, dout @ v.swapaxes(-1, -2))
        ds = t.value / np.sqrt(q.shape[-1])
        value = ds @ k if label == "dq" else ds.swapaxes(-1, -2) @ q
        return [Term("the softmax's " + t.name[4:], value, "the softmax inside: " + t.look)]
    return []


def _scales(layer: str, label: str, ex: Example) -> dict:
    """Named factors: ``name -> (factor, whether the right gradient has it, where to look)``.
    Yours, the expected divided by a factor it has, lacks it; times it, has it twice; times
    one it has not, has it in excess."""
    if layer in ("attention", "flash_attention") and label in ("dq", "dk"):
        return {"1/sqrt(d_k) of the scores": (1.0 / math.sqrt(ex.get("q").shape[-1]), True,
                                              "the scale of the scores, 1/sqrt(d_k), applies to their gradient: "
                                              "ds is multiplied by it too")}
    if layer == "linear" and label in ("dw", "db"):
        n = ex.get("x").size // ex.get("x").shape[-1]
        return {f"1/{n}, one over the number of rows: a mean over the rows instead of their sum": (1.0 / n, False,
                                                                                                  "")}
    return {}


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
    for m in layer.mistakes:
        several = isinstance(m.result, tuple)
        if result not in (m.result if several else (m.result,)):
            continue
        try:
            value = m.wrong(ex, dout)[result] if several else m.wrong(ex, dout)
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


def diagnose(f: Failure, layer: Layer, key: str, g, w, ex: Example, dout) -> None:
    """Name the mistake, the term or the factor that makes the gradient ``g`` (yours) differ
    from ``w`` (expected) in ``f``'s symptom (hint 1) and where it comes from in ``f.look``
    (hint 2), where the comparison says which."""
    if g.shape != w.shape or not np.isfinite(g).all() or w.dtype.kind != "f":
        return
    if name_mistake(f, layer, key, g, ex, dout):
        return
    label = key
    try:
        terms = [t for t in _terms(layer.name, label, ex, dout) if np.abs(t.value).max() > 0]
    except Exception:                   # an example the terms cannot be computed on: no diagnosis
        terms = []
    c = _fit(g - w, [t.value for t in terms]) if terms else None
    if c is not None:
        wrong = [(t, ck) for t, ck in zip(terms, c) if abs(ck) > 1e-6]
        if wrong:
            f.symptom = "yours is the expected where " + " and ".join(f"{t.name} {_how(ck)}" for t, ck in wrong)
            f.look = "; ".join(t.look for t, _ in wrong)
            return
    ww = float((w * w).sum())
    ratio = float((g * w).sum()) / ww if ww > 0 else 0.0
    if ww > 0 and rel_error(g, ratio * w) < 1e-7:
        for name, (s, has, look) in _scales(layer.name, label, ex).items():
            if has and abs(ratio * s - 1) < 1e-6:
                f.symptom = f"yours is {ratio:.6g} times the expected: the factor {name} is missing"
            elif abs(ratio - s) < 1e-6:
                f.symptom = f"yours is {ratio:.6g} times the expected: " + (
                    f"the factor {name} is applied twice" if has else f"the factor {name}")
            else:
                continue
            f.look = look or f.look

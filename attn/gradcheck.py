"""Numerical gradients by central differences, and a relative-error measure.

Used by the tests and the lessons to prove every hand-written backward pass:

    f(x + h) - f(x - h)
    ------------------- ≈ df/dx     (error O(h^2); in float64 h = 1e-6 gives ~1e-9)
            2h

A layer's output is a tensor, not a number, so it is reduced against a random
upstream gradient ``dout``: ``L = sum(forward(...) * dout)``. Then ``dL/dx`` is
exactly what ``backward(dout, cache)`` must return.
"""
from __future__ import annotations

from . import backend as B


def numerical_gradient(f, x, h: float = 1e-6, indices=None):
    """Central-difference gradient of the scalar function ``f()`` with respect to
    the array ``x``, which ``f`` reads and this function perturbs in place
    (and restores). Works on NumPy and CuPy arrays, contiguous or strided views.

    ``indices``: flat indices of the entries to differentiate (the others stay 0),
    for a spot check of a large input; None for every entry.

    Returns: an array of x's shape.
    """
    xp = B.get_array_module(x)
    grad = xp.zeros((x.shape), dtype=x.dtype)
    if x.flags.c_contiguous:
        flat, gflat = x.reshape(-1), grad.reshape(-1)      # views: writing flat[i] writes x
        at = int
    else:                                   # a strided view (a column block of the fast model's arena)
        flat, gflat = x, grad

        def at(i):
            return tuple(int(v) for v in B.host.unravel_index(int(i), x.shape))
    for i in (range(x.size) if indices is None else (int(j) for j in indices)):
        k = at(i)
        old = flat[k].item()
        flat[k] = old + h
        fp = float(f())
        flat[k] = old - h
        fm = float(f())
        flat[k] = old
        gflat[k] = (fp - fm) / (2 * h)
    return grad


def numerical_gradient_of(forward, args: dict, name: str, dout, h: float = 1e-6):
    """Numerical gradient of ``sum(forward(**args) * dout)`` with respect to ``args[name]``.

    ``forward`` returns the output array, or a tuple whose first item is it.
    """
    def f():
        out = forward(**args)
        out = out[0] if isinstance(out, tuple) else out
        return (out * dout).sum()
    return numerical_gradient(f, args[name], h)


def rel_error(a, b, zero: float = 1e-6) -> float:
    """``|a - b| / (|a| + |b|)`` with Euclidean norms over all elements.

    Norms rather than an element-wise maximum, so that one tiny component's
    rounding noise cannot dominate. Where both norms add up to less than
    ``zero`` the gradient is zero in truth and the absolute difference
    ``|a - b|`` is returned instead: the key bias of attention, for one, shifts
    every score of a row equally, so its exact gradient is 0 and its numerical
    estimate is rounding noise (about 1e-9 in float64), which no ratio can judge.
    """
    xp = B.get_array_module(a, b)
    a = xp.asarray(a, dtype=xp.float64)
    b = xp.asarray(b, dtype=xp.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_error: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    num = float(xp.linalg.norm((a - b).ravel()))
    den = float(xp.linalg.norm(a.ravel()) + xp.linalg.norm(b.ravel()))
    return num if den < zero else num / den


def check_layer(name: str, forward, backward, args: dict, wrt, seed: int = 0, h: float = 1e-6,
                tol: float = 1e-6) -> dict:
    """Check a layer's backward against central differences, argument by argument.

    Inputs: ``forward(**args) -> (out, cache)``; ``backward(dout, cache)`` returns the
    gradients in the order of ``wrt`` (a single array when ``wrt`` names one);
    ``args`` float64 arrays (and any other arguments); ``wrt`` the names to check.

    Returns: {argument name: relative error}. Raises AssertionError naming the
    layer and the argument if any error exceeds ``tol``.
    """
    out, cache = forward(**args)
    rng = B.host_rng(seed)
    dout = B.get_array_module(out).asarray(rng.standard_normal(out.shape)).astype(out.dtype)
    grads = backward(dout, cache)
    if not isinstance(grads, tuple):
        grads = (grads,)
    if len(grads) != len(wrt):
        raise ValueError(f"check_layer({name}): backward returned {len(grads)} gradients for {len(wrt)} arguments")
    errors = {}
    for arg, g in zip(wrt, grads):
        num = numerical_gradient_of(forward, args, arg, dout, h)
        errors[arg] = rel_error(g, num)
    bad = {k: v for k, v in errors.items() if not v < tol}
    if bad:
        detail = ", ".join(f"{k}: {v:.3g}" for k, v in bad.items())
        raise AssertionError(f"{name}: analytic and numerical gradients disagree (relative error > {tol:g}) "
                             f"for {detail}; shapes {[tuple(args[k].shape) for k in bad]}")
    return errors

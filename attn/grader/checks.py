"""The checks of one example: a forward/backward pair, a plain function, the loss, an
optimizer's steps, and dropout over many draws; each raises a :class:`Failure` that the
report explains."""
from __future__ import annotations

import contextlib
import math

from hypothesis import reject

from .. import backend as B
from ..gradcheck import numerical_gradient, rel_error
from ..testing import DROPOUT_PROBES, XP, Built, Example, Fresh, InvariantError, Layer
from .diagnosis import diagnose, name_mistake
from .library import Handle, is_array, library_function, reference
from .results import FLOAT32_TOL, FORWARD_TOL, GRADIENT_TOL, NOISE_FLOOR, SPOT_CHECK, Failure, Fatal, NotImplementedYet
from .sandbox import Sandbox, _Raised

np = B.host

# ----------------------------------------------------------------------------- calling learner code


def _call(fn, name: str, check: str, *args):
    """Call a learner's function; what it raises becomes a Failure (or NotImplementedYet)."""
    try:
        return fn(*args)
    except _Raised as e:
        look = "read the message and the line above; the example shows the shapes that triggered it"
        if e.kind in ("SystemExit", "KeyboardInterrupt"):
            look = "a graded function must return its result: no sys.exit, no KeyboardInterrupt, no exit()"
        elif not e.where and e.kind == "TypeError":
            look = f"{name} must take the library's arguments: {_signature(name)}"
        raise Failure(check, f"{name} {e.message}", where=e.where, look=look) from None
    except Fatal as e:
        e.failure.check = check if e.failure.check == "integrity" else e.failure.check
        raise


def _signature(name: str) -> str:
    import inspect
    try:
        return name + str(inspect.signature(library_function(name)))
    except (KeyError, TypeError, ValueError):
        return name


def _typename(x) -> str:
    return x.type_name if isinstance(x, Handle) else type(x).__name__


class _Args:
    """An example's arguments on the device: ``arrays`` are the ones the forward reads
    (perturbed in place by the numerical gradient); :meth:`call` makes a fresh rng and
    the namespace each time. ``drop``: argument names left out of the learner's call."""

    def __init__(self, ex: Example, dtype=None, drop=()):
        pairs = [(n, v) for n, v in ex.args if not n.startswith("_") and n not in drop]
        self.names = [n for n, _ in pairs]
        self.host = [v for _, v in pairs]
        self.arrays = [self._dev(v, dtype) for v in self.host]

    @staticmethod
    def _dev(v, dtype):
        if isinstance(v, np.ndarray):
            a = v.copy()
            if dtype is not None and a.dtype.kind == "f":
                a = a.astype(dtype)
            return B.to_device(a)
        if type(v) is dict:
            return {k: _Args._dev(x, dtype) for k, x in v.items()}
        return v

    def call(self, sandbox: "Sandbox | None" = None) -> list:
        """The arguments of one call; a :class:`Built` one made by the library here, or in
        ``sandbox``'s child for the learner's call."""
        return [B.DeviceRNG(v.seed) if isinstance(v, Fresh) else B.xp() if v is XP else
                (sandbox.call(v.function, v.args, given=True) if sandbox else library_function(v.function)(*v.args))
                if isinstance(v, Built) else v for v in self.arrays]

    def index(self, name: str) -> int:
        return self.names.index(name)

    def check_unchanged(self, fn_name: str, check: str, extra=()):
        items = list(zip(self.names, self.host, self.arrays)) + list(extra)
        for name, h, a in items:
            pairs = ([(f"{name}[{k!r}]", h[k], a[k]) for k in h] if type(h) is dict else [(name, h, a)])
            for label, hh, aa in pairs:
                if isinstance(hh, np.ndarray) and is_array(aa):
                    now = B.to_host(aa)
                    if now.shape != hh.shape or not np.array_equal(now.astype(hh.dtype), hh):
                        raise Failure(check, f"{fn_name} modified its input {label} in place",
                                      look="compute into new arrays (x = x - m, not x -= m; dout * mask, not dout "
                                           "*= mask): the caller still needs its arrays, a residual connection "
                                           "reads them again")

# ----------------------------------------------------------------------------- comparing


def _symptom(g, w) -> str:
    """A recognisable shape of the difference between ``g`` (yours) and ``w`` (expected)."""
    if not np.issubdtype(w.dtype, np.floating) or not np.isfinite(g).all():
        return ""
    if not g.any() and w.any():
        return "yours is all zeros: a whole term or path is missing"
    ww = float((w * w).sum())
    if ww > 0:
        c = float((g * w).sum()) / ww
        if abs(c - 1) > 1e-6 and rel_error(g, c * w) < 1e-7:
            if abs(c + 1) < 1e-6:
                return "yours is the expected with the opposite sign"
            return f"yours is {c:.6g} times the expected: a scale factor is missing or extra"
    if g.ndim >= 2 and g.shape[-1] == g.shape[-2] and g.shape[-1] > 1 and rel_error(g.swapaxes(-1, -2), w) < 1e-7:
        return "yours is the transpose of the expected: a transposed product"
    return ""


def _entries(g, w, k: int = 4) -> list:
    """The first ``k`` entries (C order) where ``g`` and ``w`` differ: (index, yours, expected)."""
    if np.issubdtype(w.dtype, np.floating):
        bad = ~(np.abs(g - w) <= 1e-9 + 1e-7 * np.abs(w))
    else:
        bad = g != w
    return [(tuple(int(i) for i in idx), g[tuple(idx)], w[tuple(idx)]) for idx in np.argwhere(bad)[:k]]


def _compare(check: str, what: str, got, want, tol: float, hint: str, look: str = "") -> None:
    """Raise a Failure unless ``got`` has ``want``'s shape and dtype and is close to it."""
    g, w = B.to_host(got), B.to_host(want)
    if g.shape != w.shape:
        transposed = g.ndim >= 2 and g.shape[:-2] + g.shape[-2:][::-1] == w.shape
        raise Failure(check, f"{what} has shape {g.shape}, expected {w.shape}", hint, look=look,
                      symptom="the last two axes are swapped: a transposed product" if transposed else "")
    if g.dtype != w.dtype:
        raise Failure(check, f"{what} has dtype {g.dtype}, expected {w.dtype}",
                      look="keep the input's dtype: no float() / astype to another precision, constants as "
                      "x.dtype.type(c), new arrays with dtype=x.dtype")
    if np.issubdtype(w.dtype, np.floating):
        bad = ~np.isfinite(g) & np.isfinite(w)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise Failure(check, f"{what} has {g[i]} at {i} where the library's is finite ({w[i]:.6g})", hint,
                          look="NaN or inf: exp of a large logit (subtract the row maximum first), a -inf mask "
                               "fill, or 0/0 on a fully masked row", entries=_entries(g, w), arrays=(g, w))
        err = rel_error(g, w) if g.size else 0.0
    else:
        err = float((g != w).sum())
        tol = 0.0
    if err > tol:
        raise Failure(check, f"{what} differs from the library's", hint, error=err if w.dtype.kind == "f" else None,
                      entries=_entries(g, w), symptom=_symptom(g, w), tol=tol, look=look, arrays=(g, w))


def _check_output(check: str, what: str, out, want) -> None:
    if not is_array(out):
        raise Failure(check, f"{what} is a {_typename(out)}, expected an array of shape {tuple(want.shape)}",
                      look="return the array itself")
    if B.get_array_module(out) is not B.get_array_module(want):
        raise Failure(check, f"{what} is a {B.get_array_module(out).__name__} array, expected "
                             f"{B.get_array_module(want).__name__}",
                      look="use xp = attn.backend.get_array_module(x) instead of numpy, so the layer runs on CuPy too")


@contextlib.contextmanager
def _naming(layer: Layer, result: str, yours, ex: Example, dout=None):
    """A Failure raised inside names the typical mistake ``yours`` shows, where one fits."""
    try:
        yield
    except Failure as f:
        name_mistake(f, layer, result, yours, ex, dout)
        raise

# ----------------------------------------------------------------------------- one example of each kind


def _run_invariants(layer: Layer, functions: dict, ex: Example, check: str = "invariant") -> None:
    if layer.invariants is None:
        return
    try:
        layer.invariants(functions, ex)
    except InvariantError as e:
        raise Failure(check, str(e), look=e.hint) from None
    except (NotImplementedYet, Failure):
        raise
    except Exception as e:      # the learner's result was not what the invariant could work with
        raise Failure(check, f"{type(e).__name__} while checking an invariant: {e}",
                      look="the example shows the inputs; the result of your function had an unexpected type "
                           "or shape") from None


class _Wrapped:
    """A learner's function as the invariants call it: its failures name the function."""

    def __init__(self, fn, name):
        self.fn, self.name = fn, name

    def __call__(self, *args):
        return _call(self.fn, self.name, "invariant", *args)


def _grad_items(layer, wrt, grads, ref_grads, args, bname):
    """(label, hint key, yours, expected, the input array) for every gradient, dict inputs
    (a block's parameters) one entry per key."""
    items = []
    for name, g, rg in zip(wrt, grads, ref_grads):
        x = args.arrays[args.index(name)]
        if type(x) is dict:
            if not isinstance(g, dict):
                raise Failure("backward", f"{bname} returned a {_typename(g)} for d{name}, expected a dict keyed "
                                          f"like {name}", look="return the gradients in a dict with the parameters' "
                                          "names: grads[name] has the shape of params[name]")
            missing = [k for k in x if k not in g]
            if missing:
                raise Failure("backward", f"d{name} has no gradient for {', '.join(missing[:4])}"
                                          + (" ..." if len(missing) > 4 else ""),
                              look="every parameter gets a gradient; a parameter used in several places gets "
                                   "the sum of its paths")
            items += [(f"d{name}[{k!r}]", f"d{k}" if f"d{k}" in layer.hints or f"d{k}" in layer.where
                       else "d" + k.split(".")[-1], g[k], rg[k], x[k]) for k in x]
        else:
            items.append((f"d{name}", "d" + name, g, rg, x))
    return items


def _hints(layer: Layer, key: str) -> tuple[str, str]:
    return layer.where.get(key, ""), layer.hints.get(key, "")


def check_pair(layer: Layer, impl: dict, ex: Example, phase: str = "all", drop=()) -> None:
    """One example of a forward/backward pair.

    ``phase``: ``"forward"`` (structure, invariants, the library's output, float32),
    ``"backward"`` (the forward passed: every gradient against the library's and against
    central differences of the learner's forward, the backward invariants) or
    ``"self"`` (the forward is wrong: the backward against central differences of the
    learner's own forward only)."""
    fname, bname = layer.functions
    ref_f, _ = reference(layer.name)
    fwd, bwd = impl[fname], impl.get(bname)
    if drop and any(ex.get(n) for n in ("dropout",) if n in dict(ex.args)):
        reject()                                        # dropout deferred: examples without it only
    args = _Args(ex, drop=drop)
    ref_out, ref_cache = ref_f(*_Args(ex).call())
    out, cache = _forward(fwd, fname, args)
    _check_output("forward", "the output", out, ref_out)
    args.check_unchanged(fname, "forward")
    look, formula = _hints(layer, "forward")
    with _naming(layer, "forward", out, ex):                     # a typical mistake may be what makes NaN
        _compare("forward", "the output", out, ref_out, np.inf, formula, look)      # shape, dtype, NaN
    if phase == "forward":
        _check_forward(layer, fwd, ex, drop, out, ref_out)
        return
    if bwd is None:
        return
    if phase == "backward":
        _interleave(fwd, fname, ex, drop)
    dout_host = B.host_rng(ex.seed).standard_normal(tuple(ref_out.shape)).astype(B.to_host(ref_out).dtype)
    dout = B.to_device(dout_host.copy())
    items = _backward_items(layer, bwd, ex, args, cache, ref_cache, dout_host, dout)
    if phase == "backward":
        if ex.compare:
            _compare_gradients(layer, items, ex, dout_host)
        _run_invariants(layer, {fname: _Wrapped(fwd, fname), bname: _Wrapped(bwd, bname)}, ex)
    if ex.gradcheck:
        _check_central_differences(layer, fwd, args, items, ex, dout)


def _forward(fwd, fname: str, args: "_Args") -> tuple:
    """The learner's forward on ``args``: its ``(out, cache)``, or a Failure naming what came back."""
    res = _call(fwd, fname, "forward", *args.call())
    if not (isinstance(res, tuple) and len(res) == 2):
        got = f"a tuple of {len(res)}" if isinstance(res, tuple) else f"a {_typename(res)}"
        raise Failure("forward", f"{fname} returned {got}, expected (out, cache)",
                      look="return the output and a cache, `return out, cache`: backward gets only dout and "
                           "the cache")
    return res


def _check_forward(layer: Layer, fwd, ex: Example, drop, out, ref_out) -> None:
    """The forward phase past the structure: the invariants, the library's output, and the
    same example in float32 (its dtype kept, its output close)."""
    fname = layer.functions[0]
    ref_f = reference(layer.name)[0]
    look, formula = _hints(layer, "forward")
    with _naming(layer, "forward", out, ex):
        _run_invariants(layer, {fname: _Wrapped(fwd, fname)}, ex)
        if ex.compare:
            _compare("forward", "the output", out, ref_out, FORWARD_TOL, formula, look)
    a32 = _Args(ex, "float32", drop=drop)
    r32 = ref_f(*_Args(ex, "float32").call())[0]
    o32 = _call(fwd, fname, "float32", *a32.call())
    if isinstance(o32, tuple) and len(o32) == 2 and is_array(o32[0]) and o32[0].dtype != r32.dtype:
        raise Failure("float32", f"with float32 inputs the output is {o32[0].dtype}, expected {r32.dtype}",
                      look="keep the input's dtype: constants as x.dtype.type(c), new arrays with "
                           "dtype=x.dtype")
    if ex.compare and isinstance(o32, tuple) and len(o32) == 2 and is_array(o32[0]):
        _compare("float32", "the float32 output", o32[0], r32, FLOAT32_TOL, formula, look)


def _backward_items(layer: Layer, bwd, ex: Example, args: "_Args", cache, ref_cache, dout_host, dout) -> list:
    """The learner's backward on ``dout`` and its cache, one gradient per input of ``ex.wrt``,
    each checked for shape, dtype and NaN against the library's: :func:`_grad_items`'s list."""
    bname = layer.functions[1]
    ref_b = reference(layer.name)[1]
    ref_grads = ref_b(B.to_device(dout_host.copy()), ref_cache)
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    grads = _call(bwd, bname, "backward", dout, cache)
    wrt = ex.wrt
    if not isinstance(grads, tuple):
        grads = (grads,) if len(wrt) == 1 else grads
    if not isinstance(grads, tuple) or len(grads) != len(wrt):
        n = len(grads) if isinstance(grads, tuple) else 1
        raise Failure("backward", f"{bname} returned {n} value(s), expected {len(wrt)}: "
                                  + ", ".join("d" + w for w in wrt),
                      look="return one gradient per input of the forward, in the forward's order")
    args.check_unchanged(bname, "backward", [("dout", dout_host, dout)])
    items = _grad_items(layer, wrt, grads, ref_grads, args, bname)
    for label, key, g, rg, _ in items:
        _check_output("backward", label, g, rg)
        _compare("backward", label, g, rg, np.inf, *_hints(layer, key)[::-1])
    return items


def _compare_gradients(layer: Layer, items: list, ex: Example, dout_host) -> None:
    """Every gradient against the library's. The one reported is the first that the layer's
    own explanation or a diagnosis of its typical mistakes explains (a mistake in dv shows in
    dx too, which the mistake of dv does not explain), else the first that disagrees; its
    message names the others that disagree."""
    failed = []
    for label, key, g, rg, _ in items:
        try:
            _compare("backward", f"gradient {label}", g, rg, GRADIENT_TOL, *_hints(layer, key)[::-1])
        except Failure as f:
            said = layer.explain(label, g, rg, ex, dout_host) if layer.explain is not None else None
            if said:
                f.symptom, f.look = said
            failed.append((diagnose(f, layer, key, B.to_host(g), B.to_host(rg), ex, dout_host) or bool(said), f,
                           label))
    if failed:
        _, f, label = next((x for x in failed if x[0]), failed[0])
        others = [lb for _, _, lb in failed if lb != label]
        if others:
            f.message += f" ({' and '.join(others)} too)"
        raise f


def _check_central_differences(layer: Layer, fwd, args: "_Args", items: list, ex: Example, dout) -> None:
    """A few entries of every gradient against central differences of the learner's own forward."""
    fname = layer.functions[0]
    spot = SPOT_CHECK if len(items) <= 12 else 3
    for label, key, g, _, x in items:
        idx = _spot(x.size, ex.seed, spot)
        num = _central_differences(fwd, fname, args, x, dout, idx)
        gh, nh = B.to_host(g).reshape(-1)[idx], B.to_host(num).reshape(-1)[idx]
        err = rel_error(gh, nh)
        # Entries of a tiny gradient carry the central difference's rounding noise (about
        # ulp(sum(out * dout)) / h) at full weight: an absolute floor far above it, far below a bug.
        if not err <= GRADIENT_TOL and not np.abs(gh - nh).max() <= NOISE_FLOOR:
            where = f" (at flat indices {idx.tolist()} of {x.size})" if len(idx) < x.size else ""
            look, formula = _hints(layer, key)
            raise Failure("backward", f"gradient {label} disagrees with central differences of your forward"
                          + where, formula, error=err, entries=_entries(gh, nh), symptom=_symptom(gh, nh),
                          tol=GRADIENT_TOL, look=look, arrays=(gh, nh))


def _interleave(fwd, fname: str, ex: Example, drop) -> None:
    """A second forward, on other inputs of the same shapes, between a forward and its
    backward: a backward that reads what the last forward left (globals, attributes)
    instead of its own cache gets the other example's state."""
    other = _Args(ex, drop=drop)
    rng = B.host_rng(ex.seed + 7919)
    other.arrays = [B.to_device(rng.standard_normal(v.shape).astype(v.dtype)) if isinstance(v, np.ndarray)
                    and v.dtype.kind == "f" and v.size else a for v, a in zip(other.host, other.arrays)]
    _call(fwd, fname, "forward", *other.call())


def check_function(layer: Layer, impl: dict, ex: Example, phase: str = "all", drop=()) -> None:
    """A plain function (a table, a reshape, a mask, a schedule): its result against the library's."""
    (name,) = layer.functions
    ref_fn = reference(layer.name)[0]
    args = _Args(ex)
    want = ref_fn(*_Args(ex).call())
    got = _call(impl[name], name, "output", *args.call(getattr(impl[name], "sandbox", None)))
    if B.is_device_array(want):
        _check_output("output", "the result", got, want)
    args.check_unchanged(name, "output")
    look, formula = _hints(layer, name)
    with _naming(layer, name, got, ex):
        if layer.compare is not None:
            try:
                layer.compare(got, want, ex)
            except InvariantError as e:
                raise Failure("output", str(e), formula, look=e.hint or look) from None
            _run_invariants(layer, {name: _Wrapped(impl[name], name)}, ex)
            return
        _compare("output", "the result", got, want, np.inf, formula, look)
        _run_invariants(layer, {name: _Wrapped(impl[name], name)}, ex)
        _compare("output", "the result", got, want, FORWARD_TOL, formula, look)


def check_loss(layer: Layer, impl: dict, ex: Example, phase: str = "all", drop=()) -> None:
    """``(loss, dlogits)``: both against the library's, dlogits against central differences of the loss."""
    (name,) = layer.functions
    fn, ref_fn = impl[name], reference(layer.name)[0]
    args = _Args(ex)
    ref_loss, ref_d = ref_fn(*_Args(ex).call())
    res = _call(fn, name, "loss", *args.call())
    if not (isinstance(res, tuple) and len(res) == 2):
        raise Failure("loss", f"{name} returned {_typename(res)}, expected (loss, dlogits)",
                      look="the loss and its gradient come out together: `return loss, dlogits`")
    loss, d = res
    args.check_unchanged(name, "loss")
    look, formula = _hints(layer, "dlogits")
    _check_output("loss", "dlogits", d, ref_d)
    _compare("loss", "dlogits", d, ref_d, np.inf, formula, look)
    try:
        lv = float(B.to_host(loss))
    except Exception:
        raise Failure("loss", f"the loss is a {_typename(loss)} of shape {getattr(loss, 'shape', '?')}, "
                              "expected one number", look="average over the real tokens to a 0-d array") from None
    _run_invariants(layer, {name: _Wrapped(fn, name)}, ex)
    rv = float(B.to_host(ref_loss))
    if not abs(lv - rv) <= FORWARD_TOL * (abs(rv) + 1e-12):
        with _naming(layer, name, lv, ex):
            raise Failure("loss", f"the loss is {lv!r}, the library's {rv!r}", layer.hints.get(name, ""),
                          error=abs(lv - rv) / (abs(rv) + abs(lv) + 1e-300), tol=FORWARD_TOL,
                          look=layer.where.get(name, ""))
    with _naming(layer, "dlogits", d, ex):
        _compare("loss", "dlogits", d, ref_d, GRADIENT_TOL, formula, look)
    if ex.gradcheck:
        x = args.arrays[0]
        idx = _spot(x.size, ex.seed)
        num = numerical_gradient(lambda: float(B.to_host(_call(fn, name, "loss", *args.call())[0])), x, indices=idx)
        gh, nh = B.to_host(d).reshape(-1)[idx], B.to_host(num).reshape(-1)[idx]
        err = rel_error(gh, nh)
        if not err <= GRADIENT_TOL:
            spot = f" (at flat indices {idx.tolist()} of {x.size})" if len(idx) < x.size else ""
            raise Failure("loss", "dlogits disagrees with central differences of your loss" + spot, formula,
                          error=err, entries=_entries(gh, nh), symptom=_symptom(gh, nh), tol=GRADIENT_TOL,
                          look=look, arrays=(gh, nh))


def _central_differences(fwd, fname: str, args: _Args, x, dout, idx, h: float = 1e-6):
    """:func:`~attn.gradcheck.numerical_gradient` of sum(forward(...)[0] * dout) with respect
    to ``x`` at the flat indices ``idx``; a learner's forward in the child gets the arguments
    once and makes every perturbed call there (one round trip, one copy of the arguments)."""
    loss = lambda out: float(B.to_host((out * dout).sum()))             # noqa: E731
    where = _where(args.arrays, x)
    if not hasattr(fwd, "perturbed") or where is None or any(isinstance(v, Built) for v in args.arrays):
        return numerical_gradient(lambda: loss(_call(fwd, fname, "forward", *args.call())[0]), x, indices=idx)
    outs = _call(fwd.perturbed, fname, "forward", args.call(), where, idx, h)
    grad = B.get_array_module(x).zeros(x.shape, dtype=x.dtype)
    for k, i in enumerate(idx):
        grad.reshape(-1)[int(i)] = (loss(outs[2 * k]) - loss(outs[2 * k + 1])) / (2 * h)
    return grad


def _where(arrays: list, x):
    """(the argument's index,) or (its index, the key) of the contiguous array ``x`` among
    ``arrays`` (a dict argument holds a block's parameters); None where it is neither."""
    if not x.flags.c_contiguous:
        return None
    for j, a in enumerate(arrays):
        if a is x:
            return (j,)
        if type(a) is dict:
            key = next((k for k, v in a.items() if v is x), None)
            if key is not None:
                return (j, key)
    return None


def _spot(size: int, seed: int, k: int = SPOT_CHECK):
    """Flat indices where central differences are taken: every entry of a small input,
    ``k`` random ones of a larger one (the whole gradient is compared with the library's
    anyway; the spot check keeps a layer's check at seconds)."""
    if size <= k:
        return np.arange(size)
    return np.sort(B.host_rng(seed).choice(size, k, replace=False))


def check_steps(layer: Layer, impl: dict, ex: Example, phase: str = "all", drop=()) -> None:
    """An optimizer step, a few times from zero moments: the learner's state carried from
    step to step, compared after every step with the library's carried the same way."""
    (name,) = layer.functions
    ref_fn = reference(layer.name)[0]
    d = dict(ex.args)
    dev = lambda tree: {k: B.to_device(v.copy()) for k, v in tree.items()}        # noqa: E731
    params = dev(d["params"])
    zeros = {k: B.to_device(np.zeros_like(v)) for k, v in d["params"].items()}
    mine, ref = (params, dict(zeros), dict(zeros)), (dev(d["params"]), dict(zeros), dict(zeros))
    look, formula = _hints(layer, name)
    for t, (grads, lr) in enumerate(zip(d["grads"], d["lrs"]), start=1):
        g = dev(grads)
        res = _call(impl[name], name, "output", mine[0], g, mine[1], mine[2], t, lr, d["beta1"], d["beta2"],
                    d["eps"])
        ref = ref_fn(ref[0], dev(grads), ref[1], ref[2], t, lr, d["beta1"], d["beta2"], d["eps"])
        if not (isinstance(res, tuple) and len(res) == 3 and all(isinstance(x, dict) for x in res)):
            raise Failure("output", f"{name} returned a {_typename(res)}, expected (params, m, v), three dicts",
                          formula, look="return the new parameters and both moments, each a dict keyed like params")
        for what, got, want in zip(("the parameters", "m", "v"), res, ref):
            for k in want:
                if k not in got:
                    raise Failure("output", f"step {t}: {what} have no {k!r}", formula, look=look)
                try:
                    _compare("output", f"step {t} (lr {lr:g}): {what}[{k!r}]", got[k], want[k], FORWARD_TOL,
                             formula, look)
                except Failure as f:
                    if what == "the parameters" and t == 1:
                        f.symptom = f.symptom or ("already wrong at the first step, where the bias correction "
                                                  "matters most")
                        name_mistake(f, layer, name, got, ex)
                    raise
        mine = res


CHECKS = {"pair": check_pair, "function": check_function, "loss": check_loss, "steps": check_steps}

#: A share of --examples for the checks whose examples cost most (a whole model's
#: central differences): a whole-model check stays under a minute.
EXAMPLE_SHARE = {"encoder_layer": 0.5, "decoder_layer": 0.5, "transformer": 0.25}

# ----------------------------------------------------------------------------- dropout, graded


class _MaskRNG:
    """A generator whose ``random`` reproduces a given keep-mask (1 where kept, 0 where
    dropped): the library's layer run with it drops exactly what the learner's did."""

    def __init__(self, keep):
        self.keep = keep

    def random(self, shape, dtype="float32"):
        return B.to_device(np.where(self.keep.reshape(shape), 1.0, 0.0).astype(dtype))


DROPOUT_DRAWS = 8          # forward calls with one generator


def check_dropout(layer: Layer, impl: dict, seed: int = 0) -> None:
    """Dropout of a layer that takes ``dropout``/``p`` and ``rng``: the identity at ``p = 0``
    and at inference (``rng=None``); over :data:`DROPOUT_DRAWS` calls with one seeded
    generator, kept units scaled by ``1/(1-p)``, the kept fraction ``1 - p`` within five
    standard deviations, a new mask at every call; the backward of the first call (after
    the others) equal to the library's backward with that call's mask."""
    fname, bname = layer.functions
    fwd, bwd = impl[fname], impl.get(bname)
    probe = DROPOUT_PROBES[layer.name]
    base_args, shown = probe(0.0, None)
    base = B.to_host(reference(layer.name)[0](*_on_device(base_args))[0])     # the output without dropout
    _check_no_dropout(fwd, fname, probe, base, seed)
    p = 0.5
    rng = B.DeviceRNG(seed)
    outs, caches = [], []
    for _ in range(DROPOUT_DRAWS):
        args, shown = probe(p, rng)
        res = _call(fwd, fname, "dropout", *_on_device(args))
        if not (isinstance(res, tuple) and len(res) == 2):
            raise Failure("dropout", f"{fname} returned a {_typename(res)}, expected (out, cache)")
        outs.append(B.to_host(res[0]))
        caches.append(res[1])
    setup = shown + [f"p = {p}, one rng = attn.backend.DeviceRNG({seed}) for {DROPOUT_DRAWS} calls"]
    kept = _check_masks(layer, outs, base, p, setup)
    if bwd is not None:
        _check_dropout_backward(layer, bwd, probe(p, rng)[0], kept[0], caches[0], seed, setup)


def _on_device(args) -> list:
    return [B.to_device(a) if isinstance(a, np.ndarray) else a for a in args]


def _check_no_dropout(fwd, fname: str, probe, base, seed: int) -> None:
    """With ``p = 0`` and a generator, and at inference (``p = 0.5``, ``rng=None``), the forward's
    output is ``base``, the output without dropout."""
    for p, rng, what in ((0.0, B.DeviceRNG(seed), "p = 0 with a generator"),
                         (0.5, None, "inference: p = 0.5 with rng=None")):
        args, shown = probe(p, rng)
        got = _call(fwd, fname, "dropout", *_on_device(args))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Failure("dropout", f"{fname} returned a {_typename(got)}, expected (out, cache)")
        try:
            _compare("dropout", f"the output ({what})", got[0], B.to_device(base), FORWARD_TOL, "",
                     "with p == 0, or rng None (evaluation), dropout must leave everything as it is")
        except Failure as f:
            f.setup = shown + [f"dropout: {what}"]
            raise


def _dropout_failure(setup: list, message: str, look: str, formula: str = "") -> Failure:
    f = Failure("dropout", message, formula, look=look)
    f.setup = setup
    return f


def _check_masks(layer: Layer, outs: list, base, p: float, setup: list) -> list:
    """The outputs of the calls with one generator against ``base``: the shape kept, some units
    dropped, the kept ones scaled by ``1/(1-p)``, about ``1 - p`` of them kept, a new mask at
    every call. Returns each call's mask of kept units."""
    if any(o.shape != base.shape for o in outs):
        raise _dropout_failure(setup, f"the output has shape {outs[0].shape}, expected {base.shape}",
                               "dropout keeps the shape")
    kept = [o != 0 for o in outs]
    n = sum(k.size for k in kept)
    frac = sum(int(k.sum()) for k in kept) / n
    ratios = np.concatenate([o[k] / base[k] for o, k in zip(outs, kept)])
    if frac == 1.0:
        raise _dropout_failure(
            setup, f"no unit was dropped in {DROPOUT_DRAWS} calls with p = {p}: the dropout argument is ignored",
            "with p > 0 and an rng, draw a mask from rng at every call (rng.random(shape) >= p) and apply it",
            layer.hints.get("dropout", ""))
    if not np.allclose(ratios, 1 / (1 - p), rtol=1e-9, atol=0):
        raise _dropout_failure(
            setup, f"kept units are {float(np.median(ratios)):.6g} times their value without dropout, expected "
                   f"1/(1-p) = {1 / (1 - p):.6g}", "inverted dropout scales the kept units by 1/(1-p), so that "
                   "inference needs no rescale")
    sigma = math.sqrt(p * (1 - p) / n)
    if abs(frac - (1 - p)) > 5 * sigma:
        raise _dropout_failure(
            setup, f"a fraction {frac:.4f} of {n} units was kept over {DROPOUT_DRAWS} calls, expected "
                   f"{1 - p} (within {5 * sigma:.4f})", "p is the probability of dropping a unit: keep where "
                   "rng.random(shape) >= p")
    if all(np.array_equal(kept[0], k) for k in kept[1:]):
        raise _dropout_failure(setup, f"all {DROPOUT_DRAWS} calls with one generator dropped the same units",
                               "draw a new mask from rng at every call; never keep one between calls")
    return kept


def _check_dropout_backward(layer: Layer, bwd, args: list, kept, cache, seed: int, setup: list) -> None:
    """The backward of the first call's ``cache``, after all the forwards, against the library's
    backward with that call's mask ``kept``."""
    ref_f, ref_b = reference(layer.name)
    bname = layer.functions[1]
    dout_host = B.host_rng(seed + 1).standard_normal(kept.shape)
    d = [_MaskRNG(kept) if isinstance(a, B.DeviceRNG) else a for a in _on_device(args)]
    _, ref_cache = ref_f(*d)
    ref_grads = ref_b(B.to_device(dout_host), ref_cache)
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    grads = _call(bwd, bname, "dropout", B.to_device(dout_host.copy()), cache)
    grads = grads if isinstance(grads, tuple) else (grads,)
    names = [n for n, _ in _probe_wrt(layer)]
    for name, g, rg in zip(names, grads, ref_grads):
        try:
            _compare("dropout", f"d{name} of the first of {DROPOUT_DRAWS} calls", g, rg, GRADIENT_TOL,
                     layer.hints.get("dropout_backward", ""),
                     "the backward must use the mask its own forward drew, kept in that call's cache: not a "
                     "new draw, not the last call's mask")
        except Failure as f:
            f.setup = setup + ["backward: of the first call's cache, after all eight forwards"]
            raise


def _probe_wrt(layer: Layer):
    return {"dropout": [("x", 0)], "attention": [("q", 0), ("k", 1), ("v", 2)],
            "feed_forward": [(n, i) for i, n in enumerate(("x", "w1", "b1", "w2", "b2"))],
            "multi_head_attention": [(n, i) for i, n in enumerate(("x_q", "x_kv", "w_q", "b_q", "w_k", "b_k",
                                                                    "w_v", "b_v", "w_o", "b_o"))]}[layer.name]

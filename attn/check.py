"""``attn-check``: grade your own layers with the checks that prove the library's.

    attn-check PATH.py [--layer NAME ...] [--examples N] [--backend numpy|cupy]

Imports the learner's file, finds the functions it defines under the library's names
(``layer_norm_forward`` / ``layer_norm_backward``, ``softmax_forward`` / ..., the
helpers ``sinusoidal_table``, ``split_heads``, ``merge_heads``, the masks and
``cross_entropy``), and for every layer it finds runs, on examples that hypothesis
draws (:data:`attn.testing.LAYERS`; hard inputs included: logits of 1e4, fully masked
rows, repeated ids, padding):

1. the learner's forward on the example: an exception, a result that is not
   ``(out, cache)``, an input modified in place, a wrong shape or dtype, NaN;
2. the layer's invariants (:mod:`attn.testing`), with the learner's functions;
3. the output against the library's own (the solution) on the same inputs;
4. the backward: the same structural checks, each gradient against the library's,
   then against float64 central differences of the learner's own forward;
5. float32 in, float32 out.

Hypothesis shrinks a failure to the smallest example it can find; the report shows it
(shapes and, when small, values), which input's gradient, the relative error, the
first entries that differ, and a hint naming the usual cause. A function whose body
raises ``NotImplementedError`` is reported as "not implemented yet". The exit status
is 0 only when every layer found passes.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import sys
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis.errors import Flaky

from . import backend as B
from .gradcheck import numerical_gradient, rel_error
from .testing import LAYERS, XP, Example, Fresh, InvariantError, Layer, _library, reference

DEFAULT_EXAMPLES = 20
FORWARD_TOL = 1e-8          # relative error of an output against the library's (float64)
GRADIENT_TOL = 1e-6         # relative error of a gradient against the library's or central differences
SPOT_CHECK = 24             # entries per input where central differences are taken (all of a smaller input)

np = B.host


class NotImplementedYet(Exception):
    """The learner's function raised NotImplementedError (an untouched starter)."""

    def __init__(self, function: str):
        super().__init__(function)
        self.function = function
        self.example = None


class Failure(Exception):
    """One failed check, with what the report needs to explain it."""

    def __init__(self, check: str, message: str, hint: str = "", error: float | None = None,
                 entries: list | None = None, symptom: str = "", where: str = "", tol: float | None = None):
        super().__init__(message)
        self.tol = tol
        self.check, self.message, self.hint = check, message, hint
        self.error, self.entries, self.symptom, self.where = error, entries or [], symptom, where
        self.example: Example | None = None


# ----------------------------------------------------------------------------- calling learner code

_LEARNER_FILE: list[str] = [""]


def _where(tb) -> str:
    """'file:line in function: source' of the innermost frame in the learner's file."""
    frames = [f for f in traceback.extract_tb(tb) if _LEARNER_FILE[0] and Path(f.filename).resolve() == Path(
        _LEARNER_FILE[0]).resolve()]
    if not frames:          # raised before any line of the learner's ran (a wrong signature)
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def _raiser(e: BaseException, default: str) -> str:
    """Name of the function whose body raised ``e`` (the innermost frame)."""
    frames = traceback.extract_tb(e.__traceback__)
    return frames[-1].name if frames else default


def _call(fn, name: str, check: str, *args):
    """Call a learner's function; its exceptions become a Failure (or NotImplementedYet)."""
    try:
        return fn(*args)
    except NotImplementedError as e:
        raise NotImplementedYet(_raiser(e, name)) from None
    except Exception as e:      # anything the learner's code raises is a finding, not a crash
        where = _where(e.__traceback__)
        hint = "read the message and the line above; the example shows the shapes that triggered it"
        if not where and isinstance(e, TypeError):
            hint = f"{name} must take the library's arguments: {_signature(name)}"
        raise Failure(check, f"{name} raised {type(e).__name__}: {e}", hint, where=where) from None


def _signature(name: str) -> str:
    try:
        return name + str(inspect.signature(_library(name)))
    except (KeyError, TypeError, ValueError):
        return name


def _is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim")


class _Args:
    """An example's arguments on the device: ``arrays`` are the ones the forward reads
    (perturbed in place by the numerical gradient); :meth:`call` makes a fresh rng and
    the namespace each time."""

    def __init__(self, ex: Example, dtype=None):
        self.names = [n for n, _ in ex.args if not n.startswith("_")]
        self.host = [v for n, v in ex.args if not n.startswith("_")]
        self.arrays = []
        for v in self.host:
            if isinstance(v, np.ndarray):
                a = v.copy()
                if dtype is not None and a.dtype.kind == "f":
                    a = a.astype(dtype)
                v = B.to_device(a)
            self.arrays.append(v)

    def call(self) -> list:
        return [B.DeviceRNG(v.seed) if isinstance(v, Fresh) else B.xp() if v is XP else v for v in self.arrays]

    def index(self, name: str) -> int:
        return self.names.index(name)

    def check_unchanged(self, fn_name: str, check: str, extra=()):
        for name, h, a in list(zip(self.names, self.host, self.arrays)) + list(extra):
            if isinstance(h, np.ndarray) and _is_array(a):
                now = B.to_host(a)
                if now.shape != h.shape or not np.array_equal(now.astype(h.dtype), h):
                    raise Failure(check, f"{fn_name} modified its input {name} in place",
                                  "compute into new arrays (x = x - m, not x -= m; dout * mask, not dout *= "
                                  "mask): the caller still needs its arrays, a residual connection reads them again")

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


def _compare(check: str, what: str, got, want, tol: float, hint: str) -> None:
    """Raise a Failure unless ``got`` has ``want``'s shape and dtype and is close to it."""
    g, w = B.to_host(got), B.to_host(want)
    if g.shape != w.shape:
        transposed = g.ndim >= 2 and g.shape[:-2] + g.shape[-2:][::-1] == w.shape
        raise Failure(check, f"{what} has shape {g.shape}, expected {w.shape}", hint,
                      symptom="the last two axes are swapped: a transposed product" if transposed else "")
    if g.dtype != w.dtype:
        raise Failure(check, f"{what} has dtype {g.dtype}, expected {w.dtype}",
                      "keep the input's dtype: no float() / astype to another precision, constants as "
                      "x.dtype.type(c), new arrays with dtype=x.dtype")
    if np.issubdtype(w.dtype, np.floating):
        bad = ~np.isfinite(g) & np.isfinite(w)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise Failure(check, f"{what} has {g[i]} at {i} where the library's is finite ({w[i]:.6g})",
                          "NaN or inf: exp of a large logit (subtract the row maximum first), a -inf mask fill, "
                          "or 0/0 on a fully masked row", entries=_entries(g, w))
        err = rel_error(g, w) if g.size else 0.0
    else:
        err = float((g != w).sum())
        tol = 0.0
    if err > tol:
        raise Failure(check, f"{what} differs from the library's", hint, error=err if w.dtype.kind == "f" else None,
                      entries=_entries(g, w), symptom=_symptom(g, w), tol=tol)


def _check_output(check: str, what: str, out, want) -> None:
    if not _is_array(out):
        raise Failure(check, f"{what} is a {type(out).__name__}, expected an array of shape {tuple(want.shape)}",
                      "return the array itself")
    if B.get_array_module(out) is not B.get_array_module(want):
        raise Failure(check, f"{what} is a {B.get_array_module(out).__name__} array, expected "
                             f"{B.get_array_module(want).__name__}",
                      "use xp = attn.backend.get_array_module(x) instead of numpy, so the layer runs on CuPy too")

# ----------------------------------------------------------------------------- one example of each kind


def _run_invariants(layer: Layer, functions: dict, ex: Example) -> None:
    if layer.invariants is None:
        return
    try:
        layer.invariants(functions, ex)
    except InvariantError as e:
        raise Failure("invariant", str(e), e.hint) from None
    except NotImplementedError as e:
        raise NotImplementedYet(_raiser(e, next(iter(functions)))) from None
    except Exception as e:
        raise Failure("invariant", f"{type(e).__name__} while checking an invariant: {e}",
                      "the example shows the inputs; the line is in your file", where=_where(e.__traceback__)) from None


def check_pair(layer: Layer, impl: dict, ex: Example) -> None:
    """Forward, invariants, comparison with the library, backward, central differences, float32."""
    fname, bname = layer.functions
    ref_f, ref_b = reference(layer.name)
    fwd = impl.get(fname, ref_f)
    bwd = impl.get(bname)
    hints = layer.hints

    args = _Args(ex)
    ref_out, ref_cache = ref_f(*_Args(ex).call())
    res = _call(fwd, fname, "forward", *args.call())
    if not (isinstance(res, tuple) and len(res) == 2):
        got = f"a tuple of {len(res)}" if isinstance(res, tuple) else f"a {type(res).__name__}"
        raise Failure("forward", f"{fname} returned {got}, expected (out, cache)",
                      "return the output and a cache, `return out, cache`: backward gets only dout and the cache")
    out, cache = res
    _check_output("forward", "the output", out, ref_out)
    args.check_unchanged(fname, "forward")
    _compare("forward", "the output", out, ref_out, np.inf, hints.get("forward", ""))   # shape, dtype, NaN
    functions = {**dict(zip(layer.functions, (ref_f, ref_b))), **impl}
    _run_invariants(layer, functions, ex)
    if ex.compare:
        _compare("forward", "the output", out, ref_out, FORWARD_TOL, hints.get("forward", ""))
    if bwd is None:
        return

    dout_host = B.host_rng(ex.seed).standard_normal(tuple(ref_out.shape)).astype(B.to_host(ref_out).dtype)
    dout = B.to_device(dout_host.copy())
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
                      "return one gradient per input of the forward, in the forward's order")
    args.check_unchanged(bname, "backward", [("dout", dout_host, dout)])
    for name, g, rg in zip(wrt, grads, ref_grads):
        _check_output("backward", f"d{name}", g, rg)
        _compare("backward", f"d{name}", g, rg, np.inf, hints.get("d" + name, ""))
    if ex.compare:
        for name, g, rg in zip(wrt, grads, ref_grads):
            _compare("backward", f"gradient d{name}", g, rg, GRADIENT_TOL, hints.get("d" + name, ""))
    if ex.gradcheck:
        for name, g in zip(wrt, grads):
            x = args.arrays[args.index(name)]
            idx = _spot(x.size, ex.seed)
            num = numerical_gradient(lambda: float((_call(fwd, fname, "forward", *args.call())[0] * dout).sum()), x,
                                     indices=idx)
            gh, nh = B.to_host(g).reshape(-1)[idx], B.to_host(num).reshape(-1)[idx]
            err = rel_error(gh, nh)
            if not err <= GRADIENT_TOL:
                spot = f" (at flat indices {idx.tolist()} of {x.size})" if len(idx) < x.size else ""
                raise Failure("backward", f"gradient d{name} disagrees with central differences of your forward"
                                          + spot,
                              hints.get("d" + name, ""), error=err, entries=_entries(gh, nh), symptom=_symptom(gh, nh),
                              tol=GRADIENT_TOL)

    # float32 in, float32 out
    a32 = _Args(ex, "float32")
    r32 = ref_f(*_Args(ex, "float32").call())[0]
    o32 = _call(fwd, fname, "float32", *a32.call())
    if isinstance(o32, tuple) and len(o32) == 2 and _is_array(o32[0]) and o32[0].dtype != r32.dtype:
        raise Failure("float32", f"with float32 inputs the output is {o32[0].dtype}, expected {r32.dtype}",
                      "keep the input's dtype: constants as x.dtype.type(c), new arrays with dtype=x.dtype")


def check_function(layer: Layer, impl: dict, ex: Example) -> None:
    """A plain function (a table, a reshape, a mask): its result against the library's."""
    (name,) = layer.functions
    ref_fn = reference(layer.name)[0]
    args = _Args(ex)
    want = ref_fn(*_Args(ex).call())
    got = _call(impl[name], name, "output", *args.call())
    if B.is_device_array(want):
        _check_output("output", "the result", got, want)
    args.check_unchanged(name, "output")
    _compare("output", "the result", got, want, np.inf, layer.hints.get(name, ""))
    _run_invariants(layer, {name: ref_fn, **impl}, ex)
    _compare("output", "the result", got, want, FORWARD_TOL, layer.hints.get(name, ""))


def check_loss(layer: Layer, impl: dict, ex: Example) -> None:
    """``(loss, dlogits)``: both against the library's, dlogits against central differences of the loss."""
    (name,) = layer.functions
    fn, ref_fn = impl[name], reference(layer.name)[0]
    args = _Args(ex)
    ref_loss, ref_d = ref_fn(*_Args(ex).call())
    res = _call(fn, name, "loss", *args.call())
    if not (isinstance(res, tuple) and len(res) == 2):
        raise Failure("loss", f"{name} returned {type(res).__name__}, expected (loss, dlogits)",
                      "the loss and its gradient come out together: `return loss, dlogits`")
    loss, d = res
    args.check_unchanged(name, "loss")
    _check_output("loss", "dlogits", d, ref_d)
    _compare("loss", "dlogits", d, ref_d, np.inf, layer.hints.get("dlogits", ""))
    try:
        lv = float(B.to_host(loss))
    except Exception:
        raise Failure("loss", f"the loss is a {type(loss).__name__} of shape {getattr(loss, 'shape', '?')}, "
                              "expected one number", "average over the real tokens to a 0-d array") from None
    _run_invariants(layer, {name: fn}, ex)
    rv = float(B.to_host(ref_loss))
    if not abs(lv - rv) <= FORWARD_TOL * (abs(rv) + 1e-12):
        raise Failure("loss", f"the loss is {lv!r}, the library's {rv!r}", layer.hints.get(name, ""),
                      error=abs(lv - rv) / (abs(rv) + abs(lv) + 1e-300), tol=FORWARD_TOL)
    _compare("loss", "dlogits", d, ref_d, GRADIENT_TOL, layer.hints.get("dlogits", ""))
    if ex.gradcheck:
        x = args.arrays[0]
        idx = _spot(x.size, ex.seed)
        num = numerical_gradient(lambda: float(B.to_host(_call(fn, name, "loss", *args.call())[0])), x, indices=idx)
        gh, nh = B.to_host(d).reshape(-1)[idx], B.to_host(num).reshape(-1)[idx]
        err = rel_error(gh, nh)
        if not err <= GRADIENT_TOL:
            spot = f" (at flat indices {idx.tolist()} of {x.size})" if len(idx) < x.size else ""
            raise Failure("loss", "dlogits disagrees with central differences of your loss" + spot,
                          layer.hints.get("dlogits", ""), error=err, entries=_entries(gh, nh), symptom=_symptom(gh, nh),
                              tol=GRADIENT_TOL)


def _spot(size: int, seed: int):
    """Flat indices where central differences are taken: every entry of a small input,
    ``SPOT_CHECK`` random ones of a larger one (the whole gradient is compared with the
    library's anyway; the spot check keeps a layer's check at seconds)."""
    if size <= SPOT_CHECK:
        return np.arange(size)
    return np.sort(B.host_rng(seed).choice(size, SPOT_CHECK, replace=False))


CHECKS = {"pair": check_pair, "function": check_function, "loss": check_loss}

# ----------------------------------------------------------------------------- grading a layer


class Result:
    """How one layer did: ``status`` is "pass", "fail" or "todo" (not implemented yet)."""

    def __init__(self, layer: str, status: str, seconds: float, examples: int, detail=None, note: str = ""):
        self.layer, self.status, self.seconds, self.examples = layer, status, seconds, examples
        self.detail, self.note = detail, note


def grade(layer: Layer, impl: dict, examples: int = DEFAULT_EXAMPLES) -> Result:
    """Run hypothesis over the layer's examples; shrink a failure to the smallest example."""
    count = [0]

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, verbosity=Verbosity.quiet,
              phases=(Phase.explicit, Phase.generate, Phase.shrink))
    @given(layer.examples)
    def run(ex):
        count[0] += 1
        try:
            CHECKS[layer.kind](layer, impl, ex)
        except (Failure, NotImplementedYet) as e:
            e.example = ex
            raise

    note = ""
    if layer.kind == "pair":
        missing = [n for n in layer.functions if n not in impl]
        if missing == [layer.functions[1]]:
            note = f"forward only: {layer.functions[1]} is not defined, gradients not checked"
        elif missing == [layer.functions[0]]:
            note = f"{layer.functions[0]} is not defined: your backward gets the library's forward and cache"
    t0 = time.perf_counter()
    try:
        run()
        return Result(layer.name, "pass", time.perf_counter() - t0, count[0], note=note)
    except NotImplementedYet as e:
        return Result(layer.name, "todo", time.perf_counter() - t0, count[0], e, note)
    except Failure as f:
        return Result(layer.name, "fail", time.perf_counter() - t0, count[0], f, note)
    except Flaky as e:
        inner = next((x for x in getattr(e, "exceptions", ()) if isinstance(x, Failure)), None)
        f = inner or Failure("repeatability", "the same input gave different results on two calls",
                             "an unseeded random number, or state kept between calls (globals, attributes)")
        return Result(layer.name, "fail", time.perf_counter() - t0, count[0], f, note)
    except Exception as e:      # a bug of attn-check's own: say so, without a traceback for the learner
        f = Failure("attn-check", f"attn-check itself failed: {type(e).__name__}: {e}",
                    "not your code's fault: please report it with this file", where=_where(e.__traceback__))
        return Result(layer.name, "fail", time.perf_counter() - t0, count[0], f, note)

# ----------------------------------------------------------------------------- the report


def _describe(v) -> str:
    if isinstance(v, np.ndarray):
        s = f"{v.shape} {v.dtype}"
        if v.size <= 12:
            s += "  " + np.array2string(v, precision=4, separator=", ", max_line_width=10**6).replace("\n", "")
        return s
    if isinstance(v, Fresh):
        return f"attn.backend.DeviceRNG({v.seed}), the same mask on every call"
    return repr(v)


def _fmt(x) -> str:
    return f"{x:.6g}" if isinstance(x, (float, np.floating)) else str(x)


def report(r: Result, out=sys.stdout) -> None:
    w = out.write
    label = {"pass": "PASS", "fail": "FAIL", "todo": "not implemented yet"}[r.status]
    runs = (f"{r.examples} example{'s' * (r.examples != 1)}" if r.status == "pass"
            else f"{r.examples} runs, shrinking included")
    w(f"{r.layer:<22} {label:<6} {r.seconds:6.2f} s  ({runs})\n")
    if r.note:
        w(f"    note: {r.note}\n")
    if r.status == "todo":
        w(f"    {r.detail.function} raises NotImplementedError: write its body, then run this again\n")
        return
    if r.status != "fail":
        return
    f: Failure = r.detail
    w(f"    check:    {f.check}: {f.message}\n")
    if f.where:
        w(f"    where:    {f.where}\n")
    if f.example is not None:
        w("    example:  the smallest hypothesis found\n")
        for name, v in f.example.args:
            if not name.startswith("_"):
                w(f"                {name} = {_describe(v)}\n")
        if f.check in ("backward", "invariant"):
            w(f"                dout = standard normal of the output's shape, attn.backend.host_rng({f.example.seed})\n")
    if f.error is not None:
        w(f"    error:    relative error {f.error:.3g}" + (f" (tolerance {f.tol:g})" if f.tol else "") + "\n")
    if f.entries:
        w(f"    entries:  {'index':<14} {'yours':>14} {'expected':>14}\n")
        for idx, a, b in f.entries:
            w(f"              {str(idx):<14} {_fmt(a):>14} {_fmt(b):>14}\n")
    if f.symptom:
        w(f"    looks like: {f.symptom}\n")
    if f.hint:
        w(f"    hint:     {f.hint}\n")

# ----------------------------------------------------------------------------- command line


def load_learner(path: Path):
    """Import the learner's file as a module (its directory on sys.path while it imports)."""
    name = "attn_check_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent.resolve()))
    return module


def _layer_table() -> str:
    return "\n".join(f"  {n:<22} {', '.join(layer.functions)}" for n, layer in LAYERS.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attn-check", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Grade your own layers against attn's: the same hypothesis examples, gradient checks "
                    "and invariants that prove the library's layers.",
        epilog=(
            "Write the functions of a layer in PATH.py under the library's names (start from a file in\n"
            "lessons/exercises/), then run `attn-check PATH.py`. Only the layers the file defines are checked.\n"
            "For each, hypothesis draws examples (hard ones included: logits of 1e4, fully masked rows,\n"
            "repeated ids, padding) and attn-check runs your forward and backward on them: exceptions, NaN,\n"
            "wrong shapes or dtypes, inputs modified in place and a forward without a cache are caught; the\n"
            "layer's invariants are checked; outputs and gradients are compared with the library's, and\n"
            "gradients with float64 central differences of your forward. A layer passes, or the report shows\n"
            "the smallest failing example hypothesis found, which check and which gradient failed, the\n"
            "relative error, the first entries that differ and a hint at the usual cause. A function that\n"
            "still raises NotImplementedError is reported as 'not implemented yet'. A forward without its\n"
            "backward is checked without gradients; a backward without its forward gets the library's\n"
            "forward and cache (so does one that imports the library's forward, as\n"
            "lessons/exercises/08_backprop_by_hand.py does).\n\n"
            "Exit status: 0 when every layer found passes, 1 when one fails or is not implemented yet,\n"
            "2 when the file cannot be loaded or defines no layer.\n\n"
            "Layers and the names attn-check looks for:\n" + _layer_table()))
    p.add_argument("path", type=Path, help="your Python file, e.g. lessons/exercises/07_feed_forward_layer_norm.py")
    p.add_argument("--layer", action="append", choices=list(LAYERS), metavar="NAME",
                   help="check only this layer (repeatable); default: every layer the file defines")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, metavar="N",
                   help=f"hypothesis examples per layer (default {DEFAULT_EXAMPLES}; more finds rarer bugs, slower)")
    p.add_argument("--backend", choices=["numpy", "cupy"], default="numpy",
                   help="array backend to run on (default numpy; cupy needs a GPU)")
    return p


def main(argv=None, out=None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    path: Path = args.path
    if not path.is_file():
        out.write(f"attn-check: {path}: no such file\n")
        return 2
    if args.examples < 1:
        out.write("attn-check: --examples must be at least 1\n")
        return 2
    try:
        B.set_backend(args.backend)
    except B.BackendError as e:
        out.write(f"attn-check: {e}\n")
        return 2
    _LEARNER_FILE[0] = str(path)
    try:
        module = load_learner(path)
    except Exception as e:
        where = f"{e.filename}:{e.lineno}: " if isinstance(e, SyntaxError) else ""
        tb_where = "" if isinstance(e, SyntaxError) else _where(e.__traceback__)
        out.write(f"attn-check: could not import {path}: {where}{type(e).__name__}: {e}\n")
        if tb_where:
            out.write(f"    where: {tb_where}\n")
        return 2
    found = {}
    for name, layer in LAYERS.items():
        impl = {n: getattr(module, n) for n in layer.functions if callable(getattr(module, n, None))}
        if impl and (not args.layer or name in args.layer):
            found[name] = impl
    missing = [n for n in args.layer or [] if n not in found]
    if missing:
        out.write(f"attn-check: {path} defines no function of {', '.join(missing)} (looked for "
                  + "; ".join(", ".join(LAYERS[n].functions) for n in missing) + ")\n")
        return 2
    if not found:
        out.write(f"attn-check: {path} defines none of the library's layer functions. Names it looks for:\n"
                  f"{_layer_table()}\n")
        return 2
    out.write(f"attn-check {path}: {len(found)} layer{'s' * (len(found) != 1)}, "
              f"{args.examples} examples each, backend {B.get_backend()}\n")
    results = []
    for name, impl in found.items():
        r = grade(LAYERS[name], impl, args.examples)
        report(r, out)
        out.flush()
        results.append(r)
    passed = sum(r.status == "pass" for r in results)
    todo = sum(r.status == "todo" for r in results)
    total = sum(r.seconds for r in results)
    out.write(f"{passed} of {len(results)} passed"
              + (f", {todo} not implemented yet" if todo else "")
              + (f", {len(results) - passed - todo} failed" if len(results) - passed - todo else "")
              + f" ({total:.1f} s)\n")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

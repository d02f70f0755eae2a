"""The registration of LoRA (:mod:`attn.layers.lora`): the adapter's forward and backward, and
the merge; their examples, the invariants a reader states aloud (at initialisation the adapter
adds exactly nothing; the merged weight gives the adapter's output; the frozen weight steers no
gradient of the adapter) and their hints, read from :data:`attn.testing.registry.LAYERS` like
every other."""
from __future__ import annotations

from hypothesis import strategies as st

from .. import backend as B
from .invariants import InvariantError, _dev, _host, _out
from . import mistakes as M
from . import explicit as X
from .layers import Example, Factor, Layer, Mistake, seeds
from .strategies import leading_shapes, normals

np = B.host

ALPHAS = (2.0, 1.0, 16.0, 0.5)


@st.composite
def lora_examples(draw):
    lead = draw(leading_shapes(1, 2))
    Din, Dout, r = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    zero_b = draw(st.booleans())     # (hypothesis starts from False: a trained adapter first)
    b = np.zeros((r, Dout)) if zero_b else draw(normals((r, Dout)))
    return Example((("x", draw(normals(lead + (Din,)))), ("w", draw(normals((Din, Dout)))),
                    ("a", draw(normals((Din, r)))), ("b", b), ("alpha", draw(st.sampled_from(ALPHAS)))),
                   ("x", "a", "b"), seed=draw(seeds))


def _merge(f):
    """The learner's merge where the file defines it, the library's otherwise."""
    if "lora_merge" in f:
        return f["lora_merge"]
    from ..layers import lora_merge
    return lora_merge


def _differs(a, b) -> float:
    a, b = _host(a), _host(b)
    return float(np.abs(a - b).max(initial=0.0)) if a.shape == b.shape else float("inf")


def lora_invariants(f, ex):
    """With b = 0 (an adapter at initialisation) the adapter adds exactly nothing: the output is
    the same to the last bit whatever a and alpha are, and it is x @ w; ``x @ lora_merge(w, a, b,
    alpha)`` is the adapter's output; the frozen w steers neither da nor db (the adapter learns
    through its own path, x a b, beside w)."""
    fwd, bwd = f["lora_forward"], f.get("lora_backward")
    x, w, a, b, alpha = (ex.get(n) for n in ("x", "w", "a", "b", "alpha"))
    zero, other = np.zeros_like(b), np.flip(a, axis=0) * 3.0 + 1.0
    base = _host(_out(fwd(_dev(x), _dev(w), _dev(a), _dev(zero), alpha)))
    moved = _host(_out(fwd(_dev(x), _dev(w), _dev(other), _dev(zero), alpha * 4.0)))
    if not np.array_equal(base, moved):
        raise InvariantError(f"with b = 0 the output changes (by up to {_differs(base, moved):.3g}) when a and alpha "
                             "change: at initialisation the adapter must add exactly nothing, so that the adapted "
                             "model starts as the trained one to the last bit",
                             "out = x @ w + (alpha / r) * ((x @ a) @ b): with b = 0 the second term is exactly zero")
    tol = 1e-9 * (np.abs(x).sum(axis=-1).max(initial=0.0) + 1) * (np.abs(w).max(initial=0.0) + 1)
    if _differs(base, x @ w) > tol:
        raise InvariantError(f"with b = 0 the output differs from x @ w by {_differs(base, x @ w):.3g}: the frozen "
                             "weight's own map is missing or changed", "out = x @ w + (alpha / r) * ((x @ a) @ b)")
    out = _host(_out(fwd(_dev(x), _dev(w), _dev(a), _dev(b), alpha)))
    merged = x @ _host(_merge(f)(_dev(w), _dev(a), _dev(b), alpha))
    scale = 1e-9 * (np.abs(out).max(initial=0.0) + np.abs(merged).max(initial=0.0) + 1)
    if _differs(out, merged) > scale:
        raise InvariantError(f"x @ lora_merge(w, a, b, alpha) differs from the adapter's output by "
                             f"{_differs(out, merged):.3g}: the merged weight must map x as the adapter does",
                             "merge: w + (alpha / r) * (a @ b), with r = a.shape[1], the same scale as the forward")
    if bwd is None:
        return
    dout = B.host_rng(ex.seed).standard_normal(out.shape)
    grads = {}
    for name, weight in (("w", w), ("another w", 2.0 * w + 1.0)):
        g = bwd(_dev(dout), fwd(_dev(x), _dev(weight), _dev(a), _dev(b), alpha)[1])
        grads[name] = g if isinstance(g, tuple) and len(g) == 3 else None
    if grads["w"] is None or grads["another w"] is None:
        return                                          # the grader reports the count of gradients
    for i, label in ((1, "da"), (2, "db")):
        one, two = _host(grads["w"][i]), _host(grads["another w"][i])
        if _differs(one, two) > 1e-9 * (np.abs(one).max(initial=0.0) + 1):
            raise InvariantError(f"{label} changes (by {_differs(one, two):.3g}) when the frozen w changes: the "
                                 "adapter's gradient went through the frozen weight",
                                 "a and b sit beside w, not after it: dh = (alpha / r) * dout @ b.T, "
                                 "da = x.T @ dh, db = (alpha / r) * (x @ a).T @ dout")


def _scale(ex) -> float:
    return ex.get("alpha") / ex.get("a").shape[1]


LORA = Layer(
    "lora", "pair", ("lora_forward", "lora_backward"), lora_examples(), lora_invariants,
    {"forward": "out = x @ w + (alpha / r) * ((x @ a) @ b), r = a.shape[1], over any leading axes of x",
     "dx": "dx = dout @ w.T + dh @ a.T with dh = (alpha / r) * dout @ b.T: x reaches the output by both paths",
     "da": "da = x.T @ dh, dh = (alpha / r) * dout @ b.T, the leading axes flattened",
     "db": "db = (alpha / r) * (x @ a).T @ dout, the leading axes flattened"},
    where={"forward": "the scale is alpha over the rank, and the adapter's path is added to the frozen map's",
           "dx": "w is frozen, not cut: x still reaches the output through x @ w",
           "da": "a's path is x @ a @ b beside w: its gradient comes back through b, scaled",
           "db": "what the last product's input was, and the scale that multiplies the path"},
    mistakes=(
        Factor("db", _scale, "alpha/r, the adapter's scale", True,
               "the scale multiplies the whole adapter path, so b's gradient carries it: "
               "db = (alpha / r) * (x @ a).T @ dout"),
        Factor("da", _scale, "alpha/r, the adapter's scale", True,
               "dh = (alpha / r) * dout @ b.T carries the scale into a's gradient"),
        Mistake("forward", M.lora_scale_alpha, "x @ w + alpha * ((x @ a) @ b): scaled by alpha, not alpha/r",
                "the update is scaled by alpha / r, r = a.shape[1], so that the rank does not change its size"),
        Mistake("dx", M.lora_dx_adapter_only, "dh @ a.T alone: the frozen path's gradient is missing",
                "w is frozen, not cut: it gets no gradient, but x reaches the output through x @ w too, "
                "dx = dout @ w.T + dh @ a.T"),
        Mistake("da", M.lora_da_through_w, "x.T @ ((dout @ w.T) @ a) scaled: a's gradient taken through the frozen "
                "w", "a sits beside w, not after it: da = x.T @ ((alpha / r) * dout @ b.T)")),
    explicit=X.lora())


@st.composite
def lora_merge_examples(draw):
    Din, Dout, r = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    b = np.zeros((r, Dout)) if draw(st.booleans()) else draw(normals((r, Dout)))
    return Example((("w", draw(normals((Din, Dout)))), ("a", draw(normals((Din, r)))), ("b", b),
                    ("alpha", draw(st.sampled_from(ALPHAS)))), seed=draw(seeds))


def lora_merge_invariants(f, ex):
    """With b = 0 the merged weight is w itself, to the last bit."""
    w, a, b = ex.get("w"), ex.get("a"), ex.get("b")
    merged = _host(f["lora_merge"](_dev(w), _dev(a), _dev(np.zeros_like(b)), ex.get("alpha")))
    if not np.array_equal(merged, w):
        raise InvariantError(f"with b = 0 the merged weight differs from w (by up to {_differs(merged, w):.3g}): "
                             "an adapter at initialisation must leave the weight exactly as it was",
                             "merged = w + (alpha / r) * (a @ b): nothing else changes w")


LORA_MERGE = Layer(
    "lora_merge", "function", ("lora_merge",), lora_merge_examples(), lora_merge_invariants,
    {"lora_merge": "w + (alpha / r) * (a @ b), r = a.shape[1], a new array (w is not changed)"},
    {"lora_merge": "the scale, and which product of a and b has w's shape"},
    mistakes=(Mistake("lora_merge", M.lora_merge_unscaled, "w + a @ b: the merge without alpha/r",
                      "the merged weight must map x as the forward does: the same scale, alpha / r"),
              Mistake("lora_merge", M.lora_merge_rank_wrong_axis, "w + (alpha / D_in) * (a @ b): the rank read from "
                      "a.shape[0]", "a is (D_in, r), the paper's A transposed: the rank is a.shape[1]")),
    explicit=X.lora_merge())

LORA_LAYERS = (LORA, LORA_MERGE)

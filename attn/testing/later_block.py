"""The registrations of the later block's layers (lesson 26): rotary positions, SwiGLU and
grouped-query attention, each its examples (hard inputs included), the invariants a reader
states aloud and its hints, read from :data:`attn.testing.registry.LAYERS` like every other."""
from __future__ import annotations

from hypothesis import strategies as st

from .. import backend as B
from .invariants import InvariantError, _dev, _first, _host, _out
from . import mistakes as M
from . import explicit as X
from .layers import MHA_PARAMS, Example, Layer, Mistake, seeds
from .strategies import causal, floats, leading_shapes, normals, padding_masks

np = B.host

# ----------------------------------------------------------------------------- rotary positions


@st.composite
def rope_examples(draw):
    lead = draw(leading_shapes(0, 2))
    T, half = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    offset = draw(st.integers(0, 60))
    positions = None if draw(st.booleans()) else np.arange(offset, offset + T)
    base = draw(st.sampled_from([10000.0, 100.0, 10.0]))
    hard = draw(st.booleans())       # hypothesis' values, zeros and repeats included
    x = draw(floats(lead + (T, 2 * half), bound=100.0)) if hard else draw(normals(lead + (T, 2 * half)))
    return Example((("x", x), ("positions", positions), ("base", base),
                    ("_shift", draw(st.integers(-offset if positions is not None else 0, 40)))),
                   ("x",), gradcheck=not hard, seed=draw(seeds))


def rope_invariants(f, ex):
    """A rotation: every pair keeps its length; the score of a query and a key depends only on
    their offset; the backward turns a gradient back (backward of the output is the input)."""
    fwd, bwd = f["rope_forward"], f.get("rope_backward")
    x, positions, base = ex.get("x"), ex.get("positions"), ex.get("base")
    T, Dh = x.shape[-2:]
    pos = np.arange(T) if positions is None else positions
    out = _host(_out(fwd(_dev(x), _dev(pos), base)))
    pair = lambda a: np.hypot(a[..., :Dh // 2], a[..., Dh // 2:])      # noqa: E731
    bad = ~np.isclose(pair(out), pair(x), rtol=1e-10, atol=1e-10)
    if bad.any():
        raise InvariantError(f"the pair of features at {_first(bad)} changed its length from "
                             f"{pair(x)[_first(bad)]:.10g} to {pair(out)[_first(bad)]:.10g}: not a rotation",
                             "each pair (x_i, x_(i + Dh/2)) turns by one angle: cos and sin of the same angle")
    q, k, s = x.reshape(-1, T, Dh)[0, 0], x.reshape(-1, T, Dh)[-1, -1], ex.get("_shift")
    m, n = int(pos[0]), int(pos[-1])

    def score(a, b):
        turned = [_host(_out(fwd(_dev(v[None]), _dev(np.array([p])), base)))[0] for v, p in ((q, a), (k, b))]
        return float(turned[0] @ turned[1])
    here, there = score(m, n), score(m + s, n + s)
    if not np.isclose(here, there, rtol=1e-8, atol=1e-8 * (np.abs(q).sum() * np.abs(k).sum() + 1)):
        raise InvariantError(f"a query at {m} and a key at {n} score {here:.10g}, at {m + s} and {n + s} "
                             f"{there:.10g}: the score must depend on the offset only",
                             "the angle is position * theta_i with theta_i = base ** (-2 i / Dh)")
    if bwd is not None:
        y, cache = fwd(_dev(x), _dev(pos), base)
        back = _host(bwd(y, cache))
        if not np.allclose(back, x, rtol=1e-10, atol=1e-10 * (np.abs(x).max() + 1)):
            i = _first(~np.isclose(back, x, rtol=1e-10, atol=1e-10 * (np.abs(x).max() + 1)))
            raise InvariantError(f"rope_backward of the forward's output is {back[i]:.10g} at {i}, the input was "
                                 f"{x[i]:.10g}: the backward of a rotation is the rotation back",
                                 "turn the gradient by the same angles with sin negated")


ROPE = Layer("rope", "pair", ("rope_forward", "rope_backward"), rope_examples(), rope_invariants,
             {"forward": "pair x_i with x_(i + Dh/2): out_a = x_a cos - x_b sin, out_b = x_a sin + x_b cos, "
                         "angle = position * base ** (-2 i / Dh), i = 0 .. Dh/2 - 1",
              "dx": "dx = the rotation back: dx_a = d_a cos + d_b sin, dx_b = -d_a sin + d_b cos"},
             where={"forward": "which features are paired (i with i + Dh/2, not neighbours) and the angle of "
                               "each pair",
                    "dx": "the transpose of a rotation is the rotation by minus the angle"}, mistakes=(
                 Mistake("forward", M.rope_neighbours, "neighbours (2i, 2i+1) turned together",
                         "the pairs are the half split's: feature i with feature i + Dh/2"),
                 Mistake("forward", M.rope_exponent_without_two, "each pair's angle base^(-i/Dh): the exponent "
                         "without its 2", "theta_i = base^(-2i/Dh), i = 0 .. Dh/2 - 1: the exponent runs over the "
                         "even numbers up to Dh"),
                 Mistake("dx", M.rope_backward_same_way, "dout turned the same way as the forward",
                         "the backward turns the gradient back: the rotation by minus the angle, sin negated")),
             explicit=X.rope())

# ----------------------------------------------------------------------------- SwiGLU


@st.composite
def swiglu_examples(draw):
    lead, D, F = draw(leading_shapes(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    hard = draw(st.booleans())
    x = draw(floats(lead + (D,), bound=30.0)) if hard else draw(normals(lead + (D,)))
    return Example((("x", x), ("w", draw(normals((D, F)))), ("v", draw(normals((D, F)))),
                    ("w2", draw(normals((F, D))))), ("x", "w", "v", "w2"), gradcheck=not hard, seed=draw(seeds))


def swiglu_invariants(f, ex):
    """The value path gates nothing on its own: with V = 0 the output is zero, and so is W's
    gradient (the gate's weights learn only through what they gate)."""
    fwd, bwd = f["swiglu_forward"], f.get("swiglu_backward")
    x, w, w2 = ex.get("x"), ex.get("w"), ex.get("w2")
    zero = np.zeros_like(w)
    out, cache = fwd(_dev(x), _dev(w), _dev(zero), _dev(w2))
    if np.abs(_host(out)).max(initial=0.0) > 0:
        raise InvariantError("with v = 0 the output is not zero: the value path x @ v must multiply the gate",
                             "(silu(x @ w) * (x @ v)) @ w2: a product of the two paths")
    if bwd is not None:
        dw = _host(bwd(_dev(np.ones(out.shape)), cache)[1])
        if np.abs(dw).max(initial=0.0) > 0:
            raise InvariantError("with v = 0, dw is not zero: the gate's gradient must be multiplied by x @ v",
                                 "da = dh * (x @ v) * silu'(a)")


SWIGLU = Layer("swiglu", "pair", ("swiglu_forward", "swiglu_backward"), swiglu_examples(), swiglu_invariants,
               {"forward": "a = x @ w, b = x @ v, out = (a * sigmoid(a) * b) @ w2",
                "dx": "dx = da @ w.T + db @ v.T: x reaches the output through both products",
                "dw": "dw = x.T @ da with da = dh * b * s * (1 + a * (1 - s)), s = sigmoid(a), dh = dout @ w2.T",
                "dv": "dv = x.T @ db with db = dh * silu(a)",
                "dw2": "dw2 = h.T @ dout with h = silu(a) * b, the leading axes flattened"},
               where={"forward": "which path goes through SiLU and which multiplies it",
                      "dx": "x feeds two products",
                      "dw": "the derivative of a * sigmoid(a): the product rule, sigmoid' = s (1 - s)",
                      "dv": "the value path's gradient is the gate times dh",
                      "dw2": "what the last product's input was"}, mistakes=(
                   Mistake("forward", M.swiglu_silu_on_values, "(x @ w) * silu(x @ v): SiLU on the value path",
                           "the gate goes through SiLU, silu(x @ w), and multiplies the values x @ v"),
                   Mistake("forward", M.swiglu_silu_overflows, "NaN where a = x @ w is large: SiLU written "
                           "a * exp(a) / (1 + exp(a)), inf / inf once exp(a) overflows (a > 88.7 in float32)",
                           "write sigmoid(a) without exp of a large number: 1 / (1 + exp(-a)), or "
                           "(1 + tanh(a / 2)) / 2"),
                   Mistake("forward", M.swiglu_sigmoid_gate, "sigmoid(x @ w) * (x @ v): a sigmoid gate (GLU), not "
                           "SiLU", "the gate is silu(a) = a * sigmoid(a), not sigmoid(a)"),
                   Mistake("dx", M.swiglu_gate_derivative_sigmoid, "the gradient with SiLU's derivative taken as "
                           "sigmoid(a)", "the derivative of a * sigmoid(a) by the product rule: s * (1 + a * (1 - s))"),
                   Mistake("dx", M.swiglu_dx_gate_only, "da @ w.T alone: the value path's gradient is missing",
                           "x feeds two products: dx = da @ w.T + db @ v.T"),
                   Mistake("dv", M.swiglu_dv_without_sigmoid, "x.T @ (dh * a): the value path's gradient with the "
                           "gate a, not silu(a) = a * sigmoid(a)", "db = dh * silu(a): the value path is multiplied "
                           "by the gate after SiLU")), explicit=X.swiglu())

# ----------------------------------------------------------------------------- grouped-query attention


@st.composite
def gqa_examples(draw):
    kv, group, Dh = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    H, D = kv * group, kv * group * Dh
    Bsz, T = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    self_attn = draw(st.booleans())
    S = T if self_attn else draw(st.integers(1, 4))
    x_q = draw(normals((Bsz, T, D)))
    x_kv = x_q.copy() if self_attn else draw(normals((Bsz, S, D)))
    widths = {"q": D, "k": kv * Dh, "v": kv * Dh, "o": D}
    params = tuple((name, draw(normals((D, widths[name[2]]) if name[0] == "w" else (widths[name[2]],),
                                       D ** -0.5 if name[0] == "w" else 0.5))) for name in MHA_PARAMS)
    mask = causal(T) if self_attn else (draw(padding_masks(Bsz, S)) if draw(st.booleans()) else None)
    return Example((("x_q", x_q), ("x_kv", x_kv)) + params + (("n_heads", H), ("kv_heads", kv), ("mask", mask)),
                   ("x_q", "x_kv") + MHA_PARAMS, seed=draw(seeds))


def gqa_invariants(f, ex):
    """Grouped-query attention is the paper's attention with each group's key/value head shared:
    the same output as kv_heads = n_heads with the key and value weights of each head repeated."""
    fwd = f["grouped_query_attention_forward"]
    H, kv = ex.get("n_heads"), ex.get("kv_heads")
    if H == kv:
        return
    Dh = ex.get("x_q").shape[-1] // H

    def repeated(a):
        return np.repeat(a.reshape(*a.shape[:-1], kv, Dh), H // kv, axis=-2).reshape(*a.shape[:-1], H * Dh)
    args = {k: ex.get(k) for k in ("x_q", "x_kv") + MHA_PARAMS}
    full = {k: repeated(a) if k[2:] in ("k", "v") else a for k, a in args.items()}
    mask = ex.get("mask")
    grouped = _host(_out(fwd(*(_dev(a) for a in args.values()), H, kv, _dev(mask))))   # positionally, as the
    shared = _host(_out(fwd(*(_dev(a) for a in full.values()), H, H, _dev(mask))))      # grader calls a learner's
    if not np.allclose(grouped, shared, rtol=1e-9, atol=1e-10):
        raise InvariantError(f"with {kv} key/value heads for {H} query heads the output differs from the paper's "
                             f"attention with each group's key and value weights repeated (largest difference "
                             f"{np.abs(grouped - shared).max():.3g})",
                             "query head h reads key/value head h // (n_heads / kv_heads): repeat each head, "
                             "do not tile the heads")


GQA = Layer("grouped_query_attention", "pair",
            ("grouped_query_attention_forward", "grouped_query_attention_backward"), gqa_examples(), gqa_invariants,
            {"forward": "q in n_heads heads, k and v in kv_heads heads; repeat each key/value head for the "
                        "n_heads / kv_heads query heads of its group (numpy.repeat on the head axis), then "
                        "the paper's attention and the output projection",
             "dw_k": "sum the keys' gradient over each group of query heads before merging the heads: "
                     "(B, H, T, Dh) -> (B, KV, G, T, Dh).sum(axis=2)",
             "dw_v": "as dw_k: each value head's gradient is the sum over the query heads that read it",
             "dx_kv": "x_kv feeds the keys and the values: dx_kv = dx_k + dx_v, each from the summed gradient"},
            where={"forward": "which query heads read which key/value head",
                   "dw_k": "a key/value head used by several query heads gets all of their gradients",
                   "dw_v": "a key/value head used by several query heads gets all of their gradients",
                   "dx_kv": "the gradient of a repeated head is a sum"}, mistakes=(
        Mistake("dx_kv", M.gqa_group_mean, "each key/value head's gradient a mean over its group of query heads",
                "a key/value head read by g query heads gets the sum of their gradients, not their mean"),
        Mistake("dx_kv", M.gqa_group_first, "each key/value head's gradient from the first query head of its "
                "group alone", "a key/value head read by g query heads gets the gradients of all g: sum over "
                "the group")), explicit=X.grouped_query_attention())

LATER_BLOCK = (ROPE, SWIGLU, GQA)

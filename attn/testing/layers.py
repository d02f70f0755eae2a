"""What a layer's registration (:mod:`attn.testing.registry`) is made of, and the examples and
invariants of every layer of :mod:`attn.layers`, its helpers, the masks and the loss."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from .. import backend as B
from ..layers import merge_heads, split_heads
from ..masks import PAD_ID
from .invariants import (assert_attention_ignores_unseen_keys, assert_causal_mask_properties,
                         assert_cross_entropy_properties, assert_dropout_properties, assert_embedding_properties,
                         assert_heads_round_trip, assert_layer_norm_properties, assert_no_look_ahead,
                         assert_padding_ignored, assert_positional_properties, assert_rnn_skips_masked_steps,
                         assert_sinusoidal_table_properties, assert_softmax_properties)
from .strategies import (SCALE, away_from, causal, dims, floats, leading_shapes, logits, masks, normals, padded_ids,
                         padding_masks, token_ids)

np = B.host

# ----------------------------------------------------------------------------- examples and invariants
#
# A strategy of examples per layer (hypothesis shrinks them to the smallest that fails),
# and the invariants that apply. attn.grader grades a learner's functions with these; the
# hard inputs (large logits, fully masked rows, repeated ids, padding) come from the same
# strategies the tests use.

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
        ``(label, yours, expected, example, dout) -> (symptom, look) or None``: what a
        wrong gradient looks like and where to look, beyond what any layer's could (which
        path of a shared weight is missing).
    library
        the module that holds the library's own functions under these names.
    mistakes
        the typical mistakes a learner makes in this layer, each with the hints that name it:
        a :class:`Mistake` (a whole wrong result: a result that equals it is reported as that
        mistake), a :class:`Term` of a right gradient or a :class:`Factor`.
    explicit
        a few :class:`Example` built by plain code (:mod:`attn.testing.explicit`), each chosen to
        show typical mistakes: the grader runs them first in every profile, before hypothesis
        draws ``examples``, so that what a grade catches does not rest on hypothesis's search.
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
    library: str = "attn.layers"
    mistakes: tuple = ()
    explicit: tuple = ()


class Mistake(NamedTuple):
    """A typical mistake in one result of a layer, and what the report says of it.

    result
        which result it is in: ``"forward"``, a gradient's key (``"dx"``, ``"dw"``) or a
        function's name; or a tuple of them, for a mistake that every one of them shows.
    wrong
        ``(example, dout) -> that result with the mistake made``, computed on the example's
        host arrays (``dout``: the upstream gradient of a backward, None otherwise); for a
        tuple of results, a dict of them.
    looks
        what yours then is (hint 1, after "yours is").
    look
        where to look (hint 2).
    """
    result: object
    wrong: Callable
    looks: str
    look: str


class Term(NamedTuple):
    """A term of a right gradient that a learner may leave out, count twice or give the wrong
    sign: where yours minus the expected is a combination of a layer's terms, the report says
    which, and how (``result``, ``look`` as :class:`Mistake`'s).

    value
        ``(example, dout) -> the term`` on the example (for a tuple of results, a dict).
    name
        what it is, for hint 1 ("yours is the expected where <name> is missing").
    """
    result: object
    value: Callable
    name: str
    look: str


class Factor(NamedTuple):
    """A factor a right gradient has (``has``), which a learner may leave out or apply twice, or
    one it has not, which a learner may add (a mean for a sum): where yours is the expected
    times a number, the report names the factor that number is.

    value
        ``example -> the factor``.
    name
        what it is, for hint 1; ``{inverse}`` stands for one over the factor.
    look
        where to look (hint 2), or "" to keep the gradient's own.
    """
    result: object
    value: Callable
    name: str
    has: bool
    look: str


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


def dropout_invariants(f, ex):
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


def embedding_invariants(f, ex):
    ids, W = ex.get("ids"), ex.get("W")
    assert_embedding_properties(f["embedding_forward"], f.get("embedding_backward"), ids, W, ex.get("scale"),
                                _dout(ex, ids.shape + (W.shape[1],)))


@st.composite
def positional_examples(draw):
    d = draw(dims())
    x, table = draw(floats((d.B, d.T, d.D))), draw(normals((d.T + draw(st.integers(0, 3)), d.D)))
    return Example((("x", x), ("table", table)), ("x", "table"), seed=draw(seeds))


def positional_invariants(f, ex):
    x = ex.get("x")
    assert_positional_properties(f["positional_forward"], f.get("positional_backward"), x, ex.get("table"),
                                 _dout(ex, x.shape))


@st.composite
def sinusoidal_examples(draw):
    return Example((("max_len", draw(st.integers(1, 12))), ("d_model", draw(st.integers(1, 8))),
                    ("dtype", "float64")))


def sinusoidal_invariants(f, ex):
    assert_sinusoidal_table_properties(f["sinusoidal_table"], ex.get("max_len"), ex.get("d_model"))

# -- softmax, layer norm, feed-forward, residual


@st.composite
def softmax_examples(draw):
    lead, K = draw(leading_shapes(1, 3)), draw(st.integers(1, 6 * SCALE[0]))
    shape = lead + (K,)
    if draw(st.booleans()):          # well-conditioned: gradient check
        x = draw(normals(shape))
        mask = draw(masks(shape, ensure_key=draw(st.booleans()))) if draw(st.booleans()) else None
        return Example((("x", x), ("mask", mask)), ("x",), seed=draw(seeds))
    # hard: logits up to 1e4, fully masked rows
    x = draw(logits(shape))
    mask = draw(masks(shape, fully_masked_row=draw(st.booleans()))) if draw(st.booleans()) else None
    return Example((("x", x), ("mask", mask)), ("x",), gradcheck=False, seed=draw(seeds))


def softmax_invariants(f, ex):
    x = ex.get("x")
    assert_softmax_properties(f["softmax_forward"], f.get("softmax_backward"), x, ex.get("mask"), _dout(ex, x.shape))


@st.composite
def layer_norm_examples(draw):
    # Rows of 3 or more: with 1 or 2 entries every centred row is a multiple of one vector, and
    # the mistakes (a missing mean or variance term, a wrong scale) cannot be told apart.
    lead, D = draw(leading_shapes(1, 3)), draw(st.integers(3, 6 * SCALE[0]))
    if not draw(st.booleans()):      # shrinks to Gaussian rows, which show every term of the gradient
        eps = draw(st.sampled_from([1e-5, 1e-3, 0.1, 1.0]))
        x = draw(normals(lead + (D,), draw(st.sampled_from([1.0, 0.1, 10.0]))))
        gradcheck = True
    else:                            # hard: hypothesis' values, constant rows included
        eps = draw(st.sampled_from([1e-5, 1e-2]))
        x = draw(floats(lead + (D,), bound=100.0))
        gradcheck = False
    return Example((("x", x), ("gamma", draw(normals((D,)))), ("beta", draw(normals((D,)))), ("eps", eps)),
                   ("x", "gamma", "beta"), gradcheck=gradcheck, seed=draw(seeds))


def layer_norm_invariants(f, ex):
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
    d = d._replace(D=max(d.D, 3))                  # rows the norm's mistakes show in (layer_norm_examples)
    x = draw(normals((d.B, d.T, d.D)))
    params = _ffn_params(draw, d)
    assume(np.abs(x @ params[0][1] + params[1][1]).min() > 1e-4)
    return Example((("x", x),) + params + (("gamma", draw(normals((d.D,)))), ("beta", draw(normals((d.D,)))),
                                           ("eps", draw(st.sampled_from([1e-5, 0.1, 1.0])))),
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


def attention_invariants(f, ex):
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


def heads_invariants(f, ex):
    x = ex.get("x")
    if x.ndim == 3:
        assert_heads_round_trip(f["split_heads"], f.get("merge_heads", merge_heads), x, ex.get("H"))
    else:
        Bsz, H, T, Dh = x.shape
        assert_heads_round_trip(f.get("split_heads", split_heads), f["merge_heads"],
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


def mha_invariants(f, ex):
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


def rnn_invariants(f, ex):
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


def cross_entropy_invariants(f, ex):
    assert_cross_entropy_properties(f["cross_entropy"], *(ex.get(k) for k in ("logits", "targets", "smoothing",
                                                                             "pad_id")))


@st.composite
def causal_mask_examples(draw):
    return Example((("T", draw(st.integers(1, 8))), ("xp", XP)))


@st.composite
def padding_mask_examples(draw):
    d = draw(dims())
    return Example((("ids", draw(padded_ids(d.B, d.S, d.V))), ("pad_id", PAD_ID)))


def causal_invariants(f, ex):
    assert_causal_mask_properties(f["causal_mask"], ex.get("T"))


HINT_RESHAPE = ("reshape (B, T, D) to (B, T, H, Dh), then transpose to (B, H, T, Dh); reshaping straight "
                 "to (B, H, T, Dh) mixes positions into heads")

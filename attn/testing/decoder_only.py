"""The registration of the decoder-only layer (lesson 24's exercise): GPT's block, the paper's
decoder layer without its cross-attention, its self-attention under the look-ahead mask.
Its examples, the invariants a reader states aloud (a later position never changes an earlier
output; a gradient at one position never reaches a later one) and its hints, read from
:data:`attn.testing.registry.LAYERS` like every other."""
from __future__ import annotations

from hypothesis import strategies as st

from .. import backend as B
from . import explicit as X
from .exercises import BLOCK_EPS, _block_dims, _block_params
from .invariants import InvariantError, _dev, _first, _host, _out
from .layers import Example, Layer, Mistake, Term, seeds
from .mistakes import _Block
from .strategies import normals

np = B.host

#: The layer's sub-layers and norms, in the order its parameters' names start with them.
PARTS = ("self_attn", "norm1", "ffn", "norm2")


@st.composite
def decoder_only_layer_examples(draw):
    d = draw(_block_dims())
    return Example((("x", draw(normals((d.B, d.T, d.D)))), ("params", _block_params(draw, d.D, d.F, PARTS)),
                    ("n_heads", d.H), ("eps", draw(BLOCK_EPS))), ("x", "params"), seed=draw(seeds))


def _causal(T: int, k: int = 0):
    return np.tril(np.ones((T, T), dtype=bool), k)[None, None]


def decoder_only_invariants(f, ex):
    """Changing the positions after ``t`` leaves the outputs at ``0..t`` as they were (the
    look-ahead mask); and, with the backward, a gradient that reaches the output at position
    ``t`` alone sends nothing to the inputs after ``t``."""
    fwd, bwd = f["decoder_only_layer_forward"], f.get("decoder_only_layer_backward")
    x, params, H, eps = (ex.get(n) for n in ("x", "params", "n_heads", "eps"))
    T = x.shape[1]
    if T < 2:
        return
    t = (T - 1) // 2
    later = x.copy()
    later[:, t + 1:] += 1.0 + np.abs(later[:, t + 1:])

    def run(a):
        return fwd(_dev(a), {k: _dev(v) for k, v in params.items()}, H, eps)
    outs = [_host(_out(run(a))) for a in (x, later)]
    if outs[0].shape != x.shape or outs[1].shape != x.shape:
        return                                          # the grader reports the shape
    if not np.allclose(outs[1][:, :t + 1], outs[0][:, :t + 1], rtol=1e-12, atol=1e-12):
        raise InvariantError(f"changing positions {t + 1}.. changed the outputs at positions 0..{t}: the future "
                             "leaks into the past", "the self-attention takes the look-ahead mask: position i sees "
                             "keys 0..i (attn.masks.causal_mask(T)), and nothing else in the layer mixes positions")
    if bwd is None:
        return
    dout = np.zeros(x.shape)
    dout[:, t] = B.host_rng(ex.seed).standard_normal((x.shape[0], x.shape[2]))
    result = bwd(_dev(dout), run(x)[1])
    dx = _host(result[0]) if isinstance(result, tuple) and result else None
    if dx is None or getattr(dx, "shape", None) != x.shape:
        return                                          # the grader reports the gradients' count and shapes
    leak = np.abs(dx[:, t + 1:]) > 1e-12 * (np.abs(dx).max(initial=0.0) + 1)
    if leak.any():
        b, i, j = _first(leak)
        raise InvariantError(f"with dout nonzero at position {t} alone, dx is {dx[b, t + 1 + i, j]:.3g} at the later "
                             f"position {t + 1 + i}: the backward sends a gradient into the future",
                             "the backward runs through the forward's masked weights (the cache): a later position "
                             "never contributed to position t, so it gets none of its gradient")


# -- the typical mistakes: the layer with one thing changed, on the library's own layers


def _layer(ex, mask=None, residual=True, pre=False):
    """The layer's output (host) on the example, with a mistake: another ``mask``, no residual
    around the attention, or the norms before the sub-layers (pre-norm, no final norm)."""
    b, x = _Block(ex), ex.get("x")
    mask = _causal(x.shape[1]) if mask is None else mask
    if pre:
        n = b.norm(x, "norm1")[0]
        h = x + b.attend("self_attn", n, n, mask)[0]
        return h + b.ffn(b.norm(h, "norm2")[0])[0]
    h = b.norm((x if residual else 0 * x) + b.attend("self_attn", x, x, mask)[0], "norm1")[0]
    return b.norm(h + b.ffn(h)[0], "norm2")[0]


def without_the_diagonal(ex, dout):
    return _layer(ex, mask=_causal(ex.get("x").shape[1], -1))


def without_the_residual(ex, dout):
    return _layer(ex, residual=False)


def pre_norm(ex, dout):
    return _layer(ex, pre=True)


def _backward(ex, dout) -> dict:
    """The right backward's pieces: ``dz1`` (the first norm's gradient, what the skip path
    passes to x), ``dq``, ``dkv`` and ``through``, x's gradient from a gradient ``g`` at the
    first norm's output alone."""
    b, x = _Block(ex), ex.get("x")
    a, ca = b.attend("self_attn", x, x, _causal(x.shape[1]))
    h, c1 = b.norm(x + a, "norm1")
    f, cf = b.ffn(h)
    _, c2 = b.norm(h + f, "norm2")

    def through(g):
        dz = b.L.layer_norm_backward(g, c1)[0]
        dq, dkv = b.L.multi_head_attention_backward(dz, ca)[:2]
        return dz, dq, dkv
    dz2 = b.L.layer_norm_backward(dout, c2)[0]
    dz1, dq, dkv = through(dz2 + b.L.feed_forward_backward(dz2, cf)[0])
    return {"dz1": dz1, "dq": dq, "dkv": dkv, "second_skip": sum(through(dz2))}


def first_skip_term(ex, dout):
    return _backward(ex, dout)["dz1"]


def keys_values_term(ex, dout):
    return _backward(ex, dout)["dkv"]


def second_skip_term(ex, dout):
    return _backward(ex, dout)["second_skip"]


DECODER_ONLY_LAYER = Layer(
    "decoder_only_layer", "pair", ("decoder_only_layer_forward", "decoder_only_layer_backward"),
    decoder_only_layer_examples(), decoder_only_invariants,
    {"forward": "h = LayerNorm1(x + SelfAttn(x, x, causal_mask(T))); out = LayerNorm2(h + FFN(h)): the paper's "
                "decoder layer without its cross-attention",
     "dx": "dz2 = LN2 backward of dout; dz1 = LN1 backward of (dz2 + FFN backward of dz2); dx = dz1 + dx_q + dx_kv: "
           "x is the queries, the keys and the values"},
    where={"forward": "the self-attention's mask (may a position see itself?), the residual additions, and where "
                      "the norms sit (after each addition, the paper's post-norm)",
           "dx": "each residual sends its gradient by two paths, and the self-attention reads x as its queries and "
                 "as its keys and values"},
    library="attn.grader.solutions",
    mistakes=(
        Mistake("forward", without_the_diagonal, "the layer under tril(ones, -1): the look-ahead mask hides each "
                "position from itself", "a position may see itself: causal_mask(T) is tril with the diagonal "
                "(k=0); position 0 would otherwise see nothing"),
        Mistake("forward", without_the_residual, "LayerNorm1(SelfAttn(x)): the residual x is not added",
                "each sub-layer is LayerNorm(x + sublayer(x)): the input is added to the attention's output"),
        Mistake("forward", pre_norm, "x + SelfAttn(LayerNorm(x)): the norm before the sub-layer (pre-norm)",
                "this layer is the paper's: it normalises after the addition, LayerNorm(x + sublayer(x))"),
        Term("dx", first_skip_term, "the first residual's skip path dz1",
             "x reaches the first Add & Norm by two paths: dz1 passes straight back too, dx = dz1 + dx_q + dx_kv"),
        Term("dx", keys_values_term, "the self-attention's keys and values path dx_kv",
             "the self-attention reads x as its queries and as its keys and values: dx_q + dx_kv"),
        Term("dx", second_skip_term, "the path through the second residual's skip connection",
             "h reaches the second Add & Norm by two paths: the norm's gradient dz2 goes back by the skip path "
             "besides the feed-forward network, dz2 + FFN backward of dz2")),
    explicit=X.decoder_only_layer())

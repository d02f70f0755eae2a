"""The exercises beyond single layers (lessons 2-15): Luong attention, the decoder's mask,
an encoder and a decoder layer, the whole Transformer, the schedule, Adam, greedy and beam
search, checkpoint averaging and BPE merges: their examples and invariants, which their
registrations in :mod:`attn.testing.registry` name."""
from __future__ import annotations

import math
from typing import NamedTuple

from hypothesis import strategies as st

from .. import backend as B
from ..masks import PAD_ID
from ..model import Transformer, TransformerConfig
from .invariants import InvariantError, _dev, _host, _out
from .layers import Example, seeds, small_shapes
from .strategies import dims, divisors, normals, padded_ids, padding_masks

np = B.host

# ----------------------------------------------------------------------------- the whole path: lessons 2-15
#
# Exercises beyond single layers, graded against the code the library runs
# (:mod:`attn.grader.solutions` calls attn.model, attn.optim, attn.decode and attn.bpe).


class Built(NamedTuple):
    """An argument made by ``attn.grader.solutions.<function>(*args)`` (the fixed model of the
    decoding exercise): in the grader's process for the library's call, in the child for
    the learner's."""
    function: str
    args: tuple


@st.composite
def luong_examples(draw):
    Bsz, T, S, H = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    lengths = np.array(draw(st.lists(st.integers(1, S), min_size=Bsz, max_size=Bsz)))
    mask = np.arange(S)[None, :] < lengths[:, None]
    return Example((("s", draw(normals((Bsz, T, H)))), ("e", draw(normals((Bsz, S, H)))),
                    ("w_c", draw(normals((2 * H, H), 1 / math.sqrt(2 * H)))), ("b_c", draw(normals((H,), 0.1))),
                    ("src_mask", mask)), ("s", "e", "w_c", "b_c"), seed=draw(seeds))


def luong_invariants(f, ex):
    """Whatever sits at padded source positions, the output does not change."""
    s, e, w_c, b_c, mask = (ex.get(k) for k in ("s", "e", "w_c", "b_c", "src_mask"))
    if mask.all():
        return
    e2 = e.copy()
    e2[~mask] = 1e3
    fwd = f["luong_attention_forward"]
    outs = [_host(_out(fwd(_dev(s), _dev(x), _dev(w_c), _dev(b_c), _dev(mask)))) for x in (e, e2)]
    if not np.allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12):
        raise InvariantError("changing padded encoder states changed the output: padding leaks into the context",
                             "the source mask must reach the scores before the softmax")


@st.composite
def decoder_mask_examples(draw):
    d = draw(dims())
    return Example((("tgt_ids", draw(padded_ids(d.B, d.T, d.V))), ("pad_id", PAD_ID)))


def _block_params(draw, D, F, names):
    out = {}
    for name in names:
        if name.endswith("attn"):
            for n in "qkvo":
                out[f"{name}.w_{n}"] = draw(normals((D, D), 1.0 / math.sqrt(D)))
                out[f"{name}.b_{n}"] = draw(normals((D,), 0.1))
        elif name == "ffn":
            out.update({"ffn.w1": draw(normals((D, F), 1 / math.sqrt(D))), "ffn.b1": draw(normals((F,), 0.1)),
                        "ffn.w2": draw(normals((F, D), 1 / math.sqrt(F))), "ffn.b2": draw(normals((D,), 0.1))})
        else:
            out[f"{name}.gamma"] = 1.0 + draw(normals((D,), 0.1))
            out[f"{name}.beta"] = draw(normals((D,), 0.1))
    return out


@st.composite
def _block_dims(draw):
    """dims() for a whole block: widths 3 or 4 (with D = 2 a layer norm's output is +-1 whatever its input,
    and central differences through it stop resolving the gradients behind it)."""
    d = draw(dims(max_batch=2, max_len=4, max_width=4))
    D = draw(st.sampled_from([3, 4]))
    return d._replace(D=D, H=draw(st.sampled_from(divisors(D))), F=max(d.F, 2))


#: eps of the blocks' layer norms: large enough that central differences resolve every gradient.
BLOCK_EPS = st.sampled_from([1e-3, 0.1])


@st.composite
def encoder_layer_examples(draw):
    d = draw(_block_dims())
    mask = draw(padding_masks(d.B, d.S)) if draw(st.booleans()) else None
    params = _block_params(draw, d.D, d.F, ("self_attn", "norm1", "ffn", "norm2"))
    return Example((("x", draw(normals((d.B, d.S, d.D)))), ("mask", mask), ("params", params), ("n_heads", d.H),
                    ("eps", draw(BLOCK_EPS))), ("x", "params"), seed=draw(seeds))


@st.composite
def decoder_layer_examples(draw):
    d = draw(_block_dims())
    from ..masks import decoder_mask
    tgt = draw(padded_ids(d.B, d.T, max(d.V, 2)))
    params = _block_params(draw, d.D, d.F, ("self_attn", "norm1", "cross_attn", "norm2", "ffn", "norm3"))
    return Example((("x", draw(normals((d.B, d.T, d.D)))), ("memory", draw(normals((d.B, d.S, d.D)))),
                    ("src_mask", draw(padding_masks(d.B, d.S))), ("tgt_mask", decoder_mask(tgt)),
                    ("params", params), ("n_heads", d.H), ("eps", draw(BLOCK_EPS))), ("x", "memory", "params"),
                   seed=draw(seeds))


@st.composite
def transformer_examples(draw):
    D = draw(st.sampled_from([3, 4]))
    H, F, V = draw(st.sampled_from(divisors(D))), draw(st.integers(2, 4)), draw(st.integers(4, 7))
    n_enc, n_dec = draw(st.integers(1, 2)), 1
    Bsz, S, T = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    params = {"embedding.weight": draw(normals((V, D)))}
    for i in range(n_enc):
        params.update({f"encoder.{i}.{k}": v for k, v in _block_params(
            draw, D, F, ("self_attn", "norm1", "ffn", "norm2")).items()})
    for i in range(n_dec):
        params.update({f"decoder.{i}.{k}": v for k, v in _block_params(
            draw, D, F, ("self_attn", "norm1", "cross_attn", "norm2", "ffn", "norm3")).items()})
    return Example((("src", draw(padded_ids(Bsz, S, V))), ("tgt_in", draw(padded_ids(Bsz, T, V))),
                    ("params", params), ("n_heads", H), ("eps", draw(BLOCK_EPS))), ("params",), seed=draw(seeds))


def tied_embedding_paths(params, n_heads, eps, src, tgt_in, dlogits) -> dict:
    """The three contributions to ``embedding.weight``'s gradient, by path: the source
    embedding, the target embedding and the output projection (the model untied, the
    one matrix copied to each)."""
    E = params["embedding.weight"]
    w1 = params["encoder.0.ffn.w1"]
    untied = {k: v for k, v in params.items() if k != "embedding.weight"}
    untied.update({"src_embedding.weight": E, "tgt_embedding.weight": E, "generator.weight": E})
    n_enc = len({k.split(".")[1] for k in params if k.startswith("encoder.")})
    n_dec = len({k.split(".")[1] for k in params if k.startswith("decoder.")})
    cfg = TransformerConfig(vocab_size=int(E.shape[0]), d_model=int(w1.shape[0]), n_heads=n_heads,
                            d_ff=int(w1.shape[1]), n_encoder_layers=n_enc, n_decoder_layers=n_dec, dropout=0.0,
                            ln_eps=eps, share_embeddings=False)
    m = Transformer(cfg, dtype=E.dtype, params=untied)
    _, cache = m.forward(src, tgt_in)
    g = m.backward(dlogits, cache)
    return {"the source embedding": g["src_embedding.weight"], "the target embedding": g["tgt_embedding.weight"],
            "the output projection": g["generator.weight"]}


#: Where each use of the shared embedding sends its gradient from (hint 2).
TIED_PATHS = {
    "the source embedding": "the encoder's input is src embedded with E: embedding_backward of the gradient that "
                            "reaches the encoder's input adds to dE",
    "the target embedding": "the decoder's input is tgt_in embedded with E: embedding_backward of the gradient "
                            "that reaches the decoder's input adds to dE",
    "the output projection": "the logits are h @ E^T: that product sends dlogits^T @ h to dE"}


def explain_tied_embedding(label, yours, expected, ex, dout):
    """For ``embedding.weight``: which of its three gradient paths yours lacks (or counts
    twice), and where that path's gradient comes from; None for any other gradient."""
    if "embedding.weight" not in label:
        return None
    args = {k: B.to_device(v) if isinstance(v, np.ndarray) else
            ({n: B.to_device(a) for n, a in v.items()} if isinstance(v, dict) else v) for k, v in ex.args}
    paths = tied_embedding_paths(args["params"], args["n_heads"], args["eps"], args["src"], args["tgt_in"],
                                 B.to_device(dout))
    y, e = B.to_host(yours), B.to_host(expected)
    scale = np.abs(e).max() + 1e-300
    for name, g in paths.items():
        g = B.to_host(g)
        if np.abs(g).max() > 1e-9 * scale:
            if np.abs(y - (e - g)).max() <= 1e-7 * scale:
                return (f"yours is the expected without the path through {name}: embedding.weight is used three "
                        "times, and its gradient is the sum of all three", TIED_PATHS[name])
            if np.abs(y - (e + g)).max() <= 1e-7 * scale:
                return f"yours counts the path through {name} twice", TIED_PATHS[name]
    return None


@st.composite
def noam_examples(draw):
    return Example((("step", draw(st.integers(1, 20000))), ("d_model", draw(st.sampled_from([8, 64, 256, 512]))),
                    ("warmup_steps", draw(st.sampled_from([1, 10, 400, 4000]))),
                    ("factor", draw(st.sampled_from([1.0, 2.0, 0.5])))))


@st.composite
def adam_examples(draw):
    """A few steps from zero moments: params, one gradient dict per step, and the rate of each step."""
    shapes = draw(st.lists(small_shapes, min_size=1, max_size=3))
    params = {f"p{i}": draw(normals(s)) for i, s in enumerate(shapes)}
    K = draw(st.integers(1, 4))
    grads = [{k: draw(normals(v.shape, draw(st.sampled_from([1.0, 1e-3, 100.0])))) for k, v in params.items()}
             for _ in range(K)]
    lrs = [draw(st.sampled_from([1e-3, 0.1, 0.5])) for _ in range(K)]
    beta1, beta2 = draw(st.sampled_from([(0.9, 0.98), (0.9, 0.999), (0.5, 0.9)]))
    return Example((("params", params), ("grads", grads), ("lrs", lrs), ("beta1", beta1), ("beta2", beta2),
                    ("eps", draw(st.sampled_from([1e-9, 1e-3])))))


@st.composite
def decoding_examples(draw, beam: bool):
    Bsz, S = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    args = [("model", Built("decoding_model", (draw(st.integers(0, 3)),))), ("src", draw(padded_ids(Bsz, S, 6)))]
    if beam:
        args += [("beam_size", draw(st.integers(1, 4))), ("alpha", draw(st.sampled_from([0.0, 0.6, 1.0])))]
    args.append(("max_len", draw(st.integers(1, 8))))
    return Example(tuple(args))


def compare_decoded(got, want, ex) -> None:
    """(tokens, scores): the same tokens for every sentence, scores within 1e-9."""
    if not (isinstance(got, tuple) and len(got) == 2):
        raise InvariantError(f"the result is a {type(got).__name__}, expected (tokens, scores)",
                             "return the tokens of each sentence (a list of lists of ints) and their scores")
    tokens, scores = got
    wt, ws = want
    try:
        tokens = [[int(t) for t in row] for row in tokens]
        scores = [float(s) for s in scores]
    except (TypeError, ValueError):
        raise InvariantError("tokens must be a list of lists of ids and scores a list of numbers",
                             "one row of tokens and one score per sentence") from None
    if len(tokens) != len(wt) or len(scores) != len(ws):
        raise InvariantError(f"{len(tokens)} rows of tokens and {len(scores)} scores for {len(wt)} sentences",
                             "one row of tokens and one score per sentence of src")
    for i, (a, b) in enumerate(zip(tokens, wt)):
        if a != b:
            raise InvariantError(f"sentence {i}: your tokens {a}, the library's {b}",
                                 "the stopping rule (EOS, max_len), PAD and BOS never generated, and which "
                                 "hypothesis is kept")
    for i, (a, b) in enumerate(zip(scores, ws)):
        if not abs(a - b) <= 1e-9 * (1 + abs(b)):
            raise InvariantError(f"sentence {i}: your score {a!r}, the library's {b!r} (same tokens)",
                                 "the score is the summed log-probabilities, EOS included; beam search divides "
                                 "it by the length penalty")


@st.composite
def average_examples(draw):
    shapes = draw(st.lists(small_shapes, min_size=1, max_size=3))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    ckpts = [{f"p{i}": draw(normals(s, 10.0)).astype(dtype) for i, s in enumerate(shapes)}
             for _ in range(draw(st.integers(1, 5)))]
    return Example((("checkpoints", ckpts),))


def compare_arrays_by_name(got, want, ex) -> None:
    if not isinstance(got, dict) or sorted(got) != sorted(want):
        raise InvariantError(f"the result has keys {sorted(got) if isinstance(got, dict) else type(got).__name__}, "
                             f"expected {sorted(want)}", "return a dict keyed like each checkpoint")
    for k in want:
        g, w = B.to_host(got[k]), B.to_host(want[k])
        if g.shape != w.shape or g.dtype != w.dtype:
            raise InvariantError(f"{k!r} has shape {g.shape} dtype {g.dtype}, expected {w.shape} {w.dtype}",
                                 "the mean keeps each parameter's shape and dtype")
        tol = 1e-6 if w.dtype == np.float32 else 1e-12
        if not np.allclose(g, w, rtol=tol, atol=tol * (np.abs(w).max() + 1)):
            raise InvariantError(f"{k!r} differs from the parameter-wise mean",
                                 "sum in float64, divide by the number of checkpoints, then cast back")


WORDS = st.text(alphabet="abcde", min_size=1, max_size=6)


@st.composite
def bpe_examples(draw):
    counts = draw(st.dictionaries(WORDS, st.integers(1, 6), min_size=1, max_size=8))
    return Example((("token_counts", counts), ("num_merges", draw(st.integers(0, 12)))))


def compare_merges(got, want, ex) -> None:
    try:
        got = [tuple(p) for p in got]
    except TypeError:
        raise InvariantError(f"the result is a {type(got).__name__}, expected a list of (a, b) pairs",
                             "return the merges in the order learned") from None
    want = [tuple(p) for p in want]
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if got != want:
        raise InvariantError(
            f"merge {n}: yours {got[n] if n < len(got) else '(none)'}, the library's "
            f"{want[n] if n < len(want) else '(none)'} ({len(got)} merges, expected {len(want)})",
            "the most frequent pair, counted with each word's count; ties to the alphabetically first pair; "
            "stop at num_merges or when no pair occurs twice")

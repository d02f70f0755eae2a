"""Each layer's explicit examples: a few small inputs built by plain code (fixed NumPy seeds,
hand-chosen hard cases), one function per layer, that its registration
(:mod:`attn.testing.registry`) names as ``explicit``. The grader runs them first in every
profile, before hypothesis draws its own, so that every typical mistake of a layer is met by an
input that shows it whatever hypothesis's search does (``tests/test_explicit_examples.py``
grades each with these alone)."""
from __future__ import annotations

import math

from .. import backend as B
from ..masks import PAD_ID
from ..masks import decoder_mask as _decoder_mask
from .layers import XP, Example, Fresh
from .strategies import causal

np = B.host


def _normals(seed: int):
    """``n(shape, scale=1.0)``: Gaussian arrays from one fixed seed, drawn in call order."""
    rng = np.random.default_rng(seed)
    return lambda shape, scale=1.0: rng.standard_normal(shape) * scale


def _lengths_mask(lengths, T: int):
    return np.arange(T)[None, :] < np.array(lengths)[:, None]


def _padded(rows, T: int):
    """(len(rows), T) int64 ids: each row's tokens, then PAD_ID."""
    ids = np.full((len(rows), T), PAD_ID, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return ids


# -- linear, relu, dropout, embedding, positional, the sinusoids


def linear():
    n = _normals(101)
    return (Example((("x", n((2, 3, 4))), ("w", n((4, 3))), ("b", n((3,)))), ("x", "w", "b"), seed=1),)


def relu():
    x = np.array([[-1.5, 0.7, -0.2, 2.1], [0.4, -0.9, 1.3, -2.6], [0.05, -0.3, 0.8, -1.1]])
    return (Example((("x", x),), ("x",), seed=2),)


def dropout():
    n = _normals(103)
    x = n((4, 8)) + np.where(n((4, 8)) > 0, 0.5, -0.5)          # no entry near 0
    return (Example((("x", x), ("p", 0.1), ("rng", Fresh(7))), ("x",), compare=False, seed=3),
            Example((("x", x), ("p", 0.5), ("rng", None)), ("x",), seed=4),
            Example((("x", x), ("p", 0.5), ("rng", Fresh(11))), ("x",), compare=False, seed=5))


def embedding():
    n = _normals(104)
    ids = np.array([[1, 3, 1, 4], [0, 3, 2, 1]], dtype=np.int64)
    return (Example((("ids", ids), ("W", n((5, 3))), ("scale", 2.0)), ("W",), seed=6),)


def positional():
    n = _normals(105)
    return (Example((("x", n((3, 2, 4))), ("table", n((4, 4)))), ("x", "table"), seed=7),)


def sinusoidal_table():
    return (Example((("max_len", 6), ("d_model", 8), ("dtype", "float64"))),
            Example((("max_len", 4), ("d_model", 5), ("dtype", "float64"))))

# -- softmax, layer norm, feed-forward, residual, RMSNorm


def softmax():
    n = _normals(106)
    mask = np.array([[True, False, True, True, False], [False, True, True, False, True]])
    hard = n((2, 5), 1e4)
    hard_mask = np.array([[True, True, False, True, True], [False] * 5])            # a fully masked row
    return (Example((("x", n((2, 3, 5))), ("mask", None)), ("x",), seed=8),
            Example((("x", n((2, 2, 5))), ("mask", mask[None])), ("x",), seed=9),
            Example((("x", hard), ("mask", hard_mask)), ("x",), gradcheck=False, seed=10))


def layer_norm():
    n = _normals(107)
    hard = np.array([[3.0, 3.0, 3.0, 3.0, 3.0], [-100.0, 0.0, 100.0, 1e-3, 50.0]])   # a constant row
    args = lambda x, eps: (("x", x), ("gamma", n((5,))), ("beta", n((5,))), ("eps", eps))  # noqa: E731
    wrt = ("x", "gamma", "beta")
    return (Example(args(n((2, 3, 5)), 1e-5), wrt, seed=11),
            Example(args(n((3, 5), 0.1), 0.1), wrt, seed=12),
            Example(args(hard, 1e-2), wrt, gradcheck=False, seed=13))


def rmsnorm():
    n = _normals(108)
    hard = np.array([[0.0, 0.0, 0.0, 0.0], [-50.0, 2.0, 0.5, 100.0]])                # a row of zeros
    return (Example((("x", n((2, 3, 4))), ("gamma", n((4,))), ("eps", 1e-6)), ("x", "gamma"), seed=14),
            Example((("x", n((3, 4), 0.1)), ("gamma", n((4,))), ("eps", 0.1)), ("x", "gamma"), seed=15),
            Example((("x", hard), ("gamma", n((4,))), ("eps", 1e-2)), ("x", "gamma"), gradcheck=False, seed=16))


def _ffn(n, D: int, F: int):
    return (("w1", n((D, F))), ("b1", n((F,))), ("w2", n((F, D))), ("b2", n((D,))))


def feed_forward():
    n = _normals(109)
    x, params = n((2, 3, 4)), _ffn(n, 4, 5)
    wrt = ("x", "w1", "b1", "w2", "b2")
    return (Example((("x", x),) + params + (("dropout", 0.0), ("rng", None)), wrt, seed=17),
            Example((("x", x),) + params + (("dropout", 0.3), ("rng", Fresh(19))), wrt, compare=False, seed=18))


def residual_ffn():
    n = _normals(110)
    x, params = n((2, 3, 4)), _ffn(n, 4, 5)
    return (Example((("x", x),) + params + (("gamma", n((4,))), ("beta", n((4,))), ("eps", 1e-5)),
                    ("x", "w1", "b1", "w2", "b2", "gamma", "beta"), seed=19),)

# -- attention


def attention():
    n = _normals(111)
    mask = np.array([[True, True, False, True], [False, True, True, True], [True, False, False, False]])
    qkv = lambda lead, T, S: (("q", n(lead + (T, 2))), ("k", n(lead + (S, 2))), ("v", n(lead + (S, 3))))  # noqa
    hard_mask = mask.copy()
    hard_mask[2] = False                                                            # a fully masked row
    hard = (("q", n((2, 3, 2), 30.0)), ("k", n((2, 4, 2), 30.0)), ("v", n((2, 4, 3))))
    return (Example(qkv((2, 2), 3, 4) + (("mask", mask), ("dropout", 0.0), ("rng", None)), ("q", "k", "v"), seed=20),
            Example(qkv((2,), 3, 4) + (("mask", None), ("dropout", 0.2), ("rng", Fresh(23))), ("q", "k", "v"),
                    compare=False, seed=21),
            Example(hard + (("mask", hard_mask), ("dropout", 0.0), ("rng", None)), ("q", "k", "v"), gradcheck=False,
                    seed=22))


def split_heads():
    n = _normals(112)
    return (Example((("x", n((2, 3, 6))), ("H", 2))), Example((("x", n((1, 4, 6))), ("H", 3))))


def merge_heads():
    n = _normals(113)
    return (Example((("x", n((2, 3, 4, 2))),)),)


def _mha_params(n, D: int):
    return tuple((f"{w}_{c}", n((D, D), 1 / math.sqrt(D)) if w == "w" else n((D,), 0.1)) for c in "qkvo"
                 for w in "wb")


def multi_head_attention():
    n = _normals(114)
    wrt = ("x_q", "x_kv", "w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
    params = _mha_params(n, 4)
    x, x_kv = n((2, 3, 4)), n((2, 4, 4))
    src, src3 = _padded([[3, 1, 2], [2, 4, 1, 1]], 4), _padded([[2, 1, 3], [1, 2]], 3)
    pad = (src != PAD_ID)[:, None, None, :]

    def ex(x_kv, mask, p, rng, t, ids, seed):
        return Example((("x_q", x), ("x_kv", x_kv)) + params + (("n_heads", 2), ("mask", mask), ("dropout", p),
                                                                ("rng", rng), ("_t", t), ("_src", ids)),
                       wrt, compare=not p, seed=seed)
    return (ex(x_kv, pad, 0.0, None, 1, src, 23), ex(x, causal(3), 0.0, None, 0, src3, 24),
            ex(x_kv, None, 0.2, Fresh(29), 2, src, 25))


def grouped_query_attention():
    n = _normals(115)
    D, kv, Dh = 8, 2, 2
    widths = {"q": D, "k": kv * Dh, "v": kv * Dh, "o": D}
    params = tuple((f"{w}_{c}", n((D, widths[c]), D ** -0.5) if w == "w" else n((widths[c],), 0.5))
                   for c in "qkvo" for w in "wb")
    wrt = ("x_q", "x_kv", "w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
    x = n((2, 3, D))
    pad = _lengths_mask([4, 2], 4)[:, None, None, :]
    return (Example((("x_q", x), ("x_kv", x.copy())) + params + (("n_heads", 4), ("kv_heads", kv),
                                                                  ("mask", causal(3))), wrt, seed=26),
            Example((("x_q", x), ("x_kv", n((2, 4, D)))) + params + (("n_heads", 4), ("kv_heads", kv), ("mask", pad)),
                    wrt, seed=27))


def flash_attention():
    n = _normals(116)
    pad = _lengths_mask([6, 3], 6).reshape(2, 1, 1, 6)
    return (Example((("q", n((2, 2, 5, 3))), ("k", n((2, 2, 6, 3))), ("v", n((2, 2, 6, 2))), ("mask", pad),
                     ("q_tile", 2), ("k_tile", 4), ("causal", False)), ("q", "k", "v"), seed=28),
            Example((("q", n((2, 5, 3))), ("k", n((2, 5, 3))), ("v", n((2, 5, 2))), ("mask", None),
                     ("q_tile", 2), ("k_tile", 3), ("causal", True)), ("q", "k", "v"), seed=29),
            Example((("q", n((2, 5, 3), 30.0)), ("k", n((2, 6, 3), 10.0)), ("v", n((2, 6, 2))), ("mask", None),
                     ("q_tile", 3), ("k_tile", 2), ("causal", False)), ("q", "k", "v"), gradcheck=False, seed=30),
            # keys padded on the left: the second row's first key tile has no key to see, its later ones do
            Example((("q", n((2, 4, 3))), ("k", n((2, 6, 3))), ("v", n((2, 6, 2))),
                     ("mask", _lengths_mask([6, 3], 6)[:, ::-1].reshape(2, 1, 6).copy()), ("q_tile", 2),
                     ("k_tile", 3), ("causal", False)), ("q", "k", "v"), seed=43))

# -- recurrent cells, Luong attention


def rnn_step():
    n = _normals(117)
    return (Example((("x", n((2, 3))), ("h_prev", n((2, 4), 0.5)), ("w_x", n((3, 4), 1 / math.sqrt(3))),
                     ("w_h", n((4, 4), 0.5)), ("b", n((4,), 0.1))), ("x", "h_prev", "w_x", "w_h", "b"), seed=31),
            # pre-activations in the thousands: tanh by exp(2a) overflows in float64 too
            Example((("x", n((2, 3), 1000.0)), ("h_prev", n((2, 4), 0.5)), ("w_x", n((3, 4), 1 / math.sqrt(3))),
                     ("w_h", n((4, 4), 0.5)), ("b", n((4,), 0.1))), ("x", "h_prev", "w_x", "w_h", "b"),
                    gradcheck=False, seed=44))


def rnn():
    n = _normals(118)
    return (Example((("x", n((3, 4, 2))), ("h0", n((3, 3), 0.5)), ("w_x", n((2, 3), 1 / math.sqrt(2))),
                     ("w_h", n((3, 3), 0.5)), ("b", n((3,), 0.1)), ("mask", _lengths_mask([4, 2, 3], 4))),
                    ("x", "h0", "w_x", "w_h", "b"), seed=32),)


def luong_attention():
    n = _normals(119)
    return (Example((("s", n((2, 3, 4))), ("e", n((2, 5, 4))), ("w_c", n((8, 4), 1 / math.sqrt(8))),
                     ("b_c", n((4,), 0.1)), ("src_mask", _lengths_mask([5, 3], 5))), ("s", "e", "w_c", "b_c"),
                    seed=33),)

# -- loss and masks


def cross_entropy():
    n = _normals(120)
    targets = np.array([[2, 4, 1, PAD_ID], [3, 3, PAD_ID, PAD_ID]], dtype=np.int64)
    return (Example((("logits", n((2, 4, 5), 2.0)), ("targets", targets), ("smoothing", 0.1), ("pad_id", PAD_ID)),
                    ("logits",), seed=34),
            Example((("logits", n((2, 4, 5), 2.0)), ("targets", targets), ("smoothing", 0.0), ("pad_id", None)),
                    ("logits",), seed=35))


def causal_mask():
    return (Example((("T", 4), ("xp", XP))), Example((("T", 1), ("xp", XP))))


def padding_mask():
    return (Example((("ids", _padded([[3, 1, 2], [2, 4, 1, 1], [1]], 4)), ("pad_id", PAD_ID))),)


def decoder_mask():
    return (Example((("tgt_ids", _padded([[3, 1, 2], [2, 4, 1, 1], [1]], 4)), ("pad_id", PAD_ID))),)

# -- the blocks and the whole model


def _block(n, D: int, F: int, names) -> dict:
    out = {}
    for name in names:
        if name.endswith("attn"):
            out.update({f"{name}.{w}_{c}": n((D, D), 1 / math.sqrt(D)) if w == "w" else n((D,), 0.1)
                        for c in "qkvo" for w in "wb"})
        elif name == "ffn":
            out.update({"ffn.w1": n((D, F), 1 / math.sqrt(D)), "ffn.b1": n((F,), 0.1),
                        "ffn.w2": n((F, D), 1 / math.sqrt(F)), "ffn.b2": n((D,), 0.1)})
        else:
            out.update({f"{name}.gamma": 1.0 + n((D,), 0.1), f"{name}.beta": n((D,), 0.1)})
    return out


ENCODER = ("self_attn", "norm1", "ffn", "norm2")
DECODER = ("self_attn", "norm1", "cross_attn", "norm2", "ffn", "norm3")


def encoder_layer():
    n = _normals(121)
    params = _block(n, 4, 3, ENCODER)
    return (Example((("x", n((2, 3, 4))), ("mask", _lengths_mask([3, 2], 3)[:, None, None, :]), ("params", params),
                     ("n_heads", 2), ("eps", 1e-3)), ("x", "params"), seed=36),)


def decoder_layer():
    n = _normals(122)
    params = _block(n, 4, 3, DECODER)
    tgt = _padded([[3, 1, 2], [2, 4]], 3)
    # memory as long as x: a mistake that takes one for the other shows (and does not raise)
    return (Example((("x", n((2, 3, 4))), ("memory", n((2, 3, 4))),
                     ("src_mask", _lengths_mask([3, 2], 3)[:, None, None, :]), ("tgt_mask", _decoder_mask(tgt)),
                     ("params", params), ("n_heads", 2), ("eps", 1e-3)), ("x", "memory", "params"), seed=37),)


def transformer():
    n = _normals(123)
    params = {"embedding.weight": n((6, 4))}
    params.update({f"encoder.0.{k}": v for k, v in _block(n, 4, 3, ENCODER).items()})
    params.update({f"decoder.0.{k}": v for k, v in _block(n, 4, 3, DECODER).items()})
    return (Example((("src", _padded([[3, 1, 5], [2, 4]], 3)), ("tgt_in", _padded([[1, 2, 5], [4, 3]], 3)),
                     ("params", params), ("n_heads", 2), ("eps", 1e-3)), ("params",), seed=38),)

# -- the training recipe, decoding, checkpoints, BPE


def noam_lr():
    return (Example((("step", 10), ("d_model", 64), ("warmup_steps", 400), ("factor", 2.0))),
            Example((("step", 5000), ("d_model", 512), ("warmup_steps", 4000), ("factor", 1.0))))


def adam():
    n = _normals(124)
    params = {"p0": n((2, 3)), "p1": n((3,))}
    grads = [{k: n(v.shape, s) for k, v in params.items()} for s in (1.0, 1e-3, 100.0)]
    return (Example((("params", params), ("grads", grads), ("lrs", [0.1, 1e-3, 0.5]), ("beta1", 0.9),
                     ("beta2", 0.98), ("eps", 1e-3))),)


def decoding(beam: bool):
    from .exercises import Built
    out = []
    for model in (0, 1, 2, 3):
        args = [("model", Built("decoding_model", (model,))), ("src", _padded([[3, 1, 5, 2], [2, 4], [5]], 4))]
        if beam:
            args += [("beam_size", 3), ("alpha", 0.6)]
        out.append(Example(tuple(args) + (("max_len", 6),)))
    return tuple(out)


def average_checkpoints():
    n = _normals(125)
    ckpts = [{"p0": n((2, 2), 10.0).astype("float32"), "p1": n((3,), 10.0).astype("float32")} for _ in range(3)]
    return (Example((("checkpoints", ckpts),)),)


def bpe():
    """Each typical mistake's own corpus: counts that outweigh the pairs' number of words, a tie
    met first in the wrong order, and merges left once no pair occurs twice."""
    return (Example((("token_counts", {"abab": 1, "cd": 3}), ("num_merges", 2))),
            Example((("token_counts", {"ba": 2, "ab": 2}), ("num_merges", 1))),
            Example((("token_counts", {"abcde": 1, "aa": 2}), ("num_merges", 4))))

# -- the later block: rotary positions, SwiGLU


def rope():
    n = _normals(126)
    return (Example((("x", n((2, 3, 6))), ("positions", None), ("base", 10000.0), ("_shift", 7)), ("x",), seed=39),
            Example((("x", n((4, 4))), ("positions", np.arange(5, 9)), ("base", 10.0), ("_shift", -3)), ("x",),
                    seed=40))


def swiglu():
    n = _normals(127)
    big = n((2, 4), 1000.0)              # gate pre-activations in the thousands: exp(a) overflows in float64 too
    return (Example((("x", n((2, 3, 4))), ("w", n((4, 3))), ("v", n((4, 3))), ("w2", n((3, 4)))),
                    ("x", "w", "v", "w2"), seed=41),
            Example((("x", big), ("w", n((4, 3))), ("v", n((4, 3))), ("w2", n((3, 4)))), ("x", "w", "v", "w2"),
                    gradcheck=False, seed=42))


def lora():
    n = _normals(141)
    args = lambda lead, Din, Dout, r, alpha: (("x", n(lead + (Din,))), ("w", n((Din, Dout))),  # noqa: E731
                                             ("a", n((Din, r))), ("b", n((r, Dout))), ("alpha", alpha))
    return (Example(args((2, 3), 4, 5, 2, 16.0), ("x", "a", "b"), seed=61),
            Example(args((3,), 6, 3, 3, 2.0), ("x", "a", "b"), seed=62))


def lora_merge():
    n = _normals(142)
    return (Example((("w", n((4, 5))), ("a", n((4, 2))), ("b", n((2, 5))), ("alpha", 16.0)), seed=63),)


def decoder_only_layer():
    n = _normals(151)
    params = _block(n, 4, 3, ENCODER)              # a decoder-only layer's parts are named as the encoder's
    return (Example((("x", n((2, 4, 4))), ("params", params), ("n_heads", 2), ("eps", 1e-3)), ("x", "params"),
                    seed=39),)

"""Typical mistakes, written as a learner would, for every layer an exercise asks for: layer ->
[(the mistake, the learner's file, what hint 1 must say (the check's line or "looks like"),
what hint 2 ("look at") must say)]. Most are the answer in ``tests/answers/`` or a template
with one line changed. ``tests/test_hints.py`` grades each and requires at least three per
exercised layer."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NORM = '''
def {name}(dout, cache):
    xhat, rstd, gamma = cache
    D = xhat.shape[-1]
    g = dout * gamma
    dx = {dx}
    return dx, (dout * xhat).reshape(-1, D).sum(axis=0), dout.reshape(-1, D).sum(axis=0)
'''
LN = "from attn.layers import layer_norm_forward\n\n" + NORM.replace("{name}", "layer_norm_backward")
SOFTMAX = '''
from attn.layers import softmax_forward


def softmax_backward(dy, cache):
    y = cache.y
    return {dx}
'''
ATTENTION = '''
from attn.layers import attention_forward, dropout_backward, softmax_backward
from attn.layers.softmax import SoftmaxCache


def attention_backward(dout, cache):
    q, k, v, w, cd, scale = cache
    wd = w if cd.mask is None else w * cd.mask
    dv = wd.swapaxes(-1, -2) @ dout
    dw = dropout_backward(dout @ v.swapaxes(-1, -2), cd)
    ds = {ds}
    return ds @ k, ds.swapaxes(-1, -2) @ q, dv
'''
RESIDUAL = "from attn.layers import feed_forward_backward, residual_ffn_forward\n\n" + NORM.replace(
    "{name}", "_norm_backward") + '''

def residual_ffn_backward(dout, cache):
    dz, dgamma, dbeta = _norm_backward(dout, cache.norm)
    dx_ffn, dw1, db1, dw2, db2 = feed_forward_backward(dz, cache.ffn)
    return {ret}, dw1, db1, dw2, db2, dgamma, dbeta
'''
LINEAR = '''
from attn.layers import linear_forward


def linear_backward(dout, cache):
    x, w = cache
    x2, d2 = x.reshape(-1, w.shape[0]), dout.reshape(-1, w.shape[1])
    return (d2 @ w.T).reshape(x.shape), {dw}, {db}
'''
RIGHT_LN = "rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))"
NO_MEAN = "rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))"
NO_VAR = "rstd * (g - g.mean(axis=-1, keepdims=True))"

MISTAKES = {
    "linear": [
        ("dw transposed", LINEAR.format(dw="d2.T @ x2", db="d2.sum(axis=0)"), r"transposed product",
         r"which two arrays are multiplied, in which order"),
        ("db a mean", LINEAR.format(dw="x2.T @ d2", db="d2.mean(axis=0)"),
         r"a mean over the rows instead of their sum", r"which axes the bias gradient is summed over"),
        ("dw a mean", LINEAR.format(dw="x2.T @ d2 / len(d2)", db="d2.sum(axis=0)"),
         r"a mean over the rows instead of their sum", r"every position contributes to dw"),
    ],
    "layer_norm": [
        ("no mean term", LN.format(dx=NO_MEAN), r"the mean term .* is missing", r"mean of the row"),
        ("no variance term", LN.format(dx=NO_VAR), r"the variance term .* is missing$", r"rstd = 1/sqrt"),
        ("neither term", LN.format(dx="rstd * g"), r"the mean term .* is missing and the variance term .* is "
                                                   r"missing", r"mean of the row.*rstd = 1/sqrt"),
        ("variance term's sign", LN.format(dx="rstd * (g - g.mean(axis=-1, keepdims=True) + xhat * (g * xhat)"
                                              ".mean(axis=-1, keepdims=True))"),
         r"the variance term .* has the wrong sign", r"rstd = 1/sqrt"),
    ],
    "softmax": [
        ("no normaliser term", SOFTMAX.format(dx="y * dy"), r"the normaliser's term .* is missing", r"normaliser"),
        ("normaliser's sign", SOFTMAX.format(dx="y * (dy + (dy * y).sum(axis=-1, keepdims=True))"),
         r"the normaliser's term .* has the wrong sign", r"normaliser"),
        ("whole sign", SOFTMAX.format(dx="-y * (dy - (dy * y).sum(axis=-1, keepdims=True))"),
         r"the opposite sign", r"every logit of its row"),
    ],
    "attention": [
        ("no scale", ATTENTION.format(ds="softmax_backward(dw, SoftmaxCache(w))"),
         r"the factor 1/sqrt\(d_k\) of the scores is missing", r"scale of the scores"),
        ("scale twice", ATTENTION.format(ds="softmax_backward(dw, SoftmaxCache(w)) * scale * scale"),
         r"the factor 1/sqrt\(d_k\) of the scores is applied twice", r"scale of the scores"),
        ("softmax without its normaliser", ATTENTION.format(ds="w * dw * scale"),
         r"the softmax's normaliser's term .* is missing", r"the softmax inside"),
    ],
    "residual_ffn": [
        ("no skip path", RESIDUAL.format(dx=RIGHT_LN, ret="dx_ffn"), r"the skip path's dz is missing$",
         r"two paths"),
        ("the norm without its variance term", RESIDUAL.format(dx=NO_VAR, ret="dz + dx_ffn"),
         r"the layer norm's variance term .* is missing$", r"^the layer norm's rstd"),
        ("the norm without its mean term", RESIDUAL.format(dx=NO_MEAN, ret="dz + dx_ffn"),
         r"the layer norm's mean term .* is missing$", r"^the layer norm's mean of the row"),
    ],
}

MISTAKES["relu"] = [
    ("no mask", "from attn.layers import relu_forward\n\ndef relu_backward(dout, cache):\n    return dout\n",
     r"dout itself: the ReLU's mask .* is missing", r"the forward's input x"),
    ("the mask from dout", "from attn.layers import relu_forward\n\ndef relu_backward(dout, cache):\n"
                           "    return dout * (dout > 0)\n", r"the mask comes from dout", r"whatever the sign of dout"),
    ("the mask inverted", '''
def relu_forward(x):
    return x * (x > 0), x


def relu_backward(dout, x):
    return dout * (x <= 0)
''', r"the mask is inverted", r"which side of 0"),
]
EMBEDDING = '''
import numpy as np


def embedding_forward(ids, W, scale=1.0):
    return {out}, (ids, W, scale)


def embedding_backward(dout, cache):
    ids, W, scale = cache
    dW = np.zeros_like(W)
    {dW}
    return dW
'''
MISTAKES["embedding"] = [
    ("repeated ids overwrite", EMBEDDING.format(out="W[ids] * scale", dW="dW[ids] += dout * scale"),
     r"a repeated id keeps one position's gradient", r"an id occurs twice.*np.add.at"),
    ("the scale forgotten in dW", EMBEDDING.format(out="W[ids] * scale", dW="np.add.at(dW, ids, dout)"),
     r"without the factor scale", r"dW gets the scale too"),
    ("no scale in the forward", EMBEDDING.format(out="W[ids]", dW="np.add.at(dW, ids, dout * scale)"),
     r"out is not W\[ids\] \* scale", r"then multiply by scale"),
]
POSITIONAL = '''
def positional_forward(x, table):
    T = x.shape[1]
    return x + {rows}, (table.shape, T)


def positional_backward(dout, cache):
    import numpy as np
    shape, T = cache
    dtable = np.zeros(shape)
    dtable[:T] = {dtable}
    return {dx}, dtable
'''
MISTAKES["positional"] = [
    ("dtable not summed over the batch", POSITIONAL.format(rows="table[:T]", dtable="dout[0]", dx="dout"),
     r"the first sentence's", r"the sum over the batch"),
    ("dtable a mean over the batch", POSITIONAL.format(rows="table[:T]", dtable="dout.mean(axis=0)", dx="dout"),
     r"a mean over the batch", r"none is divided"),
    ("dx zero", POSITIONAL.format(rows="table[:T]", dtable="dout.sum(axis=0)", dx="0 * dout"),
     r"all zeros", r"what the addition passes back to x"),
    ("the last rows of the table", POSITIONAL.format(rows="table[-T:]", dtable="dout.sum(axis=0)", dx="dout"),
     r"out - x is not table\[:T\]", r"x \+ table\[:T\]"),
]
SINUSOIDAL = '''
import numpy as np


def sinusoidal_table(max_len, d_model, dtype="float32"):
    pos = np.arange(max_len)[:, None]
    two_i = np.arange(0, d_model, 2)[None, :]
    angle = pos / 10000.0 ** ({exponent})
    pe = np.zeros((max_len, d_model))
    pe[:, 0::2] = {even}(angle)
    pe[:, 1::2] = {odd}(angle[:, :d_model // 2])
    return pe.astype(dtype)
'''
MISTAKES["sinusoidal_table"] = [
    ("sine and cosine swapped", SINUSOIDAL.format(exponent="two_i / d_model", even="np.cos", odd="np.sin"),
     r"sin 0 = 0 in even columns", r"sin and cos swapped"),
    ("halves, not interleaved", SINUSOIDAL.replace("pe[:, 0::2]", "pe[:, :(d_model + 1) // 2]").replace(
        "pe[:, 1::2]", "pe[:, (d_model + 1) // 2:]").format(exponent="two_i / d_model", even="np.sin", odd="np.cos"),
     r"sines in the first half", r"the columns interleave"),
    ("each column its own exponent", '''
import numpy as np


def sinusoidal_table(max_len, d_model, dtype="float32"):
    pe = np.zeros((max_len, d_model))
    for pos in range(max_len):
        for j in range(d_model):
            angle = pos / 10000 ** (j / d_model)
            pe[pos, j] = np.sin(angle) if j % 2 == 0 else np.cos(angle)
    return pe.astype(dtype)
''', r"its own index j", r"columns 2i and 2i\+1 share one angle"),
]
DROPOUT = '''
def dropout_forward(x, p, rng=None):
    if {off}:
        return x, None
    mask = {mask}
    return x * mask, mask


def dropout_backward(dout, mask):
    return {dx}
'''
KEEP = "(rng.random(x.shape) >= p) / (1 - p)"
MISTAKES["dropout"] = [
    ("kept units not rescaled", DROPOUT.format(off="p == 0 or rng is None", mask="(rng.random(x.shape) >= p) * 1.0",
                                              dx="dout if mask is None else dout * mask"),
     r"kept units are scaled by 1, expected 1/\(1-p\)", r"scales the kept units by 1/\(1-p\)"),
    ("dropping at inference", '''
import numpy as np


def dropout_forward(x, p, rng=None):
    if p == 0:
        return x, None
    mask = (np.random.default_rng(0).random(x.shape) >= p) / (1 - p)
    return x * mask, mask


def dropout_backward(dout, mask):
    return dout if mask is None else dout * mask
''', r"rng = None must return x unchanged", r"rng None \(evaluation\) dropout is the identity"),
    ("a new mask in the backward", '''
import numpy as np


def dropout_forward(x, p, rng=None):
    if p == 0 or rng is None:
        return x, None
    return x * (rng.random(x.shape) >= p) / (1 - p), (p, x.shape)


def dropout_backward(dout, cache):
    if cache is None:
        return dout
    p, shape = cache
    return dout * (np.random.random(shape) >= p) / (1 - p)
''', r"dx is not dout times the forward's mask", r"must not draw a new one"),
    ("p taken as the probability of keeping", DROPOUT.format(off="p == 0 or rng is None",
                                                             mask="(rng.random(x.shape) < p) / (1 - p)",
                                                             dx="dout if mask is None else dout * mask"),
     r"kept", r"the probability of dropping"),
]
FFN = '''
import numpy as np


def feed_forward_forward(x, w1, b1, w2, b2, dropout=0.0, rng=None):
    h = x @ w1 + b1
    a = np.maximum(h, 0)
    return {out}, (x, w1, w2, h, a)


def feed_forward_backward(dout, cache):
    x, w1, w2, h, a = cache
    D, F = w1.shape
    x2, a2, h2, d2 = x.reshape(-1, D), a.reshape(-1, F), h.reshape(-1, F), dout.reshape(-1, D)
    dw2, db2 = {dw2}, d2.sum(axis=0)
    dh = {dh}
    dw1, db1 = x2.T @ dh, dh.sum(axis=0)
    return (dh @ w1.T).reshape(x.shape), dw1, db1, dw2, db2
'''
RIGHT_FFN = dict(out="a @ w2 + b2", dw2="a2.T @ d2", dh="(d2 @ w2.T) * (h2 > 0)")
MISTAKES["feed_forward"] = [
    ("no ReLU", FFN.format(**dict(RIGHT_FFN, out="h @ w2 + b2")), r"the ReLU is missing", r"the ReLU between"),
    ("the ReLU after the second map", FFN.format(**dict(RIGHT_FFN, out="np.maximum(h @ w2 + b2, 0)")),
     r"the ReLU after the second linear map", r"before the second linear map"),
    ("no mask in the backward", FFN.format(**dict(RIGHT_FFN, dh="d2 @ w2.T")), r"the ReLU's mask is missing",
     r"passes the ReLU's mask"),
    ("dw2 from the ReLU's input", FFN.format(**dict(RIGHT_FFN, dw2="h2.T @ d2")), r"before the ReLU",
     r"the ReLU's output, not its input"),
]
SPLIT = '''
def split_heads(x, H):
    B, T, D = x.shape
    return {body}
'''
MERGE = '''
def merge_heads(x):
    B, H, T, Dh = x.shape
    return {body}
'''
MISTAKES["split_heads"] = [
    ("heads interleaved", SPLIT.format(body="x.reshape(B, T, D // H, H).transpose(0, 3, 1, 2)"),
     r"the heads interleaved", r"head h takes the columns"),
    ("no transpose", SPLIT.format(body="x.reshape(B, H, T, D // H)"), r"the positions mixed into the heads",
     r"reshape to \(B, T, H, Dh\) first"),
    ("transpose forgotten", SPLIT.format(body="x.reshape(B, T, H, D // H)"),
     r"shape \(.*\), expected|without the transpose", r"transpose"),
]
MISTAKES["merge_heads"] = [
    ("no transpose", MERGE.format(body="x.reshape(B, T, H * Dh)"), r"with no transpose",
     r"before the reshape"),
    ("heads interleaved", MERGE.format(body="x.transpose(0, 2, 3, 1).reshape(B, T, H * Dh)"),
     r"the heads interleaved", r"heads before features"),
    ("features before positions", MERGE.format(body="x.reshape(B, H * Dh, T).swapaxes(1, 2)"),
     r"features and positions mixed", r"only after the transpose"),
]
HEADS = '''
from attn import backend as B
from attn import layers as L


def {name}_forward(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o, n_heads, {kv}mask=None):
    xp = B.get_array_module(x_q)
    g = n_heads // kv_heads
    q, cq = L.linear_forward(x_q, {w_q}, {b_q})
    k, ck = L.linear_forward(x_kv, w_k, b_k)
    v, cv = L.linear_forward(x_kv, w_v, b_v)
    k = {repeat}(L.split_heads(k, kv_heads), g, axis=1)
    v = {repeat}(L.split_heads(v, kv_heads), g, axis=1)
    o, ca = L.attention_forward(L.split_heads(q, n_heads), k, v, mask)
    out, co = {project}
    return out, (cq, ck, cv, ca, co, n_heads, g)


def {name}_backward(dout, cache):
    cq, ck, cv, ca, co, H, g = cache
    dm, dw_o, db_o = L.linear_backward(dout, co)
    dq, dk, dv = L.attention_backward(L.split_heads(dm, H), ca)
    Bsz, _, Tk, Dh = dk.shape
    dk = dk.reshape(Bsz, H // g, g, Tk, Dh).{fold}
    dv = dv.reshape(Bsz, H // g, g, Tk, Dh).{fold}
    dx_q, dw_q, db_q = L.linear_backward(L.merge_heads(dq), cq)
    dx_k, dw_k, db_k = L.linear_backward(L.merge_heads(dk), ck)
    dx_v, dw_v, db_v = L.linear_backward(L.merge_heads(dv), cv)
    return dx_q, {dx_kv}, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o
'''
RIGHT_HEADS = dict(w_q="w_q", b_q="b_q", repeat="xp.repeat", project="L.linear_forward(L.merge_heads(o), w_o, b_o)",
                   fold="sum(axis=2)", dx_kv="dx_k + dx_v")
def mha(**changes) -> str:
    """The grouped template as plain multi-head attention (one key/value head per query head,
    no dropout yet, as lesson 06's starter), with ``changes`` made."""
    return (HEADS.format(**dict(RIGHT_HEADS, name="multi_head_attention", kv="", **changes))
            .replace("g = n_heads // kv_heads", "kv_heads, g = n_heads, 1"))


SCALED = "w_q * (x_q.shape[-1] // n_heads / x_q.shape[-1]) ** 0.5"
MISTAKES["multi_head_attention"] = [
    ("scaled by sqrt(d_model)", mha(w_q=SCALED, b_q=SCALED.replace("w_q *", "b_q *")),
     r"divided by sqrt\(d_model\)", r"scaled by its own width"),
    ("no output projection", mha(project="L.merge_heads(o), o.shape").replace(
        "dm, dw_o, db_o = L.linear_backward(dout, co)",
        "dm, dw_o, db_o = dout, xp.zeros((dout.shape[-1],) * 2), xp.zeros(dout.shape[-1])").replace(
        "cq, ck, cv, ca, co, H, g = cache", "cq, ck, cv, ca, co, H, g = cache\n    xp = B.get_array_module(dout)"),
     r"without the output projection", r"then the output projection"),
    ("dx_kv without the values", mha(dx_kv="dx_k"), r"the values' gradient is missing", r"dx_kv = dx_k \+ dx_v"),
    ("dx_kv without the keys", mha(dx_kv="dx_v"), r"the keys' gradient is missing", r"dx_kv = dx_k \+ dx_v"),
]
GQA = dict(RIGHT_HEADS, name="grouped_query_attention", kv="kv_heads, ")
MISTAKES["grouped_query_attention"] = [
    ("heads tiled", HEADS.format(**dict(GQA, repeat="(lambda a, g, axis: xp.concatenate([a] * g, axis=axis))")),
     r"repeated", r"do not tile the heads"),
    ("a mean over the group", HEADS.format(**dict(GQA, fold="mean(axis=2)")), r"a mean over its group",
     r"the sum of their gradients, not their mean"),
    ("the group's first head alone", HEADS.format(**dict(GQA, fold="__getitem__((slice(None), slice(None), 0))")),
     r"the first query head of its group alone", r"sum over the group"),
]
STEP = '''
import numpy as np


def rnn_step_forward(x, h_prev, w_x, w_h, b):
    a = x @ w_x + h_prev @ w_h + b
    h = np.tanh(a)
    return h, (x, h_prev, w_x, w_h, a, h)


def rnn_step_backward(dh, cache):
    x, h_prev, w_x, w_h, a, h = cache
    da = {da}
    return da @ w_x.T, da @ w_h.T, {dw_x}, h_prev.T @ da, da.sum(axis=0)
'''
MISTAKES["rnn_step"] = [
    ("tanh by exp(2a)", STEP.format(da="dh * (1 - h ** 2)", dw_x="x.T @ da").replace(
        "h = np.tanh(a)", "h = (np.exp(2 * a) - 1) / (np.exp(2 * a) + 1)"),
     r"tanh written \(exp\(2a\) - 1\) / \(exp\(2a\) \+ 1\)", r"without exp of a large number"),
    ("no tanh derivative", STEP.format(da="dh", dw_x="x.T @ da"), r"without tanh's derivative",
     r"passes tanh on its way back"),
    ("tanh' without the square", STEP.format(da="dh * (1 - h)", dw_x="x.T @ da"), r"without the square",
     r"the square of the output"),
    ("tanh' of the pre-activation", STEP.format(da="dh * (1 - a ** 2)", dw_x="x.T @ da"), r"a the pre-activation",
     r"with the output h = tanh\(a\), not with a"),
    ("dw_x transposed", STEP.format(da="dh * (1 - h ** 2)", dw_x="da.T @ x"), r"transposed product",
     r"the order of the product"),
]
RNN = '''
import numpy as np


def rnn_forward(x, h0, w_x, w_h, b, mask=None):
    B, T, _ = x.shape
    h = np.zeros((B, w_h.shape[0])) if h0 is None else h0
    hs = []
    for t in range(T):
        h_new = np.tanh(x[:, t] @ w_x + h @ w_h + b)
        h = {step}
        hs.append(h)
    return np.stack(hs, axis=1), (x, h0 if h0 is not None else 0 * h, w_x, w_h, np.stack(hs, axis=1), mask)


def rnn_backward(dhs, cache):
    x, h0, w_x, w_h, hs, mask = cache
    B, T, H = hs.shape
    live = np.ones((B, T), bool) if mask is None else mask
    dx, dw_x, dw_h, db = np.zeros_like(x), np.zeros_like(w_x), np.zeros_like(w_h), np.zeros(H)
    g = np.zeros_like(h0)
    for t in reversed(range(T)):
        g = {g}
        da = np.where(live[:, t, None], g * (1 - hs[:, t] ** 2), 0.0)
        h_prev = h0 if t == 0 else hs[:, t - 1]
        dx[:, t] = da @ w_x.T
        dw_x += x[:, t].T @ da
        dw_h += {dw_h}.T @ da
        db += da.sum(axis=0)
        g = np.where(live[:, t, None], da @ w_h.T, g)
    return dx, g, dw_x, dw_h, db
'''
RIGHT_RNN = dict(step="h_new if mask is None else np.where(mask[:, t, None], h_new, h)", g="g + dhs[:, t]",
                 dw_h="h_prev")
MISTAKES["rnn"] = [
    ("the mask ignored", RNN.format(**dict(RIGHT_RNN, step="h_new")), r"the mask is ignored|masked",
     r"the step is skipped and the state carried"),
    ("nothing carried back", RNN.format(**dict(RIGHT_RNN, g="dhs[:, t]")), r"nothing is carried back",
     r"what step t\+1 sent back"),
    ("dw_h from h_t", RNN.format(**dict(RIGHT_RNN, dw_h="hs[:, t]")), r"each step's own state",
     r"h_\{t-1\}\.T @ da_t"),
]
CAUSAL = '''
import numpy as np


def causal_mask(T, xp=np):
    return {body}
'''
MISTAKES["causal_mask"] = [
    ("the diagonal excluded", CAUSAL.format(body="xp.tril(xp.ones((T, T), dtype=bool), -1)[None, None]"),
     r"the diagonal excluded", r"a position may see itself"),
    ("one position ahead", CAUSAL.format(body="xp.tril(xp.ones((T, T), dtype=bool), 1)[None, None]"),
     r"sees the next one", r"not k=1"),
    ("the upper triangle", CAUSAL.format(body="xp.triu(xp.ones((T, T), dtype=bool))[None, None]"),
     r"sees the future", r"the lower triangle \(tril\) is the past"),
    ("no broadcasting axes", CAUSAL.format(body="xp.tril(xp.ones((T, T), dtype=bool))"),
     r"without the batch and head axes", r"\[None, None\] makes it \(1, 1, T, T\)"),
]
PADDING = '''
def padding_mask(ids, pad_id=0):
    return {body}
'''
MISTAKES["padding_mask"] = [
    ("inverted", PADDING.format(body="(ids == pad_id)[:, None, None, :]"), r"the mask inverted", r"ids != pad_id"),
    ("on the queries' axis", PADDING.format(body="(ids != pad_id)[:, None, :, None]"),
     r"the padding on the queries' axis", r"the keys are the last axis"),
    ("no broadcasting axes", PADDING.format(body="ids != pad_id"), r"has shape \(\d+, \d+\), expected \(\d+, 1, 1, \d+\)",
     r"broadcasts over heads and queries"),
]
DECODER = '''
import numpy as np


def decoder_mask(tgt_ids, pad_id=0):
    T = tgt_ids.shape[1]
    future = np.tril(np.ones((T, T), dtype=bool))[None, None]
    return {body}
'''
MISTAKES["decoder_mask"] = [
    ("the padding forgotten", DECODER.format(body="future & np.ones((len(tgt_ids), 1, T, T), dtype=bool)"),
     r"the look-ahead mask alone", r"the padding mask of tgt_ids too"),
    ("the future forgotten", DECODER.format(body="(tgt_ids != pad_id)[:, None, None, :] & (future | True)"),
     r"the padding mask alone", r"the look-ahead \(causal\) mask too"),
    ("or, not and", DECODER.format(body="future | (tgt_ids != pad_id)[:, None, None, :]"),
     r"either mask allows it", r"not \| \(or\)"),
    ("padding on the queries", DECODER.format(body="future & (tgt_ids != pad_id)[:, None, :, None]"),
     r"the padding applied to the queries' axis", r"the padding mask on the last axis"),
]
CE = '''
import numpy as np


def cross_entropy(logits, targets, smoothing=0.0, pad_id=0):
    V = logits.shape[-1]
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    real = np.ones(targets.shape) if pad_id is None else (targets != pad_id) * 1.0
    q = np.eye(V)[targets]
    q = {q}
    n = {n}
    loss = -((q * logp).sum(axis=-1) * real).sum() / max(n, 1)
    return np.array(loss), (np.exp(logp) - q) * real[..., None] / {dn}
'''
RIGHT_CE = dict(q="(1 - smoothing) * q + smoothing / V", n="real.sum()", dn="max(n, 1)")
MISTAKES["cross_entropy"] = [
    ("a mean over every position", CE.format(**dict(RIGHT_CE, n="targets.size")),
     r"a mean over every position, padding included", r"divide by their number, not by every position"),
    ("no smoothing", CE.format(**dict(RIGHT_CE, q="q")), r"without label smoothing",
     r"the smoothed loss|the smoothing moves eps"),
    ("the gradient of the sum", CE.format(**dict(RIGHT_CE, dn="1")), r"the gradient of the sum",
     r"divided by the number of real targets"),
    ("smoothing on the padding", CE.format(**dict(RIGHT_CE)).replace(
        "loss = -((q * logp).sum(axis=-1) * real).sum()",
        "loss = -((1 - smoothing) * (np.eye(V)[targets] * logp).sum(axis=-1) * real + "
        "smoothing * logp.mean(axis=-1)).sum()"),
     r"padded targets changed the loss", r"the smoothing term as well"),
]
NOAM = '''
def noam_lr(step, d_model, warmup_steps, factor=1.0):
    return {body}
'''
MISTAKES["noam_lr"] = [
    ("no d_model factor", NOAM.format(body="factor * min(step ** -0.5, step * warmup_steps ** -1.5)"),
     r"without its factor d_model\^-0.5", r"scaled by d_model\^-0.5"),
    ("max, not min", NOAM.format(body="factor * d_model ** -0.5 * max(step ** -0.5, step * warmup_steps ** -1.5)"),
     r"max instead of min", r"the smaller of the two branches"),
    ("warmup's square root", NOAM.format(body="factor * d_model ** -0.5 * min(step ** -0.5, "
                                              "step * warmup_steps ** -0.5)"),
     r"step \* warmup_steps\^-0.5", r"step \* warmup_steps\^-1.5"),
]
ADAM = '''
def adam_step(params, grads, m, v, t, lr, beta1=0.9, beta2=0.98, eps=1e-9):
    new_p, new_m, new_v = {{}}, {{}}, {{}}
    for k, p in params.items():
        g = grads[k]
        new_m[k] = beta1 * m[k] + (1 - beta1) * g
        new_v[k] = beta2 * v[k] + (1 - beta2) * g * g
        m_hat = new_m[k] / ({c1})
        v_hat = new_v[k] / ({c2})
        new_p[k] = p - lr * m_hat / ({denominator})
    return new_p, new_m, new_v
'''
RIGHT_ADAM = dict(c1="1 - beta1 ** t", c2="1 - beta2 ** t", denominator="v_hat ** 0.5 + eps")
MISTAKES["adam"] = [
    ("no bias correction", ADAM.format(**dict(RIGHT_ADAM, c1="1", c2="1")), r"without the bias correction",
     r"divide m by 1 - beta1\^t and v by 1 - beta2\^t"),
    ("v not corrected", ADAM.format(**dict(RIGHT_ADAM, c2="1")), r"m corrected and v not", r"v too"),
    ("eps inside the root", ADAM.format(**dict(RIGHT_ADAM, denominator="(v_hat + eps) ** 0.5")),
     r"eps inside the square root", r"after the square root"),
]
RMS = '''
def rmsnorm_forward(x, gamma, eps=1e-6):
    {forward}
    return gamma * xhat, (xhat, rrms, gamma)


def rmsnorm_backward(dout, cache):
    xhat, rrms, gamma = cache
    g = dout * gamma
    dx = {dx}
    D = xhat.shape[-1]
    return dx, (dout * xhat).reshape(-1, D).sum(axis=0)
'''
RIGHT_RMS = dict(forward="rrms = 1.0 / ((x * x).mean(axis=-1, keepdims=True) + eps) ** 0.5\n    xhat = x * rrms",
                 dx="rrms * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))")
MISTAKES["rmsnorm"] = [
    ("the mean subtracted", RMS.format(**dict(RIGHT_RMS, forward="c = x - x.mean(axis=-1, keepdims=True)\n    rrms = "
                                                          "1.0 / ((c * c).mean(axis=-1, keepdims=True) + eps) ** 0.5\n"
                                                          "    xhat = c * rrms")),
     r"the mean subtracted", r"no mean subtracted"),
    ("eps outside the root", RMS.format(**dict(RIGHT_RMS, forward="rrms = 1.0 / (((x * x).mean(axis=-1, keepdims="
                                                           "True)) ** 0.5 + eps)\n    xhat = x * rrms")),
     r"eps outside the square root", r"eps goes inside the square root"),
    ("the rms term forgotten", RMS.format(**dict(RIGHT_RMS, dx="rrms * g")),
     r"the root mean square's own term is missing", r"depends on every x of the row"),
]
ROPE = '''
from attn import backend as B


def rope_forward(x, positions=None, base=10000.0):
    np, xp = B.host, B.get_array_module(x)
    T, Dh = x.shape[-2:]
    pos = np.arange(T) if positions is None else B.to_host(positions)
    angle = pos[:, None] * base ** (-np.arange(0, {stop}, {step}) / Dh)
    cos, sin = xp.asarray(np.cos(angle).astype(x.dtype)), xp.asarray(np.sin(angle).astype(x.dtype))
    {turn}
    return out, (cos, sin)


def rope_backward(dout, cache):
    cos, sin = cache
    xp = B.get_array_module(dout)
    h = dout.shape[-1] // 2
    a, b = dout[..., :h], dout[..., h:]
    return xp.concatenate([{back}], axis=-1)
'''
HALVES = ("a, b = x[..., :Dh // 2], x[..., Dh // 2:]\n"
          "    out = xp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)")
RIGHT_ROPE = dict(stop="Dh", step="2", turn=HALVES, back="a * cos + b * sin, -a * sin + b * cos")
MISTAKES["rope"] = [
    ("neighbours paired", ROPE.format(**dict(RIGHT_ROPE, turn="a, b = x[..., 0::2], x[..., 1::2]\n"
                                                             "    out = xp.empty_like(x)\n"
                                                             "    out[..., 0::2] = a * cos - b * sin\n"
                                                             "    out[..., 1::2] = a * sin + b * cos")),
     r"neighbours \(2i, 2i\+1\)", r"feature i with feature i \+ Dh/2"),
    ("the exponent without its 2", ROPE.format(**dict(RIGHT_ROPE, stop="Dh // 2", step="1")),
     r"the exponent without its 2", r"theta_i = base\^\(-2i/Dh\)"),
    ("turned the same way back", ROPE.format(**dict(RIGHT_ROPE, back="a * cos - b * sin, a * sin + b * cos")),
     r"turned the same way as the forward", r"sin negated"),
]
SWIGLU = '''
from attn import backend as B


def swiglu_forward(x, w, v, w2):
    xp = B.get_array_module(x)
    a, b = x @ w, x @ v
    s = 1 / (1 + xp.exp(-a))
    h = {h}
    return h @ w2, (x, w, v, w2, a, b, s, h)


def swiglu_backward(dout, cache):
    x, w, v, w2, a, b, s, h = cache
    D, F = w.shape
    dh = dout @ w2.T
    da = dh * b * {dsilu}
    db = dh * a * s
    x2, da2, db2 = x.reshape(-1, D), da.reshape(-1, F), db.reshape(-1, F)
    dw2 = h.reshape(-1, F).T @ dout.reshape(-1, D)
    return {dx}, x2.T @ da2, x2.T @ db2, dw2
'''
RIGHT_SWIGLU = dict(h="a * s * b", dsilu="s * (1 + a * (1 - s))", dx="da @ w.T + db @ v.T")
MISTAKES["swiglu"] = [
    ("SiLU on the values", SWIGLU.format(**dict(RIGHT_SWIGLU, h="a * b / (1 + xp.exp(-b))")),
     r"SiLU on the value path", r"the gate goes through SiLU"),
    ("a sigmoid gate", SWIGLU.format(**dict(RIGHT_SWIGLU, h="s * b")), r"a sigmoid gate", r"not sigmoid\(a\)"),
    ("SiLU by exp(a) / (1 + exp(a))", SWIGLU.format(**dict(RIGHT_SWIGLU, h="a * xp.exp(a) / (1 + xp.exp(a)) * b")),
     r"SiLU written a \* exp\(a\) / \(1 \+ exp\(a\)\)", r"without exp of a large number"),
    ("SiLU's derivative the sigmoid", SWIGLU.format(**dict(RIGHT_SWIGLU, dsilu="s")),
     r"SiLU's derivative taken as sigmoid", r"the product rule"),
    ("db without the sigmoid", SWIGLU.format(**RIGHT_SWIGLU).replace("db = dh * a * s", "db = dh * a"),
     r"gradient dv differs from the library's \(dx too\).*\| yours is x.T @ \(dh \* a\)",
     r"db = dh \* silu\(a\): the value path is multiplied by the gate after SiLU"),
    ("dx without the value path", SWIGLU.format(**dict(RIGHT_SWIGLU, dx="da @ w.T")),
     r"the value path's gradient is missing", r"dx = da @ w.T \+ db @ v.T"),
]
LUONG = '''
from attn import backend as B
from attn import layers as L


def luong_attention_forward(s, e, w_c, b_c, src_mask):
    xp = B.get_array_module(s)
    a, c_soft = L.softmax_forward(s @ e.transpose(0, 2, 1), src_mask[:, None, :])
    ctx = a @ e
    z, c_lin = L.linear_forward(xp.concatenate([{cat}], axis=-1), w_c, b_c)
    out = xp.tanh(z)
    return out, (s, e, a, c_soft, c_lin, out)


def luong_attention_backward(dout, cache):
    s, e, a, c_soft, c_lin, out = cache
    H = s.shape[-1]
    dcat, dw_c, db_c = L.linear_backward(dout * (1 - out * out), c_lin)
    dctx, ds = dcat[..., :H], dcat[..., H:]
    de = a.transpose(0, 2, 1) @ dctx
    dscores = L.softmax_backward(dctx @ e.transpose(0, 2, 1), c_soft)
    return {ds}, {de}, dw_c, db_c
'''
RIGHT_LUONG = dict(cat="ctx, s", ds="ds + dscores @ e", de="de + dscores.transpose(0, 2, 1) @ s")
MISTAKES["luong_attention"] = [
    ("the state first", LUONG.format(**dict(RIGHT_LUONG, cat="s, ctx")), r"the state first",
     r"\[context ; state\], the context first"),
    ("ds without the scores", LUONG.format(**dict(RIGHT_LUONG, ds="ds")), r"the scores' path is missing",
     r"s is used twice"),
    ("de without the scores", LUONG.format(**dict(RIGHT_LUONG, de="de")), r"the scores' path is missing",
     r"e is used twice"),
]
WHOLE = (ROOT / "tests" / "answers" / "the_whole_model.py").read_text(encoding="utf-8")


def whole(old: str, new: str) -> str:
    """The whole model's answer with one line changed."""
    assert WHOLE.count(old) == 1, old
    return WHOLE.replace(old, new)


MISTAKES["encoder_layer"] = [
    ("no residual", whole('n_heads, mask)\n    h, c1 = _add_norm(x, a,', 'n_heads, mask)\n    h, c1 = _add_norm(0 * x, a,'),
     r"the residual x is not added", r"the input is added to the attention's output"),
    ("pre-norm", whole('''    a, ca = L.multi_head_attention_forward(x, x, *(p["self_attn." + k] for k in ATT), n_heads, mask)
    h, c1 = _add_norm(x, a, p, "norm1", eps)
    f, cf = L.feed_forward_forward(h, *(p["ffn." + k] for k in FFN))
    out, c2 = _add_norm(h, f, p, "norm2", eps)''', '''    n, c1 = L.layer_norm_forward(x, p["norm1.gamma"], p["norm1.beta"], eps)
    a, ca = L.multi_head_attention_forward(n, n, *(p["self_attn." + k] for k in ATT), n_heads, mask)
    h = x + a
    n, c2 = L.layer_norm_forward(h, p["norm2.gamma"], p["norm2.beta"], eps)
    f, cf = L.feed_forward_forward(n, *(p["ffn." + k] for k in FFN))
    out = h + f'''), r"pre-norm", r"normalises after the addition"),
    ("dx without the skip path", whole("    return dz + dq + dkv, g\n\n\ndef decoder_layer_forward",
                                       "    return dq + dkv, g\n\n\ndef decoder_layer_forward"),
     r"the first residual's path is missing", r"dz passes straight back too"),
]
MISTAKES["decoder_layer"] = [
    ("cross-attention on itself", whole("L.multi_head_attention_forward(h, memory,", "L.multi_head_attention_forward(h, h,"),
     r"not from memory", r"from the encoder's output, memory"),
    ("no source mask", whole("n_heads, src_mask)\n    h2, c2", "n_heads, None)\n    h2, c2"),
     r"without src_mask", r"src_mask hides the padded source words"),
    ("no look-ahead mask", whole("n_heads, tgt_mask)", "n_heads, None)"), r"without tgt_mask",
     r"takes tgt_mask, the look-ahead mask"),
]
MISTAKES["transformer"] = [
    ("no output projection path", whole('g = {"embedding.weight": dlogits.reshape(-1, E.shape[0]).T @ y.reshape(-1, D)}',
                                        'g = {"embedding.weight": 0 * E}'),
     r"without the path through the output projection", r"sends dlogits\^T @ h to dE"),
    ("no target embedding path", whole("g[\"embedding.weight\"] = g[\"embedding.weight\"] + L.embedding_backward(dy, ct[0])",
                                       "pass"),
     r"without the path through the target embedding", r"the decoder's input is tgt_in embedded"),
    ("no source embedding path", whole("g[\"embedding.weight\"] = g[\"embedding.weight\"] + L.embedding_backward(dx, cs[0])",
                                       "pass"),
     r"without the path through the source embedding", r"the encoder's input is src embedded"),
]
AVERAGE = '''
def average_checkpoints(checkpoints):
    return {{k: ({body}).astype(v.dtype) for k, v in checkpoints[0].items()}}
'''
MISTAKES["average_checkpoints"] = [
    ("the sum", AVERAGE.format(body="sum(c[k].astype('float64') for c in checkpoints)"),
     r"the sum of the checkpoints, not their mean", r"divide the sum by the number of checkpoints"),
    ("the last one", AVERAGE.format(body="checkpoints[-1][k]"), r"the last checkpoint alone",
     r"every checkpoint enters the mean"),
    ("over the parameters", AVERAGE.format(body="sum(c[k].astype('float64') for c in checkpoints) / "
                                                "len(checkpoints[0])"),
     r"the sum divided by the number of parameters", r"not by the number of keys"),
    ("float64 kept", AVERAGE.format(body="sum(c[k].astype('float64') for c in checkpoints) / len(checkpoints)")
     .replace(").astype(v.dtype)", ")"), r"dtype float64, expected .*float32", r"shape and dtype"),
]
BPE = (ROOT / "tests" / "answers" / "bpe.py").read_text(encoding="utf-8")
MISTAKES["bpe"] = [
    ("pairs counted once per word", BPE.replace("counts.get(pair, 0) + n", "counts.get(pair, 0) + 1"),
     r"counted once per word", r"add the word's count, not 1"),
    ("ties to the first found", BPE.replace("min(counts, key=lambda pair: (-counts[pair], pair))",
                                            "max(counts, key=counts.get)"),
     r"ties going to the pair counted first", r"the alphabetically first pair"),
    ("merging pairs seen once", BPE.replace("        if counts[best] < 2:\n            break\n", ""),
     r"pairs that occur once", r"fewer than twice"),
]
GREEDY = (ROOT / "tests" / "answers" / "decoding.py").read_text(encoding="utf-8")
MISTAKES["greedy_decode"] = [
    ("PAD and BOS allowed", GREEDY.replace("            logp[PAD] = logp[BOS] = -float(\"inf\")\n", ""),
     r"PAD and BOS allowed", r"PAD and BOS are never generated"),
    ("EOS left out of the score", GREEDY.replace('''            score += float(logp[tok])
            if tok == EOS:
                break''', '''            if tok == EOS:
                break
            score += float(logp[tok])'''), r"leaves out EOS's log-probability", r"EOS included"),
    ("no stop at EOS", GREEDY.replace("            if tok == EOS:\n                break\n", ""),
     r"goes on after EOS", r"a sentence ends at EOS"),
]
BEAM = (ROOT / "tests" / "mutants" / "beam_search_stops_at_first_finished.py").read_text(encoding="utf-8")
RIGHT_BEAM = BEAM.replace("STOP_AT_FIRST_FINISHED = True", "STOP_AT_FIRST_FINISHED = False")
MISTAKES["beam_search"] = [
    ("stops at the first finished", BEAM, r"stops at the first finished", r"could still beat it"),
    ("no length penalty", RIGHT_BEAM.replace("return ((5.0 + length) / 6.0) ** alpha", "return 1.0"),
     r"without the length penalty", r"logP / \(\(5 \+ len\) / 6\)\^alpha"),
    ("PAD and BOS allowed", RIGHT_BEAM.replace("        logp[:, PAD] = logp[:, BOS] = -np.inf\n", ""),
     r"PAD and BOS allowed", r"PAD and BOS are never generated"),
]
FLASH = (ROOT / "tests" / "answers" / "flash_attention.py").read_text(encoding="utf-8")


def flash(old: str, new: str) -> str:
    """The FlashAttention answer with one line changed."""
    assert FLASH.count(old) == 1, old
    return FLASH.replace(old, new)


MISTAKES["flash_attention"] = [
    ("no rescale", flash("            l = l * xp.exp(m - ref) + p.sum(axis=-1, keepdims=True)\n"
                         "            acc = acc * xp.exp(m - ref) + p @ v[..., j0:j1, :]",
                         "            l = l + p.sum(axis=-1, keepdims=True)\n"
                         "            acc = acc + p @ v[..., j0:j1, :]"),
     r"tiles of \d+ queries and \d+ keys give an output that differs", r"exp\(m_old - m_new\)"),
    ("causal skip by the first query", flash("if not causal or j0 <= i1 - 1 + Tk - Tq]", "if not causal or j0 <= i0 + Tk - Tq]"),
     r"a tile a query may see was skipped", r"j0 > i1 - 1 \+ Tk - Tq"),
    ("no guard for a first tile without keys", flash("            ref = xp.where(xp.isinf(new), q.dtype.type(0), new)\n",
                                                     "            ref = new\n"),
     r"zero for the queries whose first key tile has no key they may see", r"subtract 0 instead"),
    ("causal tiles computed and masked", flash("if not causal or j0 <= i1 - 1 + Tk - Tq]", "if True]"),
     r"computed and masked, not skipped", r"a masked tile costs as much as a visible one"),
    ("no scale in the backward", flash("            ds = ds * q.dtype.type(1 / math.sqrt(q.shape[-1]))\n", ""),
     r"the factor 1/sqrt\(d_k\) of the scores is missing", r"1/sqrt\(d_k\), applies to their gradient"),
    ("D of each tile", flash("            ds = p * (dout[..., i0:i1, :] @ v[..., j0:j1, :].swapaxes(-1, -2) - D[..., i0:i1, :])",
                             "            dp = dout[..., i0:i1, :] @ v[..., j0:j1, :].swapaxes(-1, -2)\n"
                             "            ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))"),
     r"D = rowsum\(p \* dp\) of each key tile", r"D = rowsum\(dout \* out\) of the whole row"),
]

from typical_mistakes_int8 import INT8_MISTAKES  # noqa: E402  (int8's, kept beside: this file is full)

MISTAKES["int8"] = INT8_MISTAKES

from typical_mistakes_lora import MISTAKES as _LORA  # noqa: E402  (the module at its size limit)
from typical_mistakes_speculative import MISTAKES as _SPECULATIVE  # noqa: E402
from typical_mistakes_decoder_only import MISTAKES as _DECODER_ONLY  # noqa: E402

MISTAKES.update({**_LORA, **_SPECULATIVE, **_DECODER_ONLY})

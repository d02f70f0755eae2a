"""Multi-head split by reshaping (B, T, D) straight to (B, H, T, Dh): heads get slices of
other positions instead of their own columns. merge_heads undoes it, so the two are
inverses of each other, and only a comparison with the paper's heads shows the mistake."""
from attn.layers.attention import MultiHeadCache, attention_backward, attention_forward
from attn.layers.linear import linear_backward, linear_forward


def split_heads(x, H):
    Bsz, T, D = x.shape
    return x.reshape(Bsz, H, T, D // H)


def merge_heads(x):
    Bsz, H, T, Dh = x.shape
    return x.reshape(Bsz, T, H * Dh)


def multi_head_attention_forward(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o, n_heads, mask=None,
                                 dropout=0.0, rng=None):
    q, cq = linear_forward(x_q, w_q, b_q)
    k, ck = linear_forward(x_kv, w_k, b_k)
    v, cv = linear_forward(x_kv, w_v, b_v)
    o, ca = attention_forward(split_heads(q, n_heads), split_heads(k, n_heads), split_heads(v, n_heads), mask,
                              dropout, rng)
    out, co = linear_forward(merge_heads(o), w_o, b_o)
    return out, MultiHeadCache(cq, ck, cv, ca, co, n_heads)


def multi_head_attention_backward(dout, cache):
    dmerged, dw_o, db_o = linear_backward(dout, cache.lin_o)
    dq, dk, dv = attention_backward(split_heads(dmerged, cache.H), cache.attn)
    dx_q, dw_q, db_q = linear_backward(merge_heads(dq), cache.lin_q)
    dx_k, dw_k, db_k = linear_backward(merge_heads(dk), cache.lin_k)
    dx_v, dw_v, db_v = linear_backward(merge_heads(dv), cache.lin_v)
    return dx_q, dx_k + dx_v, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o

"""A learner's answer to lessons/exercises/grouped_query_attention.py, written from its
docstrings: attn-check must pass it."""
from attn import backend as B
from attn import layers as L


def grouped_query_attention_forward(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o, n_heads, kv_heads,
                                    mask=None):
    xp, g = B.get_array_module(x_q), n_heads // kv_heads
    q, cq = L.linear_forward(x_q, w_q, b_q)
    k, ck = L.linear_forward(x_kv, w_k, b_k)
    v, cv = L.linear_forward(x_kv, w_v, b_v)
    k = xp.repeat(L.split_heads(k, kv_heads), g, axis=1)
    v = xp.repeat(L.split_heads(v, kv_heads), g, axis=1)
    o, ca = L.attention_forward(L.split_heads(q, n_heads), k, v, mask)
    out, co = L.linear_forward(L.merge_heads(o), w_o, b_o)
    return out, (cq, ck, cv, ca, co, n_heads, g)


def grouped_query_attention_backward(dout, cache):
    cq, ck, cv, ca, co, H, g = cache
    dm, dw_o, db_o = L.linear_backward(dout, co)
    dq, dk, dv = L.attention_backward(L.split_heads(dm, H), ca)
    Bsz, _, Tk, Dh = dk.shape
    dk = dk.reshape(Bsz, H // g, g, Tk, Dh).sum(axis=2)
    dv = dv.reshape(Bsz, H // g, g, Tk, Dh).sum(axis=2)
    dx_q, dw_q, db_q = L.linear_backward(L.merge_heads(dq), cq)
    dx_k, dw_k, db_k = L.linear_backward(L.merge_heads(dk), ck)
    dx_v, dw_v, db_v = L.linear_backward(L.merge_heads(dv), cv)
    return dx_q, dx_k + dx_v, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o

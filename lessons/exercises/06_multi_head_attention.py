"""Exercise for lesson 6: multi-head attention.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/06_multi_head_attention.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

Your multi-head attention may call the library's layers as ``L.linear_forward``,
``L.attention_forward``, ... (imported as a module, so that attn-check grades only what you
write here), or your own from the earlier exercises.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401
from attn import layers as L  # noqa: F401  (L.linear_forward, L.attention_forward, ...)


def split_heads(x, H):
    """Give head h the columns ``h*Dh .. (h+1)*Dh`` of every position, ``Dh = D // H``.

    Inputs: x (B, T, D); H heads dividing D. Returns: (B, H, T, Dh).
    """
    raise NotImplementedError


def merge_heads(x):
    """The inverse of split_heads: concatenate the heads' columns at every position.

    Inputs: x (B, H, T, Dh). Returns: (B, T, H*Dh).
    """
    raise NotImplementedError


def multi_head_attention_forward(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o,
                                 n_heads, mask=None):
    """``MultiHead = Concat(head_1..head_H) W^O + b_o``, ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)``:
    project ``q = x_q @ w_q + b_q``, ``k = x_kv @ w_k + b_k``, ``v = x_kv @ w_v + b_v``; split each
    into heads; attention with ``mask``; merge; ``@ w_o + b_o``. (Dropout on the attention
    weights comes in lesson 12; after its exercise, add ``dropout=0.0, rng=None`` and pass them
    to the attention: attn-check grades it then.)

    Inputs: x_q (B, Tq, D); x_kv (B, Tk, D); w_* (D, D); b_* (D,); mask broadcastable to
    (B, H, Tq, Tk). Returns: out (B, Tq, D), cache.
    """
    raise NotImplementedError


def multi_head_attention_backward(dout, cache):
    """The forward's steps in reverse. What is the backward of merge_heads, and of split_heads?
    Where is an input used more than once?

    Inputs: dout (B, Tq, D).
    Returns: dx_q, dx_kv, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o.
    """
    raise NotImplementedError

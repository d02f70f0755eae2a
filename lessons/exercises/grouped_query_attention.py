"""Exercise for lesson 26: grouped-query attention (Ainslie et al., 2023).

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/grouped_query_attention.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

Build on the library's layers (``L.linear_forward``, ``L.split_heads``, ``L.attention_forward``,
``L.merge_heads`` and their backwards); ``xp = B.get_array_module(x_q)`` is NumPy (or CuPy).
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401
from attn import layers as L  # noqa: F401


def grouped_query_attention_forward(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o, n_heads, kv_heads,
                                    mask=None):
    """Multi-head attention whose keys and values have ``kv_heads`` heads (dividing ``n_heads``):
    key/value head j is read by the g = n_heads / kv_heads query heads j*g .. j*g + g - 1.

    Inputs: x_q (B, Tq, D); x_kv (B, Tk, D); w_q, w_o (D, D); w_k, w_v (D, kv_heads * Dh) with
    Dh = D / n_heads; b_* of each width; mask broadcastable to (B, n_heads, Tq, Tk), True where
    a query may attend to a key.
    Returns: out (B, Tq, D), cache.
    """
    raise NotImplementedError


def grouped_query_attention_backward(dout, cache):
    """The gradients of the forward. A key/value head read by g query heads receives g gradients.

    Returns: dx_q, dx_kv, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o.
    """
    raise NotImplementedError

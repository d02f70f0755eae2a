"""Exercise for lesson 2: Luong's global attention with the dot score.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/luong_attention.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

The forward returns ``(out, cache)`` (the cache is yours); the backward returns the gradients
in the order the forward took its inputs. The library's layers are at hand as
``L.softmax_forward``, ``L.linear_forward``, ... (imported as a module, so that attn-check
grades only what you write here). ``xp = B.get_array_module(s)`` is NumPy (or CuPy).
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401
from attn import layers as L  # noqa: F401  (L.softmax_forward, L.linear_forward, ...)


def luong_attention_forward(s, e, w_c, b_c, src_mask):
    """For every decoder state s_t and every encoder state h_i (lesson 2):

        scores   e_{t,i} = s_t . h_i                     (B, T, S)
        weights  a_t = softmax(e_t) over the real source positions (src_mask)
        context  c_t = sum_i a_{t,i} h_i                 (B, T, H)
        output   h~_t = tanh([c_t ; s_t] @ w_c + b_c)    (B, T, H), context first

    Inputs: s (B, T, H) decoder states; e (B, S, H) encoder states; w_c (2H, H); b_c (H,);
    src_mask (B, S) bool, True at real source positions.
    Returns: out (B, T, H), cache.
    """
    raise NotImplementedError


def luong_attention_backward(dout, cache):
    """The gradients of the forward, step by step in reverse: derive them. Both inputs are
    used twice (s in the scores and in the concatenation; e as keys and as values).

    Inputs: dout (B, T, H). Returns: ds (B, T, H), de (B, S, H), dw_c (2H, H), db_c (H,).
    """
    raise NotImplementedError

"""Exercise for lesson 27: FlashAttention (Dao et al., 2022), the paper's attention a tile at a time.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/flash_attention.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

``xp = B.get_array_module(q)`` is NumPy (or CuPy on a GPU). Keep the input's dtype: constants
as ``q.dtype.type(c)``. The grader compares your output and gradients with the paper's attention
on every mask, with tile sizes that do not divide the lengths, in float64.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def flash_attention_forward(q, k, v, mask=None, q_tile=64, k_tile=64, causal=False):
    """softmax(q @ k^T / sqrt(d_k), mask) @ v, computed a tile of ``q_tile`` queries and a tile of
    ``k_tile`` keys at a time (the last tile of each may be shorter), never holding all the scores.

    For each query tile keep a running maximum m and a running sum l of exp(s - m) per query,
    and the output accumulated so far. When a key tile raises the maximum, what was summed under
    the old one must be rescaled. Masked scores are -inf; a query that may see no key at all
    gets an output of zeros (as ``attn.layers.attention_forward`` gives).

    Inputs: q (..., Tq, Dk); k (..., Tk, Dk); v (..., Tk, Dv), the same leading axes; mask None or
    bool broadcastable to (..., Tq, Tk), True where a query may attend to a key; causal: query i
    also sees only keys 0 .. i + Tk - Tq, and a key tile that no query of the tile may see is
    skipped without computing its scores.
    Returns: out (..., Tq, Dv), cache. The cache keeps the inputs, the output and one log-sum-exp
    per query, lse = m + log(l): nothing of size Tq x Tk.
    """
    raise NotImplementedError


def flash_attention_backward(dout, cache):
    """The gradients of the forward, by the same tiles: each tile's weights recomputed from the
    scores and the log-sum-exp, and the softmax's backward with D = rowsum(dout * out) in place of
    the sum over a row of weights you no longer have.

    Returns: dq, dk, dv (shapes of q, k, v).
    """
    raise NotImplementedError

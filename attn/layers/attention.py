"""Scaled dot-product attention (section 3.2.1) and multi-head attention (3.2.2).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V
    MultiHead(Q, K, V) = Concat(head_1..head_h) W^O,  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

The heads are not a Python loop: the projections are single (D, D) matrices
whose output is reshaped to (B, H, T, Dh), so every head runs in one batched matmul.

Grouped-query attention (Ainslie et al., 2023, "GQA") gives the keys and values fewer heads
than the queries: ``kv_heads`` divides ``n_heads``, and each group of ``n_heads / kv_heads``
query heads reads one key/value head. ``kv_heads = n_heads`` is the paper's multi-head
attention; ``kv_heads = 1`` is multi-query attention (Shazeer, 2019). A decoder's key/value
cache then holds ``kv_heads`` heads instead of ``n_heads``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ..backend import get_array_module
from .dropout import dropout_backward, dropout_forward
from .linear import linear_backward, linear_forward
from .rope import rope_backward, rope_forward
from .softmax import SoftmaxCache, softmax_backward, softmax_forward


class AttentionCache(NamedTuple):
    """Kept for backward: q, k, v, the attention weights (before dropout), the
    dropout cache, and the scale 1/sqrt(d_k)."""
    q: object
    k: object
    v: object
    weights: object
    drop: object
    scale: float


def attention_forward(q, k, v, mask=None, dropout: float = 0.0, rng=None):
    """Inputs: q (..., Tq, Dk); k (..., Tk, Dk); v (..., Tk, Dv); mask None or bool
    broadcastable to (..., Tq, Tk), True where the query may attend to the key;
    dropout on the attention weights.

    Returns: out (..., Tq, Dv), cache. ``cache.weights`` (..., Tq, Tk) are the
    attention weights, exactly zero on masked keys.
    """
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: "
                         "q and k need the same last dimension, k and v the same length")
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.swapaxes(-1, -2)) * q.dtype.type(scale)   # (..., Tq, Tk)
    w, _ = softmax_forward(scores, mask)
    wd, cd = dropout_forward(w, dropout, rng)
    out = wd @ v                                              # (..., Tq, Dv)
    return out, AttentionCache(q, k, v, w, cd, scale)


def attention_backward(dout, cache: AttentionCache):
    """Forward was ``out = drop(softmax(s)) @ v`` with ``s = q @ k.T * scale``, so
    ``dv = drop(w).T @ dout``, ``dw = dropback(dout @ v.T)``, ``ds = softmax_back(dw)``,
    ``dq = ds @ k * scale`` and ``dk = ds.T @ q * scale``.

    Returns: dq, dk, dv (shapes of q, k, v).
    """
    q, k, v, w, cd, scale = cache
    wd = w if cd.mask is None else w * cd.mask
    dv = wd.swapaxes(-1, -2) @ dout                           # (..., Tk, Dv)
    dw = dropout_backward(dout @ v.swapaxes(-1, -2), cd)      # (..., Tq, Tk)
    ds = softmax_backward(dw, SoftmaxCache(w)) * q.dtype.type(scale)
    dq = ds @ k                                               # (..., Tq, Dk)
    dk = ds.swapaxes(-1, -2) @ q                              # (..., Tk, Dk)
    return dq, dk, dv


def split_heads(x, H: int):
    """(B, T, D) -> (B, H, T, D/H)."""
    B, T, D = x.shape
    return x.reshape(B, T, H, D // H).transpose(0, 2, 1, 3)


def merge_heads(x):
    """(B, H, T, Dh) -> (B, T, H*Dh), the inverse of :func:`split_heads`."""
    B, H, T, Dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)


def repeat_kv(x, group: int):
    """(B, KV, T, Dh) -> (B, KV * group, T, Dh): query head j reads key/value head j // group."""
    if group == 1:
        return x
    return get_array_module(x).repeat(x, group, axis=1)


def sum_kv_groups(dx, group: int):
    """The backward of :func:`repeat_kv`: a key/value head was read by ``group`` query heads,
    so its gradient is the sum of theirs. (B, H, T, Dh) -> (B, H / group, T, Dh)."""
    if group == 1:
        return dx
    B, H, T, Dh = dx.shape
    return dx.reshape(B, H // group, group, T, Dh).sum(axis=2)


class MultiHeadCache(NamedTuple):
    """The caches of the four projections and of the attention, the number of query heads,
    and how many query heads share one key/value head (1 in the paper's attention)."""
    lin_q: object
    lin_k: object
    lin_v: object
    attn: AttentionCache
    lin_o: object
    H: int
    group: int = 1
    rope_q: object = None
    rope_k: object = None


def multi_head_attention_forward(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o,
                                 n_heads: int, mask=None, dropout: float = 0.0, rng=None, *,
                                 kv_heads: int | None = None, rope_base: float | None = None):
    """Inputs: x_q (B, Tq, D) queries' source; x_kv (B, Tk, D) keys' and values' source
    (the same array for self-attention, the encoder output for encoder-decoder
    attention); w_q, w_o (D, D); w_k, w_v (D, KV * Dh) with KV = ``kv_heads`` (None: n_heads,
    so (D, D)) and Dh = D / n_heads; b_* their widths; mask broadcastable to (B, H, Tq, Tk);
    rope_base None, or the base of rotary positions (:mod:`attn.layers.rope`) applied to every
    head's queries and keys at positions 0, 1, ... (self-attention).
    ``kv_heads`` and ``rope_base`` are given by name; ``n_heads``, ``mask``, ``dropout`` and ``rng``
    may come by position too, as the grader passes them to a learner's function and to this one.

    Returns: out (B, Tq, D), cache. ``cache.attn.weights`` is (B, H, Tq, Tk).
    """
    D = x_q.shape[-1]
    kv_heads = n_heads if kv_heads is None else kv_heads
    if D % n_heads:
        raise ValueError(f"multi_head_attention: d_model {D} is not divisible by n_heads {n_heads}")
    if kv_heads < 1 or n_heads % kv_heads:
        raise ValueError(f"multi_head_attention: kv_heads {kv_heads} must divide n_heads {n_heads}")
    if w_k.shape[-1] != kv_heads * (D // n_heads):
        raise ValueError(f"multi_head_attention: w_k has shape {tuple(w_k.shape)}, expected (D, {kv_heads * (D // n_heads)}) "
                         f"for {kv_heads} key/value heads of size {D // n_heads}")
    group = n_heads // kv_heads
    q, cq = linear_forward(x_q, w_q, b_q)
    k, ck = linear_forward(x_kv, w_k, b_k)
    v, cv = linear_forward(x_kv, w_v, b_v)
    q, k = split_heads(q, n_heads), split_heads(k, kv_heads)     # (B, H, Tq, Dh), (B, KV, Tk, Dh)
    rq = rk = None
    if rope_base is not None:
        q, rq = rope_forward(q, base=rope_base)
        k, rk = rope_forward(k, base=rope_base)
    o, ca = attention_forward(q, repeat_kv(k, group), repeat_kv(split_heads(v, kv_heads), group),
                              mask, dropout, rng)                # (B, H, Tq, Dh)
    out, co = linear_forward(merge_heads(o), w_o, b_o)
    return out, MultiHeadCache(cq, ck, cv, ca, co, n_heads, group, rq, rk)


def grouped_query_attention_forward(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o, n_heads: int,
                                     kv_heads: int, mask=None, dropout: float = 0.0, rng=None):
    """Grouped-query attention: :func:`multi_head_attention_forward` whose keys and values have
    ``kv_heads`` heads (dividing ``n_heads``), key/value head j read by query heads
    ``j * g .. j * g + g - 1``, ``g = n_heads / kv_heads``. w_k, w_v are (D, kv_heads * Dh).

    Returns: out (B, Tq, D), cache."""
    return multi_head_attention_forward(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o, n_heads=n_heads,
                                        mask=mask, dropout=dropout, rng=rng, kv_heads=kv_heads)


def grouped_query_attention_backward(dout, cache: MultiHeadCache):
    """Backward of :func:`grouped_query_attention_forward`: each key/value head's gradient is the
    sum of its group's. Returns: dx_q, dx_kv, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o."""
    return multi_head_attention_backward(dout, cache)


def attention_weights(cache):
    """The attention weights an attention forward kept, from its cache: (..., Tq, Tk) from
    :func:`attention_forward`, (B, H, Tq, Tk) from :func:`multi_head_attention_forward`.
    Each row sums to one over the keys a query may see and is exactly zero on masked keys
    (the weights before attention dropout, which is what the model attended with in evaluation)."""
    if isinstance(cache, MultiHeadCache):
        return cache.attn.weights
    if isinstance(cache, AttentionCache):
        return cache.weights
    raise TypeError(f"attention_weights: expected the cache of attention_forward or multi_head_attention_forward, "
                    f"got {type(cache).__name__}")


def multi_head_attention_backward(dout, cache: MultiHeadCache):
    """Backward through the output projection, the heads, and the three input projections;
    with grouped-query attention, each key/value head's gradient is summed over its group.

    Returns: dx_q, dx_kv, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o.
    For self-attention the caller adds dx_q and dx_kv.
    """
    H, group = cache.H, cache.group
    dmerged, dw_o, db_o = linear_backward(dout, cache.lin_o)
    dq, dk, dv = attention_backward(split_heads(dmerged, H), cache.attn)
    dk = sum_kv_groups(dk, group)
    if cache.rope_q is not None:                  # rotated queries and keys: turn their gradients back
        dq, dk = rope_backward(dq, cache.rope_q), rope_backward(dk, cache.rope_k)
    dx_q, dw_q, db_q = linear_backward(merge_heads(dq), cache.lin_q)
    dx_k, dw_k, db_k = linear_backward(merge_heads(dk), cache.lin_k)
    dx_v, dw_v, db_v = linear_backward(merge_heads(sum_kv_groups(dv, group)), cache.lin_v)
    return dx_q, dx_k + dx_v, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o

"""Scaled dot-product attention (section 3.2.1) and multi-head attention (3.2.2).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V
    MultiHead(Q, K, V) = Concat(head_1..head_h) W^O,  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

The heads are not a Python loop: the projections are single (D, D) matrices
whose output is reshaped to (B, H, T, Dh), so every head runs in one batched matmul.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .dropout import dropout_backward, dropout_forward
from .linear import linear_backward, linear_forward
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
    Bsz, T, D = x.shape
    return x.reshape(Bsz, T, H, D // H).transpose(0, 2, 1, 3)


def merge_heads(x):
    """(B, H, T, Dh) -> (B, T, H*Dh), the inverse of :func:`split_heads`."""
    Bsz, H, T, Dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(Bsz, T, H * Dh)


class MultiHeadCache(NamedTuple):
    """The caches of the four projections and of the attention, and the number of heads."""
    lin_q: object
    lin_k: object
    lin_v: object
    attn: AttentionCache
    lin_o: object
    H: int


def multi_head_attention_forward(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o,
                                 n_heads: int, mask=None, dropout: float = 0.0, rng=None):
    """Inputs: x_q (B, Tq, D) queries' source; x_kv (B, Tk, D) keys' and values' source
    (the same array for self-attention, the encoder output for encoder-decoder
    attention); w_* (D, D); b_* (D,); mask broadcastable to (B, H, Tq, Tk).

    Returns: out (B, Tq, D), cache. ``cache.attn.weights`` is (B, H, Tq, Tk).
    """
    D = x_q.shape[-1]
    if D % n_heads:
        raise ValueError(f"multi_head_attention: d_model {D} is not divisible by n_heads {n_heads}")
    q, cq = linear_forward(x_q, w_q, b_q)
    k, ck = linear_forward(x_kv, w_k, b_k)
    v, cv = linear_forward(x_kv, w_v, b_v)
    o, ca = attention_forward(split_heads(q, n_heads), split_heads(k, n_heads),
                              split_heads(v, n_heads), mask, dropout, rng)   # (B, H, Tq, Dh)
    out, co = linear_forward(merge_heads(o), w_o, b_o)
    return out, MultiHeadCache(cq, ck, cv, ca, co, n_heads)


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
    """Backward through the output projection, the heads, and the three input projections.

    Returns: dx_q, dx_kv, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o.
    For self-attention the caller adds dx_q and dx_kv.
    """
    H = cache.H
    dmerged, dw_o, db_o = linear_backward(dout, cache.lin_o)
    dq, dk, dv = attention_backward(split_heads(dmerged, H), cache.attn)
    dx_q, dw_q, db_q = linear_backward(merge_heads(dq), cache.lin_q)
    dx_k, dw_k, db_k = linear_backward(merge_heads(dk), cache.lin_k)
    dx_v, dw_v, db_v = linear_backward(merge_heads(dv), cache.lin_v)
    return dx_q, dx_k + dx_v, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_o, db_o

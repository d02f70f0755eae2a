"""FlashAttention (Dao et al., 2022): the paper's scaled dot-product attention computed a tile
of queries and a tile of keys at a time, never holding the (Tq, Tk) weights.

Forward, for each tile of queries, over the tiles of keys: the scores of the tile, a running
maximum ``m`` and a running sum ``l`` of ``exp(s - m)`` (the online softmax; when the maximum
grows, what was summed so far is rescaled by ``exp(m_old - m_new)``), and the output
accumulated with the same rescaling. It keeps the output and one log-sum-exp per query,
``lse = m + log(l)``: memory linear in the length.

Backward: each tile's weights are recomputed as ``exp(s - lse)``, and the softmax's backward
uses ``D = rowsum(dout * out)`` in place of the stored weights (``sum_j p_j dp_j = dout . out``).

Same shapes and mask as :func:`attn.layers.attention.attention_forward`: q (..., Tq, Dk),
k (..., Tk, Dk), v (..., Tk, Dv), a boolean mask broadcastable to (..., Tq, Tk), True where a
query may attend to a key; a fully masked row gives zeros, as there. ``causal=True`` adds the
look-ahead mask (query i sees keys up to i + Tk - Tq, the paper's mask when Tq = Tk) and skips
the tiles that lie wholly above the diagonal. Masked scores are -inf here, not the dtype's most
negative value as in :mod:`attn.layers.softmax`: a tile whose keys are all masked would take
that value as its maximum and weigh every masked key by exp(0) = 1.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .. import backend as B

np = B.host


class FlashCache(NamedTuple):
    """Kept for backward: the inputs and the mask (the caller's arrays, not copies), the output,
    one log-sum-exp per query (+inf on a fully masked row), the tile sizes, the causal flag,
    the scale 1/sqrt(d_k), and how many (query tile, key tile) pairs the causal mask skipped."""
    q: object
    k: object
    v: object
    mask: object
    out: object
    lse: object
    q_tile: int
    k_tile: int
    causal: bool
    scale: float
    skipped: int


def _check(q, k, v, mask, q_tile, k_tile, dropout):
    if dropout:
        raise ValueError("flash_attention_forward: dropout is not supported: the backward recomputes the weights, so it "
                         "would need each tile's dropout mask drawn again; use attention_forward for dropout")
    if q.ndim < 2 or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or not q.shape[:-2] == k.shape[:-2] \
            == v.shape[:-2]:
        raise ValueError(f"flash_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: "
                         "q and k need the same last dimension, k and v the same length, all three the same "
                         "leading axes")
    for name, size in (("q_tile", q_tile), ("k_tile", k_tile)):
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise ValueError(f"flash_attention: {name} must be a positive integer, got {size!r}")
    if mask is not None:
        full = q.shape[:-1] + (k.shape[-2],)
        try:
            fits = np.broadcast_shapes(tuple(mask.shape), full) == full
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"flash_attention: mask {tuple(mask.shape)} does not broadcast to (..., Tq, Tk) = {full}")


def _tiles(n: int, size: int) -> list:
    """[(start, stop), ...] covering 0..n in steps of ``size``; the last one may be shorter."""
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def key_tiles(i0: int, i1: int, Tk: int, k_tile: int, causal: bool, offset: int) -> list:
    """The key tiles that queries i0..i1-1 read: all of them, or with ``causal`` those whose
    first key ``j0`` some query of the tile may see (``j0 <= i1 - 1 + offset``)."""
    return [(j0, j1) for j0, j1 in _tiles(Tk, k_tile) if not causal or j0 <= i1 - 1 + offset]


def _keep(xp, mask, causal: bool, offset: int, i0: int, i1: int, j0: int, j1: int):
    """Where queries i0..i1-1 may see keys j0..j1-1 (bool, broadcastable), or None: everywhere."""
    keep = None
    if mask is not None:
        rows = slice(i0, i1) if mask.shape[-2] > 1 else slice(None)
        cols = slice(j0, j1) if mask.shape[-1] > 1 else slice(None)
        keep = mask[..., rows, cols]
    if causal and j1 - 1 > i0 + offset:                  # the tile crosses the diagonal
        below = xp.arange(j0, j1)[None, :] <= xp.arange(i0, i1)[:, None] + offset
        keep = below if keep is None else keep & below
    return keep


def _scores(qi, kj, scale, keep):
    """The tile's scaled scores, -inf where a query may not see the key."""
    xp = B.get_array_module(qi)
    s = (qi @ kj.swapaxes(-1, -2)) * qi.dtype.type(scale)
    return s if keep is None else xp.where(keep, s, qi.dtype.type(-np.inf))


def _query_tile(q, k, v, mask, i0, i1, k_tile, causal, scale):
    """The online softmax over the key tiles for queries i0..i1-1: (out, lse, tiles skipped)."""
    xp = B.get_array_module(q)
    Tq, Tk = q.shape[-2], k.shape[-2]
    qi, dt = q[..., i0:i1, :], q.dtype.type
    m = xp.full(qi.shape[:-1], -np.inf, dtype=q.dtype)   # running maximum of each query's scores
    l = xp.zeros(qi.shape[:-1], dtype=q.dtype)           # running sum of exp(s - m)
    acc = xp.zeros(qi.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    tiles = key_tiles(i0, i1, Tk, k_tile, causal, Tk - Tq)
    for j0, j1 in tiles:
        s = _scores(qi, k[..., j0:j1, :], scale, _keep(xp, mask, causal, Tk - Tq, i0, i1, j0, j1))
        m_new = xp.maximum(m, s.max(axis=-1))
        m_ref = xp.where(m_new == -np.inf, dt(0), m_new)  # a row that has seen only masked keys so far
        alpha = xp.exp(m - m_ref)                         # rescales what was summed under the old maximum
        p = xp.exp(s - m_ref[..., None])
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + p @ v[..., j0:j1, :]
        m = m_new
    seen = l > 0                                          # False: every key masked, the row stays zero
    l_safe = xp.where(seen, l, dt(1))
    lse = xp.where(seen, m + xp.log(l_safe), dt(np.inf))
    return acc / l_safe[..., None], lse, len(_tiles(Tk, k_tile)) - len(tiles)


def flash_attention_forward(q, k, v, mask=None, q_tile: int = 64, k_tile: int = 64, causal: bool = False,
                            dropout: float = 0.0):
    """Inputs: q (..., Tq, Dk); k (..., Tk, Dk); v (..., Tk, Dv) with the same leading axes;
    mask None or bool broadcastable to (..., Tq, Tk), True where the query may attend to the key;
    q_tile, k_tile the tiles' lengths (any positive sizes: the last tile may be shorter);
    causal adds the look-ahead mask and skips the tiles above the diagonal; dropout is refused.

    Returns: out (..., Tq, Dv), the paper's attention to round-off, and a :class:`FlashCache`
    holding the output and one log-sum-exp per query beyond the inputs, never (Tq, Tk).
    """
    _check(q, k, v, mask, q_tile, k_tile, dropout)
    xp = B.get_array_module(q)
    if mask is not None and mask.ndim < 2:
        mask = mask.reshape((1,) * (2 - mask.ndim) + tuple(mask.shape))
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs, lses, skipped = [], [], 0
    for i0, i1 in _tiles(q.shape[-2], q_tile):
        o, lse, n = _query_tile(q, k, v, mask, i0, i1, k_tile, causal, scale)
        outs.append(o)
        lses.append(lse)
        skipped += n
    out = xp.concatenate(outs, axis=-2)
    lse = xp.concatenate(lses, axis=-1)
    return out, FlashCache(q, k, v, mask, out, lse, q_tile, k_tile, causal, scale, skipped)


def flash_attention_backward(dout, cache: FlashCache):
    """Forward was ``out = P v`` with ``P = softmax(s)``, ``s = q k^T * scale``, computed by tiles.
    Per tile: ``P = exp(s - lse)``, ``dv += P^T dout``, ``dP = dout v^T``,
    ``ds = P * (dP - D) * scale`` with ``D = rowsum(dout * out)``, ``dq += ds k``, ``dk += ds^T q``.

    Returns: dq, dk, dv (shapes of q, k, v).
    """
    q, k, v, mask, out, lse, q_tile, k_tile, causal, scale, _ = cache
    xp = B.get_array_module(q)
    Tq, Tk = q.shape[-2], k.shape[-2]
    D = (dout * out).sum(axis=-1)                        # (..., Tq): sum_j P_ij dP_ij, without P
    dk, dv = xp.zeros_like(k), xp.zeros_like(v)
    dqs = []
    for i0, i1 in _tiles(Tq, q_tile):
        qi, doi = q[..., i0:i1, :], dout[..., i0:i1, :]
        dqi = xp.zeros_like(qi)
        for j0, j1 in key_tiles(i0, i1, Tk, k_tile, causal, Tk - Tq):
            kj, vj = k[..., j0:j1, :], v[..., j0:j1, :]
            p = xp.exp(_scores(qi, kj, scale, _keep(xp, mask, causal, Tk - Tq, i0, i1, j0, j1))
                       - lse[..., i0:i1, None])          # the forward's weights, recomputed
            dv[..., j0:j1, :] += p.swapaxes(-1, -2) @ doi
            ds = p * (doi @ vj.swapaxes(-1, -2) - D[..., i0:i1, None]) * q.dtype.type(scale)
            dqi = dqi + ds @ kj
            dk[..., j0:j1, :] += ds.swapaxes(-1, -2) @ qi
        dqs.append(dqi)
    return xp.concatenate(dqs, axis=-2), dk, dv

"""A recurrent (Elman, tanh) cell and its unrolling over a sequence, with
backpropagation through time: the encoder and decoder of the seq2seq lessons,
and the "Recurrent" row of the paper's Table 1 (section 4).

    h_t = tanh(x_t W_x + h_{t-1} W_h + b)

Everything about a sequence that the recurrent network keeps is the one vector
``h_t``; and ``h_t`` cannot be computed before ``h_{t-1}``: T dependent steps,
whatever the hardware. Those two facts are what attention removes.

Only the product with ``W_h`` is sequential. :func:`rnn_forward` computes the
input projection ``x_t W_x + b`` of every step in one matrix product before its
loop, and :func:`rnn_backward` forms ``dx`` and ``dW_x`` (and ``dW_h``) in one
product each after its loop; the loops themselves do one (B, H) @ (H, H) each.

Padding
-------
``rnn_forward(..., mask=m)`` with ``m`` (B, T) bool skips the steps where ``m``
is False: there the state passes through unchanged, ``h_t = h_{t-1}``. With real
tokens followed by padding, ``hs[:, -1]`` is then every row's state after its last
real token, and pad content changes nothing.
"""
from __future__ import annotations

from typing import NamedTuple

from ..backend import get_array_module
from ._checks import check_float


def _check_cell(layer: str, x, h, w_x, w_h, b, x_name: str, h_name: str) -> None:
    """Shapes of one cell: x (..., Din), h (B, H), w_x (Din, H), w_h (H, H), b (H,)."""
    check_float(layer, **{x_name: x, h_name: h, "w_x": w_x, "w_h": w_h, "b": b})
    if w_h.ndim != 2 or w_h.shape[0] != w_h.shape[1]:
        raise ValueError(f"{layer}: w_h must be square (H, H), got shape {tuple(w_h.shape)}")
    H = w_h.shape[0]
    if w_x.ndim != 2 or w_x.shape[1] != H:
        raise ValueError(f"{layer}: w_x has shape {tuple(w_x.shape)}, expected (Din, {H}) "
                         f"to match w_h {tuple(w_h.shape)}")
    if b.shape != (H,):
        raise ValueError(f"{layer}: b has shape {tuple(b.shape)}, expected ({H},) to match w_h {tuple(w_h.shape)}")
    if x.shape[-1] != w_x.shape[0]:
        raise ValueError(f"{layer}: {x_name} has shape {tuple(x.shape)}, but its last dimension must be "
                         f"{w_x.shape[0]} (w_x has shape {tuple(w_x.shape)})")
    if h.ndim != 2 or h.shape != (x.shape[0], H):
        raise ValueError(f"{layer}: {h_name} has shape {tuple(h.shape)}, expected ({x.shape[0]}, {H}) "
                         f"(batch of {x_name} {tuple(x.shape)}, hidden size of w_h {tuple(w_h.shape)})")

# ----------------------------------------------------------------------------- one step


class RNNStepCache(NamedTuple):
    """Kept for backward: the step's inputs ``x`` and ``h_prev``, the weights, and
    the new state ``h`` (``1 - h**2`` is the derivative of the tanh, so the
    pre-activation is not kept)."""
    x: object
    h_prev: object
    w_x: object
    w_h: object
    h: object


def rnn_step_forward(x, h_prev, w_x, w_h, b):
    """One step of the tanh cell: ``h = tanh(x @ w_x + h_prev @ w_h + b)``.

    Inputs: x (B, Din); h_prev (B, H); w_x (Din, H); w_h (H, H); b (H,).
    Returns: h (B, H), cache.
    """
    if x.ndim != 2:
        raise ValueError(f"rnn_step: x must be 2-D (B, Din), got shape {tuple(x.shape)}")
    _check_cell("rnn_step", x, h_prev, w_x, w_h, b, "x", "h_prev")
    xp = get_array_module(x)
    h = xp.tanh(x @ w_x + h_prev @ w_h + b)                   # (B, H)
    return h, RNNStepCache(x, h_prev, w_x, w_h, h)


def rnn_step_backward(dh, cache: RNNStepCache):
    """Forward was ``h = tanh(a)`` with ``a = x @ w_x + h_prev @ w_h + b``; tanh' = 1 - tanh^2,
    so ``da = dh * (1 - h**2)``, then as for two linear maps sharing one output:
    ``dx = da @ w_x.T``, ``dh_prev = da @ w_h.T``, ``dw_x = x.T @ da``,
    ``dw_h = h_prev.T @ da``, ``db = sum(da)`` over the batch.

    Inputs: dh (B, H). Returns: dx (B, Din), dh_prev (B, H), dw_x (Din, H), dw_h (H, H), db (H,).
    """
    x, h_prev, w_x, w_h, h = cache
    da = dh * (1 - h * h)                                     # (B, H)
    return da @ w_x.T, da @ w_h.T, x.T @ da, h_prev.T @ da, da.sum(axis=0)

# ----------------------------------------------------------------------------- a sequence


class RNNCache(NamedTuple):
    """Kept for backward: the input ``x``, the initial state ``h0``, the weights, every
    state ``hs``, and the step mask (None when every step is real). The tanh
    derivative is recomputed from ``hs``; the pre-activations are not kept."""
    x: object
    h0: object
    w_x: object
    w_h: object
    hs: object
    mask: object


def rnn_forward(x, h0, w_x, w_h, b, mask=None):
    """Run the tanh cell over a sequence: ``h_t = tanh(x_t @ w_x + h_{t-1} @ w_h + b)``.

    Inputs: x (B, T, Din); h0 (B, H) the state before the first step, or None for
    zeros; w_x (Din, H); w_h (H, H); b (H,); mask None or (B, T) bool, True at the
    steps to take: where it is False the step is skipped and ``h_t = h_{t-1}``.

    Returns: hs (B, T, H) the state after every step, cache. With a mask of real
    tokens followed by padding, ``hs[:, -1]`` is each row's state after its last
    real token.
    """
    if x.ndim != 3:
        raise ValueError(f"rnn: x must be 3-D (B, T, Din), got shape {tuple(x.shape)}")
    xp = get_array_module(x)
    B, T, _ = x.shape
    if h0 is None:
        h0 = xp.zeros((B, w_h.shape[-1]), dtype=x.dtype)
    _check_cell("rnn", x, h0, w_x, w_h, b, "x", "h0")
    if mask is not None:
        if mask.shape != (B, T) or mask.dtype != bool:
            raise ValueError(f"rnn: mask must be a ({B}, {T}) bool array (one flag per step of x "
                             f"{tuple(x.shape)}), got {mask.dtype} of shape {tuple(mask.shape)}")
    H = w_h.shape[0]
    xw = (x.reshape(B * T, x.shape[-1]) @ w_x + b).reshape(B, T, H)   # every step's input term at once
    hs = xp.empty((B, T, H), dtype=x.dtype)
    h = h0
    for t in range(T):                                       # the only sequential part
        h_new = xp.tanh(xw[:, t] + h @ w_h)                  # (B, H)
        h = h_new if mask is None else xp.where(mask[:, t, None], h_new, h)
        hs[:, t] = h
    return hs, RNNCache(x, h0, w_x, w_h, hs, mask)


def rnn_backward(dhs, cache: RNNCache):
    """Backpropagation through time. Forward was, for t = 0..T-1,
    ``h_t = m_t ? tanh(a_t) : h_{t-1}`` with ``a_t = x_t @ w_x + h_{t-1} @ w_h + b``.
    ``h_t`` feeds the output ``hs[:, t]`` and the next step, so walking t backwards
    its gradient is ``g_t = dhs[:, t] + (what step t+1 sent back)``. A real step sends
    ``da_t @ w_h.T`` with ``da_t = g_t * (1 - h_t**2)``; a skipped step passes ``g_t`` on
    unchanged. The weights are shared by every step, so their gradients are sums over
    t: ``dw_x = sum x_t.T @ da_t``, ``dw_h = sum h_{t-1}.T @ da_t``, ``db = sum da_t``.

    Inputs: dhs (B, T, H). Returns: dx (B, T, Din), dh0 (B, H), dw_x (Din, H), dw_h (H, H), db (H,).
    """
    x, h0, w_x, w_h, hs, mask = cache
    xp = get_array_module(dhs)
    B, T, H = hs.shape
    das = xp.zeros_like(hs)                                  # (B, T, H): da_t, 0 on skipped steps
    g = xp.zeros_like(h0)                                    # gradient arriving from step t+1
    for t in reversed(range(T)):
        g = g + dhs[:, t]
        da = g * (1 - hs[:, t] * hs[:, t])
        if mask is not None:
            da = xp.where(mask[:, t, None], da, da.dtype.type(0))
        das[:, t] = da
        back = da @ w_h.T
        g = back if mask is None else xp.where(mask[:, t, None], back, g)
    h_prev = xp.concatenate([h0[:, None], hs[:, :-1]], axis=1)[:, :T]   # (B, T, H): h_{t-1} for each t
    da2 = das.reshape(B * T, H)
    dx = (da2 @ w_x.T).reshape(x.shape)
    dw_x = x.reshape(B * T, x.shape[-1]).T @ da2
    dw_h = h_prev.reshape(B * T, H).T @ da2
    return dx, g, dw_x, dw_h, da2.sum(axis=0)

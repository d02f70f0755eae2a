"""Exercise for lesson 1: the layers of a recurrent sequence-to-sequence model.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/01_seq2seq.py

Only the layers whose functions you define are checked, so you can write one at a time
(``--layer rnn_step`` checks one). Each forward returns ``(out, cache)``: the cache is
yours, whatever your backward needs. Each backward returns the gradients in the order
the forward took its inputs. ``xp = B.get_array_module(x)`` is NumPy (or CuPy on a GPU);
use it instead of importing NumPy, and keep the input's dtype.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401  (xp = B.get_array_module(x); B.scatter_add)


def linear_forward(x, w, b=None):
    """Affine map of the last axis: ``out = x @ w + b``.

    Inputs: x (..., Din) any number of leading axes; w (Din, Dout); b (Dout,) or None.
    Returns: out (..., Dout), cache.
    """
    raise NotImplementedError


def linear_backward(dout, cache):
    """Forward was ``out = x @ w + b``, so ``dx = dout @ w.T``, ``dw = x.T @ dout`` and
    ``db = sum(dout)``, with x and dout flattened to (N, Din) and (N, Dout) (every leading
    axis is a batch axis, summed over).

    Inputs: dout (..., Dout). Returns: dx (..., Din), dw (Din, Dout), db (Dout,).
    """
    raise NotImplementedError


def embedding_forward(ids, W, scale=1.0):
    """Row lookup: ``out = W[ids] * scale``.

    Inputs: ids (...) integers in [0, V); W (V, D); scale a float.
    Returns: out (..., D), cache.
    """
    raise NotImplementedError


def embedding_backward(dout, cache):
    """Row v of dW is ``scale`` times the sum of dout over every position holding id v.
    Ids repeat: ``dW[ids] += g`` keeps only one of the repeats; ``B.scatter_add(dW, ids, g)``
    (``np.add.at``) accumulates them.

    Inputs: dout (..., D). Returns: dW (V, D).
    """
    raise NotImplementedError


def rnn_step_forward(x, h_prev, w_x, w_h, b):
    """One step of the tanh cell: ``h = tanh(x @ w_x + h_prev @ w_h + b)``.

    Inputs: x (B, Din); h_prev (B, H); w_x (Din, H); w_h (H, H); b (H,).
    Returns: h (B, H), cache.
    """
    raise NotImplementedError


def rnn_step_backward(dh, cache):
    """``tanh'(a) = 1 - tanh(a)**2``, so ``da = dh * (1 - h**2)``; then as for two linear maps
    sharing one output: ``dx = da @ w_x.T``, ``dh_prev = da @ w_h.T``, ``dw_x = x.T @ da``,
    ``dw_h = h_prev.T @ da``, ``db = sum(da)`` over the batch.

    Inputs: dh (B, H). Returns: dx (B, Din), dh_prev (B, H), dw_x (Din, H), dw_h (H, H), db (H,).
    """
    raise NotImplementedError


def rnn_forward(x, h0, w_x, w_h, b, mask=None):
    """The cell over a sequence: ``h_t = tanh(x_t @ w_x + h_{t-1} @ w_h + b)`` for t = 0..T-1,
    with ``h_{-1} = h0``. Where ``mask[:, t]`` is False the step is skipped: ``h_t = h_{t-1}``.

    Inputs: x (B, T, Din); h0 (B, H), or None for zeros; w_x (Din, H); w_h (H, H); b (H,);
    mask None or (B, T) bool.
    Returns: hs (B, T, H) every state, cache.
    """
    raise NotImplementedError


def rnn_backward(dhs, cache):
    """Backpropagation through time. Walking t backwards, the gradient reaching ``h_t`` is
    ``g_t = dhs[:, t] + (what step t+1 sent back)``; a real step has ``da_t = g_t * (1 - h_t**2)``
    and sends ``da_t @ w_h.T`` back; a skipped step passes ``g_t`` on unchanged. The weights
    are shared by every step, so their gradients are sums over t:
    ``dw_x = sum x_t.T @ da_t``, ``dw_h = sum h_{t-1}.T @ da_t``, ``db = sum da_t``.

    Inputs: dhs (B, T, H). Returns: dx (B, T, Din), dh0 (B, H), dw_x (Din, H), dw_h (H, H), db (H,).
    """
    raise NotImplementedError

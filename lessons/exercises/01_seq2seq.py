"""Exercise for lesson 1: the layers of a recurrent sequence-to-sequence model.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/01_seq2seq.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

Every layer this file asks for is graded; one whose body still raises
NotImplementedError is "not implemented yet", so you can write one at a time
(``--layer rnn_step`` grades one). Each forward returns ``(out, cache)``: the cache is
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
    """The gradients of ``out = x @ w + b``: derive them (every leading axis of x is a batch
    axis, and every position used w and b).

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
    """The gradient of ``out = W[ids] * scale`` with respect to W. Ids repeat, and
    ``dW[ids] += g`` keeps only one of the repeats: ``B.scatter_add(dW, ids, g)`` (``np.add.at``)
    accumulates them.

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
    """The gradients of one step of the cell, from dh: derive them (tanh's derivative can be
    written with its output).

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
    """Backpropagation through time: walk t backwards. Think about what reaches ``h_t`` (its
    own output's gradient, and what the next step sends back), what a skipped step does,
    and that the weights are shared by every step.

    Inputs: dhs (B, T, H), the gradient of every state the forward returned.
    Returns:
        dx (B, T, Din)   the gradient of every input step x_t;
        dh0 (B, H)       the gradient of the initial state (what step 0 sends back);
        dw_x (Din, H), dw_h (H, H), db (H,)   summed over the steps.
    """
    raise NotImplementedError

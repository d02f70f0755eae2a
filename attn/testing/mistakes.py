"""The wrong results of typical mistakes, computed on an example: each layer's registration
(:mod:`attn.testing.registry`) pairs them with what its hints say of them
(:class:`attn.testing.Mistake`), and the grader names the one a learner's result equals.

Each takes ``(example, dout)``, the example's host arrays and the upstream gradient of a
backward (None for a forward or a function), and returns the result with the mistake made."""
from __future__ import annotations

from .. import backend as B

np = B.host


# -- embedding, positions


def embedding_ids_overwrite(ex, dout):
    """``dW[ids] += g``: a repeated id keeps one position's gradient, not their sum."""
    W, ids = ex.get("W"), ex.get("ids")
    dW = np.zeros_like(W)
    dW[ids.reshape(-1)] += dout.reshape(-1, W.shape[1]) * ex.get("scale")
    return dW


def embedding_unscaled_grad(ex, dout):
    W, ids = ex.get("W"), ex.get("ids")
    dW = np.zeros_like(W)
    np.add.at(dW, ids.reshape(-1), dout.reshape(-1, W.shape[1]))
    return dW


def _dtable(ex, rows):
    table, T = ex.get("table"), ex.get("x").shape[-2]
    d = np.zeros_like(table)
    d[:T] = rows
    return d


def positional_first_sentence(ex, dout):
    return _dtable(ex, dout[0])


def positional_batch_mean(ex, dout):
    return _dtable(ex, dout.mean(axis=0))


def _angles(ex, exponent):
    pos = np.arange(ex.get("max_len"), dtype=np.float64)[:, None]
    return pos / 10000.0 ** exponent


def sinusoidal_halves(ex, dout):
    """Sines in the first half of the columns, cosines in the second, instead of interleaved."""
    D = ex.get("d_model")
    angle = _angles(ex, np.arange(0, D, 2)[None, :] / D)
    h = angle.shape[1]
    return np.concatenate([np.sin(angle), np.cos(angle[:, :D - h])], axis=1)


def sinusoidal_column_exponent(ex, dout):
    """The exponent of each column its own index j / d_model, not the pair's 2i / d_model."""
    D = ex.get("d_model")
    angle = _angles(ex, np.arange(D)[None, :] / D)
    pe = np.cos(angle)
    pe[:, 0::2] = np.sin(angle[:, 0::2])
    return pe

"""Cross-entropy over logits with label smoothing (section 5.4), ignoring padding.

With smoothing ``eps`` the target distribution is ``q = (1 - eps) * onehot(y) + eps / V``
(the convention of PyTorch's ``cross_entropy(label_smoothing=eps)``), so

    loss_token = -(1 - eps) * log p_y - eps * mean_v log p_v

averaged over the real (non-padding) target tokens. The softmax and the loss
fuse: ``dlogits = (softmax(logits) - q) / n_tokens`` on real tokens, 0 on padding.
"""
from __future__ import annotations

from . import backend as B
from .layers import check_ids
from .masks import PAD_ID


def check_loss_args(logits, targets, smoothing: float) -> None:
    """The argument checks both cross-entropies (this one and attn.fast's) make before any work."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"cross_entropy: smoothing must be in [0, 1), got {smoothing}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         "must agree on every axis but the last")
    if logits.dtype.kind != "f":
        raise TypeError(f"cross_entropy: logits must be floating point, got {logits.dtype}")


def cross_entropy(logits, targets, smoothing: float = 0.0, pad_id: int | None = PAD_ID,
                  check_finite: bool = True):
    """Inputs: logits (..., V) float; targets (...) integer ids in [0, V);
    smoothing in [0, 1); pad_id: targets equal to it contribute nothing (None: none ignored).

    Returns: (loss, dlogits): loss a 0-d array on the logits' device (the mean over
    real tokens; 0 if there are none), dlogits of the logits' shape and dtype.
    Raises FloatingPointError if the loss is not finite (NaN or inf in the logits)
    unless ``check_finite=False`` (which avoids the one host sync).
    """
    check_loss_args(logits, targets, smoothing)
    xp = B.get_array_module(logits)
    V = logits.shape[-1]
    check_ids("cross_entropy", "targets", targets, V)
    dt = logits.dtype.type
    x = logits.reshape(-1, V)                                     # (N, V)
    y = targets.reshape(-1)                                       # (N,)
    valid = (y != pad_id) if pad_id is not None else xp.ones(y.shape, dtype=bool)
    n = xp.maximum(valid.sum(), 1).astype(logits.dtype)           # real tokens, on device

    # log p = shifted - log(sum(exp(shifted))), with shifted = x - max(x) (no overflow).
    # One (N, V) buffer is allocated and reused: shifted, then exp(shifted), then dlogits.
    # (A fresh buffer of that size costs page faults at every step: at V = 16,000 and 4,096
    # tokens each is 262 MB; see benchmarks/RESULTS.md, "Large vocabularies".)
    shifted = x - x.max(axis=1, keepdims=True)                                             # (N, V)
    shifted_y = xp.take_along_axis(shifted, y[:, None], axis=1)[:, 0]                      # (N,)
    shifted_mean = shifted.mean(axis=1)                                                    # (N,)
    e = xp.exp(shifted, out=shifted)                    # shifted is not needed any more
    se = e.sum(axis=1, keepdims=True)
    logp_y = shifted_y - xp.log(se[:, 0])                                                  # (N,)
    mean_logp = shifted_mean - xp.log(se[:, 0])                                            # (N,)
    per_tok = -(dt(1.0 - smoothing) * logp_y + dt(smoothing) * mean_logp)
    loss = (per_tok * valid).sum() / n

    # dlogits = (p - q) / n on real tokens, with p = e / se and q = (1-eps) onehot + eps/V.
    d = e
    d /= se
    d -= dt(smoothing / V)
    d[xp.arange(d.shape[0]), y] -= dt(1.0 - smoothing)
    d *= (valid.astype(logits.dtype) / n)[:, None]
    if check_finite and not bool(xp.isfinite(loss)):
        raise FloatingPointError(f"cross_entropy: the loss is {float(loss)}: the logits "
                                 f"(shape {tuple(logits.shape)}) contain NaN or inf")
    return loss, d.reshape(logits.shape)

"""The fast path's label-smoothed cross-entropy: the reference's loss with fewer passes over
the logits, in place, split over threads on NumPy."""
from __future__ import annotations

from ... import backend as B
from ...layers import check_ids
from ...masks import PAD_ID
from ...loss import check_loss_args
from ..core.dispatch import ops_for
from ..core.threads import THREADS, row_slices, default_workers

def cross_entropy(logits, targets, smoothing: float = 0.0, pad_id: int | None = PAD_ID,
                  check_finite: bool = True, inplace: bool = False, workers: int | None = None,
                  validate: bool = True):
    """:func:`attn.loss.cross_entropy` with fewer passes over the logits. ``inplace=True`` overwrites
    the logits with ``dlogits`` (returned second: the caller must not use the logits after). On NumPy
    the rows are split over ``workers`` threads. ``validate=False`` and ``check_finite=False`` skip
    the targets' range and the finiteness checks: with both off a CuPy call never waits for the device."""
    check_loss_args(logits, targets, smoothing)
    xp = B.get_array_module(logits)
    V = logits.shape[-1]
    if validate:
        check_ids("cross_entropy", "targets", targets, V)
    x = (logits if inplace and logits.flags.c_contiguous else logits.copy()).reshape(-1, V)
    y = targets.reshape(-1)
    valid = (y != pad_id) if pad_id is not None else xp.ones(y.shape, dtype=bool)
    n = xp.maximum(valid.sum(), 1).astype(logits.dtype)
    ops = ops_for(xp)
    k = 1 if B.is_device_array(x) else (default_workers() if workers is None else workers)
    parts = row_slices(x.shape[0], k if x.size >= 1 << 18 else 1)
    losses = THREADS.parallel([lambda sl=sl: ops.cross_entropy_(x[sl], y[sl], valid[sl], n, smoothing)
                                for sl in parts])
    loss = sum(losses[1:], losses[0])
    if check_finite and not bool(xp.isfinite(loss)):
        raise FloatingPointError(f"cross_entropy: the loss is {float(loss)}: the logits "
                                 f"(shape {tuple(logits.shape)}) contain NaN or inf")
    return loss, x.reshape(logits.shape)

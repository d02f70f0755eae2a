"""The readable training step and loop (:mod:`attn.train`) as the fast engine runs them, so that a
step on a GPU never waits for the device: the batch's ids checked on the host, the step in the
model's step memory, each step's loss copied out of it into one buffer (:class:`PendingLosses`)."""
from __future__ import annotations

from ... import backend as B
from ... import engine as engines
from ...layers import check_ids
from ...loss import cross_entropy
from ...train import train_step as readable_step


def check_batch(model, batch, where: str = "train_step") -> None:
    """A :class:`attn.data.Batch`'s ids within the model's vocabularies, checked on the host
    (``batch`` is there): no sync. Raises IndexError naming ``where`` and the batch's field."""
    cfg = model.config
    for name, V in (("src", cfg.vocab_size), ("tgt_in", cfg.target_vocab_size), ("tgt_out", cfg.target_vocab_size)):
        if getattr(batch, name) is not None:          # a language model's batch has no source
            check_ids(where, f"batch.{name}", B.to_host(getattr(batch, name)), V)


def loop_step(model, step, dp=None):
    """``step(batch, seed) -> (loss, lr)`` as the fast engine runs it for the training loop: the
    batch checked on the host, the step in the model's step memory keyed by the batch's shapes
    (not under a data-parallel group ``dp``: its step all-reduces between its launches). The loss
    may lie in the step memory, valid until the next step begins."""
    def run(batch, seed, copy_loss: bool = False):
        check_batch(model, batch)
        if dp is not None:
            return step(batch, seed)
        with engines.step_memory(model, (getattr(batch.src, "shape", None), batch.tgt_in.shape)) as reused:
            loss, lr = step(batch, seed)
        return (loss.copy() if copy_loss and reused else loss), lr
    return run


def train_step(model, opt, batch, rng, label_smoothing: float, clip: float = 0.0, loss_fn=cross_entropy,
               dp=None, copy_loss: bool = True):
    """:func:`attn.train.train_step` (same arguments) as the fast engine runs it (:func:`loop_step`).
    Returns (loss, lr); with ``copy_loss=False`` the loss may lie in the step memory, valid until
    the next step begins, else it is a copy of its own."""
    def step(b, _seed):
        return readable_step(model, opt, b, rng, label_smoothing, clip, loss_fn, dp)
    return loop_step(model, step, dp)(batch, None, copy_loss=copy_loss)


class PendingLosses(engines.LossLog):
    """The fast engine's loss log: each step's loss copied into the next slot of one buffer on its
    device (one launch, nothing allocated once it holds a log's worth), so that a step may hand back
    a loss in its step memory; :meth:`take` brings them to the host in one transfer."""

    def __init__(self):
        self.buf, self.n = None, 0

    def append(self, loss) -> None:
        if self.buf is None or self.n == self.buf.size:
            xp = B.get_array_module(loss)              # (the loop calls this between steps)
            grown = xp.empty((max(2 * self.every, 0 if self.buf is None else 2 * self.buf.size),), dtype=loss.dtype)
            if self.n:
                grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        self.buf[self.n] = loss
        self.n += 1

    def __len__(self) -> int:
        return self.n

    def take(self) -> list:
        """The pending losses as host floats (one transfer); none pending afterwards."""
        values = B.to_host(self.buf[:self.n]).astype("float64").tolist() if self.n else []
        self.n = 0
        return values

"""The fast engine (:mod:`attn.engine`'s interface, registered as ``fast``): what ``attn-train``
trains with unless ``--reference`` is given."""
from __future__ import annotations

from functools import partial

from .. import backend as B
from ..engine import EngineError, check_precision
from ..precision import FP32, PRECISIONS, Precision
from ..quantize import refuse_training
from .gpu.graph import GraphedTrainStep
from .training.loss import cross_entropy
from .model import FastTransformer
from .training.optim import FastAdam


class FastEngine:
    """:class:`FastTransformer`, :class:`FastAdam` and the fused cross-entropy: the reference's
    numbers with fewer passes over memory; products at any of :data:`attn.precision.PRECISIONS`;
    on CuPy a step captured as a CUDA graph (:class:`attn.fast.gpu.graph.GraphedTrainStep`)."""

    name = "fast"
    precisions = PRECISIONS
    captures = True

    def model(self, config, *, seed: int = 0, dtype="float32", params: dict | None = None,
              precision: Precision = FP32, check_ids: bool = True) -> FastTransformer:
        self.check_precision(precision, dtype)
        return FastTransformer(config, seed=seed, dtype=dtype, params=params, precision=precision,
                               check_ids=check_ids)

    def optimizer(self, model, lr_factor: float = 1.0, cooldown: float = 0.0) -> FastAdam:
        refuse_training(model.params, "the fast engine's optimizer")
        return FastAdam(model.params, model.config.d_model, model.config.warmup_steps, lr_factor, cooldown=cooldown)

    def loss(self, trusted: bool = False):
        """The fused cross-entropy, in place on the logits; ``trusted``: it checks neither the ids
        nor the loss's finiteness, so a step never waits for the device."""
        return partial(cross_entropy, inplace=True, validate=not trusted, check_finite=not trusted)

    def check_precision(self, precision: Precision, dtype="float32") -> None:
        check_precision(self, precision)

    def settle(self, config, say):
        """The config as it can run on this GPU (:func:`attn.fast.gpu.fallback.settle`)."""
        from .gpu.fallback import settle
        return settle(config, say)

    def captured_step(self, model, opt, label_smoothing: float, clip: float, loss_fn):
        """The training step captured as a CUDA graph per input shape and replayed (CuPy only)."""
        if B.get_backend() != "cupy":
            raise EngineError("a captured step needs the CuPy backend (a GPU)")
        return partial(GraphedTrainStep(model, opt, label_smoothing, clip, loss_fn), copy_loss=False)

    def loop_step(self, model, step, dp=None):
        """:func:`attn.fast.training.loop.loop_step`."""
        from .training.loop import loop_step
        return loop_step(model, step, dp)

    def loss_log(self):
        """:class:`attn.fast.training.loop.PendingLosses`."""
        from .training.loop import PendingLosses
        return PendingLosses()

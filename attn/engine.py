"""What the trainer and the searches ask of a model: the engine interface.

An *engine* makes the three things a training run needs: a model, its optimizer and the loss.
Two engines implement this interface:

* ``reference``, in this module: the readable :class:`attn.model.Transformer` (one
  forward/backward pair per layer, as the lessons build it), :class:`attn.optim.Adam` and
  :func:`attn.loss.cross_entropy`. It is what a learner reads, and it trains, decodes and
  checkpoints end to end on its own (``attn-train --reference``).
* ``fast``, in :mod:`attn.fast`: the same numbers with fewer passes over memory, fused CUDA
  kernels on a GPU, and what only it can do (other precisions, a captured step).

The trainer (:mod:`attn.train`), the searches (:mod:`attn.decode`), the data-parallel code and
the benchmarks talk to this interface only. An engine is found by name (:func:`get`): the
reference is always there; others are registered as entry points of the group
``attn.engines`` (``setup.cfg``), so this package never imports them.

A model made by an engine has the reference model's attributes and methods (``config``,
``params``, ``dtype``, ``xp``, ``num_parameters``, ``save``, ``forward``, ``backward``,
``encode``, ``decode``, ``project``, ``cross_attention_kv``, ``start_decoding``,
``decode_step``, ``greedy_pick``, ``beam_candidates``), and these, in which engines differ:

``backward(dlogits, cache, grads=None, ready=None)``
    The gradients by parameter name. A data-parallel run passes either ``grads`` (a dict-like
    object that sends a bucket once its last entry is set: the reference) or ``ready`` (a
    callback told each finished stage of :attr:`gradient_arena`: an engine with one).
``gradient_arena``
    None, or the one flat buffer the backward writes every gradient into (``grad_buffer``,
    its ``size`` gradients followed by :data:`SLOT` elements for a data-parallel
    run's loss and tokens; ``layout.stages``, the stages in the order the backward finishes
    them), which a data-parallel run all-reduces in place.
``keys_first``
    True where the model keeps attention weights keys-first, (Tk, B, H, Tq), so a
    data-parallel run knows the sentence axis of its dropout draws.
``step_memory(key=None)``
    A context manager around one training step (``key``: the batch's shapes): where the step's arrays come from (the
    reference: CuPy's pool as usual, and its value None; an engine that gives every step the
    same addresses has a true value, and a loss kept past the step is then copied).
``start_decoding(memory, src_mask, reserve=None)``
    ``reserve`` = (rows, positions), the most a search will step: an engine may size its
    buffers once; the state's ``select(index, index_host=None)`` keeps rows ``index``.
"""
from __future__ import annotations

from importlib import metadata

from .loss import cross_entropy
from .model import Transformer, TransformerConfig
from .optim import Adam
from .precision import FP32, Precision

#: Elements after the gradients in a :attr:`gradient_arena`'s buffer and in a data-parallel
#: run's flat buffer: the weighted loss at :data:`LOSS`, the target tokens at :data:`TOKENS`.
SLOT, LOSS, TOKENS = 2, 0, 1

#: The entry-point group in which engines are registered.
ENTRY_POINTS = "attn.engines"


class EngineError(ValueError):
    """An engine that is not registered, or asked for what it cannot do."""


class ReferenceEngine:
    """The readable engine: :class:`attn.model.Transformer`, :class:`attn.optim.Adam`,
    :func:`attn.loss.cross_entropy`. Products in float32 (or the model's dtype) only."""

    name = "reference"
    #: The precisions its products can take (:mod:`attn.precision`).
    precisions = ("fp32",)
    #: Whether :meth:`captured_step` can capture a step as a CUDA graph.
    captures = False

    def model(self, config: TransformerConfig, *, seed: int = 0, dtype="float32", params: dict | None = None,
              precision: Precision = FP32, check_ids: bool = True) -> Transformer:
        """A model of ``config``: ``params`` (shared, not copied) or drawn from ``seed``.
        ``check_ids=False`` says the caller has checked the ids it will pass (the reference
        checks them anyway: it is cheap on the host, where it runs)."""
        self.check_precision(precision, dtype)
        return Transformer(config, seed=seed, dtype=dtype, params=params)

    def optimizer(self, model, lr_factor: float = 1.0, cooldown: float = 0.0) -> Adam:
        """Adam over ``model.params`` with the model's warm-up schedule (section 5.3), and the
        ``cooldown`` of :func:`attn.optim.cooldown_scale`."""
        return Adam(model.params, model.config.d_model, model.config.warmup_steps, lr_factor, cooldown=cooldown)

    def loss(self, trusted: bool = False):
        """``loss(logits, targets, eps) -> (loss, dlogits)``. ``trusted``: the targets were checked
        and the loss's finiteness is checked by the caller (an engine may skip both)."""
        return cross_entropy

    def captured_step(self, model, opt, label_smoothing: float, clip: float, loss_fn):
        raise EngineError(f"the {self.name} engine cannot capture a training step (the fast engine on a GPU can)")

    def check_precision(self, precision: Precision, dtype="float32") -> None:
        """:class:`EngineError` unless this engine multiplies at ``precision``."""
        if Precision.of(precision).name not in self.precisions:
            raise EngineError(f"precision {Precision.of(precision).name} is not one of the {self.name} engine's "
                              f"({', '.join(self.precisions)})")


def names() -> list:
    """The engines that :func:`get` can make, by name."""
    return sorted({"reference", *(ep.name for ep in metadata.entry_points(group=ENTRY_POINTS))})


def get(name: str):
    """The engine registered as ``name`` (``reference`` is this module's; ``fast`` is
    :mod:`attn.fast`'s, registered in ``setup.cfg``), else :class:`EngineError` naming the ones
    there are."""
    if name == "reference":
        return ReferenceEngine()
    found = [ep for ep in metadata.entry_points(group=ENTRY_POINTS) if ep.name == name]
    if not found:
        raise EngineError(f"no engine named {name!r} (engines: {', '.join(names())}); an engine is registered "
                          f"in the {ENTRY_POINTS!r} entry points of an installed package (pip install -e .)")
    return found[0].load()()

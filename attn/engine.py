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

The contract is written as :class:`typing.Protocol` classes, which a test holds both engines
to, method by method and signature by signature: :class:`Engine` (what makes a run's parts),
:class:`Model` (what every engine's model answers: the readable model's public methods),
:class:`DecodingState` (its key/value cache: a length and a rollback) and :class:`Search` (what
the searches step). Neither engine's model is a subclass of the other's;
what they share are functions: the config, :func:`attn.model.parameter_shapes`,
:func:`attn.model.init_params` and the checkpoint format.

A model may also be :class:`Tuned` by its engine: it then has a flat gradient buffer, keeps
attention weights keys-first, gives every step the same memory or brings its own search.
:func:`gradient_arena`, :func:`keys_first`, :func:`step_memory` and :func:`attn.decode.search_of`
ask it, and answer for the readable model, which is none of these.
"""
from __future__ import annotations

import contextlib
from importlib import metadata
from typing import Protocol, runtime_checkable

from . import backend as B
from .loss import cross_entropy
from .model import Transformer, TransformerConfig
from .optim import Adam
from .precision import FP32, Precision

#: Elements after the gradients in a :attr:`gradient_arena`'s buffer and in a data-parallel
#: run's flat buffer: the weighted loss at :data:`LOSS`, the target tokens at :data:`TOKENS`.
SLOT, LOSS, TOKENS = 2, 0, 1

#: The entry-point group in which engines are registered.
ENTRY_POINTS = "attn.engines"


class Model(Protocol):
    """What every engine's model answers (the readable :class:`attn.model.Transformer`'s public
    methods): the trainer, the searches, the checkpoints and the lessons use these alone."""

    config: TransformerConfig
    params: dict

    @property
    def xp(self): ...

    def num_parameters(self) -> int: ...

    def forward(self, src, tgt_in, rng=None): ...

    def backward(self, dlogits, cache) -> dict:
        """The gradients by parameter name. A data-parallel run also passes the readable model
        ``grads`` (a dict that sends each bucket once its last entry is set) and a
        :class:`Tuned` model with a :attr:`~Tuned.gradient_arena` ``ready``."""

    def encode(self, src, rng=None, src_mask=None): ...

    def decode(self, tgt_in, memory, src_mask, rng=None): ...

    def project(self, h): ...

    def cross_attention_kv(self, memory) -> list: ...

    def start_decoding(self, memory, src_mask) -> "DecodingState":
        """The :class:`DecodingState` before the first position (a language model: ``(None, None)``)."""

    def decode_positions(self, tokens, state: "DecodingState"):
        """Tokens (B, T) read in one pass through ``state``'s cache, each position attending to the
        cache and to the new ones up to its own: ``(log-probabilities (B, T, V), the new state, the
        cross-attention weights per layer)``. Speculative decoding checks a draft's tokens so."""

    def state_arrays(self) -> dict: ...

    def save(self, path, extra_arrays=None, extra_meta=None): ...


class DecodingState(Protocol):
    """What a model's key/value cache answers (:meth:`Model.start_decoding`, each engine's own:
    :class:`attn.model.DecodeState`, the fast engine's in :mod:`attn.fast.decoding`): how many
    positions it holds, and the rollback that speculative decoding asks of either engine."""

    length: int

    def truncate(self, length: int) -> "DecodingState":
        """The state as it was after its first ``length`` positions (0..:attr:`length`), the later
        positions' keys and values forgotten; the state it was truncated from may not be used again."""


class Search(Protocol):
    """What :mod:`attn.decode`'s searches ask of a model (:class:`attn.decode.ReadableSearch` for
    the readable one): a decoding state, a step, rows kept, the decoder on a whole prefix, and
    the token picks."""

    model: Model
    #: Positions greedy decoding generates between two looks at which sentences have ended (one
    #: transfer to the host each); 1: every position.
    check_every: int

    def rows_to_device(self, index, tokens, scores):
        """Beam search's next rows on the model's backend: the (n,) host row index and tokens
        (int64) and scores (float64), as device arrays."""

    def start(self, memory, src_mask, reserve=None):
        """The state for :meth:`step`. ``reserve`` = (rows, positions), the most the search will
        step: an engine may size its buffers once."""

    def step(self, tokens, state):
        """``(log-probabilities (n, V), the new state, the cross-attention weights per layer)``."""

    def select(self, state, index, index_host):
        """The state with rows ``index`` kept (and repeated); ``index_host`` is the same on the host."""

    def prefix(self, tgt_in, memory, src_mask, cross_kv, keep_weights):
        """The decoder on a whole prefix, as :meth:`Model.decode`; ``cross_kv`` the memory's keys and
        values (:meth:`Model.cross_attention_kv`), ``keep_weights`` whether weights are read."""

    def greedy_pick(self, logp, banned, info, tokens) -> None:
        """Each row's most probable token into ``tokens`` and ``info`` (ids, log-probabilities)."""

    def beam_candidates(self, logp, beam_scores, W: int, c: int, C: int, banned):
        """Each sentence's best ``C`` continuations, on the host: (2, n, C) scores and ids."""


@runtime_checkable
class Tuned(Protocol):
    """A model whose engine gives it what the readable model has no need of."""

    #: None, or the one flat buffer the backward writes every gradient into (``grad_buffer``, its
    #: ``size`` gradients followed by :data:`SLOT` elements for a data-parallel run's loss and
    #: tokens; ``layout.stages``, the stages in the order the backward finishes them), which a
    #: data-parallel run all-reduces in place. Its ``backward`` then takes ``ready``, a callback
    #: told each finished stage.
    gradient_arena: object
    #: True where attention weights are kept keys-first, (Tk, B, H, Tq), so a data-parallel run
    #: knows the sentence axis of its dropout draws.
    keys_first: bool

    def step_memory(self, key=None):
        """A context manager around one training step (``key``: the batch's shapes, which tell
        the steps that ask for the same arrays): a true value when it gives every step the same
        addresses (a loss kept past the step is then copied)."""

    def search(self) -> Search:
        """Its own :class:`Search`."""


def gradient_arena(model):
    """The model's flat gradient buffer (:class:`Tuned`), or None: the readable model's gradients
    are separate arrays."""
    return model.gradient_arena if isinstance(model, Tuned) else None


def keys_first(model) -> bool:
    """Whether the model keeps attention weights keys-first; the readable model keeps them
    (B, H, Tq, Tk), sentences first."""
    return isinstance(model, Tuned) and model.keys_first


def step_memory(model, key=None):
    """The context one training step runs in (``key``: the batch's shapes): the model's own
    (:class:`Tuned`), else the array library's memory as anywhere else (the value None)."""
    return model.step_memory(key) if isinstance(model, Tuned) else contextlib.nullcontext()


class Engine(Protocol):
    """What makes a run's parts: a model, its optimizer, its loss (and, for an engine that can,
    a captured step). :class:`ReferenceEngine` here, ``attn.fast.engine.FastEngine``."""

    name: str
    precisions: tuple
    captures: bool

    def model(self, config: TransformerConfig, *, seed: int = 0, dtype="float32", params: dict | None = None,
              precision: Precision = FP32, check_ids: bool = True) -> Model: ...

    def optimizer(self, model, lr_factor: float = 1.0, cooldown: float = 0.0): ...

    def loss(self, trusted: bool = False): ...

    def captured_step(self, model, opt, label_smoothing: float, clip: float, loss_fn):
        """The training step captured whole, ``step(batch, seed) -> (loss, lr)``, the loss valid
        until the next step begins (an engine that :attr:`captures`)."""

    def loop_step(self, model, step, dp=None):
        """``step(batch, seed) -> (loss, lr)``, the readable step the training loop runs
        (:func:`attn.train.train_step`), as this engine runs it (``dp``: a data-parallel group,
        or None); the loss valid until the next step begins."""

    def loss_log(self) -> "LossLog":
        """Where the training loop keeps the losses of the steps since it last logged."""

    def check_precision(self, precision: Precision, dtype="float32") -> None: ...

    def settle(self, config, say):
        """The run's config as this device can run it (an engine probes what it needs), saying
        through ``say`` what it switched off."""


class LossLog:
    """The losses of the steps since the training loop last logged: the loop appends each step's
    and logs every :attr:`every` steps (and before every evaluation, checkpoint and stop), when
    :meth:`take` brings them all to the host at once: on a GPU, the loop's one wait for the
    device. The readable engine's keeps the loss arrays themselves (each step's is its own)."""

    #: Steps between two logs of the training loss (the progress bar; ``state.losses`` gets every step's).
    every = 10

    def __init__(self):
        self.losses = []

    def append(self, loss) -> None:
        self.losses.append(loss)

    def __len__(self) -> int:
        return len(self.losses)

    def take(self) -> list:
        """The losses as host floats (one transfer); none kept afterwards."""
        if not self.losses:
            return []
        xp = B.get_array_module(*self.losses)
        values = B.to_host(xp.stack(self.losses)).astype("float64").tolist()
        self.losses = []
        return values


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

    def loop_step(self, model, step, dp=None):
        """``step`` as it is: the readable step is what the loop runs."""
        return step

    def loss_log(self) -> LossLog:
        return LossLog()

    def check_precision(self, precision: Precision, dtype="float32") -> None:
        check_precision(self, precision)

    def settle(self, config, say):
        """``config`` as it is: the readable model needs nothing a device could lack."""
        return config


def check_precision(engine: Engine, precision: Precision) -> None:
    """:class:`EngineError` unless ``engine`` multiplies at ``precision``."""
    if Precision.of(precision).name not in engine.precisions:
        raise EngineError(f"precision {Precision.of(precision).name} is not one of the {engine.name} engine's "
                          f"({', '.join(engine.precisions)})")


def for_inference(model: Transformer, engine: str | None = None) -> Model:
    """The readable ``model`` as ``engine`` decodes and evaluates it: ``"reference"``, as it is;
    another engine's name, that engine's model over the same parameters. None decides from the
    parameters: an int8 model (:class:`attn.quantize.Int8Params`) runs on the fast engine, its
    matrices dequantised as each layer reads them (:mod:`attn.fast.core.int8`); any other on the
    readable model. The one place ``attn-translate`` (``--reference``) and the benchmarks choose."""
    from .quantize import Int8Params
    if engine is None:
        engine = "fast" if isinstance(model.params, Int8Params) else "reference"
    if engine == "reference":
        return model
    return get(engine).model(model.config, dtype=model.dtype, params=model.params)


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

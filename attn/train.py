"""The trainer: ``train(TrainConfig(...))`` in Python, ``attn-train`` on the command line.

    from attn.train import TrainConfig, train
    metrics = train(TrainConfig(preset="toy", minutes=2, out="runs/try"))   # the dict of metrics.json

:class:`TrainConfig` holds every setting and its default; the ``attn-train``
flags are its fields (``--lr-factor`` is ``lr_factor``), and :func:`main` only
turns the command line into one. With no arguments it trains the toy
translator (``data/toy``, English -> toy language) on the default backend and
writes, under ``out``:

    checkpoint.npz   model, Adam moments, schedule step, data position, vocabulary, config
    config.json      the model config and the training settings
    metrics.jsonl    one JSON object per evaluation (step, losses, perplexity, BLEU, ...)
    metrics.json     the final summary (test_bleu, val_loss, steps, train_seconds, ...)
    loss.png         training and validation loss against steps

One training step (section 5, :func:`train_step`): forward, label-smoothed
cross-entropy, backward, optional gradient clipping, Adam with the warm-up
schedule. Everything random is a function of ``seed``: the batch order of epoch
``e`` comes from ``seed + e`` and the dropout masks of step ``s`` from
``(seed, s)``, so a run resumed from a checkpoint repeats the uninterrupted
run's losses exactly.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from . import backend as B
from .checkpoint import CheckpointError, load_npz, save_npz
from .data import DataError, Vocab, encode_pairs, make_batches, read_parallel, read_tsv, tokenize
from .fast import FastAdam, FastTransformer
from .fast import cross_entropy as fast_cross_entropy
from .loss import cross_entropy
from .model import PRESETS, Transformer, TransformerConfig
from .layers._checks import check_ids
from .optim import Adam

DEFAULT_DATA = Path(__file__).resolve().parent.parent / "data" / "toy"


# --------------------------------------------------------------------------- settings

#: The training recipe of each preset: what ``vocab``, ``max_tokens``, ``lr_factor`` and ``min_freq``
#: mean when left at None. The toy's are the values measured on the toy corpus (README); ``small`` and
#: ``base`` are for real corpora (issue 9: 2,048-token batches, learning-rate factor 0.5 and
#: every word in the vocabulary left a 20-minute run on real text far behind). BPE: on Tatoeba
#: en-de an epoch of 8,000 BPE pieces costs what one of the words seen twice does, and no test
#: word becomes <unk> (benchmarks/recipe_vocab.py measures both). Learning-rate factor 1: the run of
#: issue 9 that reached 21.3 used it (against 14.0 with 0.5 and the other toy defaults); a warm-up
#: fitted to the budget keeps the preset schedule's peak (:func:`schedule_factor`), 1.4e-3 for
#: ``small``, and reaches it within the run.
RECIPES = {
    "toy": dict(vocab="word", max_tokens=2048, lr_factor=0.5, min_freq=1),
    "small": dict(vocab="bpe", max_tokens=4096, lr_factor=1.0, min_freq=2),
    "base": dict(vocab="bpe", max_tokens=4096, lr_factor=1.0, min_freq=2),
}

#: With no ``warmup`` given and a budget (``minutes`` or ``steps``), the warm-up is this fraction
#: of the steps the budget allows, if that is shorter than the preset's: a 20-minute run on two
#: cores takes about a thousand steps, and the ``small`` preset's 2,000 would leave it inside its
#: warm-up, the learning rate still rising at the last step. (The toy's 400 steps are 30% of the
#: 1,316 that its 7 minutes allowed, and it learned well: README.)
WARMUP_FRACTION = 0.3
#: Share of a --minutes budget spent on evaluations and checkpoints, for the estimate of steps.
EVAL_SHARE = 0.1

class TrainConfigError(ValueError):
    """A training setting is out of range or of the wrong type; the message names it."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run, with its default.

    The field names are the ``attn-train`` flags (``lr_factor`` is ``--lr-factor``).
    ``None`` for a model field keeps the preset's value. Out-of-range values raise
    :class:`TrainConfigError` naming the field, before any work starts.
    """
    # data
    data: Path = DEFAULT_DATA          # folder with {train,val,test}.{src,tgt} line-aligned files
    src: str = "en"                    # source language suffix
    tgt: str = "tk"                    # target language suffix
    tsv: Path | None = None            # tab-separated pairs file instead of `data`; val/test held out
    min_freq: int | None = None        # words seen fewer times in training become <unk> (None: the recipe's)
    vocab: str | None = None           # "word" (tokens of attn.text) or "bpe" (subword pieces, attn.bpe);
                                       # None: the recipe's
    vocab_size: int | None = None      # bpe: the vocabulary's size (None: 8000); word: at most this many
    max_len: int | None = None         # skip training pairs longer than this many tokens (None: the preset's)
    # model (None: the preset's value)
    preset: str = "toy"
    d_model: int | None = None
    heads: int | None = None
    d_ff: int | None = None
    layers: int | None = None          # encoder layers and decoder layers
    dropout: float | None = None
    label_smoothing: float | None = None
    dtype: str = "float32"
    # training
    backend: str | None = None         # numpy, cupy, auto; None: $ATTN_BACKEND or numpy
    minutes: float = 7.0               # wall-clock budget for training (0: no limit)
    steps: int = 0                     # stop after this many optimizer steps (0: no limit)
    epochs: int = 0                    # stop after this many epochs (0: no limit)
    max_tokens: int | None = None      # tokens per batch, padding included (None: the recipe's)
    warmup: int | None = None          # warm-up steps (None: the preset's, shortened to fit the budget)
    lr_factor: float | None = None     # multiplies the section-5.3 learning rate (None: the recipe's)
    clip: float = 0.0                  # clip the global gradient norm to this (0: off)
    seed: int = 0                      # weights, batch order, dropout, the tsv split
    eval_every: int = 250              # validate and checkpoint every N steps
    bleu_sentences: int = 200          # validation sentences translated at each evaluation (0: none)
    average: int = 5                   # average the last K snapshots for the final model (0 or 1: off)
    snapshot_every: int = 50           # steps between the snapshots that `average` uses
    beam: int = 1                      # beam size for the final test translation (1: greedy)
    out: Path = Path("runs/toy")       # output folder
    resume: bool = False               # continue from out/checkpoint.npz, with the saved run's settings
    overwrite: bool = False            # a fresh run into an `out` that holds a run deletes that run first
    reference: bool = False            # train the readable reference classes instead of attn.fast
    quiet: bool = False                # no progress bar

    def __post_init__(self):
        for name in ("data", "tsv", "out"):
            v = getattr(self, name)
            if isinstance(v, str):
                object.__setattr__(self, name, Path(v))
            elif v is not None and not isinstance(v, Path):
                self._bad(name, "must be a path")
        if self.resume and self.overwrite:
            self._bad("overwrite", "cannot be combined with resume (one continues the run in out, the other deletes it)")
        if self.tsv is None and self.data is None:
            self._bad("data", "must be a folder (or give tsv)")
        for name in ("src", "tgt"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                self._bad(name, "must be a non-empty language suffix such as 'en'")
        if self.preset not in PRESETS:
            self._bad("preset", f"must be one of {sorted(PRESETS)}")
        if self.dtype not in ("float32", "float64"):
            self._bad("dtype", "must be 'float32' or 'float64'")
        if self.vocab not in (None, "word", "bpe"):
            self._bad("vocab", "must be 'word' or 'bpe' (or None: the preset's recipe)")
        kind = self.vocab or RECIPES.get(self.preset, RECIPES["base"])["vocab"]
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool)
                                            or self.vocab_size < _smallest_vocab(kind)):
            self._bad("vocab_size", f"must be an integer of at least {_smallest_vocab(kind)} "
                                    f"for vocab={kind!r}")
        if self.backend not in (None, "numpy", "cupy", "auto"):
            self._bad("backend", "must be 'numpy', 'cupy', 'auto' or None ($ATTN_BACKEND or numpy)")
        for name, low, optional in (("min_freq", 1, True), ("max_len", 1, True), ("d_model", 1, True),
                                    ("heads", 1, True), ("d_ff", 1, True), ("layers", 1, True),
                                    ("steps", 0, False), ("epochs", 0, False), ("max_tokens", 1, True),
                                    ("warmup", 1, True), ("seed", 0, False), ("eval_every", 1, False),
                                    ("bleu_sentences", 0, False), ("average", 0, False),
                                    ("snapshot_every", 1, False), ("beam", 1, False)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                self._bad(name, "must be an integer")
            if v < low:
                self._bad(name, f"must be at least {low}")
        for name, check, rule in (("minutes", lambda v: v >= 0, "must be >= 0 (0: no limit)"),
                                  ("lr_factor", lambda v: v > 0, "must be > 0"),
                                  ("clip", lambda v: v >= 0, "must be >= 0 (0: off)"),
                                  ("dropout", lambda v: 0 <= v < 1, "must be in [0, 1)"),
                                  ("label_smoothing", lambda v: 0 <= v < 1, "must be in [0, 1)")):
            v = getattr(self, name)
            if v is None and name in ("dropout", "label_smoothing", "lr_factor"):
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                self._bad(name, "must be a finite number")
            if not check(v):
                self._bad(name, rule)
        for name in ("resume", "overwrite", "reference", "quiet"):
            if not isinstance(getattr(self, name), bool):
                self._bad(name, "must be True or False")

    def _bad(self, name: str, rule: str):
        raise TrainConfigError(f"{name} ({_flag(name)}) {rule}, got {getattr(self, name)!r}")

    def with_recipe(self) -> "TrainConfig":
        """This config with the fields left at ``None`` that :data:`RECIPES` covers filled
        in from the preset's recipe."""
        recipe = RECIPES.get(self.preset, RECIPES["base"])     # a preset added elsewhere: the real-corpus recipe
        return dataclasses.replace(self, **{k: v for k, v in recipe.items() if getattr(self, k) is None})

    def to_dict(self) -> dict:
        """JSON-ready: paths as strings. :meth:`from_dict` inverts it."""
        return {f.name: (str(v) if isinstance(v, Path) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """A config from :meth:`to_dict` output (or a checkpoint's saved settings); unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def model_config(self, vocab_size: int) -> TransformerConfig:
        """The preset with this config's overrides, for a vocabulary of ``vocab_size``."""
        overrides = {k: v for k, v in (("d_model", self.d_model), ("n_heads", self.heads), ("d_ff", self.d_ff),
                                        ("n_encoder_layers", self.layers), ("n_decoder_layers", self.layers),
                                        ("dropout", self.dropout), ("label_smoothing", self.label_smoothing),
                                        ("warmup_steps", self.warmup)) if v is not None}
        try:
            return TransformerConfig.preset(self.preset, vocab_size=vocab_size, **overrides)
        except ValueError as e:
            raise TrainConfigError(f"the model settings do not fit together: {e}") from None


#: Settings a resumed run may take from the new command line: they change how the run is watched,
#: evaluated or where it stops, not what it computes. Every other setting comes from the saved run.
RESUME_MAY_CHANGE = ("minutes", "steps", "epochs", "backend", "quiet", "reference", "beam", "bleu_sentences",
                     "eval_every", "out", "resume", "overwrite")


def _same(a, b) -> bool:
    if isinstance(a, Path) and isinstance(b, Path):
        return a.resolve() == b.resolve()
    return a == b


def resumed_config(config: TrainConfig, saved: dict, given=None) -> TrainConfig:
    """The settings of a resumed run: the saved run's (``saved``, a :meth:`TrainConfig.to_dict`),
    with those in :data:`RESUME_MAY_CHANGE` taken from ``config``.

    ``given`` names the fields the user set (the command line passes the flags it saw); by
    default, those where ``config`` differs from the defaults. A given field that contradicts
    the saved run is a :class:`TrainConfigError` naming it.
    """
    base = TrainConfig.from_dict({**saved, "resume": False, "overwrite": False})
    default = TrainConfig()
    if given is None:
        given = {f.name for f in dataclasses.fields(config)
                 if not _same(getattr(config, f.name), getattr(default, f.name))}
    clashes = [f"{_flag(n)} {getattr(config, n)} (the saved run has {getattr(base, n)})"
               for n in sorted(given) if n not in RESUME_MAY_CHANGE
               and not _same(getattr(config, n), getattr(base, n))]
    if clashes:
        raise TrainConfigError(
            f"--resume continues the run in {config.out} with its own settings, but "
            + "; ".join(clashes) + ". Drop the flag(s), or start a new run with another --out. "
            f"A resumed run may change only {', '.join(_flag(n) for n in RESUME_MAY_CHANGE[:-3])}.")
    take = {n: getattr(config, n) for n in RESUME_MAY_CHANGE if n in given or n in ("out", "resume", "overwrite")}
    take.setdefault("backend", config.backend)       # this machine's choice ($ATTN_BACKEND), not the saved one
    return dataclasses.replace(base, **take)


# --------------------------------------------------------------------------- data

@dataclass
class Corpus:
    """Raw sentence pairs of the three splits and where they came from."""
    train: list
    val: list
    test: list
    source: str


def load_corpus(config: TrainConfig) -> Corpus:
    """The three splits from ``config.tsv`` or ``config.data`` with ``config.src``/``config.tgt``."""
    if config.tsv:
        train, val, test = split_by_source(read_tsv(config.tsv), config.seed, str(config.tsv))
        return Corpus(train, val, test, f"tsv:{config.tsv}")
    data, src, tgt = Path(config.data), config.src, config.tgt
    return Corpus(read_parallel(data, src, tgt, "train"),
                  read_parallel(data, src, tgt, "val"),
                  read_parallel(data, src, tgt, "test"),
                  f"{data}/{{train,val,test}}.{{{src},{tgt}}}")


def split_by_source(pairs, seed: int, name: str = "corpus"):
    """Hold out about 5% of the pairs (at most 1000) each for validation and test, by
    *distinct source sentence*: all translations of a source land in the same split, so
    no test source is seen in training (Tatoeba has many sources with several translations).
    Deterministic in ``seed``. Returns (train, val, test) lists of pairs."""
    groups: dict[str, list[int]] = {}
    for i, (src, _) in enumerate(pairs):
        groups.setdefault(src, []).append(i)
    if len(groups) < 3:
        raise DataError(f"{name}: need at least 3 distinct source sentences to split into train/val/test, "
                        f"got {len(groups)} (in {len(pairs)} pairs)")
    sources = list(groups)
    order = B.host_rng(seed).permutation(len(sources)).tolist()
    n_hold = max(1, min(1000, len(pairs) // 20))
    held: list[list[int]] = [[], []]
    k = 0
    for part in held:
        while len(part) < n_hold and k < len(order) - 1:      # keep at least one source for training
            part.extend(groups[sources[order[k]]])
            k += 1
    train = [pairs[i] for j in order[k:] for i in groups[sources[j]]]
    return train, [pairs[i] for i in held[0]], [pairs[i] for i in held[1]]


#: The BPE vocabulary's size when ``vocab_size`` is not given.
DEFAULT_BPE_SIZE = 8000


def _smallest_vocab(kind: str) -> int:
    from .bpe import BYTE_TOKENS
    from .data import SPECIALS
    return len(SPECIALS) + (len(BYTE_TOKENS) + 1 if kind == "bpe" else 1)


def build_vocab(train_pairs, min_freq: int = 1, kind: str = "word", size: int | None = None) -> Vocab:
    """One vocabulary for both languages, so the three embedding matrices can be shared (section 3.4).

    ``kind="word"``: the words of :func:`attn.text.tokenize` seen at least ``min_freq``
    times (the ``size`` most frequent if given). ``kind="bpe"``: byte-pair merges
    learned on both sides of the training text until the vocabulary has ``size``
    entries (default :data:`DEFAULT_BPE_SIZE`; section 5.1).
    """
    if kind == "bpe":
        try:
            return Vocab.build_bpe([s for s, _ in train_pairs] + [t for _, t in train_pairs],
                                   size if size is not None else DEFAULT_BPE_SIZE)
        except ValueError as e:
            raise TrainConfigError(f"vocab_size (--vocab-size): {e}") from None
    return Vocab.build([tokenize(s) for s, _ in train_pairs] + [tokenize(t) for _, t in train_pairs],
                       min_freq=min_freq, max_size=size)


# --------------------------------------------------------------------------- state

@dataclass
class TrainState:
    """Where training stands: what a checkpoint must hold besides the arrays."""
    step: int = 0                  # optimizer steps taken
    epoch: int = 0
    batch_index: int = 0           # next batch within the epoch's (seeded) order
    train_seconds: float = 0.0
    tokens_seen: int = 0
    wall_seconds: float = 0.0      # of the --minutes budget used, evaluations included, over all sessions
    losses: list = field(default_factory=list)      # training loss of every step
    evals: list = field(default_factory=list)       # the metrics.jsonl records


def save_checkpoint(path, model: Transformer, opt: Adam, state: TrainState, vocab: Vocab,
                    config: TrainConfig) -> None:
    arrays = {**model.state_arrays(), **opt.state_arrays(),
              "history/train_loss": B.host.asarray(state.losses, dtype="float64")}
    meta = {"format": "attn-checkpoint-1", "config": model.config.to_dict(), "vocab": vocab.to_json(),
            "step": state.step, "epoch": state.epoch, "batch_index": state.batch_index,
            "train_seconds": state.train_seconds, "tokens_seen": state.tokens_seen, "evals": state.evals,
            "wall_seconds": state.wall_seconds,
            "seed": config.seed, "args": config.to_dict(), "dtype": str(model.dtype)}
    save_npz(path, arrays, meta)


def schedule_factor(config: TrainConfig, model_config: TransformerConfig) -> float:
    """The optimizer's learning-rate factor: ``lr_factor``, times ``sqrt(w / w0)`` when the warm-up
    ``w`` was fitted to the budget (:func:`fit_warmup`) in place of the preset's ``w0``.

    The section-5.3 schedule peaks at ``lr_factor * d_model^-0.5 * w^-0.5``: shortening the
    warm-up alone would raise the peak (a 6-minute run warming up for 9 steps peaked at 1e-2 and
    stalled). The scale keeps the peak the preset's schedule would reach, and reaches it sooner.
    """
    w0 = PRESETS[config.preset]["warmup_steps"]
    if config.warmup is not None or model_config.warmup_steps == w0:
        return config.lr_factor
    return config.lr_factor * math.sqrt(model_config.warmup_steps / w0)


def make_engine(model: Transformer, reference: bool, lr_factor: float):
    """The model and optimizer that train: the readable reference classes with
    ``reference=True``, else their faster twins from :mod:`attn.fast`, which compute
    the same numbers (tests/test_fast.py checks that) with fewer passes over memory."""
    cls, opt_cls = (Transformer, Adam) if reference else (FastTransformer, FastAdam)
    if type(model) is not cls:
        model = cls(model.config, dtype=model.dtype, params=model.params)
    if not reference:
        model.validate_ids = False      # train_step checks each batch on the host (no device sync)
    return model, opt_cls(model.params, model.config.d_model, model.config.warmup_steps, lr_factor)


# --------------------------------------------------------------------------- one step

def step_loss_fn(reference: bool):
    """The loss the trainer's steps use: the reference cross-entropy, or the fast one in place.
    The fast one neither re-checks the ids (:func:`train_step` did, on the host) nor the
    loss's finiteness (the loop checks it when the losses come to the host), so a fast step
    never waits for the device."""
    if reference:
        return cross_entropy
    return partial(fast_cross_entropy, inplace=True, validate=False, check_finite=False)


def train_step(model: Transformer, opt: Adam, batch, rng, label_smoothing: float, clip: float = 0.0,
               loss_fn=cross_entropy):
    """One optimizer step on one batch (sections 5.3, 5.4).

    Forward with dropout (masks from ``rng``), label-smoothed cross-entropy,
    backward, optional clipping of the global gradient norm to ``clip`` (0: off),
    Adam with the warm-up schedule. ``batch`` is an :class:`attn.data.Batch` on the
    host; ``loss_fn(logits, targets, eps) -> (loss, dlogits)``.

    Returns (loss, lr): the loss as a 0-d array on the device (no host sync here)
    and the learning rate the step used.
    """
    cfg = model.config
    for name, V in (("src", cfg.vocab_size), ("tgt_in", cfg.target_vocab_size), ("tgt_out", cfg.target_vocab_size)):
        check_ids("train_step", f"batch.{name}", B.to_host(getattr(batch, name)), V)   # on the host: no sync
    src, tgt_in, tgt_out = (B.to_device(a) for a in (batch.src, batch.tgt_in, batch.tgt_out))
    logits, cache = model.forward(src, tgt_in, rng)
    loss, dlogits = loss_fn(logits, tgt_out, label_smoothing)
    del logits
    grads = model.backward(dlogits, cache)
    del cache, dlogits
    lr = opt.step(grads, clip=clip)                      # clipping decided on the device: no host sync
    return loss, lr


# --------------------------------------------------------------------------- the warm-up for a budget

def measure_step_seconds(model: Transformer, batches, label_smoothing: float, loss_fn=cross_entropy) -> float:
    """Seconds per training step on this machine now: forward and backward on ``batches``
    (the first untimed: it pays for first-call set-up), the parameters left unchanged.
    The update is not run; it adds a few per cent (callers allow for it)."""
    times = []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        src, tgt_in, tgt_out = (B.to_device(a) for a in (b.src, b.tgt_in, b.tgt_out))
        logits, cache = model.forward(src, tgt_in, B.DeviceRNG(i))
        loss, dlogits = loss_fn(logits, tgt_out, label_smoothing)
        del logits
        model.backward(dlogits, cache)
        del cache, dlogits
        B.to_float(loss)                 # waits for the device (the copy queues behind the backward)
        times.append(time.perf_counter() - t0)
    timed = times[1:] or times
    return sum(timed) / len(timed)


def fit_warmup(model: Transformer, model_config: TransformerConfig, config: TrainConfig, train_enc, loss_fn):
    """The warm-up for a run with a budget and no ``warmup`` given: :data:`WARMUP_FRACTION` of the
    steps the budget allows (the least of ``steps``, ``epochs`` times the batches of an epoch, and
    ``minutes`` at the step time measured now), if that is shorter than the preset's.

    Returns (model, optimizer, model config, a record of the rule for config.json); the model's
    parameters are unchanged, only the schedule's warm-up."""
    t0 = time.perf_counter()
    batches = make_batches(train_enc, config.max_tokens, shuffle=True, seed=config.seed)
    allowed, rule, why = math.inf, {}, ""
    for limit, what in ((config.steps, f"--steps {config.steps}"),
                        (config.epochs * len(batches), f"--epochs {config.epochs} of {len(batches)} steps")):
        if limit and limit < allowed:
            allowed, why = limit, what
    if config.minutes:
        batches = batches[:3]
        per_step = 1.05 * measure_step_seconds(model, batches, model_config.label_smoothing, loss_fn)
        by_time = config.minutes * 60.0 * (1.0 - EVAL_SHARE) / per_step
        if by_time < allowed:
            allowed = by_time
            why = f"about {by_time:.0f} steps in --minutes {config.minutes:g} at {per_step:.2f} s/step"
        rule.update(seconds_per_step=round(per_step, 4), probe_seconds=round(time.perf_counter() - t0, 2))
    warmup = max(1, min(model_config.warmup_steps, round(WARMUP_FRACTION * allowed)))
    why = (f"{WARMUP_FRACTION:.0%} of {why}" if warmup < model_config.warmup_steps
           else f"the preset's; {why} allow it")
    rule.update(steps_allowed=round(allowed), fraction=WARMUP_FRACTION, preset_warmup=model_config.warmup_steps,
                warmup_steps=warmup, why=why)
    if warmup != model_config.warmup_steps:
        model_config = dataclasses.replace(model_config, warmup_steps=warmup)
        model = Transformer(model_config, dtype=model.dtype, params=model.params)
    model, opt = make_engine(model, config.reference, schedule_factor(config, model_config))
    rule.update(peak_lr=opt.lr(warmup), schedule_factor=opt.lr_factor)
    return model, opt, model_config, rule


#: Steps between two logs of the training loss (the progress bar; ``state.losses`` gets every
#: step's). Fetching the losses is the loop's one host sync, so on a GPU it happens on these
#: steps only, for all the steps since the last log at once (and before every evaluation,
#: checkpoint and stop).
LOG_EVERY = 10


def _log_losses(pending: list, state: "TrainState") -> float:
    """Bring the pending device losses to the host in one transfer, append them to
    ``state.losses`` and empty ``pending``. Returns the last one. Raises FloatingPointError
    naming the step if one is NaN or infinite."""
    if not pending:
        return state.losses[-1] if state.losses else math.nan
    xp = B.get_array_module(pending[0])
    values = B.to_host(xp.stack(pending)).astype("float64").tolist()
    first = state.step - len(values) + 1
    pending.clear()
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise FloatingPointError(f"train: the training loss is {v} at step {first + i}: the model diverged "
                                     "(lower --lr-factor, or --clip the gradients)")
    state.losses.extend(values)
    return values[-1]


# --------------------------------------------------------------------------- evaluation

def evaluate_loss(model: Transformer, batches, smoothing: float) -> dict:
    """Mean per-token cross-entropy (with and without label smoothing) over batches, no dropout."""
    total_nll = total_smoothed = 0.0
    n = 0
    for b in batches:
        src, tgt_in, tgt_out = (B.to_device(a) for a in (b.src, b.tgt_in, b.tgt_out))
        logits, _ = model.forward(src, tgt_in)
        nll, _ = cross_entropy(logits, tgt_out, 0.0)
        sm, _ = cross_entropy(logits, tgt_out, smoothing)
        total_nll += B.to_float(nll) * b.n_tgt_tokens
        total_smoothed += B.to_float(sm) * b.n_tgt_tokens
        n += b.n_tgt_tokens
    nll = total_nll / max(n, 1)
    return {"val_loss": total_smoothed / max(n, 1), "val_nll": nll, "val_ppl": math.exp(min(nll, 50.0))}


def bleu_on(model, vocab, pairs, beam: int, limit: int | None = None):
    from .evaluate import evaluate_bleu
    pairs = pairs[:limit] if limit else pairs
    bleu, hyps = evaluate_bleu(model, vocab, pairs, beam_size=beam)
    return bleu, hyps


# --------------------------------------------------------------------------- the loop

class _Interrupt:
    """Turns the first Ctrl-C into a flag the loop checks between steps, so the
    checkpoint is written from a consistent state; a second Ctrl-C aborts."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            print("\ninterrupt: finishing this step, saving a checkpoint, then exiting "
                  "(Ctrl-C again to abort without saving)", file=sys.stderr)
        try:
            self._old = signal.signal(signal.SIGINT, handler)
        except ValueError:          # not the main thread: keep the default behaviour
            self._old = None
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


#: What a run writes into ``out``; a fresh run refuses an ``out`` that holds any of them.
RUN_FILES = ("checkpoint.npz", "config.json", "metrics.jsonl", "metrics.json", "loss.png",
             "test_translations.txt", "averaged.npz", "snapshots")


def _previous_run(out: Path) -> list[str]:
    return [name for name in RUN_FILES if (out / name).exists()]


def _remove_previous_run(out: Path) -> list[str]:
    """Delete the files a previous run wrote into ``out`` (only those: see :data:`RUN_FILES`)."""
    removed = _previous_run(out)
    for name in removed:
        path = out / name
        if path.is_dir():
            for f in path.glob("step-*.npz"):
                f.unlink()
            if not any(path.iterdir()):
                path.rmdir()
        else:
            path.unlink()
    return removed


def train(config: TrainConfig, *, given=None, on_step=None) -> dict:
    """Train as ``config`` says; returns the final metrics (also written to ``out/metrics.json``).

    The returned dict holds at least ``test_bleu``, ``val_loss``, ``steps``,
    ``train_seconds``, ``tokens_per_second`` and ``backend``; an interrupted run
    returns ``{"interrupted": True, "steps": ...}``.

    A fresh run refuses an ``out`` that already holds a run (unless ``overwrite``);
    with ``resume`` the saved run's settings and seed are used (see
    :func:`resumed_config`; ``given`` names the fields the caller set explicitly).

    ``on_step(state, model, wall_seconds)``, if given, is called after every optimizer
    step (after its averaging snapshot, before any evaluation) with the :class:`TrainState`,
    the model and the seconds of the ``minutes`` budget used so far; it must change
    neither. ``state.losses`` then holds every step's loss so far (so each step brings its
    loss to the host, where an unwatched run does so every :data:`LOG_EVERY` steps). The side-by-side benchmark (:mod:`attn.bench.quality`) watches the run with it.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train() takes a TrainConfig, got {type(config).__name__}")
    out = Path(config.out)
    ckpt_path = out / "checkpoint.npz"
    if config.resume:
        if not ckpt_path.is_file():
            raise CheckpointError(f"--resume: there is no checkpoint at {ckpt_path}")
        arrays, meta = load_npz(ckpt_path)
        config = resumed_config(config, meta.get("args", {}), given)
    elif _previous_run(out) and not config.overwrite:
        raise TrainConfigError(
            f"--out {out} already holds a run ({', '.join(_previous_run(out))}); a fresh run would mix with it. "
            f"Continue it with --resume, choose another --out, or pass --overwrite to delete it and start clean.")
    if config.backend is None:
        config = dataclasses.replace(config, backend=os.environ.get("ATTN_BACKEND", "numpy"))
    config = config.with_recipe()
    B.set_backend(config.backend)
    loss_fn = step_loss_fn(config.reference)

    corpus = load_corpus(config)
    state = TrainState()
    if config.resume:
        vocab = Vocab.from_json(meta["vocab"])
        model = Transformer.from_arrays(arrays, meta, source=str(ckpt_path))
        model_config = model.config
        model, opt = make_engine(model, config.reference, schedule_factor(config, model_config))
        opt.load_state(arrays, meta["step"])
        state = TrainState(meta["step"], meta["epoch"], meta["batch_index"], meta["train_seconds"],
                           meta["tokens_seen"], meta.get("wall_seconds", meta["train_seconds"]),
                           [float(x) for x in arrays.get("history/train_loss", [])], meta.get("evals", []))
        _check_something_left(config, state)
        print(f"resumed from {ckpt_path} at step {state.step} (epoch {state.epoch}, batch {state.batch_index})",
              file=sys.stderr)
    else:
        t_vocab = time.perf_counter()
        vocab = build_vocab(corpus.train, config.min_freq, config.vocab, config.vocab_size)
        if vocab.bpe is not None:
            print(f"attn-train: learned {len(vocab.bpe.merges)} BPE merges on the training text in "
                  f"{time.perf_counter() - t_vocab:.1f} s", file=sys.stderr)
        model_config = config.model_config(len(vocab))
        model, opt = make_engine(Transformer(model_config, seed=config.seed, dtype=config.dtype),
                                 config.reference, config.lr_factor)

    # A sentence of n tokens takes n + 1 positions (EOS on the source, BOS on the target input).
    max_len = min(config.max_len or model_config.max_len, model_config.max_len - 1)
    train_enc = encode_pairs(corpus.train, vocab, max_len=max_len)
    if not train_enc:
        raise DataError(f"{corpus.source}: no training pair is left of {len(corpus.train)}: every one is empty on "
                        f"a side or longer than {max_len} tokens (--max-len; the preset's max_len is "
                        f"{model_config.max_len})")
    val_enc = encode_pairs(corpus.val, vocab, max_len=max_len)
    val_batches = make_batches(val_enc, config.max_tokens, shuffle=False)
    warmup_rule = None
    if not config.resume and config.warmup is None and (config.minutes or config.steps or config.epochs):
        model, opt, model_config, warmup_rule = fit_warmup(model, model_config, config, train_enc, loss_fn)
        state.wall_seconds += warmup_rule.get("probe_seconds", 0.0)
        print(f"warm-up: {model_config.warmup_steps} steps ({warmup_rule['why']})", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    if not config.resume and config.overwrite and _previous_run(out):
        print(f"--overwrite: starting clean in {out}: removed the previous run's "
              f"{', '.join(_remove_previous_run(out))}", file=sys.stderr)
    (out / "config.json").write_text(json.dumps({"model": model_config.to_dict(), "train": config.to_dict(),
                                                 "vocab_size": len(vocab), "corpus": corpus.source,
                                                 "train_pairs": len(train_enc), "warmup_rule": warmup_rule},
                                                indent=2))
    print(f"attn-train: {len(train_enc)} training pairs from {corpus.source}, vocabulary {len(vocab)} "
          f"({'BPE' if vocab.bpe is not None else 'words'}), "
          f"model {model.num_parameters():,} parameters ({config.preset}), backend {B.describe()}",
          file=sys.stderr)

    pending = []                    # the device losses of the steps since the last log
    budget = config.minutes * 60.0 if config.minutes else math.inf     # over the whole run, resumed or not
    started, wall_before = time.perf_counter(), state.wall_seconds
    last_eval_step = state.step
    from tqdm import tqdm
    bar = tqdm(total=config.steps if config.steps else None, initial=state.step, unit="step", dynamic_ncols=True,
               disable=config.quiet, file=sys.stderr, desc="train")
    evaluate = partial(_evaluate_and_save, model, opt, state, vocab, config, corpus, val_batches, model_config,
                       out, bar)
    stop_reason = None
    with _Interrupt() as interrupt:
        while stop_reason is None:
            batches = make_batches(train_enc, config.max_tokens, shuffle=True, seed=config.seed,
                                   epoch=state.epoch)
            while state.batch_index < len(batches):
                b = batches[state.batch_index]
                t0 = time.perf_counter()
                rng = B.DeviceRNG(config.seed * 1_000_003 + state.step)
                loss, lr = train_step(model, opt, b, rng, model_config.label_smoothing, config.clip, loss_fn)
                pending.append(loss)
                dt = time.perf_counter() - t0
                state.step += 1
                state.batch_index += 1
                state.train_seconds += dt
                state.wall_seconds = wall_before + (time.perf_counter() - started)
                state.tokens_seen += b.n_src_tokens + b.n_tgt_tokens
                bar.update(1)

                if config.steps and state.step >= config.steps:
                    stop_reason = f"reached --steps {config.steps}"
                elif state.wall_seconds >= budget:
                    stop_reason = f"reached --minutes {config.minutes}"
                elif interrupt.requested:
                    stop_reason = "interrupted"
                if (state.step % LOG_EVERY == 0 or stop_reason or state.step - last_eval_step >= config.eval_every
                        or on_step is not None):                # a watcher reads each step's loss
                    loss_value = _log_losses(pending, state)    # the one host sync, on the steps that log
                    tok_s = state.tokens_seen / max(state.train_seconds, 1e-9)
                    left = budget - state.wall_seconds
                    bar.set_postfix_str(f"loss {loss_value:.3f} lr {lr:.2e} {tok_s:,.0f} tok/s"
                                        + (f" left {_fmt_secs(left)}" if budget < math.inf else "")
                                        + f" ep {state.epoch}", refresh=False)
                if config.average > 1 and state.step % config.snapshot_every == 0:
                    _snapshot(out, model, vocab, state.step, config.average)
                if on_step is not None:
                    on_step(state, model, state.wall_seconds)
                if stop_reason == "interrupted":
                    save_checkpoint(ckpt_path, model, opt, state, vocab, config)
                elif stop_reason or state.step - last_eval_step >= config.eval_every:
                    evaluate()
                    last_eval_step = state.step
                if stop_reason:
                    break
            else:
                state.epoch += 1
                state.batch_index = 0
                if config.epochs and state.epoch >= config.epochs:
                    stop_reason = f"reached --epochs {config.epochs}"
                    if state.step != last_eval_step:
                        _log_losses(pending, state)
                        evaluate()
    bar.close()
    print(f"stopped: {stop_reason} after {state.step} steps, {state.train_seconds:.0f} s of training; "
          f"checkpoint {ckpt_path}", file=sys.stderr)
    if stop_reason == "interrupted":
        print(f"resume with: attn-train --resume --out {out}", file=sys.stderr)
        return {"interrupted": True, "steps": state.step}

    last_eval = state.evals[-1] if state.evals and state.evals[-1]["step"] == state.step else None
    final_model, choice = choose_final_model(model, out, config.average, vocab, val_batches,
                                             model_config.label_smoothing, last_eval)
    from .evaluate import evaluate_translations
    scores, test_hyps = evaluate_translations(final_model, vocab, corpus.test, beam_size=config.beam)
    test_bleu = scores.bleu
    (out / "test_translations.txt").write_text("\n".join(test_hyps) + "\n", encoding="utf-8")
    last = state.evals[-1] if state.evals else {}
    metrics = {"test_bleu": test_bleu, "test_chrf": scores.chrf, "test_bleu_lc": scores.bleu_lc,
               "sacrebleu": scores.signatures, "vocab": "bpe" if vocab.bpe is not None else "word",
               "vocab_size": len(vocab), "val_loss": last.get("val_loss"), "val_bleu": last.get("val_bleu"),
               "val_ppl": last.get("val_ppl"), "steps": state.step, "epochs": state.epoch,
               "train_seconds": round(state.train_seconds, 2),
               "tokens_per_second": round(state.tokens_seen / max(state.train_seconds, 1e-9), 1),
               "backend": B.get_backend(), "preset": config.preset, "parameters": model.num_parameters(),
               "beam": config.beam, "averaged_checkpoints": config.average if final_model is not model else 1,
               **choice,
               "max_tokens": config.max_tokens, "lr_factor": config.lr_factor, "min_freq": config.min_freq,
               "warmup_steps": model_config.warmup_steps,
               "wall_seconds": round(wall_before + time.perf_counter() - started, 2), "stop": stop_reason}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    _plot(out, state)
    print(json.dumps(metrics), file=sys.stderr)
    final_path = out / "averaged.npz" if final_model is not model else ckpt_path
    print(f"test BLEU {test_bleu:.2f}, chrF {scores.chrf:.2f}, lower-cased BLEU {scores.bleu_lc:.2f} "
          f"(sacrebleu {scores.signatures.get('bleu', '-')}; chrF {scores.signatures.get('chrf', '-')})")
    print(f"test BLEU {test_bleu:.2f} ({'beam ' + str(config.beam) if config.beam > 1 else 'greedy'}"
          f"{', average of the last %d snapshots' % config.average if final_model is not model else ''}); "
          f"translate with: attn-translate --checkpoint {final_path} \"a sentence\"")
    return metrics


def choose_final_model(model: Transformer, out: Path, average: int, vocab: Vocab, val_batches, smoothing: float,
                       last_eval: dict | None = None):
    """The model a run is tested with: the last one, or the average of the last ``average``
    snapshots in ``out/snapshots`` (section 6.1: the base models average the last 5 checkpoints).
    A short run's snapshots can span a good part of it, while the model still improves fast: the
    average is used only if its validation loss is no worse than the last model's (``last_eval``,
    the last model's :func:`evaluate_loss`, where the caller has it).

    Returns (the model, a record of the choice for metrics.json: both validation NLLs, or {})."""
    if average <= 1:
        return model, {}
    averaged = average_snapshots(out, average, model, vocab)
    if averaged is None:
        return model, {}
    last = last_eval or evaluate_loss(model, val_batches, smoothing)
    avg = evaluate_loss(averaged, val_batches, smoothing)
    choice = {"val_nll_last": last["val_nll"], "val_nll_averaged": avg["val_nll"]}
    if avg["val_nll"] <= last["val_nll"]:
        return averaged, choice
    print(f"the average of the last {average} snapshots has a higher validation loss "
          f"({avg['val_nll']:.3f}) than the last model ({last['val_nll']:.3f}): testing the last model",
          file=sys.stderr)
    return model, choice


def _check_something_left(config: TrainConfig, state: TrainState) -> None:
    """A resumed run that has already met its stopping rule is an error, not a run of one more step."""
    for name, done, limit in (("steps", state.step, config.steps), ("epochs", state.epoch, config.epochs),
                              ("minutes", state.wall_seconds / 60.0, config.minutes)):
        if limit and done >= limit:
            raise TrainConfigError(f"--resume: the run in {config.out} has already reached --{name} {limit:g} "
                                   f"({done:.4g} done); give a larger --{name} to train on")


def _evaluate_and_save(model, opt, state, vocab, config, corpus, val_batches, model_config, out, bar):
    """Validation loss (and BLEU on the first ``bleu_sentences``), one metrics.jsonl line, a checkpoint."""
    t0 = time.perf_counter()
    record = {"step": state.step, "epoch": state.epoch,
              "train_loss": float(B.host.mean(state.losses[-config.eval_every:])) if state.losses else None,
              "lr": opt.lr(state.step) if state.step else None}
    record.update(evaluate_loss(model, val_batches, model_config.label_smoothing))
    if config.bleu_sentences:
        record["val_bleu"], _ = bleu_on(model, vocab, corpus.val, 1, config.bleu_sentences)
    record["train_seconds"] = round(state.train_seconds, 2)
    record["eval_seconds"] = round(time.perf_counter() - t0, 2)
    state.evals.append(record)
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    save_checkpoint(out / "checkpoint.npz", model, opt, state, vocab, config)
    msg = (f"step {state.step}: val loss {record['val_loss']:.3f}, ppl {record['val_ppl']:.2f}"
           + (f", BLEU {record['val_bleu']:.1f} (first {config.bleu_sentences} val)" if "val_bleu" in record else ""))
    (bar.write if not config.quiet else (lambda m: print(m, file=sys.stderr)))(msg)


def _snapshot(out: Path, model: Transformer, vocab: Vocab, step: int, keep: int) -> None:
    """Parameters only, for checkpoint averaging; the newest ``keep`` are kept."""
    snap = out / "snapshots"
    save_npz(snap / f"step-{step:08d}.npz", model.state_arrays(),
             {"config": model.config.to_dict(), "step": step, "vocab": vocab.to_json()})
    for old in sorted(snap.glob("step-*.npz"))[:-keep]:
        old.unlink()


def average_snapshots(out: Path, k: int, model: Transformer, vocab: Vocab):
    """The parameter-wise mean of the last ``k`` snapshots (section 6.1), as a new model."""
    files = sorted((out / "snapshots").glob("step-*.npz"))[-k:]
    if len(files) < 2:
        return None
    total = None
    for f in files:
        arrays, _ = load_npz(f)
        if total is None:
            total = {k_: a.astype("float64") for k_, a in arrays.items()}
        else:
            for k_, a in arrays.items():
                total[k_] += a
    params = {k_[len("param/"):]: B.to_device(v / len(files), model.dtype) for k_, v in total.items()}
    avg = Transformer(model.config, dtype=model.dtype, params=params)
    avg.save(out / "averaged.npz", extra_meta={"averaged": [f.name for f in files], "vocab": vocab.to_json()})
    return avg


def _plot(out: Path, state: TrainState) -> None:
    from .plot import plot_loss_curve
    plot_loss_curve(state.losses, [(e["step"], e["val_loss"]) for e in state.evals], out / "loss.png")


def _fmt_secs(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 60}:{s % 60:02d}"


# --------------------------------------------------------------------------- command line

_D = TrainConfig()      # the defaults, quoted in the help


def _recipe(name: str) -> str:
    return ", ".join(f"{preset} {r[name]:g}" if not isinstance(r[name], str) else f"{preset} {r[name]}"
                     for preset, r in RECIPES.items())


def build_parser() -> argparse.ArgumentParser:
    """The ``attn-train`` command line. Flags that are not given stay out of the
    namespace (``argparse.SUPPRESS``): :func:`config_from_argv` fills them from
    :class:`TrainConfig`'s defaults, and ``--resume`` knows which ones the user set."""
    p = argparse.ArgumentParser(
        prog="attn-train", argument_default=argparse.SUPPRESS,
        description="Train a Transformer translator. With no arguments: the toy English -> toy-language "
                    "translator in data/toy, on the backend chosen by ATTN_BACKEND (default numpy), "
                    "for at most --minutes of training, writing runs/toy/. "
                    "In Python: attn.train.train(attn.train.TrainConfig(...)), whose fields are these flags.",
        epilog="examples:\n"
               "  attn-train                                   # the toy translator\n"
               "  attn-train --backend cupy                    # the same on a GPU\n"
               "  attn-train --data multi30k --src de --tgt en --preset small --minutes 60\n"
               "  attn-train --tsv deu.txt --preset small      # Tatoeba/Anki pairs: src<TAB>tgt\n"
               "  attn-train --resume --out runs/toy           # continue an interrupted run",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", type=Path,
                   help="folder with {train,val,test}.{SRC,TGT} line-aligned files (default: the toy corpus)")
    g.add_argument("--src", help=f"source language suffix (default: {_D.src})")
    g.add_argument("--tgt", help=f"target language suffix (default: {_D.tgt})")
    g.add_argument("--tsv", type=Path, help="tab-separated pairs file instead of --data; 5%% each held out for val/test")
    g.add_argument("--min-freq", type=int,
                   help=f"drop words seen fewer times in training (-> <unk>; default: the preset's, {_recipe('min_freq')})")
    g.add_argument("--max-len", type=int, help="skip training pairs longer than this many tokens (default: the preset's max_len)")
    g.add_argument("--vocab", choices=["word", "bpe"],
                   help=f"word: words and punctuation as written; bpe: subword pieces learned on both languages "
                        f"(byte-pair encoding; no <unk>) (default: the preset's, {_recipe('vocab')})")
    g.add_argument("--vocab-size", type=int, metavar="N",
                   help=f"with --vocab bpe: the vocabulary's size, e.g. 8000 (default {DEFAULT_BPE_SIZE}); "
                        "with --vocab word: keep the N most frequent (default: all)")
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(PRESETS), help=f"model size (default: {_D.preset})")
    g.add_argument("--d-model", type=int, help="override the preset's d_model")
    g.add_argument("--heads", type=int, help="override the number of attention heads")
    g.add_argument("--d-ff", type=int, help="override the feed-forward width")
    g.add_argument("--layers", type=int, help="override the number of encoder and decoder layers")
    g.add_argument("--dropout", type=float, help="override the residual dropout")
    g.add_argument("--label-smoothing", type=float, help="override label smoothing epsilon")
    g.add_argument("--dtype", choices=["float32", "float64"], help=f"default {_D.dtype}")
    g = p.add_argument_group("training")
    g.add_argument("--backend", choices=["numpy", "cupy", "auto"],
                   help="array backend (default: $ATTN_BACKEND or numpy)")
    g.add_argument("--minutes", type=float,
                   help=f"wall-clock budget for training, in minutes (0: no limit; default {_D.minutes:g})")
    g.add_argument("--steps", type=int, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--epochs", type=int, help="stop after this many epochs (0: no limit)")
    g.add_argument("--max-tokens", type=int,
                   help=f"tokens per batch, padding included (default: the preset's, {_recipe('max_tokens')})")
    g.add_argument("--warmup", type=int,
                   help=f"warm-up steps of the schedule (default: the preset's, or {round(WARMUP_FRACTION * 100)}%% of the "
                        "steps that --minutes/--steps/--epochs allow when that is shorter, with the peak learning "
                        "rate of the preset's schedule; --minutes measures the step time first)")
    g.add_argument("--lr-factor", type=float,
                   help=f"multiplies the section-5.3 learning rate (default: the preset's, {_recipe('lr_factor')}; "
                        "the toy model's d_model of 128 would peak at 4.4e-3 with 1, where it learns markedly slower)")
    g.add_argument("--clip", type=float, help="clip the global gradient norm to this (0: off, the default)")
    g.add_argument("--seed", type=int, help=f"seed for weights, batch order and dropout (default {_D.seed})")
    g.add_argument("--eval-every", type=int,
                   help=f"validate and checkpoint every N steps (default {_D.eval_every})")
    g.add_argument("--bleu-sentences", type=int,
                   help=f"validation sentences translated for the periodic BLEU (0: skip; default {_D.bleu_sentences})")
    g.add_argument("--average", type=int,
                   help="average the parameters of the last K snapshots for the final model, written to "
                        "OUT/averaged.npz and used for the test BLEU (section 6.1; 0 or 1: off; "
                        f"default {_D.average})")
    g.add_argument("--snapshot-every", type=int,
                   help=f"steps between the snapshots that --average uses (default {_D.snapshot_every})")
    g.add_argument("--beam", type=int, help="beam size for the final test translation (1: greedy, the default)")
    g.add_argument("--out", type=Path, help=f"output folder (default {_D.out})")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in OUT from its checkpoint, with its saved settings and seed; "
                        f"only {', '.join(_flag(n) for n in RESUME_MAY_CHANGE[:-3])} may be given anew")
    g.add_argument("--overwrite", action="store_true",
                   help="a fresh run into an OUT that holds a run deletes that run's files first "
                        "(without it, such an OUT is an error)")
    g.add_argument("--reference", action="store_true",
                   help="train with the readable reference layers instead of the faster attn.fast path "
                        "(same numbers up to float rounding, slower)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def config_from_argv(argv=None) -> TrainConfig:
    """The :class:`TrainConfig` that an ``attn-train`` command line asks for.

    Raises SystemExit (argparse's usage message) for an unknown flag and
    :class:`TrainConfigError` for a value out of range."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))


def main(argv=None) -> int:
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    try:
        config = TrainConfig(**given)
    except TrainConfigError as e:
        parser.error(str(e))            # exit status 2, before any work
    try:
        train(config, given=set(given))
    except (DataError, CheckpointError, B.BackendError, FileNotFoundError, TrainConfigError) as e:
        print(f"attn-train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attn-train: aborted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

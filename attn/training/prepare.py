"""Everything a training run needs before its first step: the corpus and its source-wise split,
the vocabulary, the model and optimizer (made by the engine the config names: :mod:`attn.engine`), and the
warm-up fitted to the budget. :func:`prepare` does it all, in that order, for a fresh run or a
resumed one; the loop in :mod:`attn.train` starts from what it returns.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import backend as B
from .. import engine as engines
from ..bpe import MAX_WORD_CHARS
from ..checkpoint import CheckpointError
from ..data import DataError, Vocab, encode_pairs, make_batches, read_parallel, read_tsv, tokenize
from ..loss import cross_entropy
from ..model import PRESETS, Transformer, TransformerConfig
from ..optim import Adam
from ..precision import FP32, Precision
from ..text import split_glue
from .checkpoints import TrainState, check_something_left, state_from_checkpoint
from .config import DEFAULT_BPE_SIZE, EVAL_SHARE, WARMUP_FRACTION, TrainConfig, TrainConfigError


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


@dataclass
class Prepared:
    """What :func:`prepare` hands the loop."""
    config: TrainConfig        # with the recipe filled in
    corpus: "Corpus"
    vocab: Vocab
    engine: object             # the attn.engine engine that made model, opt and loss_fn
    model: Transformer         # the engine's model
    opt: Adam
    state: TrainState          # step 0, or where the resumed run stopped
    train_enc: list            # the training pairs as ids, too long ones left out
    val_batches: list
    loss_fn: object            # loss_fn(logits, targets, eps) -> (loss, dlogits), see step_loss_fn
    warmup_rule: dict | None   # how the warm-up was fitted to the budget (None: not fitted)
    untested: str | None = None    # a resumed run that met its budget but whose test was cut short: why it stopped


def prepare(config: TrainConfig, saved=None, dp=None, say=_stderr) -> Prepared:
    """The corpus, vocabulary, model, optimizer and state of a run, ready for its first step.

    ``saved`` is the checkpoint ``(arrays, meta)`` of a resumed run (its vocabulary, weights,
    Adam moments and position are taken from it) or None for a fresh run (the vocabulary is
    built on the training split, the weights drawn from ``config.seed``, the warm-up fitted to
    the budget). ``dp`` is the data-parallel group (:mod:`attn.training.distributed`) or None;
    it only changes how the step time is measured for the warm-up. ``say`` prints progress.
    The run's ``config`` is the engine's to settle first (:meth:`attn.engine.Engine.settle`: on a
    GPU a feature that fails its probe is switched off); :attr:`Prepared.config` is what runs.
    """
    asked = engines.get(config.engine)
    config = asked.settle(config, say)           # on a GPU: a feature that fails its probe is switched off
    engine = engines.get(config.engine) if config.engine != asked.name else asked   # readable if the probe failed
    loss_fn = engine.loss(trusted=True)          # the engine's step checks the ids; the loop, the loss's finiteness
    corpus = load_corpus(config)
    train_pairs = within_reach(corpus.train, longest_pair(config, config.model_config(2)), config.vocab == "bpe", say)
    if saved is not None:
        arrays, meta = saved
        check_same_corpus(corpus, meta, Path(config.out) / "checkpoint.npz", config.allow_new_corpus)
        vocab = Vocab.from_json(meta["vocab"])
        model = Transformer.from_arrays(arrays, meta, source=str(Path(config.out) / "checkpoint.npz"))
        if len(vocab) != model.config.target_vocab_size:
            raise CheckpointError(f"--resume: {Path(config.out) / 'checkpoint.npz'}: the vocabulary has {len(vocab)} "
                                  f"tokens, the model {model.config.target_vocab_size}")
        model, opt = make_engine(model, engine, schedule_factor(config, model.config), config.precision,
                                 config.cooldown, config.attention)
        opt.load_state(arrays, meta["step"])
        state = state_from_checkpoint(arrays, meta)
        untested = check_something_left(config, state)
        say(f"resumed from {Path(config.out) / 'checkpoint.npz'} at step {state.step} "
            f"(epoch {state.epoch}, batch {state.batch_index})")
    else:
        t_vocab = time.perf_counter()
        vocab = build_vocab(train_pairs, config.min_freq, config.vocab, config.vocab_size)
        if vocab.bpe is not None:
            say(f"attn-train: learned {len(vocab.bpe.merges)} BPE merges on the training text in "
                f"{time.perf_counter() - t_vocab:.1f} s")
        model, opt = make_engine(Transformer(config.model_config(len(vocab)), seed=config.seed, dtype=config.dtype),
                                 engine, config.lr_factor, config.precision, config.cooldown, config.attention)
        state = TrainState()

    model_config = model.config
    max_len = longest_pair(config, model_config)
    train_enc = encode_pairs(train_pairs, vocab, max_len=max_len)
    if not train_enc:
        raise DataError(f"{corpus.source}: no training pair is left of {len(corpus.train)}: every one is empty on "
                        f"a side or longer than {max_len} tokens (--max-len; the preset's max_len is "
                        f"{model_config.max_len})")
    val_batches = make_batches(encode_pairs(corpus.val, vocab, max_len=max_len), config.max_tokens, shuffle=False)
    warmup_rule = None
    if saved is None and config.warmup is None and (config.minutes or config.steps or config.epochs):
        model, opt, model_config, warmup_rule = fit_warmup(model, model_config, config, train_enc, engine, dp)
        state.wall_seconds += warmup_rule.get("probe_seconds", 0.0)
    return Prepared(config, corpus, vocab, engine, model, opt, state, train_enc, val_batches, loss_fn, warmup_rule,
                    untested if saved is not None else None)


def within_reach(pairs: list, limit: int, bpe: bool, say) -> list:
    """The pairs whose sides could be at most ``limit`` tokens, decided on their words before any
    vocabulary is learned: a word is at least one token, and at least one BPE piece per
    :data:`attn.bpe.MAX_WORD_CHARS` characters. The others would be skipped anyway once encoded;
    leaving them out first spares learning and encoding them (a 1 MB line: minutes)."""
    def least(text: str) -> int:
        words = tokenize(text)
        return sum(-(-len(split_glue(w)[0]) // MAX_WORD_CHARS) for w in words) if bpe else len(words)
    kept = [p for p in pairs if least(p[0]) <= limit and least(p[1]) <= limit]
    if len(kept) < len(pairs):
        say(f"attn-train: left out {len(pairs) - len(kept)} training pair(s) longer than {limit} tokens "
            f"(--max-len) before learning the vocabulary")
    return kept


def longest_pair(config: TrainConfig, model_config: TransformerConfig) -> int:
    """The most tokens a training sentence may have (``max_len``, at most the model's): a sentence
    of n tokens takes n + 1 positions (EOS on the source, BOS on the target input)."""
    return min(config.max_len or model_config.max_len, model_config.max_len - 1)


# --------------------------------------------------------------------------- corpus and vocabulary

@dataclass
class Corpus:
    """Raw sentence pairs of the three splits and where they came from."""
    train: list
    val: list
    test: list
    source: str

    @functools.cached_property
    def fingerprint(self) -> dict:
        """What a checkpoint records of the training split: its pairs' count and their SHA-256, so
        that a resumed run notices that its corpus changed (:func:`check_same_corpus`)."""
        h = hashlib.sha256()
        for pair in self.train:
            h.update(json.dumps(pair, ensure_ascii=False).encode("utf-8") + b"\n")
        return {"train_pairs": len(self.train), "sha256": h.hexdigest()}


def check_same_corpus(corpus: Corpus, meta: dict, checkpoint: Path, allow_new: bool) -> None:
    """A :class:`CheckpointError` when the checkpoint's run trained on another corpus than ``corpus``
    (its recorded fingerprint differs) and ``allow_new`` is off; a checkpoint without one (written
    before runs recorded it) resumes."""
    saved = meta.get("corpus")
    if allow_new or not isinstance(saved, dict) or saved.get("sha256") in (None, corpus.fingerprint["sha256"]):
        return
    now = corpus.fingerprint
    raise CheckpointError(f"--resume: the corpus {corpus.source} is not the one the run in {checkpoint.parent} "
                          f"trained on ({saved.get('train_pairs')} training pairs, sha256 {saved['sha256'][:12]}; "
                          f"now {now['train_pairs']}, sha256 {now['sha256'][:12]}): words it never saw become "
                          "<unk>. Resume on the same files, or pass --allow-new-corpus to continue on these")


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


# --------------------------------------------------------------------------- model and optimizer

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


def make_engine(model: Transformer, engine, lr_factor: float, precision=FP32, cooldown: float = 0.0,
                attention: str = "auto"):
    """The model and optimizer that train: ``engine``'s (an :mod:`attn.engine` engine or its name,
    ``"fast"`` or ``"reference"``), over ``model``'s config and parameters (shared, not copied),
    its products at ``precision`` (:class:`attn.precision.Precision` or its name), the optimizer's
    rate ending with ``cooldown`` (:func:`attn.optim.cooldown_scale`). The fast
    engine computes the reference's numbers (tests/test_fast.py checks that) with fewer passes
    over memory. The fast model does not check token ids: its engine's step
    (:func:`attn.fast.training.loop.loop_step`) checks each batch on the host (on a GPU the model's check
    would wait for the device); the readable model checks them in its layers. ``attention``: the
    fast engine's (:mod:`attn.fast.core.flash`; the reference engine has the plain one alone)."""
    engine = engines.get(engine) if isinstance(engine, str) else engine
    model = engine.model(model.config, dtype=model.dtype, params=model.params, precision=Precision.of(precision),
                         check_ids=False)
    if attention != "auto":
        if not hasattr(model, "attention"):
            raise ValueError(f"make_engine: attention={attention!r} chooses the fast engine's attention "
                             f"(attn.fast.core.flash); the {engine.name} engine has the plain one alone")
        model.attention = attention
    return model, engine.optimizer(model, lr_factor, cooldown)


def step_loss_fn(engine):
    """The loss the trainer's steps use: ``engine``'s (or the engine's name), which need not
    re-check the ids (the engine's step did: :meth:`attn.engine.Engine.loop_step`) nor the loss's finiteness
    (the loop checks it when the losses come to the host), so a step never waits for the device."""
    return (engines.get(engine) if isinstance(engine, str) else engine).loss(trusted=True)


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


def fit_warmup(model: Transformer, model_config: TransformerConfig, config: TrainConfig, train_enc, engine,
               dp=None):
    """The warm-up for a run with a budget and no ``warmup`` given: :data:`WARMUP_FRACTION` of the
    steps the budget allows (the least of ``steps``, ``epochs`` times the batches of an epoch, and
    ``minutes`` at the step time measured now), if that is shorter than the preset's.

    ``engine`` (an :mod:`attn.engine` engine or its name) makes the model and optimizer of the
    fitted schedule and the loss the step time is measured with.

    With a data-parallel group ``dp`` every rank times its own share of the batches, and all
    take rank 0's time, so that every rank fits the same schedule.

    Returns (model, optimizer, model config, a record of the rule for config.json); the model's
    parameters are unchanged, only the schedule's warm-up."""
    t0 = time.perf_counter()
    engine = engines.get(engine) if isinstance(engine, str) else engine
    batches = make_batches(train_enc, config.max_tokens, shuffle=True, seed=config.seed)
    allowed, rule, why = math.inf, {}, ""
    for limit, what in ((config.steps, f"--steps {config.steps}"),
                        (config.epochs * len(batches), f"--epochs {config.epochs} of {len(batches)} steps")):
        if limit and limit < allowed:
            allowed, why = limit, what
    if config.minutes:
        batches = batches[:3]
        if dp is not None:
            batches = [dp.share(b)[0] for b in batches]
        per_step = 1.05 * measure_step_seconds(model, batches, model_config.label_smoothing, engine.loss(trusted=True))
        if dp is not None:
            per_step = dp.broadcast(per_step)
        by_time = config.minutes * 60.0 * (1.0 - EVAL_SHARE) / per_step
        if by_time < allowed:
            allowed = by_time
            why = (f"an estimated {by_time:.0f} steps in --minutes {config.minutes:g}, from {per_step:.2f} s a step "
                   f"timed on {len(batches)} step{'s' if len(batches) > 1 else ''} before training")
        rule.update(seconds_per_step=round(per_step, 4), probe_seconds=round(time.perf_counter() - t0, 2))
    warmup = max(1, min(model_config.warmup_steps, round(WARMUP_FRACTION * allowed)))
    why = (f"{WARMUP_FRACTION:.0%} of {why}" if warmup < model_config.warmup_steps
           else f"the preset's; {why} allow it")
    rule.update(steps_allowed=round(allowed), fraction=WARMUP_FRACTION, preset_warmup=model_config.warmup_steps,
                warmup_steps=warmup, why=why)
    if warmup == model_config.warmup_steps:            # the model stands; only the schedule's factor is made
        opt = engine.optimizer(model, schedule_factor(config, model_config), config.cooldown)
    else:
        model_config = dataclasses.replace(model_config, warmup_steps=warmup)
        model, opt = make_engine(Transformer(model_config, dtype=model.dtype, params=model.params), engine,
                                 schedule_factor(config, model_config), config.precision, config.cooldown,
                                 config.attention)
    rule.update(peak_lr=opt.lr(warmup), schedule_factor=opt.lr_factor)
    return model, opt, model_config, rule

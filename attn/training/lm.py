"""A language model's run (``attn-train --task lm``): the text and its split, the vocabulary,
the batches of windows, the model (a decoder-only stack of the block, :mod:`attn.model`), its
validation and its report. The loop, the step, the checkpoints and ``--resume`` are the
translator's (:mod:`attn.train`, :mod:`attn.training.checkpoints`).

nanoGPT's recipe: the text's first 90 % trains and its last 10 % validates; a step reads
``batch`` windows of ``context + 1`` tokens at random places of the training text, the model
predicting each window's tokens 1.. from those before them. An epoch is as many windows as the
text has tokens, drawn from ``(seed, epoch)``, so a resumed run draws the same batches.
"""
from __future__ import annotations

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
from ..checkpoint import CheckpointError, write_text_atomic
from ..data import Batch, DataError, Vocab, char_vocab, encode_text, read_text
from ..loss import cross_entropy
from ..model import Transformer
from .checkpoints import TrainState, check_something_left, save_checkpoint, state_from_checkpoint
from .config import DEFAULT_BPE_SIZE, DEFAULT_TEXT, TrainConfig, TrainConfigError
from .prepare import make_engine, schedule_factor

#: The share of the text, at its end, that validates (nanoGPT's).
VAL_FRACTION = 0.1
#: The most validation windows an evaluation reads (evenly spread over the validation text).
MAX_VAL_WINDOWS = 512


@dataclass
class TextCorpus:
    """A text as ids, split into its training and validation parts; where it came from."""
    train: object              # host int64 (N,)
    val: object                # host int64 (M,)
    source: str
    characters: int            # of the whole text

    @functools.cached_property
    def fingerprint(self) -> dict:
        """What a checkpoint records of the training ids: their count and SHA-256."""
        return {"train_tokens": int(self.train.size), "sha256": hashlib.sha256(self.train.tobytes()).hexdigest()}


def load_text(config: TrainConfig, vocab: Vocab | None, say) -> tuple[TextCorpus, Vocab]:
    """The text of ``config.text`` (default: tiny Shakespeare) as ids in ``vocab`` (None: built:
    its characters, or BPE pieces learned on the training part), split 90/10."""
    path = Path(config.text) if config.text is not None else DEFAULT_TEXT
    text = read_text(path)
    cut = int(len(text) * (1 - VAL_FRACTION))
    if vocab is None:
        vocab = char_vocab(text) if config.char else _bpe_vocab(text[:cut], config.vocab_size, say)
    np = B.host
    ids = np.asarray(encode_text(text[:cut], vocab, config.char), dtype="int64")
    val = np.asarray(encode_text(text[cut:], vocab, config.char), dtype="int64")
    for name, part in (("training", ids), ("validation", val)):
        if part.size < config.context + 1:
            raise DataError(f"{path}: its {name} part holds {part.size} tokens, fewer than one window of "
                            f"--context {config.context} and the token after it")
    return TextCorpus(ids, val, str(path), len(text)), vocab


def _bpe_vocab(text: str, size: int | None, say) -> Vocab:
    t0 = time.perf_counter()
    try:
        vocab = Vocab.build_bpe(text.split("\n"), size if size is not None else DEFAULT_BPE_SIZE)
    except ValueError as e:
        raise TrainConfigError(f"vocab_size (--vocab-size): {e}") from None
    say(f"attn-train: learned {len(vocab.bpe.merges)} BPE merges on the training text in "
        f"{time.perf_counter() - t0:.1f} s")
    return vocab


def window_batch(ids, starts, context: int) -> Batch:
    """The windows of ``ids`` at ``starts`` (B,): inputs ``ids[s:s+context]`` (B, T), targets one
    token further, as a :class:`attn.data.Batch` with no source."""
    np = B.host
    rows = ids[np.asarray(starts)[:, None] + np.arange(context + 1)]              # (B, T + 1)
    return Batch(None, rows[:, :-1], rows[:, 1:], 0, int(rows[:, 1:].size))


class Windows:
    """One epoch's batches: ``len(ids) // (batch * context)`` of them (as many tokens as the
    text, about), each ``batch`` windows at places drawn from ``(seed, epoch)``."""

    def __init__(self, ids, context: int, batch: int, seed: int, epoch: int):
        n = max(1, ids.size // (batch * context))
        self.ids, self.context = ids, context
        self.starts = B.host_rng(seed * 1_000_003 + epoch).integers(0, ids.size - context, (n, batch))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Batch:
        return window_batch(self.ids, self.starts[i], self.context)


def val_batches(ids, context: int, rows: int = 32) -> list:
    """The validation text's windows, one every ``context`` tokens (at most
    :data:`MAX_VAL_WINDOWS`, evenly spread), ``rows`` a batch."""
    np = B.host
    starts = np.arange(0, ids.size - context, context)
    if starts.size > MAX_VAL_WINDOWS:
        starts = starts[np.linspace(0, starts.size - 1, MAX_VAL_WINDOWS).astype("int64")]
    return [window_batch(ids, starts[i:i + rows], context) for i in range(0, starts.size, rows)]


@dataclass
class PreparedLM:
    """What :func:`prepare_lm` hands the loop."""
    config: TrainConfig
    corpus: TextCorpus
    vocab: Vocab
    engine: object
    model: Transformer
    opt: object
    state: TrainState
    val_batches: list
    loss_fn: object
    untested: str | None = None


def prepare_lm(config: TrainConfig, saved=None, say=print) -> PreparedLM:
    """The text, vocabulary, model, optimizer and state of a language model's run; ``saved`` the
    checkpoint ``(arrays, meta)`` of a resumed run, or None."""
    engine = engines.get(config.engine)
    untested = None
    if saved is not None:
        arrays, meta = saved
        path = Path(config.out) / "checkpoint.npz"
        corpus, vocab = load_text(config, Vocab.from_json(meta["vocab"]), say)
        check_same_text(corpus, meta, path, config.allow_new_corpus)
        model = Transformer.from_arrays(arrays, meta, source=str(path))
        model, opt = make_engine(model, engine, schedule_factor(config, model.config), config.precision,
                                 config.cooldown, config.attention)
        opt.load_state(arrays, meta["step"])
        state = state_from_checkpoint(arrays, meta)
        untested = check_something_left(config, state)
        say(f"resumed from {path} at step {state.step} (epoch {state.epoch}, batch {state.batch_index})")
    else:
        corpus, vocab = load_text(config, None, say)
        model, opt = make_engine(Transformer(config.model_config(len(vocab)), seed=config.seed, dtype=config.dtype),
                                 engine, config.lr_factor, config.precision, config.cooldown, config.attention)
        state = TrainState()
    return PreparedLM(config, corpus, vocab, engine, model, opt, state, val_batches(corpus.val, config.context),
                      engine.loss(trusted=True), untested)


def check_same_text(corpus: TextCorpus, meta: dict, checkpoint: Path, allow_new: bool) -> None:
    """A CheckpointError when the run in ``checkpoint`` trained on other ids than ``corpus``'s."""
    saved = meta.get("corpus")
    if allow_new or not isinstance(saved, dict) or saved.get("sha256") == corpus.fingerprint["sha256"]:
        return
    raise CheckpointError(f"--resume: the text {corpus.source} is not the one the run in {checkpoint.parent} "
                          f"trained on ({saved.get('train_tokens')} training tokens; now "
                          f"{corpus.fingerprint['train_tokens']}). Resume on the same text, or pass "
                          "--allow-new-corpus to continue on this one")


def validate(model, batches) -> dict:
    """Mean cross-entropy per token over ``batches`` (no dropout): ``val_loss`` (nats),
    ``val_ppl``, ``val_bits_per_token``."""
    total = n = 0.0
    for b in batches:
        logits, _ = model.forward(None, B.to_device(b.tgt_in))
        total += B.to_float(cross_entropy(logits, B.to_device(b.tgt_out), 0.0)[0]) * b.n_tgt_tokens
        n += b.n_tgt_tokens
    loss = total / max(n, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_bits_per_token": loss / math.log(2)}


def evaluate_and_save(run: PreparedLM, state: TrainState, out: Path, bar) -> None:
    """Validation, one metrics.jsonl line, a checkpoint (as the translator's evaluation)."""
    t0 = time.perf_counter()
    record = {"step": state.step, "epoch": state.epoch,
              "train_loss": float(B.host.mean(state.losses[-run.config.eval_every:])) if state.losses else None,
              "lr": run.opt.lr(state.step) if state.step else None}
    record.update(validate(run.model, run.val_batches))
    if run.config.char:
        record["val_bpc"] = record["val_bits_per_token"]          # bits per character
    record.update(train_seconds=round(state.train_seconds, 2), wall_seconds=round(state.wall_seconds, 2),
                  eval_seconds=round(time.perf_counter() - t0, 2))
    state.evals.append(record)
    save_checkpoint(out / "checkpoint.npz", run.model, run.opt, state, run.vocab, run.config, run.corpus)
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    msg = f"step {state.step}: val loss {record['val_loss']:.4f}, " + (
        f"{record['val_bpc']:.3f} bits per character" if run.config.char else f"ppl {record['val_ppl']:.2f}")
    (bar.write if not run.config.quiet else (lambda m: print(m, file=sys.stderr)))(msg)


def report(run: PreparedLM, state: TrainState, stop_reason: str) -> dict:
    """The end of a run: ``out/metrics.json`` (returned) and the loss curve."""
    from .evaluation import plot_losses
    out, config = Path(run.config.out), run.config
    last = state.evals[-1] if state.evals else {}
    metrics = {"task": "lm", "val_loss": last.get("val_loss"), "val_ppl": last.get("val_ppl"),
               **({"val_bpc": last.get("val_bpc")} if config.char else {}),
               "steps": state.step, "epochs": state.epoch, "train_seconds": round(state.train_seconds, 2),
               "seconds_per_step": round(state.train_seconds / max(state.step, 1), 4),
               "tokens_per_second": round(state.tokens_seen / max(state.train_seconds, 1e-9), 1),
               "backend": B.get_backend(), "preset": config.preset, "parameters": run.model.num_parameters(),
               "text": run.corpus.source, "vocab": "char" if config.char else "bpe", "vocab_size": len(run.vocab),
               "context": config.context, "batch": config.batch, "lr_factor": config.lr_factor,
               "warmup_steps": run.model.config.warmup_steps, "wall_seconds": round(state.wall_seconds, 2),
               "stop": stop_reason}
    write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    plot_losses(out, state)
    print(f"validation loss {metrics['val_loss']:.4f}"
          + (f", {metrics['val_bpc']:.3f} bits per character" if config.char else f", perplexity {metrics['val_ppl']:.2f}")
          + f" (every figure in {out / 'metrics.json'}); generate with: attn-generate --checkpoint "
          f"{out / 'checkpoint.npz'} --prompt 'ROMEO:'")
    return metrics

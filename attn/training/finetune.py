"""Fine-tuning a trained translator on another corpus (``attn-train --resume-from CHECKPOINT``):
every weight (full fine-tuning), or, with ``--lora RANK``, LoRA adapters alone with the weights
frozen (:mod:`attn.lora`; lesson 29). The base checkpoint gives the weights and the vocabulary
(the new corpus is encoded with it: words it never had become ``<unk>``); the loop, its budget
and its Ctrl-C are the trainer's (:func:`attn.train.run_loop`).

Adam runs at a constant rate, ``--lr-factor`` times the peak of the base run's schedule (its
config's warm-up), and falls over the recipe's cooldown. ``out`` gets ``adapter.npz`` (LoRA: the adapters alone, their
size stated) or ``checkpoint.npz`` (full fine-tuning: the whole model and its vocabulary), and
``metrics.json`` with the validation loss and BLEU of the new corpus before and after.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import backend as B
from ..checkpoint import write_text_atomic
from ..data import Vocab, encode_pairs, make_batches
from ..evaluate import evaluate_bleu
from ..lora import Adapter, LoraModel, adapter_bytes, parse_targets, trained_fraction
from ..model import Transformer
from ..optim import Adam, noam_lr
from ..quantize import Int8TrainingError, refuse_training
from .checkpoints import TrainState, start_writing
from .config import TrainConfig, TrainConfigError
from .evaluation import evaluate_loss
from .prepare import load_corpus, longest_pair


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def trainable(config: TrainConfig, base):
    """What the optimizer trains: a :class:`~attn.lora.LoraModel` on ``base`` with ``--lora``, else
    ``base`` itself (full fine-tuning)."""
    if config.lora is None:
        return base
    adapter = Adapter(config.lora, parse_targets(config.lora_targets), config.lora_alpha)
    return LoraModel(base, adapter, seed=config.seed)


def decoder_of(model):
    """The plain Transformer that decodes: the merged one of a LoRA model."""
    return model.merged() if isinstance(model, LoraModel) else model


def scores(model, vocab, val_batches, pairs, config: TrainConfig, smoothing: float) -> dict:
    """Validation loss of ``model`` and greedy BLEU on ``config.bleu_sentences`` of ``pairs``."""
    plain = decoder_of(model)
    out = evaluate_loss(plain, val_batches, smoothing)
    if config.bleu_sentences and pairs:
        out["val_bleu"] = evaluate_bleu(plain, vocab, pairs[:config.bleu_sentences], beam_size=1)[0]
    return out


def save(model, vocab, out: Path, config: TrainConfig) -> Path:
    """The adapter alone (LoRA) or the whole model with its vocabulary (full fine-tuning)."""
    record = {"vocab": vocab.to_json(), "resume_from": str(config.resume_from)}
    if isinstance(model, LoraModel):
        return model.save(out / "adapter.npz", record)
    return model.save(out / "checkpoint.npz", extra_meta={**record, "format": "attn-checkpoint-1"})


@dataclass
class FineTune:
    """What :func:`prepare_finetune` hands the trainer's loop (:func:`attn.train.run_loop`)."""
    config: TrainConfig
    base: Transformer
    model: object              # the base itself, or a LoraModel on it
    vocab: Vocab
    opt: Adam
    train_enc: list
    val_batches: list
    val_pairs: list
    before: dict               # the new corpus's validation figures before the first step
    state: TrainState
    started: float

    def evaluate(self, bar=None) -> None:
        """The validation loss into ``metrics.jsonl``, and the adapter (or model) saved."""
        record = {"step": self.state.step, **evaluate_loss(decoder_of(self.model), self.val_batches,
                                                           self.base.config.label_smoothing)}
        self.state.evals.append(record)
        write_text_atomic(Path(self.config.out) / "metrics.jsonl",
                          "".join(json.dumps(e) + "\n" for e in self.state.evals))
        self.save()

    def save(self) -> Path:
        return save(self.model, self.vocab, Path(self.config.out), self.config)

    def finish(self, stop_reason: str) -> dict:
        path = self.save()
        after = scores(self.model, self.vocab, self.val_batches, self.val_pairs, self.config,
                       self.base.config.label_smoothing)
        return report(self.config, self.model, self.base, path, self.before, after, self.state, stop_reason,
                      time.perf_counter() - self.started)


def prepare_finetune(config: TrainConfig, dp) -> FineTune:
    """The base checkpoint, the new corpus encoded with its vocabulary, what trains and its
    optimizer, and the new corpus's figures before training (``config``: ``resume_from`` set,
    the recipe filled in)."""
    from ..translate import load_translator
    if dp.size > 1:
        raise TrainConfigError("resume_from (--resume-from) fine-tunes in one process: run it without mpiexec")
    B.set_backend(config.backend)
    base, vocab = load_translator(config.resume_from)
    if config.lora is None:                     # LoRA trains its adapters alone: an int8 base stays frozen
        try:
            refuse_training(base.params, f"resume_from (--resume-from) {config.resume_from}")
        except Int8TrainingError as e:
            raise TrainConfigError(str(e)) from None
    corpus, out = load_corpus(config), Path(config.out)
    max_len = longest_pair(config, base.config)
    train_enc = encode_pairs(corpus.train, vocab, max_len=max_len)
    val_batches = make_batches(encode_pairs(corpus.val, vocab, max_len=max_len), config.max_tokens, shuffle=False)
    if not train_enc or not val_batches:
        raise TrainConfigError(f"{corpus.source}: no training or validation pair fits the checkpoint's "
                               f"{max_len} tokens")
    model = trainable(config, base)
    rate = config.lr_factor * noam_lr(base.config.warmup_steps, base.config.d_model, base.config.warmup_steps)
    opt = Adam(model.params, base.config.d_model, lr=rate, cooldown=config.cooldown or 0.0)
    start_writing(out, config.overwrite, {"model": base.config.to_dict(), "train": config.to_dict(),
                                          "corpus": corpus.source, "train_pairs": len(train_enc)}, _say)
    what = (f"LoRA rank {config.lora} on {config.lora_targets} of every attention, the weights frozen"
            if isinstance(model, LoraModel) else "every weight (full fine-tuning)")
    total = sum(int(v.size) for v in base.params.values())
    _say(f"attn-train: fine-tuning {config.resume_from} on {corpus.source} ({len(train_enc)} training pairs): "
         f"{what}; {model.num_parameters():,} of {total:,} parameters trained "
         f"({100 * model.num_parameters() / total:.2f}%), Adam at {rate:.2e}")
    started = time.perf_counter()
    before = scores(model, vocab, val_batches, corpus.val, config, base.config.label_smoothing)
    _say(f"before: validation loss {before['val_loss']:.3f}" + (f", BLEU {before['val_bleu']:.2f}"
                                                                  if "val_bleu" in before else ""))
    return FineTune(config, base, model, vocab, opt, train_enc, val_batches, corpus.val, before, TrainState(),
                    started)


def report(config, model, base, path: Path, before: dict, after: dict, state, stop_reason: str,
           seconds: float) -> dict:
    """The run's figures to ``out/metrics.json`` and stderr: what was trained, its size, the new
    corpus's validation loss and BLEU before and after."""
    metrics = {"resume_from": str(config.resume_from), "lora": config.lora, "lora_targets": config.lora_targets,
               "trained_parameters": model.num_parameters(),
               "base_parameters": sum(int(v.size) for v in base.params.values()),
               "steps": state.step, "stop": stop_reason, "wall_seconds": round(seconds, 2),
               "train_seconds": round(state.train_seconds, 2),
               "before": before, "after": after, "saved": str(path), "saved_bytes": path.stat().st_size}
    if isinstance(model, LoraModel):
        metrics.update(trained_fraction=trained_fraction(model), adapter_bytes=adapter_bytes(model),
                       lora_alpha=model.adapter.scale_alpha)
        _say(f"adapter: {model.num_parameters():,} parameters ({100 * trained_fraction(model):.2f}% of the "
             f"model's {metrics['base_parameters']:,}), {adapter_bytes(model):,} bytes of numbers, "
             f"{metrics['saved_bytes']:,} bytes in {path}")
        _say(f"translate with: attn-translate --checkpoint {config.resume_from} --adapter {path} \"a sentence\"")
    write_text_atomic(Path(config.out) / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    _say(f"stopped: {stop_reason} after {state.step} steps; validation loss {before['val_loss']:.3f} -> "
         f"{after['val_loss']:.3f}" + (f", BLEU {before['val_bleu']:.2f} -> {after['val_bleu']:.2f}"
                                       if "val_bleu" in after else ""))
    return metrics

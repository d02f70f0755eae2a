"""How a run is judged: validation loss and BLEU during training (:func:`evaluate_and_save`,
which also writes the checkpoint), and at the end the test split translated by the final model
(:func:`test_and_report`, which writes ``metrics.json``).
"""
from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path

from .. import backend as B
from ..checkpoint import write_text_atomic
from ..data import Vocab
from ..evaluate import evaluate_bleu, evaluate_translations
from ..loss import cross_entropy
from ..model import Transformer
from .checkpoints import TrainState, average_snapshots, save_checkpoint


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
    pairs = pairs[:limit] if limit else pairs
    bleu, hyps = evaluate_bleu(model, vocab, pairs, beam_size=beam)
    return bleu, hyps


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
    print(f"the average of the last {average} snapshots has a higher validation loss without label smoothing "
          f"({avg['val_nll']:.3f}) than the last model ({last['val_nll']:.3f}): testing the last model",
          file=sys.stderr)
    return model, choice


def evaluate_and_save(model, opt, state, vocab, config, corpus, val_batches, model_config, out, bar):
    """Validation loss (and BLEU on the first ``bleu_sentences``), one metrics.jsonl line, a checkpoint."""
    t0 = time.perf_counter()
    record = {"step": state.step, "epoch": state.epoch,
              "train_loss": float(B.host.mean(state.losses[-config.eval_every:])) if state.losses else None,
              "lr": opt.lr(state.step) if state.step else None, "lr_scale": opt.scale}
    record.update(evaluate_loss(model, val_batches, model_config.label_smoothing))
    if config.bleu_sentences:
        record["val_bleu"], _ = bleu_on(model, vocab, corpus.val, 1, config.bleu_sentences)
    record["train_seconds"] = round(state.train_seconds, 2)
    record["wall_seconds"] = round(state.wall_seconds, 2)          # of the budget, before this evaluation
    record["eval_seconds"] = round(time.perf_counter() - t0, 2)
    state.evals.append(record)
    save_checkpoint(out / "checkpoint.npz", model, opt, state, vocab, config, corpus)
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:     # after the checkpoint: never ahead of it
        f.write(json.dumps(record) + "\n")
    smoothing = (f" (with label smoothing {model_config.label_smoothing:g}; without {record['val_nll']:.3f})"
                 if model_config.label_smoothing else "")
    msg = (f"step {state.step}: val loss {record['val_loss']:.3f}{smoothing}, ppl {record['val_ppl']:.2f}"
           + (f", BLEU {record['val_bleu']:.1f} (first {config.bleu_sentences} val)" if "val_bleu" in record else ""))
    (bar.write if not config.quiet else (lambda m: print(m, file=sys.stderr)))(msg)


def plot_losses(out: Path, state: TrainState) -> None:
    from ..plot import plot_loss_curve      # matplotlib: imported when a run ends
    plot_loss_curve(state.losses, [(e["step"], e["val_loss"]) for e in state.evals], out / "loss.png")


def test_and_report(run, model, state: TrainState, stop_reason: str, wall_seconds: float, extra: dict) -> dict:
    """The end of a run: the final model (the last, or the average of the last snapshots:
    :func:`choose_final_model`) translates the test split; BLEU and chrF, the run's figures and
    ``extra`` go to ``out/metrics.json``, which is returned; the loss curve to ``out/loss.png``.
    ``run`` is what :func:`attn.training.prepare.prepare` made."""
    config, vocab, out = run.config, run.vocab, Path(run.config.out)
    model_config = model.config
    last_eval = state.evals[-1] if state.evals and state.evals[-1]["step"] == state.step else None
    final_model, choice = choose_final_model(model, out, config.average, vocab, run.val_batches,
                                             model_config.label_smoothing, last_eval)
    scores, test_hyps = evaluate_translations(final_model, vocab, run.corpus.test, config.decoding,
                                              progress=not config.quiet)
    test_bleu = scores.bleu
    write_text_atomic(out / "test_translations.txt", "\n".join(test_hyps) + "\n")
    last = state.evals[-1] if state.evals else {}
    metrics = {"test_bleu": test_bleu, "test_chrf": scores.chrf, "test_bleu_lc": scores.bleu_lc,
               "sacrebleu": scores.signatures, "vocab": "bpe" if vocab.bpe is not None else "word",
               "vocab_size": len(vocab), "val_loss": last.get("val_loss"), "val_bleu": last.get("val_bleu"),
               "val_ppl": last.get("val_ppl"), "steps": state.step, "epochs": state.epoch,
               "train_seconds": round(state.train_seconds, 2),
               "tokens_per_second": round(state.tokens_seen / max(state.train_seconds, 1e-9), 1),
               "backend": B.get_backend(), "preset": config.preset, "parameters": model.num_parameters(),
               "beam": config.beam, "alpha": config.alpha, "no_repeat_ngram": config.no_repeat_ngram,
               "averaged_checkpoints": config.average if final_model is not model else 1,
               **choice,
               "max_tokens": config.max_tokens, "lr_factor": config.lr_factor, "min_freq": config.min_freq,
               "warmup_steps": model_config.warmup_steps,
               "wall_seconds": round(wall_seconds, 2), "stop": stop_reason, **extra}
    write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    plot_losses(out, state)
    final_path = out / "averaged.npz" if final_model is not model else out / "checkpoint.npz"
    how = ", ".join([f"beam {config.beam}, alpha {config.alpha:g}" if config.beam > 1 else "greedy"]
                    + ([f"no repeated {config.no_repeat_ngram}-gram"] if config.no_repeat_ngram else [])
                    + ([f"average of the last {config.average} snapshots"] if final_model is not model else []))
    print(f"test BLEU {test_bleu:.2f}, chrF {scores.chrf:.2f} ({how}; every figure in {out / 'metrics.json'})")
    print(f"translate with: attn-translate --checkpoint {shlex.quote(str(final_path))}"
          + (f" --beam {config.beam} --alpha {config.alpha:g}" if config.beam > 1 else "")
          + (f" --no-repeat-ngram {config.no_repeat_ngram}" if config.no_repeat_ngram else "") + ' "a sentence"')
    return metrics

"""The trainer and the ``attn-train`` command.

With no arguments it trains the toy translator (``data/toy``, English -> toy
language) on the default backend and writes, under ``--out``:

    checkpoint.npz   model, Adam moments, schedule step, data position, vocabulary, config
    config.json      the model config and the training arguments
    metrics.jsonl    one JSON object per evaluation (step, losses, perplexity, BLEU, ...)
    metrics.json     the final summary (test_bleu, val_loss, steps, train_seconds, ...)
    loss.png         training and validation loss against steps

One training step (section 5): forward, label-smoothed cross-entropy, backward,
optional gradient clipping, Adam with the warm-up schedule. Everything random
is a function of ``--seed``: the batch order of epoch ``e`` comes from
``seed + e`` and the dropout masks of step ``s`` from ``(seed, s)``, so a run
resumed from a checkpoint repeats the uninterrupted run's losses exactly.
"""
from __future__ import annotations

import argparse
import json
import math
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
from .optim import Adam, clip_grad_norm

DEFAULT_DATA = Path(__file__).resolve().parent.parent / "data" / "toy"


# --------------------------------------------------------------------------- data

@dataclass
class Corpus:
    """Raw sentence pairs of the three splits and where they came from."""
    train: list
    val: list
    test: list
    source: str


def load_corpus(args) -> Corpus:
    """The three splits from ``--tsv FILE`` or ``--data DIR --src L1 --tgt L2``."""
    if args.tsv:
        pairs = read_tsv(args.tsv)
        if len(pairs) < 3:
            raise DataError(f"{args.tsv}: need at least 3 sentence pairs to split into train/val/test, got {len(pairs)}")
        # A held-out slice, deterministic in the seed: 5% (at most 1000) each for val and test.
        order = B.host_rng(args.seed).permutation(len(pairs))
        n_hold = max(1, min(1000, len(pairs) // 20))
        val = [pairs[i] for i in order[:n_hold]]
        test = [pairs[i] for i in order[n_hold:2 * n_hold]]
        train = [pairs[i] for i in order[2 * n_hold:]]
        return Corpus(train, val, test, f"tsv:{args.tsv}")
    data = Path(args.data)
    return Corpus(read_parallel(data, args.src, args.tgt, "train"),
                  read_parallel(data, args.src, args.tgt, "val"),
                  read_parallel(data, args.src, args.tgt, "test"),
                  f"{data}/{{train,val,test}}.{{{args.src},{args.tgt}}}")


def build_vocab(train_pairs, min_freq: int) -> Vocab:
    """One vocabulary for both languages, so the three embedding matrices can be shared (section 3.4)."""
    return Vocab.build([tokenize(s) for s, _ in train_pairs] + [tokenize(t) for _, t in train_pairs],
                       min_freq=min_freq)


# --------------------------------------------------------------------------- state

@dataclass
class TrainState:
    """Where training stands: what a checkpoint must hold besides the arrays."""
    step: int = 0                  # optimizer steps taken
    epoch: int = 0
    batch_index: int = 0           # next batch within the epoch's (seeded) order
    train_seconds: float = 0.0
    tokens_seen: int = 0
    losses: list = field(default_factory=list)      # training loss of every step
    evals: list = field(default_factory=list)       # the metrics.jsonl records


def save_checkpoint(path, model: Transformer, opt: Adam, state: TrainState, vocab: Vocab, args) -> None:
    arrays = {**model.state_arrays(), **opt.state_arrays(),
              "history/train_loss": B.host.asarray(state.losses, dtype="float64")}
    meta = {"format": "attn-checkpoint-1", "config": model.config.to_dict(), "vocab": vocab.to_json(),
            "step": state.step, "epoch": state.epoch, "batch_index": state.batch_index,
            "train_seconds": state.train_seconds, "tokens_seen": state.tokens_seen, "evals": state.evals,
            "seed": args.seed, "args": _args_dict(args), "dtype": str(model.dtype)}
    save_npz(path, arrays, meta)


def _engine(model: Transformer, args):
    """The model and optimizer that train: the readable reference classes with
    ``--reference``, else their faster twins from :mod:`attn.fast`, which compute
    the same numbers (tests/test_fast.py checks that) with fewer passes over memory."""
    cls, opt_cls = (Transformer, Adam) if args.reference else (FastTransformer, FastAdam)
    if type(model) is not cls:
        model = cls(model.config, dtype=model.dtype, params=model.params)
    return model, opt_cls(model.params, model.config.d_model, model.config.warmup_steps, args.lr_factor)


def _args_dict(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


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


def train(args) -> dict:
    """Train as the arguments say; returns the final metrics (also written to metrics.json)."""
    B.set_backend(args.backend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.npz"

    corpus = load_corpus(args)
    state = TrainState()
    if args.resume:
        if not ckpt_path.is_file():
            raise CheckpointError(f"--resume: there is no checkpoint at {ckpt_path}")
        arrays, meta = load_npz(ckpt_path)
        vocab = Vocab.from_json(meta["vocab"])
        model = Transformer.from_arrays(arrays, meta, source=str(ckpt_path))
        config = model.config
        model, opt = _engine(model, args)
        opt.load_state(arrays, meta["step"])
        state = TrainState(meta["step"], meta["epoch"], meta["batch_index"], meta["train_seconds"],
                           meta["tokens_seen"], [float(x) for x in arrays.get("history/train_loss", [])],
                           meta.get("evals", []))
        print(f"resumed from {ckpt_path} at step {state.step} (epoch {state.epoch}, batch {state.batch_index})",
              file=sys.stderr)
    else:
        vocab = build_vocab(corpus.train, args.min_freq)
        overrides = {k: v for k, v in (("d_model", args.d_model), ("n_heads", args.heads), ("d_ff", args.d_ff),
                                        ("n_encoder_layers", args.layers), ("n_decoder_layers", args.layers),
                                        ("dropout", args.dropout), ("label_smoothing", args.label_smoothing),
                                        ("warmup_steps", args.warmup)) if v is not None}
        config = TransformerConfig.preset(args.preset, vocab_size=len(vocab), **overrides)
        model, opt = _engine(Transformer(config, seed=args.seed, dtype=args.dtype), args)

    # A sentence of n tokens takes n + 1 positions (EOS on the source, BOS on the target input).
    max_len = min(args.max_len or config.max_len, config.max_len - 1)
    train_enc = encode_pairs(corpus.train, vocab, max_len=max_len)
    val_enc = encode_pairs(corpus.val, vocab, max_len=max_len)
    val_batches = make_batches(val_enc, args.max_tokens, shuffle=False)
    (out / "config.json").write_text(json.dumps({"model": config.to_dict(), "train": _args_dict(args),
                                                 "vocab_size": len(vocab), "corpus": corpus.source,
                                                 "train_pairs": len(train_enc)}, indent=2))
    print(f"attn-train: {len(train_enc)} training pairs from {corpus.source}, vocabulary {len(vocab)}, "
          f"model {model.num_parameters():,} parameters ({args.preset}), backend {B.get_backend()}",
          file=sys.stderr)

    step_loss = cross_entropy if args.reference else partial(fast_cross_entropy, inplace=True)
    budget = args.minutes * 60.0 if args.minutes else math.inf
    started = time.perf_counter()
    last_eval_step = state.step
    from tqdm import tqdm
    bar = tqdm(total=args.steps if args.steps else None, initial=state.step, unit="step", dynamic_ncols=True,
               disable=args.quiet, file=sys.stderr, desc="train")
    stop_reason = None
    with _Interrupt() as interrupt:
        while stop_reason is None:
            batches = make_batches(train_enc, args.max_tokens, shuffle=True, seed=args.seed, epoch=state.epoch)
            while state.batch_index < len(batches):
                b = batches[state.batch_index]
                t0 = time.perf_counter()
                rng = B.DeviceRNG(args.seed * 1_000_003 + state.step)
                src, tgt_in, tgt_out = (B.to_device(a) for a in (b.src, b.tgt_in, b.tgt_out))
                logits, cache = model.forward(src, tgt_in, rng)
                loss, dlogits = step_loss(logits, tgt_out, config.label_smoothing)
                del logits
                grads = model.backward(dlogits, cache)
                del cache, dlogits
                if args.clip:
                    clip_grad_norm(grads, args.clip)
                lr = opt.step(grads)
                loss_value = B.to_float(loss)      # the one host sync of the step: the bar shows it
                dt = time.perf_counter() - t0
                state.step += 1
                state.batch_index += 1
                state.train_seconds += dt
                state.tokens_seen += b.n_src_tokens + b.n_tgt_tokens
                state.losses.append(loss_value)
                tok_s = state.tokens_seen / max(state.train_seconds, 1e-9)
                bar.update(1)
                left = budget - (time.perf_counter() - started)
                bar.set_postfix_str(f"loss {loss_value:.3f} lr {lr:.2e} {tok_s:,.0f} tok/s"
                                    + (f" left {_fmt_secs(left)}" if budget < math.inf else "")
                                    + f" ep {state.epoch}", refresh=False)

                if args.steps and state.step >= args.steps:
                    stop_reason = f"reached --steps {args.steps}"
                elif time.perf_counter() - started >= budget:
                    stop_reason = f"reached --minutes {args.minutes}"
                elif interrupt.requested:
                    stop_reason = "interrupted"
                if args.average > 1 and state.step % args.snapshot_every == 0:
                    _snapshot(out, model, vocab, state.step, args.average)
                if stop_reason == "interrupted":
                    save_checkpoint(ckpt_path, model, opt, state, vocab, args)
                elif stop_reason or state.step - last_eval_step >= args.eval_every:
                    _evaluate_and_save(model, opt, state, vocab, args, corpus, val_batches, config, out, bar,
                                       write_ckpt=True)
                    last_eval_step = state.step
                if stop_reason:
                    break
            else:
                state.epoch += 1
                state.batch_index = 0
                if args.epochs and state.epoch >= args.epochs:
                    stop_reason = f"reached --epochs {args.epochs}"
                    if state.step != last_eval_step:
                        _evaluate_and_save(model, opt, state, vocab, args, corpus, val_batches, config, out, bar,
                                           write_ckpt=True)
    bar.close()
    print(f"stopped: {stop_reason} after {state.step} steps, {state.train_seconds:.0f} s of training; "
          f"checkpoint {ckpt_path}", file=sys.stderr)
    if stop_reason == "interrupted":
        print(f"resume with: attn-train --resume --out {out} (and the same data arguments)", file=sys.stderr)
        return {"interrupted": True, "steps": state.step}

    # Section 6.1: the base models average the last 5 checkpoints.
    final_model = model
    if args.average > 1:
        final_model = average_snapshots(out, args.average, model, vocab) or model
    test_bleu, test_hyps = bleu_on(final_model, vocab, corpus.test, args.beam)
    (out / "test_translations.txt").write_text("\n".join(test_hyps) + "\n", encoding="utf-8")
    last = state.evals[-1] if state.evals else {}
    metrics = {"test_bleu": test_bleu, "val_loss": last.get("val_loss"), "val_bleu": last.get("val_bleu"),
               "val_ppl": last.get("val_ppl"), "steps": state.step, "epochs": state.epoch,
               "train_seconds": round(state.train_seconds, 2),
               "tokens_per_second": round(state.tokens_seen / max(state.train_seconds, 1e-9), 1),
               "backend": B.get_backend(), "preset": args.preset, "parameters": model.num_parameters(),
               "beam": args.beam, "averaged_checkpoints": args.average if args.average > 1 else 1,
               "wall_seconds": round(time.perf_counter() - started, 2), "stop": stop_reason}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    _plot(out, state)
    print(json.dumps(metrics), file=sys.stderr)
    final_path = out / "averaged.npz" if final_model is not model else ckpt_path
    print(f"test BLEU {test_bleu:.2f} ({'beam ' + str(args.beam) if args.beam > 1 else 'greedy'}"
          f"{', average of the last %d snapshots' % args.average if final_model is not model else ''}); "
          f"translate with: attn-translate --checkpoint {final_path} \"a sentence\"")
    return metrics


def _evaluate_and_save(model, opt, state, vocab, args, corpus, val_batches, config, out, bar, write_ckpt):
    t0 = time.perf_counter()
    record = {"step": state.step, "epoch": state.epoch,
              "train_loss": float(B.host.mean(state.losses[-args.eval_every:])) if state.losses else None,
              "lr": opt.lr(state.step) if state.step else None}
    record.update(evaluate_loss(model, val_batches, config.label_smoothing))
    if args.bleu_sentences:
        record["val_bleu"], _ = bleu_on(model, vocab, corpus.val, 1, args.bleu_sentences)
    record["train_seconds"] = round(state.train_seconds, 2)
    record["eval_seconds"] = round(time.perf_counter() - t0, 2)
    state.evals.append(record)
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    if write_ckpt:
        save_checkpoint(out / "checkpoint.npz", model, opt, state, vocab, args)
    msg = (f"step {state.step}: val loss {record['val_loss']:.3f}, ppl {record['val_ppl']:.2f}"
           + (f", BLEU {record['val_bleu']:.1f} (first {args.bleu_sentences} val)" if "val_bleu" in record else ""))
    (bar.write if not args.quiet else (lambda m: print(m, file=sys.stderr)))(msg)


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

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attn-train",
        description="Train a Transformer translator. With no arguments: the toy English -> toy-language "
                    "translator in data/toy, on the backend chosen by ATTN_BACKEND (default numpy), "
                    "for at most --minutes of training, writing runs/toy/.",
        epilog="examples:\n"
               "  attn-train                                   # the toy translator\n"
               "  attn-train --backend cupy                    # the same on a GPU\n"
               "  attn-train --data multi30k --src de --tgt en --preset small --minutes 60\n"
               "  attn-train --tsv deu.txt --preset small      # Tatoeba/Anki pairs: src<TAB>tgt\n"
               "  attn-train --resume --out runs/toy           # continue an interrupted run",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="folder with {train,val,test}.{SRC,TGT} line-aligned files (default: the toy corpus)")
    g.add_argument("--src", default="en", help="source language suffix (default: en)")
    g.add_argument("--tgt", default="tk", help="target language suffix (default: tk)")
    g.add_argument("--tsv", type=Path, help="tab-separated pairs file instead of --data; 5%% each held out for val/test")
    g.add_argument("--min-freq", type=int, default=1, help="drop words seen fewer times in training (-> <unk>)")
    g.add_argument("--max-len", type=int, help="skip training pairs longer than this many tokens (default: the preset's max_len)")
    g = p.add_argument_group("model")
    g.add_argument("--preset", default="toy", choices=sorted(PRESETS), help="model size (default: toy)")
    g.add_argument("--d-model", type=int, help="override the preset's d_model")
    g.add_argument("--heads", type=int, help="override the number of attention heads")
    g.add_argument("--d-ff", type=int, help="override the feed-forward width")
    g.add_argument("--layers", type=int, help="override the number of encoder and decoder layers")
    g.add_argument("--dropout", type=float, help="override the residual dropout")
    g.add_argument("--label-smoothing", type=float, help="override label smoothing epsilon")
    g.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    g = p.add_argument_group("training")
    g.add_argument("--backend", default=None, choices=["numpy", "cupy", "auto"],
                   help="array backend (default: $ATTN_BACKEND or numpy)")
    g.add_argument("--minutes", type=float, default=7.0,
                   help="wall-clock budget for training, in minutes (0: no limit; default 7)")
    g.add_argument("--steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--epochs", type=int, default=0, help="stop after this many epochs (0: no limit)")
    g.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch, padding included (default 2048)")
    g.add_argument("--warmup", type=int, help="override the warm-up steps of the schedule")
    g.add_argument("--lr-factor", type=float, default=0.5,
                   help="multiplies the section-5.3 learning rate (default 0.5: the toy model's d_model of 128 "
                        "would otherwise peak at 4.4e-3, where it learns markedly slower)")
    g.add_argument("--clip", type=float, default=0.0, help="clip the global gradient norm to this (0: off)")
    g.add_argument("--seed", type=int, default=0, help="seed for weights, batch order and dropout (default 0)")
    g.add_argument("--eval-every", type=int, default=250, help="validate and checkpoint every N steps")
    g.add_argument("--bleu-sentences", type=int, default=200,
                   help="validation sentences translated for the periodic BLEU (0: skip)")
    g.add_argument("--average", type=int, default=5,
                   help="average the parameters of the last K snapshots for the final model, written to "
                        "OUT/averaged.npz and used for the test BLEU (section 6.1; 0 or 1: off; default 5)")
    g.add_argument("--snapshot-every", type=int, default=50, help="steps between the snapshots that --average uses")
    g.add_argument("--beam", type=int, default=1, help="beam size for the final test translation (1: greedy)")
    g.add_argument("--out", type=Path, default=Path("runs/toy"), help="output folder (default runs/toy)")
    g.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.npz")
    g.add_argument("--reference", action="store_true",
                   help="train with the readable reference layers instead of the faster attn.fast path "
                        "(same numbers up to float rounding, slower)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.backend is None:
        import os
        args.backend = os.environ.get("ATTN_BACKEND", "numpy")
    try:
        train(args)
    except (DataError, CheckpointError, B.BackendError, FileNotFoundError) as e:
        print(f"attn-train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attn-train: aborted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

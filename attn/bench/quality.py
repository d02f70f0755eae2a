"""The same run in PyTorch, side by side: ``python -m attn.bench --quality``.

    python -m attn.bench --quality --tsv deu.txt --preset small --minutes 10,20

trains attn, then the same architecture in PyTorch (:func:`attn.bench.twin.torch_transformer`),
one after the other in one process, each for the same wall-clock minutes, and reports for
both: steps, tokens per second, test BLEU, lower-cased BLEU, chrF and validation loss.

The attn half *is* an ``attn-train`` run: every flag but the benchmark's own goes to
``attn-train``'s parser, and :func:`attn.train.train` runs the :class:`~attn.train.TrainConfig`
it builds, writing its usual files into ``OUT/attn``. The PyTorch half repeats that run
rule for rule:

* the corpus split, the vocabulary (read back from attn's checkpoint), the training settings
  as ``train()`` resolved them (the preset's recipe filled in: ``OUT/attn/config.json``) and
  the model settings as attn used them (the warm-up fitted to the budget, dropout, label
  smoothing);
* attn's initial weights, loaded into the twin, and the batches in attn's order: the
  trainer's :func:`attn.data.make_batches` with the run's seed, epoch by epoch, at the same
  ``max_tokens``. The token count of every step is checked against attn's;
* the schedule (an :class:`attn.optim.Adam` with attn's warm-up and factor gives each step's
  rate, checked against the rates attn logged before PyTorch starts), Adam's betas and
  epsilon, gradient clipping, the label-smoothed loss (PyTorch's
  ``cross_entropy(label_smoothing=...)`` is the same formula as :mod:`attn.loss`);
* the clock: the budget counts wall time from the first step, evaluations included, and a
  run stops after the step that reaches it. Every ``eval_every`` steps both validate (loss,
  and BLEU of ``bleu_sentences`` sentences) and write a checkpoint, and every
  ``snapshot_every`` steps both save an averaging snapshot; PyTorch does these with attn's
  code on a copy of its weights, so both spend the same time on them;
* the final model and its scoring: the average of the last ``average`` snapshots (section
  6.1), translated by attn's decoder (greedy, or beam search with ``--beam``) and scored by
  :mod:`attn.evaluate` against the raw test references, so that only the training differs.

Dropout masks come from each framework's own random numbers. Both use the same number of
threads (``--threads``, default: NumPy's BLAS threads), recorded with the CPU model and the
load average before and after.

With two budgets (``--minutes 10,20``) each framework trains once, for the longer; the row
of the shorter budget is that run's state after the step at which the shorter budget was
reached (its weights and averaging snapshots then), evaluated as a finished run is. Its
settings are the longer run's. So 10 and 20 minutes cost 2 x 20 minutes of training, not 2 x 30.

Files: ``OUT/attn`` (the attn-train run), ``OUT/torch`` (the PyTorch run: ``metrics.jsonl``,
``checkpoint.pt``, ``snapshots/``, ``test_translations.txt``, ``metrics.json``),
``OUT/<framework>-at-<M>min`` (the shorter budget's state and its results), ``OUT/results.jsonl``
(the ``--json`` lines; ``python -m attn.bench --render-markdown OUT/results.jsonl`` prints them
as Markdown again), ``OUT/loss.png`` (both training losses against the minutes used).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from .. import backend as B
from .. import engine as engines
from ..checkpoint import load_npz
from ..data import Vocab, encode_pairs, make_batches
from ..evaluate import evaluate_translations
from ..model import Transformer
from ..optim import Adam
from ..training import evaluation, prepare
from .machine import blas_threads, machine_info
from .twin import torch_adam, torch_available, torch_loss, torch_transformer

PROG = "python -m attn.bench --quality"


class QualityError(RuntimeError):
    """The two halves did not do the same work (a bug, not a user error): the message says where."""


# --------------------------------------------------------------------------- one row

@dataclass
class Point:
    """One framework at one budget: where its run stood and, once evaluated, its scores."""
    framework: str             # "attn" or "pytorch"
    minutes: float             # the budget this row answers
    how: str                   # how the state was taken
    folder: Path               # holds snapshots/ for the averaging; results are written here
    step: int
    epoch: int
    tokens_seen: int
    train_seconds: float       # in training steps only (tokens per second is per these)
    wall_seconds: float        # of the budget: steps, evaluations, snapshots
    params: dict | None = None     # host arrays of the last model (None: already evaluated)
    results: dict = field(default_factory=dict)

    def row(self) -> dict:
        return {"framework": self.framework, "minutes": self.minutes, "how": self.how, "steps": self.step,
                "epochs": self.epoch, "tokens_seen": self.tokens_seen,
                "train_seconds": round(self.train_seconds, 2), "wall_seconds": round(self.wall_seconds, 2),
                "seconds_per_step": self.train_seconds / max(self.step, 1),
                "tokens_per_second": self.tokens_seen / max(self.train_seconds, 1e-9), **self.results}


def _link_snapshots(src: Path, dst: Path) -> None:
    """The averaging snapshots in ``src`` as they are now, hard-linked (copied where links
    fail) into ``dst``: the run deletes old ones as it goes on, the links keep them."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("step-*.npz")):
        try:
            os.link(f, dst / f.name)
        except OSError:
            import shutil
            shutil.copy2(f, dst / f.name)


class Watch:
    """Follows a run step by step: the tokens seen, the budget used and the loss after every
    step, and the state once ``at_minutes`` of the budget are used (the shorter budget's row):
    the weights (``params``, host copies) and the averaging snapshots then (hard links)."""

    def __init__(self, framework: str, at_minutes: float | None, folder: Path | None, snapshots: Path):
        self.framework, self.at_minutes, self.folder, self.snapshots = framework, at_minutes, folder, snapshots
        self.tokens: list[int] = []        # after each step: tokens seen so far
        self.walls: list[float] = []       # after each step: seconds of the budget used
        self.point: Point | None = None

    def __call__(self, state, params: dict | None, wall_seconds: float) -> None:
        self.tokens.append(state.tokens_seen)
        self.walls.append(wall_seconds)
        if self.at_minutes is not None and self.point is None and wall_seconds >= self.at_minutes * 60:
            _link_snapshots(self.snapshots, self.folder / "snapshots")
            self.point = Point(self.framework, self.at_minutes, "", self.folder, state.step, state.epoch,
                               state.tokens_seen, state.train_seconds, wall_seconds,
                               params={k: B.host.array(B.to_host(v)) for k, v in params.items()})


def evaluate_point(p: Point, model_config, vocab, val_batches, test_pairs, config, val=None) -> dict:
    """Evaluate a run's state as :func:`attn.train.train` evaluates its end: validation loss
    of the last model (``val``, where the run measured it already), the final model chosen by
    :func:`attn.training.evaluation.choose_final_model` (the average of the last ``config.average`` snapshots
    in ``p.folder`` where its validation loss is no worse), the test set translated with
    ``config.beam`` and scored. Writes ``test_translations.txt`` and ``metrics.json``
    into ``p.folder``; returns the results (also kept in ``p.results``)."""
    from .. import train as T
    t0 = time.perf_counter()
    params = {k: B.to_device(v, config.dtype) for k, v in p.params.items()}
    model = engines.get(config.engine).model(model_config, dtype=config.dtype, params=params)
    if val is None:
        val = evaluation.evaluate_loss(model, val_batches, model_config.label_smoothing)
    final, choice = evaluation.choose_final_model(model, p.folder, config.average, vocab, val_batches,
                                         model_config.label_smoothing, val)
    scores, hyps = evaluate_translations(final, vocab, test_pairs, config.decoding)     # as train() does
    p.folder.mkdir(parents=True, exist_ok=True)
    (p.folder / "test_translations.txt").write_text("\n".join(hyps) + "\n", encoding="utf-8")
    p.results = {"test_bleu": scores.bleu, "test_bleu_lc": scores.bleu_lc, "test_chrf": scores.chrf,
                 "val_loss": val["val_loss"], "val_ppl": val["val_ppl"],
                 "averaged_checkpoints": _averaged(p.folder, config.average) if final is not model else 1,
                 **choice,
                 "beam": config.beam, "sacrebleu": scores.signatures,
                 "eval_seconds": round(time.perf_counter() - t0, 1)}
    (p.folder / "metrics.json").write_text(json.dumps({**p.row(), "folder": str(p.folder)}, indent=2) + "\n")
    p.params = None
    return p.results


def _averaged(folder: Path, k: int) -> int:
    """How many snapshots :func:`attn.training.checkpoints.average_snapshots` averages in ``folder``
    (1: none, the last model)."""
    n = min(len(list((folder / "snapshots").glob("step-*.npz"))), k)
    return n if k > 1 and n >= 2 else 1


# --------------------------------------------------------------------------- the attn half

def run_attn(config, at_minutes: float | None, out: Path, quiet: bool):
    """``attn.train.train(config)``, watched. Returns (its metrics, the :class:`Watch`)."""
    from .. import train as T
    watch = Watch("attn", at_minutes, out / f"attn-at-{at_minutes:g}min" if at_minutes else None,
                  Path(config.out) / "snapshots")
    _progress(f"attn: training for {config.minutes:g} min into {config.out}", quiet)
    with contextlib.redirect_stdout(sys.stderr):      # stdout carries the report alone (--json)
        metrics = T.train(config, on_step=lambda state, model, wall: watch(state, model.params, wall))
    if metrics.get("interrupted"):
        raise KeyboardInterrupt
    return metrics, watch


# --------------------------------------------------------------------------- the PyTorch half

def run_torch(config, model_config, vocab, corpus, out: Path, at_minutes: float | None, attn_tokens: list,
              quiet: bool):
    """Train the twin as :func:`attn.train.train` trains attn (see the module docstring).

    Returns (the end-of-run :class:`Point`, the :class:`Watch` with the shorter budget's
    state, the training loss of every step, the evaluation records). Raises :class:`QualityError` where a step's
    token count differs from attn's (the batches would not be the same)."""
    import torch
    from .. import train as T

    out.mkdir(parents=True, exist_ok=True)
    twin = _twin(torch, config, model_config, vocab, corpus, out, attn_tokens)
    max_len = min(config.max_len or model_config.max_len, model_config.max_len - 1)
    train_enc = encode_pairs(corpus.train, vocab, max_len=max_len)
    twin.val_batches = make_batches(encode_pairs(corpus.val, vocab, max_len=max_len), config.max_tokens,
                                    shuffle=False)
    twin.watch = Watch("pytorch", at_minutes, out.parent / f"torch-at-{at_minutes:g}min" if at_minutes else None,
                       out / "snapshots")
    twin.state = state = T.TrainState()
    twin.metrics_log.write_text("")
    _progress(f"pytorch: training for {config.minutes:g} min into {out} (threads {torch.get_num_threads()}, "
              f"Adam {twin.adam_kind})", quiet)
    hooks = T.Hooks(twin.step, twin.evaluate, twin.save,
                    snapshot=lambda at: T.snapshot(out, twin.attn_view(), vocab, at, config.average),
                    on_step=twin.check_and_watch, set_progress=twin.schedule.set_progress, desc="pytorch")
    stop = T.run_loop(dataclasses.replace(config, quiet=quiet), state, train_enc, hooks)
    if stop == "interrupted":
        raise KeyboardInterrupt
    _progress(f"pytorch: stopped ({stop}) after {state.step} steps, {state.train_seconds:.0f} s of training", quiet)
    end = Point("pytorch", config.minutes, "end of the run", out, state.step, state.epoch, state.tokens_seen,
                state.train_seconds, state.wall_seconds, params=twin.tmodel.attn_params())
    end.results = {"torch_adam": twin.adam_kind}
    return end, twin.watch, state.losses, twin.evals


def _twin(torch, config, model_config, vocab, corpus, out: Path, attn_tokens: list) -> "_Twin":
    """The twin on attn's initial weights, its optimizer, and attn's schedule (checked against
    the rates attn logged, before any work: fail fast)."""
    device = "cuda" if B.get_backend() == "cupy" else "cpu"
    torch.manual_seed(config.seed)                       # dropout masks: PyTorch's own generator
    init = Transformer(model_config, seed=config.seed, dtype=config.dtype)   # attn's initial weights
    tmodel = torch_transformer(model_config, device, config.dtype)
    tmodel.load_attn_params(init.params)
    del init
    topt, adam_kind = torch_adam(tmodel)
    # attn's schedule: its warm-up (fitted to the budget, where it was) and its factor
    schedule = Adam({}, model_config.d_model, model_config.warmup_steps, prepare.schedule_factor(config, model_config),
                    cooldown=config.cooldown)           # the cooldown follows PyTorch's own budget used
    _check_schedule(Path(config.out) / "metrics.jsonl", schedule)
    return _Twin(torch, config, model_config, vocab, corpus, out, attn_tokens, device, tmodel, topt, adam_kind,
                 schedule, engines.get(config.engine))


@dataclass
class _Twin:
    """The PyTorch half as attn-train's loop drives it (:class:`attn.train.Hooks`): the twin, its
    optimizer and attn's schedule, the run's data, and what it records (``evals``, the metrics log)."""
    torch: object
    config: object
    model_config: object
    vocab: object
    corpus: object
    out: Path
    attn_tokens: list
    device: str
    tmodel: object
    topt: object
    adam_kind: str
    schedule: Adam
    engine: object
    val_batches: list = field(default_factory=list)
    watch: Watch | None = None
    state: object = None
    evals: list = field(default_factory=list)

    @property
    def metrics_log(self) -> Path:
        return self.out / "metrics.jsonl"

    def attn_view(self):
        """A copy of the twin's weights as an attn model (for attn's evaluation code)."""
        params = {k: B.to_device(v, self.config.dtype) for k, v in self.tmodel.attn_params().items()}
        return self.engine.model(self.model_config, dtype=self.config.dtype, params=params)

    def save(self):
        state = self.state
        self.torch.save({"model": self.tmodel.state_dict(), "optimizer": self.topt.state_dict(), "step": state.step,
                         "epoch": state.epoch, "batch_index": state.batch_index, "train_loss": list(state.losses)},
                        self.out / "checkpoint.pt")

    def evaluate(self, bar):
        """What attn's ``evaluate_and_save`` does: validate, log a line, write a checkpoint."""
        config, state, losses = self.config, self.state, self.state.losses
        t0 = time.perf_counter()
        model = self.attn_view()
        record = {"step": state.step, "epoch": state.epoch,
                  "train_loss": float(B.host.mean(losses[-config.eval_every:])) if losses else None,
                  "lr": self.topt.param_groups[0]["lr"] if state.step else None,     # the rate the last step used
                  "lr_scale": self.schedule.scale}
        record.update(evaluation.evaluate_loss(model, self.val_batches, self.model_config.label_smoothing))
        if config.bleu_sentences:
            record["val_bleu"], _ = evaluation.bleu_on(model, self.vocab, self.corpus.val, 1, config.bleu_sentences)
        record["train_seconds"] = round(state.train_seconds, 2)
        record["eval_seconds"] = round(time.perf_counter() - t0, 2)
        self.evals.append(record)
        with open(self.metrics_log, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.save()
        bar.write(f"pytorch step {state.step}: val loss {record['val_loss']:.3f}"
                  + (f", BLEU {record['val_bleu']:.1f}" if "val_bleu" in record else ""), file=sys.stderr)

    def step(self, b, seed):
        """PyTorch's optimizer step (dropout from PyTorch's own generator, not ``seed``)."""
        src, tgt_in, tgt_out = (self.torch.from_numpy(a).to(self.device) for a in (b.src, b.tgt_in, b.tgt_out))
        return torch_step(self, src, tgt_in, tgt_out)

    def check_and_watch(self, state, wall):
        attn_tokens, watch = self.attn_tokens, self.watch
        if state.step <= len(attn_tokens) and attn_tokens[state.step - 1] != state.tokens_seen:
            raise QualityError(f"step {state.step}: PyTorch has seen {state.tokens_seen} tokens, attn "
                               f"{attn_tokens[state.step - 1]}: the batches differ")
        capture = watch.at_minutes is not None and watch.point is None and wall >= watch.at_minutes * 60
        watch(state, self.tmodel.attn_params() if capture else None, wall)


# --------------------------------------------------------------------------- the command

def torch_step(runner, src, tgt_in, tgt_out):
    """One step of a PyTorch runner (``torch``, ``tmodel``, ``topt``, ``model_config``, ``config``,
    ``schedule``, ``state``): the loss of ``tmodel(src, tgt_in)`` (``src`` None for a language
    model), its gradients clipped as attn clips, attn's rate for the next step. Returns (loss, lr)."""
    torch, tmodel, topt = runner.torch, runner.tmodel, runner.topt
    tmodel.train()
    loss = torch_loss(tmodel(src, tgt_in), tgt_out, runner.model_config.label_smoothing)
    topt.zero_grad(set_to_none=True)
    loss.backward()
    if runner.config.clip:
        torch.nn.utils.clip_grad_norm_(tmodel.parameters(), runner.config.clip)
    lr = runner.schedule.lr(runner.state.step + 1)
    for g in topt.param_groups:
        g["lr"] = lr
    topt.step()
    return B.host.asarray(loss.item()), lr            # the one sync of the step, as attn's


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, add_help=True,
        description="Train attn (exactly as attn-train would, from the same flags) and then the same "
                    "architecture in PyTorch, one after the other, for the same wall-clock minutes, on "
                    "the same corpus, vocabulary, initial weights, batches and schedule; translate the "
                    "test set with the same decoder and score both with sacreBLEU (BLEU, lower-cased "
                    "BLEU, chrF). Every flag not listed here is attn-train's (see attn-train --help): "
                    "--data/--tsv/--src/--tgt, --preset, --max-tokens, --lr-factor, --beam, ...",
        epilog="example: python -m attn.bench --quality --tsv deu.txt --preset small --minutes 10,20 --threads 2\n"
               "With two budgets each framework trains once, for the longer, and the shorter budget's row "
               "is that run's state when the shorter budget was reached.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", required=True, metavar="M[,M2]",
                   help="wall-clock training budget per framework, in minutes; two comma-separated values "
                        "(e.g. 10,20) report both from one run of the longer")
    p.add_argument("--out", type=Path, default=Path("runs/quality"),
                   help="output folder (default runs/quality): attn/ is the attn-train run, torch/ PyTorch's")
    p.add_argument("--threads", type=int,
                   help="threads for both: NumPy's BLAS (and attn.fast) and torch.set_num_threads "
                        "(default: NumPy's BLAS threads as they are)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line on stdout: the machine, then one per budget")
    p.add_argument("--markdown", action="store_true", help="the results as Markdown (for benchmarks/RESULTS.md)")
    p.add_argument("--no-torch", action="store_true", help="train attn only (no comparison)")
    return p


def parse_args(argv=None):
    """(the benchmark's own arguments, the attn half's TrainConfig). Bad flags exit with status 2."""
    from .. import train as T
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    try:
        budgets = sorted({float(m) for m in args.minutes.split(",") if m.strip()})
    except ValueError:
        p.error(f"--minutes takes one or two numbers separated by a comma, such as 10 or 10,20; got {args.minutes!r}")
    if not budgets or len(budgets) > 2 or len(args.minutes.split(",")) > 2:
        p.error(f"--minutes takes one or two numbers separated by a comma, such as 10 or 10,20; got {args.minutes!r}")
    if any(not math.isfinite(m) or m <= 0 for m in budgets):
        p.error(f"--minutes must be positive finite numbers, got {args.minutes!r}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    tp = T.build_parser()
    tp.prog = f"{PROG} (attn-train's flags)"
    for bad in ("--resume", "--minutes", "--out"):
        if any(a == bad or a.startswith(bad + "=") for a in rest):
            p.error(f"{bad} is not an attn-train flag here: the benchmark starts fresh runs; see --help")
    given = vars(tp.parse_args(rest))
    try:
        config = T.TrainConfig(**given, minutes=budgets[-1], out=args.out / "attn")
    except T.TrainConfigError as e:
        p.error(str(e))
    args.budgets = budgets
    args.quiet = config.quiet
    if not args.no_torch and not torch_available():
        p.error("PyTorch is not installed: the comparison needs it (pip install torch), or pass --no-torch")
    return args, config


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[attn.bench --quality] {msg}", file=sys.stderr, flush=True)


def _load_average():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


METHOD = ("each framework trains once for the longest budget, one after the other in one process; a shorter "
          "budget's row is that run's state after the step at which the shorter budget was reached (weights and "
          "averaging snapshots), evaluated as a finished run is. Budgets are wall-clock, periodic evaluations "
          "included (for attn also attn-train's probe of its step time, which fits the warm-up to the budget; "
          "PyTorch takes that warm-up as it is). PyTorch starts from attn's initial weights and trains on attn's "
          "batches in attn's order with attn's schedule; its final model is chosen by the same rule (the average "
          "of the last snapshots where its validation loss is no worse), translated by attn's decoder and scored "
          "by the same code.")


def run(args, config) -> list[dict]:
    """Both halves and their evaluation; returns the result rows (machine first)."""
    from .. import train as T
    out = Path(args.out)
    _clear_previous(out, config.overwrite, args.quiet)
    backend = config.backend or os.environ.get("ATTN_BACKEND", "numpy")
    B.set_backend(backend)
    threads = blas_threads(args.threads) if B.get_backend() == "numpy" else None
    with_torch = not args.no_torch
    budgets = args.budgets
    at = budgets[0] if len(budgets) == 2 else None
    info = _run_info(args, config, threads, with_torch)
    quiet = args.quiet

    metrics, attn_watch = run_attn(config, at, out, quiet)
    info["load_average_after_attn"] = _load_average()          # our own training adds about the thread count
    arrays, meta = load_npz(Path(config.out) / "checkpoint.npz")
    vocab = Vocab.from_json(meta["vocab"])
    model_config = Transformer.from_arrays(arrays, meta, source=str(Path(config.out) / "checkpoint.npz")).config
    attn_losses = arrays["history/train_loss"].tolist()            # every step's (the trainer logs them in blocks)
    del arrays
    saved = json.loads((Path(config.out) / "config.json").read_text())
    config = T.TrainConfig.from_dict(saved["train"])     # as train() resolved it (the preset's recipe filled in)
    corpus = prepare.load_corpus(config)
    info.update(model_config=model_config.to_dict(), vocab_size=len(vocab), corpus=saved.get("corpus"),
                train_pairs=saved.get("train_pairs"), test_pairs=len(corpus.test), train_config=config.to_dict(),
                warmup_rule=saved.get("warmup_rule"))
    max_len = min(config.max_len or model_config.max_len, model_config.max_len - 1)
    val_batches = make_batches(encode_pairs(corpus.val, vocab, max_len=max_len), config.max_tokens, shuffle=False)
    points = _attn_points(metrics, attn_watch, config, budgets, at)
    watches = {"attn": (attn_watch.walls, attn_losses)}

    if with_torch:
        torch_end, torch_watch, torch_losses, evals = run_torch(config, model_config, vocab, corpus, out / "torch", at,
                                                                attn_watch.tokens, quiet)
        info["load_average_after_torch"] = _load_average()
        _progress("pytorch: translating the test set", quiet)
        evaluate_point(torch_end, model_config, vocab, val_batches, corpus.test, config,
                       val={k: evals[-1][k] for k in ("val_loss", "val_nll", "val_ppl")})
        points[("pytorch", budgets[-1])] = torch_end
        watches["PyTorch"] = (torch_watch.walls, torch_losses)
        if at is not None:
            points[("pytorch", at)] = _shorter(torch_watch, torch_end, at, budgets[-1])
    for (fw, m), p in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if p.params is not None:
            _progress(f"{fw}: evaluating its state at {m:g} min (step {p.step})", quiet)
            evaluate_point(p, model_config, vocab, val_batches, corpus.test, config)
    info["load_average_after"] = info.get("load_average_after_torch", info["load_average_after_attn"])
    info["loss_figure"] = str(plot_losses(watches, budgets, out / "loss.png"))
    return _write_rows(info, points, budgets, out)


def _clear_previous(out: Path, overwrite: bool, quiet: bool) -> None:
    """A previous quality run in ``out`` refused, or with ``--overwrite`` removed."""
    from .. import train as T
    previous = _previous_run(out)
    if previous and not overwrite:
        raise T.TrainConfigError(f"--out {out} already holds a quality run ({', '.join(previous)}); choose another "
                                 "--out, or pass --overwrite to delete that run's files and start clean")
    if previous:
        _progress(f"--overwrite: removed the previous run's {', '.join(_remove_previous_run(out))}", quiet)


def _run_info(args, config, threads, with_torch: bool) -> dict:
    """The first row: the machine, the budgets and the method, the settings, PyTorch's threads
    (set here to ``--threads``, else NumPy's BLAS threads)."""
    if with_torch:
        import torch
        if B.get_backend() == "numpy":
            torch.set_num_threads(args.threads or threads or os.cpu_count() or 1)
    info = machine_info()
    info.update(load_average_before=_load_average(), backend=B.get_backend(), blas_threads=threads,
                budgets_minutes=args.budgets, method=METHOD, train_config=config.to_dict(),
                command="python -m attn.bench " + " ".join(getattr(args, "argv", None) or ["--quality"]))
    info.pop("load_average", None)
    if with_torch:
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    return info


def _attn_points(metrics: dict, attn_watch: Watch, config, budgets: list, at: float | None) -> dict:
    """attn's rows: {("attn", minutes): Point}, at the end of its run (attn-train's own result,
    metrics.json) and, with two budgets, its state at the shorter."""
    attn_end = Point("attn", budgets[-1], "end of the run (attn-train's metrics.json)", Path(config.out),
                     metrics["steps"], metrics["epochs"], attn_watch.tokens[-1], metrics["train_seconds"],
                     attn_watch.walls[-1])      # the budget used at the last step, as the stop rule saw it
    keep = ("test_bleu", "test_bleu_lc", "test_chrf", "val_loss", "val_ppl", "beam", "sacrebleu", "val_nll_last",
            "val_nll_averaged")
    attn_end.results = {k: metrics[k] for k in keep if k in metrics}
    attn_end.results["averaged_checkpoints"] = \
        _averaged(Path(config.out), config.average) if metrics["averaged_checkpoints"] > 1 else 1
    points = {("attn", budgets[-1]): attn_end}
    if at is not None:
        points[("attn", at)] = _shorter(attn_watch, attn_end, at, budgets[-1])
    return points


def _write_rows(info: dict, points: dict, budgets: list, out: Path) -> list[dict]:
    """The result rows (``info``, then one per budget, attn's and PyTorch's side by side), also
    written to ``out/results.jsonl``."""
    results = [info]
    for m in budgets:
        a = points[("attn", m)].row()
        r = {"name": f"quality_{m:g}min", "minutes": m, "peak_memory_mb": None, **a}
        r.pop("framework")
        if ("pytorch", m) in points:
            t = points[("pytorch", m)].row()
            r.update({f"torch_{k}": v for k, v in t.items() if k not in ("framework", "minutes")})
            r["ratio"] = r["seconds_per_step"] / r["torch_seconds_per_step"]
            r["bleu_difference"] = r["test_bleu"] - r["torch_test_bleu"]
        results.append(r)
    with open(out / "results.jsonl", "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    return results


#: What the benchmark writes into ``OUT`` besides attn-train's run in ``OUT/attn`` (which
#: attn-train itself refuses, or cleans with ``--overwrite``): folders, then the files in them.
_OWN_FILES = ("metrics.jsonl", "checkpoint.pt", "averaged.npz", "test_translations.txt", "metrics.json")


def _own_folders(out: Path) -> list[Path]:
    return [f for f in [out / "torch", *sorted(out.glob("attn-at-*min")), *sorted(out.glob("torch-at-*min"))]
            if f.is_dir()]


def _previous_run(out: Path) -> list[str]:
    found = [f.name for f in _own_folders(out)] + [n for n in ("results.jsonl", "loss.png") if (out / n).exists()]
    attn = out / "attn"
    if attn.is_dir() and any(attn.iterdir()):
        found.insert(0, "attn")
    return found


def _remove_previous_run(out: Path) -> list[str]:
    """Delete what a previous benchmark run wrote (its known files only; attn-train cleans ``OUT/attn``)."""
    removed = [f.name for f in _own_folders(out)] + [n for n in ("results.jsonl", "loss.png") if (out / n).exists()]
    for folder in _own_folders(out):
        for f in [*(folder / "snapshots").glob("step-*.npz"), *(folder / n for n in _OWN_FILES)]:
            if f.is_file():
                f.unlink()
        for d in (folder / "snapshots", folder):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    for n in ("results.jsonl", "loss.png"):
        if (out / n).exists():
            (out / n).unlink()
    return removed


def _shorter(watch: Watch, end: Point, at: float, longest: float) -> Point:
    """The shorter budget's point: the watched state, or the end of a run that stopped before it."""
    if watch.point is not None:
        watch.point.how = f"state at {at:g} min of the {longest:g}-min run"
        return watch.point
    folder = end.folder.parent / f"{'torch' if end.framework == 'pytorch' else 'attn'}-at-{at:g}min"
    p = Point(end.framework, at, f"the run stopped before {at:g} min: its end", folder, end.step, end.epoch,
              end.tokens_seen, end.train_seconds, end.wall_seconds, results=dict(end.results))
    folder.mkdir(parents=True, exist_ok=True)
    return p


def _check_schedule(attn_log: Path, schedule: Adam) -> None:
    """The rates ``schedule`` gives equal those attn logged (``metrics.jsonl``) at every step it logged,
    at the cooldown's factor attn logged (``lr_scale``: it follows each run's own clock)."""
    for line in attn_log.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        schedule.scale = rec.get("lr_scale", 1.0)
        if rec.get("lr") is not None and not math.isclose(schedule.lr(rec["step"]), rec["lr"], rel_tol=1e-12):
            raise QualityError(f"step {rec['step']}: PyTorch's learning rate would be {schedule.lr(rec['step'])}, "
                               f"attn's was {rec['lr']}: the schedules differ")
    schedule.set_progress(0.0)


# --------------------------------------------------------------------------- output

def plot_losses(watches: dict, budgets, path) -> Path:
    """Training loss against the minutes of the budget used, one line per framework
    (``watches``: label -> (budget seconds after each step, each step's loss))
    (a running mean over up to 20 steps), the budgets marked: the race the table sums up."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    np = B.host
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    for label, (walls, losses) in watches.items():
        if not losses:
            continue
        y = np.asarray(losses, dtype=float)
        k = max(1, min(20, len(y) // 10))          # a short run's few steps are drawn as they are
        smooth = np.convolve(y, np.ones(k) / k, mode="valid")
        ax.plot(np.asarray(walls[k - 1:len(y)]) / 60.0, smooth, label=f"{label} ({len(y)} steps)")
    for m in budgets:
        ax.axvline(m, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("minutes of the budget (wall clock, evaluations included)")
    ax.set_ylabel("training loss (label-smoothed; running mean of up to 20 steps)")
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


_COLUMNS = (("steps", "steps", "d"), ("tokens/s", "tokens_per_second", ".0f"), ("BLEU", "test_bleu", ".2f"),
            ("BLEU lc", "test_bleu_lc", ".2f"), ("chrF", "test_chrf", ".2f"), ("val loss", "val_loss", ".3f"),
            ("averaged", "averaged_checkpoints", "d"))


def _framework_rows(results):
    for r in results[1:]:
        yield r["minutes"], "attn", {k: r.get(k) for _, k, _ in _COLUMNS} | {"how": r["how"]}
        if "torch_steps" in r:
            yield r["minutes"], "PyTorch", {k: r.get("torch_" + k) for _, k, _ in _COLUMNS} | {"how": r["torch_how"]}


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def _header(info) -> list[str]:
    before = info.get("load_average_before")
    cfg = info.get("model_config", {})
    return [f"corpus {info.get('corpus')}: {info.get('train_pairs')} training pairs, {info.get('test_pairs')} test "
            f"sentences; vocabulary {info.get('vocab_size')}; model d_model {cfg.get('d_model')}, "
            f"{cfg.get('n_encoder_layers')}+{cfg.get('n_decoder_layers')} layers, {cfg.get('n_heads')} heads, d_ff "
            f"{cfg.get('d_ff')}, warm-up {cfg.get('warmup_steps')}, dropout {cfg.get('dropout')}, label smoothing "
            f"{cfg.get('label_smoothing')}; max_tokens {info['train_config']['max_tokens']}, lr factor "
            f"{info['train_config']['lr_factor']}, beam {info['train_config']['beam']}, average "
            f"{info['train_config']['average']}",
            f"machine: {info.get('cpu_model')}, {info.get('usable_cpus', info.get('cpu_count'))} usable CPUs; "
            f"threads: BLAS {info.get('blas_threads')}, PyTorch {info.get('torch_threads', '-')}; "
            f"load average (1/5/15 min) before {before}, after attn's training "
            f"{info.get('load_average_after_attn')}, after PyTorch's {info.get('load_average_after_torch', '-')}",
            f"software: Python {info.get('python')}, NumPy {info.get('numpy')} ({info.get('blas', '?')}), "
            f"PyTorch {info.get('torch', 'absent')}, backend {info.get('backend')}",
            f"method: {info['method']}"]


def _differences(results) -> str | None:
    """attn's test BLEU minus PyTorch's at each budget (the issue's target: at least 0)."""
    parts = [f"{r['minutes']:g} min {r['bleu_difference']:+.2f}" for r in results[1:] if "bleu_difference" in r]
    return ("attn's test BLEU minus PyTorch's: " + ", ".join(parts)) if parts else None


def print_table(results, out=sys.stdout):
    info = results[0]
    print(f"{PROG}: budgets {', '.join(f'{m:g}' for m in info['budgets_minutes'])} min", file=out)
    for line in _header(info):
        print(line, file=out)
    head = f"{'budget':>8}  {'framework':<9}" + "".join(f"{h:>10}" for h, _, _ in _COLUMNS) + "  how"
    print(head, file=out)
    print("-" * len(head), file=out)
    for m, fw, v in _framework_rows(results):
        print(f"{m:>6g} m  {fw:<9}" + "".join(f"{_f(v[k], s):>10}" for _, k, s in _COLUMNS) + f"  {v['how']}",
              file=out)
    if _differences(results):
        print(_differences(results), file=out)


def print_markdown(results, out=sys.stdout):
    info = results[0]
    print(f"- command: `{info.get('command')}`", file=out)
    for line in _header(info):
        print(f"- {line}", file=out)
    print(file=out)
    print("| budget | framework | steps | tokens/s | test BLEU | BLEU (lower-cased) | chrF | val loss | "
          "snapshots averaged | how |", file=out)
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|", file=out)
    for m, fw, v in _framework_rows(results):
        print(f"| {m:g} min | {fw} | " + " | ".join(_f(v[k], s) for _, k, s in _COLUMNS) + f" | {v['how']} |",
              file=out)
    if _differences(results):
        print(f"\n{_differences(results)}", file=out)


def main(argv=None) -> int:
    from .. import train as T
    from ..checkpoint import CheckpointError
    from ..data import DataError
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [a for a in argv if a != "--quality"]
    args, config = parse_args(argv)
    args.argv = ["--quality", *argv]
    try:
        results = run(args, config)
    except (DataError, CheckpointError, B.BackendError, FileNotFoundError, T.TrainConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    if args.json:
        for r in results:
            print(json.dumps(r))
    elif args.markdown:
        print_markdown(results)
    else:
        print_table(results)
    return 0

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

This module is the step and the loop; what they call lives beside them in
:mod:`attn.training`: ``config`` (:class:`TrainConfig`, the recipes, the command
line), ``prepare`` (corpus, split, vocabulary, model and optimizer, the warm-up
fitted to the budget), ``checkpoints`` (state, checkpoints, snapshots, averaging,
the files of ``out``), ``evaluation`` (validation during training, the test at the
end) and ``distributed`` (``mpiexec -n N attn-train``: N processes training one
model as one process would; a run of one process never uses it beyond asking how
many processes there are). Import what they define from them.
"""
from __future__ import annotations

import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import backend as B
from . import engine as engines
from .checkpoint import CheckpointError
from .data import DataError, make_batches
from .evaluate import progress_bar_options
from .loss import cross_entropy
from .training import distributed, finetune, lm
from .training.interrupts import Interrupted, StopSignals, abort_on_signals, exit_status
from .training.checkpoints import TrainState, hold_out, open_run, save_checkpoint, snapshot, start_writing
from .training.config import TrainConfig, TrainConfigError, build_parser
from .training.evaluation import evaluate_and_save, test_and_report
from .training.prepare import prepare


def train_step(model, opt, batch, rng, label_smoothing: float, clip: float = 0.0, loss_fn=cross_entropy, dp=None):
    """One optimizer step on one batch (sections 5.3, 5.4).

    Forward with dropout (masks from ``rng``), label-smoothed cross-entropy,
    backward, optional clipping of the global gradient norm to ``clip`` (0: off),
    Adam with the warm-up schedule. ``batch`` is an :class:`attn.data.Batch` on the
    host; ``loss_fn(logits, targets, eps) -> (loss, dlogits)``.

    With a data-parallel group ``dp`` (:mod:`attn.training.distributed`) this process
    takes its share of the batch's sentences, and the gradients and the loss are the
    sums over all processes: those of the whole batch, as one process computes them.

    Returns (loss, lr): the loss as a 0-d array on the device (no host sync here)
    and the learning rate the step used.
    """
    weight = None
    if dp is not None:
        batch, rng, weight = dp.share(batch, rng, model)     # this process's sentences and their random numbers
    src, tgt_in, tgt_out = (B.to_device(a) for a in (batch.src, batch.tgt_in, batch.tgt_out))
    logits, cache = model.forward(src, tgt_in, rng)
    loss, dlogits = loss_fn(logits, tgt_out, label_smoothing)
    del logits
    if dp is None:
        grads = model.backward(dlogits, cache)
    else:           # the sum over processes of weight * (loss, grads), sent layer by layer as the backward goes
        loss, grads = dp.backward(model, dlogits, cache, loss, weight)
    del cache, dlogits
    lr = opt.step(grads, clip=clip)                      # clipping decided on the device: no host sync
    return loss, lr


def _log_losses(pending: engines.LossLog, state: "TrainState") -> float:
    """Bring the pending losses to the host in one transfer, append them to
    ``state.losses`` and empty ``pending``. Returns the last one. Raises FloatingPointError
    naming the step if one is NaN or infinite."""
    if not len(pending):
        return state.losses[-1] if state.losses else math.nan
    values = pending.take()
    first = state.step - len(values) + 1
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise FloatingPointError(f"train: the training loss is {v} at step {first + i}: the model diverged "
                                     "(lower --lr-factor, or --clip the gradients)")
    state.losses.extend(values)
    return values[-1]


def train(config: TrainConfig, *, given=None, on_step=None) -> dict:
    """Train as ``config`` says; returns the final metrics (also written to ``out/metrics.json``).

    The returned dict holds at least ``test_bleu``, ``val_loss``, ``steps``,
    ``train_seconds``, ``tokens_per_second`` and ``backend``; a run stopped by Ctrl-C or SIGTERM
    saves its checkpoint at the next step boundary and returns ``{"interrupted": True, "steps": ...,
    "signal": "SIGINT" or "SIGTERM", "exit_status": 130 or 143}``.

    A fresh run refuses an ``out`` that already holds a run (unless ``overwrite``);
    with ``resume`` the saved run's settings and seed are used (see
    :func:`resumed_config`; ``given`` names the fields the caller set explicitly).

    Started by ``mpiexec -n N``, the N processes train one model on the same batches,
    each on its share (:mod:`attn.training.distributed`); process 0 alone logs, evaluates
    and writes, and every process returns its metrics.

    ``on_step(state, model, wall_seconds)``, if given, is called after every optimizer
    step (after its averaging snapshot, before any evaluation) with the :class:`TrainState`,
    the model and the seconds of the ``minutes`` budget used so far; it must change
    neither. ``state.losses`` then holds every step's loss so far (so each step brings its
    loss to the host, where an unwatched run does so every ``log.every`` steps). The
    side-by-side benchmark (:mod:`attn.bench.quality`) watches the run with it.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train() takes a TrainConfig, got {type(config).__name__}")
    dp = distributed.group()                     # one process: Single, whose calls change nothing
    with hold_out(config.out, dp.master):        # one run at a time in out, for the run's life
        return _train(config, given, on_step, dp)


def _train(config: TrainConfig, given, on_step, dp) -> dict:
    parallel = dp if dp.size > 1 else None       # what train_step is given: None for one process
    config, saved = open_run(config, given)      # --resume: the saved run's settings and checkpoint
    if config.task == "lm":
        return _train_lm(config, saved, on_step, dp)
    if config.resume_from is not None:           # fine-tuning a trained translator, LoRA or every weight
        return _finetune(config, dp)
    dp.check_same_settings(config.to_dict())     # several processes: the same settings, or an error
    dp.barrier()                                 # every process has looked at out before process 0 writes to it
    B.set_backend(config.backend)
    dp.use_backend()
    if config.cuda_graph:
        _check_cuda_graph(config, dp)            # before any work
    _check_precision(config)
    run = prepare(config, saved, parallel, dp.say)
    config = run.config                          # as the device can run it (a feature failing its probe, off)
    model, opt, state, vocab = run.model, run.opt, run.state, run.vocab
    out, ckpt_path, smoothing = Path(config.out), Path(config.out) / "checkpoint.npz", model.config.label_smoothing
    dp.check_same_parameters(model.params)       # several processes: the same weights, or an error
    if dp.master:
        start_writing(out, not config.resume and config.overwrite,
                      {"model": model.config.to_dict(), "train": config.to_dict(), "vocab_size": len(vocab),
                       "corpus": run.corpus.source, "train_pairs": len(run.train_enc),
                       "warmup_rule": run.warmup_rule, "processes": dp.size}, dp.say,
                      evals=state.evals if config.resume else None, step=state.step if config.resume else None)
    dp.say(f"attn-train: {len(run.train_enc)} training pairs from {run.corpus.source}, vocabulary {len(vocab)} "
           f"({'BPE' if vocab.bpe is not None else 'words'}), "
           f"model {model.num_parameters():,} parameters ({config.preset}), backend {B.describe()}"
           + (f", {dp.size} processes (gradients over {dp.transport})" if dp.size > 1 else ""))
    if run.warmup_rule is not None:
        dp.say(f"warm-up: {run.warmup_rule['warmup_steps']} steps ({run.warmup_rule['why']})")

    def step(batch, seed):
        return train_step(model, opt, batch, B.DeviceRNG(seed), smoothing, config.clip, run.loss_fn, parallel)
    if config.cuda_graph:                               # one launch a step
        step = run.engine.captured_step(model, opt, smoothing, config.clip, run.loss_fn)
    else:                                               # as its engine runs it (the fast one: in step memory)
        step = run.engine.loop_step(model, step, parallel)

    def evaluate(bar):
        evaluate_and_save(model, opt, state, vocab, config, run.corpus, run.val_batches, model.config, out, bar)

    stop = StopSignals(dp.say)
    hooks = Hooks(step, evaluate, save=lambda: save_checkpoint(ckpt_path, model, opt, state, vocab, config, run.corpus),
                  snapshot=lambda at: snapshot(out, model, vocab, at, config.average),
                  on_step=None if on_step is None else (lambda st, wall: on_step(st, model, wall)),
                  set_progress=opt.set_progress if opt.cooldown else None, log=run.engine.loss_log())
    stop_reason = run.untested or run_loop(config, state, run.train_enc, hooks, dp, stop)   # untested: owes its test
    if stop_reason == "interrupted":
        return _interrupted(stop, state, ckpt_path, dp)
    dp.say(f"stopped: {stop_reason} after {state.step} steps, {state.train_seconds:.0f} s of training; "
           f"checkpoint {ckpt_path}")
    metrics = _test(run, model, state, stop_reason, dp, ckpt_path) if dp.master else None
    return dp.broadcast(metrics)


def _finetune(config: TrainConfig, dp) -> dict:
    """A fine-tuning run (``--resume-from``, :mod:`attn.training.finetune`): the translator's step
    and loop over what trains (the adapters with ``--lora``, else every weight)."""
    run = finetune.prepare_finetune(config, dp)
    model, opt = run.model, run.opt

    def step(batch, seed):
        return train_step(model, opt, batch, B.DeviceRNG(seed), run.base.config.label_smoothing, config.clip)
    hooks = Hooks(step, run.evaluate, save=run.save, set_progress=opt.set_progress if opt.cooldown else None,
                  desc="fine-tune")
    return run.finish(run_loop(config, run.state, run.train_enc, hooks, dp))


def _interrupted(stop: StopSignals, state: TrainState, ckpt_path: Path, dp) -> dict:
    """The line and the dict of a run stopped by Ctrl-C or SIGTERM (its checkpoint saved)."""
    dp.say(f"stopped by {stop.name} after {state.step} steps, {state.train_seconds:.0f} s of training; "
           f"checkpoint {ckpt_path} (step {state.step}); resume with: {_resume_command(ckpt_path.parent)}")
    return {"interrupted": True, "steps": state.step, "signal": stop.name, "exit_status": exit_status(stop.signum or 2)}


def _train_lm(config: TrainConfig, saved, on_step, dp) -> dict:
    """A language model's run (``--task lm``, :mod:`attn.training.lm`): the translator's loop,
    step, checkpoints and ``--resume`` (``saved``: the checkpoint :func:`open_run` read), over
    windows of a text; validated by its loss alone."""
    if dp.size > 1:
        raise TrainConfigError("task (--task) lm trains in one process: run it without mpiexec")
    B.set_backend(config.backend)
    run = lm.prepare_lm(config, saved, dp.say)
    model, opt, state = run.model, run.opt, run.state
    out = Path(config.out)
    ckpt_path = out / "checkpoint.npz"
    start_writing(out, not config.resume and config.overwrite,
                  {"model": model.config.to_dict(), "train": config.to_dict(), "vocab_size": len(run.vocab),
                   "corpus": run.corpus.source, "train_tokens": int(run.corpus.train.size)}, dp.say,
                  evals=state.evals if config.resume else None, step=state.step if config.resume else None)
    dp.say(f"attn-train: a language model of {run.corpus.source}: {run.corpus.train.size:,} training and "
           f"{run.corpus.val.size:,} validation tokens ({'characters' if config.char else 'BPE pieces'}, vocabulary "
           f"{len(run.vocab)}), model {model.num_parameters():,} parameters ({config.preset}, decoder-only), "
           f"backend {B.describe()}")

    def step(batch, seed):
        return train_step(model, opt, batch, B.DeviceRNG(seed), model.config.label_smoothing, config.clip,
                          run.loss_fn)
    stop = StopSignals(dp.say)
    hooks = Hooks(run.engine.loop_step(model, step), lambda bar: lm.evaluate_and_save(run, state, out, bar),
                  save=lambda: save_checkpoint(ckpt_path, model, opt, state, run.vocab, config, run.corpus),
                  on_step=None if on_step is None else (lambda st, wall: on_step(st, model, wall)),
                  set_progress=opt.set_progress if opt.cooldown else None, log=run.engine.loss_log(),
                  batches=lambda epoch: lm.Windows(run.corpus.train, config.context, config.batch, config.seed,
                                                   epoch))
    stop_reason = run.untested or run_loop(config, state, None, hooks, dp, stop)
    if stop_reason == "interrupted":
        return _interrupted(stop, state, ckpt_path, dp)
    dp.say(f"stopped: {stop_reason} after {state.step} steps, {state.train_seconds:.0f} s of training; "
           f"checkpoint {ckpt_path}")
    return lm.report(run, state, stop_reason)


def _test(run, model, state: TrainState, stop_reason: str, dp, ckpt_path: Path) -> dict:
    """:func:`test_and_report`; where Ctrl-C or SIGTERM cuts the test short, a line saying that the
    checkpoint holds every step and how to test it (``--resume`` runs the test a run owes), and
    the interrupted run's dict with the exit status that signal asks for."""
    try:
        return test_and_report(run, model, state, stop_reason, state.wall_seconds,
                               {"processes": dp.size} if dp.size > 1 else {})
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else 2
        dp.say(f"stopped by {Interrupted(signum)} while testing; checkpoint {ckpt_path} holds all {state.step} "
               f"steps; test it with: {_resume_command(ckpt_path.parent)}")
        return {"interrupted": True, "steps": state.step, "signal": str(Interrupted(signum)),
                "exit_status": exit_status(signum)}


def _resume_command(out: Path) -> str:
    """The command that resumes the run in ``out``, quoted for a shell (a path may hold a space)."""
    return f"attn-train --resume --out {shlex.quote(str(out))}"


def budget_used(config: TrainConfig, state: TrainState, batches_in_epoch: int) -> float:
    """The fraction of the run's budget used, 0 to 1: the largest of the fractions of ``minutes``
    (wall time, the whole run's), ``steps`` and ``epochs`` used; 0 for a run with no budget."""
    used = [0.0]
    if config.minutes:
        used.append(state.wall_seconds / (config.minutes * 60.0))
    if config.steps:
        used.append(state.step / config.steps)
    if config.epochs:
        used.append((state.epoch + state.batch_index / max(batches_in_epoch, 1)) / config.epochs)
    return min(1.0, max(used))


@dataclass
class Hooks:
    """What :func:`run_loop` does at each step, handed in so that any model trains by the same
    rules (attn's engines, and the PyTorch twin of :mod:`attn.bench.quality`).

    ``step(batch, seed) -> (loss, lr)``
        One optimizer step on ``batch``, its dropout seeded by ``seed``; the loss a 0-d array
        (host or device) valid until the next step begins.
    ``evaluate(bar)``
        Validate and checkpoint: every ``config.eval_every`` steps and at the end.
    ``save()``
        Write the checkpoint of an interrupted run.
    ``snapshot(step)``
        An averaging snapshot, every ``config.snapshot_every`` steps when ``config.average > 1``.
    ``on_step(state, wall_seconds)``
        After every step (after its snapshot, before any evaluation); every step's loss is then
        in ``state.losses`` (else they come to the host every ``log.every`` steps).
    ``set_progress(fraction)``
        Before every step: the fraction of the budget used (:func:`budget_used`), for the
        schedule's cooldown (:meth:`attn.optim.Adam.set_progress`). Under ``dp`` it is process 0's,
        one broadcast a step: a run without a cooldown passes None and skips it.
    ``desc``
        The progress bar's label.
    ``log``
        Where the losses of the steps since the last log wait (:class:`attn.engine.LossLog`,
        or the engine's own: :meth:`attn.engine.Engine.loss_log`).
    ``batches(epoch)``
        The batches of an epoch, in order (None: the translator's, :func:`attn.data.make_batches`
        of the training pairs; a language model's windows: :class:`attn.training.lm.Windows`).
    """
    step: Callable
    evaluate: Callable
    save: Callable
    snapshot: Callable | None = None
    on_step: Callable | None = None
    set_progress: Callable | None = None
    desc: str = "train"
    log: engines.LossLog = field(default_factory=engines.LossLog)
    batches: Callable | None = None


def run_loop(config: TrainConfig, state: TrainState, train_enc, hooks: Hooks, dp=None,
             stop: StopSignals | None = None) -> str:
    """The training loop (section 5): epochs of batches of about ``config.max_tokens`` tokens from
    ``train_enc`` (the order of epoch ``e`` from ``config.seed + e``), one optimizer step each
    (``hooks``, :class:`Hooks`), until ``config``'s budget (``steps``, ``minutes`` of wall time over
    the whole run, ``epochs``) is reached or Ctrl-C or SIGTERM asks it to stop (``stop``, a
    :class:`StopSignals`, says which and when; default: a new one); ``state``
    (:class:`TrainState`) is where it starts and is kept up to date. Returns why it stopped.

    With a data-parallel group ``dp`` (:mod:`attn.training.distributed`; default: one process)
    process 0's clock decides when all stop, and it alone evaluates, saves and snapshots.
    """
    from tqdm import tqdm
    dp = distributed.group() if dp is None else dp
    budget = _RunBudget(config, state)
    after_step = _AfterStep(config, state, hooks, dp, budget)
    bar = tqdm(total=config.steps if config.steps else None, initial=state.step, unit="step",
               disable=config.quiet or not dp.master, desc=hooks.desc, **progress_bar_options())
    stop_reason = None
    with (stop or StopSignals(dp.say)) as interrupt:
        while stop_reason is None:
            batches = (hooks.batches(state.epoch) if hooks.batches is not None else
                       make_batches(train_enc, config.max_tokens, shuffle=True, seed=config.seed, epoch=state.epoch))
            while state.batch_index < len(batches):
                batch = batches[state.batch_index]
                if hooks.set_progress is not None:
                    used = budget_used(config, state, len(batches))
                    hooks.set_progress(dp.broadcast(used) if dp.size > 1 else used)    # process 0's clock
                t0 = time.perf_counter()
                loss, lr = hooks.step(batch, config.seed * 1_000_003 + state.step)
                hooks.log.append(loss)
                budget.stepped(batch, time.perf_counter() - t0)
                bar.update(1)
                stop_reason = dp.agree(budget.stop_reason(interrupt), interrupt.requested)  # process 0's decides
                after_step(stop_reason, bar, lr)
                if stop_reason:
                    break
            else:
                state.epoch += 1
                state.batch_index = 0
                if config.epochs and state.epoch >= config.epochs:
                    stop_reason = f"reached --epochs {config.epochs}"
                    after_step.evaluate_if_new(bar)
    bar.close()
    budget.tick()                                       # the last evaluation included
    return stop_reason


class _RunBudget:
    """The run against its budget: the step, the batch and the tokens counted, the wall time over
    the whole run (resumed or not) kept in ``state``, and the reason to stop once it is spent."""

    def __init__(self, config: TrainConfig, state: TrainState):
        self.config, self.state = config, state
        self.seconds = config.minutes * 60.0 if config.minutes else math.inf
        self.started, self.wall_before = time.perf_counter(), state.wall_seconds

    def tick(self) -> None:
        self.state.wall_seconds = self.wall_before + (time.perf_counter() - self.started)

    def stepped(self, batch, seconds: float) -> None:
        state = self.state
        state.step += 1
        state.batch_index += 1
        state.train_seconds += seconds
        state.tokens_seen += batch.n_src_tokens + batch.n_tgt_tokens
        self.tick()

    def stop_reason(self, interrupt) -> str | None:
        config, state = self.config, self.state
        if config.steps and state.step >= config.steps:
            return f"reached --steps {config.steps}"
        if state.wall_seconds >= self.seconds:
            return f"reached --minutes {config.minutes}"
        return "interrupted" if interrupt.requested else None


class _AfterStep:
    """What follows a step, in this order: the losses logged (on the steps that log, and before an
    evaluation), the averaging snapshot, the watcher (``on_step``), then an evaluation when one is
    due or the checkpoint of an interrupted run; process 0 alone snapshots, evaluates and saves."""

    def __init__(self, config: TrainConfig, state: TrainState, hooks: Hooks, dp, budget: _RunBudget):
        self.config, self.state, self.hooks, self.dp, self.budget = config, state, hooks, dp, budget
        self.pending = hooks.log                        # the losses of the steps since the last log
        self.last_eval_step = state.step

    def log_losses(self) -> float:
        """:func:`_log_losses`: the one host sync, on the steps that log. On a GPU it waits for the
        steps queued since the last one, whose launches alone were timed, so its time is training's."""
        t0 = time.perf_counter()
        loss = _log_losses(self.pending, self.state)
        self.state.train_seconds += time.perf_counter() - t0
        return loss

    def __call__(self, stop_reason, bar, lr: float) -> None:
        config, state, hooks, master = self.config, self.state, self.hooks, self.dp.master
        due = stop_reason or state.step - self.last_eval_step >= config.eval_every
        if state.step % self.pending.every == 0 or due or hooks.on_step is not None:    # a watcher reads each step's loss
            self._show(bar, self.log_losses(), lr)
        if master and hooks.snapshot is not None and config.average > 1 and state.step % config.snapshot_every == 0:
            hooks.snapshot(state.step)
        if hooks.on_step is not None and master:
            hooks.on_step(state, state.wall_seconds)
        if stop_reason == "interrupted":
            if master:
                hooks.save()
        elif due:
            if master:
                hooks.evaluate(bar)
            self.last_eval_step = state.step

    def _show(self, bar, loss: float, lr: float) -> None:
        state, budget = self.state, self.budget.seconds
        tok_s = state.tokens_seen / max(state.train_seconds, 1e-9)
        bar.set_postfix_str(f"loss {loss:.3f} lr {lr:.2e} {tok_s:,.0f} tok/s"
                            + (f" left {_fmt_secs(budget - state.wall_seconds)}" if budget < math.inf else "")
                            + f" ep {state.epoch}", refresh=False)

    def evaluate_if_new(self, bar) -> None:
        """At the end of the last epoch: log and evaluate, unless this step was just evaluated."""
        if self.state.step != self.last_eval_step:
            self.log_losses()
            if self.dp.master:
                self.hooks.evaluate(bar)


def _check_cuda_graph(config: TrainConfig, dp) -> None:
    """``--cuda-graph`` (the engine's ``captured_step``) where it can run, or a
    :class:`TrainConfigError` naming the flag and why not."""
    why = ("it needs --backend cupy (a GPU)" if B.get_backend() != "cupy" else
           f"the {config.engine} engine cannot capture a step"
           + (" (drop --reference)" if config.reference else "") if not engines.get(config.engine).captures else
           "it runs one process (a data-parallel step all-reduces between its launches)" if dp.size > 1 else
           f"a captured step keeps the learning rate's factor it was captured with, and --cooldown "
           f"{config.cooldown:g} changes it every step: give --cooldown 0" if config.cooldown else None)
    if why:
        raise TrainConfigError(f"cuda_graph (--cuda-graph) cannot be used here: {why}")


def _check_precision(config: TrainConfig) -> None:
    """``--precision`` where the engine can apply it, or a :class:`TrainConfigError` naming the flag
    (``--reference`` and ``--dtype float64`` are refused by :class:`TrainConfig` itself)."""
    if config.precision == "bf16" and B.get_backend() == "cupy":
        try:
            B.bfloat16()
        except B.BackendError as e:
            raise TrainConfigError(f"precision (--precision) bf16 cannot be used here: {e}") from None


def _fmt_secs(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 60}:{s % 60:02d}"


def main(argv=None) -> int:
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    try:
        config = TrainConfig(**given)
    except TrainConfigError as e:
        parser.error(str(e))            # exit status 2, before any work
    try:
        with abort_on_signals():                # before the loop: nothing to save yet
            metrics = train(config, given=set(given))
    except (DataError, CheckpointError, B.BackendError, TrainConfigError, FloatingPointError,
            distributed.DistributedError, engines.EngineError) as e:
        return _error(str(e))
    except MemoryError:
        return _error(_out_of_memory_advice(config))
    except OSError as e:
        return _error(f"{e.filename or config.out}: {e.strerror or e}")
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else 2
        print(f"attn-train: aborted by {Interrupted(signum)} without saving", file=sys.stderr)
        _end_other_processes(exit_status(signum))
        return exit_status(signum)
    return metrics.get("exit_status", 0) if metrics else 0


def _out_of_memory_advice(config: TrainConfig) -> str:
    """What to lower after running out of memory, in flags the user can set, with their values."""
    tokens = config.max_tokens if config.max_tokens is not None else config.with_recipe().max_tokens
    given = "--max-tokens" if config.max_tokens is not None else "the recipe's batch"
    return (f"out of memory (preset {config.preset}, batches of {tokens:,} tokens: {given}): pass a smaller "
            f"--max-tokens, e.g. --max-tokens {max(tokens // 2, 1)}, or choose a smaller model (--preset)")


def _error(message: str) -> int:
    print(f"attn-train: error: {message}", file=sys.stderr)
    _end_other_processes(2)
    return 2


def _end_other_processes(code: int) -> None:
    """Under ``mpiexec``, one process's error would leave the others waiting for it: end them all."""
    if distributed.launched_size() > 1:
        try:
            distributed.group().abort(code)
        except distributed.DistributedError:        # no mpi4py: no MPI process is waiting
            pass


if __name__ == "__main__":
    sys.exit(main())

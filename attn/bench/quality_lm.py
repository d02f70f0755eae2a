"""A language model side by side with PyTorch: ``python -m attn.bench --quality --task lm``.

    python -m attn.bench --quality --task lm --preset shakespeare_char --steps 2000 --threads 2

trains attn's decoder-only model (an ``attn-train --task lm`` run: every flag but the benchmark's
own is ``attn-train``'s) and then the same model in PyTorch (:func:`attn.bench.twin.torch_transformer`
of the run's config), one after the other in one process, and reports for both: the validation
loss at equal steps (every ``--eval-every`` steps) and at equal minutes of training, the seconds
per step, and a sample from each final model. The default preset is ``shakespeare_char``,
nanoGPT's CPU recipe for tiny Shakespeare (4 layers, 4 heads, width 128, context 64, batch 12,
characters, no dropout).

The PyTorch half repeats the attn run rule for rule, so that only the framework differs:

* the text, its 90/10 split and the vocabulary (read back from attn's checkpoint);
* attn's initial weights (:func:`attn.model.init_params` of the run's seed), copied into the twin;
* the batches: the same windows in the same order (:class:`attn.training.lm.Windows` of the run's
  seed, epoch by epoch), every step's token count checked against attn's;
* attn's optimizer (Adam, betas 0.9 and 0.98, epsilon 1e-9) and schedule (an
  :class:`attn.optim.Adam` gives each step's rate, checked against the rates attn logged before
  PyTorch starts), gradient clipping at ``--clip``;
* the loop: :func:`attn.train.run_loop`, the same budget, evaluations every ``eval_every`` steps;
* validation: :func:`attn.training.lm.validate` on a copy of the twin's weights as an attn model,
  the same windows; the sample: :func:`attn.sample.generate` on each final model, the same seed.

How the recipe differs from nanoGPT's ``train.py`` (which attn's flags do not reach): nanoGPT
uses AdamW (betas 0.9 and 0.99, weight decay 0.1) and a cosine decay from 1e-3 to 1e-4 over the
2,000 steps after 100 warm-up steps; attn's schedule is section 5.3's, which with ``lr_factor``
0.113 and 100 warm-up steps peaks at 1e-3 and falls as the inverse square root of the step (to
2.2e-4 at step 2,000), with Adam and no weight decay. nanoGPT's linear layers and norms have no
biases (``bias=False``); attn's have them. nanoGPT validates on 20 random batches; here every
evaluation reads the same windows spread evenly over the validation text.

Files: ``OUT/attn`` (the attn-train run), ``OUT/torch`` (PyTorch's ``metrics.jsonl``,
``checkpoint.npz``: its final weights in attn's format, for ``attn-generate``), ``OUT/results.jsonl``
(the ``--json`` lines; ``python -m attn.bench --render-markdown OUT/results.jsonl`` prints them as
Markdown again).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import backend as B
from ..checkpoint import load_npz
from ..data import BOS, EOS, PAD, UNK, Vocab, decode_text, encode_text
from ..model import Transformer
from ..optim import Adam
from ..sample import Sampler, generate
from ..training import lm, prepare
from .machine import blas_threads, machine_info
from .quality import QualityError, _check_schedule, _load_average, torch_step
from .twin import torch_adam, torch_available, torch_transformer

PROG = "python -m attn.bench --quality --task lm"
#: The sample each final model writes: nanoGPT's ``sample.py`` settings (a line end to start from,
#: temperature 0.8, the 200 likeliest tokens), the same seed for both.
SAMPLE = dict(prompt="\n", temperature=0.8, top_k=200, seed=0)


# --------------------------------------------------------------------------- the attn half

def run_attn(config, quiet: bool) -> list:
    """``attn.train.train(config)``; returns the tokens seen after each step."""
    from .. import train as T
    tokens = []
    _progress(f"attn: training into {config.out} ({config.engine} engine)", quiet)
    with contextlib.redirect_stdout(sys.stderr):      # stdout carries the report alone (--json)
        metrics = T.train(config, on_step=lambda state, model, wall: tokens.append(state.tokens_seen))
    if metrics.get("interrupted"):
        raise KeyboardInterrupt
    return tokens


# --------------------------------------------------------------------------- the PyTorch half

@dataclass
class TorchLM:
    """The PyTorch half as attn-train's loop drives it (:class:`attn.train.Hooks`): the twin on
    attn's initial weights, its Adam, attn's schedule, the run's text and what it records."""
    torch: object
    config: object
    model_config: object
    corpus: object
    out: Path
    attn_tokens: list
    tmodel: object = None
    topt: object = None
    schedule: Adam | None = None
    state: object = None
    evals: list = field(default_factory=list)

    def __post_init__(self):
        torch, config, mc = self.torch, self.config, self.model_config
        torch.manual_seed(config.seed)
        init = Transformer(mc, seed=config.seed, dtype=config.dtype)          # attn's initial weights
        self.tmodel = torch_transformer(mc, "cpu", config.dtype)
        self.tmodel.load_attn_params(init.params)
        self.topt, _ = torch_adam(self.tmodel)
        self.schedule = Adam({}, mc.d_model, mc.warmup_steps, prepare.schedule_factor(config, mc),
                             cooldown=config.cooldown)
        _check_schedule(Path(config.out) / "metrics.jsonl", self.schedule)
        self.val_batches = lm.val_batches(self.corpus.val, config.context)

    def attn_view(self) -> Transformer:
        """A copy of the twin's weights as an attn model (attn's validation and sampling read it)."""
        params = {k: B.to_device(v, self.config.dtype) for k, v in self.tmodel.attn_params().items()}
        return Transformer(self.model_config, dtype=self.config.dtype, params=params)

    def step(self, b, seed):
        """One PyTorch optimizer step on the windows ``b`` (no dropout: ``seed`` unused)."""
        return torch_step(self, None, self.torch.from_numpy(b.tgt_in), self.torch.from_numpy(b.tgt_out))

    def evaluate(self, bar):
        state = self.state
        t0 = time.perf_counter()
        record = {"step": state.step, "train_loss": float(B.host.mean(state.losses[-self.config.eval_every:]))}
        record.update(lm.validate(self.attn_view(), self.val_batches))
        record.update(train_seconds=round(state.train_seconds, 2), wall_seconds=round(state.wall_seconds, 2),
                      eval_seconds=round(time.perf_counter() - t0, 2))
        self.evals.append(record)
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        bar.write(f"pytorch step {state.step}: val loss {record['val_loss']:.4f}", file=sys.stderr)

    def check_tokens(self, state, wall):
        if state.step > len(self.attn_tokens) or self.attn_tokens[state.step - 1] != state.tokens_seen:
            raise QualityError(f"step {state.step}: PyTorch has seen {state.tokens_seen} tokens, attn "
                               f"{self.attn_tokens[state.step - 1] if state.step <= len(self.attn_tokens) else '-'}"
                               ": the batches differ")


def run_torch(config, model_config, corpus, out: Path, attn_tokens: list, quiet: bool) -> TorchLM:
    """Train the twin as :func:`attn.train.train` trained attn; returns the finished :class:`TorchLM`."""
    import torch
    from .. import train as T
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    half = TorchLM(torch, config, model_config, corpus, out, attn_tokens)
    half.state = state = T.TrainState()
    _progress(f"pytorch: training into {out} (threads {torch.get_num_threads()})", quiet)
    hooks = T.Hooks(half.step, half.evaluate, lambda: None, on_step=half.check_tokens,
                    set_progress=half.schedule.set_progress if config.cooldown else None, desc="pytorch",
                    batches=lambda epoch: lm.Windows(corpus.train, config.context, config.batch, config.seed, epoch))
    stop = T.run_loop(dataclasses.replace(config, quiet=quiet), state, None, hooks)
    if stop == "interrupted":
        raise KeyboardInterrupt
    half.attn_view().save(out / "checkpoint.npz", extra_meta={"steps": state.step})
    return half


# --------------------------------------------------------------------------- the steps interleaved

def step_times(config, model_config, corpus, rounds: int, steps: int = 5, with_torch: bool = True) -> dict:
    """Seconds per training step of attn's two engines and of PyTorch, timed interleaved: ``rounds``
    rounds, each ``steps`` steps of every framework in turn on the same windows (the run's first),
    from the same initial weights; the median of each framework's rounds. On a machine other jobs
    share, the load changes over minutes: the sequential runs' seconds per step then compare times
    under different loads, the interleaved rounds under the same."""
    from .. import engine as engines
    from .. import train as T
    from ..training.prepare import make_engine
    windows = lm.Windows(corpus.train, config.context, config.batch, config.seed, 0)
    batches = [windows[i % len(windows)] for i in range(steps)]
    runners = {}
    for name in ("fast", "reference"):
        engine = engines.get(name)
        model, opt = make_engine(Transformer(model_config, seed=config.seed, dtype=config.dtype), engine,
                                 config.lr_factor, cooldown=config.cooldown)
        loss_fn = engine.loss(trusted=True)
        runners[name] = engine.loop_step(model, lambda b, seed, m=model, o=opt, f=loss_fn: T.train_step(
            m, o, b, None, 0.0, config.clip, f))
    if with_torch:
        import torch
        half = TorchLM(torch, config, model_config, corpus, Path(config.out), [])
        half.state = T.TrainState()
        runners["pytorch"] = half.step
    times = {name: [] for name in runners}
    for r in range(rounds + 1):                          # round 0 warms each up, untimed
        for name, run in runners.items():
            t0 = time.perf_counter()
            for b in batches:
                B.to_float(run(b, 0)[0])                 # the loss on the host: the step is done
            if r:
                times[name].append((time.perf_counter() - t0) / steps)
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    row = {"name": "quality_lm_step_times", "rounds": rounds, "steps_per_round": steps,
           **{f"{n}_seconds_per_step": v for n, v in med.items()}, "load_average_after": _load_average()}
    if with_torch:
        row.update(fast_ratio=med["fast"] / med["pytorch"], reference_ratio=med["reference"] / med["pytorch"])
    return row


# --------------------------------------------------------------------------- the comparison

def sample(model, vocab, chars: int, context: int) -> str:
    """``chars`` characters (tokens) a final model writes from :data:`SAMPLE`'s start."""
    ids = generate(model, encode_text(SAMPLE["prompt"], vocab, True), chars,
                   Sampler(SAMPLE["temperature"], SAMPLE["top_k"], None), SAMPLE["seed"], None,
                   [PAD, BOS, UNK, EOS], window=context)
    return decode_text(ids, vocab, True)


def at_minutes(evals: list, seconds: float) -> dict | None:
    """The last evaluation whose training seconds are at most ``seconds`` (None: none yet)."""
    done = [e for e in evals if e["train_seconds"] <= seconds + 1e-9]
    return done[-1] if done else None


def minute_marks(total_seconds: float) -> list:
    """Training minutes to compare at: every minute (every half minute below 4 minutes, every
    tenth of the time below 1) up to ``total_seconds``."""
    step = 60.0 if total_seconds >= 240 else 30.0 if total_seconds >= 60 else max(total_seconds / 10, 1e-3)
    n = int(total_seconds // step)
    return [round((k + 1) * step / 60, 4) for k in range(n)]


def compare(attn_evals: list, torch_evals: list) -> tuple[list, list]:
    """The rows at equal steps and at equal minutes of training (both frameworks' evaluations)."""
    by_step = {e["step"]: e for e in torch_evals}
    steps = [{"name": "quality_lm_step", "step": e["step"], "val_loss": e["val_loss"],
              "torch_val_loss": by_step.get(e["step"], {}).get("val_loss"), "train_seconds": e["train_seconds"],
              "torch_train_seconds": by_step.get(e["step"], {}).get("train_seconds")} for e in attn_evals]
    total = max([e["train_seconds"] for e in attn_evals + torch_evals] or [0.0])
    minutes = []
    for m in minute_marks(total):
        a, t = at_minutes(attn_evals, m * 60), at_minutes(torch_evals, m * 60)
        minutes.append({"name": "quality_lm_minutes", "minutes": m,
                        "step": a and a["step"], "val_loss": a and a["val_loss"],
                        "torch_step": t and t["step"], "torch_val_loss": t and t["val_loss"]})
    return steps, minutes


def _evals(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(args, config) -> list[dict]:
    """Both halves, the comparison and the samples; returns the rows (machine first)."""
    from .. import train as T
    out = Path(args.out)
    B.set_backend(config.backend or os.environ.get("ATTN_BACKEND", "numpy"))
    if B.get_backend() != "numpy":
        raise QualityError(f"{PROG} runs on NumPy (the CPU): PyTorch's half is timed on the CPU")
    info = _run_info(args, blas_threads(args.threads), not args.no_torch)
    attn_tokens = run_attn(config, args.quiet)
    info["load_average_after_attn"] = _load_average()
    arrays, meta = load_npz(Path(config.out) / "checkpoint.npz")
    ours = Transformer.from_arrays(arrays, meta, source=str(Path(config.out) / "checkpoint.npz"))
    vocab = Vocab.from_json(meta["vocab"])
    attn_losses = arrays["history/train_loss"].tolist()
    config = T.TrainConfig.from_dict(json.loads((Path(config.out) / "config.json").read_text())["train"])
    corpus, _ = lm.load_text(config, vocab, lambda m: None)
    info.update(model_config=ours.config.to_dict(), train_config=config.to_dict(), vocab_size=len(vocab),
                text=corpus.source, train_tokens=int(corpus.train.size), engine=config.engine)
    attn_evals = _evals(Path(config.out) / "metrics.jsonl")
    final = {"name": "quality_lm", "steps": attn_evals[-1]["step"], "val_loss": attn_evals[-1]["val_loss"],
             "train_seconds": attn_evals[-1]["train_seconds"], "peak_memory_mb": None,
             "attn_train_losses_first": attn_losses[:3]}
    torch_evals = []
    if not args.no_torch:
        half = run_torch(config, ours.config, corpus, out / "torch", attn_tokens, args.quiet)
        info["load_average_after_torch"] = _load_average()
        torch_evals = half.evals
        final.update(torch_steps=half.state.step, torch_val_loss=torch_evals[-1]["val_loss"],
                     torch_train_seconds=torch_evals[-1]["train_seconds"],
                     torch_train_losses_first=half.state.losses[:3])
    _progress(f"sampling {args.sample_chars} characters from each final model", args.quiet)
    final["sample"] = sample(ours, vocab, args.sample_chars, config.context)
    if not args.no_torch:
        final["torch_sample"] = sample(half.attn_view(), vocab, args.sample_chars, config.context)
    _per_step(final, config)
    steps, minutes = compare(attn_evals, torch_evals)
    rows = [info, *steps, *minutes, final]
    if args.step_times:
        _progress(f"timing each framework's step interleaved ({args.step_times} rounds)", args.quiet)
        rows.insert(-1, step_times(config, ours.config, corpus, args.step_times, with_torch=not args.no_torch))
    with open(out / "results.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


def _per_step(final: dict, config) -> None:
    """Seconds per step and tokens per second of each framework, and attn's over PyTorch's."""
    tokens = config.context * config.batch
    for pre in ("", "torch_"):
        if pre + "steps" in final:
            s = final[pre + "train_seconds"] / max(final[pre + "steps"], 1)
            final[pre + "seconds_per_step"], final[pre + "tokens_per_second"] = s, tokens / s
    if "torch_seconds_per_step" in final:
        final["ratio"] = final["seconds_per_step"] / final["torch_seconds_per_step"]


def _run_info(args, threads, with_torch: bool) -> dict:
    if with_torch:
        import torch
        torch.set_num_threads(args.threads or threads or os.cpu_count() or 1)
    info = machine_info()
    info.update(name="machine", load_average_before=_load_average(), blas_threads=threads,
                sample_settings=SAMPLE, command="python -m attn.bench --quality " + " ".join(args.argv))
    info.pop("load_average", None)
    if with_torch:
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    return info


# --------------------------------------------------------------------------- the command

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Train attn's language model (exactly as attn-train --task lm would, from the "
                               "same flags) and then the same model in PyTorch, one after the other, on the "
                               "same text, initial weights, windows and schedule; report the validation loss "
                               "at equal steps and at equal minutes, the seconds per step, and a sample from "
                               "each. Every flag not listed here is attn-train's (see attn-train --help).",
        epilog=f"example: {PROG} --preset shakespeare_char --steps 2000 --threads 2")
    p.add_argument("--out", type=Path, default=Path("runs/quality-lm"),
                   help="output folder (default runs/quality-lm): attn/ is the attn-train run, torch/ PyTorch's")
    p.add_argument("--threads", type=int, help="threads for both: NumPy's BLAS and torch.set_num_threads")
    p.add_argument("--sample-chars", type=int, default=300, metavar="N",
                   help="characters each final model writes (default 300)")
    p.add_argument("--step-times", type=int, default=5, metavar="R",
                   help="after the runs, time the step of attn's engines (fast, reference) and PyTorch's "
                        "interleaved, R rounds of 5 steps each, the median (default 5; 0: not)")
    p.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    p.add_argument("--markdown", action="store_true",
                   help="the results as Markdown (for benchmarks/RESULTS.md): the default without --json")
    p.add_argument("--no-torch", action="store_true", help="train attn only (no comparison)")
    return p


def parse_args(argv):
    """(the benchmark's own arguments, the attn half's TrainConfig). Bad flags exit with status 2."""
    from .. import train as T
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.step_times < 0:
        p.error(f"--step-times must be at least 0, got {args.step_times}")
    if args.sample_chars < 1:
        p.error(f"--sample-chars must be at least 1, got {args.sample_chars}")
    for bad in ("--resume", "--out"):
        if any(a == bad or a.startswith(bad + "=") for a in rest):
            p.error(f"{bad} is not an attn-train flag here: the benchmark starts a fresh run; see --help")
    tp = T.build_parser()
    tp.prog = f"{PROG} (attn-train's flags)"
    given = vars(tp.parse_args(rest))
    if not any(a == "--preset" or a.startswith("--preset=") for a in rest):
        given["preset"] = "shakespeare_char"
    if not any(a == "--minutes" or a.startswith("--minutes=") for a in rest):
        given["minutes"] = 0.0                     # the budget is --steps
    try:
        config = T.TrainConfig(**given, out=args.out / "attn")
    except T.TrainConfigError as e:
        p.error(str(e))
    if config.task != "lm" or not config.steps:
        p.error("compares language models by --steps: give --task lm and --steps N")
    if not config.with_recipe().char:
        p.error("compares character-level models (--char): the samples are characters")
    if not args.no_torch and not torch_available():
        p.error("PyTorch is not installed: the comparison needs it (pip install torch), or pass --no-torch")
    args.quiet, args.argv = config.quiet, list(argv)
    return args, config


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def print_markdown(rows, out=sys.stdout) -> None:
    """The run as Markdown: the settings, the table at equal steps, at equal minutes, the samples."""
    info, final = rows[0], rows[-1]
    cfg, tc = info.get("model_config", {}), info.get("train_config", {})
    print(f"- command: `{info.get('command')}` (at commit {str(info.get('commit'))[:7]})", file=out)
    print(f"- text {info.get('text')}: {info.get('train_tokens'):,} training tokens, vocabulary "
          f"{info.get('vocab_size')}; model {cfg.get('n_decoder_layers')} layers, {cfg.get('n_heads')} heads, "
          f"width {cfg.get('d_model')}, d_ff {cfg.get('d_ff')}, {cfg.get('norm_position')}-norm, "
          f"{cfg.get('positional')} positions, dropout {cfg.get('dropout')}; context {tc.get('context')}, batch "
          f"{tc.get('batch')}, warm-up {cfg.get('warmup_steps')}, lr factor {tc.get('lr_factor')}, clip "
          f"{tc.get('clip')}; attn's engine: {info.get('engine')}", file=out)
    print(f"- machine: {info.get('cpu_model')} ({', '.join(info.get('cpu_features') or [])}), "
          f"{info.get('usable_cpus', info.get('cpu_count'))} usable CPUs, BLAS {info.get('blas', '?')} kernel "
          f"{info.get('blas_kernel', '?')} (threads {info.get('blas_threads')}), PyTorch {info.get('torch', '-')} "
          f"(threads {info.get('torch_threads', '-')}); load average (1/5/15 min) before "
          f"{info.get('load_average_before')}, after attn {info.get('load_average_after_attn')}, after PyTorch "
          f"{info.get('load_average_after_torch', '-')}", file=out)
    print("\n| step | attn val loss | PyTorch val loss | attn training s | PyTorch training s |", file=out)
    print("|---:|---:|---:|---:|---:|", file=out)
    for r in rows:
        if r.get("name") == "quality_lm_step":
            print(f"| {r['step']} | {_f(r['val_loss'], '.4f')} | {_f(r['torch_val_loss'], '.4f')} | "
                  f"{_f(r['train_seconds'], '.1f')} | {_f(r['torch_train_seconds'], '.1f')} |", file=out)
    print("\n| training minutes | attn step | attn val loss | PyTorch step | PyTorch val loss |", file=out)
    print("|---:|---:|---:|---:|---:|", file=out)
    for r in rows:
        if r.get("name") == "quality_lm_minutes":
            print(f"| {r['minutes']:g} | {_f(r['step'], 'd')} | {_f(r['val_loss'], '.4f')} | "
                  f"{_f(r['torch_step'], 'd')} | {_f(r['torch_val_loss'], '.4f')} |", file=out)
    print(f"\nseconds per step: attn {_f(final.get('seconds_per_step'), '.4f')}, PyTorch "
          f"{_f(final.get('torch_seconds_per_step'), '.4f')}; attn / PyTorch {_f(final.get('ratio'), '.2f')}",
          file=out)
    for r in rows:
        if r.get("name") == "quality_lm_step_times":
            print(f"\ninterleaved ({r['rounds']} rounds of {r['steps_per_round']} steps, medians): seconds per step "
                  f"attn fast {r['fast_seconds_per_step']:.4f}, attn reference {r['reference_seconds_per_step']:.4f}"
                  + (f", PyTorch {r['pytorch_seconds_per_step']:.4f}; attn / PyTorch: fast {r['fast_ratio']:.2f}, "
                     f"reference {r['reference_ratio']:.2f}" if "fast_ratio" in r else "")
                  + f"; load average after {r['load_average_after']}", file=out)
    for who, key in (("attn", "sample"), ("PyTorch", "torch_sample")):
        if key in final:
            print(f"\n{who}'s sample ({len(final[key])} characters, temperature {SAMPLE['temperature']}, top-k "
                  f"{SAMPLE['top_k']}, seed {SAMPLE['seed']}):\n\n```\n{final[key]}\n```", file=out)


def main(argv=None) -> int:
    from .. import train as T
    from ..checkpoint import CheckpointError
    from ..data import DataError
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--quality"]
    args, config = parse_args(argv)
    try:
        rows = run(args, config)
    except (DataError, CheckpointError, B.BackendError, FileNotFoundError, T.TrainConfigError, QualityError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print_markdown(rows)
    return 0

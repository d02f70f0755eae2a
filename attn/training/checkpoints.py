"""What a training run keeps on disk: its state and checkpoint, the snapshots that
checkpoint averaging uses, and the files of ``out`` (a fresh run refuses an ``out`` that holds
another run; ``--resume`` continues the one there; one run at a time holds an ``out``:
:func:`hold_out`).

A checkpoint holds the model, the Adam moments, the schedule step, the position in the data
(epoch and batch), the vocabulary and the run's settings, so a resumed run repeats the
uninterrupted run's steps exactly, with any number of processes (:mod:`attn.training.distributed`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import backend as B
from ..checkpoint import CheckpointError, load_npz, remove_stale_temporaries, save_npz, write_text_atomic
from ..data import Vocab
from ..model import Transformer
from ..model_files import model_members
from ..optim import Adam
from .config import TrainConfig, TrainConfigError, resumed_config, say_resumed_backend, say_resumed_engine


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
                    config: TrainConfig, corpus=None) -> None:
    """The run's checkpoint; ``corpus`` (an :class:`attn.training.prepare.Corpus`): its fingerprint
    is recorded, which a resumed run checks."""
    arrays = {**model.state_arrays(), **opt.state_arrays(),
              "history/train_loss": B.host.asarray(state.losses, dtype="float64")}
    meta = {"format": "attn-checkpoint-1", "config": model.config.to_dict(), "vocab": vocab.to_json(),
            "step": state.step, "epoch": state.epoch, "batch_index": state.batch_index,
            "train_seconds": state.train_seconds, "tokens_seen": state.tokens_seen, "evals": state.evals,
            "wall_seconds": state.wall_seconds,
            "seed": config.seed, "args": config.to_dict(), "dtype": str(model.dtype)}
    if corpus is not None:
        meta["corpus"] = corpus.fingerprint
    save_npz(path, arrays, meta)


#: What a checkpoint of a run holds beside the model, and what each must be.
STATE_FIELDS = {"step": int, "epoch": int, "batch_index": int, "train_seconds": (int, float),
                "tokens_seen": int}


def check_resumable(path: Path, arrays: dict, meta: dict) -> None:
    """A CheckpointError naming ``path`` unless it holds a run's training state (a model alone,
    such as ``averaged.npz`` or a snapshot, cannot be resumed)."""
    missing = [k for k in STATE_FIELDS if k not in meta]
    if missing or not any(k.startswith("adam.") for k in arrays):
        what = f"no {', '.join(missing)}" if missing else "no optimizer state"
        raise CheckpointError(f"--resume: {path} holds a model but not a run's training state ({what}): it is an "
                              f"averaged model or a snapshot, which translates and exports but does not resume; "
                              f"resume from the run's checkpoint.npz or start a fresh run")
    for k, kind in STATE_FIELDS.items():
        if isinstance(meta[k], bool) or not isinstance(meta[k], kind) or meta[k] < 0:
            raise CheckpointError(f"--resume: {path} has an invalid training state ({k} = {meta[k]!r:.40})")
    if not isinstance(meta.get("args", {}), dict) or not isinstance(meta.get("evals", []), list):
        raise CheckpointError(f"--resume: {path} has an invalid record of the run's settings or evaluations")


def state_from_checkpoint(arrays: dict, meta: dict) -> TrainState:
    """The :class:`TrainState` that :func:`save_checkpoint` wrote."""
    return TrainState(meta["step"], meta["epoch"], meta["batch_index"], meta["train_seconds"],
                      meta["tokens_seen"], meta.get("wall_seconds", meta["train_seconds"]),
                      [float(x) for x in arrays.get("history/train_loss", [])], meta.get("evals", []))


#: What a run writes into ``out``; a fresh run refuses an ``out`` that holds any of them.
RUN_FILES = ("checkpoint.npz", "config.json", "metrics.jsonl", "metrics.json", "loss.png",
             "test_translations.txt", "averaged.npz", "snapshots")


def previous_run(out: Path) -> list[str]:
    return [name for name in RUN_FILES if (out / name).exists()]


def remove_previous_run(out: Path) -> list[str]:
    """Delete the files a previous run wrote into ``out`` (only those: see :data:`RUN_FILES`)."""
    removed = previous_run(out)
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


#: The file in ``out`` that the run writing there holds locked, and which says who it is.
LOCK_FILE = ".attn-train.lock"


@contextlib.contextmanager
def hold_out(out, master: bool = True):
    """Hold ``out`` for one run, from before it looks at what ``out`` holds until it ends: a
    TrainConfigError naming the run that holds it already (its process, machine and start). The
    lock is the operating system's (``fcntl.flock`` on ``out/.attn-train.lock``, the standard
    library's: the file also says who holds it, which a second run reads), so a killed run lets
    go of it. Only process 0 of a data-parallel run (``master``) takes it; the others yield at once."""
    if not master:
        yield
        return
    import fcntl
    out = Path(out)
    check_out(out)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "a process that has not said"
            os.close(fd)
            raise TrainConfigError(f"--out {out} is in use by another attn-train run ({holder}); wait for it "
                                   f"to end or choose another --out") from None
        if os.path.exists(path) and os.path.samestat(os.fstat(fd), os.stat(path)):
            break
        os.close(fd)                # the run before removed the file as this one opened it: again
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}, started "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}".encode())
        yield
    finally:
        os.unlink(path)             # before letting go, so that no one locks a file no longer there
        os.close(fd)
        if made and not any(out.iterdir()):         # a run that wrote nothing leaves no folder behind
            out.rmdir()


def open_run(config: TrainConfig, given=None):
    """The settings of the run about to start in ``config.out``, and its checkpoint if it resumes.

    With ``resume`` the saved run's settings come back (:func:`attn.training.config.resumed_config`)
    and its checkpoint is read: returns ``(config, (arrays, meta))``. A fresh run refuses an ``out``
    that already holds a run unless ``overwrite`` is set (:func:`start_writing` then clears it):
    returns ``(config, None)``. Either way the config comes back with the backend chosen
    (``$ATTN_BACKEND`` or numpy) and the preset's recipe filled in."""
    out = Path(config.out)
    ckpt_path = out / "checkpoint.npz"
    saved = None
    if config.resume:
        if not ckpt_path.is_file():
            raise CheckpointError(f"--resume: there is no checkpoint at {ckpt_path}")
        saved = load_npz(ckpt_path, expect=functools.partial(model_members, optimizer=True))
        check_resumable(ckpt_path, *saved)
        asked_backend = config.backend
        config = resumed_config(config, saved[1].get("args", {}), given)
        say_resumed_backend(saved[1].get("args", {}).get("backend"), asked_backend, config.backend)
        say_resumed_engine(saved[1].get("args", {}), config)
    elif previous_run(out) and not config.overwrite:
        raise TrainConfigError(
            f"--out {out} already holds a run ({', '.join(previous_run(out))}); a fresh run would mix with it. "
            f"Continue it with --resume, choose another --out, or pass --overwrite to delete it and start clean.")
    check_out(out)
    config.check_model_fits()
    if config.backend is None:
        config = dataclasses.replace(config, backend=os.environ.get("ATTN_BACKEND", "numpy"))
    return config.with_recipe(), saved


def check_out(out: Path) -> None:
    """A TrainConfigError unless ``out`` is a folder this process can write into, or one it can
    make (checked before any data preparation)."""
    folder = out
    while not folder.exists() and folder != folder.parent:       # the nearest folder that exists
        folder = folder.parent
    if not folder.is_dir():
        raise TrainConfigError(f"--out {out}: {folder} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise TrainConfigError(f"--out {out}: cannot write into {folder} ({e.strerror})") from None


def start_writing(out: Path, fresh_overwrite: bool, record: dict, say, evals: list | None = None,
                  step: int | None = None) -> None:
    """Make ``out``, remove the temporary files a killed run left there, clear a previous run if
    this fresh run was told to ``--overwrite`` it, and write ``config.json`` (``record``: the model
    config, the settings, the corpus...). A resumed run passes the checkpoint's ``evals`` and
    ``step``: ``metrics.jsonl`` is rewritten to hold exactly those evaluations and the snapshots
    taken after ``step`` are removed (none written after the checkpoint is kept, so that none is
    averaged), and the ``warmup_rule`` that the first session recorded is kept."""
    out.mkdir(parents=True, exist_ok=True)
    stale = remove_stale_temporaries(out, RUN_FILES) + remove_stale_temporaries(out / "snapshots", ["step-*.npz"])
    if stale:
        say(f"removed {len(stale)} temporary file(s) that an interrupted write left in {out}")
    if fresh_overwrite and previous_run(out):
        say(f"--overwrite: starting clean in {out}: removed the previous run's {', '.join(remove_previous_run(out))}")
    if evals is not None:
        if record.get("warmup_rule") is None:
            record = {**record, "warmup_rule": _saved_record(out / "config.json").get("warmup_rule")}
        write_text_atomic(out / "metrics.jsonl", "".join(json.dumps(e) + "\n" for e in evals))
    if step is not None:
        later = [f for f in (out / "snapshots").glob("step-*.npz") if _snapshot_step(f) > step]
        for f in later:
            f.unlink()
        if later:
            say(f"removed {len(later)} snapshot(s) taken after the checkpoint's step {step}")
    write_text_atomic(out / "config.json", json.dumps(record, indent=2))


def _snapshot_step(path: Path) -> int:
    """The step of a snapshot named ``step-00000120.npz``."""
    return int(path.stem.split("-", 1)[1])


def _saved_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def check_something_left(config: TrainConfig, state: TrainState) -> str | None:
    """A resumed run that has already met its stopping rule is an error, not a run of one more step;
    unless its test was never scored (stopped during it: no metrics.json), and then what stopped
    it comes back, for the run to take its test alone. None: there are steps left."""
    for name, done, limit in (("steps", state.step, config.steps), ("epochs", state.epoch, config.epochs),
                              ("minutes", state.wall_seconds / 60.0, config.minutes)):
        if limit and done >= limit:
            if not (Path(config.out) / "metrics.json").exists():
                return f"reached --{name} {limit:g}"
            raise TrainConfigError(f"--resume: the run in {config.out} has already reached --{name} {limit:g} "
                                   f"({done:.4g} done); give a larger --{name} to train on")
    return None


def snapshot(out: Path, model: Transformer, vocab: Vocab, step: int, keep: int) -> None:
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

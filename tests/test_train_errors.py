"""What a user of attn-train can get wrong, and a hard kill: each mistake is one line in the
command's words, before any data preparation where it can be; a killed run's leftovers are
cleared at the next start and its records never run ahead of its checkpoint."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from attn import backend as B
from attn.checkpoint import file_mode, load_npz
from attn.train import TrainConfig, main, train
from attn.training.config import TrainConfigError, config_from_argv
from test_train import TINY, run_train, write_corpus

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _numpy_backend():
    B.set_backend("numpy")
    yield


def attn_train(tmp_path, *flags):
    """``python -m attn.train`` on the tiny corpus, as a user runs it; returns the finished process."""
    (tmp_path / "data").mkdir(exist_ok=True)
    data = write_corpus(tmp_path / "data")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "attn.train", "--data", str(data), *TINY, "--backend", "numpy",
                           *map(str, flags)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def one_line(proc, *words):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attn-train: error:"), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_an_out_that_is_a_file_is_refused_before_the_data_is_read(tmp_path):
    (tmp_path / "file").write_text("x")
    # The data folder does not exist: had the data been read first, that would be the error.
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        proc = subprocess.run([sys.executable, "-m", "attn.train", "--data", str(tmp_path / "nowhere"),
                               "--out", str(out), "--steps", "1"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        one_line(proc, f"--out {out}", "is a file, not a folder")


def test_an_out_that_cannot_be_written_is_refused_before_the_data_is_read(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "attn.train", "--data", str(tmp_path / "nowhere"),
                           "--out", "/proc/attn-run", "--steps", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    one_line(proc, "--out /proc/attn-run", "cannot write into /proc")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_out_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    with pytest.raises(TrainConfigError, match=f"--out {ro / 'run'}: cannot write into {ro}"):
        train(config_from_argv(["--out", str(ro / "run"), "--steps", "1"]))


def test_resuming_an_averaged_model_is_one_line(tmp_path):
    out = tmp_path / "run"
    run_train(tmp_path, "--steps", "4", "--eval-every", "4", "--average", "2", "--snapshot-every", "2",
              "--out", str(out))
    shutil.copy(out / "averaged.npz", out / "checkpoint.npz")
    line = one_line(attn_train(tmp_path, "--resume", "--out", out, "--steps", "6"),
                    str(out / "checkpoint.npz"), "averaged model or a snapshot")
    assert "KeyError" not in line


def test_a_text_file_as_the_checkpoint_to_resume_is_said_to_be_text(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.npz").write_text("not a checkpoint\n")
    one_line(attn_train(tmp_path, "--resume", "--out", out), "not an .npz archive", "looks like text")


@pytest.mark.parametrize("flags, words", [
    (["--lr-factor", "1e308"], ["lr_factor (--lr-factor) must be > 0 and at most 1000"]),
    (["--max-tokens", "100000000"], ["max_tokens (--max-tokens) must be at most 1,000,000"]),
    (["--beam", "100000"], ["beam (--beam) must be at most 256"]),
    (["--beam", "2", "--alpha", "1000"], ["alpha (--alpha) must be in [0, 10]"]),
    (["--d-model", "1000000", "--heads", "2"], ["d_model = 1,000,000 gives", "parameters", "GiB"]),
    (["--task", "lm", "--context", "9000"], ["context (--context) must be at most 8,192"]),
    (["--layers", "100000000"], ["(--layers 100000000)", "n_encoder_layers = 100,000,000 and n_decoder_layers = "
                                 "100,000,000 give", "parameters"]),
])
def test_numbers_out_of_reach_are_refused_before_any_work(tmp_path, flags, words, capsys):
    with pytest.raises(SystemExit) if flags[0] in ("--lr-factor", "--max-tokens", "--beam", "--task") else _returns(2) as got:
        got.value = main(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not (tmp_path / "run").exists()


class _returns:
    def __init__(self, status):
        self.status, self.value = status, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        assert exc[0] is None and self.value == self.status
        return False


def test_a_hard_kill_leaves_nothing_the_next_start_keeps(tmp_path, capsys):
    """Temporary files of a killed write go at the next start; a record of an evaluation whose
    checkpoint was never written is not in metrics.jsonl."""
    out = tmp_path / "run"
    run_train(tmp_path, "--steps", "4", "--eval-every", "2", "--out", str(out))
    for name in (".checkpoint.npz.abc123.tmp", ".metrics.json.x.tmp", "snapshots/.step-00000002.npz.y.tmp"):
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_bytes(b"\0" * 100)
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() + '{"step": 5}\n')   # ahead
    run_train(tmp_path, "--steps", "6", "--eval-every", "2", "--out", str(out), "--resume")
    assert not list(out.rglob("*.tmp"))
    assert "removed 3 temporary file(s)" in capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6]


def test_metrics_jsonl_is_written_after_the_checkpoint(tmp_path, monkeypatch):
    import attn.training.evaluation as E
    calls = []
    real = E.save_checkpoint

    def save(*args, **kwargs):
        calls.append((out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else "")
        return real(*args, **kwargs)

    out = tmp_path / "run"
    monkeypatch.setattr(E, "save_checkpoint", save)
    run_train(tmp_path, "--steps", "4", "--eval-every", "2", "--out", str(out))
    assert [text.count("\n") for text in calls] == [0, 1]          # each record after its checkpoint


def test_resume_keeps_the_warmup_rule_and_files_get_one_mode(tmp_path):
    out = tmp_path / "run"
    run_train(tmp_path, "--steps", "4", "--eval-every", "2", "--out", str(out), "--warmup", "30")
    rule = {"why": "fitted", "steps": 3}
    record = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**record, "warmup_rule": rule}))
    run_train(tmp_path, "--steps", "6", "--eval-every", "2", "--out", str(out), "--resume")
    assert json.loads((out / "config.json").read_text())["warmup_rule"] == rule
    for name in ("checkpoint.npz", "config.json", "metrics.json", "metrics.jsonl"):
        assert stat.S_IMODE((out / name).stat().st_mode) == file_mode(), name
    load_npz(out / "checkpoint.npz")



def test_a_run_of_the_tiled_attention_resumes_on_the_readable_engine():
    """``--resume --reference`` on a run saved with ``--attention flash``: the readable engine has
    no attention to choose, so the saved choice is dropped instead of refused as a clash of two
    flags the user did not give together."""
    from attn.training.config import TrainConfig, resumed_config
    saved = TrainConfig(attention="flash", out="runs/x").to_dict()
    resumed = resumed_config(TrainConfig(resume=True, reference=True, out="runs/x"), saved, {"resume", "reference"})
    assert resumed.reference and resumed.attention == "auto"


def test_resuming_on_the_readable_engine_says_that_the_numbers_change(tmp_path, capsys):
    """The two engines draw other dropout masks: ``--resume --reference`` on a run of the fast engine
    says so, as a switch of ``--backend`` does; resuming on the engine that trained it says nothing."""
    from attn.data import Vocab
    from attn.model import Transformer, TransformerConfig
    from attn.optim import Adam
    from attn.training.checkpoints import TrainState, open_run, save_checkpoint
    out = tmp_path / "run"
    model = Transformer(TransformerConfig(vocab_size=6, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                                          n_decoder_layers=1), seed=0)
    save_checkpoint(out / "checkpoint.npz", model, Adam(model.params, 8), TrainState(step=1),
                    Vocab.build([["a", "b"]]), TrainConfig(out=str(out), backend="numpy"))
    capsys.readouterr()
    config, _ = open_run(config_from_argv(["--resume", "--out", str(out)]), {"resume", "out"})
    assert config.engine == "fast" and capsys.readouterr().err == ""
    config, _ = open_run(config_from_argv(["--resume", "--out", str(out), "--reference"]),
                         {"resume", "out", "reference"})
    err = capsys.readouterr().err.strip().splitlines()
    assert config.engine == "reference" and len(err) == 1, err
    assert "trained by the attn.fast engine and continues on the readable one" in err[0] and "not match" in err[0]


def test_a_resumed_run_refuses_a_changed_corpus_unless_allowed(tmp_path, capsys):
    from attn.checkpoint import save_npz
    from test_train import PAIRS
    out = tmp_path / "run"
    run_train(tmp_path, "--steps", "2", "--eval-every", "2", "--out", str(out))
    arrays, meta = load_npz(out / "checkpoint.npz")
    assert meta["corpus"]["train_pairs"] == len(PAIRS) and len(meta["corpus"]["sha256"]) == 64
    write_corpus(tmp_path / "data", [*PAIRS, *PAIRS])                  # the files doubled since
    capsys.readouterr()
    assert main(["--resume", "--out", str(out), "--steps", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the one the run" in err[0] and "--allow-new-corpus" in err[0], err
    assert f"{len(PAIRS)} training pairs" in err[0] and f"now {2 * len(PAIRS)}" in err[0], err
    assert load_npz(out / "checkpoint.npz")[1]["step"] == 2                 # nothing trained
    assert main(["--resume", "--out", str(out), "--steps", "4", "--allow-new-corpus"]) == 0
    arrays, meta = load_npz(out / "checkpoint.npz")
    assert meta["step"] == 4 and meta["corpus"]["train_pairs"] == 2 * len(PAIRS)   # the new corpus, recorded
    del meta["corpus"]                                                  # a checkpoint from before fingerprints
    save_npz(out / "checkpoint.npz", arrays, meta)
    write_corpus(tmp_path / "data")
    assert main(["--resume", "--out", str(out), "--steps", "6"]) == 0

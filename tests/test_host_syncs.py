"""Host synchronisations of the hot loops, counted on the CuPy stand-in (tests/fakecupy).

On a GPU every device->host transfer waits for the device to finish all the work queued so
far, so a training step or a decoding step that reads a device value back mid-way stalls
the GPU. The stand-in counts every transfer (``.get()``, ``asnumpy``, ``float()``, ``int()``,
``bool()``, ``.item()``, ``.tolist()``...), so the budgets are asserted here, on every machine:

* a training step (:func:`attn.train.train_step` as the fast engine runs it,
  :func:`attn.fast.training.loop.train_step`, with or without gradient clipping): none;
* the training loop: one per step that logs (every :attr:`attn.engine.LossLog.every` steps, and
  before each evaluation or checkpoint), bringing every pending loss at once; none otherwise;
* decoding with the key/value cache: beam search one per generated position, greedy decoding
  one per :attr:`attn.engine.Search.check_every` positions (the fast engine's
  :data:`attn.fast.decoding.search.EOS_CHECK_EVERY` on a GPU: the host learns which sentences have
  ended only then), plus two to start (the source's lengths, the source ids' range check) and
  one at the end for the attention weights when they are asked for. Without the cache (the
  O(t^2) baseline), one more per position: the re-run prefix's ids are range-checked on the
  device each time.

The stand-in is used even where a GPU is usable: real CuPy cannot count its transfers.
"""
from __future__ import annotations

import numpy as np
import pytest

import attn.backend as B
import attn.fast.decoding.search as fast_decoding
import attn.fast.training.loop as FL
import attn.train as T
import fakecupy
from attn import decode
from attn.engine import LossLog
from attn.fast import FastTransformer
from attn.model import Transformer, TransformerConfig
from attn.training.prepare import make_engine, step_loss_fn
from conftest import selected_backend

CFG = TransformerConfig(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=2,
                        dropout=0.1, max_len=32)


class _Batch:
    """A host batch, as :func:`attn.data.make_batches` gives them."""

    def __init__(self, src, tgt_in, tgt_out):
        self.src, self.tgt_in, self.tgt_out = src, tgt_in, tgt_out
        self.n_src_tokens, self.n_tgt_tokens = int((src != 0).sum()), int((tgt_out != 0).sum())


BATCH = _Batch(np.array([[5, 6, 7, 0], [8, 9, 10, 11]]), np.array([[1, 5, 6], [1, 7, 0]]),
               np.array([[5, 6, 2], [7, 2, 0]]))


@pytest.fixture
def stand_in():
    with selected_backend("fakecupy") as cp:
        yield cp


@pytest.mark.filterwarnings("ignore:cupyx.allow_synchronize:UserWarning")   # CuPy's own, entered here on purpose
@pytest.mark.parametrize("clip", [0.0, 1e-3, 1e3])                  # off, clipping, not clipping
def test_a_fast_training_step_never_waits_for_the_device(stand_in, clip):
    model, opt = make_engine(Transformer(CFG, seed=0), "fast", lr_factor=1.0)
    loss_fn = step_loss_fn("fast")
    FL.train_step(model, opt, BATCH, B.DeviceRNG(0), 0.1, clip, loss_fn)    # positional table, buffers
    with fakecupy.counting() as c, fakecupy.cupyx.allow_synchronize(False):
        loss, lr = FL.train_step(model, opt, BATCH, B.DeviceRNG(1), 0.1, clip, loss_fn)
    assert c.n == 0, c.kinds
    assert B.is_device_array(loss) and loss.ndim == 0 and isinstance(lr, float)


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 3.0, 1e6])
def test_clipping_on_the_device_gives_the_host_decision_s_numbers(stand_in, max_norm):
    from attn.optim import clip_grad_norm
    rng = np.random.default_rng(0)
    host = {"a": rng.standard_normal((3, 4)).astype("float32"), "b": rng.standard_normal(5)}
    g1 = {k: B.to_device(v) for k, v in host.items()}
    g2 = {k: B.to_device(v) for k, v in host.items()}
    norm = clip_grad_norm(g1, max_norm)
    with fakecupy.counting() as c:
        dnorm = clip_grad_norm(g2, max_norm, sync=False)
    assert c.n == 0 and B.is_device_array(dnorm) and float(dnorm) == norm
    for k in host:
        assert np.array_equal(B.to_host(g1[k]), B.to_host(g2[k])) and g2[k].dtype == host[k].dtype, k


def test_the_reference_step_checks_on_the_device(stand_in):
    """The readable path validates ids in its layers and the loss's finiteness, each a sync:
    counted here so that a change shows (the trainer's default is the fast path)."""
    model, opt = make_engine(Transformer(CFG, seed=0), "reference", lr_factor=1.0)
    loss_fn = step_loss_fn("reference")
    T.train_step(model, opt, BATCH, B.DeviceRNG(0), 0.1, 0.0, loss_fn)
    with fakecupy.counting() as c:
        T.train_step(model, opt, BATCH, B.DeviceRNG(1), 0.1, 0.0, loss_fn)
    # two embeddings' and the loss's id checks (one transfer each), the loss's finiteness
    assert c.kinds == {"get": 3, "bool": 1}


def test_a_bad_batch_is_refused_on_the_host(stand_in):
    model, opt = make_engine(Transformer(CFG, seed=0), "fast", lr_factor=1.0)
    bad = _Batch(BATCH.src, BATCH.tgt_in, BATCH.tgt_out.copy())
    bad.tgt_out[0, 0] = CFG.vocab_size                       # CuPy would wrap it to 0 silently
    with fakecupy.counting() as c, pytest.raises(IndexError, match=r"train_step: batch.tgt_out .*\[0, 30\)"):
        FL.train_step(model, opt, bad, B.DeviceRNG(0), 0.1, 0.0, step_loss_fn("fast"))
    assert c.n == 0


PAIRS = [("the red cat sleeps", "le chat rouge dort"), ("a big dog runs", "un grand chien court"),
         ("the small bird sings", "le petit oiseau chante"), ("a red dog sleeps", "un chien rouge dort")]


@pytest.mark.parametrize("reference", [False, True])
def test_the_training_loop_syncs_only_on_the_steps_that_log(stand_in, tmp_path, monkeypatch, reference):
    """Transfers between the starts of consecutive steps: one on a logging step (all pending
    losses at once), none on the others; every step's loss still reaches ``state.losses``."""
    for split in ("train", "val", "test"):
        (tmp_path / f"{split}.xx").write_text("\n".join(s for s, _ in PAIRS) + "\n", encoding="utf-8")
        (tmp_path / f"{split}.yy").write_text("\n".join(t for _, t in PAIRS) + "\n", encoding="utf-8")
    at_start, step_syncs = [], []
    real_step = T.train_step

    def counted_step(*args, **kwargs):
        at_start.append(fakecupy.transfers.n)
        with fakecupy.counting() as c:
            out = real_step(*args, **kwargs)
        step_syncs.append(c.n)
        return out
    monkeypatch.setattr(T, "train_step", counted_step)
    n_steps = 2 * LossLog.every + 3
    cfg = T.TrainConfig(data=tmp_path, src="xx", tgt="yy", d_model=16, heads=2, d_ff=32, layers=1, max_tokens=16,
                        steps=n_steps, eval_every=1000, bleu_sentences=0, average=0, minutes=0, quiet=True,
                        backend="cupy", reference=reference, out=tmp_path / "run")
    metrics = T.train(cfg)
    assert metrics["steps"] == n_steps and metrics["backend"] == "cupy"
    per_iteration = np.diff(at_start).tolist()                 # the last iteration ends in the final evaluation
    step_budget = 0 if not reference else 4
    expected = [step_budget + (1 if (i + 1) % LossLog.every == 0 else 0) for i in range(n_steps - 1)]
    assert per_iteration == expected
    assert set(step_syncs) == {step_budget}
    from attn.checkpoint import load_npz
    arrays, _ = load_npz(tmp_path / "run" / "checkpoint.npz")
    losses = arrays["history/train_loss"]
    assert losses.shape == (n_steps,) and np.isfinite(losses).all()


def test_the_wait_for_queued_steps_is_training_time(tmp_path, monkeypatch):
    """On a GPU a step's call only queues its work, and the loss log's sync waits for it: that
    wait is counted in ``train_seconds`` (and so in tokens per second). Here the sync is made to
    take 0.2 s, as a GPU's queue would."""
    import time
    for split in ("train", "val", "test"):
        (tmp_path / f"{split}.xx").write_text("\n".join(s for s, _ in PAIRS) + "\n", encoding="utf-8")
        (tmp_path / f"{split}.yy").write_text("\n".join(t for _, t in PAIRS) + "\n", encoding="utf-8")
    real, waits = T._log_losses, []

    def queued(pending, state):
        if len(pending):
            waits.append(0.2)
            time.sleep(0.2)
        return real(pending, state)
    monkeypatch.setattr(T, "_log_losses", queued)
    cfg = T.TrainConfig(data=tmp_path, src="xx", tgt="yy", d_model=16, heads=2, d_ff=32, layers=1, max_tokens=16,
                        steps=LossLog.every + 2, eval_every=1000, bleu_sentences=0, average=0, minutes=0, quiet=True,
                        backend="numpy", out=tmp_path / "run")
    metrics = T.train(cfg)
    assert len(waits) == 2 and metrics["train_seconds"] >= sum(waits), (waits, metrics["train_seconds"])


def test_a_watched_run_has_every_loss_at_every_step(stand_in, tmp_path):
    """``train(on_step=...)`` (the side-by-side benchmark's watcher) reads ``state.losses[-1]``
    after every step: then every step brings its loss to the host."""
    for split in ("train", "val", "test"):
        (tmp_path / f"{split}.xx").write_text("\n".join(s for s, _ in PAIRS) + "\n", encoding="utf-8")
        (tmp_path / f"{split}.yy").write_text("\n".join(t for _, t in PAIRS) + "\n", encoding="utf-8")
    seen = []
    cfg = T.TrainConfig(data=tmp_path, src="xx", tgt="yy", d_model=16, heads=2, d_ff=32, layers=1, max_tokens=16,
                        steps=3, eval_every=1000, bleu_sentences=0, average=0, minutes=0, quiet=True,
                        backend="cupy", out=tmp_path / "run")
    T.train(cfg, on_step=lambda state, model, wall: seen.append((state.step, list(state.losses))))
    assert [(s, len(losses)) for s, losses in seen] == [(1, 1), (2, 2), (3, 3)]


def test_a_diverged_loss_is_reported_with_its_step(stand_in):
    state = T.TrainState(step=12)
    cp = stand_in
    pending = FL.PendingLosses()
    for v in (2.0, float("nan"), 1.0):
        pending.append(cp.asarray(np.float32(v)))
    with fakecupy.counting() as c, pytest.raises(FloatingPointError, match="nan at step 11"):
        T._log_losses(pending, state)
    assert c.n == 1


@pytest.mark.parametrize("cls", [Transformer, FastTransformer])
@pytest.mark.parametrize("search", ["greedy", "beam"])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("with_attention", [False, True])
@pytest.mark.parametrize("every", [3, 8])
def test_decoding_syncs_once_per_generated_position(stand_in, monkeypatch, cls, search, use_cache, with_attention,
                                                    every):
    """Beam search: one sync per position. Greedy: one per ``every`` positions (rows that ended
    meanwhile leave the batch then, without another)."""
    monkeypatch.setattr(decode.ReadableSearch, "check_every", every)
    monkeypatch.setattr(fast_decoding, "EOS_CHECK_EVERY", every)
    model = cls(TransformerConfig(**{**CFG.__dict__, "dropout": 0.0}), seed=1, dtype="float64")
    src = B.to_device(np.array([[4, 5, 6, 7, 0], [8, 5, 4, 6, 7], [6, 0, 0, 0, 0]]))
    positions = []
    real = decode._CachedStepper.step if use_cache else decode._FullStepper.step
    stepper = decode._CachedStepper if use_cache else decode._FullStepper

    def counted(self, tokens):
        positions.append(fakecupy.transfers.n)
        return real(self, tokens)
    monkeypatch.setattr(stepper, "step", counted)
    run = (lambda: decode.greedy_decode(model, src, max_len=9, use_cache=use_cache, with_attention=with_attention)) \
        if search == "greedy" else \
        (lambda: decode.beam_search(model, src, beam_size=3, max_len=9, use_cache=use_cache,
                                    with_attention=with_attention))
    with fakecupy.counting() as c:
        result = run()
    assert len(result.tokens) == 3
    # Without the cache each position re-runs the decoder on the whole prefix, whose embedding
    # layer checks the ids' range on the device: one more transfer per position. That path is
    # the benchmark's baseline ("recompute the prefix"), not what the translator runs.
    extra = 0 if use_cache else 1
    k = every if search == "greedy" else 1                         # positions between two checks
    n = len(positions)
    assert n > every and positions
    assert np.diff(positions).tolist() == [extra + (1 if (i + 1) % k == 0 else 0) for i in range(n - 1)]
    assert c.n == extra * n + -(-n // k) + 2 + (1 if with_attention else 0), c.kinds


def test_pending_losses_are_one_buffer_that_allocates_only_to_grow(stand_in):
    """The training loop copies each step's loss into one device buffer (so a step may hand back
    a loss in its step memory): an append is one copy, no allocation, except when the buffer
    grows (to twice a log's worth first, then doubling); a log is one transfer of them all."""
    from attn.bench.counts import Tally
    cp = stand_in
    losses = [cp.asarray(np.float32(v)) for v in np.arange(2 * LossLog.every + 3) / 7]
    pending = FL.PendingLosses()
    tally = fakecupy.cupy.tracer = Tally()
    try:
        grows = []
        for loss in losses:
            before = tally.allocations
            pending.append(loss)
            grows.append(tally.allocations - before)
    finally:
        fakecupy.cupy.tracer = None
    assert [i for i, g in enumerate(grows) if g] == [0, 2 * LossLog.every] and max(grows) == 1, grows
    with fakecupy.counting() as c:
        values = pending.take()
    assert c.n == 1 and len(pending) == 0 and pending.take() == []
    assert values == [float(np.float32(v)) for v in np.arange(2 * LossLog.every + 3) / 7]

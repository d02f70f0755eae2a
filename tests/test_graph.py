"""A step captured as a CUDA graph (:mod:`attn.fast.gpu.graph`), proven on the CuPy stand-in.

The stand-in models capture as a GPU does it: while a stream captures, nothing it records has
any effect on memory (the stand-in runs each operation, records it, and puts every array back
when the capture ends; arrays made during it are filled with NaN), a graph replays exactly what
was recorded (host scalars by their value at the capture), and what CUDA or CuPy refuse during a
capture raises. So a step that replays equal to the same steps run eagerly, with a learning rate
that changes every step, is one that a GPU can replay.
"""
from __future__ import annotations

import numpy as np
import pytest

from attn.fast.gpu.graph import CapturedStep, CaptureError, summarise, survey


@pytest.fixture
def fc():
    import fakecupy
    from conftest import selected_backend
    with selected_backend("fakecupy"):
        yield fakecupy.cupy


def _state(cp, seed=0, n=64):
    rng = np.random.default_rng(seed)
    return {"w": cp.asarray(rng.standard_normal(n).astype(np.float32)),
            "g": cp.zeros(n, dtype=np.float32), "lr": cp.zeros(1, dtype=np.float32),
            "cols": cp.zeros(8, dtype=np.float32)}


def _sgd(cp, s):
    """A capture-safe step: its learning rate is read from device memory."""
    from attn.fast.core.dispatch import ops_for
    ops = ops_for(cp)

    def step(x):
        cp.subtract(s["w"], x, out=s["g"])                       # the gradient of |w - x|^2 / 2
        ops.colsum(s["g"].reshape(8, 8), out=s["cols"])         # a RawKernel (two-stage column sums)
        s["cols"] *= np.float32(1 / 64)
        s["g"].reshape(8, 8)[...] += s["cols"]
        cp.multiply(s["g"], s["lr"], out=s["g"])
        s["w"] -= s["g"]
        return s["w"]
    return step


def _batches(n, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(64).astype(np.float32) for _ in range(n)]


def test_a_capture_changes_nothing_and_a_launch_replays_it(fc):
    s = _state(fc)
    before = s["w"].get()
    stream = fc.cuda.Stream(non_blocking=True)
    x = fc.asarray(_batches(1)[0])
    s["lr"][...] = fc.asarray(np.float32([0.5]))
    _sgd(fc, _state(fc))(x)                  # an eager call first: the kernels' scratch memory is made
    with stream:                             # only the current stream's work is captured
        stream.begin_capture()
        _sgd(fc, s)(x)
        graph = stream.end_capture()
    np.testing.assert_array_equal(s["w"].get(), before)       # recorded, not run
    graph.launch()
    eager = _state(fc)
    eager["lr"][...] = fc.asarray(np.float32([0.5]))
    _sgd(fc, eager)(x)
    np.testing.assert_array_equal(s["w"].get(), eager["w"].get())


def test_replaying_equals_eager_steps_with_a_changing_learning_rate(fc):
    lrs = [0.1, 0.05, 0.2, 0.01, 0.3, 0.07]
    eager, captured = _state(fc), _state(fc)
    eager_step, graphed = _sgd(fc, eager), CapturedStep(_sgd(fc, captured), warmup=1)
    for lr, x in zip(lrs, _batches(len(lrs))):
        for s in (eager, captured):
            s["lr"][...] = fc.asarray(np.float32([lr]))       # outside the graph: one host->device copy
        eager_step(fc.asarray(x))
        graphed(fc.asarray(x))
    assert graphed.graphs == 1
    np.testing.assert_array_equal(captured["w"].get(), eager["w"].get())


def test_a_host_scalar_is_replayed_as_it_was_captured(fc):
    """Why the learning rate must live on the device: passed as a host number, a graph replays
    the value it saw when it was captured, and the replayed run leaves the eager one."""
    eager, captured = _state(fc), _state(fc)

    def step_with(s):
        def step(x, lr):
            fc.subtract(s["w"], x, out=s["g"])
            s["g"] *= np.float32(lr)
            s["w"] -= s["g"]
        return step
    lrs, xs = [0.1, 0.2, 0.3], _batches(3)
    box = {}
    graphed = CapturedStep(lambda x: step_with(captured)(x, box["lr"]), warmup=1)
    for lr, x in zip(lrs, xs):
        step_with(eager)(fc.asarray(x), lr)
        box["lr"] = lr
        graphed(fc.asarray(x))
    assert not np.array_equal(captured["w"].get(), eager["w"].get())


def test_one_graph_per_input_shape(fc):
    calls = []

    def step(x):
        calls.append(x.shape)
        x *= np.float32(2)
    graphed = CapturedStep(step, warmup=2)
    for n in (4, 4, 4, 4, 6, 6, 6, 4):
        graphed(fc.ones(n, dtype=np.float32))
    # shape 4: two eager calls, one capture, then launches; shape 6: two eager, one capture
    assert graphed.graphs == 2
    assert calls == [(4,), (4,), (4,), (6,), (6,), (6,)]


@pytest.mark.parametrize("what, kind", [
    (lambda cp, x: x + 1, "memory pool"),
    (lambda cp, x: float(x[0]), "device->host"),
    (lambda cp, x: cp.matmul(x.reshape(1, -1), x.reshape(-1, 1), out=x[:1].reshape(1, 1)), "matmul"),
    (lambda cp, x: cp.random.RandomState(0).random_sample(3, dtype=np.float32), "cuRAND"),
    (lambda cp, x: x.set(np.zeros(x.shape, x.dtype)), "host->device"),
])
def test_what_a_capture_refuses_is_an_error_naming_it(fc, what, kind):
    graphed = CapturedStep(lambda x: what(fc, x), warmup=1, strict=True)
    x = fc.ones(4, dtype=np.float32)
    graphed(x)                                   # eager: allowed
    with pytest.raises(CaptureError, match=kind) as e:
        graphed(x)
    assert "test_graph.py" in str(e.value)       # where the step asked for it
    assert not fc.cuda.Stream(non_blocking=True).is_capturing()


def test_the_stand_in_records_a_pool_allocation_in_a_capture_as_cuda_does(fc):
    """CUDA does not refuse a pool allocation while a stream captures where the pool serves it from
    a free block of the capturing stream's arena, nor a ``cudaMalloc`` in relaxed mode (CuPy's
    default): the stand-in records it, the pool keeps the block, and memory hooks are told of it.
    A ``cudaMalloc`` in global or thread-local mode (a fresh stream's arena holds nothing) is
    refused, naming it."""
    seen = []

    class Hook(fc.cuda.MemoryHook):
        def malloc_postprocess(self, **kw):
            seen.append(kw["mem_size"])
    x = fc.ones(4, dtype=np.float32)
    pool = fc.get_default_memory_pool()
    for mode in (None, fc.cuda.runtime.streamCaptureModeGlobal, fc.cuda.runtime.streamCaptureModeThreadLocal):
        stream = fc.cuda.Stream(non_blocking=True)
        with stream:
            if mode is not None:
                with pytest.raises(fc.StreamCaptureError, match="cudaMalloc of 512 bytes"):
                    stream.begin_capture(mode=mode)
                    try:
                        x + 1
                    finally:
                        stream.end_capture()
                x + 1                        # a block in this stream's arena, freed
            before = pool.total_bytes()
            with Hook():
                stream.begin_capture(mode=mode)
                y = x + 1
                graph = stream.end_capture()
            assert len(graph.pool_allocations) == 1 and "test_graph.py" in graph.pool_allocations[0][1]
            assert pool.total_bytes() == before + (512 if mode is None else 0)       # a block: 512 bytes
        del y
    assert seen == [512, 512, 512]


def test_a_capture_with_an_allocation_in_it_is_refused_and_runs_eagerly(fc):
    """CUDA refuses it (the pool's ``cudaMalloc``: the capture's own stream has no free block),
    or attn's guard where the pool served it from one: the graph is dropped, the reason kept, and
    the step runs eagerly with its right results; the capture is tried again after ``warmup`` eager calls,
    :data:`CAPTURE_TRIES` times, and then that shape runs eagerly for good."""
    from attn.fast.gpu.graph import CAPTURE_TRIES
    calls = []

    def step(x):
        calls.append(1)
        y = x + 1                                # from the memory pool: no step memory here
        x[...] = y
        return x
    graphed = CapturedStep(step, warmup=1)
    x = fc.zeros(4, dtype=np.float32)
    for i in range(10):
        out = graphed(x)
        x = fc.asarray(out.get())                # the step's input is the last result
    assert CAPTURE_TRIES == 3 and graphed.graphs == 0
    assert len(calls) == 10 + CAPTURE_TRIES      # eager, then (refused capture + its eager run, eager) x 3, eager
    (why,) = graphed.refusals.values()
    assert "memory pool" in why and "test_graph.py" in why
    np.testing.assert_array_equal(x.get(), np.full(4, 10, np.float32))


def test_a_transient_refusal_is_followed_by_a_capture(fc):
    """A shape refused once (here: the first capture finds a buffer not made yet) is captured at
    the next try, not left eager for the rest of the run."""
    made = {}

    def step(x):
        if "buf" not in made and fc.cuda.get_current_stream().is_capturing() and not made.get("tried"):
            made["tried"] = True
            made["late"] = fc.zeros(4, dtype=np.float32)      # from the pool, during the capture
        x += 1
        return x
    graphed = CapturedStep(step, warmup=1)
    x = fc.zeros(4, dtype=np.float32)
    for _ in range(5):
        x = fc.asarray(graphed(x).get())                      # the step's input is the last result
    assert graphed.graphs == 1 and not graphed.refusals and made["tried"]
    np.testing.assert_array_equal(x.get(), np.full(4, 5, np.float32))


def test_the_guard_leaves_no_hook_registered_when_warnings_are_errors(fc):
    """CuPy's ``allow_synchronize`` warns that it is deprecated (the stand-in's too): with
    warnings made errors a capture still runs, unwarned, and the guard's memory hook is gone after
    it whatever happened inside."""
    import warnings
    from attn.fast.gpu.graph import CaptureGuard
    cupyx = __import__("attn.backend", fromlist=["_cupyx"])._cupyx()
    with pytest.warns(UserWarning, match="allow_synchronize will be removed"):
        with cupyx.allow_synchronize(False):
            pass
    hooks = fc._tls.hooks                                    # (this thread's: CuPy's hooks are per thread)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CaptureGuard(fc) as guard:
            assert len(fc._tls.hooks) == len(hooks) + 1
        assert fc._tls.hooks == hooks and not guard.reasons
        graphed = CapturedStep(lambda x: x.__iadd__(1), warmup=1)
        x = fc.zeros(4, dtype=np.float32)
        for _ in range(3):
            graphed(x)
    assert graphed.graphs == 1 and fc._tls.hooks == hooks


def test_the_guard_refuses_a_host_sync_and_a_step_memory_overflow(fc):
    from attn.fast.gpu.graph import CaptureGuard
    from attn.fast.gpu.stepmem import StepMemory
    x = fc.ones(4, dtype=np.float32)
    stream = fc.cuda.Stream(non_blocking=True)
    with pytest.raises(Exception, match="synchronis|device->host"):
        with CaptureGuard(fc):
            float(x[0])                          # outside a capture too: the guard forbids waiting
    memory = StepMemory(fc)
    with memory.step():
        with CaptureGuard(fc, memory) as guard, stream:
            stream.begin_capture()
            y = x * 2                            # the slab is empty: the step memory overflows to the pool
            stream.end_capture()
    assert any("overflowed" in r for r in guard.reasons) and any("memory pool" in r for r in guard.reasons)
    del y


def test_numpy_calls_the_function(fc):
    calls = []
    graphed = CapturedStep(lambda x: calls.append(1), warmup=1)
    for _ in range(3):
        graphed(np.ones(3))
    assert len(calls) == 3 and graphed.graphs == 0


def test_the_survey_lists_every_refusal_and_where(fc):
    x = fc.ones(4, dtype=np.float32)

    def step():
        y = x + 1                                 # an allocation
        fc.matmul(y.reshape(1, -1), y.reshape(-1, 1))   # CuPy's matmul (and its result's allocation)
        x.sum()                                   # an allocation
    found = survey(step, fc)
    assert summarise(found) == {"pool allocation": 3, "CuPy matmul": 1}
    assert all("test_graph.py" in r.where for r in found)
    np.testing.assert_array_equal(x.get(), np.ones(4, np.float32))


# ----------------------------------------------------------------------------- batches of few shapes


def _pairs(seed, n=7, V=23):
    rng = np.random.default_rng(seed)
    return [(rng.integers(4, V, rng.integers(1, 9)).tolist(), rng.integers(4, V, rng.integers(1, 11)).tolist())
            for _ in range(n)]


def test_a_batch_padded_to_its_bucket_has_the_same_loss_and_gradients():
    """Padding to a bucket adds masked positions and rows of PAD alone: in float64 the loss and
    every gradient are the unpadded batch's (to the rounding of sums taken in another order)."""
    from conftest import selected_backend
    from attn.data import _pad_batch, pad_to_bucket
    from attn.fast import FastTransformer, cross_entropy as fast_ce
    from attn.model import TransformerConfig
    with selected_backend("numpy"):
        _padded_against_unpadded(FastTransformer, fast_ce, TransformerConfig, _pad_batch, pad_to_bucket)


def _padded_against_unpadded(FastTransformer, fast_ce, TransformerConfig, _pad_batch, pad_to_bucket):
    cfg = TransformerConfig(vocab_size=23, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=2, n_decoder_layers=2,
                            dropout=0.0, label_smoothing=0.1, max_len=32)
    model = FastTransformer(cfg, seed=3, dtype="float64")
    batch = _pad_batch(_pairs(5))
    bucketed = pad_to_bucket(batch, 8, 4)
    assert bucketed.src.shape[0] % 4 == 0 and bucketed.src.shape[1] % 8 == 0 and bucketed.tgt_in.shape[1] % 8 == 0
    assert bucketed.src.shape != batch.src.shape
    assert (bucketed.n_src_tokens, bucketed.n_tgt_tokens) == (batch.n_src_tokens, batch.n_tgt_tokens)
    got = []
    for b in (batch, bucketed):
        logits, cache = model.forward(b.src, b.tgt_in)
        loss, dlogits = fast_ce(logits, b.tgt_out, 0.1)
        grads = model.backward(dlogits, cache)
        got.append((float(loss), {k: np.array(v) for k, v in grads.items()}))
    (l1, g1), (l2, g2) = got
    assert l2 == pytest.approx(l1, rel=1e-13)
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], rtol=1e-10, atol=1e-13, err_msg=k)


def test_bucketing_leaves_few_shapes_and_a_bucketed_batch_as_it_is():
    from attn.data import make_batches, pad_to_bucket
    pairs = _pairs(0, n=400)
    batches = make_batches(pairs, 256, shuffle=True, seed=0)
    shapes = {(b.src.shape, b.tgt_in.shape) for b in batches}
    bucketed = [pad_to_bucket(b) for b in batches]
    few = {(b.src.shape, b.tgt_in.shape) for b in bucketed}
    assert len(few) < len(shapes) / 2, (len(few), len(shapes))
    assert all(pad_to_bucket(b) is b for b in bucketed)
    with pytest.raises(ValueError, match="length_multiple"):
        pad_to_bucket(batches[0], 0)


# ----------------------------------------------------------------------------- the training step captured


#: How far a replayed step may be from the eager one on a GPU (what float atomics allow: see
#: attn.fast.gpu.graph). The stand-in sums in one order: there the replay must equal the eager step
#: bit for bit.
import fakecupy.cupy as fcp  # noqa: E402

import attn.backend as B  # noqa: E402
from attn.fast.gpu.graph import REPLAY_TOLERANCE, held_parameters  # noqa: E402


@pytest.mark.parametrize("positional", ["sinusoidal", "rope"])
def test_the_parameters_a_replay_is_not_held_to_change_no_loss(positional):
    """:func:`held_parameters` leaves out exactly the key biases that change no loss: in float64,
    each key bias moved alone leaves the loss as it was (to rounding) where it is left out, and
    changes it where it is held (the self-attentions' with rotary positions)."""
    from conftest import selected_backend
    from attn.fast import FastTransformer, cross_entropy as fast_ce
    from attn.model import TransformerConfig
    cfg = TransformerConfig(vocab_size=23, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.0, max_len=32, positional=positional)
    rng = np.random.default_rng(4)
    src, tgt = rng.integers(4, 23, (3, 6)), rng.integers(4, 23, (3, 7))
    with selected_backend("numpy"):
        model = FastTransformer(cfg, seed=1, dtype="float64")
        views = model.arena.views(model.arena.params)

        def loss():
            logits, _ = model.forward(src, tgt[:, :-1])
            return float(fast_ce(logits, tgt[:, 1:], 0.1)[0])
        base, moved = loss(), {}
        for name in [k for k in views if k.endswith(".b_k")]:
            views[name] += 3.0
            moved[name] = abs(loss() - base) > 1e-6
            views[name] -= 3.0
        left_out = sum(v.size for v in views.values()) - held_parameters(model).size
    assert len(moved) == 3 and left_out == cfg.d_model * sum(not m for m in moved.values()), moved
    assert moved == {k: positional == "rope" and ".cross_attn." not in k for k in moved}


def _replayed_as_eager(got, want, what) -> None:
    if B.xp() is fcp:
        assert np.array_equal(got, want), what
    else:
        np.testing.assert_allclose(got, want, **REPLAY_TOLERANCE, err_msg=str(what))


@pytest.mark.parametrize("buckets, warmup, precision, attention", [(1, 2, "fp32", "auto"), (2, 2, "fp32", "auto"),
                                                                   (1, 1, "fp32", "auto"), (1, 2, "bf16", "auto"),
                                                                   (1, 2, "fp32", "flash")])
def test_the_captured_training_step_replays_equal_to_eager_steps(buckets, warmup, precision, attention):
    """The capture check of the training step: the toy model's steps on the stand-in, one
    process, dropout on and the warm-up's learning rate rising every step, taken eagerly
    (``train_step`` on the padded batches, ``DeviceRNG`` seeds) and through
    :class:`GraphedTrainStep` (``warmup`` eager calls, one capture, then replays): the losses and
    the parameters after every step are the same (bit for bit on the stand-in; on a GPU within
    :data:`REPLAY_TOLERANCE`, what float atomics allow); one graph was captured per batch
    shape, and every step after a shape's capture is one graph launch. With two shapes in turn,
    the larger grows the engine's scratch buffers between the smaller's capture and its replays.
    With one eager call, the capture is the first step in the slab: the batched products'
    pointer arrays are not kept yet, and the graph makes them in a scratch buffer (a capture
    allocates nothing). At bf16 the graph also replays the weights' bf16 copy (made at every
    forward) and the operands' copies (step memory), and reads the new weights every step. With
    ``attention="flash"`` every attention is the tiled one (:mod:`attn.fast.core.flash`)."""
    from conftest import selected_backend
    with selected_backend("cupy"):
        _captured_against_eager(buckets, warmup, precision, attention)


def _captured_against_eager(buckets, warmup, precision, attention="auto"):
    import attn.backend as B
    from attn.data import _pad_batch, pad_to_bucket
    from attn.fast import FastAdam, FastTransformer
    from attn.fast.gpu.graph import GraphedTrainStep
    from attn.fast.training.loop import train_step
    from attn.model import TransformerConfig
    from attn.training.prepare import step_loss_fn
    cfg = TransformerConfig(vocab_size=23, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=2, n_decoder_layers=2,
                            dropout=0.1, label_smoothing=0.1, max_len=32, warmup_steps=8)
    models = [FastTransformer(cfg, seed=5, precision=precision, check_ids=False, attention=attention)
              for _ in range(2)]
    opts = [FastAdam(m.params, cfg.d_model, cfg.warmup_steps) for m in models]
    graphed = GraphedTrainStep(models[1], opts[1], cfg.label_smoothing, clip=1.0, warmup=warmup)
    loss_fn = step_loss_fn("fast")
    calls, run = [], graphed.captured.fn
    graphed.captured.fn = lambda *a: calls.append(1) or run(*a)
    rng = np.random.default_rng(0)
    batches = []
    while len(batches) < (warmup + 3) * buckets + 1:
        big = buckets == 2 and len(batches) % 2 == 1     # bucket (32 rows, 16 and 16 positions), else (16, 8, 8)
        lo, hi, rows = (9, 16, (17, 33)) if big else (1, 8, (9, 17))
        pairs = [(rng.integers(4, 23, rng.integers(lo, hi)).tolist(), rng.integers(4, 23, rng.integers(lo, hi)).tolist())
                 for _ in range(int(rng.integers(*rows)))]
        batches.append(_pad_batch(pairs))
    for step, batch in enumerate(batches):
        seed = 1000 + step
        loss, lr = graphed(batch, seed)               # first: nothing the eager step leaves behind helps it
        eager_loss, eager_lr = train_step(models[0], opts[0], pad_to_bucket(batch), B.DeviceRNG(seed),
                                          cfg.label_smoothing, 1.0, loss_fn)
        assert lr == eager_lr
        _replayed_as_eager(np.float64(float(loss)), np.float64(float(eager_loss)), ("loss", step))
        _replayed_as_eager(held_parameters(models[1]), held_parameters(models[0]), ("params", step))
        if B.xp() is fcp:                             # one order of sums: every parameter, bit for bit
            assert np.array_equal(B.to_host(models[1].arena.params), B.to_host(models[0].arena.params)), step
    assert graphed.graphs == buckets and not graphed.refusals and opts[0].t == opts[1].t == len(batches)
    assert len(calls) == (warmup + 1) * buckets   # per shape, the eager calls and the capture: the rest replays


@pytest.mark.parametrize("args, why", [(["--backend", "numpy"], "--backend cupy"),
                                       (["--backend", "cupy", "--reference"], "--reference")])
def test_cuda_graph_says_where_it_cannot_run(tmp_path, capsys, args, why):
    from conftest import selected_backend
    from attn.train import main
    with selected_backend("fakecupy"):
        rc = main(["--cuda-graph", *args, "--steps", "1", "--quiet", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "--cuda-graph" in err and why in err, err
    assert not (tmp_path / "run" / "checkpoint.npz").exists()

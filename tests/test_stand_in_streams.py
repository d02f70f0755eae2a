"""The CuPy stand-in's streams are no kinder than CUDA's: its memory pool keeps free blocks per
stream (:mod:`fakecupy.pool`, as CuPy's ``memory.pyx``), so a block freed on one stream is
never handed to a request on another, and a capture that needs memory its stream does not hold
asks for a ``cudaMalloc`` that CUDA refuses in attn's capture mode; and in its asynchronous mode
(:mod:`fakecupy.streams`) a read of what a launch wrote before that launch is known to have run
is an error, where the engine's steps and decoding read nothing early."""
from __future__ import annotations

import numpy as np
import pytest

from attn.fast.gpu.graph import CaptureGuard


@pytest.fixture
def fc():
    import fakecupy
    from conftest import selected_backend
    with selected_backend("fakecupy"):
        yield fakecupy.cupy


def test_a_block_freed_on_one_stream_is_not_handed_to_another(fc):
    pool = fc.get_default_memory_pool()
    a, b = fc.cuda.Stream(non_blocking=True), fc.cuda.Stream(non_blocking=True)
    with a:
        x = fc.ones(1000, dtype=np.float32)                      # 4000 bytes: a block of 4096
    total, free = pool.total_bytes(), pool.free_bytes()
    del x                                                        # back to a's arena (b is current now)
    with b:
        y = fc.ones(1000, dtype=np.float32)
    assert pool.total_bytes() == total + 4096                    # not a's free block: a cudaMalloc
    with a:
        z = fc.ones(500, dtype=np.float32)                       # a's block, split: no cudaMalloc
    assert pool.total_bytes() == total + 4096 and pool.free_bytes() == free + 4096 - 2048
    del y, z
    pool.free_all_blocks(stream=b)
    assert pool.total_bytes() == total and pool.free_bytes() == free + 4096   # a's block, whole again, kept


def test_a_capture_takes_only_its_own_streams_blocks(fc):
    """A capture on stream B of a step whose memory was freed on stream A: on a GPU the pool
    holds no block for B, its ``cudaMalloc`` is refused in thread-local mode (attn's). Where B
    holds one, CUDA lets the capture take it, and attn's guard refuses the capture instead."""
    step = lambda x: x * 2                                       # noqa: E731 (a step that allocates)
    a, b = fc.cuda.Stream(non_blocking=True), fc.cuda.Stream(non_blocking=True)
    x = fc.ones(256, dtype=np.float32)
    for warm in (a, b):
        with warm:
            step(x)                                              # made and freed on `warm`
        with b:
            guard = CaptureGuard(fc)
            with guard:
                b.begin_capture(mode=fc.cuda.runtime.streamCaptureModeThreadLocal)
                try:
                    if warm is a:
                        with pytest.raises(fc.StreamCaptureError, match="cudaMalloc of 1024 bytes"):
                            step(x)
                    else:
                        step(x)
                finally:
                    b.end_capture()
        assert (warm is b) == any("1 allocation(s) of 1024 bytes from the memory pool" in r for r in guard.reasons)


def test_a_result_read_before_its_producer_ran_is_an_error_in_the_asynchronous_mode(fc):
    """A launch on stream B of what stream A wrote runs after it only where an event orders it,
    or the host waited for A; a copy to the host runs on the current stream and waits for it
    alone (the legacy null stream also waits for blocking streams, not for non-blocking ones)."""
    a, b, blocking = fc.cuda.Stream(non_blocking=True), fc.cuda.Stream(non_blocking=True), fc.cuda.Stream()
    with fc.asynchronous():
        with a:
            x = fc.ones(8, dtype=np.float32) * 3                 # queued on a
        with b:
            with pytest.raises(fc.ReadBeforeRunError, match="on stream 0x.* reads an array that .* wrote on stream"):
                x + 1
            b.wait_event(a.record())
            y = x + 1                                            # after a's launches so far
        with pytest.raises(fc.ReadBeforeRunError, match="device->host copy"):
            y.get()                                              # on the null stream: b is non-blocking
        b.synchronize()
        np.testing.assert_array_equal(y.get(), np.full(8, 4, np.float32))
        with blocking:
            z = y * 2
        assert float(z[0]) == 8                                  # the null stream waits for a blocking one
        with a:
            x *= 2                                               # queued on a again
        with pytest.raises(fc.ReadBeforeRunError):
            int(x[0].astype(np.int32))
        fc.cuda.Device().synchronize()
        assert int(x[0].astype(np.int32)) == 6


CFG = dict(vocab_size=23, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1, n_decoder_layers=2, dropout=0.1,
           label_smoothing=0.1, max_len=32, warmup_steps=8)


def test_the_engine_s_steps_and_decoding_run_in_the_asynchronous_mode(fc):
    """A fast training step, the captured step (eager, captured, replayed) and greedy decoding
    with the cache, their losses and tokens read on the host, in the asynchronous mode: nothing
    is read before its producer ran."""
    import attn.backend as B
    from attn import decode
    from attn.data import _pad_batch
    from attn.fast import FastAdam, FastTransformer
    from attn.fast.gpu.graph import GraphedTrainStep
    from attn.model import TransformerConfig
    from attn.train import train_step
    from attn.training.prepare import step_loss_fn
    cfg = TransformerConfig(**CFG)
    rng = np.random.default_rng(0)
    batch = _pad_batch([(rng.integers(4, 23, 6).tolist(), rng.integers(4, 23, 7).tolist()) for _ in range(5)])
    with fc.asynchronous() as order:
        models = [FastTransformer(cfg, seed=5, check_ids=False) for _ in range(2)]
        opts = [FastAdam(m.params, cfg.d_model, cfg.warmup_steps) for m in models]
        loss, _ = train_step(models[0], opts[0], batch, B.DeviceRNG(0), cfg.label_smoothing, 1.0, step_loss_fn("fast"))
        assert np.isfinite(float(loss))
        graphed = GraphedTrainStep(models[1], opts[1], cfg.label_smoothing, clip=1.0, warmup=1)
        for seed in range(3):                                    # eager, captured, replayed
            assert np.isfinite(float(graphed(batch, seed)[0]))
        assert graphed.graphs == 1 and not graphed.refusals
        result = decode.greedy_decode(models[0], B.to_device(batch.src), max_len=4)
        assert len(result.tokens) == batch.src.shape[0]
        assert sum(order.launched.values()) > 100                # the launches were seen


def _in_a_thread(fn):
    """What ``fn()`` returned in a new thread (its exception raised here)."""
    import threading
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:   # noqa: BLE001 (re-raised in the caller's thread)
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_the_current_stream_is_per_thread(fc, monkeypatch):
    """As CuPy keeps it (thread-local state in ``cupy/cuda/stream.pyx``): ``with s:`` and ``use()``
    change the calling thread's current stream only; a thread that made none current launches on
    ``Stream.null``, or on ``Stream.ptds`` (``cudaStreamPerThread``) where
    ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``, whatever its starter made current."""
    s, t = fc.cuda.Stream(non_blocking=True), fc.cuda.Stream()
    with s:
        assert _in_a_thread(fc.cuda.get_current_stream) is fc.cuda.Stream.null
        assert _in_a_thread(lambda: (t.use(), fc.cuda.get_current_stream())[1]) is t
        assert fc.cuda.get_current_stream() is s                 # the other thread's use() left it
        monkeypatch.setattr(fc, "_PTDS", True)
        assert _in_a_thread(fc.cuda.get_current_stream).ptr == fc.cuda.runtime.streamPerThread
    assert fc.cuda.get_current_stream() is fc.cuda.Stream.null
    with fc.asynchronous():
        with s:
            x = fc.ones(8, dtype=np.float32) * 3                 # queued on s (non-blocking)
            with pytest.raises(fc.ReadBeforeRunError, match="on the per-thread default stream of thread"):
                _in_a_thread(lambda: x + 1)                      # the worker's stream does not wait for s
            s.synchronize()
            y = _in_a_thread(lambda: x + 1)                      # on the worker's own default stream
        with pytest.raises(fc.ReadBeforeRunError, match="wrote on the per-thread default stream"):
            _in_a_thread(lambda: y * 2)                          # another thread's: another stream
        monkeypatch.setattr(fc, "_PTDS", False)
        assert float(y[0]) == 4                                  # the legacy null stream waits for it


def test_an_operation_on_another_stream_during_a_capture_is_not_captured(fc):
    """On a GPU only the capturing stream's work enters the graph: a worker thread's (on its own
    default stream), or this thread's inside ``with`` another stream, runs at once. The stand-in
    cannot run it beside a capture (the capture is undone at its end) and refuses it, naming it;
    the capturing stream's own operations are recorded and replayed."""
    s = fc.cuda.Stream(non_blocking=True)
    x = fc.ones(4, dtype=np.float32)
    y = x + 0
    with s:
        s.begin_capture()
        try:
            with pytest.raises(fc.StreamCaptureError, match="on the null stream .* while stream 0x.* captures"):
                _in_a_thread(lambda: x + 1)
            with fc.cuda.Stream():
                with pytest.raises(fc.StreamCaptureError, match="on stream 0x.* while stream 0x.* captures"):
                    x + 1
            y += 1
        finally:
            graph = s.end_capture()
        graph.launch()
    assert float(y[0]) == 2


LATER = {"norm_kind": "rms", "positional": "rope", "ffn": "swiglu", "kv_heads": 1, "dropout": 0.0}


@pytest.mark.parametrize("options", [{}, LATER], ids=["paper", "later"])
def test_the_engine_launches_on_cupy_from_the_calling_thread_only(fc, monkeypatch, options):
    """The fast engine splits a batch over helper threads on NumPy; on CuPy a helper would launch
    on its own default stream (the current stream is per thread), not on the caller's: its
    kernels would escape a capture and race the step. A training step with four workers asked
    for, its optimiser on four threads, and greedy decoding, of the paper's block and of the
    later one: every launch from this thread."""
    import threading

    import attn.backend as B
    from attn import decode
    from attn.data import _pad_batch
    from attn.fast import FastAdam, FastTransformer
    from attn.model import TransformerConfig
    from attn.train import train_step
    from attn.training.prepare import step_loss_fn
    cfg = TransformerConfig(**{**CFG, **options})
    rng = np.random.default_rng(1)
    batch = _pad_batch([(rng.integers(4, 23, 6).tolist(), rng.integers(4, 23, 7).tolist()) for _ in range(8)])
    threads = set()
    monkeypatch.setattr(fc, "tracer", lambda *a: threads.add(threading.current_thread()))
    model = FastTransformer(cfg, seed=5, check_ids=False)
    model.workers = 4
    opt = FastAdam(model.params, cfg.d_model, cfg.warmup_steps)
    opt.threads = 4
    loss, _ = train_step(model, opt, batch, B.DeviceRNG(0), cfg.label_smoothing, 1.0, step_loss_fn("fast"))
    decode.greedy_decode(model, B.to_device(batch.src), max_len=4)
    assert threads == {threading.current_thread()}

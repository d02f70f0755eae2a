"""The step memory (:mod:`attn.fast.gpu.stepmem`), proven on the CuPy stand-in.

While a step's allocator is in place, the stand-in places every new device array in the memory
the allocator returns (a view of the slab), so memory handed out twice is shared for real, as
on a GPU: an array kept past its step is overwritten by the next one, and with the slab
poisoned at every step's start it reads NaN.
"""
from __future__ import annotations

import numpy as np
import pytest

from attn.fast.gpu import stepmem
from attn.fast.gpu.stepmem import StepMemory, outside_step


@pytest.fixture
def fc():
    import fakecupy
    from conftest import selected_backend
    with selected_backend("fakecupy"):
        yield fakecupy.cupy


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(stepmem, "POISON", True)


def _reserve(memory, nbytes: int) -> None:
    """Make ``memory``'s slab hold ``nbytes`` now, outside a step, so that even the first step at a
    shape is served by it."""
    memory._grow(memory.xp.cuda.get_allocator(), -(-nbytes // stepmem.ALIGN) * stepmem.ALIGN)


def _addresses(cp, memory, shapes):
    with memory.step():
        arrays = [cp.ones(s, dtype=np.float32) * 2 for s in shapes]
        return [a.data.ptr for a in arrays], arrays


@pytest.mark.parametrize("planned", [True, False])
def test_a_step_is_served_by_the_slab_at_the_same_addresses_every_step(fc, planned):
    memory = StepMemory(fc, planned=planned)
    shapes = [(3, 5), (7,), (2, 2, 2)]
    first, _ = _addresses(fc, memory, shapes)
    assert memory.overflows == 2 * len(shapes) and memory.allocations == 0     # an empty slab: the pool
    if planned:                  # each `ones` is freed once doubled: the next one takes its bytes
        assert memory.capacity == memory.last_plan.size == 4 * stepmem.ALIGN < memory.demand
    else:
        assert memory.capacity == memory.demand > 0                            # grown after the step
    second, arrays = _addresses(fc, memory, shapes)
    third, _ = _addresses(fc, memory, shapes)
    assert second == third and memory.overflows == 0 and memory.allocations == 2 * len(shapes)
    slab = memory.slab.data.ptr
    assert all(slab <= p < slab + memory.capacity and (p - slab) % stepmem.ALIGN == 0 for p in second)
    np.testing.assert_array_equal(arrays[0].get(), np.full((3, 5), 2, np.float32))


def test_a_larger_step_grows_the_slab_after_it_and_keeps_the_old_one_if_pinned(fc):
    memory = StepMemory(fc, planned=False)
    _addresses(fc, memory, [(4,)])
    small = memory.capacity
    _addresses(fc, memory, [(4,), (1000,)])          # the second array does not fit: from the pool
    assert memory.overflows == 2 and memory.capacity > small
    assert memory.stats()["retired_slabs"] == 0      # no graph was captured on it: let go
    _addresses(fc, memory, [(4,), (1000,)])
    assert memory.overflows == 0
    memory.pin()                                     # a graph captured on this slab
    old = memory.slab
    _addresses(fc, memory, [(4,), (5000,)])
    assert memory.stats()["retired_slabs"] == 1 and memory._retired[0] is old


@pytest.mark.parametrize("planned", [True, False])
def test_a_step_over_the_limit_keeps_its_slab_and_takes_the_rest_from_the_pool(fc, planned):
    memory = StepMemory(fc, planned=planned)
    _addresses(fc, memory, [(100,)])
    small = memory.capacity
    memory.limit = 1000
    _addresses(fc, memory, [(100,), (1000,)])
    if planned:                  # the plan served the first array, then the sizes changed: the pool
        assert memory.overflows == 2 and not memory.over_limit
        _addresses(fc, memory, [(100,), (1000,)])                      # traced: its plan is over the limit
    assert memory.over_limit and memory.capacity == small
    _addresses(fc, memory, [(100,), (1000,)])
    assert memory.allocations == 2 and memory.overflows == 2           # ones and * 2, for each shape


def test_what_is_kept_between_steps_is_made_outside_the_slab(fc):
    memory = StepMemory(fc)
    _reserve(memory, 4096)
    assert memory.capacity == 4096
    with memory.step():
        with outside_step():
            kept = fc.zeros(8, dtype=np.float32)
        inside = fc.zeros(8, dtype=np.float32)
    import fakecupy.cupy as fcp
    assert not fcp.in_step_memory(kept._a) and fcp.in_step_memory(inside._a)
    assert memory.allocations == 1
    with outside_step():                               # outside any step: nothing changes
        assert not fcp.in_step_memory(fc.zeros(3)._a)


def test_a_read_of_a_previous_steps_array_is_detectable(fc, poisoned):
    """With POISON, every step begins by filling the slab with 0xFF: an array of the last step
    read after the next one began reads NaN (without it, whatever the next step wrote)."""
    memory = StepMemory(fc)
    _addresses(fc, memory, [(6,)])
    _, (stale,) = _addresses(fc, memory, [(6,)])
    with memory.step():
        assert np.isnan(stale.get()).all()


def test_steps_do_not_nest_and_numpy_has_no_step_memory(fc):
    memory = StepMemory(fc)
    with memory.step():
        with pytest.raises(RuntimeError, match="already in progress"):
            with memory.step():
                pass

    class Host:
        xp = np
    assert StepMemory.of(Host()) is None
    with pytest.raises(TypeError, match="NumPy"):
        StepMemory(np)


def test_the_stand_in_models_cupys_allocator_api(fc):
    calls = []
    slab = fc.zeros(4096, dtype=np.uint8)

    def malloc(size):
        calls.append(size)
        return slab.data + 512
    assert fc.cuda.get_allocator() == fc.get_default_memory_pool().malloc
    with fc.cuda.using_allocator(malloc):
        assert fc.cuda.get_allocator() is malloc
        a = fc.arange(10, dtype=np.float32) + 1
        with pytest.raises(ValueError, match="using_allocator"):
            fc.cuda.set_allocator(malloc)
    assert calls == [40, 40] and a.data.ptr == slab.data.ptr + 512        # arange, then + 1, at one address
    np.testing.assert_array_equal(slab[512:552].view(np.float32).get(), np.arange(1, 11, dtype=np.float32))
    b = fc.arange(3) + 1                                 # the pool again: not in the slab
    assert not np.may_share_memory(b._a, slab._a)


def test_a_capture_inside_a_step_takes_the_slab_and_refuses_the_pool(fc):
    from attn.fast.gpu.graph import CaptureError, CapturedStep
    memory = StepMemory(fc)
    x = fc.ones(16, dtype=np.float32)
    shape = {"n": 16}

    def step(x):
        y = x * 2 + 1                                   # two new arrays a step
        fc.zeros(shape["n"], dtype=np.float32)
        return y.sum()
    graphed = CapturedStep(step, warmup=1, memory=memory)
    assert float(graphed(x)) == 48                       # eager: the pool, then the slab grows
    out = graphed(x)                                     # captured: the slab only
    assert graphed.graphs == 1 and memory.overflows == 0 and memory._pinned, graphed.refusals
    x[...] = 2
    graphed(x)
    assert float(out) == 80
    shape["n"] = 10_000                                  # a capture that would need the pool
    other = CapturedStep(step, warmup=1, memory=memory, strict=True)
    other(fc.ones(16, dtype=np.float32))
    shape["n"] = 20_000
    with pytest.raises(CaptureError, match="memory pool"):
        other(fc.ones(16, dtype=np.float32))


def _toy():
    from attn.model import TransformerConfig
    return TransformerConfig(vocab_size=23, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=2, n_decoder_layers=2,
                             dropout=0.1, label_smoothing=0.1, max_len=32, warmup_steps=8)


def test_the_training_step_in_step_memory_equals_it_without(fc, poisoned):
    """The fast engine's ``train_step`` (:mod:`attn.fast.training.loop`) runs in the model's step memory, poisoned at every
    step: over batches of two shapes (the slab grows once more) it computes what the same
    step computes without step memory, bit for bit (a buffer kept between steps taken from
    the slab, or a kept array of a previous step, would read NaN), and a steady-state step
    takes nothing from the pool."""
    import attn.backend as B
    import attn.fast.training.loop as FL
    from attn import train as T
    from attn.data import _pad_batch, pad_to_bucket
    from attn.fast import FastAdam, FastTransformer
    from attn.fast.core.dispatch import ops_for
    from attn.bench.counts import Tally
    from attn.training.prepare import step_loss_fn
    cfg = _toy()
    models = [FastTransformer(cfg, seed=5) for _ in range(2)]
    opts = [FastAdam(m.params, cfg.d_model, cfg.warmup_steps) for m in models]
    loss_fn = step_loss_fn("fast")
    # the slab large enough from the first step, so that whatever the engine makes on first use
    # and keeps (scratch buffers, device constants, Adam's step count) would land in it, were it
    # not made outside the step; and those made by earlier tests made again here
    _reserve(StepMemory.of(models[0]), 3 << 20)          # the first shape needs less, the second more
    ops = ops_for(B.xp())
    ops._scratch.clear(), ops._ones.clear(), ops._seeds.clear()
    rng = np.random.default_rng(0)
    losses, pool = [], []
    for step in range(6):
        n, L = (6, 7) if step < 3 else (20, 12)        # padded to (16, 8) and (32, 16) positions
        pairs = [(rng.integers(4, 23, rng.integers(1, L)).tolist(), rng.integers(4, 23, rng.integers(1, L)).tolist())
                 for _ in range(n)]
        batch = pad_to_bucket(_pad_batch(pairs))
        tally = fc.tracer = Tally()
        try:                                           # (the seed: a new DeviceRNG a step, as attn-train makes)
            with_memory = FL.train_step(models[0], opts[0], batch, B.DeviceRNG(step), cfg.label_smoothing, 1.0,
                                        loss_fn)
        finally:
            fc.tracer = None
        pool.append(tally.allocations)
        without = T.train_step(models[1], opts[1], batch, B.DeviceRNG(step), cfg.label_smoothing, 1.0, loss_fn)
        losses.append(with_memory[0])
        assert float(with_memory[0]) == float(without[0]) and with_memory[1] == without[1], step
        assert np.array_equal(B.to_host(models[0].arena.params), B.to_host(models[1].arena.params)), step
        memory = StepMemory.of(models[0])
        assert (memory.overflows > 0) == (step == 3), (step, memory.stats())
    assert memory.steps == 6 and not memory._retired          # no graph: the slab replaced was let go
    # from the pool: what the engine keeps, made at each shape's first two steps (the first is
    # traced at the bump allocator's addresses, the second is the first at its plan's: the batched
    # products' pointer arrays for its addresses); in every other step one array, the loss's copy
    # the step returns (kept past it)
    assert pool[2] == pool[5] == 1 and min(pool[0], pool[1], pool[3], pool[4]) > 1, pool
    assert memory.plans_made == 2 and not memory.overlapping
    assert all(np.isfinite(float(v)) for v in losses)             # the losses kept are copies


# ----------------------------------------------------------------------------- the plan by lifetimes


def _overlaps(p, died) -> list:
    """(i, j) of every two requests of plan ``p`` alive at once whose bytes overlap (none, if right)."""
    n = len(p)
    off, size = np.asarray(p.offsets, dtype=np.int64), np.asarray(p.sizes, dtype=np.int64)
    born = np.arange(n, dtype=np.int64)
    end = np.maximum(np.asarray(died, dtype=np.int64), born + 1)
    out = []
    for i in range(n):
        j = np.nonzero((born > i) & (born < end[i]) & (off < off[i] + size[i]) & (off[i] < off + size))[0]
        out += [(i, int(k)) for k in j]
    return out


def test_a_plan_never_overlaps_two_live_arrays_and_needs_about_their_peak():
    from attn.fast.gpu.stepplan import FOREVER, peak_live, plan
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 60))
        sizes = (rng.integers(1, 64, n) * stepmem.ALIGN).tolist()
        died = [FOREVER if rng.random() < 0.1 else int(i + 1 + rng.integers(0, 8)) for i in range(n)]
        p = plan(sizes, died)
        assert not _overlaps(p, died), trial
        assert p.peak == peak_live(sizes, died) <= p.size <= sum(sizes)
        assert all(o % stepmem.ALIGN == 0 for o in p.offsets)
    # a chain of arrays each freed once the next is made: two at a time
    p = plan([1024] * 10, [i + 2 for i in range(10)])
    assert p.size == p.peak == 2048


def test_the_training_step_planned_equals_it_unplanned_and_no_live_arrays_overlap(fc, poisoned):
    """The toy model's training step in a planned step memory that checks every step (each
    array's memory watched: no two alive at once share a byte) computes, bit for bit, what the
    bump allocator's step computes, with a slab near the peak of live bytes, well under the sum."""
    cfg = _toy()
    planned, bump = StepMemory(fc, planned=True, check=True), StepMemory(fc, planned=False)

    def watch(step):
        if step:
            assert planned.overflows == 0 and planned.allocations == bump.allocations, planned.stats()
    twin_steps_agree(cfg, 5, seed=1, memories=(planned, bump), after=watch)
    assert not planned.overlapping and planned.plans_made == 1
    peak = planned.last_plan.peak
    assert peak <= planned.capacity <= 1.1 * peak and planned.capacity < 0.8 * bump.capacity, \
        (planned.capacity, peak, bump.capacity)


def twin_steps_agree(cfg, steps: int, seed: int, memories=(None, None), second=None, after=None):
    """Train two fast models of ``cfg`` with the same weights on the same random padded batches
    (``memories``: the step memory each runs in, None for its own; ``second(step)``: a context
    around the second model's step; ``after(step)``: a check after both): every step's loss,
    learning rate and parameters agree bit for bit. Returns the two optimizers."""
    import contextlib

    import attn.backend as B
    import attn.fast.training.loop as FL
    from attn.data import _pad_batch, pad_to_bucket
    from attn.fast import FastAdam, FastTransformer
    from attn.training.prepare import step_loss_fn
    models = [FastTransformer(cfg, seed=5) for _ in range(2)]
    opts = [FastAdam(m.params, cfg.d_model, cfg.warmup_steps) for m in models]
    for m, memory in zip(models, memories):
        if memory is not None:
            m._step_memory = memory
    loss_fn = step_loss_fn("fast")
    rng = np.random.default_rng(seed)
    V = cfg.vocab_size
    for step in range(steps):
        pairs = [(rng.integers(4, V, rng.integers(1, 7)).tolist(), rng.integers(4, V, rng.integers(1, 7)).tolist())
                 for _ in range(6)]
        batch = pad_to_bucket(_pad_batch(pairs))
        a = FL.train_step(models[0], opts[0], batch, B.DeviceRNG(step), cfg.label_smoothing, 1.0, loss_fn)
        with (second(step) if second is not None else contextlib.nullcontext()):
            b = FL.train_step(models[1], opts[1], batch, B.DeviceRNG(step), cfg.label_smoothing, 1.0, loss_fn)
        assert float(a[0]) == float(b[0]) and a[1] == b[1], step
        assert np.array_equal(B.to_host(models[0].arena.params), B.to_host(models[1].arena.params)), step
        if after is not None:
            after(step)
    return opts


# ----------------------------------------------------------------------------- plans keyed by shape


def test_a_zero_size_array_takes_no_bytes_and_is_not_one_of_the_plans_requests(fc):
    """CuPy asks the allocator for a zero-size array's memory too (so does the stand-in): in a
    first step, with no slab yet, that request takes nothing; the plan counts only the others."""
    memory = StepMemory(fc)
    for _ in range(3):
        with memory.step(((3, 4),)):
            fc.ones(0, dtype=np.float32)
            kept = fc.ones((3, 4), dtype=np.float32) * 2
            fc.empty((0, 5), dtype=np.float32)
    assert len(memory.last_plan) == 2 and memory.stats()["steps_planned"] == 2 and memory.overflows == 0
    np.testing.assert_array_equal(kept.get(), np.full((3, 4), 2, np.float32))


def test_steps_of_shapes_in_one_bucket_share_a_plan_as_large_as_the_largest(fc):
    """A step key's integers are rounded up to powers of two (:func:`stepmem.bucket`): steps of
    5 and 7 rows share the plan of 8: a step asking for more than it holds goes past it (spilled),
    and the plan is made again with each request as large as either asked (the same requests in
    the same order: the same lifetimes, no trace); then planned whichever comes."""
    memory = StepMemory(fc)
    assert stepmem.bucket(((5, 3), "<f4", 0)) == ((8, 4), "<f4", 0)
    outcomes = []
    for rows in (5, 5, 7, 7, 5, 7, 6, 12):
        with memory.step(((rows, 3),)):
            a = fc.ones((rows, 64), dtype=np.float32)
            b = a * 2
            del a
            c = b + 1
            np.testing.assert_array_equal(c.get(), np.full((rows, 64), 3, np.float32))
        outcomes.append(memory.last_outcome)
    assert outcomes == ["traced", "planned", "spilled", "planned", "planned", "planned", "planned", "traced"], outcomes
    assert len(memory._plans) == 2 and not memory.overlapping


def test_a_plan_met_in_another_order_is_checked_not_overlapped(fc):
    """The first step at each exact key on a plan watches every array: a request the plan places
    over an array still alive (the requests came in another order, with the same sizes) is served
    past the plan's bytes instead, noted, and the key traced again; so two live arrays never share
    a byte. Once checked, a key's steps run on the plan unwatched."""
    memory = StepMemory(fc)

    def step(key, keep_first):
        with memory.step(key):
            a = fc.full(64, 1, dtype=np.float32)
            b = fc.full(64, 2, dtype=np.float32)
            if not keep_first:
                del a
                a = None
            c = fc.full(64, 3, dtype=np.float32)              # where the plan put it: over the first's bytes
            values = [x.get().tolist() for x in (a, b, c) if x is not None]
        return values, memory.last_outcome
    assert step((5,), False)[1] == "traced"
    assert step((5,), False)[1] == "planned" and not memory.overlapping
    values, outcome = step((6,), True)                        # the same bucket and sizes; the first kept
    assert values == [[1] * 64, [2] * 64, [3] * 64] and outcome == "spilled" and memory.overlapping == [(0, 2)]
    assert step((6,), True)[1] == "traced"
    assert step((6,), True)[1] == "planned" and step((6,), True)[1] == "planned"
    assert (6,) in memory.last_plan.verified


def test_an_eager_attn_train_runs_its_steps_on_a_plan_after_the_first_few(fc, tmp_path):
    """``attn-train`` on the stand-in, eagerly, over batches of about N tokens in many shapes:
    each bucket of batch shapes is traced once, and after the first steps nearly every step runs on
    its bucket's plan (a step spills past it only when it asks for more than every earlier step of
    its bucket, so spills end too)."""
    from attn.train import train
    from attn.training.config import config_from_argv
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    lines = ["\t".join(" ".join(rng.choice(words, rng.integers(11, 15))) for _ in range(2)) for _ in range(100)]
    (tmp_path / "pairs.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    seen = []
    fakecupy_install()
    train(config_from_argv(["--tsv", str(tmp_path / "pairs.tsv"), "--d-model", "8", "--heads", "2", "--d-ff", "16",
                            "--layers", "1", "--max-tokens", "96", "--minutes", "0", "--bleu-sentences", "0",
                            "--average", "0", "--backend", "cupy", "--steps", "16", "--eval-every", "1000",
                            "--out", str(tmp_path / "run"), "--quiet"]),
          on_step=lambda state, model, wall: seen.append((StepMemory.of(model).last_outcome,
                                                          stepmem.bucket(StepMemory.of(model)._step_key))))
    outcomes = "".join(o[0] for o, _ in seen)
    traced = [b for o, b in seen if o == "traced"]
    late = outcomes[6:]           # batches of 6 to 8 sentences of 12 to 15 tokens: mostly one bucket, (8, 16)
    assert len(seen) == 16 and len(traced) == len(set(traced)) and late.count("p") >= 0.75 * len(late), outcomes


def fakecupy_install():
    import fakecupy
    fakecupy.install()


def test_a_request_is_watched_until_its_last_view_and_costs_no_runtime_call(fc):
    """The stand-in honours ``ndarray(memptr=)`` as CuPy does (the array over that memory, keeping
    it alive), so the weak reference on a request's ``UnownedMemory`` fires only once its last view
    is gone; and the step memory gives each one its device id, so wrapping a request asks the
    runtime nothing (without it CuPy calls ``cudaPointerGetAttributes`` per request)."""
    import weakref
    from attn.fast.gpu.stepmem import piece_class
    base = fc.zeros(1024, dtype=np.uint8)
    piece = piece_class(fc)(base.data.ptr + 256, 512, base, 0)
    fired = []
    weakref.finalize(piece, fired.append, 1)
    a = fc.ndarray((128,), dtype=np.float32, memptr=fc.cuda.MemoryPointer(piece, 0))
    del piece
    view = a[10:20]
    a[...] = 1
    del a
    assert not fired and float(base[256:260].view(np.float32)[0]) == 1.0         # written where it points
    del view
    assert fired == [1]
    with pytest.raises(ValueError, match="does not fit"):
        fc.ndarray((200,), dtype=np.float32, memptr=fc.cuda.MemoryPointer(piece_class(fc)(base.data.ptr, 512,
                                                                                               base, 0), 0))
    calls = fc.runtime_calls["pointerGetAttributes"]
    fc.cuda.UnownedMemory(base.data.ptr, 16, base)
    assert fc.runtime_calls["pointerGetAttributes"] == calls + 1
    memory = StepMemory(fc, check=True)
    for _ in range(3):
        _addresses(fc, memory, [(3, 5), (7,)])
    assert fc.runtime_calls["pointerGetAttributes"] == calls + 1


def test_a_step_memorys_allocator_and_a_hook_are_the_threads_that_set_them(fc):
    """CuPy's ``using_allocator`` and memory hooks are per thread (so is the stand-in's): a
    worker thread inside a step's ``with`` allocates from the pool, and a hook registered in the
    main thread does not hear it. (The fast engine on CuPy runs its steps in one thread:
    ``_n_parts`` is 1 there.)"""
    import threading
    memory = StepMemory(fc)
    seen = []

    class Hook(fc.cuda.MemoryHook):
        def malloc_postprocess(self, **kw):
            seen.append(kw["mem_size"])
    made = {}
    for _ in range(2):                       # the first sizes the slab
        with memory.step(), Hook():
            here = fc.ones(64, dtype=np.float32)
            worker = threading.Thread(target=lambda: made.__setitem__("a", fc.ones(64, dtype=np.float32)))
            worker.start()
            worker.join()
    assert fc.in_step_memory(here._a) and not fc.in_step_memory(made["a"]._a) and memory.overflows == 0
    assert seen == [512]                     # the first step's overflow (a 512-byte block), the main thread's


def _many_shapes(fc, memory, shapes, calls=3):
    """A captured step over ``shapes`` (each called ``calls`` times: eager, captured, replayed) whose
    memory grows with its input; returns the step and the most bytes its step memory held."""
    from attn.fast.gpu.graph import CapturedStep

    def step(x):
        y = x * 2 + 1
        fc.zeros(x.size * 4, dtype=np.float32)          # more memory the larger the shape
        return y.sum()
    graphed, peak = CapturedStep(step, warmup=1, memory=memory), 0
    for n in shapes:
        for _ in range(calls):
            graphed(fc.ones(n, dtype=np.float32))
            peak = max(peak, memory.capacity + sum(int(s.nbytes) for s in memory._retired))
    return graphed, peak


def test_a_captured_run_over_many_shapes_holds_a_bounded_number_of_graphs_and_slabs(fc, monkeypatch):
    """Twelve growing shapes, each captured: at most MAX_GRAPHS graphs are kept (the least recently
    called dropped, its slab let go), so at most MAX_GRAPHS - 1 replaced slabs; without the cap
    every slab a graph was captured on stays, and the memory held grows with the shapes."""
    from attn.fast.gpu import graph
    shapes = [16 * k for k in range(1, 13)]
    monkeypatch.setattr(graph, "MAX_GRAPHS", 10 ** 6)                  # no cap: what the cap prevents
    unbounded, unbounded_peak = _many_shapes(fc, StepMemory(fc), shapes)
    assert unbounded.kept == 12 and unbounded.memory.stats()["retired_slabs"] == 11
    monkeypatch.setattr(graph, "MAX_GRAPHS", 3)
    memory = StepMemory(fc)
    graphed, peak = _many_shapes(fc, memory, shapes)
    assert (graphed.graphs, graphed.kept, graphed.dropped) == (12, 3, 9), graphed.refusals
    assert memory.stats()["retired_slabs"] == 2 and len(memory._pins) == 3
    assert memory.kept_bytes() == 10752 and peak == 10752 < unbounded_peak == 26112
    graphed(fc.ones(16, dtype=np.float32))                              # a dropped shape: eager again, then captured
    graphed(fc.ones(16, dtype=np.float32))
    assert graphed.kept == 3 and graphed.graphs == 13


def test_the_slabs_kept_for_graphs_count_in_the_limit(fc):
    """A slab that would not fit beside the slabs kept for graphs has every graph dropped first
    (they are captured again on the new slab): the slabs held stay within the limit."""
    memory = StepMemory(fc)
    graphed, _ = _many_shapes(fc, memory, [16, 32])
    assert graphed.kept == 2 and memory.kept_bytes() > 0
    need = _many_shapes(fc, StepMemory(fc), [512], calls=1)[0].memory.capacity      # the slab shape 512 needs
    memory.limit = need + memory.kept_bytes() - 1          # room for it once the graphs' slabs are let go, not before
    for _ in range(3):
        graphed(fc.ones(512, dtype=np.float32))
    assert not memory.over_limit and graphed.dropped == 2 and graphed.kept == 1, graphed.refusals
    assert memory.capacity + sum(int(s.nbytes) for s in memory._retired) <= memory.limit

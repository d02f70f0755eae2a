"""The fast engine's arena and the kernels built on it (:mod:`attn.fast.core.arena`, ``adam_flat``,
``column_sums``), on every backend this machine has (NumPy, and CuPy or its stand-in).

* The layout: every parameter's view has its name's shape and writes through to the flat
  buffer; fused blocks are the parameters side by side; the padding stays zero.
* N training steps of the fast model with its arena and FastAdam (one update; clipping
  decided on the device) equal N steps of the reference model with :class:`attn.optim.Adam`
  on separate arrays: float64, a changing learning rate, clipping on and off.
* On the stand-in, counted: the optimizer step is one kernel launch (two with clipping) and
  nothing else; the per-step weight concatenation is gone; kernels are looked up once.
* ``column_sums`` (dgamma, dbeta, bias gradients) against NumPy's sums, through the launch
  code, at shapes that take one and several rounds over its row blocks.
"""
from __future__ import annotations

import ast
import pathlib
from collections import Counter

import fakecupy
import numpy as np
import pytest

import attn.backend as B
from attn.fast import FastAdam, FastTransformer, cross_entropy as fast_ce, ops_for
from attn.fast.core.arena import ALIGN, Arena, layout
from attn.gradcheck import rel_error
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig, parameter_shapes
from attn.optim import Adam

CFG = TransformerConfig(vocab_size=23, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=2, n_decoder_layers=2,
                        dropout=0.0, label_smoothing=0.1, max_len=16, warmup_steps=3)


def _batch(seed=0, Bsz=3, S=5, T=4, V=23):
    rng = np.random.default_rng(seed)
    src = rng.integers(3, V, (Bsz, S))
    tgt = rng.integers(3, V, (Bsz, T + 1))
    src[0, 3:] = 0
    tgt[1, 3:] = 0
    return tuple(B.to_device(a) for a in (src, tgt[:, :-1].copy(), tgt[:, 1:].copy()))


# ----------------------------------------------------------------------------- the layout


@pytest.mark.parametrize("cfg", [CFG, TransformerConfig(vocab_size=9, tgt_vocab_size=7, share_embeddings=False,
                                                        d_model=4, n_heads=1, d_ff=6, n_encoder_layers=1,
                                                        n_decoder_layers=3, norm_position="pre", positional="learned")])
def test_every_parameter_is_a_view_of_the_arena_with_its_shape(backend, cfg):
    xp = backend
    lay = layout(cfg)
    assert all(b.offset % ALIGN == 0 for b in lay.blocks.values())
    assert list(lay.members) == list(parameter_shapes(cfg))
    ref = Transformer(cfg, seed=1, dtype="float64")
    want = {k: B.to_host(v).copy() for k, v in ref.params.items()}
    fast = FastTransformer.from_model(ref)
    a = fast.arena
    assert a.holds(fast.params) and fast.params is ref.params          # the reference shares the arena
    for k, shape in parameter_shapes(cfg).items():
        v = fast.params[k]
        assert tuple(v.shape) == tuple(shape) and v.dtype == np.float64, k
        assert np.array_equal(B.to_host(v), want[k]), k
    # writing a view writes the flat buffer; the flat buffer holds every value once, padding 0
    fast.params["decoder.0.cross_attn.w_v"][1, 2] = 7.5
    blk = a.block(a.params, "decoder.cross_attn.w_kv")
    D = cfg.d_model
    assert float(blk[1, D + 2]) == 7.5
    total = sum(float((B.to_host(v) ** 2).sum()) for v in fast.params.values())
    assert abs(float((a.params ** 2).sum()) - total) < 1e-9 * total
    # w_q, w_k, w_v are the (D, 3D) block's column blocks
    W = a.block(a.params, "encoder.0.self_attn.w_qkv")
    for j, n in enumerate("qkv"):
        assert np.array_equal(B.to_host(W[:, j * D:(j + 1) * D]), B.to_host(fast.params[f"encoder.0.self_attn.w_{n}"]))
    assert Arena.find(fast.params) is a and Arena.find(dict(fast.params)) is a
    assert Arena.find({k: v.copy() for k, v in fast.params.items()}) is None


@pytest.mark.parametrize("cfg", [CFG, TransformerConfig(vocab_size=9, tgt_vocab_size=7, share_embeddings=False,
                                                        d_model=4, n_heads=1, d_ff=6, n_encoder_layers=2,
                                                        n_decoder_layers=3, norm_position="pre", positional="learned")])
def test_the_arena_lies_in_the_order_the_backward_finishes_its_gradients(cfg):
    """Stage by stage, last layer first (a data-parallel run sends the front while the backward
    computes the rest): the stages tile the buffer in :func:`stages` order, each block lies in
    its stage, and the gradient buffer has the slot for the loss and the tokens past the end."""
    from attn.fast.core.arena import SLOT, stages
    lay = layout(cfg)
    assert list(lay.stages) == stages(cfg)
    assert stages(cfg)[:2] == ["decoder.norm", f"decoder.{cfg.n_decoder_layers - 1}"]
    assert stages(cfg)[-1] == "embeddings"
    spans = list(lay.stages.values())
    assert spans[0][0] == 0 and spans[-1][1] == lay.size
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    offsets = [b.offset for b in lay.blocks.values()]
    assert offsets == sorted(offsets)                                   # blocks in the buffers' order
    for name, blk in lay.blocks.items():
        stage = next(st for st, (lo, hi) in lay.stages.items() if lo <= blk.offset < hi)
        want = "embeddings" if "embedding" in name or name.startswith("generator") else \
            name.split(".")[0] if name.endswith("_pos.weight") else ".".join(name.split(".")[:2])
        assert stage == want, (name, stage)
    last_layer = f"decoder.{cfg.n_decoder_layers - 1}.ffn.w1"
    assert lay.blocks[last_layer].offset < lay.blocks["decoder.0.ffn.w1"].offset \
        < lay.blocks["decoder.cross_attn.w_kv"].offset < lay.blocks["encoder.1.ffn.w1"].offset \
        < lay.blocks["encoder.0.ffn.w1"].offset
    a = Arena(cfg, "float64", np)
    assert a.grad_buffer.shape == (lay.size + SLOT,) and np.shares_memory(a.grads, a.grad_buffer)
    assert a.grads.shape == (lay.size,) and a.grads.base is a.grad_buffer


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_the_backward_announces_each_stage_once_it_is_final(backend, workers, norm):
    """``backward(..., ready=)``: the calls rise to ``arena.size`` along the stages' ends, and what
    each call declares final (``grads[:stop]``) holds its final values then; the gradients are
    those of a backward told nothing, bit for bit. With the batch split over threads (NumPy,
    ``workers`` 3) a stage is final only when every part has written it."""
    from dataclasses import replace
    cfg = replace(CFG, norm_position=norm, dropout=0.1)
    fast = FastTransformer(cfg, seed=2, dtype="float64")
    fast.workers = workers
    src, tgt_in, tgt_out = _batch(3, Bsz=5)
    grads = []
    for told in (False, True):
        logits, cache = fast.forward(src, tgt_in, B.DeviceRNG(8))
        if workers > 1 and backend is np:
            assert type(cache).__name__ == "SplitCache" and len(cache.parts) == 3
        _, d = fast_ce(logits, tgt_out, cfg.label_smoothing, inplace=True)
        seen = []
        ready = (lambda stop: seen.append((stop, fast.arena.grads[:stop].copy()))) if told else None
        g = fast.backward(d, cache, ready=ready)
        grads.append({k: B.to_host(v).copy() for k, v in g.items()})
    for k in grads[0]:
        if k == "embedding.weight" and backend is not np and not fakecupy.installed():
            # a scatter-add: a GPU's float atomics sum a token's rows in whatever order they arrive
            np.testing.assert_allclose(grads[0][k], grads[1][k], rtol=1e-12, atol=1e-15, err_msg=k)
        else:
            assert np.array_equal(grads[0][k], grads[1][k]), k
    ends = [hi for _, hi in fast.arena.layout.stages.values()]
    stops = [stop for stop, _ in seen]
    assert stops == ends and stops[-1] == fast.arena.size
    final = B.to_host(fast.arena.grads)
    for stop, early in seen:
        assert np.array_equal(B.to_host(early), final[:stop]), stop


def test_a_replaced_parameter_is_copied_into_the_arena(backend):
    xp = backend
    fast = FastTransformer(CFG, seed=0, dtype="float64")
    new = xp.asarray(np.full((CFG.d_model, CFG.d_model), 0.25))
    fast.params["decoder.1.self_attn.w_k"] = new
    src, tgt_in, _ = _batch()
    fast.forward(src, tgt_in)
    assert fast.arena.holds(fast.params)
    assert np.array_equal(B.to_host(fast.params["decoder.1.self_attn.w_k"]), B.to_host(new))
    ref = Transformer(CFG, seed=0, dtype="float64")
    ref.params["decoder.1.self_attn.w_k"] = new
    assert rel_error(B.to_host(ref.forward(src, tgt_in)[0]), B.to_host(fast.forward(src, tgt_in)[0])) < 1e-12


def test_checkpoint_round_trip_through_the_arena(backend, tmp_path):
    fast = FastTransformer(CFG, seed=4)
    path = fast.save(tmp_path / "m.npz")
    back = FastTransformer.load(path)
    assert back.arena.holds(back.params) and back.arena is not fast.arena
    for k in fast.params:
        assert np.array_equal(B.to_host(back.params[k]), B.to_host(fast.params[k])), k

# ----------------------------------------------------------------------------- N steps against the reference


@pytest.mark.parametrize("clip", [0.0, 1.0])
@pytest.mark.parametrize("workers", [1, 2])
def test_steps_with_the_arena_equal_the_reference_with_adam(backend, clip, workers):
    """Forward, loss, backward and the optimizer, 6 steps in float64 on two batches: the fast
    model (arena, one flat Adam update, clipping decided on the device) against the reference
    model and :class:`attn.optim.Adam` on separate arrays (clipped by ``clip_grad_norm``). The
    warm-up of 3 steps makes the rate rise and fall; ``clip`` 1.0 clips the first steps (norms near 2), not the later ones."""
    ref = Transformer(CFG, seed=5, dtype="float64")
    fast = FastTransformer(CFG, seed=5, dtype="float64")
    fast.workers = workers
    assert not any(np.shares_memory(B.to_host(a), B.to_host(b)) for a, b in zip(ref.params.values(),
                                                                                   fast.params.values()))
    o_ref = Adam(ref.params, CFG.d_model, CFG.warmup_steps)
    o_fast = FastAdam(fast.params, CFG.d_model, CFG.warmup_steps)
    assert o_fast.arena is fast.arena
    batches = [_batch(0, Bsz=4), _batch(1, Bsz=4)]
    clipped, lrs = [], []
    for step in range(6):
        src, tgt_in, tgt_out = batches[step % 2]
        logits, cache = ref.forward(src, tgt_in)
        _, d = cross_entropy(logits, tgt_out, CFG.label_smoothing)
        g_ref = ref.backward(d, cache)
        norm = float(np.sqrt(sum(float((B.to_host(g) ** 2).sum()) for g in g_ref.values())))
        clipped.append(clip > 0 and norm > clip)
        lr_ref = o_ref.step(g_ref, clip=clip)
        logits, cache = fast.forward(src, tgt_in)
        _, d = fast_ce(logits, tgt_out, CFG.label_smoothing, inplace=True)
        lr_fast = o_fast.step(fast.backward(d, cache), clip=clip)
        assert lr_ref == lr_fast
        lrs.append(lr_fast)
    assert len(set(lrs)) == 6                                   # the rate changed at every step
    if clip:
        assert any(clipped) and not all(clipped), clipped
    for k in ref.params:
        for a, b, what in ((ref.params[k], fast.params[k], "parameter"), (o_ref.m[k], o_fast.m[k], "m"),
                           (o_ref.v[k], o_fast.v[k], "v")):
            err = rel_error(B.to_host(a), B.to_host(b))
            # 1e-8: the keys' bias has a gradient of rounding noise alone (a softmax does not see
            # a shift of its row), which Adam's normalisation turns into steps of ~lr * 1e-8
            assert err < 1e-8, f"{what} of {k} after 6 steps: relative error {err:.1e}"
    assert o_fast.t == o_ref.t == 6


def test_fast_adam_over_the_arena_takes_any_dict_of_gradients(backend):
    """Gradients that are not the arena's own (a caller's dict) are copied in first."""
    xp = backend
    fast = FastTransformer(CFG, seed=1, dtype="float64")
    ref = {k: v.copy() for k, v in fast.params.items()}
    o_ref, o_fast = Adam(ref, CFG.d_model, 3), FastAdam(fast.params, CFG.d_model, 3)
    rng = np.random.default_rng(0)
    for _ in range(3):
        g = {k: xp.asarray(rng.standard_normal(v.shape)) for k, v in ref.items()}
        o_ref.step({k: v.copy() for k, v in g.items()}, clip=1.0)
        o_fast.step(g, clip=1.0)
    for k in ref:
        assert rel_error(B.to_host(ref[k]), B.to_host(fast.params[k])) < 1e-12, k


def test_optimizer_state_loads_into_the_arena(backend):
    fast = FastTransformer(CFG, seed=1, dtype="float64")
    opt = FastAdam(fast.params, CFG.d_model, 3)
    src, tgt_in, tgt_out = _batch()
    logits, cache = fast.forward(src, tgt_in)
    opt.step(fast.backward(fast_ce(logits, tgt_out, 0.1, inplace=True)[1], cache))
    state = {k: B.to_host(v).copy() for k, v in opt.state_arrays().items()}
    other = FastTransformer(CFG, seed=1, dtype="float64")
    o2 = FastAdam(other.params, CFG.d_model, 3)
    o2.load_state(state, opt.t)
    assert o2.t == 1 and Arena.find(other.params) is other.arena
    for k in fast.params:
        assert np.array_equal(B.to_host(o2.m[k]), B.to_host(opt.m[k])), k
        assert np.array_equal(B.to_host(o2.v[k]), B.to_host(opt.v[k])), k
    assert np.array_equal(B.to_host(other.arena.m), B.to_host(fast.arena.m))       # padding included


def test_a_resumed_optimizer_continues_the_schedule_and_its_step_count_on_the_device(backend):
    """The learning rate and Adam's bias corrections come from the step count (on a GPU the
    count lives on the device, advanced by ``adam_flat``): an optimizer loaded at step t takes
    step t + 1 exactly as the optimizer that took the t steps, with a warm-up still rising."""
    fast, twin = FastTransformer(CFG, seed=1, dtype="float64"), FastTransformer(CFG, seed=1, dtype="float64")
    opt, o2 = FastAdam(fast.params, CFG.d_model, 4), FastAdam(twin.params, CFG.d_model, 4)
    rng = np.random.default_rng(3)
    grads = [{k: B.to_device(rng.standard_normal(v.shape)) for k, v in fast.params.items()} for _ in range(3)]
    for g in grads[:2]:
        opt.step(g)
    twin.arena.params[...] = fast.arena.params
    o2.load_state({k: B.to_host(v).copy() for k, v in opt.state_arrays().items()}, opt.t)
    lrs = [opt.step(grads[2]), o2.step(grads[2])]
    assert lrs[0] == lrs[1] == opt.lr(3) and opt.t == o2.t == 3
    assert np.array_equal(B.to_host(fast.arena.params), B.to_host(twin.arena.params))
    for o in (opt, o2):
        count = getattr(o, "_device_count", None)
        assert count is None or int(B.to_host(count)[0]) == 3

# ----------------------------------------------------------------------------- counted on the stand-in


class _Launches:
    """Counts, on the stand-in, the kernels launched (by name) and every other device
    operation that would be a launch on a GPU: ufuncs (arithmetic, in place or not), NumPy-like
    functions (``matmul``, ``concatenate``...), reductions and copies. Allocations and views
    are not launches."""

    NOT_LAUNCHES = {"empty", "empty_like", "broadcast_to", "ascontiguousarray"}

    def __init__(self, monkeypatch, fc):
        self.kernels, self.ops = Counter(), Counter()
        cupy = fc.cupy
        real_call = cupy.RawKernel.__call__

        def call(kernel, *a, **k):
            self.kernels[kernel.name.split("<")[0]] += 1
            return real_call(kernel, *a, **k)
        monkeypatch.setattr(cupy.RawKernel, "__call__", call)
        real_ufunc, real_function = cupy._ufunc, cupy._function

        def ufunc(uf, method, inputs, kwargs):
            self.ops[f"ufunc {uf.__name__}"] += 1
            return real_ufunc(uf, method, inputs, kwargs)
        monkeypatch.setattr(cupy, "_ufunc", ufunc)
        for name in list(vars(cupy)):          # cached function wrappers: made again, counted
            if callable(vars(cupy)[name]) and getattr(vars(cupy)[name], "__doc__", "") and \
                    str(vars(cupy)[name].__doc__).startswith("fakecupy: numpy."):
                monkeypatch.delattr(cupy, name)

        def function(name, f):
            inner = real_function(name, f)

            def counted(*a, **k):
                if name not in self.NOT_LAUNCHES:
                    self.ops[f"function {name}"] += 1
                return inner(*a, **k)
            counted.__doc__ = inner.__doc__
            return counted
        monkeypatch.setattr(cupy, "_function", function)
        for op in ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__add__", "__sub__", "__mul__",
                   "__truediv__", "__radd__", "__rsub__", "__rmul__", "__matmul__", "__neg__", "__gt__",
                   "__ge__", "__lt__", "__setitem__", "copy", "astype", "sum", "max"):
            real = getattr(cupy.ndarray, op)

            def counted(self_, *a, _real=real, _op=op, **k):
                self.ops[f"ndarray {_op}"] += 1
                return _real(self_, *a, **k)
            monkeypatch.setattr(cupy.ndarray, op, counted)

    def total(self) -> int:
        return sum(self.kernels.values()) + sum(self.ops.values())


@pytest.fixture
def stand_in(monkeypatch):
    """The stand-in selected, its CupyOps with :attr:`counter_dropout` on."""
    import fakecupy
    from conftest import selected_backend
    from attn.fast.gpu.kernels import CupyOps
    monkeypatch.setattr(CupyOps, "counter_dropout", True)
    with selected_backend("fakecupy") as cp:
        yield fakecupy, cp


@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_the_optimizer_step_is_one_launch_over_the_arena(stand_in, monkeypatch, clip):
    fc, cp = stand_in
    fast = FastTransformer(CFG, seed=0, check_ids=False)
    opt = FastAdam(fast.params, CFG.d_model, 3)
    src, tgt_in, tgt_out = _batch()
    logits, cache = fast.forward(src, tgt_in)
    grads = fast.backward(fast_ce(logits, tgt_out, 0.1, inplace=True, validate=False, check_finite=False)[1],
                          cache)
    opt.step(grads, clip=clip)                  # compiles; the next step is counted
    count = _Launches(monkeypatch, fc)
    opt.step(grads, clip=clip)
    want = Counter({"adam_flat": 1, **({"sumsq_partial": 1} if clip else {})})
    assert count.kernels == want and not count.ops, (count.kernels, count.ops)


def test_a_training_step_concatenates_and_slices_no_weights(stand_in, monkeypatch):
    """The fused weights are the arena's blocks: no ``concatenate``, no weight copied or
    scaled per step, no gradient sliced into a contiguous copy; each kernel is looked up in
    the module once."""
    fc, cp = stand_in
    fast = FastTransformer(CFG, seed=0, check_ids=False)
    opt = FastAdam(fast.params, CFG.d_model, 3)
    src, tgt_in, tgt_out = _batch()

    def step():
        logits, cache = fast.forward(src, tgt_in, B.DeviceRNG(0))
        _, d = fast_ce(logits, tgt_out, 0.1, inplace=True, validate=False, check_finite=False)
        opt.step(fast.backward(d, cache), clip=1.0)
    step()
    lookups = Counter()
    real_get = fc.cupy.RawModule.get_function
    monkeypatch.setattr(fc.cupy.RawModule, "get_function",
                        lambda self, name: (lookups.update([name]), real_get(self, name))[1])
    count = _Launches(monkeypatch, fc)
    step()
    assert not lookups, f"kernels looked up again: {dict(lookups)}"
    assert count.ops["function concatenate"] == 0
    assert count.ops["ndarray copy"] <= 2 * (CFG.n_encoder_layers + 3 * CFG.n_decoder_layers), count.ops
    # the weights are read where they are: every matmul's weight operand is the arena's memory
    assert count.kernels["adam_flat"] == 1 and count.kernels["column_sums"] > 0
    assert "colsum_prod" not in count.kernels

# ----------------------------------------------------------------------------- column sums


@pytest.mark.parametrize("N,D", [(1, 1), (5, 31), (64, 32), (65, 33), (1000, 40), (70_000, 3), (0, 5)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_column_sums_match_numpy(stand_in, N, D, dtype):
    """Through :class:`CupyOps`'s launch code and the twin (the stand-in): the bias gradient's
    column sum, and layer norm's dgamma and dbeta, at one and several rounds of row blocks
    (N = 70,000 is 1,094 chunks of 64 rows over at most 1,024 row blocks)."""
    fc, cp = stand_in
    ops = ops_for(cp)
    rng = np.random.default_rng(N + D)
    a = rng.standard_normal((N, D)).astype(dtype)
    b = rng.standard_normal((N, D)).astype(dtype)
    tol = 1e-5 if dtype == "float32" else 1e-12
    got = cp.asnumpy(ops.colsum(cp.asarray(a)))
    assert got.shape == (D,) and rel_error(got, a.sum(axis=0, dtype=np.float64)) < tol
    if N == 0:
        return
    out = cp.zeros((2, D), dtype=dtype)
    gamma = cp.asarray(rng.standard_normal(D).astype(dtype))
    rstd = cp.ones((N,), dtype=dtype)
    _, dg, db = ops.layer_norm_backward_(cp.asarray(a), cp.asarray(b), rstd, gamma, out=out)
    assert rel_error(cp.asnumpy(out[0]), (a * b).sum(axis=0, dtype=np.float64)) < tol
    assert rel_error(cp.asnumpy(out[1]), a.sum(axis=0, dtype=np.float64)) < tol
    assert not cp.asnumpy(ops._counters(1)).any()               # every ticket counter back at 0


def test_column_sums_refuses_a_launch_with_a_busy_counter(stand_in):
    from attn.fast.gpu import kernels as K
    fc, cp = stand_in
    ops = ops_for(cp)
    ops._counters(4)[1] = 3
    try:
        with pytest.raises(ValueError, match="counters must be 0"):
            ops.colsum(cp.ones((10, 40), dtype="float32"))
    finally:
        ops._counters(4)[...] = 0
    assert K.column_sums_np.__doc__.startswith("NumPy twin of ``column_sums``")


def test_colsum_prod_and_its_one_thread_per_column_grid_are_gone():
    from attn.fast.gpu import kernels as K
    assert "colsum_prod" not in K.NUMPY_TWINS and "column_sums" in K.NUMPY_TWINS

# ----------------------------------------------------------------------------- imports


def test_ops_and_kernels_do_not_import_each_other_in_a_circle():
    """``ops`` <- ``kernels`` <- ``dispatch``: ops imports neither, kernels not dispatch."""
    root = pathlib.Path(__file__).resolve().parents[1] / "attn" / "fast"

    def imports(*paths):
        """The last names of the modules of attn.fast that ``paths`` import (``from ..core.ops
        import Ops`` -> ``ops``, ``from .common import x`` -> ``common``)."""
        found = set()
        for path in paths:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            found |= {n.module.split(".")[-1] for n in ast.walk(tree)
                      if isinstance(n, ast.ImportFrom) and n.level and n.module}
        return found
    assert not imports(root / "core" / "ops.py") & {"kernels", "dispatch"}
    kernels = imports(*(root / "gpu" / "kernels").glob("*.py"))
    assert "dispatch" not in kernels and "ops" in kernels


# ----------------------------------------------------------------------------- dropout from a counter


def _splitmix64_reference(key: int, i: int) -> int:
    """splitmix64 of ``key + (i + 1) * golden``, written out on Python ints (an independent
    statement of what ``dropout_hash`` computes per element)."""
    m = (1 << 64) - 1
    z = (key + (i + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) >> 48


def test_dropout_bits_are_splitmix64_bit_for_bit():
    from attn.fast.gpu.kernels import dropout_bits_np
    for key in (0, 1, 0xDEADBEEFCAFEF00D, (1 << 64) - 1):
        bits = dropout_bits_np(key, 1000)
        assert [int(b) for b in bits[[0, 1, 2, 517, 999]]] == [_splitmix64_reference(key, i)
                                                              for i in (0, 1, 2, 517, 999)]
    assert abs(float((dropout_bits_np(12345, 200_000) >= 6554).mean()) - (1 - 6554 / 65536)) < 0.003


def test_cupy_dropout_is_one_launch_each_way_and_the_backward_regenerates_the_mask(stand_in, monkeypatch):
    fc, cp = stand_in
    ops = ops_for(cp)
    rng = B.DeviceRNG(7)
    x = np.random.default_rng(0).standard_normal((64, 33)).astype("float32")
    m = ops.dropout_mask(rng, x.shape, 0.3)
    count = _Launches(monkeypatch, fc)
    y = cp.asnumpy(ops.dropout_(cp.asarray(x), m))
    d = cp.asnumpy(ops.dropout_backward(cp.asarray(x), m))
    assert count.kernels == Counter({"dropout_hash": 2}) and not count.ops, (count.kernels, count.ops)
    keep = cp.asnumpy(m.keep.array(cp))
    assert np.array_equal(y, np.where(keep, x * np.float32(m.scale), 0)) and np.array_equal(y, d)
    m2 = ops.dropout_mask(rng, x.shape, 0.3)
    assert m2.keep.key != m.keep.key and not np.array_equal(cp.asnumpy(m2.keep.array(cp)), keep)
    assert ops.dropout_mask(B.DeviceRNG(7), x.shape, 0.3).keep.key == m.keep.key       # seeded
    with pytest.raises(ValueError, match="drawn for shape"):
        ops.dropout_(cp.ones((3, 3), dtype="float32"), m)


class _SeedOnDevice:
    """A step's random numbers as a captured step gives them: the seed in a device buffer."""

    def __init__(self, buffer):
        self.device_seed = buffer


def test_dropout_reads_the_steps_seed_from_the_device(stand_in):
    """What makes dropout capturable as a CUDA graph: the kernels read the step's seed from
    device memory, so the same launches (the same arguments) draw the masks of whatever seed
    the buffer holds when they run; each is the mask of that seed, bit for bit."""
    from attn.fast.gpu.kernels.dropout import _splitmix64, dropout_bits_np, dropout_key_np
    fc, cp = stand_in
    ops = ops_for(cp)
    seed = cp.asarray(np.array([11], dtype=np.uint64))
    rng = _SeedOnDevice(seed)
    x = cp.ones((16, 24), dtype="float32")
    m = ops.dropout_mask(rng, x.shape, 0.5)
    first = cp.asnumpy(ops.dropout_(x.copy(), m)) != 0
    seed[...] = cp.asarray(np.array([12], dtype=np.uint64))
    second = cp.asnumpy(ops.dropout_(x.copy(), m)) != 0
    assert not np.array_equal(first, second)
    for value, got in ((11, first), (12, second)):
        key = (_splitmix64(_splitmix64(value) ^ m.keep.site) + m.keep.offset) % (1 << 64)
        assert dropout_key_np(np.array([value], dtype=np.uint64), m.keep.site, m.keep.offset) == key
        assert np.array_equal(got.reshape(-1), dropout_bits_np(key, x.size) >= m.keep.thr)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_post_norm_epilogue_is_one_launch_and_equals_the_steps_one_by_one(stand_in, monkeypatch, p):
    """``residual_layer_norm_``: bias, dropout (from its counter), residual sum and layer
    norm in one ``residual_ln_fwd`` launch, equal to ``Ops``'s steps one by one with the same
    mask (the one ``dropout_hash`` regenerates in the backward)."""
    from attn.fast.core.ops import Ops
    fc, cp = stand_in
    ops = ops_for(cp)
    rng = np.random.default_rng(1)
    N, D = 37, 48
    s, x = rng.standard_normal((N, D)), rng.standard_normal((N, D))
    bias, gamma, beta = rng.standard_normal(D), rng.standard_normal(D), rng.standard_normal(D)
    m = ops.dropout_mask(B.DeviceRNG(3), (N, D), p) if p else None
    count = _Launches(monkeypatch, fc)
    s_d = cp.asarray(s)
    out, rstd = ops.residual_layer_norm_(s_d, cp.asarray(bias), m, cp.asarray(x), cp.asarray(gamma),
                                         cp.asarray(beta), 1e-6)
    assert count.kernels == Counter({"residual_ln_fwd": 1}) and not count.ops, (count.kernels, count.ops)
    s2 = cp.asarray(s)                          # the unfused steps, on the same arrays
    want_out, want_rstd = Ops.residual_layer_norm_(ops, s2, cp.asarray(bias), m, cp.asarray(x), cp.asarray(gamma),
                                                    cp.asarray(beta), 1e-6)
    for a, b in ((out, want_out), (rstd, want_rstd), (s_d, s2)):
        assert rel_error(cp.asnumpy(a), cp.asnumpy(b)) < 1e-12
    if p:
        dropped = ~cp.asnumpy(m.keep.array(cp))
        assert 0.2 < dropped.mean() < 0.4


def test_post_norm_backward_through_norm_and_dropout_is_two_launches(stand_in, monkeypatch):
    from attn.fast.core.ops import Ops
    fc, cp = stand_in
    ops = ops_for(cp)
    rng = np.random.default_rng(2)
    N, D = 29, 40
    dout, xhat = rng.standard_normal((N, D)), rng.standard_normal((N, D))
    rstd, gamma = rng.uniform(0.5, 2, N), rng.standard_normal(D)
    m = ops.dropout_mask(B.DeviceRNG(4), (N, D), 0.25)
    out = cp.empty((2, D))
    count = _Launches(monkeypatch, fc)
    dy, ds = ops.layer_norm_backward_dropout_(cp.asarray(dout), cp.asarray(xhat), cp.asarray(rstd),
                                              cp.asarray(gamma), m, out=out)
    assert count.kernels == Counter({"column_sums": 1, "layer_norm_bwd_drop": 1}) and not count.ops
    out2 = cp.empty((2, D))
    dy2, ds2 = Ops.layer_norm_backward_dropout_(ops, cp.asarray(dout), cp.asarray(xhat), cp.asarray(rstd),
                                                 cp.asarray(gamma), m, out=out2)
    for a, b in ((dy, dy2), (ds, ds2), (out, out2)):
        assert rel_error(cp.asnumpy(a), cp.asnumpy(b)) < 1e-12
    assert np.array_equal(cp.asnumpy(ds) == 0, ~cp.asnumpy(m.keep.array(cp)) | (cp.asnumpy(dy) == 0))


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_feed_forward_epilogue_is_one_launch_and_equals_the_steps_one_by_one(stand_in, monkeypatch, p):
    from attn.fast.core.ops import Ops
    fc, cp = stand_in
    ops = ops_for(cp)
    rng = np.random.default_rng(5)
    a, bias = rng.standard_normal((31, 24)).astype("float32"), rng.standard_normal(24).astype("float32")
    m = ops.dropout_mask(B.DeviceRNG(9), a.shape, p) if p else None
    count = _Launches(monkeypatch, fc)
    got = ops.bias_relu_dropout_(cp.asarray(a), cp.asarray(bias), m)
    assert count.kernels == Counter({"bias_relu_drop": 1}) and not count.ops, (count.kernels, count.ops)
    want = Ops.bias_relu_dropout_(ops, cp.asarray(a), cp.asarray(bias), m)
    assert np.array_equal(cp.asnumpy(got), cp.asnumpy(want))
    assert (cp.asnumpy(got) >= 0).all()


def test_counter_dropout_is_on_by_default_and_off_draws_from_the_stream(cupy_only, monkeypatch):
    """On by default (keyed by the index in the global batch: a data-parallel rank's masks are
    its rows of one process's, tests/test_distributed.py); off, ``uniform >= p`` drawn."""
    from attn.fast.gpu.kernels import CupyOps, HashedKeep
    cp = cupy_only
    m = ops_for(cp).dropout_mask(B.DeviceRNG(0), (4, 6), 0.5)
    assert CupyOps.counter_dropout and isinstance(m.keep, HashedKeep) and (m.keep.run, m.keep.skip) == (0, 0)
    monkeypatch.setattr(CupyOps, "counter_dropout", False)
    m = ops_for(cp).dropout_mask(B.DeviceRNG(0), (4, 6), 0.5)
    assert m.keep.dtype == bool


def test_counters_in_runs_are_the_global_index_bit_for_bit(stand_in):
    """``dropout_bits`` of element i of a share whose elements lie in runs of ``run``, ``skip``
    apart in the whole batch, the first at ``base`` (folded into the key): splitmix64 of the whole
    batch's index ``base + i + (i // run) * skip``, bit for bit; the fused kernels, which index
    by row, refuse a mask that lies in runs."""
    from attn.fast.gpu.kernels import GOLDEN, HashedKeep, dropout_bits_np
    from attn.fast.core.ops import Mask
    key, base, run, skip = 0xDEADBEEFCAFEF00D, 40, 12, 30
    bits = dropout_bits_np((key + base * GOLDEN) % (1 << 64), 50, run, skip)
    for i in (0, 11, 12, 13, 49):
        assert int(bits[i]) == _splitmix64_reference(key, base + i + (i // run) * skip), i
    fc, cp = stand_in
    bad = Mask(HashedKeep(cp.zeros(1, dtype=np.uint64), 0, 0, 100, (4, 6), 12, 12), 1.0)
    with pytest.raises(ValueError, match="row-major"):
        ops_for(cp).bias_relu_dropout_(cp.ones((4, 6)), cp.zeros(6), bad)
    with pytest.raises(ValueError, match="row-major"):
        ops_for(cp).residual_layer_norm_(cp.ones((4, 6)), cp.zeros(6), bad, cp.ones((4, 6)), cp.ones(6),
                                         cp.zeros(6), 1e-6)


@pytest.fixture
def cupy_only():
    from conftest import selected_backend
    with selected_backend("fakecupy") as cp:
        yield cp

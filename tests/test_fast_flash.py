"""The fast engine's tiled attention (attn.fast.core.flash, the kernels' twins in
attn.fast.gpu.kernels.flash) against the readable attention, in float64, on NumPy and the stand-in:
every mask (padding, causal, a sentence of padding alone), cross-attention (Tq != Tk),
grouped-query attention, tiles that do not divide the lengths."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attn.backend as B
from attn.fast import FastTransformer, cross_entropy as fast_ce
from attn.fast.core import flash
from attn.fast.core.dispatch import ops_for
from attn.gradcheck import rel_error
from attn.layers.attention import attention_backward, attention_forward, repeat_kv, sum_kv_groups
from attn.model import Transformer, TransformerConfig
from test_fast import batches, configs


@st.composite
def cases(draw):
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 3))
    causal = draw(st.booleans())
    Tk = draw(st.integers(1, 19))
    Tq = Tk if causal else draw(st.integers(1, 19))
    Bsz = draw(st.integers(1, 3))
    lengths = [draw(st.integers(0 if b else 1, Tk)) for b in range(Bsz)]   # a sentence may be all padding
    return dict(Bsz=Bsz, H=H, Hkv=Hkv, Tq=Tq, Tk=Tk, Dh=draw(st.integers(1, 6)), causal=causal,
                lengths=lengths, tile=draw(st.integers(1, 8)), seed=draw(st.integers(0, 2 ** 16)))


def _readable(q, k, v, ok, causal, dout, G):
    """The paper's attention (attn.layers.attention) on host arrays, keys and values repeated
    over the group: out, dq, dk, dv (dk and dv summed over the group)."""
    Tq, Tk = q.shape[2], k.shape[2]
    mask = ok[:, None, None, :]
    if causal:
        mask = mask & np.tril(np.ones((Tq, Tk), dtype=bool))
    out, cache = attention_forward(q, repeat_kv(k, G), repeat_kv(v, G), mask)
    dq, dk, dv = attention_backward(dout, cache)
    return out, dq, sum_kv_groups(dk, G), sum_kv_groups(dv, G)


def _run_flash(xp, q, k, v, ok, causal, dout, tile):
    """The tiled attention on ``xp``, its inputs as the fast engine lays them out (q, k, v views
    of one fused projection; the context (B*Tq, H*Dh))."""
    Bsz, H, Tq, Dh = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    ops = ops_for(xp)
    rows = [a.transpose(0, 2, 1, 3).reshape(Bsz, a.shape[2], -1) for a in (q, k, v)]
    if Tq == Tk:                                  # self-attention: views of one (B, T, (H + 2 Hkv) Dh) product
        f = B.to_device(np.concatenate(rows, axis=2))
        parts = (f[:, :, :H * Dh], f[:, :, H * Dh:(H + Hkv) * Dh], f[:, :, (H + Hkv) * Dh:])
    else:                                         # cross-attention: the queries, and keys beside values
        f = B.to_device(np.concatenate(rows[1:], axis=2))
        parts = (B.to_device(rows[0]), f[:, :, :Hkv * Dh], f[:, :, Hkv * Dh:])
    qd, kd, vd = (a.reshape(Bsz, a.shape[1], -1, Dh).transpose(0, 2, 1, 3) for a in parts)
    scale = 1.0 / math.sqrt(Dh)
    ctx, cache = flash.attend(ops, qd, kd, vd, flash.KeyMask(B.to_device(ok), causal), scale, tile)
    dq = xp.empty((Bsz, H, Tq, Dh))
    dkv = xp.empty((Bsz, Tk, 2, Hkv, Dh))                   # dk and dv of one layout, as the engine's
    dk, dv = (dkv[:, :, j].transpose(0, 2, 1, 3) for j in range(2))
    dctx = B.to_device(dout.transpose(0, 2, 1, 3).reshape(Bsz * Tq, H * Dh))
    flash.attend_backward(ops, dctx, cache, dq, dk, dv, scale, tile)
    out = B.to_host(ctx).reshape(Bsz, Tq, H, Dh).transpose(0, 2, 1, 3)
    return out, B.to_host(dq), B.to_host(dk), B.to_host(dv)


@given(cases())
def test_the_tiled_attention_equals_the_papers_in_float64(backend, case):
    rng = np.random.default_rng(case["seed"])
    Bsz, H, Hkv, Tq, Tk, Dh = (case[n] for n in ("Bsz", "H", "Hkv", "Tq", "Tk", "Dh"))
    q = rng.standard_normal((Bsz, H, Tq, Dh))
    k, v = (rng.standard_normal((Bsz, Hkv, Tk, Dh)) for _ in range(2))
    dout = rng.standard_normal((Bsz, H, Tq, Dh))
    ok = np.arange(Tk)[None, :] < np.array(case["lengths"])[:, None]
    want = _readable(q, k, v, ok, case["causal"], dout, H // Hkv)
    got = _run_flash(backend, q, k, v, ok, case["causal"], dout, case["tile"])
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=name)


def test_queries_with_no_key_get_zeros_and_launch_no_tile_loop(backend, monkeypatch):
    """Tk = 0: the forward's tile loop would end before any barrier and leave its sums unset, so
    no ``flash_fwd`` runs; the output and every gradient are the plain attention's zeros."""
    launched = []
    real = flash._run
    monkeypatch.setattr(flash, "_run", lambda ops, name, *a: (launched.append(name), real(ops, name, *a)))
    xp, ops = B.xp(), ops_for(B.xp())
    q = B.to_device(np.random.default_rng(0).normal(size=(2, 2, 3, 4)))
    k, v = xp.zeros((2, 1, 0, 4)), xp.zeros((2, 1, 0, 4))
    ctx, cache = flash.attend(ops, q, k, v, flash.KeyMask(xp.ones((2, 0), dtype=bool), False), 0.5, 2)
    dq, dk, dv = xp.full(q.shape, 7.0), xp.zeros(k.shape), xp.zeros(v.shape)
    flash.attend_backward(ops, xp.ones((6, 8)), cache, dq, dk, dv, 0.5, 2)
    assert launched == [] and ctx.shape == (6, 8) and not B.to_host(ctx).any() and not B.to_host(dq).any()


def test_causal_tiles_past_the_queries_are_skipped():
    """A causal attention's forward reads no key tile that lies wholly after its query tile: a
    NaN key there changes nothing (the plain attention would multiply it by a weight of 0)."""
    from conftest import selected_backend
    with selected_backend("numpy"):
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 1, 8, 2)) for _ in range(3))
        ok = np.ones((1, 8), dtype=bool)
        clean = _run_flash(np, q, k, v, ok, True, q, 4)[0]
        k[:, :, 4:], v[:, :, 4:] = np.nan, np.nan
        poisoned = _run_flash(np, q, k, v, ok, True, q, 4)[0]
        np.testing.assert_array_equal(poisoned[:, :, :4], clean[:, :, :4])


def test_the_rule_chooses_by_mode_memory_and_dropout():
    cfg = TransformerConfig(vocab_size=10, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1,
                            n_decoder_layers=1)
    need = flash.plain_weight_bytes(cfg, 2, 100, 100, 4)
    assert need == (100 * 100 + 2 * 100 * 100) * 2 * 2 * 4
    assert flash.choose("auto", cfg, 2, 100, 100, 4, np, False, memory=need * 3)
    assert not flash.choose("auto", cfg, 2, 100, 100, 4, np, False, memory=need * 5)
    assert flash.choose("flash", cfg, 2, 1, 1, 4, np, False)
    assert not flash.choose("plain", cfg, 2, 100, 100, 4, np, False, memory=1)
    assert not flash.choose("auto", cfg, 2, 100, 100, 4, np, True, memory=1)
    with pytest.raises(ValueError, match="attention_dropout"):
        flash.choose("flash", cfg, 2, 1, 1, 4, np, True)
    with pytest.raises(ValueError, match="auto, plain, flash"):
        flash.check_mode("tiled")


def test_the_kernels_tiles_fit_a_blocks_shared_memory():
    from attn.fast.gpu.kernels import flash as K
    for kernel in ("flash_fwd", "flash_bwd_kv", "flash_bwd_q"):
        for Dh, it in ((64, 4), (128, 4), (64, 8), (256, 8)):
            t = K.flash_tiles(kernel, Dh, it)
            assert K.flash_shared(kernel, t, t, Dh, it) <= K.SHARED_LIMIT < K.flash_shared(kernel, 2 * t, 2 * t, Dh, it) \
                or t == K.MOST_TILE
    assert K.flash_tiles("flash_fwd", 64, 4) == 32 and K.flash_tiles("flash_bwd_kv", 64, 4) == 16
    with pytest.raises(ValueError, match="does not fit"):
        K.flash_tiles("flash_bwd_kv", 4096, 8)


def _step(model, batch, rng_seed):
    src, tgt_in, tgt_out = (B.to_device(a) for a in batch)
    rng = None if rng_seed is None else B.DeviceRNG(rng_seed)
    logits, cache = model.forward(src, tgt_in, rng)
    out = B.to_host(logits)
    kinds = {type(c.enc[0][0].sub.att) for c in getattr(cache, "caches", [cache])}   # before backward frees them
    loss, d = fast_ce(logits, tgt_out, model.config.label_smoothing, inplace=True)
    return out, float(loss), {k: B.to_host(g).copy() for k, g in model.backward(d, cache).items()}, kinds


@settings(max_examples=10)
@given(data=st.data(), workers=st.sampled_from([1, 2]), dropout=st.booleans())
def test_the_engines_step_with_the_tiled_attention_equals_the_plain_one(backend, data, workers, dropout):
    """float64: logits, loss and every gradient, the batch whole or split over threads, with the
    residual and ReLU dropout on (the same masks: the attention's is 0, as the tiled one needs)."""
    cfg = data.draw(configs(dropout=dropout))
    cfg = TransformerConfig(**{**cfg.to_dict(), "attention_dropout": 0.0})
    batch = data.draw(batches(cfg, max_len=7))
    ref = Transformer(cfg, seed=0, dtype="float64")
    steps, evaluated = [], []
    for mode in ("plain", "flash"):
        fast = FastTransformer(cfg, dtype="float64", params=ref.params, attention=mode)
        fast.workers = workers
        steps.append(_step(fast, batch, 3 if dropout else None))
        evaluated.append(B.to_host(fast.logits(*(B.to_device(a) for a in batch[:2]))))   # no cache kept
    assert rel_error(evaluated[0], evaluated[1]) < 1e-12
    (l0, loss0, g0, kinds0), (l1, loss1, g1, kinds1) = steps
    assert kinds1 == {flash.FlashCache} and flash.FlashCache not in kinds0           # the tiled one ran, once
    assert rel_error(l0, l1) < 1e-12 and abs(loss0 - loss1) < 1e-12 * max(1.0, abs(loss0))
    for k in g0:
        assert rel_error(g0[k], g1[k]) < 1e-10, k


def test_the_tiled_attention_refuses_attention_dropout_and_inspection():
    from conftest import selected_backend
    with selected_backend("numpy"):
        cfg = TransformerConfig(vocab_size=12, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1,
                                attention_dropout=0.1)
        model = FastTransformer(cfg, dtype="float64", attention="flash")
        ids = np.array([[3, 4, 5]])
        with pytest.raises(ValueError, match="attention_dropout is 0.1"):
            model.forward(ids, ids, B.DeviceRNG(0))
        _, cache = model.forward(ids, ids)                  # no dropout without an rng: the tiled one runs
        with pytest.raises(ValueError, match="keeps no attention weights"):
            FastTransformer.attention_weights(cache)
        with pytest.raises(ValueError, match="auto, plain, flash"):
            FastTransformer(cfg, attention="tiled")


#: Ceilings of a steady-state training step of the ``quick`` preset with the tiled attention, on the
#: stand-in (tests/test_counts.py holds the plain step's): 103 launches when first counted (the
#: plain step: 126), no sync, nothing from the memory pool, nothing a CUDA graph capture refuses.
def test_auto_says_once_which_attention_it_took_and_by_which_rule(backend, capsys):
    """``auto`` never takes the tiled attention in silence: the first step that takes it says so on
    stderr with the rule's reason (the memory rule: every row of ``AUTO_RULES`` has no length, since
    no GPU has timed the kernels), and no later step says it again; a step on the plain one says nothing."""
    cfg = TransformerConfig(vocab_size=12, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1,
                            attention_dropout=0.0)
    assert all(rule.min_length is None for rule in flash.AUTO_RULES.values())
    src, tgt = (B.to_device(np.array([[5, 6, 7, 8]] * 2)) for _ in range(2))
    model = FastTransformer(cfg, attention="auto")
    assert model._device_kind == ("numpy" if backend is np else "cupy")
    model.logits(src, tgt)
    assert capsys.readouterr().err == ""                               # the plain attention: nothing said
    model._memory = flash.plain_weight_bytes(cfg, 2, 4, 4, 4) * 3      # a quarter of it is less than the weights
    for _ in range(3):
        model.logits(src, tgt)
    said = [ln for ln in capsys.readouterr().err.splitlines() if "--attention auto" in ln]
    assert len(said) == 1 and "takes the tiled attention" in said[0] and "the memory rule" in said[0], said
    assert f"more than 0.25 of the" in said[0]


def test_a_devices_measured_row_of_the_auto_table_is_used_before_its_backends(monkeypatch):
    """A row for a GPU's name (what a GPU report that timed the kernels would add) is the rule on that
    GPU; every other GPU keeps the backend's."""
    from conftest import selected_backend
    cfg = TransformerConfig(vocab_size=12, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1)
    with selected_backend("fakecupy") as cp:
        assert flash.device_kind(cp) == "cupy"
        assert not flash.choose("auto", cfg, 2, 64, 64, 4, cp, False)
        monkeypatch.setitem(flash.AUTO_RULES, "fakecupy (NumPy stand-in)", flash.AutoRule(0.25, 64, "measured"))
        assert flash.device_kind(cp) == "fakecupy (NumPy stand-in)"
        assert flash.choose("auto", cfg, 2, 64, 64, 4, cp, False) and not flash.choose("auto", cfg, 2, 63, 9, 4,
                                                                                       cp, False)
        assert "reaches 64" in flash.choose("auto", cfg, 2, 64, 9, 4, cp, False)


TILED_STEP_BUDGET = {"launches": 103, "syncs": 0, "pool_allocations": 0}


def test_a_tiled_step_is_counted_and_capturable(monkeypatch):
    """``--counts`` of a step that takes the tiled attention (the rule's length threshold lowered
    to 1 on CuPy): one ``flash_fwd`` per attention in the forward, the three backward kernels
    once each per attention, no plain softmax, and no kernel whose grid stays while the batch grows."""
    from attn.bench import counts as C
    monkeypatch.setitem(flash.AUTO_RULES, "cupy", flash.AUTO_RULES["cupy"]._replace(min_length=1))
    rows = {r["name"]: r for r in C.measure_counts("quick", which=("train_step",))}
    step = rows["counts_train_step"]
    over = {k: (step[k], most) for k, most in TILED_STEP_BUDGET.items() if step[k] > most}
    assert not over, f"the tiled step went over its budget (count, ceiling): {over}; {step['launches_by_kind']}"
    assert rows["counts_capture"]["total"] == 0, rows["counts_capture"]["refused"]
    assert rows["counts_lint"]["fixed_grid_kernels"] == []          # the grids grow with the batch
    tally = C.count_at(C.BENCH_PRESETS["quick"], ("train_step",))["train_step"][0]
    raw = {name: n for (kind, name), n in tally.ops.items() if kind == "raw"}
    cfg = C.BENCH_PRESETS["quick"].model
    attentions = cfg["n_encoder_layers"] + 2 * cfg["n_decoder_layers"]
    assert [raw.get(k, 0) for k in ("flash_fwd", "flash_bwd_prep", "flash_bwd_kv", "flash_bwd_q")] == [attentions] * 4
    assert "softmax0_fwd" not in raw


def test_attn_train_takes_the_attention_and_hands_it_to_the_fast_engine():
    from attn.training.config import TrainConfigError, config_from_argv
    from attn.training.prepare import make_engine
    assert config_from_argv([]).attention == "auto"
    assert config_from_argv(["--attention", "flash"]).attention == "flash"
    with pytest.raises(TrainConfigError, match="--attention"):
        config_from_argv(["--attention", "plain", "--reference"])
    cfg = TransformerConfig(vocab_size=12, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1)
    model, _ = make_engine(Transformer(cfg), "fast", 1.0, attention="flash")
    assert model.attention == "flash"


def test_make_engine_refuses_a_choice_of_attention_the_engine_lacks():
    """``make_engine(..., attention=)`` sets the fast engine's attention; the reference engine has
    the plain one alone, and is refused the choice in words rather than given an attribute it
    never reads."""
    from attn.model import Transformer
    from attn.training.prepare import make_engine
    from conftest import selected_backend
    cfg = TransformerConfig(vocab_size=12, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1)
    with selected_backend("numpy"):
        model = Transformer(cfg, seed=0)
        fast, _ = make_engine(model, "fast", 1.0, attention="flash")
        assert fast.attention == "flash"
        assert make_engine(model, "reference", 1.0)[0] is not None
        with pytest.raises(ValueError, match="attention='flash'.*reference engine"):
            make_engine(model, "reference", 1.0, attention="flash")


def test_the_float32_kernels_at_their_production_tiles_and_head_size(monkeypatch):
    """float32 at Dh = 64 on the stand-in: the instances compiled for that head size
    (``flash_fwd<float, 64>``), the tiles the GPU's opt-in shared memory allows (64 rows, where 48 KiB
    gave 32, 16 and 32), rows padded to 65 values; against the paper's attention in float64."""
    from conftest import selected_backend
    from attn.fast.gpu.kernels import flash as K
    assert K.flash_shared("flash_fwd", 32, 32, 64, 4) == (2 * 32 * 65 + 2 * 32 * 64 + 32 * 33) * 4
    assert [K.flash_tiles(k, 64, 4, 99 << 10) for k in ("flash_fwd", "flash_bwd_kv", "flash_bwd_q")] == [64, 64, 64]
    assert K.compiled_head(64, 4) == 64 and K.compiled_head(48, 4) == 0 and K.compiled_head(64, 8) == 0
    rng = np.random.default_rng(1)
    Bsz, H, Hkv, T, Dh = 2, 2, 1, 80, 64
    q, dout = (rng.standard_normal((Bsz, H, T, Dh)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((Bsz, Hkv, T, Dh)).astype(np.float32) for _ in range(2))
    ok = np.arange(T)[None, :] < np.array([[T], [50]])
    names = []
    real = flash._run
    monkeypatch.setattr(flash, "_run", lambda ops, name, dt, grid, block, *a: (names.append((name, block[0])),
                                                                             real(ops, name, dt, grid, block, *a)))
    with selected_backend("fakecupy") as cp:
        ops, scale = ops_for(cp), 1 / math.sqrt(Dh)
        ctx, cache = flash.attend(ops, *(B.to_device(a) for a in (q, k, v)), flash.KeyMask(B.to_device(ok), True), scale)
        dq, dk, dv = (cp.empty(a.shape, dtype=np.float32) for a in (q, k, v))
        flash.attend_backward(ops, B.to_device(dout.transpose(0, 2, 1, 3).reshape(Bsz * T, H * Dh)), cache, dq, dk, dv,
                              scale)
        got = [B.to_host(ctx).reshape(Bsz, T, H, Dh).transpose(0, 2, 1, 3), *(B.to_host(a) for a in (dq, dk, dv))]
        assert [n for n in names if n[0] != "flash_bwd_prep"] == [("flash_fwd", 64), ("flash_bwd_kv", 64),
                                                                  ("flash_bwd_q", 64)]
        opted = {name: n for name, (_, n) in flash._HEADED[ops].items()}
        assert all(opted[f"flash_{k}<float, 64>"] > K.SHARED_LIMIT for k in ("fwd", "bwd_kv", "bwd_q")), opted
    want = _readable(*(a.astype(np.float64) for a in (q, k, v)), ok, True, dout.astype(np.float64), H // Hkv)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=1e-5 * np.abs(w).max(), rtol=0, err_msg=name)
    with pytest.raises(ValueError, match="compiled for heads of 64 values, launched with Dh = 32"):
        K._check_tiled(K.HostLaunch("flash_fwd<float, 64>", (1, 1), (1,), 1 << 20), "flash_fwd", 1, 1, 1, 1, 32, 4)

"""The tiled attention on the tensor cores (attn.fast.core.flash_tc; its kernels and their NumPy twins in
attn.fast.gpu.kernels.flash_mma): each twin against the paper's attention in float64 on the inputs
rounded to 16 bits, at the tiles the kernels are launched with and at small ones (many tiles at
short lengths), with every mask (padding, causal, a query that sees no key), grouped-query
attention and cross-attention; the launch checks; the engine on the stand-in (which runs the twins)
against the plain attention at bf16; the rule that takes these kernels only when asked; and NVRTC
compiling them (to machine code, so that ptxas reads the inline PTX) for every compute capability
8.0 to 10.0 it supports."""
from __future__ import annotations

import math

import numpy as np
import pytest

import attn.backend as B
from attn.fast import FastTransformer
from attn.fast.core import flash, flash_tc
from attn.fast.core.dispatch import ops_for
from attn.fast.gpu.kernels import flash_mma as M
from attn.fast.core.ops import Ops
from attn.model import Transformer, TransformerConfig
from test_fast_flash import _readable, _step
from test_kernels import _nvrtc, compile_source

# (B, H, Hkv, Tq, Tk, Dh, causal, format, padding: the lengths of the sentences' keys)
CASES = [(2, 4, 2, 70, 70, 64, True, "bf16", (70, 52)),           # GQA, causal, a padded sentence
         (2, 2, 1, 33, 150, 128, False, "fp16", (150, 0)),         # cross-attention, a sentence of padding alone
         (1, 2, 2, 130, 130, 64, True, "bf16", (129,))]            # three query tiles, keys over two tiles
#: Each format's tolerance against float64, as a share of the largest value: P (and dS) rounded to 16 bits.
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3}


def _attend(ops, q, k, v, ok, causal, fmt, dout):
    """The tensor-core attention on ``ops``: out (B, H, Tq, Dh), dq, dk, dv as host float64."""
    Bsz, H, Tq, Dh = q.shape
    xp, scale = ops.xp, 1 / math.sqrt(Dh)
    qd, kd, vd = (B.to_device(a) for a in (q, k, v))
    ctx, cache = flash_tc.attend(ops, qd, kd, vd, flash.KeyMask(B.to_device(ok), causal, fmt), scale)
    dq, dk, dv = (xp.empty(a.shape, dtype=np.float32) for a in (q, k, v))
    flash_tc.attend_backward(ops, B.to_device(dout.transpose(0, 2, 1, 3).reshape(Bsz * Tq, H * Dh)), cache, dq, dk,
                             dv, scale)
    out = B.to_host(ctx).reshape(Bsz, Tq, H, Dh).transpose(0, 2, 1, 3)
    return [B.to_host(a).astype(np.float64) for a in (out, dq, dk, dv)]


def _case(case, seed=0):
    Bsz, H, Hkv, Tq, Tk, Dh, causal, fmt, lengths = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((Bsz, H, Tq, Dh)).astype(np.float32)
    k, v = (rng.standard_normal((Bsz, Hkv, Tk, Dh)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal((Bsz, H, Tq, Dh)).astype(np.float32)
    ok = np.arange(Tk)[None, :] < np.array(lengths)[:, None]
    if causal:
        ok[0, 0] = False                            # query 0 of sentence 0 sees no key: its output is 0
    return q, k, v, dout, ok


def _check(got, case, q, k, v, dout, ok):
    Bsz, H, Hkv, Tq, Tk, Dh, causal, fmt, _ = case
    kind = M.KINDS[fmt]
    rounded = [M.round16(a, kind).astype(np.float64) for a in (q, k, v, dout)]
    want = _readable(*rounded[:3], ok, causal, rounded[3], H // Hkv)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=TOLERANCE[fmt] * np.abs(w).max(), rtol=0, err_msg=name)
    if causal:
        assert not got[0][0, :, 0].any() and not got[1][0, :, 0].any()     # no visible key: 0, and no gradient


@pytest.mark.parametrize("tiles", ["launched", "small"])
@pytest.mark.parametrize("case", CASES, ids=["gqa-causal", "cross-fp16-128", "three-tiles"])
def test_the_twins_equal_the_papers_attention(case, tiles, monkeypatch):
    """At the tiles the kernels are launched with (:data:`TILES`) and at 16 x 16 / 32 x 16 ones."""
    if tiles == "small":
        monkeypatch.setattr(flash_tc, "TILES", {"flash_mma_fwd": (16, 32), "flash_mma_bwd_kv": (16, 32),
                                                "flash_mma_bwd_q": (32, 16)})
    q, k, v, dout, ok = _case(case)
    _check(_attend(Ops(np), q, k, v, ok, case[6], case[7], dout), case, q, k, v, dout, ok)


def test_the_stand_in_runs_the_twins_through_the_launch_code():
    """On the stand-in the kernels' instances are found in a module compiled from the source (the
    template instances NVRTC makes), each launch checked as a GPU would check it: the forward at
    Dh = 128 opts into more than 48 KiB of shared memory, and without the opt-in it is refused."""
    from conftest import selected_backend
    case = CASES[1]
    q, k, v, dout, ok = _case(case)
    with selected_backend("fakecupy"):
        ops = ops_for(B.xp())
        _check(_attend(ops, q, k, v, ok, case[6], case[7], dout), case, q, k, v, dout, ok)
        f = flash_tc._fn(ops, M.instance("flash_mma_fwd", "fp16", 128), 0)
        assert f.max_dynamic_shared_size_bytes == M.mma_shared("flash_mma_fwd", 128, 64, 64) > flash.SHARED_LIMIT
        f.max_dynamic_shared_size_bytes = 0
        with pytest.raises(ValueError, match="max_dynamic_shared_size_bytes"):
            f((2, 1), (128,), (), shared_mem=M.mma_shared("flash_mma_fwd", 128, 64, 64))


def test_a_twin_refuses_a_launch_its_kernel_would_get_wrong():
    """A block of the wrong size, too little shared memory, an instance that is not one."""
    q, k, v, dout, ok = _case(CASES[0])
    ops = Ops(np)
    real = flash_tc._run
    for broken, match in ((lambda n, g, b, s: (n, g, (b[0] // 2,), s), "block"),
                          (lambda n, g, b, s: (n, g, b, s - 16), "shared memory"),
                          (lambda n, g, b, s: (n.replace(", 64>", ">"), g, b, s), "template arguments")):
        def launch(ops_, name, grid, block, shared, args, broken=broken):
            if "pack" not in name:
                name, grid, block, shared = broken(name, grid, block, shared)
            real(ops_, name, grid, block, shared, args)
        flash_tc._run = launch
        try:
            with pytest.raises(ValueError, match=match):
                _attend(ops, q, k, v, ok, True, "bf16", dout)
        finally:
            flash_tc._run = real


def test_the_tiles_fit_what_every_gpu_since_ampere_allows():
    most = 99 << 10                      # the shared memory every GPU of compute capability 8.0 to 10.0 allows
    for kernel, (BR, BC) in M.TILES.items():
        for DH in M.HEAD_SIZES:
            assert M.mma_shared(kernel, DH, BR, BC) <= most, (kernel, DH)
    assert M.mma_shared("flash_mma_fwd", 64, 64, 64) <= flash.SHARED_LIMIT             # Dh = 64: no opt-in at all
    assert M.NAME_EXPRESSIONS[:2] == ("flash_mma_pack<0>", "flash_mma_pack<1>") and len(M.NAME_EXPRESSIONS) == 14


def test_the_tensor_cores_are_taken_only_when_asked():
    """``flash`` at bf16 on a GPU with heads of 64 or 128: the tensor cores; ``auto`` never, while
    :data:`TC_RULES` is empty (no GPU has run them); NumPy, fp32 and other head sizes never."""
    from conftest import selected_backend
    with selected_backend("fakecupy") as cp:
        assert flash_tc.TC_RULES == {}
        assert flash_tc.cores_for("flash", "bf16", cp, 64, "cupy")[0] == "bf16"
        assert flash_tc.cores_for("flash", "bf16", cp, 128, "cupy")[0] == "bf16"
        for mode, precision, xp, Dh in (("auto", "bf16", cp, 64), ("flash", "fp32", cp, 64), ("flash", "tf32", cp, 64),
                                        ("flash", "bf16", np, 64), ("flash", "bf16", cp, 32)):
            fmt, why = flash_tc.cores_for(mode, precision, xp, Dh, "cupy")
            assert fmt is None and why, (mode, precision, Dh)
        flash_tc.TC_RULES["cupy"] = "measured"
        try:
            assert flash_tc.cores_for("auto", "bf16", cp, 64, "cupy") == ("bf16", "auto on cupy: measured")
        finally:
            flash_tc.TC_RULES.clear()


def test_the_engine_at_bf16_with_flash_runs_them_and_says_so(capsys):
    """A training step on the stand-in with ``attention='flash'`` at bf16 (heads of 64): the
    tensor-core kernels' twins run every attention, said once on stderr; logits, loss and
    gradients as the plain attention's at bf16 within bf16's rounding of P."""
    from conftest import selected_backend
    cfg = TransformerConfig(vocab_size=16, d_model=64, n_heads=1, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                            attention_dropout=0.0, dropout=0.0)
    src = np.array([[5, 6, 7, 8, 9, 0], [3, 4, 5, 6, 7, 8]])
    tgt = np.array([[1, 5, 6, 7, 0], [1, 9, 8, 7, 6]])
    batch = (src, tgt, np.array([[5, 6, 7, 2, 0], [9, 8, 7, 6, 2]]))
    launched = []
    real = flash_tc._run
    with selected_backend("fakecupy"):
        ref = Transformer(cfg, seed=0)
        flash_tc._run = lambda ops, name, *a: (launched.append(name.split("<")[0]), real(ops, name, *a))
        try:
            steps = [_step(FastTransformer(cfg, params=ref.params, precision="bf16", attention=mode), batch, None)
                     for mode in ("plain", "flash")]
        finally:
            flash_tc._run = real
    said = [ln for ln in capsys.readouterr().err.splitlines() if "tensor cores" in ln]
    assert len(said) == 1 and "have not yet run on a GPU" in said[0], said
    assert launched.count("flash_mma_fwd") == 3 and launched.count("flash_mma_bwd_q") == 3
    (l0, loss0, g0, _), (l1, loss1, g1, kinds) = steps
    assert kinds == {flash.FlashCache}
    assert np.abs(l0 - l1).max() < 0.05 * np.abs(l0).max() and abs(loss0 - loss1) < 0.01 * loss0
    for name in g0:
        if name.endswith("b_k"):            # adds one number to all of a query's scores: its gradient is 0 but for rounding
            continue
        assert np.abs(g0[name] - g1[name]).max() <= 0.05 * np.abs(g0[name]).max() + 1e-6, name


#: Compute capabilities 8.0 to 10.0 (bf16's mma.sync needs 8.0).
MMA_ARCHS = ["compute_80", "compute_86", "compute_87", "compute_89", "compute_90", "compute_100"]
#: One instance of each kernel, bf16 at Dh = 64: what every architecture compiles.
EACH = tuple(M.instance(name, "bf16", None if name == "flash_mma_pack" else 64) for name in M.KERNELS)


def _supported(arch):
    nvrtc = _nvrtc()
    if int(arch.split("_")[1]) not in nvrtc.getSupportedArchs():
        pytest.skip(f"NVRTC {nvrtc.getVersion()} does not compile for {arch}")


@pytest.mark.parametrize("arch", MMA_ARCHS)
def test_the_tensor_core_kernels_compile_for(arch):
    """Each kernel, to PTX, with its tensor-core instructions in it."""
    _supported(arch)
    ptx, log, lowered = compile_source(M.SOURCE, arch, EACH, M.OPTIONS)
    assert not log.strip(), log
    assert {n.split("<")[0] for n in lowered} == set(M.KERNELS) and len(EACH) == len(M.KERNELS)
    for instruction in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared",
                        "ldmatrix.sync.aligned.m8n8.x4.trans", "cp.async.cg.shared.global", "cp.async.wait_group"):
        assert instruction in ptx, instruction


def test_every_tensor_core_instance_assembles_for_the_h100():
    """Every instance (both formats, both head sizes) to sm_90 machine code: ptxas reads each inline
    ``mma``, ``ldmatrix``, ``cvt`` and ``cp.async``, which PTX alone would pass unread."""
    _supported("compute_90")
    code, log, lowered = compile_source(M.SOURCE, "sm_90", M.NAME_EXPRESSIONS, M.OPTIONS, binary=True)
    assert not log.strip() and code[:4] == b"\x7fELF" and len(lowered) == len(M.NAME_EXPRESSIONS), log


def test_a_wrong_inline_instruction_fails_the_machine_code():
    """The check above can fail: an mma shape the tensor cores lack (k32 for 16-bit types) is refused."""
    _supported("compute_80")
    broken = M.SOURCE.replace("mma.sync.aligned.m16n8k16.row.col.f32.bf16", "mma.sync.aligned.m16n8k32.row.col.f32.bf16")
    with pytest.raises(AssertionError, match="rejects"):
        compile_source(broken, "sm_80", (M.instance("flash_mma_fwd", "bf16", 64),), M.OPTIONS, binary=True)


def test_the_fallbacks_probe_takes_the_runs_head_size_where_the_tensor_cores_would_run():
    """A run with heads of 64 (the paper's) is probed on heads of 64, so a bf16 ``flash`` run's probe
    takes the tensor-core kernels it will train with; heads of 8 keep the probe's tiny ones."""
    from attn.fast.gpu import probe
    paper = TransformerConfig(vocab_size=16, d_model=512, n_heads=8, d_ff=32)
    small = TransformerConfig(vocab_size=16, d_model=32, n_heads=4, d_ff=32)
    assert probe.block_of(paper)["head_dim"] == 64 and "head_dim" not in probe.block_of(small)
    cfg = probe.probe_config(probe.block_of(paper))
    assert cfg.d_model // cfg.n_heads == 64 and probe.probe_config(probe.block_of(small)).d_model == 16

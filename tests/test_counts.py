"""What a step asks of a GPU, counted without one (:mod:`attn.bench.counts`), and the budgets
that hold it.

* The stand-in reports each operation as CuPy would run it: one elementwise kernel for an
  arithmetic operator, none for a view, a copy before a product where cuBLAS cannot take a
  strided head view, a host transfer and a sync for ``float()``.
* The budgets: a steady-state ``toy-bench`` training step and decoding position may not launch
  more kernels, allocate more arrays from the pool or synchronise more than they did when the
  counts were first taken. They are ceilings, not targets: lower them as the engine improves
  (the targets are printed by ``python -m attn.bench --counts``).
* The lint of kernels whose grid does not grow with the batch while their work does.
* ``python -m attn.bench --counts --json`` reports them.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from attn.bench import counts as C
from attn.bench.presets import BENCH_PRESETS

#: Ceilings at today's counts (toy-bench, steady state): a regression fails here. Per training
#: step, and per generated position for decoding. (When the counter was written, before the
#: arena, the one-launch Adam and the fused epilogues, a step launched 842 kernels, Adam 127 of
#: them, and allocated 543 arrays; with those and dropout masks drawn, 574 and 365; with counter
#: dropout, 480 and 331, of which 108 operand copies and 54 ``out=`` copies CuPy's ``matmul`` made
#: of head views and transposed operands, until the products went to cuBLAS directly; and the
#: arrays came from the pool until the step memory served them all from one slab; 372, until the
#: head-view products kept their pointer arrays per address, a sub-layer's two bias gradients
#: became one launch and post-norm's backward residual sum went into cuBLAS's beta.)
BUDGETS = {
    "train_step": {"launches": 288, "optimizer_launches": 1, "syncs": 0, "pool_allocations": 0},
    "greedy_cached": {"launches": 43.1, "syncs": 0.18, "pool_allocations": 1.7},
    "beam_cached": {"launches": 45.98, "syncs": 1.04, "pool_allocations": 2.76},
}
# (Decoding, before its device state and kernels: greedy 242.68 launches, 1.04 syncs and 232.32
# allocations a position, beam 270.38, 1.04 and 259.02. What remains of the allocations is the
# encoder's and the state's, once per decoding, and beam search's one transfer of the next rows
# a position; a steady-state position of the model makes none: see
# test_a_decoding_position_on_the_gpu_allocates_nothing.)

#: Ceilings on what a CUDA graph capture of a steady-state toy-bench training step refuses, by
#: kind (:func:`attn.fast.gpu.graph.survey`): the step can be captured when none is left. Every kind
#: not named here must stay at 0 (no host transfer or sync inside the step).
CAPTURE_BUDGET: dict = {}

#: RawKernels known to keep a fixed grid while their work grows (the lint below must not find
#: others). None today: ``colsum_prod`` (layer norm's dgamma, one thread per column) was the
#: one, until the two-stage ``column_sums`` replaced it.
KNOWN_FIXED_GRID: set = set()


@pytest.fixture(scope="module")
def toy_bench():
    return {r["name"]: r for r in C.measure_counts("toy-bench")}


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_toy_bench_stays_within_its_budget(toy_bench, name):
    row = toy_bench[f"counts_{name}"]
    over = {k: (row[k], ceiling) for k, ceiling in BUDGETS[name].items() if row[k] > ceiling + 1e-9}
    assert not over, (f"{name} on toy-bench went over its budget (count, ceiling): {over}; by kind "
                      f"{row['launches_by_kind']}; most launched {row['top_operations'][:6]}")


def test_the_training_step_reports_its_phases_and_the_targets(toy_bench):
    row = toy_bench["counts_train_step"]
    assert sum(row["launches_by_phase"].values()) == row["launches"]
    assert row["optimizer_launches"] == row["launches_by_phase"]["optimizer"] >= 1
    assert row["targets"] == {"launches": 300, "optimizer_launches": 1, "syncs": 0, "pool_allocations": 0}
    assert sum(row["launches_by_kind"].values()) == row["launches"]
    assert row["launches_by_kind"]["raw"] >= 1 and row["launches_by_kind"]["matmul"] >= 1
    assert row["bytes_moved_mb"] > row["slab_mb"] > 0 and row["batch"] == BENCH_PRESETS["toy-bench"].batch
    assert row["pool_allocated_mb"] == 0 and row["step_memory_allocations"] > 0
    assert row["peak_live_mb"] <= row["slab_mb"] <= 1.1 * row["peak_live_mb"]     # the plan: near the peak
    assert 0 < row["host_us_per_launch"] < 10_000


def test_what_a_capture_of_the_step_refuses_stays_within_its_budget(toy_bench):
    row = toy_bench["counts_capture"]
    over = {k: (n, CAPTURE_BUDGET.get(k, 0)) for k, n in row["refused"].items() if n > CAPTURE_BUDGET.get(k, 0)}
    assert not over, f"a capture of the training step refuses more than before (count, ceiling): {over}; " \
                     f"where: {row['places']}"
    assert row["total"] == sum(row["refused"].values())
    assert all(where.startswith("attn/") for _, where, _ in row["places"]), row["places"]


def test_dropout_draws_no_random_numbers_on_the_gpu(toy_bench):
    """The counter-based dropout (on by default) regenerates each mask inside the kernels that
    apply it: no cuRAND draw, no comparison, no ``dropout_fwd`` with a mask in memory."""
    row = toy_bench["counts_train_step"]
    assert row["launches_by_kind"].get("random", 0) == 0, row["launches_by_kind"]
    assert not {name for _, name, _ in row["top_operations"]} & {"random_sample", "greater_equal", "dropout_fwd"}


def test_the_lint_finds_no_other_fixed_grid_kernel(toy_bench):
    found = {k["kernel"] for k in toy_bench["counts_lint"]["fixed_grid_kernels"]}
    assert found <= KNOWN_FIXED_GRID, f"kernels whose grid does not grow with the batch: {found - KNOWN_FIXED_GRID}"


def test_the_lint_flags_a_grid_that_stays_while_the_work_grows():
    small = [("rows", 2, 256, 512), ("cols", 2, 256, 4096), ("adam", 40, 256, 10_000), ("tiny", 1, 256, 256)]
    large = [("rows", 4, 256, 1024), ("cols", 2, 256, 8192), ("adam", 40, 256, 10_000), ("tiny", 1, 256, 512)]
    assert C.fixed_grid_kernels(small, large) == [{"kernel": "cols", "blocks": 2, "work_small": 4096,
                                                   "work_large": 8192}]
    assert C.fixed_grid_kernels(small, small) == []           # "tiny": one block, two elements a thread


def _traced(call):
    """(tally, syncs) of ``call(cp)`` on the stand-in."""
    with C._on_the_stand_in() as fc:
        tally, syncs, _ = C._count_once(fc, lambda: call(fc.cupy))
    return tally, syncs


def test_the_stand_in_reports_operations_as_cupy_runs_them():
    def ops(cp):
        a, b = cp.ones((8, 4), dtype="float32"), cp.ones((4, 6), dtype="float32")
        c = a + 1                      # an elementwise kernel and a new array
        c += a                         # an elementwise kernel in place: no allocation
        c.T                            # a view: nothing
        c.sum(axis=0)                  # a reduction
        a @ b                          # a cuBLAS product
        cp.asarray(np.ones(3))         # a host -> device copy
        float(c[0, 0])                 # a device -> host copy, and a sync
    t, syncs = _traced(ops)
    assert dict(t.ops) == {("elementwise", "ones"): 2, ("elementwise", "add"): 2, ("reduction", "sum"): 1,
                           ("matmul", "matmul"): 1, ("copy", "host->device"): 1, ("copy", "device->host"): 1}
    assert syncs == 1 and t.allocations == 6            # ones x2, a + 1, the sum, the product, the copy
    assert t.bytes >= 8 * 4 * 4 * 3                     # c += a reads two and writes one (8, 4) float32


def test_cupys_matmul_copies_what_cublas_is_not_given_as_it_is():
    """CuPy's batched product makes each operand C-contiguous: a (B, T, H, Dh) -> (B, H, T, Dh)
    head view and a transposed batch are copied, a contiguous batch is not. A plain product
    takes a transposed matrix as it is and copies a column slice. A non-contiguous ``out=``
    gets the product through a new array and a copy."""
    def ops(cp):
        x = cp.ones((2, 5, 3, 4), dtype="float32")
        q = x.transpose(0, 2, 1, 3)                        # (B, H, T, Dh) head view: copied
        y = cp.ones((6, 5, 4), dtype="float32")
        y @ cp.ones((6, 4, 5), dtype="float32")            # nothing copied
        q @ cp.ones((1, 3, 4, 5), dtype="float32")         # the head view
        y @ y.swapaxes(-1, -2)                             # the transposed batch
        w, big = cp.ones((4, 6), dtype="float32"), cp.ones((5, 12), dtype="float32")
        big[:, :6] @ w.T                                   # the column slice, not the transposed matrix
        cp.matmul(big[:, :4], w, out=big[:, 6:])           # and the out= view
    t, _ = _traced(ops)
    assert t.ops[("matmul", "matmul")] == 5
    assert t.ops[("copy", "matmul operand copy")] == 4 and t.ops[("copy", "matmul out= copy")] == 1


def test_a_kernel_launch_reports_its_grid_and_work():
    from attn.fast.gpu import kernels as K

    def ops(cp):
        f = cp.RawModule(code=K.SOURCE, options=K.OPTIONS, name_expressions=K.NAME_EXPRESSIONS) \
            .get_function("relu_bwd<float>")
        da, a = cp.zeros(1000, dtype="float32"), cp.ones(1000, dtype="float32")
        f((4,), (256,), (da, a, np.int64(1000)))
    t, _ = _traced(ops)
    assert t.kinds["raw"] == 1 and t.raw == [("relu_bwd", 4, 256, 1000)]


def test_bytes_scale_with_the_batch_as_counted():
    """Bytes are counted at two small batches and scaled to the preset's: the scaling agrees with
    a count at that batch (quick preset, training step)."""
    from dataclasses import replace
    bc = BENCH_PRESETS["quick"]
    got = {b: C.count_at(replace(bc, batch=b, decode_batch=b), ("train_step",))["train_step"][0] for b in (2, 4, 8)}
    assert got[2].launches == got[4].launches == got[8].launches
    scaled = C._scale(got[2].bytes, got[4].bytes, 2, 4, 8)
    assert scaled == pytest.approx(got[8].bytes, rel=1e-9)


def test_the_benchmark_prints_the_counts(capsys):
    from attn.bench.cli import main
    assert main(["--counts", "--quick", "--json", "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in rows] == ["counts_train_step", "counts_greedy_cached", "counts_beam_cached",
                                         "counts_capture", "counts_lint"]
    assert rows[0]["targets"] == {"optimizer_launches": 1, "syncs": 0, "pool_allocations": 0}   # no launch target
    text = io.StringIO()
    C.print_counts(rows, text)
    assert "of which Adam" in text.getvalue() and "(target 1)" in text.getvalue() and "lint" in text.getvalue()
    assert "capture (operations a CUDA graph capture of the training step refuses)" in text.getvalue()
    md = io.StringIO()
    C.print_counts_markdown(rows, md)
    table = [line for line in md.getvalue().splitlines() if line.startswith("| quick |")]
    assert [line.split(" | ")[1] for line in table] == ["train_step", "target", "greedy_cached", "beam_cached"]
    assert table[0].split(" | ")[3] == f"{rows[0]['launches']:g}"


def test_docs_quote_the_counts_the_code_prints(toy_bench):
    """docs/GPU.md quotes ``python -m attn.bench --counts --markdown --preset toy-bench``; after a
    change to the counts, run it again and paste its output there (and the base preset's)."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "GPU.md").read_text(encoding="utf-8")
    md = io.StringIO()
    C.print_counts_markdown(list(toy_bench.values()), md)
    assert md.getvalue().strip() in doc, "docs/GPU.md does not quote today's toy-bench counts:\n" + md.getvalue()


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_a_decoding_position_on_the_gpu_allocates_nothing(norm):
    """A steady-state cached decoding position on CuPy (FastTransformer's device state, then
    greedy decoding's pick) writes into buffers made before it: no pool allocation, no sync, and
    per decoder layer six products and six kernels (two attentions, three residual-and-norm
    epilogues, the ReLU), plus the embedding, the projection, the log-softmax and the pick."""
    from attn import decode as D
    from attn.fast import FastTransformer
    from attn.model import TransformerConfig
    L = 2
    with C._on_the_stand_in() as fc:
        cp = fc.cupy
        cfg = TransformerConfig(vocab_size=20, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                                n_decoder_layers=L, dropout=0.0, norm_position=norm)
        model = FastTransformer(cfg, seed=0)
        src = cp.asarray(np.array([[4, 5, 6, 0], [7, 8, 9, 10], [11, 4, 0, 0]]))
        mask = (src != 0)[:, None, None, :]
        state = model.start_decoding(model.encode(src, None, mask)[0], mask, reserve=(3, 8))
        tokens, info = cp.full((3,), 1, dtype=np.int64), cp.empty((2, 3), dtype=np.float64)

        def position():
            nonlocal state
            logp, state, _ = model.decode_step(tokens, state)
            model.search().greedy_pick(logp, D.BANNED, info, tokens)
        for _ in range(2):
            position()
        tally, syncs, _ = C._count_once(fc, position)
    assert (tally.allocations, syncs) == (0, 0), tally.ops
    assert dict(tally.kinds) == {"matmul": 6 * L + 1, "raw": 6 * L + 3}, tally.ops


def test_a_bf16_step_is_counted_and_capturable(monkeypatch):
    """``--counts --precision bf16``: the bf16 step (``gemmEx`` on bf16 copies) keeps the
    training step's targets: no host sync, nothing from the memory pool, nothing a capture
    refuses, one Adam launch; the weights' bf16 copy is one launch a step and every other product
    operand one ``round_bf16_gather``; no fp32 GEMM is left in the step (every operation of the
    step the counts took at the preset's batch, kept as they are taken)."""
    real, taken = C.count_at, {}

    def keep(bc, *args, **kw):
        taken[bc.batch] = real(bc, *args, **kw)
        return taken[bc.batch]
    monkeypatch.setattr(C, "count_at", keep)
    rows = {r["name"]: r for r in C.measure_counts("quick", which=("train_step",), precision="bf16")}
    row = rows["counts_train_step"]
    assert row["precision"] == "bf16" and "launches" not in row["targets"]
    assert (row["syncs"], row["pool_allocations"], row["optimizer_launches"]) == (0, 0, 1), row
    assert rows["counts_capture"]["total"] == 0, rows["counts_capture"]
    assert BENCH_PRESETS["quick"].batch in taken, f"the counts were taken at batches {sorted(taken)}"
    tally = taken[BENCH_PRESETS["quick"].batch]["train_step"][0]
    ops = {name: n for (_, name), n in tally.ops.items()}
    assert ops["round_bf16"] == 1 and ops["round_bf16_gather"] > 0 and ops["cublas gemmEx"] > 0, ops
    assert not any(name.startswith("cublas s") for name in ops), ops


def test_the_later_blocks_step_is_counted_and_capturable():
    """``--counts --block later``: the later block's training step (RMSNorm, rotary positions,
    SwiGLU, grouped-query attention) keeps the step's targets (no host sync, nothing from the
    memory pool, nothing a capture refuses, one Adam launch), and runs its kernels, not the
    NumPy-style operations: one ``rope_rotate`` per rotated head block and no ``tanh``."""
    from attn.bench.presets import BenchConfig, later_block
    bc = BENCH_PRESETS["quick"]
    bc = BenchConfig(**{**bc.__dict__, "model": later_block(bc.model)})
    tally, syncs, _ = C.count_at(bc, ("train_step",))["train_step"]
    assert (syncs, tally.allocations, tally.phases.get("optimizer")) == (0, 0, 1), tally.ops
    assert C.capture_survey(bc, "quick, later block")["total"] == 0
    ops = {name: n for (_, name), n in tally.ops.items()}
    L = bc.model["n_encoder_layers"] + bc.model["n_decoder_layers"]          # self-attentions
    assert ops["rope_rotate"] == 4 * L, ops                                  # q and k, forward and backward
    assert ops["swiglu_fwd"] == ops["swiglu_bwd"] == L and ops["rms_norm_bwd"] > 0, ops
    assert "tanh" not in ops and "einsum" not in ops, ops

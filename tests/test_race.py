"""The race check: the stand-in runs a kernel's blocks in an order drawn at random
(``fakecupy.cupy.race``), as a GPU may, for the kernels whose blocks depend on one another:
``column_sums`` (each tile's last block, by a ticket, sums the partials of the others) and
``adam_flat`` (every block reads the step count; the last, by a ticket, advances it). A
protocol that let a tile's sum run before one of its partials was written would read NaN (the
partials are spoiled first), and one that advanced the count early would change a block's
learning rate: the results must equal those of the blocks in order, bit for bit, in every order.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest


@contextlib.contextmanager
def _racing(seed):
    import fakecupy.cupy as fcp
    fcp.race = None if seed is None else np.random.default_rng(seed)
    try:
        yield
    finally:
        fcp.race = None


@pytest.fixture
def fc():
    import fakecupy
    from conftest import selected_backend
    with selected_backend("fakecupy"):
        yield fakecupy.cupy


def test_column_sums_in_any_block_order_equal_them_in_order(fc):
    from attn.fast.core.dispatch import ops_for
    ops = ops_for(fc)
    rng = np.random.default_rng(0)
    for shape in ((300, 70), (5000, 33), (64, 8)):
        a = fc.asarray(rng.standard_normal(shape).astype(np.float32))
        b = fc.asarray(rng.standard_normal(shape).astype(np.float32))
        want = [ops.colsum(a).get(), ops.colsum_prod(a, b).get()] if hasattr(ops, "colsum_prod") else \
            [ops.colsum(a).get()]
        for seed in range(4):
            with _racing(seed):
                got = [ops.colsum(a).get(), ops.colsum_prod(a, b).get()] if hasattr(ops, "colsum_prod") else \
                    [ops.colsum(a).get()]
            for g, w in zip(got, want):
                assert np.array_equal(g, w), (shape, seed)
        assert not ops._scratch["column_counters"].get().any() if "column_counters" in ops._scratch else True


def test_the_training_step_in_any_block_order_equals_it_in_order(fc):
    """Two models, one trained with every launch's blocks in a random order: the same losses
    and parameters bit for bit, and Adam's count advanced once a step."""
    from attn.model import TransformerConfig
    from test_stepmem import twin_steps_agree
    cfg = TransformerConfig(vocab_size=23, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.1, label_smoothing=0.1, max_len=32, warmup_steps=8)
    opts = twin_steps_agree(cfg, 3, seed=3, second=lambda step: _racing(100 + step))
    assert opts[0].t == opts[1].t == 3


def test_a_sum_taken_before_its_partials_would_read_nan(fc, monkeypatch):
    """The check can fail: a stage two run by a tile's first block instead of its last reads the
    partials the other blocks have not written yet (spoiled with NaN)."""
    from attn.fast.core.dispatch import ops_for
    from attn.fast.gpu.kernels import column_sums as C
    ops = ops_for(fc)
    a = fc.asarray(np.random.default_rng(1).standard_normal((4000, 40)).astype(np.float32))
    real = C._column_sums_in_order

    def first_block_sums(launch, jobs, partial, cnt, tiles, tiles0, R):
        class Early:                     # a tile's first ticket taken for its last, and no other
            def __init__(self, c):
                self.c, self.summed = c, set()

            def __getitem__(self, x):
                if x in self.summed:
                    return -1
                if self.c[x] == 1:
                    self.summed.add(x)
                    return R
                return self.c[x]

            def __setitem__(self, x, v):
                self.c[x] = v
        real(launch, jobs, partial, Early(cnt), tiles, tiles0, R)
        cnt[...] = 0
    monkeypatch.setattr(C, "_column_sums_in_order", first_block_sums)
    with _racing(0):
        assert np.isnan(ops.colsum(a).get()).any()

"""Model FLOPs of a step and the machine's matmul rate at exactly the step's shapes."""
from __future__ import annotations

import math
import time

from .. import backend as B
from ..model import TransformerConfig

def matmul_shapes(cfg: TransformerConfig, Bsz: int, S: int, T: int):
    """The forward's matrix multiplies as ``(batch, m, k, n, count)``: batch 1 for a plain
    2-D matmul, ``B*H`` for the attention's batched ones. Padded shapes; the fused layout
    of :mod:`attn.fast` (QKV as one (D, 3D) matmul, the decoder's cross-attention keys and
    values of all layers as one)."""
    D, F, H, V = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.target_vocab_size
    Dh, Le, Ld = D // H, cfg.n_encoder_layers, cfg.n_decoder_layers
    Ns, Nt, BH = Bsz * S, Bsz * T, Bsz * H
    return [
        (1, Ns, D, 3 * D, Le), (BH, S, Dh, S, Le), (BH, S, S, Dh, Le), (1, Ns, D, D, Le),   # encoder attention
        (1, Ns, D, F, Le), (1, Ns, F, D, Le),                                               # encoder FFN
        (1, Nt, D, 3 * D, Ld), (BH, T, Dh, T, Ld), (BH, T, T, Dh, Ld), (1, Nt, D, D, Ld),   # decoder self-attention
        (1, Ns, D, 2 * D * Ld, 1), (1, Nt, D, D, Ld),                                       # cross: K,V (all layers), Q
        (BH, T, Dh, S, Ld), (BH, T, S, Dh, Ld), (1, Nt, D, D, Ld),                          # cross: attention, output
        (1, Nt, D, F, Ld), (1, Nt, F, D, Ld),                                               # decoder FFN
        (1, Nt, D, V, 1),                                                                   # tied output projection
    ]


def model_flops(cfg: TransformerConfig, Bsz: int, S: int, T: int, training: bool = True) -> int:
    """Matmul FLOPs of a forward pass (``training=False``) or a training step (3x: the
    backward does two matmuls, for the input's and the weight's gradient, per forward one)."""
    fwd = sum(2 * b * m * k * n * c for b, m, k, n, c in matmul_shapes(cfg, Bsz, S, T))
    return 3 * fwd if training else fwd


def measure_matmul_rate(cfg, Bsz, S, T, xp, sync, training=True, repeats=3):
    """GFLOP/s of float32 matmuls of exactly the step's shapes (forward, and for training
    the two backward products of each: ``dA = dC @ B.T`` and ``dB = A.T @ dC``), timed one
    shape at a time, total FLOPs over total time; and of a square 2048^3 matmul."""
    rng = B.DeviceRNG(0)            # drawn where they are used: no host arrays to copy to a GPU

    def arr(*shape):
        return rng.random(shape, dtype="float32")

    total_flops, total_time = 0, 0.0
    for b, m, k, n, c in matmul_shapes(cfg, Bsz, S, T):
        lead = (b,) if b > 1 else ()
        A, Bm, C = arr(*lead, m, k), arr(*lead, k, n), arr(*lead, m, n)
        products = [lambda: A @ Bm]
        if training:
            products += [lambda: C @ Bm.swapaxes(-1, -2), lambda: A.swapaxes(-1, -2) @ C]
        for f in products:
            f()
            sync()
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                f()
                sync()
                best = min(best, time.perf_counter() - t0)
            total_flops += 2 * b * m * k * n * c
            total_time += best * c
    sq = arr(2048, 2048)
    sq @ sq
    sync()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        sq @ sq
        sync()
        best = min(best, time.perf_counter() - t0)
    return total_flops / total_time / 1e9, 2 * 2048 ** 3 / best / 1e9


class _Replay:
    """What :func:`gemm_replay` returns: the replay, whose operands are drawn on the first call."""

    def __init__(self, cfg, Bsz, S, T, sync, training):
        self.args, self.sync, self.training, self.mats = (cfg, Bsz, S, T), sync, training, None

    @property
    def built(self) -> bool:
        return self.mats is not None

    def build(self):
        """Draw the operands (uniform floats: their values do not change a product's time) with
        the selected backend's generator, on its device: on ``base`` they are gigabytes, which
        drawn on the host and copied took a minute per worker."""
        rng = B.DeviceRNG(1)
        self.mats = []
        for b, m, k, n, c in matmul_shapes(*self.args):
            lead = (b,) if b > 1 else ()
            self.mats.append((rng.random((*lead, m, k)), rng.random((*lead, k, n)), rng.random((*lead, m, n)), c))
        return self

    def __call__(self):
        if self.mats is None:
            self.build()
        training = self.training
        for A, Bm, C, c in self.mats:
            for _ in range(c):
                A @ Bm
                if training:
                    C @ Bm.swapaxes(-1, -2)
                    A.swapaxes(-1, -2) @ C
        self.sync()


def gemm_replay(cfg, Bsz, S, T, xp, sync, training=True):
    """A callable that runs every matmul of a step once, at the step's shapes (the forward's,
    and for training the two backward products of each), on the selected backend (NumPy's BLAS
    as it is set, or cuBLAS). Its operands are drawn on the device at its first call, so a
    process that never replays (the PyTorch worker, the counts) never pays for them.

    The benchmark times it interleaved with the step itself, so that the step's fraction of
    the matmul rate compares medians taken under the same conditions (this machine's speed
    drifts by 10 % from minute to minute). Its operands stay hot in cache, which makes the
    replay an optimistic, so the fraction a conservative, figure. ``xp`` is kept for callers;
    the operands come from the selected backend."""
    return _Replay(cfg, Bsz, S, T, sync, training)

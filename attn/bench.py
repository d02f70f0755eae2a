"""The benchmark: ``python -m attn.bench [--json] [--preset NAME] [--backend numpy|cupy|auto] ...``

Times, for one named configuration on one backend:

* ``train_step`` -- forward, label-smoothed loss, backward and Adam, on the fast path
  (:mod:`attn.fast`), and ``train_step_reference`` on the readable one (:mod:`attn.model`);
* ``forward`` / ``forward_reference`` -- logits in evaluation mode (no dropout);
* ``greedy_cached`` / ``greedy_uncached`` / ``beam4_cached`` / ``beam4_uncached`` -- decoding
  a batch for a fixed number of tokens (EOS is banned so every sentence runs to the end)
  with and without the key/value cache (:mod:`attn.decode`).

Each figure is the median of several timed runs after warm-up. Where PyTorch is installed
the same architecture, written below in :func:`torch_transformer` (post-norm, tied
embeddings scaled by sqrt(d_model), label-smoothed cross-entropy ignoring padding, Adam
with betas (0.9, 0.98) and eps 1e-9), runs the same work in the same process, interleaved
run by run with ours, with ``torch.set_num_threads`` equal to NumPy's BLAS threads; the
ratio is ours / PyTorch (below 1: we are faster).

Model FLOPs count the matrix multiplies (2*m*n*k each) at the padded shapes; a training
step is three times the forward's. The machine's matmul rate is measured in the same run by
timing float32 matmuls of exactly the step's shapes with NumPy's BLAS: a replay of all of the
step's products (forward and backward), timed in the same rotation as the step itself, so
``fraction_of_matmul_rate`` (replay median / step median) says how close the step comes to
doing nothing but its matmuls. For reference there are also each shape's best of three
(``fraction_of_best_matmul_rate``) and a square 2048^3 matmul.

Peak memory is the growth of the resident set during one step over the resident set
just before it (parameters, optimizer state and the batch already allocated), measured
for both frameworks in the same way in a child process: glibc is told to return freed
blocks of 64 kB and more to the system (``MALLOC_MMAP_THRESHOLD_``), the kernel's
high-water mark is reset (``/proc/self/clear_refs``), one step runs, ``VmHWM`` is read.
On CuPy / CUDA it is the peak of the memory pool's bytes in use (PyTorch: its allocator's
``max_memory_allocated``). For NumPy the child also reports ``tracemalloc``'s peak
(NumPy reports its allocations to it) as a cross-check.

The JSON output (``--json``) is one object per line: first ``machine``, then ``matmul``,
then one per measurement with at least ``name``, ``seconds_per_step``,
``tokens_per_second``, ``peak_memory_mb`` and, with PyTorch, ``torch_seconds_per_step``
and ``ratio``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from . import backend as B
from .fast import FastAdam, FastTransformer, keep_freed_memory
from .fast import cross_entropy as fast_cross_entropy
from .loss import cross_entropy
from .masks import PAD_ID
from .model import PRESETS, Transformer, TransformerConfig, log_softmax
from .optim import Adam, noam_lr

# --------------------------------------------------------------------------- configurations

BOS_ID, EOS_ID = 1, 2     # attn.data's ids (PAD 0, BOS 1, EOS 2); checked against it when decoding


@dataclass(frozen=True)
class BenchConfig:
    """A model configuration and the shapes it is timed at."""
    model: dict
    batch: int
    src_len: int
    tgt_len: int
    decode_batch: int
    decode_steps: int
    beam: int = 4
    repeats: int = 5
    warmup: int = 2
    note: str = ""


BENCH_PRESETS = {
    # The issue's CPU target: the step that must beat PyTorch on two cores.
    "toy-bench": BenchConfig(
        dict(vocab_size=1000, d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3,
             dropout=0.1, label_smoothing=0.1, max_len=256),
        batch=64, src_len=32, tgt_len=32, decode_batch=64, decode_steps=50, repeats=9, warmup=3,
        note="batch 64, source and target length 32, V 1000, D 256, 4 heads, F 1024, 3+3 layers"),
    # For tests: seconds in total.
    "quick": BenchConfig(
        dict(vocab_size=50, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1, n_decoder_layers=1,
             dropout=0.1, label_smoothing=0.1, max_len=64),
        batch=4, src_len=8, tgt_len=8, decode_batch=3, decode_steps=5, repeats=2, warmup=1,
        note="tiny: for tests"),
    # The model presets of attn.model at a usual batch.
    "toy": BenchConfig({**PRESETS["toy"], "vocab_size": 1000}, batch=64, src_len=32, tgt_len=32,
                       decode_batch=64, decode_steps=50),
    "small": BenchConfig({**PRESETS["small"], "vocab_size": 8000}, batch=64, src_len=32, tgt_len=32,
                         decode_batch=64, decode_steps=50),
    # The paper's base model at about 25,000 source and 25,000 target tokens: the GPU mode.
    "base": BenchConfig({**PRESETS["base"], "vocab_size": 37000}, batch=400, src_len=64, tgt_len=64,
                        decode_batch=128, decode_steps=50, repeats=5, warmup=2,
                        note="paper base, ~25.6k+25.6k tokens per batch (GPU)"),
}

MEASUREMENTS = ("train_step", "train_step_reference", "forward", "forward_reference",
                "greedy_cached", "greedy_uncached", "beam_cached", "beam_uncached")


def model_config(bc: BenchConfig) -> TransformerConfig:
    return TransformerConfig(**bc.model)


def make_batch(bc: BenchConfig, seed: int = 0):
    """A padded batch on the host as teacher forcing makes it from ``[BOS, y.., EOS, PAD..]``
    (B, T+1): src (B, S), tgt_in its first T columns, tgt_out its last T. Each sentence's real
    length is drawn uniformly in [3/4 L, L]."""
    np = B.host
    rng = np.random.default_rng(seed)
    V = model_config(bc).vocab_size
    src = rng.integers(4, V, (bc.batch, bc.src_len))
    tgt = rng.integers(4, V, (bc.batch, bc.tgt_len + 1))
    tgt[:, 0] = BOS_ID
    for i in range(bc.batch):
        ls = rng.integers(max(1, (3 * bc.src_len) // 4), bc.src_len + 1)
        lt = rng.integers(max(1, (3 * bc.tgt_len) // 4), bc.tgt_len + 1)
        src[i, ls:] = PAD_ID
        tgt[i, lt] = EOS_ID
        tgt[i, lt + 1:] = PAD_ID
    return src, tgt[:, :-1].copy(), tgt[:, 1:].copy()


def decode_batch(bc: BenchConfig, seed: int = 1):
    src, _, _ = make_batch(BenchConfig(bc.model, bc.decode_batch, bc.src_len, bc.tgt_len, 0, 0), seed)
    return src


# --------------------------------------------------------------------------- FLOPs


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
    rng = B.host_rng(0)

    def arr(*shape):
        return xp.asarray(rng.standard_normal(shape, dtype="float32"))

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


def gemm_replay(cfg, Bsz, S, T, xp, sync, training=True):
    """A callable that runs every matmul of a step once, at the step's shapes (the forward's,
    and for training the two backward products of each), with NumPy's BLAS as it is set.

    The benchmark times it interleaved with the step itself, so that the step's fraction of
    the matmul rate compares medians taken under the same conditions (this machine's speed
    drifts by 10 % from minute to minute). Its operands stay hot in cache, which makes the
    replay an optimistic, so the fraction a conservative, figure."""
    rng = B.host_rng(1)

    def arr(*shape):
        return xp.asarray(rng.standard_normal(shape, dtype="float32"))

    mats = []
    for b, m, k, n, c in matmul_shapes(cfg, Bsz, S, T):
        lead = (b,) if b > 1 else ()
        mats.append((arr(*lead, m, k), arr(*lead, k, n), arr(*lead, m, n), c))

    def run():
        for A, Bm, C, c in mats:
            for _ in range(c):
                A @ Bm
                if training:
                    C @ Bm.swapaxes(-1, -2)
                    A.swapaxes(-1, -2) @ C
        sync()
    return run


# --------------------------------------------------------------------------- threads and machine


def blas_threads(set_to: int | None = None) -> int | None:
    """NumPy's BLAS threads (OpenBLAS), optionally setting them first. None if unknown."""
    return B.blas_threads(set_to)


def machine_info() -> dict:
    info = {"name": "machine", "platform": platform.platform(), "python": platform.python_version(),
            "numpy": B.host.__version__, "cpu_count": os.cpu_count()}
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        m = re.search(r"model name\s*:\s*(.*)", open("/proc/cpuinfo").read())
        info["cpu_model"] = m.group(1).strip() if m else platform.processor()
    except OSError:
        info["cpu_model"] = platform.processor()
    try:
        cfgs = B.host.show_config(mode="dicts")
        blas = cfgs["Build Dependencies"]["blas"]
        info["blas"] = f"{blas.get('name')} {blas.get('version')}"
    except Exception:
        pass
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


# --------------------------------------------------------------------------- the PyTorch model


def torch_available() -> bool:
    try:
        import torch  # noqa: F401  (optional reference; attn itself never needs it)
        return True
    except Exception:
        return False


def torch_transformer(cfg: TransformerConfig, device: str = "cpu", dtype: str = "float32"):
    """The same architecture in PyTorch, for timing and for checking (``tests/test_bench.py``
    loads attn's parameters into it and compares losses and gradients).

    Written as a PyTorch user would write it efficiently: QKV as one linear layer (as
    ``nn.MultiheadAttention`` does), ``F.scaled_dot_product_attention``, ``nn.LayerNorm``,
    weight tying by sharing the embedding matrix with the output projection. Supports what
    the benchmark presets use: shared embeddings, sinusoidal positions, post- or pre-norm.
    Only called where ``torch`` imports.
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if not cfg.share_embeddings or cfg.positional != "sinusoidal":
        raise ValueError("torch_transformer: only shared embeddings and sinusoidal positions")
    D, H, Fd, V = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.vocab_size
    Dh = D // H
    tdtype = getattr(torch, dtype)

    def attend(q, k, v, mask, p, training):
        """q (B, H, Tq, Dh), k/v (B, H, Tk, Dh), mask bool broadcastable, True = may attend."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p if training else 0.0)

    def heads(x, n):
        Bsz, T, _ = x.shape
        return x.view(Bsz, T, n, H, Dh).permute(2, 0, 3, 1, 4)          # (n, B, H, T, Dh)

    def merge(o):
        Bsz, _, T, _ = o.shape
        return o.transpose(1, 2).reshape(Bsz, T, D)

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

        def forward(self, x, mask, cache=None):
            q, k, v = heads(self.qkv(x), 3)
            if cache is not None:                 # incremental decoding: append this position
                if cache[0] is not None:
                    k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
                cache[0], cache[1] = k, v
            return self.out(merge(attend(q, k, v, mask, cfg.attention_dropout, self.training)))

    class CrossAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv, self.out = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)

        def keys_values(self, memory):
            k, v = heads(self.kv(memory), 2)
            return k, v

        def forward(self, x, kv, mask):
            (q,) = heads(self.q(x), 1)
            return self.out(merge(attend(q, kv[0], kv[1], mask, cfg.attention_dropout, self.training)))

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Linear(D, Fd), nn.Linear(Fd, D)
            self.drop = nn.Dropout(cfg.relu_dropout)

        def forward(self, x):
            return self.w2(self.drop(F.relu(self.w1(x))))

    class Sub(nn.Module):
        """A sub-layer in its residual connection (post-norm: LN(x + drop(f(x))))."""

        def __init__(self, f):
            super().__init__()
            self.f, self.norm, self.drop = f, nn.LayerNorm(D, eps=cfg.ln_eps), nn.Dropout(cfg.dropout)

        def forward(self, x, *args, **kw):
            if cfg.norm == "pre":
                return x + self.drop(self.f(self.norm(x), *args, **kw))
            return self.norm(x + self.drop(self.f(x, *args, **kw)))

    class EncoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.ffn = Sub(SelfAttention()), Sub(FFN())

        def forward(self, x, mask):
            return self.ffn(self.self_attn(x, mask))

    class DecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.cross_attn, self.ffn = Sub(SelfAttention()), Sub(CrossAttention()), Sub(FFN())

        def forward(self, x, kv, self_mask, src_mask, cache=None):
            x = self.self_attn(x, self_mask, cache)
            return self.ffn(self.cross_attn(x, kv, src_mask))

    class TorchTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(V, D)
            nn.init.normal_(self.embedding.weight, std=D ** -0.5)
            self.encoder = nn.ModuleList(EncoderLayer() for _ in range(cfg.n_encoder_layers))
            self.decoder = nn.ModuleList(DecoderLayer() for _ in range(cfg.n_decoder_layers))
            if cfg.norm == "pre":
                self.enc_norm = nn.LayerNorm(D, eps=cfg.ln_eps)
                self.dec_norm = nn.LayerNorm(D, eps=cfg.ln_eps)
            self.drop = nn.Dropout(cfg.dropout)
            pos = torch.arange(cfg.max_len, dtype=torch.float64)[:, None]
            div = torch.pow(10000.0, torch.arange(0, D, 2, dtype=torch.float64) / D)
            pe = torch.zeros(cfg.max_len, D, dtype=torch.float64)
            pe[:, 0::2] = torch.sin(pos / div)
            pe[:, 1::2] = torch.cos(pos / div)[:, : D // 2]
            self.register_buffer("pe", pe.to(tdtype), persistent=False)

        def embed(self, ids, offset=0):
            x = self.embedding(ids) * math.sqrt(D)
            return self.drop(x + self.pe[offset:offset + ids.shape[1]])

        def encode(self, src):
            src_mask = (src != PAD_ID)[:, None, None, :]                    # (B, 1, 1, S)
            x = self.embed(src)
            for layer in self.encoder:
                x = layer(x, src_mask)
            if cfg.norm == "pre":
                x = self.enc_norm(x)
            return x, src_mask

        def cross_kv(self, memory):
            return [layer.cross_attn.f.keys_values(memory) for layer in self.decoder]

        def decode(self, tgt_in, memory, src_mask, kv=None):
            T = tgt_in.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=tgt_in.device).tril()
            tgt_mask = causal & (tgt_in != PAD_ID)[:, None, None, :]           # (B, 1, T, T)
            kv = self.cross_kv(memory) if kv is None else kv
            y = self.embed(tgt_in)
            for layer, kv_i in zip(self.decoder, kv):
                y = layer(y, kv_i, tgt_mask, src_mask)
            if cfg.norm == "pre":
                y = self.dec_norm(y)
            return y

        def project(self, h):
            return F.linear(h, self.embedding.weight)

        def forward(self, src, tgt_in):
            memory, src_mask = self.encode(src)
            return self.project(self.decode(tgt_in, memory, src_mask))

        def decode_step(self, tokens, state):
            """One position for every row with cached keys/values. state: dict with kv, src_mask,
            self (per layer [k, v]), pos. Returns log-probabilities (B, V)."""
            pos = state["pos"]
            y = self.embed(tokens[:, None], offset=pos)
            for layer, kv_i, c in zip(self.decoder, state["kv"], state["self"]):
                y = layer(y, kv_i, None, state["src_mask"], cache=c)
            if cfg.norm == "pre":
                y = self.dec_norm(y)
            state["pos"] = pos + 1
            return torch.log_softmax(self.project(y[:, 0]), dim=-1)

        def load_attn_params(self, params):
            """Copy attn's parameters (host arrays, attn's names) into this model."""
            def t(a):
                return torch.as_tensor(B.host.ascontiguousarray(B.to_host(a)), dtype=tdtype)
            with torch.no_grad():
                self.embedding.weight.copy_(t(params["embedding.weight"]))
                for stack, layers in (("encoder", self.encoder), ("decoder", self.decoder)):
                    for i, layer in enumerate(layers):
                        pre = f"{stack}.{i}"
                        sa = layer.self_attn.f
                        sa.qkv.weight.copy_(t(B.host.concatenate(
                            [B.to_host(params[f"{pre}.self_attn.w_{n}"]) for n in "qkv"], axis=1)).T)
                        sa.qkv.bias.copy_(t(B.host.concatenate(
                            [B.to_host(params[f"{pre}.self_attn.b_{n}"]) for n in "qkv"])))
                        sa.out.weight.copy_(t(params[f"{pre}.self_attn.w_o"]).T)
                        sa.out.bias.copy_(t(params[f"{pre}.self_attn.b_o"]))
                        subs = [("norm1", layer.self_attn)]
                        if stack == "decoder":
                            ca = layer.cross_attn.f
                            ca.q.weight.copy_(t(params[f"{pre}.cross_attn.w_q"]).T)
                            ca.q.bias.copy_(t(params[f"{pre}.cross_attn.b_q"]))
                            ca.kv.weight.copy_(t(B.host.concatenate(
                                [B.to_host(params[f"{pre}.cross_attn.w_{n}"]) for n in "kv"], axis=1)).T)
                            ca.kv.bias.copy_(t(B.host.concatenate(
                                [B.to_host(params[f"{pre}.cross_attn.b_{n}"]) for n in "kv"])))
                            ca.out.weight.copy_(t(params[f"{pre}.cross_attn.w_o"]).T)
                            ca.out.bias.copy_(t(params[f"{pre}.cross_attn.b_o"]))
                            subs += [("norm2", layer.cross_attn), ("norm3", layer.ffn)]
                        else:
                            subs += [("norm2", layer.ffn)]
                        ff = layer.ffn.f
                        ff.w1.weight.copy_(t(params[f"{pre}.ffn.w1"]).T)
                        ff.w1.bias.copy_(t(params[f"{pre}.ffn.b1"]))
                        ff.w2.weight.copy_(t(params[f"{pre}.ffn.w2"]).T)
                        ff.w2.bias.copy_(t(params[f"{pre}.ffn.b2"]))
                        for norm, sub in subs:
                            sub.norm.weight.copy_(t(params[f"{pre}.{norm}.gamma"]))
                            sub.norm.bias.copy_(t(params[f"{pre}.{norm}.beta"]))
                if cfg.norm == "pre":
                    for stack, norm in (("encoder", self.enc_norm), ("decoder", self.dec_norm)):
                        norm.weight.copy_(t(params[f"{stack}.norm.gamma"]))
                        norm.bias.copy_(t(params[f"{stack}.norm.beta"]))

    return TorchTransformer().to(device=device, dtype=tdtype)


def torch_loss(logits, tgt_out, smoothing):
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1),
                           ignore_index=PAD_ID, label_smoothing=smoothing)


def torch_adam(model, fused: bool | None = None):
    """Adam with the paper's betas and eps; ``fused`` where this PyTorch has it."""
    import torch
    kw = dict(lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    if fused is not False:
        try:
            return torch.optim.Adam(model.parameters(), fused=True, **kw), "fused"
        except (RuntimeError, TypeError, ValueError):
            if fused:
                raise
    return torch.optim.Adam(model.parameters(), **kw), "default"


def _torch_decode(model, src, steps, beam, use_cache):
    """Fixed-length greedy (beam 1) or beam search in PyTorch, EOS/PAD/BOS banned, mirroring
    what attn.decode does when no sentence ends early. Returns the (B*beam, steps) tokens,
    each sentence's beams best first."""
    import torch
    with torch.no_grad():
        Bsz = src.shape[0]
        memory, src_mask = model.encode(src)
        K = beam
        if K > 1:
            memory = memory.repeat_interleave(K, 0)
            src_mask = src_mask.repeat_interleave(K, 0)
            scores = torch.full((Bsz, K), -float("inf"), dtype=torch.float64, device=src.device)
            scores[:, 0] = 0
        n = Bsz * K
        tokens = torch.full((n,), BOS_ID, dtype=torch.long, device=src.device)
        kv = model.cross_kv(memory)
        state = {"kv": kv, "src_mask": src_mask, "self": [[None, None] for _ in kv], "pos": 0}
        prefix = tokens[:, None]
        for _ in range(steps):
            if use_cache:
                logp = model.decode_step(tokens, state)
            else:
                h = model.decode(prefix, memory, src_mask, kv)
                logp = torch.log_softmax(model.project(h[:, -1]), dim=-1)
            logp[:, [PAD_ID, BOS_ID, EOS_ID]] = -float("inf")
            if K == 1:
                tokens = logp.argmax(dim=-1)
            else:
                V = logp.shape[-1]
                cand = (scores[:, :, None] + logp.view(Bsz, K, V).double()).view(Bsz, K * V)
                scores, top_i = cand.topk(K, dim=1)
                idx = (torch.arange(Bsz, device=src.device)[:, None] * K + top_i // V).view(-1)
                tokens = (top_i % V).view(-1)
                prefix = prefix.index_select(0, idx)
                if use_cache:
                    for c in state["self"]:
                        c[0], c[1] = c[0].index_select(0, idx), c[1].index_select(0, idx)
            prefix = torch.cat([prefix, tokens[:, None]], dim=1)
        return prefix[:, 1:]


# --------------------------------------------------------------------------- our side


def _no_eos(model: Transformer) -> Transformer:
    """The same model (shared parameters) whose projection never lets EOS win, so that a
    decoding benchmark generates exactly the asked-for number of tokens."""
    base = type(model)

    class NoEOS(base):
        def project(self, h):
            out = super().project(h)
            out[..., EOS_ID] = self.xp.finfo(out.dtype).min
            return out

    return NoEOS(model.config, dtype=model.dtype, params=model.params)


@dataclass
class Work:
    """One measurement: our callable, PyTorch's (or None), and how to count it."""
    name: str
    ours: object
    torch: object = None
    tokens: int = 0
    flops: int = 0
    repeats: int = 5
    warmup: int = 2
    extra: dict = field(default_factory=dict)
    replay: object = None           # the step's matmuls alone, timed in the same rotation


def build_work(bc: BenchConfig, which, backend: str, with_torch: bool, sync, torch_sync=None,
               device="cpu", repeats=None, warmup=None):
    """The measurements as :class:`Work` items (model, optimizer and batch built once)."""
    cfg = model_config(bc)
    xp = B.xp()
    src_h, tgt_in_h, tgt_out_h = make_batch(bc)
    src, tgt_in, tgt_out = (B.to_device(a) for a in (src_h, tgt_in_h, tgt_out_h))
    n_tokens = int((src_h != PAD_ID).sum() + (tgt_out_h != PAD_ID).sum())
    flops_train = model_flops(cfg, bc.batch, bc.src_len, bc.tgt_len, True)
    flops_fwd = model_flops(cfg, bc.batch, bc.src_len, bc.tgt_len, False)
    R = repeats or bc.repeats
    W = bc.warmup if warmup is None else warmup

    ref = Transformer(cfg, seed=0)
    fast = FastTransformer.from_model(Transformer(cfg, seed=0))
    on_gpu = backend == "cupy"
    if on_gpu:
        # The batch is checked once here; inside the timed step nothing waits for the device.
        from .layers._checks import check_ids
        for a in (src, tgt_in, tgt_out):
            check_ids("bench", "batch", a, cfg.vocab_size)
        fast.validate_ids = False
    tmodel = topt = None
    if with_torch:
        import torch
        tmodel = torch_transformer(cfg, device)
        topt, adam_kind = torch_adam(tmodel)
        t_src, t_in, t_out = (torch.as_tensor(a, device=device) for a in (src_h, tgt_in_h, tgt_out_h))
    state = {"fast_opt": FastAdam(fast.params, cfg.d_model, cfg.warmup_steps),
             "ref_opt": Adam(ref.params, cfg.d_model, cfg.warmup_steps),
             "fast_rng": B.DeviceRNG(1), "ref_rng": B.DeviceRNG(1)}
    eps = cfg.label_smoothing

    def fast_step():
        logits, cache = fast.forward(src, tgt_in, state["fast_rng"])
        loss, d = fast_cross_entropy(logits, tgt_out, eps, check_finite=False, inplace=True,
                                     validate=not on_gpu)
        state["fast_opt"].step(fast.backward(d, cache))
        sync()
        return loss

    def ref_step():
        logits, cache = ref.forward(src, tgt_in, state["ref_rng"])
        loss, d = cross_entropy(logits, tgt_out, eps, check_finite=False)
        state["ref_opt"].step(ref.backward(d, cache))
        sync()
        return loss

    def torch_step():
        tmodel.train()
        loss = torch_loss(tmodel(t_src, t_in), t_out, eps)
        topt.zero_grad(set_to_none=True)
        loss.backward()
        for g in topt.param_groups:
            g["lr"] = noam_lr(state.setdefault("torch_t", 1), cfg.d_model, cfg.warmup_steps)
        state["torch_t"] += 1
        topt.step()
        torch_sync()
        return loss

    def fwd(model):
        def f():
            out = model.forward(src, tgt_in, None)[0]
            sync()
            return out
        return f

    def torch_fwd():
        import torch
        tmodel.eval()
        with torch.no_grad():
            out = tmodel(t_src, t_in)
        torch_sync()
        return out

    work = []
    extra_train = {"torch_adam": adam_kind} if with_torch else {}
    replay_train = gemm_replay(cfg, bc.batch, bc.src_len, bc.tgt_len, xp, sync, True)
    replay_fwd = gemm_replay(cfg, bc.batch, bc.src_len, bc.tgt_len, xp, sync, False)
    if "train_step" in which:
        work.append(Work("train_step", fast_step, torch_step if with_torch else None, n_tokens, flops_train,
                         R, W, dict(extra_train), replay_train))
    if "train_step_reference" in which:
        work.append(Work("train_step_reference", ref_step, torch_step if with_torch else None, n_tokens,
                         flops_train, max(2, R // 2), max(1, W // 2), dict(extra_train)))
    def fast_logits():
        out = fast.logits(src, tgt_in)
        sync()
        return out

    if "forward" in which:
        work.append(Work("forward", fast_logits, torch_fwd if with_torch else None, n_tokens, flops_fwd, R, W,
                         replay=replay_fwd))
    if "forward_reference" in which:
        work.append(Work("forward_reference", fwd(ref), torch_fwd if with_torch else None, n_tokens, flops_fwd,
                         max(2, R // 2), max(1, W // 2)))

    dec_names = [w for w in which if w.startswith(("greedy", "beam"))]
    if dec_names:
        from . import decode as D
        from .data import BOS, EOS, PAD
        if (PAD, BOS, EOS) != (PAD_ID, BOS_ID, EOS_ID):
            raise RuntimeError(f"attn.data's PAD/BOS/EOS {(PAD, BOS, EOS)} differ from the bench's")
        dmodel = _no_eos(fast)
        dsrc_h = decode_batch(bc)
        dsrc = B.to_device(dsrc_h)
        steps = bc.decode_steps
        gen_tokens = bc.decode_batch * steps
        if with_torch:
            td_src = torch.as_tensor(dsrc_h, device=device)
        for name in dec_names:
            cached = name.endswith("_cached")
            K = bc.beam if name.startswith("beam") else 1

            def ours(cached=cached, K=K):
                if K == 1:
                    r = D.greedy_decode(dmodel, dsrc, max_len=steps, use_cache=cached)
                else:
                    r = D.beam_search(dmodel, dsrc, beam_size=K, max_len=steps, use_cache=cached)
                sync()
                return r

            def theirs(cached=cached, K=K):
                tmodel.eval()
                r = _torch_decode(tmodel, td_src, steps, K, cached)
                torch_sync()
                return r
            # Recomputing the prefix costs tens of seconds per run at toy-bench size: no warm-up
            # (the cached runs before it did the first-call work), two runs for greedy, one for beam.
            reps, warm = (R, 1) if cached else ((repeats or (2 if K == 1 else 1)), 0)
            work.append(Work(name, ours, theirs if with_torch else None, gen_tokens, 0, reps, warm,
                             {"beam": K, "decode_steps": steps, "decode_batch": bc.decode_batch}))
    return work


# --------------------------------------------------------------------------- timing


def _progress(msg: str, quiet: bool):
    if not quiet:
        print(f"[attn.bench] {msg}", file=sys.stderr, flush=True)


def time_work(w: Work, settle: float, quiet: bool) -> dict:
    """Warm up both sides, then alternate timed runs (ours, PyTorch, ours, ...); medians."""
    fns = [("ours", w.ours)] + ([("torch", w.torch)] if w.torch is not None else [])
    fns += [("matmul", w.replay)] if w.replay is not None else []
    for _ in range(w.warmup):
        for _, f in fns:
            f()
    times = {k: [] for k, _ in fns}
    for r in range(w.repeats):
        for k, f in fns:
            if settle:
                time.sleep(settle)            # let the other library's idle threads stop spinning
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
        last = ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items())
        _progress(f"{w.name}: run {r + 1}/{w.repeats}: {last}", quiet)
    return times


# --------------------------------------------------------------------------- memory (child processes)


def _rss_kb(field_name: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field_name} in /proc/self/status")


class _PeakMeter:
    """Peak memory growth of a callable on the current backend (see the module docstring)."""

    def __init__(self, backend: str, framework: str):
        self.backend, self.framework = backend, framework

    def __call__(self, f) -> dict:
        out = {}
        if self.backend == "cupy":
            if self.framework == "torch":
                import torch
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                f()
                torch.cuda.synchronize()
                out["peak_memory_mb"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            else:
                cp = B.xp()
                hook = _cupy_peak_hook(cp)
                cp.cuda.Device().synchronize()
                with hook:
                    f()
                    cp.cuda.Device().synchronize()
                out["peak_memory_mb"] = hook.peak / 2 ** 20
            return out
        import tracemalloc
        traced = self.framework == "attn"
        if traced and not tracemalloc.is_tracing():
            tracemalloc.start()
            f()                       # a call under tracing first: tracing's own first-call allocations
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            base = _rss_kb("VmRSS")
            if traced:
                tracemalloc.reset_peak()
                t0 = tracemalloc.get_traced_memory()[0]
            f()
            out["peak_memory_mb"] = (_rss_kb("VmHWM") - base) / 1024
        except OSError:
            out["peak_memory_mb"] = None
            if traced:
                tracemalloc.reset_peak()
                t0 = tracemalloc.get_traced_memory()[0]
                f()
        if traced:
            out["tracemalloc_peak_mb"] = (tracemalloc.get_traced_memory()[1] - t0) / 2 ** 20
        return out


def _cupy_peak_hook(cp):
    """A CuPy memory hook recording the peak of bytes handed out by the pool during its ``with``."""
    class Peak(cp.cuda.MemoryHook):
        name = "attn-bench-peak"

        def __init__(self):
            super().__init__()
            self.used = self.peak = 0

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            self.used += mem_size
            self.peak = max(self.peak, self.used)

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            self.used -= mem_size
    return Peak()


def _memory_child(args) -> None:
    """``--_memory-child attn|torch``: measure every requested measurement's peak, print JSON."""
    bc = _bench_config(args)
    framework = args._memory_child
    with_torch = framework == "torch"
    sync, tsync, device = _syncs(args.backend, with_torch)
    work = build_work(bc, args.only, args.backend, with_torch, sync, tsync, device)
    meter = _PeakMeter(args.backend, framework)
    result = {}
    for w in work:
        if w.name.endswith("_reference") and with_torch:
            continue
        if w.name.endswith("_uncached") and not args.memory_all:
            continue
        f = w.torch if with_torch else w.ours
        if f is None:
            continue
        if not w.name.startswith(("greedy", "beam")):
            f()
            f()                           # warm-up: optimizer state and first-call allocations exist
        result[w.name] = meter(f)
    print(json.dumps(result))


def measure_memory(args, framework: str, quiet: bool) -> dict:
    """Run a child process for one framework; {measurement: {peak_memory_mb, ...}} or {}."""
    cmd = [sys.executable, "-m", "attn.bench", "--_memory-child", framework, "--preset", args.preset,
           "--backend", args.backend, "--only", ",".join(args.only)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.memory_all:
        cmd += ["--memory-all"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    _progress(f"peak memory ({framework}) in a child process", quiet)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    except subprocess.TimeoutExpired:
        return {}
    if r.returncode != 0:
        _progress(f"memory child for {framework} failed:\n{r.stderr[-2000:]}", quiet)
        return {}
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the command


def _syncs(backend: str, with_torch: bool):
    """Device synchronisation for timing (no-ops on the CPU) and PyTorch's device."""
    if backend == "cupy":
        cp = B.xp()

        def sync():
            cp.cuda.Device().synchronize()
        device = "cuda"
    else:
        def sync():
            pass
        device = "cpu"
    tsync = sync
    if with_torch and device == "cuda":
        import torch

        def tsync():
            torch.cuda.synchronize()
    return sync, tsync, device


def _bench_config(args) -> BenchConfig:
    bc = BENCH_PRESETS[args.preset]
    changes = {}
    for k in ("batch", "src_len", "tgt_len", "decode_batch", "decode_steps", "beam"):
        v = getattr(args, k, None)
        if v is not None:
            changes[k] = v
    if changes:
        bc = BenchConfig(**{**bc.__dict__, **changes})
    return bc


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m attn.bench",
        description="Time attn's training step (forward, backward, Adam), forward pass and decoding "
                    "(greedy and beam search, with and without the key/value cache) on a named "
                    "configuration; where PyTorch is installed, time the same model in PyTorch in the "
                    "same run and print ours/PyTorch. Reports seconds (median of several runs after "
                    "warm-up), tokens per second, peak memory growth of one step, model FLOPs, the "
                    "achieved FLOP rate and its fraction of this machine's float32 matmul rate "
                    "measured in the same run. Progress goes to stderr.",
        epilog="presets: " + "; ".join(f"{k}: {v.note or 'model preset ' + k}" for k, v in BENCH_PRESETS.items())
               + ". Example: python -m attn.bench --preset toy-bench --threads 2")
    p.add_argument("--preset", default="toy-bench", choices=sorted(BENCH_PRESETS),
                   help="named configuration (default toy-bench)")
    p.add_argument("--backend", default="numpy", choices=["numpy", "cupy", "auto"],
                   help="array backend (auto: CuPy where a GPU is usable); PyTorch runs on the matching device")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement on stdout")
    p.add_argument("--markdown", action="store_true", help="the results as Markdown (for benchmarks/RESULTS.md)")
    p.add_argument("--quick", action="store_true",
                   help="the tiny 'quick' configuration, 1 warm-up and 2 repeats (for tests)")
    p.add_argument("--only", default=",".join(MEASUREMENTS),
                   help="comma-separated measurements (default all): " + ", ".join(MEASUREMENTS))
    p.add_argument("--repeats", type=int, help="timed runs per measurement (default per preset)")
    p.add_argument("--warmup", type=int, help="untimed runs before timing (default per preset)")
    p.add_argument("--threads", type=int,
                   help="BLAS threads for NumPy (OpenBLAS) and torch.set_num_threads (default: NumPy's current)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--return-freed-memory", action="store_true",
                   help="leave glibc's malloc as it is (by default the timing process keeps freed blocks "
                        "for reuse, see attn.fast.keep_freed_memory; it applies to PyTorch alike)")
    p.add_argument("--memory-all", action="store_true",
                   help="also measure the peak memory of the uncached decodes (slow)")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds to sleep before each timed run (default 0.1 with PyTorch, else 0)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    for k, h in (("batch", "sentences per training batch"), ("src_len", "source length"),
                 ("tgt_len", "target length"), ("decode_batch", "sentences decoded at once"),
                 ("decode_steps", "tokens generated per sentence"), ("beam", "beam size")):
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=int, help=h + " (default per preset)")
    p.add_argument("--_memory-child", dest="_memory_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.preset = "quick"
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.only if s not in MEASUREMENTS]
    if unknown:
        p.error(f"unknown measurement(s) {unknown}; choose from {', '.join(MEASUREMENTS)}")
    return args


def run(args) -> list[dict]:
    """Run the benchmark; returns the list of result dicts (also printed)."""
    quiet = args.quiet
    B.set_backend(args.backend)
    args.backend = B.get_backend()
    threads = blas_threads(args.threads) if args.backend == "numpy" else None
    with_torch = not args.no_torch and torch_available()
    if with_torch:
        import torch
        if args.backend == "numpy":
            torch.set_num_threads(threads or args.threads or os.cpu_count() or 1)
    bc = _bench_config(args)
    cfg = model_config(bc)
    sync, tsync, device = _syncs(args.backend, with_torch)
    # glibc keeps freed blocks for reuse (both frameworks share this process's malloc); the
    # memory children below run without it so that their resident set falls with frees.
    kept = keep_freed_memory() if not args.return_freed_memory else False
    settle = args.settle if args.settle is not None else (0.1 if with_torch else 0.0)

    info = machine_info()
    info["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info.update(backend=args.backend, preset=args.preset, blas_threads=threads, malloc_keeps_freed_memory=kept,
                config=cfg.to_dict(), batch=bc.batch, src_len=bc.src_len, tgt_len=bc.tgt_len,
                command="python -m attn.bench " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("bench.py")
                else None)
    if with_torch:
        import torch
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    if args.backend == "cupy":
        cp = B.xp()
        info.update(cupy=cp.__version__, gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    results = [info]

    _progress(f"preset {args.preset} on {args.backend} (threads {threads}); measuring the matmul rate", quiet)
    rate, peak = measure_matmul_rate(cfg, bc.batch, bc.src_len, bc.tgt_len, B.xp(), sync)
    results.append({"name": "matmul", "gflops_per_second": rate, "square_2048_gflops_per_second": peak,
                    "shapes": "the training step's (forward and backward), float32",
                    "seconds_per_step": None, "tokens_per_second": None, "peak_memory_mb": None})

    work = build_work(bc, args.only, args.backend, with_torch, sync, tsync, device,
                      repeats=args.repeats, warmup=args.warmup)
    for i, w in enumerate(work):
        _progress(f"[{i + 1}/{len(work)}] {w.name}", quiet)
        times = time_work(w, settle, quiet)
        ours = statistics.median(times["ours"])
        r = {"name": w.name, "seconds_per_step": ours, "tokens_per_second": w.tokens / ours,
             "peak_memory_mb": None, "times": times["ours"], "repeats": w.repeats}
        if w.flops:
            if args.backend == "cupy":
                r["tflops_per_second"] = w.flops / ours / 1e12
            r.update(flops_per_step=w.flops, gflops_per_second=w.flops / ours / 1e9,
                     fraction_of_best_matmul_rate=w.flops / ours / 1e9 / rate,
                     fraction_of_square_matmul_rate=w.flops / ours / 1e9 / peak)
            if "matmul" in times:
                mm_t = statistics.median(times["matmul"])
                r.update(matmul_seconds_per_step=mm_t, matmul_gflops_per_second=w.flops / mm_t / 1e9,
                         fraction_of_matmul_rate=mm_t / ours, matmul_times=times["matmul"])
            else:
                r["fraction_of_matmul_rate"] = r["fraction_of_best_matmul_rate"]
        if "torch" in times:
            t = statistics.median(times["torch"])
            r.update(torch_seconds_per_step=t, torch_tokens_per_second=w.tokens / t, ratio=ours / t,
                     torch_times=times["torch"])
        r.update(w.extra)
        results.append(r)
    _derived(results)
    info["load_average_end_of_timing"] = os.getloadavg() if hasattr(os, "getloadavg") else None

    if not args.no_memory:
        mem = {"attn": measure_memory(args, "attn", quiet)}
        if with_torch:
            mem["torch"] = measure_memory(args, "torch", quiet)
        for r in results[2:]:
            m = mem["attn"].get(r["name"], {})
            r["peak_memory_mb"] = m.get("peak_memory_mb")
            if "tracemalloc_peak_mb" in m:
                r["tracemalloc_peak_mb"] = m["tracemalloc_peak_mb"]
            if with_torch:
                tm = mem.get("torch", {}).get(r["name"].replace("_reference", ""), {})
                r["torch_peak_memory_mb"] = tm.get("peak_memory_mb")
    return results


def _derived(results):
    """Cache speed-ups and beam/greedy cost, on the rows they concern."""
    by = {r["name"]: r for r in results}
    for kind in ("greedy", "beam"):
        c, u = by.get(f"{kind}_cached"), by.get(f"{kind}_uncached")
        if c and u:
            c["cache_speedup"] = u["seconds_per_step"] / c["seconds_per_step"]
    g, b = by.get("greedy_cached"), by.get("beam_cached")
    if g and b:
        b["cost_vs_greedy"] = b["seconds_per_step"] / g["seconds_per_step"]


def _fmt(v, spec):
    if v is None:
        return format("-", ">" + spec.split(".")[0]) if spec[0].isdigit() else "-"
    return format(v, spec)


def print_table(results, out=sys.stdout):
    info, mm = results[0], results[1]
    print(f"attn.bench  preset {info['preset']}  backend {info['backend']}  BLAS threads {info.get('blas_threads')}"
          f"  torch {info.get('torch', 'absent')} (threads {info.get('torch_threads', '-')})", file=out)
    print(f"machine: {info.get('cpu_model')}, {info.get('usable_cpus', info.get('cpu_count'))} usable CPUs, "
          f"numpy {info['numpy']} ({info.get('blas', '?')})" + (f", GPU {info['gpu']}" if "gpu" in info else ""),
          file=out)
    if info["backend"] == "cupy":
        print(f"achieved TFLOP/s: " + ", ".join(f"{r['name']} {r['tflops_per_second']:.1f}"
                                                for r in results[2:] if "tflops_per_second" in r), file=out)
    print(f"matmul rate at the step's shapes: {mm['gflops_per_second']:.1f} GFLOP/s "
          f"(square 2048: {mm['square_2048_gflops_per_second']:.1f} GFLOP/s)", file=out)
    head = (f"{'measurement':<22}{'s/step':>9}{'tokens/s':>11}{'GFLOP/s':>9}{'%matmul':>8}{'peak MB':>9}"
            f"{'torch s':>9}{'ratio':>7}{'torch MB':>9}  notes")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in results[2:]:
        notes = []
        if "cache_speedup" in r:
            notes.append(f"cache x{r['cache_speedup']:.1f}")
        if "cost_vs_greedy" in r:
            notes.append(f"{r['cost_vs_greedy']:.2f}x greedy")
        frac = r.get("fraction_of_matmul_rate")
        print(f"{r['name']:<22}{r['seconds_per_step']:>9.4f}{r['tokens_per_second']:>11.0f}"
              f"{_fmt(r.get('gflops_per_second'), '9.1f')}{_fmt(None if frac is None else 100 * frac, '7.1f')}"
              f"{'%' if frac is not None else ' '}"
              f"{_fmt(r.get('peak_memory_mb'), '9.1f')}{_fmt(r.get('torch_seconds_per_step'), '9.4f')}"
              f"{_fmt(r.get('ratio'), '7.2f')}{_fmt(r.get('torch_peak_memory_mb'), '9.1f')}  {', '.join(notes)}",
              file=out)


def print_markdown(results, out=sys.stdout):
    info, mm = results[0], results[1]
    load = info.get("load_average")
    print(f"- command: `{info.get('command') or 'python -m attn.bench'}`", file=out)
    print(f"- machine: {info.get('cpu_model')}, {info.get('usable_cpus', info.get('cpu_count'))} usable CPUs"
          + (f", GPU {info['gpu']}" if "gpu" in info else "")
          + (f"; load average (1/5/15 min) at the start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}" if load else "")
          + (f", after the timing {info['load_average_end_of_timing'][0]:.2f}"
             if info.get("load_average_end_of_timing") else ""),
          file=out)
    print(f"- software: Python {info['python']}, NumPy {info['numpy']} ({info.get('blas', '?')}), "
          f"BLAS threads {info.get('blas_threads')}, PyTorch {info.get('torch', 'absent')} "
          f"(threads {info.get('torch_threads', '-')})" + (f", CuPy {info['cupy']}" if "cupy" in info else "")
          + (", malloc keeps freed memory (both frameworks)" if info.get("malloc_keeps_freed_memory") else ""),
          file=out)
    print(f"- preset `{info['preset']}`: batch {info['batch']}, source {info['src_len']}, target {info['tgt_len']}, "
          f"config {json.dumps({k: info['config'][k] for k in ('vocab_size', 'd_model', 'n_heads', 'd_ff', 'n_encoder_layers', 'n_decoder_layers', 'dropout', 'label_smoothing')})}",
          file=out)
    print(f"- float32 matmul rate at the step's shapes, best of three per shape: {mm['gflops_per_second']:.1f} "
          f"GFLOP/s (square 2048: {mm['square_2048_gflops_per_second']:.1f} GFLOP/s); the table's "
          f"'% of matmul rate' is the step's matmuls replayed alone, timed in the same rotation as the step",
          file=out)
    print(file=out)
    print("| measurement | s/step (median) | tokens/s | model GFLOP/s | % of matmul rate | peak MB | "
          "PyTorch s/step | ratio ours/PyTorch | PyTorch peak MB | notes |", file=out)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|", file=out)
    for r in results[2:]:
        notes = []
        if "cache_speedup" in r:
            notes.append(f"cache speed-up x{r['cache_speedup']:.1f}")
        if "cost_vs_greedy" in r:
            notes.append(f"{r['cost_vs_greedy']:.2f}x greedy (cached)")
        if "matmul_gflops_per_second" in r:
            notes.append(f"matmul replay {r['matmul_gflops_per_second']:.1f} GFLOP/s; "
                         f"{100 * r['fraction_of_best_matmul_rate']:.1f} % of best-of-3 per shape, "
                         f"{100 * r['fraction_of_square_matmul_rate']:.1f} % of square 2048")
        if "torch_adam" in r:
            notes.append(f"PyTorch Adam: {r['torch_adam']}")
        frac = r.get("fraction_of_matmul_rate")
        print(f"| {r['name']} | {r['seconds_per_step']:.4f} | {r['tokens_per_second']:.0f} | "
              f"{_fmt(r.get('gflops_per_second'), '.1f')} | {_fmt(None if frac is None else 100 * frac, '.1f')} | "
              f"{_fmt(r.get('peak_memory_mb'), '.1f')} | {_fmt(r.get('torch_seconds_per_step'), '.4f')} | "
              f"{_fmt(r.get('ratio'), '.3f')} | {_fmt(r.get('torch_peak_memory_mb'), '.1f')} | {'; '.join(notes)} |",
              file=out)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--render-markdown":
        with open(sys.argv[2]) as fh:             # re-render a saved --json run
            print_markdown([json.loads(line) for line in fh if line.strip()])
        return 0
    args = parse_args(argv)
    if args._memory_child:
        B.set_backend(args.backend)
        if args.backend == "numpy" and args.threads:
            blas_threads(args.threads)
        if args._memory_child == "torch":
            import torch
            torch.set_num_threads(args.threads or blas_threads() or os.cpu_count() or 1)
        _memory_child(args)
        return 0
    results = run(args)
    if args.json:
        for r in results:
            print(json.dumps(r))
    elif args.markdown:
        print_markdown(results)
    else:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

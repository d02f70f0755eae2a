"""The benchmark's named configurations and the batches they are timed on."""
from __future__ import annotations

from dataclasses import dataclass

from .. import backend as B
from ..masks import PAD_ID
from ..model import PRESETS, TransformerConfig

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
    measurements: tuple | None = None       # what a plain run times (None: every measurement)


BENCH_PRESETS = {
    # The CPU target: the step that must beat PyTorch on two cores.
    "toy-bench": BenchConfig(
        dict(vocab_size=1000, d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3,
             dropout=0.1, label_smoothing=0.1, max_len=256),
        batch=64, src_len=32, tgt_len=32, decode_batch=64, decode_steps=50, repeats=9, warmup=3,
        note="batch 64, source and target length 32, V 1000, D 256, 4 heads, F 1024, 3+3 layers"),
    # A real corpus's vocabulary (a word vocabulary of ~30k pairs, or 16k subwords) at a batch of
    # ~4,000 tokens (B * max(S, T), as attn.data counts them): the output layer dominates.
    **{f"vocab-{V // 1000}k": BenchConfig(
        dict(vocab_size=V, d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3,
             dropout=0.1, label_smoothing=0.1, max_len=256),
        batch=128, src_len=32, tgt_len=32, decode_batch=64, decode_steps=50, repeats=5, warmup=2,
        note=f"batch 128 (4096 tokens a side), source and target length 32, V {V}, D 256, 4 heads, F 1024, "
             "3+3 layers",
        measurements=("train_step", "train_step_reference", "forward", "greedy_cached", "beam_cached"))
       for V in (16000, 32000)},
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

MEASUREMENTS = ("train_step", "train_step_graph", "train_step_reference", "forward", "forward_reference",
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


#: The benchmark's blocks (``--block``): the paper's, and the later models' (lesson 26: pre-norm,
#: RMSNorm, rotary positions, SwiGLU, and grouped-query attention with half as many key/value heads).
BLOCKS = ("paper", "later")


def later_block(model: dict) -> dict:
    """A preset's model options with the later block in place of the paper's."""
    H = model["n_heads"]
    return {**model, "norm_position": "pre", "norm_kind": "rms", "positional": "rope", "ffn": "swiglu",
            "kv_heads": H // 2 if H % 2 == 0 else H}


def _bench_config(args) -> BenchConfig:
    bc = BENCH_PRESETS[args.preset]
    if getattr(args, "block", "paper") == "later":
        bc = BenchConfig(**{**bc.__dict__, "model": later_block(bc.model)})
    changes = {}
    for k in ("batch", "src_len", "tgt_len", "decode_batch", "decode_steps", "beam"):
        v = getattr(args, k, None)
        if v is not None:
            changes[k] = v
    if changes:
        bc = BenchConfig(**{**bc.__dict__, **changes})
    return bc

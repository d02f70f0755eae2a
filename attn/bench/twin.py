"""The same model in PyTorch, the benchmark's reference: its model, loss, optimizer and decoding.
PyTorch is optional; only what is called here imports it (the model's modules, part by part, are
:mod:`attn.bench.torch_model`'s, imported by :func:`torch_transformer`)."""
from __future__ import annotations

from .. import backend as B
from ..masks import PAD_ID
from ..model import TransformerConfig
from .presets import BOS_ID, EOS_ID

def torch_available() -> bool:
    try:
        import torch  # noqa: F401  (optional reference; attn itself never needs it)
        return True
    except Exception:
        return False


def match_precision(torch, precision: str | None = None) -> str:
    """Set PyTorch's float32 products to the precision of attn's, and return it.

    ``precision`` is attn's ``--precision`` (:mod:`attn.precision`): ``"fp32"`` (full float32
    products), ``"tf32"`` (``allow_tf32``: TensorFloat-32 on a GPU's tensor cores) or ``"bf16"``
    (the products in bfloat16 under :func:`torch_autocast`, with float32 parameters and
    optimizer, as attn's master weights; the float32 products outside it at full precision).
    None: ``"tf32"`` where CuPy is told to use TensorFloat-32 (``CUPY_TF32=1``), else ``"fp32"``.

    CuPy computes float32 products in full float32 unless ``CUPY_TF32=1``; PyTorch's defaults
    have changed across versions (and cuDNN's allow TF32), so the benchmark sets them rather
    than trusting them: otherwise PyTorch's GPU step could run at a lower precision than attn's."""
    import os
    if precision is None:
        cupy_tf32 = B.get_backend() == "cupy" and os.environ.get("CUPY_TF32", "0").strip() == "1"
        precision = "tf32" if cupy_tf32 else "fp32"
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return precision


def torch_autocast(torch, precision: str, device: str):
    """The context PyTorch's forward and loss run in at ``precision``: ``torch.autocast`` to
    bfloat16 for ``"bf16"`` (PyTorch's mixed precision: the products of bf16 operands, float32
    weights and gradients), else nothing."""
    import contextlib
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type="cpu" if device == "cpu" else "cuda", dtype=torch.bfloat16)


def torch_transformer(cfg: TransformerConfig, device: str = "cpu", dtype: str = "float32"):
    """The same architecture in PyTorch, for timing and for checking (``tests/test_bench.py``
    loads attn's parameters into it and compares losses and gradients).

    Written as a PyTorch user would write it efficiently: QKV as one linear layer (as
    ``nn.MultiheadAttention`` does), ``F.scaled_dot_product_attention``, ``nn.LayerNorm``,
    weight tying by sharing the embedding matrix with the output projection. Supports what
    the benchmark presets use: shared embeddings, sinusoidal, learned or rotary positions, post- or
    pre-norm, an encoder-decoder or a decoder-only language model (``n_encoder_layers=0``,
    ``model(None, ids)``: the decoder's layers without their cross-attention, as nanoGPT's ``GPT``), and the later block's options as Llama's code writes them: ``nn.RMSNorm``
    (``F.rms_norm``), rotary positions with the half-split pairing and ``cfg.rope_base``, SwiGLU
    (``w2(silu(x W) * x V)``, W | V one linear layer, no biases), grouped-query attention
    (``scaled_dot_product_attention(enable_gqa=True)``), QK-norm as OLMo 2's code writes it (an
    ``nn.RMSNorm`` over each head's queries and one over its keys, before rotary positions).
    Its modules, part by part, are :mod:`attn.bench.torch_model`'s. Only called where ``torch``
    imports.
    """
    from .torch_model import TorchTransformer, Twin
    twin = Twin.of(cfg, dtype)
    return TorchTransformer(twin).to(device=device, dtype=twin.dtype)


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

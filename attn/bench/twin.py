"""The same model in PyTorch, the benchmark's reference: its model, loss, optimizer and decoding.
PyTorch is optional; only what is called here imports it."""
from __future__ import annotations

import math

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

        def attn_params(self) -> dict:
            """This model's parameters under attn's names and layouts, as host (NumPy) arrays:
            the inverse of :meth:`load_attn_params` (fused QKV/KV split back, weights transposed
            to attn's ``x @ W``), so attn's decoder and scorer can run a model PyTorch trained."""
            np = B.host

            def h(p):
                return p.detach().to("cpu").numpy().copy()

            def split(lin, names, pre, out):
                w, b = h(lin.weight).T, h(lin.bias)                  # (D, n*D), (n*D,)
                for j, n in enumerate(names):
                    out[f"{pre}.w_{n}"] = np.ascontiguousarray(w[:, j * D:(j + 1) * D])
                    out[f"{pre}.b_{n}"] = b[j * D:(j + 1) * D].copy()

            out = {"embedding.weight": h(self.embedding.weight)}
            for stack, layers in (("encoder", self.encoder), ("decoder", self.decoder)):
                for i, layer in enumerate(layers):
                    pre = f"{stack}.{i}"
                    sa = layer.self_attn.f
                    split(sa.qkv, "qkv", f"{pre}.self_attn", out)
                    out[f"{pre}.self_attn.w_o"] = np.ascontiguousarray(h(sa.out.weight).T)
                    out[f"{pre}.self_attn.b_o"] = h(sa.out.bias)
                    subs = [("norm1", layer.self_attn)]
                    if stack == "decoder":
                        ca = layer.cross_attn.f
                        split(ca.q, "q", f"{pre}.cross_attn", out)
                        split(ca.kv, "kv", f"{pre}.cross_attn", out)
                        out[f"{pre}.cross_attn.w_o"] = np.ascontiguousarray(h(ca.out.weight).T)
                        out[f"{pre}.cross_attn.b_o"] = h(ca.out.bias)
                        subs += [("norm2", layer.cross_attn), ("norm3", layer.ffn)]
                    else:
                        subs += [("norm2", layer.ffn)]
                    ff = layer.ffn.f
                    for n, lin in (("1", ff.w1), ("2", ff.w2)):
                        out[f"{pre}.ffn.w{n}"] = np.ascontiguousarray(h(lin.weight).T)
                        out[f"{pre}.ffn.b{n}"] = h(lin.bias)
                    for norm, sub in subs:
                        out[f"{pre}.{norm}.gamma"] = h(sub.norm.weight)
                        out[f"{pre}.{norm}.beta"] = h(sub.norm.bias)
            if cfg.norm == "pre":
                for stack, norm in (("encoder", self.enc_norm), ("decoder", self.dec_norm)):
                    out[f"{stack}.norm.gamma"] = h(norm.weight)
                    out[f"{stack}.norm.beta"] = h(norm.bias)
            return out

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

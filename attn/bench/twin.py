"""The same model in PyTorch, the benchmark's reference: its model, loss, optimizer and decoding.
PyTorch is optional; only what is called here imports it."""
from __future__ import annotations

import math

from .. import backend as B
from ..block import parts
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
    the benchmark presets use: shared embeddings, sinusoidal or rotary positions, post- or
    pre-norm, and the later block's options as Llama's code writes them: ``nn.RMSNorm``
    (``F.rms_norm``), rotary positions with the half-split pairing and ``cfg.rope_base``, SwiGLU
    (``w2(silu(x W) * x V)``, W | V one linear layer, no biases), grouped-query attention
    (``scaled_dot_product_attention(enable_gqa=True)``), QK-norm as OLMo 2's code writes it (an
    ``nn.RMSNorm`` over each head's queries and one over its keys, before rotary positions).
    Only called where ``torch`` imports.
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    block = parts(cfg)                    # the twin asks the block's parts, as attn's engines do
    if not cfg.share_embeddings or block.positions.learned:
        raise ValueError("torch_transformer: only shared embeddings and sinusoidal or rotary positions")
    D, H, Fd, V, KV = cfg.d_model, cfg.n_heads, cfg.ffn_width, cfg.vocab_size, cfg.key_value_heads
    Dh = D // H
    tdtype = getattr(torch, dtype)
    rope, qk = block.positions.rotary, block.self_attention

    class QKNorm(nn.Module):
        """QK-norm's RMSNorm (Dh) of the query heads and of the key heads (nothing without it)."""

        def __init__(self):
            super().__init__()
            if qk.qk_norm:
                self.q_norm, self.k_norm = nn.RMSNorm(Dh, eps=qk.eps), nn.RMSNorm(Dh, eps=qk.eps)

        def forward(self, a, which):
            return getattr(self, f"{which}_norm")(a) if qk.qk_norm else a

    def attend(q, k, v, mask, p, training):
        """q (B, H, Tq, Dh), k/v (B, KV, Tk, Dh), mask bool broadcastable, True = may attend."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p if training else 0.0,
                                              enable_gqa=KV != H)

    def heads(x, n, h=H):
        Bsz, T, _ = x.shape
        return x.view(Bsz, T, n, h, Dh).permute(2, 0, 3, 1, 4)          # (n, B, h, T, Dh)

    def qkv_heads(x):
        """(B, T, D + 2 KV Dh) -> q (B, H, T, Dh), k and v (B, KV, T, Dh)."""
        q, k, v = x.split([D, KV * Dh, KV * Dh], dim=-1)
        return heads(q, 1)[0], heads(k, 1, KV)[0], heads(v, 1, KV)[0]

    def norm():
        return {"layer": nn.LayerNorm, "rms": nn.RMSNorm}[block.norm.kind](D, eps=block.norm.eps)

    angle = torch.arange(cfg.max_len, dtype=torch.float64)[:, None] * cfg.rope_base ** (
        -torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)                      # (L, Dh/2)

    def rotate(x, cos, sin, offset):
        """Rotary positions offset.. on x (B, h, T, Dh), the pairs (i, i + Dh/2)."""
        T = x.shape[2]
        c, s = cos[offset:offset + T], sin[offset:offset + T]
        a, b = x[..., :Dh // 2], x[..., Dh // 2:]
        return torch.cat([a * c - b * s, a * s + b * c], dim=-1)

    def merge(o):
        Bsz, _, T, _ = o.shape
        return o.transpose(1, 2).reshape(Bsz, T, D)

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out, self.qk = nn.Linear(D, D + 2 * KV * Dh), nn.Linear(D, D), QKNorm()
            if rope:                              # the rotary tables (the sinusoids' place), on the model's device
                self.register_buffer("cos", torch.cos(angle).to(tdtype), persistent=False)
                self.register_buffer("sin", torch.sin(angle).to(tdtype), persistent=False)

        def forward(self, x, mask, cache=None):
            q, k, v = qkv_heads(self.qkv(x))
            q, k = self.qk(q, "q"), self.qk(k, "k")
            if rope:                              # the new key turned once, before it is cached
                offset = 0 if cache is None or cache[0] is None else cache[0].shape[2]
                q, k = (rotate(a, self.cos, self.sin, offset) for a in (q, k))
            if cache is not None:                 # incremental decoding: append this position
                if cache[0] is not None:
                    k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
                cache[0], cache[1] = k, v
            return self.out(merge(attend(q, k, v, mask, cfg.attention_dropout, self.training)))

    class CrossAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv, self.out = nn.Linear(D, D), nn.Linear(D, 2 * KV * Dh), nn.Linear(D, D)
            self.qk = QKNorm()

        def keys_values(self, memory):
            k, v = heads(self.kv(memory), 2, KV)
            return self.qk(k, "k"), v

        def forward(self, x, kv, mask):
            q = self.qk(heads(self.q(x), 1)[0], "q")
            return self.out(merge(attend(q, kv[0], kv[1], mask, cfg.attention_dropout, self.training)))

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Linear(D, Fd), nn.Linear(Fd, D)
            self.drop = nn.Dropout(cfg.relu_dropout)

        def forward(self, x):
            return self.w2(self.drop(F.relu(self.w1(x))))

    class SwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.w13, self.w2 = nn.Linear(D, 2 * Fd, bias=False), nn.Linear(Fd, D, bias=False)
            self.drop = nn.Dropout(cfg.relu_dropout)

        def forward(self, x):
            a, b = self.w13(x).chunk(2, dim=-1)
            return self.w2(self.drop(F.silu(a) * b))

    def ffn():
        return {"relu": FFN, "swiglu": SwiGLU}[block.ffn.kind]()

    class Sub(nn.Module):
        """A sub-layer in its residual connection (post-norm: LN(x + drop(f(x))))."""

        def __init__(self, f):
            super().__init__()
            self.f, self.norm, self.drop = f, norm(), nn.Dropout(cfg.dropout)

        def forward(self, x, *args, **kw):
            if block.placement.pre:
                return x + self.drop(self.f(self.norm(x), *args, **kw))
            return self.norm(x + self.drop(self.f(x, *args, **kw)))

    class EncoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.ffn = Sub(SelfAttention()), Sub(ffn())

        def forward(self, x, mask):
            return self.ffn(self.self_attn(x, mask))

    class DecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.cross_attn, self.ffn = Sub(SelfAttention()), Sub(CrossAttention()), Sub(ffn())

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
            if block.placement.final_norm:
                self.enc_norm, self.dec_norm = norm(), norm()
            self.drop = nn.Dropout(cfg.dropout)
            pos = torch.arange(cfg.max_len, dtype=torch.float64)[:, None]
            div = torch.pow(10000.0, torch.arange(0, D, 2, dtype=torch.float64) / D)
            pe = torch.zeros(cfg.max_len, D, dtype=torch.float64)
            pe[:, 0::2] = torch.sin(pos / div)
            pe[:, 1::2] = torch.cos(pos / div)[:, : D // 2]
            self.register_buffer("pe", pe.to(tdtype), persistent=False)

        def embed(self, ids, offset=0):
            x = self.embedding(ids) * math.sqrt(D)
            return self.drop(x if rope else x + self.pe[offset:offset + ids.shape[1]])

        def encode(self, src):
            src_mask = (src != PAD_ID)[:, None, None, :]                    # (B, 1, 1, S)
            x = self.embed(src)
            for layer in self.encoder:
                x = layer(x, src_mask)
            if block.placement.final_norm:
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
            if block.placement.final_norm:
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
            if block.placement.final_norm:
                y = self.dec_norm(y)
            state["pos"] = pos + 1
            return torch.log_softmax(self.project(y[:, 0]), dim=-1)

        def pairs(self):
            """(attn's name, torch parameter, how attn lays it out) for every parameter: ``("T",)``
            a weight transposed (attn's ``x @ W``), ``("cols", lo, hi)`` columns lo..hi of a fused
            linear layer's weight transposed, ``("part", lo, hi)`` a slice of a fused bias, ``()`` as
            it is."""
            out = [("embedding.weight", self.embedding.weight, ())]
            widths = {"q": D, "k": KV * Dh, "v": KV * Dh}

            def fused(pre, lin, names):
                lo = 0
                for n in names:
                    hi = lo + widths[n]
                    out.extend([(f"{pre}.w_{n}", lin.weight, ("cols", lo, hi)),
                                (f"{pre}.b_{n}", lin.bias, ("part", lo, hi))])
                    lo = hi

            def norm_of(name, mod):
                out.extend((f"{name}.{n}", getattr(mod, {"gamma": "weight", "beta": "bias"}[n]), ())
                           for n in block.norm.names)

            for stack, layers in (("encoder", self.encoder), ("decoder", self.decoder)):
                for i, layer in enumerate(layers):
                    pre = f"{stack}.{i}"
                    subs = [("self_attn", layer.self_attn)] + (
                        [("cross_attn", layer.cross_attn)] if stack == "decoder" else [])
                    for sub, mod in subs:
                        f = mod.f
                        if sub == "self_attn":
                            fused(f"{pre}.self_attn", f.qkv, "qkv")
                        else:
                            fused(f"{pre}.cross_attn", f.q, "q")
                            fused(f"{pre}.cross_attn", f.kv, "kv")
                        out.extend([(f"{pre}.{sub}.w_o", f.out.weight, ("T",)), (f"{pre}.{sub}.b_o", f.out.bias, ())])
                        if qk.qk_norm:
                            out.extend((f"{pre}.{sub}.{w}_gamma", getattr(f.qk, f"{w}_norm").weight, ()) for w in "qk")
                    ff = layer.ffn.f
                    if block.ffn.gated:
                        out.extend([(f"{pre}.ffn.w1", ff.w13.weight, ("cols", 0, Fd)),
                                    (f"{pre}.ffn.w3", ff.w13.weight, ("cols", Fd, 2 * Fd)),
                                    (f"{pre}.ffn.w2", ff.w2.weight, ("T",))])
                    else:
                        out.extend([(f"{pre}.ffn.w1", ff.w1.weight, ("T",)), (f"{pre}.ffn.b1", ff.w1.bias, ()),
                                    (f"{pre}.ffn.w2", ff.w2.weight, ("T",)), (f"{pre}.ffn.b2", ff.w2.bias, ())])
                    for k, (_, mod) in enumerate(subs + [("ffn", layer.ffn)]):
                        norm_of(f"{pre}.norm{k + 1}", mod.norm)
            if block.placement.final_norm:
                for stack, mod in (("encoder", self.enc_norm), ("decoder", self.dec_norm)):
                    norm_of(f"{stack}.norm", mod)
            return out

        def load_attn_params(self, params):
            """Copy attn's parameters (host arrays, attn's names) into this model."""
            with torch.no_grad():
                for name, p, how in self.pairs():
                    a = torch.as_tensor(B.host.ascontiguousarray(B.to_host(params[name])), dtype=tdtype)
                    if not how:
                        p.copy_(a)
                    elif how[0] == "T":
                        p.copy_(a.T)
                    elif how[0] == "cols":
                        p[how[1]:how[2]].copy_(a.T)
                    else:
                        p[how[1]:how[2]].copy_(a)

        def attn_params(self, grads: bool = False) -> dict:
            """This model's parameters (or with ``grads`` their gradients) under attn's names and
            layouts, as host (NumPy) arrays: the inverse of :meth:`load_attn_params` (fused
            layers split back, weights transposed to attn's ``x @ W``), so attn's decoder and
            scorer can run a model PyTorch trained."""
            np = B.host
            out = {}
            for name, p, how in self.pairs():
                a = (p.grad if grads else p).detach().to("cpu").numpy()
                if how and how[0] in ("cols", "part"):
                    a = a[how[1]:how[2]]
                if how and how[0] in ("T", "cols"):
                    a = a.T
                out[name] = np.ascontiguousarray(a)
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

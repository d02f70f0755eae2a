"""The benchmark's PyTorch twin of attn's model, part by part; imported only where PyTorch is
(:func:`attn.bench.twin.torch_transformer` imports it when called). Every module is made from a
:class:`Twin` (the config, its block's parts, its widths) and dispatches on the parts as
:mod:`attn.block` declares them, never on an option's string: the norm and the feed-forward
network are the twins of their part's readable forward (:data:`NORMS`, :data:`FFNS`), the
placement is ``block.placement.pre``, rotary positions ``block.positions.rotary``, QK-norm the
attention part's ``qk_norm``. Each module lists its parameters under attn's names and layouts
(``pairs``), which :meth:`TorchTransformer.load_attn_params` and
:meth:`TorchTransformer.attn_params` read."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import backend as B
from ..block import parts
from ..layers import feed_forward_forward, layer_norm_forward, rmsnorm_forward, swiglu_forward
from ..masks import PAD_ID


class Twin(NamedTuple):
    """What the twin's modules read: the config, its block's parts, the widths D, H, KV (key/value
    heads), Dh, F (the feed-forward's hidden width), V, and the parameters' torch dtype."""
    cfg: object
    block: object
    D: int
    H: int
    KV: int
    Dh: int
    F: int
    V: int
    dtype: object

    @classmethod
    def of(cls, cfg, dtype: str) -> "Twin":
        block = parts(cfg)                # the twin asks the block's parts, as attn's engines do
        if not cfg.share_embeddings:
            raise ValueError("torch_transformer: only shared embeddings (share_embeddings=True)")
        return cls(cfg, block, cfg.d_model, cfg.n_heads, cfg.key_value_heads, cfg.d_model // cfg.n_heads,
                   cfg.ffn_width, cfg.vocab_size, getattr(torch, dtype))

    def heads(self, x, n, h=None):
        """(B, T, n * h * Dh) -> (n, B, h, T, Dh) (h: H unless given)."""
        Bsz, T, _ = x.shape
        return x.view(Bsz, T, n, h or self.H, self.Dh).permute(2, 0, 3, 1, 4)

    def qkv_heads(self, x):
        """(B, T, D + 2 KV Dh) -> q (B, H, T, Dh), k and v (B, KV, T, Dh)."""
        q, k, v = x.split([self.D, self.KV * self.Dh, self.KV * self.Dh], dim=-1)
        return self.heads(q, 1)[0], self.heads(k, 1, self.KV)[0], self.heads(v, 1, self.KV)[0]

    def merge(self, o):
        Bsz, _, T, _ = o.shape
        return o.transpose(1, 2).reshape(Bsz, T, self.D)

    def attend(self, q, k, v, mask, training):
        """q (B, H, Tq, Dh), k/v (B, KV, Tk, Dh), mask bool broadcastable, True = may attend."""
        p = self.cfg.attention_dropout if training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=self.KV != self.H)


#: Each norm's PyTorch module, by the readable forward of its part (:attr:`attn.block.Norm.forward_pair`).
NORMS = {layer_norm_forward: nn.LayerNorm, rmsnorm_forward: nn.RMSNorm}
#: attn's names of a norm's parameters, as PyTorch's module names them.
_NORM_NAMES = {"gamma": "weight", "beta": "bias"}


def norm(t: Twin) -> nn.Module:
    return NORMS[t.block.norm.forward_pair](t.D, eps=t.block.norm.eps)


def norm_pairs(t: Twin, name: str, mod) -> list:
    """The pairs (see :meth:`TorchTransformer.pairs`) of the norm ``mod`` called ``name``."""
    return [(f"{name}.{n}", getattr(mod, _NORM_NAMES[n]), ()) for n in t.block.norm.names]


def fused_pairs(name: str, lin, widths: list) -> list:
    """The pairs of a linear layer fusing attn's ``w_<n>``, ``b_<n>`` for (n, width) in ``widths``
    side by side: its weight's rows and its bias's parts, in order."""
    out, lo = [], 0
    for n, width in widths:
        hi = lo + width
        out.extend([(f"{name}.w_{n}", lin.weight, ("cols", lo, hi)), (f"{name}.b_{n}", lin.bias, ("part", lo, hi))])
        lo = hi
    return out


# --------------------------------------------------------------------------- attention

class QKNorm(nn.Module):
    """QK-norm's RMSNorm (Dh) of the query heads and of the key heads (nothing without it)."""

    def __init__(self, t: Twin):
        super().__init__()
        self.on = t.block.self_attention.qk_norm
        if self.on:
            eps = t.block.self_attention.eps
            self.q_norm, self.k_norm = nn.RMSNorm(t.Dh, eps=eps), nn.RMSNorm(t.Dh, eps=eps)

    def forward(self, a, which):
        return getattr(self, f"{which}_norm")(a) if self.on else a

    def pairs(self, name: str) -> list:
        return [(f"{name}.{w}_gamma", getattr(self, f"{w}_norm").weight, ()) for w in "qk"] if self.on else []


def rotate(x, cos, sin, offset):
    """Rotary positions offset.. on x (B, h, T, Dh), the pairs (i, i + Dh/2)."""
    T, half = x.shape[2], x.shape[3] // 2
    c, s = cos[offset:offset + T], sin[offset:offset + T]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


class SelfAttention(nn.Module):
    """Q, K and V as one linear layer; rotary positions where the block's are, turning the new key
    once, before it is cached."""

    def __init__(self, t: Twin):
        super().__init__()
        self.t, self.rotary = t, t.block.positions.rotary
        self.qkv, self.out, self.qk = nn.Linear(t.D, t.D + 2 * t.KV * t.Dh), nn.Linear(t.D, t.D), QKNorm(t)
        if self.rotary:                           # the rotary tables (the sinusoids' place), on the model's device
            angle = torch.arange(t.cfg.max_len, dtype=torch.float64)[:, None] * t.cfg.rope_base ** (
                -torch.arange(0, t.Dh, 2, dtype=torch.float64) / t.Dh)          # (L, Dh/2)
            self.register_buffer("cos", torch.cos(angle).to(t.dtype), persistent=False)
            self.register_buffer("sin", torch.sin(angle).to(t.dtype), persistent=False)

    def forward(self, x, mask, cache=None):
        q, k, v = self.t.qkv_heads(self.qkv(x))
        q, k = self.qk(q, "q"), self.qk(k, "k")
        if self.rotary:                           # the new key turned once, before it is cached
            offset = 0 if cache is None or cache[0] is None else cache[0].shape[2]
            q, k = (rotate(a, self.cos, self.sin, offset) for a in (q, k))
        if cache is not None:                     # incremental decoding: append this position
            if cache[0] is not None:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            cache[0], cache[1] = k, v
        return self.out(self.t.merge(self.t.attend(q, k, v, mask, self.training)))

    def pairs(self, name: str) -> list:
        t = self.t
        return [*fused_pairs(name, self.qkv, [("q", t.D), ("k", t.KV * t.Dh), ("v", t.KV * t.Dh)]),
                (f"{name}.w_o", self.out.weight, ("T",)), (f"{name}.b_o", self.out.bias, ()), *self.qk.pairs(name)]


class CrossAttention(nn.Module):
    """The queries one linear layer, the keys and values another (projected once per source)."""

    def __init__(self, t: Twin):
        super().__init__()
        self.t = t
        self.q, self.kv, self.out = nn.Linear(t.D, t.D), nn.Linear(t.D, 2 * t.KV * t.Dh), nn.Linear(t.D, t.D)
        self.qk = QKNorm(t)

    def keys_values(self, memory):
        k, v = self.t.heads(self.kv(memory), 2, self.t.KV)
        return self.qk(k, "k"), v

    def forward(self, x, kv, mask):
        q = self.qk(self.t.heads(self.q(x), 1)[0], "q")
        return self.out(self.t.merge(self.t.attend(q, kv[0], kv[1], mask, self.training)))

    def pairs(self, name: str) -> list:
        t = self.t
        return [*fused_pairs(name, self.q, [("q", t.D)]), *fused_pairs(name, self.kv, [("k", t.KV * t.Dh),
                                                                                       ("v", t.KV * t.Dh)]),
                (f"{name}.w_o", self.out.weight, ("T",)), (f"{name}.b_o", self.out.bias, ()), *self.qk.pairs(name)]


# --------------------------------------------------------------------------- feed-forward

class ReluFFN(nn.Module):
    """``w2(drop(relu(w1(x))))`` (equation 2)."""

    def __init__(self, t: Twin):
        super().__init__()
        self.w1, self.w2 = nn.Linear(t.D, t.F), nn.Linear(t.F, t.D)
        self.drop = nn.Dropout(t.cfg.relu_dropout)

    def forward(self, x):
        return self.w2(self.drop(F.relu(self.w1(x))))

    def pairs(self, name: str) -> list:
        return [(f"{name}.w1", self.w1.weight, ("T",)), (f"{name}.b1", self.w1.bias, ()),
                (f"{name}.w2", self.w2.weight, ("T",)), (f"{name}.b2", self.w2.bias, ())]


class SwiGLU(nn.Module):
    """``w2(drop(silu(x W) * x V))`` as Llama's code writes it: W | V one linear layer, no biases."""

    def __init__(self, t: Twin):
        super().__init__()
        self.F = t.F
        self.w13, self.w2 = nn.Linear(t.D, 2 * t.F, bias=False), nn.Linear(t.F, t.D, bias=False)
        self.drop = nn.Dropout(t.cfg.relu_dropout)

    def forward(self, x):
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(self.drop(F.silu(a) * b))

    def pairs(self, name: str) -> list:
        return [(f"{name}.w1", self.w13.weight, ("cols", 0, self.F)),
                (f"{name}.w3", self.w13.weight, ("cols", self.F, 2 * self.F)), (f"{name}.w2", self.w2.weight, ("T",))]


#: Each feed-forward's PyTorch module, by the readable forward of its part
#: (:attr:`attn.block.FeedForward.forward_pair`).
FFNS = {feed_forward_forward: ReluFFN, swiglu_forward: SwiGLU}


# --------------------------------------------------------------------------- the layers

class Sub(nn.Module):
    """A sub-layer ``f`` in its residual connection (post-norm: LN(x + drop(f(x))); pre-norm:
    x + drop(f(LN(x))))."""

    def __init__(self, t: Twin, f):
        super().__init__()
        self.pre = t.block.placement.pre
        self.f, self.norm, self.drop = f, norm(t), nn.Dropout(t.cfg.dropout)

    def forward(self, x, *args, **kw):
        if self.pre:
            return x + self.drop(self.f(self.norm(x), *args, **kw))
        return self.norm(x + self.drop(self.f(x, *args, **kw)))


class EncoderLayer(nn.Module):
    def __init__(self, t: Twin):
        super().__init__()
        self.self_attn, self.ffn = Sub(t, SelfAttention(t)), Sub(t, FFNS[t.block.ffn.forward_pair](t))
        self.subs = (("self_attn", self.self_attn), ("ffn", self.ffn))

    def forward(self, x, mask):
        return self.ffn(self.self_attn(x, mask))


class DecoderLayer(nn.Module):
    """The decoder's layer; a decoder-only block's (no cross-attention part: GPT's) is the masked
    self-attention and the feed-forward network alone, their norms ``norm1`` and ``norm3`` as attn
    names them."""

    def __init__(self, t: Twin):
        super().__init__()
        self.self_attn, self.ffn = Sub(t, SelfAttention(t)), Sub(t, FFNS[t.block.ffn.forward_pair](t))
        self.cross_attn = Sub(t, CrossAttention(t)) if t.block.cross_attention is not None else None
        self.subs = (("self_attn", self.self_attn), ("cross_attn", self.cross_attn), ("ffn", self.ffn))

    def forward(self, x, kv, self_mask, src_mask, cache=None):
        x = self.self_attn(x, self_mask, cache)
        if self.cross_attn is not None:
            x = self.cross_attn(x, kv, src_mask)
        return self.ffn(x)


def layer_pairs(t: Twin, pre: str, layer) -> list:
    """The pairs of an encoder or decoder layer called ``pre``: its sub-layers', then their norms
    (``norm1``...: the k-th sub-layer's ``norm<k>``, a missing cross-attention's number skipped)."""
    subs = [(k + 1, sub, mod) for k, (sub, mod) in enumerate(layer.subs) if mod is not None]
    out = [p for _, sub, mod in subs for p in mod.f.pairs(f"{pre}.{sub}")]
    for k, _, mod in subs:
        out.extend(norm_pairs(t, f"{pre}.norm{k}", mod.norm))
    return out


# --------------------------------------------------------------------------- the model

class TorchTransformer(nn.Module):
    """The encoder-decoder of :class:`Twin` ``t``, its embedding tied to the output projection; or,
    where the config has no encoder (``n_encoder_layers=0``), the decoder-only language model of the
    same block (GPT's: ``forward(None, ids)``)."""

    def __init__(self, t: Twin):
        super().__init__()
        cfg, D = t.cfg, t.D
        self.t, self.rotary, self.final_norm = t, t.block.positions.rotary, t.block.placement.final_norm
        self.has_encoder = cfg.n_encoder_layers > 0
        self.embedding = nn.Embedding(t.V, D)
        nn.init.normal_(self.embedding.weight, std=D ** -0.5)
        self.encoder = nn.ModuleList(EncoderLayer(t) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(t) for _ in range(cfg.n_decoder_layers))
        if self.final_norm:
            self.enc_norm = norm(t) if self.has_encoder else None
            self.dec_norm = norm(t)
        # learned positions (nanoGPT's wpe): a table per stack that embeds tokens, attn's {stack}_pos.weight
        self.positions = nn.ParameterDict({w: nn.Parameter(torch.randn(cfg.max_len, D) * 0.02)
                                           for w in (t.block.positions.stacks if t.block.positions.learned else ())})
        self.drop = nn.Dropout(cfg.dropout)
        pos = torch.arange(cfg.max_len, dtype=torch.float64)[:, None]
        div = torch.pow(10000.0, torch.arange(0, D, 2, dtype=torch.float64) / D)
        pe = torch.zeros(cfg.max_len, D, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos / div)
        pe[:, 1::2] = torch.cos(pos / div)[:, : D // 2]
        self.register_buffer("pe", pe.to(t.dtype), persistent=False)

    def embed(self, ids, offset=0, which="tgt"):
        x = self.embedding(ids) * math.sqrt(self.t.D)
        if self.rotary:
            return self.drop(x)
        table = self.positions[which] if self.positions else self.pe
        return self.drop(x + table[offset:offset + ids.shape[1]])

    def encode(self, src):
        src_mask = (src != PAD_ID)[:, None, None, :]                        # (B, 1, 1, S)
        x = self.embed(src, which="src")
        for layer in self.encoder:
            x = layer(x, src_mask)
        if self.final_norm:
            x = self.enc_norm(x)
        return x, src_mask

    def cross_kv(self, memory):
        if not self.has_encoder:                                            # a language model: no memory
            return [None] * len(self.decoder)
        return [layer.cross_attn.f.keys_values(memory) for layer in self.decoder]

    def decode(self, tgt_in, memory, src_mask, kv=None):
        T = tgt_in.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt_in.device).tril()
        tgt_mask = causal & (tgt_in != PAD_ID)[:, None, None, :]               # (B, 1, T, T)
        kv = self.cross_kv(memory) if kv is None else kv
        y = self.embed(tgt_in)
        for layer, kv_i in zip(self.decoder, kv):
            y = layer(y, kv_i, tgt_mask, src_mask)
        if self.final_norm:
            y = self.dec_norm(y)
        return y

    def project(self, h):
        return F.linear(h, self.embedding.weight)

    def forward(self, src, tgt_in):
        """Logits (B, T, V) of ``tgt_in`` (B, T) given ``src`` (B, S); a language model's src is None."""
        if (src is None) == self.has_encoder:
            raise ValueError("TorchTransformer.forward: " + ("src is None, but the model has an encoder"
                                                             if self.has_encoder else
                                                             "a decoder-only model reads no source: src must be None"))
        memory, src_mask = self.encode(src) if self.has_encoder else (None, None)
        return self.project(self.decode(tgt_in, memory, src_mask))

    def decode_step(self, tokens, state):
        """One position for every row with cached keys/values. state: dict with kv, src_mask,
        self (per layer [k, v]), pos. Returns log-probabilities (B, V)."""
        pos = state["pos"]
        y = self.embed(tokens[:, None], offset=pos)
        for layer, kv_i, c in zip(self.decoder, state["kv"], state["self"]):
            y = layer(y, kv_i, None, state["src_mask"], cache=c)
        if self.final_norm:
            y = self.dec_norm(y)
        state["pos"] = pos + 1
        return torch.log_softmax(self.project(y[:, 0]), dim=-1)

    def pairs(self):
        """(attn's name, torch parameter, how attn lays it out) for every parameter: ``("T",)``
        a weight transposed (attn's ``x @ W``), ``("cols", lo, hi)`` columns lo..hi of a fused
        linear layer's weight transposed, ``("part", lo, hi)`` a slice of a fused bias, ``()`` as
        it is."""
        out = [("embedding.weight", self.embedding.weight, ())]
        out.extend((f"{w}_pos.weight", p, ()) for w, p in self.positions.items())
        for stack, layers in (("encoder", self.encoder), ("decoder", self.decoder)):
            for i, layer in enumerate(layers):
                out.extend(layer_pairs(self.t, f"{stack}.{i}", layer))
        if self.final_norm:
            for stack, mod in (("encoder", self.enc_norm), ("decoder", self.dec_norm)):
                if mod is not None:
                    out.extend(norm_pairs(self.t, f"{stack}.norm", mod))
        return out

    def load_attn_params(self, params):
        """Copy attn's parameters (host arrays, attn's names) into this model."""
        with torch.no_grad():
            for name, p, how in self.pairs():
                a = torch.as_tensor(B.host.ascontiguousarray(B.to_host(params[name])), dtype=self.t.dtype)
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
        out = {}
        for name, p, how in self.pairs():
            a = (p.grad if grads else p).detach().to("cpu").numpy()
            if how and how[0] in ("cols", "part"):
                a = a[how[1]:how[2]]
            if how and how[0] in ("T", "cols"):
                a = a.T
            out[name] = B.host.ascontiguousarray(a)
        return out

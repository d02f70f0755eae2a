"""The block, declared once: a :class:`~attn.model.TransformerConfig` becomes named parts.

    part          the paper's                    a later model's (lesson 26)   the config's field
    norm          layer norm                     RMSNorm                       norm_kind, ln_eps
    placement     post-norm                      pre-norm (and a final norm)   norm_position, dropout
    positions     sinusoids (or a learned        rotary, inside the            positional, rope_base,
                  table, Table 3 row E)          self-attention                max_len
    attention     multi-head                     grouped-query (kv_heads),     n_heads, kv_heads,
                                                 QK-norm                       qk_norm
    ffn           ReLU network (equation 2)      SwiGLU                        ffn, d_ff, relu_dropout
    cross-attn    over the encoder's output      none: a decoder-only stack    n_encoder_layers (0)
                                                 (a language model, lesson 24)

Each part carries its parameters' names and shapes and its readable forward and backward from
:mod:`attn.layers`. The model (:mod:`attn.model`) composes the parts and asks them; it never
compares an option's string. :func:`parts` is the one place that reads the block's options, and
refuses one it does not know, naming the field; :func:`check` adds what the parts need of the
numbers (kv_heads dividing n_heads, rotary's even head size, a decoder-only stack's one tied
vocabulary).

QK-norm (``qk_norm``; OLMo 2, Gemma 3) is RMSNorm over each head's queries and keys, after the
projections and before rotary positions: a gain (Dh,) for the queries and one for the keys
(``q_gamma``, ``k_gamma``), shared by the heads of one attention, starting at one. It is on in
every attention of the block, the cross-attention's too: a score is then at most
``sqrt(Dh) max|g_q| max|g_k|`` in every attention (lesson 26), which is what QK-norm is for,
and the cross-attention's keys are normed once, when they are projected from the memory, so
decoding pays for it only on its one query a position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

from .backend import get_array_module, host
from .layers import (feed_forward_backward, feed_forward_forward, layer_norm_backward, layer_norm_forward,
                     linear_forward, multi_head_attention_backward, multi_head_attention_forward,
                     rmsnorm_backward, rmsnorm_forward, rope_forward, swiglu_backward, swiglu_forward,
                     swiglu_width)
from .layers.attention import attention_forward, merge_heads, repeat_kv, split_heads

#: QK-norm's gains: the queries', the keys' (each (Dh,)), in the order the attention takes them.
QK_GAINS = ("q_gamma", "k_gamma")


def size(shapes: dict) -> int:
    """How many numbers the parameters ``shapes`` (name -> shape) hold."""
    return sum(math.prod(s) for s in shapes.values())


# --------------------------------------------------------------------------- norm

@dataclass(frozen=True)
class Norm:
    """A norm: its parameters ``names``, each (D,), in the order ``forward_pair`` takes them
    (``forward_pair(x, *params, eps) -> (out, cache)``, ``backward_pair(dout, cache) -> (dx,
    *dparams)``); ``later``, whether the paper's block has another."""
    kind: str
    names: tuple
    forward_pair: Callable
    backward_pair: Callable
    later: bool
    eps: float

    def shapes(self, D: int) -> dict:
        return {n: (D,) for n in self.names}

    def forward(self, x, p: dict, name: str):
        """The norm called ``name`` in ``p`` (``norm1``, ``encoder.norm``, ...). Returns: out, cache."""
        return self.forward_pair(x, *(p[f"{name}.{n}"] for n in self.names), self.eps)

    def backward(self, dout, cache, name: str, grads: dict):
        """Backward of :meth:`forward`: its parameters' gradients into ``grads``. Returns: dx."""
        dx, *dparams = self.backward_pair(dout, cache)
        grads.update(zip((f"{name}.{n}" for n in self.names), dparams))
        return dx


NORMS = {"layer": (("gamma", "beta"), layer_norm_forward, layer_norm_backward, False),
         "rms": (("gamma",), rmsnorm_forward, rmsnorm_backward, True)}          # RMSNorm: no mean, no beta


# --------------------------------------------------------------------------- placement

@dataclass(frozen=True)
class PostNorm:
    """The paper's placement: ``LN(x + Dropout(Sublayer(x)))``; the stacks end without a norm.
    ``dropout`` is the residual's, P_drop (section 5.4)."""
    dropout: float
    kind = "post"
    pre = False                             # the sub-layer reads x, not its norm
    final_norm = False

    def before(self, x, norm: Norm, p, name):
        """What the sub-layer reads, and the norm's cache: x itself."""
        return x, None

    def after(self, x, s, cache, norm: Norm, p, name):
        """The sub-layer's output ``s`` (after dropout) added to x, then normed."""
        return norm.forward(x + s, p, name)

    def after_backward(self, dout, cache, norm: Norm, name, grads):
        return norm.backward(dout, cache, name, grads)

    def before_backward(self, dh, cache, norm: Norm, name, grads):
        return dh


@dataclass(frozen=True)
class PreNorm:
    """Later models' placement: ``x + Dropout(Sublayer(LN(x)))``, and a final norm on each stack."""
    dropout: float
    kind = "pre"
    pre = True
    final_norm = True

    def before(self, x, norm: Norm, p, name):
        return norm.forward(x, p, name)

    def after(self, x, s, cache, norm: Norm, p, name):
        return x + s, cache

    def after_backward(self, dout, cache, norm: Norm, name, grads):
        return dout

    def before_backward(self, dh, cache, norm: Norm, name, grads):
        return norm.backward(dh, cache, name, grads)


PLACEMENTS = {"post": PostNorm, "pre": PreNorm}


# --------------------------------------------------------------------------- positions

@dataclass(frozen=True)
class Positions:
    """Where the positions come in: ``added``, a table (L, D) added to the scaled embeddings,
    ``learned`` if the table is the parameters ``src_pos.weight`` and ``tgt_pos.weight`` (else the
    sinusoids of section 3.5); or ``rope_base``, rotary positions turning every self-attention's
    queries and keys (:mod:`attn.layers.rope`). ``stacks``: the stacks that embed tokens
    (``src``, ``tgt``; a decoder-only model's ``tgt`` alone), each with its learned table."""
    kind: str
    added: bool
    learned: bool
    rope_base: float | None
    later: bool
    max_len: int
    stacks: tuple = ("src", "tgt")

    @property
    def rotary(self) -> bool:
        return self.rope_base is not None

    def shapes(self, D: int) -> dict:
        return {f"{w}_pos.weight": (self.max_len, D) for w in self.stacks} if self.learned else {}


#: Each position scheme: (added, learned, rotary); a later model's is rotary.
POSITIONAL = {"sinusoidal": (True, False, False), "learned": (True, True, False), "rope": (False, False, True)}


def _positions(cfg) -> Positions:
    added, learned, rotary = _kind(cfg, "positional", POSITIONAL)
    stacks = ("src", "tgt") if cfg.n_encoder_layers else ("tgt",)
    return Positions(cfg.positional, added, learned, cfg.rope_base if rotary else None, rotary, cfg.max_len, stacks)


# --------------------------------------------------------------------------- attention

#: The parameters of an attention sub-layer, in the order its forward takes them.
ATTENTION = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")


class Attended(NamedTuple):
    """What an attention kept while decoding: the keys and values it attended to, (B, KV, t, Dh)
    each (a self-attention's grown by the new positions), and its weights (B, H, T, t)."""
    k: object
    v: object
    weights: object


@dataclass(frozen=True)
class Attention:
    """Multi-head attention whose keys and values have ``kv_heads`` heads (grouped-query when
    fewer than ``n_heads``; 1: multi-query); ``rope_base``, rotary positions on its queries and
    keys (self-attention only: positions are within one sequence); ``qk_norm``, RMSNorm (``eps``)
    over each head's queries and keys before them (the module docstring)."""
    n_heads: int
    kv_heads: int
    dropout: float
    rope_base: float | None
    qk_norm: bool = False
    eps: float = 1e-6

    @property
    def grouped(self) -> bool:
        """Whether fewer key/value heads than query heads (grouped-query attention)."""
        return self.kv_heads != self.n_heads

    @property
    def names(self) -> tuple:
        """The parameters, in the order the layer's forward takes them (and its backward returns
        their gradients): :data:`ATTENTION`, then QK-norm's gains."""
        return ATTENTION + (QK_GAINS if self.qk_norm else ())

    def shapes(self, D: int) -> dict:
        """w_q, w_o (D, D); w_k, w_v (D, KV) with KV the key/value heads' width; a bias of each
        width; with QK-norm, q_gamma and k_gamma (Dh,)."""
        Dh = D // self.n_heads
        KV = self.kv_heads * Dh
        width = {"q": D, "k": KV, "v": KV, "o": D}
        shapes = {f"{p}_{n}": ((D, width[n]) if p == "w" else (width[n],)) for n in "qkvo" for p in "wb"}
        return {**shapes, **{g: (Dh,) for g in self.names[len(ATTENTION):]}}

    def forward(self, xq, xkv, mask, p: dict, name: str, rng=None, past=None):
        """Training: :func:`attn.layers.multi_head_attention_forward` of the parameters ``name.*``
        in ``p``, returning (out, its cache). Decoding (``past``, the cached keys and values):
        :meth:`step`, returning (out, :class:`Attended`)."""
        if past is not None:
            return self.step(xq, xkv, past, mask, p, name)
        gains = tuple(p[f"{name}.{g}"] for g in self.names[len(ATTENTION):]) or None
        return multi_head_attention_forward(xq, xkv, *(p[f"{name}.{n}"] for n in ATTENTION), n_heads=self.n_heads,
                                            mask=mask, dropout=self.dropout, rng=rng, kv_heads=self.kv_heads,
                                            rope_base=self.rope_base, qk_gains=gains, qk_eps=self.eps)

    def backward(self, ds, cache, name: str, grads: dict):
        """Backward of :meth:`forward` (training): the parameters' gradients into ``grads``.
        Returns: dxq, dxkv (for self-attention the caller adds them)."""
        dxq, dxkv, *dparams = multi_head_attention_backward(ds, cache)
        grads.update(zip((f"{name}.{n}" for n in self.names), dparams))
        return dxq, dxkv

    def norm_heads(self, a, p: dict, name: str, which: str, scale: float = 1.0):
        """QK-norm of the heads ``a`` (..., Dh) of the queries (``which`` "q") or keys ("k") of the
        attention ``name``: ``rmsnorm(a) * gain * scale`` (``scale``: a factor folded into the gain,
        the fast decoding's 1/sqrt(Dh)). Returns: out, its RMSNorm cache; without QK-norm, a
        itself and None."""
        if not self.qk_norm:
            return a, None
        gain = p[f"{name}.{which}_gamma"]
        return rmsnorm_forward(a, gain if scale == 1.0 else gain * gain.dtype.type(scale), self.eps)

    def norm_heads_backward(self, da, cache):
        """Backward of :meth:`norm_heads` (``scale`` 1): ``rmsnorm_backward``, the gain's gradient
        summed over every head, position and row. Returns: da (the heads'), dgain (Dh,)."""
        return rmsnorm_backward(da, cache)

    def heads(self, x, p: dict, name: str, which: str, start: int = 0):
        """x (B, T, D) projected by ``w_which``, split into heads (B, heads, T, Dh), QK-normed
        (queries and keys, when the part has QK-norm), and turned to positions start.. where rotary
        positions turn it (queries and keys)."""
        n = self.n_heads if which == "q" else self.kv_heads
        a = split_heads(linear_forward(x, p[f"{name}.w_{which}"], p[f"{name}.b_{which}"])[0], n)
        if which != "v":
            a = self.norm_heads(a, p, name, which)[0]
        if self.rope_base is not None and which != "v":
            a = rope_forward(a, host.arange(start, start + a.shape[2]), self.rope_base)[0]
        return a

    def step(self, xq, xkv, past, mask, p: dict, name: str):
        """Decoding: the queries of xq (B, T, D) attend to the cached keys and values ``past``
        ((B, KV, t, Dh) each, or None before the first position), followed by xkv's (a
        self-attention's new positions t..; None for a cross-attention, whose cache holds the
        source's). Inference only. Returns: out (B, T, D), :class:`Attended`."""
        k, v = past
        start = 0 if k is None or xkv is None else k.shape[2]
        q = self.heads(xq, p, name, "q", start)                                    # (B, H, T, Dh)
        if xkv is not None:
            k_new, v_new = self.heads(xkv, p, name, "k", start), self.heads(xkv, p, name, "v")
            k = k_new if k is None else _concat(k, k_new)                          # (B, KV, t+T, Dh)
            v = v_new if v is None else _concat(v, v_new)
        group = self.n_heads // self.kv_heads
        o, c = attention_forward(q, repeat_kv(k, group), repeat_kv(v, group), mask)
        out = linear_forward(merge_heads(o), p[f"{name}.w_o"], p[f"{name}.b_o"])[0]
        return out, Attended(k, v, c.weights)


def _concat(a, b):
    """a, b (B, KV, t, Dh) and (B, KV, T, Dh) -> (B, KV, t+T, Dh): positions follow each other."""
    return get_array_module(a).concatenate([a, b], axis=2)


# --------------------------------------------------------------------------- feed-forward

@dataclass(frozen=True)
class FeedForward:
    """The position-wise network: its parameters ``names`` (``ffn.*``) in the order
    ``forward_pair(x, *params, dropout, rng)`` takes them, hidden ``width``, ``dropout`` on the
    hidden layer."""
    kind: str
    names: tuple
    forward_pair: Callable
    backward_pair: Callable
    later: bool
    width: int
    dropout: float

    @property
    def gated(self) -> bool:
        """Whether a gate multiplies the hidden layer (SwiGLU's ``x V``: the parameters ``w3``)."""
        return "w3" in self.names

    @property
    def out_bias(self) -> bool:
        """Whether the output has a bias (``b2``; SwiGLU has none)."""
        return "b2" in self.names

    def shapes(self, D: int) -> dict:
        F = self.width
        every = {"w1": (D, F), "b1": (F,), "w3": (D, F), "w2": (F, D), "b2": (D,)}
        return {n: every[n] for n in self.names}

    def forward(self, x, p: dict, rng=None):
        return self.forward_pair(x, *(p[f"ffn.{n}"] for n in self.names), self.dropout, rng)

    def backward(self, ds, cache, grads: dict):
        """Backward of :meth:`forward`: the parameters' gradients into ``grads``. Returns: dx."""
        dx, *dparams = self.backward_pair(ds, cache)
        grads.update(zip((f"ffn.{n}" for n in self.names), dparams))
        return dx


def _paper_width(d_ff: int) -> int:
    return d_ff


FFNS = {"relu": (("w1", "b1", "w2", "b2"), feed_forward_forward, feed_forward_backward, False, _paper_width),
        # SwiGLU: Llama's names, no biases, 2/3 of d_ff wide (the same parameters)
        "swiglu": (("w1", "w3", "w2"), swiglu_forward, swiglu_backward, True, swiglu_width)}


def _feed_forward(cfg) -> FeedForward:
    names, forward, backward, later, width = _kind(cfg, "ffn", FFNS)
    return FeedForward(cfg.ffn, names, forward, backward, later, width(cfg.d_ff), cfg.relu_dropout)


# --------------------------------------------------------------------------- the block

#: Each option of the block that names a kind, and the kinds its parts know (in the order the
#: command line lists them: the paper's first).
KINDS = {"norm_position": tuple(PLACEMENTS), "norm_kind": tuple(NORMS), "positional": tuple(POSITIONAL),
         "ffn": tuple(FFNS)}


class Block(NamedTuple):
    """The parts of one config's block; the encoder's and decoder's self-attention turn positions
    where the positions are rotary, the cross-attention never does. A decoder-only model
    (``n_encoder_layers=0``, a language model) has no cross-attention: None."""
    norm: Norm
    placement: PostNorm | PreNorm
    positions: Positions
    self_attention: Attention
    cross_attention: Attention | None
    ffn: FeedForward


def _kind(cfg, field: str, kinds: dict):
    """The entry of ``kinds`` that the config's ``field`` names: the one refusal of an unknown kind."""
    value = getattr(cfg, field)
    if not isinstance(value, str) or value not in kinds:
        raise ValueError(f"TransformerConfig: {field} must be one of {', '.join(map(repr, kinds))}, got {value!r}")
    return kinds[value]


def parts(cfg) -> Block:
    """The block's parts for ``cfg`` (a :class:`~attn.model.TransformerConfig`, or anything with
    its fields). Raises ValueError naming the field of a kind no part knows."""
    positions = _positions(cfg)
    norm = Norm(cfg.norm_kind, *_kind(cfg, "norm_kind", NORMS), cfg.ln_eps)
    kv_heads, qk = cfg.kv_heads or cfg.n_heads, dict(qk_norm=getattr(cfg, "qk_norm", False), eps=cfg.ln_eps)
    cross = Attention(cfg.n_heads, kv_heads, cfg.attention_dropout, None, **qk) if cfg.n_encoder_layers else None
    return Block(norm, _kind(cfg, "norm_position", PLACEMENTS)(cfg.dropout), positions,
                 Attention(cfg.n_heads, kv_heads, cfg.attention_dropout, positions.rope_base, **qk),
                 cross, _feed_forward(cfg))


def check(cfg) -> Block:
    """:func:`parts`, and what they need of the numbers: ``kv_heads`` dividing ``n_heads``, an
    even head size for rotary positions, their base; a decoder-only stack (no cross-attention)
    embeds and predicts one vocabulary with one tied matrix. Raises ValueError naming the field."""
    def bad(msg):
        raise ValueError(f"TransformerConfig: {msg}")
    block = parts(cfg)
    if cfg.kv_heads is not None and (not isinstance(cfg.kv_heads, int) or cfg.kv_heads < 1
                                     or cfg.n_heads % cfg.kv_heads):
        bad(f"kv_heads must be None or a positive integer that divides n_heads ({cfg.n_heads}), got {cfg.kv_heads!r}")
    if block.positions.rope_base is not None and (cfg.d_model // cfg.n_heads) % 2:
        bad(f"rotary positions turn pairs of features: the head size d_model / n_heads "
            f"({cfg.d_model // cfg.n_heads}) must be even")
    if not (isinstance(cfg.rope_base, (int, float)) and cfg.rope_base > 1):
        bad(f"rope_base must be a number greater than 1, got {cfg.rope_base!r}")
    if block.cross_attention is None and (not cfg.share_embeddings or cfg.tgt_vocab_size not in (None, cfg.vocab_size)):
        bad(f"a decoder-only model (n_encoder_layers=0) reads and predicts one vocabulary through one tied "
            f"embedding: share_embeddings must be True (got {cfg.share_embeddings!r}) and tgt_vocab_size None "
            f"or vocab_size (got {cfg.tgt_vocab_size!r})")
    if not isinstance(block.self_attention.qk_norm, bool):
        bad(f"qk_norm must be True or False, got {block.self_attention.qk_norm!r}")
    return block


def later_block(cfg) -> list[str]:
    """The parts of a later model's block that ``cfg`` asks for (lesson 26), as ``field=value``:
    empty for the paper's block, post- or pre-norm."""
    block = parts(cfg)
    named = (("positional", block.positions.later), ("ffn", block.ffn.later), ("kv_heads", block.self_attention.grouped),
             ("norm_kind", block.norm.later), ("qk_norm", block.self_attention.qk_norm))
    return [f"{field}={getattr(cfg, field)!r}" for field, later in named if later]

"""The Transformer (section 3): configuration, parameters, forward, backward, save/load.

    src ids ─ embed·√D + PE ─ dropout ─ [self-attn, FFN] × N ───────────── memory
    tgt ids ─ embed·√D + PE ─ dropout ─ [masked self-attn, cross-attn(memory), FFN] × N
            ─ @ Eᵀ (the embedding matrix, shared) ─ logits

Every sub-layer sits in a residual connection with dropout, followed by layer
norm (post-norm, as in the paper): ``LayerNorm(x + Dropout(Sublayer(x)))``.
``norm="pre"`` gives ``x + Dropout(Sublayer(LayerNorm(x)))`` with a final norm.

The model owns a ``params`` dict with stable dotted names and assembles the
forward/backward pairs of :mod:`attn.layers`. ``forward`` returns
``(logits, cache)`` and ``backward(dlogits, cache)`` returns a ``grads`` dict
keyed like ``params``; gradients of a parameter used in several places (the
shared embedding) are accumulated, never overwritten.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from . import backend as B
from .checkpoint import CheckpointError, load_npz, save_npz
from .layers import (dropout_backward, dropout_forward, embedding_backward, embedding_forward,
                     feed_forward_backward, feed_forward_forward, layer_norm_backward,
                     layer_norm_forward, multi_head_attention_backward,
                     multi_head_attention_forward, positional_backward, positional_forward,
                     sinusoidal_table)
from .layers.attention import attention_forward, merge_heads, split_heads
from .masks import decoder_mask, padding_mask

# --------------------------------------------------------------------------- config

PRESETS = {
    # The default translator: small enough to train in minutes on two CPU cores.
    "toy": dict(d_model=128, n_heads=4, d_ff=512, n_encoder_layers=2, n_decoder_layers=2,
                dropout=0.1, label_smoothing=0.1, warmup_steps=400, max_len=128),
    # What tutorials train on Multi30k.
    "small": dict(d_model=256, n_heads=8, d_ff=512, n_encoder_layers=3, n_decoder_layers=3,
                  dropout=0.1, label_smoothing=0.1, warmup_steps=2000, max_len=256),
    # The paper's base model (Table 3).
    "base": dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6,
                 dropout=0.1, label_smoothing=0.1, warmup_steps=4000, max_len=256),
}


@dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters; the defaults are the paper's base model (Table 3).

    ``vocab_size`` is the source vocabulary, and the target's too unless
    ``tgt_vocab_size`` is given. ``share_embeddings`` ties the source embedding,
    the target embedding and the pre-softmax projection (section 3.4); it needs
    one shared vocabulary.
    """
    vocab_size: int = 37000
    tgt_vocab_size: int | None = None
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1             # residual and embedding dropout, P_drop (section 5.4)
    attention_dropout: float = 0.0   # on the attention weights (not in the paper's text)
    relu_dropout: float = 0.0        # on the FFN's hidden layer (not in the paper's text)
    label_smoothing: float = 0.1     # epsilon_ls (section 5.4)
    max_len: int = 256               # rows of the positional table (sinusoids extend on demand)
    positional: str = "sinusoidal"   # or "learned" (Table 3, row E)
    norm: str = "post"               # "post" (the paper) or "pre"
    share_embeddings: bool = True
    ln_eps: float = 1e-6
    warmup_steps: int = 4000         # of the learning-rate schedule (section 5.3)

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"TransformerConfig: {msg}")
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                bad(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("n_encoder_layers", "n_decoder_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.tgt_vocab_size is not None and (not isinstance(self.tgt_vocab_size, int) or self.tgt_vocab_size <= 0):
            bad(f"tgt_vocab_size must be a positive integer or None, got {self.tgt_vocab_size!r}")
        if self.d_model % self.n_heads:
            bad(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        for name in ("dropout", "attention_dropout", "relu_dropout", "label_smoothing"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                bad(f"{name} must be in [0, 1), got {v!r}")
        if self.positional not in ("sinusoidal", "learned"):
            bad(f"positional must be 'sinusoidal' or 'learned', got {self.positional!r}")
        if self.norm not in ("post", "pre"):
            bad(f"norm must be 'post' or 'pre', got {self.norm!r}")
        if self.share_embeddings and self.tgt_vocab_size not in (None, self.vocab_size):
            bad(f"share_embeddings needs one vocabulary, got vocab_size {self.vocab_size} "
                f"and tgt_vocab_size {self.tgt_vocab_size}")
        if self.warmup_steps < 1:
            bad(f"warmup_steps must be positive, got {self.warmup_steps!r}")

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size or self.vocab_size

    @classmethod
    def preset(cls, name: str, **overrides) -> "TransformerConfig":
        """A named configuration (``toy``, ``small``, ``base``) with optional overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TransformerConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"TransformerConfig: unknown fields {unknown}")
        return cls(**d)


# --------------------------------------------------------------------------- parameters

def _attention_shapes(D):
    return {f"{p}_{n}": ((D, D) if p == "w" else (D,)) for n in "qkvo" for p in "wb"}


def parameter_shapes(cfg: TransformerConfig) -> dict:
    """Every parameter's dotted name and shape, in a stable order."""
    D, F = cfg.d_model, cfg.d_ff
    shapes = {}
    if cfg.share_embeddings:
        shapes["embedding.weight"] = (cfg.vocab_size, D)
    else:
        shapes["src_embedding.weight"] = (cfg.vocab_size, D)
        shapes["tgt_embedding.weight"] = (cfg.target_vocab_size, D)
        shapes["generator.weight"] = (cfg.target_vocab_size, D)
    if cfg.positional == "learned":
        shapes["src_pos.weight"] = (cfg.max_len, D)
        shapes["tgt_pos.weight"] = (cfg.max_len, D)
    ffn = {"w1": (D, F), "b1": (F,), "w2": (F, D), "b2": (D,)}
    norm = {"gamma": (D,), "beta": (D,)}
    blocks = {"encoder": [("self_attn", _attention_shapes(D)), ("norm1", norm), ("ffn", ffn), ("norm2", norm)],
              "decoder": [("self_attn", _attention_shapes(D)), ("norm1", norm),
                          ("cross_attn", _attention_shapes(D)), ("norm2", norm), ("ffn", ffn), ("norm3", norm)]}
    for stack, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(n):
            for sub, fields in blocks[stack]:
                for f, shape in fields.items():
                    shapes[f"{stack}.{i}.{sub}.{f}"] = shape
        if cfg.norm == "pre":
            shapes[f"{stack}.norm.gamma"] = (D,)
            shapes[f"{stack}.norm.beta"] = (D,)
    return shapes


def init_params(cfg: TransformerConfig, seed: int = 0, dtype="float32") -> dict:
    """Initial parameters, drawn on the host from one seeded generator (so NumPy and
    CuPy start from identical numbers), then moved to the selected backend.

    Matrices: Xavier/Glorot uniform. Embeddings: normal with std ``d_model**-0.5``,
    so that the embedding scaled by ``sqrt(d_model)`` has unit variance. Biases 0,
    layer-norm gains 1. Learned positions: normal with std 0.02.
    """
    rng = B.host_rng(seed)
    np = B.host
    params = {}
    for name, shape in parameter_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[1]
        if name.endswith("_pos.weight"):
            a = rng.normal(0.0, 0.02, shape)
        elif name.endswith(".weight"):
            a = rng.normal(0.0, cfg.d_model ** -0.5, shape)
        elif leaf == "gamma":
            a = np.ones(shape)
        elif len(shape) == 1:
            a = np.zeros(shape)
        else:
            limit = math.sqrt(6.0 / (shape[0] + shape[1]))
            a = rng.uniform(-limit, limit, shape)
        params[name] = B.to_device(a.astype(dtype))
    return params


# --------------------------------------------------------------------------- caches

class ResidualCache(NamedTuple):
    """One sub-layer in its residual connection: the norm's, the sub-layer's and the dropout's caches."""
    norm: object
    sub: object
    drop: object


class StackCache(NamedTuple):
    """Embedding, positional and dropout caches, then one list of ResidualCaches per layer."""
    embed: object
    pos: object
    drop: object
    layers: list
    final_norm: object


class ForwardCache(NamedTuple):
    """Everything :meth:`Transformer.backward` needs: both stacks, the decoder output and the masks."""
    enc: StackCache
    dec: StackCache
    dec_out: object
    src_mask: object
    tgt_mask: object


class Transformer:
    """The encoder-decoder Transformer of section 3 with hand-written backward.

    Inputs to :meth:`forward`: ``src`` (B, S) and ``tgt_in`` (B, T) integer ids,
    padded with ``PAD_ID`` (0). Outputs: logits (B, T, V_tgt).
    """

    #: What :mod:`attn.engine` asks of every engine's model, answered for the readable one: its
    #: gradients are separate arrays (no flat buffer to all-reduce in place), and its attention
    #: weights are (B, H, Tq, Tk), sentences first.
    gradient_arena = None
    keys_first = False

    def __init__(self, config: TransformerConfig, seed: int = 0, dtype="float32", params: dict | None = None):
        self.config = config
        self.dtype = B.host.dtype(dtype)
        self.params = params if params is not None else init_params(config, seed, dtype)
        self._pe = None

    # ------------------------------------------------------------------ helpers

    @property
    def xp(self):
        return B.get_array_module(next(iter(self.params.values())))

    def _emb(self, which: str) -> str:
        if self.config.share_embeddings:
            return "embedding.weight"
        return {"src": "src_embedding.weight", "tgt": "tgt_embedding.weight", "out": "generator.weight"}[which]

    def _pos_table(self, which: str, T: int):
        """The positional table (L, D) with L >= T: a parameter, or the sinusoids,
        extended on demand so that no length is ever silently wrong."""
        if self.config.positional == "learned":
            return self.params[f"{which}_pos.weight"]
        xp = self.xp
        if self._pe is None or self._pe.shape[0] < T or self._pe.dtype != self.dtype or \
                B.get_array_module(self._pe) is not xp:
            self._pe = xp.asarray(sinusoidal_table(max(2 * T, self.config.max_len), self.config.d_model, self.dtype))
        return self._pe

    def num_parameters(self) -> int:
        return int(sum(int(p.size) for p in self.params.values()))

    # ------------------------------------------------------------------ sub-layers

    def _attn_fwd(self, pre, xq, xkv, mask, rng):
        p = self.params
        return multi_head_attention_forward(
            xq, xkv, p[pre + ".w_q"], p[pre + ".b_q"], p[pre + ".w_k"], p[pre + ".b_k"],
            p[pre + ".w_v"], p[pre + ".b_v"], p[pre + ".w_o"], p[pre + ".b_o"],
            self.config.n_heads, mask, self.config.attention_dropout, rng)

    def _attn_bwd(self, pre, dout, cache, grads):
        dxq, dxkv, *dparams = multi_head_attention_backward(dout, cache)
        for name, g in zip(("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o"), dparams):
            _acc(grads, f"{pre}.{name}", g)
        return dxq, dxkv

    def _ffn_fwd(self, pre, x, rng):
        p = self.params
        return feed_forward_forward(x, p[pre + ".w1"], p[pre + ".b1"], p[pre + ".w2"], p[pre + ".b2"],
                                    self.config.relu_dropout, rng)

    def _ffn_bwd(self, pre, dout, cache, grads):
        dx, *dparams = feed_forward_backward(dout, cache)
        for name, g in zip(("w1", "b1", "w2", "b2"), dparams):
            _acc(grads, f"{pre}.{name}", g)
        return dx

    def _norm_fwd(self, pre, x):
        return layer_norm_forward(x, self.params[pre + ".gamma"], self.params[pre + ".beta"], self.config.ln_eps)

    def _norm_bwd(self, pre, dout, cache, grads):
        dx, dg, db = layer_norm_backward(dout, cache)
        _acc(grads, pre + ".gamma", dg)
        _acc(grads, pre + ".beta", db)
        return dx

    def _residual_fwd(self, norm, x, sublayer, rng):
        """post: ``LN(x + drop(sublayer(x)))``; pre: ``x + drop(sublayer(LN(x)))``."""
        if self.config.norm == "pre":
            h, cn = self._norm_fwd(norm, x)
            s, cs = sublayer(h)
            s, cd = dropout_forward(s, self.config.dropout, rng)
            return x + s, ResidualCache(cn, cs, cd)
        s, cs = sublayer(x)
        s, cd = dropout_forward(s, self.config.dropout, rng)
        out, cn = self._norm_fwd(norm, x + s)
        return out, ResidualCache(cn, cs, cd)

    def _residual_bwd(self, norm, dout, cache, sublayer_bwd, grads):
        """Backward of :meth:`_residual_fwd`: the residual path carries the gradient
        straight through, the sub-layer path adds its own. ``sublayer_bwd(ds, cache)``
        returns the gradient of the sub-layer's input."""
        if self.config.norm == "pre":
            ds = dropout_backward(dout, cache.drop)
            dh = sublayer_bwd(ds, cache.sub)
            return dout + self._norm_bwd(norm, dh, cache.norm, grads)
        dy = self._norm_bwd(norm, dout, cache.norm, grads)       # y = x + drop(s)
        ds = dropout_backward(dy, cache.drop)
        return dy + sublayer_bwd(ds, cache.sub)

    # ------------------------------------------------------------------ stacks

    def _embed_fwd(self, which, ids, rng):
        D = self.config.d_model
        x, ce = embedding_forward(ids, self.params[self._emb(which)], math.sqrt(D))    # (B, T, D)
        x, cp = positional_forward(x, self._pos_table(which, ids.shape[1]))
        x, cd = dropout_forward(x, self.config.dropout, rng)
        return x, ce, cp, cd

    def _embed_bwd(self, which, dx, cache: StackCache, grads):
        dx = dropout_backward(dx, cache.drop)
        dx, dtable = positional_backward(dx, cache.pos)
        if self.config.positional == "learned":
            _acc(grads, f"{which}_pos.weight", dtable)
        _acc(grads, self._emb(which), embedding_backward(dx, cache.embed))

    def encode(self, src, rng=None, src_mask=None):
        """Encoder stack. Inputs: src (B, S) ids. Returns: memory (B, S, D), cache."""
        src_mask = padding_mask(src) if src_mask is None else src_mask        # (B, 1, 1, S)
        x, ce, cp, cd = self._embed_fwd("src", src, rng)
        layers = []
        for i in range(self.config.n_encoder_layers):
            pre = f"encoder.{i}"
            x, c1 = self._residual_fwd(pre + ".norm1", x,
                                       lambda h: self._attn_fwd(pre + ".self_attn", h, h, src_mask, rng), rng)
            x, c2 = self._residual_fwd(pre + ".norm2", x, lambda h: self._ffn_fwd(pre + ".ffn", h, rng), rng)
            layers.append((c1, c2))
        cn = None
        if self.config.norm == "pre":
            x, cn = self._norm_fwd("encoder.norm", x)
        return x, StackCache(ce, cp, cd, layers, cn)

    def decode(self, tgt_in, memory, src_mask, rng=None, cross_kv=None, keep_weights=True):
        """Decoder stack. Inputs: tgt_in (B, T) ids; memory (B, S, D); src_mask (B, 1, 1, S).
        Returns: decoder output (B, T, D), cache, tgt_mask.

        (For a search that runs the decoder on the whole prefix, ``cross_kv`` are the memory's
        keys and values precomputed by :meth:`cross_attention_kv`, and ``keep_weights=False``
        says no attention weight will be read: a faster engine uses both; this model recomputes
        the keys and values from ``memory`` and keeps every weight, as training needs.)"""
        tgt_mask = decoder_mask(tgt_in)                                        # (B, 1, T, T)
        x, ce, cp, cd = self._embed_fwd("tgt", tgt_in, rng)
        layers = []
        for i in range(self.config.n_decoder_layers):
            pre = f"decoder.{i}"
            x, c1 = self._residual_fwd(pre + ".norm1", x,
                                       lambda h: self._attn_fwd(pre + ".self_attn", h, h, tgt_mask, rng), rng)
            x, c2 = self._residual_fwd(pre + ".norm2", x,
                                       lambda h: self._attn_fwd(pre + ".cross_attn", h, memory, src_mask, rng), rng)
            x, c3 = self._residual_fwd(pre + ".norm3", x, lambda h: self._ffn_fwd(pre + ".ffn", h, rng), rng)
            layers.append((c1, c2, c3))
        cn = None
        if self.config.norm == "pre":
            x, cn = self._norm_fwd("decoder.norm", x)
        return x, StackCache(ce, cp, cd, layers, cn), tgt_mask

    def project(self, h):
        """Pre-softmax projection with the (shared) embedding matrix: (..., D) -> (..., V)."""
        E = self.params[self._emb("out")]                                       # (V, D)
        return (h.reshape(-1, h.shape[-1]) @ E.T).reshape(*h.shape[:-1], E.shape[0])

    def forward(self, src, tgt_in, rng=None):
        """Inputs: src (B, S), tgt_in (B, T) integer ids; rng a DeviceRNG for dropout
        (None: no dropout, as in evaluation).

        Returns: logits (B, T, V_tgt), cache for :meth:`backward`.
        """
        if src.ndim != 2 or tgt_in.ndim != 2 or src.shape[0] != tgt_in.shape[0]:
            raise ValueError(f"Transformer.forward: src and tgt_in must be (B, S) and (B, T) with one B, "
                             f"got {tuple(src.shape)} and {tuple(tgt_in.shape)}")
        src_mask = padding_mask(src)
        memory, enc = self.encode(src, rng, src_mask)
        h, dec, tgt_mask = self.decode(tgt_in, memory, src_mask, rng)
        return self.project(h), ForwardCache(enc, dec, h, src_mask, tgt_mask)

    def backward(self, dlogits, cache: ForwardCache, grads: dict | None = None) -> dict:
        """Inputs: dlogits (B, T, V_tgt), the cache of :meth:`forward`; ``grads`` the dict to
        fill (default: a new one), filled layer by layer from the last (data parallelism passes
        one that sends each layer's gradients as soon as they are final:
        :class:`attn.training.distributed.BucketFeed`).

        Returns: grads, a dict keyed like ``params``.
        """
        grads = {} if grads is None else grads
        h = cache.dec_out
        D = h.shape[-1]
        # Forward was logits = h @ E.T, so dh = dlogits @ E and dE += dlogits.T @ h.
        E = self.params[self._emb("out")]
        d2 = dlogits.reshape(-1, E.shape[0])                                  # (B*T, V)
        _acc(grads, self._emb("out"), d2.T @ h.reshape(-1, D))
        dx = (d2 @ E).reshape(h.shape)                                        # (B, T, D)

        dec = cache.dec
        if dec.final_norm is not None:
            dx = self._norm_bwd("decoder.norm", dx, dec.final_norm, grads)
        dmemory = None
        for i in reversed(range(self.config.n_decoder_layers)):
            pre = f"decoder.{i}"
            c1, c2, c3 = dec.layers[i]
            dx = self._residual_bwd(pre + ".norm3", dx, c3,
                                    lambda d, c: self._ffn_bwd(pre + ".ffn", d, c, grads), grads)
            dmem_i = []

            def cross_bwd(d, c):
                dq, dkv = self._attn_bwd(pre + ".cross_attn", d, c, grads)
                dmem_i.append(dkv)
                return dq
            dx = self._residual_bwd(pre + ".norm2", dx, c2, cross_bwd, grads)
            dmemory = dmem_i[0] if dmemory is None else dmemory + dmem_i[0]
            dx = self._residual_bwd(pre + ".norm1", dx, c1,
                                    lambda d, c: _sum2(self._attn_bwd(pre + ".self_attn", d, c, grads)), grads)
        self._embed_bwd("tgt", dx, dec, grads)

        enc = cache.enc
        dx = dmemory
        if enc.final_norm is not None:
            dx = self._norm_bwd("encoder.norm", dx, enc.final_norm, grads)
        for i in reversed(range(self.config.n_encoder_layers)):
            pre = f"encoder.{i}"
            c1, c2 = enc.layers[i]
            dx = self._residual_bwd(pre + ".norm2", dx, c2,
                                    lambda d, c: self._ffn_bwd(pre + ".ffn", d, c, grads), grads)
            dx = self._residual_bwd(pre + ".norm1", dx, c1,
                                    lambda d, c: _sum2(self._attn_bwd(pre + ".self_attn", d, c, grads)), grads)
        self._embed_bwd("src", dx, enc, grads)
        return grads

    @staticmethod
    def attention_weights(cache: ForwardCache) -> dict:
        """The attention weights of a forward pass, by sub-layer name:
        ``encoder.i.self_attn`` (B, H, S, S), ``decoder.i.self_attn`` (B, H, T, T),
        ``decoder.i.cross_attn`` (B, H, T, S)."""
        out = {}
        for i, (c1, _) in enumerate(cache.enc.layers):
            out[f"encoder.{i}.self_attn"] = c1.sub.attn.weights
        for i, (c1, c2, _) in enumerate(cache.dec.layers):
            out[f"decoder.{i}.self_attn"] = c1.sub.attn.weights
            out[f"decoder.{i}.cross_attn"] = c2.sub.attn.weights
        return out

    # ------------------------------------------------------------------ incremental decoding

    def cross_attention_kv(self, memory) -> list:
        """Each decoder layer's cross-attention keys and values, (B, H, S, Dh) each, from the
        encoder output (B, S, D): they depend on the source alone."""
        p, H = self.params, self.config.n_heads
        cross = []
        for i in range(self.config.n_decoder_layers):
            pre = f"decoder.{i}.cross_attn"
            k = split_heads(_affine(memory, p[pre + ".w_k"], p[pre + ".b_k"]), H)   # (B, H, S, Dh)
            v = split_heads(_affine(memory, p[pre + ".w_v"], p[pre + ".b_v"]), H)
            cross.append((k, v))
        return cross

    def _decoding_params(self) -> dict:
        """The parameters :meth:`decode_step` reads (a faster model may hand it copies laid out
        for its products)."""
        return self.params

    def step_memory(self, key=None):
        """Where a training step's arrays come from: here, the array library's own memory, as
        anywhere else, and the context's value is None (a faster engine may give each step the
        same addresses, and says so with a true value; ``key``, the batch's shapes, tells it
        which steps ask for the same arrays)."""
        return contextlib.nullcontext()

    def start_decoding(self, memory, src_mask, reserve=None) -> "DecodeState":
        """Precompute each decoder layer's cross-attention keys and values from the
        encoder output once. Returns the state for :meth:`decode_step`. (``reserve``, the most
        rows and positions a search will step, lets a faster engine size its buffers once; the
        state here grows as it goes.)"""
        empty = [(None, None)] * self.config.n_decoder_layers
        return DecodeState(self.cross_attention_kv(memory), list(empty), src_mask, 0)

    def decode_step(self, tokens, state: "DecodeState"):
        """One decoder position for every sequence in the batch, attending to the
        cached keys/values of the earlier positions: the cost of a step does not
        grow with a recomputed prefix.

        Inputs: tokens (B,) the ids at position ``state.length``. Returns:
        log-probabilities (B, V_tgt) for the next token, the new state, and the
        cross-attention weights of every layer (list of (B, H, 1, S)).
        """
        cfg, p, H = self.config, self._decoding_params(), self.config.n_heads
        pos = state.length
        if cfg.positional == "learned" and pos >= cfg.max_len:     # as forward() says it, not an IndexError
            raise ValueError(f"decode_step: sequence length {pos + 1} exceeds the learned positional "
                             f"table's {cfg.max_len} positions (raise max_len)")
        x = self.params[self._emb("tgt")][tokens] * self.dtype.type(math.sqrt(cfg.d_model))  # (B, D)
        x = (x + self._pos_table("tgt", pos + 1)[pos])[:, None, :]                           # (B, 1, D)
        new_self, cross_w = [], []
        for i in range(cfg.n_decoder_layers):
            pre = f"decoder.{i}"
            kc, vc = state.self_kv[i]

            def self_attn(h):
                q = split_heads(_affine(h, p[pre + ".self_attn.w_q"], p[pre + ".self_attn.b_q"]), H)
                k = split_heads(_affine(h, p[pre + ".self_attn.w_k"], p[pre + ".self_attn.b_k"]), H)
                v = split_heads(_affine(h, p[pre + ".self_attn.w_v"], p[pre + ".self_attn.b_v"]), H)
                k_all = k if kc is None else self.xp.concatenate([kc, k], axis=2)        # (B, H, t+1, Dh)
                v_all = v if vc is None else self.xp.concatenate([vc, v], axis=2)
                new_self.append((k_all, v_all))
                o, _ = attention_forward(q, k_all, v_all)                                 # no mask: all past
                return _affine(merge_heads(o), p[pre + ".self_attn.w_o"], p[pre + ".self_attn.b_o"])

            def cross_attn(h):
                q = split_heads(_affine(h, p[pre + ".cross_attn.w_q"], p[pre + ".cross_attn.b_q"]), H)
                k, v = state.cross_kv[i]
                o, c = attention_forward(q, k, v, state.src_mask)
                cross_w.append(c.weights)
                return _affine(merge_heads(o), p[pre + ".cross_attn.w_o"], p[pre + ".cross_attn.b_o"])

            def ffn(h):
                return self._ffn_fwd(pre + ".ffn", h, None)[0]

            x = self._residual_infer(pre + ".norm1", x, self_attn)
            x = self._residual_infer(pre + ".norm2", x, cross_attn)
            x = self._residual_infer(pre + ".norm3", x, ffn)
        if cfg.norm == "pre":
            x = self._norm_fwd("decoder.norm", x)[0]
        logits = self.project(x[:, 0, :])                                                # (B, V)
        return log_softmax(logits), DecodeState(state.cross_kv, new_self, state.src_mask, pos + 1), cross_w

    def _residual_infer(self, norm, x, sublayer):
        if self.config.norm == "pre":
            return x + sublayer(self._norm_fwd(norm, x)[0])
        return self._norm_fwd(norm, x + sublayer(x))[0]

    # ------------------------------------------------------------------ choosing tokens

    def greedy_pick(self, logp, banned, info, tokens) -> None:
        """Greedy decoding's choice at one position, written in place: ``info`` (2, n) float64 <-
        the most probable token of each row of ``logp`` (n, V), the ids ``banned`` excluded, and
        its log-probability; ``tokens`` (n,) <- the same ids."""
        xp = B.get_array_module(logp)
        logp[:, list(banned)] = -float("inf")
        nxt = logp.argmax(axis=-1)                                                     # (n,)
        info[0] = nxt
        info[1] = xp.take_along_axis(logp, nxt[:, None], axis=1)[:, 0]
        tokens[...] = nxt

    def beam_candidates(self, logp, beam_scores, W: int, c: int, C: int, banned):
        """Beam search's best ``C`` continuations of each sentence, on the host: (2, n, C) float64,
        their scores (log P so far plus the token's) and ids ``w * V + v`` (beam, token), in no
        order. ``logp`` (n*W, V) the step's log-probabilities (changed in place), ``beam_scores``
        (n, W) float64, ``c`` <= V the tokens kept per beam, ``banned`` ids never chosen.

        A sentence's best C candidates are among each of its beams' best c tokens (a beam's
        score is the same for all its tokens): pick those first, over V in float32, then rank
        the W * c survivors in float64, instead of all W * V of them."""
        xp = B.get_array_module(logp)
        nl, V = beam_scores.shape[0], logp.shape[1]
        logp[:, list(banned)] = -float("inf")
        neg = xp.negative(logp, out=logp)               # the best are the least
        top_v = least_columns(neg, c)                                                 # (n*W, c)
        top_lp = -xp.take_along_axis(neg, top_v, axis=1)
        cand = (beam_scores[:, :, None] + top_lp.reshape(nl, W, c).astype(xp.float64)).reshape(nl, W * c)
        flat = (xp.arange(W)[None, :, None] * V + top_v.reshape(nl, W, c)).reshape(nl, W * c)  # id w*V + v
        top = xp.argpartition(-cand, C - 1, axis=1)[:, :C]                            # (n, C), unordered
        top_s = xp.take_along_axis(cand, top, axis=1)
        top_f = xp.take_along_axis(flat, top, axis=1)
        return B.to_host(xp.stack([top_s, top_f.astype(xp.float64)]))

    # ------------------------------------------------------------------ save / load

    def state_arrays(self) -> dict:
        return {f"param/{k}": v for k, v in self.params.items()}

    def save(self, path, extra_arrays: dict | None = None, extra_meta: dict | None = None):
        """Write the config and every parameter to ``path`` (.npz, atomically)."""
        meta = {"format": "attn-checkpoint-1", "config": self.config.to_dict(), **(extra_meta or {})}
        return save_npz(path, {**self.state_arrays(), **(extra_arrays or {})}, meta)

    @classmethod
    def load(cls, path, config: TransformerConfig | None = None, dtype=None) -> "Transformer":
        """Load a model saved by :meth:`save` on either backend onto the selected one.

        ``config``, if given, must equal the file's; any difference, or parameters
        missing, unexpected or of the wrong shape, is a CheckpointError listing them.
        """
        arrays, meta = load_npz(path)
        return cls.from_arrays(arrays, meta, config, dtype, source=str(path))

    @classmethod
    def from_arrays(cls, arrays, meta, config=None, dtype=None, source="checkpoint"):
        if "config" not in meta:
            raise CheckpointError(f"{source} holds no model config")
        try:
            file_cfg = TransformerConfig.from_dict(meta["config"])
        except (TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{source} has an invalid config: {e}") from None
        if config is not None and config != file_cfg:
            a, b = config.to_dict(), file_cfg.to_dict()
            diff = ", ".join(f"{k}: expected {a[k]!r}, file has {b[k]!r}" for k in a if a[k] != b[k])
            raise CheckpointError(f"{source}: config does not match: {diff}")
        expected = parameter_shapes(file_cfg)
        found = {k[len("param/"):]: v for k, v in arrays.items() if k.startswith("param/")}
        problems = [f"missing {k}" for k in expected if k not in found]
        problems += [f"unexpected {k}" for k in found if k not in expected]
        problems += [f"{k} has shape {tuple(found[k].shape)}, expected {expected[k]}"
                     for k in expected if k in found and tuple(found[k].shape) != tuple(expected[k])]
        problems += [f"{k} holds {found[k].dtype} numbers, not floating point ones"
                     for k in expected if k in found and found[k].dtype.kind != "f"]
        if problems:
            raise CheckpointError(f"{source} does not fit its config: " + "; ".join(problems))
        dtype = dtype or next(iter(found.values())).dtype
        if dtype not in ("float32", "float64"):
            dtype = "float32"
        params = {k: B.to_device(found[k], dtype) for k in expected}
        return cls(file_cfg, dtype=dtype, params=params)


class DecodeState(NamedTuple):
    """Incremental decoding: per decoder layer the cross-attention (k, v) of the
    encoder output (B, H, S, Dh) and the self-attention (k, v) of the positions
    decoded so far (B, H, t, Dh); the source mask; how many positions are done."""
    cross_kv: list
    self_kv: list
    src_mask: object
    length: int

    def select(self, index, index_host=None) -> "DecodeState":
        """Keep (and repeat) batch rows ``index``: beam search reorders hypotheses with it.
        (``index_host``, the same on the host, is for states that plan on the host.)"""
        cross = [(k[index], v[index]) for k, v in self.cross_kv]
        self_kv = [(None, None) if k is None else (k[index], v[index]) for k, v in self.self_kv]
        return DecodeState(cross, self_kv, self.src_mask[index], self.length)


#: Columns per block in :func:`least_columns`'s first round.
PRESELECT_BLOCK = 256


def least_columns(a, c: int):
    """The column ids (R, c) of c least entries of each row of ``a`` (R, V): beam search's
    preselection of each beam's best tokens. Among entries tied with the c-th least value,
    the ones kept are those ``argpartition`` keeps (not the lowest ids: breaking exact ties
    by id would cost a sort at every step).

    With many columns, in two rounds: the c blocks of :data:`PRESELECT_BLOCK` columns with
    the least minima hold c least entries, so only those blocks (and the last, shorter one)
    are searched, not all V columns."""
    xp = B.get_array_module(a)
    R, V = a.shape
    b = PRESELECT_BLOCK
    nb = V // b
    if nb <= 2 * c:                                           # few blocks: search every column
        ids = xp.broadcast_to(xp.arange(V), (R, V))
        vals = a
    else:
        minima = a[:, :nb * b].reshape(R, nb, b).min(axis=2)                      # (R, nb)
        blocks = xp.argpartition(minima, c - 1, axis=1)[:, :c]
        ids = (blocks[:, :, None] * b + xp.arange(b)).reshape(R, c * b)
        if nb * b < V:
            ids = xp.concatenate([ids, xp.broadcast_to(xp.arange(nb * b, V), (R, V - nb * b))], axis=1)
        vals = xp.take_along_axis(a, ids, axis=1)
    least = xp.argpartition(vals, c - 1, axis=1)[:, :c]
    return xp.take_along_axis(ids, least, axis=1)


def log_softmax(x):
    """Log-probabilities over the last axis (inference only)."""
    xp = B.get_array_module(x)
    s = x - x.max(axis=-1, keepdims=True)
    return s - xp.log(xp.exp(s).sum(axis=-1, keepdims=True))


def _affine(x, w, b):
    return (x.reshape(-1, w.shape[0]) @ w).reshape(*x.shape[:-1], w.shape[1]) + b


def _sum2(pair):
    return pair[0] + pair[1]


def _acc(grads: dict, name: str, g) -> None:
    """Accumulate: a parameter used twice (the shared embedding) gets both contributions."""
    if name in grads:
        grads[name] = grads[name] + g
    else:
        grads[name] = g

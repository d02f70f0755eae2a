"""The Transformer (section 3): configuration, parameters, forward, backward, save/load.

    src ids ─ embed·√D + PE ─ dropout ─ [self-attn, FFN] × N ───────────── memory
    tgt ids ─ embed·√D + PE ─ dropout ─ [masked self-attn, cross-attn(memory), FFN] × N
            ─ @ Eᵀ (the embedding matrix, shared) ─ logits

Every sub-layer sits in a residual connection with dropout, followed by layer
norm (post-norm, as in the paper): ``LayerNorm(x + Dropout(Sublayer(x)))``.
``norm_position="pre"`` gives ``x + Dropout(Sublayer(LayerNorm(x)))`` with a final norm.

``n_encoder_layers=0`` is a decoder-only language model (GPT; lesson 24) of the same block: no
encoder, no cross-attention, ``forward(None, ids)``, the same decoder layers and decoding.

The block of later models is five options away, each off by default (lesson 26):
``positional="rope"`` (rotary positions on every self-attention's queries and keys instead
of a table added to the embeddings), ``ffn="swiglu"`` (the gated network, at the width that
keeps the parameter count), ``kv_heads`` (grouped-query attention), ``norm_kind="rms"`` and
``qk_norm`` (RMSNorm over each head's queries and keys, before the scores).
:mod:`attn.block` turns a config into the block's named parts, which the layers here ask.

The model owns a ``params`` dict with stable dotted names and assembles the
forward/backward pairs of :mod:`attn.layers`. ``forward`` returns
``(logits, cache)`` and ``backward(dlogits, cache)`` returns a ``grads`` dict
keyed like ``params``; gradients of a parameter used in several places (the
shared embedding) are accumulated, never overwritten.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

from . import backend as B
from .block import Block, check, parts, size
from .block import later_block  # noqa: F401  (the engine and the tests ask the model for it)
from .checkpoint import CheckpointError, load_npz, save_npz
from .layers import (dropout_backward, dropout_forward, embedding_backward, embedding_forward,
                     positional_backward, positional_forward, sinusoidal_table)
from .masks import cached_causal_mask, decoder_mask, padding_mask


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
    # nanoGPT's shakespeare_char for a CPU: a decoder-only language model of 4 pre-norm layers, 4
    # heads, width 128, learned positions for a context of 64, no dropout (attn-train --task lm).
    "shakespeare_char": dict(d_model=128, n_heads=4, d_ff=512, n_encoder_layers=0, n_decoder_layers=4,
                             dropout=0.0, label_smoothing=0.0, warmup_steps=100, max_len=64,
                             norm_position="pre", positional="learned"),
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
    positional: str = "sinusoidal"   # or "learned" (Table 3, row E), or "rope" (rotary, lesson 26)
    norm_position: str = "post"      # where the norm sits: "post" (the paper) or "pre"
    norm_kind: str = "layer"         # "layer" (the paper's layer norm) or "rms" (RMSNorm: no mean, no beta)
    ffn: str = "relu"                # "relu" (equation 2) or "swiglu" (width 2/3 d_ff, no biases)
    kv_heads: int | None = None      # key/value heads of every attention (None: n_heads; 1: multi-query)
    rope_base: float = 10000.0       # the base of rotary positions' angles
    qk_norm: bool = False            # RMSNorm over each head's queries and keys (QK-norm, lesson 26)
    share_embeddings: bool = True
    ln_eps: float = 1e-6
    warmup_steps: int = 4000         # of the learning-rate schedule (section 5.3)

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"TransformerConfig: {msg}")
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                bad(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.n_encoder_layers, int) or self.n_encoder_layers < 0:
            bad(f"n_encoder_layers must be a non-negative integer (0: a decoder-only language model), "
                f"got {self.n_encoder_layers!r}")
        if not isinstance(self.n_decoder_layers, int) or self.n_decoder_layers < 1:
            bad(f"n_decoder_layers must be a positive integer, got {self.n_decoder_layers!r}")
        if self.tgt_vocab_size is not None and (not isinstance(self.tgt_vocab_size, int) or self.tgt_vocab_size <= 0):
            bad(f"tgt_vocab_size must be a positive integer or None, got {self.tgt_vocab_size!r}")
        if self.max_len > MAX_LEN_LIMIT:      # before a table of max_len rows is built (sinusoids: no parameters)
            bad(f"max_len must be at most {MAX_LEN_LIMIT:,} (a table of max_len positions is built as the model "
                f"loads, here and in the page), got {self.max_len:,}")
        if self.d_model % self.n_heads:
            bad(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        for name in ("dropout", "attention_dropout", "relu_dropout", "label_smoothing"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                bad(f"{name} must be in [0, 1), got {v!r}")
        check(self)                       # the block's kinds and numbers (attn.block: the one place)
        if self.share_embeddings and self.tgt_vocab_size not in (None, self.vocab_size):
            bad(f"share_embeddings needs one vocabulary, got vocab_size {self.vocab_size} "
                f"and tgt_vocab_size {self.tgt_vocab_size}")
        if self.warmup_steps < 1:
            bad(f"warmup_steps must be positive, got {self.warmup_steps!r}")
        count = parameter_count(self)
        if count > MAX_PARAMETERS:        # before anything is allocated, or parameter_shapes listed
            fields = dataclasses.asdict(self)     # named: the field (or both layer counts, as --layers sets
            groups = [(f,) for f in SIZE_FIELDS] + [LAYER_FIELDS]      # them) whose shrinking to 1 saves the most

            def saves(group):
                return count - parameter_count(SimpleNamespace(**{**fields, **dict.fromkeys(group, 1)}))
            group = max(groups, key=saves)
            big = [f"{f} = {getattr(self, f):,}" for f in group if len(group) == 1 or 10 * saves((f,)) >= saves(group)]
            bad(f"{' and '.join(big)} give{'s' if len(big) == 1 else ''} {count:,} parameters "
                f"({4 * count / 2**30:,.0f} GiB in float32), more than the {MAX_PARAMETERS:,} a model may have")

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size or self.vocab_size

    @property
    def key_value_heads(self) -> int:
        """How many key/value heads every attention has (``n_heads`` unless ``kv_heads`` says fewer)."""
        return self.kv_heads or self.n_heads

    @property
    def ffn_width(self) -> int:
        """The feed-forward network's hidden width: d_ff, or SwiGLU's 2/3 of it (the same parameters)."""
        return parts(self).ffn.width

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
        """A config from :meth:`to_dict` output, today's or an older file's (:func:`renamed_fields`)."""
        d = renamed_fields(d, "TransformerConfig")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"TransformerConfig: unknown fields {unknown}")
        return cls(**d)


#: Config fields renamed since files were first written, old name -> new: a config read from a
#: file (a checkpoint, a page export, a run's config.json) passes through :func:`renamed_fields`.
RENAMED_FIELDS = {"norm": "norm_position"}


def renamed_fields(d: dict, owner: str) -> dict:
    """``d`` with each old field name of :data:`RENAMED_FIELDS` replaced by its new one (a new dict);
    ValueError naming ``owner`` and both names if ``d`` gives both."""
    if not isinstance(d, dict):
        return d
    both = [f"{old!r} (the old name of {new!r}) and {new!r}" for old, new in RENAMED_FIELDS.items()
            if old in d and new in d]
    if both:
        raise ValueError(f"{owner}: both {both[0]} given")
    return {RENAMED_FIELDS.get(k, k): v for k, v in d.items()}


# --------------------------------------------------------------------------- parameters

#: The largest ``max_len`` a config may give: a table of ``max_len`` positions is built as a model
#: loads (:func:`sinusoids`, and the page's, ``web/attn/model.js``): 8,192 rows of d_model 512 take a
#: fraction of a second; the page took 16 s at 10**6 and failed at 10**8.
MAX_LEN_LIMIT = 8192
#: The most parameters a config may give (16 GiB in float32, 75 times the paper's big model): a
#: config read from a file that asks for more is refused naming its field, before anything is allocated.
MAX_PARAMETERS = 2**32
#: The fields a model's size grows with.
SIZE_FIELDS = ("vocab_size", "tgt_vocab_size", "d_model", "d_ff", "n_encoder_layers", "n_decoder_layers", "max_len")
#: The layer counts, which ``attn-train --layers`` sets together.
LAYER_FIELDS = ("n_encoder_layers", "n_decoder_layers")


def parameter_count(cfg) -> int:
    """How many numbers :func:`parameter_shapes` holds, counted without listing them (a config of
    10⁸ layers is counted at once); ``cfg`` has the fields of a :class:`TransformerConfig`."""
    D, V = cfg.d_model, cfg.vocab_size
    T = cfg.tgt_vocab_size or V
    block = parts(cfg)
    embeddings = V * D if cfg.share_embeddings else V * D + 2 * T * D
    attention, ffn, norm = size(block.self_attention.shapes(D)), size(block.ffn.shapes(D)), size(block.norm.shapes(D))
    sublayers = 3 if block.cross_attention is not None else 2          # decoder-only: no cross-attention
    final = norm * (bool(cfg.n_encoder_layers) + 1) if block.placement.final_norm else 0
    return (embeddings + size(block.positions.shapes(D)) + cfg.n_encoder_layers * (attention + ffn + 2 * norm)
            + cfg.n_decoder_layers * ((sublayers - 1) * attention + ffn + sublayers * norm) + final)


def parameter_shapes(cfg: TransformerConfig) -> dict:
    """Every parameter's dotted name and shape, in a stable order."""
    D, block = cfg.d_model, parts(cfg)
    shapes = {}
    if cfg.share_embeddings:
        shapes["embedding.weight"] = (cfg.vocab_size, D)
    else:
        shapes["src_embedding.weight"] = (cfg.vocab_size, D)
        shapes["tgt_embedding.weight"] = (cfg.target_vocab_size, D)
        shapes["generator.weight"] = (cfg.target_vocab_size, D)
    shapes.update(block.positions.shapes(D))
    ffn, norm, attn = block.ffn.shapes(D), block.norm.shapes(D), block.self_attention.shapes(D)
    blocks = {"encoder": [("self_attn", attn), ("norm1", norm), ("ffn", ffn), ("norm2", norm)],
              "decoder": [("self_attn", attn), ("norm1", norm), ("cross_attn", attn), ("norm2", norm),
                          ("ffn", ffn), ("norm3", norm)]}
    if block.cross_attention is None:                # decoder-only: the feed-forward keeps its norm3
        blocks["decoder"] = [blocks["decoder"][i] for i in (0, 1, 4, 5)]
    for stack, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        if n == 0:
            continue                                          # a decoder-only model: no encoder stack
        for i in range(n):
            for sub, fields in blocks[stack]:
                for f, shape in fields.items():
                    shapes[f"{stack}.{i}.{sub}.{f}"] = shape
        if block.placement.final_norm:
            shapes.update({f"{stack}.norm.{n}": shape for n, shape in norm.items()})
    return shapes


def init_params(cfg: TransformerConfig, seed: int = 0, dtype="float32") -> dict:
    """Initial parameters, drawn on the host from one seeded generator (so NumPy and
    CuPy start from identical numbers), then moved to the selected backend.

    Matrices: Xavier/Glorot uniform. Embeddings: normal with std ``d_model**-0.5``,
    so that the embedding scaled by ``sqrt(d_model)`` has unit variance. Biases 0,
    the norms' gains 1 (QK-norm's too). Learned positions: normal with std 0.02.
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
        elif leaf.endswith("gamma"):                 # gamma, q_gamma, k_gamma: gains
            a = np.ones(shape)
        elif len(shape) == 1:
            a = np.zeros(shape)
        else:
            limit = math.sqrt(6.0 / (shape[0] + shape[1]))
            a = rng.uniform(-limit, limit, shape)
        params[name] = B.to_device(a.astype(dtype))
    return params


def embedding_name(cfg: TransformerConfig, which: str) -> str:
    """The parameter that embeds ``which`` ("src", "tgt") or projects the output ("out")."""
    if cfg.share_embeddings:
        return "embedding.weight"
    return {"src": "src_embedding.weight", "tgt": "tgt_embedding.weight", "out": "generator.weight"}[which]


def sinusoids(cfg: TransformerConfig, T: int, dtype, xp, table=None):
    """``table`` if it is a sinusoidal table (L, D) of at least T rows in ``dtype`` on ``xp``,
    else a new one of ``max(2 T, max_len)`` rows."""
    if table is None or table.shape[0] < T or table.dtype != dtype or B.get_array_module(table) is not xp:
        table = xp.asarray(sinusoidal_table(max(2 * T, cfg.max_len), cfg.d_model, dtype))
    return table


# --------------------------------------------------------------------------- the layers

class SublayerCache(NamedTuple):
    """One sub-layer in its residual connection: the norm's, the sub-layer's and the dropout's
    caches, and the block whose parts ran them (where its norm is, which norm, which network)."""
    norm: object
    sub: object
    drop: object
    block: Block


def layer_params(params: dict, prefix: str) -> dict:
    """One layer's parameters by their names in it: ``encoder.0.ffn.w1`` -> ``ffn.w1``."""
    n = len(prefix) + 1
    return {k[n:]: params[k] for k in params if k.startswith(prefix + ".")}     # looks up only its own


def encoder_layer_forward(x, mask, p: dict, cfg: TransformerConfig, rng=None):
    """One encoder layer (section 3.1): self-attention, then the position-wise feed-forward
    network, each a sub-layer in its residual connection with dropout and a layer norm.

    Inputs: x (B, S, D); mask (B, 1, 1, S) bool or None; p the layer's parameters by their names
    in it (``self_attn.w_q`` ... ``norm2.beta``, :func:`layer_params`); cfg the model's
    :class:`TransformerConfig` (its block's parts: :func:`attn.block.parts`); rng a DeviceRNG for
    dropout (None: none). Returns: out (B, S, D), cache (a :class:`SublayerCache` per sub-layer).
    """
    block = parts(cfg)
    h, cn = _sublayer_input(x, p, "norm1", block)
    s, cs = block.self_attention.forward(h, h, mask, p, "self_attn", rng)
    x, c1 = _residual_output(x, s, cn, cs, p, "norm1", block, rng)
    h, cn = _sublayer_input(x, p, "norm2", block)
    s, cs = block.ffn.forward(h, p, rng)
    x, c2 = _residual_output(x, s, cn, cs, p, "norm2", block, rng)
    return x, (c1, c2)


def encoder_layer_backward(dout, cache):
    """Backward of :func:`encoder_layer_forward`. Returns: dx (B, S, D), grads keyed like p."""
    c1, c2 = cache
    block, grads = c1.block, {}
    dx, ds = _residual_output_backward(dout, c2, "norm2", grads)
    dx = _sublayer_input_backward(dx, block.ffn.backward(ds, c2.sub, grads), c2, "norm2", grads)
    dx, ds = _residual_output_backward(dx, c1, "norm1", grads)
    dq, dkv = block.self_attention.backward(ds, c1.sub, "self_attn", grads)   # x: queries, keys, values
    dx = _sublayer_input_backward(dx, dq + dkv, c1, "norm1", grads)
    return dx, grads


def decoder_layer_forward(x, memory, src_mask, tgt_mask, p: dict, cfg: TransformerConfig, rng=None, kv=None):
    """One decoder layer (section 3.1): masked self-attention, attention over the encoder's
    output ``memory``, then the feed-forward network, each in its residual connection. The same
    function trains and decodes (nanochat's ``Block.forward(x, kv_cache)``).

    Inputs: x (B, T, D); memory (B, S, D); src_mask (B, 1, 1, S); tgt_mask (B, 1, T, T); p keyed
    ``self_attn.*``, ``norm1.*``, ``cross_attn.*``, ``norm2.*``, ``ffn.*``, ``norm3.*``; cfg and
    rng as :func:`encoder_layer_forward`'s; kv None (training), or, decoding, the layer's key/value
    cache: ``((k, v), (k_src, v_src))``, the self-attention's of the earlier positions ((B, KV, t,
    Dh) each, or None before the first: x's positions follow them) and the cross-attention's,
    computed from the memory once (then ``memory`` may be None).

    A decoder-only block (``n_encoder_layers=0``: no cross-attention part) has no memory: its
    layer is the masked self-attention and the feed-forward network alone (GPT's block), called
    with ``memory``, ``src_mask`` and the cross-attention's cache None.

    Returns: out (B, T, D), cache (a :class:`SublayerCache` per sub-layer, None for the missing
    cross-attention). Decoding, the attentions' caches are :class:`attn.block.Attended`: the
    grown keys and values, the weights."""
    block = parts(cfg)
    self_kv, cross_kv = (None, None) if kv is None else kv
    h, cn = _sublayer_input(x, p, "norm1", block)
    s, cs = block.self_attention.forward(h, h, tgt_mask, p, "self_attn", rng, self_kv)
    x, c1 = _residual_output(x, s, cn, cs, p, "norm1", block, rng)
    c2 = None
    if block.cross_attention is not None:
        h, cn = _sublayer_input(x, p, "norm2", block)
        s, cs = block.cross_attention.forward(h, memory, src_mask, p, "cross_attn", rng, cross_kv)
        x, c2 = _residual_output(x, s, cn, cs, p, "norm2", block, rng)
    h, cn = _sublayer_input(x, p, "norm3", block)
    s, cs = block.ffn.forward(h, p, rng)
    x, c3 = _residual_output(x, s, cn, cs, p, "norm3", block, rng)
    return x, (c1, c2, c3)


def decoder_layer_backward(dout, cache):
    """Backward of :func:`decoder_layer_forward` (training). Returns: dx (B, T, D), dmemory
    (B, S, D; None for a decoder-only block, which reads no memory), grads keyed like p."""
    c1, c2, c3 = cache
    block, grads, dmemory = c1.block, {}, None
    dx, ds = _residual_output_backward(dout, c3, "norm3", grads)
    dx = _sublayer_input_backward(dx, block.ffn.backward(ds, c3.sub, grads), c3, "norm3", grads)
    if c2 is not None:
        dx, ds = _residual_output_backward(dx, c2, "norm2", grads)
        dq, dmemory = block.cross_attention.backward(ds, c2.sub, "cross_attn", grads)   # keys, values: the memory
        dx = _sublayer_input_backward(dx, dq, c2, "norm2", grads)
    dx, ds = _residual_output_backward(dx, c1, "norm1", grads)
    dq, dkv = block.self_attention.backward(ds, c1.sub, "self_attn", grads)
    dx = _sublayer_input_backward(dx, dq + dkv, c1, "norm1", grads)
    return dx, dmemory, grads


def _sublayer_input(x, p, norm, block: Block):
    """What a sub-layer reads: ``LN(x)`` where the norm comes first (pre-norm), else x itself."""
    return block.placement.before(x, block.norm, p, norm)


def _residual_output(x, s, cn, cs, p, norm, block: Block, rng):
    """The sub-layer's output ``s`` added to its input: ``x + drop(s)``, then, post-norm (the
    paper), ``LN(x + drop(s))``. Returns: out, SublayerCache."""
    s, cd = dropout_forward(s, block.placement.dropout, rng)
    out, cn = block.placement.after(x, s, cn, block.norm, p, norm)
    return out, SublayerCache(cn, cs, cd, block)


def _residual_output_backward(dout, cache: SublayerCache, norm, grads):
    """Backward of :func:`_residual_output`: the gradient of x by the skip path, and of s."""
    dy = cache.block.placement.after_backward(dout, cache.norm, cache.block.norm, norm, grads)
    return dy, dropout_backward(dy, cache.drop)


def _sublayer_input_backward(dskip, dh, cache: SublayerCache, norm, grads):
    """x's whole gradient: the skip path's plus the sub-layer's, through the norm before it."""
    return dskip + cache.block.placement.before_backward(dh, cache.norm, cache.block.norm, norm, grads)


# --------------------------------------------------------------------------- the model

class StackCache(NamedTuple):
    """Embedding, positional and dropout caches, then each layer's cache (a tuple of
    :class:`SublayerCache`), then the final norm's (pre-norm) or None."""
    embed: object
    pos: object
    drop: object
    layers: list
    final_norm: object


class ForwardCache(NamedTuple):
    """Everything :meth:`Transformer.backward` needs: both stacks (a decoder-only model's ``enc``
    and ``src_mask`` None), the decoder output and the masks."""
    enc: StackCache
    dec: StackCache
    dec_out: object
    src_mask: object
    tgt_mask: object


class Transformer:
    """The encoder-decoder Transformer of section 3 with hand-written backward.

    Inputs to :meth:`forward`: ``src`` (B, S) and ``tgt_in`` (B, T) integer ids,
    padded with ``PAD_ID`` (0). Outputs: logits (B, T, V_tgt). A decoder-only config
    (``n_encoder_layers=0``) is a language model: ``src`` is None, ``tgt_in`` the text's ids, and
    the logits at position t predict the token at t + 1 from those at <= t.
    """

    def __init__(self, config: TransformerConfig, seed: int = 0, dtype="float32", params: dict | None = None):
        self.config = config
        self.dtype = B.host.dtype(dtype)
        self.params = params if params is not None else init_params(config, seed, dtype)
        self.block = parts(config)
        self._pe = None

    # ------------------------------------------------------------------ helpers

    @property
    def xp(self):
        return B.get_array_module(next(iter(self.params.values())))

    def _emb(self, which: str) -> str:
        return embedding_name(self.config, which)

    def _pos_table(self, which: str, T: int):
        """The positional table (L, D) with L >= T: a parameter, or the sinusoids,
        extended on demand so that no length is ever silently wrong."""
        if self.block.positions.learned:
            return self.params[f"{which}_pos.weight"]
        self._pe = sinusoids(self.config, T, self.dtype, self.xp, self._pe)
        return self._pe

    def num_parameters(self) -> int:
        return int(sum(int(p.size) for p in self.params.values()))

    def _norm_fwd(self, name, x):
        return self.block.norm.forward(x, self.params, name)

    def _norm_bwd(self, name, dout, cache, grads):
        return self.block.norm.backward(dout, cache, name, grads)

    # ------------------------------------------------------------------ stacks

    def _embed_fwd(self, which, ids, rng, start=0, own_tokens=False):
        """ids (B, T) at positions start.. -> (B, T, D), the caches. ``own_tokens``: ids the model
        chose itself while decoding, in range by construction, so not checked (the check reads
        them back to the host: a transfer per position)."""
        D, W = self.config.d_model, self.params[self._emb(which)]
        if own_tokens:
            x, ce = W[ids] * W.dtype.type(math.sqrt(D)), None                          # (B, T, D)
        else:
            x, ce = embedding_forward(ids, W, math.sqrt(D))                              # (B, T, D)
        cp = None                                          # rotary positions act inside the attention
        if self.block.positions.added:
            x, cp = positional_forward(x, self._pos_table(which, start + ids.shape[1])[start:])
        x, cd = dropout_forward(x, self.config.dropout, rng)
        return x, ce, cp, cd

    def _embed_bwd(self, which, dx, cache: StackCache, grads):
        dx = dropout_backward(dx, cache.drop)
        if cache.pos is not None:
            dx, dtable = positional_backward(dx, cache.pos)
            if self.block.positions.learned:
                _acc(grads, f"{which}_pos.weight", dtable)
        _acc(grads, self._emb(which), embedding_backward(dx, cache.embed))

    def encode(self, src, rng=None, src_mask=None):
        """Encoder stack. Inputs: src (B, S) ids. Returns: memory (B, S, D), cache."""
        src_mask = padding_mask(src) if src_mask is None else src_mask        # (B, 1, 1, S)
        x, ce, cp, cd = self._embed_fwd("src", src, rng)
        layers = []
        for i in range(self.config.n_encoder_layers):
            x, c = encoder_layer_forward(x, src_mask, layer_params(self.params, f"encoder.{i}"), self.config, rng)
            layers.append(c)
        cn = None
        if self.block.placement.final_norm:
            x, cn = self._norm_fwd("encoder.norm", x)
        return x, StackCache(ce, cp, cd, layers, cn)

    def decode(self, tgt_in, memory, src_mask, rng=None):
        """Decoder stack. Inputs: tgt_in (B, T) ids; memory (B, S, D); src_mask (B, 1, 1, S).
        Returns: decoder output (B, T, D), cache, tgt_mask."""
        tgt_mask = decoder_mask(tgt_in)                                        # (B, 1, T, T)
        x, ce, cp, cd = self._embed_fwd("tgt", tgt_in, rng)
        layers = []
        for i in range(self.config.n_decoder_layers):
            x, c = decoder_layer_forward(x, memory, src_mask, tgt_mask, layer_params(self.params, f"decoder.{i}"),
                                         self.config, rng)
            layers.append(c)
        cn = None
        if self.block.placement.final_norm:
            x, cn = self._norm_fwd("decoder.norm", x)
        return x, StackCache(ce, cp, cd, layers, cn), tgt_mask

    def project(self, h):
        """Pre-softmax projection with the (shared) embedding matrix: (..., D) -> (..., V)."""
        E = self.params[self._emb("out")]                                       # (V, D)
        return (h.reshape(-1, h.shape[-1]) @ E.T).reshape(*h.shape[:-1], E.shape[0])

    def forward(self, src, tgt_in, rng=None):
        """Inputs: src (B, S), tgt_in (B, T) integer ids (a decoder-only model: src None);
        rng a DeviceRNG for dropout (None: no dropout, as in evaluation).

        Returns: logits (B, T, V_tgt), cache for :meth:`backward`.
        """
        decoder_only = self.block.cross_attention is None
        if decoder_only != (src is None):
            raise ValueError("Transformer.forward: " + ("a decoder-only model (n_encoder_layers=0) reads no source: "
                                                        "src must be None" if decoder_only else
                                                        "src is None, but the model has an encoder"))
        if tgt_in.ndim != 2 or (src is not None and (src.ndim != 2 or src.shape[0] != tgt_in.shape[0])):
            raise ValueError(f"Transformer.forward: src and tgt_in must be (B, S) and (B, T) with one B, "
                             f"got {None if src is None else tuple(src.shape)} and {tuple(tgt_in.shape)}")
        src_mask = memory = enc = None
        if not decoder_only:
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
        dmemory = 0
        for i in reversed(range(self.config.n_decoder_layers)):
            dx, dmem, g = decoder_layer_backward(dx, dec.layers[i])
            _add(grads, f"decoder.{i}", g)
            if dmem is not None:
                dmemory = dmemory + dmem                      # every layer attends to the memory
        self._embed_bwd("tgt", dx, dec, grads)

        enc = cache.enc
        if enc is None:                                       # a decoder-only model: no encoder
            return grads
        dx = dmemory
        if enc.final_norm is not None:
            dx = self._norm_bwd("encoder.norm", dx, enc.final_norm, grads)
        for i in reversed(range(self.config.n_encoder_layers)):
            dx, g = encoder_layer_backward(dx, enc.layers[i])
            _add(grads, f"encoder.{i}", g)
        self._embed_bwd("src", dx, enc, grads)
        return grads

    @staticmethod
    def attention_weights(cache: ForwardCache) -> dict:
        """The attention weights of a forward pass, by sub-layer name:
        ``encoder.i.self_attn`` (B, H, S, S), ``decoder.i.self_attn`` (B, H, T, T),
        ``decoder.i.cross_attn`` (B, H, T, S)."""
        out = {}
        for i, (c1, _) in enumerate(cache.enc.layers if cache.enc is not None else []):
            out[f"encoder.{i}.self_attn"] = c1.sub.attn.weights
        for i, (c1, c2, _) in enumerate(cache.dec.layers):
            out[f"decoder.{i}.self_attn"] = c1.sub.attn.weights
            if c2 is not None:
                out[f"decoder.{i}.cross_attn"] = c2.sub.attn.weights
        return out

    # ------------------------------------------------------------------ incremental decoding

    def cross_attention_kv(self, memory) -> list:
        """Each decoder layer's cross-attention keys and values, (B, KV, S, Dh) each (KV: the
        key/value heads), from the encoder output (B, S, D): they depend on the source alone."""
        attention, cross = self.block.cross_attention, []
        for i in range(self.config.n_decoder_layers):
            name = f"decoder.{i}.cross_attn"
            cross.append((attention.heads(memory, self.params, name, "k"), attention.heads(memory, self.params, name, "v")))
        return cross

    def start_decoding(self, memory, src_mask) -> "DecodeState":
        """Precompute each decoder layer's cross-attention keys and values from the
        encoder output once. Returns the state for :meth:`decode_step`, which grows as it goes.
        A decoder-only model has no memory: ``start_decoding(None, None)``."""
        empty = [(None, None)] * self.config.n_decoder_layers
        if self.block.cross_attention is None:
            return DecodeState([None] * self.config.n_decoder_layers, list(empty), None, 0)
        return DecodeState(self.cross_attention_kv(memory), list(empty), src_mask, 0)

    def decode_step(self, tokens, state: "DecodeState"):
        """One decoder position for every sequence in the batch, attending to the
        cached keys/values of the earlier positions: the cost of a step does not
        grow with a recomputed prefix. Each layer is :func:`decoder_layer_forward`, the
        training's, given the layer's key/value cache.

        Inputs: tokens (B,) the ids at position ``state.length``. Returns:
        log-probabilities (B, V_tgt) for the next token, the new state, and the
        cross-attention weights of every layer (list of (B, H, 1, S); empty for a decoder-only model).

        The cache holds the key/value heads (``kv_heads`` of them), each read by its group of
        query heads; with rotary positions a key is turned once, when it is computed.
        """
        logp, state, cross_w = self.decode_positions(tokens[:, None], state)
        return logp[:, 0], state, cross_w

    def decode_positions(self, tokens, state: "DecodeState"):
        """:meth:`decode_step` over T new positions at once: tokens (B, T) the ids at positions
        ``state.length``.., each attending to the cache and to the new positions up to its own
        (:func:`attn.masks.cached_causal_mask`). Speculative decoding checks a draft's T tokens
        so, in one pass. Returns: log-probabilities (B, T, V_tgt) (row j: the token after
        position ``state.length + j``), the new state, the cross-attention weights (B, H, T, S)."""
        cfg, pos, T = self.config, state.length, tokens.shape[1]
        if self.block.positions.learned and pos + T > cfg.max_len:   # as forward() says it, not an IndexError
            raise ValueError(f"decode_step: sequence length {pos + T} exceeds the learned positional "
                             f"table's {cfg.max_len} positions (raise max_len)")
        x = self._embed_fwd("tgt", tokens, None, start=pos, own_tokens=True)[0]          # (B, T, D)
        mask = None if T == 1 else cached_causal_mask(T, pos, self.xp)                    # (1, 1, T, pos+T)
        new_self, cross_w = [], []
        for i in range(cfg.n_decoder_layers):
            kv = (state.self_kv[i], state.cross_kv[i])
            x, (c1, c2, _) = decoder_layer_forward(x, None, state.src_mask, mask,
                                                   layer_params(self.params, f"decoder.{i}"), cfg, kv=kv)
            new_self.append((c1.sub.k, c1.sub.v))                                        # (B, KV, t+T, Dh)
            if c2 is not None:
                cross_w.append(c2.sub.weights)                                           # (B, H, T, S)
        if self.block.placement.final_norm:
            x = self._norm_fwd("decoder.norm", x)[0]
        logits = self.project(x)                                                         # (B, T, V)
        return log_softmax(logits), DecodeState(state.cross_kv, new_self, state.src_mask, pos + T), cross_w

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
    encoder output (B, KV, S, Dh) and the self-attention (k, v) of the positions
    decoded so far (B, KV, t, Dh), KV the key/value heads; the source mask; how many
    positions are done."""
    cross_kv: list
    self_kv: list
    src_mask: object
    length: int

    def select(self, index) -> "DecodeState":
        """Keep (and repeat) batch rows ``index``: beam search reorders hypotheses with it."""
        cross = [None if kv is None else (kv[0][index], kv[1][index]) for kv in self.cross_kv]
        self_kv = [(None, None) if k is None else (k[index], v[index]) for k, v in self.self_kv]
        src_mask = None if self.src_mask is None else self.src_mask[index]
        return DecodeState(cross, self_kv, src_mask, self.length)

    def truncate(self, length: int) -> "DecodeState":
        """The state as it was after its first ``length`` positions: the later positions' keys
        and values dropped (speculative decoding rolls back the tokens it rejected)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"DecodeState.truncate: length must be in 0..{self.length}, got {length}")
        self_kv = [(None, None) if k is None or length == 0 else (k[:, :, :length], v[:, :, :length])
                   for k, v in self.self_kv]
        return DecodeState(self.cross_kv, self_kv, self.src_mask, length)


def log_softmax(x):
    """Log-probabilities over the last axis (inference only)."""
    xp = B.get_array_module(x)
    s = x - x.max(axis=-1, keepdims=True)
    return s - xp.log(xp.exp(s).sum(axis=-1, keepdims=True))


def _acc(grads: dict, name: str, g) -> None:
    """Accumulate: a parameter used twice (the shared embedding) gets both contributions."""
    if name in grads:
        grads[name] = grads[name] + g
    else:
        grads[name] = g


def _add(grads: dict, prefix: str, layer_grads: dict) -> None:
    """One layer's gradients into the model's, by the parameters' full names."""
    for name, g in layer_grads.items():
        _acc(grads, f"{prefix}.{name}", g)

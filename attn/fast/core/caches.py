"""The fast model's caches: what :meth:`attn.fast.FastTransformer.forward` keeps for its backward
(:class:`FastCache`, one NamedTuple per layer), what a split batch keeps (:class:`SplitCache`),
the step's fused weights (:class:`Fused`) and what inference keeps of the cross-attention
(:class:`CrossWeights`)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple


class AttendCache(NamedTuple):
    """Scaled dot-product attention: q, k, v as (B, H, T, Dh) views (q unscaled: the softmax
    applies ``1/sqrt(d_k)``), the weights w before dropout, keys first (Tk, B, H, Tq), their
    dropout mask, and the merged context ctx (B*Tq, D), the input of the output projection."""
    q: object
    k: object
    v: object
    w: object
    drop: object
    ctx: object


class AttnCache(NamedTuple):
    """A self- or cross-attention sub-layer: its (query) input x (N, D), its input projection's
    weight (self: the arena's fused (D, D + 2KV) block; cross: the queries'), the attention, the
    prefix, QK-norm's caches of the queries and keys (None without; a cross-attention's keys' is the
    :class:`FastCache`'s)."""
    x: object
    W: object
    att: AttendCache
    pre: str
    qk: tuple = (None, None)


class FFNCache(NamedTuple):
    """Feed-forward: input x (N, D), hidden activation a (N, F) after ReLU (and dropout),
    the ReLU-dropout scale (None without), and the parameter prefix."""
    x: object
    a: object
    drop_scale: object
    pre: str


class SwiGLUCache(NamedTuple):
    """SwiGLU's feed-forward: input x (N, D), the two products ``ab = [x W | x V]`` (N, 2F), the
    gated hidden activation h (N, F) (after dropout), its dropout mask, the parameter prefix."""
    x: object
    ab: object
    h: object
    drop: object
    pre: str


class ResCache(NamedTuple):
    """A sub-layer in its residual connection: layer norm's xhat (N, D) and rstd (N,), the
    residual dropout mask, the sub-layer's cache, the norm's prefix."""
    xhat: object
    rstd: object
    drop: object
    sub: object
    norm: str


class EmbedCache(NamedTuple):
    ids: object
    drop: object
    T: int


class FastCache:
    """Everything :meth:`FastTransformer.backward` needs: the step's fused weights, the embeddings'
    caches, one tuple of ResCaches per layer, the final norms (pre-norm), the encoder output, the
    cross-attention keys/values of all layers, the decoder output, (B, S, T), and QK-norm's caches
    of each layer's cross-attention keys (None each without). Not a NamedTuple: backward drops each
    layer's buffers as soon as it is done with them (as autograd frees saved tensors), so that the
    step's peak memory is not the whole forward's activations plus the gradients (read
    :meth:`FastTransformer.attention_weights` before the backward)."""
    __slots__ = ("fused", "src_emb", "tgt_emb", "enc", "enc_norm", "dec", "dec_norm", "memory", "kv", "h",
                 "shapes", "keys")

    def __init__(self, fused, src_emb, tgt_emb, enc, enc_norm, dec, dec_norm, memory, kv, h, shapes, keys):
        self.fused, self.src_emb, self.tgt_emb = fused, src_emb, tgt_emb
        self.enc, self.enc_norm, self.dec, self.dec_norm = enc, enc_norm, dec, dec_norm
        self.memory, self.kv, self.h, self.shapes, self.keys = memory, kv, h, shapes, keys


class CrossWeights(NamedTuple):
    """What :meth:`FastTransformer.decode` keeps for inference: per decoder layer a triple
    whose middle item reads like the reference's cross-attention cache,
    ``layers[i][1].sub.attn.weights`` (B, H, T, S); nothing for a backward."""
    layers: list

    @classmethod
    def of(cls, weights: list) -> "CrossWeights":
        """Each decoder layer's cross-attention weights, laid out as above."""
        return cls([(None, SimpleNamespace(sub=SimpleNamespace(attn=SimpleNamespace(weights=w))), None)
                    for w in weights])


class SplitCache(NamedTuple):
    """The caches of the parts a batch was split into, and their row slices."""
    caches: list
    parts: list


class Fused(NamedTuple):
    """The step's fused weights (see :meth:`FastTransformer._fuse`): (W, b) per layer of
    each stack's self-attention, the cross-attention queries' (W, b), the keys/values of
    every decoder layer's cross-attention (W, b), and the attention's ``1/sqrt(d_k)``."""
    enc_qkv: list
    dec_qkv: list
    cross_q: list
    kv: tuple
    scale: float

"""The fast engine's decoder-only language model (``n_encoder_layers=0``, GPT's stack of the block):
the forward of :class:`attn.fast.FastTransformer` without a source, on the translator's decoder layer,
backward and arena, which skip what a model without an encoder lacks; on NumPy the batch is split
over the helper threads (:func:`n_parts`). Decoding runs on the readable model's cache."""
from __future__ import annotations

from ... import backend as B
from .caches import FastCache
from .threads import default_workers

#: From this many activations (rows x positions x d_model) up, a language model's training forward
#: splits its rows over the helper threads (NumPy, ``workers`` None). Lower than the translator's
#: rule (:attr:`attn.fast.FastTransformer.SPLIT_MIN_SIZE`), which counts a forward alone: a step's
#: forward and backward hand each part a dozen products per layer. nanoGPT's CPU recipe (12 x 64 x
#: 128 = 98,304) took 0.87 s a step split in two against 2.58 s on OpenBLAS's two threads, timed
#: interleaved on the two loaded cores of benchmarks/RESULTS.md's run.
LM_SPLIT_MIN_SIZE = 1 << 16


def n_parts(model, Bsz: int, T: int, training: bool) -> int:
    """How many parts a forward of ``Bsz`` rows of ``T`` splits into: the model's rule, or in training
    on NumPy with ``workers`` None, :data:`LM_SPLIT_MIN_SIZE`'s."""
    if not training or model.workers is not None or model.xp is not B.host:
        return model._n_parts(Bsz, T)
    if Bsz * T * model.config.d_model < LM_SPLIT_MIN_SIZE:
        return 1
    return max(1, min(default_workers(), Bsz))


def forward(model, tgt_in, rng=None, keep_cache: bool = True):
    """Logits (B, T, V) of the ids ``tgt_in`` (B, T) and the cache for the backward (None without
    ``keep_cache``); ``rng`` draws the dropout (None: none). The rows are split over the helper
    threads (NumPy) as :meth:`attn.fast.FastTransformer.forward` splits the translator's."""
    if tgt_in.ndim != 2:
        raise ValueError(f"Transformer.forward: a language model's tgt_in must be (B, T) ids, got shape "
                         f"{tuple(tgt_in.shape)}")
    Bsz, T = tgt_in.shape
    k = n_parts(model, Bsz, T, keep_cache)
    tiled = model._tiled(Bsz, 0, T, rng)
    if k == 1:
        return forward_part(model, tgt_in, rng, keep_cache=keep_cache, tiled=tiled)
    return model.split_forward(k, Bsz, 0, T, rng, keep_cache, lambda sl, r, out, fused:
                               forward_part(model, tgt_in[sl], r, out, keep_cache, fused, tiled))


def forward_part(model, tgt_in, rng=None, logits_out=None, keep_cache=True, fused=None, tiled=False):
    """The forward of one part (or the whole batch): the decoder stack, then the tied projection
    into ``logits_out`` (B, T, V) when given. Returns logits, a :class:`FastCache` with no encoder,
    memory or cross-attention keys (None without ``keep_cache``)."""
    Bsz, T = tgt_in.shape
    F = model._fuse() if fused is None else fused
    model._phase("forward: decoder")
    y, tgt_emb, dec, dec_norm, _ = model._decoder(tgt_in, None, None, None, F, rng, keep_cache, tiled=tiled)
    model._phase("forward: output projection")
    E = model.params[model._emb("out")]
    if logits_out is None:
        logits_out = model.xp.empty((Bsz, T, E.shape[0]), dtype=model.dtype)
    model.ops.mm(y, E.T, out=logits_out.reshape(Bsz * T, E.shape[0]))         # (N, V)
    if not keep_cache:
        return logits_out, None
    keys = [None] * model.config.n_decoder_layers                             # no cross-attention keys
    return logits_out, FastCache(F, None, tgt_emb, [], None, dec, dec_norm, None, None, y, (Bsz, 0, T), keys)

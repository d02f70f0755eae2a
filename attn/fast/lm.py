"""The fast engine's decoder-only language model (``n_encoder_layers=0``: GPT's stack of the block,
:mod:`attn.model`): the forward of :class:`attn.fast.FastTransformer` without a source. The decoder
layers are the translator's (:func:`attn.fast.layer.decoder_layer`, which skips the missing
cross-attention), the backward is :class:`attn.fast.backward.Backward`'s (which skips the memory's
keys and values and the encoder), and the arena lays out the parameters the config has. On NumPy the
batch is split into the model's :attr:`~attn.fast.FastTransformer.workers` parts on the helper
threads, as the translator's is. Decoding runs on the readable model's cache
(:meth:`attn.model.Transformer.start_decoding`), over the same parameters."""
from __future__ import annotations

import copy

from .caches import FastCache, SplitCache
from .threads import _THREADS, _row_slices


def check_ids_shape(tgt_in, what: str = "Transformer.forward") -> None:
    if tgt_in.ndim != 2:
        raise ValueError(f"{what}: a language model's tgt_in must be (B, T) ids, got shape {tuple(tgt_in.shape)}")


def forward(model, tgt_in, rng=None, keep_cache: bool = True):
    """Logits (B, T, V) of the ids ``tgt_in`` (B, T) and the cache for the backward (None without
    ``keep_cache``); ``rng`` draws the dropout (None: none). The rows are split over the helper
    threads (NumPy) as :meth:`attn.fast.FastTransformer.forward` splits the translator's: each part
    draws its rows of what one pass over the batch would (:class:`attn.training.distributed.RowsOf`)."""
    check_ids_shape(tgt_in)
    Bsz, T = tgt_in.shape
    k = model._n_parts(Bsz, T)
    tiled = model._tiled(Bsz, 0, T, rng)
    if k == 1:
        return forward_part(model, tgt_in, rng, keep_cache=keep_cache, tiled=tiled)
    model.embeddings.shared_tables(0, T)                  # the shared tables, before the threads
    parts = _row_slices(Bsz, k)
    rngs = [None] * k
    if rng is not None:
        from ..training.distributed import RowsOf
        rngs = [RowsOf(copy.deepcopy(rng), sl.start, sl.stop, Bsz, keys_first=model.keys_first) for sl in parts]
    V = model.params[model._emb("out")].shape[0]
    logits = model.xp.empty((Bsz, T, V), dtype=model.dtype)
    fused = model._fuse()
    caches = _THREADS.parallel([
        lambda sl=sl, r=r: forward_part(model, tgt_in[sl], r, logits[sl], keep_cache, fused, tiled)[1]
        for sl, r in zip(parts, rngs)])
    return logits, (SplitCache(caches, parts) if keep_cache else None)


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

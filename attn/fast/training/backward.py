"""The fast model's backward: :class:`Backward`, which :class:`attn.fast.FastTransformer` holds,
runs its pieces' backwards (each beside its forward in :mod:`attn.fast.core`) on a
:class:`attn.fast.core.caches.FastCache`, writing the gradients in the order the arena lies."""
from __future__ import annotations

import threading
from typing import NamedTuple

from ...model import embedding_name
from ..core.arena import Arena
from ..core.caches import FastCache, SplitCache
from ..core.layer import decoder_layer_backward
from ..core.threads import THREADS


class _Grads(NamedTuple):
    """Where one part of a step writes its gradients: a flat buffer of the arena's layout (its
    ``grads``, or a split batch's scratch), its views, the arena (for :meth:`block`), and
    ``done(stage)``, called when the part has written a stage of :func:`attn.fast.core.arena.stages`
    (announced to the backward's ``ready`` once every part has)."""
    flat: object
    views: dict
    arena: Arena
    done: object

    def block(self, name: str):
        return self.arena.block(self.flat, name)


class Backward:
    """The backward of ``model`` (:meth:`attn.fast.FastTransformer.backward`): its pieces' backwards
    in the arena's order; a split batch's other parts write into ``part_grads`` (scratch buffers of
    the arena's layout, kept between steps), added in stage by stage."""

    def __init__(self, model):
        self.model, self.config, self.arena = model, model.config, model.arena
        self.embeddings, self.residuals, self.ffn, self.mha = model.embeddings, model.residuals, model.ffn, model.mha
        self.part_grads: list = []

    def __call__(self, dlogits, cache, ready=None) -> dict:
        """Inputs: dlogits (B, T, V_tgt) (it may be overwritten), the cache of
        :meth:`attn.fast.FastTransformer.forward`; ``ready`` (optional), called as ``ready(stop)`` each
        time ``arena.grads[:stop]`` has become final (the arena lies in the order the backward finishes,
        so a data-parallel run sends the front while the rest is computed), last ``ready(arena.size)``.
        Returns: grads, keyed like ``params``: the views of ``arena.grads`` (the next backward overwrites
        them)."""
        a = self.arena
        split = isinstance(cache, SplitCache)
        caches, rows = (cache.caches, cache.parts) if split else ([cache], [slice(None)])
        k = len(caches)
        while len(self.part_grads) < k - 1:
            flat = a.new_buffer()
            self.part_grads.append((flat, a.views(flat)))
        others = [flat for flat, _ in self.part_grads[:k - 1]]
        left, lock, last = {}, threading.Lock(), next(reversed(a.layout.stages))

        def add(lo, hi):                            # the other parts' gradients into the arena's
            for flat in others:
                a.grads[lo:hi] += flat[lo:hi]

        def done(stage):
            # A stage is final once every part has written it: the last part to finish it adds the
            # others' in (in the parts' order) and announces it; the embeddings are added below.
            with lock:
                unfinished = left[stage] = left.get(stage, k) - 1
            if not unfinished and stage != last:
                lo, hi = a.layout.stages[stage]
                add(lo, hi)
                if ready is not None:
                    ready(hi)
        grads = [_Grads(flat, views, a, done)
                 for flat, views in [(a.grads, a.grad_views), *self.part_grads[:k - 1]]]
        THREADS.parallel([lambda sl=sl, c=c, g=g: self._backward_part(dlogits[sl], c, g)
                           for sl, c, g in zip(rows, caches, grads)])
        start, n = a.layout.stages[last][0], a.size                  # the embeddings, over the threads
        bounds = [start + (n - start) * i // k for i in range(k + 1)]
        THREADS.run([lambda lo=lo, hi=hi: add(lo, hi) for lo, hi in zip(bounds, bounds[1:])])
        if ready is not None:
            ready(a.size)
        return dict(a.grad_views)

    def _backward_part(self, dlogits, cache: FastCache, G: _Grads) -> None:
        """The backward of one part: every gradient into ``G``, stage by stage in the arena's
        order. Frees the cache as it goes."""
        self.model._phase("backward: output projection")
        dy = self._projection_bwd(dlogits, cache, G)
        self.model._phase("backward: decoder")
        d_tgt, dmem = self._decoder_bwd(dy, cache, G)
        del dy
        self.model._phase("backward: encoder")
        d_src = self._encoder_bwd(dmem, cache, G)
        del dmem
        self.model._phase("backward: embeddings")
        self._embeddings_bwd(d_src, d_tgt, cache, G)

    def _projection_bwd(self, dlogits, cache: FastCache, G: _Grads):
        """The output projection's backward, then the decoder's final norm's (pre-norm).
        Returns dy (N_t, D), the gradient of the decoder's output."""
        ops, name = self.model.ops, embedding_name(self.config, "out")
        E = self.model.params[name]
        # Forward was logits = h @ E.T, so dh = dlogits @ E and dE = dlogits.T @ h.
        d2 = dlogits.reshape(-1, E.shape[0])                                  # (N_t, V)
        ops.mm(d2.T, cache.h, out=G.views[name])                             # (V, D)
        dy = ops.mm(d2, E)                                                    # (N_t, D)
        cache.h = None
        if cache.dec_norm is not None:
            dy = self.residuals.norm_backward("decoder.norm", dy, *cache.dec_norm, G)
            cache.dec_norm = None
        G.done("decoder.norm")
        return dy

    def _decoder_bwd(self, dy, cache: FastCache, G: _Grads):
        """The decoder layers' backward (:func:`attn.fast.core.layer.decoder_layer_backward`), last
        first, then their cross-attention keys and values' and the target positions'. Returns
        the rows for the target embedding's gradient, and dmemory (N_s, D)."""
        cfg, ops = self.config, self.model.ops
        Bsz, S, _ = cache.shapes
        L, KV = cfg.n_decoder_layers, cfg.key_value_heads * (cfg.d_model // cfg.n_heads)
        cross = cache.memory is not None               # a language model (decoder-only) reads no memory
        # The cross-attention keys/values of every layer were one product of the encoder output,
        # kv = memory @ [w_k0 | w_v0 | ...] + [b_k0 | b_v0 | ...]: their gradients are collected
        # in one (N_s, 2KV*L) buffer and go back through one product at the end.
        dkv = self.model.xp.empty((Bsz * S, 2 * KV * L), dtype=self.model.dtype) if cross else None
        dkv_heads = self.mha.heads(dkv, Bsz, S, 2 * L, cfg.key_value_heads) if cross else [None] * (2 * L)
        for i in reversed(range(L)):
            dy = decoder_layer_backward(self.model, dy, cache.dec, i, dkv_heads[2 * i], dkv_heads[2 * i + 1], G,
                                        cache.keys[i])                # keys: QK-norm's cache
            G.done(f"decoder.{i}")
        dmem = None
        if cross:
            Wkv, _ = cache.fused.kv
            dmem = ops.mm(dkv, Wkv.T)                                             # (N_s, D)
            ops.mm(cache.memory.T, dkv, out=G.block("decoder.cross_attn.w_kv"))    # (D, 2D*L)
            ops.colsum(dkv, out=G.block("decoder.cross_attn.b_kv"))
        G.done("decoder.cross_attn")
        del dkv, dkv_heads
        cache.kv = cache.memory = None
        d_tgt = self.embeddings.backward("tgt", dy, cache.tgt_emb, G)
        G.done("tgt_pos")
        return d_tgt, dmem

    def _encoder_bwd(self, dx, cache: FastCache, G: _Grads):
        """The encoder's backward from dmemory ``dx`` (N_s, D): its final norm (pre-norm), its
        layers last first, the source positions. Returns the rows for the source embedding's
        gradient (None for a language model: no encoder, ``dx`` None)."""
        if dx is None:
            for stage in ("encoder.norm", "src_pos"):
                G.done(stage)
            return None
        if cache.enc_norm is not None:
            dx = self.residuals.norm_backward("encoder.norm", dx, *cache.enc_norm, G)
            cache.enc_norm = None
        G.done("encoder.norm")
        for i in reversed(range(self.config.n_encoder_layers)):
            c1, c2 = cache.enc[i]
            cache.enc[i] = None
            dx = self.residuals.backward(dx, c2, self.ffn.backward, G)
            dx = self.residuals.backward(dx, c1, self.mha.self_attn_backward, G)
            del c1, c2
            G.done(f"encoder.{i}")
        d_src = self.embeddings.backward("src", dx, cache.src_emb, G)
        G.done("src_pos")
        return d_src

    def _embeddings_bwd(self, d_src, d_tgt, cache: FastCache, G: _Grads) -> None:
        """Forward was x = E[ids] * sqrt(D) + PE: scatter-add the rows (already scaled). A shared
        embedding already holds the output projection's gradient; a separate one starts at 0."""
        out_name = embedding_name(self.config, "out")
        for which, rows, ec in (("src", d_src, cache.src_emb), ("tgt", d_tgt, cache.tgt_emb)):
            if rows is None:                              # a language model's source: none
                continue
            name = embedding_name(self.config, which)
            if name != out_name:
                G.views[name][...] = 0
            self.model.ops.scatter_rows_(G.views[name], ec.ids.reshape(-1), rows)
        G.done("embeddings")

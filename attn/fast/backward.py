"""The fast model's backward: :class:`FastBackward`, the half of
:class:`attn.fast.FastTransformer` that turns a :class:`attn.fast.caches.FastCache` into
the gradients, and where it writes them (:class:`_Grads`, the stages announced by
:class:`_Stages`)."""
from __future__ import annotations

import math
import threading
from typing import NamedTuple

from . import flash
from .arena import Arena
from ..layers.attention import sum_kv_groups
from .caches import (AttendCache, CrossAttnCache, EmbedCache, FastCache, ResCache, SelfAttnCache, SplitCache,
                     SwiGLUCache)
from .forward import FUSED_NORMS
from .layer import decoder_layer_backward
from .threads import _THREADS


class _Grads(NamedTuple):
    """Where one part of a step writes its gradients: a flat buffer with the arena's layout
    (the arena's own ``grads``, or a split batch's other parts' scratch), its per-name views,
    the arena (for the fused blocks: :meth:`block`), and ``done(stage)``, called when the part
    has written every gradient of a stage of :func:`attn.fast.arena.stages`."""
    flat: object
    views: dict
    arena: Arena
    done: object

    def block(self, name: str):
        return self.arena.block(self.flat, name)


def _nothing(stage: str) -> None:
    """``done`` of one process's backward: nobody waits for a stage."""


class _Stages:
    """The stages of a backward announced to ``ready`` (see :meth:`FastTransformer.backward`).

    One part: each stage as its part finishes it. Several parts (a split batch, on threads):
    a stage is final only when every part has written it; the last part to finish it adds the
    other parts' gradients of the stage into the arena's (in the parts' order, as one sum over
    the parts would) and announces it. The last stage (the embeddings) is added by
    :meth:`FastTransformer.backward` over the threads once they have all returned."""

    def __init__(self, arena: Arena, parts: list, ready):
        self.arena, self.parts, self.ready = arena, parts, ready
        self.last = next(reversed(arena.layout.stages))
        self.left = {}
        self.lock = threading.Lock()

    def one(self, stage: str) -> None:
        self.ready(self.arena.layout.stages[stage][1])

    def of_parts(self, stage: str) -> None:
        with self.lock:
            left = self.left[stage] = self.left.get(stage, len(self.parts)) - 1
        if left or stage == self.last:
            return
        lo, hi = self.arena.layout.stages[stage]
        for g in self.parts[1:]:
            self.arena.grads[lo:hi] += g.flat[lo:hi]
        self.ready(hi)


class FastBackward:
    """The backward of :class:`attn.fast.FastTransformer` (its base class): :meth:`backward`
    and the backward of each piece of its forward, which it reads (``config``, ``params``,
    ``ops``, ``_heads``...) from the model."""

    def backward(self, dlogits, cache, ready=None) -> dict:
        """Inputs: dlogits (B, T, V_tgt) (it may be overwritten), the cache of :meth:`forward`;
        ``ready`` (optional), called as ``ready(stop)`` each time ``arena.grads[:stop]`` has
        become final: the arena lies in the order the backward finishes its gradients, last
        layer first (:mod:`attn.fast.arena`), so a data-parallel run sends the front of the
        buffer while the backward computes the rest. The last call is ``ready(arena.size)``.

        Returns: grads, a dict keyed like ``params`` (the reference's gradients): the views
        of ``arena.grads``, which every gradient is written into (the next backward
        overwrites them). The parts of a split batch (NumPy) write theirs into scratch
        buffers of the arena's layout, kept between steps, which are added in stage by stage.
        """
        a = self.arena
        if not isinstance(cache, SplitCache):
            done = _nothing if ready is None else _Stages(a, [], ready).one
            G = _Grads(a.grads, a.grad_views, a, done)
            self._backward_part(dlogits, cache, G)
            return dict(G.views)
        k = len(cache.parts)
        while len(self._part_grads) < k - 1:
            flat = a.new_buffer()
            self._part_grads.append((flat, a.views(flat)))
        stages = _Stages(a, [], ready or _nothing)
        parts = stages.parts
        parts.extend(_Grads(flat, views, a, stages.of_parts)
                     for flat, views in [(a.grads, a.grad_views), *self._part_grads[:k - 1]])
        _THREADS.parallel([lambda sl=sl, c=c, g=g: self._backward_part(dlogits[sl], c, g)
                           for sl, c, g in zip(cache.parts, cache.caches, parts)])
        start, n = a.layout.stages[stages.last][0], a.size          # the embeddings, over the threads
        bounds = [start + (n - start) * i // k for i in range(k + 1)]

        def add(lo, hi):
            for g in parts[1:]:
                a.grads[lo:hi] += g.flat[lo:hi]
        _THREADS.run([lambda lo=lo, hi=hi: add(lo, hi) for lo, hi in zip(bounds, bounds[1:])])
        stages.ready(n)
        return dict(parts[0].views)

    def _backward_part(self, dlogits, cache: FastCache, G: _Grads) -> None:
        """The backward of one part: writes its gradients into ``G`` (every parameter's: the
        arena's layout, nothing concatenated or sliced), in the arena's stages' order (last
        layer first, :mod:`attn.fast.arena`). Frees the cache as it goes."""
        self._phase("backward: output projection")
        dy = self._projection_bwd(dlogits, cache, G)
        self._phase("backward: decoder")
        d_tgt, dmem = self._decoder_bwd(dy, cache, G)
        del dy
        self._phase("backward: encoder")
        d_src = self._encoder_bwd(dmem, cache, G)
        del dmem
        self._phase("backward: embeddings")
        self._embeddings_bwd(d_src, d_tgt, cache, G)

    def _projection_bwd(self, dlogits, cache: FastCache, G: _Grads):
        """The output projection's backward, then the decoder's final norm's (pre-norm).
        Returns dy (N_t, D), the gradient of the decoder's output."""
        ops, E = self.ops, self.params[self._emb("out")]
        # Forward was logits = h @ E.T, so dh = dlogits @ E and dE = dlogits.T @ h.
        d2 = dlogits.reshape(-1, E.shape[0])                                  # (N_t, V)
        ops.mm(d2.T, cache.h, out=G.views[self._emb("out")])                  # (V, D)
        dy = ops.mm(d2, E)                                                    # (N_t, D)
        cache.h = None
        if cache.dec_norm is not None:
            dy = self._final_norm_bwd("decoder.norm", dy, cache.dec_norm, G)
            cache.dec_norm = None
        G.done("decoder.norm")
        return dy

    def _decoder_bwd(self, dy, cache: FastCache, G: _Grads):
        """The decoder layers' backward (:func:`attn.fast.layer.decoder_layer_backward`), last
        first, then their cross-attention keys and values' and the target positions'. Returns
        the rows for the target embedding's gradient, and dmemory (N_s, D)."""
        cfg, ops = self.config, self.ops
        Bsz, S, _ = cache.shapes
        L, KV = cfg.n_decoder_layers, cfg.key_value_heads * (cfg.d_model // cfg.n_heads)
        # The cross-attention keys/values of every layer were one product of the encoder output,
        # kv = memory @ [w_k0 | w_v0 | ...] + [b_k0 | b_v0 | ...]: their gradients are collected
        # in one (N_s, 2KV*L) buffer and go back through one product at the end.
        dkv = self.xp.empty((Bsz * S, 2 * KV * L), dtype=self.dtype)
        dkv_heads = self._heads(dkv, Bsz, S, 2 * L, cfg.key_value_heads)
        for i in reversed(range(L)):
            dy = decoder_layer_backward(self, dy, cache.dec, i, dkv_heads[2 * i], dkv_heads[2 * i + 1], G,
                                        cache.keys[i])                # keys: QK-norm's cache
            G.done(f"decoder.{i}")
        Wkv, _ = cache.fused.kv
        dmem = ops.mm(dkv, Wkv.T)                                             # (N_s, D)
        ops.mm(cache.memory.T, dkv, out=G.block("decoder.cross_attn.w_kv"))    # (D, 2D*L)
        ops.colsum(dkv, out=G.block("decoder.cross_attn.b_kv"))
        G.done("decoder.cross_attn")
        del dkv, dkv_heads
        cache.kv = cache.memory = None
        d_tgt = self._embed_bwd("tgt", dy, cache.tgt_emb, G)
        G.done("tgt_pos")
        return d_tgt, dmem

    def _encoder_bwd(self, dx, cache: FastCache, G: _Grads):
        """The encoder's backward from dmemory ``dx`` (N_s, D): its final norm (pre-norm), its
        layers last first, the source positions. Returns the rows for the source embedding's
        gradient."""
        if cache.enc_norm is not None:
            dx = self._final_norm_bwd("encoder.norm", dx, cache.enc_norm, G)
            cache.enc_norm = None
        G.done("encoder.norm")
        for i in reversed(range(self.config.n_encoder_layers)):
            c1, c2 = cache.enc[i]
            cache.enc[i] = None
            dx = self._residual_bwd(dx, c2, self._ffn_bwd, G)
            dx = self._residual_bwd(dx, c1, self._self_attn_bwd, G)
            del c1, c2
            G.done(f"encoder.{i}")
        d_src = self._embed_bwd("src", dx, cache.src_emb, G)
        G.done("src_pos")
        return d_src

    def _embeddings_bwd(self, d_src, d_tgt, cache: FastCache, G: _Grads) -> None:
        """Forward was x = E[ids] * sqrt(D) + PE: scatter-add the rows (already scaled). A shared
        embedding already holds the output projection's gradient; a separate one starts at 0."""
        out_name = self._emb("out")
        for which, rows, ec in (("src", d_src, cache.src_emb), ("tgt", d_tgt, cache.tgt_emb)):
            name = self._emb(which)
            if name != out_name:
                G.views[name][...] = 0
            self.ops.scatter_rows_(G.views[name], ec.ids.reshape(-1), rows)
        G.done("embeddings")

    def _residual_bwd(self, dout, c: ResCache, sub_bwd, G: _Grads):
        """Backward of :meth:`_residual`. ``dout`` is the step's own buffer (overwritten).
        dgamma and dbeta go into the norm's (2, D) block of ``G``. ``sub_bwd(ds, cache, G,
        into)`` adds the sub-layer's input gradient to ``into`` (its last product accumulates
        there: post-norm's residual sum costs no launch of its own) or, with ``into`` None,
        returns it in an array of its own."""
        ops = self.ops
        if self.block.placement.pre:
            ds = dout if c.drop is None else ops.dropout_backward(dout, c.drop)
            dh = sub_bwd(ds, c.sub, G, None)
            dx = self._norm_bwd(c.norm, dh, c.xhat, c.rstd, G)
            dx += dout
            return dx
        gamma, dgb = self.params[c.norm + ".gamma"], G.block(c.norm + ".gamma_beta")
        fused = getattr(ops, FUSED_NORMS[self.block.norm.kind].backward_dropout)
        dy, ds = fused(dout, c.xhat, c.rstd, gamma, c.drop, out=dgb)                    # y = x + drop(s)
        return sub_bwd(ds, c.sub, G, dy)                                      # dy + d(sub)/dx

    def _norm_bwd(self, norm, dout, xhat, rstd, G: _Grads):
        """Backward of :meth:`FastForward._norm_` in place on ``dout``; its parameters' gradients
        into their block of ``G``. Returns dx."""
        gamma, out = self.params[norm + ".gamma"], G.block(norm + ".gamma_beta")
        return getattr(self.ops, FUSED_NORMS[self.block.norm.kind].backward)(dout, xhat, rstd, gamma, out=out)[0]

    def _final_norm_bwd(self, norm, dout, nc, G: _Grads):
        return self._norm_bwd(norm, dout, *nc, G)

    def _out_proj_bwd(self, pre, dout, ctx, G: _Grads):
        """Forward was ``out = ctx @ w_o + b_o``. Returns dctx; b_o's gradient is left to the
        caller (one column-sum launch with the input projection's bias)."""
        self.ops.mm(ctx.T, dout, out=G.views[pre + ".w_o"])
        return self.ops.mm(dout, self.params[pre + ".w_o"].T)

    def _attend_bwd(self, dctx, ac: AttendCache, dq, dk, dv):
        """Forward was ``ctx = drop(softmax(q k^T s + bias)) v`` with ``s = 1/sqrt(d_k)``; writes
        dq, dk, dv (views) in place: ``dv = wd^T dctx``, ``dw = dctx v^T``,
        ``ds = s * softmax_back(dropback(dw))``,
        ``dq = ds k``, ``dk = ds^T q``. The weights and their gradient are keys-first. With
        grouped-query attention (dk, dv have fewer heads than q) a key/value head's gradient
        is the sum of its group's (:func:`attn.layers.attention.sum_kv_groups`). The tiled
        attention's cache (:class:`attn.fast.flash.FlashCache`) goes to its own backward, which
        sums the groups itself."""
        xp, ops = self.xp, self.ops
        if isinstance(ac, flash.FlashCache):
            return flash.attend_backward(ops, dctx, ac, dq, dk, dv, self._attn_scale)
        Bsz, H, Tq, Dh = ac.q.shape
        Tk = ac.k.shape[2]
        group = H // dk.shape[1]
        if group > 1:
            dk_out, dv_out = dk, dv
            dk, dv = (xp.empty((Bsz, H, Tk, Dh), dtype=dctx.dtype) for _ in range(2))
        dO = dctx.reshape(Bsz, Tq, H, Dh).transpose(0, 2, 1, 3)               # (B, H, Tq, Dh)
        wd = ac.w if ac.drop is None else ops.dropout_(ac.w.copy(), ac.drop)
        ops.bmm(wd.transpose(1, 2, 0, 3), dO, out=dv)                         # (B, H, Tk, Dh)
        dw = xp.empty((Tk, Bsz, H, Tq), dtype=dctx.dtype)
        ops.bmm(ac.v, dO.swapaxes(-1, -2), out=dw.transpose(1, 2, 0, 3))      # dw^T, per (b, h)
        if ac.drop is not None:
            ops.dropout_(dw, ac.drop)
        ds = ops.softmax0_backward_(dw, ac.w, self._attn_scale)                # (Tk, B, H, Tq), times 1/sqrt(d_k)
        ops.bmm(ds.transpose(1, 2, 3, 0), ac.k, out=dq)
        ops.bmm(ds.transpose(1, 2, 0, 3), ac.q, out=dk)
        if group > 1:
            dk_out[...] = sum_kv_groups(dk, group)
            dv_out[...] = sum_kv_groups(dv, group)

    def _self_attn_bwd(self, dout, c: SelfAttnCache, G: _Grads, into=None):
        xp = self.xp
        dctx = self._out_proj_bwd(c.pre, dout, c.att.ctx, G)
        Bsz, H, T, Dh = c.att.q.shape
        dqkv = xp.empty((Bsz * T, c.W.shape[1]), dtype=dout.dtype)          # (N, D + 2KV)
        dq, dk, dv = self._qkv_heads(dqkv, Bsz, T)
        self._attend_bwd(dctx, c.att, dq, dk, dv)
        if self.block.positions.rotary:           # forward turned q and k: turn their gradients back
            self._rope_(dq, T, inverse=True)
            self._rope_(dk, T, inverse=True)
        self._norm_heads_bwd_(c.pre, dq, c.qk[0], "q", G)
        self._norm_heads_bwd_(c.pre, dk, c.qk[1], "k", G)
        # Forward was qkv = x @ [w_q | w_k | w_v] + [b_q | b_k | b_v]: the arena's two blocks.
        self.ops.mm(c.x.T, dqkv, out=G.block(c.pre + ".w_qkv"))               # (D, 3D)
        self.ops.colsums((dout, G.views[c.pre + ".b_o"]), (dqkv, G.block(c.pre + ".b_qkv")))
        return self.ops.mm(dqkv, c.W.T, out=into, accumulate=into is not None)

    def _cross_attn_bwd(self, dout, c: CrossAttnCache, dk, dv, G: _Grads, into=None, keys=None):
        """``dk``, ``dv``: this layer's views of the keys' and values' gradients, which it writes
        (``keys``: QK-norm's cache of the keys, normed where they were projected; None without)."""
        xp = self.xp
        dctx = self._out_proj_bwd(c.pre, dout, c.att.ctx, G)
        dq = xp.empty(dout.shape, dtype=dout.dtype)                           # (N_t, D)
        Bsz, H, T, Dh = c.att.q.shape
        (dqh,) = self._heads(dq, Bsz, T, 1)
        self._attend_bwd(dctx, c.att, dqh, dk, dv)
        self._norm_heads_bwd_(c.pre, dqh, c.qk, "q", G)
        self._norm_heads_bwd_(c.pre, dk, keys, "k", G)
        self.ops.mm(c.x.T, dq, out=G.views[c.pre + ".w_q"])
        self.ops.colsums((dout, G.views[c.pre + ".b_o"]), (dq, G.views[c.pre + ".b_q"]))
        return self.ops.mm(dq, c.Wq.T, out=into, accumulate=into is not None)

    def _norm_heads_bwd_(self, pre, da, cache, which, G: _Grads) -> None:
        """Backward of :meth:`attn.fast.FastTransformer._norm_heads_` in place on the heads' gradient
        ``da`` (a view); the gain's gradient into ``G``. Nothing without QK-norm (``cache`` None)."""
        if cache is not None:
            da[...], G.views[f"{pre}.{which}_gamma"][...] = self.block.self_attention.norm_heads_backward(da, cache)

    def _ffn_bwd(self, dout, c, G: _Grads, into=None):
        """Forward was ``out = a @ w2 + b2`` with ``a = drop(relu(x @ w1 + b1))``."""
        if isinstance(c, SwiGLUCache):
            return self._swiglu_bwd(dout, c, G, into)
        p, ops, gv = self.params, self.ops, G.views
        ops.mm(c.a.T, dout, out=gv[c.pre + ".w2"])
        da = ops.mm(dout, p[c.pre + ".w2"].T)                                 # (N, F)
        ops.relu_backward_(da, c.a)
        if c.drop_scale is not None:
            da *= da.dtype.type(c.drop_scale)
        ops.mm(c.x.T, da, out=gv[c.pre + ".w1"])
        ops.colsums((dout, gv[c.pre + ".b2"]), (da, gv[c.pre + ".b1"]))
        return ops.mm(da, p[c.pre + ".w1"].T, out=into, accumulate=into is not None)

    def _swiglu_bwd(self, dout, c: SwiGLUCache, G: _Grads, into=None):
        """Forward was ``out = h @ w2`` with ``h = drop(silu(a) * b)``, ``[a | b] = x @ [W | V]``:
        ``dw2 = h^T dout``, ``dh = dout w2^T``, ``[da | db]`` by the gate's backward, then one
        product each for ``d[W | V] = x^T [da | db]`` and ``dx = [da | db] [W | V]^T``."""
        p, ops = self.params, self.ops
        ops.mm(c.h.T, dout, out=G.views[c.pre + ".w2"])
        dh = ops.mm(dout, p[c.pre + ".w2"].T)                                 # (N, F)
        dab = ops.swiglu_gate_backward(dh, c.ab, c.drop)                      # (N, 2F)
        ops.mm(c.x.T, dab, out=G.block(c.pre + ".w13"))
        W13 = self.arena.block(self.arena.params, c.pre + ".w13")
        return ops.mm(dab, W13.T, out=into, accumulate=into is not None)

    def _embed_bwd(self, which, dx, ec: EmbedCache, G: _Grads):
        """Dropout and positional backward; returns the rows to scatter into the
        embedding's gradient, scaled by sqrt(D) (in ``dx``'s buffer or a new one)."""
        ops, D = self.ops, self.config.d_model
        d = dx if ec.drop is None else ops.dropout_backward(dx, ec.drop)
        if self.block.positions.learned:
            g = G.views[f"{which}_pos.weight"]
            g[...] = 0
            g[:ec.T] = d.reshape(-1, ec.T, D).sum(axis=0)
        d *= self.dtype.type(math.sqrt(D))
        return d

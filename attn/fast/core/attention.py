"""The fast engine's attention sub-layers (:class:`Attentions`, forward beside backward): the heads
as views of the fused projections, QK-norm and rotary positions where they are formed, scaled
dot-product attention with its weights keys-first (or the tiled attention of
:mod:`attn.fast.core.flash`); and :func:`mask_bias`, a mask as the softmax's additive bias."""
from __future__ import annotations

import math

from ... import backend as B
from ...layers.attention import repeat_kv, sum_kv_groups
from . import flash, flash_tc
from .caches import AttendCache, AttnCache
from .pieces import drop_mask


def mask_bias(mask, dtype, xp):
    """bool mask (B, 1, Tq or 1, Tk) -> the additive bias (0 / most negative finite) and
    the queries' scale (0 where a query has no key at all; None when every query has
    one), both keys-first: (Tk, B, 1, Tq or 1) and (1, B, 1, Tq or 1)."""
    bias = xp.where(mask, dtype.type(0), xp.finfo(dtype).min).astype(dtype)
    rows = mask.any(axis=-1, keepdims=True)
    bias_t = bias.transpose(3, 0, 1, 2)
    if xp is B.host and bool(rows.all()):
        return bias_t, None
    return bias_t, rows.astype(dtype).transpose(3, 0, 1, 2)


class Attentions:
    """The attention sub-layers of ``model``'s block (its ``self_attention`` part), ``scale`` =
    ``1/sqrt(d_k)``; ``embeddings`` turns rotary positions. Reads the model's ``params`` and ``ops``."""

    def __init__(self, model, embeddings):
        cfg = model.config
        self.model, self.embeddings, self.xp = model, embeddings, model.xp
        self.part, self.rotary = model.block.self_attention, model.block.positions.rotary
        self.H, self.KV, self.Dh = cfg.n_heads, cfg.key_value_heads, cfg.d_model // cfg.n_heads
        self.dropout, self.scale = cfg.attention_dropout, 1.0 / math.sqrt(self.Dh)

    def heads(self, a, Bsz, T, n, heads=None):
        """(B*T, n*heads*Dh) -> n views (B, heads, T, Dh) of the n column blocks (``heads``:
        n_heads unless given)."""
        a5 = a.reshape(Bsz, T, n, heads or self.H, self.Dh)
        return [a5[:, :, j].transpose(0, 2, 1, 3) for j in range(n)]

    def qkv_heads(self, a, Bsz, T):
        """(B*T, D + 2KV) -> q (B, H, T, Dh), k and v (B, KV, T, Dh): views of the column blocks."""
        H, KV = self.H, self.KV
        a4 = a.reshape(Bsz, T, H + 2 * KV, self.Dh)
        return [a4[:, :, lo:hi].transpose(0, 2, 1, 3) for lo, hi in ((0, H), (H, H + KV), (H + KV, H + 2 * KV))]

    def norm_heads_(self, pre, a, which):
        """QK-norm (:meth:`attn.block.Attention.norm_heads`) of the query or key heads ``a`` (a view
        (B, heads, T, Dh)) in place. Returns its cache, or None where the block has no QK-norm."""
        if not self.part.qk_norm:
            return None
        a[...], cache = self.part.norm_heads(a, self.model.params, pre, which)
        return cache

    def norm_heads_backward_(self, pre, da, cache, which, G) -> None:
        """Backward of :meth:`norm_heads_` in place on ``da`` (a view); the gain's gradient into ``G``."""
        if cache is not None:
            da[...], G.views[f"{pre}.{which}_gamma"][...] = self.part.norm_heads_backward(da, cache)

    def norm_cross_keys_(self, kv_heads) -> list:
        """QK-norm of every decoder layer's cross-attention keys, in place (``kv_heads``: the 2L
        views keys, values, keys, ...), once, where they are projected. Returns their caches."""
        return [self.norm_heads_(f"decoder.{i}.cross_attn", kv_heads[2 * i], "k") for i in range(len(kv_heads) // 2)]

    def attend(self, q, k, v, bias_t, rows_t, rng):
        """softmax(q k^T / sqrt(d_k) + bias) v, the scores kept keys-first.

        Inputs: q (B, H, Tq, Dh), k and v (B, KV, Tk, Dh) views (KV < H: grouped-query attention,
        each key/value head repeated for its group); bias_t and rows_t the mask keys-first
        (:func:`mask_bias`), or a :class:`attn.fast.core.flash.KeyMask` and None for the tiled
        attention. Returns ctx (B*Tq, D), AttendCache whose ``w`` is the (Tk, B, H, Tq) weights (or
        the tiled attention's :class:`attn.fast.core.flash.FlashCache`)."""
        xp, ops = self.xp, self.model.ops
        if isinstance(bias_t, flash.KeyMask):
            return (flash_tc.attend if bias_t.cores else flash.attend)(ops, q, k, v, bias_t, self.scale)
        group = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, group), repeat_kv(v, group)
        Bsz, H, Tq, Dh = q.shape
        Tk = k.shape[2]
        w = xp.empty((Tk, Bsz, H, Tq), dtype=q.dtype)
        ops.bmm(k, q.swapaxes(-1, -2), out=w.transpose(1, 2, 0, 3))           # scores^T, per (b, h)
        ops.softmax0_(w, bias_t, rows_t, self.scale)
        m = drop_mask(ops, rng, w.shape, self.dropout)
        wd = w if m is None else ops.dropout_(w.copy(), m)
        ctx = xp.empty((Bsz, Tq, H, Dh), dtype=q.dtype)
        ops.bmm(wd.transpose(1, 2, 3, 0), v, out=ctx.transpose(0, 2, 1, 3))   # (B, H, Tq, Dh)
        ctx = ctx.reshape(Bsz * Tq, H * Dh)
        return ctx, AttendCache(q, k, v, w, m, ctx)

    def attend_backward(self, dctx, ac: AttendCache, dq, dk, dv):
        """Forward was ``ctx = drop(softmax(q k^T s + bias)) v`` with ``s = 1/sqrt(d_k)``; writes
        dq, dk, dv (views) in place: ``dv = wd^T dctx``, ``dw = dctx v^T``, ``ds = s *
        softmax_back(dropback(dw))``, ``dq = ds k``, ``dk = ds^T q``, keys-first. With grouped-query
        attention a key/value head's gradient is the sum of its group's (:func:`sum_kv_groups`; the
        tiled attention's own backward sums them itself)."""
        xp, ops = self.xp, self.model.ops
        if isinstance(ac, flash.FlashCache):
            backward = flash_tc.attend_backward if ac.mask.cores else flash.attend_backward
            return backward(ops, dctx, ac, dq, dk, dv, self.scale)
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
        ds = ops.softmax0_backward_(dw, ac.w, self.scale)                     # (Tk, B, H, Tq), times 1/sqrt(d_k)
        ops.bmm(ds.transpose(1, 2, 3, 0), ac.k, out=dq)
        ops.bmm(ds.transpose(1, 2, 0, 3), ac.q, out=dk)
        if group > 1:
            dk_out[...] = sum_kv_groups(dk, group)
            dv_out[...] = sum_kv_groups(dv, group)

    def out_proj(self, pre, ctx):
        """``ctx @ w_o``; the residual adds ``b_o`` (fused with its dropout, sum and norm)."""
        return self.model.ops.mm(ctx, self.model.params[pre + ".w_o"])

    def out_proj_backward(self, pre, dout, ctx, G):
        """Forward was ``out = ctx @ w_o + b_o``. Returns dctx; b_o's gradient is left to the
        caller (one column-sum launch with the input projection's bias)."""
        self.model.ops.mm(ctx.T, dout, out=G.views[pre + ".w_o"])
        return self.model.ops.mm(dout, self.model.params[pre + ".w_o"].T)

    def self_attn(self, pre, W, b, x, Bsz, T, bias, row_scale, rng):
        """The self-attention ``pre`` of x (N, D) with its fused ``[w_q | w_k | w_v]`` (W, b).
        Returns its output without b_o, :class:`AttnCache`."""
        qkv = self.model.ops.mm(x, W)
        qkv += b                                                              # (N, 3D)
        q, k, v = self.qkv_heads(qkv, Bsz, T)
        qk = (self.norm_heads_(pre, q, "q"), self.norm_heads_(pre, k, "k"))
        if self.rotary:
            self.embeddings.rope_(q, T)
            self.embeddings.rope_(k, T)
        ctx, ac = self.attend(q, k, v, bias, row_scale, rng)
        return self.out_proj(pre, ctx), AttnCache(x, W, ac, pre, qk)

    def self_attn_backward(self, dout, c: AttnCache, G, into=None):
        ops = self.model.ops
        dctx = self.out_proj_backward(c.pre, dout, c.att.ctx, G)
        Bsz, H, T, Dh = c.att.q.shape
        dqkv = self.xp.empty((Bsz * T, c.W.shape[1]), dtype=dout.dtype)     # (N, D + 2KV)
        dq, dk, dv = self.qkv_heads(dqkv, Bsz, T)
        self.attend_backward(dctx, c.att, dq, dk, dv)
        if self.rotary:                           # forward turned q and k: turn their gradients back
            self.embeddings.rope_(dq, T, inverse=True)
            self.embeddings.rope_(dk, T, inverse=True)
        self.norm_heads_backward_(c.pre, dq, c.qk[0], "q", G)
        self.norm_heads_backward_(c.pre, dk, c.qk[1], "k", G)
        # Forward was qkv = x @ [w_q | w_k | w_v] + [b_q | b_k | b_v]: the arena's two blocks.
        ops.mm(c.x.T, dqkv, out=G.block(c.pre + ".w_qkv"))                    # (D, 3D)
        ops.colsums((dout, G.views[c.pre + ".b_o"]), (dqkv, G.block(c.pre + ".b_qkv")))
        return ops.mm(dqkv, c.W.T, out=into, accumulate=into is not None)

    def cross_attn(self, pre, Wq, bq, x, kv, Bsz, T, bias, row_scale, rng):
        """The cross-attention ``pre`` of x (N_t, D) over the key and value heads ``kv`` (QK-normed
        where they were projected). Returns its output without b_o, :class:`AttnCache`."""
        q = self.model.ops.mm(x, Wq)
        q += bq                                                               # (N_t, D)
        (q,) = self.heads(q, Bsz, T, 1)
        nq = self.norm_heads_(pre, q, "q")                                    # the keys were, when projected
        k, v = kv
        ctx, ac = self.attend(q, k, v, bias, row_scale, rng)
        return self.out_proj(pre, ctx), AttnCache(x, Wq, ac, pre, (nq, None))

    def cross_attn_backward(self, dout, c: AttnCache, dk, dv, G, into=None, keys=None):
        """``dk``, ``dv``: this layer's views of the keys' and values' gradients, which it writes
        (``keys``: QK-norm's cache of the keys, normed where they were projected; None without)."""
        ops = self.model.ops
        dctx = self.out_proj_backward(c.pre, dout, c.att.ctx, G)
        dq = self.xp.empty(dout.shape, dtype=dout.dtype)                      # (N_t, D)
        Bsz, H, T, Dh = c.att.q.shape
        (dqh,) = self.heads(dq, Bsz, T, 1)
        self.attend_backward(dctx, c.att, dqh, dk, dv)
        self.norm_heads_backward_(c.pre, dqh, c.qk[0], "q", G)
        self.norm_heads_backward_(c.pre, dk, keys, "k", G)
        ops.mm(c.x.T, dq, out=G.views[c.pre + ".w_q"])
        ops.colsums((dout, G.views[c.pre + ".b_o"]), (dq, G.views[c.pre + ".b_q"]))
        return ops.mm(dq, c.W.T, out=into, accumulate=into is not None)

    def cross_kv(self, memory, F, Bsz, S, L):
        """Keys and values of the L decoder layers' cross-attention, one matmul: kv (N_s, 2D*L)
        and its 2L views (B, KV, S, Dh)."""
        Wkv, bkv = F.kv
        kv = self.model.ops.mm(memory, Wkv)
        kv += bkv                                                             # (N_s, 2D*L)
        return kv, self.heads(kv, Bsz, S, 2 * L, self.KV)

    def cross_kv_layer(self, memory, F, i, Bsz, S):
        """Layer i's cross-attention keys and values alone: two views (B, KV, S, Dh) of one
        (N_s, 2KV) product (inference projects them layer by layer, holding one layer's)."""
        W = 2 * self.KV * self.Dh
        Wkv, bkv = F.kv
        kv = self.model.ops.mm(memory, Wkv[:, W * i:W * (i + 1)])
        kv += bkv[W * i:W * (i + 1)]
        heads = self.heads(kv, Bsz, S, 2, self.KV)
        self.norm_heads_(f"decoder.{i}.cross_attn", heads[0], "k")
        return heads

"""The fast model's forward pieces around the attention: :class:`FastForward`, a base class of
:class:`attn.fast.FastTransformer` holding the embeddings and positions (sinusoids, learned,
or the rotary tables), the norms (layer norm or RMSNorm) in their residual connections, and
the feed-forward network (ReLU or SwiGLU). Each piece asks the model's ``block`` (the parts of
:mod:`attn.block`) which it runs, and reads its ``config``, ``params``, ``ops`` and ``xp``; a
part's kind names its fused ops in :data:`FUSED_NORMS` and :data:`FUSED_FFNS`. The backward is
in :mod:`attn.fast.backward`."""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

from .. import backend as B
from ..layers import check_ids
from ..layers.rope import rope_angles
from ..model import sinusoids
from .caches import EmbedCache, FFNCache, ResCache, SwiGLUCache
from .stepmem import in_step, outside_step


class FusedNorm(NamedTuple):
    """A norm kind's fused ops (:class:`attn.fast.ops._Ops` methods, by name): alone, as post-norm's
    epilogue after the residual sum, and their backwards; ``bias``: whether the epilogue needs a
    bias (a sub-layer without one, SwiGLU, gives it zeros)."""
    alone: str
    residual: str
    backward: str
    backward_dropout: str
    bias: bool


#: Each norm's fused ops, by :attr:`attn.block.Norm.kind`.
FUSED_NORMS = {"layer": FusedNorm("layer_norm_", "residual_layer_norm_", "layer_norm_backward_",
                                  "layer_norm_backward_dropout_", True),
               "rms": FusedNorm("rms_norm_", "residual_rms_norm_", "rms_norm_backward_", "rms_norm_backward_dropout_",
                                False)}
#: Each feed-forward's forward (a :class:`FastForward` method), by :attr:`attn.block.FeedForward.kind`.
FUSED_FFNS = {"relu": "_relu_ffn", "swiglu": "_swiglu"}


class FastForward:
    """The forward of the embeddings, the norms and the feed-forward network (see the module
    docstring)."""

    _pe = None                      # the sinusoids, kept between steps
    _rope = None                    # the rotary positions' (cos, sin), kept between steps
    block = None                    # the block's parts (attn.block.parts of the config)

    # ------------------------------------------------------------------ positions

    def _pos_table(self, which: str, T: int):
        """The positional table, as the reference's, made (on first use, or longer) outside a
        step's memory: it is kept between steps (:mod:`attn.fast.stepmem`)."""
        if self.block.positions.learned:
            return self.params[f"{which}_pos.weight"]
        with outside_step() if in_step() else contextlib.nullcontext():
            self._pe = sinusoids(self.config, T, self.dtype, self.xp, self._pe)
        return self._pe

    def _rope_table(self, T: int):
        """The rotary positions' cos and sin, each (L, Dh/2) with L >= T, in the model's dtype on
        its device: made once (on first use, or longer: ``max(2 T, max_len)`` rows, as the
        sinusoids) outside a step's memory, so a step copies nothing from the host."""
        if self._rope is None or self._rope[0].shape[0] < T:
            cfg = self.config
            n = max(2 * T, cfg.max_len)
            with outside_step() if in_step() else contextlib.nullcontext():
                self._rope = tuple(self.xp.asarray(a.astype(self.dtype))
                                   for a in rope_angles(B.host.arange(n), cfg.d_model // cfg.n_heads, cfg.rope_base))
        return self._rope

    def _shared_tables(self, S: int, T: int) -> None:
        """Make the tables the parts of a split batch share, before the threads start."""
        if self.block.positions.rotary:
            self._rope_table(max(S, T))
        else:
            self._pos_table("src", S)
            self._pos_table("tgt", T)

    def _rope_(self, x, T: int, inverse: bool = False):
        """Rotary positions 0..T-1 applied in place to the heads x (B, H, T, Dh) (a view of a
        projection's output); ``inverse``: turned back (the backward)."""
        cos, sin = self._rope_table(T)
        return self.ops.rope_(x, cos[:T], sin[:T], inverse)

    def _embed(self, which, ids, rng):
        """``drop(E[ids] * sqrt(D) + PE)`` as (B*T, D) (rotary positions: no PE here)."""
        xp, D = self.xp, self.config.d_model
        E = self.params[self._emb(which)]
        if self.validate_ids:
            check_ids("embedding", "ids", ids, E.shape[0])
        Bsz, T = ids.shape
        x = xp.take(E, ids.reshape(-1), axis=0)                               # (N, D)
        x *= self.dtype.type(math.sqrt(D))
        if self.block.positions.added:
            x3 = x.reshape(Bsz, T, D)
            x3 += self._pos_table(which, T)[:T]
        m = self._drop(x, rng)
        return x, EmbedCache(ids, m, T)

    # ------------------------------------------------------------------ norms, residuals

    def _norm_params(self, norm) -> list:
        """The parameters of the norm called ``norm`` (gamma, and beta for layer norm)."""
        return [self.params[f"{norm}.{n}"] for n in self.block.norm.names]

    def _norm_(self, norm, x):
        """The norm called ``norm`` on x (N, D), which becomes xhat: layer norm or RMSNorm.
        Returns out (N, D) new, rstd (N,)."""
        fused = getattr(self.ops, FUSED_NORMS[self.block.norm.kind].alone)
        return fused(x, *self._norm_params(norm), self.block.norm.eps)

    def _residual(self, norm, x, sublayer, bias, rng):
        """post: ``N(x + drop(sub(x) + bias))``; pre: ``x + drop(sub(N(x)) + bias)``, with
        ``bias`` the sub-layer's output bias (the sub-layers leave it out, so that post-norm's
        epilogue is one fused operation; None for SwiGLU, which has none) and N the norm.
        x is not modified."""
        ops, cfg = self.ops, self.config
        if self.block.placement.pre:
            xhat = x.copy()
            h, rstd = self._norm_(norm, xhat)
            s, cs = sublayer(h)
            if bias is not None:
                s += bias
            m = self._drop(s, rng)
            s += x
            return s, ResCache(xhat, rstd, m, cs, norm)
        s, cs = sublayer(x)
        m = None
        if rng is not None and cfg.dropout > 0:
            m = ops.dropout_mask(rng, s.shape, cfg.dropout)
        fused = FUSED_NORMS[self.block.norm.kind]
        if bias is None and fused.bias:
            bias = ops.zeros(s.shape[1], s.dtype)
        out, rstd = getattr(ops, fused.residual)(s, bias, m, x, *self._norm_params(norm),
                                                 self.block.norm.eps)     # s becomes xhat
        return out, ResCache(s, rstd, m, cs, norm)

    def _final_norm(self, norm, x):
        """Pre-norm's last norm. Returns out, (xhat, rstd)."""
        xhat = x.copy()
        out, rstd = self._norm_(norm, xhat)
        return out, (xhat, rstd)

    def _drop(self, x, rng):
        if rng is None or self.config.dropout == 0:
            return None
        m = self.ops.dropout_mask(rng, x.shape, self.config.dropout)
        self.ops.dropout_(x, m)
        return m

    # ------------------------------------------------------------------ feed-forward

    def _ffn(self, pre, x, rng):
        """The feed-forward network without its output bias (added by :meth:`_residual`)."""
        return getattr(self, FUSED_FFNS[self.block.ffn.kind])(pre, x, rng)

    def _relu_ffn(self, pre, x, rng):
        """``drop(relu(x w1 + b1)) w2`` (equation 2; + b2 in :meth:`_residual`)."""
        p, ops = self.params, self.ops
        a = ops.mm(x, p[pre + ".w1"])                                         # (N, F)
        m = scale = None
        if rng is not None and self.config.relu_dropout > 0:
            m = ops.dropout_mask(rng, a.shape, self.config.relu_dropout)
            scale = m.scale
        ops.bias_relu_dropout_(a, p[pre + ".b1"], m)                          # drop(relu(x @ w1 + b1))
        out = ops.mm(a, p[pre + ".w2"])                                       # + b2 in _residual
        return out, FFNCache(x, a, scale, pre)

    def _swiglu(self, pre, x, rng):
        """``drop(silu(x W) * x V) W2`` (:func:`attn.layers.swiglu.swiglu_forward`), W | V one
        product with the arena's ``w13`` block."""
        ops = self.ops
        ab = ops.mm(x, self.arena.block(self.arena.params, pre + ".w13"))    # (N, 2F)
        m = None
        if rng is not None and self.config.relu_dropout > 0:
            m = ops.dropout_mask(rng, (ab.shape[0], ab.shape[1] // 2), self.config.relu_dropout)
        h = ops.swiglu_gate(ab, m)                                            # (N, F)
        return ops.mm(h, self.params[pre + ".w2"]), SwiGLUCache(x, ab, h, m, pre)

    def _ffn_bias(self, pre):
        """The feed-forward's output bias (None for SwiGLU)."""
        return self.params[pre + ".ffn.b2"] if self.block.ffn.out_bias else None

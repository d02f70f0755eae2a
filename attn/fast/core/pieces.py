"""The fast engine's pieces around the attention, forward beside backward: :class:`Embeddings`
(tokens and positions), :class:`Residuals` (a sub-layer in its residual with the block's norm) and
the feed-forward networks :class:`ReluNetwork` and :class:`SwiGLUNetwork` (:func:`feed_forward`
picks the block's). Each reads from the model only its ``params`` and ``ops``."""
from __future__ import annotations

import math
from typing import NamedTuple

from ... import backend as B
from ...layers import check_ids, layer_norm_forward, rmsnorm_forward
from ...layers.rope import rope_angles
from ...model import embedding_name, sinusoids
from .caches import EmbedCache, FFNCache, ResCache, SwiGLUCache
from ..gpu.stepmem import outside_step


def drop_mask(ops, rng, shape, p: float):
    """The dropout mask of rate p for ``shape``: None without ``rng`` or at 0."""
    return None if rng is None or p == 0 else ops.dropout_mask(rng, shape, p)


def dropout_(ops, x, p: float, rng):
    """Dropout at rate p on x in place (nothing without ``rng`` or at 0). Returns its mask or None."""
    m = drop_mask(ops, rng, x.shape, p)
    if m is not None:
        ops.dropout_(x, m)
    return m


class Embeddings:
    """``drop(E[ids] * sqrt(D) + PE)`` and its backward, and the positions' tables kept between steps:
    ``pe``, the sinusoids; ``rope``, the rotary positions' (cos, sin)."""

    def __init__(self, model):
        self.model, self.config, self.positions = model, model.config, model.block.positions
        self.dtype, self.xp = model.dtype, model.xp
        self.pe = self.rope = None

    def table(self, which: str, T: int):
        """The positional table added to the ``which`` (``src``, ``tgt``) embeddings, as the
        reference's: the learned parameters, or the sinusoids (made, or longer, outside a step)."""
        if self.positions.learned:
            return self.model.params[f"{which}_pos.weight"]
        with outside_step():
            self.pe = sinusoids(self.config, T, self.dtype, self.xp, self.pe)
        return self.pe

    def rope_table(self, T: int):
        """The rotary positions' cos and sin, each (L, Dh/2) with L >= T, on the model's device: made
        on first use (or longer: ``max(2 T, max_len)`` rows) outside a step's memory."""
        if self.rope is None or self.rope[0].shape[0] < T:
            cfg = self.config
            n = max(2 * T, cfg.max_len)
            with outside_step():
                self.rope = tuple(self.xp.asarray(a.astype(self.dtype))
                                  for a in rope_angles(B.host.arange(n), cfg.d_model // cfg.n_heads, cfg.rope_base))
        return self.rope

    def shared_tables(self, S: int, T: int) -> None:
        """Make the tables the parts of a split batch share, before the threads start."""
        if self.positions.rotary:
            self.rope_table(max(S, T))
        else:
            for which, n in (("src", S), ("tgt", T)):
                if which in self.positions.stacks:        # a language model embeds no source
                    self.table(which, n)

    def rope_(self, x, T: int, inverse: bool = False):
        """Rotary positions 0..T-1 turning the heads x (B, H, T, Dh) in place (back: ``inverse``)."""
        cos, sin = self.rope_table(T)
        return self.model.ops.rope_(x, cos[:T], sin[:T], inverse)

    def forward(self, which, ids, rng):
        """``drop(E[ids] * sqrt(D) + PE)`` as (B*T, D) (rotary positions: no PE here)."""
        model, D = self.model, self.config.d_model
        E = model.params[embedding_name(self.config, which)]
        if model.validate_ids:
            check_ids("embedding", "ids", ids, E.shape[0])
        Bsz, T = ids.shape
        x = self.xp.take(E, ids.reshape(-1), axis=0)                          # (N, D)
        x *= self.dtype.type(math.sqrt(D))
        if self.positions.added:
            x3 = x.reshape(Bsz, T, D)
            x3 += self.table(which, T)[:T]
        m = dropout_(model.ops, x, self.config.dropout, rng)
        return x, EmbedCache(ids, m, T)

    def backward(self, which, dx, ec: EmbedCache, G):
        """Forward was ``x = drop(E[ids] * sqrt(D) + PE)``: the dropout's and a learned table's
        backward (its gradient into ``G``). Returns the rows to scatter into the embedding's
        gradient, scaled by sqrt(D) (in ``dx``'s buffer or a new one)."""
        ops, D = self.model.ops, self.config.d_model
        d = dx if ec.drop is None else ops.dropout_backward(dx, ec.drop)
        if self.positions.learned:
            g = G.views[f"{which}_pos.weight"]
            g[...] = 0
            g[:ec.T] = d.reshape(-1, ec.T, D).sum(axis=0)
        d *= self.dtype.type(math.sqrt(D))
        return d


class FusedNorm(NamedTuple):
    """A norm's fused ops (:class:`attn.fast.core.ops.Ops` methods, by name): alone, as post-norm's
    epilogue after the residual sum, and their backwards; ``bias``: whether the epilogue needs a
    bias (a sub-layer without one, SwiGLU, gives it zeros)."""
    alone: str
    residual: str
    backward: str
    backward_dropout: str
    bias: bool


#: Each norm's fused ops, by the readable forward of its part (:attr:`attn.block.Norm.forward_pair`).
FUSED_NORMS = {layer_norm_forward: FusedNorm("layer_norm_", "residual_layer_norm_", "layer_norm_backward_",
                                             "layer_norm_backward_dropout_", True),
               rmsnorm_forward: FusedNorm("rms_norm_", "residual_rms_norm_", "rms_norm_backward_",
                                          "rms_norm_backward_dropout_", False)}


class Residuals:
    """A sub-layer in its residual connection with the block's norm where its placement puts it,
    pre-norm's final norm, and their backwards. ``fused``: the norm's fused ops."""

    def __init__(self, model):
        self.model, self.norm, self.placement = model, model.block.norm, model.block.placement
        self.fused = FUSED_NORMS[self.norm.forward_pair]
        self.dropout = model.config.dropout

    def params(self, name) -> list:
        """The parameters of the norm called ``name`` (gamma, and beta for layer norm)."""
        p = self.model.params
        return [p[f"{name}.{n}"] for n in self.norm.names]

    def norm_(self, name, x, ops=None):
        """The norm called ``name`` on x (N, D), which becomes xhat, by ``ops`` (the model's unless
        given). Returns out (N, D) new, rstd (N,)."""
        ops = self.model.ops if ops is None else ops
        return getattr(ops, self.fused.alone)(x, *self.params(name), self.norm.eps)

    def residual(self, name, x, sublayer, bias, rng):
        """post: ``N(x + drop(sub(x) + bias))``; pre: ``x + drop(sub(N(x)) + bias)``, with
        ``bias`` the sub-layer's output bias (the sub-layers leave it out, so that post-norm's
        epilogue is one fused operation; None for SwiGLU, which has none) and N the norm
        called ``name``. x is not modified. Returns out, :class:`ResCache`."""
        ops = self.model.ops
        if self.placement.pre:
            h, (xhat, rstd) = self.final_norm(name, x)                        # on a copy of x
            s, cs = sublayer(h)
            if bias is not None:
                s += bias
            m = dropout_(ops, s, self.dropout, rng)
            s += x
            return s, ResCache(xhat, rstd, m, cs, name)
        s, cs = sublayer(x)
        m = drop_mask(ops, rng, s.shape, self.dropout)
        if bias is None and self.fused.bias:
            bias = ops.zeros(s.shape[1], s.dtype)
        out, rstd = getattr(ops, self.fused.residual)(s, bias, m, x, *self.params(name), self.norm.eps)  # s: xhat
        return out, ResCache(s, rstd, m, cs, name)

    def final_norm(self, name, x):
        """The norm called ``name`` on a copy of x (pre-norm's, a stack's last). Returns out, (xhat, rstd)."""
        xhat = x.copy()
        out, rstd = self.norm_(name, xhat)
        return out, (xhat, rstd)

    def backward(self, dout, c: ResCache, sub_bwd, G):
        """Backward of :meth:`residual`, overwriting ``dout``; the norm's gradients into ``G``.
        ``sub_bwd(ds, cache, G, into)`` adds the sub-layer's input gradient to ``into`` (its last
        product accumulates there: post-norm's residual sum costs no launch of its own) or, with
        ``into`` None, returns it in an array of its own."""
        ops = self.model.ops
        if self.placement.pre:
            ds = dout if c.drop is None else ops.dropout_backward(dout, c.drop)
            dh = sub_bwd(ds, c.sub, G, None)
            dx = self.norm_backward(c.norm, dh, c.xhat, c.rstd, G)
            dx += dout
            return dx
        gamma, dgb = self.model.params[c.norm + ".gamma"], G.block(c.norm + ".gamma_beta")
        fused = getattr(ops, self.fused.backward_dropout)
        dy, ds = fused(dout, c.xhat, c.rstd, gamma, c.drop, out=dgb)                    # y = x + drop(s)
        return sub_bwd(ds, c.sub, G, dy)                                      # dy + d(sub)/dx

    def norm_backward(self, name, dout, xhat, rstd, G):
        """Backward of :meth:`norm_` in place on ``dout``; the gains' gradients into ``G``. Returns dx."""
        gamma, out = self.model.params[name + ".gamma"], G.block(name + ".gamma_beta")
        return getattr(self.model.ops, self.fused.backward)(dout, xhat, rstd, gamma, out=out)[0]


class ReluNetwork:
    """The paper's feed-forward network (equation 2), ``drop(relu(x w1 + b1)) w2 + b2``, the
    output bias b2 left to :meth:`Residuals.residual` (:meth:`bias`)."""

    def __init__(self, model):
        self.model, self.dropout = model, model.config.relu_dropout

    def bias(self, pre):
        """The output bias of the layer ``pre`` (``decoder.0``...)."""
        return self.model.params[pre + ".ffn.b2"]

    def forward(self, pre, x, rng):
        """``drop(relu(x w1 + b1)) w2`` of the network ``pre`` (``decoder.0.ffn``...)."""
        p, ops = self.model.params, self.model.ops
        a = ops.mm(x, p[pre + ".w1"])                                         # (N, F)
        m = drop_mask(ops, rng, a.shape, self.dropout)
        ops.bias_relu_dropout_(a, p[pre + ".b1"], m)                          # drop(relu(x @ w1 + b1))
        out = ops.mm(a, p[pre + ".w2"])                                       # + b2 in the residual
        return out, FFNCache(x, a, None if m is None else m.scale, pre)

    def backward(self, dout, c: FFNCache, G, into=None):
        """Forward was ``out = a @ w2 + b2`` with ``a = drop(relu(x @ w1 + b1))``."""
        p, ops, gv = self.model.params, self.model.ops, G.views
        ops.mm(c.a.T, dout, out=gv[c.pre + ".w2"])
        da = ops.mm(dout, p[c.pre + ".w2"].T)                                 # (N, F)
        ops.relu_backward_(da, c.a)
        if c.drop_scale is not None:
            da *= da.dtype.type(c.drop_scale)
        ops.mm(c.x.T, da, out=gv[c.pre + ".w1"])
        ops.colsums((dout, gv[c.pre + ".b2"]), (da, gv[c.pre + ".b1"]))
        return ops.mm(da, p[c.pre + ".w1"].T, out=into, accumulate=into is not None)


class SwiGLUNetwork:
    """SwiGLU, ``drop(silu(x W) * x V) W2`` (:func:`attn.layers.swiglu.swiglu_forward`), W | V one
    product with the arena's ``w13`` block; no output bias."""

    def __init__(self, model):
        self.model, self.arena, self.dropout = model, model.arena, model.config.relu_dropout

    def bias(self, pre):
        return None

    def forward(self, pre, x, rng):
        ops = self.model.ops
        ab = ops.mm(x, self.arena.block(self.arena.params, pre + ".w13"))    # (N, 2F)
        m = drop_mask(ops, rng, (ab.shape[0], ab.shape[1] // 2), self.dropout)
        h = ops.swiglu_gate(ab, m)                                            # (N, F)
        return ops.mm(h, self.model.params[pre + ".w2"]), SwiGLUCache(x, ab, h, m, pre)

    def backward(self, dout, c: SwiGLUCache, G, into=None):
        """Forward was ``out = h @ w2`` with ``h = drop(silu(a) * b)``, ``[a | b] = x @ [W | V]``:
        ``dw2 = h^T dout``, ``dh = dout w2^T``, ``[da | db]`` by the gate's backward, then one
        product each for ``d[W | V] = x^T [da | db]`` and ``dx = [da | db] [W | V]^T``."""
        p, ops = self.model.params, self.model.ops
        ops.mm(c.h.T, dout, out=G.views[c.pre + ".w2"])
        dh = ops.mm(dout, p[c.pre + ".w2"].T)                                 # (N, F)
        dab = ops.swiglu_gate_backward(dh, c.ab, c.drop)                      # (N, 2F)
        ops.mm(c.x.T, dab, out=G.block(c.pre + ".w13"))
        W13 = self.arena.block(self.arena.params, c.pre + ".w13")
        return ops.mm(dab, W13.T, out=into, accumulate=into is not None)


def feed_forward(model):
    """The network of ``model``'s block: SwiGLU where its part is gated, else the paper's."""
    return (SwiGLUNetwork if model.block.ffn.gated else ReluNetwork)(model)

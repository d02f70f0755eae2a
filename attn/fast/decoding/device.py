"""Incremental decoding on CuPy: :class:`DeviceDecodeState` and its step. A decoding step there is
bound by how many kernels it launches and how often it waits for the host, not by its arithmetic: a
row is one query. The state preallocates everything a step writes, so that a steady-state position
allocates nothing from the memory pool, and runs each sub-layer as its product(s) and one kernel
(:mod:`attn.fast.gpu.kernels`, "decoding"). The NumPy step is :mod:`attn.fast.decoding.host`."""
from __future__ import annotations

import functools
import math

from ... import backend as B
from ..core.dispatch import ops_for
from ..core.layer import decoder_layer
from .host import check_length, decoding_weights, per_row, regroup, source_bias, successor


class _DeviceBuffers:
    """What device steps write, shared by the states of one decoding: the self-attention keys and
    values of every layer in one array ``kv`` (rows, L, 2, H, capacity, Dh) (one launch reorders
    all layers: beam search's every step), a spare of that shape for the reorder (made at the first
    :meth:`DeviceDecodeState.select`), and each step's buffers for ``rows`` rows (a step of n rows
    uses the first n). ``generation`` counts steps and selects: only the state of the latest one
    may be stepped or selected from."""

    def __init__(self, model, rows: int, capacity: int, S: int):
        self.model, self.S = model, S
        self.generation = 0
        self._make(rows, capacity)

    def _make(self, rows: int, capacity: int, keep=None):
        cfg, xp, dt = self.model.config, self.model.xp, self.model.dtype
        D, H, L = cfg.d_model, cfg.n_heads, cfg.n_decoder_layers
        V = self.model.params[self.model._emb("out")].shape[0]
        self.rows, self.capacity = rows, capacity
        kv = xp.empty((rows, L, 2, H, capacity, D // H), dtype=dt)
        if keep is not None:                           # (old kv, filled rows, filled positions)
            old, n, t = keep
            kv[:n, :, :, :, :t] = old[:n, :, :, :, :t]
        self.kv, self.spare = kv, None
        e = lambda *shape: xp.empty(shape, dtype=dt)    # noqa: E731
        self.x, self.h, self.ctx, self.s, self.qc = (e(rows, D) for _ in range(5))
        self.qkv, self.a, self.logits = e(rows, 3 * D), e(rows, cfg.d_ff), e(rows, V)
        self.w_self = e(rows, H, capacity)
        self.cross_w = [e(rows, H, 1, self.S) for _ in range(L)]

    def fit(self, rows: int, capacity: int, n: int, t: int) -> None:
        """Room for ``rows`` rows and ``capacity`` positions, the first n rows' t positions kept
        (a new set of buffers when either grows: a quarter more than asked, rarely)."""
        if rows > self.rows or capacity > self.capacity:
            grow = lambda want, have: have if want <= have else max(want, have + have // 4)   # noqa: E731
            self._make(grow(rows, self.rows), grow(capacity, self.capacity), keep=(self.kv, n, t))


class DeviceDecodeState:
    """A :class:`attn.model.DecodeState` for :class:`attn.fast.FastTransformer` on CuPy, read as
    :class:`attn.fast.FastDecodeState` is (the cross-attention keys and values kept once per
    ``group`` rows of one sentence). Its buffers are preallocated (:class:`_DeviceBuffers`, sized by
    :func:`start`'s ``reserve``): a step launches its kernels into them and allocates nothing, and
    what it returns are their views, overwritten by the next step. A state is stepped (or selected
    from) once: using an older one raises a ValueError."""
    __slots__ = ("cross", "group", "src_mask", "length", "sentence", "buf", "fused", "src_bias", "generation")

    def __init__(self, cross, group, src_mask, length, sentence, buf, fused, src_bias):
        self.cross, self.group, self.src_mask, self.length = cross, group, src_mask, length
        self.sentence, self.buf, self.fused, self.src_bias = sentence, buf, fused, src_bias
        self.generation = buf.generation

    def _check_latest(self, what: str) -> None:
        if self.generation != self.buf.generation:
            raise ValueError(f"DeviceDecodeState.{what}: this state was already stepped or selected from (its "
                             f"buffers now hold a later position); use the state that call returned")

    def _successor(self, **changes) -> "DeviceDecodeState":
        self.buf.generation += 1
        return successor(self, generation=self.buf.generation, **changes)

    @property
    def n(self) -> int:
        return self.sentence.shape[0]

    cross_kv = property(per_row)

    @property
    def self_kv(self) -> list:
        self._check_latest("self_kv")
        t, kv = self.length, self.buf.kv
        if t == 0:
            return [(None, None)] * kv.shape[1]
        return [(kv[:self.n, i, 0, :, :t], kv[:self.n, i, 1, :, :t]) for i in range(kv.shape[1])]

    def select(self, index, index_h=None) -> "DeviceDecodeState":
        """Keep (and repeat) rows ``index`` (device ints; ``index_h`` the same on the host, else it
        is fetched): one ``gather_prefix`` launch gathers every layer's keys and values at the
        positions written so far into the spare buffer, which then becomes the buffer."""
        self._check_latest("select")
        np, xp = B.host, B.get_array_module(self.src_bias)
        index_h = B.to_host(index) if index_h is None else np.asarray(index_h)
        if not (B.get_array_module(index) is xp and index.dtype == np.int64 and index.flags.c_contiguous):
            index = xp.asarray(index_h.astype(np.int64))
        new = regroup(self, index, index_h, xp)                      # the range checked first
        t, buf = self.length, self.buf
        buf.fit(index_h.shape[0], max(buf.capacity, t), self.n, t)
        if buf.spare is None:
            buf.spare = xp.empty_like(buf.kv)
        kernels(xp).gather_prefix(buf.kv, buf.spare, index, t)       # the t positions written, not the room
        buf.kv, buf.spare = buf.spare, buf.kv
        return self._successor(**new)

    def truncate(self, length: int) -> "DeviceDecodeState":
        """The state after its first ``length`` positions (:meth:`attn.model.DecodeState.truncate`):
        the buffers stay, the next step writes over the positions after."""
        self._check_latest("truncate")
        if not 0 <= length <= self.length:
            raise ValueError(f"DeviceDecodeState.truncate: length must be in 0..{self.length}, got {length}")
        return self._successor(length=length)


def start(model, cross_kv, src_mask, reserve=None) -> DeviceDecodeState:
    """The device state before the first step: the cross-attention keys/values (B, H, S, Dh) per
    layer (the reference's), the mask (B, 1, 1, S) as a bias (B, S), and buffers for ``reserve`` =
    (rows, positions) (the most the search will step: beam search's B * K rows; without it, B rows
    and 16 positions, grown as needed)."""
    n, S = src_mask.shape[0], src_mask.shape[-1]
    rows, positions = reserve if reserve is not None else (n, 16)
    buf = _DeviceBuffers(model, max(int(rows), n, 1), max(int(positions), 1), S)
    return DeviceDecodeState(list(cross_kv), 1, src_mask, 0, B.host.arange(n), buf, decoding_weights(model),
                             source_bias(model, src_mask.reshape(n, S)))


def kernels(xp):
    """The decoding kernels' launches (:class:`attn.fast.gpu.kernels.DecodeKernels`) on ``xp``."""
    return _launches(ops_for(xp))


@functools.lru_cache(maxsize=None)
def _launches(ops):
    from ..gpu.kernels import DecodeKernels
    return DecodeKernels(ops)


def step(model, tokens, state: DeviceDecodeState):
    """One position for every row (:meth:`attn.model.Transformer.decode_step`): log-probabilities
    (n, V), the new state, the cross-attention weights per layer (n, H, 1, S), views of the buffers.
    One ``decode_embed`` (the embedding, and pre-norm's first norm), each decoder layer on
    :class:`DeviceRows`, then the projection and ``log_softmax_rows``."""
    t, n, xp, p = state.length, state.n, model.xp, model.params
    check_length(model, t)
    state._check_latest("decode_step")
    if tokens.shape != (n,):
        raise ValueError(f"decode_step: tokens must be ({n},), one per row of the state, got {tuple(tokens.shape)}")
    if tokens.dtype != B.host.int64 or not tokens.flags.c_contiguous:
        tokens = xp.ascontiguousarray(tokens, dtype=B.host.int64)
    state.buf.fit(n, t + 1, n, t)
    run = DeviceRows(model, state)
    g1, b1 = run.norm("decoder.0.norm1")
    run.K.embed(tokens, p[model._emb("tgt")], model.embeddings.table("tgt", t + 1)[t], math.sqrt(model.config.d_model),
                run.x, run.h, g1, b1, run.eps, run.pre)
    for i in range(model.config.n_decoder_layers):
        decoder_layer(run, i, run.x)
    logits = state.buf.logits[:n]
    run.K.log_softmax(model.project(run.inp, out=logits), logits)
    return logits, state._successor(length=t + 1), [w[:n] for w in state.buf.cross_w]


def positions(model, tokens, state: DeviceDecodeState):
    """T positions for every row, tokens (n, T) (:meth:`attn.model.Transformer.decode_positions`):
    one :func:`step` after another, the kernels reading one position each; what each step left in
    its buffers copied out."""
    xp, logps, weights = model.xp, [], []
    for j in range(tokens.shape[1]):
        logp, state, cross_w = step(model, tokens[:, j], state)
        logps.append(logp.copy())
        weights.append([w.copy() for w in cross_w])
    return xp.stack(logps, axis=1), state, [xp.concatenate(w, axis=2) for w in zip(*weights)]


class DeviceRows:
    """The CuPy step's sub-layers (:func:`attn.fast.core.layer.decoder_layer`) for the n rows of
    ``state`` at position t, in its buffers (nothing allocated): each sub-layer reads ``inp``
    (pre-norm: ``h``, the norm of x; post-norm: x itself), writes its output without the bias
    into ``s`` by its products around one kernel (``one_query_attention``: the new key and value
    written into the cache, then the attention; the feed-forward's ``bias_relu_drop``), and
    :meth:`residual` is one ``add_norm``: x <- x + s + bias, then pre-norm h <- the next norm
    of x, post-norm x <- this norm of x."""

    def __init__(self, model, state: DeviceDecodeState):
        self.model, self.state, self.buf = model, state, state.buf
        self.K, self.ops = kernels(model.xp), ops_for(model.xp)
        self.n, self.t, self.eps, self.pre = state.n, state.length, model.config.ln_eps, model.block.placement.pre
        self.x, self.h, self.ctx, self.s, self.qc, self.qkv, self.a, self.w_self = \
            (b[:self.n] for b in (self.buf.x, self.buf.h, self.buf.ctx, self.buf.s, self.buf.qc, self.buf.qkv,
                                  self.buf.a, self.buf.w_self))
        self.inp = self.h if self.pre else self.x
        L = model.config.n_decoder_layers
        norms = [f"decoder.{i}.norm{j}" for i in range(L) for j in (1, 2, 3)] + ["decoder.norm"]
        self.next_norm = dict(zip(norms, norms[1:]))

    def norm(self, name):
        return self.model.params[name + ".gamma"], self.model.params[name + ".beta"]

    def residual(self, norm, x, sub, bias):
        sub(self.inp)
        g, b = self.norm(self.next_norm[norm] if self.pre else norm)
        self.K.add_norm(x, self.s, bias, self.h if self.pre else x, g, b, self.eps)
        return x, None

    def self_attn(self, i, h):
        W, b = self.state.fused.dec_qkv[i]
        self.model.xp.matmul(h, W, out=self.qkv)
        kv = self.buf.kv[:self.n, i]
        self.K.attend(self.qkv, b, kv[:, 0], kv[:, 1], 1, None, self.w_self, self.ctx, self.model.config.n_heads,
                      self.t + 1, self_attn=True)
        self.model.xp.matmul(self.ctx, self.model.params[f"decoder.{i}.self_attn.w_o"], out=self.s)

    def cross_attn(self, i, h):
        Wq, bq = self.state.fused.cross_q[i]
        self.model.xp.matmul(h, Wq, out=self.qc)
        kc, vc = self.state.cross[i]
        self.K.attend(self.qc, bq, kc, vc, self.state.group, self.state.src_bias, self.buf.cross_w[i][:self.n, :, 0],
                      self.ctx, self.model.config.n_heads, kc.shape[2], self_attn=False)
        self.model.xp.matmul(self.ctx, self.model.params[f"decoder.{i}.cross_attn.w_o"], out=self.s)

    def ffn(self, pre, h):
        p, xp = self.model.params, self.model.xp
        xp.matmul(h, p[pre + ".w1"], out=self.a)
        self.ops.bias_relu_dropout_(self.a, p[pre + ".b1"], None)
        xp.matmul(self.a, p[pre + ".w2"], out=self.s)

"""Incremental decoding on CuPy: :class:`DeviceDecodeState` and its step. A decoding step there is
bound by how many kernels it launches and how often it waits for the host, not by its arithmetic: a
row is one query. The state preallocates everything a step writes, so that a steady-state position
allocates nothing from the memory pool, and runs each sub-layer as its product(s) and one kernel
(:mod:`attn.fast.gpu.kernels`, "decoding"). The NumPy step is :mod:`attn.fast.decoding.host`."""
from __future__ import annotations

import math

from ... import backend as B
from ..core.dispatch import ops_for
from ..core.layer import decoder_layer
from .host import check_length, per_row, regroup



class _DeviceBuffers:
    """What device steps write, shared by the states of one decoding: the self-attention keys and
    values of every layer in one array ``kv`` (rows, L, 2, H, capacity, Dh) (one launch reorders
    all layers: beam search's every step), a spare of that shape for the reorder (made at the first
    :meth:`DeviceDecodeState.select`), and each step's buffers for ``rows`` rows (a step of n rows
    uses the first n). ``generation`` counts steps and selects: only the state of the latest one
    may be stepped or selected from."""

    def __init__(self, model, rows: int, capacity: int, S: int):
        self.model, self.S = model, S
        self.spare = None
        self.generation = 0
        self.project_into = _projects_into(model)
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
    """A :class:`attn.model.DecodeState` for :class:`attn.fast.FastTransformer` on CuPy.

    As :class:`FastDecodeState`, it reads as the reference's (``cross_kv``, ``self_kv``,
    ``src_mask``, ``length``) and keeps the cross-attention keys and values once per group of
    ``group`` rows that decode one sentence. Its keys, values and step buffers are preallocated
    (:class:`_DeviceBuffers`, sized by ``reserve`` at :func:`start_device`), so a step launches its
    kernels into them and allocates nothing: the log-probabilities and attention weights a step
    returns are views of those buffers, overwritten by the next step. A state is stepped (or
    selected from) once; using an older one raises a ValueError. :meth:`select` takes the host
    copy of the index as well (``index_h``), so that reordering needs no transfer to the host."""
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
        fields = {k: getattr(self, k) for k in ("cross", "group", "src_mask", "length", "sentence", "fused",
                                                "src_bias")}
        fields.update(changes)
        return DeviceDecodeState(buf=self.buf, **fields)

    @property
    def n(self) -> int:
        return self.sentence.shape[0]

    @property
    def cross_kv(self) -> list:
        """Per layer the reference's (k, v), one row per decoded row, (n, H, S, Dh) (a copy when
        rows share them)."""
        return per_row(self.cross, self.group)

    @property
    def self_kv(self) -> list:
        """Per layer the (k, v) of the positions decoded so far, (n, H, t, Dh) views; (None, None)
        before the first step."""
        self._check_latest("self_kv")
        t, kv = self.length, self.buf.kv
        if t == 0:
            return [(None, None)] * kv.shape[1]
        return [(kv[:self.n, i, 0, :, :t], kv[:self.n, i, 1, :, :t]) for i in range(kv.shape[1])]

    def __iter__(self):
        return iter((self.cross_kv, self.self_kv, self.src_mask, self.length))

    def select(self, index, index_h=None) -> "DeviceDecodeState":
        """Keep (and repeat) rows ``index`` (device ints; ``index_h`` the same on the host, else it
        is fetched): the keys and values of every layer, at the positions written so far, are
        gathered by one ``gather_prefix`` launch into the spare buffer, which then becomes the
        buffer (no allocation). The cross-attention copies,
        the source bias and mask are gathered only when the rows' sentences change."""
        self._check_latest("select")
        np, xp = B.host, B.get_array_module(self.src_bias)
        index_h = B.to_host(index) if index_h is None else np.asarray(index_h)
        if index_h.size and (index_h.min() < 0 or index_h.max() >= self.n):
            raise IndexError(f"DeviceDecodeState.select: index out of range for {self.n} rows")
        n_new, t, buf = index_h.shape[0], self.length, self.buf
        buf.fit(n_new, max(buf.capacity, t), self.n, t)
        if buf.spare is None:
            buf.spare = xp.empty_like(buf.kv)
        if not (B.get_array_module(index) is xp and index.dtype == np.int64 and index.flags.c_contiguous):
            index = xp.asarray(index_h.astype(np.int64))
        _kernels(xp).gather_prefix(buf.kv, buf.spare, index, t)      # the t positions written, not the room
        buf.kv, buf.spare = buf.spare, buf.kv
        sentence, group, cross, same = regroup(self, index_h, xp)
        mask, bias = self.src_mask, self.src_bias
        if not same:
            mask, bias = mask[index], bias[index]
        return self._successor(cross=cross, group=group, src_mask=mask, sentence=sentence, src_bias=bias)

    def truncate(self, length: int) -> "DeviceDecodeState":
        """The state as it was after its first ``length`` positions
        (:meth:`attn.model.DecodeState.truncate`): the buffers stay, the next step writes over the
        positions after; this state can no longer be used, as after a step."""
        self._check_latest("truncate")
        if not 0 <= length <= self.length:
            raise ValueError(f"DeviceDecodeState.truncate: length must be in 0..{self.length}, got {length}")
        return self._successor(length=length)


def start_device(model, cross_kv, src_mask, reserve=None) -> DeviceDecodeState:
    """The device state before the first step: the cross-attention keys/values (B, H, S, Dh) per
    layer (the reference's), the mask (B, 1, 1, S) as a bias (B, S), and buffers for ``reserve`` =
    (rows, positions) (the most rows and positions the search will step: beam search's B * K rows;
    without it, B rows and 16 positions, grown as needed)."""
    xp = model.xp
    n, S = src_mask.shape[0], src_mask.shape[-1]
    rows, positions = reserve if reserve is not None else (n, 16)
    bias = xp.where(src_mask.reshape(n, S), model.dtype.type(0), xp.finfo(model.dtype).min).astype(model.dtype)
    buf = _DeviceBuffers(model, max(int(rows), n, 1), max(int(positions), 1), S)
    return DeviceDecodeState(list(cross_kv), 1, src_mask, 0, B.host.arange(n), buf, model._decoding_weights(), bias)


def _projects_into(model) -> bool:
    """Whether ``model.project`` takes ``out=`` (a subclass may override it without)."""
    import inspect
    return "out" in inspect.signature(model.project).parameters


#: The launchers of each CupyOps (by its id), made on first use.
_DECODE_KERNELS: dict = {}


def _kernels(xp):
    from ..gpu.kernels import DecodeKernels
    ops = ops_for(xp)
    K = _DECODE_KERNELS.get(id(ops))
    if K is None or K.ops is not ops:
        K = _DECODE_KERNELS[id(ops)] = DecodeKernels(ops)
    return K


def beam_candidates(logp, beam_scores, W: int, c: int, C: int, ban, info):
    """Beam search's ranking on CuPy, one ``beam_candidates`` launch: for each sentence of W beams
    (consecutive rows of logp (n, V)), each beam's c best tokens other than the two ids of ``ban``
    scored ``beam_scores`` (n,) float64 + their log-probability, then the sentence's C best of them
    into info (2, n / W, C) float64: (score, w * V + v), best first."""
    _kernels(B.get_array_module(logp)).beam_candidates(logp, beam_scores, W, c, C, ban, info)


def greedy_pick(logp, ban, info, tokens):
    """Greedy decoding's choice on CuPy, one ``greedy_pick`` launch: info (2, n) float64 <- the most
    probable id of each row of logp (n, V) other than the two ids of ``ban``, and its
    log-probability; tokens (n,) int64 <- the ids."""
    _kernels(B.get_array_module(logp)).greedy_pick(logp, ban, info, tokens)


def device_step(model, tokens, state: DeviceDecodeState):
    """One position for every row on CuPy (see :meth:`attn.model.Transformer.decode_step`):
    log-probabilities (n, V), the new state, the cross-attention weights per layer (n, H, 1, S);
    the arrays returned are the buffers' views (overwritten by the next step).

    One ``decode_embed`` (the embedding, and pre-norm's first norm), then each decoder layer,
    :func:`attn.fast.core.layer.decoder_layer` on :class:`DeviceRows`, then the projection and
    ``log_softmax_rows``."""
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
    if state.buf.project_into:
        out = model.project(run.inp, out=logits)
    else:                                          # a projection that cannot write into the buffer
        out = model.project(run.inp)
    run.K.log_softmax(out, logits)
    return logits, state._successor(length=t + 1), [w[:n] for w in state.buf.cross_w]


def device_positions(model, tokens, state: DeviceDecodeState):
    """T positions for every row, tokens (n, T) (:meth:`attn.model.Transformer.decode_positions`):
    one :func:`device_step` after another, the kernels reading one position each. Returns
    log-probabilities (n, T, V), the new state, the cross-attention weights per layer (n, H, T, S),
    copies of what each step left in its buffers."""
    xp, logps, weights = model.xp, [], []
    for j in range(tokens.shape[1]):
        logp, state, cross_w = device_step(model, tokens[:, j], state)
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
        self.K, self.ops = _kernels(model.xp), ops_for(model.xp)
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

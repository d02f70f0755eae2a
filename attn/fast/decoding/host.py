"""Incremental decoding on the fast path: one decoder position for every row, the reference's
:meth:`attn.model.Transformer.decode_step` with fewer passes over memory. On NumPy a
:class:`FastDecodeState` (below); on CuPy a :class:`DeviceDecodeState` (:mod:`attn.fast.decoding.device`:
buffers preallocated, one kernel per sub-layer, nothing allocated by a steady-state step).

What it does differently (``tests/test_fast_decoding.py`` checks the tokens and scores of greedy and
beam search against the reference decoder):

* The self-attention keys and values live in buffers with room for more positions
  (``(n, H, capacity, Dh)``, a quarter larger when full): a step writes its own position
  instead of concatenating the whole prefix again.
* Q, K and V of a step are one ``(D, 3D)`` matmul with the ``1/sqrt(d_k)`` scale folded into
  the query weights (copies of the arena's fused blocks, made once per decode).
* The rows are split into parts that run at the same time on the helper threads, each with
  single-threaded BLAS: a step of 64 sentences is a few hundred small products, too small
  for BLAS's own threads (their hand-offs cost more than the products), but two halves of
  the batch keep two cores busy with one hand-off per step.
* Cross-attention keys and values are kept once per group of consecutive rows that decode
  one sentence, not once per row: beam search keeps a sentence's beams side by side, so
  they attend to their sentence's one copy together (see :class:`FastDecodeState`), and a
  reorder within the sentences copies none of them.

* The later block (lesson 26) decodes here too, on NumPy and on CuPy (the device state
  runs the paper's sub-layers only): the cache holds ``kv_heads`` heads, which each group of
  query heads reads without a copy; a step turns its query and its new key by its position
  once (rotary positions), before the key is written into the cache; QK-norm norms them before
  that (:func:`norm_heads_`).

* Speculative decoding (:mod:`attn.speculative`) reads T positions of every row in one pass
  (:func:`decode_positions`: the same decoder layer, :class:`HostRows` given T new rows a row
  and the causal mask among them; a step is T = 1) and rolls rejected positions back
  (:meth:`FastDecodeState.truncate`: the buffers handed on, nothing copied).

A state is meant to be stepped once (as :mod:`attn.decode` does): stepping it writes the
next position into buffers its successor shares. Stepping an older state again is still
correct: it sees that its buffers have moved on and copies them first. :meth:`FastDecodeState.select`
hands the buffers on instead (reordered layer by layer, each old array freed as its copy is
made): after it only the selected state can be used, the others raise a ValueError that says so.
"""
from __future__ import annotations

import math

from ... import backend as B
from ..core.dispatch import ops_for
from ..core.layer import decoder_layer
from ..core.threads import THREADS, row_slices, single_threaded_blas

#: Greedy decoding on a GPU generates this many positions between two looks at which sentences
#: have ended (one transfer to the host each, :attr:`attn.engine.Search.check_every`), instead of
#: one look (a synchronisation) at every position. The tokens are the same: the host replays the
#: positions in order and keeps each sentence's tokens up to its EOS; a finished sentence's row
#: runs on for at most this many positions less one. On the host there is nothing to wait for.
EOS_CHECK_EVERY = 8


def rows_to_device(xp, index, tokens, scores):
    """:meth:`attn.engine.Search.rows_to_device` in one transfer: the (n,) row index and tokens
    (int64) and scores (float64) as one int64 array (the scores' bits ride in a row), returned as
    device views of it, so nothing is converted there."""
    np = B.host
    packed = xp.asarray(np.stack([np.asarray(index, dtype=np.int64), np.asarray(tokens, dtype=np.int64),
                                  np.ascontiguousarray(scores, dtype=np.float64).view(np.int64)]))
    return packed[0], packed[1], packed[2].view(xp.float64)


class _KV:
    """The self-attention keys and values of every decoder layer, ``(n, H, capacity, Dh)``
    each, and how many positions are written (``filled``)."""
    __slots__ = ("keys", "values", "filled")

    def __init__(self, keys, values, filled):
        self.keys, self.values, self.filled = keys, values, filled

    @classmethod
    def empty(cls, xp, n, H, Dh, L, capacity, dtype):
        shape = (n, H, capacity, Dh)
        return cls([xp.empty(shape, dtype=dtype) for _ in range(L)],
                   [xp.empty(shape, dtype=dtype) for _ in range(L)], 0)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def copy(self, length: int, capacity: int) -> "_KV":
        """A new buffer with the first ``length`` positions and room for ``capacity``."""
        xp = B.get_array_module(self.keys[0])
        new = _KV.empty(xp, self.keys[0].shape[0], self.keys[0].shape[1], self.keys[0].shape[3],
                        len(self.keys), capacity, self.keys[0].dtype)
        for a, b in zip(self.keys + self.values, new.keys + new.values):
            b[:, :, :length] = a[:, :, :length]
        new.filled = length
        return new

    def grow_(self, capacity: int) -> "_KV":
        """Room for ``capacity`` positions, in place: layer by layer a larger array receives
        the filled positions and replaces the old one (freed then), so growing needs one
        layer's array beyond the buffers. The states sharing this ``_KV`` see the new arrays."""
        xp = B.get_array_module(self.keys[0])
        for arrays in (self.keys, self.values):
            for i, a in enumerate(arrays):
                n, H, _, Dh = a.shape
                b = xp.empty((n, H, capacity, Dh), dtype=a.dtype)
                b[:, :, :self.filled] = a[:, :, :self.filled]
                arrays[i] = b
        return self

    def take(self, index, length: int) -> "_KV":
        """Rows ``index`` (with repeats, already checked to lie in range), same capacity, in a
        new ``_KV`` that takes this one's place. Layer by layer, each old array is let go as
        soon as its copy exists, so a reorder needs one layer's array beyond the buffers, not
        a second set of them (beam search reorders at every step); this ``_KV`` is left empty
        (:attr:`moved`), and the states that shared it can no longer be stepped. The whole
        rows are copied (contiguous blocks: faster than copying the filled positions alone
        through a strided view, and the room beyond them is at most a quarter, or 8 positions,
        when the buffers grew in place); buffers made with more room (a search's reserve, see
        :func:`start`) are first cut to the room they would have grown to, so that a reorder at
        every step copies no more than it did with growing buffers."""
        xp = B.get_array_module(self.keys[0])
        keys, values = self.keys, self.values
        keep = min(self.capacity, max(16, length + max(8, length // 4)))
        self.keys, self.values, self.filled = [], [], -1
        for arrays in (keys, values):
            for i in range(len(arrays)):                         # the old array is freed here
                a = arrays[i]
                arrays[i] = xp.take(a, index, axis=0) if keep == a.shape[2] else a[index, :, :keep]
        return _KV(keys, values, length)

    def cut(self, length: int) -> "_KV":
        """The first ``length`` positions, in a new ``_KV`` that takes this one's place: the arrays
        are handed on, nothing copied (the next step writes over the positions after). This one is
        left empty (:attr:`moved`), as by :meth:`take`: a state that still counted the positions
        after could read them overwritten."""
        new = _KV(self.keys, self.values, length)
        self.keys, self.values, self.filled = [], [], -1
        return new

    @property
    def moved(self) -> bool:
        """True once :meth:`take` or :meth:`cut` handed the buffers to a successor."""
        return self.filled < 0


def _check_not_moved(state: "FastDecodeState", what: str) -> None:
    if state.kv.moved:
        raise ValueError(f"FastDecodeState.{what}: this state's key/value buffers were handed on by "
                         f"select() or truncate() (to save a copy of them); use the state that call returned")


class FastDecodeState:
    """A :class:`attn.model.DecodeState` for :class:`attn.fast.FastTransformer` on NumPy.

    ``cross_kv``, ``self_kv``, ``src_mask`` and ``length`` read as the reference's (and
    iterating gives them in that order); besides, it keeps the self-attention keys and
    values in growing buffers (see the module docstring), the fused decoder weights, the
    source mask as an additive bias, and which sentence each row decodes.

    The cross-attention keys and values of a row depend only on its sentence (they are the
    projections of that sentence's encoder output). Beam search keeps each sentence's
    beams side by side, so they are kept once per group of ``group`` consecutive rows
    (``cross``: (n / group, H, S, Dh) per layer) and a step attends with the group's
    queries together: beam 4 holds and reads a quarter of the copies the reference makes.
    When :meth:`select` leaves every group with the sentence it had -- beam search
    reordering the beams within each sentence, which is every step but the first and those
    where a sentence finishes -- they are not copied at all."""
    __slots__ = ("cross", "group", "src_mask", "length", "sentence", "kv", "fused", "src_bias", "src_rows")

    def __init__(self, cross, group, src_mask, length, sentence, kv, fused, src_bias, src_rows):
        self.cross, self.group, self.src_mask, self.length = cross, group, src_mask, length
        self.sentence, self.kv, self.fused, self.src_bias, self.src_rows = sentence, kv, fused, src_bias, src_rows

    @property
    def cross_kv(self) -> list:
        """Per layer the reference's (k, v), one row per decoded row, (n, H, S, Dh) (a copy when
        rows share them)."""
        return per_row(self.cross, self.group)

    @property
    def self_kv(self) -> list:
        """Per layer the (k, v) of the positions decoded so far, (n, H, t, Dh) views; (None, None)
        before the first step."""
        t = self.length
        _check_not_moved(self, "self_kv")
        if t == 0:
            return [(None, None)] * len(self.kv.keys)
        return [(k[:, :, :t], v[:, :, :t]) for k, v in zip(self.kv.keys, self.kv.values)]

    def __iter__(self):
        return iter((self.cross_kv, self.self_kv, self.src_mask, self.length))

    def select(self, index, index_host=None) -> "FastDecodeState":
        """Keep (and repeat) rows ``index``: beam search reorders hypotheses with it. The key/value
        buffers move to the new state (see :meth:`_KV.take`): this one, and the states it was
        stepped from, cannot be stepped or selected from again."""
        _check_not_moved(self, "select")
        np = B.host
        index_h = B.to_host(index)
        if index_h.size and (index_h.min() < 0 or index_h.max() >= self.sentence.shape[0]):
            raise IndexError(f"FastDecodeState.select: index out of range for {self.sentence.shape[0]} rows")
        sentence, group, cross, same = regroup(self, index_h, np)
        if same:
            mask, bias, rows = self.src_mask, self.src_bias, self.src_rows
        else:
            mask, bias = self.src_mask[index], self.src_bias[index]
            rows = None if self.src_rows is None else self.src_rows[index]
        return FastDecodeState(cross, group, mask, self.length, sentence, self.kv.take(index, self.length),
                               self.fused, bias, rows)

    def truncate(self, length: int) -> "FastDecodeState":
        """The state as it was after its first ``length`` positions
        (:meth:`attn.model.DecodeState.truncate`: speculative decoding rolls back the tokens it
        rejected). The later positions are forgotten, not copied out: the buffers move to the new
        state (:meth:`_KV.cut`), whose next step writes over them; this state, and the states it was
        stepped from, cannot be used again."""
        _check_not_moved(self, "truncate")
        if not 0 <= length <= self.length:
            raise ValueError(f"FastDecodeState.truncate: length must be in 0..{self.length}, got {length}")
        return FastDecodeState(self.cross, self.group, self.src_mask, length, self.sentence, self.kv.cut(length),
                               self.fused, self.src_bias, self.src_rows)


def per_row(cross, group: int) -> list:
    """The per-group cross-attention keys and values ``cross``, repeated for each row of a group."""
    return list(cross) if group == 1 else [(k.repeat(group, axis=0), v.repeat(group, axis=0)) for k, v in cross]


def regroup(state, index_h, xp):
    """What the rows ``index_h`` (host ints) of a decoding ``state`` share: their sentences,
    :func:`_group_size`, the keys and values per group (a gather, on ``xp``, only where the groups'
    rows change: not when beam search reorders beams within each sentence), and whether they
    decode the same sentences as before (then the source mask stays)."""
    sentence = state.sentence[index_h]
    group = _group_size(sentence)
    source = index_h[::group] // state.group            # each new group's row of the old ``cross``
    cross = state.cross
    if not (source.shape[0] == cross[0][0].shape[0] and bool((source == B.host.arange(source.shape[0])).all())):
        source = xp.asarray(source)
        cross = [(k[source], v[source]) for k, v in cross]
    same = sentence.shape == state.sentence.shape and bool((sentence == state.sentence).all())
    return sentence, group, cross, same


def _group_size(sentence) -> int:
    """The largest g such that every block of g consecutive rows decodes one sentence: the
    greatest common divisor of the lengths of the runs of equal sentences (1 for none)."""
    np = B.host
    if sentence.size == 0:
        return 1
    bounds = np.concatenate([[0], np.flatnonzero(sentence[1:] != sentence[:-1]) + 1, [sentence.size]])
    return int(np.gcd.reduce(np.diff(bounds)))


#: Most positions the key/value buffers are made with at the start (a search's reserve): beyond,
#: they grow as the decoding goes.
MAX_START_POSITIONS = 256


def start(model, cross_kv, src_mask, positions=None) -> FastDecodeState:
    """The state before the first step: cross-attention keys/values (B, H, S, Dh) per layer
    (the reference's), the fused weights, the mask (B, 1, 1, S) as a bias (B, 1, 1, S), and
    key/value buffers with room for ``positions`` (the most the search will step, at most
    :data:`MAX_START_POSITIONS`; None: 16), so that a decoding of that length never grows
    them (each growth copies every layer's buffers: a few percent of a greedy decoding)."""
    xp, cfg = model.xp, model.config
    capacity = 16 if positions is None else max(16, min(int(positions), MAX_START_POSITIONS))
    n = src_mask.shape[0]
    D, H, KV = cfg.d_model, cfg.n_heads, cfg.key_value_heads
    bias = xp.where(src_mask, model.dtype.type(0), xp.finfo(model.dtype).min).astype(model.dtype)
    rows = src_mask.any(axis=-1, keepdims=True)                               # (B, 1, 1, 1)
    rows = None if bool(rows.all()) else rows.astype(model.dtype)
    kv = _KV.empty(xp, n, KV, D // H, cfg.n_decoder_layers, capacity, model.dtype)   # the key/value heads
    return FastDecodeState(list(cross_kv), 1, src_mask, 0, B.host.arange(n), kv, model._decoding_weights(), bias, rows)


#: Least rows per part when a step is split over threads: below it the hand-off costs more
#: than the part's products save.
MIN_ROWS_PER_PART = 8


def check_length(model, t: int) -> None:
    """Position t needs a row of a learned positional table: as forward() says it, not an IndexError."""
    if model.block.positions.learned and t >= model.config.max_len:
        raise ValueError(f"decode_step: sequence length {t + 1} exceeds the learned positional "
                         f"table's {model.config.max_len} positions (raise max_len)")


def decode_step(model, tokens, state: FastDecodeState, parts: int):
    """One position for every row (see :meth:`attn.model.Transformer.decode_step`):
    log-probabilities (n, V), the new state, the cross-attention weights per layer
    (n, H, 1, S). ``parts``: how many row parts run at the same time (1: this thread)."""
    logp, new, cross_w = decode_positions(model, tokens[:, None], state, parts)
    return logp[:, 0], new, cross_w


def decode_positions(model, tokens, state: FastDecodeState, parts: int):
    """T positions for every row in one pass (see :meth:`attn.model.Transformer.decode_positions`):
    tokens (n, T) the ids at positions ``state.length``.., each attending to the cache and to the
    new positions up to its own. Returns log-probabilities (n, T, V), the new state, the
    cross-attention weights per layer (n, H, T, S). ``parts``: as :func:`decode_step`'s."""
    cfg, xp = model.config, model.xp
    t, (n, T) = state.length, tokens.shape
    check_length(model, t + T - 1)
    _check_not_moved(state, "decode_step")
    kv = state.kv
    if kv.filled != t:                           # an older state stepped again: copy first
        kv = kv.copy(t, max(t + T, max(kv.capacity, 16) * (2 if t + T > kv.capacity else 1)))
    elif t + T > kv.capacity:                    # full: a quarter more room (at least 8 positions):
        kv.grow_(max(t + T, kv.capacity + max(8, kv.capacity // 4)))   # less slack than doubling, few copies
    V = model.params[model._emb("out")].shape[0]
    S = state.cross[0][0].shape[2]
    g = state.group
    logp = xp.empty((n * T, V), dtype=model.dtype)
    cross_w = [xp.empty((n * T, cfg.n_heads, 1, S), dtype=model.dtype) for _ in range(cfg.n_decoder_layers)]
    pe = model.embeddings.table("tgt", t + T)[t:t + T] if model.block.positions.added else None   # (T, D)
    # Parts hold whole groups: one sentence with a wide beam (one group) runs on one thread.
    k = max(1, min(parts, n // MIN_ROWS_PER_PART, n // g))
    if k == 1:
        _rows(model, tokens, state, kv, t, pe, slice(0, n), logp, cross_w)
    else:                                                  # parts of whole groups (see FastDecodeState)
        THREADS.parallel([lambda sl=slice(gs.start * g, gs.stop * g):
                           _rows(model, tokens, state, kv, t, pe, sl, logp, cross_w)
                           for gs in row_slices(n // g, k)])
    kv.filled = t + T
    new = FastDecodeState(state.cross, g, state.src_mask, t + T, state.sentence, kv, state.fused,
                          state.src_bias, state.src_rows)
    if T > 1:                                    # the rows' (n T, H, 1, S) as (n, H, T, S) views
        cross_w = [w.reshape(n, T, cfg.n_heads, S).transpose(0, 2, 1, 3) for w in cross_w]
    return logp.reshape(n, T, V), new, cross_w


def _softmax_last_(s, bias=None, row_scale=None):
    """Softmax over the last axis, in place; ``bias`` 0 / most negative finite (masked
    weights come out exactly 0), ``row_scale`` 0 for rows with no key at all."""
    xp = B.get_array_module(s)
    if bias is not None:
        s += bias
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    r = s.sum(axis=-1, keepdims=True)
    xp.reciprocal(r, out=r)
    if row_scale is not None:
        r *= row_scale
    s *= r
    return s


def _rows(model, tokens, state: FastDecodeState, kv: _KV, t: int, pe, sl, logp, cross_w):
    """The step for rows ``sl`` of tokens (n, T): writes their keys/values at positions t..t+T-1,
    their log-probabilities into ``logp`` and cross-attention weights into ``cross_w[i]`` (the rows
    ``sl``'s T positions each, (n T, ...))."""
    xp, block, T = model.xp, model.block, tokens.shape[1]
    x = xp.take(model.params[model._emb("tgt")], tokens[sl].reshape(-1), axis=0)         # (n T, D)
    x *= model.dtype.type(math.sqrt(model.config.d_model))
    if pe is not None:
        xt = x.reshape(-1, T, x.shape[1])
        xt += pe
    rope = model.embeddings.rope_table(t + T) if block.positions.rotary else None
    xs = slice(sl.start * T, sl.stop * T)                                    # the rows' positions
    run = HostRows(model, state, kv, t, rope, sl, [w[xs] for w in cross_w], T)
    for i in range(model.config.n_decoder_layers):
        x, _ = decoder_layer(run, i, x)
    if block.placement.final_norm:
        x = _norm(model, run.ops, "decoder.norm", x)
    out = model.project(x)                     # (n, V); a subclass may change the projection
    # log_softmax: out - max - log(sum(exp(out - max))), with no (n, V) buffer beyond these two
    out -= out.max(axis=1, keepdims=True)
    logp[xs] = out
    xp.exp(out, out=out)
    logp[xs] -= xp.log(run.ops.rowsum(out))[:, None]


def _norm(model, ops, name, x):
    """The norm called ``name`` on x (n, D), which it overwrites. Returns out (n, D)."""
    return model.residuals.norm_(name, x, ops)[0]


class HostRows:
    """The NumPy step's sub-layers (:func:`attn.fast.core.layer.decoder_layer`) for the rows ``sl``
    of ``state`` at positions t..t+T-1: T new rows each (one in a step; the layer's input is
    (n T, D), each row's positions side by side), their keys and values written at those positions
    into the cache ``kv`` and attended with the t before them and each other up to their own
    (``rope``: the rotary tables, or None), the cross-attention weights into ``cross_w`` (per layer
    (n T, H, 1, S), the rows' views), no dropout, nothing kept. Products on NumPy's BLAS, the rest
    the fp32 ops of ``ops_for``."""

    def __init__(self, model, state: FastDecodeState, kv: _KV, t: int, rope, sl, cross_w, T: int = 1):
        self.model, self.ops, self.state, self.kv, self.t, self.T = model, ops_for(model.xp), state, kv, t, T
        self.rope, self.sl, self.cross_w = rope, sl, cross_w
        cfg = model.config
        self.H, self.KV, self.Dh = cfg.n_heads, cfg.key_value_heads, cfg.d_model // cfg.n_heads

    def residual(self, norm, x, sub, bias):
        """post-norm ``N(x + sub(x) + bias)``, pre-norm ``x + sub(N(x)) + bias`` (bias None: none)."""
        pre = self.model.block.placement.pre
        y = sub(_norm(self.model, self.ops, norm, x.copy()) if pre else x)
        if bias is not None:
            y += bias
        y += x
        return (y if pre else _norm(self.model, self.ops, norm, y)), None

    def ffn(self, pre, h):
        """The feed-forward network ``pre`` on h (n, D), without its output bias."""
        model, ops = self.model, self.ops
        if model.block.ffn.gated:
            a = ops.swiglu_gate(h @ model.arena.block(model.arena.params, pre + ".w13"))
        else:
            a = h @ model.params[pre + ".w1"]
            a += model.params[pre + ".b1"]
            ops.relu_(a)                                                      # (n, F)
        return a @ model.params[pre + ".w2"]

    def self_attn(self, i, h):
        """Layer i's self-attention of the new rows h (n T, D) over positions 0..t+T-1."""
        H, KV, Dh, t, T = self.H, self.KV, self.Dh, self.t, self.T
        n = h.shape[0] // T
        W, b = self.state.fused.dec_qkv[i]
        qkv = h @ W
        qkv += b                                                              # (n T, D + 2KV), q pre-scaled
        q3 = qkv.reshape(n, T, H + 2 * KV, Dh).swapaxes(1, 2)                # heads: H queries, KV keys, KV values
        q, k = q3[:, :H], q3[:, H:H + KV]
        norm_heads_(self.model, f"decoder.{i}.self_attn", q, k)
        if self.rope is not None:                                             # positions t.., each key turned once
            for a in (q, k):
                self.ops.rope_(a, self.rope[0][t:t + T], self.rope[1][t:t + T])
        kb, vb = self.kv.keys[i][self.sl], self.kv.values[i][self.sl]        # (n, KV, cap, Dh) views
        kb[:, :, t:t + T] = k
        vb[:, :, t:t + T] = q3[:, H + KV:]
        # a group's G query heads (T positions each) against their one key/value head: (n, KV, G T, t+T)
        s = q.reshape(n, KV, (H // KV) * T, Dh) @ kb[:, :, :t + T].swapaxes(-1, -2)
        if T == 1:
            _softmax_last_(s)                                                 # no mask: every past position
        else:                                                                 # new position j sees t + j + 1
            s5 = s.reshape(n, KV, H // KV, T, t + T)
            past = self.model.xp.arange(t + T)[None, :] <= t + self.model.xp.arange(T)[:, None]
            _softmax_last_(s5, self.model.xp.where(past, s.dtype.type(0), self.model.xp.finfo(s.dtype).min))
        ctx = s @ vb[:, :, :t + T]                                            # (n, KV, G T, Dh)
        ctx = ctx.reshape(n, -1) if T == 1 else ctx.reshape(n, H, T, Dh).swapaxes(1, 2).reshape(n * T, -1)
        return ctx @ self.model.params[f"decoder.{i}.self_attn.w_o"]          # + b_o in residual()

    def cross_attn(self, i, h):
        """Layer i's cross-attention of the rows h (n, D) (each row's T positions: n of them): the g
        rows of a group (one sentence's beams, see :class:`FastDecodeState`, T positions each) attend
        to their one copy of the keys and values together."""
        xp, state, sl, H, KV, Dh, n = self.model.xp, self.state, self.sl, self.H, self.KV, self.Dh, h.shape[0]
        gsl = slice(sl.start // state.group, sl.stop // state.group)             # the rows' groups
        g = state.group * self.T                                                 # a group's rows' positions
        kc, vc = state.cross[i]                                                  # (n / g, KV, S, Dh)

        def by_group(a):
            """(n, A, 1, C) -> the (n / g, A, g, C) view whose row j holds group j's g rows."""
            return a.reshape(n // g, g, a.shape[1], a.shape[3]).transpose(0, 2, 1, 3)
        Wq, bq = state.fused.cross_q[i]
        q = h @ Wq
        q += bq                                                               # (n, D), pre-scaled
        norm_heads_(self.model, f"decoder.{i}.cross_attn", q.reshape(n, self.H, 1, self.Dh), None)
        s = by_group(self.cross_w[i])                                         # (m, H, g, S) of (n, H, 1, S)
        m = s.shape[0]
        s5 = s.reshape(m, KV, H // KV, g, s.shape[-1])                       # H split into (KV, G): a view
        xp.matmul(by_group(q.reshape(n, H, 1, Dh)).reshape(m, KV, H // KV, g, Dh),
                  kc[gsl][:, :, None].swapaxes(-1, -2), out=s5)
        bias, rows = (a if a is None or self.T == 1 else a.repeat(self.T, axis=0)
                      for a in (state.src_bias[sl], None if state.src_rows is None else state.src_rows[sl]))
        rows_g = None if rows is None else by_group(rows)[:, :, None]
        _softmax_last_(s5, by_group(bias)[:, :, None], rows_g)
        ctx = (s5 @ vc[gsl][:, :, None]).reshape(m, H, g, Dh).transpose(0, 2, 1, 3).reshape(n, -1)
        return ctx @ self.model.params[f"decoder.{i}.cross_attn.w_o"]         # + b_o in residual()


def norm_heads_(model, name, q, k) -> None:
    """QK-norm of a step's query heads q (n, H, 1, Dh) and new key heads k (n, KV, 1, Dh) (None: a
    cross-attention's, normed once when projected) of the attention ``name``, in place; the
    queries' gain times 1/sqrt(d_k), which the query weights then do not hold
    (:meth:`attn.fast.FastTransformer._decoding_weights`). Nothing without QK-norm."""
    attention = model.block.self_attention
    if attention.qk_norm:
        q[...] = attention.norm_heads(q, model.params, name, "q", model.mha.scale)[0]
        if k is not None:
            k[...] = attention.norm_heads(k, model.params, name, "k")[0]


def run_step(model, tokens, state, parts: int, one_thread: bool, step=decode_step):
    """``step`` (:func:`decode_step`, or :func:`decode_positions`) with NumPy's BLAS on one thread
    when asked (small steps) and the rows run as one part (too few to split): OpenBLAS threads a
    product from 8 rows up, a speculative round's k + 1 positions of one sentence among them, and
    its threads' hand-offs cost many times such a product."""
    if one_thread and min(parts, tokens.shape[0] // MIN_ROWS_PER_PART) <= 1:
        with single_threaded_blas():
            return step(model, tokens, state, 1)
    return step(model, tokens, state, parts)

"""The NumPy decoding step, the readable :meth:`attn.model.Transformer.decode_step` with fewer
passes over memory (:class:`FastDecodeState`; the later block's on CuPy too), and what the CuPy
step (:mod:`.device`) shares with it: the rows' sentences, the length check, the step's weights.

* The keys and values live in buffers with room for more positions (a quarter larger when full):
  a step writes its own position instead of concatenating the prefix again.
* The rows are split into parts that run at the same time on the helper threads, each with
  single-threaded BLAS: a step of 64 sentences is a few hundred small products, too small for
  BLAS's own threads (their hand-offs cost more than the products), but two halves of the batch
  keep two cores busy with one hand-off per step.
* T positions of every row are read in one pass (speculative decoding; a step is T = 1).

A state is meant to be stepped once: stepping it writes the next position into buffers its
successor shares (stepping an older state again copies them first). ``select`` and ``truncate``
hand the buffers on: the states before then raise a ValueError that says so."""
from __future__ import annotations

import contextlib
import copy
import math

from ... import backend as B
from ..core.caches import Fused
from ..core.dispatch import ops_for
from ..core.int8 import each_for
from ..core.layer import decoder_layer
from ..core.threads import THREADS, default_workers, row_slices, single_threaded_blas


class _KV:
    """The self-attention keys and values of every decoder layer, ``(n, H, capacity, Dh)`` each,
    and how many positions are written (``filled``; -1 once handed on)."""
    __slots__ = ("keys", "values", "filled")

    def __init__(self, keys, values, filled):
        self.keys, self.values, self.filled = keys, values, filled

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def moved(self) -> bool:
        """True once :meth:`take` or :meth:`cut` handed the buffers to a successor."""
        return self.filled < 0

    def copy(self, length: int, capacity: int) -> "_KV":
        """A new buffer with the first ``length`` positions and room for ``capacity``."""
        return _KV(list(self.keys), list(self.values), length).grow_(capacity)

    def grow_(self, capacity: int) -> "_KV":
        """Room for ``capacity`` positions, in place: layer by layer a larger array receives the
        filled positions and replaces the old one (freed then), so growing needs one layer's array
        beyond the buffers. The states sharing this ``_KV`` see the new arrays."""
        xp = B.get_array_module(self.keys[0])
        for arrays in (self.keys, self.values):
            for i, a in enumerate(arrays):
                n, H, _, Dh = a.shape
                b = xp.empty((n, H, capacity, Dh), dtype=a.dtype)
                b[:, :, :self.filled] = a[:, :, :self.filled]
                arrays[i] = b
        return self

    def take(self, index, length: int) -> "_KV":
        """Rows ``index`` (with repeats, in range), in a new ``_KV`` that takes this one's place,
        this one left :attr:`moved`. Layer by layer each old array is let go as soon as its copy
        exists, so a reorder (beam search's every step) needs one layer's array beyond the buffers,
        not a second set. The whole rows are copied (contiguous blocks: faster than the filled
        positions alone through a strided view); buffers made with more room (a search's reserve)
        are first cut to the room growing would have given them, so a reorder copies no more."""
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
        """The first ``length`` positions, in a new ``_KV`` that takes this one's place (the arrays
        handed on, the next step writing over the positions after), this one left :attr:`moved`."""
        new = _KV(self.keys, self.values, length)
        self.keys, self.values, self.filled = [], [], -1
        return new


def _check_not_moved(state: "FastDecodeState", what: str) -> None:
    if state.kv.moved:
        raise ValueError(f"FastDecodeState.{what}: this state's key/value buffers were handed on by "
                         f"select() or truncate() (to save a copy of them); use the state that call returned")


def successor(state, **changes):
    """A decoding state like ``state`` with the fields ``changes`` replaced."""
    new = copy.copy(state)
    for name, value in changes.items():
        setattr(new, name, value)
    return new


def per_row(state) -> list:
    """A decoding state's per-group cross-attention keys and values, repeated for each row of a group."""
    g = state.group
    return list(state.cross) if g == 1 else [(k.repeat(g, axis=0), v.repeat(g, axis=0)) for k, v in state.cross]


class FastDecodeState:
    """A :class:`attn.model.DecodeState` for :class:`attn.fast.FastTransformer` on NumPy:
    ``cross_kv``, ``self_kv``, ``src_mask`` and ``length`` read as the reference's. It keeps the keys
    and values in growing buffers (``kv``), the step's weights (``fused``), the source mask as a bias
    (and ``src_rows``, 0 for a source of padding alone), and which sentence each row decodes. A
    row's cross-attention keys and values depend on its sentence alone: they are kept once per
    group of ``group`` consecutive rows (``cross``: (n / group, H, S, Dh) per layer), which a step
    attends with together: beam 4 holds and reads a quarter of the reference's copies."""
    __slots__ = ("cross", "group", "src_mask", "length", "sentence", "kv", "fused", "src_bias", "src_rows")

    def __init__(self, cross, group, src_mask, length, sentence, kv, fused, src_bias, src_rows):
        self.cross, self.group, self.src_mask, self.length = cross, group, src_mask, length
        self.sentence, self.kv, self.fused, self.src_bias, self.src_rows = sentence, kv, fused, src_bias, src_rows

    #: Per layer the reference's (k, v), (n, H, S, Dh) (a copy where rows share them).
    cross_kv = property(per_row)

    @property
    def self_kv(self) -> list:
        """Per layer the (k, v) of the positions decoded so far, (n, H, t, Dh) views; (None, None)
        before the first step."""
        t = self.length
        _check_not_moved(self, "self_kv")
        if t == 0:
            return [(None, None)] * len(self.kv.keys)
        return [(k[:, :, :t], v[:, :, :t]) for k, v in zip(self.kv.keys, self.kv.values)]

    def select(self, index, index_host=None) -> "FastDecodeState":
        """Keep (and repeat) rows ``index``: beam search reorders hypotheses with it. The buffers
        move to the new state (:meth:`_KV.take`)."""
        _check_not_moved(self, "select")
        new = regroup(self, index, B.to_host(index), B.host)
        if "src_bias" in new and self.src_rows is not None:
            new["src_rows"] = self.src_rows[index]
        return successor(self, kv=self.kv.take(index, self.length), **new)

    def truncate(self, length: int) -> "FastDecodeState":
        """The state after its first ``length`` positions (:meth:`attn.model.DecodeState.truncate`):
        the buffers move to the new state (:meth:`_KV.cut`), whose next step writes over the rest."""
        _check_not_moved(self, "truncate")
        if not 0 <= length <= self.length:
            raise ValueError(f"FastDecodeState.truncate: length must be in 0..{self.length}, got {length}")
        return successor(self, length=length, kv=self.kv.cut(length))


def regroup(state, index, index_h, xp) -> dict:
    """The fields of a decoding ``state`` that the rows ``index`` (``index_h`` on the host) take
    from their sentences: ``sentence``, ``group`` (:func:`_group_size`), ``cross`` (gathered, on
    ``xp``, only where the groups' rows change: not when beam search reorders beams within each
    sentence), and where the sentences change, ``src_mask`` and ``src_bias``."""
    n = state.sentence.shape[0]
    if index_h.size and (index_h.min() < 0 or index_h.max() >= n):
        raise IndexError(f"{type(state).__name__}.select: index out of range for {n} rows")
    sentence = state.sentence[index_h]
    group = _group_size(sentence)
    source = index_h[::group] // state.group            # each new group's row of the old ``cross``
    cross = state.cross
    if not (source.shape[0] == cross[0][0].shape[0] and bool((source == B.host.arange(source.shape[0])).all())):
        source = xp.asarray(source)
        cross = [(k[source], v[source]) for k, v in cross]
    new = {"sentence": sentence, "group": group, "cross": cross}
    if not (sentence.shape == state.sentence.shape and bool((sentence == state.sentence).all())):
        new.update(src_mask=state.src_mask[index], src_bias=state.src_bias[index])
    return new


def _group_size(sentence) -> int:
    """The largest g such that every block of g consecutive rows decodes one sentence: the
    greatest common divisor of the lengths of the runs of equal sentences (1 for none)."""
    np = B.host
    if sentence.size == 0:
        return 1
    bounds = np.concatenate([[0], np.flatnonzero(sentence[1:] != sentence[:-1]) + 1, [sentence.size]])
    return int(np.gcd.reduce(np.diff(bounds)))


def source_bias(model, src_mask):
    """The source mask as an additive bias of its shape (0, or the most negative finite value)."""
    xp = model.xp
    return xp.where(src_mask, model.dtype.type(0), xp.finfo(model.dtype).min).astype(model.dtype)


def decoding_weights(model) -> Fused:
    """What the decoding states read, made once per decoding: the decoder's self-attention
    ``[w_q * s | w_k | w_v]`` and cross-attention queries ``w_q * s`` with ``s = 1/sqrt(d_k)``
    folded in (copies). With QK-norm the norm would undo it: s rides on the queries' gain instead
    (:func:`norm_heads_`). An int8 model's are made at each read (:func:`each_for`)."""
    cfg, p, D = model.config, model.params, model.config.d_model
    s = 1.0 if model.block.self_attention.qk_norm else model.mha.scale
    dt, F, each = model.dtype.type, model._fuse(), each_for(model.arena)

    def scaled_qkv(i):
        W, b = (a.copy() for a in F.dec_qkv[i])
        W[:, :D] *= dt(s)
        b[:D] *= dt(s)
        return W, b
    L = cfg.n_decoder_layers
    return Fused([], each(L, scaled_qkv), each(L, lambda i: (
        p[f"decoder.{i}.cross_attn.w_q"] * dt(s), p[f"decoder.{i}.cross_attn.b_q"] * dt(s))), None, s)


#: Most positions the key/value buffers are made with at the start (a search's reserve): beyond,
#: they grow as the decoding goes.
MAX_START_POSITIONS = 256


def start(model, cross_kv, src_mask, positions=None) -> FastDecodeState:
    """The state before the first step over ``cross_kv`` ((B, H, S, Dh) per layer, the reference's)
    and ``src_mask`` (B, 1, 1, S), its buffers with room for ``positions`` (the most the search will
    step, at most :data:`MAX_START_POSITIONS`; None: 16): each growth copies every layer's buffers,
    a few percent of a greedy decoding."""
    cfg = model.config
    capacity = 16 if positions is None else max(16, min(int(positions), MAX_START_POSITIONS))
    n = src_mask.shape[0]
    rows = src_mask.any(axis=-1, keepdims=True)                               # (B, 1, 1, 1)
    rows = None if bool(rows.all()) else rows.astype(model.dtype)
    shape, L = (n, cfg.key_value_heads, capacity, cfg.d_model // cfg.n_heads), cfg.n_decoder_layers
    keys, values = ([model.xp.empty(shape, dtype=model.dtype) for _ in range(L)] for _ in "kv")
    return FastDecodeState(list(cross_kv), 1, src_mask, 0, B.host.arange(n), _KV(keys, values, 0),
                           decoding_weights(model), source_bias(model, src_mask), rows)


#: Least rows per part when a step is split over threads: below it the hand-off costs more
#: than the part's products save.
MIN_ROWS_PER_PART = 8

#: A step runs with single-threaded BLAS (NumPy) while rows x d_model is at most this: OpenBLAS
#: splits even (64, 256) x (256, 256) products over its threads, and the threads' hand-offs cost
#: several times the product.
DECODE_ONE_THREAD_MAX = 1 << 18


def one_thread(model, tokens, parts: int):
    """NumPy's BLAS on one thread for positions ``tokens`` few enough (:data:`DECODE_ONE_THREAD_MAX`)
    that run as one part (too few to split in ``parts``): OpenBLAS threads a product from 8 rows
    up, a speculative round's k + 1 positions of one sentence among them."""
    small = model.xp is B.host and tokens.size * model.config.d_model <= DECODE_ONE_THREAD_MAX
    alone = small and min(parts, tokens.shape[0] // MIN_ROWS_PER_PART) <= 1
    return single_threaded_blas() if alone else contextlib.nullcontext()


def check_length(model, t: int) -> None:
    """Position t needs a row of a learned positional table: as forward() says it, not an IndexError."""
    if model.block.positions.learned and t >= model.config.max_len:
        raise ValueError(f"decode_step: sequence length {t + 1} exceeds the learned positional "
                         f"table's {model.config.max_len} positions (raise max_len)")


def decode_positions(model, tokens, state: FastDecodeState):
    """T positions for every row in one pass (:meth:`attn.model.Transformer.decode_positions`):
    tokens (n, T) the ids at positions ``state.length``.., each attending to the cache and to the
    new positions up to its own. Returns log-probabilities (n, T, V), the new state, the
    cross-attention weights per layer (n, H, T, S). The rows are split over :attr:`workers` parts
    (default :func:`default_workers`) of whole groups: one sentence's wide beam runs on one thread."""
    if not isinstance(state, FastDecodeState):
        raise TypeError(f"FastTransformer.decode_step: the state must come from its start_decoding, "
                        f"got a {type(state).__name__}")
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
    S, g = state.cross[0][0].shape[2], state.group
    logp = xp.empty((n * T, V), dtype=model.dtype)
    cross_w = [xp.empty((n * T, cfg.n_heads, 1, S), dtype=model.dtype) for _ in range(cfg.n_decoder_layers)]
    pe = model.embeddings.table("tgt", t + T)[t:t + T] if model.block.positions.added else None   # (T, D)
    parts = default_workers() if model.workers is None else max(1, int(model.workers))
    parts = parts if xp is B.host else 1
    k = max(1, min(parts, n // MIN_ROWS_PER_PART, n // g))
    with one_thread(model, tokens, parts):
        if k == 1:
            _rows(model, tokens, state, kv, t, pe, slice(0, n), logp, cross_w)
        else:
            THREADS.parallel([lambda sl=slice(gs.start * g, gs.stop * g):
                              _rows(model, tokens, state, kv, t, pe, sl, logp, cross_w)
                              for gs in row_slices(n // g, k)])
    kv.filled = t + T
    if T > 1:                                    # the rows' (n T, H, 1, S) as (n, H, T, S) views
        cross_w = [w.reshape(n, T, cfg.n_heads, S).transpose(0, 2, 1, 3) for w in cross_w]
    return logp.reshape(n, T, V), successor(state, length=t + T, kv=kv), cross_w


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
    """The step for rows ``sl`` of tokens (n, T): their keys/values written at positions t..t+T-1,
    their log-probabilities into ``logp`` and cross-attention weights into ``cross_w`` ((n T, ...))."""
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
        x = model.residuals.norm_("decoder.norm", x, run.ops)[0]
    out = model.project(x)                                                   # (n, V)
    # log_softmax: out - max - log(sum(exp(out - max))), with no (n, V) buffer beyond these two
    out -= out.max(axis=1, keepdims=True)
    logp[xs] = out
    xp.exp(out, out=out)
    logp[xs] -= xp.log(run.ops.rowsum(out))[:, None]


class HostRows:
    """The NumPy step's sub-layers (:func:`attn.fast.core.layer.decoder_layer`) for the rows ``sl``
    of ``state`` at positions t..t+T-1 (the layer's input (n T, D), each row's positions side by
    side): their keys and values written into ``kv`` and attended with the t before them and each
    other up to their own (``rope``: the rotary tables, or None), the cross-attention weights into
    ``cross_w`` (per layer (n T, H, 1, S)), no dropout, nothing kept."""

    def __init__(self, model, state: FastDecodeState, kv: _KV, t: int, rope, sl, cross_w, T: int = 1):
        self.model, self.ops, self.state, self.kv, self.t, self.T = model, ops_for(model.xp), state, kv, t, T
        self.rope, self.sl, self.cross_w = rope, sl, cross_w
        cfg = model.config
        self.H, self.KV, self.Dh = cfg.n_heads, cfg.key_value_heads, cfg.d_model // cfg.n_heads

    def residual(self, norm, x, sub, bias):
        """post-norm ``N(x + sub(x) + bias)``, pre-norm ``x + sub(N(x)) + bias`` (bias None: none)."""
        pre = self.model.block.placement.pre
        y = sub(self.model.residuals.norm_(norm, x.copy(), self.ops)[0] if pre else x)
        if bias is not None:
            y += bias
        y += x
        return (y if pre else self.model.residuals.norm_(norm, y, self.ops)[0]), None

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
    (:func:`decoding_weights`). Nothing without QK-norm."""
    attention = model.block.self_attention
    if attention.qk_norm:
        q[...] = attention.norm_heads(q, model.params, name, "q", model.mha.scale)[0]
        if k is not None:
            k[...] = attention.norm_heads(k, model.params, name, "k")[0]

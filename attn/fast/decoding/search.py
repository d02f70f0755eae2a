"""The fast engine's decoding: :class:`FastSearch` (:class:`attn.engine.Search`) holds a
:class:`attn.fast.FastTransformer` and decodes with its pieces: the states of :mod:`.host` (NumPy,
and the later block on CuPy) and :mod:`.device` (CuPy), the decoder over a whole prefix with the
memory's keys and values projected once, and the token picks (one kernel each on CuPy). The model's
``start_decoding``, ``decode_step``, ``decode_positions``, ``cross_attention_kv`` and inference
``decode`` are one-line delegations to its search."""
from __future__ import annotations

from ... import backend as B
from ...decode import ReadableSearch
from ...layers.attention import split_heads
from ...masks import decoder_mask
from ...model import DecodeState as ReadableDecodeState, later_block
from ..core.attention import mask_bias
from ..core.caches import CrossWeights
from ..core.threads import THREADS, row_slices, single_threaded_blas
from . import device, host

#: Greedy decoding on a GPU generates this many positions between two looks at which sentences
#: have ended (one transfer to the host each, :attr:`attn.engine.Search.check_every`), instead of
#: one look (a synchronisation) at every position. The tokens are the same: the host replays the
#: positions in order and keeps each sentence's tokens up to its EOS; a finished sentence's row
#: runs on for at most this many positions less one. On the host there is nothing to wait for.
EOS_CHECK_EVERY = 8


class FastSearch:
    """What :mod:`attn.decode`'s searches step, for a :class:`attn.fast.FastTransformer`
    (``model.search()``, one per model: beam search's ranked candidates stay on the device between
    searches)."""

    def __init__(self, model):
        self.model = model
        self._candidates = None

    @property
    def check_every(self) -> int:
        return 1 if self.model.xp is B.host else EOS_CHECK_EVERY

    def rows_to_device(self, index, tokens, scores):
        """In one transfer: the three rows as one int64 array (the scores' bits ride in a row),
        returned as device views of it, so nothing is converted there."""
        np, xp = B.host, self.model.xp
        packed = xp.asarray(np.stack([np.asarray(index, dtype=np.int64), np.asarray(tokens, dtype=np.int64),
                                      np.ascontiguousarray(scores, dtype=np.float64).view(np.int64)]))
        return packed[0], packed[1], packed[2].view(xp.float64)

    def start(self, memory, src_mask, reserve=None):
        """On NumPy a :class:`FastDecodeState`; on CuPy a :class:`DeviceDecodeState`, its buffers
        sized by ``reserve`` = (rows, positions) when given. The later block decodes with a
        :class:`FastDecodeState` on CuPy too (the device state's kernels are the paper's sub-layers);
        a language model with the readable model's cache."""
        model = self.model
        model._own_params()
        if model.block.cross_attention is None:
            return model.readable.start_decoding(None, None)
        if model.xp is not B.host and not later_block(model.config):
            return device.start(model, self.cross_attention_kv(memory), src_mask, reserve)
        positions = None if reserve is None else reserve[1]
        return host.start(model, self.cross_attention_kv(memory), src_mask, positions)

    def step(self, tokens, state):
        """:meth:`attn.model.Transformer.decode_step` on any of :meth:`start`'s states."""
        if isinstance(state, device.DeviceDecodeState):
            return device.step(self.model, tokens, state)
        if isinstance(state, ReadableDecodeState):
            return self.model.readable.decode_step(tokens, state)
        logp, new, cross_w = host.decode_positions(self.model, tokens[:, None], state)
        return logp[:, 0], new, cross_w

    def positions(self, tokens, state):
        """:meth:`attn.model.Transformer.decode_positions`: tokens (B, T) in one pass (speculative
        decoding's check of a draft); a :class:`DeviceDecodeState`, whose kernels read one position,
        steps them one after another."""
        if isinstance(state, device.DeviceDecodeState):
            return device.positions(self.model, tokens, state)
        if isinstance(state, ReadableDecodeState):      # a language model's: small ones on one BLAS thread
            with host.one_thread(self.model, tokens, 1):
                return self.model.readable.decode_positions(tokens, state)
        return host.decode_positions(self.model, tokens, state)

    def select(self, state, index, index_host):
        return state.select(index, index_host)

    def cross_attention_kv(self, memory) -> list:
        """:meth:`attn.model.Transformer.cross_attention_kv`, the same arrays. On NumPy the sentences
        are split over the helper threads, each part's products on one thread (unless ``workers``
        is 1): BLAS threads left spinning by a product here took a core from the first steps (a
        tenth of a greedy decoding of toy-bench on two cores)."""
        model = self.model
        if model.xp is not B.host or model.workers is not None and int(model.workers) <= 1:
            return model.readable.cross_attention_kv(memory)
        xp, p, cfg = model.xp, model.params, model.config
        Bsz, S, D = memory.shape
        names = [(f"decoder.{i}.cross_attn.w_{kv}", f"decoder.{i}.cross_attn.b_{kv}")
                 for i in range(cfg.n_decoder_layers) for kv in "kv"]
        outs = [xp.empty((Bsz, S, p[w].shape[1]), dtype=xp.result_type(memory, p[w], p[b])) for w, b in names]

        def part(sl):
            """The rows ``sl`` of every layer's keys and values: ``memory @ w + b``."""
            m = memory[sl].reshape(-1, D)
            for (w, b), out in zip(names, outs):
                y = out[sl].reshape(-1, out.shape[-1])                 # a view: whole sentences
                xp.matmul(m, p[w], out=y)
                y += p[b]
        with single_threaded_blas():                                    # a single part as well
            THREADS.parallel([lambda sl=sl: part(sl) for sl in row_slices(Bsz, model._n_parts(Bsz, S))])
        pairs = [(split_heads(outs[i], cfg.key_value_heads), split_heads(outs[i + 1], cfg.key_value_heads))
                 for i in range(0, len(outs), 2)]
        model.mha.norm_cross_keys_([a for pair in pairs for a in pair])
        return pairs

    def prefix(self, tgt_in, memory, src_mask, cross_kv, keep_weights):
        """The fast decoder on a whole prefix, its batch split over threads: y (B, T, D), a cache
        holding each layer's cross-attention weights in the reference's place
        (``cache.layers[i][1].sub.attn.weights``, (B, H, T, S); None without ``keep_weights``), the
        target mask. ``cross_kv``: :meth:`cross_attention_kv`'s, or None to project them here."""
        model, xp, cfg = self.model, self.model.xp, self.model.config
        D, H, L, KV = cfg.d_model, cfg.n_heads, cfg.n_decoder_layers, cfg.key_value_heads
        Bsz, T = tgt_in.shape
        S = memory.shape[1]
        if cross_kv is not None and (len(cross_kv) != L or cross_kv[0][0].shape[:3] != (Bsz, KV, S)):
            raise ValueError(f"FastSearch.prefix: cross_kv must hold {L} (keys, values) pairs of shape "
                             f"({Bsz}, {KV}, {S}, {D // H}), got {len(cross_kv)} pairs, the first keys "
                             f"{tuple(cross_kv[0][0].shape) if cross_kv else None}")
        out = xp.empty((Bsz, T, D), dtype=model.dtype)
        weights = [xp.empty((Bsz, H, T, S), dtype=model.dtype) for _ in range(L)] if keep_weights else None
        F = model._fuse()

        def part(sl):
            n = tgt_in[sl].shape[0]
            bias, rows = mask_bias(src_mask[sl], model.dtype, xp)
            kv_heads = None if cross_kv is None else [a[sl] for pair in cross_kv for a in pair]
            y, _, _, _, cross = model._decoder(tgt_in[sl], kv_heads, bias, rows, F, None, False,
                                               keep_cross=keep_weights, memory=memory[sl].reshape(n * S, D))
            out[sl] = y.reshape(n, T, D)
            for w_all, w in zip(weights or [], cross or []):
                w_all[sl] = w.transpose(1, 2, 3, 0)                           # (S, n, H, T) -> (n, H, T, S)
        model._in_parts(Bsz, max(S, T), part)
        return out, None if weights is None else CrossWeights.of(weights), decoder_mask(tgt_in)

    def greedy_pick(self, logp, banned, info, tokens) -> None:
        """:meth:`attn.decode.ReadableSearch.greedy_pick`; on CuPy one kernel (``greedy_pick``)."""
        if self.model.xp is B.host:
            return ReadableSearch.greedy_pick(logp, banned, info, tokens)
        device.kernels(self.model.xp).greedy_pick(logp, tuple(banned), info, tokens)

    def beam_candidates(self, logp, beam_scores, W: int, c: int, C: int, banned):
        """:meth:`attn.decode.ReadableSearch.beam_candidates`; on CuPy one kernel (``beam_candidates``:
        each beam's best tokens, then each sentence's best C of those) where a sentence's beams have
        at most the kernel's ``BEAM_MAX_CANDIDATES`` between them, else the array calls: the same
        candidates (among exactly equal scores at the cut, which ones may differ)."""
        xp = self.model.xp
        if xp is B.host or c > logp.shape[1] - 2 or W * c > device.kernels(xp).BEAM_MAX_CANDIDATES:
            return ReadableSearch.beam_candidates(logp, beam_scores, W, c, C, banned)
        shape = (2, beam_scores.shape[0], C)
        if self._candidates is None or self._candidates.shape != shape:
            self._candidates = xp.empty(shape, dtype=xp.float64)
        info = self._candidates
        device.kernels(xp).beam_candidates(logp, beam_scores.reshape(-1), W, c, C, tuple(banned), info)
        return B.to_host(info)

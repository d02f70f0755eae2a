"""The fast model: :class:`FastTransformer` (the reference's parameters, logits and gradients
with fewer passes over memory); its caches are in :mod:`attn.fast.core.caches`, its backward in
:mod:`attn.fast.training.backward`, its decoding in :mod:`attn.fast.decoding` (the model's
decoding methods hand over to its :class:`attn.fast.decoding.search.FastSearch`). See
:mod:`attn.fast` for what it does differently."""
from __future__ import annotations

import contextlib
import copy
import math
import threading

from .. import backend as B
from ..masks import decoder_mask, padding_mask
from ..block import parts
from ..model import Transformer, embedding_name
from ..precision import FP32, Precision, PrecisionError
from ..quantize import refuse_training
from .core import flash, flash_tc, lm
from .core.int8 import Int8Arena, arena_for, each_for
from .core.attention import Attentions, mask_bias
from .training.backward import Backward
from .core.pieces import Embeddings, Residuals, feed_forward
from .core.layer import Sequences, decoder_layer
from .core.caches import FastCache, Fused, SplitCache
from .decoding.search import FastSearch
from .core.dispatch import ops_for
from .core.ops import Ops
from .gpu.stepmem import StepMemory
from .core.threads import THREADS, row_slices, default_workers, single_threaded_blas


class FastTransformer:
    """:class:`attn.model.Transformer`'s numbers with a faster ``forward``/``backward`` for
    training; its decoding is its :class:`FastSearch`'s (:meth:`search`). It holds the readable
    model, :attr:`readable`, over the same parameter arrays, and hands it what it does not do
    faster (a forward with dropout outside a step, the checkpoint). ``forward`` must be followed by
    ``backward`` with its cache (views into buffers the step reuses in place).

    ``params`` holds views of one arena (``self.arena``, docs/ARCHITECTURE.md; an int8 model's
    dequantises each block it is asked for); a parameter replaced in ``params`` by another array is
    copied into the arena at the next forward. ``precision`` (a :class:`attn.precision.Precision`
    or its name) is what the step's products read, fixed when the model is made.
    ``check_ids=False`` skips the check that token ids lie in the vocabulary (CuPy would wrap them
    silently; on CuPy the check is a host synchronisation): for a caller that checked its batches.
    ``attention`` (an attribute too) is ``"plain"``, ``"flash"`` (the tiled attention of
    :mod:`attn.fast.core.flash`: memory linear in the length) or ``"auto"`` (the rule
    :func:`attn.fast.core.flash.choose` chooses for each step). Its pieces (:attr:`embeddings`,
    :attr:`residuals`, :attr:`ffn`, :attr:`mha`) are objects made from it once, each forward beside
    its backward; ``backward`` runs theirs (:class:`attn.fast.training.backward.Backward`)."""

    #: Attention weights are kept keys-first, (Tk, B, H, Tq) (:mod:`attn.engine`).
    keys_first = True

    def __init__(self, config, seed: int = 0, dtype="float32", params: dict | None = None,
                 precision: Precision | str = FP32, check_ids: bool = True, attention: str = "auto"):
        #: The readable model over the same parameters (the same dict).
        self.readable = Transformer(config, seed, dtype, params)
        self.config, self.dtype = config, self.readable.dtype
        self.block = parts(config)              # what the engine asks, instead of the config's strings
        self.arena = arena_for(self.params, config, self.dtype)    # an Int8Arena for int8 params
        self.precision = self._usable(Precision.of(precision))
        self.validate_ids = check_ids
        self.attention = flash.check_mode(attention)
        self._memory = flash.memory_bytes(self.xp)      # once, here: never a driver call inside a captured step
        self._device_kind = flash.device_kind(self.xp)
        self._auto_notice = flash.AutoNotice()         # auto's tiled choice, said once
        self._cores = None                      # the tensor-core kernels' format where the tiled attention uses them
        self._cores_said = False                # ... said once on stderr
        self._fused = None
        self._bf16_weights = None               # at bf16 on CuPy: the weights' bf16 copy (see _fuse)
        self._search = FastSearch(self)         # its decoding: one, whose buffers outlive a search
        self.embeddings = Embeddings(self)
        self.residuals = Residuals(self)
        self.ffn = feed_forward(self)
        self.mha = Attentions(self, self.embeddings)
        self._backward = Backward(self)

    @property
    def params(self) -> dict:
        """The parameters by the reference's names: views of the arena."""
        return self.readable.params

    @params.setter
    def params(self, params: dict) -> None:
        self.readable.params = params

    @property
    def xp(self):
        return self.readable.xp

    def num_parameters(self) -> int:
        return self.readable.num_parameters()

    def state_arrays(self) -> dict:
        return self.readable.state_arrays()

    def save(self, path, extra_arrays: dict | None = None, extra_meta: dict | None = None):
        """:meth:`Transformer.save`: one checkpoint format for both engines."""
        return self.readable.save(path, extra_arrays, extra_meta)

    def _emb(self, which: str) -> str:
        return embedding_name(self.config, which)

    def _own_params(self) -> None:
        """Keep ``params`` the arena's views: a dict replaced, or entries replaced in it, are
        copied into the arena (and the entries replaced by the views again)."""
        if not self.arena.holds(self.params):
            self.arena.load(self.params)
            self.params.update(self.arena.param_views)

    @classmethod
    def from_model(cls, model: Transformer, precision: Precision | str = FP32) -> "FastTransformer":
        """A fast view of an existing model: the same config and the same parameter arrays."""
        return cls(model.config, dtype=model.dtype, params=model.params, precision=precision)

    @classmethod
    def load(cls, path, config=None, dtype=None, precision: Precision | str = FP32) -> "FastTransformer":
        """A model saved by either engine (:meth:`Transformer.load`: the one checkpoint format)."""
        return cls.from_model(Transformer.load(path, config, dtype), precision)

    def _usable(self, precision: Precision) -> Precision:
        """``precision`` (what the step's matrix products read, :mod:`attn.precision`; the
        parameters stay in the arena in the model's dtype, the master weights) if this model can
        multiply at it: tf32 and bf16 need float32, and bf16 on CuPy needs ml_dtypes."""
        if precision.name != "fp32" and isinstance(self.arena, Int8Arena):
            raise PrecisionError(f"precision {precision.name!r}: an int8 model's products read its weights "
                                 "dequantised to float32 (fp32)")
        if not precision.exact and self.dtype != self.xp.float32:
            raise PrecisionError(f"precision {precision.name!r} rounds float32 products; this model is "
                                 f"{self.dtype} (use fp32)")
        if precision.name == "bf16" and B.is_device_array(self.arena.params):
            B.bfloat16()                  # CuPy's bf16 arrays need ml_dtypes: a BackendError now, not mid-step
        return precision

    @property
    def gradient_arena(self):
        """The flat buffer every gradient is written into (:mod:`attn.engine`)."""
        return self.arena

    def step_memory(self, key=None):
        """On CuPy, the model's :class:`attn.fast.gpu.stepmem.StepMemory`: every array a step makes
        comes from one slab, at the same addresses every step (those of the plan of ``key``'s
        bucket: the batch's shapes); on NumPy nothing."""
        memory = StepMemory.of(self)
        return contextlib.nullcontext() if memory is None else memory.step(key)

    @property
    def ops(self) -> Ops:
        return ops_for(self.xp, self.precision.name)

    # ------------------------------------------------------------------ weights

    def _fuse(self) -> Fused:
        """The fused weights as the arena lays them out (views, docs/ARCHITECTURE.md's table; the
        ``1/sqrt(d_k)`` scale is the softmax's). Called once by every forward, encoding and
        decoding: where the products read bf16, the weights' bf16 copy is made here. An int8
        model's items are made each time they are read, dequantised (:func:`each_for`)."""
        self._own_params()
        prepare = getattr(self.ops, "prepare_weights", None)
        if prepare is not None:                          # the model's own copy: a graph keeps its address
            self._bf16_weights = prepare(self.arena.params, self._bf16_weights)
        if self._fused is None:
            cfg, a, P, p = self.config, self.arena, self.arena.params, self.params
            each = each_for(a)                  # lists of views; an int8 model's made at each read

            def qkv(pre):
                return a.block(P, pre + ".w_qkv"), a.block(P, pre + ".b_qkv")
            L, cross = cfg.n_decoder_layers, self.block.cross_attention is not None   # a language model: no cross
            self._fused = Fused(
                each(cfg.n_encoder_layers, lambda i: qkv(f"encoder.{i}.self_attn")),
                each(L, lambda i: qkv(f"decoder.{i}.self_attn")),
                each(L, lambda i: (p[f"decoder.{i}.cross_attn.w_q"], p[f"decoder.{i}.cross_attn.b_q"]))
                if cross else [],
                each(2, lambda j: a.block(P, ("decoder.cross_attn.w_kv", "decoder.cross_attn.b_kv")[j]))
                if cross else None,
                self.mha.scale)
        return self._fused

    def _tiled(self, Bsz: int, S: int, T: int, rng) -> bool:
        """Whether a forward of B sentences (S source, T target tokens) takes the tiled attention:
        :attr:`attention` by the rule of :func:`attn.fast.core.flash.choose`; ``auto``'s first tiled
        choice said on stderr with its reason. Whether it runs on the tensor cores (``_cores``) is
        :func:`attn.fast.core.flash_tc.cores_for`'s rule, said once too."""
        dropping = rng is not None and self.config.attention_dropout > 0
        why = flash.choose(self.attention, self.config, Bsz, S, T, self.dtype.itemsize, self.xp, dropping,
                           self._memory, self._device_kind)
        if why is not None and self.attention == "auto":
            self._auto_notice(why)
        cores = None
        if why is not None:
            cores, because = flash_tc.cores_for(self.attention, self.precision.name, self.xp,
                                                self.config.d_model // self.config.n_heads, self._device_kind)
            if cores is not None and not self._cores_said:
                self._cores_said = True
                flash_tc.say(cores, because)
        self._cores = cores
        return why is not None

    # ------------------------------------------------------------------ forward

    #: Parts the batch is split into, each run on its own thread with single-threaded BLAS
    #: (NumPy only). None: :func:`default_workers` (NumPy's BLAS threads, at most 4).
    workers: int | None = None

    #: Below this many activations (sentences x length x d_model) the automatic choice does
    #: not split: handing work to a thread costs tens of microseconds.
    SPLIT_MIN_SIZE = 1 << 17

    def _n_parts(self, Bsz: int, T: int = 1) -> int:
        if self.xp is not B.host:
            return 1
        if self.workers is None:
            if Bsz * T * self.config.d_model < self.SPLIT_MIN_SIZE:
                return 1
            k = default_workers()
        else:
            k = int(self.workers)
        return max(1, min(k, Bsz))

    def forward(self, src, tgt_in, rng=None):
        """Inputs: src (B, S), tgt_in (B, T) integer ids; rng a DeviceRNG for dropout (None: off).

        Returns: logits (B, T, V_tgt), a cache for :meth:`backward`.

        On NumPy the batch is split by sentences into :attr:`workers` parts that run at the
        same time on separate threads (BLAS single-threaded meanwhile); :meth:`backward`
        sums their gradients. The result is the same as one pass over the whole batch, dropout
        included: each part draws, from its own copy of ``rng``, what the whole batch would, and
        keeps its rows (:class:`attn.training.distributed.RowsOf`), so the masks depend neither
        on the number of parts nor on how many processes share the batch.
        """
        return self._forward(src, tgt_in, rng, True, "forward")

    def logits(self, src, tgt_in):
        """Logits (B, T, V_tgt) for evaluation: no dropout, and no cache kept, so each
        layer's buffers are freed as soon as the next layer has run."""
        return self._forward(src, tgt_in, None, False, "logits")[0]

    def _forward(self, src, tgt_in, rng, keep_cache: bool, what: str):
        decoder_only = self.block.cross_attention is None        # src None: as the readable model's
        if decoder_only != (src is None):
            raise ValueError(f"Transformer.{what}: " + ("a decoder-only model (n_encoder_layers=0) reads no "
                                                        "source: src must be None" if decoder_only else
                                                        "src is None, but the model has an encoder"))
        if decoder_only:
            return lm.forward(self, tgt_in, rng, keep_cache=keep_cache)
        if src.ndim != 2 or tgt_in.ndim != 2 or src.shape[0] != tgt_in.shape[0]:
            raise ValueError(f"Transformer.{what}: src and tgt_in must be (B, S) and (B, T) with one B, "
                             f"got {tuple(src.shape)} and {tuple(tgt_in.shape)}")
        Bsz, T = tgt_in.shape
        k = self._n_parts(Bsz, max(T, src.shape[1]))
        tiled = self._tiled(Bsz, src.shape[1], T, rng)
        if k == 1:
            return self._forward_part(src, tgt_in, rng, keep_cache=keep_cache, tiled=tiled)
        return self.split_forward(k, Bsz, src.shape[1], T, rng, keep_cache, lambda sl, r, out, fused:
                                  self._forward_part(src[sl], tgt_in[sl], r, out, keep_cache, fused, tiled))

    def split_forward(self, k: int, Bsz: int, S: int, T: int, rng, keep_cache: bool, part):
        """The forward of ``Bsz`` rows in ``k`` parts on the helper threads, ``part(rows, rng, logits_out,
        fused)`` running one. Each part draws, from its own copy of ``rng``, its rows of what one pass over
        the batch draws. Returns logits (B, T, V) and a :class:`SplitCache` (None without ``keep_cache``)."""
        self.embeddings.shared_tables(S, T)            # build the shared tables before the threads
        parts = row_slices(Bsz, k)
        rngs = [None] * k
        if rng is not None:
            from ..training.distributed import RowsOf
            rngs = [RowsOf(copy.deepcopy(rng), sl.start, sl.stop, Bsz, keys_first=self.keys_first)
                    for sl in parts]
        logits = self.xp.empty((Bsz, T, self.params[self._emb("out")].shape[0]), dtype=self.dtype)
        fused = self._fuse()                            # once, shared by the parts
        caches = THREADS.parallel([lambda sl=sl, r=r: part(sl, r, logits[sl], fused)[1]
                                   for sl, r in zip(parts, rngs)])
        return logits, SplitCache(caches, parts) if keep_cache else None

    def backward(self, dlogits, cache, ready=None) -> dict:
        """The gradients of :meth:`forward`'s ``cache`` given dlogits (B, T, V_tgt) (it may be
        overwritten): a dict keyed like ``params``, views of ``arena.grads`` (the next backward
        overwrites them); ``ready(stop)``, when given, is told each time ``arena.grads[:stop]``
        is final (:meth:`attn.fast.training.backward.Backward.__call__`). An int8 model refuses
        (:func:`attn.quantize.refuse_training`)."""
        refuse_training(self.params, "FastTransformer.backward")
        return self._backward(dlogits, cache, ready)

    def project(self, h, out=None):
        """:meth:`Transformer.project`: (..., D) -> (..., V); into ``out`` when given on CuPy (the
        decoding step's logits buffer). On NumPy never on BLAS's own threads (unless ``workers``
        is 1): split by rows over the helper threads, or on one thread. BLAS's threads spin for a
        while after a product, and a split pass right after it shares the cores with them
        (benchmarks/RESULTS.md, "OpenBLAS's spinning threads")."""
        if out is not None and self.xp is not B.host:
            return self.xp.matmul(h, self.params[self._emb("out")].T, out=out)
        if self.xp is not B.host or self.workers is not None and int(self.workers) <= 1:
            return self.readable.project(h)
        E = self.params[self._emb("out")]                                       # (V, D)
        lead = h.shape[:-1]
        rows = math.prod(lead)
        k = self._n_parts(rows)
        if k == 1:
            with single_threaded_blas():
                return self.readable.project(h)
        h2 = h.reshape(rows, h.shape[-1])
        out = self.xp.empty((rows, E.shape[0]), dtype=self.dtype)
        THREADS.parallel([lambda sl=sl: self.xp.matmul(h2[sl], E.T, out=out[sl])
                           for sl in row_slices(rows, k)])
        return out.reshape(*lead, E.shape[0])

    #: A callable ``clock(phase)`` told when each phase of a forward/backward begins (the
    #: benchmark's per-phase profile), or None. Only the part on the main thread calls it: the
    #: parts of a split batch run the same phases at the same time.
    phase_clock = None

    def _phase(self, name: str) -> None:
        if self.phase_clock is not None and threading.current_thread() is threading.main_thread():
            self.phase_clock(name)

    def _forward_part(self, src, tgt_in, rng=None, logits_out=None, keep_cache=True, fused=None, tiled=False):
        """The forward of one part (or the whole batch). Writes the logits into
        ``logits_out`` (B, T, V) when given; ``tiled``: every attention the tiled one
        (:meth:`_tiled`). Returns logits, FastCache (None without ``keep_cache``)."""
        cfg, xp = self.config, self.xp
        Bsz, S = src.shape
        T = tgt_in.shape[1]
        F = self._fuse() if fused is None else fused
        src_bias, src_rows = (flash.KeyMask.of(src, False, self._cores), None) if tiled else \
            mask_bias(padding_mask(src), self.dtype, xp)                     # (B, 1, 1, S)
        memory, src_emb, enc, enc_norm = self._encoder(src, src_bias, src_rows, F, rng, keep_cache)
        self._phase("forward: decoder")
        kv = kv_heads = keys = None         # inference: the decoder projects them layer by layer
        if keep_cache:
            kv, kv_heads = self.mha.cross_kv(memory, F, Bsz, S, cfg.n_decoder_layers)
            keys = self.mha.norm_cross_keys_(kv_heads)
        y, tgt_emb, dec, dec_norm, _ = self._decoder(tgt_in, kv_heads, src_bias, src_rows, F, rng, keep_cache,
                                                     memory=memory, tiled=tiled)
        self._phase("forward: output projection")
        E = self.params[self._emb("out")]
        if logits_out is None:
            logits_out = xp.empty((Bsz, T, E.shape[0]), dtype=self.dtype)
        self.ops.mm(y, E.T, out=logits_out.reshape(Bsz * T, E.shape[0]))      # (N_t, V)
        cache = FastCache(F, src_emb, tgt_emb, enc, enc_norm, dec, dec_norm, memory, kv, y, (Bsz, S, T), keys)
        return logits_out, cache if keep_cache else None

    def _encoder(self, src, src_bias, src_rows, F, rng, keep_cache):
        """Embeddings and encoder layers of one part. Returns memory (N_s, D), the embedding's
        cache, the layers' caches (empty without ``keep_cache``), the final norm's (pre-norm)."""
        cfg, p = self.config, self.params
        Bsz, S = src.shape
        self._phase("forward: embeddings, encoder")
        x, src_emb = self.embeddings.forward("src", src, rng)
        enc = []
        for i in range(cfg.n_encoder_layers):
            pre = f"encoder.{i}"
            W, b = F.enc_qkv[i]
            x, c1 = self.residuals.residual(pre + ".norm1", x, lambda h: self.mha.self_attn(
                pre + ".self_attn", W, b, h, Bsz, S, src_bias, src_rows, rng), p[pre + ".self_attn.b_o"], rng)
            if not keep_cache:
                c1 = None                   # inference: the attention's buffers go before the FFN runs
            x, c2 = self.residuals.residual(pre + ".norm2", x, lambda h: self.ffn.forward(pre + ".ffn", h, rng),
                                            self.ffn.bias(pre), rng)
            if keep_cache:
                enc.append((c1, c2))
            del c1, c2
        enc_norm = None
        if self.block.placement.final_norm:
            x, enc_norm = self.residuals.final_norm("encoder.norm", x)
        return x, src_emb, enc, enc_norm

    def _decoder(self, tgt_in, kv_heads, src_bias, src_rows, F, rng, keep_cache, keep_cross=False,
                 memory=None, tiled=False):
        """Embeddings and decoder layers (:class:`attn.fast.core.layer.Sequences`) of one part.
        Returns y (N_t, D), the embedding's cache, the layers' caches (empty without
        ``keep_cache``), the final norm's (pre-norm), and with ``keep_cross`` each layer's
        cross-attention weights (S, B, H, T), else None. ``kv_heads``: every layer's cross-attention
        keys and values (2L views), or None to project them from ``memory`` (N_s, D) layer by
        layer; ``tiled``: the tiled self-attention (``src_bias`` then a ``KeyMask`` too)."""
        cfg, xp = self.config, self.xp
        Bsz, T = tgt_in.shape
        tgt_bias, tgt_rows = (flash.KeyMask.of(tgt_in, True, self._cores), None) if tiled else \
            mask_bias(decoder_mask(tgt_in), self.dtype, xp)                  # (B, 1, T, T)
        y, tgt_emb = self.embeddings.forward("tgt", tgt_in, rng)
        cross = [] if keep_cross else None
        run = Sequences(self, F, Bsz, T, (tgt_bias, tgt_rows), (src_bias, src_rows), rng, kv_heads, memory,
                        keep_cache, cross)
        dec = []
        for i in range(cfg.n_decoder_layers):
            y, caches = decoder_layer(run, i, y)
            if keep_cache:
                dec.append(caches)
        dec_norm = None
        if self.block.placement.final_norm:
            y, dec_norm = self.residuals.final_norm("decoder.norm", y)
        return y, tgt_emb, dec, dec_norm, cross

    # ------------------------------------------------------------------ encode / decode for inference

    def encode(self, src, rng=None, src_mask=None):
        """:meth:`Transformer.encode`. Without dropout (``rng=None``, inference: what decoding
        calls) the fast encoder, its batch split over threads like :meth:`forward`, and no
        cache (None); with ``rng`` the reference's, whose cache its backward needs."""
        if rng is not None:
            return self.readable.encode(src, rng, src_mask)
        xp, D = self.xp, self.config.d_model
        Bsz, S = src.shape
        src_mask = padding_mask(src) if src_mask is None else src_mask
        out = xp.empty((Bsz, S, D), dtype=self.dtype)
        F = self._fuse()

        def part(sl):
            bias, rows = mask_bias(src_mask[sl], self.dtype, xp)
            out[sl] = self._encoder(src[sl], bias, rows, F, None, False)[0].reshape(-1, S, D)
        self._in_parts(Bsz, S, part)
        return out, None

    def decode(self, tgt_in, memory, src_mask, rng=None):
        """:meth:`Transformer.decode`: with ``rng`` the reference's (whose cache a backward reads);
        without, the search's decoder on the prefix (:meth:`FastSearch.prefix`)."""
        if rng is not None:
            return self.readable.decode(tgt_in, memory, src_mask, rng)
        return self._search.prefix(tgt_in, memory, src_mask, None, True)

    def _in_parts(self, Bsz: int, T: int, part) -> None:
        """Call ``part(rows)`` for the batch's row slices, at the same time on the helper
        threads (BLAS single-threaded meanwhile) when :meth:`_n_parts` splits it."""
        k = self._n_parts(Bsz, T)
        if k == 1:
            part(slice(0, Bsz))
            return
        self.embeddings.shared_tables(T, T)                       # build the shared tables before the threads
        THREADS.parallel([lambda sl=sl: part(sl) for sl in row_slices(Bsz, k)])

    # ------------------------------------------------------------------ decoding: the search's

    def search(self) -> FastSearch:
        """Its :class:`attn.fast.decoding.search.FastSearch` (:class:`attn.engine.Search`), which decodes."""
        return self._search

    def cross_attention_kv(self, memory) -> list:
        return self._search.cross_attention_kv(memory)

    def start_decoding(self, memory, src_mask, reserve=None):
        return self._search.start(memory, src_mask, reserve)

    def decode_step(self, tokens, state):
        return self._search.step(tokens, state)

    def decode_positions(self, tokens, state):
        return self._search.positions(tokens, state)

    @staticmethod
    def attention_weights(cache) -> dict:
        """As :meth:`Transformer.attention_weights`, for a :class:`FastCache` (or a reference cache)."""
        if isinstance(cache, SplitCache):
            parts = [FastTransformer.attention_weights(c) for c in cache.caches]
            xp = B.get_array_module(next(iter(parts[0].values())))
            return {k: xp.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}
        if not isinstance(cache, FastCache):
            return Transformer.attention_weights(cache)
        out = {}
        for i, (c1, _) in enumerate(cache.enc):
            out[f"encoder.{i}.self_attn"] = c1.sub.att.w.transpose(1, 2, 3, 0)
        for i, (c1, c2, _) in enumerate(cache.dec):
            out[f"decoder.{i}.self_attn"] = c1.sub.att.w.transpose(1, 2, 3, 0)
            out[f"decoder.{i}.cross_attn"] = c2.sub.att.w.transpose(1, 2, 3, 0)
        return out

"""The fast model: :class:`FastTransformer` (the reference's parameters, logits and gradients
with fewer passes over memory); its caches are in :mod:`attn.fast.core.caches`, its backward in
:mod:`attn.fast.training.backward`, its decoding state in :mod:`attn.fast.decoding`. See
:mod:`attn.fast` for what it does differently."""
from __future__ import annotations

import contextlib
import copy
import math
import threading

from .. import backend as B
from ..masks import decoder_mask, padding_mask
from ..decode import ReadableSearch
from ..layers.attention import split_heads
from ..block import parts
from ..model import DecodeState as ReadableDecodeState, Transformer, embedding_name, later_block
from ..precision import FP32, Precision, PrecisionError
from ..quantize import refuse_training
from .core import flash, flash_tc, lm
from .decoding import device, host
from .core.int8 import Int8Arena, arena_for, each_for
from .core.attention import Attentions, mask_bias
from .training.backward import Backward
from .core.pieces import Embeddings, Residuals, feed_forward
from .core.layer import Sequences, decoder_layer
from .core.caches import CrossWeights, FastCache, Fused, SplitCache
from .decoding.device import DeviceDecodeState
from .decoding.host import FastDecodeState
from .core.dispatch import ops_for
from .core.ops import Ops
from .gpu.stepmem import StepMemory
from .core.threads import THREADS, row_slices, default_workers, single_threaded_blas


# --------------------------------------------------------------------------- the model


class FastTransformer:
    """:class:`attn.model.Transformer`'s numbers with a faster ``forward``/``backward`` for
    training, and its own decoding (:class:`FastSearch`).

    Same config, parameters (names, shapes, initial values), inputs, logits and
    gradients; the cache is a :class:`FastCache`. It is not a subclass of the readable
    model: it holds one, :attr:`readable`, over the same parameter arrays, and hands it what it
    does not do faster (a forward with dropout outside a step, the checkpoint). ``forward`` must
    be followed by ``backward`` with its cache (the cache holds views into buffers the step
    reuses in place).

    The parameters live in one :class:`attn.fast.core.arena.Arena` (``self.arena``; an int8
    model's, an :class:`attn.fast.core.int8.Int8Arena`, which dequantises each block it is asked for):
    ``self.params`` holds its views, under the reference's names. ``backward`` writes the
    gradients into ``arena.grads`` and returns its views (overwritten by the next
    ``backward``); :class:`FastAdam` over ``self.params`` updates the arena in one pass.
    A parameter replaced in ``params`` by another array (not written into) is copied into
    the arena at the next forward.

    ``precision`` (:class:`attn.precision.Precision` or its name) is what the step's products
    read, fixed when the model is made. ``check_ids=False`` skips the check that token ids lie
    in the vocabulary (CuPy would wrap them silently; on CuPy the check is a host
    synchronisation): for a caller that checked its batches on the host. ``attention`` (an
    attribute too) is ``"plain"`` (the weights kept for the backward), ``"flash"`` (the tiled
    attention of :mod:`attn.fast.core.flash`: memory linear in the length) or ``"auto"`` (the rule
    :func:`attn.fast.core.flash.choose` chooses for each step).

    Its pieces are objects it holds, each made from it once, its forward beside its backward:
    :attr:`embeddings` (the token embeddings and the positions' tables), :attr:`residuals` (the
    block's norm in each residual connection), :attr:`ffn` (the block's feed-forward network),
    :attr:`mha` (the attention sub-layers); ``backward`` runs theirs in the arena's order
    (:class:`attn.fast.training.backward.Backward`).
    """

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
        self._candidates = None                 # beam search's ranked candidates on CuPy, kept between steps
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

    def cross_attention_kv(self, memory) -> list:
        """:meth:`Transformer.cross_attention_kv`, the same arrays. On NumPy its products never run
        on BLAS's own threads (unless ``workers`` is 1), for the reason :meth:`project` gives: the
        decoding steps that follow split their rows over the helper threads, and BLAS threads left
        spinning by a product here took a core from the first steps (a tenth of a greedy decoding
        of toy-bench on two cores). The sentences are split over the helper threads instead, each
        part's products on one thread, into the arrays the reference's products make."""
        ref = self.readable
        if self.xp is not B.host or self.workers is not None and int(self.workers) <= 1:
            return ref.cross_attention_kv(memory)
        xp, p, cfg = self.xp, ref.params, self.config
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
        k = self._n_parts(Bsz, S)
        if k == 1:
            with single_threaded_blas():
                part(slice(0, Bsz))
        else:
            THREADS.parallel([lambda sl=sl: part(sl) for sl in row_slices(Bsz, k)])
        H = cfg.key_value_heads
        pairs = [(split_heads(outs[2 * i], H), split_heads(outs[2 * i + 1], H)) for i in range(cfg.n_decoder_layers)]
        self.mha.norm_cross_keys_([a for pair in pairs for a in pair])
        return pairs

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

    def search(self) -> "FastSearch":
        """What :mod:`attn.decode`'s searches step (:class:`attn.engine.Search`)."""
        return FastSearch(self)

    @property
    def ops(self) -> Ops:
        return ops_for(self.xp, self.precision.name)

    # ------------------------------------------------------------------ weights

    def _fuse(self) -> Fused:
        """The fused weights as the arena lays them out (views: nothing is copied): each
        self-attention's ``[w_q | w_k | w_v]`` (D, 3D), the cross-attention queries, and the
        keys and values of all decoder layers' cross-attention ``[w_k0 | w_v0 | w_k1 | ...]``
        (D, 2D*L). The ``1/sqrt(d_k)`` scale is applied by the softmax (its kernel on CuPy).
        Called once by every forward, encoding and decoding: where the products read bf16
        (:class:`attn.fast.gpu.kernels.products.Bf16Products`), the weights' bf16 copy is made here. An
        int8 model's items are made each time they are read, dequantised (:func:`each_for`)."""
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

    def _decoding_weights(self) -> Fused:
        """What the fast decoding state (:mod:`attn.fast.decoding`) reads, made once per
        decoding: the decoder's self-attention ``[w_q * s | w_k | w_v]`` and cross-attention
        queries ``w_q * s`` with ``s = 1/sqrt(d_k)`` folded in (copies; ``enc_qkv`` empty,
        ``kv`` None). With QK-norm the norm would undo it: s rides on the queries' gain instead
        (:func:`attn.fast.decoding.host.norm_heads_`), and the weights are the arena's. An int8
        model's are made at each read instead (:func:`each_for`): nothing float32 is kept."""
        cfg, p, xp = self.config, self.params, self.xp
        D = cfg.d_model
        s = 1.0 if self.block.self_attention.qk_norm else self.mha.scale
        dt, F, each = self.dtype.type, self._fuse(), each_for(self.arena)

        def scaled_qkv(i):
            W, b = (a.copy() for a in F.dec_qkv[i])
            W[:, :D] *= dt(s)
            b[:D] *= dt(s)
            return W, b
        L = cfg.n_decoder_layers
        return Fused([], each(L, scaled_qkv), each(L, lambda i: (
            p[f"decoder.{i}.cross_attn.w_q"] * dt(s), p[f"decoder.{i}.cross_attn.b_q"] * dt(s))), None, s)

    # ------------------------------------------------------------------ pieces: forward

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
        if self._language_model(src, "forward"):
            return lm.forward(self, tgt_in, rng)
        if src.ndim != 2 or tgt_in.ndim != 2 or src.shape[0] != tgt_in.shape[0]:
            raise ValueError(f"Transformer.forward: src and tgt_in must be (B, S) and (B, T) with one B, "
                             f"got {tuple(src.shape)} and {tuple(tgt_in.shape)}")
        Bsz, T = tgt_in.shape
        k = self._n_parts(Bsz, max(T, src.shape[1]))
        tiled = self._tiled(Bsz, src.shape[1], T, rng)
        if k == 1:
            return self._forward_part(src, tgt_in, rng, tiled=tiled)
        self.embeddings.shared_tables(src.shape[1], T)            # build the shared tables before the threads
        parts = row_slices(Bsz, k)
        rngs = [None] * k           # each part: its rows of what one pass over the batch draws
        if rng is not None:
            from ..training.distributed import RowsOf
            rngs = [RowsOf(copy.deepcopy(rng), sl.start, sl.stop, Bsz, keys_first=self.keys_first) for sl in parts]
        V = self.params[self._emb("out")].shape[0]
        logits = self.xp.empty((Bsz, T, V), dtype=self.dtype)
        fused = self._fuse()                            # once, shared by the parts
        caches = THREADS.parallel([
            lambda sl=sl, r=r: self._forward_part(src[sl], tgt_in[sl], r, logits[sl], fused=fused, tiled=tiled)[1]
            for sl, r in zip(parts, rngs)])
        return logits, SplitCache(caches, parts)

    def _language_model(self, src, what: str) -> bool:
        """Whether this is a decoder-only model's call (``src`` None); a ValueError where ``src``
        and the model disagree, as the readable model's."""
        decoder_only = self.block.cross_attention is None
        if decoder_only != (src is None):
            raise ValueError(f"Transformer.{what}: " + ("a decoder-only model (n_encoder_layers=0) reads no "
                                                        "source: src must be None" if decoder_only else
                                                        "src is None, but the model has an encoder"))
        return decoder_only

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
        decoding step's logits buffer: (n, D) -> (n, V)). On NumPy it never runs on BLAS's
        own threads (unless ``workers`` is 1), as no product of the fast path does: a large one
        is split by rows over the helper threads like :meth:`forward`, a small one runs on one
        thread. A product on BLAS's threads leaves them spinning for a while after it returns,
        and a split pass right after it shares the cores with them: decoding without the cache
        projects each step's last position between two split decoder passes (see
        benchmarks/RESULTS.md, "OpenBLAS's spinning threads")."""
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

    def logits(self, src, tgt_in):
        """Logits (B, T, V_tgt) for evaluation: no dropout, and no cache kept, so each
        layer's buffers are freed as soon as the next layer has run."""
        if self._language_model(src, "logits"):
            return lm.forward(self, tgt_in, None, keep_cache=False)[0]
        if src.ndim != 2 or tgt_in.ndim != 2 or src.shape[0] != tgt_in.shape[0]:
            raise ValueError(f"Transformer.logits: src and tgt_in must be (B, S) and (B, T) with one B, "
                             f"got {tuple(src.shape)} and {tuple(tgt_in.shape)}")
        Bsz, T = tgt_in.shape
        k = self._n_parts(Bsz, max(T, src.shape[1]))
        tiled = self._tiled(Bsz, src.shape[1], T, None)
        if k == 1:
            return self._forward_part(src, tgt_in, None, keep_cache=False, tiled=tiled)[0]
        self.embeddings.shared_tables(src.shape[1], T)
        V = self.params[self._emb("out")].shape[0]
        out = self.xp.empty((Bsz, T, V), dtype=self.dtype)
        fused = self._fuse()
        THREADS.parallel([lambda sl=sl: self._forward_part(src[sl], tgt_in[sl], None, out[sl], keep_cache=False,
                                                            fused=fused, tiled=tiled)
                           for sl in row_slices(Bsz, k)])
        return out

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
        if not keep_cache:
            return logits_out, None
        cache = FastCache(F, src_emb, tgt_emb, enc, enc_norm, dec, dec_norm, memory, kv, y,
                          (Bsz, S, T), keys)
        return logits_out, cache

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
        """Embeddings and decoder layers of one part. Returns y (N_t, D), the embedding's cache,
        the layers' caches (empty without ``keep_cache``), the final norm's (pre-norm), and with
        ``keep_cross`` each layer's cross-attention weights (S, B, H, T), else None.
        ``kv_heads``: the cross-attention keys and values of every layer (2L views), or None
        to project them from ``memory`` (N_s, D) layer by layer; ``tiled``: the self-attention
        the tiled one (``src_bias`` then a :class:`attn.fast.core.flash.KeyMask` too). Each layer is
        :func:`attn.fast.core.layer.decoder_layer` on whole sequences (:class:`attn.fast.core.layer.Sequences`)."""
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

    def decode(self, tgt_in, memory, src_mask, rng=None, cross_kv=None, keep_weights=True):
        """:meth:`Transformer.decode`. Without dropout (``rng=None``: decoding without the cache
        recomputes the prefix with it) the fast decoder, its batch split over threads; the
        cache it returns holds only each layer's cross-attention weights, in the reference's
        place (``cache.layers[i][1].sub.attn.weights``, (B, H, T, S)), for
        :func:`attn.decode.greedy_decode`'s attention. With ``rng`` the reference's.

        Two inference options (what :func:`attn.decode.greedy_decode` passes when it
        recomputes the prefix at every step): ``cross_kv``, each decoder layer's
        cross-attention keys and values (B, H, S, Dh) as :meth:`cross_attention_kv` makes them
        (they depend on the source alone, so they are projected once, not at every step);
        ``keep_weights=False``: no cross-attention weights are kept, and the cache is None."""
        if rng is not None:
            if cross_kv is not None or not keep_weights:
                raise ValueError("FastTransformer.decode: cross_kv and keep_weights are for inference (rng=None)")
            return self.readable.decode(tgt_in, memory, src_mask, rng)
        xp, cfg = self.xp, self.config
        D, H, L, KV = cfg.d_model, cfg.n_heads, cfg.n_decoder_layers, cfg.key_value_heads
        Bsz, T = tgt_in.shape
        S = memory.shape[1]
        if cross_kv is not None and (len(cross_kv) != L or cross_kv[0][0].shape[:3] != (Bsz, KV, S)):
            raise ValueError(f"FastTransformer.decode: cross_kv must hold {L} (keys, values) pairs of shape "
                             f"({Bsz}, {KV}, {S}, {D // H}), got {len(cross_kv)} pairs, the first keys "
                             f"{tuple(cross_kv[0][0].shape) if cross_kv else None}")
        out = xp.empty((Bsz, T, D), dtype=self.dtype)
        weights = [xp.empty((Bsz, H, T, S), dtype=self.dtype) for _ in range(L)] if keep_weights else None
        F = self._fuse()

        def part(sl):
            n = tgt_in[sl].shape[0]
            bias, rows = mask_bias(src_mask[sl], self.dtype, xp)
            kv_heads = None if cross_kv is None else [a[sl] for pair in cross_kv for a in pair]
            y, _, _, _, cross = self._decoder(tgt_in[sl], kv_heads, bias, rows, F, None, False,
                                              keep_cross=keep_weights, memory=memory[sl].reshape(n * S, D))
            out[sl] = y.reshape(n, T, D)
            for w_all, w in zip(weights or [], cross or []):
                w_all[sl] = w.transpose(1, 2, 3, 0)                           # (S, n, H, T) -> (n, H, T, S)
        self._in_parts(Bsz, max(S, T), part)
        cache = None if weights is None else CrossWeights.of(weights)
        return out, cache, decoder_mask(tgt_in)

    def _in_parts(self, Bsz: int, T: int, part) -> None:
        """Call ``part(rows)`` for the batch's row slices, at the same time on the helper
        threads (BLAS single-threaded meanwhile) when :meth:`_n_parts` splits it."""
        k = self._n_parts(Bsz, T)
        if k == 1:
            part(slice(0, Bsz))
            return
        self.embeddings.shared_tables(T, T)                       # build the shared tables before the threads
        THREADS.parallel([lambda sl=sl: part(sl) for sl in row_slices(Bsz, k)])

    # ------------------------------------------------------------------ decoding

    #: decode_step runs with single-threaded BLAS (NumPy) while rows x d_model is at most this:
    #: OpenBLAS splits even (64, 256) x (256, 256) products over its threads, and the threads'
    #: hand-offs cost several times the product.
    DECODE_ONE_THREAD_MAX = 1 << 18

    def start_decoding(self, memory, src_mask, reserve=None):
        """:meth:`Transformer.start_decoding`; on NumPy a :class:`FastDecodeState` (growing
        key/value buffers, fused weights, each row's sentence: see :mod:`attn.fast.decoding`); on
        CuPy a :class:`DeviceDecodeState` (preallocated buffers, one kernel per sub-layer), its
        buffers sized by ``reserve`` = (rows, positions) when given. The later block
        (:func:`attn.model.later_block`) decodes with a :class:`FastDecodeState` on CuPy too: the
        device state's kernels are the paper's sub-layers."""
        if self.block.cross_attention is None:          # a language model: the readable model's cache
            self._own_params()
            return self.readable.start_decoding(None, None)
        if self.xp is not B.host and not later_block(self.config):
            self._own_params()
            return device.start_device(self, self.cross_attention_kv(memory), src_mask, reserve)
        return host.start(self, self.cross_attention_kv(memory), src_mask,
                              None if reserve is None else reserve[1])

    def decode_step(self, tokens, state):
        """:meth:`Transformer.decode_step`. On NumPy with a :class:`FastDecodeState`, the fast
        step of :mod:`attn.fast.decoding`, its rows split over :attr:`workers` threads (default
        :func:`default_workers`); small steps otherwise run with single-threaded BLAS."""
        if isinstance(state, DeviceDecodeState):
            return device.device_step(self, tokens, state)
        if isinstance(state, ReadableDecodeState):
            return self.readable.decode_step(tokens, state)
        return self._host_step(tokens, state, host.decode_step)

    def decode_positions(self, tokens, state):
        """:meth:`Transformer.decode_positions`: tokens (B, T) read in one pass through the state's
        cache (speculative decoding's check of a draft's tokens); the state is rolled back by its
        ``truncate``. A :class:`FastDecodeState` runs them through the same decoder layer as a step
        (:func:`attn.fast.decoding.host.decode_positions`); a :class:`DeviceDecodeState`, whose
        kernels read one position, steps them one after another."""
        if isinstance(state, DeviceDecodeState):
            return device.device_positions(self, tokens, state)
        if isinstance(state, ReadableDecodeState):         # a language model's: small ones on one BLAS thread
            with single_threaded_blas() if self._small(tokens) else contextlib.nullcontext():
                return self.readable.decode_positions(tokens, state)
        return self._host_step(tokens, state, host.decode_positions)

    def _small(self, tokens) -> bool:
        """Whether positions ``tokens`` are few enough for NumPy's BLAS on one thread (see
        :attr:`DECODE_ONE_THREAD_MAX`)."""
        return self.xp is B.host and tokens.size * self.config.d_model <= self.DECODE_ONE_THREAD_MAX

    def _host_step(self, tokens, state, step):
        if not isinstance(state, FastDecodeState):
            raise TypeError(f"FastTransformer.{step.__name__}: the state must come from its start_decoding, "
                            f"got a {type(state).__name__}")
        small = self._small(tokens)
        parts = default_workers() if self.workers is None else max(1, int(self.workers))
        parts = parts if self.xp is B.host else 1
        return host.run_step(self, tokens, state, parts, small, step)

    #: On CuPy, beam search's candidates are ranked by one kernel where a sentence's beams have at
    #: most this many between them; above it, by the reference's array calls. Both keep the same
    #: candidates (among exactly equal scores at the cut, which ones may differ).
    BEAM_FUSED_MAX = 1024

    def greedy_pick(self, logp, banned, info, tokens) -> None:
        """:meth:`attn.decode.ReadableSearch.greedy_pick`; on CuPy one kernel (``greedy_pick``)."""
        if self.xp is B.host:
            return ReadableSearch.greedy_pick(logp, banned, info, tokens)
        device.greedy_pick(logp, tuple(banned), info, tokens)

    def beam_candidates(self, logp, beam_scores, W: int, c: int, C: int, banned):
        """:meth:`attn.decode.ReadableSearch.beam_candidates`; on CuPy one kernel (``beam_candidates``: each beam's
        best tokens, then each sentence's best C of those) up to :attr:`BEAM_FUSED_MAX`."""
        V = logp.shape[1]
        if self.xp is B.host or c > V - 2 or W * c > self.BEAM_FUSED_MAX:
            return ReadableSearch.beam_candidates(logp, beam_scores, W, c, C, banned)
        shape = (2, beam_scores.shape[0], C)
        if self._candidates is None or self._candidates.shape != shape:
            self._candidates = self.xp.empty(shape, dtype=self.xp.float64)
        device.beam_candidates(logp, beam_scores.reshape(-1), W, c, C, tuple(banned), self._candidates)
        return B.to_host(self._candidates)

    # ------------------------------------------------------------------ inspection

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


class FastSearch:
    """What :mod:`attn.decode`'s searches step (:class:`attn.engine.Search`), for a
    :class:`FastTransformer`: its decoding states (:mod:`attn.fast.decoding`), its decoder on a
    prefix with the memory's keys and values projected once, its token picks."""

    def __init__(self, model: FastTransformer):
        self.model = model
        self.check_every = 1 if model.xp is B.host else host.EOS_CHECK_EVERY

    def rows_to_device(self, index, tokens, scores):
        return host.rows_to_device(self.model.xp, index, tokens, scores)

    def start(self, memory, src_mask, reserve=None):
        return self.model.start_decoding(memory, src_mask, reserve)

    def step(self, tokens, state):
        return self.model.decode_step(tokens, state)

    def select(self, state, index, index_host):
        return state.select(index, index_host)

    def prefix(self, tgt_in, memory, src_mask, cross_kv, keep_weights):
        return self.model.decode(tgt_in, memory, src_mask, cross_kv=cross_kv, keep_weights=keep_weights)

    def greedy_pick(self, logp, banned, info, tokens) -> None:
        self.model.greedy_pick(logp, banned, info, tokens)

    def beam_candidates(self, logp, beam_scores, W: int, c: int, C: int, banned):
        return self.model.beam_candidates(logp, beam_scores, W, c, C, banned)

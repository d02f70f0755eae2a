"""The fast engine's tiled attention (FlashAttention, docs/GPU.md): :func:`attend` and
:func:`attend_backward` launch the kernels of :mod:`attn.fast.gpu.kernels.flash` on CuPy and run
their NumPy twins on NumPy; :func:`choose` is the one rule that chooses it over the plain
attention. It keeps the output and one log-sum-exp per query (memory linear in the length), has
no weights to drop out or inspect, and multiplies in the model's dtype at every precision."""
from __future__ import annotations

import math
import os
import sys
import weakref
from typing import NamedTuple

from ... import backend as B
from ...masks import PAD_ID
from ..gpu.kernels.flash import SHARED_LIMIT, HostLaunch, compiled_head, flash_shared, flash_tiles
from ..gpu.kernels.registry import CTYPES, NUMPY_TWINS

#: The choices of ``FastTransformer.attention`` and ``attn-train --attention``.
MODES = ("auto", "plain", "flash")

class AutoRule(NamedTuple):
    """How ``auto`` chooses on one kind of device (docs/GPU.md, "The rule"): tiled where the weights
    the plain step keeps would exceed ``memory_share`` of the memory, or from the length
    ``min_length`` on (None: by memory alone); ``basis``, said with the choice, is what the numbers
    rest on."""
    memory_share: float
    min_length: int | None
    basis: str


#: ``auto``'s rule by device kind (:func:`device_kind`): a GPU's name where a GPU report measured the
#: tiled attention there, else the backend's row. No GPU has timed the tiled kernels: both rows are
#: the memory rule, so on a GPU ``auto`` tiles only to save memory, never for speed.
AUTO_RULES = {
    "numpy": AutoRule(0.25, None, "the memory rule: on the CPU the plain attention was the faster at every "
                                  "length measured up to 8,192 (benchmarks/RESULTS.md, \"Attention alone\")"),
    "cupy": AutoRule(0.25, None, "the memory rule: no GPU has timed the tiled attention's kernels, so no "
                                 "length is known from which they are the faster"),
}

#: The tiles of the NumPy twins on the CPU (no shared memory to fit: larger tiles, fewer passes).
HOST_TILE = 256


class KeyMask(NamedTuple):
    """What the tiled attention masks: ``ok`` (B, Tk) bool, True for keys that are real tokens,
    and ``causal`` (queries see no later key); ``cores``: the 16-bit format in which the
    tensor-core kernels run it (:mod:`attn.fast.core.flash_tc`), None for the float kernels here."""
    ok: object
    causal: bool
    cores: str | None = None

    @classmethod
    def of(cls, ids, causal: bool, cores: str | None = None) -> "KeyMask":
        return cls(ids != PAD_ID, causal, cores)


class FlashCache(NamedTuple):
    """What the tiled attention keeps for its backward: q (B, H, Tq, Dh), k and v (B, Hkv, Tk, Dh)
    views, the mask, the log-sum-exp (B, H, Tq) and the output ctx (B*Tq, H*Dh) (the output
    projection's input, which the backward's ``D = rowsum(dO * O)`` reads)."""
    q: object
    k: object
    v: object
    mask: KeyMask
    lse: object
    ctx: object

    @property
    def w(self):
        raise ValueError("the tiled attention keeps no attention weights; make the model with "
                         "attention='plain' to inspect them")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"attention must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def plain_weight_bytes(config, Bsz: int, S: int, T: int, itemsize: int) -> int:
    """Bytes of the attention weights a plain step keeps for its backward: every encoder layer's
    (S x S), every decoder layer's (T x T and T x S), for B sentences and H heads."""
    per = config.n_encoder_layers * S * S + config.n_decoder_layers * (T * T + T * S)
    return per * Bsz * config.n_heads * itemsize


def memory_bytes(xp) -> int:
    """The memory the rule shares out: the GPU's total on CuPy, the host's physical memory on NumPy."""
    if xp is B.host:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(xp.cuda.Device().mem_info[1])


def device_kind(xp) -> str:
    """The row of :data:`AUTO_RULES` for ``xp``'s device: ``numpy``, the GPU's name where the table
    has it, else ``cupy``."""
    if xp is B.host:
        return "numpy"
    name = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return name if name in AUTO_RULES else "cupy"


def choose(mode: str, config, Bsz: int, S: int, T: int, itemsize: int, xp, dropping: bool,
           memory: int | None = None, kind: str | None = None) -> str | None:
    """The rule: None where a step of B sentences of S source and T target tokens runs the plain
    attention, else why the tiled one, in words. ``plain``: never; ``flash``: always (an error where
    the weights are dropped out); ``auto``: not where the weights are dropped out, else by the row
    ``kind`` (default :func:`device_kind`) of :data:`AUTO_RULES`, of ``memory`` (default
    :func:`memory_bytes`)."""
    check_mode(mode)
    if mode == "plain":
        return None
    if dropping:
        if mode == "flash":
            raise ValueError(f"attention='flash' has no weights to drop out: attention_dropout is "
                             f"{config.attention_dropout}; set it to 0 or use attention='plain'")
        return None
    if mode == "flash":
        return "attention='flash' was asked for"
    memory = memory_bytes(xp) if memory is None else memory
    kind = device_kind(xp) if kind is None else kind
    rule = AUTO_RULES[kind]
    if rule.min_length is not None and max(S, T) >= rule.min_length:
        return (f"the length {max(S, T)} reaches {rule.min_length}, from which the tiled attention is the faster "
                f"on {kind} ({rule.basis})")
    need = plain_weight_bytes(config, Bsz, S, T, itemsize)
    if need > rule.memory_share * memory:
        return (f"the plain attention's weights for {Bsz} sentences of {S} source and {T} target tokens would take "
                f"{need / 2 ** 20:,.1f} MiB, more than {rule.memory_share:g} of the {memory / 2 ** 30:,.1f} GiB "
                f"of {'this GPU' if kind != 'numpy' else 'the host'} ({rule.basis})")
    return None


class AutoNotice:
    """Says on stderr, once (per model, so once per run), that ``auto`` took the tiled attention and
    why: a slower path is never taken in silence."""

    def __init__(self):
        self.said = False

    def __call__(self, why: str) -> None:
        if not self.said:
            self.said = True
            print(f"attn: --attention auto takes the tiled attention (FlashAttention) from this step on: {why}",
                  file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- launches


_HEADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_OPT_IN: dict = {}


def _run(ops, name: str, dtype, grid, block, shared: int, args, Dh: int | None = None) -> None:
    """Launch kernel ``name`` (CuPy: the compiled module's) or call its twin (NumPy). With ``Dh``,
    the instance compiled for that head size where there is one (``flash_fwd<float, 64>``, else
    ``<float, 0>``), opted into ``shared`` bytes where that is above :data:`SHARED_LIMIT`."""
    full = name if Dh is None else f"{name}<{CTYPES[str(dtype)]}, {compiled_head(Dh, dtype.itemsize)}>"
    if ops.xp is B.host:
        NUMPY_TWINS[name](HostLaunch(full, grid, block, shared), *args)
    elif Dh is None:
        ops.kernel(name, dtype)(grid, block, args, shared_mem=shared)
    else:
        opted_in(ops.xp, _HEADED.setdefault(ops, {}), full, ops.function, shared)(grid, block, args, shared_mem=shared)


def opted_in(xp, fns: dict, name: str, lookup, shared: int):
    """Function ``name`` from ``fns`` ({name: (function, bytes opted into)}; ``lookup(name)`` the first
    time), opted into ``shared`` bytes of dynamic shared memory where that is above the 48 KiB any
    kernel may take (:data:`SHARED_LIMIT`): CUDA's ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``,
    through CuPy's driver module (a module's functions have no ``max_dynamic_shared_size_bytes``)."""
    f, opted = fns.get(name) or (lookup(name), 0)
    if shared > max(SHARED_LIMIT, opted):
        xp.cuda.driver.funcSetAttribute(f.ptr, xp.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        int(shared))
        opted = shared
    fns[name] = f, opted
    return f


def shared_limit(xp) -> int:
    """The shared memory a block of the current GPU may opt into (``sharedMemPerBlockOptin``), read once."""
    dev = xp.cuda.Device().id
    if dev not in _OPT_IN:
        _OPT_IN[dev] = int(xp.cuda.runtime.getDeviceProperties(dev).get("sharedMemPerBlockOptin", SHARED_LIMIT))
    return _OPT_IN[dev]


def _tile(ops, kernel: str, Dh: int, itemsize: int, tile: int | None) -> tuple:
    """The tile ``kernel`` runs with (``tile`` when given, else the backend's: on a GPU the largest
    whose shared memory the device allows) and its shared memory."""
    if tile is None:
        tile = HOST_TILE if ops.xp is B.host else flash_tiles(kernel, Dh, itemsize, shared_limit(ops.xp))
    return tile, flash_shared(kernel, tile, tile, Dh, itemsize)


def _strides(a, what: str) -> tuple:
    """Element strides (sentence, head, position) of a (B, H, T, Dh) view with contiguous rows."""
    it = a.dtype.itemsize
    if a.ndim != 4 or a.shape[3] > 1 and a.strides[3] != it:
        raise ValueError(f"flash attention: {what} must be (B, H, T, Dh) with contiguous rows of Dh, "
                         f"got shape {tuple(a.shape)} strides {a.strides}")
    return tuple(B.host.int64(s // it) for s in a.strides[:3])


def _shapes(q, k, v, mask: KeyMask):
    Bsz, H, Tq, Dh = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.strides != v.strides or k.shape[0] != Bsz or k.shape[3] != Dh or H % Hkv:
        raise ValueError(f"flash attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: keys and "
                         f"values of one shape and layout, their heads dividing the queries'")
    if tuple(mask.ok.shape) != (Bsz, Tk) or (mask.causal and Tq != Tk):
        raise ValueError(f"flash attention: the key mask is {tuple(mask.ok.shape)} for {Bsz} sentences of {Tk} "
                         f"keys{' (causal: as many queries as keys)' if mask.causal else ''}")
    return Bsz, H, Hkv, Tq, Tk, Dh


def attend(ops, q, k, v, mask: KeyMask, scale: float, tile: int | None = None):
    """``softmax(q k^T scale + mask) v`` tiled: one ``flash_fwd`` launch. q (B, H, Tq, Dh), k and v
    (B, Hkv, Tk, Dh) views with contiguous rows. Returns ctx (B*Tq, H*Dh) and the
    :class:`FlashCache` for :func:`attend_backward`. ``tile``: rows of queries and of keys per
    tile (default: the largest that fits a block's shared memory on CuPy, :data:`HOST_TILE` on NumPy)."""
    xp, i32 = ops.xp, B.host.int32
    Bsz, H, Hkv, Tq, Tk, Dh = _shapes(q, k, v, mask)
    dt, it = q.dtype, q.dtype.itemsize
    o = xp.empty((Bsz, Tq, H, Dh), dtype=dt)
    lse = xp.empty((Bsz, H, Tq), dtype=dt)
    ok = xp.ascontiguousarray(mask.ok)
    t, shared = _tile(ops, "flash_fwd", Dh, it, tile)
    if Bsz * H and Tq and not Tk:                      # no key: the plain attention's zeros, and no launch
        o[...] = 0                                       # whose tile loop would never reach a barrier
        lse[...] = 0
    elif Bsz * H and Tq:
        _run(ops, "flash_fwd", dt, (Bsz * H, math.ceil(Tq / t)), (t,), shared,
             (q, k, v, ok, o, lse, dt.type(scale), dt.type(B.host.finfo(dt).min), i32(H), i32(Hkv), i32(Tq),
              i32(Tk), i32(Dh), i32(mask.causal), i32(t), *_strides(q, "q"), *_strides(k, "k"), B.host.int64(Tk)), Dh)
    ctx = o.reshape(Bsz * Tq, H * Dh)
    return ctx, FlashCache(q, k, v, KeyMask(ok, mask.causal), lse, ctx)


def backward_prep(ops, dctx, c, dq, dk, dv, dtype):
    """A tiled backward's start (this one's and :mod:`.flash_tc`'s): the gradients' views checked,
    zeros where nothing is attended (then None), else (dO contiguous, D = rowsum(dO * O) in
    ``dtype`` by one ``flash_bwd_prep`` launch)."""
    if dk.strides != dv.strides or dq.shape != c.q.shape or dk.shape != c.k.shape or dv.shape != c.v.shape:
        raise ValueError(f"flash attention backward: dq {tuple(dq.shape)}, dk {tuple(dk.shape)}, dv "
                         f"{tuple(dv.shape)} must match q and k, dk and dv of one layout")
    Bsz, H, Tq, Dh = c.q.shape
    n = Bsz * H * Tq
    if n == 0 or c.k.shape[2] == 0:
        for a in (dq, dk, dv):
            a[...] = 0
        return None
    dout = ops.xp.ascontiguousarray(dctx)
    dsum = ops.xp.empty((Bsz, H, Tq), dtype=dtype)
    _run(ops, "flash_bwd_prep", dtype, (math.ceil(n / 256),), (256,), 0,
         (dout, c.ctx, dsum, B.host.int32(H), B.host.int32(Tq), B.host.int32(Dh), B.host.int64(n)))
    return dout, dsum


def attend_backward(ops, dctx, c: FlashCache, dq, dk, dv, scale: float, tile: int | None = None) -> None:
    """The tiled attention's backward into the views dq (B, H, Tq, Dh), dk and dv (B, Hkv, Tk, Dh):
    ``D = rowsum(dO * O)`` (``flash_bwd_prep``), then dK and dV per key tile (``flash_bwd_kv``)
    and dQ per query tile (``flash_bwd_q``), each recomputing P from the log-sum-exp. ``tile`` as
    :func:`attend`'s."""
    i32, i64 = B.host.int32, B.host.int64
    Bsz, H, Hkv, Tq, Tk, Dh = _shapes(c.q, c.k, c.v, c.mask)
    dt, it = c.q.dtype, c.q.dtype.itemsize
    prep = backward_prep(ops, dctx, c, dq, dk, dv, dt)
    if prep is None:
        return
    dout, dsum = prep
    shape = (dt.type(scale), i32(H), i32(Hkv), i32(Tq), i32(Tk), i32(Dh), i32(c.mask.causal))
    inputs = (c.q, c.k, c.v, c.mask.ok, dout, c.lse, dsum)
    qs, ks = _strides(c.q, "q"), _strides(c.k, "k")
    t, shared = _tile(ops, "flash_bwd_kv", Dh, it, tile)
    _run(ops, "flash_bwd_kv", dt, (Bsz * Hkv, math.ceil(Tk / t)), (t,), shared,
         (*inputs, dk, dv, *shape, i32(t), *qs, *ks, *_strides(dk, "dk"), i64(Tk)), Dh)
    t, shared = _tile(ops, "flash_bwd_q", Dh, it, tile)
    _run(ops, "flash_bwd_q", dt, (Bsz * H, math.ceil(Tq / t)), (t,), shared,
         (*inputs, dq, *shape, i32(t), *qs, *ks, *_strides(dq, "dq"), i64(Tk)), Dh)

"""The tiled attention on the tensor cores (FlashAttention-2, :mod:`attn.fast.gpu.kernels.flash_mma`):
:func:`attend` and :func:`attend_backward` launch its kernels on CuPy (the stand-in runs their
twins), and :func:`cores_for` is the one rule that chooses them. They **have never run on a GPU**,
so nothing takes them in silence (docs/GPU.md): ``--attention flash`` at ``--precision bf16`` with
heads of 64 or 128 on CuPy, or ``auto`` on a device kind :data:`TC_RULES` names (none yet); the
choice is said once on stderr. q, k and v are packed to 16 bits at every forward, and the backward
reads those copies again; masks, layouts and a query with no key are :mod:`attn.fast.core.flash`'s."""
from __future__ import annotations

import math
import sys
import weakref

from ... import backend as B
from . import flash
from ..gpu.kernels.common import grid_of
from ..gpu.kernels.flash import HostLaunch
from ..gpu.kernels.flash_mma import (HEAD_SIZES, KINDS, NAME_EXPRESSIONS, OPTIONS, SOURCE, TILES, instance,
                                     mma_rows, mma_shared)
from ..gpu.kernels.registry import NUMPY_TWINS

#: ``auto``'s rule for the tensor-core kernels: the device kinds (:func:`attn.fast.core.flash.device_kind`)
#: on which a GPU report measured them right (against their twins) and faster than the float32 tiled
#: kernels, with what the measurement was. Empty: no GPU has run them.
TC_RULES: dict = {}


def cores_for(mode: str, precision: str, xp, Dh: int, kind: str) -> tuple:
    """(the 16-bit format the tiled attention's tensor-core kernels run in, or None; why, in words)
    for attention ``mode`` at ``precision`` on ``xp``'s device of ``kind`` with heads of Dh."""
    if xp is B.host:
        return None, "NumPy has no tensor cores"
    if precision not in KINDS:
        return None, f"the precision is {precision}: the float32 tiled kernels"
    if Dh not in HEAD_SIZES:
        return None, f"heads of {Dh} values: the tensor-core kernels are compiled for {HEAD_SIZES}"
    if mode == "flash":
        return precision, f"--attention flash at {precision} asks for them"
    if mode == "auto" and kind in TC_RULES:
        return precision, f"auto on {kind}: {TC_RULES[kind]}"
    return None, f"{mode}: no GPU report has measured the tensor-core kernels on {kind}"


def say(fmt: str, why: str) -> None:
    """The choice of the tensor-core kernels, on stderr: they have never run on a GPU."""
    print(f"attn: the tiled attention runs on the tensor cores in {fmt} ({why}); these kernels are compiled by "
          f"NVRTC but have not yet run on a GPU (docs/GPU.md)", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- launches

_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fn(ops, name: str, shared: int):
    """Instance ``name`` of the tensor-core module (compiled once per ``ops``, on first use), opted
    into ``shared`` bytes of shared memory where that is above the 48 KiB every block may take."""
    fns = _FUNCTIONS.get(ops)
    if fns is None:
        module = ops.xp.RawModule(code=SOURCE, options=OPTIONS, name_expressions=NAME_EXPRESSIONS)
        fns = _FUNCTIONS[ops] = {None: module}
    return flash.opted_in(ops.xp, fns, name, fns[None].get_function, shared)


def _run(ops, name: str, grid, block, shared: int, args) -> None:
    """Launch instance ``name`` (CuPy) or call its twin (NumPy: tests only, the engine never does)."""
    if ops.xp is B.host:
        NUMPY_TWINS[name.split("<")[0]](HostLaunch(name, grid, block, shared), *args)
    else:
        _fn(ops, name, shared)(grid, block, args, shared_mem=shared)


def pack(ops, a, fmt: str):
    """The contiguous 16-bit copy (uint16 patterns) of a float32 (B, H, T, Dh) view with contiguous rows."""
    if a.dtype != B.host.float32:
        raise ValueError(f"the tensor-core attention packs float32 q, k, v and dO, got {a.dtype}")
    out = ops.xp.empty(a.shape, dtype=B.host.uint16)
    n = out.size
    if n:
        i32 = B.host.int32
        _run(ops, instance("flash_mma_pack", fmt), grid_of(n), (256,), 0,
             (a, out, i32(a.shape[1]), i32(a.shape[2]), i32(a.shape[3]), *flash._strides(a, "a packed operand"),
              B.host.int64(n)))
    return out


def _launch(ops, kernel: str, fmt: str, Dh: int, groups: int, rows: int, args) -> None:
    """``kernel`` at its production tiles: a block per (head, tile of ``rows``)."""
    BR, BC = TILES[kernel]
    own = mma_rows(kernel, BR, BC)
    _run(ops, instance(kernel, fmt, Dh, (BR, BC)), (groups, math.ceil(rows / own)), (2 * own,),
         mma_shared(kernel, Dh, BR, BC), args)


def attend(ops, q, k, v, mask: flash.KeyMask, scale: float):
    """:func:`attn.fast.core.flash.attend` on the tensor cores in ``mask.cores`` (bf16 or fp16): q, k, v
    packed, then one ``flash_mma_fwd`` launch. Returns ctx (B*Tq, H*Dh) float32 and the
    :class:`attn.fast.core.flash.FlashCache` (holding the 16-bit copies) for :func:`attend_backward`."""
    xp, i32, f32 = ops.xp, B.host.int32, B.host.float32
    Bsz, H, Hkv, Tq, Tk, Dh = flash._shapes(q, k, v, mask)
    qp, kp, vp = (pack(ops, a, mask.cores) for a in (q, k, v))
    o = xp.empty((Bsz, Tq, H, Dh), dtype=f32)
    lse = xp.empty((Bsz, H, Tq), dtype=f32)
    ok = xp.ascontiguousarray(mask.ok)
    if Bsz * H and Tq and not Tk:                      # no key: zeros, and no launch
        o[...] = 0
        lse[...] = 0
    elif Bsz * H and Tq:
        _launch(ops, "flash_mma_fwd", mask.cores, Dh, Bsz * H, Tq,
                (qp, kp, vp, ok, o, lse, f32(scale), i32(H), i32(Hkv), i32(Tq), i32(Tk), i32(mask.causal)))
    ctx = o.reshape(Bsz * Tq, H * Dh)
    return ctx, flash.FlashCache(qp, kp, vp, flash.KeyMask(ok, mask.causal, mask.cores), lse, ctx)


def attend_backward(ops, dctx, c: flash.FlashCache, dq, dk, dv, scale: float) -> None:
    """The backward of :func:`attend` into the float32 views dq (B, H, Tq, Dh), dk and dv
    (B, Hkv, Tk, Dh). Forward was O = softmax(Q K^T s) V row by row, so with P recomputed from the
    log-sum-exp, dV = P^T dO, dP = dO V^T, dS = P (dP - D) with D = rowsum(dO O), dK = s dS^T Q and
    dQ = s dS K: D by ``flash_bwd_prep``, dK and dV by ``flash_mma_bwd_kv`` (a block per key
    tile), dQ by ``flash_mma_bwd_q`` (a pass of its own)."""
    i32, f32 = B.host.int32, B.host.float32
    Bsz, H, Hkv, Tq, Tk, Dh = flash._shapes(c.q, c.k, c.v, c.mask)
    prep = flash.backward_prep(ops, dctx, c, dq, dk, dv, B.host.dtype(f32))
    if prep is None:
        return
    dout, dsum = prep
    dop = pack(ops, dout.reshape(Bsz, Tq, H, Dh).transpose(0, 2, 1, 3), c.mask.cores)
    inputs = (c.q, c.k, c.v, c.mask.ok, dop, c.lse, dsum)
    shape = (f32(scale), i32(H), i32(Hkv), i32(Tq), i32(Tk), i32(c.mask.causal))
    _launch(ops, "flash_mma_bwd_kv", c.mask.cores, Dh, Bsz * Hkv, Tk,
            (*inputs, dk, dv, *shape, *flash._strides(dk, "dk")))
    _launch(ops, "flash_mma_bwd_q", c.mask.cores, Dh, Bsz * H, Tq, (*inputs, dq, *shape, *flash._strides(dq, "dq")))

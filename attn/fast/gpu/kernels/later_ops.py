"""The launch code of the later block's kernels (:mod:`.later`): :class:`LaterKernels`, which
:class:`attn.fast.gpu.kernels.CupyOps` holds and hands RMSNorm, rotary positions and SwiGLU's gate,
each run in one launch (RMSNorm's backward: its dgamma by one ``column_sums`` launch first)."""
from __future__ import annotations

from .... import backend as B
from ...core.ops import Mask, Ops
from .common import block_size_for, grid_of


class LaterKernels:
    """RMSNorm, RoPE and SwiGLU's gate as kernels, launched through the public launch interface of
    ``ops``, the :class:`attn.fast.gpu.kernels.CupyOps` that holds this object; a mask that is not a
    kernel's own goes to the NumPy-style operations of :class:`attn.fast.core.ops.Ops`."""

    def __init__(self, ops):
        self.ops = ops

    def _rms(self, s, bias, m, x, gamma, eps, residual: bool):
        ops, cp = self.ops, self.ops.xp
        N, D = s.shape
        ops.check_contiguous("rms_norm_", s=s, **({"x": x} if residual else {}))
        out = cp.empty_like(s)
        rstd = cp.empty((N,), dtype=s.dtype)
        threads = block_size_for(D)
        ops.kernel("rms_norm_fwd", s.dtype)(
            (N,), (threads,), (s, s if bias is None else cp.ascontiguousarray(bias), s if x is None else x, out, rstd,
                               cp.ascontiguousarray(gamma), *ops.dropout_args(m, s.dtype), B.host.int32(D),
                               ops.scalar(eps, s.dtype), B.host.int32(residual), B.host.int32(bias is not None)),
            shared_mem=threads * s.dtype.itemsize)
        return out, rstd

    def rms_norm_(self, x, gamma, eps: float):
        """As :meth:`attn.fast.core.ops.Ops.rms_norm_`: one ``rms_norm_fwd`` launch."""
        return self._rms(x, None, None, None, gamma, eps, False)

    def residual_rms_norm_(self, s, bias, m, x, gamma, eps: float):
        """As :meth:`attn.fast.core.ops.Ops.residual_rms_norm_`: one ``rms_norm_fwd`` launch (bias,
        dropout from its counter, residual sum, RMSNorm)."""
        if not self.ops.fused_mask(m, s.shape, "residual_rms_norm_"):
            return Ops.residual_rms_norm_(self.ops, s, bias, m, x, gamma, eps)
        return self._rms(s, bias, m, x, gamma, eps, True)

    def _rms_bwd(self, dout, xhat, rstd, gamma, m, out, where):
        ops, cp = self.ops, self.ops.xp
        N, D = dout.shape
        ops.check_contiguous(where, dout=dout, xhat=xhat)
        out = cp.empty((1, D), dtype=dout.dtype) if out is None else out
        sums = ops.buffer("rms_column_sums", 2 * D, dout.dtype)          # sum(dout * xhat), sum(dout)
        ops.column_sums(dout, xhat, sums, where)
        out[0] = sums[:D]
        ds = dout if m is None else cp.empty_like(dout)
        threads = block_size_for(D)
        ops.kernel("rms_norm_bwd", dout.dtype)(
            (N,), (threads,), (dout, xhat, rstd, cp.ascontiguousarray(gamma), ds, *ops.dropout_args(m, dout.dtype),
                               B.host.int32(D)),
            shared_mem=threads * dout.dtype.itemsize)
        return dout, out[0], ds

    def rms_norm_backward_(self, dout, xhat, rstd, gamma, out=None):
        """As :meth:`attn.fast.core.ops.Ops.rms_norm_backward_`: dgamma by one ``column_sums`` launch
        (and its copy into ``out``), then one ``rms_norm_bwd`` launch for dx."""
        return self._rms_bwd(dout, xhat, rstd, gamma, None, out, "rms_norm_backward_")[:2]

    def rms_norm_backward_dropout_(self, dout, xhat, rstd, gamma, m, out=None):
        """As :meth:`attn.fast.core.ops.Ops.rms_norm_backward_dropout_`, drop(dy) written by the
        ``rms_norm_bwd`` launch (the mask regenerated from its counter)."""
        if not self.ops.fused_mask(m, dout.shape, "rms_norm_backward_dropout_"):
            return Ops.rms_norm_backward_dropout_(self.ops, dout, xhat, rstd, gamma, m, out)
        dy, _, ds = self._rms_bwd(dout, xhat, rstd, gamma, m, out, "rms_norm_backward_dropout_")
        return dy, ds

    def rope_(self, x, cos, sin, inverse: bool = False):
        """As :meth:`attn.fast.core.ops.Ops.rope_`: one ``rope_rotate`` launch on the view as it lies
        (x (B, H, T, Dh), its last axis contiguous; cos and sin (T, Dh/2) contiguous)."""
        Bsz, H, T, Dh = x.shape
        item = x.dtype.itemsize
        if x.strides[3] != item or not (cos.flags.c_contiguous and sin.flags.c_contiguous):
            raise ValueError(f"CupyOps.rope_: x's last axis and cos, sin must be contiguous, got x strides "
                             f"{x.strides}")
        sb, sh, st = (s // item for s in x.strides[:3])
        n = Bsz * H * T * (Dh // 2)
        if n:
            self.ops.kernel("rope_rotate", x.dtype)(
                grid_of(n), (256,), (x, cos, sin, B.host.int32(H), B.host.int32(T), B.host.int32(Dh // 2),
                                   B.host.int64(sb), B.host.int64(sh), B.host.int64(st), B.host.int32(inverse),
                                   B.host.int64(n)))
        return x

    def swiglu_gate(self, ab, m: Mask | None = None):
        """As :meth:`attn.fast.core.ops.Ops.swiglu_gate`: one ``swiglu_fwd`` launch."""
        ops, (N, F2) = self.ops, ab.shape
        if not ops.fused_mask(m, (N, F2 // 2), "swiglu_gate"):
            return Ops.swiglu_gate(ops, ab, m)
        ops.check_contiguous("swiglu_gate", ab=ab)
        h = ops.xp.empty((N, F2 // 2), dtype=ab.dtype)
        ops.kernel("swiglu_fwd", ab.dtype)(grid_of(h.size), (256,), (ab, h, *ops.dropout_args(m, ab.dtype),
                                                                    B.host.int64(h.size), B.host.int32(F2 // 2)))
        return h

    def swiglu_gate_backward(self, dh, ab, m: Mask | None = None):
        """As :meth:`attn.fast.core.ops.Ops.swiglu_gate_backward`: one ``swiglu_bwd`` launch."""
        ops = self.ops
        if not ops.fused_mask(m, dh.shape, "swiglu_gate_backward"):
            return Ops.swiglu_gate_backward(ops, dh, ab, m)
        ops.check_contiguous("swiglu_gate_backward", dh=dh)
        ops.check_contiguous("swiglu_gate_backward", ab=ab)
        dab = ops.xp.empty(ab.shape, dtype=ab.dtype)
        ops.kernel("swiglu_bwd", ab.dtype)(grid_of(dh.size), (256,), (dh, ab, dab, *ops.dropout_args(m, ab.dtype),
                                                                     B.host.int64(dh.size), B.host.int32(dh.shape[1])))
        return dab

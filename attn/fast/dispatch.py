"""Which memory-bound operations a namespace gets: :func:`ops_for`.

The NumPy operations (:mod:`attn.fast.ops`) and the CuPy kernels (:mod:`attn.fast.kernels`,
which subclass them) are imported by this module alone, so neither imports the other's
chooser and the imports run one way: ``ops`` <- ``kernels`` <- ``dispatch``.
"""
from __future__ import annotations

from .. import backend as B
from .kernels import CupyOps
from .ops import _Ops


def ops_for(xp, precision: str = "fp32") -> _Ops:
    """The ``_Ops`` for an array namespace: fused CuPy kernels where they apply. One object
    per namespace, made on first use (the CuPy one compiles its module then), and one per
    other ``precision`` of its products (:meth:`_Ops.with_precision`: the same buffers)."""
    key = xp.__name__ if precision == "fp32" else (xp.__name__, precision)
    ops = _OPS.get(key)
    if ops is None:
        if precision != "fp32":
            ops = _OPS[key] = ops_for(xp).with_precision(precision)
        else:
            ops = _OPS[key] = _Ops(xp) if xp is B.host else CupyOps(xp)   # CuPy, or the tests' stand-in
    return ops


_OPS: dict = {}

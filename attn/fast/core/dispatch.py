"""Which memory-bound operations a namespace gets: :func:`ops_for`.

The NumPy operations (:mod:`attn.fast.core.ops`) and the CuPy kernels (:mod:`attn.fast.gpu.kernels`,
which subclass them) are imported by this module alone, so neither imports the other's
chooser and the imports run one way: ``ops`` <- ``kernels`` <- ``dispatch``.
"""
from __future__ import annotations

from ... import backend as B
from ...precision import check as check_precision
from ..gpu.kernels import CupyOps
from .ops import Ops


def ops_for(xp, precision="fp32") -> Ops:
    """The ``Ops`` for an array namespace (on CuPy, or the tests' stand-in, a :class:`CupyOps`),
    made on first use: one per namespace, and one per other ``precision`` of its products (``fp32``,
    ``tf32``, ``bf16``, or an object whose ``name`` is one) sharing the fp32 object's buffers."""
    name = check_precision(getattr(precision, "name", precision))
    key = xp.__name__ if name == "fp32" else (xp.__name__, name)
    ops = _OPS.get(key)
    if ops is None:
        fp32 = None if name == "fp32" else ops_for(xp)
        ops = _OPS[key] = (Ops if xp is B.host else CupyOps)(xp, name, sharing=fp32)
    return ops


_OPS: dict = {}

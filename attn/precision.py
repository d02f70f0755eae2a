"""The precision of a training step's matrix products: ``fp32``, ``tf32`` or ``bf16``.

The parameters stay float32 in every mode (the arena holds the *master weights*, which Adam
updates in float32); what changes is what the products read. A GPU's tensor cores multiply
narrower numbers and add them up in float32:

=========  ============================  ============================================
mode       a product's inputs             on the GPU today (cuBLAS)
=========  ============================  ============================================
``fp32``   float32 (24-bit significand)   ``sgemm`` family, full float32: the reference
``tf32``   TF32: 8-bit exponent, 11-bit   the handle's ``CUBLAS_TF32_TENSOR_OP_MATH``:
           significand (10 stored bits)   float32 operands rounded in the tensor cores
``bf16``   bfloat16: 8-bit exponent,      ``gemmEx`` family on ``CUDA_R_16BF`` operands
           8-bit significand (7 stored)   (the weights' bf16 copy made once a forward,
                                          activations copied to bf16 per product),
                                          float32 sums and results
=========  ============================  ============================================

On the CPU the products run in float32 on rounded inputs: :func:`round_to` rounds a float32
array's significand to the mode's width, so a CPU run shows the numbers a GPU run would (up to
the order of the float32 sums). The rounding is round-to-nearest, ties to even, by integer
arithmetic on the float32 bits (what ``ml_dtypes.bfloat16`` and CUDA's ``__float2bfloat16_rn``
do): add ``0x7FFF`` plus the lowest kept bit, then clear the dropped bits. A carry out of the
significand goes into the exponent, which is the correct rounding (and overflows to infinity
past the narrow type's largest finite value); subnormals round the same way; infinities stay;
NaNs stay NaN (the quiet bit is set first, so that clearing the dropped bits cannot turn a NaN
into an infinity).

This module uses only the array namespace of its inputs (:func:`attn.backend.get_array_module`).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import backend as B

#: The modes, fp32 first: the default and the reference.
PRECISIONS = ("fp32", "tf32", "bf16")

#: Stored significand bits of each mode's product inputs (float32 has 23).
MANTISSA_BITS = {"fp32": 23, "tf32": 10, "bf16": 7}


class PrecisionError(ValueError):
    """A precision that is not one of :data:`PRECISIONS`, or one that cannot apply where asked."""


@dataclass(frozen=True)
class Precision:
    """What a step's matrix products read: one of :data:`PRECISIONS`, checked once, here.

    An engine is given one when it is made (``Precision("bf16")``, or :meth:`of` a flag's
    string) and keeps it: a model's precision is part of what it is, not a switch."""
    name: str = "fp32"

    def __post_init__(self):
        if self.name not in PRECISIONS:
            raise PrecisionError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.name!r}")

    @classmethod
    def of(cls, value) -> "Precision":
        """``value`` itself if it is a :class:`Precision`, else ``Precision(value)``."""
        return value if isinstance(value, cls) else cls(value)

    @property
    def exact(self) -> bool:
        """True for fp32: the products read their float32 operands as they are."""
        return self.name == "fp32"

    @property
    def mantissa_bits(self) -> int:
        return MANTISSA_BITS[self.name]

    def round(self, x, out=None):
        """``x`` as a product at this precision reads it (:func:`round_to`)."""
        return round_to(x, self.name, out)

    def __str__(self) -> str:
        return self.name


#: The default: full float32 products.
FP32 = Precision("fp32")


def check(precision) -> str:
    """The name of ``precision`` (a :class:`Precision` or its name), else :class:`PrecisionError`."""
    return Precision.of(precision).name


def _round_bits(x, drop: int, out=None):
    """``x`` (float32) with its significand rounded to ``23 - drop`` bits, to nearest, ties to
    even; into ``out`` (float32, x's shape; may be x) when given, else a new array."""
    xp = B.get_array_module(x)
    if x.dtype != xp.float32:
        raise TypeError(f"precision rounding needs float32 arrays, got {x.dtype}")
    u = x.view(xp.uint32)
    lsb = (u >> xp.uint32(drop)) & xp.uint32(1)                  # the lowest kept bit: ties go to even
    r = u + (lsb + xp.uint32((1 << (drop - 1)) - 1))
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    if B.is_device_array(x) or nan.any():                         # (no host sync on a device)
        r = xp.where(nan, u | xp.uint32(0x00400000), r)           # quiet NaN: its top significand bit
    r &= xp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    if out is None:
        return r.view(xp.float32)
    out.view(xp.uint32)[...] = r
    return out


def round_bf16(x, out=None):
    """float32 ``x`` rounded to bfloat16's 7 stored significand bits (still float32)."""
    return _round_bits(x, 16, out)


def round_tf32(x, out=None):
    """float32 ``x`` rounded to TF32's 10 stored significand bits (still float32)."""
    return _round_bits(x, 13, out)


def bf16_bits(x):
    """The bfloat16 numbers nearest to float32 ``x`` as their 16-bit patterns (uint16): the
    top half of :func:`round_bf16`'s words, what a bf16 buffer on the GPU holds."""
    xp = B.get_array_module(x)
    return (round_bf16(x).view(xp.uint32) >> xp.uint32(16)).astype(xp.uint16)


def from_bf16_bits(h):
    """uint16 bfloat16 patterns -> float32 (exact: bf16 is the top half of a float32)."""
    xp = B.get_array_module(h)
    return (h.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


def round_to(x, precision, out=None):
    """``x`` as a product of ``precision`` (a :class:`Precision` or its name) reads it: rounded to
    bf16 or tf32, or ``x`` itself (no copy) for fp32 and for anything not float32 (float64
    gradient checks stay exact)."""
    precision = getattr(precision, "name", precision)
    if precision == "fp32" or x.dtype.itemsize != 4 or x.dtype.kind != "f":
        return x if out is None or out is x else _copy(x, out)
    return _round_bits(x, 16 if precision == "bf16" else 13, out)


def _copy(x, out):
    out[...] = x
    return out

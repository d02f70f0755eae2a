"""The bfloat16 copies a bf16 product reads (``--precision bf16``): of the weights, in one launch,
and of any other operand, gathered from its strided view: CUDA source and NumPy twins."""
from __future__ import annotations

from .... import backend as B
from ....precision import bf16_bits
from .common import strided_view

ROUND_BF16 = r"""
// --precision bf16: dst[i] = the bfloat16 nearest to src[i], as its 16-bit pattern (the top half of a
// float32). Round to nearest, ties to even, on the bits (attn.precision, CUDA's __float2bfloat16_rn):
// add 0x7FFF plus the lowest kept bit and keep the top half; a carry goes into the exponent, which
// rounds past bf16's largest finite value to infinity. A NaN keeps its sign and gets the quiet bit,
// so that dropping the low half cannot make it an infinity. A double is first made a float.
template <typename T>
__global__ void round_bf16(const T* src, unsigned short* dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned int u = __float_as_uint((float)src[i]);
        if ((u & 0x7FFFFFFFu) > 0x7F800000u) dst[i] = (unsigned short)((u | 0x00400000u) >> 16);
        else dst[i] = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}
"""


def round_bf16_np(launch, src, dst, n):
    """NumPy twin of ``round_bf16``."""
    np = B.host
    n = int(n)
    strided_view(dst, (n,), (1,))[...] = bf16_bits(strided_view(src, (n,), (1,)).astype(np.float32))


ROUND_BF16_GATHER = r"""
// --precision bf16, a product's operand that is not a parameter: the bfloat16 copy of a strided
// view of up to four axes (n0, n1, n2, n3) with element strides (s0, s1, s2, s3), written as
// n0 * n1 matrices (n2, n3) of contiguous rows, each starting `per` elements after the one
// before (per >= n2 * n3; what lies between is not written): what cuBLAS's bf16 GEMMs read.
// The rounding is round_bf16's.
template <typename T>
__global__ void round_bf16_gather(const T* src, unsigned short* dst, long long n, long long n1, long long n2,
                                  long long n3, long long s0, long long s1, long long s2, long long s3,
                                  long long per) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long i3 = i % n3, t = i / n3;
        long long i2 = t % n2;
        t /= n2;
        long long i1 = t % n1, i0 = t / n1;
        unsigned int u = __float_as_uint((float)src[i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3]);
        unsigned short r;
        if ((u & 0x7FFFFFFFu) > 0x7F800000u) r = (unsigned short)((u | 0x00400000u) >> 16);
        else r = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        dst[(i0 * n1 + i1) * per + i2 * n3 + i3] = r;
    }
}
"""


def round_bf16_gather_np(launch, src, dst, n, n1, n2, n3, s0, s1, s2, s3, per):
    """NumPy twin of ``round_bf16_gather``."""
    np = B.host
    n, n1, n2, n3, per = (int(v) for v in (n, n1, n2, n3, per))
    if n % (n1 * n2 * n3 or 1) or per < n2 * n3:
        raise ValueError(f"{launch.name}: {n} elements are not a whole number of ({n1}, {n2}, {n3}) blocks, or per "
                         f"{per} < {n2} x {n3}")
    if n:
        shape = (n // (n1 * n2 * n3), n1, n2, n3)
        x = strided_view(src, shape, (s0, s1, s2, s3)).astype(np.float32)
        strided_view(dst, shape, (n1 * per, per, n3, 1))[...] = bf16_bits(x)

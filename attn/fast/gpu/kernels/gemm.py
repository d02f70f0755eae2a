"""The pointer arrays of cuBLAS's batched products (``gemmBatched``) over a batch of two levels:
CUDA source and NumPy twin. The products themselves are :class:`.products.Products`'s."""
from __future__ import annotations

from .... import backend as B
from .common import check_threads, strided_view

GEMM_POINTERS = r"""
// The three pointer arrays of a batched GEMM (cublas<t>gemmBatched) over a batch of two levels,
// outer x inner (an attention's batch x heads): for each operand j (0, 1, 2: cuBLAS's A, B, C) and
// batch entry i = o * inner + n, ptrs[j * count + i] = base_j + (o * outer_j + n * inner_j) elements of T
// (the strides may be negative). One thread per batch entry.
template <typename T>
__global__ void gemm_pointers(unsigned long long* ptrs, unsigned long long a, long long a_outer, long long a_inner,
                              unsigned long long b, long long b_outer, long long b_inner, unsigned long long c,
                              long long c_outer, long long c_inner, int count, int inner) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    long long o = i / inner, n = i % inner;
    const unsigned long long size = sizeof(T);
    ptrs[i] = a + size * (unsigned long long)(o * a_outer + n * a_inner);
    ptrs[count + i] = b + size * (unsigned long long)(o * b_outer + n * b_inner);
    ptrs[2 * (long long)count + i] = c + size * (unsigned long long)(o * c_outer + n * c_inner);
}
"""


def gemm_pointers_np(launch, ptrs, a, a_outer, a_inner, b, b_outer, b_inner, c, c_outer, c_inner, count, inner):
    """NumPy twin of ``gemm_pointers`` (``launch.name`` says T: float or double); the addresses
    are computed modulo 2**64, as the kernel's unsigned arithmetic does."""
    np = B.host
    count, inner = int(count), int(inner)
    check_threads(launch, count, "batch entries")
    if inner < 1 or count % inner:
        raise ValueError(f"{launch.name}: {count} batch entries are not a whole number of {inner} inner entries")
    size = 8 if "double" in launch.name else 4
    i = np.arange(count, dtype=np.int64)
    o, n = i // inner, i % inner
    out = strided_view(ptrs, (3, count), (count, 1))
    for j, (base, so, si) in enumerate(((a, a_outer, a_inner), (b, b_outer, b_inner), (c, c_outer, c_inner))):
        offs = (o * int(so) + n * int(si)) * size                        # bytes, int64 (|offsets| < 2**63)
        out[j] = (offs.astype(np.uint64) + np.uint64(int(base)))         # modulo 2**64, as the kernel

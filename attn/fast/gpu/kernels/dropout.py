"""Dropout: with a mask in memory, and counter-based (``dropout_hash``: the mask regenerated from a
key and the element's index, nothing stored): CUDA source, NumPy twins, and the host side of the
counter-based generator (:class:`HashedKeep`)."""
from __future__ import annotations

import math
from typing import NamedTuple

from .... import backend as B
from .common import strided_view

DROPOUT_FWD = r"""
// x <- keep ? x * scale : 0, in place (x and keep contiguous, n elements).
template <typename T>
__global__ void dropout_fwd(T* x, const bool* keep, T scale, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = keep[i] ? x[i] * scale : T(0);
}
"""


DROPOUT_BWD = r"""
// out <- keep ? d * scale : 0.
template <typename T>
__global__ void dropout_bwd(const T* d, const bool* keep, T scale, T* out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = keep[i] ? d[i] * scale : T(0);
}
"""


def dropout_fwd_np(launch, x, keep, scale, n):
    """NumPy twin of ``dropout_fwd``."""
    dropout_bwd_np(launch, x, keep, scale, x, n)


def dropout_bwd_np(launch, d, keep, scale, out, n):
    """NumPy twin of ``dropout_bwd``."""
    np = B.host
    strided_view(out, (n,), (1,))[...] = np.where(strided_view(keep, (n,), (1,)), strided_view(d, (n,), (1,)) * scale,
                                           d.dtype.type(0))


DROPOUT_HASH = r"""
// Dropout whose random numbers come from a counter-based generator, not from memory: element i
// of a site is kept when the top 16 bits of splitmix64(key + (i + 1) * golden) are >= thr, so the
// backward regenerates the forward's mask from (key, i) and no mask is stored or drawn.
// out <- keep ? x * scale : 0 (out may be x).
__device__ __forceinline__ unsigned int dropout_bits(unsigned long long key, long long i) {
    unsigned long long z = key + (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (unsigned int)(z >> 48);
}

// One step of splitmix64.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// The key of a dropout site: the step's seed, read from device memory (so that a step captured
// as a CUDA graph draws new masks at every replay: a seed passed by value would be replayed as
// it was captured), mixed with the site's number in the step, plus where the rank's first
// element sits in the global batch (offset = base * golden).
__device__ __forceinline__ unsigned long long dropout_key(const unsigned long long* seed, unsigned long long site,
                                                          unsigned long long offset) {
    return splitmix64(splitmix64(seed[0]) ^ site) + offset;
}

//
// The counter is the element's index in the GLOBAL batch, so that the ranks of a data-parallel
// run, each holding some of the batch's sentences, draw what one process draws for them: a
// rank's elements come in runs of `run` contiguous ones, each run `skip` elements before the
// next in the whole batch's array (the other ranks' sentences: keys-first attention weights
// (Tk, B, H, Tq) hold one run per key), so element i is the whole batch's i + (i / run) * skip;
// where the rank's first element sits is folded into `key` (key + base * golden). One process:
// skip 0.
template <typename T>
__global__ void dropout_hash(T* out, const T* x, const unsigned long long* seed, unsigned long long site,
                             unsigned long long offset, unsigned int thr, T scale, long long run, long long skip,
                             long long n) {
    const unsigned long long key = dropout_key(seed, site, offset);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = dropout_bits(key, i + (i / run) * skip) >= thr ? x[i] * scale : T(0);
}
"""

M64 = (1 << 64) - 1
#: splitmix64's increment (the golden ratio in 64 bits): counter i is mixed as key + (i + 1) * GOLDEN.
GOLDEN = 0x9E3779B97F4A7C15


def dropout_bits_np(key: int, n: int, run: int = 0, skip: int = 0):
    """``dropout_bits`` of ``dropout_hash`` for its elements i = 0 .. n-1 (counters
    ``i + (i // run) * skip``; ``skip`` 0: i): uint32 in [0, 65536), bit for bit."""
    np = B.host
    i = np.arange(n, dtype=np.uint64)
    if skip:
        i += (i // np.uint64(run)) * np.uint64(skip)
    with np.errstate(over="ignore"):
        z = (i + np.uint64(1)) * np.uint64(GOLDEN) + np.uint64(key & M64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(48)).astype(np.uint32)


def dropout_key_np(seed, site, offset) -> int:
    """``dropout_key``: the key of a site from the step's seed (a one-element uint64 array, as
    the kernels read it), the site's number and the rank's offset."""
    return (_splitmix64(_splitmix64(int(seed[0])) ^ int(site)) + int(offset)) & M64


def dropped_np(v, seed, site, offset, thr, scale, run: int = 0, skip: int = 0):
    """``v`` through ``dropout_hash``'s dropout (a fused kernel's, over the flat index): kept and scaled
    where ``dropout_bits`` of its counter reaches ``thr``, else 0."""
    keep = (dropout_bits_np(dropout_key_np(seed, site, offset), v.size, run, skip) >= thr).reshape(v.shape)
    return B.host.where(keep, v * scale, v.dtype.type(0))


def dropout_hash_np(launch, out, x, seed, site, offset, thr, scale, run, skip, n):
    """NumPy twin of ``dropout_hash``."""
    n = int(n)
    dropped = dropped_np(strided_view(x, (n,), (1,)), seed, site, offset, thr, scale, int(run), int(skip))
    strided_view(out, (n,), (1,))[...] = dropped


class HashedKeep(NamedTuple):
    """The ``keep`` of a CuPy dropout :class:`Mask`: no array, but what ``dropout_key`` makes the key of
    ``dropout_hash`` from (the step's ``seed``, a one-element uint64 device array; the ``site``; the
    rank's ``offset``), the threshold ``round(p * 65536)``, the shape drawn for, and the runs of ``run``
    elements ``skip`` apart it lies in (see ``dropout_hash``). :attr:`key` and :meth:`array` read the
    seed from the device: for tests and inspection."""
    seed: object
    site: int
    offset: int
    thr: int
    shape: tuple
    run: int = 0
    skip: int = 0

    @property
    def key(self) -> int:
        return dropout_key_np(B.to_host(self.seed), self.site, self.offset)

    def array(self, xp):
        n = math.prod(self.shape)
        return xp.asarray(dropout_bits_np(self.key, n, self.run, self.skip) >= self.thr).reshape(self.shape)


def _splitmix64(x: int) -> int:
    """One step of splitmix64 on a Python int (host-side key mixing)."""
    z = (x + GOLDEN) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)

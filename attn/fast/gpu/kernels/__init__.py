"""Fused CuPy kernels for the memory-bound parts of the fast training step and decoding, each
family in a module with its CUDA source and its NumPy twin: ``softmax``, ``layer_norm``, ``relu``,
``dropout``, ``loss``, ``column_sums``, ``adam``, ``bf16``, ``flash`` (the tiled attention),
``gemm`` (the batched products' pointer arrays), ``later`` (RMSNorm, rotary positions, SwiGLU) and
``decode`` (a cached decoding step); ``common`` holds what they share, ``registry`` compiles them
into one module, and the launch code is ``cupy_ops`` (:class:`CupyOps`), ``later_ops`` and
``precision_ops`` (the tf32 and bf16 products). ``flash_mma`` is the tiled attention on the tensor
cores (FlashAttention-2 in bf16 or fp16), a module of its own for compute capability 8.0 and up,
compiled but never run on a GPU.

:class:`CupyOps` is what :func:`attn.fast.ops_for` returns for CuPy arrays: the same methods as the
NumPy ``Ops`` (which they are tested against in ``tests/test_fast.py``), each one kernel launch (or
two) instead of a chain of elementwise operations, the matrix products by cuBLAS itself on the
operands as they lie (:meth:`CupyOps.mm`, :meth:`CupyOps.bmm`: never CuPy's ``matmul``, which copies
such views and which CuPy refuses while a stream captures). :class:`DecodeKernels` launches a
cached decoding step's; :mod:`attn.fast.core.flash` the tiled attention's. Each family's
module says what its kernels compute. Nothing here synchronises with the host; the
loss stays a 0-d device array.

Every kernel is listed once in :mod:`.registry`, which joins them (but ``flash_mma``) into one ``RawModule`` (so
that the whole of it can be compiled by NVRTC without a GPU: ``tests/test_kernels.py`` does, for
compute capabilities 7.0, 8.0 and 9.0). Beside each kernel is its **NumPy twin**: a function
taking what the kernel takes (the launch's grid, block and shared memory, then the arguments, the
arrays as the memory the kernel's pointers point at) and computing what the kernel computes,
written as whole-array NumPy. The twin is the kernel's specification; the test suite's CuPy
stand-in (``tests/fakecupy``) runs the twins in place of the CUDA, so the launch code runs in CI
exactly as on a GPU. The kernels are written to be obviously correct rather than fast (no
vectorised loads, no warp-level tricks, power-of-two blocks with a textbook tree reduction);
docs/GPU.md says what has run on a GPU and what a GPU owner runs. :mod:`attn.fast.core.flash_tc`
launches ``flash_mma``'s kernels where a run asks for the tiled attention at bf16
(:func:`attn.fast.core.flash_tc.cores_for`): they need compute capability 8.0 and have
**never run on a GPU**.
"""
from __future__ import annotations

from .common import block_size_for
from .column_sums import column_sums_np
from .cupy_ops import CupyOps
from .decode import DecodeKernels
from .dropout import GOLDEN, HashedKeep, dropout_bits_np, dropout_key_np
from .layer_norm import layer_norm_fwd_np
from .precision_ops import Bf16CupyOps, Tf32CupyOps
from .registry import KERNELS, NAME_EXPRESSIONS, NUMPY_TWINS, OPTIONS, SOURCE

__all__ = ["Bf16CupyOps", "CupyOps", "DecodeKernels", "GOLDEN", "HashedKeep", "KERNELS", "NAME_EXPRESSIONS",
           "NUMPY_TWINS", "OPTIONS", "SOURCE", "Tf32CupyOps", "block_size_for", "column_sums_np", "dropout_bits_np",
           "dropout_key_np", "layer_norm_fwd_np"]

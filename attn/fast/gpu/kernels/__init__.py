"""Fused CuPy kernels for the memory-bound parts of the fast training step and decoding, each
family in a module with its CUDA source and its NumPy twin: ``softmax``, ``layer_norm``, ``relu``,
``dropout``, ``loss``, ``column_sums``, ``adam``, ``bf16``, ``flash`` (the tiled attention),
``gemm`` (the batched products' pointer arrays), ``later`` (RMSNorm, rotary positions, SwiGLU) and
``decode`` (a cached decoding step); ``common`` holds what they share, ``registry`` compiles them
into one module, and the launch code is ``cupy_ops`` (:class:`CupyOps`) with its component
``products`` (the products by cuBLAS, fp32, tf32 and bf16). ``flash_mma`` is the tiled attention
on the tensor cores (FlashAttention-2 in bf16 or fp16), a module of its own for compute
capability 8.0 and up, compiled but never run on a GPU.

:class:`CupyOps` is what :func:`attn.fast.ops_for` returns for CuPy arrays: the NumPy ``Ops``'s
methods (tested against them in ``tests/test_fast.py``), each one kernel launch (or two), the
products by cuBLAS on the operands as they lie. Nothing here synchronises with the host. Beside
each kernel is its **NumPy twin**, its specification: a function taking the launch (grid, block,
shared memory) and the kernel's arguments and computing what it computes; the CuPy stand-in
(``tests/fakecupy``) runs the twins, so the launch code runs in CI as on a GPU (docs/GPU.md, "What
CI proves without a GPU"). The kernels are written to be obviously correct rather than fast."""
from __future__ import annotations

from .common import block_size_for
from .column_sums import column_sums_np
from .cupy_ops import CupyOps
from .decode import DecodeKernels
from .dropout import GOLDEN, HashedKeep, dropout_bits_np, dropout_key_np
from .layer_norm import layer_norm_fwd_np
from .products import Bf16Products, Products, Tf32Products
from .registry import KERNELS, NAME_EXPRESSIONS, NUMPY_TWINS, OPTIONS, SOURCE

__all__ = ["Bf16Products", "CupyOps", "DecodeKernels", "GOLDEN", "HashedKeep", "KERNELS", "NAME_EXPRESSIONS",
           "NUMPY_TWINS", "OPTIONS", "Products", "SOURCE", "Tf32Products", "block_size_for", "column_sums_np",
           "dropout_bits_np", "dropout_key_np", "layer_norm_fwd_np"]

"""Fused CuPy kernels for the memory-bound parts of the fast training step and decoding, each
family in a module with its CUDA source and its NumPy twin: ``softmax``, ``layer_norm``, ``relu``,
``dropout``, ``loss``, ``column_sums``, ``adam``, ``bf16``, ``flash`` (the tiled attention),
``gemm`` (the batched products' pointer arrays), ``later`` (RMSNorm, rotary positions, SwiGLU) and
``decode`` (a cached decoding step); ``common`` holds what they share, ``registry`` compiles them
into one module, and the launch code is ``cupy_ops`` (:class:`CupyOps`), ``later_ops`` and
``precision_ops`` (the tf32 and bf16 products). ``flash_mma`` is the tiled attention on the tensor
cores (FlashAttention-2 in bf16 or fp16), a module of its own for compute capability 8.0 and up,
compiled but never run on a GPU.

:class:`CupyOps` is what :func:`attn.fast.ops_for` returns for CuPy arrays: the same
methods as the NumPy ``Ops`` (which they are tested against in ``tests/test_fast.py``),
each one kernel launch (or two) instead of a chain of elementwise operations:

=====================  =====================================================================
softmax0_              keys-first masked softmax: one thread per (batch, head, query) column,
                       three loops over the keys (max, exp and sum, scale); a query with no
                       key gets zeros
softmax0_backward_     one thread per column: ``dx = y * (dy - sum(dy * y))``
layer_norm_            one block per row: mean and variance by a shared-memory tree sum,
                       then ``xhat`` (in place) and ``gamma * xhat + beta``
layer_norm_backward_   dgamma and dbeta by one ``column_sums`` launch (into the arena's
                       (2, D) block), before ``dout`` is overwritten; then one block per
                       row for ``dx``
colsum, colsums        the bias gradients: ``column_sums``, one launch of two stages
                       (blocks of 32 columns x 64-row chunks write partial sums; the last
                       block of each column tile to finish adds them up), so the grid
                       grows with the rows as well as the columns; two matrices of the same
                       rows in one launch (a sub-layer's two bias gradients)
cross_entropy_         one block per row: max, sum of exp, then ``dlogits`` in place; the
                       per-row losses are summed on the device
dropout_mask / _       ``uniform >= p`` (exact p), ``x * keep * scale``; with
                       ``counter_dropout`` (the default), no mask in memory: ``dropout_hash``
                       keeps element i where the top 16 bits of splitmix64(key + (g+1) golden)
                       are >= round(p * 65536), g the element's index in the global batch, the
                       key made in the kernel from the step's seed (read from device memory, so a
                       captured step draws new masks every replay) and the site's number; the
                       backward regenerates the same bits (one launch each way, nothing drawn)
layer_norm_backward_   post-norm's backward: dgamma and dbeta (one ``column_sums``), then
  dropout_             dy and drop(dy) in one launch (the mask regenerated)
residual_layer_norm_   post-norm's epilogue in one launch: ``s + bias``, dropout (from its
                       counter), ``+ x``, then layer norm of the row (one block per row)
bias_relu_dropout_     the feed-forward's hidden epilogue, ``drop(max(a + b1, 0))``, one launch
relu_backward_         ``da * (a > 0)``
rms_norm_,             RMSNorm (lesson 26), one block per row (``rms_norm_fwd``): alone, or as
  residual_rms_norm_   post-norm's epilogue (``s + bias``, dropout from its counter, ``+ x``)
rms_norm_backward_     dgamma by one ``column_sums`` launch (and its row copied into the arena),
  (_dropout_)          then ``rms_norm_bwd``: dx, and drop(dx) where post-norm dropped
rope_                  rotary positions in place on the heads of a projection's output, as the
                       view lies (``rope_rotate``, one thread per pair; turned back for the backward)
swiglu_gate            SwiGLU's ``drop(silu(a) * b)`` from the ``[x W | x V]`` product
  (_backward)          (``swiglu_fwd``), and ``[da | db]`` (``swiglu_bwd``), one launch each
adam_                  the whole Adam update of one parameter in one kernel
adam_flat_             the whole arena's Adam update in one kernel, after one
                       ``sumsq_partial`` launch when clipping: the norm and the decision
                       to clip stay on the device
mm, bmm                the step's matrix products by cuBLAS itself (``cupy.cuda.cublas``, the
                       handle set to the current stream, alpha and beta host pointers), the
                       operands and ``out`` as they lie (transposed, column blocks, head
                       views: leading dimensions and transposes, column-major C^T = B^T A^T):
                       ``sgemm``/``dgemm``; a batch that is one stride, ``gemmStridedBatched``;
                       head views (offset ``b * T * n*D + h * Dh``: two strides), the three
                       pointer arrays by one ``gemm_pointers`` launch (inside a step memory,
                       once per product and kept: the addresses repeat), then ``gemmBatched``.
                       Never CuPy's ``matmul``, which copies such views and which CuPy
                       refuses while a stream captures
=====================  =====================================================================

and, launched by :class:`DecodeKernels` for a cached decoding step on CuPy
(:mod:`attn.fast.decoding.device`, one position for every row):

=====================  =====================================================================
decode_embed           ``table[ids] * sqrt(D) + pe``, and pre-norm's first layer norm
one_query_attention    one block per (row, head): the new key and value written into the
                       cache (self-attention), the scores, the masked softmax and the
                       weighted sum of the values for the row's one query
add_norm               a sub-layer's epilogue: ``x <- (s + bias) + x`` and the next layer
                       norm of it (pre-norm: into the next sub-layer's input; post-norm:
                       into x). ``residual_ln_fwd`` writes xhat over its input and keeps
                       no residual stream, which pre-norm needs
log_softmax_rows       one block per row
greedy_pick            greedy decoding's choice (PAD and BOS banned) and its log-probability
beam_candidates        one block per sentence: each beam's best tokens, then the sentence's
                       best 2K candidates, in the order (score, then lower id)
gather_prefix          beam search's reorder of the key/value cache: the positions written
                       so far of the rows picked, one block per (row, layer, keys or values,
                       head)
=====================  =====================================================================

and, launched by :mod:`attn.fast.core.flash` for the tiled attention (FlashAttention; the fast
engine's choice by :func:`attn.fast.core.flash.use_flash`), one thread per row of a tile, the tiles of
the other operand read once per tile into shared memory (:mod:`.flash`):

=====================  =====================================================================
flash_fwd              one block per (sentence and head, query tile): the online softmax over
                       the key tiles (causal tiles past the queries skipped), the output and
                       one log-sum-exp per query written
flash_bwd_prep         ``D = rowsum(dO * O)``, one thread per query
flash_bwd_kv           one block per (sentence and key head, key tile): P recomputed from the
                       log-sum-exp, dK and dV summed over every query of the group's heads
flash_bwd_q            one block per (sentence and head, query tile): dQ
=====================  =====================================================================

and, launched by :mod:`attn.fast.core.flash_tc` where a run asks for the tiled attention at bf16
(:func:`attn.fast.core.flash_tc.cores_for`), FlashAttention-2 on the tensor cores (:mod:`.flash_mma`,
a module of its own: it needs compute capability 8.0), **compiled but never run on a GPU**:

=====================  =====================================================================
flash_mma_pack         a float32 (B, H, T, Dh) view as contiguous bf16 or fp16
flash_mma_fwd          one block per (sentence and head, 64 queries), a warp per 16 queries:
                       S = Q K^T by ``mma.sync`` m16n8k16 from ``ldmatrix``, the online
                       softmax in registers, O += P V; K and V double-buffered by ``cp.async``
flash_mma_bwd_kv       one block per (sentence and key head, 64 keys): dK and dV in registers
flash_mma_bwd_q        one block per (sentence and head, 64 queries): dQ, a pass of its own
=====================  =====================================================================

Nothing here synchronises with the host; the loss stays a 0-d device array.

Every kernel is CUDA source in this package, one module per family (:mod:`.softmax`,
:mod:`.layer_norm`, :mod:`.column_sums`, :mod:`.loss`, :mod:`.dropout`, :mod:`.relu`,
:mod:`.later` (RMSNorm, RoPE, SwiGLU), :mod:`.adam`, :mod:`.decode`, :mod:`.gemm`, :mod:`.bf16`, :mod:`.flash`,
:mod:`.flash_mma`; the device functions they share
and the launch sizes in :mod:`.common`), listed once in :mod:`.registry`, which joins them
into one ``RawModule`` (so that the whole of it can be compiled by NVRTC without a GPU:
``tests/test_kernels.py`` does, for compute capabilities 7.0, 8.0 and 9.0). Beside each
kernel is its **NumPy twin**: a function taking what the kernel takes (the launch's grid,
block and shared memory, then the arguments, the arrays as the memory the kernel's pointers
point at) and computing what the kernel computes, written as whole-array NumPy. The twin is
the kernel's specification; the test suite's CuPy stand-in (``tests/fakecupy``) runs the
twins in place of the CUDA, so the launch code (:mod:`.cupy_ops`, :mod:`.precision_ops`,
:class:`DecodeKernels`) runs in CI exactly as on a GPU.

These kernels are written to be obviously correct rather than fast (no vectorised loads,
no warp-level tricks, power-of-two blocks with a textbook tree reduction). They have
**not been run on GPU hardware** in this repository's CI: the machine it was written on
has no GPU (docs/GPU.md lists what a GPU owner should run).
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

"""The fast engine: the readable model's parameters, logits and gradients with fewer passes over
memory, on NumPy and on GPUs through CuPy. Its rooms, by what they serve: ``model`` holds
:class:`FastTransformer` (weights, forward, the decoding entry points), which holds its pieces;
``engine`` is :class:`~attn.fast.engine.FastEngine`, what ``attn-train`` trains with; ``core`` holds
the pieces training and decoding both run (the operations and their dispatch, the arena, the
embeddings, norms, feed-forward networks, attention and the one decoder layer); ``training`` the
backward, the fused loss, :class:`FastAdam` and the loop's step; ``decoding`` the incremental
step on NumPy and on CuPy; ``gpu`` the GPU's kernels, cuBLAS, step memory, captured steps and
the probes and fallback that keep a GPU run training. Each sub-package opens with its own map.

:class:`attn.model.Transformer` is the readable version: one forward/backward pair
per layer, new arrays everywhere. This package computes the same numbers with fewer
passes over memory, for the benchmark and the trainer to use when asked:

    model = FastTransformer(config)                 # or FastTransformer.from_model(model)
    logits, cache = model.forward(src, tgt_in, rng)
    loss, dlogits = cross_entropy(logits, tgt_out, smoothing, inplace=True)
    grads = model.backward(dlogits, cache)          # the same dict the reference returns
    FastAdam(model.params, d_model).step(grads, clip=0.0)   # one update over model.arena

What it does differently, and why (every item is checked against the reference in
``tests/test_fast.py``: outputs and gradients agree to float32 rounding):

* One arena (:mod:`attn.fast.core.arena`). Parameters, gradients and Adam's moments are
  four flat buffers of one layout; ``params`` holds views of the first under the
  reference's names, ``backward`` writes every gradient into the second (``out=``)
  and returns its views, and :class:`FastAdam` is one update of all four.
* Fused projections, laid out side by side in the arena. Self-attention's Q, K and V
  are one ``(D, 3D)`` matmul; the keys and values of every decoder layer's
  cross-attention are one ``(D, 2D*L)`` matmul of the encoder output, and their
  gradient one matmul back. Nothing is concatenated or sliced per step; the
  ``1/sqrt(d_k)`` scale is applied by the softmax (for free in the CuPy kernel).
* Heads without copies. Q, K, V are strided views of the fused projection; the
  attention's output and the gradients of Q, K, V are written by ``matmul(out=)``
  straight into the ``(B, T, H, Dh)`` layout the next matmul reads.
* In place. Softmax, layer norm, ReLU, dropout, residual sums and the loss work in
  the arrays the step owns (``x += ...``, ``out=``), not in fresh temporaries.
  Masks become an additive bias of 0 / most-negative-finite once per step.
* Reductions on BLAS. Row and column sums (layer norm, bias gradients, softmax
  denominators) are matrix-vector products with a vector of ones.
* Dropout masks from 16-bit random integers (:meth:`DeviceRNG.random_uint16`): the
  drop probability is ``round(p * 65536) / 65536`` (0.1 -> 0.100006) and kept units
  are scaled by the exact inverse of the keep probability, so the expectation is
  unchanged. The random stream differs from the reference's (so do the masks).
* Embedding gradient by a one-dimensional ``add.at`` on flat indices (the two-
  dimensional form loops over rows and is ten times slower), one call for the
  source and target lookups together.
* :class:`FastAdam`: over the arena, one update of the flat buffers (one kernel launch
  on CuPy, clipping decided on the device; slices over the helper threads on NumPy).

Memory-bound pieces (softmax, layer norm, dropout, the loss) are methods of the ops object that
:func:`ops_for` picks by array namespace (on CuPy, the fused kernels). Decoding is the engine's
own: it inherits nothing from the readable model, which it holds over the same parameters.
"""
from __future__ import annotations

from .training.loss import cross_entropy
from .decoding.device import DeviceDecodeState
from .decoding.host import FastDecodeState
from .core.caches import FastCache, SplitCache
from .model import FastTransformer
from .core.dispatch import ops_for
from .core.ops import Mask
from .training.optim import FastAdam
from .core.threads import MAX_AUTO_WORKERS, default_workers, keep_freed_memory, single_threaded_blas

__all__ = ["FastTransformer", "FastAdam", "cross_entropy", "keep_freed_memory", "default_workers",
           "single_threaded_blas", "ops_for", "Mask", "FastCache", "FastDecodeState", "DeviceDecodeState", "SplitCache",
           "MAX_AUTO_WORKERS"]

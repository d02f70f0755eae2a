"""The fast engine: the readable model's parameters, logits and gradients with fewer passes over
memory, on NumPy and on GPUs through CuPy. Its rooms, by what they serve: ``model`` holds
:class:`FastTransformer` (weights, forward, the decoding entry points), which holds its pieces;
``engine`` is :class:`~attn.fast.engine.FastEngine`, what ``attn-train`` trains with; ``core`` holds
the pieces training and decoding both run (the operations and their dispatch, the arena, the
embeddings, norms, feed-forward networks, attention and the one decoder layer); ``training`` the
backward, the fused loss, :class:`FastAdam` and the loop's step; ``decoding`` the incremental
step on NumPy and on CuPy; ``gpu`` the GPU's kernels, cuBLAS, step memory, captured steps and
the probes and fallback that keep a GPU run training. Each sub-package opens with its own map.

The readable model (:class:`attn.model.Transformer`) computes the same numbers with a new array
everywhere; docs/ARCHITECTURE.md ("The fast engine") says what this one does differently and why:

    model = FastTransformer(config)                 # or FastTransformer.from_model(model)
    logits, cache = model.forward(src, tgt_in, rng)
    loss, dlogits = cross_entropy(logits, tgt_out, smoothing, inplace=True)
    grads = model.backward(dlogits, cache)          # the same dict the reference returns
    FastAdam(model.params, d_model).step(grads, clip=0.0)   # one update over model.arena
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

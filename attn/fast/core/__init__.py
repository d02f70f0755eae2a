"""The fast model's pieces, which training and decoding both run: ``ops`` holds the memory-bound
operations written with in-place ufuncs (:class:`~attn.fast.core.ops.Ops`, NumPy and CuPy alike),
``dispatch`` picks them or the GPU's fused kernels for an array namespace (:func:`ops_for`),
``threads`` runs a split batch on long-lived helper threads with single-threaded BLAS, ``arena``
lays the parameters, gradients and Adam's moments out in four flat buffers (``int8``, an int8 model's:
the same blocks in int8 with a float32 scale a channel, each dequantised when read), ``caches`` names what
a forward keeps for its backward, ``pieces`` holds the embeddings, the norms in their residuals and
the feed-forward networks, ``attention`` the heads and the self- and cross-attention sub-layers,
``flash`` the tiled attention and the rule that chooses it, ``flash_tc`` the same on the tensor cores
(FlashAttention-2 in bf16, compiled but never run on a GPU, taken only when asked), and ``layer`` the one decoder layer
(and its backward) that training and both decoding steps run; ``lm`` a decoder-only language model's
forward (no source), on the same layer. Each piece is an object the model
holds (composition: no base classes), forward beside backward; the GPU's kernels and memory they
call are :mod:`attn.fast.gpu`'s."""

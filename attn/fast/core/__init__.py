"""The fast model's pieces, which training and decoding both run: ``ops``, the memory-bound
operations in in-place ufuncs (:class:`~attn.fast.core.ops.Ops`, NumPy and CuPy alike), and
``dispatch``, which picks them or the GPU's fused kernels for a namespace (:func:`ops_for`);
``threads``, a split batch on long-lived helper threads; ``arena``, the parameters, gradients and
Adam's moments in four flat buffers (``int8``: an int8 model's, each block dequantised when read);
``caches``, what a forward keeps for its backward; ``pieces``, the embeddings, the norms in their
residuals and the feed-forward networks; ``attention``, the heads and the attention sub-layers;
``flash``, the tiled attention and the rule that chooses it, ``flash_tc`` the same on the tensor
cores (FlashAttention-2 in bf16, never yet run on a GPU, taken only when asked); ``layer``, the one
decoder layer training and both decoding steps run; ``lm``, a language model's forward (no source).
Each piece is an object the model holds, forward beside backward; the GPU's kernels and memory
they call are :mod:`attn.fast.gpu`'s."""

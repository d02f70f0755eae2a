"""What a fast training step adds to the model's pieces: ``backward`` turns the forward's caches
into the gradients in the order the arena lies (:class:`~attn.fast.training.backward.Backward`,
which the model holds), ``loss`` is the fused label-smoothed cross-entropy (in place, split over
threads on NumPy), ``optim`` is :class:`FastAdam`, one update over the arena's flat buffers, and
``loop`` wraps the readable step and loop (:mod:`attn.train`) so that a step on a GPU checks its
ids on the host, runs in the step memory and logs its losses without waiting for the device. The
model itself is :mod:`attn.fast.model`; a captured step (CUDA graphs) is :mod:`attn.fast.gpu.graph`."""

"""What a fast training step adds to the model's pieces: ``backward`` turns the forward's caches
into the gradients in the order the arena lies (:class:`~attn.fast.training.backward.Backward`),
``loss`` is the fused label-smoothed cross-entropy (in place, split over threads on NumPy),
``optim`` is :class:`FastAdam`, one update over the arena's flat buffers, and ``loop`` runs the
readable step and loop (:mod:`attn.train`) so that a step on a GPU never waits for the device."""

"""The fast engine's incremental decoding, one decoder position for every row (the readable
:meth:`attn.model.Transformer.decode_step` with fewer passes over memory): ``host`` holds the NumPy
step (:class:`FastDecodeState`: key/value buffers that grow, rows split over the helper threads,
the later block's heads) and what both steps share (the length check, the rows' transfer to the
device); ``device`` holds the CuPy step (:class:`DeviceDecodeState`: buffers preallocated, one
kernel per sub-layer, nothing allocated by a steady-state step) and the kernels' greedy pick and
beam candidates. Both run :func:`attn.fast.core.layer.decoder_layer`; the model's entry points
(``start_decoding``, ``decode_step``, ``decode_positions``, ``search``) are :mod:`attn.fast.model`'s.
For speculative decoding, ``host`` also reads a chunk of positions in one pass, and each state's
``truncate`` rolls positions back (:class:`attn.engine.DecodingState`)."""

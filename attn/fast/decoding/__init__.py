"""The fast engine's decoding, one decoder position for every row (the readable
:meth:`attn.model.Transformer.decode_step` with fewer passes over memory): ``search`` holds
:class:`FastSearch`, which holds the model and decodes with it (the model's ``search()``, and its
``start_decoding``, ``decode_step``, ``decode_positions`` and inference ``decode``, one line each,
hand over to it): the states, the decoder over a prefix, the token picks; ``host`` holds the NumPy
step (:class:`FastDecodeState`: key/value buffers that grow, rows split over the helper threads,
the later block's heads, a chunk of positions in one pass) and what both steps share; ``device``
holds the CuPy step (:class:`DeviceDecodeState`: buffers preallocated, one kernel per sub-layer,
nothing allocated by a steady-state step). Both run :func:`attn.fast.core.layer.decoder_layer`,
and each state's ``truncate`` rolls positions back (:class:`attn.engine.DecodingState`)."""

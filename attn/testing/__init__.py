"""Testing tools for attn's layers, public as ``numpy.testing`` is: the hypothesis
strategies, the float64 gradient check, and each layer's invariants.

The test suite (``tests/``) and the learner's grader (``attn-check``, :mod:`attn.grader`)
both use this module, so a learner's layer is graded by exactly what proves the
library's.

Everything here draws **host** arrays; a test moves them to the backend under test
with ``attn.backend.to_device``. Sizes are tiny on purpose: a numerical gradient
costs two forward passes per input element.

Typical use, with ``st.data()`` so that later draws can depend on earlier ones::

    @given(data=st.data())
    def test_something(backend, data):
        d = data.draw(dims())                                  # B, T, S, D, H, F, V
        x = to_device(data.draw(floats((d.B, d.T, d.D))))
        mask = to_device(data.draw(masks((d.B, d.H, d.T, d.S))))

What is here
------------
shapes
    :func:`dims` (a consistent set of model dimensions, heads dividing d_model),
    :func:`leading_shapes` (1-3 batch axes), :func:`divisors`.
values (float64)
    :func:`floats` (hypothesis-chosen elements, edge values included: invariants,
    and gradient checks of piecewise-linear layers),
    :func:`normals` (seeded Gaussian arrays: weights, and inputs of gradient
    checks of smooth layers, see its docstring),
    :func:`away_from` (elements at least a margin away from a kink),
    :func:`logits` (floats times ``10**k``, k up to 4: the softmax stability check).
masks (bool, True = may attend)
    :func:`masks` (random, broadcastable, optionally with a fully masked row),
    :func:`padding_masks` (trailing padding, at least one real key per row),
    :func:`causal` (the look-ahead mask, a plain function).
token ids
    :func:`token_ids` (ids with at least one repeat), :func:`padded_ids`
    (real tokens then trailing ``PAD_ID``).
gradient checks
    :func:`check_gradients` wraps :func:`attn.gradcheck.check_layer` and records
    every relative error; :func:`gradient_summary` is the closing line the
    conftest prints ("max relative gradient error: X over N checks").
invariants
    ``assert_*`` functions that take a layer's functions (the library's, or a
    learner's) and host inputs, and raise :class:`InvariantError` (an
    AssertionError with a ``hint``) when a property a reader would state aloud
    fails: softmax rows sum to one over unmasked keys, masked weights are exactly
    zero, the future never changes the past, padding never changes real
    positions, layer norm's output has zero mean, repeated ids accumulate...
layers
    :data:`LAYERS` (:mod:`attn.testing.registry`): every layer of :mod:`attn.layers`,
    its helpers and the loss, and every exercise beyond them (Luong attention, the
    decoder's mask, an encoder layer, a decoder layer, the whole Transformer, the
    schedule, Adam, greedy and beam search, checkpoint averaging, BPE merges),
    registered once: the names of its functions and where the library's live, a
    strategy of examples (hard inputs included), which invariants apply, and hints at
    two levels (where to look, the formula); :data:`EXERCISES`, each exercise's
    manifest. The tests, :mod:`attn.grader` and the book's API page read them.
dropout
    :data:`DROPOUT_PROBES`: for each layer that takes dropout, inputs on which the
    output is the tensor dropout applies to, so that the mask can be read off it.
"""
from __future__ import annotations

from .strategies import (Dims, away_from, causal, dims, divisors, floats, leading_shapes, logits, magnitudes, masks,
                         normals, padded_ids, padding_masks, token_ids)
from .gradients import GRADIENT_CHECKS, GRADIENT_ERRORS, check_gradients, gradient_summary
from .invariants import (InvariantError, assert_attention_ignores_unseen_keys, assert_causal_mask_properties,
                         assert_cross_entropy_properties, assert_dropout_properties, assert_embedding_properties,
                         assert_heads_round_trip, assert_layer_norm_properties, assert_no_look_ahead,
                         assert_padding_ignored, assert_positional_properties, assert_rnn_skips_masked_steps,
                         assert_sinusoidal_table_properties, assert_softmax_properties)
from .layers import MHA_PARAMS, XP, Example, Factor, Fresh, Layer, Mistake, Namespace, Term, seeds, small_shapes
from .probes import DROPOUT_PROBES
from .exercises import BLOCK_EPS, WORDS, Built
from .registry import EXERCISES, LAYERS, Manifest

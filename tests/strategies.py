"""The shared hypothesis strategies and the gradient-check recorder live in
:mod:`attn.testing` (public, so that ``attn-check`` grades learners with them); this
module only re-exports them for the test modules that ``import strategies``."""
from attn.testing import *  # noqa: F401,F403
from attn.testing import (GRADIENT_CHECKS, GRADIENT_ERRORS, Dims, away_from, causal, check_gradients,  # noqa: F401
                          dims, divisors, floats, gradient_summary, leading_shapes, logits, magnitudes, masks,
                          normals, padded_ids, padding_masks, token_ids)

"""Exercise for lesson 4: masked softmax and scaled dot-product attention.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/04_attention.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

Every layer this file asks for is graded; one whose body still raises NotImplementedError
is "not implemented yet" (``--layer softmax`` grades one).
Each forward returns ``(out, cache)`` (the cache is yours); each backward returns the
gradients in the order the forward took its inputs. ``xp = B.get_array_module(x)``.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def softmax_forward(x, mask=None):
    """Softmax over the last axis: ``y_i = exp(x_i) / sum_j exp(x_j)``.

    Inputs: x (..., K) logits; mask None or a bool array broadcastable to x, True where a
    position may receive weight.
    Returns: y (..., K), cache. Rows sum to one over their unmasked positions; masked
    positions are exactly 0; a fully masked row is all zeros (not NaN, not uniform).
    Logits reach 1e4: subtract each row's maximum before exp. Fill masked logits with
    ``xp.finfo(x.dtype).min`` (not -inf) and zero masked outputs afterwards.
    """
    raise NotImplementedError


def softmax_backward(dy, cache):
    """The gradient of the softmax with respect to its logits: derive it (each output
    depends on every logit of its row), and apply it to dy without building a K x K matrix.
    Lesson 8, section 1 derives it (equation 8.2): do this after lesson 8, or derive it first.

    Inputs: dy (..., K). Returns: dx (..., K).
    """
    raise NotImplementedError


def attention_forward(q, k, v, mask=None):
    """``out = softmax(q @ k^T / sqrt(d_k), mask) @ v`` (equation 1).

    Inputs: q (..., Tq, Dk); k (..., Tk, Dk); v (..., Tk, Dv); mask None or bool broadcastable
    to (..., Tq, Tk), True where query i may attend to key j.
    Returns: out (..., Tq, Dv), cache.

    Dropout on the weights comes in lesson 12. After its exercise, add ``dropout=0.0,
    rng=None`` to this signature and drop the weights with inverted dropout (your
    ``dropout_forward`` of lesson 12): attn-check then grades the dropout too (until then it
    says "dropout not graded").
    """
    raise NotImplementedError


def attention_backward(dout, cache):
    """The gradients of the three steps of the forward, in reverse: the product with v, the
    softmax (your softmax_backward), the scaled scores. Derive each; lesson 8, section 3
    derives them (do this after lesson 8, or derive them first).

    Inputs: dout (..., Tq, Dv). Returns: dq, dk, dv (shapes of q, k, v).
    """
    raise NotImplementedError

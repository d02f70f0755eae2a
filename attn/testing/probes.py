"""Dropout probes: for each layer that takes dropout, inputs on which its output is the
tensor dropout applies to, so that the grader reads the mask off the output."""
from __future__ import annotations

from .. import backend as B

np = B.host

# ----------------------------------------------------------------------------- dropout probes
#
# For each layer that takes dropout: arguments on which the layer's output *is* the tensor
# dropout applies to (identity weights after it), every entry of it non-zero. With dropout
# each entry of the output is then 0 or its value without dropout times 1 / (1 - p), so the
# grader reads the mask off the output; the inputs before the dropout are random, so every
# gradient depends on the mask. ``probe(p, rng) -> (arguments, lines that describe them)``.


def _probe_dropout(p, rng):
    return [np.ones((64, 32)), p, rng], ["x = ones (64, 32)"]


def _probe_attention(p, rng):
    Bsz, T = 4, 16
    r = np.random.default_rng(7)
    q, k = r.standard_normal((Bsz, T, 2)), r.standard_normal((Bsz, T, 2))
    v = np.broadcast_to(np.eye(T), (Bsz, T, T)).copy()
    return [q, k, v, None, p, rng], [
        "q, k = standard normal (4, 16, 2), v = identity (4, 16, 16): the output is the attention weights"]


def _probe_feed_forward(p, rng):
    D = 32
    r = np.random.default_rng(7)
    x = r.standard_normal((4, 16, D))
    b1 = np.abs(r.standard_normal(D)) + 0.1
    return [x, np.zeros((D, D)), b1, np.eye(D), np.zeros(D), p, rng], [
        "x standard normal (4, 16, 32), w1 = 0, b1 > 0 (the hidden units), w2 = identity, b2 = 0: the output is "
        "the hidden units"]


def _probe_multi_head_attention(p, rng):
    Bsz, T = 4, 16
    r = np.random.default_rng(7)
    x_q = r.standard_normal((Bsz, T, T))
    x_kv = np.broadcast_to(np.eye(T), (Bsz, T, T)).copy()
    eye, zero = np.eye(T), np.zeros(T)
    w_q, b_q = r.standard_normal((T, T)) / 4, r.standard_normal(T) / 4
    w_k, b_k = r.standard_normal((T, T)) / 4, r.standard_normal(T) / 4
    return [x_q, x_kv, w_q, b_q, w_k, b_k, eye, zero, eye, zero, 1, None, p, rng], [
        "one head, x_q, w_q, b_q, w_k, b_k standard normal, x_kv = w_v = w_o = identity (16 x 16), b_v = b_o = 0: "
        "the output is the attention weights"]


DROPOUT_PROBES = {"dropout": _probe_dropout, "attention": _probe_attention,
                  "feed_forward": _probe_feed_forward, "multi_head_attention": _probe_multi_head_attention}

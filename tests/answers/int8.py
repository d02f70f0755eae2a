"""A learner's answer to lessons/exercises/int8.py, written from its docstring: attn-check
must pass it."""
from attn import backend as B


def int8_round_trip(w):
    xp = B.get_array_module(w)
    scale = xp.abs(w).max(axis=-1, keepdims=True) / w.dtype.type(127)
    q = xp.clip(xp.round(w / xp.where(scale > 0, scale, w.dtype.type(1))), -127, 127)
    return q * scale

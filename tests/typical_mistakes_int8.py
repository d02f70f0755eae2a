"""Typical mistakes in int8 quantisation (``int8_round_trip``), written as a learner would: read into
``typical_mistakes.MISTAKES["int8"]`` (see there for the form of each entry)."""
from __future__ import annotations

INT8 = '''
from attn import backend as B


def int8_round_trip(w):
    xp = B.get_array_module(w)
    scale = {scale} / {steps}
    return xp.clip(xp.{rnd}(w / xp.where(scale > 0, scale, 1.0)), -127, 127) * scale
'''
I8 = dict(scale="xp.abs(w).max(axis=-1, keepdims=True)", steps="127", rnd="round")
INT8_MISTAKES = [
    ("one scale a matrix", INT8.format(**dict(I8, scale="xp.abs(w).max()")), r"one scale for the whole", r"own scale"),
    ("one scale a column", INT8.format(**dict(I8, scale="xp.abs(w).max(axis=0, keepdims=True)")),
     r"one scale per column", r"max\(axis=-1"),
    ("truncated", INT8.format(**dict(I8, rnd="trunc")), r"truncated toward zero", r"round to the nearest"),
    ("128 steps", INT8.format(**dict(I8, steps="128")), r"max\|row\| / 128", r"127 steps each side"),
]

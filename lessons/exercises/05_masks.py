"""Exercise for lesson 5: the padding mask and the look-ahead (causal) mask.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/05_masks.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

A mask is a bool array that broadcasts against attention scores (B, H, Tq, Tk): True where
a query may attend to a key.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def padding_mask(ids, pad_id=0):
    """Keys that are real tokens: ``ids != pad_id``, shaped to broadcast over heads and queries.

    Inputs: ids (B, S) integer token ids. Returns: (B, 1, 1, S) bool.
    """
    raise NotImplementedError


def causal_mask(T, xp=None):
    """The look-ahead mask of section 3.2.3: query i may see keys 0..i (itself included),
    never a later one.

    Inputs: T the length; xp the array library to build it with (``B.xp()`` when None).
    Returns: (1, 1, T, T) bool, True on and below the diagonal.
    """
    raise NotImplementedError


def decoder_mask(tgt_ids, pad_id=0):
    """The decoder's self-attention mask: a query may attend to a key only if the key is not
    in its future *and* the key is a real token (not padding).

    Inputs: tgt_ids (B, T) integer ids. Returns: (B, 1, T, T) bool.
    """
    raise NotImplementedError

"""Padding and look-ahead masks.

A mask is a boolean array that broadcasts against attention scores of shape
``(B, H, Tq, Tk)``: ``True`` where a query may attend to a key, ``False`` where
it may not. :func:`attn.layers.softmax.softmax_forward` takes it as is.
"""
from __future__ import annotations

from . import backend as B

#: Id of the padding token in every vocabulary attn builds.
PAD_ID = 0


def padding_mask(ids, pad_id: int = PAD_ID):
    """Keys that are real tokens.

    Inputs: ids (B, S) integer token ids. Returns: (B, 1, 1, S) bool, True for non-pad.
    """
    return (ids != pad_id)[:, None, None, :]


def causal_mask(T: int, xp=None):
    """The look-ahead mask of section 3.2.3: position i sees positions 0..i.

    Returns: (1, 1, T, T) bool, lower triangle (diagonal included) True.
    """
    xp = xp or B.xp()
    return xp.tril(xp.ones((T, T), dtype=bool))[None, None]


def cached_causal_mask(T: int, past: int, xp=None):
    """The look-ahead mask of T new positions that follow ``past`` cached ones: new position i
    (the sequence's ``past + i``) sees keys 0..past+i. Decoding several positions in one pass
    (speculative decoding's check) needs it; one new position sees every key.

    Returns: (1, 1, T, past + T) bool."""
    xp = xp or B.xp()
    return xp.tril(xp.ones((T, past + T), dtype=bool), k=past)[None, None]


def decoder_mask(tgt_ids, pad_id: int = PAD_ID):
    """Look-ahead mask combined with the padding mask of the target keys.

    Inputs: tgt_ids (B, T). Returns: (B, 1, T, T) bool.
    """
    xp = B.get_array_module(tgt_ids)
    return causal_mask(tgt_ids.shape[1], xp) & padding_mask(tgt_ids, pad_id)

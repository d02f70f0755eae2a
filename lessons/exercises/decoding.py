"""Exercise for lesson 15: greedy decoding and beam search with a key/value cache, and
checkpoint averaging.

Write the bodies below (replace each ``raise NotImplementedError``), then grade them:

    attn-check lessons/exercises/decoding.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

attn-check runs your decoders on a fixed small model (an ``attn.model.Transformer`` with 6
ids: 0 PAD, 1 BOS, 2 EOS) and compares tokens and scores with ``attn.decode``. Use the
model's cached decoding:

    src_mask = M.padding_mask(src)                     # (B, 1, 1, S)
    memory, _ = model.encode(src, None, src_mask)      # (B, S, D)
    state = model.start_decoding(memory, src_mask)
    logp, state, _ = model.decode_step(tokens, state)  # tokens (B,) -> log-probabilities (B, V)
    state = state.select(rows)                         # keep (and reorder) rows of the cache
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401
from attn import masks as M  # noqa: F401

PAD, BOS, EOS = 0, 1, 2


def greedy_decode(model, src, max_len):
    """From BOS, take the most probable next token at every step (PAD and BOS are never
    generated) until EOS or ``max_len`` tokens (EOS counted). A sentence's score is the sum
    of the log-probabilities of its chosen tokens, EOS included.

    Inputs: model; src (B, S) ids padded with PAD; max_len an int.
    Returns: (tokens, scores): per sentence the generated ids without EOS (a list of lists
    of ints), and the scores (a list of floats).
    """
    raise NotImplementedError


def beam_search(model, src, beam_size, alpha, max_len):
    """Beam search with the length penalty of GNMT (section 6.1 of the paper: beam 4,
    alpha 0.6): keep the ``beam_size`` best unfinished hypotheses of each sentence by summed
    log-probability; a hypothesis that takes EOS is finished, with the score
    ``logP / ((5 + length) / 6) ** alpha`` (length counts EOS); PAD and BOS are never
    generated. A sentence's search ends when no live hypothesis can still beat its best
    finished one, or at ``max_len`` tokens (live hypotheses are then finished as they are).

    Returns: (tokens, scores): per sentence the best finished hypothesis (without EOS) and
    its length-penalised score.
    """
    raise NotImplementedError


def average_checkpoints(checkpoints):
    """The parameter-wise mean of several checkpoints (section 6.1 averages the last 5 or 20).

    Inputs: a list of dicts {name: array}, all with the same keys, shapes and dtype.
    Returns: a dict {name: mean}, of each parameter's shape and dtype (sum in float64).
    """
    raise NotImplementedError

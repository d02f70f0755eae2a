"""Exercise for lesson 13: learning byte-pair-encoding merges (Sennrich et al., 2016).

Write the body below (replace the ``raise NotImplementedError``), then grade it:

    attn-check lessons/exercises/bpe.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

attn-check compares your merges with ``attn.bpe.learn_merges`` on corpora hypothesis draws.
"""
from __future__ import annotations

from attn.bpe import merge_symbols, symbols_of  # noqa: F401  (the spelling of symbols, given)


def learn_merges(token_counts, num_merges):
    """Learn BPE merges from word counts.

    Every word starts as its characters, ``symbols_of(word)`` (``"low" -> ["l", "##o", "##w"]``:
    the symbols after the first carry the glue mark). Then, ``num_merges`` times at most:
    count every pair of adjacent symbols over all words, each occurrence weighted by its
    word's count; take the most frequent pair (ties: the alphabetically first pair, comparing
    ``(a, b)`` tuples); stop if it occurs fewer than twice; replace it in every word, left to
    right, by ``merge_symbols(a, b)``.

    Inputs: token_counts a dict {word: count}; num_merges an int >= 0.
    Returns: the merges, a list of pairs (a, b) in the order learned.
    """
    raise NotImplementedError

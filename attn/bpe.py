"""Byte-pair encoding, learned by hand (Sennrich, Haddow and Birch 2016).

A word vocabulary gives every inflected form its own row ("Haus", "Hauses",
"Häuser") and turns every word it has not seen into ``<unk>``. Byte-pair encoding
instead cuts words into *subword* pieces learned from the corpus:

1. Start with every word as a sequence of characters.
2. Count every pair of adjacent symbols, weighted by how often the word occurs.
3. Merge the most frequent pair into one new symbol everywhere ("e" "r" -> "er"),
   and remember the merge. Repeat until the vocabulary has the size you asked for.

To encode a new word, apply the learned merges to its characters in the order they
were learned. Frequent words end up as one piece, rare ones as a few pieces, and a
word never seen is still spelled from known pieces. The Transformer paper shares
one such vocabulary between source and target ("a shared source-target vocabulary
of about 37000 tokens", section 5.1), so merges are learned on the training text of
both languages together, and the embedding matrices can be tied (section 3.4).

    >>> bpe = BPE.learn(["low lower lowest slow", "new newer newest", "wide wider widest"], num_merges=10)
    >>> bpe.merges[:4]
    [('##o', '##w'), ('##d', '##e'), ('##e', '##w'), ('##i', '##de')]
    >>> bpe.encode("newer slower")           # "slower" was never seen: known pieces, no <unk>
    ['new', '##er', 's', '##l', '##ow', '##er']
    >>> bpe.encode("the")                    # "t" and "h" were never seen: their bytes
    ['<0x74>', '##<0x68>', '##e']
    >>> bpe.decode(bpe.encode("the newer, slower"))
    'the newer, slower'

Words and spacing come from :func:`attn.text.tokenize`, which marks a token glued
to the one before it with ``##``. Pieces use the same mark: every piece after a
word's first is glued to the one before ("s" "##lowest"), so
:func:`attn.text.detokenize` joins pieces back into exactly the normalised text:
``decode(encode(s)) == normalize(s)`` for any string ``s``. (Sennrich et al. mark the
*end* of a word, ``</w>``, while learning and ``@@`` on every piece but the last when
writing; marking the glued pieces is the same information, and keeps a word that
stands alone the same token in both vocabularies.)

**Characters never seen in training** (an emoji, a Chinese name in a German
corpus) cannot be spelled from learned pieces. Rather than ``<unk>``, such a
character is written as its UTF-8 bytes, one token each (``<0xF0>`` ``##<0x9F>``
..., as SentencePiece's byte fallback does), and all 256 bytes, in both forms
(after a space and glued), are in the vocabulary. So nothing is ever ``<unk>``,
and nothing is lost; the price is 512 rows of the vocabulary that are rarely used.

**Learning fast.** Recounting every pair after every merge costs a pass over the
whole corpus per merge. Instead (as subword-nmt does), the pair counts are kept
and, per merge, only the words that contain the merged pair are visited: an index
from each pair to the words containing it says which. Their old pairs are
subtracted, their new pairs added, and a heap (with stale entries skipped when
popped) finds the next most frequent pair. ``python -m attn.bench.vocab --tsv FILE``
times it.

**Long words.** A merge revisits every word that holds its pair, so one word of n characters
costs time in n² (a 1 MB word: minutes). No sentence a model trains on holds such a word whole,
so learning sees every word cut to its first :data:`MAX_WORD_CHARS` characters, and a longer
word is segmented in pieces of that many characters (no learned symbol is longer): time
linear in the input.
"""
from __future__ import annotations

import heapq
import time
from collections import Counter, defaultdict
from typing import Iterable, Mapping, NamedTuple, Sequence

from .text import GLUE, detokenize, normalize, split_glue, tokenize

#: The longest word learning sees (longer ones are cut to this many characters) and the longest stretch
#: of a word segmented at once: no learned symbol is longer.
MAX_WORD_CHARS = 100
#: The byte tokens, after a space and glued: a character the merges have no symbol for is spelled with these.
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256)) + tuple(f"{GLUE}<0x{b:02X}>" for b in range(256))


def symbols_of(token: str) -> list[str]:
    """A word token as its characters, the starting point of BPE.

    >>> symbols_of("lower"), symbols_of("##er")
    (['l', '##o', '##w', '##e', '##r'], ['##e', '##r'])

    The first character keeps the token's own mark; the others are glued to it.
    """
    body, glued = split_glue(token)
    if not body:
        raise ValueError(f"a word token has at least one character, got {token!r}")
    return [(GLUE if glued else "") + body[0]] + [GLUE + ch for ch in body[1:]]


def cut_word(token: str, n: int = MAX_WORD_CHARS) -> str:
    """A word token cut to its first ``n`` characters (its glue mark kept), as learning sees it.

    >>> cut_word("##" + "a" * 300)[:5], len(split_glue(cut_word("##" + "a" * 300))[0])
    ('##aaa', 100)
    """
    body, glued = split_glue(token)
    return token if len(body) <= n else (GLUE if glued else "") + body[:n]


def merge_symbols(a: str, b: str) -> str:
    """The symbol that merging ``a`` and ``b`` makes: ``("l", "##o") -> "lo"``.

    ``b`` is never a word's first symbol, so it always carries the glue mark, which goes.
    """
    return a + b[len(GLUE):]


def _merge_word(symbols: list[str], a: str, b: str, new: str) -> list[str]:
    """Replace every occurrence of the pair (a, b) in ``symbols``, left to right."""
    out, i, n = [], 0, len(symbols)
    while i < n:
        if i + 1 < n and symbols[i] == a and symbols[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def learn_merges(token_counts: Mapping[str, int], num_merges: int | None = None, *,
                 max_symbols: int | None = None, min_count: int = 2) -> tuple[list[str], list[tuple[str, str]]]:
    """Learn BPE merges from word-token counts.

    Parameters
    ----------
    token_counts : {token: count}, tokens as :func:`attn.text.tokenize` writes them
    num_merges : stop after this many merges (the paper's one hyperparameter)
    max_symbols : or stop when the alphabet plus the merged symbols number this many
    min_count : never merge a pair seen fewer times than this (default 2)

    Returns
    -------
    (alphabet, merges) : the sorted starting symbols, and the merges in the order
        learned, each a pair ``(a, b)`` that becomes ``merge_symbols(a, b)``.

    Notes
    -----
    A token longer than :data:`MAX_WORD_CHARS` characters is counted as its first that many
    (:func:`cut_word`). Each merge visits only the words that contain the merged pair (``where``):
    their old pair counts are subtracted and their new ones added. The most frequent
    pair comes off a heap of ``(-count, pair)`` entries; an entry whose count is no
    longer current is skipped (the current count was pushed when it changed). Ties
    go to the alphabetically first pair, so learning is deterministic.
    """
    if num_merges is None and max_symbols is None:
        raise ValueError("learn_merges: give num_merges or max_symbols")
    if num_merges is not None and num_merges < 0:
        raise ValueError(f"learn_merges: num_merges must be at least 0, got {num_merges}")
    cut: Counter = Counter()
    for token, count in token_counts.items():
        if count > 0:
            cut[cut_word(token)] += int(count)
    words = [symbols_of(token) for token in cut]
    alphabet = sorted({s for w in words for s in w})
    known = set(alphabet)
    pairs = _PairCounts(words, list(cut.values()))
    merges: list[tuple[str, str]] = []
    while num_merges is None or len(merges) < num_merges:
        if max_symbols is not None and len(known) >= max_symbols:
            break
        best = pairs.most_frequent()
        if best is None or best[1] < min_count:
            break
        pair = best[0]
        merges.append(pair)
        known.add(pairs.merge(pair))
    return alphabet, merges


class _PairCounts:
    """The adjacent pairs of symbols in the words (each word standing for ``freqs[i]`` tokens):
    each pair's count, the words that hold it (``where``), and a heap of ``(-count, pair)``
    entries, some of them stale, from which the most frequent pair comes."""

    def __init__(self, words: list[list[str]], freqs: list[int]):
        self.words, self.freqs = words, freqs
        self.count: dict[tuple[str, str], int] = defaultdict(int)
        self.where: dict[tuple[str, str], set[int]] = defaultdict(set)   # pair -> indices of the words holding it
        for i, w in enumerate(words):
            for pair in zip(w, w[1:]):
                self.count[pair] += freqs[i]
                self.where[pair].add(i)
        self.heap = [(-n, pair) for pair, n in self.count.items()]
        heapq.heapify(self.heap)

    def most_frequent(self) -> tuple[tuple[str, str], int] | None:
        """The most frequent pair and its count (ties: the alphabetically first pair); None
        when no pair is left."""
        while self.heap:
            neg, pair = heapq.heappop(self.heap)
            if self.count.get(pair, 0) == -neg:
                return pair, -neg
            # stale: the count changed since this entry was pushed
        return None

    def merge(self, pair: tuple[str, str]) -> str:
        """Merge ``pair`` in every word that holds it, update the counts of the pairs that
        change (pushing their new counts) and return the new symbol."""
        a, b = pair
        new = merge_symbols(a, b)
        delta: Counter = Counter()
        for i in self.where.pop(pair):
            old = self.words[i]
            merged = _merge_word(old, a, b, new)
            self.words[i] = merged
            old_pairs, new_pairs = list(zip(old, old[1:])), list(zip(merged, merged[1:]))
            for p in old_pairs:
                delta[p] -= self.freqs[i]
            for p in new_pairs:
                delta[p] += self.freqs[i]
            for p in set(old_pairs) - set(new_pairs) - {pair}:
                self.where[p].discard(i)
            for p in new_pairs:
                self.where[p].add(i)
        del self.count[pair]
        delta.pop(pair, None)
        for p, d in delta.items():
            if d:
                n = self.count[p] + d
                if n > 0:
                    self.count[p] = n
                    heapq.heappush(self.heap, (-n, p))
                else:
                    del self.count[p]
                    self.where.pop(p, None)
        return new


def count_tokens(texts: Iterable[str]) -> Counter:
    """How often each word token occurs in the texts (both languages, for a shared vocabulary)."""
    counts: Counter = Counter()
    for text in texts:
        counts.update(tokenize(text))
    return counts


class BPE:
    """Learned merges that cut text into subword pieces, and join pieces back into text.

    ``BPE.learn(texts, ...)`` learns; ``encode(text)`` gives the pieces,
    ``decode(pieces)`` the text; ``vocabulary()`` lists every piece ``encode`` can
    produce (the byte tokens included); ``to_json()``/``from_json`` save and load.
    """

    def __init__(self, alphabet: Iterable[str], merges: Iterable[Sequence[str]]):
        self.alphabet = sorted(set(alphabet))
        self.merges = [(str(a), str(b)) for a, b in merges]
        for a, b in self.merges:
            if not b.startswith(GLUE):
                raise ValueError(f"a merge joins a symbol to a glued one ('##...'), got {(a, b)}")
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}
        symbols = list(self.alphabet)
        seen = set(symbols)
        for a, b in self.merges:
            new = merge_symbols(a, b)
            if new not in seen:            # two different merges can make the same string
                seen.add(new)
                symbols.append(new)
        self.symbols = symbols
        self._known = seen
        self._cache: dict[str, list[str]] = {}

    @classmethod
    def learn(cls, texts: Iterable[str], num_merges: int | None = None, *, max_symbols: int | None = None,
              min_count: int = 2) -> "BPE":
        """Learn merges on ``texts`` (see :func:`learn_merges` for the arguments)."""
        alphabet, merges = learn_merges(count_tokens(texts), num_merges, max_symbols=max_symbols,
                                        min_count=min_count)
        return cls(alphabet, merges)

    def vocabulary(self) -> list[str]:
        """Every piece :meth:`encode` can produce: the alphabet, the merged symbols, the 512 byte tokens."""
        return self.symbols + list(BYTE_TOKENS)

    def segment(self, token: str) -> list[str]:
        """The pieces of one word token: its characters, merged in the order the merges were learned.

        Each time, the pair with the earliest merge is merged everywhere in the word;
        a merge's new symbol only takes part in later merges, so this gives what
        learning gave. A character outside the alphabet becomes byte tokens. A word of more
        than :data:`MAX_WORD_CHARS` characters is segmented that many characters at a time.
        """
        cached = self._cache.get(token)
        if cached is not None:
            return cached
        body, glued = split_glue(token)
        if len(body) > MAX_WORD_CHARS:
            return [piece for i in range(0, len(body), MAX_WORD_CHARS)
                    for piece in self.segment((GLUE if glued or i else "") + body[i:i + MAX_WORD_CHARS])]
        symbols = symbols_of(token)
        while len(symbols) > 1:
            rank, pair = min(((self.ranks.get(p, len(self.ranks)), p) for p in zip(symbols, symbols[1:])))
            if rank == len(self.ranks):
                break                                  # no learned merge applies
            symbols = _merge_word(symbols, *pair, merge_symbols(*pair))
        pieces: list[str] = []
        for s in symbols:
            if s in self._known:
                pieces.append(s)
            else:                                      # one character never seen: its UTF-8 bytes
                body, glued = split_glue(s)
                raw = body.encode("utf-8")
                pieces.append((GLUE if glued else "") + f"<0x{raw[0]:02X}>")
                pieces.extend(f"{GLUE}<0x{b:02X}>" for b in raw[1:])
        if len(self._cache) < 200_000:
            self._cache[token] = pieces
        return pieces

    def encode(self, text: str) -> list[str]:
        """Text -> subword pieces (tokenised, then each word segmented)."""
        return [piece for token in tokenize(text) for piece in self.segment(token)]

    def decode(self, pieces: Iterable[str]) -> str:
        """Pieces -> text; ``decode(encode(s)) == attn.text.normalize(s)``."""
        return detokenize(pieces)

    def to_json(self) -> dict:
        """``{"alphabet": [...], "merges": [[a, b], ...]}``: plain JSON, stored in checkpoints."""
        return {"alphabet": list(self.alphabet), "merges": [list(m) for m in self.merges]}

    @classmethod
    def from_json(cls, obj) -> "BPE":
        if not isinstance(obj, dict) or not isinstance(obj.get("alphabet"), list) \
                or not isinstance(obj.get("merges"), list):
            raise ValueError("a saved BPE is a JSON object with the lists 'alphabet' and 'merges'")
        if not all(isinstance(s, str) and s for s in obj["alphabet"]):
            raise ValueError("a saved BPE alphabet is a list of non-empty strings")
        if not all(isinstance(m, list) and len(m) == 2 and all(isinstance(s, str) and s for s in m)
                   for m in obj["merges"]):
            raise ValueError("a saved BPE merge is a pair of non-empty strings")
        return cls(obj["alphabet"], obj["merges"])

    def __eq__(self, other) -> bool:
        return isinstance(other, BPE) and self.alphabet == other.alphabet and self.merges == other.merges

    def __repr__(self) -> str:
        return f"BPE({len(self.alphabet)} characters, {len(self.merges)} merges)"


# --------------------------------------------------------------------------- measuring it

class Timing(NamedTuple):
    """What :func:`time_learning` measured."""
    bpe: "BPE"
    count_seconds: float        # wall-clock seconds counting the word tokens
    learn_seconds: float        # wall-clock seconds learning the merges
    learn_cpu_seconds: float    # CPU seconds of this process learning the merges (less sensitive to a busy machine)


def time_learning(texts: Sequence[str], num_merges: int | None = None, *, max_symbols: int | None = None) -> Timing:
    """Learn BPE on ``texts`` and time it, on one core (pure Python: one thread)."""
    t0 = time.perf_counter()
    counts = count_tokens(texts)
    t1, c1 = time.perf_counter(), time.process_time()
    alphabet, merges = learn_merges(counts, num_merges, max_symbols=max_symbols)
    t2, c2 = time.perf_counter(), time.process_time()
    return Timing(BPE(alphabet, merges), t1 - t0, t2 - t1, c2 - c1)

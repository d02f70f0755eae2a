"""Text <-> tokens without loss: normalise, split into words and marks, join back.

    >>> tokenize("It's 3.5 km, „quite“ far.")
    ["It's", '3', '##.', '##5', 'km', '##,', '„', '##quite', '##“', 'far', '##.']
    >>> detokenize(tokenize("It's 3.5 km, „quite“ far."))
    "It's 3.5 km, „quite“ far."

A token is either a *word* (a run of letters, marks, digits and "_", which may
contain an apostrophe, hyphen or zero-width (non-)joiner between two word
characters: "don't", "well-known", "l'homme") or a single other visible
character (punctuation, symbols, emoji). A token that follows the one before it
with no space in between carries the prefix ``##`` (as in BERT's WordPiece), so
the spacing travels with the tokens and :func:`detokenize` puts back exactly the
text that was split:

    detokenize(tokenize(s)) == normalize(s)      for every string s

Text whose tokens are all separated by spaces (the toy corpus: "the old friend
laughed .") has no ``##`` tokens at all: it reads back token for token as written.

:func:`normalize` is the only place where text changes, and it changes only what
is invisible or ambiguous: invisible format characters (byte-order mark, soft
hyphen, direction marks; not the joiners U+200C/U+200D) are dropped; the text is
put into Unicode NFC (an "é" typed as "e" + combining accent becomes the one
character "é"); every run of whitespace (no-break spaces included), control
characters or zero-width spaces becomes one space, and the ends are stripped. Case
is kept. (sacreBLEU splits words at any whitespace too, so a reference with a
no-break space scores the same against its normalised self: 100.)

Why ``##`` cannot be misread: a token's own text is either a word (no "#" in it)
or one character, so a token that starts with "##" is always a glued one ("###"
is a glued "#").

:mod:`attn.bpe` cuts these word tokens into subword pieces with the same ``##``
convention, and may spell a character it never saw as its UTF-8 bytes, tokens
like ``<0xE2>``; :func:`detokenize` joins those too.
"""
from __future__ import annotations

import re
import unicodedata
from typing import Iterable

#: Prefix of a token glued to the one before it (no space in between).
GLUE = "##"

_JOINERS = frozenset("'\u2019-\u2010\u200c\u200d")  # ' ’ - ‐ ZWNJ ZWJ
_ZWSP = "\u200b"
# The same rules restricted to ASCII, as one regular expression: the fast path
# for the (common) ASCII line. A test checks that both paths agree on ASCII text.
_ASCII_TOKEN = re.compile(r"[A-Za-z0-9_]+(?:['-][A-Za-z0-9_]+)*|[!-/:-@\[-^`{-~]")
#: A byte token, as :mod:`attn.bpe` writes a character it has no symbol for.
BYTE_TOKEN = re.compile(r"<0x([0-9A-F]{2})>")


def _char_kind(ch: str) -> str:
    """ "w" word character, "s" separator, "x" dropped, "p" a token on its own."""
    cat = unicodedata.category(ch)
    if cat[0] in "LMN" or ch == "_":
        return "w"
    if ch.isspace() or cat[0] == "Z" or cat == "Cc" or ch == _ZWSP:
        return "s"
    if cat == "Cf" and ch not in _JOINERS:
        return "x"
    return "p"


# ASCII separators: whitespace and the control characters (str.split() alone misses some, e.g. \x00).
_ASCII_SEPARATORS = {c: " " for c in range(128) if _char_kind(chr(c)) == "s"}


def normalize(text: str) -> str:
    """The text as :func:`tokenize` sees it and :func:`detokenize` gives it back.

    >>> normalize("  Cafe\\u0301\\u00ad au\\tlait \\n")
    'Café au lait'

    Drops invisible format characters, applies NFC, turns every run of separators
    (whitespace, controls, zero-width spaces) into one space and strips the ends.
    """
    if text.isascii():
        return " ".join(text.translate(_ASCII_SEPARATORS).split())
    return _normalize_unicode(text)


def _normalize_unicode(text: str) -> str:
    # drop invisible format characters first: "a<soft hyphen><combining acute>" must become "á"
    text = unicodedata.normalize("NFC", "".join(ch for ch in text if _char_kind(ch) != "x"))
    spaced = "".join(" " if _char_kind(ch) == "s" else ch for ch in text)
    return " ".join(part for part in spaced.split(" ") if part)


def _spans_ascii(text: str) -> list[tuple[str, bool]]:
    tokens, end = [], -1
    for m in _ASCII_TOKEN.finditer(text):
        tokens.append((m.group(), m.start() == end))
        end = m.end()
    return tokens


def _spans_unicode(text: str) -> list[tuple[str, bool]]:
    text = _normalize_unicode(text)
    kinds = [_char_kind(ch) for ch in text]
    tokens: list[tuple[str, bool]] = []
    glued = False              # no space between the previous token and the current position
    start = None               # where the current word started
    for i, (ch, kind) in enumerate(zip(text, kinds)):
        if kind == "w" or (ch in _JOINERS and start is not None and i + 1 < len(text) and kinds[i + 1] == "w"):
            if start is None:   # "don't": the apostrophe sits between two word characters
                start = i
            continue
        if start is not None:
            tokens.append((text[start:i], glued))
            start, glued = None, True
        if kind == "s":         # normalize() left exactly one space here
            glued = False
        else:
            tokens.append((ch, glued))
            glued = True
    if start is not None:
        tokens.append((text[start:], glued))
    if tokens:
        tokens[0] = (tokens[0][0], False)
    return tokens


def tokenize(text: str) -> list[str]:
    """Split text into words and single marks; a token with no space before it gets ``##``.

    >>> tokenize("Hello, world!  It's 3.5km.")
    ['Hello', '##,', 'world', '##!', "It's", '3', '##.', '##5km', '##.']

    Unicode-aware (letters, marks and digits of any script make words); the text is
    :func:`normalize`-d first. :func:`detokenize` inverts it exactly.
    """
    spans = _spans_ascii(text) if text.isascii() else _spans_unicode(text)
    return [GLUE + tok if glued else tok for tok, glued in spans]


def split_glue(token: str) -> tuple[str, bool]:
    """``"##,"`` -> ``(",", True)``; ``"word"`` -> ``("word", False)``."""
    if token.startswith(GLUE):
        return token[len(GLUE):], True
    return token, False


def detokenize(tokens: Iterable[str]) -> str:
    """Join tokens back into text: a space before each token, none before a ``##`` one.

    >>> detokenize(["Hello", "##,", "world", "##!"])
    'Hello, world!'
    >>> detokenize(["caf", "##<0xC3>", "##<0xA9>"])    # bytes, as attn.bpe spells an unseen character
    'café'

    Works on the UTF-8 bytes of the tokens, so that byte tokens ``<0xNN>`` join into
    the character they spell; a byte sequence that is not valid UTF-8 (a model can
    produce one) becomes U+FFFD. Word tokens and BPE pieces join the same way.
    """
    out = bytearray()
    for tok in tokens:
        body, glued = split_glue(str(tok))
        if out and not glued:
            out += b" "
        m = BYTE_TOKEN.fullmatch(body)
        out += bytes([int(m.group(1), 16)]) if m else body.encode("utf-8")
    return out.decode("utf-8", errors="replace")

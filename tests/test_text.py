"""Tests for attn/text.py: normalisation, the lossless tokeniser and its inverse."""
from __future__ import annotations

import doctest
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

import attn.data
import attn.text as T
from attn.text import detokenize, normalize, tokenize

ROOT = Path(__file__).resolve().parent.parent

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
ASCII_TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=127), max_size=60)
# Text made of the characters the rules treat specially, so that they meet often.
TRICKY = st.text(st.sampled_from(list("ab1 _'’-‐.,#\t\n\u200b\u200c\u200d\u00ad\ufeff\u0301e\u00e9ß„“🙂\x00\x85")),
                 max_size=30)


def test_doctests():
    assert doctest.testmod(T).failed == 0


@pytest.mark.parametrize("text, tokens", [
    ("Hello, world!", ["Hello", "##,", "world", "##!"]),
    ("  two   spaces\tand\na newline ", ["two", "spaces", "and", "a", "newline"]),
    ("It's a well-known (old) fact.", ["It's", "a", "well-known", "(", "##old", "##)", "fact", "##."]),
    ("Ein Mann mit Hut, der läuft.", ["Ein", "Mann", "mit", "Hut", "##,", "der", "läuft", "##."]),
    ("«Ça va?» l’homme", ["«", "##Ça", "va", "##?", "##»", "l’homme"]),
    ("हिन्दी भाषा।", ["हिन्दी", "भाषा", "##।"]),  # marks (virama) stay inside words
    ("cafe\u0301", ["café"]),  # NFC
    ("a\u200bb\ufeffc", ["a", "bc"]),  # zero-width space separates; BOM dropped
    ("3.5%", ["3", "##.", "##5", "##%"]),
    ("1,000 students' „Bücher“", ["1", "##,", "##000", "students", "##'", "„", "##Bücher", "##“"]),
    ("#1 ##", ["#", "##1", "#", "###"]),  # a glued "#" is "###": still unambiguous
    ("the old friend laughed .", ["the", "old", "friend", "laughed", "."]),  # pre-tokenised: as written
    ("", []),
])
def test_tokenize_examples(text, tokens):
    assert tokenize(text) == tokens
    assert detokenize(tokens) == normalize(text)


def test_the_issues_examples_survive():
    """Issue 9: the old round trip turned these into "3. 5", "1, 000", "students '"."""
    for text in ("3.5", "1,000", "students'", "„Ja“, sagte er.", "Tom's 2.5-hour trip"):
        assert detokenize(tokenize(text)) == text


def test_normalize_examples():
    assert normalize("  Cafe\u0301\u00ad au\tlait \n") == "Café au lait"
    assert normalize("a\r\nb\x00c\u2028d\u3000e") == "a b c d e"
    assert normalize("\ufeffx\u200e") == "x"
    assert normalize("") == "" and normalize(" \t ") == ""


def test_detokenize_examples():
    assert detokenize(["hello", "##,", "world", "##."]) == "hello, world."
    assert detokenize(["(", "##a", "##)", "b", "##?"]) == "(a) b?"
    assert detokenize("the old friend laughed .".split()) == "the old friend laughed ."
    assert detokenize(["caf", "##<0xC3>", "##<0xA9>"]) == "café"          # bytes of an unseen character
    assert detokenize(["<0xF0>", "##<0x9F>", "##<0x99>", "##<0x82>", "##!"]) == "🙂!"
    assert detokenize(["a", "##<0xC3>", "b"]) == "a\ufffd b"               # an invalid byte sequence: U+FFFD
    assert detokenize(["##x"]) == "x"                                     # a glued first token: no space
    assert detokenize([]) == ""


@given(TEXT)
def test_detokenize_inverts_tokenize_on_any_text(text):
    tokens = tokenize(text)
    assert detokenize(tokens) == normalize(text)
    assert all(tok and not any(ch.isspace() for ch in tok) for tok in tokens)
    assert tokenize(detokenize(tokens)) == tokens
    assert not tokens or not tokens[0].startswith(T.GLUE)


@given(TRICKY)
def test_detokenize_inverts_tokenize_on_tricky_text(text):
    assert detokenize(tokenize(text)) == normalize(text)
    assert tokenize(detokenize(tokenize(text))) == tokenize(text)


@given(st.one_of(TEXT, TRICKY))
def test_normalize_is_idempotent_and_leaves_single_inner_spaces(text):
    n = normalize(text)
    assert normalize(n) == n
    assert n == n.strip(" ") and "  " not in n
    assert not any(ch.isspace() and ch != " " for ch in n)


@given(st.lists(st.one_of(st.text("abcé1_", min_size=1, max_size=5), st.sampled_from(list(".,!?„“'-#"))),
                max_size=10))
def test_space_separated_tokens_read_back_without_glue_marks(words):
    """Pre-tokenised text (the toy corpus) is read as written: no ## anywhere."""
    text = " ".join(words)
    assert tokenize(text) == words
    assert detokenize(tokenize(text)) == normalize(text)


@given(ASCII_TEXT)
def test_ascii_fast_path_agrees_with_the_unicode_rules(text):
    assert T._spans_ascii(text) == T._spans_unicode(text)
    assert normalize(text) == T._normalize_unicode(text)


def test_toy_corpus_reads_back_token_for_token():
    toy = ROOT / "data" / "toy" / "val.tk"
    if not toy.is_file():
        pytest.skip("the toy corpus is not in this checkout")
    for line in toy.read_text(encoding="utf-8").splitlines()[:200]:
        assert tokenize(line) == line.split()
        assert detokenize(tokenize(line)) == line


def test_data_reexports_the_tokeniser():
    assert attn.data.tokenize is tokenize and attn.data.detokenize is detokenize
    assert attn.data.normalize is normalize

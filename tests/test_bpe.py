"""Tests for attn/bpe.py: learning merges (against a slow recount-every-merge reference),
segmenting, byte fallback, the lossless round trip, saving, the command; and the BPE
vocabulary in attn/data.py."""
from __future__ import annotations

import doctest
import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

import attn.bench.vocab as vocab_command
import attn.bpe as bpe_module
from attn import data as D
from attn.bpe import BPE, BYTE_TOKENS, count_tokens, learn_merges, merge_symbols, symbols_of
from attn.data import SPECIALS, UNK, DataError, Vocab, read_tsv
from attn.text import GLUE, normalize, tokenize

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "real_text.tsv"
FIXTURE_TEXTS = [side for pair in read_tsv(FIXTURE) for side in pair]


def reference_merges(token_counts, num_merges, min_count=2):
    """Sennrich et al.'s algorithm as written in the paper: recount every pair after every merge."""
    words = {tok: symbols_of(tok) for tok, n in token_counts.items() if n > 0}
    merges = []
    for _ in range(num_merges):
        pairs = Counter()
        for tok, syms in words.items():
            for p in zip(syms, syms[1:]):
                pairs[p] += token_counts[tok]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))          # most frequent, ties alphabetical
        if pairs[best] < min_count:
            break
        merges.append(best)
        words = {tok: bpe_module._merge_word(s, *best, merge_symbols(*best)) for tok, s in words.items()}
    return merges, words


# Word tokens over a small alphabet, so that pairs repeat and ties happen; some glued ("##").
TOKENS = st.builds(lambda glue, body: (GLUE if glue else "") + body, st.booleans(),
                   st.text("abcä", min_size=1, max_size=7))
COUNTS = st.dictionaries(TOKENS, st.integers(1, 6), max_size=12)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


@pytest.fixture(scope="module")
def fixture_bpe():
    return BPE.learn(FIXTURE_TEXTS, num_merges=200)


def test_doctests():
    assert doctest.testmod(bpe_module).failed == 0


def test_symbols_and_merges():
    assert symbols_of("low") == ["l", "##o", "##w"]
    assert symbols_of("##,") == ["##,"]
    assert symbols_of("###") == ["###"]                      # a glued "#"
    assert merge_symbols("l", "##o") == "lo" and merge_symbols("##e", "##r") == "##er"
    with pytest.raises(ValueError):
        symbols_of("##")


@given(COUNTS, st.integers(0, 25), st.integers(1, 3))
def test_incremental_learning_equals_recounting_every_merge(counts, n, min_count):
    alphabet, merges = learn_merges(counts, n, min_count=min_count)
    expected, words = reference_merges(counts, n, min_count)
    assert merges == expected
    assert alphabet == sorted({s for tok in counts for s in symbols_of(tok)})
    # encoding a training word applies the merges as learning did
    bpe = BPE(alphabet, merges)
    for tok in counts:
        assert bpe.segment(tok) == words[tok]


def test_learning_stops_at_max_symbols_and_min_count():
    counts = count_tokens(FIXTURE_TEXTS)
    alphabet, merges = learn_merges(counts, max_symbols=150)
    assert len(alphabet) < 150 and len(BPE(alphabet, merges).symbols) == 150
    _, all_merges = learn_merges(counts, 10 ** 6)
    pairs_left = Counter()
    bpe = BPE(alphabet, all_merges)
    for tok, n in counts.items():
        pieces = bpe.segment(tok)
        for p in zip(pieces, pieces[1:]):
            pairs_left[p] += n
    assert max(pairs_left.values(), default=0) < 2               # nothing left to merge twice
    with pytest.raises(ValueError):
        learn_merges(counts)


def test_merges_follow_frequency():
    bpe = BPE.learn(["er er er er", "ab ab", "xy"], num_merges=2)
    assert bpe.merges == [("e", "##r"), ("a", "##b")]
    assert bpe.encode("er ab xy") == ["er", "ab", "x", "##y"]


@given(TEXT)
def test_decode_inverts_encode_on_any_text(fixture_bpe, text):
    """Characters the merges never saw are spelled as bytes: nothing lost, nothing <unk>."""
    pieces = fixture_bpe.encode(text)
    assert fixture_bpe.decode(pieces) == normalize(text)
    known = set(fixture_bpe.vocabulary())
    assert all(p in known for p in pieces)
    assert not pieces or not pieces[0].startswith(GLUE)


@given(st.lists(st.text(st.characters(exclude_categories=("Cs",)), max_size=12), max_size=6), TEXT,
       st.integers(0, 40))
def test_decode_inverts_encode_for_merges_learned_on_any_text(corpus, text, n):
    bpe = BPE.learn(corpus, num_merges=n, min_count=1)
    for s in corpus + [text]:
        assert bpe.decode(bpe.encode(s)) == normalize(s)


def test_unseen_characters_become_bytes_not_unk(fixture_bpe):
    assert fixture_bpe.encode("🙂") == ["<0xF0>", "##<0x9F>", "##<0x99>", "##<0x82>"]
    assert fixture_bpe.encode("Ö🙂")[1:] == ["##<0xF0>", "##<0x9F>", "##<0x99>", "##<0x82>"]
    vocab = Vocab(SPECIALS + tuple(fixture_bpe.vocabulary()), bpe=fixture_bpe)
    ids = vocab.encode(vocab.tokenize("Ein Kätzchen 🐈 frisst 3,5 Mäuse."))
    assert UNK not in ids
    assert D.detokenize(vocab.decode(ids)) == "Ein Kätzchen 🐈 frisst 3,5 Mäuse."
    assert len(BYTE_TOKENS) == 512 and len(set(BYTE_TOKENS)) == 512


def test_json_round_trip_and_bad_json(fixture_bpe):
    saved = json.loads(json.dumps(fixture_bpe.to_json()))
    assert BPE.from_json(saved) == fixture_bpe
    assert BPE.from_json(saved).encode("Größe: 42") == fixture_bpe.encode("Größe: 42")
    for bad in ([], {"merges": []}, {"alphabet": ["a"], "merges": [["a"]]}, {"alphabet": [""], "merges": []},
                {"alphabet": ["a"], "merges": [["a", "b"]]}):
        with pytest.raises(ValueError):
            BPE.from_json(bad)


# ----------------------------------------------------------------------------- the vocabulary

def test_build_bpe_has_the_size_asked_for_and_round_trips_through_json():
    v = Vocab.build_bpe(FIXTURE_TEXTS, vocab_size=700)
    assert len(v) == 700 and v.itos[:4] == list(SPECIALS) and v.bpe is not None
    assert all(t in v for t in BYTE_TOKENS)
    saved = json.loads(json.dumps(v.to_json()))
    assert set(saved) == {"itos", "bpe"}
    assert Vocab.from_json(saved) == v
    words = Vocab.build([tokenize(t) for t in FIXTURE_TEXTS])
    assert words.to_json() == words.itos and Vocab.from_json(words.to_json()) == words    # the old format
    assert v != Vocab(v.itos)
    with pytest.raises(ValueError, match="at least"):
        Vocab.build_bpe(FIXTURE_TEXTS, vocab_size=100)
    with pytest.raises(ValueError, match="characters"):
        Vocab.build_bpe(FIXTURE_TEXTS, vocab_size=600)       # fewer than the characters of the text
    with pytest.raises(DataError):
        Vocab.from_json({"itos": v.itos})
    with pytest.raises(DataError, match="missing"):
        Vocab(v.itos[:-1], bpe=v.bpe)
    with pytest.raises(DataError, match="merges"):
        Vocab.from_json({"itos": v.itos, "bpe": {"alphabet": 3}})


def test_encode_pairs_uses_the_vocabularys_tokeniser():
    pairs = read_tsv(FIXTURE)
    v = Vocab.build_bpe([s for p in pairs for s in p], vocab_size=650)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enc = D.encode_pairs(pairs, v)
    for (src, tgt), (s_ids, t_ids) in zip(pairs, enc):
        assert D.detokenize(v.decode(s_ids)) == src and D.detokenize(v.decode(t_ids)) == tgt
        assert len(t_ids) == len(v.tokenize(tgt))


# ----------------------------------------------------------------------------- the command

def test_command_help(capsys):
    with pytest.raises(SystemExit) as e:
        vocab_command.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--tsv" in out and "--vocab-size" in out and "--merges" in out


def test_command_measures_a_corpus(capsys):
    assert vocab_command.main(["--tsv", str(FIXTURE), "--merges", "50", "--vocab-size", "650",
                            "--held-out", "3"]) == 0
    out = capsys.readouterr().out
    assert "words, min-freq 1" in out and "BPE, 50 merges" in out and "BPE, vocab-size 650" in out
    assert "round trip exact: True" in out


def test_command_bad_arguments(capsys, tmp_path):
    assert vocab_command.main(["--tsv", str(tmp_path / "missing.tsv")]) == 2
    assert "missing.tsv" in capsys.readouterr().err
    assert vocab_command.main(["--tsv", str(FIXTURE), "--vocab-size", "10"]) == 2


def test_time_learning_returns_the_bpe_and_both_times():
    timing = bpe_module.time_learning(FIXTURE_TEXTS, 20)
    assert len(timing.bpe.merges) == 20
    assert timing.count_seconds >= 0 and timing.learn_seconds >= 0 and timing.learn_cpu_seconds >= 0
    assert len(bpe_module.time_learning(FIXTURE_TEXTS, max_symbols=150).bpe.symbols) == 150


def test_runs_as_a_module():
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "attn.bench.vocab", "--help"], capture_output=True, text=True, cwd=root,
                       env={"PYTHONPATH": str(root), "PATH": ""}, timeout=60)
    assert r.returncode == 0 and "--tsv" in r.stdout


def _long_word(n: int, seed: int = 0) -> str:
    import random
    return "".join(random.Random(seed).choices("abcdefghij", k=n))


def test_a_1mb_word_is_learned_as_its_first_max_word_chars_characters():
    """Learning revisits every word that holds the merged pair: a 1 MB word took over 400 s whole."""
    word, line = _long_word(10**6), "the low lower lowest"
    assert BPE.learn([line, word], num_merges=200) == BPE.learn([line, word[:bpe_module.MAX_WORD_CHARS]],
                                                                num_merges=200)
    glued = learn_merges({GLUE + word: 3}, num_merges=5)
    assert glued == learn_merges({GLUE + word[:bpe_module.MAX_WORD_CHARS]: 3}, num_merges=5)


def test_a_long_word_is_segmented_max_word_chars_at_a_time():
    bpe = BPE.learn(["the low lower lowest", _long_word(300, seed=1)], num_merges=50)
    word, n = _long_word(2_050, seed=2), bpe_module.MAX_WORD_CHARS
    pieces = bpe.encode("a " + word)
    assert bpe.decode(pieces) == "a " + word
    chunks = [word[i:i + n] for i in range(0, len(word), n)]
    assert pieces[1:] == [p for i, c in enumerate(chunks) for p in bpe.segment((GLUE if i else "") + c)]

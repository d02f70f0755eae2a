"""Tests for attn/data.py (tokeniser, vocabulary, readers, batches) and the toy corpus
generator data/make_toy.py."""
from __future__ import annotations

import gzip
import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

from attn import data as D
from attn.data import BOS, EOS, PAD, SPECIALS, UNK, DataError, DataWarning, Vocab
from attn.masks import PAD_ID

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "data" / "toy"


def _load_make_toy():
    spec = importlib.util.spec_from_file_location("make_toy", ROOT / "data" / "make_toy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_toy"] = module
    spec.loader.exec_module(module)
    return module


make_toy = _load_make_toy()


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


# --------------------------------------------------------------------------
# The toy corpus
# --------------------------------------------------------------------------


def test_generator_is_deterministic_and_check_catches_a_change(tmp_path, capsys):
    sizes = ["--train", "300", "--val", "50", "--test", "50"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert make_toy.main(["--out", str(a)] + sizes) == 0
    assert make_toy.main(["--out", str(b)] + sizes) == 0
    for name in make_toy.file_names(make_toy.SIZES):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert make_toy.main(["--out", str(a), "--check"] + sizes) == 0
    (a / "val.tk").write_text("changed\n", encoding="utf-8")
    assert make_toy.main(["--out", str(a), "--check"] + sizes) == 1
    assert "val.tk" in capsys.readouterr().err
    assert make_toy.main(["--out", str(a), "--check", "--seed", "1"] + sizes) == 1


def test_shipped_toy_corpus_matches_the_generator():
    """`python data/make_toy.py --check`: data/toy is what the script writes."""
    assert make_toy.main(["--check"]) == 0


def test_toy_splits_sizes_and_no_val_or_test_source_in_train():
    src = {split: _lines(TOY / f"{split}.en") for split in ("train", "val", "test")}
    tgt = {split: _lines(TOY / f"{split}.tk") for split in ("train", "val", "test")}
    assert {k: len(v) for k, v in src.items()} == {"train": 30000, "val": 1000, "test": 1000}
    assert {k: len(v) for k, v in tgt.items()} == {"train": 30000, "val": 1000, "test": 1000}
    train = set(src["train"])
    assert len(train) == 30000, "train sources are unique"
    assert not train & set(src["val"])
    assert not train & set(src["test"])
    assert not set(src["val"]) & set(src["test"])


def test_toy_corpus_is_pre_tokenised_lowercase_and_in_range():
    """Every line reads back token for token through attn.data.tokenize, lengths are
    within [3, 25], and the vocabulary per side is 100 to 400 words."""
    for lang in ("en", "tk"):
        vocab = set()
        for split in ("train", "val", "test"):
            for line in _lines(TOY / f"{split}.{lang}"):
                tokens = line.split()
                assert D.tokenize(line) == tokens, line
                assert line == line.lower() and 3 <= len(tokens) <= 25, line
                vocab.update(tokens)
        assert 100 <= len(vocab) <= 400, (lang, len(vocab))


@pytest.mark.parametrize("n, en, tk", [
    (7, "seven", "sep"), (10, "ten", "dek"), (13, "thirteen", "tri dek"),
    (20, "twenty", "vint"), (23, "twenty three", "tri e vint"), (99, "ninety nine", "nov e novant"),
])
def test_number_words(n, en, tk):
    assert make_toy.number_words(n) == (en.split(), tk.split())


def _np(noun, plural=False, definite=True, number=0, adjs=()):
    nouns = {n.sg: n for n in make_toy.NOUNS}
    return make_toy.NP(nouns[noun], plural, definite, number, tuple(adjs))


def _verb(base):
    return next(v for v in make_toy.VERBS if v.base == base)


def test_noun_phrase_agreement_and_order():
    # article and adjective endings follow the noun's class and number; mirror order
    assert _np("dog", adjs=["big", "red"]).tk() == "du hund rudo grando".split()
    assert _np("cat", plural=True, adjs=["big"]).tk() == "kas mitsas grandan".split()
    assert _np("apple", definite=False, adjs=["old"]).en() == "an old apple".split()
    assert _np("apple", definite=False).tk() == ["pomo"]  # "a"/"an" translate to nothing
    assert _np("dog", plural=True, number=23).en() == "the twenty three dogs".split()
    assert _np("dog", plural=True, number=23).tk() == "dus tri e vint hunden".split()


def test_clause_word_order():
    C = make_toy.Clause
    c = C(_np("dog"), _verb("call"), "past", True, _np("cat"), None, None)
    assert c.en() == "the dog did not call the cat".split()
    assert c.tk(False) == "du hund ba fonat ka mitsa ne tele".split()  # verb second, particle last
    assert c.tk(True) == "du hund ka mitsa ne tele ba fonat".split()  # verb final
    f = C("we", _verb("see"), "future", False, _np("book", plural=True, definite=False), "in", _np("house"))
    assert f.en() == "we will see books in the house".split()
    assert f.tk(False) == "ulamos libroen du domo en vidar".split()  # pronoun dropped, infinitive last
    assert f.tk(True) == "libroen du domo en vidar ulamos".split()


def _readme_examples():
    """The example pairs of data/README.md, built from the generator's grammar."""
    C, V = make_toy.Clause, _verb

    def simple(c):
        return c.en() + ["."], c.tk(False) + ["."]

    def complex_(main, word, sub):
        tk_word = make_toy.THAT if word == "that" else make_toy.CONJUNCTIONS[word]
        return main.en() + [word] + sub.en() + ["."], main.tk(False) + [",", tk_word] + sub.tk(True) + ["."]

    return [
        simple(C(_np("dog", adjs=["big"]), V("sleep"), "present", False, None, None, None)),
        simple(C(_np("cat", definite=False, adjs=["big"]), V("sleep"), "present", False, None, None, None)),
        simple(C(_np("queen", plural=True, adjs=["happy"]), V("sleep"), "present", False, None, None, None)),
        simple(C(_np("dog"), V("see"), "present", False, _np("cat"), None, None)),
        simple(C(_np("dog", plural=True), V("see"), "present", False, _np("cat", plural=True), None, None)),
        simple(C("they", V("sleep"), "past", False, None, None, None)),
        simple(C("she", V("see"), "past", True, _np("apple", definite=False), None, None)),
        simple(C(_np("king"), V("open"), "future", False, _np("book"), None, None)),
        simple(C(_np("king"), V("open"), "future", True, _np("book"), "in", _np("garden"))),
        simple(C("we", V("call"), "present", False, _np("teacher"), None, None)),
        simple(C(_np("dog", plural=True, number=23), V("run"), "present", False, None, "near", _np("house"))),
        simple(C("you", V("sing"), "present", True, None, "near",
                 _np("tree", plural=True, definite=False, number=13))),
        complex_(C(_np("woman"), V("say"), "present", False, None, None, None), "that",
                 C(_np("dog"), V("call"), "past", False, _np("cat"), None, None)),
        complex_(C("he", V("sing"), "present", False, None, None, None), "because",
                 C(_np("king"), V("open"), "future", True, _np("book"), None, None)),
        complex_(C(_np("bird", plural=True), V("sing"), "past", False, None, None, None), "because",
                 C("i", V("visit"), "past", True, _np("child", plural=True), None, None)),
    ]


def test_readme_examples_are_what_the_generator_writes():
    readme = (ROOT / "data" / "README.md").read_text(encoding="utf-8")
    for en, tk in _readme_examples():
        row = f"| {' '.join(en)} | {' '.join(tk)} |"
        assert row in readme, f"data/README.md should show the pair {row}"


def test_every_english_sentence_has_one_translation():
    """The generator asserts it while drawing; here on a fresh sample of 3000."""
    splits = make_toy.generate(seed=7, sizes={"test": 0, "val": 0, "train": 3000})
    assert len({en for en, _ in splits["train"]}) == 3000


# --------------------------------------------------------------------------
# Tokeniser
# --------------------------------------------------------------------------


def test_specials():
    assert (PAD, BOS, EOS, UNK) == (0, 1, 2, 3)
    assert PAD == PAD_ID
    assert SPECIALS == ("<pad>", "<s>", "</s>", "<unk>")


# The tokeniser itself (attn/text.py) is tested in tests/test_text.py.


# --------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------


def test_vocab_build_order_min_freq_and_max_size():
    lists = [["b", "a", "c", "a"], ["c", "d", "a"], ["<unk>", "e"]]
    v = Vocab.build(lists)
    assert v.itos == list(SPECIALS) + ["a", "c", "b", "d", "e"]  # frequency, then alphabetical
    assert v.stoi["a"] == 4 and len(v) == 9
    assert Vocab.build(lists, min_freq=2).itos == list(SPECIALS) + ["a", "c"]
    assert Vocab.build(lists, max_size=6).itos == list(SPECIALS) + ["a", "c"]
    with pytest.raises(ValueError):
        Vocab.build(lists, max_size=3)


def test_vocab_encode_decode_unknown_and_json():
    v = Vocab.build([["the", "dog", "sleeps", "."]])
    ids = v.encode(["the", "cat", "sleeps", "."])
    assert ids[1] == UNK and v.decode(ids) == ["the", "<unk>", "sleeps", "."]
    assert v.decode([BOS] + ids + [EOS, v.stoi["dog"], PAD]) == ["the", "<unk>", "sleeps", "."]
    assert v.decode(np.array([BOS, v.stoi["dog"], PAD, EOS], dtype=np.int64)) == ["dog"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        v.decode([len(v)])
    assert Vocab.from_json(v.to_json()) == v
    assert "dog" in v and "cat" not in v
    with pytest.raises(DataError):
        Vocab.from_json(["a", "b"])
    with pytest.raises(DataError):
        Vocab.from_json(list(SPECIALS) + ["x", "x"])


# --------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


def test_read_parallel(tmp_path):
    _write(tmp_path / "train.de", "\ufeffEin Hund.\r\nZwei Katzen.\n\n")
    _write(tmp_path / "train.en", "A dog.\nTwo cats.\n\n")
    assert D.read_parallel(tmp_path, "de", "en", "train") == [
        ("Ein Hund.", "A dog."), ("Zwei Katzen.", "Two cats."), ("", "")]


def test_read_parallel_reads_gzip(tmp_path):
    _write(tmp_path / "val.de.gz", gzip.compress("Hallo\n".encode()))
    _write(tmp_path / "val.en", "Hello\n")
    assert D.read_parallel(tmp_path, "de", "en", "val") == [("Hallo", "Hello")]


def test_a_gzip_corpus_that_expands_past_the_bound_is_refused_naming_file_and_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "MAX_GUNZIP_BYTES", 1_000_000, raising=False)
    _write(tmp_path / "train.de.gz", gzip.compress(b"a " * 1_000_000))      # 2 MB from 2 kB
    _write(tmp_path / "train.en.gz", gzip.compress(b"a\n" * 10))
    with pytest.raises(DataError, match=r"train\.de\.gz: decompresses to more than 1,000,000 bytes"):
        D.read_parallel(tmp_path, "de", "en", "train")


def test_out_of_memory_advice_names_only_flags_with_their_values():
    from attn.train import TrainConfig, _out_of_memory_advice
    advice = _out_of_memory_advice(TrainConfig())
    assert "None" not in advice and "2,048 tokens" in advice and "--max-tokens 1024" in advice
    assert "--max-tokens 256" in _out_of_memory_advice(TrainConfig(max_tokens=512))


def test_read_parallel_missing_file(tmp_path):
    _write(tmp_path / "test.de", "x\n")
    with pytest.raises(DataError, match=r"test\.en: no such file"):
        D.read_parallel(tmp_path, "de", "en", "test")


def test_read_parallel_mismatched_line_counts(tmp_path):
    _write(tmp_path / "train.de", "a\nb\nc\n")
    _write(tmp_path / "train.en", "a\nb\n")
    with pytest.raises(DataError) as e:
        D.read_parallel(tmp_path, "de", "en", "train")
    msg = str(e.value)
    assert "train.de" in msg and "train.en" in msg and "3" in msg and "2" in msg


def test_read_parallel_bad_utf8_names_file_and_line(tmp_path):
    _write(tmp_path / "train.de", b"gut\nauch gut\nschlecht \xff\n")
    _write(tmp_path / "train.en", "a\nb\nc\n")
    with pytest.raises(DataError, match=r"train\.de: line 3 is not valid UTF-8"):
        D.read_parallel(tmp_path, "de", "en", "train")


def test_read_tsv(tmp_path):
    path = _write(tmp_path / "pairs.tsv", "\ufeffGo.\tVa !\tCC-BY 2.0 (France)\r\nHi.\tSalut !\n")
    assert D.read_tsv(path) == [("Go.", "Va !"), ("Hi.", "Salut !")]


@pytest.mark.parametrize("content,words", [
    ("a\tb\nEmpty \t\n", r"pairs\.tsv: line 2 has an empty target field"),
    ("a\tb\n \tfoo\n", r"pairs\.tsv: line 2 has an empty source field"),
    ("a\tb\rc\td\re\tf\n", r"pairs\.tsv: line 1 holds a carriage return"),
    ("a\tb\n".encode("utf-16"), r"pairs\.tsv: line 1 starts with a UTF-16 byte-order mark"),
    (b"a\tb\nc\td\xe9\n", r"pairs\.tsv: line 2 is not valid UTF-8")])
def test_read_tsv_bad_lines_name_file_and_line(tmp_path, content, words):
    path = _write(tmp_path / "pairs.tsv", content)
    with pytest.raises(DataError, match=words):
        D.read_tsv(path)


def test_read_parallel_line_empty_on_one_side_only(tmp_path):
    _write(tmp_path / "train.de", "a\n\nc\n")
    _write(tmp_path / "train.en", "a\nb\nc\n")
    with pytest.raises(DataError, match=r"train\.de: line 2 is empty but line 2 of .*train\.en is not"):
        D.read_parallel(tmp_path, "de", "en", "train")


def test_read_tsv_blank_lines_warn_once(tmp_path):
    path = _write(tmp_path / "pairs.tsv", "a\tb\n\n\nc\td\n")
    with pytest.warns(DataWarning, match="skipped 2 blank"):
        assert D.read_tsv(path) == [("a", "b"), ("c", "d")]


def test_read_tsv_line_without_tab(tmp_path):
    path = _write(tmp_path / "pairs.tsv", "a\tb\nno tab here\n")
    with pytest.raises(DataError, match=r"pairs\.tsv: line 2 has no tab"):
        D.read_tsv(path)


def test_read_tsv_missing_and_bad_utf8(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        D.read_tsv(tmp_path / "nope.tsv")
    path = _write(tmp_path / "bad.tsv", b"\xc3\tb\n")
    with pytest.raises(DataError, match=r"bad\.tsv: line 1"):
        D.read_tsv(path)


# --------------------------------------------------------------------------
# Encoding and batches
# --------------------------------------------------------------------------


def test_encode_pairs_skips_and_counts_in_one_warning():
    pairs = [("a b", "c"), ("", "c"), ("a", "  "), ("a b c d", "c"), ("a zz", "c")]
    v = Vocab.build([["a", "b", "c"]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enc = D.encode_pairs(pairs, v, max_len=3)
    assert [str(w.message) for w in caught if issubclass(w.category, DataWarning)] == [
        "skipped 3 of 5 sentence pairs: 2 with an empty side, 1 longer than max_len=3 tokens"]
    a, b, c = v.encode(["a", "b", "c"])
    assert enc == [([a, b], [c]), ([a, UNK], [c])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert D.encode_pairs(pairs[:1], v) == [([a, b], [c])]


def test_batch_layout():
    pairs = [([5, 6, 7], [8]), ([9], [10, 11, 12, 13])]
    [b] = D.make_batches(pairs, max_tokens=100, shuffle=False)
    assert b.src.dtype == np.int64 and b.tgt_in.dtype == np.int64 and b.tgt_out.dtype == np.int64
    np.testing.assert_array_equal(b.src, [[9, EOS, PAD, PAD], [5, 6, 7, EOS]])  # shorter source first
    np.testing.assert_array_equal(b.tgt_in, [[BOS, 10, 11, 12, 13], [BOS, 8, PAD, PAD, PAD]])
    np.testing.assert_array_equal(b.tgt_out, [[10, 11, 12, 13, EOS], [8, EOS, PAD, PAD, PAD]])
    assert (b.n_src_tokens, b.n_tgt_tokens) == (6, 7)


def test_batches_reject_bad_input():
    with pytest.raises(ValueError):
        D.make_batches([([4], [5])], max_tokens=0, shuffle=False)
    with pytest.raises(DataError):
        D.make_batches([([], [5])], max_tokens=10, shuffle=False)


def _unpad(batch):
    """The (src ids, tgt ids) pairs a batch holds, read back from its arrays."""
    out = []
    for s, ti, to in zip(batch.src, batch.tgt_in, batch.tgt_out):
        s = s.tolist()
        n = s.index(EOS)
        assert all(x == PAD for x in s[n + 1:]) and PAD not in s[:n]
        to = to.tolist()
        m = to.index(EOS)
        assert all(x == PAD for x in to[m + 1:]) and PAD not in to[:m]
        assert ti.tolist() == [BOS] + to[:m] + [PAD] * (len(to) - m - 1)  # tgt_in is tgt_out shifted
        out.append((tuple(s[:n]), tuple(to[:m])))
    return out


pair_lists = st.lists(
    st.tuples(st.lists(st.integers(4, 40), min_size=1, max_size=30),
              st.lists(st.integers(4, 40), min_size=1, max_size=30)),
    min_size=1, max_size=60)


@given(pair_lists, st.integers(1, 400), st.booleans(), st.integers(0, 3), st.integers(0, 3))
def test_batches_hold_every_pair_once_within_budget(pairs, max_tokens, shuffle, seed, epoch):
    batches = D.make_batches(pairs, max_tokens, shuffle=shuffle, seed=seed, epoch=epoch)
    seen = []
    for b in batches:
        n_rows, S = b.src.shape
        T = b.tgt_in.shape[1]
        assert b.tgt_out.shape == (n_rows, T) and n_rows >= 1
        assert max(S, T) * n_rows <= max_tokens or n_rows == 1
        assert b.n_src_tokens == int((b.src != PAD).sum())
        assert b.n_tgt_tokens == int((b.tgt_out != PAD).sum())
        seen += _unpad(b)
    assert sorted(seen) == sorted((tuple(s), tuple(t)) for s, t in pairs)
    if not shuffle:  # shortest first: lengths never decrease across the list
        lengths = [(len(s), len(t)) for s, t in seen]
        assert lengths == sorted(lengths)


def test_batches_are_deterministic_per_seed_and_epoch():
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(4, 50, rng.integers(1, 20)).tolist(), rng.integers(4, 50, rng.integers(1, 20)).tolist())
             for _ in range(500)]

    def order(**kw):
        return [b.src.tolist() + b.tgt_out.tolist() for b in D.make_batches(pairs, 200, shuffle=True, **kw)]

    assert order(seed=1, epoch=2) == order(seed=1, epoch=2)
    assert order(seed=1, epoch=2) != order(seed=1, epoch=3)
    assert order(seed=0, epoch=0) != order(seed=5, epoch=0)
    fixed = D.make_batches(pairs, 200, shuffle=False)
    again = D.make_batches(pairs, 200, shuffle=False, seed=9, epoch=4)
    assert [b.src.tolist() for b in fixed] == [b.src.tolist() for b in again]

"""The development corpus (Tatoeba English-German, ../shared/corpora/tatoeba-en-de/deu.txt):
read whole, and split by source sentence so that no test source is seen in training.

The corpus is not part of the repository (README: "Real corpora"). These tests skip with a
reason where it is absent; ``ATTN_TATOEBA=/path/to/deu.txt`` points them at another copy.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from attn.data import read_tsv
from attn.train import TrainConfig
from attn.training.prepare import load_corpus

ROOT = Path(__file__).resolve().parents[1]
TATOEBA = Path(os.environ.get("ATTN_TATOEBA", ROOT.parent / "shared" / "corpora" / "tatoeba-en-de" / "deu.txt"))
SHA256 = "ad109252de3e35f8ec8030669ccddf6ee2f5cc1656c1928468e175233c01eb1d"   # SOURCE.md beside it

pytestmark = pytest.mark.skipif(not TATOEBA.is_file(),
                                reason=f"the Tatoeba corpus is absent ({TATOEBA}); see README, 'Real corpora', "
                                       "or set ATTN_TATOEBA=/path/to/deu.txt")


def test_the_copy_is_the_one_documented():
    assert hashlib.sha256(TATOEBA.read_bytes()).hexdigest() == SHA256


def test_tatoeba_reads_whole():
    """CRLF line ends, umlauts, quotes: every line is a pair with both sides."""
    pairs = read_tsv(TATOEBA)
    assert len(pairs) == 50_002
    assert all(s and t and "\r" not in t for s, t in pairs)
    assert len({s for s, _ in pairs}) == 37_679
    assert any("ß" in t for _, t in pairs) and any("„" in t for _, t in pairs)


def test_tatoeba_split_holds_out_whole_sources():
    corpus = load_corpus(TrainConfig(tsv=TATOEBA, seed=0))
    train, val, test = ({s for s, _ in part} for part in (corpus.train, corpus.val, corpus.test))
    assert not train & val and not train & test and not val & test
    assert len(corpus.train) + len(corpus.val) + len(corpus.test) == 50_002
    assert 1000 <= len(corpus.val) < 1010 and 1000 <= len(corpus.test) < 1010
    # Many held-out sources have several translations: all of them are held out together.
    assert len(val) < len(corpus.val)

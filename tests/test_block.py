"""The block's parts (attn/block.py) and the one decoder layer they run in.

Greedy and beam search on a few blocks are recorded in ``tests/fixtures/decoding.json`` (tokens,
scores as exact float hex, each cross-attention's bytes as a SHA-256) and must come back bit
for bit: declaring the block once and decoding through the training's layer function change
no number. ``python tests/test_block.py`` records them again (only after a change meant to
alter them).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from attn.data import EOS, PAD
from attn.decode import beam_search, greedy_decode
from attn.model import Transformer, TransformerConfig

FIXTURE = Path(__file__).parent / "fixtures" / "decoding.json"

#: The paper's block, the later one with every part, and two in between; float32 and float64.
BLOCKS = {
    "paper": dict(),
    "later": dict(norm="pre", norm_kind="rms", positional="rope", ffn="swiglu", kv_heads=2),
    "learned-pre-mqa": dict(norm="pre", positional="learned", kv_heads=1),
    "rope-post-rms": dict(positional="rope", norm_kind="rms"),
}
DTYPES = ("float64", "float32")


def block_model(name, dtype):
    cfg = TransformerConfig(vocab_size=13, d_model=16, n_heads=4, d_ff=32, n_encoder_layers=2,
                            n_decoder_layers=2, **BLOCKS[name])
    m = Transformer(cfg, seed=3, dtype=dtype)
    m.params["embedding.weight"][EOS] *= 2.0          # sentences then end at varied lengths
    return m


def block_sources():
    src = np.random.default_rng(0).integers(4, 13, (4, 7))
    for i, L in enumerate([7, 4, 2, 5]):
        src[i, L:] = PAD
    return src


def _digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _result(res) -> dict:
    return {"tokens": res.tokens, "scores": [float(s).hex() for s in res.scores],
            "attention": [_digest(a) for a in res.cross_attention],
            "n_best": None if res.n_best is None else [[[t, float(s).hex()] for t, s in nb] for nb in res.n_best]}


def decodings(name, dtype) -> dict:
    m, src = block_model(name, dtype), block_sources()
    src = m.xp.asarray(src)
    return {"greedy": _result(greedy_decode(m, src, max_len=9, with_attention=True)),
            "beam": _result(beam_search(m, src, beam_size=3, max_len=9, with_attention=True))}


def record() -> dict:
    return {f"{name}/{dtype}": decodings(name, dtype) for name in BLOCKS for dtype in DTYPES}


def test_decoding_is_bit_identical_to_the_recorded_searches():
    expected = json.loads(FIXTURE.read_text())
    for key, want in expected.items():
        name, dtype = key.split("/")
        got = json.loads(json.dumps(decodings(name, dtype)))
        assert got == want, f"{key}: decoding changed"
    assert any(len(t) < 9 for t in expected["paper/float64"]["greedy"]["tokens"])    # EOS is reached


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(record(), indent=1) + "\n")
    print(f"wrote {FIXTURE}", file=sys.stderr)

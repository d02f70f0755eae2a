"""The fast engine on the block's parts (attn/block.py): its numbers do not move.

Greedy and beam search through :class:`attn.fast.FastTransformer` on the blocks of
``tests/test_block.py``, and one training forward and backward (the logits and every gradient,
as SHA-256 of their bytes), are recorded in ``tests/fixtures/fast_decoding.json`` and must come
back bit for bit: dispatching on the parts instead of the config's strings, and one decoder
position shared by the searches, change no number. ``python tests/test_fast_block.py`` records
them again (only after a change meant to alter them).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from attn.data import BOS
from attn.fast import FastTransformer
from test_block import BLOCKS, DTYPES, _digest, block_model, block_sources, searches

FIXTURE = Path(__file__).parent / "fixtures" / "fast_decoding.json"


def fast_model(name, dtype):
    m = FastTransformer.from_model(block_model(name, dtype))
    m.workers = 1                   # the same products on any machine, whatever its cores
    return m


def fast_numbers(name, dtype) -> dict:
    m, src = fast_model(name, dtype), np.asarray(block_sources())
    tgt = np.asarray([[BOS, 5, 6, 7, 8]] * 4)
    logits, cache = m.forward(src, tgt)
    dlogits = np.random.default_rng(1).standard_normal(logits.shape).astype(logits.dtype)
    grads = m.backward(dlogits, cache)
    return {**searches(m, src), "logits": _digest(logits), "grads": {k: _digest(g) for k, g in sorted(grads.items())}}


def record() -> dict:
    return {f"{name}/{dtype}": fast_numbers(name, dtype) for name in BLOCKS for dtype in DTYPES}


def test_fast_engine_is_bit_identical_to_its_recorded_numbers():
    expected = json.loads(FIXTURE.read_text())
    for key, want in expected.items():
        name, dtype = key.split("/")
        got = json.loads(json.dumps(fast_numbers(name, dtype)))
        for what in want:
            assert got[what] == want[what], f"{key}: {what} changed"


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(record(), indent=1) + "\n")
    print(f"wrote {FIXTURE}", file=sys.stderr)

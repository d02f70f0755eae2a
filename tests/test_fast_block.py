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
import pytest

from attn.data import BOS
from attn.fast import DeviceDecodeState, FastTransformer
from attn.masks import padding_mask
from conftest import selected_backend
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


#: What runs on the way from a decoder layer to its cross-attention: the residual connections and
#: the cross-attentions themselves (``attend`` is the CuPy step's kernel, for both attentions).
_ON_THE_WAY = {"<lambda>", "residual", "cross_attn"}
FAST = Path(FastTransformer.__module__.replace(".", "/")).parent.as_posix()


def _runners_of_a_decoder_layer(run) -> set:
    """The engine's functions that run a decoder layer while ``run()`` runs: from each call of a
    cross-attention (``cross_attn``, or the kernel ``attend`` with ``self_attn=False``) in
    attn/fast, the first caller that is neither a residual connection nor a cross-attention."""
    found = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or FAST not in Path(code.co_filename).as_posix():
            return
        if code.co_name == "cross_attn" or \
                code.co_name == "attend" and frame.f_locals.get("self_attn") is False:
            f = frame.f_back
            while f is not None and f.f_code.co_name in _ON_THE_WAY:
                f = f.f_back
            found.add(f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}")
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return found


@pytest.mark.parametrize("name", ["paper", "later"])
def test_one_engine_function_runs_a_decoder_layer_in_training_and_both_steps(name):
    """Training's forward, the NumPy step and the CuPy step (the stand-in where there is no GPU;
    the later block decodes with the NumPy step there) run their decoder layers through one
    function of the engine."""
    found = {}
    for where in ("numpy", "cupy"):
        with selected_backend(where):
            m = fast_model(name, "float64")
            src, tgt = m.xp.asarray(block_sources()), m.xp.asarray(np.asarray([[BOS, 5, 6]] * 4))
            found[f"{where} training"] = _runners_of_a_decoder_layer(lambda: m.forward(src, tgt))
            state = m.start_decoding(m.encode(src)[0], padding_mask(src))
            assert isinstance(state, DeviceDecodeState) == (where == "cupy" and name == "paper")
            found[f"{where} step"] = _runners_of_a_decoder_layer(lambda: m.decode_step(tgt[:, 0], state))
    assert all(f == {"layer.py:decoder_layer"} for f in found.values()), found


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(record(), indent=1) + "\n")
    print(f"wrote {FIXTURE}", file=sys.stderr)

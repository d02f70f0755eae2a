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
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import attn
from attn.block import Attention, parts, size
from attn.data import BOS, EOS, PAD
from attn.masks import padding_mask
from attn.decode import beam_search, greedy_decode
from attn.model import Transformer, TransformerConfig, log_softmax, parameter_count, parameter_shapes

FIXTURE = Path(__file__).parent / "fixtures" / "decoding.json"

#: The paper's block, the later one with every part, and two in between; float32 and float64.
BLOCKS = {
    "paper": dict(),
    "later": dict(norm_position="pre", norm_kind="rms", positional="rope", ffn="swiglu", kv_heads=2),
    "learned-pre-mqa": dict(norm_position="pre", positional="learned", kv_heads=1),
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


def searches(m, src) -> dict:
    """Greedy and beam search of model ``m`` on ``src``, as the fixtures record them."""
    return {"greedy": _result(greedy_decode(m, src, max_len=9, with_attention=True)),
            "beam": _result(beam_search(m, src, beam_size=3, max_len=9, with_attention=True))}


def decodings(name, dtype) -> dict:
    m = block_model(name, dtype)
    return searches(m, m.xp.asarray(block_sources()))


def record() -> dict:
    return {f"{name}/{dtype}": decodings(name, dtype) for name in BLOCKS for dtype in DTYPES}


def test_decoding_is_bit_identical_to_the_recorded_searches():
    expected = json.loads(FIXTURE.read_text())
    for key, want in expected.items():
        name, dtype = key.split("/")
        got = json.loads(json.dumps(decodings(name, dtype)))
        assert got == want, f"{key}: decoding changed"
    assert any(len(t) < 9 for t in expected["paper/float64"]["greedy"]["tokens"])    # EOS is reached


# ----------------------------------------------------------------------------- the parts


@pytest.mark.parametrize("field, value", [("norm_kind", "batch"), ("norm_position", "sandwich"), ("positional", "alibi"),
                                          ("ffn", "geglu"), ("ffn", ["relu"])])
def test_a_kind_no_part_knows_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"TransformerConfig: {field} must be one of .*got {re.escape(repr(value))}"):
        TransformerConfig(**{field: value})


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_the_parts_declare_every_parameter_of_a_layer(name):
    """A layer's parameters are its parts' (two norms and an attention more in a decoder layer)."""
    cfg = block_model(name, "float64").config
    block, D, shapes = parts(cfg), cfg.d_model, parameter_shapes(cfg)
    layer = {k.split(".", 2)[2]: v for k, v in shapes.items() if k.startswith("decoder.0.")}
    declared = {**{f"self_attn.{n}": s for n, s in block.self_attention.shapes(D).items()},
                **{f"cross_attn.{n}": s for n, s in block.cross_attention.shapes(D).items()},
                **{f"ffn.{n}": s for n, s in block.ffn.shapes(D).items()},
                **{f"norm{i}.{n}": s for i in (1, 2, 3) for n, s in block.norm.shapes(D).items()}}
    assert layer == declared
    assert parameter_count(cfg) == size(shapes)


#: A comparison of a block option's string (Python's ``==``, JavaScript's ``===`` and their negations),
#: or a table looked up by a part's kind (a part's own fields say what to run: ask them).
OPTION = re.compile(r'(==|!=) *"(rms|layer|pre|post|rope|learned|sinusoidal|swiglu|relu)"|'
                    r'\b(norm|norm_kind|positional|ffn) (not )?in \(|'
                    r'\b(norm|placement|positions|ffn)\.kind\]')
ROOT = Path(attn.__file__).parent.parent
#: The comparisons left outside attn/block.py, per file: none in the course, the engine, the
#: benchmarks' twin, the site's export or the page (web/attn/model.js declares its parts as a table).
LEFT: dict = {}


def _comparisons(files) -> dict:
    found = {}
    for f in files:
        n = sum(bool(OPTION.search(line)) for line in f.read_text(encoding="utf-8").splitlines())
        if n and f.name != "block.py":
            found[f.relative_to(ROOT).as_posix()] = n
    return found


def test_no_course_module_but_the_block_compares_an_options_string():
    """The block is declared once: the model, decoding and evaluation ask its parts."""
    root = ROOT / "attn"
    assert _comparisons([*root.glob("*.py"), *root.glob("training/*.py")]) == {}


def test_the_engine_the_tools_and_the_page_compare_no_more_option_strings_than_counted():
    """The fast engine and the PyTorch twin dispatch on the parts too; what is left is counted
    (a new comparison fails here: ask the part, or add what it lacks to attn/block.py)."""
    files = [*(ROOT / "attn").rglob("*.py"), *(ROOT / "web" / "attn").glob("*.js")]
    found = _comparisons(files)
    assert found == LEFT, found
    assert sum(found.values()) <= 10


# ----------------------------------------------------------------------------- one decoder layer


def _callers_of_the_cross_attention(run) -> set:
    """The functions that call a cross-attention while ``run()`` runs: the ones running a decoder layer."""
    forward = Attention.forward.__code__
    callers = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is forward and frame.f_locals.get("name") == "cross_attn":
            callers.add(f"{Path(frame.f_back.f_code.co_filename).name}:{frame.f_back.f_code.co_name}")
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return callers


@pytest.mark.parametrize("name", ["paper", "later"])
def test_one_function_runs_a_decoder_layer_in_training_and_decoding(name):
    m = block_model(name, "float64")
    src, tgt = m.xp.asarray(block_sources()), m.xp.asarray([[BOS, 5, 6]] * 4)
    training = _callers_of_the_cross_attention(lambda: m.forward(src, tgt))
    memory, _ = m.encode(src)
    state = m.start_decoding(memory, padding_mask(src))
    decoding = _callers_of_the_cross_attention(lambda: m.decode_step(tgt[:, 0], state))
    assert training == decoding == {"model.py:decoder_layer_forward"}


def test_a_decode_step_is_the_training_forwards_last_position():
    """The cache changes what is computed, not the numbers: position t's log-probabilities
    by steps equal those of one forward over the prefix, in float64 to rounding."""
    m = block_model("later", "float64")
    src, tgt = m.xp.asarray(block_sources()), m.xp.asarray([[BOS, 5, 6, 7]] * 4)
    memory, _ = m.encode(src)
    state = m.start_decoding(memory, padding_mask(src))
    for t in range(tgt.shape[1]):
        logp, state, _ = m.decode_step(tgt[:, t], state)
    full = log_softmax(m.forward(src, tgt)[0])[:, -1]
    np.testing.assert_allclose(logp, full, rtol=0, atol=1e-12)


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(record(), indent=1) + "\n")
    print(f"wrote {FIXTURE}", file=sys.stderr)

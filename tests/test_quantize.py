"""int8 weights (attn/quantize.py): the error bound |w - q * scale| <= scale / 2 on every draw, the
invariants (exact multiples of the scale, sign symmetry, zero rows), each typical mistake caught by
the registration's invariants, an int8 model that runs on the fly in the readable model, and its
checkpoint read back by attn-translate's loader."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import attn.backend as B
from attn.checkpoint import CheckpointError, save_npz
from attn.model import Transformer, TransformerConfig
from attn.quantize import (Int8Params, dequantize_int8, int8_round_trip, matrix_errors, quantize_int8,
                           quantize_matrix, quantize_model, save_int8)
from attn.testing import LAYERS, InvariantError
from attn.testing import quantize as Q
from attn.translate import load_translator

matrices = hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=3, max_side=6),
                      elements=st.floats(-1e6, 1e6, allow_nan=False, width=64))


@given(matrices)
def test_each_number_is_within_half_a_step_and_q_is_int8(w):
    q, scale = quantize_int8(w)
    assert q.dtype == np.int8 and np.abs(q.astype(int)).max(initial=0) <= 127
    assert scale.shape == w.shape[:-1] + (1,) and (scale >= 0).all()
    err = np.abs(w - dequantize_int8(q, scale))
    assert (err <= scale / 2 + 4 * np.finfo(float).eps * np.abs(w)).all()
    live = scale[..., 0] > 0
    assert (np.abs(q.astype(int)).max(axis=-1)[live] == 127).all()      # each row uses the whole range


@given(matrices)
def test_the_registered_invariants_hold_for_the_library(w):
    Q.assert_int8_properties(int8_round_trip, w.reshape(-1, w.shape[-1]))


@given(matrices)
def test_negation_zero_rows_and_exact_multiples(w):
    q, scale = quantize_int8(w)
    qn, sn = quantize_int8(-w)
    assert np.array_equal(qn, -q) and np.array_equal(sn, scale)
    w0 = w.copy()
    w0[..., 0, :] = 0.0
    with np.errstate(divide="raise", invalid="raise"):                                     # no 0 / 0 behind a zero row
        q0, s0 = quantize_int8(w0)
    assert not q0[..., 0, :].any() and not s0[..., 0, :].any() and not dequantize_int8(q0, s0)[..., 0, :].any()
    k = np.clip(np.round(w / np.maximum(np.abs(w).max(), 1)), -127, 127)
    k[..., 0] = 127                                                      # step 2**-5 exactly: 127 * 2**-5 / 127
    assert np.array_equal(int8_round_trip(k * 2.0 ** -5), k * 2.0 ** -5)


@pytest.mark.parametrize("mistake", LAYERS["int8"].mistakes, ids=lambda m: m.looks)
def test_the_invariants_catch_each_typical_mistake(mistake):
    """Breaking what the registration guards: each mistake's round trip fails its invariants on the
    explicit examples."""
    with pytest.raises(InvariantError):
        for ex in LAYERS["int8"].explicit:
            Q.assert_int8_properties(lambda w, ex=ex: mistake.wrong(Q.Example((("w", B.to_host(w)),)), None),
                                     ex.get("w"))


def test_matrices_quantise_per_output_channel():
    w = np.array([[1.0, 100.0], [0.5, -50.0], [0.25, 25.0]], dtype=np.float32)       # (Din 3, Dout 2): columns
    q, s = quantize_matrix("encoder.0.ffn.w1", w)
    assert s.shape == (1, 2) and np.allclose(s, [[1 / 127, 100 / 127]]) and q[0].tolist() == [127, 127]
    q, s = quantize_matrix("src_embedding.weight", w)                                # a table: rows
    assert s.shape == (3, 1) and q[:, 1].tolist() == [127, -127, 127]


@pytest.fixture(scope="module")
def tiny():
    cfg = TransformerConfig(vocab_size=12, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.0, max_len=16, positional="learned")
    return Transformer(cfg, seed=3)


def test_an_int8_model_dequantises_on_the_fly_to_the_round_tripped_weights(tiny):
    q = quantize_model(tiny)
    assert isinstance(q.params, Int8Params) and set(q.params) == set(tiny.params)
    matrices = [k for k, v in tiny.params.items() if v.ndim == 2]
    assert set(q.params.quantized) == set(matrices) and len(matrices) > 10      # embeddings and positions too
    by_hand = Transformer(tiny.config, params={k: int8_round_trip(v.T).T if v.ndim == 2 and not k.endswith(
        ".weight") else int8_round_trip(v) if v.ndim == 2 else v for k, v in tiny.params.items()})
    src, tgt = np.array([[4, 5, 6, 2]]), np.array([[1, 7, 8]])
    out = lambda m: B.to_host(m.forward(src, tgt)[0])          # noqa: E731
    assert np.array_equal(out(q), out(by_hand))
    assert 0 < np.abs(out(q) - out(tiny)).max() < 0.05
    assert max(r for _, _, r in matrix_errors(tiny.params, q.params).values()) <= 1 + 1e-5
    channels = lambda k, v: v.shape[0] if k.endswith(".weight") else v.shape[1]      # noqa: E731
    assert q.params.nbytes() == sum(v.size + 4 * channels(k, v) if v.ndim == 2 else 4 * v.size
                                    for k, v in tiny.params.items())


def test_an_int8_checkpoint_loads_as_a_translator_and_refuses_a_damaged_one(tiny, tmp_path):
    from attn.data import Vocab
    vocab = Vocab(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(8)])
    path = save_int8(tiny, tmp_path / "int8.npz", {"vocab": vocab.to_json()})
    model, _ = load_translator(path)
    assert isinstance(model.params, Int8Params)
    want = quantize_model(tiny).forward(np.array([[4, 2]]), np.array([[1, 5]]))[0]
    assert np.array_equal(model.forward(np.array([[4, 2]]), np.array([[1, 5]]))[0], want)
    from attn.checkpoint import load_npz
    arrays, meta = load_npz(path)
    name = "encoder.0.ffn.w1"
    for key, bad in ((f"int8/{name}", arrays[f"int8/{name}"].astype(np.int16)),
                     (f"scale/{name}", arrays[f"scale/{name}"].T.copy()),
                     (f"scale/{name}", -arrays[f"scale/{name}"])):
        save_npz(tmp_path / "bad.npz", {**arrays, key: bad}, meta)
        with pytest.raises(CheckpointError, match=name):
            load_translator(tmp_path / "bad.npz")


def test_the_command_writes_an_int8_checkpoint_and_export_takes_it(tiny, tmp_path, capsys):
    from attn.data import Vocab
    from attn.quantize import main
    from attn.site.export import main as export_main
    vocab = Vocab(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(8)])
    tiny.save(tmp_path / "fp32.npz", extra_meta={"vocab": vocab.to_json()})
    assert main([str(tmp_path / "fp32.npz"), str(tmp_path / "int8.npz")]) == 0
    said = capsys.readouterr().out
    assert "bytes in float32" in said and said.count("max error/own bound") == sum(v.ndim == 2 for v in tiny.params.values())
    assert main([str(tmp_path / "int8.npz"), str(tmp_path / "again.npz")]) == 2              # int8 already
    assert export_main([str(tmp_path / "int8.npz"), str(tmp_path / "web"), "--int8"]) == 0
    assert "in float32 it would be" in capsys.readouterr().out
    assert export_main([str(tmp_path / "fp32.npz"), str(tmp_path / "web2"), "--int8", "--float16"]) == 2
    assert "give one" in capsys.readouterr().err

"""int8 weights on the fast engine (:mod:`attn.fast.core.int8`), on every backend this machine has.

* Each matrix a layer reads is ``dequantize(quantize(w))``: the int8 fast model's logits, greedy
  and beam tokens and scores equal, bit for bit, those of a float32 fast model made from the
  round-tripped weights (the same arithmetic on the same numbers); and a dequantiser broken on
  purpose (one scale for a whole block) fails that check.
* Against the readable engine's int8 model (:class:`attn.quantize.Int8Params`): the same greedy
  and beam tokens, logits and scores within float32 rounding (an int8 model is float32: its
  scales are); a language model's logits, and its sampled tokens, cached and not.
* What it holds: the int8 bytes, shared with the readable model, no float32 copy (tracemalloc);
  a float32 model keeps its arena and its fused views as before.
* Training refuses, naming what asked: the backward, both engines' optimizers, ``attn-train
  --resume-from`` an int8 checkpoint.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import attn.backend as B
from attn import decode
from attn.engine import for_inference, get
from attn.fast import FastTransformer
from attn.fast.core import int8 as I
from attn.fast.core.arena import Arena
from attn.gradcheck import rel_error
from attn.model import Transformer, TransformerConfig
from attn.quantize import Int8Params, Int8TrainingError, dequantize_int8, quantize_model, quantize_params

BLOCKS = {"paper": dict(positional="learned"),
          "later": dict(ffn="swiglu", norm_kind="rms", positional="rope", norm_position="pre", kv_heads=1,
                        share_embeddings=False, tgt_vocab_size=11)}
SRC = np.array([[4, 5, 6, 2, 0], [7, 8, 9, 10, 2], [6, 0, 0, 0, 0]])
TGT = np.array([[1, 5, 6], [1, 7, 8], [1, 4, 4]])


def _float_model(block: str, **more) -> Transformer:
    cfg = TransformerConfig(**{"vocab_size": 12, "d_model": 8, "n_heads": 2, "d_ff": 16, "n_encoder_layers": 1,
                               "n_decoder_layers": 2, "dropout": 0.0, "max_len": 16, **BLOCKS[block], **more})
    return Transformer(cfg, seed=3)


def _on_device(model: Transformer) -> Transformer:
    return Transformer(model.config, params={k: B.to_device(v) for k, v in model.params.items()})


def _round_tripped(model: Transformer) -> dict:
    """The float32 weights an int8 model computes with, made by hand: ``q * scale`` of each matrix."""
    q = quantize_params(model.params)
    return {k: dequantize_int8(*q.quantized[k]).copy() if k in q.quantized else q.vectors[k].copy() for k in q}


def _searches(model):
    src = B.to_device(SRC)
    return [decode.greedy_decode(model, src, max_len=6), decode.beam_search(model, src, beam_size=3, max_len=6)]


def _once_on_cupy(block: str, which: str) -> None:
    """Each block once on CuPy (the stand-in runs a kernel's NumPy twin at a time: slow), in the test
    that names it."""
    if B.get_backend() == "cupy" and block != which:
        pytest.skip(f"the {block} block runs on CuPy in the other test")


def assert_sees_round_trip(model: Transformer) -> None:
    """The int8 fast model of ``model`` computes what a float32 fast model of its round-tripped
    weights computes, bit for bit: logits (training's forward and evaluation's), greedy and beam."""
    int8 = FastTransformer.from_model(quantize_model(model))
    by_hand = FastTransformer(model.config, params=_round_tripped(model))
    src, tgt = B.to_device(SRC), B.to_device(TGT)
    for m in (int8, by_hand):
        m.workers = 1
    assert np.array_equal(B.to_host(int8.forward(src, tgt)[0]), B.to_host(by_hand.forward(src, tgt)[0]))
    assert np.array_equal(B.to_host(int8.logits(src, tgt)), B.to_host(by_hand.logits(src, tgt)))
    for got, want in zip(_searches(int8), _searches(by_hand)):
        assert got.tokens == want.tokens and np.array_equal(got.scores, want.scores)


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_each_layer_reads_the_round_tripped_matrices(backend, block):
    _once_on_cupy(block, "paper")                  # the device decoding state
    assert_sees_round_trip(_on_device(_float_model(block)))


def test_a_dequantiser_broken_on_purpose_fails_the_check(monkeypatch):
    """One scale for a whole block (the largest), not one a channel: the check must fail."""
    monkeypatch.setattr(I, "dequantize_int8", lambda q, s: q.astype(s.dtype) * s.max())
    with pytest.raises(AssertionError):
        assert_sees_round_trip(_float_model("paper"))


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_fast_int8_decodes_as_the_readable_int8_model(backend, block):
    _once_on_cupy(block, "later")                  # the host decoding state, on CuPy
    readable = quantize_model(_on_device(_float_model(block)))
    fast = for_inference(quantize_model(_on_device(_float_model(block))))        # the default: fast for int8
    assert isinstance(fast, FastTransformer) and isinstance(fast.arena, I.Int8Arena)
    src, tgt = B.to_device(SRC), B.to_device(TGT)
    want = B.to_host(readable.forward(src, tgt)[0])
    assert rel_error(want, B.to_host(fast.logits(src, tgt))) < 1e-5              # float32 rounding
    for got, ref in zip(_searches(fast), _searches(readable)):
        assert got.tokens == ref.tokens
        assert np.allclose(got.scores, ref.scores, rtol=1e-5, atol=1e-5)


def test_fast_int8_language_model_and_sampling():
    from attn.sample import Sampler, generate
    model = _float_model("later", n_encoder_layers=0, share_embeddings=True, tgt_vocab_size=None)
    readable, fast = quantize_model(model), for_inference(quantize_model(model), "fast")
    ids = np.array([[4, 5, 6, 7, 8], [3, 4, 5, 6, 9]])
    assert rel_error(readable.forward(None, ids)[0], fast.logits(None, ids)) < 1e-5
    for cached in (True, False):
        want = generate(readable, [4, 5], 8, Sampler(0.9, 5), seed=1, cached=cached)
        assert generate(fast, [4, 5], 8, Sampler(0.9, 5), seed=1, cached=cached) == want


def test_an_int8_model_holds_its_int8_bytes_shared_with_the_readable_model():
    model = _float_model("paper", vocab_size=1000, d_model=128, d_ff=256)
    floats = sum(int(v.nbytes) for v in model.params.values())
    readable = quantize_model(model)
    tracemalloc.start()
    try:
        fast = FastTransformer.from_model(readable)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert fast.arena.nbytes() == readable.params.nbytes() < 0.3 * floats
    assert held < fast.arena.nbytes() + 0.05 * floats     # its blocks (and views, layout), no float32 copy
    for name, (q, s) in readable.params.quantized.items():                  # the readable model reads them
        block = fast.arena.layout.members[name].block
        assert np.shares_memory(q, fast.arena.q[block]) and np.shares_memory(s, fast.arena.scale[block])


def test_a_float32_model_keeps_its_arena_and_views():
    fast = FastTransformer(_float_model("paper").config)
    assert type(fast.arena) is Arena and I.each_for(fast.arena) is not I.PerUse
    F = fast._fuse()
    assert isinstance(F.enc_qkv, list) and np.shares_memory(F.enc_qkv[0][0], fast.arena.params)
    assert np.shares_memory(F.kv[0], fast.arena.params)


def test_training_an_int8_model_is_refused(tmp_path, capsys):
    from attn.data import Vocab
    from attn.optim import Adam
    from attn.quantize import save_int8
    from attn.train import main
    model = _float_model("paper")
    fast = for_inference(quantize_model(model))
    with pytest.raises(Int8TrainingError, match="FastTransformer.backward: an int8 model is for inference"):
        fast.backward(None, None)
    with pytest.raises(Int8TrainingError, match="optimizer"):
        get("fast").optimizer(fast)
    with pytest.raises(Int8TrainingError, match="Adam"):
        Adam(quantize_model(model).params, 8)
    vocab = Vocab(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(8)])
    path = save_int8(model, tmp_path / "int8.npz", {"vocab": vocab.to_json()})
    assert main(["--resume-from", str(path), "--reference", "--out", str(tmp_path / "run")]) == 2
    assert "--resume-from" in capsys.readouterr().err and isinstance(quantize_model(model).params, Int8Params)


def test_what_an_int8_model_cannot_be_is_refused():
    from attn.precision import PrecisionError
    model = _float_model("paper")
    with pytest.raises(ValueError, match="float32"):
        FastTransformer(model.config, dtype="float64", params=quantize_params(model.params))
    with pytest.raises(PrecisionError, match="int8"):
        FastTransformer(model.config, params=quantize_params(model.params), precision="tf32")
    fast = for_inference(quantize_model(model))
    fast.params = dict(fast.params)                                     # a float dict in its place
    with pytest.raises(ValueError, match="read-only"):
        fast.logits(B.to_device(SRC), B.to_device(TGT))


def test_attn_translate_decodes_int8_on_the_fast_engine_unless_told(tmp_path, capsys, monkeypatch):
    import attn.translate as T
    from attn.data import Vocab
    from attn.quantize import save_int8
    vocab = Vocab(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(8)])
    path = save_int8(_float_model("paper"), tmp_path / "int8.npz", {"vocab": vocab.to_json()})
    ran = []

    def spy(model, engine=None):
        out = for_inference(model, engine)
        ran.append(type(out))
        return out
    monkeypatch.setattr(T, "for_inference", spy)
    outputs = []
    for flags in ([], ["--reference"], ["--draft", str(path)]):           # the last: speculative, int8 both
        assert T.main(["--checkpoint", str(path), "--backend", "numpy", *flags, "w1 w2 w3", "w4"]) == 0
        outputs.append(capsys.readouterr().out)
    assert ran == [FastTransformer, Transformer, FastTransformer, FastTransformer]
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].count("\n") == 2

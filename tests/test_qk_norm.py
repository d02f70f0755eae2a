"""QK-norm (``qk_norm``, OLMo 2 and Gemma 3): RMSNorm over each head's queries and keys, a gain
(Dh,) each, before rotary positions and the scores, in every attention of the block
(attn/block.py). Its backward against central differences in float64 (the attention part and
the whole model, on NumPy and the CuPy stand-in); the bound it puts on the scores; both engines
(the fast engine's training steps and its decoding, the PyTorch twin) against the readable model;
the CLI and old checkpoints. The page computes it too (tests/test_web_later_block.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attn.backend as B
from attn import decode
from attn.bench.twin import torch_available, torch_loss, torch_transformer
from attn.block import QK_GAINS, Attention, later_block, parts
from attn.fast import FastTransformer
from attn.gradcheck import rel_error
from attn.loss import cross_entropy
from attn.masks import padding_mask
from attn.model import Transformer, TransformerConfig, parameter_shapes
from attn.testing import causal, check_gradients, normals
from attn.training.config import config_from_argv
from test_fast_later import assert_trains_alike
from test_model import GRAD_COST_CAP, cases, check_model_gradients

dev, host = B.to_device, B.to_host


def with_random_gains(model, seed=0):
    """QK-norm's gains start at one: draw them away from it, so that a gain left out shows."""
    rng = np.random.default_rng(seed)
    for name, p in model.params.items():
        if name.rsplit(".", 1)[1] in QK_GAINS:
            p[...] = model.xp.asarray(rng.uniform(0.5, 2.0, p.shape).astype(p.dtype))
    return model


# ----------------------------------------------------------------------------- the part


@st.composite
def attention_cases(draw):
    kv = draw(st.integers(1, 2))
    H = kv * draw(st.integers(1, 2))
    rope = draw(st.booleans())
    Dh = 2 * draw(st.integers(1, 2)) if rope else draw(st.integers(2, 3))   # one feature: a head normed to +-1
    return dict(B=draw(st.integers(1, 2)), T=draw(st.integers(1, 4)), S=draw(st.integers(1, 4)), H=H, kv=kv,
                Dh=Dh, rope=rope, self_attn=draw(st.booleans()))


@given(c=attention_cases(), data=st.data())
def test_qk_norm_attention_gradients(backend, c, data):
    """The attention part with QK-norm (grouped-query heads, rotary positions or not): every
    input's and parameter's gradient, the gains' summed over sentences, positions and heads."""
    D = c["H"] * c["Dh"]
    part = Attention(c["H"], c["kv"], 0.0, 10000.0 if c["rope"] else None, qk_norm=True)
    shapes = part.shapes(D)
    assert {n: shapes[n] for n in QK_GAINS} == {"q_gamma": (c["Dh"],), "k_gamma": (c["Dh"],)}
    params = {n: dev(data.draw(normals(s))) for n, s in shapes.items()}
    mask = dev(causal(c["T"])) if c["self_attn"] else None

    def forward(x_q, x_kv=None, **prm):
        return part.forward(x_q, x_q if x_kv is None else x_kv, mask, {f"a.{n}": a for n, a in prm.items()}, "a")

    def backward(dout, cache):
        grads = {}
        dx_q, dx_kv = part.backward(dout, cache, "a", grads)
        dx = (dx_q + dx_kv,) if c["self_attn"] else (dx_q, dx_kv)
        return (*dx, *(grads[f"a.{n}"] for n in part.names))

    args = {"x_q": dev(data.draw(normals((c["B"], c["T"], D))))}
    if not c["self_attn"]:
        args["x_kv"] = dev(data.draw(normals((c["B"], c["S"], D))))
    check_gradients(f"qk_norm attention({c})", forward, backward, {**args, **params}, (*args, *part.names))


@given(c=attention_cases(), scale=st.sampled_from([1.0, 1e3, 1e6]), data=st.data())
def test_qk_norm_bounds_every_score(backend, c, scale, data):
    """|q.k| / sqrt(Dh) <= sqrt(Dh) max|g_q| max|g_k| (Cauchy-Schwarz: a normed head has norm
    sqrt(Dh) before its gain), however large the inputs; rotary positions keep the norms."""
    D = c["H"] * c["Dh"]
    part = Attention(c["H"], c["kv"], 0.0, 10000.0 if c["rope"] else None, qk_norm=True)
    p = {f"a.{n}": dev(data.draw(normals(s))) for n, s in part.shapes(D).items()}
    x = dev(data.draw(normals((c["B"], c["T"], D))) * scale)
    _, cache = part.forward(x, x, None, p, "a")
    q, k = host(cache.attn.q), host(cache.attn.k)
    scores = np.abs(q @ k.swapaxes(-1, -2)) / np.sqrt(c["Dh"])
    bound = np.sqrt(c["Dh"]) * np.abs(host(p["a.q_gamma"])).max() * np.abs(host(p["a.k_gamma"])).max()
    assert scores.max() <= bound * (1 + 1e-9)


def test_qk_norm_is_a_part_named_by_later_block_and_off_by_default():
    cfg = TransformerConfig(vocab_size=7, d_model=8, n_heads=2, d_ff=4, n_encoder_layers=1, n_decoder_layers=1)
    assert not parts(cfg).self_attention.qk_norm and later_block(cfg) == []
    assert not any("gamma" in n and "norm" not in n for n in parameter_shapes(cfg))
    on = dataclasses.replace(cfg, qk_norm=True)
    assert later_block(on) == ["qk_norm=True"]
    shapes = parameter_shapes(on)
    added = {n: s for n, s in shapes.items() if n not in parameter_shapes(cfg)}
    assert added == {f"{layer}.{g}": (4,) for layer in ("encoder.0.self_attn", "decoder.0.self_attn",
                                                        "decoder.0.cross_attn") for g in QK_GAINS}
    model = Transformer(on)
    assert all(np.all(host(model.params[n]) == 1) for n in added)          # the gains start at one
    with pytest.raises(ValueError, match="qk_norm must be True or False, got 'yes'"):
        TransformerConfig(qk_norm="yes")


# ----------------------------------------------------------------------------- the model


@settings(max_examples=4)
@given(case=cases(max_cost=GRAD_COST_CAP).map(lambda c: c._replace(cfg=dataclasses.replace(c.cfg, qk_norm=True))))
def test_every_parameter_gradient_matches_central_differences_with_qk_norm(backend, case):
    check_model_gradients(case, dropout_seed=None)


def _config(**options):
    return TransformerConfig(**{"vocab_size": 13, "d_model": 16, "n_heads": 4, "d_ff": 12, "n_encoder_layers": 2,
                                "n_decoder_layers": 2, "dropout": 0.0, "label_smoothing": 0.1, "max_len": 32,
                                "qk_norm": True, **options})


LATER = {"norm_kind": "rms", "positional": "rope", "ffn": "swiglu", "kv_heads": 2, "norm_position": "pre"}


def _batch():
    rng = np.random.default_rng(5)
    src, tgt = rng.integers(4, 13, (4, 7)), rng.integers(4, 13, (4, 6))
    src[1, 4:] = 0
    tgt[2, 3:] = 0
    return (dev(a) for a in (src, tgt[:, :-1].copy(), tgt[:, 1:].copy()))


@pytest.mark.parametrize("options,attention", [({}, "plain"), (LATER, "plain"), ({**LATER, "kv_heads": 1}, "flash")],
                         ids=["paper", "later", "later-mqa-flash"])
def test_fast_steps_match_readable_float64(backend, options, attention):
    """Three steps of each engine from the same parameters (the gains drawn): the logits, the
    loss, every gradient and the parameters Adam leaves, to float64 rounding; the batch split
    over two threads on NumPy."""
    cfg = _config(**options)
    ref = with_random_gains(Transformer(cfg, seed=3, dtype="float64"))
    fast = FastTransformer(cfg, dtype="float64", params={k: v.copy() for k, v in ref.params.items()},
                           attention=attention)
    fast.workers = 2
    src, tgt_in, tgt_out = _batch()
    assert_trains_alike(ref, fast, src, tgt_in, tgt_out, cfg.label_smoothing)


@pytest.mark.parametrize("beam,use_cache", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("options", [{}, LATER], ids=["paper", "later"])
def test_fast_decoding_matches_readable(backend, options, beam, use_cache):
    """Greedy and beam search, with the cache (on CuPy the stand-in's step) and without: the
    readable decoder's tokens and scores."""
    ref = with_random_gains(Transformer(_config(**options), seed=1, dtype="float64"))
    fast = FastTransformer.from_model(ref)
    src = dev(np.array([[4, 5, 6, 7, 0], [8, 5, 4, 6, 7], [6, 0, 0, 0, 0], [7, 7, 5, 12, 0]]))
    if beam == 1:
        want, got = (decode.greedy_decode(m, src, max_len=9, use_cache=use_cache) for m in (ref, fast))
    else:
        want, got = (decode.beam_search(m, src, beam_size=beam, max_len=9, use_cache=use_cache) for m in (ref, fast))
    assert got.tokens == want.tokens
    assert np.allclose(got.scores, want.scores, rtol=1e-12, atol=1e-12)


def test_a_decode_step_is_the_training_forwards_last_position(backend):
    """The readable cache holds normed keys: position t's log-probabilities by steps equal one
    forward over the prefix."""
    from attn.model import log_softmax
    m = with_random_gains(Transformer(_config(**LATER), seed=2, dtype="float64"))
    src, tgt_in, _ = _batch()
    memory, _ = m.encode(src)
    state = m.start_decoding(memory, padding_mask(src))
    tgt = dev(np.array([[1, 5, 6, 7]] * 4))
    for t in range(4):
        logp, state, _ = m.decode_step(tgt[:, t], state)
    np.testing.assert_allclose(host(logp), host(log_softmax(m.forward(src, tgt)[0])[:, -1]), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- the PyTorch twin


@pytest.mark.skipif(not torch_available(), reason="PyTorch is not installed")
@pytest.mark.parametrize("options", [{}, {**LATER, "kv_heads": 2}], ids=["paper", "later"])
def test_the_pytorch_twin_computes_qk_norm(options):
    """attn's parameters loaded into the twin (nn.RMSNorm over each head): the same logits, loss
    and every gradient in float64, and cached decoding's log-probabilities."""
    import torch
    cfg = _config(**options)
    ours = with_random_gains(Transformer(cfg, seed=4, dtype="float64"))
    theirs = torch_transformer(cfg, dtype="float64")
    theirs.load_attn_params(ours.params)
    src, tgt_in, tgt_out = (host(a) for a in _batch())
    logits, cache = ours.forward(dev(src), dev(tgt_in))
    loss, d = cross_entropy(logits, dev(tgt_out), cfg.label_smoothing)
    grads = ours.backward(d, cache)
    t_logits = theirs(torch.as_tensor(src), torch.as_tensor(tgt_in))
    t_loss = torch_loss(t_logits, torch.as_tensor(tgt_out), cfg.label_smoothing)
    t_loss.backward()
    assert rel_error(host(logits), t_logits.detach().numpy()) < 1e-12
    assert abs(float(loss) - t_loss.item()) < 1e-12
    t_grads = theirs.attn_params(grads=True)
    assert set(t_grads) == set(grads)
    for k in grads:
        assert rel_error(host(grads[k]), t_grads[k]) < 1e-9, k


# ----------------------------------------------------------------------------- the CLI, old files


def test_attn_train_takes_qk_norm_and_old_checkpoints_load_without_it(tmp_path):
    assert config_from_argv(["--qk-norm"]).model_config(20).qk_norm is True
    assert config_from_argv([]).model_config(20).qk_norm is False
    cfg = TransformerConfig(vocab_size=7, d_model=8, n_heads=2, d_ff=4, n_encoder_layers=1, n_decoder_layers=1)
    model = Transformer(cfg, seed=1)
    old = tmp_path / "old.npz"
    meta = {k: v for k, v in cfg.to_dict().items() if k != "qk_norm"}       # written before the field
    from attn.checkpoint import save_npz
    save_npz(old, model.state_arrays(), {"format": "attn-checkpoint-1", "config": meta})
    loaded = Transformer.load(old)
    assert loaded.config == cfg and not loaded.block.self_attention.qk_norm


def test_the_fast_step_with_qk_norm_keeps_the_steps_targets_on_the_stand_in():
    """The later block with QK-norm, its training step counted on the CuPy stand-in as
    tests/test_counts.py counts the others': no host sync, nothing from the memory pool, one Adam
    launch, nothing a CUDA graph's capture refuses."""
    from attn.bench import counts as C
    from attn.bench.presets import BENCH_PRESETS, BenchConfig, later_block as later_model
    bc = BENCH_PRESETS["quick"]
    bc = BenchConfig(**{**bc.__dict__, "model": {**later_model(bc.model), "qk_norm": True}})
    tally, syncs, _ = C.count_at(bc, ("train_step",))["train_step"]
    assert (syncs, tally.allocations, tally.phases.get("optimizer")) == (0, 0, 1), tally.ops
    assert C.capture_survey(bc, "quick, later block, QK-norm")["total"] == 0

"""The decoder-only language model: a config of the same block (``n_encoder_layers=0``), run by
the same layer functions. Its float64 gradient against central differences on every backend,
the invariants a reader states aloud (no look-ahead; cached decoding equals the full forward),
and what the config refuses."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attn.backend as B
from attn.block import parts
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig, log_softmax, parameter_count, parameter_shapes
from test_model import GRAD_EXAMPLES, GRAD_TOL, tensor_gradient_error

PAPER = dict(vocab_size=7, d_model=4, n_heads=2, d_ff=3, n_decoder_layers=2, label_smoothing=0.1)   # post-norm, sinusoids
GPT = dict(vocab_size=7, d_model=4, n_heads=1, d_ff=3, n_decoder_layers=2, norm_position="pre",
           positional="learned", label_smoothing=0.0)
LATER = dict(vocab_size=7, d_model=8, n_heads=2, kv_heads=1, d_ff=3, n_decoder_layers=2, norm_position="pre",
             norm_kind="rms", positional="rope", ffn="swiglu", label_smoothing=0.1)


def lm_config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**dict(n_encoder_layers=0, dropout=0.0, max_len=8), **kw})


@st.composite
def lm_cases(draw, max_len: int = 5):
    """A tiny decoder-only config of any block options, its init seed, and a batch of ids (B, T)
    of real tokens (4..V-1) with the targets: the ids shifted by one."""
    H = draw(st.sampled_from([1, 2]))
    cfg = lm_config(vocab_size=draw(st.integers(5, 7)), d_model=4 * H, n_heads=H, d_ff=draw(st.integers(2, 5)),
                    n_decoder_layers=draw(st.integers(1, 2)),
                    norm_position=draw(st.sampled_from(["post", "pre"])),
                    positional=draw(st.sampled_from(["sinusoidal", "learned", "rope"])),
                    ffn=draw(st.sampled_from(["relu", "swiglu"])), norm_kind=draw(st.sampled_from(["layer", "rms"])),
                    kv_heads=draw(st.sampled_from([None, 1])), label_smoothing=draw(st.sampled_from([0.0, 0.1])),
                    max_len=max_len + 1)
    Bsz, T = draw(st.integers(1, 2)), draw(st.integers(1, max_len))
    text = np.array(draw(st.lists(st.integers(4, cfg.vocab_size - 1), min_size=Bsz * (T + 1),
                                  max_size=Bsz * (T + 1)))).reshape(Bsz, T + 1)
    return cfg, draw(st.integers(0, 2**16)), text[:, :-1], text[:, 1:]


def check_lm_gradients(cfg, seed, ids, targets, dropout_seed=None) -> dict:
    """Every parameter's analytic gradient against central differences of the float64 loss (every
    tensor, at every entry or at a few and along a direction: test_model.tensor_gradient_error);
    an AssertionError naming the parameters that disagree. Returns {name: relative error}."""
    model = Transformer(cfg, seed=seed, dtype="float64")
    ids, targets = B.to_device(ids), B.to_device(targets)

    def forward():
        return model.forward(None, ids, None if dropout_seed is None else B.DeviceRNG(dropout_seed))

    logits, cache = forward()
    _, dlogits = cross_entropy(logits, targets, cfg.label_smoothing)
    grads = model.backward(dlogits, cache)
    assert set(grads) == set(model.params)
    rng = np.random.default_rng(seed)
    errors = {name: tensor_gradient_error(lambda: cross_entropy(forward()[0], targets, cfg.label_smoothing)[0],
                                          grads[name], p, rng)
              for name, p in model.params.items()}
    bad = {k: v for k, v in errors.items() if not v < GRAD_TOL}
    assert not bad, "decoder-only backward disagrees with central differences for " + ", ".join(
        f"{k}: {v:.3g}" for k, v in bad.items())
    return errors


IDS = np.array([[4, 5, 6, 4], [6, 6, 5, 4]])
TARGETS = np.array([[5, 6, 4, 5], [6, 5, 4, 6]])


@settings(max_examples=GRAD_EXAMPLES)
@given(case=lm_cases())
@example(case=(lm_config(**PAPER), 3, IDS, TARGETS))
@example(case=(lm_config(**GPT), 4, IDS, TARGETS))
@example(case=(lm_config(**LATER), 5, IDS, TARGETS))
def test_every_parameter_gradient_of_a_decoder_only_model_matches_central_differences(backend, case):
    check_lm_gradients(*case)


@pytest.mark.parametrize("kw", [PAPER, LATER], ids=["paper", "later"])
def test_the_gradient_matches_with_dropout_under_fixed_masks(backend, kw):
    cfg = lm_config(**{**kw, "dropout": 0.3, "attention_dropout": 0.2, "relu_dropout": 0.1})
    check_lm_gradients(cfg, 1, IDS, TARGETS, dropout_seed=11)


def test_the_check_would_catch_a_wrong_backward(monkeypatch):
    """Not vacuous: the feed-forward's w2 gradient 1 % off fails, naming decoder layers' ffn.w2."""
    import attn.block as M
    names, forward, real, later, width = M.FFNS["relu"]

    def off(dout, cache):
        dx, dw1, db1, dw2, db2 = real(dout, cache)
        return dx, dw1, db1, dw2 * 1.01, db2

    monkeypatch.setitem(M.FFNS, "relu", (names, forward, off, later, width))
    with pytest.raises(AssertionError, match=r"decoder\.\d\.ffn\.w2"):
        check_lm_gradients(lm_config(**PAPER), 0, IDS, TARGETS)


@given(case=lm_cases(max_len=6), data=st.data())
def test_a_later_token_never_changes_an_earlier_logit(backend, case, data):
    cfg, seed, ids, _ = case
    T = ids.shape[1]
    t = data.draw(st.integers(0, T - 1))
    changed, later = ids.copy(), ids[:, t + 1:].shape
    new = data.draw(st.lists(st.integers(4, cfg.vocab_size - 1), min_size=int(np.prod(later)),
                             max_size=int(np.prod(later))))
    changed[:, t + 1:] = np.array(new, dtype=ids.dtype).reshape(later)
    model = Transformer(cfg, seed=seed, dtype="float64")
    a = B.to_host(model.forward(None, B.to_device(ids))[0])
    b = B.to_host(model.forward(None, B.to_device(changed))[0])
    np.testing.assert_array_equal(a[:, :t + 1], b[:, :t + 1])


@given(case=lm_cases(max_len=6))
def test_cached_decoding_equals_the_full_forward(backend, case):
    """decode_step, position by position through each layer's key/value cache, gives the full
    forward's log-probabilities at every position."""
    cfg, seed, ids, _ = case
    model = Transformer(cfg, seed=seed, dtype="float64")
    full = B.to_host(log_softmax(model.forward(None, B.to_device(ids))[0]))
    state, steps = model.start_decoding(None, None), []
    for t in range(ids.shape[1]):
        lp, state, cross = model.decode_step(B.to_device(ids[:, t]), state)
        assert cross == []
        steps.append(B.to_host(lp))
    np.testing.assert_allclose(np.stack(steps, axis=1), full, rtol=0, atol=1e-10)
    picked = state.select(B.to_device(np.array([0, 0])))
    assert picked.length == ids.shape[1] and picked.self_kv[0][0].shape[0] == 2


def test_the_block_has_no_cross_attention_and_the_model_no_encoder():
    cfg = lm_config(**GPT)
    assert parts(cfg).cross_attention is None and parts(lm_config(**PAPER, n_encoder_layers=1)).cross_attention
    names = set(parameter_shapes(cfg))
    assert not {n for n in names if n.startswith("encoder") or "cross_attn" in n or "norm2" in n or "src_" in n}
    assert {"embedding.weight", "tgt_pos.weight", "decoder.1.norm3.gamma", "decoder.norm.gamma"} <= names
    assert parameter_count(cfg) == sum(int(np.prod(s)) for s in parameter_shapes(cfg).values())
    model = Transformer(cfg)
    assert set(Transformer.attention_weights(model.forward(None, np.array([[4, 5]]))[1])) == {
        "decoder.0.self_attn", "decoder.1.self_attn"}


@pytest.mark.parametrize("kw, field", [
    (dict(n_encoder_layers=-1), "n_encoder_layers"),
    (dict(n_encoder_layers=0, share_embeddings=False), "share_embeddings"),
    (dict(n_encoder_layers=0, tgt_vocab_size=9), "share_embeddings"),
    (dict(n_decoder_layers=0), "n_decoder_layers")])
def test_an_inconsistent_config_is_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{**dict(vocab_size=7, d_model=4, n_heads=1, d_ff=3), **kw})


def test_forward_says_which_model_reads_a_source():
    lm, translator = Transformer(lm_config(**GPT)), Transformer(lm_config(**GPT, n_encoder_layers=1))
    with pytest.raises(ValueError, match="src must be None"):
        lm.forward(np.array([[4, 5]]), np.array([[4, 5]]))
    with pytest.raises(ValueError, match="has an encoder"):
        translator.forward(None, np.array([[4, 5]]))



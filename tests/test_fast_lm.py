"""The fast engine's decoder-only language model (:mod:`attn.fast.core.lm`) against the readable one, in
float64: logits, loss and every parameter's gradient, one pass or the batch split over the helper
threads, every block option drawn by hypothesis (few examples: ``tests/conftest.py``'s profiles),
and on the CuPy stand-in; with dropout, a step's gradient against central differences; sampling
through its cache equals the full forward; ``attn-train --task lm`` trains on it by default and
takes the readable engine's steps (``--reference`` keeps that one)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn.backend as B
from attn.fast import FastTransformer, cross_entropy as fast_ce
from attn.gradcheck import rel_error
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig


@st.composite
def lm_configs(draw):
    """Tiny decoder-only configs: the paper's block and the later one's options, nanoGPT's learned positions."""
    H = draw(st.sampled_from([1, 2]))
    D = H * draw(st.integers(2, 4)) * 2
    return TransformerConfig(
        vocab_size=draw(st.integers(5, 11)), d_model=D, n_heads=H, d_ff=draw(st.integers(2, 8)),
        n_encoder_layers=0, n_decoder_layers=draw(st.integers(1, 2)), dropout=0.0, label_smoothing=0.0, max_len=12,
        positional=draw(st.sampled_from(["sinusoidal", "learned", "rope"])),
        norm_position=draw(st.sampled_from(["post", "pre"])), norm_kind=draw(st.sampled_from(["layer", "rms"])),
        ffn=draw(st.sampled_from(["relu", "swiglu"])), kv_heads=draw(st.sampled_from([None, 1])),
        qk_norm=draw(st.booleans()))


def _ids(cfg, rows: int, T: int, seed: int):
    return np.random.default_rng(seed).integers(1, cfg.vocab_size, (rows, T + 1))


@given(cfg=lm_configs(), rows=st.integers(1, 4), T=st.integers(1, 8), workers=st.sampled_from([1, 2]),
       attention=st.sampled_from(["plain", "flash"]), seed=st.integers(0, 99))
def test_the_fast_language_model_computes_the_readable_ones_numbers(cfg, rows, T, workers, attention, seed):
    B.set_backend("numpy")
    ref = Transformer(cfg, seed=seed, dtype="float64")
    fast = FastTransformer(cfg, seed=seed, dtype="float64", attention=attention)
    fast.workers = workers
    fast.SPLIT_MIN_SIZE = 0                           # split even a tiny batch
    ids = _ids(cfg, rows, T, seed)
    logits, cache = ref.forward(None, ids[:, :-1])
    loss, d = cross_entropy(logits, ids[:, 1:], 0.0)
    grads = ref.backward(d, cache)
    f_logits, f_cache = fast.forward(None, ids[:, :-1])
    assert rel_error(f_logits, logits) < 1e-12
    assert rel_error(fast.logits(None, ids[:, :-1]), logits) < 1e-12
    f_loss, f_d = fast_ce(f_logits, ids[:, 1:], 0.0, inplace=True)
    assert abs(float(f_loss) - float(loss)) < 1e-12
    f_grads = fast.backward(f_d, f_cache)
    assert set(f_grads) == set(grads)
    for name in grads:
        assert rel_error(f_grads[name], grads[name]) < 1e-10, name


def test_a_fast_language_model_refuses_a_source_and_a_translator_none():
    B.set_backend("numpy")
    lm = FastTransformer(TransformerConfig(vocab_size=7, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=0,
                                           n_decoder_layers=1), dtype="float64")
    ids = np.ones((1, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="src must be None"):
        lm.forward(ids, ids)
    mt = FastTransformer(TransformerConfig(vocab_size=7, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1,
                                           n_decoder_layers=1), dtype="float64")
    with pytest.raises(ValueError, match="has an encoder"):
        mt.forward(None, ids)


def test_the_fast_gradient_with_dropout_is_the_slope_of_its_loss():
    """Dropout on (residual, attention, ReLU): the masks redrawn from a fresh generator of one
    seed, the gradient of a few parameters against central differences of the fast forward."""
    B.set_backend("numpy")
    cfg = TransformerConfig(vocab_size=7, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=0, n_decoder_layers=2,
                            dropout=0.3, attention_dropout=0.3, relu_dropout=0.3, label_smoothing=0.0,
                            max_len=8, positional="learned", norm_position="pre")
    fast = FastTransformer(cfg, seed=1, dtype="float64")
    ids = _ids(cfg, 2, 5, 1)

    def loss_grads():
        logits, cache = fast.forward(None, ids[:, :-1], B.DeviceRNG(5))
        loss, d = fast_ce(logits, ids[:, 1:], 0.0, inplace=True)
        return float(loss), {k: v.copy() for k, v in fast.backward(d, cache).items()}
    _, grads = loss_grads()
    for name in ("tgt_pos.weight", "decoder.1.ffn.w1", "embedding.weight"):
        p = fast.params[name]
        for idx in [(1, 2), (0, 3)]:
            keep, eps = p[idx], 1e-6
            p[idx] = keep + eps
            up = loss_grads()[0]
            p[idx] = keep - eps
            down = loss_grads()[0]
            p[idx] = keep
            assert abs((up - down) / (2 * eps) - grads[name][idx]) < 1e-6, (name, idx)


def test_sampling_through_the_fast_engine_is_the_full_forwards():
    """The fast model's cached decoding (the readable cache over the arena's parameters): each step's
    log-probabilities are the full forward's at that position."""
    from attn.model import log_softmax
    B.set_backend("numpy")
    cfg = TransformerConfig(vocab_size=9, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=0, n_decoder_layers=2,
                            dropout=0.0, max_len=8, positional="learned", norm_position="pre")
    fast = FastTransformer(cfg, seed=2, dtype="float64")
    ids = _ids(cfg, 2, 5, 2)[:, :-1]
    full = log_softmax(fast.forward(None, ids)[0])
    state = fast.start_decoding(None, None)
    for t in range(ids.shape[1]):
        logp, state, _ = fast.decode_step(ids[:, t], state)
        assert rel_error(logp, full[:, t]) < 1e-12


def test_attn_train_trains_a_language_model_on_the_fast_engine_with_the_readable_ones_steps(tmp_path, monkeypatch):
    """``attn-train --task lm`` picks the fast engine unless ``--reference``; in float64 without
    dropout both take the same steps (every step's loss) and write the same validation loss."""
    from attn.checkpoint import load_npz
    from attn.train import train
    from attn.training import evaluation
    from attn.training.config import config_from_argv
    B.set_backend("numpy")
    monkeypatch.setattr(evaluation, "plot_losses", lambda out, state: None)    # the figure: not tested here
    text = tmp_path / "t.txt"
    text.write_text("".join(f"{w} saw the {n}.\n" for w in ("ann", "bob", "cy") for n in ("sea", "moon")) * 8)
    argv = ["--task", "lm", "--text", str(text), "--char", "--context", "8", "--batch", "3", "--d-model", "8",
            "--heads", "2", "--d-ff", "16", "--layers", "2", "--steps", "5", "--eval-every", "5", "--minutes", "0",
            "--dtype", "float64", "--dropout", "0", "--quiet", "--backend", "numpy"]
    runs = {}
    for name, extra in (("fast", []), ("reference", ["--reference"])):
        config = config_from_argv([*argv, "--out", str(tmp_path / name), *extra])
        assert config.engine == name
        runs[name] = (train(config), load_npz(tmp_path / name / "checkpoint.npz")[0]["history/train_loss"])
    np.testing.assert_allclose(runs["fast"][1], runs["reference"][1], rtol=1e-10)
    assert runs["fast"][0]["val_loss"] == pytest.approx(runs["reference"][0]["val_loss"], rel=1e-10)
    assert runs["fast"][0]["steps"] == runs["reference"][0]["steps"] == 5


@pytest.mark.parametrize("options", [{"positional": "learned", "norm_position": "pre"},
                                     {"positional": "rope", "norm_kind": "rms", "ffn": "swiglu", "kv_heads": 1}],
                         ids=["gpt", "later"])
def test_the_fast_language_model_on_the_cupy_stand_in(options):
    """The same numbers where the arrays are CuPy's (the stand-in where no GPU is: the fused kernels'
    NumPy twins, the step memory): logits and every gradient equal the readable model's, float64."""
    from conftest import selected_backend
    cfg = TransformerConfig(vocab_size=9, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=0, n_decoder_layers=2,
                            dropout=0.0, label_smoothing=0.0, max_len=8, **options)
    ids = _ids(cfg, 3, 6, 4)
    with selected_backend("numpy"):
        ref = Transformer(cfg, seed=4, dtype="float64")
        logits, cache = ref.forward(None, ids[:, :-1])
        _, d = cross_entropy(logits, ids[:, 1:], 0.0)
        grads = ref.backward(d, cache)
    with selected_backend("fakecupy") as cp:
        fast = FastTransformer(cfg, seed=4, dtype="float64")
        x = cp.asarray(ids)
        f_logits, f_cache = fast.forward(None, x[:, :-1])
        assert rel_error(B.to_host(f_logits), logits) < 1e-12
        _, f_d = fast_ce(f_logits, x[:, 1:], 0.0, inplace=True)             # in place: the logits' buffer
        got = {k: B.to_host(v) for k, v in fast.backward(f_d, f_cache).items()}
    for name in grads:
        assert rel_error(got[name], grads[name]) < 1e-10, name


def test_a_language_models_training_forward_splits_from_its_own_size(monkeypatch):
    """Training, the rows split over the helper threads from :data:`attn.fast.core.lm.LM_SPLIT_MIN_SIZE`
    activations (nanoGPT's recipe, 12 x 64 x 128, does); evaluation keeps the model's rule, and a
    ``workers`` the user set is kept."""
    from attn.fast.core import lm
    B.set_backend("numpy")
    monkeypatch.setattr(lm, "default_workers", lambda: 2)
    cfg = TransformerConfig(vocab_size=9, d_model=128, n_heads=4, d_ff=16, n_encoder_layers=0, n_decoder_layers=1)
    fast = FastTransformer(cfg)
    assert lm.n_parts(fast, 12, 64, training=True) == 2
    assert lm.n_parts(fast, 12, 32, training=True) == 1                  # 49,152 activations: one part
    assert lm.n_parts(fast, 12, 64, training=False) == fast._n_parts(12, 64)
    fast.workers = 1
    assert lm.n_parts(fast, 12, 64, training=True) == 1

"""Each sampler's definition, held on drawn logits; the seed; the cached and uncached loops; and
``attn-generate``'s errors, each naming its flag."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import attn.backend as B
from attn.model import Transformer, TransformerConfig
from attn.sample import Sampler, choose, distribution, generate

logits_ = arrays("float64", st.integers(2, 12), elements=st.floats(-8, 8), unique=True)


@given(logits=logits_, p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_of_the_likeliest_whose_mass_reaches_p(logits, p):
    full = distribution(logits)
    kept = distribution(logits, top_p=p) > 0
    mass = full[kept].sum()
    assert mass >= p * (1 - 1e-9)                                        # it reaches p
    assert full[kept].min() >= full[~kept].max(initial=0)                # the likeliest ones
    assert mass - full[kept].min() < p                                   # one fewer would not
    np.testing.assert_allclose(distribution(logits, top_p=p)[kept], full[kept] / mass, rtol=1e-12)


@given(logits=logits_, k=st.integers(1, 12))
def test_top_k_keeps_the_k_likeliest(logits, k):
    p = distribution(logits, top_k=k)
    kept = np.flatnonzero(p > 0)
    assert len(kept) == min(k, len(logits))
    assert set(kept) == set(np.argsort(-logits)[:k])
    assert p.sum() == pytest.approx(1.0, abs=1e-12)


@given(logits=logits_)
def test_temperature_towards_zero_is_greedy_and_zero_is_greedy_exactly(logits):
    best = int(np.argmax(logits))
    greedy = distribution(logits, temperature=0)
    assert greedy[best] == 1.0 and greedy.sum() == 1.0
    gap = np.sort(logits)[-1] - np.sort(logits)[-2]
    assert distribution(logits, temperature=gap / 50)[best] > 1 - 1e-12 * len(logits) - np.exp(-50) * len(logits)
    np.testing.assert_allclose(distribution(logits, temperature=1.0), np.exp(logits) / np.exp(logits).sum())


def test_choose_inverts_the_cumulative_distribution():
    p = np.array([0.0, 0.25, 0.0, 0.75])
    assert [choose(p, u) for u in (0.0, 0.2499, 0.25, 0.9999)] == [1, 1, 3, 3]


def _lm(**kw):
    cfg = TransformerConfig(**{**dict(vocab_size=9, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=0,
                                      n_decoder_layers=2, dropout=0.0, max_len=8, norm_position="pre"), **kw})
    return Transformer(cfg, seed=3, dtype="float64")


@pytest.mark.parametrize("kw", [dict(positional="learned"), dict(positional="rope", norm_kind="rms", kv_heads=1)],
                         ids=["learned", "later"])
def test_cached_and_uncached_sampling_draw_the_same_tokens(backend, kw):
    """Past the window (8), both start afresh from its last half: the same tokens, the same seed."""
    model, sampler = _lm(**kw), Sampler(1.3, 6, 0.95)
    cached = generate(model, [4, 5], 20, sampler, seed=7, banned=[0, 1, 2, 3])
    assert cached == generate(model, [4, 5], 20, sampler, seed=7, banned=[0, 1, 2, 3], cached=False)
    assert len(cached) == 20 and min(cached) >= 4


def test_a_seed_reproduces_a_sample_and_another_seed_draws_another():
    model = _lm(positional="learned")
    runs = {s: generate(model, [4], 12, Sampler(1.5), seed=s) for s in (1, 1, 2)}
    assert runs[1] == generate(model, [4], 12, Sampler(1.5), seed=1) and runs[1] != runs[2]


def test_stop_ends_the_text_after_the_token_that_stops_it():
    model = _lm(positional="learned")
    ids = generate(model, [4], 30, Sampler(0.0))
    cut = generate(model, [4], 30, Sampler(0.0), stop=lambda out: out[-1] == ids[4])
    assert cut == ids[:ids.index(ids[4]) + 1]


@pytest.mark.parametrize("flags, flag", [(["--temperature", "-1"], "--temperature"), (["--top-k", "0"], "--top-k"),
                                         (["--top-p", "0"], "--top-p"), (["--max-tokens", "0"], "--max-tokens"),
                                         (["--seed", "-2"], "--seed"), (["--prompt", ""], "--prompt")])
def test_generate_errors_name_the_flag(flags, flag, capsys, tmp_path):
    from attn.generate import main
    assert main(["--checkpoint", str(tmp_path / "none.npz"), *flags]) == 2
    assert f"attn-generate: error: {flag}" in capsys.readouterr().err


def test_generate_refuses_a_missing_checkpoint_and_a_translators(capsys, tmp_path):
    from attn.generate import main
    assert main(["--checkpoint", str(tmp_path / "none.npz")]) == 2
    assert "--checkpoint" in capsys.readouterr().err and B.get_backend()
    Transformer(TransformerConfig(vocab_size=9, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1)
                ).save(tmp_path / "mt.npz", extra_meta={"vocab": ["<pad>", "<s>", "</s>", "<unk>", *"abcde"]})
    assert main(["--checkpoint", str(tmp_path / "mt.npz")]) == 2
    assert "holds a translator" in capsys.readouterr().err

"""The whole Transformer: its gradient, the invariants a reader would state aloud, incremental
decoding, and the configuration.

* Every parameter's gradient from :meth:`Transformer.backward` agrees with central differences
  of the label-smoothed loss (float64, relative error below 1e-6; a small tensor at every entry, a
  larger one at a few drawn entries and along a random direction through all of them), on tiny
  models drawn by hypothesis, with dropout off and on (under masks that a fresh seeded RNG reproduces).
* Future target tokens never change past logits; what sits at padded positions never changes
  the logits of real positions; attention on masked keys is exactly zero.
* Decoding one position at a time with cached keys/values gives the full forward's log-probabilities.
* The config has the paper's defaults, rejects nonsense naming the field, and is frozen.
* Parameter names are stable; the shared embedding's gradient is the sum of its three uses;
  the base model has the parameter count its shapes imply (~63M, the paper's "65M").
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import attn.backend as B
import strategies
from attn.gradcheck import numerical_gradient, rel_error
from attn.layers import sinusoidal_table
from attn.loss import cross_entropy
from attn.masks import PAD_ID, decoder_mask, padding_mask
from attn.model import (PRESETS, DecodeState, Transformer, TransformerConfig, later_block, log_softmax,
                        parameter_shapes)
from strategies import padded_ids, token_ids

#: Numerical gradients cost two forward passes per scalar parameter (a few ms each), so the
#: whole-model checks run a fifth of the profile's examples (3 under ``ci``, 60 under ``thorough``)
#: plus explicit ones that between them cover every option.
GRAD_EXAMPLES = max(2, settings().max_examples // 5)
GRAD_TOL = 1e-6
#: Central differences of the float64 loss with step ``GRAD_H`` are off by rounding noise,
#: ~eps * loss / h (measured up to 9e-10 in norm with h = 1e-6), plus truncation, ~h^2 * the third
#: derivative, which a nearly constant row under a pre-norm layer norm makes large (h = 1e-5 gave
#: a relative error of 1.1e-6 on an embedding there, h = 1e-6 gives 1e-8). No relative measure can
#: judge a gradient as small as the noise: two identical target tokens make the first decoder
#: self-attention almost uniform and its query gradient ~1e-6 (NEAR_ZERO below). So the relative
#: error's denominator is floored at ``GRAD_FLOOR``: below it, the check asks
#: |analytic - numerical| < GRAD_TOL * GRAD_FLOOR = 1e-8, ten times the noise; a 1% error in any
#: gradient of norm above 1e-6 still fails.
GRAD_H = 1e-6
GRAD_FLOOR = 1e-2
#: Outside the ``thorough`` profile the drawn models are capped at this many scalar parameters
#: times (1 + encoder layers + 2 * decoder layers), a proxy for the seconds a check takes
#: (about 1 ms per unit): that leaves 1+1 layers of width 4 to 6; the explicit examples carry
#: the two-layer stacks; 2+2 of width 8 (25 s on its own) waits for ``thorough``.
GRAD_COST_CAP = None if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "thorough" else 2000

# ----------------------------------------------------------------------------- tiny models


class Case(NamedTuple):
    """A tiny model's config and init seed, and one padded batch: src (B, S), tgt_in and
    tgt_out (B, T) with the same padding (as teacher forcing makes them)."""
    cfg: TransformerConfig
    seed: int
    src: np.ndarray
    tgt_in: np.ndarray
    tgt_out: np.ndarray

    def describe(self) -> str:
        c = self.cfg
        return (f"layers {c.n_encoder_layers}+{c.n_decoder_layers}, D {c.d_model}, H {c.n_heads}, F {c.d_ff}, "
                f"V {c.vocab_size}/{c.target_vocab_size}, {c.norm_position}-norm, {c.positional} positions, "
                f"{c.ffn} network, {c.key_value_heads} key/value heads, {c.norm_kind} norm, "
                f"{'shared' if c.share_embeddings else 'separate'} embeddings, "
                f"dropout {c.dropout}/{c.attention_dropout}/{c.relu_dropout}, smoothing {c.label_smoothing}, "
                f"src {self.src.tolist()}, tgt_in {self.tgt_in.tolist()}, tgt_out {self.tgt_out.tolist()}, "
                f"seed {self.seed}")


def check_cost(cfg: TransformerConfig) -> int:
    """Scalar parameters times (1 + encoder layers + 2 * decoder layers): proportional to the
    time a whole-model numerical gradient takes (two forward passes per scalar)."""
    n = sum(math.prod(s) for s in parameter_shapes(cfg).values())
    return n * (1 + cfg.n_encoder_layers + 2 * cfg.n_decoder_layers)


@st.composite
def cases(draw, dropout: bool = False, max_len: int = 5, max_batch: int = 2, max_layers: int = 2,
          max_width: int = 8, max_cost: int | None = None) -> Case:
    """Layers 1-2 each, heads 1-2, d_model 4-8, d_ff 2-8, lengths 1-max_len with trailing
    padding, shared or separate embeddings, post- or pre-norm, sinusoidal, learned or rotary
    positions, the ReLU or the SwiGLU network, every head its keys or one key/value head for two,
    layer norm or RMSNorm.
    With ``dropout`` every dropout (residual, attention, feed-forward) is on. ``max_cost`` rejects
    models whose :func:`check_cost` exceeds it."""
    H = draw(st.sampled_from([1, 2]))
    positional = draw(st.sampled_from(["sinusoidal", "learned", "rope"]))
    even = 2 if positional == "rope" else 1                   # rotary positions turn pairs of a head's features
    D = draw(st.sampled_from([d for d in range(4, max_width + 1) if d % (H * even) == 0]))
    share = draw(st.booleans())
    V = draw(st.integers(3, 6))
    Vt = V if share else draw(st.integers(3, 6))
    rate = st.sampled_from([0.1, 0.25, 0.5]) if dropout else st.just(0.0)
    cfg = TransformerConfig(
        vocab_size=V, tgt_vocab_size=None if share else Vt, d_model=D, n_heads=H,
        d_ff=draw(st.integers(2, max_width)),
        n_encoder_layers=draw(st.integers(1, max_layers)), n_decoder_layers=draw(st.integers(1, max_layers)),
        dropout=draw(rate), attention_dropout=draw(rate), relu_dropout=draw(rate),
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 0.3])), max_len=max_len,
        positional=positional, norm_position=draw(st.sampled_from(["post", "pre"])),
        ffn=draw(st.sampled_from(["relu", "swiglu"])), kv_heads=draw(st.sampled_from([None, 1])),
        norm_kind=draw(st.sampled_from(["layer", "rms"])),
        share_embeddings=share)
    if max_cost is not None:
        assume(check_cost(cfg) <= max_cost)
    Bsz, S, T = draw(st.integers(1, max_batch)), draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    src = draw(padded_ids(Bsz, S, V))
    tgt_in = draw(padded_ids(Bsz, T, Vt))
    tgt_out = draw(token_ids((Bsz, T), Vt, low=1, repeats=False))
    tgt_out[tgt_in == PAD_ID] = PAD_ID
    return Case(cfg, draw(st.integers(0, 2**16)), src, tgt_in, tgt_out)


def build(case: Case, dtype="float64") -> tuple[Transformer, object, object, object]:
    """The model on the selected backend and the batch moved there."""
    model = Transformer(case.cfg, seed=case.seed, dtype=dtype)
    return model, B.to_device(case.src), B.to_device(case.tgt_in), B.to_device(case.tgt_out)


def host(a) -> np.ndarray:
    return B.to_host(a)

# ----------------------------------------------------------------------------- gradients


def floored_rel_error(analytic, numerical) -> float:
    """:func:`attn.gradcheck.rel_error`, ``|a - b| / (|a| + |b|)``, with the denominator floored
    at ``GRAD_FLOOR`` (see there)."""
    den = float(np.linalg.norm(host(analytic)) + np.linalg.norm(host(numerical)))
    err = rel_error(analytic, numerical, zero=GRAD_FLOOR)     # |a - b| alone when den < GRAD_FLOOR
    return err if den >= GRAD_FLOOR else err / GRAD_FLOOR


#: A tensor of more entries than this is held to central differences at this many of its entries
#: and along one random direction through all of them (:func:`tensor_gradient_error`); a smaller
#: one at every entry.
GRAD_ENTRIES = 4


def tensor_gradient_error(loss, analytic, p, rng) -> float:
    """The floored relative error of one parameter's analytic gradient: at every entry of a tensor
    of at most ``GRAD_ENTRIES + 1`` entries; of a larger one, the worse of two checks, 2 (k + 1)
    forward passes instead of 2 n: at ``GRAD_ENTRIES`` entries drawn from ``rng``, and the
    derivative along a unit direction ``v`` drawn from a Gaussian (``<analytic, v>`` against
    ``(loss(p + h v) - loss(p - h v)) / 2h``). A wrong entry anywhere moves ``<analytic, v>`` by
    its error times its component of ``v`` (an error orthogonal to a Gaussian direction has
    probability zero); the unit step keeps each central difference's truncation error at
    ``GRAD_H``'s, and the floor keeps rounding noise on a small derivative below the tolerance."""
    if p.size <= GRAD_ENTRIES + 1:
        return floored_rel_error(analytic, numerical_gradient(loss, p, GRAD_H))
    at = np.sort(rng.choice(p.size, GRAD_ENTRIES, replace=False))
    spot = host(numerical_gradient(loss, p, GRAD_H, indices=at)).reshape(-1)[at]
    v = rng.standard_normal(p.shape)
    v /= np.linalg.norm(v)
    old, step = p.copy(), B.to_device(GRAD_H * v, dtype=p.dtype)
    p[...] = old + step
    up = float(loss())
    p[...] = old - step
    down = float(loss())
    p[...] = old
    along = np.array([(up - down) / (2 * GRAD_H)])
    return max(floored_rel_error(host(analytic).reshape(-1)[at], spot),
               floored_rel_error(np.array([float(np.sum(host(analytic) * v))]), along))


def check_model_gradients(case: Case, dropout_seed: int | None, record: bool = True) -> dict:
    """Analytic gradient of every parameter against central differences of the loss
    (:func:`tensor_gradient_error`: every tensor, at every entry or at a few and along a direction).

    ``dropout_seed``: None for no dropout; else every forward pass gets a fresh
    ``DeviceRNG(dropout_seed)``, so each of the thousands of passes draws the same masks
    and the loss is a smooth function of the parameters. ``record``: add the errors to the
    session's summary (see ``strategies.gradient_summary``). Returns {name: relative error}.
    """
    model, src, tgt_in, tgt_out = build(case)
    eps = case.cfg.label_smoothing

    def forward():
        rng = None if dropout_seed is None else B.DeviceRNG(dropout_seed)
        return model.forward(src, tgt_in, rng)

    def loss():
        return cross_entropy(forward()[0], tgt_out, eps)[0]

    logits, cache = forward()
    _, dlogits = cross_entropy(logits, tgt_out, eps)
    grads = model.backward(dlogits, cache)
    assert set(grads) == set(model.params), (
        f"grads and params differ: missing {sorted(set(model.params) - set(grads))}, "
        f"extra {sorted(set(grads) - set(model.params))}")
    for name, g in grads.items():
        assert g.shape == model.params[name].shape and g.dtype == model.params[name].dtype, name

    rng = np.random.default_rng(case.seed)
    errors = {name: tensor_gradient_error(loss, grads[name], p, rng) for name, p in model.params.items()}
    if record:
        strategies.GRADIENT_CHECKS[0] += 1
        strategies.GRADIENT_ERRORS.extend(("transformer", name, err) for name, err in errors.items())
    bad = {k: v for k, v in errors.items() if not v < GRAD_TOL}
    assert not bad, ("Transformer.backward disagrees with central differences (relative error > "
                     f"{GRAD_TOL:g}) for " + ", ".join(f"{k}: {v:.3g}" for k, v in bad.items())
                     + f"\n  case: {case.describe()}; dropout seed {dropout_seed}")
    return errors


def _explicit(dropout: float, **kw) -> Case:
    """Hand-picked cases that, between the two, use every option and both stacks two layers deep
    (the gradient of the encoder output sums over decoder layers): the drawn ones are random."""
    cfg = TransformerConfig(**{**dict(dropout=dropout, attention_dropout=dropout, relu_dropout=dropout,
                                      max_len=5), **kw})
    return Case(cfg, 7, np.array([[3, 1, 4, 1, 0], [5, 2, 0, 0, 0]]), np.array([[1, 2, 3, 0], [1, 4, 4, 2]]),
                np.array([[2, 3, 1, 0], [4, 4, 2, 3]]))


POST_SHARED = dict(vocab_size=6, d_model=4, n_heads=2, d_ff=2, n_encoder_layers=1, n_decoder_layers=2,
                   label_smoothing=0.1)                                # sinusoids
PRE_SEPARATE = dict(vocab_size=6, tgt_vocab_size=5, share_embeddings=False, d_model=4, n_heads=1, d_ff=2,
                    n_encoder_layers=2, n_decoder_layers=1, norm_position="pre", positional="learned", label_smoothing=0.0)


MODERN = dict(vocab_size=6, d_model=8, n_heads=2, kv_heads=1, d_ff=3, n_encoder_layers=1, n_decoder_layers=2,
              norm_position="pre", norm_kind="rms", positional="rope", ffn="swiglu", label_smoothing=0.1)


#: Found by hypothesis: tgt_in [1, 1] gives the decoder's self-attention query gradients of norm ~1e-6.
NEAR_ZERO = Case(TransformerConfig(vocab_size=5, tgt_vocab_size=3, d_model=4, n_heads=1, d_ff=5, n_encoder_layers=1,
                                   n_decoder_layers=1, dropout=0.0, label_smoothing=0.0, max_len=5,
                                   positional="learned", share_embeddings=False),
                 1, np.array([[1, 0, 0, 0]]), np.array([[1, 1, 0, 0, 0]]), np.array([[1, 1, 0, 0, 0]]))


@settings(max_examples=GRAD_EXAMPLES)
@given(case=cases(max_cost=GRAD_COST_CAP))
@example(case=NEAR_ZERO)
@example(case=_explicit(0.0, **POST_SHARED))
@example(case=_explicit(0.0, **PRE_SEPARATE))
@example(case=_explicit(0.0, **MODERN))
def test_every_parameter_gradient_matches_central_differences(backend, case):
    check_model_gradients(case, dropout_seed=None)


@settings(max_examples=GRAD_EXAMPLES)
@given(case=cases(dropout=True, max_cost=GRAD_COST_CAP), dropout_seed=st.integers(0, 2**16))
@example(case=_explicit(0.3, **POST_SHARED), dropout_seed=1)
@example(case=_explicit(0.3, **PRE_SEPARATE), dropout_seed=2)
@example(case=_explicit(0.3, **MODERN), dropout_seed=3)
def test_every_parameter_gradient_matches_with_dropout_under_fixed_masks(backend, case, dropout_seed):
    model, src, tgt_in, _ = build(case)
    with_rng = host(model.forward(src, tgt_in, B.DeviceRNG(dropout_seed))[0])
    again = host(model.forward(src, tgt_in, B.DeviceRNG(dropout_seed))[0])
    np.testing.assert_array_equal(with_rng, again)            # the seed reproduces every mask
    assert not np.array_equal(with_rng, host(model.forward(src, tgt_in)[0])), "dropout did nothing"
    check_model_gradients(case, dropout_seed)


def test_gradient_check_would_catch_a_wrong_backward(backend, monkeypatch):
    """The check above is not vacuous: scale one sub-layer's weight gradient by 1.01 and it
    fails, naming that parameter."""
    import attn.block as M                  # where the block's parts take their pairs
    names, forward, real, later, width = M.FFNS["relu"]

    def off_by_one_percent(dout, cache):
        dx, dw1, db1, dw2, db2 = real(dout, cache)
        return dx, dw1, db1, dw2 * 1.01, db2

    monkeypatch.setitem(M.FFNS, "relu", (names, forward, off_by_one_percent, later, width))
    cfg = TransformerConfig(vocab_size=4, d_model=4, n_heads=1, d_ff=4, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.0, max_len=4)
    case = Case(cfg, 0, np.array([[1, 2, 3]]), np.array([[1, 3]]), np.array([[3, 2]]))
    with pytest.raises(AssertionError, match=r"ffn\.w2: ") as info:
        check_model_gradients(case, None, record=False)     # a planted bug is not a measurement
    flagged = str(info.value).split(" for ", 1)[1].split("\n")[0]
    assert {part.split(":")[0] for part in flagged.split(", ")} <= {"encoder.0.ffn.w2", "decoder.0.ffn.w2"}


# ----------------------------------------------------------------------------- invariants


@given(case=cases(max_len=6, max_batch=3), data=st.data(), dtype=st.sampled_from(["float32", "float64"]))
def test_future_target_tokens_never_change_past_logits(backend, case, data, dtype):
    model, src, tgt_in, _ = build(case, dtype)
    T = case.tgt_in.shape[1]
    t = data.draw(st.integers(0, T - 1), label="t")
    changed = case.tgt_in.copy()
    changed[:, t:] = data.draw(token_ids((changed.shape[0], T - t), case.cfg.target_vocab_size,
                                         repeats=False), label="new future tokens")   # pad included
    before = host(model.forward(src, tgt_in)[0])
    after = host(model.forward(src, B.to_device(changed))[0])
    np.testing.assert_array_equal(after[:, :t], before[:, :t])


def _real(ids: np.ndarray) -> np.ndarray:
    return ids != PAD_ID


@given(case=cases(max_len=6, max_batch=3), data=st.data())
def test_ids_at_masked_source_positions_never_change_real_logits(backend, case, data):
    """Encode with an explicit source mask, so that the ids under it can be anything (real
    tokens included): no real target position may see them, and neither may the encoder
    outputs at real source positions."""
    model, src, tgt_in, _ = build(case)
    mask_h = _real(case.src)
    other = case.src.copy()
    new = data.draw(token_ids(other.shape, case.cfg.vocab_size, repeats=False), label="new ids")
    other[~mask_h] = new[~mask_h]
    mask = B.to_device(mask_h[:, None, None, :])

    def run(ids):
        memory, _ = model.encode(B.to_device(ids), None, mask)
        h, _, _ = model.decode(tgt_in, memory, mask)
        return host(memory), host(model.project(h))

    mem_a, logits_a = run(case.src)
    mem_b, logits_b = run(other)
    np.testing.assert_array_equal(mem_b[mask_h], mem_a[mask_h])
    np.testing.assert_array_equal(logits_b, logits_a)
    # and with the mask forward() builds from the ids themselves:
    np.testing.assert_array_equal(host(model.forward(src, tgt_in)[0]), logits_a)


@given(case=cases(max_len=6, max_batch=3), data=st.data())
def test_ids_at_padded_target_positions_never_change_real_logits(backend, case, data):
    model, src, tgt_in, _ = build(case)
    real = _real(case.tgt_in)
    other = case.tgt_in.copy()
    new = data.draw(token_ids(other.shape, case.cfg.target_vocab_size, repeats=False), label="new ids")
    other[~real] = new[~real]
    np.testing.assert_array_equal(host(model.forward(src, B.to_device(other))[0])[real],
                                  host(model.forward(src, tgt_in)[0])[real])


@given(case=cases(max_len=6, max_batch=3), seed=st.integers(0, 2**16))
def test_the_padding_vector_never_reaches_real_positions(backend, case, seed):
    """What padded positions *carry*: change the pad row of every embedding matrix. Real
    positions' logits over the real vocabulary are unchanged (column 0 is the pad token's own
    logit, h @ E[0], and moves with it)."""
    model, src, tgt_in, _ = build(case)
    before = host(model.forward(src, tgt_in)[0])
    rng = np.random.default_rng(seed)
    for name, p in model.params.items():
        if name.endswith("embedding.weight"):
            p[PAD_ID] = B.to_device(rng.standard_normal(p.shape[1]))
    after = host(model.forward(src, tgt_in)[0])
    real = _real(case.tgt_in)
    np.testing.assert_array_equal(after[real][:, 1:], before[real][:, 1:])


@given(case=cases(max_len=5, max_batch=3), extra_src=st.integers(0, 3), extra_tgt=st.integers(0, 3))
def test_more_padding_changes_no_real_logit(backend, case, extra_src, extra_tgt):
    """The same sentences padded to longer lengths: the real positions' logits agree to
    rounding (the arrays have other shapes, so BLAS may sum in another order)."""
    cfg = dataclasses.replace(case.cfg, max_len=8)
    model = Transformer(cfg, seed=case.seed, dtype="float64")
    pad = lambda ids, n: np.concatenate([ids, np.full((ids.shape[0], n), PAD_ID)], axis=1)  # noqa: E731
    a = host(model.forward(B.to_device(case.src), B.to_device(case.tgt_in))[0])
    b = host(model.forward(B.to_device(pad(case.src, extra_src)), B.to_device(pad(case.tgt_in, extra_tgt)))[0])
    real = _real(case.tgt_in)
    np.testing.assert_allclose(b[:, : a.shape[1]][real], a[real], rtol=1e-12, atol=1e-12)


@given(case=cases(max_len=6, max_batch=3))
def test_attention_on_masked_keys_is_exactly_zero(backend, case):
    model, src, tgt_in, _ = build(case)
    _, cache = model.forward(src, tgt_in)
    weights = {k: host(v) for k, v in Transformer.attention_weights(cache).items()}
    cfg = case.cfg
    expected = {f"encoder.{i}.self_attn" for i in range(cfg.n_encoder_layers)}
    expected |= {f"decoder.{i}.{s}" for i in range(cfg.n_decoder_layers) for s in ("self_attn", "cross_attn")}
    assert set(weights) == expected
    Bsz, S, T, H = case.src.shape[0], case.src.shape[1], case.tgt_in.shape[1], cfg.n_heads
    src_keys = np.broadcast_to(host(padding_mask(src)), (Bsz, H, 1, S))
    allowed = {"encoder": np.broadcast_to(src_keys, (Bsz, H, S, S)),
               "self_attn": np.broadcast_to(host(decoder_mask(tgt_in)), (Bsz, H, T, T)),
               "cross_attn": np.broadcast_to(src_keys, (Bsz, H, T, S))}
    for name, w in weights.items():
        ok = allowed["encoder" if name.startswith("encoder") else name.rsplit(".", 1)[1]]
        assert w.shape == ok.shape, name
        assert np.all(w[~ok] == 0.0), f"{name}: weight on a masked key"
        assert np.all(w >= 0.0), name
        np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-12, err_msg=name)   # every row has a real key

# ----------------------------------------------------------------------------- incremental decoding


def _decode_all(model, src, tgt_in):
    """Log-probabilities (B, T, V) and cross-attention weights from decode_step, position by position."""
    memory, _ = model.encode(src)
    state = model.start_decoding(memory, padding_mask(src))
    logps, cross = [], []
    for t in range(tgt_in.shape[1]):
        assert state.length == t
        lp, state, cw = model.decode_step(tgt_in[:, t], state)
        logps.append(host(lp))
        cross.append([host(w) for w in cw])
    return np.stack(logps, axis=1), cross, state


@given(case=cases(max_len=6, max_batch=3))
def test_incremental_decoding_matches_the_full_forward(backend, case):
    """decode_step attends to every cached position, as a decoder that has fed real tokens does;
    so compare at real target positions (a pad query in the full forward sees fewer keys)."""
    model, src, tgt_in, _ = build(case)
    logits, cache = model.forward(src, tgt_in)
    full = host(log_softmax(logits))
    steps, cross, state = _decode_all(model, src, tgt_in)
    real = _real(case.tgt_in)
    assert steps.shape == full.shape
    np.testing.assert_allclose(steps[real], full[real], rtol=0, atol=1e-10)
    np.testing.assert_allclose(np.exp(steps).sum(-1), 1.0, rtol=1e-12)
    weights = Transformer.attention_weights(cache)
    for i in range(case.cfg.n_decoder_layers):
        w = host(weights[f"decoder.{i}.cross_attn"])                                  # (B, H, T, S)
        inc = np.concatenate([c[i] for c in cross], axis=2)
        np.testing.assert_allclose(inc.transpose(0, 2, 1, 3)[real], w.transpose(0, 2, 1, 3)[real], atol=1e-12)
    assert state.length == case.tgt_in.shape[1]


@given(case=cases(max_len=5, max_batch=3), data=st.data())
def test_decode_state_select_reorders_and_repeats_rows(backend, case, data):
    """Decode k positions, select rows (as beam search does), decode the rest: the same as
    decoding the selected sentences from scratch."""
    Bsz, T = case.tgt_in.shape
    tgt = np.where(case.tgt_in == PAD_ID, 1, case.tgt_in)            # decoding feeds real tokens
    k = data.draw(st.integers(0, T - 1), label="positions before select")
    index = np.array(data.draw(st.lists(st.integers(0, Bsz - 1), min_size=1, max_size=4), label="index"))
    model, src, _, _ = build(case)
    memory, _ = model.encode(src)
    state = model.start_decoding(memory, padding_mask(src))
    for t in range(k):
        _, state, _ = model.decode_step(B.to_device(tgt[:, t]), state)
    state = state.select(B.to_device(index))
    assert isinstance(state, DecodeState) and state.length == k
    assert state.src_mask.shape[0] == len(index)
    got = []
    for t in range(k, T):
        lp, state, _ = model.decode_step(B.to_device(tgt[index, t]), state)
        got.append(host(lp))
    ref, _, _ = _decode_all(model, B.to_device(case.src[index]), B.to_device(tgt[index]))
    np.testing.assert_allclose(np.stack(got, axis=1), ref[:, k:], rtol=0, atol=1e-12)

# ----------------------------------------------------------------------------- positions past max_len


def _cache_bytes(state) -> int:
    return sum(int(a.nbytes) for pair in state.cross_kv + state.self_kv for a in pair if a is not None)


@pytest.mark.parametrize("H", [2, 4, 8])
def test_the_cache_of_a_multi_query_model_is_one_over_n_heads_of_the_papers(backend, H):
    """Measured, not assumed: the bytes of every cached key and value after a few decoding steps."""
    rng = np.random.default_rng(H)
    src, tokens = B.to_device(rng.integers(1, 20, (3, 7))), B.to_device(rng.integers(1, 20, (3, 5)))
    measured = {}
    for kv in (None, 1):
        model = Transformer(TransformerConfig.preset("toy", vocab_size=20, n_heads=H, kv_heads=kv))
        memory, _ = model.encode(src)
        state = model.start_decoding(memory, padding_mask(src))
        for t in range(tokens.shape[1]):
            _, state, _ = model.decode_step(tokens[:, t], state)
        measured[kv] = _cache_bytes(state)
    assert measured[1] * H == measured[None], measured


def test_later_block_names_what_differs_from_the_papers():
    assert later_block(TransformerConfig(norm_position="pre")) == []
    assert later_block(TransformerConfig(kv_heads=8)) == []                 # as many key/value heads as heads
    assert later_block(TransformerConfig(positional="rope", ffn="swiglu", kv_heads=2, norm_kind="rms")) == [
        "positional='rope'", "ffn='swiglu'", "kv_heads=2", "norm_kind='rms'"]


def test_swiglu_keeps_the_papers_parameter_count_and_rope_drops_the_tables():
    paper = TransformerConfig.preset("small", vocab_size=4000, positional="learned")
    counts = {kw: sum(math.prod(s) for s in parameter_shapes(
        TransformerConfig.preset("small", vocab_size=4000, **dict(kw))).values())
        for kw in [(), (("ffn", "swiglu"),), (("positional", "rope"),)]}
    biases = (paper.d_ff + paper.d_model) * (paper.n_encoder_layers + paper.n_decoder_layers)   # b1 and b2
    assert abs(counts[(("ffn", "swiglu"),)] - (counts[()] - biases)) <= 3 * paper.d_model * 6   # a column a matrix
    assert counts[(("positional", "rope"),)] == counts[()]                  # sinusoids have no parameters either
    assert sum(math.prod(s) for s in parameter_shapes(paper).values()) - counts[()] == 2 * paper.max_len * paper.d_model


def test_sinusoidal_positions_extend_past_max_len(backend):
    cfg = TransformerConfig(vocab_size=7, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.0, max_len=3)
    model = Transformer(cfg, seed=1, dtype="float64")
    roomy = Transformer(dataclasses.replace(cfg, max_len=16), dtype="float64", params=model.params)
    rng = np.random.default_rng(0)
    src, tgt = B.to_device(rng.integers(1, 7, (2, 9))), B.to_device(rng.integers(1, 7, (2, 7)))
    logits = host(model.forward(src, tgt)[0])                                          # 9 and 7 > max_len 3
    assert logits.shape == (2, 7, 7) and np.all(np.isfinite(logits))
    np.testing.assert_array_equal(logits, host(roomy.forward(src, tgt)[0]))
    np.testing.assert_array_equal(host(model._pos_table("tgt", 9))[:9], sinusoidal_table(9, 8, "float64"))
    shorter = host(model.forward(src, tgt[:, :2])[0])                                 # within max_len
    np.testing.assert_allclose(logits[:, :2], shorter, rtol=1e-12, atol=1e-12)
    steps, _, _ = _decode_all(model, src, tgt)                                        # decoding too
    np.testing.assert_allclose(steps, host(log_softmax(model.forward(src, tgt)[0])), atol=1e-10)


@pytest.mark.parametrize("S, T", [(5, 2), (2, 5)])
def test_learned_positions_refuse_sequences_past_max_len(backend, S, T):
    cfg = TransformerConfig(vocab_size=7, d_model=4, n_heads=1, d_ff=4, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.0, max_len=4, positional="learned")
    model = Transformer(cfg, dtype="float64")
    with pytest.raises(ValueError, match=r"sequence length 5 .*4 positions"):
        model.forward(B.to_device(np.ones((1, S), np.int64)), B.to_device(np.ones((1, T), np.int64)))


def test_learned_positions_refuse_to_decode_past_max_len(backend):
    cfg = TransformerConfig(vocab_size=7, d_model=4, n_heads=1, d_ff=4, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.0, max_len=3, positional="learned")
    model = Transformer(cfg, dtype="float64")
    src = B.to_device(np.ones((2, 2), np.int64))
    memory, _ = model.encode(src)
    state = model.start_decoding(memory, padding_mask(src))
    tok = B.to_device(np.ones(2, np.int64))
    for _ in range(3):
        _, state, _ = model.decode_step(tok, state)
    with pytest.raises(ValueError, match=r"sequence length 4 .*3 positions"):
        model.decode_step(tok, state)

# ----------------------------------------------------------------------------- config


def test_defaults_are_the_papers_base_model():
    c = TransformerConfig()
    assert (c.n_encoder_layers, c.n_decoder_layers, c.d_model, c.n_heads, c.d_ff) == (6, 6, 512, 8, 2048)
    assert (c.dropout, c.label_smoothing, c.warmup_steps) == (0.1, 0.1, 4000)
    assert (c.norm_position, c.positional, c.share_embeddings) == ("post", "sinusoidal", True)
    assert c.vocab_size == 37000 and c.target_vocab_size == 37000


def test_presets():
    assert set(PRESETS) >= {"toy", "small", "base"}
    base = TransformerConfig.preset("base")
    assert (base.n_encoder_layers, base.n_decoder_layers, base.d_model, base.n_heads, base.d_ff,
            base.dropout, base.label_smoothing, base.warmup_steps) == (6, 6, 512, 8, 2048, 0.1, 0.1, 4000)
    small = TransformerConfig.preset("small")
    assert (small.d_model, small.n_encoder_layers, small.n_decoder_layers, small.n_heads, small.d_ff) == \
        (256, 3, 3, 8, 512)
    toy = TransformerConfig.preset("toy", vocab_size=100)
    assert toy.vocab_size == 100 and toy.d_model < small.d_model
    assert TransformerConfig.preset("toy", d_model=64).d_model == 64
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        TransformerConfig.preset("huge")


@pytest.mark.parametrize("overrides, field", [
    (dict(d_model=10, n_heads=4), "d_model"),
    (dict(d_model=10, n_heads=4), "n_heads"),
    (dict(d_model=0), "d_model"), (dict(d_model=-8), "d_model"), (dict(d_model=8.0), "d_model"),
    (dict(n_heads=0), "n_heads"), (dict(d_ff=0), "d_ff"), (dict(vocab_size=0), "vocab_size"),
    (dict(max_len=0), "max_len"), (dict(n_encoder_layers=-1), "n_encoder_layers"),
    (dict(n_decoder_layers=-1), "n_decoder_layers"),
    (dict(dropout=1.0), "dropout"), (dict(dropout=-0.1), "dropout"), (dict(dropout=float("nan")), "dropout"),
    (dict(attention_dropout=1.5), "attention_dropout"), (dict(relu_dropout=-1e-9), "relu_dropout"),
    (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(share_embeddings=True, tgt_vocab_size=500), "share_embeddings"),
    (dict(share_embeddings=False, tgt_vocab_size=0), "tgt_vocab_size"),
    (dict(positional="rotary"), "positional"), (dict(norm_position="sandwich"), "norm_position"),
    (dict(ffn="geglu"), "ffn"), (dict(norm_kind="batch"), "norm_kind"), (dict(norm_kind="RMS"), "norm_kind"),
    (dict(kv_heads=3), "kv_heads"), (dict(kv_heads=0), "kv_heads"), (dict(kv_heads=2.0), "kv_heads"),
    (dict(d_model=12, n_heads=4, positional="rope"), "even"), (dict(rope_base=1.0), "rope_base"),
    (dict(warmup_steps=0), "warmup_steps"),
])
def test_invalid_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**overrides)


def test_config_is_frozen_and_round_trips_through_a_dict():
    c = TransformerConfig.preset("toy", vocab_size=50, share_embeddings=False, tgt_vocab_size=60)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 64
    assert TransformerConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown fields.*colour"):
        TransformerConfig.from_dict({**c.to_dict(), "colour": "blue"})
    assert dataclasses.replace(c, share_embeddings=False, tgt_vocab_size=7).target_vocab_size == 7

# ----------------------------------------------------------------------------- parameters


def _tiny(**kw) -> TransformerConfig:
    base = dict(vocab_size=6, d_model=4, n_heads=2, d_ff=6, n_encoder_layers=1, n_decoder_layers=1,
                dropout=0.0, max_len=5)
    return TransformerConfig(**{**base, **kw})


def test_parameter_names_are_stable():
    attn_names = [f"{p}_{n}" for n in "qkvo" for p in "wb"]
    want = ["embedding.weight"]
    want += [f"encoder.0.self_attn.{n}" for n in attn_names] + ["encoder.0.norm1.gamma", "encoder.0.norm1.beta"]
    want += [f"encoder.0.ffn.{n}" for n in ("w1", "b1", "w2", "b2")] + ["encoder.0.norm2.gamma", "encoder.0.norm2.beta"]
    want += [f"decoder.0.self_attn.{n}" for n in attn_names] + ["decoder.0.norm1.gamma", "decoder.0.norm1.beta"]
    want += [f"decoder.0.cross_attn.{n}" for n in attn_names] + ["decoder.0.norm2.gamma", "decoder.0.norm2.beta"]
    want += [f"decoder.0.ffn.{n}" for n in ("w1", "b1", "w2", "b2")] + ["decoder.0.norm3.gamma", "decoder.0.norm3.beta"]
    assert list(parameter_shapes(_tiny())) == want
    assert parameter_shapes(_tiny())["encoder.0.self_attn.w_q"] == (4, 4)
    assert parameter_shapes(_tiny())["decoder.0.ffn.w1"] == (4, 6)

    untied = parameter_shapes(_tiny(share_embeddings=False, tgt_vocab_size=9, positional="learned", norm_position="pre",
                                     n_encoder_layers=2))
    assert untied["src_embedding.weight"] == (6, 4)
    assert untied["tgt_embedding.weight"] == untied["generator.weight"] == (9, 4)
    assert untied["src_pos.weight"] == untied["tgt_pos.weight"] == (5, 4)
    assert untied["encoder.norm.gamma"] == untied["decoder.norm.beta"] == (4,)
    assert "encoder.1.ffn.b2" in untied and "embedding.weight" not in untied


@pytest.mark.parametrize("kw", [{}, dict(share_embeddings=False, tgt_vocab_size=9),
                                dict(norm_position="pre", positional="learned")])
def test_params_and_grads_share_keys_shapes_and_dtypes(backend, kw):
    cfg = _tiny(**kw)
    model = Transformer(cfg, seed=3)
    assert list(model.params) == list(parameter_shapes(cfg))
    assert all(model.params[k].shape == s and model.params[k].dtype == np.float32
               for k, s in parameter_shapes(cfg).items())
    assert all(B.get_array_module(p) is backend for p in model.params.values())
    src, tgt = B.to_device(np.array([[1, 2, 0]])), B.to_device(np.array([[3, 4, 5, 0]]))
    logits, cache = model.forward(src, tgt)
    assert logits.shape == (1, 4, cfg.target_vocab_size) and logits.dtype == np.float32
    _, dlogits = cross_entropy(logits, tgt, 0.1)
    grads = model.backward(dlogits, cache)
    assert list(grads) and set(grads) == set(model.params)
    assert all(grads[k].shape == p.shape and grads[k].dtype == p.dtype for k, p in model.params.items())
    assert model.num_parameters() == sum(math.prod(s) for s in parameter_shapes(cfg).values())


def test_initialisation_is_seeded_and_the_same_on_every_backend(backend):
    """Weights are drawn on the host from the seed, then moved: every backend starts equal."""
    cfg = _tiny()
    a, b = Transformer(cfg, seed=5), Transformer(cfg, seed=5)
    saved = (B._current, B._xp)
    try:
        B.set_backend("numpy")
        on_numpy = Transformer(cfg, seed=5).params
    finally:
        B._current, B._xp = saved
    for k in a.params:
        np.testing.assert_array_equal(host(a.params[k]), host(b.params[k]))
        np.testing.assert_array_equal(host(a.params[k]), on_numpy[k])
    assert not np.array_equal(host(Transformer(cfg, seed=6).params["encoder.0.ffn.w1"]),
                              host(a.params["encoder.0.ffn.w1"]))


@given(case=cases(max_len=5), data=st.data())
def test_tied_embedding_gradient_is_the_sum_of_its_three_uses(backend, case, data):
    """The shared matrix E is the source embedding, the target embedding and the projection.
    An untied model whose three matrices all equal E computes the same logits, and its three
    gradients must add up to the tied gradient."""
    cfg = dataclasses.replace(case.cfg, share_embeddings=True, tgt_vocab_size=None)
    src = case.src
    tgt_in = np.minimum(case.tgt_in, cfg.vocab_size - 1)
    tgt_out = np.minimum(case.tgt_out, cfg.vocab_size - 1)
    tied = Transformer(cfg, seed=case.seed, dtype="float64")
    E = tied.params["embedding.weight"]
    untied_params = {k: v for k, v in tied.params.items() if k != "embedding.weight"}
    untied_params.update({"src_embedding.weight": E.copy(), "tgt_embedding.weight": E.copy(),
                          "generator.weight": E.copy()})
    untied = Transformer(dataclasses.replace(cfg, share_embeddings=False), dtype="float64", params=untied_params)
    assert set(untied.params) == set(parameter_shapes(untied.config))

    grads = {}
    logits = {}
    for name, model in (("tied", tied), ("untied", untied)):
        out, cache = model.forward(B.to_device(src), B.to_device(tgt_in))
        _, dlogits = cross_entropy(out, B.to_device(tgt_out), cfg.label_smoothing)
        logits[name], grads[name] = host(out), {k: host(v) for k, v in model.backward(dlogits, cache).items()}
    np.testing.assert_array_equal(logits["untied"], logits["tied"])
    u = grads["untied"]
    three = u["generator.weight"] + u["tgt_embedding.weight"] + u["src_embedding.weight"]
    np.testing.assert_allclose(grads["tied"]["embedding.weight"], three, rtol=1e-13, atol=1e-15)
    for k in untied_params:
        if k in grads["tied"]:
            np.testing.assert_array_equal(u[k], grads["tied"][k], err_msg=k)
    # each use contributes: the three parts are not zero (rows of tokens that occur, at least)
    for k in ("src_embedding.weight", "tgt_embedding.weight", "generator.weight"):
        assert np.abs(u[k]).max() > 0, k


def base_model_parameter_count(V: int = 37000, D: int = 512, F: int = 2048, N: int = 6) -> int:
    """What the paper's base model's shapes add up to, written out by hand."""
    attention = 4 * (D * D + D)               # W_q, W_k, W_v, W_o with biases
    ffn = D * F + F + F * D + D               # W_1, b_1, W_2, b_2
    norm = 2 * D                              # gain and bias
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    return V * D + N * encoder_layer + N * decoder_layer     # one shared V x D matrix; sinusoids are free


def test_base_model_parameter_count():
    """The paper reports 65M parameters for the base model (Table 3). Its shapes with a shared
    37000-token vocabulary add up to 63,082,496 (the paper's figure is rounded and its exact
    vocabulary and bookkeeping are not given): within 3% of 65M."""
    cfg = TransformerConfig.preset("base", vocab_size=37000)
    n = sum(math.prod(s) for s in parameter_shapes(cfg).values())
    assert n == base_model_parameter_count() == 63_082_496
    assert 0.97 < n / 65e6 < 1.0
    print(f"\nbase model: {n:,} parameters (paper: 65M)")
    # untied: two more V x D matrices
    untied = dataclasses.replace(cfg, share_embeddings=False)
    assert sum(math.prod(s) for s in parameter_shapes(untied).values()) == n + 2 * 37000 * 512

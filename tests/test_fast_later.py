"""The fast engine runs the later block (lesson 26: RMSNorm, rotary positions, SwiGLU,
grouped-query attention), each option alone and all together, against the readable model in
float64 on every backend this machine has (NumPy, the CuPy stand-in):

* a few training steps: the loss, every gradient and the parameters after Adam;
* greedy and beam search with the cache, whose keys and values have ``kv_heads`` heads;
* the new operations' NumPy twins (RMSNorm, RoPE in place, SwiGLU's gate) against the layers.
(``tests/test_fast.py`` draws these options too, in its hypothesis comparison.)
"""
from __future__ import annotations

import numpy as np
import pytest

import attn.backend as B
from attn import decode
from attn.fast import FastAdam, FastTransformer, cross_entropy as fast_ce, ops_for
from attn.gradcheck import rel_error
from attn.layers.rmsnorm import rmsnorm_backward, rmsnorm_forward
from attn.layers.rope import rope_backward, rope_forward, rope_angles
from attn.layers.swiglu import silu
from attn.loss import cross_entropy
from attn.masks import padding_mask
from attn.model import Transformer, TransformerConfig
from attn.optim import Adam

ALL = {"norm_kind": "rms", "positional": "rope", "ffn": "swiglu", "kv_heads": 2}
#: Each option alone, all together, and all together after the sub-layer (post-norm).
OPTIONS = [{"norm_kind": "rms"}, {"positional": "rope"}, {"ffn": "swiglu"}, {"kv_heads": 1}, {"kv_heads": 2},
           {**ALL, "norm_position": "pre"}, ALL]


def _config(**options):
    return TransformerConfig(**{"vocab_size": 13, "d_model": 16, "n_heads": 4, "d_ff": 12, "n_encoder_layers": 2,
                                "n_decoder_layers": 2, "dropout": 0.0, "label_smoothing": 0.1, "max_len": 32,
                                **options})


def _host(a):
    return B.to_host(a)


@pytest.mark.parametrize("options,attention", [*((o, "plain") for o in OPTIONS), (ALL, "flash"),
                                               ({**ALL, "norm_position": "pre", "kv_heads": 1}, "flash")],
                         ids=lambda o: o if isinstance(o, str) else "-".join(f"{k}={v}" for k, v in o.items()))
def test_fast_steps_match_readable_float64(backend, options, attention):
    """Three steps of each engine from the same parameters: loss, every gradient, and the
    parameters Adam leaves, to float64 rounding; the batch is split over two threads on NumPy;
    the plain attention and the tiled one (which reads each key/value head for its group)."""
    cfg = _config(**options)
    ref = Transformer(cfg, seed=3, dtype="float64")
    fast = FastTransformer(cfg, seed=3, dtype="float64", attention=attention)
    fast.workers = 2
    rng = np.random.default_rng(5)
    src = rng.integers(4, 13, (4, 7))
    tgt = rng.integers(4, 13, (4, 6))
    src[1, 4:] = 0
    tgt[2, 3:] = 0
    src, tgt_in, tgt_out = (B.to_device(a) for a in (src, tgt[:, :-1].copy(), tgt[:, 1:].copy()))
    assert_trains_alike(ref, fast, src, tgt_in, tgt_out, cfg.label_smoothing)


def assert_trains_alike(ref, fast, src, tgt_in, tgt_out, smoothing, steps: int = 3):
    """``steps`` Adam steps of the readable model ``ref`` and the engine ``fast`` (float64, equal
    parameters) on one batch: logits, loss and every gradient agree at each step, and the
    parameters after them."""
    opt_ref, opt_fast = Adam(ref.params, d_model=16, warmup_steps=2), FastAdam(fast.params, d_model=16, warmup_steps=2)
    for step in range(steps):
        logits, cache = ref.forward(src, tgt_in)
        loss_ref, d = cross_entropy(logits, tgt_out, smoothing)
        g_ref = ref.backward(d, cache)
        logits_f, cache_f = fast.forward(src, tgt_in)
        assert rel_error(_host(logits), _host(logits_f)) < 1e-12, step
        loss_fast, d_f = fast_ce(logits_f, tgt_out, smoothing, inplace=True)
        g_fast = fast.backward(d_f, cache_f)
        assert abs(float(loss_ref) - float(loss_fast)) < 1e-12, step
        assert set(g_ref) == set(g_fast)
        for k in g_ref:
            err = rel_error(_host(g_ref[k]), _host(g_fast[k]))
            assert err < 1e-10, f"step {step}: gradient of {k}, relative error {err:.1e}"
        opt_ref.step(g_ref)
        opt_fast.step(g_fast)
    for k in ref.params:        # atol: b_k's gradient is zero up to rounding (a key bias shifts every score
        # of a query alike), and Adam turns that rounding into steps of up to 1e-9
        assert np.allclose(_host(ref.params[k]), _host(fast.params[k]), rtol=1e-10, atol=1e-8), k


@pytest.mark.parametrize("beam,use_cache", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("options", [ALL, {**ALL, "norm_position": "pre", "kv_heads": 1}], ids=["post", "pre-mqa"])
def test_fast_decoding_matches_readable(backend, options, beam, use_cache):
    """Greedy and beam search, with the cache and without (the prefix recomputed), the later
    block: the readable decoder's tokens and scores; the cache holds kv_heads heads per layer."""
    cfg = _config(**options)
    ref = Transformer(cfg, seed=1, dtype="float64")
    fast = FastTransformer.from_model(ref)
    src = B.to_device(np.array([[4, 5, 6, 7, 0], [8, 5, 4, 6, 7], [6, 0, 0, 0, 0], [7, 7, 5, 12, 0]]))
    if beam == 1:
        want, got = (decode.greedy_decode(m, src, max_len=9, use_cache=use_cache) for m in (ref, fast))
    else:
        want, got = (decode.beam_search(m, src, beam_size=beam, max_len=9, use_cache=use_cache)
                     for m in (ref, fast))
    assert got.tokens == want.tokens
    assert np.allclose(got.scores, want.scores, rtol=1e-12, atol=1e-12)
    memory, _ = fast.encode(src)
    state = fast.start_decoding(memory, padding_mask(src))
    _, state, _ = fast.decode_step(B.to_device(np.array([1, 1, 1, 1])), state)
    keys, values = state.self_kv[0]
    assert keys.shape[:2] == values.shape[:2] == (4, cfg.key_value_heads)


def test_twins_of_the_later_operations_match_the_layers(backend):
    """rms_norm_ (and its backward), rope_ in place on a strided view (and turned back),
    swiglu_gate (and its backward) against the readable layers, in float64."""
    xp, ops = backend, ops_for(backend)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 10))
    gamma = rng.standard_normal(10)
    dout = rng.standard_normal((6, 10))
    want, cache = rmsnorm_forward(x, gamma, 1e-6)
    dx_want, dgamma_want = rmsnorm_backward(dout, cache)
    xhat = xp.asarray(x)
    out, rstd = ops.rms_norm_(xhat, xp.asarray(gamma), 1e-6)
    dx, dgamma = ops.rms_norm_backward_(xp.asarray(dout), xhat, rstd, xp.asarray(gamma))
    for a, b in ((want, out), (dx_want, dx), (dgamma_want, dgamma)):
        assert rel_error(a, _host(b)) < 1e-13

    qkv = rng.standard_normal((2, 5, 3, 4, 6))                 # (B, T, q|k|v, H, Dh): the heads of a projection
    q_want, rc = rope_forward(qkv[:, :, 1].transpose(0, 2, 1, 3), base=100.0)
    cos, sin = (xp.asarray(a) for a in rope_angles(np.arange(5), 6, 100.0))
    dev = xp.asarray(qkv)
    q = dev[:, :, 1].transpose(0, 2, 1, 3)
    ops.rope_(q, cos, sin)
    assert rel_error(q_want, _host(q)) < 1e-13
    assert np.array_equal(_host(dev[:, :, ::2]), qkv[:, :, ::2])           # its neighbours untouched
    ops.rope_(q, cos, sin, inverse=True)
    assert rel_error(rope_backward(q_want, rc), _host(q)) < 1e-13

    ab = rng.standard_normal((6, 8))
    dh = rng.standard_normal((6, 4))
    g, s = silu(ab[:, :4])
    h = ops.swiglu_gate(xp.asarray(ab))
    assert rel_error(g * ab[:, 4:], _host(h)) < 1e-13
    dab = _host(ops.swiglu_gate_backward(xp.asarray(dh), xp.asarray(ab)))
    a, b = ab[:, :4], ab[:, 4:]
    assert rel_error(dh * g, dab[:, 4:]) < 1e-13
    assert rel_error(dh * b * s * (1 + a * (1 - s)), dab[:, :4]) < 1e-13


def test_rotary_tables_are_made_once(backend):
    """The rotary positions' cos and sin are made on the first step and kept: later steps
    reuse the same device arrays (no host-to-device copy per layer per step)."""
    fast = FastTransformer(_config(positional="rope"), seed=0, dtype="float64")
    src = B.to_device(np.array([[4, 5, 6, 0]]))
    fast.forward(src, src)
    tables = fast.embeddings.rope
    fast.forward(src, src[:, :3])
    assert fast.embeddings.rope is tables and B.get_array_module(tables[0]) is backend


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_fast_gradient_with_dropout_matches_numerical(backend, norm):
    """Every dropout on, the later block (on the stand-in: the kernels' dropout regenerated from
    its counter in RMSNorm's epilogue and backward and in SwiGLU's gate): the fast gradient of
    every parameter against central differences, float64."""
    from attn.gradcheck import numerical_gradient
    cfg = TransformerConfig(vocab_size=7, d_model=8, n_heads=2, d_ff=6, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.3, attention_dropout=0.3, relu_dropout=0.3, max_len=8, norm_position=norm,
                            **{**ALL, "kv_heads": 1})
    model = FastTransformer(cfg, seed=2, dtype="float64")
    src, tgt_in, tgt_out = (B.to_device(np.array(a)) for a in ([[4, 5, 6], [5, 3, 0]], [[1, 4, 5], [1, 6, 0]],
                                                                  [[4, 5, 2], [6, 2, 0]]))

    def loss():
        return cross_entropy(model.forward(src, tgt_in, B.DeviceRNG(7))[0], tgt_out, 0.0)[0]

    logits, cache = model.forward(src, tgt_in, B.DeviceRNG(7))
    _, d = fast_ce(logits, tgt_out, 0.0)
    grads = model.backward(d, cache)
    # a few entries of the parameters the new operations touch (the stand-in's kernels are slow)
    for name in ("encoder.0.norm1.gamma", "decoder.0.norm3.gamma", "decoder.0.ffn.w1", "decoder.0.ffn.w3",
                 "encoder.0.ffn.w2", "encoder.0.self_attn.w_k", "decoder.0.self_attn.w_q", "embedding.weight"):
        p = model.params[name]
        picked = np.random.default_rng(len(name)).choice(p.size, 3, replace=False)
        num = _host(numerical_gradient(loss, p, indices=picked)).reshape(-1)[picked]
        got = _host(grads[name]).reshape(-1)[picked]
        err, off = rel_error(got, num), float(np.abs(got - num).max())
        assert err < 1e-6 or off < 1e-9, f"{name}: relative error {err:.1e}, at most {off:.1e}"


@pytest.mark.parametrize("H", [2, 4])
def test_the_fast_cache_of_a_multi_query_model_is_one_over_n_heads_of_the_papers(backend, H):
    """Measured, not assumed: the bytes of the buffers the fast decoding state holds (its
    self-attention keys and values with their room to grow, and the cross-attention's) after a
    few steps, for kv_heads = 1 against as many key/value heads as heads."""
    rng = np.random.default_rng(H)
    src, tokens = B.to_device(rng.integers(1, 13, (3, 7))), B.to_device(rng.integers(1, 13, (3, 5)))
    held = {}
    for kv in (None, 1):
        fast = FastTransformer(_config(n_heads=H, kv_heads=kv, positional="rope"), seed=0)
        memory, _ = fast.encode(src)
        state = fast.start_decoding(memory, padding_mask(src))
        for t in range(tokens.shape[1]):
            _, state, _ = fast.decode_step(tokens[:, t], state)
        held[kv] = sum(int(a.nbytes) for a in [*state.kv.keys, *state.kv.values, *(x for p in state.cross for x in p)])
    assert held[1] * H == held[None], held

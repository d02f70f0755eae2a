"""The library's own answer to every ``attn-check`` exercise, under the names the
exercises use.

The layers are :mod:`attn.layers`, the masks :mod:`attn.masks` and the loss
:mod:`attn.loss`, re-exported. What the library has only as part of something larger
(a whole Transformer, an Adam step inside :class:`attn.optim.Adam`) is written here as a
plain function *by calling that larger thing*, so that an exercise is graded against the
code the library runs; the encoder and decoder layers are :mod:`attn.model`'s own, given the
exercise's config.
``attn-check --timings`` grades this module (as a file, in a child process: hence the
absolute imports).
"""
from __future__ import annotations

from attn.layers import *  # noqa: F401,F403
from attn.layers import merge_heads, sinusoidal_table, split_heads  # noqa: F401
from attn.loss import cross_entropy  # noqa: F401
from attn.masks import causal_mask, decoder_mask, padding_mask  # noqa: F401

from attn import backend as B
from attn.bpe import learn_merges as _learn_merges
from attn.decode import beam_search as _beam_search, greedy_decode as _greedy_decode
from attn.layers import linear_backward, linear_forward, softmax_backward, softmax_forward
from attn.grader.built import decoding_model  # noqa: F401
from attn import model
from attn.model import Transformer, TransformerConfig
from attn.optim import Adam, noam_lr  # noqa: F401

# --------------------------------------------------------------------------- lesson 2: Luong attention


def luong_attention_forward(s, e, w_c, b_c, src_mask):
    """Luong's global attention with the dot score (lesson 2).

    Inputs: s (B, T, H) decoder states; e (B, S, H) encoder states; w_c (2H, H); b_c (H,);
    src_mask (B, S) bool, True at real source positions.
    Returns: ``tanh([a @ e ; s] @ w_c + b_c)`` (B, T, H) with ``a = softmax(s @ e^T)``, cache.
    """
    xp = B.get_array_module(s)
    a, c_soft = softmax_forward(s @ e.swapaxes(-1, -2), src_mask[:, None, :])      # (B, T, S)
    ctx = a @ e                                                                   # (B, T, H)
    z, c_lin = linear_forward(xp.concatenate([ctx, s], axis=-1), w_c, b_c)
    out = xp.tanh(z)
    return out, (s, e, a, c_soft, c_lin, out)


def luong_attention_backward(dout, cache):
    """Returns: ds (B, T, H), de (B, S, H), dw_c (2H, H), db_c (H,)."""
    s, e, a, c_soft, c_lin, out = cache
    H = s.shape[-1]
    dcat, dw_c, db_c = linear_backward(dout * (1 - out * out), c_lin)
    dctx, ds = dcat[..., :H], dcat[..., H:]
    de = a.swapaxes(-1, -2) @ dctx                       # e as the values
    dscores = softmax_backward(dctx @ e.swapaxes(-1, -2), c_soft)
    return ds + dscores @ e, de + dscores.swapaxes(-1, -2) @ s, dw_c, db_c

# --------------------------------------------------------------------------- lesson 9: layers and the model


def _config(params: dict, n_heads: int, eps: float, vocab: int = 2) -> TransformerConfig:
    n_enc = len({k.split(".")[1] for k in params if k.startswith("encoder.")}) or 1
    n_dec = len({k.split(".")[1] for k in params if k.startswith("decoder.")}) or 1
    w1 = next(v for k, v in params.items() if k.endswith("ffn.w1"))
    return TransformerConfig(vocab_size=vocab, d_model=int(w1.shape[0]), n_heads=n_heads, d_ff=int(w1.shape[1]),
                             n_encoder_layers=n_enc, n_decoder_layers=n_dec, dropout=0.0, ln_eps=eps,
                             share_embeddings=True, norm_position="post", positional="sinusoidal")


def _model(params: dict, n_heads: int, eps: float, vocab: int = 2) -> Transformer:
    dtype = next(iter(params.values())).dtype
    return Transformer(_config(params, n_heads, eps, vocab), dtype=dtype, params=params)


def encoder_layer_forward(x, mask, params, n_heads, eps=1e-6):
    """:func:`attn.model.encoder_layer_forward` (post-norm, no dropout): ``h = LayerNorm1(x +
    SelfAttention(x))``, ``out = LayerNorm2(h + FFN(h))``.

    Inputs: x (B, S, D); mask (B, 1, 1, S) bool or None; params keyed ``self_attn.w_q`` ...
    ``self_attn.b_o``, ``norm1.gamma``, ``norm1.beta``, ``ffn.w1`` ... ``ffn.b2``,
    ``norm2.gamma``, ``norm2.beta``. Returns: out (B, S, D), cache.
    """
    return model.encoder_layer_forward(x, mask, params, _config(params, n_heads, eps))


def encoder_layer_backward(dout, cache):
    """Returns: dx (B, S, D), grads (a dict keyed like params)."""
    return model.encoder_layer_backward(dout, cache)


def decoder_layer_forward(x, memory, src_mask, tgt_mask, params, n_heads, eps=1e-6):
    """:func:`attn.model.decoder_layer_forward` (post-norm, no dropout): masked self-attention,
    cross-attention over ``memory``, feed-forward, each in its Add & Norm. params keyed
    ``self_attn.*``, ``norm1.*``, ``cross_attn.*``, ``norm2.*``, ``ffn.*``, ``norm3.*``.
    Returns: out (B, T, D), cache.
    """
    return model.decoder_layer_forward(x, memory, src_mask, tgt_mask, params, _config(params, n_heads, eps))


def decoder_layer_backward(dout, cache):
    """Returns: dx (B, T, D), dmemory (B, S, D), grads (a dict keyed like params)."""
    return model.decoder_layer_backward(dout, cache)


def _decoder_only_config(params: dict, n_heads: int, eps: float) -> TransformerConfig:
    w1 = params["ffn.w1"]
    return TransformerConfig(vocab_size=2, d_model=int(w1.shape[0]), n_heads=n_heads, d_ff=int(w1.shape[1]),
                             n_encoder_layers=0, n_decoder_layers=1, dropout=0.0, ln_eps=eps,
                             share_embeddings=True, norm_position="post", positional="sinusoidal")


def decoder_only_layer_forward(x, params, n_heads, eps=1e-6):
    """:func:`attn.model.decoder_layer_forward` of a decoder-only config (``n_encoder_layers=0``:
    no cross-attention; post-norm, no dropout): ``h = LayerNorm1(x + SelfAttention(x, x,
    causal_mask(T)))``, ``out = LayerNorm2(h + FFN(h))``. params keyed ``self_attn.*``,
    ``norm1.*``, ``ffn.*``, ``norm2.*`` (the library's decoder layer calls the second norm
    ``norm3``). Returns: out (B, T, D), cache.
    """
    p = {("norm3." + k[len("norm2."):] if k.startswith("norm2.") else k): v for k, v in params.items()}
    mask = causal_mask(x.shape[1], B.get_array_module(x))
    return model.decoder_layer_forward(x, None, None, mask, p, _decoder_only_config(params, n_heads, eps))


def decoder_only_layer_backward(dout, cache):
    """Returns: dx (B, T, D), grads (a dict keyed like params)."""
    dx, _, grads = model.decoder_layer_backward(dout, cache)
    return dx, {("norm2." + k[len("norm3."):] if k.startswith("norm3.") else k): g for k, g in grads.items()}


def transformer_forward(src, tgt_in, params, n_heads, eps=1e-6):
    """The whole :class:`attn.model.Transformer` (post-norm, sinusoidal positions, one
    embedding matrix ``embedding.weight`` shared by the source, the target and the output
    projection, no dropout). Inputs: src (B, S), tgt_in (B, T) ids padded with 0.
    Returns: logits (B, T, V), cache."""
    m = _model(params, n_heads, eps, int(params["embedding.weight"].shape[0]))
    logits, cache = m.forward(src, tgt_in)
    return logits, (m, cache)


def transformer_backward(dlogits, cache):
    """Returns: grads, a dict keyed like params (``embedding.weight`` collects its three paths)."""
    m, c = cache
    return m.backward(dlogits, c)


# --------------------------------------------------------------------------- lesson 11: Adam


def adam_step(params, grads, m, v, t, lr, beta1=0.9, beta2=0.98, eps=1e-9):
    """One Adam update of :class:`attn.optim.Adam` at step ``t`` (1-based) with learning rate
    ``lr``. Inputs are dicts of arrays keyed alike; nothing is changed in place.
    Returns: (new params, new m, new v)."""
    p = {k: a.copy() for k, a in params.items()}
    opt = Adam(p, d_model=1, betas=(beta1, beta2), eps=eps, lr=lr)
    opt.m = {k: a.copy() for k, a in m.items()}
    opt.v = {k: a.copy() for k, a in v.items()}
    opt.t = int(t) - 1
    opt.step(grads)
    return p, opt.m, opt.v

# --------------------------------------------------------------------------- lesson 15: decoding


def greedy_decode(model, src, max_len):
    """:func:`attn.decode.greedy_decode`: (tokens per sentence, EOS excluded; their summed log-probabilities)."""
    r = _greedy_decode(model, src, max_len)
    return r.tokens, r.scores


def beam_search(model, src, beam_size, alpha, max_len):
    """:func:`attn.decode.beam_search`: (the best hypothesis per sentence; its length-penalised score)."""
    r = _beam_search(model, src, beam_size, alpha, max_len)
    return r.tokens, r.scores


def average_checkpoints(checkpoints):
    """The parameter-wise mean of a list of parameter dicts, summed in float64 and cast back
    (what :func:`attn.training.checkpoints.average_snapshots` does with the snapshots' files)."""
    total = {k: v.astype("float64") for k, v in checkpoints[0].items()}
    for c in checkpoints[1:]:
        for k, v in c.items():
            total[k] = total[k] + v
    return {k: (v / len(checkpoints)).astype(checkpoints[0][k].dtype) for k, v in total.items()}

# --------------------------------------------------------------------------- lesson 13: BPE


def learn_merges(token_counts, num_merges):
    """:func:`attn.bpe.learn_merges` with its defaults: the merges, in the order learned."""
    return _learn_merges(token_counts, num_merges)[1]



"""The wrong results of typical mistakes, computed on an example: each layer's registration
(:mod:`attn.testing.registry`) pairs them with what its hints say of them
(:class:`attn.testing.Mistake`), and the grader names the one a learner's result equals.

Each takes ``(example, dout)``, the example's host arrays and the upstream gradient of a
backward (None for a forward or a function), and returns the result with the mistake made."""
from __future__ import annotations

from .. import backend as B

np = B.host


# -- the terms of the gradients the lessons derive by hand, and their factors


def _layer_norm_terms(x, gamma, eps, dout):
    """The two terms of layer norm's dx besides the direct ``rstd * g``: the mean's, the variance's."""
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xhat, g = (x - mean) * rstd, dout * gamma
    return -rstd * g.mean(axis=-1, keepdims=True) + 0 * x, -rstd * xhat * (g * xhat).mean(axis=-1, keepdims=True)


def layer_norm_mean_term(ex, dout):
    return _layer_norm_terms(ex.get("x"), ex.get("gamma"), ex.get("eps"), dout)[0]


def layer_norm_variance_term(ex, dout):
    return _layer_norm_terms(ex.get("x"), ex.get("gamma"), ex.get("eps"), dout)[1]


def _normaliser_term(y, dy):
    return -y * (dy * y).sum(axis=-1, keepdims=True)


def softmax_normaliser_term(ex, dout):
    from ..layers import softmax_forward
    return _normaliser_term(softmax_forward(ex.get("x"), ex.get("mask"))[0], dout)


def attention_normaliser_term(ex, dout):
    """The softmax's normaliser's term, carried to dq and dk (examples without dropout)."""
    from ..layers import attention_forward
    q, k, v = ex.get("q"), ex.get("k"), ex.get("v")
    if ex.get("dropout"):
        raise ValueError("dropout: the weights that multiplied v are not the softmax's")
    w = attention_forward(q, k, v, ex.get("mask"))[1].weights
    ds = _normaliser_term(w, dout @ v.swapaxes(-1, -2)) / np.sqrt(q.shape[-1])
    return {"dq": ds @ k, "dk": ds.swapaxes(-1, -2) @ q}


def _residual(ex, dout):
    """residual_ffn's norm's terms and its skip path, each carried to x (z = x + FFN(x))."""
    from .. import layers as L
    x, eps, gamma = ex.get("x"), ex.get("eps"), ex.get("gamma")
    f, cf = L.feed_forward_forward(*(ex.get(n) for n in ("x", "w1", "b1", "w2", "b2")))
    _, cn = L.layer_norm_forward(x + f, gamma, ex.get("beta"), eps)
    mean, variance = (t + L.feed_forward_backward(t, cf)[0] for t in _layer_norm_terms(x + f, gamma, eps, dout))
    return L.layer_norm_backward(dout, cn)[0], mean, variance


def residual_skip_term(ex, dout):
    return _residual(ex, dout)[0]


def residual_norm_mean_term(ex, dout):
    return _residual(ex, dout)[1]


def residual_norm_variance_term(ex, dout):
    return _residual(ex, dout)[2]


def scores_scale(ex):
    return 1.0 / np.sqrt(ex.get("q").shape[-1])


def one_over_rows(ex):
    return 1.0 / (ex.get("x").size // ex.get("x").shape[-1])


# -- embedding, positions


def embedding_ids_overwrite(ex, dout):
    """``dW[ids] += g``: a repeated id keeps one position's gradient, not their sum."""
    W, ids = ex.get("W"), ex.get("ids")
    dW = np.zeros_like(W)
    dW[ids.reshape(-1)] += dout.reshape(-1, W.shape[1]) * ex.get("scale")
    return dW


def embedding_unscaled_grad(ex, dout):
    W, ids = ex.get("W"), ex.get("ids")
    dW = np.zeros_like(W)
    np.add.at(dW, ids.reshape(-1), dout.reshape(-1, W.shape[1]))
    return dW


def _dtable(ex, rows):
    table, T = ex.get("table"), ex.get("x").shape[-2]
    d = np.zeros_like(table)
    d[:T] = rows
    return d


def positional_first_sentence(ex, dout):
    return _dtable(ex, dout[0])


def positional_batch_mean(ex, dout):
    return _dtable(ex, dout.mean(axis=0))


def _angles(ex, exponent):
    pos = np.arange(ex.get("max_len"), dtype=np.float64)[:, None]
    return pos / 10000.0 ** exponent


def sinusoidal_halves(ex, dout):
    """Sines in the first half of the columns, cosines in the second, instead of interleaved."""
    D = ex.get("d_model")
    angle = _angles(ex, np.arange(0, D, 2)[None, :] / D)
    h = angle.shape[1]
    return np.concatenate([np.sin(angle), np.cos(angle[:, :D - h])], axis=1)


def sinusoidal_column_exponent(ex, dout):
    """The exponent of each column its own index j / d_model, not the pair's 2i / d_model."""
    D = ex.get("d_model")
    angle = _angles(ex, np.arange(D)[None, :] / D)
    pe = np.cos(angle)
    pe[:, 0::2] = np.sin(angle[:, 0::2])
    return pe


# -- feed-forward


def _ffn(ex):
    x, w1, b1, w2, b2 = (ex.get(n) for n in ("x", "w1", "b1", "w2", "b2"))
    return x, w1, b1, w2, b2, x @ w1 + b1


def ffn_no_relu(ex, dout):
    x, w1, b1, w2, b2, h = _ffn(ex)
    return h @ w2 + b2


def ffn_relu_last(ex, dout):
    x, w1, b1, w2, b2, h = _ffn(ex)
    return np.maximum(h @ w2 + b2, 0)


def ffn_dx_no_mask(ex, dout):
    x, w1, b1, w2, b2, h = _ffn(ex)
    return dout @ w2.T @ w1.T


def ffn_dw2_before_relu(ex, dout):
    x, w1, b1, w2, b2, h = _ffn(ex)
    return h.reshape(-1, h.shape[-1]).T @ dout.reshape(-1, dout.shape[-1])


# -- heads


def _split(ex, order):
    x, H = ex.get("x"), ex.get("H")
    Bsz, T, D = x.shape
    return {"interleaved": lambda: x.reshape(Bsz, T, D // H, H).transpose(0, 3, 1, 2),
            "reshaped": lambda: x.reshape(Bsz, H, T, D // H),
            "untransposed": lambda: x.reshape(Bsz, T, H, D // H)}[order]()


def split_interleaved(ex, dout):
    return _split(ex, "interleaved")


def split_reshaped_only(ex, dout):
    return _split(ex, "reshaped")


def split_untransposed(ex, dout):
    return _split(ex, "untransposed")


def merge_reshaped_only(ex, dout):
    x = ex.get("x")
    Bsz, H, T, Dh = x.shape
    return x.reshape(Bsz, T, H * Dh)


def merge_interleaved(ex, dout):
    x = ex.get("x")
    Bsz, H, T, Dh = x.shape
    return x.transpose(0, 2, 3, 1).reshape(Bsz, T, H * Dh)


def merge_features_first(ex, dout):
    x = ex.get("x")
    Bsz, H, T, Dh = x.shape
    return x.reshape(Bsz, H * Dh, T).swapaxes(1, 2)


# -- multi-head and grouped-query attention


def _attention_grads(ex, dout, reduce=None, **scaled):
    """The library's forward (the query or output weights replaced by ``scaled``), and the
    gradients of q, k, v per query head; ``reduce`` folds a group of query heads' key/value
    gradients into their head (the sum, when right)."""
    from .. import layers as L
    args = {n: ex.get(n) for n in ("x_q", "x_kv") + MHA_WEIGHTS}
    args.update(scaled)
    H, kv = ex.get("n_heads"), dict(ex.args).get("kv_heads") or ex.get("n_heads")
    out, c = L.multi_head_attention_forward(*args.values(), H, ex.get("mask"), kv_heads=kv)
    if dout is None:
        return out
    dq, dk, dv = L.attention_backward(L.split_heads(L.linear_backward(dout, c.lin_o)[0], H), c.attn)
    Bsz, _, S, Dh = dk.shape
    fold = reduce or (lambda a: a.reshape(Bsz, kv, H // kv, S, Dh).sum(axis=2))
    dx_k = L.linear_backward(L.merge_heads(fold(dk)), c.lin_k)[0]
    dx_v = L.linear_backward(L.merge_heads(fold(dv)), c.lin_v)[0]
    return dx_k, dx_v


MHA_WEIGHTS = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")


def heads_scaled_by_d_model(ex, dout):
    """The scores divided by sqrt(d_model), not by sqrt(Dh) of a head."""
    c = (ex.get("x_q").shape[-1] // ex.get("n_heads") / ex.get("x_q").shape[-1]) ** 0.5
    return _attention_grads(ex, None, w_q=ex.get("w_q") * c, b_q=ex.get("b_q") * c)


def heads_no_output_projection(ex, dout):
    D = ex.get("x_q").shape[-1]
    return _attention_grads(ex, None, w_o=np.eye(D), b_o=np.zeros(D))


def dx_kv_keys_only(ex, dout):
    return _attention_grads(ex, dout)[0]


def dx_kv_values_only(ex, dout):
    return _attention_grads(ex, dout)[1]


def _group_fold(ex, how):
    H, kv = ex.get("n_heads"), ex.get("kv_heads")

    def fold(a):
        g = a.reshape(a.shape[0], kv, H // kv, *a.shape[2:])
        return g.mean(axis=2) if how == "mean" else g[:, :, 0]
    return fold


def gqa_group_mean(ex, dout):
    return sum(_attention_grads(ex, dout, _group_fold(ex, "mean")))


def gqa_group_first(ex, dout):
    return sum(_attention_grads(ex, dout, _group_fold(ex, "first")))


# -- recurrent cells


STEP_GRADIENTS = ("dx", "dh_prev", "dw_x", "dw_h", "db")


def _step(ex, dout, derivative):
    """Every gradient of an RNN step whose tanh derivative is ``derivative(a, h)``."""
    x, h_prev, w_x, w_h, b = (ex.get(n) for n in ("x", "h_prev", "w_x", "w_h", "b"))
    a = x @ w_x + h_prev @ w_h + b
    da = dout * derivative(a, np.tanh(a))
    return dict(zip(STEP_GRADIENTS, (da @ w_x.T, da @ w_h.T, x.T @ da, h_prev.T @ da, da.sum(axis=0))))


def step_tanh_by_exp(ex, dout):
    """tanh written (exp(2a) - 1) / (exp(2a) + 1): inf / inf = NaN once exp(2a) overflows."""
    x, h_prev, w_x, w_h, b = (ex.get(n) for n in ("x", "h_prev", "w_x", "w_h", "b"))
    a = x @ w_x + h_prev @ w_h + b
    with np.errstate(all="ignore"):
        return (np.exp(2 * a) - 1) / (np.exp(2 * a) + 1)


def step_no_tanh_derivative(ex, dout):
    return _step(ex, dout, lambda a, h: 1.0)


def step_tanh_derivative_unsquared(ex, dout):
    return _step(ex, dout, lambda a, h: 1 - h)


def step_tanh_derivative_of_preactivation(ex, dout):
    return _step(ex, dout, lambda a, h: 1 - a * a)


def _sequence(ex):
    from ..layers import rnn_forward
    x, h0, w_x, w_h, b, mask = (ex.get(n) for n in ("x", "h0", "w_x", "w_h", "b", "mask"))
    hs = rnn_forward(x, h0, w_x, w_h, b, mask)[0]
    live = np.ones(hs.shape[:2], bool) if mask is None else mask
    return x, h0, w_x, w_h, hs, live


def rnn_no_carry(ex, dout):
    """Each step's gradient from its own output alone: nothing carried back from step t+1."""
    x, h0, w_x, w_h, hs, live = _sequence(ex)
    return (dout * (1 - hs * hs) * live[..., None]) @ w_x.T


def rnn_dw_h_of_h_t(ex, dout):
    """dw_h from each step's own state h_t instead of the state h_{t-1} that multiplied w_h."""
    x, h0, w_x, w_h, hs, live = _sequence(ex)
    das = np.zeros_like(hs)
    g = np.zeros_like(h0)
    for t in reversed(range(hs.shape[1])):         # rnn_backward's walk, to read every da_t
        g = g + dout[:, t]
        da = np.where(live[:, t, None], g * (1 - hs[:, t] ** 2), 0.0)
        das[:, t] = da
        g = np.where(live[:, t, None], da @ w_h.T, g)
    return hs.reshape(-1, hs.shape[-1]).T @ das.reshape(-1, hs.shape[-1])


def rnn_mask_ignored(ex, dout):
    from ..layers import rnn_forward
    return rnn_forward(*(ex.get(n) for n in ("x", "h0", "w_x", "w_h", "b")), None)[0]


# -- masks


def _tril(ex, k):
    T = ex.get("T")
    return np.tril(np.ones((T, T), dtype=bool), k)[None, None]


def causal_without_diagonal(ex, dout):
    return _tril(ex, -1)


def causal_one_ahead(ex, dout):
    return _tril(ex, 1)


def causal_without_axes(ex, dout):
    return _tril(ex, 0)[0, 0]


def causal_upper(ex, dout):
    T = ex.get("T")
    return np.triu(np.ones((T, T), dtype=bool))[None, None]


def padding_inverted(ex, dout):
    return (ex.get("ids") == ex.get("pad_id"))[:, None, None, :]


def padding_on_queries(ex, dout):
    return (ex.get("ids") != ex.get("pad_id"))[:, None, :, None]


def _decoder(ex):
    ids = ex.get("tgt_ids")
    T = ids.shape[1]
    return np.tril(np.ones((T, T), dtype=bool))[None, None], ids != ex.get("pad_id")


def decoder_causal_only(ex, dout):
    return np.broadcast_to(_decoder(ex)[0], (ex.get("tgt_ids").shape[0], 1) + _decoder(ex)[0].shape[2:])


def decoder_padding_only(ex, dout):
    future, real = _decoder(ex)
    return np.broadcast_to(real[:, None, None, :], (real.shape[0], 1) + future.shape[2:])


def decoder_either(ex, dout):
    future, real = _decoder(ex)
    return future | real[:, None, None, :]


def decoder_padding_on_queries(ex, dout):
    future, real = _decoder(ex)
    return future & real[:, None, :, None]


# -- the loss, the schedule, the optimizer


def _loss(ex, **changes):
    from ..loss import cross_entropy
    args = {n: ex.get(n) for n in ("logits", "targets", "smoothing", "pad_id")}
    args.update(changes)
    return cross_entropy(*args.values())


def _real(ex):
    t, pad = ex.get("targets"), ex.get("pad_id")
    return t.size if pad is None else int((t != pad).sum())


def loss_over_every_token(ex, dout):
    """The mean over every position, padding included, instead of over the real targets."""
    return _loss(ex)[1] * _real(ex) / ex.get("targets").size


def loss_value_over_every_token(ex, dout):
    return float(_loss(ex)[0]) * _real(ex) / ex.get("targets").size


def loss_without_smoothing(ex, dout):
    return _loss(ex, smoothing=0.0)[1]


def loss_value_without_smoothing(ex, dout):
    return float(_loss(ex, smoothing=0.0)[0])


def loss_gradient_of_the_sum(ex, dout):
    return _loss(ex)[1] * _real(ex)


def _noam(ex, step_exponent=-0.5, warmup_exponent=-1.5, d_model=True, pick=min):
    step, warm = ex.get("step"), ex.get("warmup_steps")
    return (ex.get("factor") * (ex.get("d_model") ** -0.5 if d_model else 1.0)
            * pick(step ** step_exponent, step * warm ** warmup_exponent))


def noam_without_d_model(ex, dout):
    return _noam(ex, d_model=False)


def noam_max(ex, dout):
    return _noam(ex, pick=max)


def noam_warmup_square_root(ex, dout):
    return _noam(ex, warmup_exponent=-0.5)


def _adam_first_step(ex, correct1, correct2, eps_inside=False):
    b1, b2, eps, lr = ex.get("beta1"), ex.get("beta2"), ex.get("eps"), ex.get("lrs")[0]
    out = {}
    for k, p in ex.get("params").items():
        g = ex.get("grads")[0][k]
        m, v = (1 - b1) * g / correct1(b1), (1 - b2) * g * g / correct2(b2)
        out[k] = p - lr * m / (np.sqrt(v + eps) if eps_inside else np.sqrt(v) + eps)
    return out


def adam_no_bias_correction(ex, dout):
    return _adam_first_step(ex, lambda b: 1.0, lambda b: 1.0)


def adam_eps_inside(ex, dout):
    return _adam_first_step(ex, lambda b: 1 - b, lambda b: 1 - b, eps_inside=True)


def adam_v_uncorrected(ex, dout):
    return _adam_first_step(ex, lambda b: 1 - b, lambda b: 1.0)


# -- the later block: RMSNorm, rotary positions, SwiGLU


def _rms(ex):
    x = ex.get("x")
    rrms = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + ex.get("eps"))
    return x, rrms, ex.get("gamma")


def rmsnorm_dx_direct_only(ex, dout):
    x, rrms, gamma = _rms(ex)
    return rrms * dout * gamma


def rmsnorm_mean_subtracted(ex, dout):
    from ..layers import layer_norm_forward
    return layer_norm_forward(ex.get("x"), ex.get("gamma"), np.zeros_like(ex.get("gamma")), ex.get("eps"))[0]


def rmsnorm_eps_outside(ex, dout):
    x, _, gamma = _rms(ex)
    return gamma * x / (np.sqrt((x * x).mean(axis=-1, keepdims=True)) + ex.get("eps"))


def _turn(x, cos, sin):
    h = x.shape[-1] // 2
    return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., :h] * sin + x[..., h:] * cos], axis=-1)


def _rope_angles(ex, exponent_step=2):
    x, positions = ex.get("x"), ex.get("positions")
    T, Dh = x.shape[-2:]
    pos = np.arange(T) if positions is None else positions
    angle = pos[:, None] * ex.get("base") ** (-np.arange(0, exponent_step * (Dh // 2), exponent_step) / Dh)
    return np.cos(angle), np.sin(angle)


def rope_backward_same_way(ex, dout):
    return _turn(dout, *_rope_angles(ex))


def rope_neighbours(ex, dout):
    """Pairs of neighbours (2i, 2i+1) turned, with the half split's angles."""
    x = ex.get("x")
    cos, sin = _rope_angles(ex)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def rope_exponent_without_two(ex, dout):
    return _turn(ex.get("x"), *_rope_angles(ex, exponent_step=1))


def _swiglu(ex):
    x, w, v, w2 = (ex.get(n) for n in ("x", "w", "v", "w2"))
    a, b = x @ w, x @ v
    return x, w, v, w2, a, b, 1 / (1 + np.exp(-a))


def swiglu_gate_derivative_sigmoid(ex, dout):
    x, w, v, w2, a, b, s = _swiglu(ex)
    dh = dout @ w2.T
    return (dh * b * s) @ w.T + (dh * a * s) @ v.T


def swiglu_dv_without_sigmoid(ex, dout):
    """dv with db = dh * a: the gate's sigmoid left out of the value path's gradient."""
    x, w, v, w2, a, b, s = _swiglu(ex)
    dh = dout @ w2.T
    return x.reshape(-1, w.shape[0]).T @ (dh * a).reshape(-1, w.shape[1])


def swiglu_dx_gate_only(ex, dout):
    x, w, v, w2, a, b, s = _swiglu(ex)
    dh = dout @ w2.T
    return (dh * b * s * (1 + a * (1 - s))) @ w.T


def swiglu_silu_on_values(ex, dout):
    x, w, v, w2, a, b, s = _swiglu(ex)
    return (a * b / (1 + np.exp(-b))) @ w2


def swiglu_sigmoid_gate(ex, dout):
    x, w, v, w2, a, b, s = _swiglu(ex)
    return (s * b) @ w2


def swiglu_silu_overflows(ex, dout):
    """SiLU written a * exp(a) / (1 + exp(a)): inf / inf = NaN once exp(a) overflows."""
    x, w, v, w2, a, b, s = _swiglu(ex)
    with np.errstate(all="ignore"):
        return (a * np.exp(a) / (1 + np.exp(a)) * b) @ w2


# -- Luong's attention, the encoder and decoder layers


def _luong(ex, dout):
    from .. import layers as L
    s, e, w_c, b_c, mask = (ex.get(n) for n in ("s", "e", "w_c", "b_c", "src_mask"))
    a, c_soft = L.softmax_forward(s @ e.transpose(0, 2, 1), None if mask is None else mask[:, None, :])
    H = s.shape[-1]
    out = np.tanh(np.concatenate([a @ e, s], axis=-1) @ w_c + b_c)
    dcat = (dout * (1 - out * out)) @ w_c.T
    dctx = dcat[..., :H]
    dscores = L.softmax_backward(dctx @ e.transpose(0, 2, 1), c_soft)
    return a, dcat, dctx, dscores


def luong_state_first(ex, dout):
    s, e, w_c, b_c, mask = (ex.get(n) for n in ("s", "e", "w_c", "b_c", "src_mask"))
    a = _luong(ex, np.zeros(s.shape))[0]
    return np.tanh(np.concatenate([s, a @ e], axis=-1) @ w_c + b_c)


def luong_ds_concatenation_only(ex, dout):
    return _luong(ex, dout)[1][..., ex.get("s").shape[-1]:]


def luong_de_context_only(ex, dout):
    a, dcat, dctx, dscores = _luong(ex, dout)
    return a.transpose(0, 2, 1) @ dctx


ATT = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
FFN = ("w1", "b1", "w2", "b2")


class _Block:
    """A layer's sub-layers on an example's parameters, each returning (out, cache)."""

    def __init__(self, ex):
        from .. import layers as L
        self.L, self.p, self.H, self.eps = L, ex.get("params"), ex.get("n_heads"), ex.get("eps")

    def attend(self, name, q, kv, mask):
        return self.L.multi_head_attention_forward(q, kv, *(self.p[f"{name}.{k}"] for k in ATT), self.H, mask)

    def ffn(self, h):
        return self.L.feed_forward_forward(h, *(self.p["ffn." + k] for k in FFN))

    def norm(self, z, name):
        return self.L.layer_norm_forward(z, self.p[name + ".gamma"], self.p[name + ".beta"], self.eps)


def encoder_no_residual(ex, dout):
    b, x, mask = _Block(ex), ex.get("x"), ex.get("mask")
    h = b.norm(b.attend("self_attn", x, x, mask)[0], "norm1")[0]
    return b.norm(h + b.ffn(h)[0], "norm2")[0]


def encoder_pre_norm(ex, dout):
    b, x, mask = _Block(ex), ex.get("x"), ex.get("mask")
    n = b.norm(x, "norm1")[0]
    h = x + b.attend("self_attn", n, n, mask)[0]
    return h + b.ffn(b.norm(h, "norm2")[0])[0]


def encoder_dx_without_skip(ex, dout):
    """dx of the first Add & Norm without its skip path: the attention's dx_q + dx_kv alone."""
    b, x, mask = _Block(ex), ex.get("x"), ex.get("mask")
    a, ca = b.attend("self_attn", x, x, mask)
    h, c1 = b.norm(x + a, "norm1")
    f, cf = b.ffn(h)
    _, c2 = b.norm(h + f, "norm2")
    dz = b.L.layer_norm_backward(dout, c2)[0]
    dz = b.L.layer_norm_backward(dz + b.L.feed_forward_backward(dz, cf)[0], c1)[0]
    dq, dkv = b.L.multi_head_attention_backward(dz, ca)[:2]
    return dq + dkv


def _decoder_layer(ex, cross_from_x=False, cross_mask=True):
    b, x, memory = _Block(ex), ex.get("x"), ex.get("memory")
    h = b.norm(x + b.attend("self_attn", x, x, ex.get("tgt_mask"))[0], "norm1")[0]
    kv = h if cross_from_x else memory
    h2 = b.norm(h + b.attend("cross_attn", h, kv, ex.get("src_mask") if cross_mask else None)[0], "norm2")[0]
    return b.norm(h2 + b.ffn(h2)[0], "norm3")[0]


def decoder_cross_from_itself(ex, dout):
    return _decoder_layer(ex, cross_from_x=True)


def decoder_cross_unmasked(ex, dout):
    return _decoder_layer(ex, cross_mask=False)


def decoder_self_unmasked(ex, dout):
    args = tuple((n, None if n == "tgt_mask" else v) for n, v in ex.args)
    return _decoder_layer(ex._replace(args=args))


# -- averaging, byte-pair merges


def average_sum(ex, dout):
    cks = ex.get("checkpoints")
    return {k: sum(c[k].astype(np.float64) for c in cks).astype(v.dtype) for k, v in cks[0].items()}


def average_last(ex, dout):
    return dict(ex.get("checkpoints")[-1])


def average_over_parameters(ex, dout):
    """Each checkpoint's sum divided by the number of parameters, not of checkpoints."""
    cks = ex.get("checkpoints")
    return {k: (sum(c[k].astype(np.float64) for c in cks) / len(cks[0])).astype(v.dtype) for k, v in cks[0].items()}


def _learn_merges(ex, weighted=True, first_found=False, least=2):
    """lessons/exercises/bpe.py's algorithm, with one of its rules changed."""
    from ..bpe import merge_symbols, symbols_of
    words = [(symbols_of(w), n if weighted else 1) for w, n in ex.get("token_counts").items()]
    merges = []
    while len(merges) < ex.get("num_merges"):
        counts: dict = {}
        for symbols, n in words:
            for pair in zip(symbols, symbols[1:]):
                counts[pair] = counts.get(pair, 0) + n
        if not counts:
            break
        best = (max(counts, key=counts.get) if first_found else min(counts, key=lambda p: (-counts[p], p)))
        if counts[best] < least:
            break
        merges.append(best)
        words = [(_merged(symbols, best, merge_symbols), n) for symbols, n in words]
    return merges


def _merged(symbols, pair, merge_symbols):
    out, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(merge_symbols(*pair))
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def bpe_unweighted(ex, dout):
    return _learn_merges(ex, weighted=False)


def bpe_first_found(ex, dout):
    return _learn_merges(ex, first_found=True)


def bpe_merges_singletons(ex, dout):
    return _learn_merges(ex, least=1)


# -- FlashAttention


def flash_first_tile_unseen(ex, dout):
    """The online softmax without its guard for a running maximum of -inf: a query whose first
    key tile has no key it may see gets exp(-inf - -inf) = NaN in its sums, and the output's
    zero for a row without visible keys (out = 0 where l > 0 fails)."""
    from ..layers import flash_attention_forward
    from ..layers.flash_attention import _keep, _tiles, key_tiles
    q, k, v, mask, q_tile, k_tile, causal = (ex.get(n) for n in ("q", "k", "v", "mask", "q_tile", "k_tile", "causal"))
    out = np.array(flash_attention_forward(q, k, v, mask, q_tile, k_tile, causal)[0])
    Tq, Tk, shown = q.shape[-2], k.shape[-2], False
    for i0, i1 in _tiles(Tq, q_tile):
        j0, j1 = key_tiles(i0, i1, Tk, k_tile, causal, Tk - Tq)[0]
        keep = _keep(np, mask, causal, Tk - Tq, i0, i1, j0, j1)
        if keep is not None:
            unseen = ~np.broadcast_to(keep, out.shape[:-2] + (i1 - i0, j1 - j0)).any(axis=-1)
            shown = shown or bool(np.abs(out[..., i0:i1, :][unseen]).max(initial=0.0) > 0)
            out[..., i0:i1, :][unseen] = 0.0
    if not shown:
        raise ValueError("no query whose first key tile hides every key sees a later one: not shown here")
    return out


def flash_tile_d(ex, dout):
    """The backward with D = rowsum(p * dp) of each key tile instead of rowsum(dout * out) of the
    whole row: dq and dk."""
    from ..layers import flash_attention_forward
    from ..layers.flash_attention import _keep, _scores, _tiles, key_tiles
    q, k, v, mask, q_tile, k_tile, causal = (ex.get(n) for n in ("q", "k", "v", "mask", "q_tile", "k_tile", "causal"))
    _, cache = flash_attention_forward(q, k, v, mask, q_tile, k_tile, causal)
    Tq, Tk, scale, lse = q.shape[-2], k.shape[-2], cache.scale, cache.lse
    dq, dk = np.zeros_like(q), np.zeros_like(k)
    for i0, i1 in _tiles(Tq, q_tile):
        for j0, j1 in key_tiles(i0, i1, Tk, k_tile, causal, Tk - Tq):
            s = _scores(q[..., i0:i1, :], k[..., j0:j1, :], scale, _keep(np, mask, causal, Tk - Tq, i0, i1, j0, j1))
            p = np.exp(s - lse[..., i0:i1, None])
            dp = dout[..., i0:i1, :] @ v[..., j0:j1, :].swapaxes(-1, -2)
            ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True)) * scale
            dq[..., i0:i1, :] += ds @ k[..., j0:j1, :]
            dk[..., j0:j1, :] += ds.swapaxes(-1, -2) @ q[..., i0:i1, :]
    return {"dq": dq, "dk": dk}

# -- LoRA


def _lora(ex):
    x, w, a, b, alpha = (ex.get(n) for n in ("x", "w", "a", "b", "alpha"))
    return x, w, a, b, alpha / a.shape[1]


def lora_scale_alpha(ex, dout):
    x, w, a, b, s = _lora(ex)
    return x @ w + ex.get("alpha") * ((x @ a) @ b)


def lora_dx_adapter_only(ex, dout):
    x, w, a, b, s = _lora(ex)
    return (s * dout @ b.T) @ a.T


def lora_da_through_w(ex, dout):
    x, w, a, b, s = _lora(ex)
    return s * x.reshape(-1, w.shape[0]).T @ ((dout @ w.T) @ a).reshape(-1, a.shape[1])


def lora_merge_unscaled(ex, dout):
    return ex.get("w") + ex.get("a") @ ex.get("b")


def lora_merge_rank_wrong_axis(ex, dout):
    a = ex.get("a")
    return ex.get("w") + ex.get("alpha") / a.shape[0] * (a @ ex.get("b"))

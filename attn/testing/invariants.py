"""Each layer's invariants: properties a reader would state aloud, checked on a layer's
functions (the library's, or a learner's)."""
from __future__ import annotations

import math

from .. import backend as B
from ..masks import PAD_ID

np = B.host

# ----------------------------------------------------------------------------- invariants
#
# Each takes a layer's functions (the library's, or a learner's) and host inputs, moves
# the inputs to the selected backend, and raises InvariantError with a hint naming the
# usual cause when the property fails. The tests call them with the library's layers;
# attn-check calls them with the learner's.


class InvariantError(AssertionError):
    """A property of a layer does not hold. ``hint`` names the usual cause."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _dev(a):
    """A device copy of a host array (a copy even on NumPy, so that a layer that writes
    into its input cannot change the caller's example); anything else as it is."""
    return B.to_device(a.copy()) if isinstance(a, np.ndarray) else a


def _host(a):
    return B.to_host(a)


def _out(result):
    """The output of a forward that returns (out, cache)."""
    return result[0] if isinstance(result, tuple) else result


def _first(bad) -> tuple:
    """Index of the first True entry of a boolean host array, as a tuple of ints."""
    return tuple(int(i) for i in np.argwhere(bad)[0])


def assert_softmax_properties(forward, backward, x, mask=None, dy=None) -> None:
    """Softmax over the last axis: finite and non-negative; rows sum to one over their
    unmasked keys; masked weights exactly zero; a fully masked row all zeros. With
    ``backward`` and ``dy``: rows of dx sum to zero and masked logits get no gradient."""
    y, cache = forward(_dev(x), None if mask is None else _dev(mask))
    y = _host(y)
    m = np.ones(x.shape, bool) if mask is None else np.broadcast_to(mask, x.shape)
    live = m.any(axis=-1)
    if not np.isfinite(y).all():
        raise InvariantError(f"softmax output has NaN or inf at {_first(~np.isfinite(y))} (logits up to "
                             f"{np.abs(x).max():.3g})",
                             "subtract each row's maximum before exp; fill masked logits with the dtype's "
                             "most negative finite value, not -inf (a fully masked row then gives 0/0)")
    if (y[~m] != 0).any():
        raise InvariantError(f"a masked position has weight {y[~m][y[~m] != 0][0]:.3g} at "
                             f"{_first((y != 0) & ~m)}; masked weights must be exactly 0",
                             "apply the mask to the logits before exp, and to the output again (a fully "
                             "masked row would otherwise come out uniform)")
    sums = y.sum(axis=-1)
    off = live & ~(np.abs(sums - 1.0) <= 1e-10)
    if off.any():
        i = _first(off)
        raise InvariantError(f"row {i} sums to {float(sums[i])!r} over its unmasked keys, not 1",
                             "mask the logits before normalising: zeroing weights after the softmax leaves "
                             "rows that no longer sum to one")
    if (y < 0).any():
        raise InvariantError(f"negative weight {y.min():.3g}", "weights are exp(...) / sum: never negative")
    if backward is None or dy is None:
        return
    dx = _host(backward(_dev(dy), cache))
    if (dx[~m] != 0).any():
        raise InvariantError(f"masked logit {_first((dx != 0) & ~m)} gets gradient "
                             f"{dx[(dx != 0) & ~m][0]:.3g}; it must be exactly 0",
                             "dx = y * (dy - sum(dy * y)) is 0 wherever y is 0")
    rows = np.abs(dx.sum(axis=-1))
    tol = 1e-10 * (np.abs(dy).max(axis=-1) + 1.0)
    if (rows > tol).any():
        i = _first(rows > tol)
        raise InvariantError(f"row {i} of dx sums to {dx.sum(axis=-1)[i]:.3g}; adding a constant to a row of "
                             "logits changes nothing, so every row of dx must sum to 0",
                             "dx = y * (dy - sum(dy * y, axis=-1)): the sum term (from the normalisation) "
                             "is missing")


def assert_layer_norm_properties(forward, backward, x, eps: float = 1e-5, gamma=None, dout=None) -> None:
    """With gamma = 1 and beta = 0 each row of the output has zero mean and variance
    ``var / (var + eps)``. With ``backward``, ``gamma`` and ``dout``: each row of dx
    sums to zero (the mean term) and ``sum(dx * xhat) = rstd * sum(g * xhat) * eps /
    (var + eps)`` with ``g = dout * gamma`` (the variance term)."""
    D = x.shape[-1]
    out = _host(_out(forward(_dev(x), _dev(np.ones(D)), _dev(np.zeros(D)), eps)))
    var = x.var(axis=-1)
    rstd = 1.0 / np.sqrt(var + eps)
    # The row mean is exact only up to rounding, ulp(x), which 1/sqrt(var + eps) magnifies.
    rounding = 8 * np.finfo(np.float64).eps * np.abs(x).max(axis=-1) * rstd
    mean = out.mean(axis=-1)
    if not (np.abs(mean) <= rounding + 1e-15).all():
        i = _first(np.abs(mean) > rounding + 1e-15)
        raise InvariantError(f"with gamma = 1, beta = 0, row {i} of the output has mean {mean[i]:.3g}, not 0",
                             "subtract the mean of each row over the last axis (axis=-1, keepdims=True)")
    got, want = out.var(axis=-1), var / (var + eps)
    if not (np.abs(got - want) <= 1e-8 + 1e-8 * want).all():
        i = _first(~(np.abs(got - want) <= 1e-8 + 1e-8 * want))
        raise InvariantError(f"with gamma = 1, beta = 0, row {i} of the output has variance {got[i]:.10g}, "
                             f"expected var / (var + eps) = {want[i]:.10g}",
                             "divide by sqrt(var + eps) with the biased variance (mean over D, not D - 1), "
                             "eps inside the square root")
    if backward is None or dout is None:
        return
    gamma = np.ones(D) if gamma is None else gamma
    _, cache = forward(_dev(x), _dev(gamma), _dev(np.zeros(D)), eps)
    dx = _host(backward(_dev(dout), cache)[0])
    g = dout * gamma
    scale = np.abs(dx).sum(axis=-1) + rstd * np.abs(g).sum(axis=-1)
    s = np.abs(dx.sum(axis=-1))
    if not (s <= 1e-10 * scale + 1e-300).all():
        i = _first(~(s <= 1e-10 * scale + 1e-300))
        raise InvariantError(f"row {i} of dx sums to {dx.sum(axis=-1)[i]:.3g}; adding a constant to a row "
                             "changes nothing, so every row of dx must sum to 0",
                             "the mean term is missing: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), "
                             "g = dout * gamma")
    xhat = (x - x.mean(axis=-1, keepdims=True)) * rstd[..., None]
    lhs = (dx * xhat).sum(axis=-1)
    rhs = rstd * (g * xhat).sum(axis=-1) * eps / (var + eps)
    tol = 1e-9 * rstd * np.abs(g).sum(axis=-1) * (1 + np.abs(xhat).max(axis=-1)) + 1e-300
    if not (np.abs(lhs - rhs) <= tol).all():
        i = _first(~(np.abs(lhs - rhs) <= tol))
        raise InvariantError(f"row {i}: sum(dx * xhat) is {lhs[i]:.3g}, but scaling a row about its mean "
                             f"changes the output only through eps, so it must be {rhs[i]:.3g}",
                             "the variance term is missing: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))")


def assert_embedding_properties(forward, backward, ids, W, scale: float = 1.0, dout=None) -> None:
    """``out == W[ids] * scale``; with ``backward``: dW collects every position, so its
    total is ``scale * sum(dout)`` and rows of ids that never occur get nothing."""
    out, cache = forward(_dev(ids), _dev(W), scale)
    out = _host(out)
    if out.shape != ids.shape + (W.shape[1],) or not np.allclose(out, W[ids] * scale, rtol=1e-12, atol=0):
        raise InvariantError(f"out is not W[ids] * scale (shape {out.shape}, expected {ids.shape + (W.shape[1],)})",
                             "look the rows up with W[ids], then multiply by scale")
    if backward is None or dout is None:
        return
    dW = _host(backward(_dev(dout), cache))
    total, want = dW.sum(axis=0), scale * dout.reshape(-1, W.shape[1]).sum(axis=0)
    if not np.allclose(total, want, rtol=1e-10, atol=1e-12):
        seen, counts = np.unique(ids, return_counts=True)
        raise InvariantError(f"dW sums to {total} over its rows, but scale * sum(dout) is {want}: gradient was "
                             f"lost (ids repeated: {seen[counts > 1].tolist()})",
                             "dW[ids] += g keeps only one of the repeated ids: accumulate with np.add.at "
                             "(attn.backend.scatter_add)")
    unused = np.setdiff1d(np.arange(W.shape[0]), ids)
    if dW[unused].any():
        raise InvariantError(f"rows {unused.tolist()} of dW are not zero, but those ids never occur",
                             "start dW from zeros and add into the rows of the ids that occur")


def assert_dropout_properties(forward, backward, x, p: float, seed: int, dout=None) -> None:
    """Inverted dropout: the identity with ``p == 0`` or no rng; otherwise every output is
    0 or ``x / (1 - p)``, about a fraction ``1 - p`` is kept, and backward passes ``dout``
    through the same mask. ``x`` has no zeros."""
    for rng in (None, B.DeviceRNG(seed)) if p else (None,):
        if rng is None or p == 0:
            out = _host(_out(forward(_dev(x), p, rng)))
            if not np.array_equal(out, x):
                raise InvariantError(f"dropout with p = {p} and rng = {rng} must return x unchanged",
                                     "with p == 0 or rng None (evaluation) dropout is the identity")
    if p == 0:
        return
    out, cache = forward(_dev(x), p, B.DeviceRNG(seed))
    out = _host(out)
    ratio = out / x
    kept = out != 0
    if not np.allclose(ratio[kept], 1.0 / (1.0 - p), rtol=1e-12):
        raise InvariantError(f"kept units are scaled by {ratio[kept][0]:.6g}, expected 1/(1-p) = {1 / (1 - p):.6g} "
                             f"(p = {p})", "inverted dropout scales the kept units by 1/(1-p), so that "
                             "inference needs no rescale")
    n = 20_000
    big = _host(_out(forward(_dev(np.ones(n)), p, B.DeviceRNG(seed))))
    frac = float((big != 0).mean())
    if abs(frac - (1 - p)) > 5 * math.sqrt(p * (1 - p) / n) + 1e-12:
        raise InvariantError(f"with p = {p} a fraction {frac:.4f} of {n} units was kept, expected about {1 - p}",
                             "p is the probability of dropping a unit: keep where rng.random(shape) >= p")
    if backward is None or dout is None:
        return
    dx = _host(backward(_dev(dout), cache))
    if not np.allclose(dx, dout * ratio, rtol=1e-12, atol=0):
        raise InvariantError("dx is not dout times the forward's mask (dropped units must pass no gradient, "
                             "kept ones dout / (1-p))",
                             "keep the forward's scaled mask in the cache; backward must not draw a new one")


def assert_positional_properties(forward, backward, x, table, dout=None) -> None:
    """``out == x + table[:T]``; backward passes dout through to x, and ``dtable`` holds
    dout summed over the batch in its first T rows and zeros after."""
    T = x.shape[-2]
    out, cache = forward(_dev(x), _dev(table))
    if not np.allclose(_host(out) - x, np.broadcast_to(table[:T], x.shape), rtol=0, atol=1e-12):
        raise InvariantError("out - x is not table[:T] at every batch row", "out = x + table[:T]")
    if backward is None or dout is None:
        return
    dx, dtable = backward(_dev(dout), cache)
    dx, dtable = _host(dx), _host(dtable)
    if not np.array_equal(dx, dout):
        raise InvariantError("dx is not dout", "out = x + table[:T], so dx = dout")
    if dtable[T:].any():
        raise InvariantError(f"rows {T}.. of dtable are not zero, but only the first T = {T} rows were used",
                             "dtable = zeros of the table's shape, then dtable[:T] = the batch sum of dout")
    if not np.allclose(dtable[:T], dout.reshape(-1, T, x.shape[-1]).sum(axis=0), rtol=1e-12, atol=1e-12):
        raise InvariantError("dtable[:T] is not dout summed over the batch",
                             "every sentence of the batch adds the same table: sum dout over the batch axis")


def assert_sinusoidal_table_properties(table_fn, max_len: int, d_model: int) -> None:
    """Row 0 is (0, 1, 0, 1, ...) and every entry is the paper's sin/cos of
    ``pos / 10000^(2i/d_model)``, sine in even columns, cosine in odd ones; float32 unless
    another dtype is asked for."""
    pe = _host(table_fn(max_len, d_model, "float64"))
    if pe.shape != (max_len, d_model):
        raise InvariantError(f"table has shape {pe.shape}, expected ({max_len}, {d_model})",
                             "one row per position, one column per feature")
    if _host(table_fn(max_len, d_model)).dtype != np.float32:
        raise InvariantError("sinusoidal_table(max_len, d_model) must be float32 by default",
                             "compute in float64, then return pe.astype(dtype) with dtype='float32' by default")
    want0 = np.array([0.0, 1.0] * d_model)[:d_model]
    if not np.allclose(pe[0], want0, atol=1e-15):
        raise InvariantError(f"row 0 is {pe[0].tolist()}, expected {want0.tolist()} (sin 0 = 0 in even "
                             "columns, cos 0 = 1 in odd ones)",
                             "column 2i holds the sine and column 2i+1 the cosine: sin and cos swapped?")
    pos = np.arange(max_len)[:, None]
    col = np.arange(d_model)[None, :]
    angle = pos / 10000.0 ** ((col - col % 2) / d_model)
    want = np.where(col % 2 == 0, np.sin(angle), np.cos(angle))
    if not np.allclose(pe, want, rtol=0, atol=1e-12):
        i = _first(~np.isclose(pe, want, rtol=0, atol=1e-12))
        raise InvariantError(f"PE{list(i)} is {pe[i]:.6g}, expected {want[i]:.6g}",
                             "columns 2i and 2i+1 share one angle, pos / 10000^(2i/d_model): the exponent "
                             "uses the even column index 2i, not i and not the column itself")


def assert_attention_ignores_unseen_keys(forward, q, k, v, mask) -> None:
    """Keys and values that no query may see can hold anything: the output does not change."""
    out = _host(_out(forward(_dev(q), _dev(k), _dev(v), _dev(mask))))
    shape = np.broadcast_shapes(mask.shape, q.shape[:-1] + (k.shape[-2],))
    unseen = ~np.broadcast_to(mask, shape).any(axis=-2)                      # (..., Tk)
    unseen = np.broadcast_to(unseen, k.shape[:-1])
    if not unseen.any():
        return
    k2, v2 = k.copy(), v.copy()
    k2[unseen] += 5.0
    v2[unseen] = 1e3
    out2 = _host(_out(forward(_dev(q), _dev(k2), _dev(v2), _dev(mask))))
    if not np.allclose(out2, out, rtol=1e-12, atol=1e-12):
        raise InvariantError("changing keys and values that the mask hides from every query changed the output",
                             "mask the scores before the softmax (False = may not attend), and zero those "
                             "weights exactly")


def assert_no_look_ahead(mha_forward, x, params: dict, n_heads: int, t: int, causal_fn=None) -> None:
    """Self-attention under a causal mask: changing positions after ``t`` never changes
    the outputs at positions ``0..t``. ``causal_fn(T, xp)`` builds the mask (the library's
    :func:`attn.masks.causal_mask` by default)."""
    from ..masks import causal_mask
    T = x.shape[1]
    mask = (causal_fn or causal_mask)(T, B.xp())
    x2 = x.copy()
    x2[:, t + 1:] += 1.0 + np.abs(x2[:, t + 1:])
    p = {k: _dev(v) for k, v in params.items()}
    outs = [_host(_out(mha_forward(_dev(a), _dev(a), *p.values(), n_heads, mask))) for a in (x, x2)]
    if not np.allclose(outs[1][:, : t + 1], outs[0][:, : t + 1], rtol=1e-12, atol=1e-12):
        raise InvariantError(f"changing positions {t + 1}.. changed the outputs at positions 0..{t}: "
                             "the future leaks into the past",
                             "position i may see keys 0..i only: a causal mask off by one (tril with k=1, or "
                             "k=-1 which hides a position from itself), or the mask not applied to the scores")


def assert_padding_ignored(mha_forward, x_q, x_kv, params: dict, n_heads: int, src_ids) -> None:
    """Cross-attention with the source's padding mask: whatever sits at padded source
    positions, the output does not change."""
    from ..masks import padding_mask
    mask = padding_mask(_dev(src_ids))
    x_kv2 = x_kv.copy()
    x_kv2[src_ids == PAD_ID] = 1e3
    p = {k: _dev(v) for k, v in params.items()}
    outs = [_host(_out(mha_forward(_dev(x_q), _dev(kv), *p.values(), n_heads, mask))) for kv in (x_kv, x_kv2)]
    if not np.allclose(outs[1], outs[0], rtol=1e-12, atol=1e-12):
        raise InvariantError("changing padded source positions changed the output: padding leaks into real "
                             "positions", "the padding mask must reach every head's scores before the softmax, and "
                             "each head must get its own columns of every position (split_heads' reshape order)")


def assert_heads_round_trip(split_fn, merge_fn, x, H: int) -> None:
    """``split_heads`` puts columns ``h*Dh..(h+1)*Dh`` of every position in head h, and
    ``merge_heads`` undoes it."""
    Bsz, T, D = x.shape
    s = _host(split_fn(_dev(x), H))
    Dh = D // H
    want = np.stack([x[:, :, h * Dh:(h + 1) * Dh] for h in range(H)], axis=1)
    if s.shape != want.shape or not np.array_equal(s, want):
        raise InvariantError(f"split_heads(x, {H})[:, h] is not x[:, :, h*Dh:(h+1)*Dh] (shape {s.shape}, "
                             f"expected {want.shape})",
                             "reshape (B, T, D) to (B, T, H, Dh), then transpose to (B, H, T, Dh); reshaping "
                             "straight to (B, H, T, Dh) mixes positions into heads")
    back = _host(merge_fn(_dev(want)))
    if back.shape != x.shape or not np.array_equal(back, x):
        raise InvariantError("merge_heads(split_heads(x)) is not x",
                             "merge_heads is the inverse: transpose (B, H, T, Dh) to (B, T, H, Dh), then reshape")


def assert_cross_entropy_properties(loss_fn, logits, targets, smoothing: float, pad_id, junk=None) -> None:
    """Every row of dlogits sums to zero (p and q both sum to one); with ``pad_id``, the
    logits at padded targets (replaced by ``junk``, or by large values) change neither the
    loss nor any gradient, and their rows of dlogits are zero."""
    loss, d = loss_fn(_dev(logits), _dev(targets), smoothing, pad_id)
    d = _host(d)
    rows = np.abs(d.sum(axis=-1))
    if not (rows <= 1e-12 * (np.abs(d).sum(axis=-1) + 1)).all():
        i = _first(~(rows <= 1e-12 * (np.abs(d).sum(axis=-1) + 1)))
        raise InvariantError(f"row {i} of dlogits sums to {d.sum(axis=-1)[i]:.3g}, not 0",
                             "dlogits = (softmax(logits) - q) / n with q = (1-eps) onehot + eps/V: both sum to one")
    if pad_id is None:
        return
    pad = targets == pad_id
    if not pad.any():
        return
    if d[pad].any():
        raise InvariantError(f"padded target {_first(pad)} has non-zero dlogits",
                             "multiply the gradient (and the loss, smoothing term included) by the mask of "
                             "real targets")
    x2 = logits.copy()
    x2[pad] = junk if junk is not None else 37.0 * (np.arange(x2[pad].size).reshape(x2[pad].shape) % 3 - 1.0)
    loss2, d2 = loss_fn(_dev(x2), _dev(targets), smoothing, pad_id)
    if abs(float(_host(loss2)) - float(_host(loss))) > 1e-12 * (1 + abs(float(_host(loss)))):
        raise InvariantError(f"changing the logits at padded targets changed the loss ({float(_host(loss)):.6g} "
                             f"-> {float(_host(loss2)):.6g})",
                             "padded targets contribute nothing: mask the whole per-token loss, the smoothing "
                             "term as well, and average over real tokens only")
    d2 = _host(d2)
    if d2[pad].any() or not np.allclose(d2[~pad], d[~pad], rtol=1e-12, atol=1e-16):
        raise InvariantError("changing the logits at padded targets changed dlogits",
                             "padded targets contribute nothing: zero their rows of dlogits, and let no real "
                             "token's gradient depend on them")


def assert_causal_mask_properties(causal_fn, T: int) -> None:
    """A (1, 1, T, T) bool mask: position i sees positions 0..i (itself included), never later ones."""
    m = _host(causal_fn(T, B.xp()))
    want = np.tril(np.ones((T, T), dtype=bool))[None, None]
    if m.shape != want.shape or m.dtype != bool:
        raise InvariantError(f"causal mask has shape {m.shape} and dtype {m.dtype}, expected {want.shape} bool",
                             "return xp.tril(xp.ones((T, T), dtype=bool))[None, None]")
    if not np.array_equal(m, want):
        i = _first(m != want)
        raise InvariantError(f"causal mask at (query {i[2]}, key {i[3]}) is {bool(m[i])}",
                             "query i sees keys 0..i, itself included: tril with the diagonal (k=0)")


def assert_rnn_skips_masked_steps(forward, x, h0, w_x, w_h, b, mask) -> None:
    """Where ``mask`` is False the state passes through unchanged: ``h_t == h_{t-1}``."""
    hs = _host(_out(forward(_dev(x), _dev(h0), _dev(w_x), _dev(w_h), _dev(b), _dev(mask))))
    prev = np.concatenate([h0[:, None], hs[:, :-1]], axis=1)
    if not np.array_equal(hs[~mask], prev[~mask]):
        i = _first(~mask & ~(hs == prev).all(axis=-1))
        raise InvariantError(f"step {i[1]} of row {i[0]} is masked, but the state changed there",
                             "h_t = where(mask[:, t, None], tanh(...), h_{t-1})")

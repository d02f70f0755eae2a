"""Label smoothing that spreads its mass onto padded positions: the smoothing term is not masked."""
from attn import backend as B


def cross_entropy(logits, targets, smoothing=0.0, pad_id=0):
    xp = B.get_array_module(logits)
    V = logits.shape[-1]
    x, y = logits.reshape(-1, V), targets.reshape(-1)
    valid = (y != pad_id) if pad_id is not None else xp.ones(y.shape, dtype=bool)
    n = max(int(valid.sum()), 1)
    shifted = x - x.max(axis=1, keepdims=True)
    e = xp.exp(shifted)
    se = e.sum(axis=1, keepdims=True)
    logp = shifted - xp.log(se)
    logp_y = xp.take_along_axis(logp, y[:, None], axis=1)[:, 0]
    loss = (-(1 - smoothing) * logp_y * valid - smoothing * logp.mean(axis=1)).sum() / n   # smoothing unmasked
    p = e / se
    d = smoothing * (p - 1.0 / V)
    d += (1 - smoothing) * valid[:, None] * p
    d[xp.arange(len(y)), y] -= (1 - smoothing) * valid
    return loss, (d / n).reshape(logits.shape)

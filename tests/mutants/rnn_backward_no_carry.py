"""Backpropagation through time that forgets what step t+1 sends back to step t."""
from attn import backend as B
from attn.layers.recurrent import rnn_forward  # noqa: F401


def rnn_backward(dhs, cache):
    x, h0, w_x, w_h, hs, mask = cache
    xp = B.get_array_module(dhs)
    Bsz, T, H = hs.shape
    das = dhs * (1 - hs * hs)                                                 # + (da_{t+1} @ w_h.T) missing
    if mask is not None:
        das = xp.where(mask[..., None], das, 0.0)
    h_prev = xp.concatenate([h0[:, None], hs[:, :-1]], axis=1)
    da2 = das.reshape(Bsz * T, H)
    dh0 = das[:, 0] @ w_h.T
    return ((da2 @ w_x.T).reshape(x.shape), dh0, x.reshape(Bsz * T, -1).T @ da2,
            h_prev.reshape(Bsz * T, H).T @ da2, da2.sum(axis=0))

"""A learner's answer to lessons/exercises/rope.py, written from its docstrings: attn-check
must pass it."""
from attn import backend as B


def rope_forward(x, positions=None, base=10000.0):
    np, xp = B.host, B.get_array_module(x)
    T, Dh = x.shape[-2:]
    pos = np.arange(T) if positions is None else B.to_host(positions)
    angle = pos[:, None] * base ** (-np.arange(0, Dh, 2) / Dh)
    cos, sin = xp.asarray(np.cos(angle).astype(x.dtype)), xp.asarray(np.sin(angle).astype(x.dtype))
    a, b = x[..., :Dh // 2], x[..., Dh // 2:]
    return xp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1), (cos, sin)


def rope_backward(dout, cache):
    cos, sin = cache
    xp = B.get_array_module(dout)
    h = dout.shape[-1] // 2
    a, b = dout[..., :h], dout[..., h:]
    return xp.concatenate([a * cos + b * sin, -a * sin + b * cos], axis=-1)

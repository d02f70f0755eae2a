"""The sinusoidal table with sine and cosine swapped: cosines in the even columns."""
from attn import backend as B


def sinusoidal_table(max_len, d_model, dtype="float32"):
    np = B.host
    pos = np.arange(max_len, dtype=np.float64)[:, None]
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
    angle = pos / np.power(10000.0, two_i / d_model)
    pe = np.zeros((max_len, d_model))
    pe[:, 0::2] = np.cos(angle)
    pe[:, 1::2] = np.sin(angle[:, : d_model // 2])
    return pe.astype(dtype)

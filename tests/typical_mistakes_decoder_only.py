"""Typical mistakes in the decoder-only layer's exercise (``lessons/exercises/decoder_only_layer.py``),
as ``tests/typical_mistakes.py`` has them for the other layers, which reads them from here."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISTAKES: dict = {}
ANSWER = (ROOT / "tests" / "answers" / "decoder_only_layer.py").read_text(encoding="utf-8")


def answer(old: str, new: str) -> str:
    """The decoder-only layer's answer with one line changed."""
    assert ANSWER.count(old) == 1, old
    return ANSWER.replace(old, new)


MISTAKES["decoder_only_layer"] = [
    ("no look-ahead mask", answer("n_heads, mask)", "n_heads, None)"), r"the future leaks into the past",
     r"takes the look-ahead mask"),
    ("the diagonal hidden", answer("mask = M.causal_mask(x.shape[1])",
                                   "mask = B.xp().tril(B.xp().ones((x.shape[1],) * 2, dtype=bool), -1)[None, None]")
     .replace("from attn import layers as L", "from attn import backend as B\nfrom attn import layers as L"),
     r"hides each position from itself", r"a position may see itself"),
    ("no residual", answer("L.layer_norm_forward(x + a,", "L.layer_norm_forward(a,"),
     r"the residual x is not added", r"the input is added to the attention's output"),
    ("pre-norm", answer('''    a, ca = L.multi_head_attention_forward(x, x, *(p["self_attn." + k] for k in ATT), n_heads, mask)
    h, c1 = L.layer_norm_forward(x + a, p["norm1.gamma"], p["norm1.beta"], eps)
    f, cf = L.feed_forward_forward(h, *(p["ffn." + k] for k in FFN))
    out, c2 = L.layer_norm_forward(h + f, p["norm2.gamma"], p["norm2.beta"], eps)''', '''    n, c1 = L.layer_norm_forward(x, p["norm1.gamma"], p["norm1.beta"], eps)
    a, ca = L.multi_head_attention_forward(n, n, *(p["self_attn." + k] for k in ATT), n_heads, mask)
    h = x + a
    n, c2 = L.layer_norm_forward(h, p["norm2.gamma"], p["norm2.beta"], eps)
    f, cf = L.feed_forward_forward(n, *(p["ffn." + k] for k in FFN))
    out = h + f'''), r"pre-norm", r"normalises after the addition"),
    ("dx without the first skip path", answer("return dz + dq + dkv, g", "return dq + dkv, g"),
     r"the first residual's skip path dz1 is missing", r"dz1 passes straight back too"),
    ("dx without the keys and values", answer("return dz + dq + dkv, g", "return dz + dq, g"),
     r"keys and values path dx_kv is missing", r"as its queries and as its keys and values"),
    ("the second skip path dropped", answer("L.layer_norm_backward(dz + dh, c1)", "L.layer_norm_backward(dh, c1)"),
     r"second residual's skip connection is missing", r"h reaches the second Add & Norm by two paths"),
]

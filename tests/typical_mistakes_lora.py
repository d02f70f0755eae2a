"""Typical mistakes in LoRA's exercise (``lessons/exercises/lora.py``), as
``tests/typical_mistakes.py`` has them for the other layers, which reads them from here."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISTAKES: dict = {}
LORA = (ROOT / "tests" / "answers" / "lora.py").read_text(encoding="utf-8")


def lora(old: str, new: str) -> str:
    """The LoRA answer with one line changed."""
    assert LORA.count(old) == 1, old
    return LORA.replace(old, new)


MISTAKES["lora"] = [
    ("db without alpha/r", lora("db = s * (h.reshape", "db = (h.reshape"),
     r"the factor alpha/r, the adapter's scale is missing", r"b's gradient carries it"),
    ("scaled by alpha", lora("s = x.dtype.type(alpha / a.shape[1])", "s = x.dtype.type(alpha)"),
     r"scaled by alpha, not alpha/r", r"scaled by alpha / r"),
    ("dx without the frozen path", lora("return dout @ w.T + dh @ a.T, da, db", "return dh @ a.T, da, db"),
     r"the frozen path's gradient is missing", r"w is frozen, not cut"),
    ("not zero at the start", lora("return x @ w + s * (h @ b), (x, w, a, b, h, s)",
                                   "return x @ w + s * (h @ b + x.dtype.type(1e-7) * s), (x, w, a, b, h, s)"),
     r"with b = 0 the output changes .* when a and alpha change", r"with b = 0 the second term is exactly zero"),
    ("a's gradient through w", lora("dh = s * (dout @ b.T)\n", "dh = s * (dout @ b.T)\n    dw = s * ((dout @ w.T) @ a)\n")
     .replace("da = x.reshape(-1, D).T @ dh.reshape(-1, r)", "da = x.reshape(-1, D).T @ dw.reshape(-1, r)"),
     r"a's gradient taken through the frozen w", r"a sits beside w, not after it"),
]
MISTAKES["lora_merge"] = [
    ("merge without alpha/r", lora("return w + w.dtype.type(alpha / a.shape[1]) * (a @ b)", "return w + a @ b"),
     r"the merge without alpha/r", r"the same scale, alpha / r"),
    ("merge in place", lora("return w + w.dtype.type(alpha / a.shape[1]) * (a @ b)",
                            "w += w.dtype.type(alpha / a.shape[1]) * (a @ b)\n    return w"),
     r"modified its input w in place", r"compute into new arrays"),
    ("the rank from the wrong axis", lora("return w + w.dtype.type(alpha / a.shape[1]) * (a @ b)",
                                          "return w + w.dtype.type(alpha / a.shape[0]) * (a @ b)"),
     r"the rank read from a.shape\[0\]", r"a is \(D_in, r\)"),
]

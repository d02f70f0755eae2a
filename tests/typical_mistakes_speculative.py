"""Typical mistakes in speculative decoding's acceptance rule (``lessons/exercises/speculative.py``),
written as a learner would, as ``tests/typical_mistakes.py`` has them for the other layers, which
reads them from here. Each is the answer in ``tests/answers/`` with one line changed."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANSWER = (ROOT / "tests" / "answers" / "speculative.py").read_text(encoding="utf-8")


def changed(old: str, new: str) -> str:
    """The answer with one line changed."""
    assert ANSWER.count(old) == 1, old
    return ANSWER.replace(old, new)


KEEP = "keep = u < p[drafts] / q[drafts]"
DRAW = "drawn = (cdf[None, :] > v[:, None]).argmax(axis=1)"
CDF = "cdf = xp.cumsum(residual / residual.sum()) if residual.sum() > 0 else xp.cumsum(p)"
MISTAKES = {"speculative_accept": [
    ("every draft accepted", changed(KEEP, "keep = u < 2"), r"every draft kept|kept it; the rule keeps each",
     r"keep d where u < p\(d\) / q\(d\)"),
    ("resampled from p", changed(CDF, "cdf = xp.cumsum(p)"), r"drawn from p|where p = .* <= q",
     r"draws from the residual max\(0, p - q\), normalised: not from p"),
    ("residual not normalised", changed(CDF, "cdf = xp.cumsum(residual)"),
     r"not normalised|rejected trials drew token|not distributed as the target's",
     r"normalise max\(0, p - q\) by its sum|draws afresh from the residual|together they give"),
    ("the test's uniform reused", changed(DRAW, "drawn = (cdf[None, :] > u[:, None]).argmax(axis=1)"),
     r"drawn with u|rejected trials drew token", r"draws afresh with the second uniform, v"),
    ("the ratio upside down", changed(KEEP, "keep = u < q[drafts] / p[drafts]"),
     r"min\(1, q/p\)|min\(1, p/q\) = 1, and yet", r"min\(1, p\(d\)/q\(d\)\)"),
]}

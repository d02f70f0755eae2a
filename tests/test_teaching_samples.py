"""docs/TEACHING.md's sample runs are what the grader prints: docs/teaching_samples.py runs
them again and they must equal the page's, seconds aside (and bubblewrap's version)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import teaching_samples  # noqa: E402


def _steady(text: str) -> str:
    text = re.sub(r"\d+\.\d+ s\b", "N s", text)
    return re.sub(r"bubblewrap [\d.]+", "bubblewrap V", text)


def test_the_pages_samples_are_what_attn_check_prints(tmp_path):
    page = teaching_samples.on_the_page(teaching_samples.PAGE.read_text(encoding="utf-8"))
    assert set(page) == {"all", "reports", "gradescope", "ls"}
    fresh = teaching_samples.samples(tmp_path)
    for name in page:
        assert _steady(fresh[name]) == _steady(page[name]), (name, "run python docs/teaching_samples.py")

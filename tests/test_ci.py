"""CI runs what the README tells a reader to run."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"Run the tests[^\n]*?:\s*```bash\n(.*?)\n```", readme, re.S)   # "(about N minutes...)"
    assert block, "README.md has no 'Run the tests:' bash block"
    readme_cmds = [c.strip() for c in block.group(1).strip().split("&&")]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(ci) if line.startswith("# README, \"Run the tests\""))
    ci_cmds = [line.strip() for line in ci[start + 1:] if line.strip() and not line.startswith("#")]
    assert ci_cmds == readme_cmds
    assert "gpu-ci" in readme_cmds[0]                 # CuPy and NVRTC, for tests/test_kernels.py

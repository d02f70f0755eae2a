"""docs/TEACHING.md's sample runs, made from real runs: four learners' submissions are written
into a fresh folder, attn-check is run on them as the page says, and each output replaces the
code block that follows its ``<!-- sample: NAME -->`` marker.

    python docs/teaching_samples.py          # rewrite docs/TEACHING.md's samples

``tests/test_teaching_samples.py`` runs the same and compares it with the page (seconds
aside), so the page cannot drift from what the grader prints.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "TEACHING.md"
EX7 = "07_feed_forward_layer_norm.py"
RELU = "def relu_forward(x):\n    return x * (x > 0), x > 0\n\n\ndef relu_backward(dout, cache):\n    return dout * cache\n"
LAYER_NORM = '''

def layer_norm_forward(x, gamma, beta, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / (var + eps) ** 0.5
    xhat = (x - mean) * rstd
    return gamma * xhat + beta, (xhat, rstd, gamma)


def layer_norm_backward(dout, cache):
    xhat, rstd, gamma = cache
    D = xhat.shape[-1]
    g = dout * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, (dout * xhat).reshape(-1, D).sum(axis=0), dout.reshape(-1, D).sum(axis=0)
'''
SOFTMAX = '''import numpy as np


def softmax_forward(x, mask=None):
    if mask is not None:
        x = np.where(mask, x, -np.inf)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0))
    s = e.sum(axis=-1, keepdims=True)
    y = np.where(s > 0, e / np.where(s > 0, s, 1), 0).astype(x.dtype)
    return y, y


def softmax_backward(dout, cache):
    y = cache
    return y * (dout - (dout * y).sum(axis=-1, keepdims=True))


def attention_forward(q, k, v, mask=None, dropout=0.0, rng=None):
    raise NotImplementedError


def attention_backward(dout, cache):
    raise NotImplementedError
'''
FFN = '''

def feed_forward_forward(x, w1, b1, w2, b2):
    h = x @ w1 + b1
    a = h * (h > 0)
    return a @ w2 + b2, (x, w1, w2, h, a)


def feed_forward_backward(dout, cache):
    x, w1, w2, h, a = cache
    D, F = w1.shape
    dw2 = a.reshape(-1, F).T @ dout.reshape(-1, D)
    dh = (dout @ w2.T) * (h > 0)
    dw1 = x.reshape(-1, D).T @ dh.reshape(-1, F)
    return dh @ w1.T, dw1, dh.reshape(-1, F).sum(axis=0), dw2, dout.reshape(-1, D).sum(axis=0)
'''
RESIDUAL = '''

def residual_ffn_forward(x, w1, b1, w2, b2, gamma, beta, eps=1e-5):
    f, cf = feed_forward_forward(x, w1, b1, w2, b2)
    out, cn = layer_norm_forward(x + f, gamma, beta, eps)
    return out, (cf, cn)


def residual_ffn_backward(dout, cache):
    cf, cn = cache
    dz, dgamma, dbeta = layer_norm_backward(dout, cn)
    dx, dw1, db1, dw2, db2 = feed_forward_backward(dz, cf)
    return dz + dx, dw1, db1, dw2, db2, dgamma, dbeta
'''
CLEO = '''"""Cleo's layer norm."""
from attn.layers import layer_norm_backward, layer_norm_forward  # noqa: F401
'''
DEV = '''

def layer_norm_forward(x, gamma, beta, eps=1e-5):
    """Dev's layer norm, still being debugged."""
    mean = x.mean(axis=-1, keepdims=True)
    while (x - mean).std() > 0: mean = mean + 0
    return gamma * (x - mean) + beta, None
'''


def write_submissions(folder: Path) -> None:
    """Ada (exercise 7 done, 4 half done, 5 and 12 not started); Ben (eps outside the square
    root), Cleo (the library's layer norm, re-exported) and Dev (a layer norm forward that never
    returns), each with Ada's other functions of exercise 7."""
    starters = ROOT / "lessons" / "exercises"
    ben = (ROOT / "tests" / "mutants" / "layer_norm_eps_outside_sqrt.py").read_text().split('"""')[-1]
    backward = LAYER_NORM[LAYER_NORM.index("def layer_norm_backward"):]
    files = {"ada/04_attention.py": SOFTMAX, "ada/05_masks.py": (starters / "05_masks.py").read_text(),
             f"ada/{EX7}": RELU + FFN + LAYER_NORM + RESIDUAL,
             "ada/12_dropout.py": (starters / "12_dropout.py").read_text(),
             f"ben/{EX7}": RELU + FFN + ben + RESIDUAL, f"cleo/{EX7}": CLEO + "\n\n" + RELU + FFN + RESIDUAL,
             f"dev/{EX7}": RELU + FFN + DEV + "\n\n" + backward + RESIDUAL}
    for name, text in files.items():
        (folder / "submissions" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "submissions" / name).write_text(text, encoding="utf-8")


def _run(folder: Path, args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "attn.grader", *args.split()], capture_output=True, text=True,
                          env=env, cwd=folder, timeout=600)
    return f"$ attn-check {args}\n{proc.stdout}(exit status {proc.returncode})\n"


def samples(folder: Path) -> dict:
    """{marker name: the code block's text} from real runs in ``folder``."""
    write_submissions(folder)
    out = {"all": _run(folder, "--all submissions/ada --examples 5")}
    runs = []
    for who in ("ada", "ben", "cleo", "dev"):
        (folder / "reports" / who).mkdir(parents=True)
        runs.append(_run(folder, f"submissions/{who}/{EX7} --layer layer_norm --timeout 5 --json "
                                 f"reports/{who}/report.json --junit "
                                 f"reports/{who}/junit.xml --gradescope reports/{who}/results.json --html "
                                 f"reports/{who}/html"))
    out["reports"] = "".join(runs)
    out["gradescope"] = json.dumps(json.loads((folder / "reports/ben/results.json").read_text()), indent=2) + "\n"
    ls = subprocess.run(["ls", "reports/ben", "reports/ben/html"], capture_output=True, text=True, cwd=folder)
    out["ls"] = f"$ ls reports/ben reports/ben/html\n{ls.stdout}(exit status {ls.returncode})\n"
    return out


MARKER = re.compile(r"(<!-- sample: (\w+) -->\n```\w*\n)(.*?)(```\n)", re.S)


def on_the_page(text: str) -> dict:
    """{marker name: the code block under it} in ``text``."""
    return {m.group(2): m.group(3) for m in MARKER.finditer(text)}


def rewrite(text: str, new: dict) -> str:
    return MARKER.sub(lambda m: m.group(1) + new.get(m.group(2), m.group(3)) + m.group(4), text)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        new = samples(Path(tmp))
    PAGE.write_text(rewrite(PAGE.read_text(encoding="utf-8"), new), encoding="utf-8")
    print(f"{PAGE}: {', '.join(sorted(new))} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Lessons 15, 16, 22, 24 and 25 can fail on their claims: each runs (quick mode) against a
library with one thing broken that the lesson's claim depends on, and must stop on one of its
own assertions, not pass and not crash.

The broken library is a ``sitecustomize.py`` put first on the child's ``PYTHONPATH``: Python
imports it at start-up, before the lesson imports anything, and it swaps one function or method
for a broken twin wherever attn bound it. (The same mechanism as the other lessons' mutants; the
mutants live here until they are folded in beside those.)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = {p.name[:2]: p for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py")}

PATCH = '''
import sys
import attn, attn.layers, attn.masks, attn.model, attn.evaluate, attn.fast, attn.fast.ops


def patch(module, name, new):
    """Bind `new` wherever attn bound the original (the defining module and every re-export)."""
    old = getattr(sys.modules[module], name)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("attn") and getattr(mod, name, None) is old:
            setattr(mod, name, new)
    return old
'''

#: lesson number -> (what is broken, the patch). Each breaks what that lesson's check claims.
MUTANTS = {
    "15": ("the decoding state's select keeps the self-attention cache in its old row order", '''
def select(self, index):
    cross = [(k[index], v[index]) for k, v in self.cross_kv]
    same = self.self_kv[0][0] is None or len(index) == self.self_kv[0][0].shape[0]
    kv = self.self_kv if same else [(k[index], v[index]) for k, v in self.self_kv]
    return attn.model.DecodeState(cross, kv, self.src_mask[index], self.length)
attn.model.DecodeState.select = select
'''),
    "16": ("the library's corpus BLEU is the mean of sentence BLEU", '''
def corpus_scores(hypotheses, references):
    from sacrebleu.metrics import BLEU
    scores = old(hypotheses, references)
    sent = BLEU(effective_order=True)
    mean = sum(sent.sentence_score(h, [r]).score for h, r in zip(hypotheses, references)) / max(len(hypotheses), 1)
    return scores._replace(bleu=mean)
old = patch("attn.evaluate", "corpus_scores", corpus_scores)
'''),
    "22": ("the fast path's layer norm adds a much larger epsilon than the readable one", '''
def layer_norm_(self, x, gamma, beta, eps):
    return old(self, x, gamma, beta, eps * 1e4)
old = attn.fast.ops._Ops.layer_norm_
attn.fast.ops._Ops.layer_norm_ = layer_norm_
'''),
    "24": ("the look-ahead mask lets each position see the next one", '''
def causal_mask(T, xp=None):
    import numpy
    xp = xp or numpy
    return xp.tril(xp.ones((T, T), dtype=bool), 1)[None, None]
old = patch("attn.masks", "causal_mask", causal_mask)
'''),
    "25": ("the encoder's output never reaches the decoder (the memory is zeroed)", '''
def encode(self, src, rng=None, src_mask=None):
    memory, cache = old(self, src, rng, src_mask)
    return memory * memory.dtype.type(0.0), cache
old = attn.model.Transformer.encode
attn.model.Transformer.encode = encode
'''),
}


def _run_with_mutant(lesson: Path, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(PATCH + textwrap.dedent(code), encoding="utf-8")
    env = dict(os.environ, ATTN_QUICK="1", ATTN_LESSONS_OUT=str(tmp_path / "out"), MPLBACKEND="Agg",
               PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, str(lesson)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("number", sorted(MUTANTS), ids=[f"{n}: {MUTANTS[n][0]}" for n in sorted(MUTANTS)])
def test_new_lesson_fails_its_check_on_a_broken_library(number, tmp_path):
    if number not in LESSONS:
        pytest.skip(f"lesson {number} is not in this checkout")
    lesson = LESSONS[number]
    what, code = MUTANTS[number]
    proc = _run_with_mutant(lesson, code, tmp_path)
    assert proc.returncode != 0, f"{lesson.name} passed its check although {what}:\n{proc.stdout[-2000:]}"
    # the lesson's own check: an AssertionError raised from a line of the lesson, not any other exception
    frames = re.findall(r'File "([^"]+)", line \d+, in <module>', proc.stderr)
    assert re.search(r"^AssertionError", proc.stderr, re.MULTILINE) and frames and Path(frames[-1]) == lesson, \
        f"{lesson.name} should fail one of its own checks when {what}, not crash:\n{proc.stderr[-3000:]}"
    assert "Check passed" not in proc.stdout

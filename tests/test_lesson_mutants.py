"""Every lesson's check can fail on the lesson's claim: run the lesson (quick mode) against a
library with one thing broken, and the lesson must stop on one of its own assertions.

The broken library is a ``sitecustomize.py`` put first on the child's ``PYTHONPATH``: Python
imports it at start-up, it imports attn and swaps one function for a broken twin everywhere attn
bound it (``attn.layers.attention.attention_forward`` and its re-export ``attn.layers
.attention_forward`` alike), before the lesson imports anything. A lesson that crashes on the
mutant instead of failing its check does not count: the run must end in an AssertionError
raised from a line of the lesson itself (an ``assert``, or a checker such as
``attn.gradcheck.check_layer`` that the lesson calls there).

Each run costs about what the lesson costs in quick mode (the checks come at the end): all of
them together about a minute of CPU on the two-core machine this was written on, about half of
it for the five lessons that train translators or many models; ``ATTN_LESSON_MUTANTS=cheap``
skips those five.
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
import attn, attn.layers, attn.masks, attn.loss, attn.model, attn.optim, attn.bpe, attn.bench, attn.train
import attn.evaluate, attn.fast, attn.fast.core.ops


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
    "01": ("BPTT drops half of the recurrent weight's gradient", '''
def rnn_backward(dhs, cache):
    dx, dh0, dw_x, dw_h, db = old(dhs, cache)
    return dx, dh0, dw_x, 0.5 * dw_h, db
old = patch("attn.layers.recurrent", "rnn_backward", rnn_backward)
'''),
    "02": ("attention forgets to divide the scores by sqrt(d_k)", '''
import math
def attention_forward(q, k, v, mask=None, dropout=0.0, rng=None):
    return old(q * q.dtype.type(math.sqrt(q.shape[-1])), k, v, mask, dropout, rng)
old = patch("attn.layers.attention", "attention_forward", attention_forward)
'''),
    "03": ("the positional table swaps sine and cosine", '''
def sinusoidal_table(max_len, d_model, dtype="float32"):
    pe = old(max_len, d_model, dtype).copy()
    pe[:, 0::2], pe[:, 1::2] = pe[:, 1::2].copy(), pe[:, 0::2].copy()
    return pe
old = patch("attn.layers.positional", "sinusoidal_table", sinusoidal_table)
'''),
    "04": ("attention forgets to divide the scores by sqrt(d_k)", None),       # as lesson 2's
    "05": ("the look-ahead mask lets each position see the next one", '''
def causal_mask(T, xp=None):
    import numpy
    xp = xp or numpy
    return xp.tril(xp.ones((T, T), dtype=bool), 1)[None, None]
old = patch("attn.masks", "causal_mask", causal_mask)
'''),
    "06": ("split_heads cuts the dimensions in the wrong order (interleaved heads)", '''
def split_heads(x, H):
    Bsz, T, D = x.shape
    return x.reshape(Bsz, T, D // H, H).transpose(0, 3, 1, 2)
old = patch("attn.layers.attention", "split_heads", split_heads)
'''),
    "07": ("layer norm's backward returns half of dx", '''
def layer_norm_backward(dout, cache):
    dx, dgamma, dbeta = old(dout, cache)
    return 0.5 * dx, dgamma, dbeta
old = patch("attn.layers.layernorm", "layer_norm_backward", layer_norm_backward)
'''),
    "08": ("softmax's backward has its sign flipped", '''
def softmax_backward(dy, cache):
    return -old(dy, cache)
old = patch("attn.layers.softmax", "softmax_backward", softmax_backward)
'''),
    "09": ("a parameter used twice keeps only its last gradient (= instead of +=)", '''
def _acc(grads, name, g):
    grads[name] = g
old = patch("attn.model", "_acc", _acc)
'''),
    "10": ("the recurrent layer's forward adds a small bias to every state", '''
def rnn_forward(x, h0, w_x, w_h, b, mask=None):
    hs, cache = old(x, h0, w_x, w_h, b, mask)
    return hs + 1e-3, cache
old = patch("attn.layers.recurrent", "rnn_forward", rnn_forward)
'''),
    "11": ("cross-entropy ignores label smoothing", '''
def cross_entropy(logits, targets, smoothing=0.0, *args, **kwargs):
    return old(logits, targets, 0.0, *args, **kwargs)
old = patch("attn.loss", "cross_entropy", cross_entropy)
'''),
    "12": ("inverted dropout forgets to scale the kept units by 1/(1-p)", '''
def dropout_forward(x, p, rng=None):
    out, cache = old(x, p, rng)
    return (out * x.dtype.type(1 - p) if p and rng is not None else out), cache
old = patch("attn.layers.dropout", "dropout_forward", dropout_forward)
'''),
    "13": ("BPE learns its merges in reverse order", '''
def learn_merges(*args, **kwargs):
    vocab, merges = old(*args, **kwargs)
    return vocab, merges[::-1]
old = patch("attn.bpe", "learn_merges", learn_merges)
'''),
    "14": ("the trainer's step ignores label smoothing (no longer the loop written in the lesson)", '''
def train_step(model, opt, batch, rng, label_smoothing, *args, **kwargs):
    return old(model, opt, batch, rng, 0.0, *args, **kwargs)
old = patch("attn.train", "train_step", train_step)
'''),
    "17": ("the softmax ignores its mask (padding gets weight)", '''
def softmax_forward(x, mask=None):
    return old(x, None)
old = patch("attn.layers.softmax", "softmax_forward", softmax_forward)
'''),
    "18": ("attention spreads its weight evenly over the keys it may see", '''
def softmax_forward(x, mask=None):
    return old(x * x.dtype.type(0.0), mask)
old = patch("attn.layers.softmax", "softmax_forward", softmax_forward)
'''),
    "19": ("learned positions' unused rows receive gradient (a broken scatter in positional_backward)", '''
def positional_backward(dout, cache):
    dx, dtable = old(dout, cache)
    return dx, (dtable + dtable.dtype.type(1e-3) if dtable is not None else dtable)
old = patch("attn.layers.positional", "positional_backward", positional_backward)
'''),
    "20": ("Adam takes no steps", '''
def step(self, grads, clip=0.0):
    return 0.0
attn.optim.Adam.step = step
'''),
    "21": ("the FLOP count forgets the backward pass", '''
def model_flops(cfg, Bsz, S, T, training=True):
    return old(cfg, Bsz, S, T, training=False)
old = patch("attn.bench.flops", "model_flops", model_flops)
'''),
}
MUTANTS["04"] = (MUTANTS["04"][0], MUTANTS["02"][1])
#: The lessons written later (15, 16, 22, 24, 25).
MUTANTS.update({
    "15": ("the decoding state's select keeps the self-attention cache in its old row order", '''
def select(self, index, index_host=None):
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
old = attn.fast.core.ops.Ops.layer_norm_
attn.fast.core.ops.Ops.layer_norm_ = layer_norm_
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
    "26": ("rotary positions' backward turns the gradient the same way as the forward, not back", '''
def rope_backward(dout, cache):
    return old(dout, cache._replace(sin=-cache.sin))
old = patch("attn.layers.rope", "rope_backward", rope_backward)
'''),
    "27": ("FlashAttention's backward recomputes the weights from a log-sum-exp one too large", '''
def flash_attention_backward(dout, cache):
    return old(dout, cache._replace(lse=cache.lse + 1))
old = patch("attn.layers.flash_attention", "flash_attention_backward", flash_attention_backward)
'''),
})
MUTANTS["28"] = ("every attention keeps a key/value head per query head, whatever kv_heads says", '''
import dataclasses
import attn.block
def parts(cfg):
    block = old(cfg)
    every = {k: dataclasses.replace(a, kv_heads=a.n_heads) for k, a in
             (("self_attention", block.self_attention), ("cross_attention", block.cross_attention))}
    return block._replace(**every)
old = patch("attn.block", "parts", parts)
''')
MUTANTS["23"] = ("each rank's share weighs 1/ranks (the mean of the ranks' means) instead of its tokens' share", '''
def share_of(batch, size, rank):
    mine, lo, rows, weight = old(batch, size, rank)
    return mine, lo, rows, 1.0 / size
old = patch("attn.training.distributed", "share_of", share_of)
''')

MUTANTS["29"] = ("LoRA's backward leaves alpha/r out of b's gradient", '''
def lora_backward(dout, cache):
    dx, da, db = old(dout, cache)
    return dx, da, db / cache.scale
old = patch("attn.layers.lora", "lora_backward", lora_backward)
''')

MUTANTS["30"] = ("top-p keeps one token fewer than the smallest set whose mass reaches p", '''
import attn.sample
def distribution(logits, temperature=1.0, top_k=None, top_p=None):
    p = old(logits, temperature, top_k, top_p)
    if top_p is not None and (p > 0).sum() > 1:
        p[p == p[p > 0].min()] = 0.0
        p /= p.sum()
    return p
old = patch("attn.sample", "distribution", distribution)
''')

MUTANTS["31"] = ("a rejected draft is redrawn from the target's p, not from max(0, p - q)", '''
import numpy as np
import attn.speculative
def speculative_accept(p, q, drafts, u, v):
    keep = u * q[drafts] < p[drafts]
    drawn = np.minimum(np.searchsorted(np.cumsum(p), v * p.sum(), side="right"), p.shape[0] - 1)
    return np.where(keep, drafts, drawn.astype(drafts.dtype))
old = patch("attn.speculative", "speculative_accept", speculative_accept)
''')

MUTANTS["32"] = ("int8 quantisation rounds down instead of to the nearest step", '''
import numpy as np
import attn.quantize
def quantize_int8(w):
    q, scale = old(w)
    safe = np.where(scale > 0, scale, w.dtype.type(1))
    return np.clip(np.floor(w / safe), -127, 127).astype(np.int8), scale
old = patch("attn.quantize", "quantize_int8", quantize_int8)
''')

#: Quick-mode lessons that train translators or many models: ATTN_LESSON_MUTANTS=cheap skips them.
EXPENSIVE = {"14", "17", "18", "20", "21"}


def _run_with_mutant(lesson: Path, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(PATCH + textwrap.dedent(code), encoding="utf-8")
    env = dict(os.environ, ATTN_QUICK="1", ATTN_LESSONS_OUT=str(tmp_path / "out"), MPLBACKEND="Agg",
               PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, str(lesson)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_every_lesson_has_a_mutant():
    missing = sorted(set(LESSONS) - set(MUTANTS))
    assert not missing, f"lessons without a mutant that breaks their claim: {missing}"


@pytest.mark.parametrize("number", sorted(MUTANTS), ids=[f"{n}: {MUTANTS[n][0]}" for n in sorted(MUTANTS)])
def test_lesson_fails_its_check_on_a_broken_library(number, tmp_path):
    if number in EXPENSIVE and os.environ.get("ATTN_LESSON_MUTANTS") == "cheap":
        pytest.skip("ATTN_LESSON_MUTANTS=cheap: an expensive lesson's mutant is skipped")
    lesson = LESSONS[number]
    what, code = MUTANTS[number]
    proc = _run_with_mutant(lesson, code, tmp_path)
    tail = proc.stderr[-3000:]
    assert proc.returncode != 0, f"{lesson.name} passed its check although {what}:\n{proc.stdout[-2000:]}"
    # the lesson's own check: an AssertionError raised from a line of the lesson (directly, or by a
    # checker it called there, such as attn.gradcheck.check_layer), not any other exception
    frames = re.findall(r'File "([^"]+)", line \d+, in <module>', proc.stderr)
    assert re.search(r"^AssertionError", proc.stderr, re.MULTILINE) and frames and Path(frames[-1]) == lesson, \
        f"{lesson.name} should fail one of its own checks when {what}, not crash:\n{tail}"
    assert "Check passed" not in proc.stdout


def test_the_shim_really_replaces_the_function(tmp_path):
    """The mechanism itself: a patched function is what a lesson-style import gets."""
    probe = tmp_path / "probe.py"
    probe.write_text("from attn.layers import attention_forward, multi_head_attention_forward\n"
                     "import attn.layers.attention as m\n"
                     "print(attention_forward.__module__, m.attention_forward is attention_forward)\n",
                     encoding="utf-8")
    proc = _run_with_mutant(probe, MUTANTS["02"][1], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["sitecustomize", "True"], proc.stdout

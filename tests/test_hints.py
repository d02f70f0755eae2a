"""Hints that find the mistake: for each layer whose backward the lessons derive by hand, a
set of typical mistakes, each written as a learner would, and each must get a report whose
"looks like" (hint 1) and "look at" (hint 2) point at its own mistake, not at a neighbour's."""
from __future__ import annotations

import io
import re
import textwrap

import pytest

import attn.backend as B
from attn.grader import cli

NORM = '''
def {name}(dout, cache):
    xhat, rstd, gamma = cache
    D = xhat.shape[-1]
    g = dout * gamma
    dx = {dx}
    return dx, (dout * xhat).reshape(-1, D).sum(axis=0), dout.reshape(-1, D).sum(axis=0)
'''
LN = "from attn.layers import layer_norm_forward\n\n" + NORM.replace("{name}", "layer_norm_backward")
SOFTMAX = '''
from attn.layers import softmax_forward


def softmax_backward(dy, cache):
    y = cache.y
    return {dx}
'''
ATTENTION = '''
from attn.layers import attention_forward, dropout_backward, softmax_backward
from attn.layers.softmax import SoftmaxCache


def attention_backward(dout, cache):
    q, k, v, w, cd, scale = cache
    wd = w if cd.mask is None else w * cd.mask
    dv = wd.swapaxes(-1, -2) @ dout
    dw = dropout_backward(dout @ v.swapaxes(-1, -2), cd)
    ds = {ds}
    return ds @ k, ds.swapaxes(-1, -2) @ q, dv
'''
RESIDUAL = "from attn.layers import feed_forward_backward, residual_ffn_forward\n\n" + NORM.replace(
    "{name}", "_norm_backward") + '''

def residual_ffn_backward(dout, cache):
    dz, dgamma, dbeta = _norm_backward(dout, cache.norm)
    dx_ffn, dw1, db1, dw2, db2 = feed_forward_backward(dz, cache.ffn)
    return {ret}, dw1, db1, dw2, db2, dgamma, dbeta
'''
LINEAR = '''
from attn.layers import linear_forward


def linear_backward(dout, cache):
    x, w = cache
    x2, d2 = x.reshape(-1, w.shape[0]), dout.reshape(-1, w.shape[1])
    return (d2 @ w.T).reshape(x.shape), {dw}, {db}
'''
RIGHT_LN = "rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))"
NO_MEAN = "rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))"
NO_VAR = "rstd * (g - g.mean(axis=-1, keepdims=True))"

#: layer -> (mistake, the file, what "looks like" must say, what "look at" must say)
MISTAKES = {
    "linear": [
        ("dw transposed", LINEAR.format(dw="d2.T @ x2", db="d2.sum(axis=0)"), r"transposed product",
         r"which two arrays are multiplied, in which order"),
        ("db a mean", LINEAR.format(dw="x2.T @ d2", db="d2.mean(axis=0)"),
         r"a mean over the rows instead of their sum", r"which axes the bias gradient is summed over"),
        ("dw a mean", LINEAR.format(dw="x2.T @ d2 / len(d2)", db="d2.sum(axis=0)"),
         r"a mean over the rows instead of their sum", r"every position contributes to dw"),
    ],
    "layer_norm": [
        ("no mean term", LN.format(dx=NO_MEAN), r"the mean term .* is missing", r"mean of the row"),
        ("no variance term", LN.format(dx=NO_VAR), r"the variance term .* is missing$", r"rstd = 1/sqrt"),
        ("neither term", LN.format(dx="rstd * g"), r"the mean term .* is missing and the variance term .* is "
                                                   r"missing", r"mean of the row.*rstd = 1/sqrt"),
        ("variance term's sign", LN.format(dx="rstd * (g - g.mean(axis=-1, keepdims=True) + xhat * (g * xhat)"
                                              ".mean(axis=-1, keepdims=True))"),
         r"the variance term .* has the wrong sign", r"rstd = 1/sqrt"),
    ],
    "softmax": [
        ("no normaliser term", SOFTMAX.format(dx="y * dy"), r"the normaliser's term .* is missing", r"normaliser"),
        ("normaliser's sign", SOFTMAX.format(dx="y * (dy + (dy * y).sum(axis=-1, keepdims=True))"),
         r"the normaliser's term .* has the wrong sign", r"normaliser"),
        ("whole sign", SOFTMAX.format(dx="-y * (dy - (dy * y).sum(axis=-1, keepdims=True))"),
         r"the opposite sign", r"every logit of its row"),
    ],
    "attention": [
        ("no scale", ATTENTION.format(ds="softmax_backward(dw, SoftmaxCache(w))"),
         r"the factor 1/sqrt\(d_k\) of the scores is missing", r"scale of the scores"),
        ("scale twice", ATTENTION.format(ds="softmax_backward(dw, SoftmaxCache(w)) * scale * scale"),
         r"the factor 1/sqrt\(d_k\) of the scores is applied twice", r"scale of the scores"),
        ("softmax without its normaliser", ATTENTION.format(ds="w * dw * scale"),
         r"the softmax's normaliser's term .* is missing", r"the softmax inside"),
    ],
    "residual_ffn": [
        ("no skip path", RESIDUAL.format(dx=RIGHT_LN, ret="dx_ffn"), r"the skip path's dz is missing$",
         r"two paths"),
        ("the norm without its variance term", RESIDUAL.format(dx=NO_VAR, ret="dz + dx_ffn"),
         r"the layer norm's the variance term .* is missing$", r"^the layer norm's rstd"),
        ("the norm without its mean term", RESIDUAL.format(dx=NO_MEAN, ret="dz + dx_ffn"),
         r"the layer norm's the mean term .* is missing$", r"^the layer norm's the mean of the row"),
    ],
}
CASES = [(layer, *m) for layer, ms in MISTAKES.items() for m in ms]


def _grade(path, *argv) -> tuple[int, str]:
    saved = (B._current, B._xp, B.cupy_modules)
    out = io.StringIO()
    try:
        rc = cli.main([str(path), *argv], out=out)
    finally:
        B._current, B._xp, B.cupy_modules = saved
    return rc, out.getvalue()


def _line(report: str, key: str) -> str:
    m = re.search(rf"^\s+{key}\s*(.*)$", report, re.M)
    return m.group(1) if m else ""


def test_every_layer_has_three_mistakes_or_more():
    assert all(len(ms) >= 3 for ms in MISTAKES.values()), {k: len(v) for k, v in MISTAKES.items()}


@pytest.mark.parametrize("layer, mistake, source, looks_like, look_at", CASES,
                         ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_each_mistake_gets_its_own_hint(tmp_path, layer, mistake, source, looks_like, look_at):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    rc, report = _grade(path, "--layer", layer, "--hint", "2", "--allow-library")
    assert rc == 1 and re.search(r"blame:\s+fix \w+_backward", report), report
    assert re.search(looks_like, _line(report, "looks like:")), f"{mistake}: hint 1 misses it:\n{report}"
    assert re.search(look_at, _line(report, "look at:")), f"{mistake}: hint 2 misses it:\n{report}"


def test_a_composite_whose_part_failed_points_at_the_part(tmp_path):
    """The file's own layer norm drops the variance term, and residual_ffn uses it: hint 2 of
    residual_ffn points at the norm, not at the skip path it got right."""
    path = tmp_path / "07_feed_forward_layer_norm.py"
    own_norm = NORM.replace("{name}", "layer_norm_backward").format(dx=NO_VAR)
    path.write_text("from attn.layers import feed_forward_backward, feed_forward_forward, layer_norm_forward\n"
                    + own_norm + textwrap.dedent('''

        def residual_ffn_forward(x, w1, b1, w2, b2, gamma, beta, eps=1e-5):
            f, cf = feed_forward_forward(x, w1, b1, w2, b2)
            out, cn = layer_norm_forward(x + f, gamma, beta, eps)
            return out, (cf, cn)


        def residual_ffn_backward(dout, cache):
            cf, cn = cache
            dz, dgamma, dbeta = layer_norm_backward(dout, cn)
            dx_ffn, dw1, db1, dw2, db2 = feed_forward_backward(dz, cf)
            return dz + dx_ffn, dw1, db1, dw2, db2, dgamma, dbeta
        '''), encoding="utf-8")
    rc, report = _grade(path, "--layer", "layer_norm", "--layer", "residual_ffn", "--hint", "2",
                        "--allow-library")
    assert rc == 1, report
    residual = report[report.index("residual_ffn "):]
    look = _line(residual, "look at:")
    assert "two paths" not in look and look.startswith("layer_norm first"), residual
    assert "rstd = 1/sqrt" in look, residual

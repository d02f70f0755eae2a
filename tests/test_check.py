"""attn-check, the learner's grader: the library's layers pass, the untouched starters say
"not implemented yet" without a traceback, a starter with one layer written passes that
layer, and every broken variant in tests/mutants/ is caught (the grader is tested the way a
test suite is: by mutants it must catch)."""
from __future__ import annotations

import configparser
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attn.backend as B
from attn import check
from attn.testing import LAYERS

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = sorted((ROOT / "tests" / "mutants").glob("*.py"))
STARTERS = sorted((ROOT / "lessons" / "exercises").glob("[0-9][0-9]_*.py"))

#: mutant file -> the layer attn-check must fail.
CAUGHT_AS = {
    "attention_backward_no_scale": "attention",
    "attention_mask_after_softmax": "attention",
    "causal_mask_off_by_one": "causal_mask",
    "cross_entropy_smoothing_on_padding": "cross_entropy",
    "dropout_backward_fresh_mask": "dropout",
    "dropout_backward_in_place": "dropout",
    "dropout_no_rescale": "dropout",
    "embedding_grad_drops_repeats": "embedding",
    "layer_norm_forward_without_cache": "layer_norm",
    "layer_norm_modifies_input": "layer_norm",
    "layer_norm_no_mean_term": "layer_norm",
    "layer_norm_no_variance_term": "layer_norm",
    "layer_norm_unbiased_variance": "layer_norm",
    "linear_weight_grad_transposed": "linear",
    "positional_backward_no_batch_sum": "positional",
    "positional_sin_cos_swapped": "sinusoidal_table",
    "relu_backward_mask_from_dout": "relu",
    "residual_drops_skip_path": "residual_ffn",
    "rnn_backward_no_carry": "rnn",
    "softmax_backward_y_times_dy": "softmax",
    "softmax_fully_masked_row_uniform": "softmax",
    "softmax_mask_after_normalising": "softmax",
    "softmax_returns_float64": "softmax",
    "softmax_without_max_shift": "softmax",
    "split_heads_wrong_reshape": "multi_head_attention",
}


_MUTANT_REPORTS: dict[str, tuple[int, str]] = {}      # mutant -> (status, report): each runs once


@pytest.fixture
def run_check():
    """attn-check in this process: (exit status, report). The backend choice is restored."""
    saved = (B._current, B._xp, B.cupy_modules)

    def run(*argv):
        out = io.StringIO()
        rc = check.main([str(a) for a in argv], out=out)
        return rc, out.getvalue()
    yield run
    B._current, B._xp, B.cupy_modules = saved


def status_lines(report: str) -> dict:
    """layer -> "PASS", "FAIL" or "not implemented yet", from the report's layer lines."""
    found = {}
    for line in report.splitlines():
        m = re.match(r"^(\w+)\s+(PASS|FAIL|not implemented yet)\s", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def test_the_librarys_layers_pass(run_check):
    rc, report = run_check(ROOT / "tests" / "solutions.py")
    assert rc == 0, report
    assert status_lines(report) == {name: "PASS" for name in LAYERS}, report
    print(report)                              # per-layer seconds at the default number of examples


def test_every_mutant_has_a_file_and_an_expected_layer():
    assert len(MUTANTS) >= 15
    assert sorted(p.stem for p in MUTANTS) == sorted(CAUGHT_AS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[p.stem for p in MUTANTS])
def test_mutant_is_caught(run_check, mutant):
    layer = CAUGHT_AS[mutant.stem]
    rc, report = _MUTANT_REPORTS[mutant.stem] = run_check(mutant, "--layer", layer)
    assert rc == 1, report
    assert status_lines(report) == {layer: "FAIL"}, report
    assert "check:" in report and "example:  the smallest hypothesis found" in report
    assert "Traceback" not in report


def test_a_failure_report_names_the_gradient_error_entries_and_hint(run_check):
    name = "attention_backward_no_scale"
    rc, report = _MUTANT_REPORTS.get(name) or run_check(ROOT / "tests" / "mutants" / f"{name}.py",
                                                         "--layer", "attention")
    assert rc == 1
    assert re.search(r"check:\s+backward: gradient d[qk] differs from the library's", report), report
    assert re.search(r"error:\s+relative error [0-9.e+-]+ \(tolerance 1e-06\)", report), report
    assert re.search(r"entries:\s+index\s+yours\s+expected", report), report
    assert "1.41421 times the expected" in report                     # sqrt(2): d_k = 2 in the smallest example
    assert "hint:" in report and "sqrt(d_k)" in report


@pytest.mark.parametrize("starter", STARTERS, ids=[p.stem for p in STARTERS])
def test_untouched_starter_says_not_implemented_yet(run_check, starter):
    rc, report = run_check(starter)
    assert rc == 1, report
    lines = status_lines(report)
    assert lines and set(lines.values()) == {"not implemented yet"}, report
    assert report.count("raises NotImplementedError: write its body") == len(lines)
    assert "Traceback" not in report


def test_every_starter_has_its_lessons_exercise_cell():
    for starter in STARTERS:
        lesson = next((ROOT / "lessons").glob(starter.name[:3] + "*.py"))
        text = lesson.read_text(encoding="utf-8")
        tail = text[text.rindex("# %%"):]
        assert tail.startswith("# %% [markdown]") and "Exercise" in tail, lesson.name
        assert f"attn-check lessons/exercises/{starter.name}" in tail, lesson.name


def _write_layer_norm(text: str) -> str:
    """The starter of lesson 7 with layer_norm_forward and layer_norm_backward written."""
    forward = '''    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / (var + x.dtype.type(eps)) ** 0.5
    xhat = (x - mean) * rstd
    return gamma * xhat + beta, (xhat, rstd, gamma)'''
    backward = '''    xhat, rstd, gamma = cache
    g = dout * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    D = xhat.shape[-1]
    return dx, (dout * xhat).reshape(-1, D).sum(axis=0), dout.reshape(-1, D).sum(axis=0)'''
    for name, body in (("layer_norm_forward", forward), ("layer_norm_backward", backward)):
        start = text.index(f"def {name}(")
        at = text.index("    raise NotImplementedError", start)
        text = text[:at] + body + text[at + len("    raise NotImplementedError"):]
    return text


def test_a_starter_with_one_layer_written_passes_that_layer(run_check, tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text(_write_layer_norm((ROOT / "lessons/exercises/07_feed_forward_layer_norm.py").read_text()))
    rc, report = run_check(mine)
    assert rc == 1                                                     # the other layers are still to do
    assert status_lines(report) == {"relu": "not implemented yet", "layer_norm": "PASS",
                                    "feed_forward": "not implemented yet", "residual_ffn": "not implemented yet"}
    rc, report = run_check(mine, "--layer", "layer_norm")
    assert rc == 0 and status_lines(report) == {"layer_norm": "PASS"}, report


def test_an_exception_is_reported_with_the_learners_line(run_check, tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("def relu_forward(x):\n    return x * (x > 0), None\n\n\n"
                 "def relu_backward(dout, cache):\n    return dout * cache.positive\n")
    rc, report = run_check(f)
    assert rc == 1 and status_lines(report) == {"relu": "FAIL"}
    assert "relu_backward raised AttributeError" in report
    assert re.search(rf"where:\s+{re.escape(str(f))}:6 in relu_backward: return dout \* cache.positive", report)
    assert "Traceback" not in report


def test_a_wrong_signature_names_the_librarys(run_check, tmp_path):
    f = tmp_path / "sig.py"
    f.write_text("def softmax_forward(x):\n    return x, None\n")
    rc, report = run_check(f)
    assert rc == 1 and "softmax_forward must take the library's arguments: softmax_forward(x, mask=None)" in report


def test_a_forward_alone_is_checked_without_gradients(run_check, tmp_path):
    f = tmp_path / "fwd.py"
    f.write_text("from attn.layers import layer_norm_forward\n")
    rc, report = run_check(f)
    assert rc == 0 and status_lines(report) == {"layer_norm": "PASS"}
    assert "forward only: layer_norm_backward is not defined" in report


def test_files_that_cannot_be_graded_exit_2(run_check, tmp_path):
    assert run_check(tmp_path / "missing.py")[0] == 2
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    rc, report = run_check(empty)
    assert rc == 2 and "defines none of the library's layer functions" in report
    bad = tmp_path / "bad.py"
    bad.write_text("def softmax_forward(x, mask=None):\n    return x +\n")
    rc, report = run_check(bad)
    assert rc == 2 and f"{bad}:2" in report and "SyntaxError" in report
    rc, report = run_check(ROOT / "tests" / "solutions.py", "--layer", "softmax", "--examples", "0")
    assert rc == 2


def test_help_and_module_entry_point():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "attn.check", "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0
    for words in ("attn-check", "--layer", "--examples", "--backend", "Exit status", "NotImplementedError",
                  "layer_norm_forward, layer_norm_backward"):
        assert words in proc.stdout, words


def test_the_grader_gets_its_arrays_from_the_backend():
    """attn.testing and attn.check import no NumPy (tests/test_backend.py checks every module of attn/;
    this names the two, so that moving them out of attn/ cannot drop them from that rule)."""
    from test_backend import _forbidden_imports
    for module in ("testing.py", "check.py"):
        path = ROOT / "attn" / module
        assert path.is_file() and not _forbidden_imports(path), module


def test_console_script_and_hypothesis_dependency_are_declared():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "attn-check = attn.check:main" in cfg["options.entry_points"]["console_scripts"]
    assert "hypothesis" in cfg["options"]["install_requires"]


def test_cupy_backend_without_a_gpu_is_a_clear_error(run_check):
    if B.cupy_available():
        pytest.skip("a GPU is usable here: the cupy backend works")
    rc, report = run_check(ROOT / "tests" / "solutions.py", "--backend", "cupy")
    assert rc == 2 and "ATTN_BACKEND=cupy was asked for" in report


def test_on_cupy_the_library_passes_and_a_mutant_fails(run_check):
    """--backend cupy: on a GPU where there is one, on the CuPy stand-in (tests/fakecupy)
    elsewhere. A few examples per layer: this proves the grader's own CuPy path."""
    from conftest import selected_backend
    with selected_backend("cupy"):
        rc, report = run_check(ROOT / "tests" / "solutions.py", "--backend", "cupy", "--examples", "5")
        assert rc == 0 and set(status_lines(report).values()) == {"PASS"}, report
        assert "backend cupy" in report
        rc, report = run_check(ROOT / "tests" / "mutants" / "embedding_grad_drops_repeats.py", "--backend", "cupy")
        assert rc == 1 and status_lines(report) == {"embedding": "FAIL"}, report

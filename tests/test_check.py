"""attn-check, the learner's grader: the library's layers pass, the untouched starters say
"not implemented yet" without a traceback, a starter with one layer written passes that
layer, and every broken variant in tests/mutants/ is caught (the grader is tested the way a
test suite is: by mutants it must catch)."""
from __future__ import annotations

import configparser
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

import attn.backend as B
from attn.grader import cli
from attn.testing import LAYERS

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = sorted((ROOT / "tests" / "mutants").glob("*.py"))
STARTERS = sorted((ROOT / "lessons" / "exercises").glob("*.py"))

#: mutant file -> (the layer attn-check must fail, the function it must blame, a regex the
#: report must match, extra arguments). Mutants that borrow the library's other half of a
#: layer (its backward, to break only the forward) run with --allow-library.
LIB = ("--allow-library",)
EX8 = ("--exercise", "08_backprop_by_hand")
FORWARD_FIRST = r"blame:\s+fix {f} first: the forward is wrong"
EX7 = ("--exercise", "07_feed_forward_layer_norm")
CAUGHT_AS = {
    # The later block's layers (lesson 26).
    "rope_backward_turns_the_same_way": ("rope", "rope_backward", r"gradient dx differs", ()),
    "swiglu_gate_derivative_is_the_sigmoid": ("swiglu", "swiglu_backward", r"gradient dx differs", ()),
    "grouped_query_attention_heads_tiled": ("grouped_query_attention", "grouped_query_attention_forward",
                                            r"check:\s+invariant: with \d key/value heads for \d query heads", ()),
    "grouped_query_attention_calls_mha": ("grouped_query_attention", "grouped_query_attention_forward",
                                          r"raised RuntimeError: attn.layers.multi_head_attention_forward is "
                                          r"withheld while attn-check grades this exercise: it would hand in the "
                                          r"answer", ()),
    "rmsnorm_backward_complex_step": ("rmsnorm", "rmsnorm_backward", r"check:\s+backward: rmsnorm_backward "
                                      r"evaluated its forward rmsnorm_forward \d+ times, with complex arguments: a "
                                      r"backward is derived", ()),
    # FlashAttention (lesson 27).
    "flash_attention_no_rescale": ("flash_attention", "flash_attention_forward", r"check:\s+invariant: tiles of \d+ "
                                   r"queries and \d+ keys give an output that differs from one tile", LIB),
    "flash_attention_keeps_the_weights": ("flash_attention", "flash_attention_forward", r"check:\s+invariant: the "
                                          r"forward's cache holds an array of shape \(.*\), one number for every "
                                          r"query and key", ()),
    "flash_attention_wrong_d": ("flash_attention", "flash_attention_backward", r"gradient d[qk] differs", LIB),
    "flash_attention_causal_off_by_one": ("flash_attention", "flash_attention_forward", r"check:\s+invariant: with "
                                          r"causal=True and tiles of \d+ queries and \d+ keys the output differs",
                                          LIB),
    # LoRA.
    "lora_db_without_the_scale": ("lora", "lora_backward", r"looks like: yours is 0.125 times the expected: the factor "
                                  r"alpha/r, the adapter's scale is missing", ()),
    # The rows of issue 28's table: what a file written to get full marks without being right gets.
    "softmax_pickle_on_the_pipe": ("softmax", "softmax_forward", r"softmax_forward sent the grader something that "
                                   r"is not plain data", ()),
    "softmax_patches_the_child": ("softmax", "softmax_forward", r"raised ImportError: attn.grader is not available "
                                  r"to the file attn-check grades", ()),
    "layer_norm_code_replaced": ("layer_norm", "layer_norm_forward", r"raised AttributeError: 'Withheld' object has "
                                 r"no attribute '__code__'", ()),
    "softmax_from_another_module": ("softmax", "softmax_forward", r"raised ImportError: attn.model is not available",
                                    ()),
    "relu_allocates_20gb": ("relu", "relu_forward", r"raised MemoryError", ()),
    "relu_writes_50mb": ("relu", "relu_forward", r"raised OSError: \[Errno 27\] File too large", ()),
    "layer_norm_backward_only": ("layer_norm", "layer_norm_forward", r"layer_norm_forward is the library's own", EX7),
    "softmax_float32_zeros": ("softmax", "softmax_forward", r"float32: the float32 output differs from the library's",
                              ()),
    "layer_norm_backward_reads_globals": ("layer_norm", "layer_norm_backward", r"gradient dx differs", ()),
    "layer_norm_wrong_for_wide_rows": ("layer_norm", "layer_norm_forward", r"check:\s+invariant", ("--seed", "4242")),
    "adam_no_bias_correction": ("adam", "adam_step", r"step 1 \(lr [0-9.e-]+\): the parameters\['p0'\] differs", ()),
    "beam_search_stops_at_first_finished": ("beam_search", "beam_search", r"sentence \d+: your tokens .*, the "
                                            r"library's", ("--exercise", "decoding")),
    "encoder_layer_no_residual": ("encoder_layer", "encoder_layer_forward", FORWARD_FIRST + r"(.|\n)*backward: "
                                  r"encoder_layer_backward agrees with central differences of your own forward", ()),
    "transformer_tied_embedding_missing_path": ("transformer", "transformer_backward",
                                                r"gradient dparams\['embedding.weight'\] differs(.|\n)*looks like: "
                                                r"yours is the expected without the path through the output "
                                                r"projection", LIB),
    "attention_backward_no_scale": ("attention", "attention_backward", r"gradient d[qk] differs", LIB),
    # attention's explicit example with dropout 0.2 meets the backward's fresh mask before the dropout check does.
    "attention_dropout_fresh_mask": ("attention", "attention_backward",
                                     r"check:\s+backward: gradient d[qk] disagrees with central differences of your "
                                     r"forward(.|\n)*dropout = 0.2(.|\n)*rng = attn.backend.DeviceRNG",
                                     ("--hint", "2")),
    "attention_dropout_ignored": ("attention", "attention_forward",
                                  r"no unit was dropped in 8 calls with p = 0.5: the dropout argument is ignored", ()),
    "attention_mask_after_softmax": ("attention", "attention_forward", FORWARD_FIRST, LIB),
    "causal_mask_off_by_one": ("causal_mask", "causal_mask", r"the result differs from the library's", ()),
    # Both are true of it: the smoothing's gradient at padded targets shows unless every logit of the row is equal.
    "cross_entropy_smoothing_on_padding": ("cross_entropy", "cross_entropy", r"padded targets changed the loss|"
                                           r"padded target \(.*\) has non-zero dlogits", ()),
    "dropout_backward_fresh_mask": ("dropout", "dropout_backward", r"dx is not dout times the forward's mask", ()),
    "dropout_backward_in_place": ("dropout", "dropout_backward", r"modified its input dout in place", LIB),
    "dropout_no_rescale": ("dropout", "dropout_forward", r"kept units are scaled by 1, expected 1/\(1-p\)", LIB),
    "embedding_grad_drops_repeats": ("embedding", "embedding_backward", r"gradient dW differs", LIB),
    "layer_norm_eps_outside_sqrt": ("layer_norm", "layer_norm_forward",
                                    FORWARD_FIRST + r"(.|\n)*backward: layer_norm_backward agrees with central "
                                                    r"differences of your own forward", ()),
    "layer_norm_forward_exits": ("layer_norm", "layer_norm_forward",
                                 r"check:\s+forward: layer_norm_forward called sys.exit\(0\)(.|\n)*where:.*"
                                 r"layer_norm_forward_exits.py:6 in layer_norm_forward: sys.exit\(0\)", ()),
    "layer_norm_forward_without_cache": ("layer_norm", "layer_norm_forward", r"expected \(out, cache\)", LIB),
    "layer_norm_library_in_a_thread": ("layer_norm", "layer_norm_forward",
                                       r"layer_norm_forward did not return within 2 s", ("--timeout", "2")),
    "layer_norm_modifies_input": ("layer_norm", "layer_norm_forward", r"modified its input x in place", LIB),
    "layer_norm_no_mean_term": ("layer_norm", "layer_norm_backward", r"gradient dx differs", EX8),
    "layer_norm_no_variance_term": ("layer_norm", "layer_norm_backward", r"gradient dx differs", EX8),
    "layer_norm_reexported": ("layer_norm", "layer_norm_backward",
                              r"layer_norm_backward is the library's own \(attn.layers", ()),
    "layer_norm_unbiased_variance": ("layer_norm", "layer_norm_forward", FORWARD_FIRST, LIB),
    "layer_norm_without_backward": ("layer_norm", None, r"forward only: layer_norm_backward is not defined", ()),
    "layer_norm_wrapped_after_setprofile": ("layer_norm", "layer_norm_forward",
                                            r"layer_norm_forward raised RuntimeError: attn.layers.layer_norm_forward "
                                            r"is withheld while attn-check grades layer_norm_forward", ()),
    "layer_norm_wrapped_library": ("layer_norm", "layer_norm_forward",
                                   r"layer_norm_forward raised RuntimeError: attn.layers.layer_norm_forward is "
                                   r"withheld while attn-check grades layer_norm_forward", ()),
    "linear_weight_grad_transposed": ("linear", "linear_backward", r"dw has shape", LIB),
    "positional_backward_no_batch_sum": ("positional", "positional_backward", r"gradient dtable differs", LIB),
    "positional_sin_cos_swapped": ("sinusoidal_table", "sinusoidal_table", r"sin and cos swapped", ("--hint", "2")),
    "relu_backward_mask_from_dout": ("relu", "relu_backward", r"gradient dx differs", LIB),
    # Issue 39's attempts (tests/test_sandbox_attempts.py runs them as an unprivileged user too).
    "layer_norm_bound_in_an_if": ("layer_norm", "layer_norm_forward", r"layer_norm_forward raised RuntimeError: "
                                  r"attn.layers.layer_norm_forward is withheld", ()),
    "softmax_global_max": ("softmax", "softmax_forward", r"sums to 0.0 over its unmasked keys", ("--seed", "4242")),
    "relu_forks_300": ("relu", "relu_forward", r"raised BlockingIOError", ()),
    "relu_fills_dev_shm": ("relu", "relu_forward", r"wrote more than 64 MB into /tmp and /dev/shm", ()),
    "relu_sleeps_near_the_limit": ("relu", "relu_forward", r"the layer's 3 s are spent",
                                   ("--timeout", "1", "--layer-time", "3")),
    "relu_looks_for_the_answer": ("relu", "relu_forward", r"raised ValueError: found \[\]", ()),
    "residual_drops_skip_path": ("residual_ffn", "residual_ffn_backward", r"gradient dx differs", LIB),
    "rnn_backward_no_carry": ("rnn", "rnn_backward", r"gradient dx differs", LIB),
    "softmax_backward_y_times_dy": ("softmax", "softmax_backward", r"gradient dx differs", EX8),
    "softmax_forward_endless_loop": ("softmax", "softmax_forward",
                                     r"softmax_forward did not return within 2 s: an endless loop\?(.|\n)*where:.*"
                                     r"softmax_forward_endless_loop.py:\d+ in softmax_forward", ("--timeout", "2")),
    "softmax_fully_masked_row_uniform": ("softmax", "softmax_forward", FORWARD_FIRST, LIB),
    "softmax_mask_after_normalising": ("softmax", "softmax_forward", FORWARD_FIRST, LIB),
    "softmax_returns_float64": ("softmax", "softmax_forward", r"with float32 inputs the output is float64", LIB),
    "softmax_without_max_shift": ("softmax", "softmax_forward", r"the output has nan", LIB),
    "split_heads_wrong_reshape": ("multi_head_attention", "multi_head_attention_forward", FORWARD_FIRST, LIB),
}


_MUTANT_REPORTS: dict[str, tuple[int, str]] = {}      # mutant -> (status, report): each runs once


@pytest.fixture
def run_check():
    """attn-check in this process: (exit status, report). The backend choice is restored."""
    saved = (B._current, B._xp, B.cupy_modules)

    def run(*argv):
        out = io.StringIO()
        rc = cli.main([str(a) for a in argv], out=out)
        return rc, out.getvalue()
    yield run
    B._current, B._xp, B.cupy_modules = saved


def status_lines(report: str) -> dict:
    """layer -> "PASS", "FAIL", "INCOMPLETE" or "not implemented yet", from the report's layer lines."""
    found = {}
    for line in report.splitlines():
        m = re.match(r"^(\w+)\s+(PASS|FAIL|INCOMPLETE|not implemented yet)\s", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def test_the_librarys_layers_pass(run_check):
    rc, report = run_check("--allow-library", ROOT / "tests" / "solutions.py", "--examples", "10")
    assert rc == 0, report
    assert status_lines(report) == {name: "PASS" for name in LAYERS}, report
    print(report)                              # per-layer seconds at the default number of examples


def test_the_librarys_answers_cannot_be_imported(run_check):
    rc, report = run_check(ROOT / "tests" / "solutions.py", "--examples", "1")
    assert rc == 2 and "is not available to the file attn-check grades" in report, report


def test_every_mutant_has_a_file_and_an_expected_blame():
    assert len(MUTANTS) >= 30
    assert sorted(p.stem for p in MUTANTS) == sorted(CAUGHT_AS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[p.stem for p in MUTANTS])
def test_mutant_is_caught_and_blamed(run_check, mutant):
    layer, blamed, pattern, extra = CAUGHT_AS[mutant.stem]
    rc, report = _MUTANT_REPORTS[mutant.stem] = run_check(mutant, "--layer", layer, *extra)
    assert rc == 1, report
    assert "Traceback" not in report
    if blamed is None:                                          # not a failure: forward only, incomplete
        assert status_lines(report) == {layer: "INCOMPLETE"}, report
    else:
        assert status_lines(report) == {layer: "FAIL"}, report
        assert re.search(rf"blame:\s+fix {blamed}\b", report), report
        assert "check:" in report
    assert re.search(pattern.format(f=blamed), report), report


def test_the_pickle_never_runs_in_the_grader():
    assert not Path("/tmp/attn-check-pickle-ran").exists()


def test_wide_rows_pass_the_everyday_profile_only(run_check):
    rc, report = run_check(ROOT / "tests" / "mutants" / "layer_norm_wrong_for_wide_rows.py")
    assert rc == 0, report


def test_a_failure_report_names_the_gradient_error_entries_and_hint(run_check):
    name = "attention_backward_no_scale"
    rc, report = run_check(ROOT / "tests" / "mutants" / f"{name}.py", "--layer", "attention", "--hint", "3", *LIB)
    assert rc == 1
    assert re.search(r"check:\s+backward: gradient d[qk] differs from the library's", report), report
    assert re.search(r"error:\s+relative error [0-9.e+-]+ \(tolerance 1e-06\)", report), report
    assert re.search(r"entries:\s+index\s+yours\s+expected", report), report
    assert "1.41421 times the expected" in report                     # sqrt(2): d_k = 2 in the smallest example
    assert "formula:" in report and "sqrt(d_k)" in report


def test_hints_come_in_levels(run_check):
    mutant = ROOT / "tests" / "mutants" / "layer_norm_no_mean_term.py"
    reports = {level: run_check(mutant, "--hint", str(level), "--layer", "layer_norm", *EX8)[1] for level in (1, 2, 3)}
    assert "look at:" not in reports[1] and "formula:" not in reports[1]
    assert "attn-check --hint 2 says where to look" in reports[1]
    assert "look at:" in reports[2] and "formula:" not in reports[2]
    assert "attn-check --hint 3 says the formula" in reports[2]
    assert "look at:" in reports[3] and "formula:" in reports[3]


@pytest.mark.parametrize("starter", STARTERS, ids=[p.stem for p in STARTERS])
def test_untouched_starter_says_not_implemented_yet(run_check, starter):
    rc, report = run_check(starter)
    assert rc == 1, report
    lines = status_lines(report)
    assert lines and set(lines.values()) == {"not implemented yet"}, report
    assert report.count("raises NotImplementedError: write its body") == len(lines)
    assert "Traceback" not in report


def test_every_starter_has_its_lessons_exercise_cell():
    """Every starter is named (`attn-check lessons/exercises/<name>`) in the closing
    markdown "Exercise" cell of some lesson."""
    tails = {}
    for lesson in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py")):
        text = lesson.read_text(encoding="utf-8")
        tail = text[text.rindex("# %%"):]
        if tail.startswith("# %% [markdown]") and "Exercise" in tail:
            tails[lesson.name] = tail
    for starter in STARTERS:
        named = [name for name, tail in tails.items() if f"attn-check lessons/exercises/{starter.name}" in tail]
        assert named, f"no lesson ends with an Exercise cell naming lessons/exercises/{starter.name}"


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
    rc, report = run_check(f, "--hint", "2")
    assert rc == 1 and "softmax_forward must take the library's arguments: softmax_forward(x, mask=None)" in report


def test_a_forward_alone_is_incomplete_unless_asked_for(run_check):
    mutant = ROOT / "tests" / "mutants" / "layer_norm_without_backward.py"
    rc, report = run_check(mutant, "--forward-only")
    assert rc == 0 and status_lines(report) == {"layer_norm": "PASS"}, report
    assert "forward only: layer_norm_backward is not defined" in report


def test_files_that_cannot_be_graded_exit_2(run_check, tmp_path):
    assert run_check(tmp_path / "missing.py")[0] == 2
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    rc, report = run_check(empty)
    assert rc == 2 and "defines no gradable function" in report
    imported = tmp_path / "imported.py"
    imported.write_text("from attn.layers import layer_norm_forward\n")
    rc, report = run_check(imported)
    assert rc == 2 and "layer_norm_forward is the library's own, imported, not written here" in report, report
    bad = tmp_path / "bad.py"
    bad.write_text("def softmax_forward(x, mask=None):\n    return x +\n")
    rc, report = run_check(bad)
    assert rc == 2 and f"{bad}:2" in report and "SyntaxError" in report
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(0)\n")
    rc, report = run_check(exits)
    assert rc == 2 and "importing it called sys.exit(0)" in report and f"{exits}:2" in report, report
    rc, report = run_check(ROOT / "tests" / "solutions.py", "--layer", "softmax", "--examples", "0")
    assert rc == 2


ENDINGS = {
    "os_exit": ("import os\n\n\ndef relu_forward(x):\n    os._exit(3)\n",
                r"relu_forward ended the process with exit status 3"),
    "segfault": ("import ctypes\n\n\ndef relu_forward(x):\n    ctypes.string_at(0)\n",
                 r"relu_forward crashed the interpreter \(SIGSEGV, segmentation fault\)(.|\n)*where:.*:5 in "
                 r"relu_forward: ctypes.string_at\(0\)"),
    "keyboard_interrupt": ("def relu_forward(x):\n    raise KeyboardInterrupt\n",
                           r"relu_forward raised KeyboardInterrupt"),
    "flood": ("def relu_forward(x):\n    while True:\n        print('debug', x)\n",
              r"relu_forward printed more than 200,000 bytes: output flooding(.|\n)*where:.*:3 in relu_forward"),
}


@pytest.mark.parametrize("kind", sorted(ENDINGS))
def test_a_call_that_ends_or_floods_the_process_fails_naming_the_function(run_check, tmp_path, kind):
    source, pattern = ENDINGS[kind]
    f = tmp_path / f"{kind}.py"
    f.write_text(source)
    rc, report = run_check(f, "--timeout", "60", "--examples", "3")
    assert rc == 1 and status_lines(report) == {"relu": "FAIL"}, report
    assert re.search(pattern, report), report
    assert re.search(r"blame:\s+fix relu_forward", report), report


def test_an_untouched_starter_with_dropout_deferred_passes_without_it(run_check, tmp_path):
    """The starters before lesson 12 leave dropout out of attention_forward's signature:
    the examples without dropout are graded, and the report says dropout was not."""
    f = tmp_path / "attention.py"
    f.write_text("import math\nfrom attn import layers as L\n\n\ndef attention_forward(q, k, v, mask=None):\n"
                 "    w, c = L.softmax_forward((q @ k.swapaxes(-1, -2)) / math.sqrt(q.shape[-1]), mask)\n"
                 "    return w @ v, None\n")
    rc, report = run_check(f, "--forward-only", "--examples", "10")
    assert rc == 0 and status_lines(report) == {"attention": "PASS"}, report
    assert "dropout not graded: attention_forward takes no dropout argument" in report


def test_teacher_reports(run_check, tmp_path):
    mutant = ROOT / "tests" / "mutants" / "layer_norm_eps_outside_sqrt.py"
    paths = {k: tmp_path / n for k, n in (("json", "r.json"), ("junit", "r.xml"), ("gradescope", "results.json"))}
    rc, report = run_check(mutant, "--json", paths["json"], "--junit", paths["junit"],
                           "--gradescope", paths["gradescope"], "--html", tmp_path / "html")
    assert rc == 1
    data = json.loads(paths["json"].read_text())
    (layer,) = data["layers"]
    assert layer["status"] == "fail" and layer["blame"] == "layer_norm_forward"
    assert layer["failure"]["example"]["eps"] and "agrees with central differences" in layer["backward"]
    xml = ElementTree.parse(paths["junit"]).getroot()
    case = xml.find("testsuite/testcase")
    assert case.get("name") == "layer_norm" and case.find("failure") is not None
    grades = json.loads(paths["gradescope"].read_text())
    assert grades["score"] == 0 and grades["max_score"] == 1
    assert grades["tests"][0]["status"] == "failed" and "fix layer_norm_forward" in grades["tests"][0]["output"]
    page = (tmp_path / "html" / "index.html").read_text()
    assert "layer_norm" in page and "fix layer_norm_forward" in page
    pngs = list((tmp_path / "html").glob("*.png"))
    assert len(pngs) == 1 and "<img src='./" + pngs[0].name in page


def test_all_prints_which_exercises_are_done(run_check, tmp_path):
    folder = tmp_path / "learner"
    folder.mkdir()
    (folder / "05_masks.py").write_text((ROOT / "lessons/exercises/05_masks.py").read_text())
    (folder / "07_feed_forward_layer_norm.py").write_text(
        _write_layer_norm((ROOT / "lessons/exercises/07_feed_forward_layer_norm.py").read_text()))
    (folder / "relu.py").write_text("def relu_forward(x):\n    return x * (x > 0), x > 0\n\n\n"
                                    "def relu_backward(dout, cache):\n    return dout * cache\n")
    rc, report = run_check("--all", folder, "--examples", "5")
    assert rc == 1, report
    rows = {line.split()[0]: line for line in report.splitlines()[2:-1]}
    assert re.search(r"\bnot started\b", rows["05_masks.py"]), report
    assert re.search(r"\bin progress\b\s+1/4", rows["07_feed_forward_layer_norm.py"]), report
    assert re.search(r"\bdone\b\s+1/1", rows["relu.py"]), report
    assert report.splitlines()[-1] == "1 of 3 exercises done"


def test_help_and_module_entry_point():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "attn.grader", "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0
    for words in ("attn-check", "--layer", "--examples", "--timeout", "--hint", "--forward-only", "--json",
                  "--junit", "--gradescope", "--html", "--all", "--backend", "Exit status", "NotImplementedError",
                  "--class", "--jobs", "--seed", "--sandbox", "--exercise", "--memory", "--similarity",
                  "layer_norm_forward, layer_norm_backward"):
        assert words in proc.stdout, words


def test_the_grader_gets_its_arrays_from_the_backend():
    """attn.testing and attn.grader import no NumPy (tests/test_backend.py checks every module of attn/;
    this names the two, so that moving them out of attn/ cannot drop them from that rule)."""
    from test_backend import _forbidden_imports
    for package, modules in (("testing", ("strategies", "gradients", "invariants", "layers", "probes", "exercises", "registry")),
                             ("grader", ("cli", "grading", "checks", "sandbox", "bubblewrap", "child", "wire", "library", "built", "reports", "results",
                                         "solutions"))):
        for module in ("__init__",) + modules:
            path = ROOT / "attn" / package / f"{module}.py"
            assert path.is_file() and not _forbidden_imports(path), path


def test_console_script_and_hypothesis_dependency_are_declared():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "attn-check = attn.grader.cli:console" in cfg["options.entry_points"]["console_scripts"]
    assert "hypothesis" in cfg["options"]["install_requires"]


def test_cupy_backend_without_a_gpu_is_a_clear_error(run_check):
    if B.cupy_available():
        pytest.skip("a GPU is usable here: the cupy backend works")
    rc, report = run_check("--allow-library", ROOT / "tests" / "solutions.py", "--backend", "cupy")
    assert rc == 2 and "ATTN_BACKEND=cupy was asked for" in report


def test_on_cupy_the_library_passes_and_a_mutant_fails(run_check):
    """--backend cupy: on a GPU where there is one, on the CuPy stand-in (tests/fakecupy)
    elsewhere. A few examples per layer: this proves the grader's own CuPy path."""
    from conftest import selected_backend
    with selected_backend("cupy"):
        rc, report = run_check("--allow-library", ROOT / "tests" / "solutions.py", "--backend", "cupy",
                               "--examples", "5")
        assert rc == 0 and set(status_lines(report).values()) == {"PASS"}, report
        assert "backend cupy" in report
        rc, report = run_check(ROOT / "tests" / "mutants" / "embedding_grad_drops_repeats.py", "--backend", "cupy")
        assert rc == 1 and status_lines(report) == {"embedding": "FAIL"}, report


ANSWERS = sorted((ROOT / "tests" / "answers").glob("*.py"))


@pytest.mark.parametrize("answer", ANSWERS, ids=[p.stem for p in ANSWERS])
def test_an_exercise_written_from_its_starter_passes(run_check, answer):
    """Every new exercise can be done from its starter: answers written from the docstrings
    (on the library's layers where the exercise allows it) pass every function."""
    rc, report = run_check(answer, "--examples", "4")
    text = answer.read_text()
    written = {name for name, layer in LAYERS.items() if f"def {layer.functions[0]}(" in text}
    lines = status_lines(report)
    assert written and all(lines[name] == "PASS" for name in written), report
    assert all(lines[name] == "FAIL" and "is not defined in the file" in report for name in set(lines) - written)


def test_answers_cover_every_new_exercise():
    graded = set()
    for answer in ANSWERS:
        text = answer.read_text()
        graded |= {name for name, layer in LAYERS.items() if f"def {layer.functions[0]}(" in text}
    assert {"luong_attention", "decoder_mask", "encoder_layer", "decoder_layer", "transformer", "noam_lr", "adam",
            "greedy_decode", "average_checkpoints", "bpe"} <= graded


def test_the_graders_examples_are_its_seeds_alone(tmp_path, monkeypatch):
    """Hypothesis now and then draws a constant found in the source of the local modules loaded
    so far; the grader draws without them, so a module loaded between two gradings (a layer
    added to the library) changes none of the examples."""
    import sys
    from attn.grader.grading import _run

    class Quiet:
        def reset(self):
            pass

    def examples():
        seen = []
        _run(LAYERS["layer_norm"], Quiet(), lambda ex: seen.append(repr(ex)), 40)
        return seen
    first = examples()
    (tmp_path / "many_constants.py").write_text(
        "FLOATS = (" + ", ".join(f"{0.25 + i / 7:.6f}" for i in range(400)) + ")\n"
        "INTS = (" + ", ".join(str(i * 37 + 5) for i in range(400)) + ")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import many_constants  # noqa: F401
    try:
        assert examples() == first
    finally:
        sys.modules.pop("many_constants", None)

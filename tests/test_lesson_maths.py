"""The lessons' formulas are typeset maths, not code: every lesson's prose holds maths
(``$...$`` inline or ``$$...$$`` displayed, which the book renders with MathJax and Jupyter
renders itself), and no inline code span in a markdown cell (`` `...` ``) holds a formula.

A code span is a formula, and must be written as maths, when it holds any of:

1. an exponent or a superscript: ``^`` (``W_i^O``, ``n^2``, ``d_model^-0.5``);
2. a braced subscript: ``_{`` (``sum_{i=1}``);
3. a LaTeX command: a backslash followed by letters (``\\frac``, ``\\sqrt``, ``\\cdot``);
4. a big operator with a subscript: ``sum_``, ``prod_``, ``max_``, ``min_``, ``argmax_``,
   followed by ``{`` or by a single letter or digit (``sum_j``; ``max_len`` is a name);
5. a maths function called bare, not a method or a module's function: ``sqrt(``, ``exp(``,
   ``log(``, ``sin(``, ``cos(``, ``softmax(`` (``np.exp(x)``, ``xp.log(p)`` and ``B.sqrt(``
   are code and allowed, as is any call written with a dotted name);
6. a Greek letter's name as a word or with a digit (``alpha``, ``beta2``, ``eps``,
   ``epsilon``, ``gamma``, ...), unless it is code: an attribute (``ln.gamma``), a keyword
   argument (``beta2=0.98``, no spaces around ``=``) or a name of the library
   (``label_smoothing_eps``, where the Greek name is part of a longer identifier);
7. a dot product or a product written as prose: `` . `` between spaces (``q . k``), or one of
   ``·``, ``×``, ``√``, ``∑``, ``≈``, ``≤``, ``≥``, ``∈``.

Everything else is code and stays code: identifiers (``d_model``, ``d_k``, ``h_t``),
expressions the library or NumPy would run (``x ** 2``, ``np.exp(x - x.max())``), paths,
commands, token strings. Fenced code blocks are code and are not read.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))

GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "eps", "zeta", "eta", "theta", "kappa", "lambda",
         "mu", "nu", "xi", "pi", "rho", "sigma", "tau", "phi", "chi", "psi", "omega")
_RULES = [
    ("an exponent", re.compile(r"\^")),
    ("a braced subscript", re.compile(r"_\{")),
    ("a LaTeX command", re.compile(r"\\[A-Za-z]+")),
    ("a big operator with a subscript", re.compile(r"\b(?:sum|prod|max|min|argmax|argmin)_(?:\{|[A-Za-z0-9](?![A-Za-z0-9_]))")),
    ("a bare maths function", re.compile(r"(?<![\w.])(?:sqrt|exp|log|sin|cos|softmax)\(")),
    ("a Greek letter's name", re.compile(r"(?<![\w.])(?:" + "|".join(GREEK) + r")\d*(?![\w=(])")),
    ("a product written as prose", re.compile(r" \. |[·×√∑≈≤≥∈]")),
]
_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")


def markdown_cells(path: Path):
    """(first line number, text) of each markdown cell, the ``# `` taken off each line, with
    fenced code blocks blanked (their lines kept, so that numbers stay right)."""
    cells, current, start, fenced = [], None, 0, False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("# %%"):
            if current is not None:
                cells.append((start, "\n".join(current)))
            current = [] if "[markdown]" in line else None
            start, fenced = number + 1, False
            continue
        if current is None:
            continue
        text = line[2:] if line.startswith("# ") else line.lstrip("#")
        if text.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            text = ""
        current.append("" if fenced else text)
    if current is not None:
        cells.append((start, "\n".join(current)))
    return cells


def formula_spans(text: str) -> list[tuple[str, str]]:
    """(span, the rule it breaks) for each code span of ``text`` that holds a formula."""
    found = []
    for m in _SPAN.finditer(text):
        span = m.group(1).replace("\n", " ")
        for name, rule in _RULES:
            if rule.search(span):
                found.append((span, name))
                break
    return found


def offenders(path: Path) -> list[str]:
    out = []
    for start, text in markdown_cells(path):
        for m in _SPAN.finditer(text):
            for span, why in formula_spans(m.group(0)):
                line = start + text[:m.start()].count("\n")
                out.append(f"{path.name}:{line}: `{span}` ({why})")
    return out


_INLINE = re.compile(r"(?<![\\$])\$(?!\$)[^$\n]+?(?<![\\\s])\$(?!\$)")
_DISPLAY = re.compile(r"\$\$.+?\$\$", re.S)


def count_maths(text: str) -> tuple[int, int]:
    """(display blocks, inline spans) of ``$$...$$`` and ``$...$`` in a lesson's markdown."""
    display = len(_DISPLAY.findall(text))
    inline = len(_INLINE.findall(_DISPLAY.sub("", text)))
    return display, inline


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_formula_in_a_code_span(lesson):
    found = offenders(lesson)
    assert not found, (f"{len(found)} formulas written as code in {lesson.name} (write them as "
                       "$...$ maths; see tests/test_lesson_maths.py for the rules):\n" + "\n".join(found))


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_lesson_typesets_maths(lesson):
    text = "\n".join(t for _, t in markdown_cells(lesson))
    assert sum(count_maths(text)) > 0, f"{lesson.name} has no $...$ or $$...$$ maths in its prose"


@pytest.mark.parametrize("span, rule", [
    ("q . k = sum_{i=1}^{d_k} q_i k_i", "an exponent"), ("sqrt(d_k)", "a bare maths function"),
    ("\\frac{1}{2}", "a LaTeX command"), ("sum_j exp(x_j)", "a big operator with a subscript"),
    ("beta2 = 0.98", "a Greek letter's name"), ("eps", "a Greek letter's name"),
    ("s_t . h_t", "a product written as prose"), ("d_model · d_ff", "a product written as prose"),
    ("W_i^O", "an exponent"), ("x_{t-1}", "a braced subscript"),
    ("sum_j w_ij V_j", "a big operator with a subscript"),
])
def test_the_rules_catch_formulas(span, rule):
    assert formula_spans(f"`{span}`") == [(span, rule)]


@pytest.mark.parametrize("span", ["d_model", "d_k", "x ** 2", "np.exp(x - x.max())", "xp.log(p)", "ln.gamma",
                                  "adam(beta2=0.98)", "label_smoothing_eps", "lessons/04_x.py", "h_t",
                                  "attn-check lessons/exercises/04_attention.py", "B.sqrt(v)", "<unk>",
                                  "sinusoidal_table(max_len, d_model)", "max_len"])
def test_the_rules_leave_code_alone(span):
    assert formula_spans(f"`{span}`") == []


def test_count_maths():
    assert count_maths("a $x$ and $y_i$, $$z$$ and\n$$\na = b\n$$\ncosts $5 or $6") == (2, 2)


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_question_has_an_answer(lesson):
    """Each numbered question under ``## Questions`` is followed by its answer, folded in a
    ``<details><summary>Answer</summary>`` block (a toggle in the book and in Jupyter, plain
    text in the script)."""
    text = lesson.read_text(encoding="utf-8")
    section = text.split("# ## Questions", 1)[1].split("# %%", 1)[0].split("\n# ## ", 1)[0]
    questions = re.findall(r"^# \d+\. ", section, re.M)
    answers = re.findall(r"^#\s+<details><summary>Answer</summary>$", section, re.M)
    closed = re.findall(r"^#\s+</details>$", section, re.M)
    assert questions and len(answers) == len(questions) == len(closed), (
        f"{lesson.name}: {len(questions)} questions, {len(answers)} answers")


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_a_tagged_equation_has_no_double_backslash(lesson):
    """Sphinx wraps a displayed equation that holds ``\\\\`` in ``\\begin{split}``, where MathJax
    refuses ``\\tag``: a numbered equation of several rows ends its rows with ``\\cr``."""
    text = "\n".join(t for _, t in markdown_cells(lesson))
    bad = [b[:60] for b in _DISPLAY.findall(text) if "\\tag" in b and "\\\\" in b]
    assert not bad, f"{lesson.name}: tagged equations with \\\\ rows: {bad}"

"""No number typed into a lesson's prose: lessons/README.md promises that every number in a
lesson's prose is printed or formatted by the code that produced it. This test reads every
markdown cell of every lesson (``# %% [markdown]`` up to the next ``# %%``), prose, inline
code, code blocks and maths alike, and reports each number that is not allowed, as
``file:line``.

A number is a run of digits, with thousands separated by commas or spaces, a decimal part and
an exponent (``3``, ``4,000``, ``100 000``, ``0.1958``, ``1e-9``, ``6.99e-4``), optionally followed by ``%`` or a
multiplier ``k``/``K``/``M`` (``100K``, ``4.5M``) or ``x``/``×`` (``4x``); a percentage or a
factor is never allowed. Digits that are part
of a word or a name are not numbers: ``W1``, ``d_k``, ``float64``, ``P100``, ``06_masks.py``.

Allowed, and only these:

1. the paper's own constants, :data:`PAPER`, by value, a whole number only when written
   without a decimal point (``4,000``, ``4000`` and ``4K`` are one; ``1`` is allowed,
   ``1.0000`` is not);
2. whole numbers from 0 to 10 written without a decimal point (counts, indices, exponents,
   the 2 of ``n^2``);
3. section, table, figure, equation and lesson numbers: the numbers that follow the words
   section(s), §, table(s), figure(s), fig., equation(s), eq., lesson(s), chapter(s), with the
   lists and ranges that continue them (``sections 3.1, 3.2.3``, ``figures 3-5``,
   ``lessons 17 and 18``, ``Table 3``), an equation's tag in maths (``\\tag{8.1}``), and any
   number with two or more dots (``3.2.1``);
4. years, 1900 to 2099 written without a comma (``Ba et al., 2016``);
5. anything inside a glue role or directive (``{glue:text}`name:.3f` ``) and link targets
   (``[paper](https://arxiv.org/abs/1706.03762)``, bare URLs);
6. a quotation: anything between double quotation marks on one line (``"2.8, 3.7, 6.0 and
   9.5 TFLOPS"``, the slides' ``"-0.756"``), the words of the paper or of a source the lesson
   cites or corrects;
7. an identity the reader can redo, which the test redoes: a left side of literals only, with an
   operator or one of sin, cos, tan, exp, sqrt, log (LaTeX's ``\\frac{}{}`` and ``\\cdot`` read
   and ``\\sqrt{}`` read as ``/``, ``·`` and ``sqrt()``), ``=``, and a right side with a decimal point that its value rounds to
   (``cos(0.03) = 0.99955``, ``sin(4) = -0.757``, ``\\frac{2 \\cdot 64 \\cdot 256}{320^2} =
   0.32``); a wrong identity leaves all its numbers flagged;
8. :data:`CITED`, the constants of another paper that a lesson cites (Adam's ``beta2 = 0.999,
   eps = 1e-8``); float64's and float32's machine epsilon to an order of magnitude, :data:`ROUNDING`
   (``1e-16``, ``1e-7``); and ``N million``/``N billion`` is read as ``NM`` (``4.5 million``
   pairs is the paper's ``4.5e6``);
9. a number that the lesson's own code writes as a literal (:func:`code_literals`: Python's
   NUMBER tokens in its code cells, not its comments or strings), matched by value: a
   tolerance the code asserts (``1e-6``), a setting it uses (``range(100)``, step ``51``), data
   it types in. A percentage or a factor is still never allowed.

Every other number is a result or a setting typed by hand: print it from the code, or
quote it with myst-nb's glue (``glue("name", value)`` in a code cell,
``{glue:text}`name:.2f` `` in the prose).
"""
from __future__ import annotations

import io
import math
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))

# The paper's constants (Vaswani et al., 2017), by where they appear.
PAPER = (                                        # a tuple: a set would merge 6 (N) with 6.0 (TFLOPS)
    512, 2048, 8, 6, 64, 0.1,                    # base model: d_model, d_ff, h, N, d_k = d_v, P_drop and eps_ls
    1024, 4096, 16, 0.3,                         # big model (Table 3), and h = 16
    1, 4, 32, 128, 256, 0.2,                     # Table 3's variations (A)-(D)
    100_000, 300_000, 65e6, 213e6, 4.92, 4.33, 25.8, 26.4,   # Table 3: steps, parameters (millions), PPL, BLEU
    27.3, 28.4, 38.1, 41.8, 3.3e18, 2.3e19,      # Table 2: BLEU EN-DE / EN-FR, training cost in FLOPs
    3.3, 2.3,                                    # the same, written 3.3·10¹⁸ and 2.3·10¹⁹
    2.8, 3.7, 6.0, 9.5,                          # footnote 5: TFLOPS of K80, K40, M40, P100
    5.29, 24.9, 5.00, 25.5, 4.91, 5.01, 25.4, 5.16, 25.1, 6.11, 23.7, 5.19, 25.3, 4.88,   # Table 3's
    5.75, 24.5, 4.66, 26.0, 5.12, 4.75, 26.2, 5.77, 24.6, 4.95, 4.67, 5.47, 25.7,         # rows (A)-(E)
    4000, 0.9, 0.98, 1e-9, 0.5, 1.5,             # section 5.3: warmup_steps, beta1, beta2, epsilon, the powers
    10000,                                       # section 3.5: the sinusoids' base
    3.5, 12, 0.4,                                # section 5.2: 3.5 days, 12 hours, 0.4 s per step
    4.5e6, 36e6, 37000, 32000, 25000,            # section 5.1: sentence pairs, shared vocabularies, batch tokens
    20, 0.6, 50,                                 # section 6.1: checkpoints averaged (big), beam length penalty, +50
    40000, 17e6, 16000, 300, 21, 91.3, 92.7,     # section 6.3 (Table 4): parsing
    88.3, 90.4, 91.7, 92.1, 93.0, 93.3,          # Table 4: the other parsers' F1 (Vinyals, Petrov, Dyer, ...)
)

_NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:[,\u2009\u202f ]\d{3})+(?!\d)|\d+)(\.\d+)?([eE][-+]?\d+)?"
                     r"(%|[kKM](?![\w])|[x×](?![\w.])| million\b| billion\b)?(?![\w])")
_DOTTED = re.compile(r"(?<![\w.])\d+(?:\.\d+){2,}(?![\w.])")
_REFERENCE = re.compile(
    r"(?:\b(?:sections?|tables?|figures?|figs?\.|equations?|eqs?\.|lessons?|chapters?)|§|\\tag\{)\s*\(?"
    r"\d+(?:\.\d+)*[a-z]?\)?(?:\s*(?:,|and|or|to|-|–|&)\s*\(?\d+(?:\.\d+)*[a-z]?\)?)*", re.I)
_EXEMPT = [re.compile(r"\{glue[:\w-]*\}`[^`]*`"),           # glue roles
           re.compile(r"\]\([^)]*\)"),                      # link targets
           re.compile(r"https?://\S+")]                     # bare URLs
# Adam's defaults in its own paper (Kingma and Ba, 2015), which the lessons contrast with section 5.3's.
CITED = {0.999, 1e-8}
# Float64's and float32's machine epsilon, to an order of magnitude (2.2e-16, 1.2e-7): the size of rounding.
ROUNDING = {1e-16, 1e-7}
_QUOTED = re.compile(r'"[^"]*"|\u201c[^\u201d]*\u201d')  # "a quotation" on one line
_FRAC = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_SQRT = re.compile(r"\\sqrt\{([^{}]*)\}")
_IDENTITY = re.compile(r"(?<![\w.])((?:(?:sin|cos|tan|exp|sqrt|log)\s*)?[-\d.\s/*·^+()]*\d[-\d.\s/*·^+()]*?)"
                       r"\s*=\s*(-?\d+\.\d+)(?![\w]|\.\d)")
_MATH = {f: getattr(math, f) for f in ("sin", "cos", "tan", "exp", "sqrt", "log")}


def _true_identity(m: re.Match) -> bool:
    """``cos(0.03) = 0.99955``, ``(2 · 64 · 256)/(320^2) = 0.32``: a left side of literals only,
    with an operator or a function, whose value rounds to the right side's digits."""
    lhs, rhs = m.group(1).strip(), m.group(2)
    if not re.search(r"[a-z/*·^+]|\d\s*-", lhs) or lhs.count("(") != lhs.count(")"):
        return False
    try:
        value = eval(lhs.replace("^", "**").replace("·", "*"), {"__builtins__": {}}, _MATH)
    except Exception:
        return False
    decimals = len(rhs.split(".")[1])
    return abs(value - float(rhs)) <= 0.5 * 10.0 ** -decimals * (1 + 1e-9)


_MULTIPLIER = {"k": 1e3, "K": 1e3, "M": 1e6, " million": 1e6, " billion": 1e9}


def code_literals(path: Path) -> set[float]:
    """The values of the number literals in the lesson's own code cells (Python's tokenizer's
    NUMBER tokens): the settings, tolerances and data the code shows. Comments and strings are
    left out: a comment, a label or a title can hold a result typed by hand."""
    source, in_code = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            in_code = "[markdown]" not in line
            source.append("")
        else:
            source.append(line if in_code else "")
    values = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO("\n".join(source) + "\n").readline):
            if tok.type == tokenize.NUMBER and (m := _NUMBER.fullmatch(tok.string.replace("_", ""))):
                values.add(_value(*m.groups()[:3], None))
    except (tokenize.TokenError, SyntaxError):
        pass
    return values


def markdown_lines(path: Path):
    """(line number, text) of every line of the lesson's markdown cells, the ``# `` taken off;
    a glue directive's block (``` ```{glue...}``` ... ``` ``` ```) is left out."""
    in_markdown = in_glue = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("# %%"):
            in_markdown, in_glue = "[markdown]" in line, False
            continue
        if not in_markdown:
            continue
        text = line[2:] if line.startswith("# ") else line.lstrip("#")
        if re.match(r"\s*(```|:::)\{glue", text):
            in_glue = True
        elif in_glue and re.match(r"\s*(```|:::)\s*$", text):
            in_glue = False
            continue
        if not in_glue:
            yield number, text


def _value(whole: str, decimals: str | None, exponent: str | None, suffix: str | None) -> float:
    v = float(re.sub(r"[,\u2009\u202f ]", "", whole) + (decimals or "") + (exponent or ""))
    return v * _MULTIPLIER.get(suffix or "", 1.0)


def typed_numbers(text: str, shown: frozenset[float] | set[float] = frozenset()) -> list[str]:
    """The numbers in one line of prose that the rules above do not allow; ``shown`` are the
    values written in the lesson's own code (:func:`code_literals`)."""
    text = _SQRT.sub(r"sqrt(\1)", _FRAC.sub(r"(\1)/(\2)", text.replace("\\cdot", "·")))
    text = _IDENTITY.sub(lambda m: " " * len(m.group(0)) if _true_identity(m) else m.group(0), text)
    for pattern in (*_EXEMPT, _QUOTED, _REFERENCE, _DOTTED):
        text = pattern.sub(lambda m: " " * len(m.group(0)), text)
    found = []
    for m in _NUMBER.finditer(text):
        whole, decimals, exponent, suffix = m.groups()
        value = _value(whole, decimals, exponent, suffix)
        if suffix in ("%", "x", "×"):           # a percentage or a factor is a result, never a constant
            found.append(m.group(0))
            continue
        if any(abs(value - c) <= 1e-12 * max(1.0, abs(c)) and (exponent or suffix or bool(decimals) == isinstance(c, float))
               for c in PAPER):
            continue
        if any(abs(value - c) <= 1e-12 * abs(c) for c in (*shown, *ROUNDING, *CITED)):
            continue
        if decimals is None and exponent is None and suffix is None and whole.isdigit():
            if value <= 10 or 1900 <= value <= 2099:
                continue
        found.append(m.group(0))
    return found


def offenders(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    shown = code_literals(path)
    return [f"{rel}:{n}: {', '.join(nums)}   | {text.strip()[:100]}"
            for n, text in markdown_lines(path) if (nums := typed_numbers(text, shown))]


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_number_typed_into_a_lessons_prose(lesson):
    found = offenders(lesson)
    assert not found, (f"{len(found)} lines of {lesson.name}'s prose type numbers (see "
                       "tests/test_lesson_numbers.py for the rules; print or glue them):\n" + "\n".join(found))


@pytest.mark.parametrize("line, expected", [
    ("across 16 positions its cosine stays at 1.0000 to four decimals", ["1.0000"]),
    ("The weights are nearly uniform (0.18 to 0.23), and `e^0.3 = 1.35`", ["0.18", "0.23", "1.35"]),
    ("    lrate_max = d_model^-0.5 * w^-0.5   (512^-0.5 * 4000^-0.5 = 6.99e-4)", ["6.99e-4"]),
    ("Our count is 63.1M, the paper says 65M; 30% of the base model", ["63.1M", "30%"]),
    ("beam search differs from greedy on 0 of 100 sentences, a 4x gap", ["100", "4x"]),
    ("a vocabulary of 1,234 words, 40-42 thousand rows, 1 500 pairs", ["1,234", "40", "42", "1 500"]),
    ("for 100 000 steps, the `<0x..>` tokens; 3.3·10¹⁸ FLOPs", []),
    ("with d_model = 512, d_ff = 2048, h = 8, P_drop = 0.1, warmup 4,000 and 100K steps", []),
    ("Table 2's 27.3 and 28.4 BLEU; beta2 = 0.98, eps = 1e-9; 4.5M sentence pairs", []),
    ("sections 3.1, 3.2.3 and 5.4; figures 3-5; lessons 17 and 18; Table 3 row E; § 6.2", []),
    ("Lesson 14 trains W1 and W2 in float64 on 8 P100 GPUs (Ba et al., 2016)", []),
    ("see `lessons/exercises/06_multi_head_attention.py` and [the paper](https://arxiv.org/abs/1706.03762)", []),
    ("the loss fell to {glue:text}`final_loss:.3f` after {glue}`steps` steps", []),
    ("two heads, columns 0, 1 and 6, 7; slope 2 and -1; n^2 d", []),
])
def test_the_rules(line, expected):
    assert typed_numbers(line) == expected


@pytest.mark.parametrize("line, expected", [
    ("so `0.9996` for `cos(0.03) = 0.99955` is right", ["0.9996"]),
    ("`sin(4) = -0.75680`, `sin(1/100) = 0.0100`, `sin(4) = -0.757`", []),
    ("`sin(4) = -0.7569`, `cos(0.03) = 0.9995`", ["0.7569", "0.03", "0.9995"]),   # a wrong identity
    (r"$$\frac{2 \cdot 64 \cdot 256}{320^2} = 0.32 .$$", []),
    (r"$$\frac{2 \cdot 64 \cdot 256}{320^2} = 0.33 .$$", ["320", "0.33"]),
    (r"$\sqrt{a} = \sqrt{0.32} = 0.57$ and $x = y \tag{7.2}$", []),
    ("a factor `1 + a = 1.32`, loss = 2.31, step 51 = 0.25", ["1.32", "2.31", "51", "0.25"]),   # not literals only
    ("Footnote 5: \"We used values of 2.8, 3.7, 6.0 and 14.1 TFLOPS\"", []),
    ("the slides print \u201c-0.756\u201d where 0.7568 is right", ["0.7568"]),
    ("about 4.5 million sentence pairs, 36 million sentences; 5.1 million apart", ["5.1 million"]),
    ("Dyer et al. (91.7, 93.3 generative), Vinyals et al. (88.3)", []),
    ("the M40's 6.0 TFLOPS on 6 layers; 6.5 is not the paper's", ["6.5"]),
    ("Adam's own `beta2 = 0.999, eps = 1e-8`, not 0.99 or 1e-5", ["0.99", "1e-5"]),
    ("machine epsilon: 1e-16 in float64, 1e-7 in float32; noise of 1e-10, 1e-14", ["1e-10", "1e-14"]),
])
def test_quotations_identities_and_rounding(line, expected):
    assert typed_numbers(line) == expected


@pytest.mark.parametrize("line, shown, expected", [
    ("raises if any relative error exceeds `1e-6`", set(), ["1e-6"]),
    ("raises if any relative error exceeds `1e-6`", {1e-6}, []),
    ("the first 100 pairs; step 51", {100.0, 51.0}, []),
    ("differences of order 1e-15", {0.0, 1e-12}, ["1e-15"]),       # no absolute tolerance near 0
    ("30% of the mass, a 4x gap", {30.0, 4.0}, ["30%", "4x"]),      # a percentage or factor never
])
def test_a_number_written_in_the_code_is_shown(line, shown, expected):
    assert typed_numbers(line, shown) == expected


def test_code_literals_are_the_code_cells_number_tokens(tmp_path):
    lesson = tmp_path / "99_example.py"
    lesson.write_text("# %% [markdown]\n# tolerance 1e-6, 0.25 and 51\n\n# %%\nassert err < 1e-6  # took 12.5 s\n"
                      "print('loss 2.31', f'{x:.3f} 0.75')\nfor step in range(1_000):\n    pass\n", encoding="utf-8")
    assert code_literals(lesson) == {1e-6, 1000.0}
    assert [f.split(": ")[1].split("   |")[0] for f in offenders(lesson)] == ["0.25, 51"]


def test_line_numbers_point_at_the_markdown(tmp_path):
    lesson = tmp_path / "99_example.py"
    lesson.write_text("# %% [markdown]\n# # Lesson 99: an example (section 3.2)\n#\n# It took 12.5 s.\n"
                      "\n# %%\nx = 25 / 2\nprint(f'took {x} s')\n\n# %% [markdown]\n# and 0.123 more\n",
                      encoding="utf-8")
    found = offenders(lesson)
    assert [f.split(": ")[0].rsplit(":", 1)[1] for f in found] == ["4", "11"], found

"""``attn-check``: grade your own layers with the checks that prove the library's.

    attn-check PATH.py [--layer NAME ...] [--examples N] [--timeout S] [--hint 1|2|3]
    attn-check --all DIR
    attn-check PATH.py --json FILE --junit FILE --gradescope FILE --html DIR

The learner's file is never imported here: a child process (:mod:`attn.grader.child`)
imports it and runs its functions one call at a time, each under a time limit
(``--timeout``), its output to a file whose size is watched. A call that hangs, exits
(``sys.exit``, ``os._exit``), raises ``KeyboardInterrupt``, crashes the interpreter or
floods its output is a failure that names the function and what it did. Everything
that decides a grade (hypothesis' examples, the library's results, every comparison)
stays in this process.

The child runs under bubblewrap (:mod:`attn.grader.bubblewrap`: only Python, NumPy, the
modules the exercise gives and the file's copy to read, the nobody user, its own /tmp and
/dev/shm) and seals itself before the file is imported (:mod:`attn.grader.child`); only
plain data comes back
(:mod:`attn.grader.wire`). Each starter's manifest (:mod:`attn.grader.library`) says what
the exercise asks for and gives: the asked-for names are withheld from the library
modules the child loads, and every other module of the library is refused, so a file
cannot re-export, wrap or copy the library's answer. A forward the exercise gives
(exercise 8 gives the forwards and asks for the backwards) is used, not graded.

For every layer the file defines, on examples hypothesis draws
(:data:`attn.testing.LAYERS`; hard inputs included):

1. **the forward**, on every example first: an exception, a result that is not
   ``(out, cache)``, an input modified in place, a wrong shape or dtype, NaN, the
   layer's invariants, the output against the library's, float32 in and out;
2. **the backward**, only once the forward passed: the same structural checks, each
   gradient against the library's, then against float64 central differences of the
   learner's own forward, and the backward invariants. When the forward is wrong, its
   backward is graded only against central differences of the learner's own forward,
   and the report says that the forward is the thing to fix;
3. **dropout**, for a layer that takes it: ``p = 0`` and inference (``rng=None``) are the
   identity; over many draws of one seeded generator the kept fraction is ``1 - p`` and
   kept units are scaled by ``1/(1-p)``; the backward uses the forward's mask.

Hypothesis shrinks a failure to the smallest example it can find; the report shows it,
which check and which gradient failed, the relative error, the first entries that
differ, what the difference looks like, and a hint at the level asked for
(``--hint 1`` the symptom, ``2`` where to look, ``3`` the formula). The exit status is 0
only when every graded function passed.

The modules: :mod:`~attn.grader.cli` (the command), :mod:`~attn.grader.grading` (a
layer, a file), :mod:`~attn.grader.checks` (one example of each kind, and dropout),
:mod:`~attn.grader.sandbox` and :mod:`~attn.grader.child` (the two sides of the child
process), :mod:`~attn.grader.reports` (the text report and the teachers' reports),
:mod:`~attn.grader.results` (settings, failures, results) and
:mod:`~attn.grader.solutions` (the library's answer to every exercise).
"""

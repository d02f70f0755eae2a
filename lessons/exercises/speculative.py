"""Exercise for lesson 31: the acceptance rule of speculative decoding (Leviathan et al., 2023).

Write the body below (replace the ``raise NotImplementedError``), then grade it:

    attn-check lessons/exercises/speculative.py

When a check fails, the report shows the symptom; ``attn-check --hint 2 ...`` adds where
to look, ``--hint 3`` the formula.

``xp = B.get_array_module(p)`` is NumPy (or CuPy on a GPU). The grader does not compare your
tokens with the library's draws: it holds them to what the rule guarantees. Some facts are exact
(a draft with p(d) >= q(d) is always kept; a rejected trial never draws a token where p <= q; the
same inputs give the same tokens, so draw only from u and v), and three are statistical, over
20,000 trials an example: how many drafts are kept, how the rejected trials' tokens are
distributed, and that all the tokens are distributed as p. Each statistical check fails a right
rule with probability under 1e-6 (a bound, Bernstein's inequality), and the grader's seeds are
fixed: your grade is a function of your file.
"""
from __future__ import annotations

from attn import backend as B  # noqa: F401


def speculative_accept(p, q, drafts, u, v):
    """One position of speculative decoding, for N independent trials at once.

    The draft model proposed ``drafts[i]``, a token it drew from its distribution q; the target
    model's distribution at the same position is p. Trial i keeps the draft with probability
    ``min(1, p(d) / q(d))``, decided by the uniform ``u[i]``: keep it where ``u[i] * q(d) < p(d)``.
    A trial that rejects the draft draws a token from the residual ``max(0, p - q)`` normalised
    to sum to one, by inverse CDF with the second uniform ``v[i]``: the first token whose
    cumulative residual exceeds ``v[i]``.

    Inputs: p (V,), q (V,) probabilities; drafts (N,) int token ids (q(d) > 0 for each);
    u (N,), v (N,) uniform in [0, 1).
    Returns: tokens (N,), of drafts' dtype: the token each trial keeps.
    """
    raise NotImplementedError

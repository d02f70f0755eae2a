"""The registration of speculative decoding's acceptance rule (:mod:`attn.speculative`):
``speculative_accept(p, q, drafts, u, v)``, one position for N trials at once, graded by what the
rule is for rather than by the library's draws. A right rule may spend its uniforms differently
(``u < p/q`` or ``u * q < p``, either uniform for the test, any inverse CDF), so the tokens are not
compared with the library's: they are held to the rule's facts, some exact (a draft with
``p(d) >= q(d)`` is always kept; a rejected trial draws only where ``p > q``; the same inputs give
the same tokens) and three statistical, each a bound that a right rule breaks with probability at
most :data:`LEVEL`:

* among the trials whose draft has ``p(d) < q(d)``, the number kept is ``sum p(d)/q(d)`` give or
  take the bound;
* the tokens of the rejected trials are distributed as ``normalise(max(0, p - q))``;
* all the tokens are distributed as ``p``: the theorem itself.

Each count is a sum of independent indicators, and Bernstein's inequality bounds its deviation
for any number of trials (no normal approximation): ``P(|S - E S| >= t) <= 2 exp(-t^2 / (2 (var +
t/3)))``. A distribution is checked a token at a time, its level shared among the V tokens
(Bonferroni). So a right rule whose draws differ from the library's fails one example with
probability under ``3 * LEVEL`` and a grade of 25 examples under 1e-4; with the grader's fixed
seeds the library's own rule and ``tests/answers/speculative.py`` pass every time, and the
grade is a function of the file alone. The examples, the typical mistakes and the hints are read
from :data:`attn.testing.registry.LAYERS` like every other layer's."""
from __future__ import annotations

import math

from hypothesis import strategies as st

from .. import backend as B
from .invariants import InvariantError, _dev, _host
from .layers import Example, Layer, Mistake, seeds

np = B.host

#: The chance that one statistical check fails a right rule on one example (an upper bound).
LEVEL = 1e-6
#: Trials per example: enough that each typical mistake is many bounds away on the explicit examples.
TRIALS = 20_000


def bernstein(variance: float, level: float = LEVEL) -> float:
    """The t with ``2 exp(-t^2 / (2 (variance + t/3))) = level``: a sum of independent
    indicators of that variance strays from its mean by t or more with probability at most
    ``level`` (Bernstein's inequality, each term within 1 of its mean)."""
    L = math.log(2 / level)
    return L / 3 + math.sqrt(L * L / 9 + 2 * L * variance)


def chi_square_sf(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with ``dof`` degrees of freedom: 1 - P(dof/2, x/2), the
    regularised lower incomplete gamma function by its series
    ``P(a, z) = z^a e^-z / Gamma(a + 1) * sum_n z^n / ((a + 1) ... (a + n))``."""
    if x <= 0:
        return 1.0
    a, z = dof / 2, x / 2
    term = total = 1.0
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= z / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a + 1)) * total)


def chi_square_critical(dof: int, level: float) -> float:
    """The x with P(X >= x) = ``level``, by bisection."""
    lo, hi = 0.0, dof + 40 * math.sqrt(2 * dof) + 50
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi_square_sf(mid, dof) > level else (lo, mid)
    return hi


def worst_token(counts, probs, level: float = LEVEL):
    """The token whose count strays most beyond its bound (each token's at ``level / V``), as
    ``(token, count, expected, bound)``, or None if every count is within its bound. ``counts``
    (V,) from n draws of ``probs`` (V,)."""
    n, V = counts.sum(), len(probs)
    expected = n * probs
    bounds = np.array([bernstein(n * pi * (1 - pi), level / V) for pi in probs])
    excess = (np.abs(counts - expected) - bounds) / bounds
    x = int(np.argmax(excess))
    return (x, int(counts[x]), float(expected[x]), float(bounds[x])) if excess[x] > 0 else None


def _example(p, q, seed: int, n: int = TRIALS) -> Example:
    rng = np.random.default_rng(seed)
    drafts = rng.choice(len(q), size=n, p=q).astype(np.int64)
    return Example((("p", p), ("q", q), ("drafts", drafts), ("u", rng.random(n)), ("v", rng.random(n))), seed=seed)


def _distribution(draw, V: int):
    w = np.array(draw(st.lists(st.integers(0, 6), min_size=V, max_size=V)), float)
    if not w.any():
        w[draw(st.integers(0, V - 1))] = 1.0
    return w / w.sum()


@st.composite
def speculative_examples(draw):
    V = draw(st.integers(2, 6))
    p = _distribution(draw, V)
    q = p.copy() if draw(st.integers(0, 5)) == 0 else _distribution(draw, V)    # now and then a perfect draft
    return _example(p, q, draw(seeds))


def explicit():
    """Two examples each typical mistake fails by many bounds: a draft that puts most of its
    mass where the target puts little (most drafts rejected, the residual spread over three
    tokens), and one that misses a token the target likes and proposes one it never would."""
    return (_example(np.array([0.1, 0.3, 0.3, 0.3]), np.array([0.7, 0.1, 0.1, 0.1]), 11),
            _example(np.array([0.5, 0.3, 0.2, 0.0, 0.0]), np.array([0.2, 0.2, 0.0, 0.3, 0.3]), 12))


def _args(ex):
    return tuple(ex.get(n) for n in ("p", "q", "drafts", "u", "v"))


def _exact_facts(tokens, p, q, drafts) -> None:
    V, N = len(p), len(drafts)
    if tokens.shape != (N,) or tokens.dtype.kind not in "iu":
        raise InvariantError(f"the result has shape {tokens.shape} and dtype {tokens.dtype}, expected integer "
                             f"tokens of shape ({N},), one a trial", "return one token id a trial, drafts' dtype")
    out = (tokens < 0) | (tokens >= V)
    if out.any():
        i = int(np.argmax(out))
        raise InvariantError(f"trial {i} gave token {int(tokens[i])}, outside the vocabulary 0..{V - 1}: the "
                             "residual's cumulative sum ends at its total, not at 1",
                             "normalise max(0, p - q) by its sum before the inverse CDF (or compare with v times "
                             "the sum)")
    kept = tokens == drafts
    sure = ~kept & (p[drafts] >= q[drafts])
    if sure.any():
        i = int(np.argmax(sure))
        d = int(drafts[i])
        raise InvariantError(f"trial {i}: the draft's token {d} has p = {p[d]:.4g} >= q = {q[d]:.4g}, so "
                             f"min(1, p/q) = 1, and yet it was not kept",
                             "keep d with probability min(1, p(d)/q(d)): where p(d) >= q(d) always (u * q(d) < "
                             "p(d) for every u in [0, 1)), not min(1, q/p)")
    where = ~kept & (p[tokens] <= q[tokens])
    if where.any():
        i = int(np.argmax(where))
        x = int(tokens[i])
        raise InvariantError(f"trial {i} rejected the draft and drew token {x}, where p = {p[x]:.4g} <= q = "
                             f"{q[x]:.4g}: max(0, p - q) is zero there, so the rule never draws it",
                             "a rejected trial draws from the residual max(0, p - q), normalised: not from p "
                             "(the draft's share of p is already given out by the acceptances)")


def _statistics(tokens, p, q, drafts) -> None:
    kept, ratio = tokens == drafts, p[drafts] / q[drafts]
    doubt = ratio < 1
    pi = ratio[doubt]
    k, mean, t = int(kept[doubt].sum()), float(pi.sum()), bernstein(float((pi * (1 - pi)).sum()))
    if abs(k - mean) > t:
        raise InvariantError(f"of the {int(doubt.sum())} trials whose draft has p(d) < q(d), {k} kept it (a "
                             f"rejection never draws d again: max(0, p(d) - q(d)) = 0); the rule keeps each with "
                             f"probability p(d)/q(d): {mean:.1f} expected, give or take {t:.1f} (a right rule "
                             f"strays further with probability under {LEVEL:g})",
                             "accept with probability min(1, p(d)/q(d)): keep d where u < p(d) / q(d), with u "
                             "uniform in [0, 1)")
    V = len(p)
    r = np.maximum(p - q, 0.0)
    rejected = tokens[~kept]
    if rejected.size and r.sum() > 0:
        bad = worst_token(np.bincount(rejected, minlength=V).astype(float), r / r.sum())
        if bad is not None:
            x, c, e, b = bad
            raise InvariantError(f"the {rejected.size} rejected trials drew token {x} {c} times; from "
                                 f"normalise(max(0, p - q)) {e:.1f} are expected, give or take {b:.1f} (a right "
                                 f"rule strays further with probability under {LEVEL:g})",
                                 "a rejection draws afresh from the residual with the second uniform, v: u, which "
                                 "decided the rejection, is no longer uniform (it is at least p(d)/q(d))")
    bad = worst_token(np.bincount(tokens, minlength=V).astype(float), p)
    if bad is not None:
        x, c, e, b = bad
        raise InvariantError(f"token {x} came {c} times in {tokens.size} trials; the target's p gives it {e:.1f}, "
                             f"give or take {b:.1f}: the tokens are not distributed as the target's",
                             "accept with min(1, p/q), on rejection draw from normalise(max(0, p - q)): together "
                             "they give min(p, q) + max(0, p - q) = p")


def compare(yours, want, ex) -> None:
    """Hold ``yours`` (the learner's tokens) to the rule's exact facts, then to its three bounds."""
    p, q, drafts, _, _ = _args(ex)
    tokens = _host(yours)
    _exact_facts(tokens, p, q, drafts)
    _statistics(tokens, p, q, drafts)


def invariants(f, ex) -> None:
    """The same inputs give the same tokens: the rule draws from u and v alone."""
    fn = f["speculative_accept"]
    one, two = (_host(fn(*(_dev(a) for a in _args(ex)))) for _ in range(2))
    if one.shape != two.shape or not np.array_equal(one, two):
        raise InvariantError("two calls on the same p, q, drafts, u and v gave different tokens",
                             "draw only from u and v, no random generator of your own: the grade is then the "
                             "same on every run")


def _choose(dist, w):
    cdf = np.cumsum(dist)
    return np.minimum(np.searchsorted(cdf, w * cdf[-1], side="right"), len(dist) - 1)


def _wrong(test, residual, uniform="v", normalised=True):
    def wrong(ex, dout):
        p, q, drafts, u, v = _args(ex)
        keep = test(p[drafts], q[drafts], u)
        dist = residual(p, q)
        w = {"u": u, "v": v}[uniform]
        if normalised:
            drawn = _choose(dist, w)
        else:                                   # the first token whose cumsum exceeds w, 0 where none does
            drawn = np.searchsorted(np.cumsum(dist), w, side="right")
            drawn[drawn >= len(p)] = 0
        return np.where(keep, drafts, drawn).astype(drafts.dtype)
    return wrong


def _rule(pd, qd, u):
    return u * qd < pd


def _res(p, q):
    return np.maximum(p - q, 0.0)


always = _wrong(lambda pd, qd, u: np.ones_like(u, bool), _res)
from_p = _wrong(_rule, lambda p, q: p)
unnormalised = _wrong(_rule, _res, normalised=False)
same_uniform = _wrong(_rule, _res, uniform="u")
inverted = _wrong(lambda pd, qd, u: u * pd < qd, _res)

SPECULATIVE = Layer(
    "speculative_accept", "function", ("speculative_accept",), speculative_examples(), invariants, {
        "speculative_accept": "keep d where u * q(d) < p(d) (probability min(1, p(d)/q(d))); elsewhere draw from "
                              "r = max(0, p - q) / sum(max(0, p - q)): the first token whose cumulative r exceeds v"},
    where={"speculative_accept": "the acceptance test's ratio, and the distribution a rejected trial draws from"},
    compare=compare, library="attn.speculative", mistakes=(
        Mistake("speculative_accept", always, "every draft kept: the test min(1, p/q) never made",
                "accept with probability min(1, p(d)/q(d)): keep d where u < p(d) / q(d)"),
        Mistake("speculative_accept", from_p, "a rejected trial drawn from p, not from max(0, p - q)",
                "a rejected trial draws from the residual max(0, p - q), normalised: not from p"),
        Mistake("speculative_accept", unnormalised, "the residual max(0, p - q) not normalised before the draw",
                "normalise max(0, p - q) by its sum before the inverse CDF"),
        Mistake("speculative_accept", same_uniform, "a rejected trial drawn with u, the uniform the test used",
                "a rejection draws afresh with the second uniform, v: u is no longer uniform once it rejected"),
        Mistake("speculative_accept", inverted, "the test min(1, q/p): the ratio upside down",
                "keep d with probability min(1, p(d)/q(d)): the target's probability over the draft's")),
    explicit=explicit())

"""Speculative decoding (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023 call it speculative sampling): a small draft model
proposes k tokens, one at a time through its own key/value cache; the target model reads all k
(and the token before them) in ONE pass over k + 1 positions through its cache
(:meth:`attn.engine.Model.decode_positions`), and keeps a prefix of them:

    q_j = the draft's distribution at proposal j,  d_j ~ q_j          j = 0 .. k-1
    p_j = the target's at the same position                          j = 0 .. k   (one pass)
    accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), in order;
    at the first rejection draw the next token from  normalise(max(0, p_j - q_j))  and stop;
    if all k are accepted draw one more from p_k.

Why it is exact: at one position, the token kept is d with probability
``q(d) min(1, p(d)/q(d)) = min(q(d), p(d))`` by acceptance, plus, by rejection,
``(1 - sum_x min(q(x), p(x))) * max(0, p(d) - q(d)) / sum_x max(0, p(x) - q(x))``; the two sums
of the second term are equal (``sum p = sum q = 1``), so it is ``max(0, p(d) - q(d))``, and the
total is ``min(p, q) + max(0, p - q) = p(d)``: the target's own distribution, whatever the draft.
Position by position, the whole sequence is distributed as the target's sampling.

Greedy decoding is the same rule with temperature 0: p and q are one-hot at their argmax, a
draft token is accepted exactly when it is the target's argmax, and the rejection's residual
``max(0, p - q)`` is the target's argmax: the output is the target's greedy output, token for
token, and the draft changes only how many passes of the target it takes.

The rejected positions are rolled back from both caches (:meth:`attn.engine.DecodingState.truncate`).
Each call decodes one sequence (a translator's sentences one at a time): the accepted lengths of
a batch's rows differ. Both models read the same tokens and must share the vocabulary; a
translator's draft reads the same source through its own encoder. Target and draft each run on
either engine: only the engine interface's :meth:`~attn.engine.Model.start_decoding`,
:meth:`~attn.engine.Model.decode_positions` and the state's ``truncate`` are asked of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from . import backend as B
from .block import parts
from .data import BOS, EOS, PAD
from .decode import BANNED, EXTRA_LENGTH, DecodeResult
from .masks import padding_mask
from .sample import Sampler, choose, distribution

#: Greedy decoding, as a sampler: temperature 0 picks the argmax (the first of equal ones).
GREEDY = Sampler(temperature=0)


@dataclass
class Acceptance:
    """What the rounds did: draft tokens ``proposed`` and ``accepted``, ``rounds`` (passes of the
    target) and ``tokens`` kept (each round keeps its accepted ones and one of the target's)."""
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    tokens: int = 0

    @property
    def rate(self) -> float:
        """The fraction of proposed draft tokens that were accepted (0 with none proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def add(self, other: "Acceptance") -> None:
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.rounds += other.rounds
        self.tokens += other.tokens

    def line(self, k: int) -> str:
        """One line for a user: the rate and the tokens per pass of the target."""
        per_pass = self.tokens / self.rounds if self.rounds else 0.0
        return (f"speculative decoding, k={k}: {self.accepted:,} of {self.proposed:,} draft tokens accepted "
                f"({100 * self.rate:.1f} %), {per_pass:.2f} tokens per pass of the target")


# --------------------------------------------------------------------------- the rule

def accepts(p_d: float, q_d: float, u: float) -> bool:
    """Leviathan et al.'s test: keep a draft token of probability ``q_d`` under the draft and
    ``p_d`` under the target with probability min(1, p_d / q_d), by the uniform ``u`` in [0, 1).
    (``q_d`` > 0: the draft drew the token.)"""
    return u * q_d < p_d


def residual(p, q):
    """The distribution to draw from at a rejection: ``normalise(max(0, p - q))`` (host (V,)).
    Where rounding leaves nothing (p and q equal to the last bit, which a rejection makes
    unlikely), the target's own p."""
    r = B.host.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


def speculative_accept(p, q, drafts, u, v):
    """The rule at one position, for N independent trials at once (lesson 31's exercise): ``p``
    (V,) the target's distribution, ``q`` (V,) the draft's, ``drafts`` (N,) tokens the draft drew
    from q, ``u`` and ``v`` (N,) uniforms in [0, 1). Trial i keeps ``drafts[i]`` where
    :func:`accepts` (``u * q(d) < p(d)``); elsewhere it draws from :func:`residual` by inverse CDF
    with ``v`` (as :func:`attn.sample.choose`). Returns the tokens (N,), of ``drafts``' dtype."""
    xp = B.get_array_module(p)
    keep = u * q[drafts] < p[drafts]
    r = xp.maximum(p - q, 0.0)
    cdf = xp.cumsum(r)
    drawn = xp.minimum(xp.searchsorted(cdf, v * cdf[-1], side="right"), p.shape[0] - 1)
    return xp.where(keep, drafts, drawn.astype(drafts.dtype))


def verify(p, q, drafts: list, rng) -> tuple[int, int]:
    """The rule on one round: ``p`` (k+1, V) the target's distributions, ``q`` (k, V) the draft's,
    ``drafts`` its k tokens, ``rng`` the host generator. Returns (n, token): the first n drafts
    are kept, followed by ``token``."""
    for j, d in enumerate(drafts):
        if not accepts(p[j, d], q[j, d], float(rng.random())):
            return j, choose(residual(p[j], q[j]), float(rng.random()))
    k = len(drafts)
    return k, choose(p[k], float(rng.random()))


# --------------------------------------------------------------------------- one model's cache

class Reader:
    """One model reading one sequence through its key/value cache: what it was fed
    (``fed``, positions), the log-probabilities of what follows, the rollback."""

    def __init__(self, model, memory=None, src_mask=None):
        self.model = model
        self.state = model.start_decoding(memory, src_mask)

    @property
    def fed(self) -> int:
        return self.state.length

    def feed(self, tokens: list, banned: Iterable[int]):
        """Read ``tokens`` (the positions after ``fed``) in one pass. Returns the host float64
        log-probabilities (len(tokens), V) of the token after each, ``banned`` ids at -inf."""
        ids = B.to_device(B.host.asarray([tokens], dtype=B.host.int64))              # (1, T)
        logp, self.state, _ = self.model.decode_positions(ids, self.state)
        logp = B.to_host(logp[0]).astype("float64")                                  # (T, V)
        logp[:, list(banned)] = -float("inf")
        return logp

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        self.state = self.state.truncate(length)


def speculate(target: Reader, draft: Reader, seq: list, k: int, sampler: Sampler, rng,
              banned: Iterable[int] = ()):
    """One round after the tokens ``seq`` (each reader has read a prefix of them): the draft
    proposes k tokens, the target reads them in one pass, the rule keeps n of them and one more
    token. Returns (the n + 1 new tokens, the target's log-probabilities (n + 1, V) of them,
    the round's :class:`Acceptance`); both caches end holding every token of ``seq`` and the new
    ones but the last."""
    banned = list(banned)
    drafts, q = [], []
    if k:
        logq = draft.feed(seq[draft.fed:], banned)[-1]
        for j in range(k):
            q.append(distribution(logq, *sampler))
            drafts.append(choose(q[-1], float(rng.random())))
            if j < k - 1:
                logq = draft.feed(drafts[-1:], banned)[0]
    logp = target.feed(seq[target.fed:] + drafts, banned)[-(k + 1):]              # (k+1, V)
    p = B.host.stack([distribution(row, *sampler) for row in logp])
    n, token = verify(p, B.host.stack(q) if q else None, drafts, rng)
    target.rollback(len(seq) + n)
    draft.rollback(min(draft.fed, len(seq) + n))
    return drafts[:n] + [token], logp[:n + 1], Acceptance(k, n, 1, n + 1)


def check_pair(target, draft) -> None:
    """A ValueError naming what differs if ``draft`` cannot propose for ``target``: both
    translators or both language models, over one vocabulary."""
    if (parts(target.config).cross_attention is None) != (parts(draft.config).cross_attention is None):
        raise ValueError("speculative decoding: the draft and the target must both be translators (an encoder) "
                         "or both language models (n_encoder_layers=0)")
    for name in ("vocab_size", "target_vocab_size"):
        a, b = getattr(target.config, name), getattr(draft.config, name)
        if a != b:
            raise ValueError(f"speculative decoding: the draft's {name} is {b}, the target's {a}: they must "
                             "share one vocabulary")


def _check_k(k) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"speculative decoding: k (--speculate) must be an integer >= 0, got {k!r}")


# --------------------------------------------------------------------------- the translator

def translate(target, draft, src, k: int, sampler: Sampler = GREEDY, seed: int = 0, max_len=None):
    """The translations of ``src`` (B, S) PAD-padded ids, one sentence at a time, the draft
    proposing ``k`` tokens a round. With the default greedy sampler the tokens are
    :func:`attn.decode.greedy_decode`'s and the scores its summed log-probabilities (EOS
    included); another sampler draws from the target's distribution (seeded by ``seed``).
    ``max_len`` as greedy decoding's. Returns (DecodeResult, :class:`Acceptance`)."""
    _check_k(k)
    check_pair(target, draft)
    np = B.host
    src_h = B.to_host(src)
    rng, stats = B.host_rng(seed), Acceptance()
    tokens, scores = [], []
    for row in src_h:
        row = row[row != PAD][None, :]
        limit = _limit(target, draft, row.shape[1], max_len)
        out, score, s = _sentence(target, draft, B.to_device(np.asarray(row)), limit, k, sampler, rng)
        tokens.append(out)
        scores.append(score)
        stats.add(s)
    return DecodeResult(tokens, scores), stats


class Speculative:
    """How to decode, for :func:`attn.evaluate.translate` (in place of an
    :class:`attn.decode.Decoding`): greedy decoding with ``draft`` proposing ``k`` tokens a
    round; ``acceptance`` adds up every batch's rounds."""

    with_attention = False                 # one sentence at a time; the figure is plain decoding's

    def __init__(self, draft, k: int, max_len: int | None = None):
        _check_k(k)
        self.draft, self.k, self.max_len = draft, k, max_len
        self.acceptance = Acceptance()

    def search(self, model, src) -> DecodeResult:
        """The greedy translations of the batch ``src`` (B, S), as :meth:`Decoding.search`'s."""
        result, stats = translate(model, self.draft, src, self.k, max_len=self.max_len)
        self.acceptance.add(stats)
        return result


def _limit(target, draft, n_source: int, max_len) -> int:
    """The sentence's most tokens, as greedy decoding's (:func:`attn.decode._start`); the draft's
    learned positions must hold them too, or the draft could not propose the last ones."""
    limit = n_source + EXTRA_LENGTH if max_len is None else int(max_len)
    if parts(target.config).positions.learned:
        limit = min(limit, target.config.max_len)
    if parts(draft.config).positions.learned and draft.config.max_len < limit:
        raise ValueError(f"speculative decoding: the draft's learned positions hold {draft.config.max_len}, "
                         f"the target decodes up to {limit}: use a draft with max_len >= {limit}")
    return max(limit, 1)


def _sentence(target, draft, src, limit: int, k: int, sampler: Sampler, rng):
    """One sentence (src (1, S), no padding): (tokens without EOS, summed log-probability,
    :class:`Acceptance`)."""
    mask = padding_mask(src)
    readers = [Reader(m, m.encode(src, None, mask)[0], mask) for m in (target, draft)]
    seq, score, stats = [BOS], 0.0, Acceptance()
    while len(seq) - 1 < limit:
        room = min(k, limit - len(seq))                  # the round keeps at most room + 1 tokens
        new, logp, s = speculate(*readers, seq, room, sampler, rng, BANNED)
        stats.add(s)
        for j, token in enumerate(new):
            seq.append(token)
            score += float(logp[j, token])
            if token == EOS:
                return seq[1:-1], score, stats
    return seq[1:], score, stats


# --------------------------------------------------------------------------- the language model

def generate(target, draft, prompt: list, max_tokens: int, k: int, sampler: Sampler = Sampler(), seed: int = 0,
             stop: Callable | None = None, banned: Iterable[int] = (), window: int | None = None):
    """:func:`attn.sample.generate` with a draft proposing ``k`` tokens a round: the same
    arguments, and texts distributed as the target's (with temperature 0, its very tokens,
    windows restarted where it restarts them). Returns (ids, :class:`Acceptance`)."""
    _check_k(k)
    check_pair(target, draft)
    sampler = sampler.check()
    if not prompt:
        raise ValueError("generate: the prompt must hold at least one token")
    window = window or target.config.max_len
    if parts(draft.config).positions.learned and draft.config.max_len < window:
        raise ValueError(f"speculative decoding: the draft's learned positions hold {draft.config.max_len}, "
                         f"the target reads windows of {window}: use a draft with max_len >= {window}")
    rng, stats = B.host_rng(seed), Acceptance()
    seq, start, readers, out = list(prompt), max(0, len(prompt) - window + 1), None, []
    while len(out) < max_tokens:
        if len(seq) - start >= window:                   # where sample.generate starts afresh
            start, readers = len(seq) - window // 2, None
        if readers is None:
            readers = (Reader(target), Reader(draft))
        room = min(k, window - 1 - (len(seq) - start), max_tokens - len(out) - 1)
        new, _, s = speculate(*readers, seq[start:], room, sampler, rng, banned)
        stats.add(s)
        for token in new:
            seq.append(token)
            out.append(token)
            if stop is not None and stop(out):
                return out, stats
    return out, stats

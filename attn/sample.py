"""Sampling a language model's continuation: temperature, top-k and top-p (nucleus) sampling, and
the loop that feeds each chosen token back through the key/value cache.

    probs = distribution(logits, temperature=0.8, top_k=40, top_p=0.95)   # host, sums to one
    ids = generate(model, prompt_ids, 200, Sampler(0.8, 40, 0.95), seed=1)

The sampler's definitions, in the order they apply (Holtzman et al. 2020, "The Curious Case of
Neural Text Degeneration", for top-p):

* ``temperature`` T divides the logits: ``p ∝ exp(logits / T)``; T → 0 is greedy decoding
  (the largest logit, the first of equal ones), which ``temperature=0`` asks for exactly.
* ``top_k`` keeps the k largest probabilities (the first k in descending order), the rest zero.
* ``top_p`` keeps the smallest set of the largest probabilities whose mass reaches p.

What is kept is renormalised, and one uniform number from the seeded generator picks a token by
the inverse of the cumulative distribution: a seed reproduces a sample, and the cached and the
uncached loops draw the same tokens from the same numbers. The model is any with a decoder-only
config (:class:`attn.model.Transformer` with ``n_encoder_layers=0``, or an engine's model of it).
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from . import backend as B
from .model import log_softmax


class Sampler(NamedTuple):
    """How a token is drawn from the next-token logits; None: that filter is off."""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def check(self) -> "Sampler":
        """This sampler, or a ValueError naming the setting out of range."""
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        return self


def distribution(logits, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """The next token's probabilities (V,) on the host, float64, from its logits (V,) (any
    backend, or log-probabilities: the same up to a constant) after ``temperature``, ``top_k`` and
    ``top_p`` (see the module's docstring), renormalised."""
    np = B.host
    x = B.to_host(logits).astype("float64")
    order = np.argsort(-x, kind="stable")                       # descending, first of equals first
    p = np.zeros_like(x)
    if temperature == 0:
        p[order[0]] = 1.0
        return p
    z = (x - x[order[0]]) / temperature
    p = np.exp(z)
    if top_k is not None:
        p[order[top_k:]] = 0.0
    p /= p.sum()
    if top_p is not None:
        mass = np.cumsum(p[order])
        keep = int(np.searchsorted(mass, top_p * (1 - 1e-12))) + 1        # the smallest prefix reaching top_p
        p[order[keep:]] = 0.0
        p /= p.sum()
    return p


def choose(probs, u: float) -> int:
    """The token whose cumulative probability first exceeds ``u`` in [0, 1) (inverse-CDF)."""
    np = B.host
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1))


def _last_logp_uncached(model, ids: list):
    """Log-probabilities of the token after ``ids``, by a full forward over them (no cache)."""
    logits, _ = model.forward(None, B.to_device(B.host.asarray([ids])))
    return log_softmax(logits[0, -1])


def generate(model, prompt: list, max_tokens: int, sampler: Sampler = Sampler(), seed: int = 0,
             stop: Callable | None = None, banned: Iterable[int] = (), window: int | None = None,
             cached: bool = True) -> list:
    """Up to ``max_tokens`` new token ids after ``prompt`` (a non-empty list of ids), drawn by
    ``sampler`` from a generator seeded by ``seed``; ``stop(new ids)`` true ends the text (after
    that token). ``banned`` ids are never drawn (the vocabulary's specials).

    The model reads at most ``window`` positions (default: its ``max_len``), the length it was
    trained on: when a text reaches it, the model starts afresh from the last half of the window
    (the cache refilled from those tokens). ``cached=False`` recomputes every position each step
    with the full forward, which draws the same tokens: the test of the cache."""
    sampler = sampler.check()
    if not prompt:
        raise ValueError("generate: the prompt must hold at least one token")
    window = window or model.config.max_len
    rng, banned = B.host_rng(seed), list(banned)
    seq, start, state, fed, out = list(prompt), max(0, len(prompt) - window + 1), None, 0, []
    for _ in range(max_tokens):
        if len(seq) - start >= window:
            start, state = len(seq) - window // 2, None
        if not cached:
            logp = _last_logp_uncached(model, seq[start:])
        else:
            if state is None:
                state, fed = model.start_decoding(None, None), start
            for t in seq[fed:]:
                logp, state, _ = model.decode_step(B.to_device(B.host.asarray([t])), state)
            fed = len(seq)
            logp = logp[0]
        logp = B.to_host(logp).astype("float64")
        logp[banned] = -float("inf")
        token = choose(distribution(logp, *sampler), float(rng.random()))
        seq.append(token)
        out.append(token)
        if stop is not None and stop(out):
            break
    return out

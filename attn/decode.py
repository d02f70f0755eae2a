"""Greedy decoding and beam search (section 6.1), batched over sentences.

    memory = encode(src)                       once per batch
    y_0 = BOS;  y_{t+1} = pick(log p(. | y_0..y_t, memory))   until EOS or the length limit

Both searches run one decoder position per step for every live hypothesis at
once. With ``use_cache=True`` a step is :meth:`Transformer.decode_step`: the keys
and values of earlier positions are cached, so a step costs O(t) attention and
O(1) everything else. With ``use_cache=False`` each step re-runs the whole
decoder on the prefix (``model.decode`` + ``model.project``), the O(t^2) way a
first implementation does it; the two give the same tokens and, in float64,
the same scores to rounding (a test checks it), and ``attn.bench`` times both.

Conventions
-----------
* ``src`` is (B, S) integer ids on the model's backend, padded with ``PAD`` at the
  end. Decoding starts from ``BOS``; ``PAD`` and ``BOS`` are never generated.
* The output length limit (section 6.1: "input length + 50") is per sentence: its
  own number of real source tokens + 50, or ``max_len`` for all when given; for a
  model with learned positions it is also capped by the positional table. It
  counts generated tokens, the final EOS included: a sentence that hits it stops
  without an EOS.
* Sentences that finish leave the batch (the cache rows are dropped with
  :meth:`DecodeState.select`), so a long tail of one sentence costs one row.
* Per step the host receives one small array (the chosen ids and their scores)
  and, when rows change, sends one back (the row index, the tokens, the scores).
  An engine's search may look less often (``check_every``: on a GPU, where each
  look waits for the device, the fast engine's greedy decoding receives several
  positions' ids and scores at once); the host replays them in order (finished
  rows run on until then, and leave the batch at that look): the same tokens and
  scores. Beam search looks at every position.

Beam search scores a hypothesis Y of |Y| tokens (EOS included) as in GNMT
(Wu et al. 2016), which the paper uses with alpha = 0.6::

    score(Y) = log P(Y | X) / lp(Y),    lp(Y) = ((5 + |Y|) / 6) ** alpha

Finished hypotheses are kept aside. Each step keeps the best ``2K`` candidates:
an EOS among the first ``K`` finishes a hypothesis, the first ``K`` others become
the next beams. A sentence's search ends when no live beam can still beat its
best finished hypothesis, or at its length limit (its live beams then count as
finished, without EOS). A live beam's log P can only fall as it grows, and
``lp`` only rises, so for ``alpha >= 0`` its final score is at most
``log P / lp(limit)``; once that bound is below the best finished score the
sentence is done. (Stopping at ``K`` finished hypotheses instead lets short,
unlikely ones end the search before the best longer one finishes.) With
``alpha = 0`` and ``beam_size=1`` this is greedy decoding, token for token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from . import backend as B
from . import engine as engines
from .block import parts
from .data import BOS, EOS, PAD
from .masks import padding_mask
from .model import log_softmax

#: Output length limit beyond the source length (section 6.1).
EXTRA_LENGTH = 50


class DecodeResult(NamedTuple):
    """What a search returns for a batch of B sentences.

    tokens : list of B lists of int
        The output ids, without BOS and without EOS.
    scores : list of B floats
        Greedy: the sum of the log-probabilities of the chosen tokens (EOS
        included). Beam: the length-penalised score ``log P / lp``.
    cross_attention : list of B host arrays (len(tokens), S_i), or None
        The last decoder layer's cross-attention, averaged over heads: row t is
        where the model looked while producing ``tokens[t]``; the columns are the
        sentence's real (non-pad) source positions. Only with ``with_attention=True``.
    n_best : list of B lists of (tokens, score), or None
        Beam search only: every finished hypothesis of a sentence, best first.
    """
    tokens: list
    scores: list
    cross_attention: list | None = None
    n_best: list | None = None


# --------------------------------------------------------------------------- the readable search

class ReadableSearch:
    """What the searches ask of a model (:class:`attn.engine.Search`), for the readable
    :class:`attn.model.Transformer`: its :meth:`~attn.model.Transformer.start_decoding` and
    :meth:`~attn.model.Transformer.decode_step`, and the token picks below. An engine's model
    may bring its own (:func:`search_of`)."""

    check_every = 1                     # greedy decoding looks for ended sentences at every position

    def __init__(self, model):
        self.model = model

    def rows_to_device(self, index, tokens, scores):
        """Beam search's next rows: the (n,) row index and tokens (int64) and scores (float64),
        from the host to the model's backend."""
        xp = self.model.xp
        return xp.asarray(index), xp.asarray(tokens), xp.asarray(scores)

    def start(self, memory, src_mask, reserve=None):
        """The decoding state (``reserve``, the most rows and positions the search will step, is
        for engines that size buffers once: this state grows as it goes)."""
        return self.model.start_decoding(memory, src_mask)

    def step(self, tokens, state):
        return self.model.decode_step(tokens, state)

    def select(self, state, index, index_host):
        return state.select(index)

    def prefix(self, tgt_in, memory, src_mask, cross_kv, keep_weights):
        """The decoder on the whole prefix (``cross_kv`` and ``keep_weights`` are for engines that
        reuse the memory's projections and drop unread weights: this model recomputes both)."""
        return self.model.decode(tgt_in, memory, src_mask)

    @staticmethod
    def greedy_pick(logp, banned, info, tokens) -> None:
        """Greedy decoding's choice at one position, written in place: ``info`` (2, n) float64 <-
        the most probable token of each row of ``logp`` (n, V), the ids ``banned`` excluded, and
        its log-probability; ``tokens`` (n,) <- the same ids."""
        xp = B.get_array_module(logp)
        logp[:, list(banned)] = -float("inf")
        nxt = logp.argmax(axis=-1)                                                     # (n,)
        info[0] = nxt
        info[1] = xp.take_along_axis(logp, nxt[:, None], axis=1)[:, 0]
        tokens[...] = nxt

    @staticmethod
    def beam_candidates(logp, beam_scores, W: int, c: int, C: int, banned):
        """Beam search's best ``C`` continuations of each sentence, on the host: (2, n, C) float64,
        their scores (log P so far plus the token's) and ids ``w * V + v`` (beam, token), in no
        order. ``logp`` (n*W, V) the step's log-probabilities (changed in place), ``beam_scores``
        (n, W) float64, ``c`` <= V the tokens kept per beam, ``banned`` ids never chosen.

        A sentence's best C candidates are among each of its beams' best c tokens (a beam's
        score is the same for all its tokens): pick those first, over V in float32, then rank
        the W * c survivors in float64, instead of all W * V of them."""
        xp = B.get_array_module(logp)
        nl, V = beam_scores.shape[0], logp.shape[1]
        logp[:, list(banned)] = -float("inf")
        neg = xp.negative(logp, out=logp)               # the best are the least
        top_v = least_columns(neg, c)                                                 # (n*W, c)
        top_lp = -xp.take_along_axis(neg, top_v, axis=1)
        cand = (beam_scores[:, :, None] + top_lp.reshape(nl, W, c).astype(xp.float64)).reshape(nl, W * c)
        flat = (xp.arange(W)[None, :, None] * V + top_v.reshape(nl, W, c)).reshape(nl, W * c)  # id w*V + v
        top = xp.argpartition(-cand, C - 1, axis=1)[:, :C]                            # (n, C), unordered
        top_s = xp.take_along_axis(cand, top, axis=1)
        top_f = xp.take_along_axis(flat, top, axis=1)
        return B.to_host(xp.stack([top_s, top_f.astype(xp.float64)]))


def search_of(model) -> "engines.Search":
    """The model's own search where its engine has one (:class:`attn.engine.Tuned`), else the
    readable one."""
    return model.search() if isinstance(model, engines.Tuned) else ReadableSearch(model)


#: Columns per block in :func:`least_columns`'s first round.
PRESELECT_BLOCK = 256


def least_columns(a, c: int):
    """The column ids (R, c) of c least entries of each row of ``a`` (R, V): beam search's
    preselection of each beam's best tokens. Among entries tied with the c-th least value,
    the ones kept are those ``argpartition`` keeps (not the lowest ids: breaking exact ties
    by id would cost a sort at every step).

    With many columns, in two rounds: the c blocks of :data:`PRESELECT_BLOCK` columns with
    the least minima hold c least entries, so only those blocks (and the last, shorter one)
    are searched, not all V columns."""
    xp = B.get_array_module(a)
    R, V = a.shape
    b = PRESELECT_BLOCK
    nb = V // b
    if nb <= 2 * c:                                           # few blocks: search every column
        ids = xp.broadcast_to(xp.arange(V), (R, V))
        vals = a
    else:
        minima = a[:, :nb * b].reshape(R, nb, b).min(axis=2)                      # (R, nb)
        blocks = xp.argpartition(minima, c - 1, axis=1)[:, :c]
        ids = (blocks[:, :, None] * b + xp.arange(b)).reshape(R, c * b)
        if nb * b < V:
            ids = xp.concatenate([ids, xp.broadcast_to(xp.arange(nb * b, V), (R, V - nb * b))], axis=1)
        vals = xp.take_along_axis(a, ids, axis=1)
    least = xp.argpartition(vals, c - 1, axis=1)[:, :c]
    return xp.take_along_axis(ids, least, axis=1)


# --------------------------------------------------------------------------- steppers

class _CachedStepper:
    """One decoder position per call, with the keys/values of the prefix cached."""

    def __init__(self, search, memory, src_mask, with_attention, reserve=None):
        self.search, self.with_attention = search, with_attention
        self.state = search.start(memory, src_mask, reserve)

    def step(self, tokens):
        """tokens (n,) ids at the next position. Returns log-probs (n, V), attention (n, S) or None."""
        logp, self.state, cross = self.search.step(tokens, self.state)
        att = cross[-1][:, :, 0, :].mean(axis=1) if self.with_attention else None    # (n, S)
        return logp, att

    def select(self, index, index_h):
        """Keep (and repeat) rows ``index`` (device int array; ``index_h`` the same on the host)."""
        self.state = self.search.select(self.state, index, index_h)


class _FullStepper:
    """The same interface, recomputing the whole prefix every step (no cache): the decoder runs
    on the whole prefix, the O(t^2) way.

    The cross-attention keys and values depend on the source alone: they are projected once
    (:meth:`Transformer.cross_attention_kv`), as PyTorch's ``nn.Transformer`` users do with the
    memory, and handed to the search's ``prefix``, which may use them (the readable model
    recomputes them from the memory, the fast one does not)."""

    def __init__(self, search, memory, src_mask, with_attention, reserve=None):
        self.search, self.model, self.with_attention = search, search.model, with_attention
        self.memory, self.src_mask, self.prefix = memory, src_mask, None
        self.cross_kv = self.model.cross_attention_kv(memory)
        self.sentence = B.host.arange(memory.shape[0])       # which source row each row decodes

    def step(self, tokens):
        xp = B.get_array_module(tokens)
        col = tokens[:, None]
        self.prefix = col.copy() if self.prefix is None else xp.concatenate([self.prefix, col], axis=1)  # (n, t+1)
        h, cache, _ = self.search.prefix(self.prefix, self.memory, self.src_mask, self.cross_kv,
                                         self.with_attention)                                    # (n, t+1, D)
        logp = log_softmax(self.model.project(h[:, -1, :]))                                      # (n, V)
        att = None
        if self.with_attention:
            att = cache.layers[-1][1].sub.attn.weights[:, :, -1, :].mean(axis=1)              # (n, S)
        return logp, att

    def select(self, index, index_h):
        self.prefix = self.prefix[index]
        sentence = self.sentence[index_h]
        if not (sentence.shape == self.sentence.shape and bool((sentence == self.sentence).all())):
            self.sentence = sentence          # rows changed sentence (beams reordered within one do not)
            self.cross_kv = [(k[index], v[index]) for k, v in self.cross_kv]
        self.memory, self.src_mask = self.memory[index], self.src_mask[index]


# --------------------------------------------------------------------------- shared parts

def _start(model, src, max_len, use_cache, with_attention, beam=1):
    """Check ``src``, encode it, and work out each sentence's step limit (``beam``: the most rows
    per sentence, which a model's decoding buffers may be sized for).

    Returns: stepper, src on the host, step limits (B,) host ints. The stepper's ``search`` is
    :func:`search_of` the model.
    """
    if src.ndim != 2 or src.dtype.kind not in "iu":
        raise ValueError(f"decode: src must be a (B, S) integer array of token ids, "
                         f"got shape {tuple(src.shape)} dtype {src.dtype}")
    xp = model.xp
    if B.get_array_module(src) is not xp:          # a host array for a GPU model, or the reverse
        src = xp.asarray(B.to_host(src))
    np = B.host
    src_h = B.to_host(src)
    limits = (src_h != PAD).sum(axis=1) + EXTRA_LENGTH if max_len is None else \
        np.full(src_h.shape[0], int(max_len))
    if parts(model.config).positions.learned:       # decode_step indexes the table at each position
        limits = np.minimum(limits, model.config.max_len)
    limits = np.maximum(limits, 1).astype(np.int64)
    src_mask = padding_mask(src)                                                  # (B, 1, 1, S)
    memory, _ = model.encode(src, None, src_mask)                                 # (B, S, D)
    reserve = (src_h.shape[0] * beam, int(limits.max()))
    stepper = (_CachedStepper if use_cache else _FullStepper)(search_of(model), memory, src_mask, with_attention,
                                                              reserve)
    return stepper, src_h, limits


#: Never generated: padding and the start symbol.
BANNED = (PAD, BOS)


def repeated_ngrams(history, n: int):
    """The tokens that would repeat an ``n``-gram: for each row of ``history`` ((rows, t) host
    ids, the tokens generated so far), every token that follows an earlier occurrence of the
    row's last ``n - 1`` tokens. Blocking them (Paulus et al. 2018, "trigram avoidance") keeps
    a search from looping ("snow snow snow snow"). Returns (rows, tokens), host int64 arrays.
    """
    np = B.host
    rows, t = history.shape
    if n < 1 or t < n or rows == 0:              # a repeat needs a whole n-gram before it
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if n == 1:                                          # every token already generated
        r = np.repeat(np.arange(rows), t)
        return r, history.reshape(-1).astype(np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(history, n, axis=1)        # (rows, t-n+1, n)
    last = history[:, t - n + 1:]                                                # (rows, n-1)
    hit = (windows[:, :, :n - 1] == last[:, None, :]).all(axis=2)                 # (rows, t-n+1)
    r, j = np.nonzero(hit)
    return r.astype(np.int64), windows[r, j, n - 1].astype(np.int64)


def _check_no_repeat(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"decode: no_repeat_ngram must be a non-negative integer (0: off), got {n!r}")


def _ban(xp, logp, history, n: int) -> None:
    """Set ``logp`` (rows, V) to -inf, in place, at the tokens :func:`repeated_ngrams` names."""
    r, tok = repeated_ngrams(history, n)
    if len(r):
        both = xp.asarray(B.host.stack([r, tok]))                  # one transfer
        logp[both[0], both[1]] = -xp.inf


def _to_host_steps(att_steps):
    """The per-step (n_t, S) device arrays as float64 host arrays, in one transfer."""
    np = B.host
    if not att_steps:
        return []
    xp = B.get_array_module(att_steps[0])
    flat = B.to_host(xp.concatenate(att_steps, axis=0)).astype(np.float64)
    return np.split(flat, np.cumsum([a.shape[0] for a in att_steps])[:-1])


def _attention_rows(att_steps, src_h, sentence_rows):
    """Gather per-sentence attention from the per-step device arrays.

    att_steps : list over steps of (n_t, S) device arrays.
    sentence_rows : per sentence a list of (step, row) pairs, in token order.
    Returns: per sentence a (len(rows), S_i) host array over its real source positions.
    """
    np = B.host
    host_steps = _to_host_steps(att_steps)
    out = []
    for i, rows in enumerate(sentence_rows):
        a = np.stack([host_steps[t][r] for t, r in rows]) if rows else np.zeros((0, src_h.shape[1]))
        out.append(a[:, src_h[i] != PAD])
    return out


@dataclass(frozen=True)
class Decoding:
    """How to decode, settled once by whoever asks (``attn-translate``'s flags, the trainer's
    final test translation) and handed down whole to :func:`attn.evaluate.translate`.

    ``beam_size`` 1 decodes greedily (:func:`greedy_decode`), more runs :func:`beam_search`
    with the length penalty ``alpha`` (ignored by greedy decoding); ``max_len`` is the most tokens
    a translation may have (None: its source's length + :data:`EXTRA_LENGTH`); ``no_repeat_ngram``
    n > 0 forbids a translation to repeat one of its own n-grams; ``use_cache`` keeps each layer's
    keys and values; ``with_attention`` returns the last layer's cross-attention.
    """
    beam_size: int = 1
    alpha: float = 0.6
    max_len: int | None = None
    no_repeat_ngram: int = 0
    use_cache: bool = True
    with_attention: bool = False

    def __post_init__(self):
        if isinstance(self.beam_size, bool) or not isinstance(self.beam_size, int) or self.beam_size < 1:
            raise ValueError(f"Decoding: beam_size must be a positive integer, got {self.beam_size!r}")
        if isinstance(self.no_repeat_ngram, bool) or not isinstance(self.no_repeat_ngram, int) \
                or self.no_repeat_ngram < 0:
            raise ValueError(f"Decoding: no_repeat_ngram must be 0 (off) or a positive n-gram length, "
                             f"got {self.no_repeat_ngram!r}")

    def search(self, model, src) -> DecodeResult:
        """The translations of the batch ``src`` (B, S): greedy decoding or beam search, as set."""
        if self.beam_size == 1:
            return greedy_decode(model, src, max_len=self.max_len, use_cache=self.use_cache,
                                 with_attention=self.with_attention, no_repeat_ngram=self.no_repeat_ngram)
        return beam_search(model, src, beam_size=self.beam_size, alpha=self.alpha, max_len=self.max_len,
                           use_cache=self.use_cache, with_attention=self.with_attention,
                           no_repeat_ngram=self.no_repeat_ngram)


# --------------------------------------------------------------------------- greedy

def greedy_decode(model, src, max_len=None, use_cache=True, with_attention=False,
                  no_repeat_ngram: int = 0) -> DecodeResult:
    """Pick the most probable token at every step.

    Inputs
    ------
    model : Transformer
    src : (B, S) integer ids, PAD-padded, on the model's backend (a host array is moved there)
    max_len : int or None
        Most tokens to generate per sentence (EOS included); None: the sentence's
        real source length + 50.
    use_cache : bool
        Incremental decoding with cached keys/values (True) or recomputing the
        prefix every step (False). Same result either way.
    with_attention : bool
        Also return the last layer's cross-attention per sentence.
    no_repeat_ngram : int
        n > 0: never generate a token that repeats an n-gram of the sentence's own output
        (:func:`repeated_ngrams`); the host then looks at every position. 0: off.

    Returns
    -------
    DecodeResult with ``scores`` the summed log-probabilities (EOS included).
    """
    _check_no_repeat(no_repeat_ngram)
    np = B.host
    xp = model.xp
    if src.shape[0] == 0:
        return DecodeResult([], [], [] if with_attention else None)
    stepper, src_h, limits = _start(model, src, max_len, use_cache, with_attention)
    n, T_max = src_h.shape[0], int(limits.max())
    kept = _Picked(n, T_max)
    rows = np.arange(n)                                # sentence of each row
    alive = np.ones(n, dtype=bool)                     # rows still decoding, as of the last check
    att_steps = []                                     # per step: (sentence of each row, (n_rows, S))
    every = 1 if no_repeat_ngram else stepper.search.check_every       # positions between two looks
    info = xp.empty((every, 2, n), dtype=xp.float64)   # per position: (ids, log-probs) of every row
    tokens = xp.full((n,), BOS, dtype=xp.int64)
    t = 0
    while t < T_max:
        steps = min(every, T_max - t)
        for j in range(steps):
            logp, att = stepper.step(tokens)
            if no_repeat_ngram:                        # every = 1 here: all rows are live
                _ban(xp, logp, kept.out[rows, :t], no_repeat_ngram)
            stepper.search.greedy_pick(logp, BANNED, info[j], tokens)   # tokens <- the picks: the next step's input
            if with_attention:
                att_steps.append((rows, att))
        kept.replay(B.to_host(info[:steps]), t, rows, alive, limits)    # the check's one sync
        t += steps
        if not alive.any():
            break
        if not alive.all():
            rows, alive, tokens, info = _without_finished(stepper, alive, rows, tokens, every)
    tokens_out = [kept.out[i, :kept.n_out[i]].tolist() for i in range(n)]   # contiguous from step 0
    cross = kept.attention(att_steps, src_h) if with_attention else None
    return DecodeResult(tokens_out, kept.scores.tolist(), cross)


def _without_finished(stepper, alive, rows, tokens, every: int):
    """Finished rows leave the batch: the decoder's cache keeps the live rows, and so do the
    rows' sentences, their flags and next tokens; a fresh (every, 2, n_live) buffer for the picks."""
    xp = B.get_array_module(tokens)
    idx = B.host.nonzero(alive)[0]
    idx_d = xp.asarray(idx)
    stepper.select(idx_d, idx)
    return rows[idx], alive[idx], tokens[idx_d], xp.empty((every, 2, len(idx)), dtype=xp.float64)


class _Picked:
    """What greedy decoding keeps on the host: each sentence's tokens by step, how many it kept
    (EOS excluded) and its score."""

    def __init__(self, n: int, T_max: int):
        np = B.host
        self.out = np.full((n, T_max), PAD, dtype=np.int64)
        self.n_out = np.zeros(n, dtype=np.int64)
        self.scores = np.zeros(n, dtype=np.float64)

    def replay(self, got, t: int, rows, alive, limits) -> None:
        """The picks of positions t, t+1, ... (``got``: (steps, 2, n_rows) ids and log-probabilities),
        in order, as if the host had looked at every position: a row stops at its EOS or its limit
        (``alive`` is updated in place; ``rows`` says each row's sentence)."""
        np = B.host
        for j in range(got.shape[0]):
            live = np.nonzero(alive)[0]
            tok, lp_h = got[j, 0, live].astype(np.int64), got[j, 1, live]
            self.scores[rows[live]] += lp_h
            is_eos = tok == EOS
            self.out[rows[live[~is_eos]], t + j] = tok[~is_eos]
            self.n_out[rows[live[~is_eos]]] += 1
            alive[live] = ~(is_eos | (t + j + 1 >= limits[rows[live]]))

    def attention(self, att_steps, src_h) -> list:
        """Per sentence the cross-attention of its kept tokens over its real source positions."""
        np = B.host
        n = len(self.n_out)
        full = np.zeros((n, len(att_steps), src_h.shape[1]))                     # (B, steps, S)
        for t, ((r, _), a) in enumerate(zip(att_steps, _to_host_steps([a for _, a in att_steps]))):
            full[r, t] = a
        return [full[i, :self.n_out[i]][:, src_h[i] != PAD] for i in range(n)]


# --------------------------------------------------------------------------- beam search

def length_penalty(length, alpha: float = 0.6):
    """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha (1 for alpha = 0)."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_search(model, src, beam_size: int = 4, alpha: float = 0.6, max_len=None, use_cache=True,
                with_attention=False, no_repeat_ngram: int = 0) -> DecodeResult:
    """Beam search with the length penalty of section 6.1, batched over sentences.

    Inputs are those of :func:`greedy_decode`, plus ``beam_size`` (K, the paper's
    4) and ``alpha`` (the paper's 0.6, at least 0). The B sentences' beams are one flat batch
    of rows (``B*K`` at most); after each step the cache is reordered to the
    surviving beams' parents with :meth:`DecodeState.select`. ``no_repeat_ngram`` n > 0 keeps
    every beam from repeating one of its own n-grams (:func:`repeated_ngrams`).

    Returns
    -------
    DecodeResult: per sentence the best finished hypothesis, its length-penalised
    score, and ``n_best`` with every finished hypothesis, best first.
    """
    if not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_search: beam_size must be a positive integer, got {beam_size!r}")
    if not alpha >= 0:
        raise ValueError(f"beam_search: alpha must be >= 0 (the stopping rule relies on it), got {alpha!r}")
    _check_no_repeat(no_repeat_ngram)
    np = B.host
    xp = model.xp
    K = beam_size
    if src.shape[0] == 0:
        return DecodeResult([], [], [] if with_attention else None, [])
    stepper, src_h, limits = _start(model, src, max_len, use_cache, with_attention, beam=K)
    n, T_max = src_h.shape[0], int(limits.max())
    finished, beams = _Finished(n, alpha), _Beams(xp, n)
    att_steps = []                               # for the attention: per step, (n_live*W, S)
    for t in range(T_max):
        live, W = beams.live, beams.W
        logp, att = stepper.step(beams.tokens)                                    # (n_live*W, V)
        if no_repeat_ngram:
            _ban(xp, logp, beams.hist, no_repeat_ngram)
        if with_attention:
            att_steps.append(att)
        V = logp.shape[1]
        C = min(2 * K, W * V)
        info = stepper.search.beam_candidates(logp, beams.scores, W, min(C, V), C, BANNED)  # the step's one sync
        s, parent, tok = _ranked(info, W, V)
        is_eos = tok == EOS
        length = t + 1
        # An EOS among the first K candidates finishes a hypothesis.
        for i, c in zip(*np.nonzero(is_eos[:, :K] & np.isfinite(s[:, :K]))):
            finished.add(live[i], beams.hist[parent[i, c]].tolist(), s[i, c], length, t, parent[i, c])
        new_parent, new_tok, new_s = _next_beams(s, parent, tok, is_eos, K)      # (n_live, Wn), Wn = min(K, C)
        Wn = new_parent.shape[1]
        beams.hist = np.concatenate([beams.hist[new_parent.ravel()], new_tok.reshape(-1, 1)], axis=1)
        # At the length limit the live beams count as finished, without EOS.
        at_limit = length >= limits[live]
        for i, k in zip(*np.nonzero(at_limit[:, None] & np.isfinite(new_s))):
            finished.add(live[i], beams.hist[i * Wn + k].tolist(), new_s[i, k], length, t, new_parent[i, k])
        # The best any live beam can still reach: its log P (which only falls) over the largest lp.
        bound = new_s.max(axis=1) / length_penalty(limits[live], alpha)
        best = finished.best[live]
        keep = ~(at_limit | (np.isfinite(best) & (bound <= best)))   # a tie cannot win: earlier ranks first
        if not keep.any():
            break
        beams.keep(keep, new_parent, new_tok, new_s, stepper)
    return finished.result(beams.parents, att_steps, src_h, with_attention)


class _Beams:
    """The live beams: W per live sentence, one row each in the decoder's batch."""

    def __init__(self, xp, n: int):
        np = B.host
        self.xp = xp
        self.live = np.arange(n)                  # sentence of each live beam group
        self.W = 1                                # beams per live sentence: 1 at the start, then K
                                                  # (fewer while K exceeds the candidates)
        self.hist = np.zeros((n, 0), dtype=np.int64)              # (n_live*W, t) tokens of each beam
        self.scores = xp.zeros((n, 1), dtype=xp.float64)          # (n_live, W) log P so far
        self.tokens = xp.full((n,), BOS, dtype=xp.int64)          # (n_live*W,) the next step's input
        self.parents = []                         # for the attention: per step, the rows' parents

    def keep(self, keep, new_parent, new_tok, new_s, stepper) -> None:
        """Go on with the sentences that ``keep`` marks, each with its next beams (``new_*``:
        (n_live, Wn) parent rows, tokens and scores); the decoder's cache follows the parents."""
        nl, Wn = new_parent.shape
        self.live = self.live[keep]
        idx = new_parent[keep].ravel()
        self.hist = self.hist.reshape(nl, Wn, -1)[keep].reshape(len(idx), -1)
        self.parents.append(idx)
        idx_d, self.tokens, s_d = stepper.search.rows_to_device(idx, new_tok[keep].ravel(), new_s[keep].ravel())
        stepper.select(idx_d, idx)
        self.scores = s_d.reshape(len(self.live), Wn)
        self.W = Wn


def _ranked(info, W: int, V: int):
    """A step's candidates from ``beam_candidates`` (``info``: (2, n_live, C) scores and flat
    indices over a group's W*V), best first (ties: lower id first, as argmax does), as their
    scores, parent rows in this step's layout and tokens, each (n_live, C)."""
    np = B.host
    s, f = info[0], info[1].astype(np.int64)
    srt = np.lexsort((f, -s), axis=-1)
    s, f = np.take_along_axis(s, srt, 1), np.take_along_axis(f, srt, 1)
    parent = np.arange(s.shape[0])[:, None] * W + f // V
    return s, parent, f % V


def _next_beams(s, parent, tok, is_eos, K: int):
    """The first K candidates that are not EOS are the next beams (an EOS that must fill in
    is dead: its score is -inf). Returns their parents, tokens and scores, (n_live, min(K, C))."""
    np = B.host
    pick = np.argsort(is_eos, axis=1, kind="stable")[:, :K]
    new_s = np.where(np.take_along_axis(is_eos, pick, 1), -np.inf, np.take_along_axis(s, pick, 1))
    return np.take_along_axis(parent, pick, 1), np.take_along_axis(tok, pick, 1), new_s


class _Finished:
    """What beam search keeps on the host: per sentence its finished hypotheses and the best
    length-penalised score among them."""

    def __init__(self, n: int, alpha: float):
        np = B.host
        self.hyps = [[] for _ in range(n)]       # per sentence: (score, -order, tokens, (step, row))
        self.best = np.full(n, -np.inf)           # per sentence: the best finished score so far
        self.alpha = alpha
        self.order = 0                            # ties rank the earlier hypothesis first

    def add(self, i: int, tokens: list, logp: float, length: int, step: int, row) -> None:
        """Sentence i's hypothesis ``tokens`` of log P ``logp``, ended at ``step`` in ``row``."""
        score = logp / length_penalty(length, self.alpha)
        self.hyps[i].append((score, -self.order, tokens, (step, int(row))))
        self.order += 1
        self.best[i] = max(self.best[i], score)

    def result(self, parents, att_steps, src_h, with_attention: bool) -> DecodeResult:
        """Each sentence's best hypothesis, its n-best list and (following ``parents``, each
        step's rows' parent rows, back to step 0) its cross-attention."""
        tokens_out, scores_out, n_best, att_rows = [], [], [], []
        for hyps in self.hyps:
            hyps = sorted(hyps, key=lambda h: (h[0], h[1]), reverse=True)
            n_best.append([(h[2], float(h[0])) for h in hyps])
            best = hyps[0] if hyps else (-float("inf"), 0, [], (0, 0))   # cannot happen while UNK is allowed
            tokens_out.append(best[2])
            scores_out.append(float(best[0]))
            if with_attention:
                step, row = best[3]
                rows = []
                for tau in range(step, -1, -1):          # follow the parents back to step 0
                    rows.append((tau, row))
                    if tau > 0:
                        row = int(parents[tau - 1][row])
                att_rows.append(rows[::-1][:len(best[2])])
        cross = _attention_rows(att_steps, src_h, att_rows) if with_attention else None
        return DecodeResult(tokens_out, scores_out, cross, n_best)

"""The wrong results of typical mistakes in greedy decoding and beam search, computed with the
example's model (as :mod:`attn.testing.mistakes` does for the layers): the exercise's
algorithms with one rule changed."""
from __future__ import annotations

import math

from .. import backend as B
from ..masks import padding_mask

np = B.host
PAD, BOS, EOS = 0, 1, 2


def _start(model, row):
    mask = padding_mask(row)
    return model.start_decoding(model.encode(row, None, mask)[0], mask)


def _greedy(ex, ban=True, eos_scored=True, stop=True):
    model, src = ex.get("model"), ex.get("src")
    tokens, scores = [], []
    for i in range(src.shape[0]):
        state, tok, out, score = _start(model, src[i:i + 1]), BOS, [], 0.0
        for _ in range(ex.get("max_len")):
            logp, state, _ = model.decode_step(B.to_device(np.array([tok])), state)
            logp = B.to_host(logp)[0].astype(np.float64)
            if ban:
                logp[PAD] = logp[BOS] = -np.inf
            tok = int(logp.argmax())
            score += float(logp[tok]) if eos_scored or tok != EOS else 0.0
            if tok == EOS and stop:
                break
            out.append(tok)
        tokens.append(out)
        scores.append(score)
    return tokens, scores


def greedy_pad_bos_allowed(ex, dout):
    return _greedy(ex, ban=False)


def greedy_eos_unscored(ex, dout):
    return _greedy(ex, eos_scored=False)


def greedy_no_stop(ex, dout):
    return _greedy(ex, stop=False)


def _penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


def _beam(model, src, K, alpha, max_len, stop_first=False, penalised=True, ban=True):
    """One sentence's beam search (lessons/exercises/decoding.py's rules), one rule changed."""
    state, beams, finished, tokens = _start(model, src), [([], 0.0)], [], np.array([BOS])
    lp = _penalty if penalised else (lambda length, a: 1.0)
    for t in range(max_len):
        logp, state, _ = model.decode_step(B.to_device(tokens), state)
        logp = B.to_host(logp).astype(np.float64)
        if ban:
            logp[:, PAD] = logp[:, BOS] = -np.inf
        V = logp.shape[1]
        cand = sorted(((s + logp[w, v], w * V + v) for w, (_, s) in enumerate(beams) for v in range(V)),
                      key=lambda c: (-c[0], c[1]))[:min(2 * K, len(beams) * V)]
        for s, f in cand[:K]:
            if f % V == EOS and math.isfinite(s):
                finished.append((s / lp(t + 1, alpha), -len(finished), beams[f // V][0]))
        nxt = [(s if f % V != EOS else -math.inf, f) for s, f in sorted(cand, key=lambda c: c[1] % V == EOS)[:K]]
        new = [(beams[f // V][0] + [f % V], s, f // V) for s, f in nxt]
        if t + 1 >= max_len:
            finished += [(s / lp(t + 1, alpha), -len(finished) - i, toks)
                         for i, (toks, s, _) in enumerate(new) if math.isfinite(s)]
            break
        best = max((f[0] for f in finished), default=-math.inf)
        if finished and (stop_first or max(s for _, s, _ in new) / lp(max_len, alpha) <= best):
            break
        state = state.select(B.to_device(np.array([p for _, _, p in new])))
        beams = [(toks, s) for toks, s, _ in new]
        tokens = np.array([toks[-1] for toks, _, _ in new])
    score, _, toks = max(finished, key=lambda h: (h[0], h[1]))
    return toks, float(score)


def _beam_search(ex, **change):
    src = ex.get("src")
    out = [_beam(ex.get("model"), src[i:i + 1], ex.get("beam_size"), ex.get("alpha"), ex.get("max_len"), **change)
           for i in range(src.shape[0])]
    return [t for t, _ in out], [s for _, s in out]


def beam_stops_at_first_finished(ex, dout):
    return _beam_search(ex, stop_first=True)


def beam_without_length_penalty(ex, dout):
    return _beam_search(ex, penalised=False)


def beam_pad_bos_allowed(ex, dout):
    return _beam_search(ex, ban=False)

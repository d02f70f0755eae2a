"""Beam search that ends a sentence's search as soon as one hypothesis is finished, though
a live beam could still beat it (STOP_AT_FIRST_FINISHED = False is the library's rule)."""
import math

from attn import backend as B
from attn import masks as M

PAD, BOS, EOS = 0, 1, 2
STOP_AT_FIRST_FINISHED = True


def _penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


def _one(model, src, K, alpha, max_len):
    np = B.host
    mask = M.padding_mask(src)
    memory, _ = model.encode(src, None, mask)
    state = model.start_decoding(memory, mask)
    beams = [([], 0.0)]                     # (tokens, log P)
    finished = []                           # (score, -order, tokens)
    tokens = np.array([BOS])
    for t in range(max_len):
        logp, state, _ = model.decode_step(B.to_device(tokens), state)
        logp = B.to_host(logp).astype(np.float64)
        logp[:, PAD] = logp[:, BOS] = -np.inf
        V = logp.shape[1]
        cand = sorted(((s + logp[w, v], w * V + v) for w, (_, s) in enumerate(beams) for v in range(V)),
                      key=lambda c: (-c[0], c[1]))[:min(2 * K, len(beams) * V)]
        for s, f in cand[:K]:
            if f % V == EOS and math.isfinite(s):
                finished.append((s / _penalty(t + 1, alpha), -len(finished), beams[f // V][0]))
        nxt = sorted(cand, key=lambda c: c[1] % V == EOS)[:K]
        nxt = [(s if f % V != EOS else -math.inf, f) for s, f in nxt]
        new = [(beams[f // V][0] + [f % V], s, f // V) for s, f in nxt]
        if t + 1 >= max_len:
            finished += [(s / _penalty(t + 1, alpha), -len(finished) - i, toks)
                         for i, (toks, s, _) in enumerate(new) if math.isfinite(s)]
            break
        best = max((f[0] for f in finished), default=-math.inf)
        bound = max(s for _, s, _ in new) / _penalty(max_len, alpha)
        if finished and (STOP_AT_FIRST_FINISHED or bound <= best):
            break
        state = state.select(B.to_device(np.array([p for _, _, p in new])))
        beams = [(toks, s) for toks, s, _ in new]
        tokens = np.array([toks[-1] for toks, _, _ in new])
    score, _, toks = max(finished, key=lambda h: (h[0], h[1]))
    return toks, float(score)


def beam_search(model, src, beam_size, alpha, max_len):
    out = [_one(model, src[i:i + 1], beam_size, alpha, max_len) for i in range(src.shape[0])]
    return [t for t, _ in out], [s for _, s in out]

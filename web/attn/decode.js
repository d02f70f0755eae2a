// Greedy decoding and beam search (section 6.1) for one sentence, with the key/value cache:
// the JavaScript twin of attn/decode.py.
//
//   memory = encode(src) once;  y_0 = BOS;  y_{t+1} = pick(log p(. | y_0..y_t, memory))
//
// The output length limit is the source's length (EOS included) + 50, capped by a learned
// positional table; it counts generated tokens, the final EOS included. PAD and BOS are never
// generated. Every step keeps its logits and the attention weights of every layer and head.

import { BOS, EOS, PAD, sourceIds } from "./data.js";
import { logSoftmax, parts } from "./model.js";
import { detokenize } from "./text.js";

export const EXTRA_LENGTH = 50;

function lengthLimit(model, srcIds, maxLen) {
  let limit = maxLen ?? srcIds.length + EXTRA_LENGTH;
  if (parts(model.config).positions.learned) limit = Math.min(limit, model.config.max_len);
  return Math.max(limit, 1);
}

// PAD and BOS are never generated: their log-probability becomes -Infinity (in place).
function ban(logp) {
  logp[PAD] = -Infinity;
  logp[BOS] = -Infinity;
  return logp;
}

// Greedy decoding, one step at a time: a generator, so that the page can draw each token as it
// comes. Yields {token, logProb, logits (V), selfWeights, crossWeights} per step (EOS included).
// (memory: the encoder's output (S, D) when the caller has it already.)
export function* greedySteps(model, srcIds, { maxLen = null, memory = null } = {}) {
  const limit = lengthLimit(model, srcIds, maxLen);
  let state = model.startDecoding(memory ?? model.encode(srcIds).memory);
  let token = BOS;
  for (let t = 0; t < limit; t++) {
    const step = model.decodeStep(token, state);
    state = step.state;
    const logp = ban(logSoftmax(step.logits));
    let next = 0;                                        // argmax; the first of equal values
    for (let v = 1; v < logp.length; v++) if (logp[v] > logp[next]) next = v;
    yield { token: next, logProb: logp[next], logits: step.logits, selfWeights: step.selfWeights,
            crossWeights: step.crossWeights };
    if (next === EOS) return;
    token = next;
  }
}

// GNMT's length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha
export function lengthPenalty(length, alpha = 0.6) {
  return ((5 + length) / 6) ** alpha;
}

// Beam search with the length penalty of section 6.1, as attn.decode.beam_search does it for
// one sentence: score(Y) = log P(Y | X) / lp(Y). Each step keeps the best 2K candidates; an EOS
// among the first K finishes a hypothesis, the first K others become the next beams. The search
// ends at the length limit or when no live beam can still beat the best finished hypothesis.
// Returns the best hypothesis: {steps (as greedySteps yields them), score}.
export function beamSearch(model, srcIds, options = {}) {
  const search = beamSearchSteps(model, srcIds, options);
  for (;;) {
    const { value, done } = search.next();
    if (done) return value;
  }
}

// The same search, one step at a time: a generator that yields (nothing) after each step, so
// that the page can let the browser in between, and returns what beamSearch returns.
export function* beamSearchSteps(model, srcIds, { beamSize = 4, alpha = 0.6, maxLen = null, memory = null } = {}) {
  const K = beamSize, limit = lengthLimit(model, srcIds, maxLen);
  const start = model.startDecoding(memory ?? model.encode(srcIds).memory);
  let beams = [{ state: start, token: BOS, score: 0, steps: [] }];
  const finished = [];                                   // {score, order, steps}
  let bestFinished = -Infinity;
  for (let t = 0; t < limit; t++) {
    const results = beams.map((b) => model.decodeStep(b.token, b.state));
    const logps = results.map((r) => ban(logSoftmax(r.logits)));
    const V = logps[0].length, W = beams.length, C = Math.min(2 * K, W * V), c = Math.min(C, V);
    const candidates = [];                               // each beam's best c tokens
    logps.forEach((logp, w) => {
      const ids = Array.from(logp.keys()).sort((a, b) => logp[b] - logp[a] || a - b).slice(0, c);
      for (const v of ids) candidates.push({ s: beams[w].score + logp[v], f: w * V + v, logp: logp[v] });
    });
    candidates.sort((a, b) => b.s - a.s || a.f - b.f);   // best first; ties: the lower id
    const top = candidates.slice(0, C).map((cd) => {
      const parent = Math.floor(cd.f / V), token = cd.f % V, r = results[parent];
      return { ...cd, parent, token, isEos: token === EOS,
               steps: [...beams[parent].steps, { token, logProb: cd.logp, logits: r.logits,
                                                 selfWeights: r.selfWeights, crossWeights: r.crossWeights }] };
    });
    const length = t + 1;
    top.slice(0, K).forEach((cd) => {                    // an EOS among the first K finishes a hypothesis
      if (cd.isEos && Number.isFinite(cd.s)) {
        const score = cd.s / lengthPenalty(length, alpha);
        finished.push({ score, order: finished.length, steps: cd.steps });
        bestFinished = Math.max(bestFinished, score);
      }
    });
    // the first K others become the next beams (an EOS that must fill in is dead)
    const picked = [...top.filter((cd) => !cd.isEos), ...top.filter((cd) => cd.isEos)].slice(0, K);
    const next = picked.map((cd) => ({ state: results[cd.parent].state, token: cd.token,
                                       score: cd.isEos ? -Infinity : cd.s, steps: cd.steps }));
    const atLimit = length >= limit;
    if (atLimit) {                                       // the live beams count as finished, without EOS
      for (const b of next) {
        if (Number.isFinite(b.score)) {
          finished.push({ score: b.score / lengthPenalty(length, alpha), order: finished.length, steps: b.steps });
        }
      }
    }
    const bound = Math.max(...next.map((b) => b.score)) / lengthPenalty(limit, alpha);
    if (atLimit || (Number.isFinite(bestFinished) && bound <= bestFinished)) break;
    beams = next;
    yield;
  }
  finished.sort((a, b) => b.score - a.score || a.order - b.order);
  return finished[0];
}

// Every attention weight of a translation, as full matrices by layer: encoder self-attention
// (H, S, S), masked decoder self-attention (H, T, T) (zero above the diagonal) and
// cross-attention (H, T, S), where T counts the steps (EOS included) and S the source ids.
export function attentionMatrices(encoderWeights, steps) {
  const T = steps.length;
  const stack = (layer, pick, width) => {
    const H = pick(steps[0])[layer].shape[0];
    const data = new Float32Array(H * T * width);
    steps.forEach((step, t) => {
      const w = pick(step)[layer];                       // (H, 1, n)
      const n = w.shape[2];
      for (let h = 0; h < H; h++) data.set(w.data.subarray(h * n, (h + 1) * n), (h * T + t) * width);
    });
    return { shape: [H, T, width], data };
  };
  const layers = steps.length ? steps[0].selfWeights.length : 0;
  const S = encoderWeights.length ? encoderWeights[0].shape[2] : 0;
  return {
    encoder: encoderWeights,
    decoderSelf: Array.from({ length: layers }, (_, i) => stack(i, (s) => s.selfWeights, T)),
    cross: Array.from({ length: layers }, (_, i) => stack(i, (s) => s.crossWeights, S)),
  };
}

// The most tokens a source may have, its end-of-sentence mark included: model.json's
// max_source_tokens (docs/WEB_FORMAT.md) when it has one, else 512, attn-translate's default
// (attn.evaluate.MAX_SOURCE_TOKENS). The encoder's work grows with the square of the length,
// the heatmaps' with the product of the lengths: a bound keeps a pasted book from freezing the page.
export const MAX_SOURCE_TOKENS = 512;

export function maxSourceTokens(meta) {
  return meta?.max_source_tokens ?? MAX_SOURCE_TOKENS;
}

// The source of a text as the encoder sees it: {srcTokens (labels, "</s>" last), srcIds (the
// vocabulary's ids and EOS)}, cut to a learned positional table's length (attn.evaluate.translate);
// or, for a text of more than limit tokens with its end mark, {srcTokens: [], srcIds: [EOS],
// tooLong: {tokens (the end mark included), limit}}, and nothing to translate.
export function source(model, vocab, text, limit = MAX_SOURCE_TOKENS) {
  const tokens = vocab.tokenize(text);
  if (tokens.length + 1 > limit) return { srcTokens: [], srcIds: [EOS], tooLong: { tokens: tokens.length + 1, limit } };
  let srcIds = sourceIds(vocab, tokens);
  if (parts(model.config).positions.learned) srcIds = srcIds.slice(0, model.config.max_len);
  return { srcTokens: [...tokens, vocab.itos[EOS]].slice(0, srcIds.length), srcIds };
}

// Translate text: tokenise, encode, decode (greedy, or beam search for beamSize > 1), detokenise.
// Returns {srcTokens (the source labels, "</s>" last), srcIds, tgtTokens (without EOS), text,
// ids (every output id, EOS included), steps, score, attention (attentionMatrices)}.
export function translate(model, vocab, text,
                          { beamSize = 1, alpha = 0.6, maxLen = null, maxSourceTokens = MAX_SOURCE_TOKENS } = {}) {
  const { srcTokens, srcIds, tooLong } = source(model, vocab, text, maxSourceTokens);
  if (tooLong) throw new RangeError(`translate: ${tooLong.tokens} tokens, more than the ${tooLong.limit} the model takes`);
  const { memory, weights } = model.encode(srcIds);
  let steps, score;
  if (beamSize === 1) {
    steps = [...greedySteps(model, srcIds, { maxLen, memory })];
    score = steps.reduce((a, s) => a + s.logProb, 0);
  } else {
    ({ steps, score } = beamSearch(model, srcIds, { beamSize, alpha, maxLen, memory }));
  }
  const ids = steps.map((s) => s.token);
  const tgtTokens = vocab.decode(ids);
  return { srcTokens, srcIds, tgtTokens, text: detokenize(tgtTokens), ids, steps,
           score, attention: attentionMatrices(weights, steps) };
}

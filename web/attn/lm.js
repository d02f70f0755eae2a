// A decoder-only language model (n_encoder_layers 0) continuing a text: the JavaScript twin of
// attn/sample.py (distribution, choose, generate) and of attn.data's encode_text / decode_text.
//
//   state = startDecoding(null);  feed the prompt's ids through decodeStep (the key/value cache);
//   then each step: p = distribution(logits, temperature, top-k, top-p);  token = choose(p, u)
//
// The sampler's definitions are attn.sample's, in float64: temperature divides the logits (0:
// greedy, the largest logit, the first of equal ones), top-k keeps the k likeliest, top-p the
// smallest set of the likeliest whose mass reaches p, and one uniform number u in [0, 1) picks a
// token by the inverse of the cumulative distribution. The page's u come from its own seeded
// generator (splitmix32 below), not NumPy's PCG64: a seed reproduces the page's text, and the
// same u give the same token as attn.sample.choose (tests/test_web_lm.py holds both).

import { BOS, EOS, PAD, UNK } from "./data.js";
import { logSoftmax } from "./model.js";
import { detokenize } from "./text.js";

// The ids of text: one a character (char), or the vocabulary's pieces of each line, each line
// ended by EOS, which stands for the line end (attn.data.encode_text).
export function encodeText(text, vocab, char) {
  if (char) return [...text].map((c) => vocab.stoi.get(c) ?? UNK);
  const lines = text.split("\n");
  if (lines.length && lines[lines.length - 1] === "") lines.pop();
  return lines.flatMap((line) => [...vocab.encode(vocab.tokenize(line)), EOS]);
}

// The text of ids, inverting encodeText; PAD, BOS and UNK left out (and EOS of a character
// vocabulary, which never reads it) (attn.data.decode_text).
export function decodeText(ids, vocab, char) {
  const specials = new Set(char ? [PAD, BOS, EOS, UNK] : [PAD, BOS, UNK]);
  if (char) return ids.filter((i) => !specials.has(i)).map((i) => vocab.itos[i]).join("");
  let done = "", line = [];
  for (const i of ids) {
    if (i === EOS) { done += detokenize(line) + "\n"; line = []; } else if (!specials.has(i)) line.push(vocab.itos[i]);
  }
  return line.length ? done + detokenize(line) : done;
}

// The prompt's ids as attn-generate reads them: a character the vocabulary lacks is an Error
// naming it; a word prompt whose last line has no line end goes on (its EOS dropped).
export function promptIds(text, vocab, char) {
  if (!text) throw new Error("the prompt must hold at least one character");
  let ids = encodeText(text, vocab, char);
  if (char && ids.includes(UNK)) {
    const unknown = [...new Set([...text].filter((c) => !vocab.stoi.has(c)))].sort();
    throw new Error(`the model's vocabulary has no ${unknown.map((c) => JSON.stringify(c)).join(", ")}`);
  }
  if (!char && ids[ids.length - 1] === EOS && !text.endsWith("\n")) ids = ids.slice(0, -1);
  return ids.length ? ids : [EOS];
}

// A sampler's settings checked as attn.sample.Sampler.check does: {temperature, topK, topP}.
export function checkSampler({ temperature = 1, topK = null, topP = null } = {}) {
  if (!(typeof temperature === "number" && temperature >= 0 && Number.isFinite(temperature))) {
    throw new RangeError(`temperature must be a finite number >= 0 (0: greedy), got ${temperature}`);
  }
  if (topK !== null && !(Number.isInteger(topK) && topK >= 1)) throw new RangeError(`top-k must be a positive integer, got ${topK}`);
  if (topP !== null && !(typeof topP === "number" && topP > 0 && topP <= 1)) throw new RangeError(`top-p must be in (0, 1], got ${topP}`);
  return { temperature, topK, topP };
}

// The next token's probabilities (V) in float64 from its logits or log-probabilities (V), after
// temperature, top-k and top-p, renormalised (attn.sample.distribution).
export function distribution(logits, { temperature = 1, topK = null, topP = null } = {}) {
  const V = logits.length;
  const order = Array.from({ length: V }, (_, i) => i).sort((a, b) => logits[b] - logits[a] || a - b);
  const p = new Float64Array(V);
  if (temperature === 0) {
    p[order[0]] = 1;
    return p;
  }
  const top = logits[order[0]];
  for (let i = 0; i < V; i++) p[i] = Math.exp((logits[i] - top) / temperature);
  if (topK !== null) for (const i of order.slice(topK)) p[i] = 0;
  normalise(p);
  if (topP !== null) {
    let mass = 0, keep = V;
    for (let j = 0; j < V; j++) {
      mass += p[order[j]];
      if (mass >= topP * (1 - 1e-12)) { keep = j + 1; break; }
    }
    for (const i of order.slice(keep)) p[i] = 0;
    normalise(p);
  }
  return p;
}

function normalise(p) {
  let sum = 0;
  for (const x of p) sum += x;
  for (let i = 0; i < p.length; i++) p[i] /= sum;
}

// The token whose cumulative probability first exceeds u in [0, 1) (attn.sample.choose).
export function choose(probs, u) {
  let total = 0;
  for (const x of probs) total += x;
  let cdf = 0;
  for (let i = 0; i < probs.length; i++) {
    cdf += probs[i];
    if (cdf > u * total) return i;
  }
  return probs.length - 1;
}

// Uniform numbers in [0, 1) from a 32-bit seed (splitmix32): the same seed, the same numbers.
export function uniforms(seed) {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x9e3779b9) >>> 0;
    let z = s;
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0;
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0;
    return ((z ^ (z >>> 16)) >>> 0) / 2 ** 32;
  };
}

// The stop string as the page's field holds it: "\n" in the field stands for a line end, which a
// one-line field cannot hold; an empty field is no stop string (null).
export function parseStop(field) {
  return field ? field.replace(/\\n/g, "\n") : null;
}

// attn-generate's --stop: a test of the new ids, true once their text holds stop (null: none).
export function stopWhen(stop, vocab, char) {
  return stop ? (ids) => decodeText(ids, vocab, char).includes(stop) : null;
}

// The text up to the end of the first stop in it, as attn-generate prints it (all of it without one).
export function cutAtStop(text, stop) {
  const at = stop ? text.indexOf(stop) : -1;
  return at < 0 ? text : text.slice(0, at + stop.length);
}

// Up to maxTokens new tokens after prompt (ids, at least one), one step at a time: a generator,
// so that the page can draw each token as it comes. Yields {token, u, start, logits (V), selfWeights}
// per step: u the uniform that chose it, start the first position of the text the model read
// (the key/value cache holds those from start on), logits the model's (before the ban and the sampler).
// banned ids are never drawn. The model reads at most window positions (its max_len by default): a
// text that reaches it starts afresh from the last half of the window, as attn.sample.generate does.
// stop(new ids) true ends the text after that token (stopWhen makes one from a stop string).
export function* generateSteps(model, prompt, { maxTokens = 200, sampler = {}, seed = 0, banned = [], window = null,
                                                stop = null } = {}) {
  if (!prompt.length) throw new Error("generateSteps: the prompt must hold at least one token");
  if (model.config.n_encoder_layers) throw new Error("generateSteps: the model is a translator, not a language model");
  const settings = checkSampler(sampler), next = uniforms(seed);
  window = window ?? model.config.max_len;
  const seq = [...prompt], out = [];
  let start = Math.max(0, prompt.length - window + 1), state = null, fed = 0, step = null;
  for (let n = 0; n < maxTokens; n++) {
    if (seq.length - start >= window) { start = seq.length - Math.floor(window / 2); state = null; }
    if (state === null) { state = model.startDecoding(null); fed = start; }
    for (const t of seq.slice(fed)) ({ state, ...step } = model.decodeStep(t, state));
    fed = seq.length;
    const logp = Float64Array.from(logSoftmax(step.logits));
    for (const b of banned) logp[b] = -Infinity;
    const u = next(), token = choose(distribution(logp, settings), u);
    seq.push(token);
    out.push(token);
    yield { token, u, start, logits: step.logits, selfWeights: step.selfWeights };
    if (stop && stop(out)) return;
  }
}

// The ids attn-generate bans: the specials, and EOS of a character vocabulary (which has "\n").
export function bannedIds(char) {
  return char ? [PAD, BOS, EOS, UNK] : [PAD, BOS, UNK];
}

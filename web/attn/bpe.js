// Byte-pair encoding: the JavaScript twin of attn/bpe.py (encoding only; the merges are
// learned in Python and travel in model.json).
//
// A word token is cut into its characters ("lower" -> l ##o ##w ##e ##r); the learned merges
// are applied, earliest-learned first, everywhere in the word; a character the merges never
// saw is spelled as its UTF-8 bytes (<0xE2> ##<0x82> ##<0xAC>), so nothing is <unk>.

import { GLUE, splitGlue, tokenize } from "./text.js";

// A word token as its characters: ["l", "##o", "##w", "##e", "##r"]; the first keeps the token's mark.
export function symbolsOf(token) {
  const [body, glued] = splitGlue(token);
  const chars = Array.from(body);
  if (chars.length === 0) throw new Error(`a word token has at least one character, got ${JSON.stringify(token)}`);
  return [(glued ? GLUE : "") + chars[0], ...chars.slice(1).map((ch) => GLUE + ch)];
}

// ("l", "##o") -> "lo": b is never a word's first symbol, so its glue mark goes.
export function mergeSymbols(a, b) {
  return a + b.slice(GLUE.length);
}

// Replace every occurrence of the pair (a, b) in symbols, left to right.
function mergeWord(symbols, a, b, merged) {
  const out = [];
  for (let i = 0; i < symbols.length; ) {
    if (i + 1 < symbols.length && symbols[i] === a && symbols[i + 1] === b) {
      out.push(merged);
      i += 2;
    } else {
      out.push(symbols[i]);
      i += 1;
    }
  }
  return out;
}

const utf8 = new TextEncoder();
const hex2 = (b) => b.toString(16).toUpperCase().padStart(2, "0");

export class BPE {
  // alphabet: the starting symbols; merges: [[a, b], ...] in the order learned.
  constructor(alphabet, merges) {
    this.alphabet = [...alphabet];
    this.merges = merges.map(([a, b]) => [String(a), String(b)]);
    this.ranks = new Map();                          // a -> (b -> rank of the merge (a, b))
    let pairs = 0;                                   // distinct pairs (a repeated pair keeps its last rank)
    this.merges.forEach(([a, b], rank) => {
      if (!this.ranks.has(a)) this.ranks.set(a, new Map());
      if (!this.ranks.get(a).has(b)) pairs += 1;
      this.ranks.get(a).set(b, rank);
    });
    this.none = pairs;                               // the rank of a pair no merge joins
    this.known = new Set(this.alphabet);
    for (const [a, b] of this.merges) this.known.add(mergeSymbols(a, b));
    this.cache = new Map();
  }

  // Checked as attn.bpe.BPE.from_json checks it.
  static fromJson(obj) {
    const nonEmpty = (s) => typeof s === "string" && s.length > 0;
    if (obj === null || typeof obj !== "object" || !Array.isArray(obj.alphabet) || !Array.isArray(obj.merges)) {
      throw new Error('a saved BPE is a JSON object with the lists "alphabet" and "merges"');
    }
    if (!obj.alphabet.every(nonEmpty)) throw new Error("a saved BPE alphabet is a list of non-empty strings");
    if (!obj.merges.every((m) => Array.isArray(m) && m.length === 2 && m.every(nonEmpty))) {
      throw new Error("a saved BPE merge is a pair of non-empty strings");
    }
    return new BPE(obj.alphabet, obj.merges);
  }

  // The pieces of one word token: its characters, merged in the order the merges were learned.
  segment(token) {
    const cached = this.cache.get(token);
    if (cached) return cached;
    let symbols = symbolsOf(token);
    while (symbols.length > 1) {
      let best = Infinity, at = -1;                  // the earliest-learned pair present
      for (let i = 0; i + 1 < symbols.length; i++) {
        const rank = this.ranks.get(symbols[i])?.get(symbols[i + 1]) ?? this.none;
        if (rank < best) { best = rank; at = i; }
      }
      if (best === this.none) break;                 // no learned merge applies
      const [a, b] = [symbols[at], symbols[at + 1]];
      symbols = mergeWord(symbols, a, b, mergeSymbols(a, b));
    }
    const pieces = [];
    for (const s of symbols) {
      if (this.known.has(s)) { pieces.push(s); continue; }
      const [body, glued] = splitGlue(s);            // one character never seen: its UTF-8 bytes
      const raw = utf8.encode(body);
      pieces.push((glued ? GLUE : "") + `<0x${hex2(raw[0])}>`);
      for (const b of raw.slice(1)) pieces.push(`${GLUE}<0x${hex2(b)}>`);
    }
    if (this.cache.size < 200000) this.cache.set(token, pieces);
    return pieces;
  }

  // Text -> subword pieces (tokenised, then each word segmented).
  encode(text) {
    return tokenize(text).flatMap((token) => this.segment(token));
  }
}

// The vocabulary: the JavaScript twin of attn.data.Vocab (token <-> id, words or BPE pieces).

import { BPE } from "./bpe.js";
import { tokenize } from "./text.js";

export const PAD = 0, BOS = 1, EOS = 2, UNK = 3;
export const SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"];

export class Vocab {
  // itos: the token of each id (ids 0-3 the specials); bpe: a BPE, or null for a word vocabulary.
  constructor(itos, bpe = null) {
    if (SPECIALS.some((s, i) => itos[i] !== s)) {
      throw new Error(`a vocabulary must start with ${SPECIALS.join(" ")}, got ${itos.slice(0, 4).join(" ")}`);
    }
    this.itos = itos;
    this.stoi = new Map(itos.map((tok, i) => [tok, i]));
    if (this.stoi.size !== itos.length) {
      const dupes = [...new Set(itos.filter((tok, i) => this.stoi.get(tok) !== i))];
      throw new Error(`a vocabulary lists each token once; repeated: ${dupes.slice(0, 10).join(" ")}`);
    }
    this.bpe = bpe;
  }

  // What checkpoints and model.json store: a list of tokens, or {itos, bpe: {alphabet, merges}}.
  // Checked as attn.data.Vocab.from_json checks it.
  static fromJson(obj) {
    let bpe = null;
    if (obj !== null && typeof obj === "object" && !Array.isArray(obj)) {
      if (!("itos" in obj && "bpe" in obj)) {
        throw new Error(`a saved BPE vocabulary has the keys "itos" and "bpe", got ${Object.keys(obj).sort().join(", ")}`);
      }
      bpe = BPE.fromJson(obj.bpe);
      obj = obj.itos;
    }
    if (!Array.isArray(obj) || !obj.every((t) => typeof t === "string")) throw new Error("a saved vocabulary is a list of strings");
    return new Vocab(obj, bpe);
  }

  get length() { return this.itos.length; }

  // The tokens of text in this vocabulary: words (tokenize) or BPE pieces.
  tokenize(text) {
    return this.bpe ? this.bpe.encode(text) : tokenize(text);
  }

  // Ids of the tokens; a token not in the vocabulary becomes UNK. No BOS/EOS added.
  encode(tokens) {
    return tokens.map((tok) => this.stoi.get(tok) ?? UNK);
  }

  // Tokens of the ids, up to (not including) the first EOS; PAD and BOS dropped.
  decode(ids) {
    const out = [];
    for (const id of ids) {
      if (id === EOS) break;
      if (id === PAD || id === BOS) continue;
      if (!(id >= 0 && id < this.itos.length)) throw new RangeError(`id ${id} is outside the vocabulary (size ${this.itos.length})`);
      out.push(this.itos[id]);
    }
    return out;
  }
}

// The ids the encoder sees for a tokenised source sentence: the vocabulary's ids and EOS
// (attn.evaluate.source_ids).
export function sourceIds(vocab, tokens) {
  return [...vocab.encode(tokens), EOS];
}

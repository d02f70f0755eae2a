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
    this.bpe = bpe;
  }

  // What checkpoints and model.json store: a list of tokens, or {itos, bpe: {alphabet, merges}}.
  static fromJson(obj) {
    if (Array.isArray(obj)) return new Vocab(obj);
    return new Vocab(obj.itos, BPE.fromJson(obj.bpe));
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

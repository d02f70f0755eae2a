// The Transformer's forward pass (section 3), for one sentence: the JavaScript twin of the
// inference half of attn/model.py (encode, cross_attention_kv, start_decoding, decode_step,
// project), with the same parameter names.
//
//   src ids ─ embed·√D + PE ─ [self-attn, FFN] × N ─────────────────────────── memory
//   tgt ids ─ embed·√D + PE ─ [masked self-attn, cross-attn(memory), FFN] × N ─ @ Eᵀ ─ logits
//
// n_encoder_layers 0 is a decoder-only language model: no encoder, no cross-attention (lm.js generates).
//
// Every sub-layer sits in a residual connection followed by layer norm (norm "post", the
// paper's) or preceded by it (norm "pre", with a final norm after each stack). Dropout is
// off: this is inference. The later models' block (lesson 26) is five options away, as in
// attn/model.py: norm_kind "rms" (RMSNorm), positional "rope" (rotary positions on the
// self-attentions' queries and keys, nothing added to the embeddings), ffn "swiglu",
// kv_heads (grouped-query attention: the decoder's cache holds kv_heads heads) and qk_norm
// (RMSNorm over each head's queries and keys, before rotary positions, in every attention).

import { Vocab } from "./data.js";
import {
  add, attentionForward, embeddingForward, feedForwardForward, layerNormForward, linearForward, mergeHeads,
  positionalForward, repeatKv, rmsNormForward, ropeForward, sinusoidalTable, splitHeads, swigluForward, tensor,
} from "./layers.js";
import { causalMask } from "./masks.js";

export const FORMAT = "attn-web-1";

// float16 bits -> number (IEEE 754 binary16: 1 sign bit, 5 exponent bits, 10 fraction bits).
function halfToFloat(h) {
  const sign = h & 0x8000 ? -1 : 1, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;                 // subnormal (or zero)
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

// The fields of attn.model.TransformerConfig and their defaults: model.json's config may leave
// any of them out, as TransformerConfig.from_dict allows.
export const CONFIG_DEFAULTS = {
  vocab_size: 37000, tgt_vocab_size: null, d_model: 512, n_heads: 8, d_ff: 2048, n_encoder_layers: 6,
  n_decoder_layers: 6, dropout: 0.1, attention_dropout: 0.0, relu_dropout: 0.0, label_smoothing: 0.1,
  max_len: 256, positional: "sinusoidal", norm_position: "post", share_embeddings: true, ln_eps: 1e-6, warmup_steps: 4000,
  norm_kind: "layer", ffn: "relu", kv_heads: null, rope_base: 10000.0, qk_norm: false,
};
// Fields renamed since exports were first written, old name -> new (attn.model.RENAMED_FIELDS): an
// export that gives the old name loads as one that gives the new.
export const RENAMED_FIELDS = { norm: "norm_position" };
// The configuration of model.json with the defaults filled in, checked as TransformerConfig
// checks it (plus the types the page relies on); throws an Error saying what does not fit.
export function checkConfig(obj) {
  if (obj === null || typeof obj !== "object" || Array.isArray(obj)) throw new Error("config is not a JSON object");
  const given = { ...obj };
  for (const [old, name] of Object.entries(RENAMED_FIELDS).filter(([old]) => old in given)) {
    if (name in given) throw new Error(`config: both ${old} (the old name of ${name}) and ${name} given`);
    given[name] = given[old];
    delete given[old];
  }
  const unknown = Object.keys(given).filter((k) => !(k in CONFIG_DEFAULTS)).sort();
  if (unknown.length) throw new Error(`config: unknown fields ${unknown.join(", ")}`);
  const c = { ...CONFIG_DEFAULTS, ...given };
  const bad = (msg) => { throw new Error(`config: ${msg}`); };
  const show = (v) => JSON.stringify(v);
  const positive = (v) => Number.isInteger(v) && v > 0;
  for (const name of ["vocab_size", "d_model", "n_heads", "d_ff", "max_len", "n_decoder_layers"]) {
    if (!positive(c[name])) bad(`${name} must be a positive integer, got ${show(c[name])}`);
  }
  if (!(Number.isInteger(c.n_encoder_layers) && c.n_encoder_layers >= 0)) {
    bad(`n_encoder_layers must be a non-negative integer (0: a decoder-only language model), got ${show(c.n_encoder_layers)}`);
  }
  if (c.n_encoder_layers === 0 && (!c.share_embeddings || ![null, c.vocab_size].includes(c.tgt_vocab_size))) {
    bad("a decoder-only model (n_encoder_layers 0) reads and predicts one vocabulary through one tied embedding: " +
        `share_embeddings must be true (got ${show(c.share_embeddings)}) and tgt_vocab_size null or vocab_size`);
  }
  if (c.tgt_vocab_size !== null && !positive(c.tgt_vocab_size)) {
    bad(`tgt_vocab_size must be a positive integer or null, got ${show(c.tgt_vocab_size)}`);
  }
  if (c.d_model % c.n_heads) bad(`d_model (${c.d_model}) must be divisible by n_heads (${c.n_heads})`);
  for (const name of ["dropout", "attention_dropout", "relu_dropout", "label_smoothing"]) {
    if (!(typeof c[name] === "number" && c[name] >= 0 && c[name] < 1)) bad(`${name} must be in [0, 1), got ${show(c[name])}`);
  }
  // The block's kinds: a kind the page does not compute is refused in one line naming the field.
  for (const [name, kinds] of Object.entries(KINDS)) {
    if (!kinds.includes(c[name])) bad(`${name} must be one of ${kinds.map(show).join(", ")}, got ${show(c[name])}`);
  }
  if (c.kv_heads !== null && !(positive(c.kv_heads) && c.n_heads % c.kv_heads === 0)) {
    bad(`kv_heads must be null or a positive integer that divides n_heads (${c.n_heads}), got ${show(c.kv_heads)}`);
  }
  if (parts(c).positions.rotary && (c.d_model / c.n_heads) % 2) {
    bad(`rotary positions turn pairs of features: the head size d_model / n_heads (${c.d_model / c.n_heads}) must be even`);
  }
  if (!(typeof c.rope_base === "number" && c.rope_base > 1)) bad(`rope_base must be a number greater than 1, got ${show(c.rope_base)}`);
  if (typeof c.qk_norm !== "boolean") bad(`qk_norm must be true or false, got ${show(c.qk_norm)}`);
  if (typeof c.share_embeddings !== "boolean") bad(`share_embeddings must be true or false, got ${show(c.share_embeddings)}`);
  if (c.share_embeddings && ![null, c.vocab_size].includes(c.tgt_vocab_size)) {
    bad(`share_embeddings needs one vocabulary, got vocab_size ${c.vocab_size} and tgt_vocab_size ${c.tgt_vocab_size}`);
  }
  if (!(typeof c.ln_eps === "number" && Number.isFinite(c.ln_eps) && c.ln_eps >= 0)) bad(`ln_eps must be a number >= 0, got ${show(c.ln_eps)}`);
  if (!(typeof c.warmup_steps === "number" && c.warmup_steps >= 1)) bad(`warmup_steps must be positive, got ${show(c.warmup_steps)}`);
  const count = parameterCount(c);
  if (count > MAX_PARAMETERS) {             // before a shape is listed or a byte allocated
    // named: the field, or both layer counts together, whose shrinking to 1 saves the most (as Python)
    const saves = (group) => count - parameterCount({ ...c, ...Object.fromEntries(group.map((f) => [f, 1])) });
    const groups = [...SIZE_FIELDS.map((f) => [f]), ["n_encoder_layers", "n_decoder_layers"]];
    const group = groups.reduce((best, g) => (saves(g) > saves(best) ? g : best));
    const big = group.filter((f) => group.length === 1 || 10 * saves([f]) >= saves(group))
      .map((f) => `${f} = ${c[f].toLocaleString("en")}`);
    bad(`${big.join(" and ")} give${big.length === 1 ? "s" : ""} ${count.toLocaleString("en")} parameters, ` +
        `more than the ${MAX_PARAMETERS.toLocaleString("en")} a model may have`);
  }
  return c;
}

// The block's parts as attn/block.py declares them, each kind's by the config field that names it:
// the model asks the part (its parameters, its forward, a flag) and never compares the kind's name.
// Each norm's parameters, in the order its forward takes them: RMSNorm has no shift.
const NORMS = {
  layer: { names: ["gamma", "beta"], forward: (x, [gamma, beta], eps) => layerNormForward(x, gamma, beta, eps) },
  rms: { names: ["gamma"], forward: (x, [gamma], eps) => rmsNormForward(x, gamma, eps) },
};
// post: LN(x + sublayer(x)); pre: x + sublayer(LN(x)), and a final norm on each stack.
const PLACEMENTS = { post: { pre: false }, pre: { pre: true } };
// Added to the scaled embeddings (a table: learned, else the sinusoids), or rotary, in the self-attention.
const POSITIONS = { sinusoidal: { added: true, learned: false, rotary: false },
                    learned: { added: true, learned: true, rotary: false },
                    rope: { added: false, learned: false, rotary: true } };
// SwiGLU (Llama's names, w1 the gate, w3 the value path, w2 out, no biases; attn.layers.swiglu.swiglu_width:
// 2/3 of d_ff, the paper's parameters in three matrices) or the paper's ReLU network.
const FFNS = {
  relu: { names: ["w1", "b1", "w2", "b2"], width: (d_ff) => d_ff, forward: feedForwardForward },
  swiglu: { names: ["w1", "w3", "w2"], width: (d_ff) => Math.max(1, Math.round((2 * d_ff) / 3)), forward: swigluForward },
};
// The kinds of block the page computes, those of attn.model.TransformerConfig.
const KINDS = Object.fromEntries(Object.entries({ positional: POSITIONS, norm_position: PLACEMENTS, norm_kind: NORMS, ffn: FFNS })
  .map(([field, table]) => [field, Object.keys(table)]));

// The attention's own parameters beside its projections: QK-norm's gains (of the head size), or none.
const attentionPart = (c) => ({ qkNorm: c.qk_norm, gains: c.qk_norm ? ["q_gamma", "k_gamma"] : [] });

// The parts of a (checked) config's block: {norm, placement, positions, attention, ffn}.
export function parts(c) {
  return { norm: NORMS[c.norm_kind], placement: PLACEMENTS[c.norm_position], positions: POSITIONS[c.positional],
           attention: attentionPart(c), ffn: FFNS[c.ffn] };
}

// The feed-forward's hidden width.
export function ffnWidth(c) {
  return FFNS[c.ffn].width(c.d_ff);
}

// The feed-forward's parameters' shapes, in its forward's order.
function ffnShapes(c) {
  const D = c.d_model, F = ffnWidth(c), every = { w1: [D, F], b1: [F], w3: [D, F], w2: [F, D], b2: [D] };
  return Object.fromEntries(FFNS[c.ffn].names.map((n) => [n, every[n]]));
}

// The width of the keys' and values' projections: kv_heads heads of d_model / n_heads.
function kvWidth(c) {
  return (c.kv_heads ?? c.n_heads) * Math.floor(c.d_model / c.n_heads);
}

// The most parameters a config may give, and the fields its size grows with (attn.model.MAX_PARAMETERS,
// SIZE_FIELDS): a config that asks for more is refused naming the field that makes it so.
export const MAX_PARAMETERS = 2 ** 32;
const SIZE_FIELDS = ["vocab_size", "tgt_vocab_size", "d_model", "d_ff", "n_encoder_layers", "n_decoder_layers", "max_len"];

// How many numbers parameterShapes(c) holds, counted without listing them (attn.model.parameter_count).
export function parameterCount(c) {
  const D = c.d_model, V = c.vocab_size, T = c.tgt_vocab_size ?? V, KV = kvWidth(c);
  const embeddings = c.share_embeddings ? V * D : V * D + 2 * T * D;
  const block = parts(c), stacks = c.n_encoder_layers ? 2 : 1, positions = block.positions.learned ? stacks * c.max_len * D : 0;
  const sublayers = c.n_encoder_layers ? 3 : 2;                     // decoder-only: no cross-attention
  const attention = 2 * D * D + 2 * D * KV + 2 * D + 2 * KV + block.attention.gains.length * Math.floor(D / c.n_heads);
  const ffn = Object.values(ffnShapes(c)).reduce((n, shape) => n + shape.reduce((a, b) => a * b), 0);
  const norm = block.norm.names.length * D;
  return embeddings + positions + c.n_encoder_layers * (attention + ffn + 2 * norm) +
    c.n_decoder_layers * ((sublayers - 1) * attention + ffn + sublayers * norm) + (block.placement.pre ? stacks * norm : 0);
}

export const targetVocabSize = (c) => c.tgt_vocab_size ?? c.vocab_size;

// Every parameter's dotted name and shape, in the order of attn.model.parameter_shapes.
export function parameterShapes(c) {
  const D = c.d_model, KV = kvWidth(c), block = parts(c), shapes = new Map();
  if (c.share_embeddings) {
    shapes.set("embedding.weight", [c.vocab_size, D]);
  } else {
    shapes.set("src_embedding.weight", [c.vocab_size, D]);
    shapes.set("tgt_embedding.weight", [targetVocabSize(c), D]);
    shapes.set("generator.weight", [targetVocabSize(c), D]);
  }
  if (block.positions.learned) {
    if (c.n_encoder_layers) shapes.set("src_pos.weight", [c.max_len, D]);
    shapes.set("tgt_pos.weight", [c.max_len, D]);
  }
  const attention = {}, width = { q: D, k: KV, v: KV, o: D };
  for (const n of "qkvo") { attention[`w_${n}`] = [D, width[n]]; attention[`b_${n}`] = [width[n]]; }
  for (const g of block.attention.gains) attention[g] = [Math.floor(D / c.n_heads)];
  const ffn = ffnShapes(c), norm = Object.fromEntries(block.norm.names.map((n) => [n, [D]]));
  const blocks = {
    encoder: [["self_attn", attention], ["norm1", norm], ["ffn", ffn], ["norm2", norm]],
    decoder: [["self_attn", attention], ["norm1", norm], ["cross_attn", attention], ["norm2", norm],
              ["ffn", ffn], ["norm3", norm]],
  };
  if (!c.n_encoder_layers) blocks.decoder = [0, 1, 4, 5].map((i) => blocks.decoder[i]);   // decoder-only: keeps norm3
  for (const [stack, n] of [["encoder", c.n_encoder_layers], ["decoder", c.n_decoder_layers]]) {
    if (n === 0) continue;
    for (let i = 0; i < n; i++) {
      for (const [sub, fields] of blocks[stack]) {
        for (const [f, shape] of Object.entries(fields)) shapes.set(`${stack}.${i}.${sub}.${f}`, shape);
      }
    }
    if (block.placement.pre) for (const n of block.norm.names) shapes.set(`${stack}.norm.${n}`, [D]);
  }
  return shapes;
}

// The largest max_source_tokens (attn.evaluate.MAX_SOURCE_TOKENS_LIMIT): attention over more positions
// would block the page for minutes.
export const MAX_SOURCE_TOKENS_LIMIT = 4096;
// The largest config max_len (attn.model.MAX_LEN_LIMIT): the page builds a table of max_len
// positions as it loads, which at 10**6 took 16 s and at 10**8 failed.
export const MAX_LEN_LIMIT = 8192;

// Bytes per number of each storage type; both little-endian IEEE 754. An int8 export holds its
// matrices as one signed byte a number, each with float32 scales (one an output channel: a row for
// axis 0, a column for axis 1), and its vectors as float32 (attn/quantize.py).
const DTYPES = { float32: 4, float16: 2, int8: 1 };

// The bytes of one tensor's numbers, and (an int8 export's matrix) of its scales: [[offset, bytes], ...].
function tensorSpans(t, shape, dtype) {
  const n = shape.reduce((a, b) => a * b, 1);
  if (dtype !== "int8") return [[t.offset, n * DTYPES[dtype]]];
  if (shape.length !== 2) return [[t.offset, 4 * n]];
  if (t.axis !== 0 && t.axis !== 1) throw new Error(`${t.name} has axis ${JSON.stringify(t.axis)}, expected 0 or 1`);
  return [[t.offset, n], [t.scales, 4 * shape[t.axis]]];
}

// Check model.json as attn.site.export.load_export does, before a byte of weights.bin is read:
// the format, the config, the vocabulary, and an index that holds every tensor the config
// implies, of its shape, and no other. Returns {config (defaults filled in), vocab: Vocab}.
export function checkExport(meta) {
  if (meta === null || typeof meta !== "object" || Array.isArray(meta)) throw new Error("not a JSON object");
  if (meta.format !== FORMAT) throw new Error(`format ${JSON.stringify(meta.format)}, expected ${FORMAT}`);
  const config = checkConfig(meta.config);
  if (config.max_len > MAX_LEN_LIMIT) {
    throw new Error(`config max_len must be at most ${MAX_LEN_LIMIT.toLocaleString("en")} (the page builds a table ` +
                    `of max_len positions), got ${config.max_len.toLocaleString("en")}`);
  }
  const vocab = Vocab.fromJson(meta.vocab);
  const limit = meta.max_source_tokens;
  if (limit !== undefined && !(Number.isInteger(limit) && limit >= 2 && limit <= MAX_SOURCE_TOKENS_LIMIT)) {
    throw new Error(`max_source_tokens must be an integer from 2 to ${MAX_SOURCE_TOKENS_LIMIT.toLocaleString("en")}, ` +
                    `got ${JSON.stringify(limit)}`);
  }
  const examples = meta.sentences;
  if (examples !== undefined && !(Array.isArray(examples) && examples.every((x) => typeof x === "string"))) {
    throw new Error("sentences must be a list of strings");
  }
  const lm = meta.language_model;          // a decoder-only model's: {char, context} (attn.site.export)
  if (config.n_encoder_layers && lm !== undefined) throw new Error("language_model is given, but the model is a translator");
  if (!config.n_encoder_layers && !(lm !== null && typeof lm === "object" && typeof lm.char === "boolean" &&
      Number.isInteger(lm.context) && lm.context >= 1 && lm.context <= config.max_len)) {
    throw new Error(`a decoder-only model needs language_model {"char": true or false, "context": 1 to max_len ` +
                    `(${config.max_len})}, got ${JSON.stringify(lm)}`);
  }
  const w = meta.weights;
  if (w === null || typeof w !== "object" || !Array.isArray(w.tensors)) throw new Error("weights: no index of tensors");
  if (!(w.dtype in DTYPES)) throw new Error(`weights dtype ${JSON.stringify(w.dtype)} is not float32, float16 or int8`);
  if (typeof w.file !== "string" || !/^[\w.-]+$/.test(w.file) || w.file.startsWith(".")) {
    throw new Error(`weights file ${JSON.stringify(w.file)} is not a plain file name beside model.json`);
  }
  if (!(Number.isInteger(w.bytes) && w.bytes >= 0)) throw new Error(`weights bytes ${JSON.stringify(w.bytes)} is not a size`);
  const expected = parameterShapes(config), index = new Map();
  for (const t of w.tensors) {
    if (t === null || typeof t !== "object" || typeof t.name !== "string") throw new Error("weights: a tensor without a name");
    if (index.has(t.name)) throw new Error(`weights: ${t.name} appears twice`);
    index.set(t.name, t);
  }
  const missing = [...expected.keys()].filter((n) => !index.has(n)).sort();
  const unexpected = [...index.keys()].filter((n) => !expected.has(n)).sort();
  if (missing.length || unexpected.length) {
    throw new Error(`the weights index does not fit the config: missing [${missing.join(", ")}], ` +
                    `unexpected [${unexpected.join(", ")}]`);
  }
  for (const [name, shape] of expected) {
    const t = index.get(name);
    if (!Array.isArray(t.shape) || t.shape.length !== shape.length || t.shape.some((d, i) => d !== shape[i])) {
      throw new Error(`${name} has shape ${JSON.stringify(t.shape)}, the config says ${JSON.stringify(shape)}`);
    }
    for (const [offset, n] of tensorSpans(t, shape, w.dtype)) {
      if (!(Number.isInteger(offset) && offset >= 0 && offset <= w.bytes - n && (w.dtype !== "int8" || offset % 4 === 0))) {
        throw new Error(`${name} at offset ${JSON.stringify(offset)} runs past the end of ${w.file}` +
                        (w.dtype === "int8" ? " or is not a multiple of 4" : ""));
      }
    }
  }
  if (vocab.length !== targetVocabSize(config)) {
    throw new Error(`the vocabulary has ${vocab.length} tokens, the model ${targetVocabSize(config)}`);
  }
  return { config, vocab };
}

// Read model.json and weights.bin (docs/WEB_FORMAT.md) from the folder at url, each checked
// (checkExport) before it is used. Returns {model: Transformer, vocab: Vocab, meta: the
// model.json document}; throws an Error naming the file and what does not fit.
export async function loadModel(url) {
  const base = url.endsWith("/") ? url : url + "/";
  const response = await fetch(base + "model.json");
  if (!response.ok) throw new Error(`${base}model.json: HTTP ${response.status}`);
  let meta, config, vocab;
  try {
    meta = await response.json();
    ({ config, vocab } = checkExport(meta));
  } catch (e) {
    throw new Error(`${base}model.json: ${e.message}`);
  }
  const w = meta.weights;
  const bin = await fetch(base + w.file);
  if (!bin.ok) throw new Error(`${base}${w.file}: HTTP ${bin.status}`);
  const buffer = await bin.arrayBuffer();
  if (buffer.byteLength !== w.bytes) throw new Error(`${base}${w.file}: ${buffer.byteLength} bytes, model.json says ${w.bytes}`);
  const view = new DataView(buffer);
  const params = {};
  for (const t of w.tensors) {
    const { name, offset, shape } = t;
    const n = shape.reduce((a, b) => a * b, 1);
    const data = new Float32Array(n);
    if (w.dtype === "int8" && shape.length === 2) readInt8(view, t, data);
    else if (w.dtype === "float32" || w.dtype === "int8") for (let i = 0; i < n; i++) data[i] = view.getFloat32(offset + 4 * i, true);
    else for (let i = 0; i < n; i++) data[i] = halfToFloat(view.getUint16(offset + 2 * i, true));
    if (!data.every(Number.isFinite)) throw new Error(`${base}${w.file}: ${name} holds NaN or infinite numbers`);
    params[name] = tensor(shape, data);
  }
  return { model: new Transformer(config, params), vocab, meta };
}

// An int8 matrix (R, C) dequantised into data: q * scale, the scale of its row (axis 0) or column
// (axis 1), rounded to float32 as NumPy's float32 product is (the exact product, rounded once).
function readInt8(view, { offset, shape, scales, axis, name }, data) {
  const [R, C] = shape;
  const s = new Float32Array(shape[axis]);
  for (let j = 0; j < s.length; j++) s[j] = view.getFloat32(scales + 4 * j, true);
  if (!s.every((x) => Number.isFinite(x) && x >= 0)) throw new Error(`${name}'s scales hold NaN, infinite or negative numbers`);
  for (let r = 0; r < R; r++) {
    for (let c = 0; c < C; c++) data[r * C + c] = view.getInt8(offset + r * C + c) * s[axis === 0 ? r : c];
  }
}

// (KV, T, Dh) and (KV, 1, Dh) -> (KV, T+1, Dh): the key/value cache grows by one position.
function appendPosition(cache, x) {
  if (cache === null) return x;
  const [H, T, Dh] = cache.shape;
  const out = tensor([H, T + 1, Dh]);
  for (let h = 0; h < H; h++) {
    out.data.set(cache.data.subarray(h * T * Dh, (h + 1) * T * Dh), h * (T + 1) * Dh);
    out.data.set(x.data.subarray(h * Dh, (h + 1) * Dh), (h * (T + 1) + T) * Dh);
  }
  return out;
}

export class Transformer {
  // config: the fields of attn.model.TransformerConfig (snake_case, as model.json stores them);
  // params: {dotted name: tensor}, the names of attn.model.parameter_shapes.
  constructor(config, params) {
    this.config = config;
    this.parts = parts(config);
    this.params = params;
    this.pe = null;
  }

  emb(which) {
    if (this.config.share_embeddings) return "embedding.weight";
    return { src: "src_embedding.weight", tgt: "tgt_embedding.weight", out: "generator.weight" }[which];
  }

  // The positional table (L, D) with L >= T: a parameter, or the sinusoids, grown on demand.
  posTable(which, T) {
    if (this.parts.positions.learned) return this.params[`${which}_pos.weight`];
    if (this.pe === null || this.pe.shape[0] < T) {
      this.pe = sinusoidalTable(Math.max(2 * T, this.config.max_len), this.config.d_model);
    }
    return this.pe;
  }

  // Token embeddings × √D plus positions offset.. (rotary positions: none added here): ids (T) -> (T, D)
  embed(which, ids, offset = 0) {
    const x = embeddingForward(ids, this.params[this.emb(which)], Math.sqrt(this.config.d_model));
    if (!this.parts.positions.added) return x;
    return positionalForward(x, this.posTable(which, offset + ids.length), offset);
  }

  // Layer norm, or RMSNorm (its gain only)
  norm(name, x) {
    const norm = this.parts.norm;
    return norm.forward(x, norm.names.map((n) => this.params[`${name}.${n}`]), this.config.ln_eps);
  }

  // The key/value heads, and how many query heads read each
  get kvHeads() {
    return this.config.kv_heads ?? this.config.n_heads;
  }

  get group() {
    return this.config.n_heads / this.kvHeads;
  }

  // q (H, T, Dh) or k (KV, T, Dh) turned to positions offset.. when the model has rotary positions
  rope(x, offset) {
    return this.parts.positions.rotary ? ropeForward(x, offset, this.config.rope_base) : x;
  }

  // post: LN(x + sublayer(x)); pre: x + sublayer(LN(x))
  residual(norm, x, sublayer) {
    if (this.parts.placement.pre) return add(x, sublayer(this.norm(norm, x)));
    return this.norm(norm, add(x, sublayer(x)));
  }

  // x (T, D) projected by the attention name's w_which (which: "q", "k" or "v"), split into heads
  // (H or KV, T, Dh); queries and keys QK-normed where the block has QK-norm (RMSNorm over each head),
  // then turned to positions offset.. (a self-attention's; null: a cross-attention's, never turned).
  heads(name, x, which, offset = null) {
    const p = (leaf) => this.params[`${name}.${leaf}`];
    const a = splitHeads(linearForward(x, p(`w_${which}`), p(`b_${which}`)), which === "q" ? this.config.n_heads : this.kvHeads);
    if (which === "v") return a;
    const normed = this.parts.attention.qkNorm ? rmsNormForward(a, p(`${which}_gamma`), this.config.ln_eps) : a;
    return offset === null ? normed : this.rope(normed, offset);
  }

  // The encoder's self-attention (the decoder attends a position at a time, in decodeStep), with
  // rotary positions turning its queries and keys when the model has them.
  attention(name, xQ, xKv, mask) {
    const q = this.heads(name, xQ, "q", 0), k = this.heads(name, xKv, "k", 0), v = this.heads(name, xKv, "v");
    const { out, weights } = attentionForward(q, repeatKv(k, this.group), repeatKv(v, this.group), mask);   // (H, T, Dh)
    return { out: linearForward(mergeHeads(out), this.params[`${name}.w_o`], this.params[`${name}.b_o`]), weights };
  }

  ffn(name, x) {
    const ffn = this.parts.ffn;
    return ffn.forward(x, ...ffn.names.map((n) => this.params[`${name}.${n}`]));
  }

  // The encoder stack. srcIds (S) -> {memory (S, D), weights: per layer (H, S, S)}
  encode(srcIds) {
    const layers = this.encodeLayers(srcIds);
    for (;;) {
      const { value, done } = layers.next();
      if (done) return value;
    }
  }

  // The same, a layer at a time: a generator that yields (nothing) after each layer, so that
  // the page can let the browser in between, and returns what encode returns.
  *encodeLayers(srcIds) {
    let x = this.embed("src", srcIds);
    const weights = [];
    for (let i = 0; i < this.config.n_encoder_layers; i++) {
      const pre = `encoder.${i}`;
      x = this.residual(`${pre}.norm1`, x, (h) => {
        const { out, weights: w } = this.attention(`${pre}.self_attn`, h, h, null);   // no padding: no mask
        weights.push(w);
        return out;
      });
      x = this.residual(`${pre}.norm2`, x, (h) => this.ffn(`${pre}.ffn`, h));
      yield;
    }
    if (this.parts.placement.pre) x = this.norm("encoder.norm", x);
    return { memory: x, weights };
  }

  // Each decoder layer's cross-attention keys and values, (KV, S, Dh) each: they depend on the source alone.
  crossAttentionKv(memory) {
    const out = [];
    for (let i = 0; i < this.config.n_decoder_layers; i++) {
      const name = `decoder.${i}.cross_attn`;
      out.push({ k: this.heads(name, memory, "k"), v: this.heads(name, memory, "v") });          // keys normed once
    }
    return out;
  }

  // The state of incremental decoding: cross-attention keys/values, an empty self-attention cache.
  // A decoder-only model has no memory: startDecoding(null), and crossKv null.
  startDecoding(memory) {
    const selfKv = Array.from({ length: this.config.n_decoder_layers }, () => ({ k: null, v: null }));
    return { crossKv: this.config.n_encoder_layers ? this.crossAttentionKv(memory) : null, selfKv, length: 0 };
  }

  // One decoder position, attending to the cached keys/values of the earlier ones.
  // token: the id at position state.length. Returns {logits (V), state (a new one; the old is
  // unchanged, so beams can share it), selfWeights and crossWeights: per layer (H, 1, t+1) and (H, 1, S)}.
  // The cache holds the kv_heads key/value heads, each read by its group of query heads; with rotary
  // positions a key is turned once, at its position, when it is computed.
  decodeStep(token, state) {
    const cfg = this.config, group = this.group, t = state.length;
    if (this.parts.positions.learned && t >= cfg.max_len) {
      throw new RangeError(`decodeStep: sequence length ${t + 1} exceeds the learned positional table's ${cfg.max_len} positions`);
    }
    let x = this.embed("tgt", [token], t);                                        // (1, D)
    const selfKv = [], selfWeights = [], crossWeights = [];
    for (let i = 0; i < cfg.n_decoder_layers; i++) {
      const pre = `decoder.${i}`;
      const p = (leaf) => this.params[`${pre}.${leaf}`];
      x = this.residual(`${pre}.norm1`, x, (h) => {
        const q = this.heads(`${pre}.self_attn`, h, "q", t);                   // (H, 1, Dh)
        const kNew = this.heads(`${pre}.self_attn`, h, "k", t);                // (KV, 1, Dh)
        const k = appendPosition(state.selfKv[i].k, kNew);
        const v = appendPosition(state.selfKv[i].v, this.heads(`${pre}.self_attn`, h, "v"));
        selfKv.push({ k, v });                                                   // (KV, t+1, Dh)
        const { out, weights } = attentionForward(q, repeatKv(k, group), repeatKv(v, group), causalMask(1, t + 1, t));
        selfWeights.push(weights);
        return linearForward(mergeHeads(out), p("self_attn.w_o"), p("self_attn.b_o"));
      });
      if (state.crossKv) x = this.residual(`${pre}.norm2`, x, (h) => {
        const q = this.heads(`${pre}.cross_attn`, h, "q");                     // (H, 1, Dh)
        const { k, v } = state.crossKv[i];
        const { out, weights } = attentionForward(q, repeatKv(k, group), repeatKv(v, group), null);
        crossWeights.push(weights);
        return linearForward(mergeHeads(out), p("cross_attn.w_o"), p("cross_attn.b_o"));
      });
      x = this.residual(`${pre}.norm3`, x, (h) => this.ffn(`${pre}.ffn`, h));
    }
    if (this.parts.placement.pre) x = this.norm("decoder.norm", x);
    const logits = this.project(x).data;                                          // (V)
    return { logits, state: { crossKv: state.crossKv, selfKv, length: t + 1 }, selfWeights, crossWeights };
  }

  // The pre-softmax projection with the (shared) embedding matrix: (T, D) -> (T, V)
  project(h) {
    const E = this.params[this.emb("out")], [V, D] = E.shape, T = h.shape[0];
    const out = tensor([T, V]);
    for (let t = 0; t < T; t++) {
      for (let v = 0; v < V; v++) {
        let dot = 0;
        for (let d = 0; d < D; d++) dot += h.data[t * D + d] * E.data[v * D + d];
        out.data[t * V + v] = dot;
      }
    }
    return out;
  }
}

// Log-probabilities over logits (V), in float32 as attn.model.log_softmax computes them.
export function logSoftmax(logits) {
  let max = -Infinity;
  for (const x of logits) if (x > max) max = x;
  const s = new Float32Array(logits.length);
  let sum = 0;
  for (let i = 0; i < logits.length; i++) {
    s[i] = logits[i] - max;
    sum += Math.fround(Math.exp(s[i]));
  }
  const lse = Math.fround(Math.log(Math.fround(sum)));
  const out = new Float32Array(logits.length);
  for (let i = 0; i < logits.length; i++) out[i] = s[i] - lse;
  return out;
}

// The Transformer's forward pass (section 3), for one sentence: the JavaScript twin of the
// inference half of attn/model.py (encode, cross_attention_kv, start_decoding, decode_step,
// project), with the same parameter names.
//
//   src ids ─ embed·√D + PE ─ [self-attn, FFN] × N ─────────────────────────── memory
//   tgt ids ─ embed·√D + PE ─ [masked self-attn, cross-attn(memory), FFN] × N ─ @ Eᵀ ─ logits
//
// Every sub-layer sits in a residual connection followed by layer norm (norm "post", the
// paper's) or preceded by it (norm "pre", with a final norm after each stack). Dropout is
// off: this is inference.

import { Vocab } from "./data.js";
import {
  add, attentionForward, embeddingForward, feedForwardForward, layerNormForward, linearForward,
  mergeHeads, multiHeadAttentionForward, positionalForward, sinusoidalTable, splitHeads, tensor,
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

// Read model.json and weights.bin (docs/WEB_FORMAT.md) from the folder at url.
// Returns {model: Transformer, vocab: Vocab, meta: the model.json document}.
export async function loadModel(url) {
  const base = url.endsWith("/") ? url : url + "/";
  const response = await fetch(base + "model.json");
  if (!response.ok) throw new Error(`${base}model.json: HTTP ${response.status}`);
  const meta = await response.json();
  if (meta.format !== FORMAT) throw new Error(`${base}model.json: format ${meta.format}, expected ${FORMAT}`);
  const w = meta.weights;
  const bin = await fetch(base + w.file);
  if (!bin.ok) throw new Error(`${base}${w.file}: HTTP ${bin.status}`);
  const buffer = await bin.arrayBuffer();
  if (buffer.byteLength !== w.bytes) throw new Error(`${base}${w.file}: ${buffer.byteLength} bytes, model.json says ${w.bytes}`);
  const view = new DataView(buffer);
  const params = {};
  for (const { name, offset, shape } of w.tensors) {
    const n = shape.reduce((a, b) => a * b, 1);
    const data = new Float32Array(n);
    if (w.dtype === "float32") for (let i = 0; i < n; i++) data[i] = view.getFloat32(offset + 4 * i, true);
    else if (w.dtype === "float16") for (let i = 0; i < n; i++) data[i] = halfToFloat(view.getUint16(offset + 2 * i, true));
    else throw new Error(`${base}model.json: weights dtype ${w.dtype} is neither float32 nor float16`);
    params[name] = tensor(shape, data);
  }
  return { model: new Transformer(meta.config, params), vocab: Vocab.fromJson(meta.vocab), meta };
}

// (H, T, Dh) and (H, 1, Dh) -> (H, T+1, Dh): the key/value cache grows by one position.
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
    this.params = params;
    this.pe = null;
  }

  emb(which) {
    if (this.config.share_embeddings) return "embedding.weight";
    return { src: "src_embedding.weight", tgt: "tgt_embedding.weight", out: "generator.weight" }[which];
  }

  // The positional table (L, D) with L >= T: a parameter, or the sinusoids, grown on demand.
  posTable(which, T) {
    if (this.config.positional === "learned") return this.params[`${which}_pos.weight`];
    if (this.pe === null || this.pe.shape[0] < T) {
      this.pe = sinusoidalTable(Math.max(2 * T, this.config.max_len), this.config.d_model);
    }
    return this.pe;
  }

  // Token embeddings × √D plus positions offset.. : ids (T) -> (T, D)
  embed(which, ids, offset = 0) {
    const x = embeddingForward(ids, this.params[this.emb(which)], Math.sqrt(this.config.d_model));
    return positionalForward(x, this.posTable(which, offset + ids.length), offset);
  }

  norm(name, x) {
    return layerNormForward(x, this.params[name + ".gamma"], this.params[name + ".beta"], this.config.ln_eps);
  }

  // post: LN(x + sublayer(x)); pre: x + sublayer(LN(x))
  residual(norm, x, sublayer) {
    if (this.config.norm === "pre") return add(x, sublayer(this.norm(norm, x)));
    return this.norm(norm, add(x, sublayer(x)));
  }

  attention(name, xQ, xKv, mask) {
    const p = (leaf) => this.params[`${name}.${leaf}`];
    return multiHeadAttentionForward(xQ, xKv, p("w_q"), p("b_q"), p("w_k"), p("b_k"), p("w_v"), p("b_v"),
      p("w_o"), p("b_o"), this.config.n_heads, mask);
  }

  ffn(name, x) {
    const p = (leaf) => this.params[`${name}.${leaf}`];
    return feedForwardForward(x, p("w1"), p("b1"), p("w2"), p("b2"));
  }

  // The encoder stack. srcIds (S) -> {memory (S, D), weights: per layer (H, S, S)}
  encode(srcIds) {
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
    }
    if (this.config.norm === "pre") x = this.norm("encoder.norm", x);
    return { memory: x, weights };
  }

  // Each decoder layer's cross-attention keys and values, (H, S, Dh) each: they depend on the source alone.
  crossAttentionKv(memory) {
    const H = this.config.n_heads, out = [];
    for (let i = 0; i < this.config.n_decoder_layers; i++) {
      const p = (leaf) => this.params[`decoder.${i}.cross_attn.${leaf}`];
      out.push({ k: splitHeads(linearForward(memory, p("w_k"), p("b_k")), H),
                 v: splitHeads(linearForward(memory, p("w_v"), p("b_v")), H) });
    }
    return out;
  }

  // The state of incremental decoding: cross-attention keys/values, an empty self-attention cache.
  startDecoding(memory) {
    const selfKv = Array.from({ length: this.config.n_decoder_layers }, () => ({ k: null, v: null }));
    return { crossKv: this.crossAttentionKv(memory), selfKv, length: 0 };
  }

  // One decoder position, attending to the cached keys/values of the earlier ones.
  // token: the id at position state.length. Returns {logits (V), state (a new one; the old is
  // unchanged, so beams can share it), selfWeights and crossWeights: per layer (H, 1, t+1) and (H, 1, S)}.
  decodeStep(token, state) {
    const cfg = this.config, H = cfg.n_heads, t = state.length;
    if (cfg.positional === "learned" && t >= cfg.max_len) {
      throw new RangeError(`decodeStep: sequence length ${t + 1} exceeds the learned positional table's ${cfg.max_len} positions`);
    }
    let x = this.embed("tgt", [token], t);                                        // (1, D)
    const selfKv = [], selfWeights = [], crossWeights = [];
    for (let i = 0; i < cfg.n_decoder_layers; i++) {
      const pre = `decoder.${i}`;
      const p = (leaf) => this.params[`${pre}.${leaf}`];
      x = this.residual(`${pre}.norm1`, x, (h) => {
        const q = splitHeads(linearForward(h, p("self_attn.w_q"), p("self_attn.b_q")), H);          // (H, 1, Dh)
        const k = appendPosition(state.selfKv[i].k, splitHeads(linearForward(h, p("self_attn.w_k"), p("self_attn.b_k")), H));
        const v = appendPosition(state.selfKv[i].v, splitHeads(linearForward(h, p("self_attn.w_v"), p("self_attn.b_v")), H));
        selfKv.push({ k, v });                                                   // (H, t+1, Dh)
        const { out, weights } = attentionForward(q, k, v, causalMask(1, t + 1, t));
        selfWeights.push(weights);
        return linearForward(mergeHeads(out), p("self_attn.w_o"), p("self_attn.b_o"));
      });
      x = this.residual(`${pre}.norm2`, x, (h) => {
        const q = splitHeads(linearForward(h, p("cross_attn.w_q"), p("cross_attn.b_q")), H);        // (H, 1, Dh)
        const { k, v } = state.crossKv[i];
        const { out, weights } = attentionForward(q, k, v, null);
        crossWeights.push(weights);
        return linearForward(mergeHeads(out), p("cross_attn.w_o"), p("cross_attn.b_o"));
      });
      x = this.residual(`${pre}.norm3`, x, (h) => this.ffn(`${pre}.ffn`, h));
    }
    if (cfg.norm === "pre") x = this.norm("decoder.norm", x);
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

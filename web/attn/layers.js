// The forward passes of attn/layers/, in plain JavaScript: the same names in camelCase, for
// one sentence at a time (no batch axis: where Python has (B, T, D), here it is (T, D)).
//
// A tensor is {shape: [...], data: Float32Array}, row-major. Every result is stored in
// float32, as NumPy stores it; sums run in float64 (JavaScript's numbers) before the store,
// so a result may differ from NumPy's float32 sums in the last bits, never more.

export function tensor(shape, data = null) {
  const size = shape.reduce((a, b) => a * b, 1);
  if (data === null) data = new Float32Array(size);
  if (data.length !== size) throw new Error(`tensor: shape [${shape}] needs ${size} numbers, got ${data.length}`);
  return { shape, data };
}

function expect(cond, message) {
  if (!cond) throw new Error(message);
}

// attn/layers/linear.py: out = x @ w + b.   x (T, Din); w (Din, Dout); b (Dout) or null (no bias) -> (T, Dout)
export function linearForward(x, w, b = null) {
  const [T, Din] = x.shape, [Din2, Dout] = w.shape;
  expect(Din === Din2 && (b === null || b.shape[0] === Dout),
         `linear: x [${x.shape}], w [${w.shape}], b [${b?.shape}] do not fit`);
  const out = tensor([T, Dout]);
  const acc = new Float64Array(Dout);
  for (let t = 0; t < T; t++) {
    if (b === null) acc.fill(0);
    else acc.set(b.data);
    for (let i = 0; i < Din; i++) {
      const xi = x.data[t * Din + i];
      if (xi === 0) continue;
      const row = i * Dout;
      for (let j = 0; j < Dout; j++) acc[j] += xi * w.data[row + j];
    }
    out.data.set(acc, t * Dout);                       // rounded to float32 here
  }
  return out;
}

// attn/layers/embedding.py: out = W[ids] * scale.   ids (T) integers in [0, V); W (V, D) -> (T, D)
export function embeddingForward(ids, W, scale = 1.0) {
  const [V, D] = W.shape;
  const out = tensor([ids.length, D]);
  const s = Math.fround(scale);
  ids.forEach((id, t) => {
    if (!(Number.isInteger(id) && id >= 0 && id < V)) throw new RangeError(`embedding: id ${id} is outside [0, ${V})`);
    for (let j = 0; j < D; j++) out.data[t * D + j] = W.data[id * D + j] * s;
  });
  return out;
}

// attn/layers/positional.py: the paper's table, PE(pos, 2i) = sin(pos / 10000^(2i/D)),
// PE(pos, 2i+1) = cos(the same), computed in float64 then stored in float32.   -> (maxLen, D)
export function sinusoidalTable(maxLen, D) {
  const pe = tensor([maxLen, D]);
  const scale = new Float64Array(D);                 // 10000^(2i/D), once per column, not once per position
  for (let twoI = 0; twoI < D; twoI += 2) scale[twoI] = Math.pow(10000, twoI / D);
  for (let pos = 0; pos < maxLen; pos++) {
    for (let twoI = 0; twoI < D; twoI += 2) {
      const angle = pos / scale[twoI];
      pe.data[pos * D + twoI] = Math.sin(angle);
      if (twoI + 1 < D) pe.data[pos * D + twoI + 1] = Math.cos(angle);
    }
  }
  return pe;
}

// out = x + table[offset : offset + T].   x (T, D); table (L, D) -> (T, D)
// (offset: the position of x's first row; decoding one position at a time passes t.)
export function positionalForward(x, table, offset = 0) {
  const [T, D] = x.shape;
  expect(table.shape[1] === D, `positional: table [${table.shape}] and x [${x.shape}] differ in their last dimension`);
  if (offset + T > table.shape[0]) {
    throw new RangeError(`positional: sequence length ${offset + T} exceeds the positional table's ${table.shape[0]} positions`);
  }
  const out = tensor([T, D]);
  for (let i = 0; i < T * D; i++) out.data[i] = x.data[i] + table.data[offset * D + i];
  return out;
}

// attn/layers/softmax.py: softmax over the last axis.   x (R, K); mask null or Uint8Array (R, K),
// 1 where a position may receive weight -> (R, K). Masked positions get exactly 0; a fully masked
// row is all zeros (never NaN).
export function softmaxForward(x, mask = null) {
  const K = x.shape[x.shape.length - 1], R = x.data.length / K;
  const y = tensor(x.shape);
  for (let r = 0; r < R; r++) {
    const o = r * K;
    let max = -Infinity;
    for (let k = 0; k < K; k++) if ((mask === null || mask[o + k]) && x.data[o + k] > max) max = x.data[o + k];
    if (max === -Infinity) continue;                   // every key masked: zeros
    let sum = 0;
    for (let k = 0; k < K; k++) {
      const e = mask === null || mask[o + k] ? Math.exp(Math.fround(x.data[o + k] - max)) : 0;
      y.data[o + k] = e;
      sum += Math.fround(e);
    }
    for (let k = 0; k < K; k++) y.data[o + k] = y.data[o + k] / sum;
  }
  return y;
}

// attn/layers/attention.py, scaled dot-product attention: softmax(q k^T / sqrt(d_k)) v.
// q (H, Tq, Dk); k (H, Tk, Dk); v (H, Tk, Dv); mask null or Uint8Array (Tq, Tk), the same for
// every head. Returns {out (H, Tq, Dv), weights (H, Tq, Tk)}.
export function attentionForward(q, k, v, mask = null) {
  const [H, Tq, dk] = q.shape, Tk = k.shape[1], Dv = v.shape[2];
  expect(k.shape[2] === dk && v.shape[1] === Tk, `attention: q [${q.shape}], k [${k.shape}], v [${v.shape}] do not fit`);
  const scale = Math.fround(1 / Math.sqrt(dk));
  const scores = tensor([H, Tq, Tk]);
  for (let h = 0; h < H; h++) {
    for (let i = 0; i < Tq; i++) {
      const qo = (h * Tq + i) * dk;
      for (let j = 0; j < Tk; j++) {
        const ko = (h * Tk + j) * dk;
        let dot = 0;
        for (let d = 0; d < dk; d++) dot += q.data[qo + d] * k.data[ko + d];
        scores.data[(h * Tq + i) * Tk + j] = Math.fround(dot) * scale;
      }
    }
  }
  let headMask = null;                                 // (Tq, Tk) repeated for each head
  if (mask !== null) {
    headMask = new Uint8Array(H * Tq * Tk);
    for (let h = 0; h < H; h++) headMask.set(mask, h * Tq * Tk);
  }
  const weights = softmaxForward(scores, headMask);
  const out = tensor([H, Tq, Dv]);
  const acc = new Float64Array(Dv);
  for (let h = 0; h < H; h++) {
    for (let i = 0; i < Tq; i++) {
      acc.fill(0);
      for (let j = 0; j < Tk; j++) {
        const w = weights.data[(h * Tq + i) * Tk + j];
        if (w === 0) continue;
        const vo = (h * Tk + j) * Dv;
        for (let d = 0; d < Dv; d++) acc[d] += w * v.data[vo + d];
      }
      out.data.set(acc, (h * Tq + i) * Dv);
    }
  }
  return { out, weights };
}

// (T, D) -> (H, T, D/H)
export function splitHeads(x, H) {
  const [T, D] = x.shape, Dh = D / H;
  const out = tensor([H, T, Dh]);
  for (let h = 0; h < H; h++)
    for (let t = 0; t < T; t++)
      for (let d = 0; d < Dh; d++) out.data[(h * T + t) * Dh + d] = x.data[t * D + h * Dh + d];
  return out;
}

// (H, T, Dh) -> (T, H*Dh), the inverse of splitHeads
export function mergeHeads(x) {
  const [H, T, Dh] = x.shape, D = H * Dh;
  const out = tensor([T, D]);
  for (let h = 0; h < H; h++)
    for (let t = 0; t < T; t++)
      for (let d = 0; d < Dh; d++) out.data[t * D + h * Dh + d] = x.data[(h * T + t) * Dh + d];
  return out;
}

// Grouped-query attention's sharing, attn.layers.attention.repeat_kv: (KV, T, Dh) -> (KV * group, T, Dh),
// query head j reading key/value head floor(j / group).
export function repeatKv(x, group) {
  if (group === 1) return x;
  const [KV, T, Dh] = x.shape, n = T * Dh;
  const out = tensor([KV * group, T, Dh]);
  for (let j = 0; j < KV * group; j++) {
    const h = Math.floor(j / group);
    out.data.set(x.data.subarray(h * n, (h + 1) * n), j * n);
  }
  return out;
}

// attn/layers/rope.py, rotary positions: each pair (x_i, x_{i+Dh/2}) of a head (the half split) at
// position offset + t turned by the angle (offset + t) * base^(-2i/Dh), computed in float64 and its
// cosine and sine stored in float32, as NumPy does.   x (H, T, Dh), Dh even -> (H, T, Dh)
export function ropeForward(x, offset = 0, base = 10000) {
  const [H, T, Dh] = x.shape, half = Dh / 2;
  expect(Dh % 2 === 0, `rope: the head size must be even (pairs of features), got x [${x.shape}]`);
  const cos = new Float32Array(T * half), sin = new Float32Array(T * half);
  for (let t = 0; t < T; t++) {
    for (let i = 0; i < half; i++) {
      const angle = (offset + t) * Math.pow(base, -(2 * i) / Dh);
      cos[t * half + i] = Math.cos(angle);
      sin[t * half + i] = Math.sin(angle);
    }
  }
  const out = tensor(x.shape);
  for (let h = 0; h < H; h++) {
    for (let t = 0; t < T; t++) {
      const o = (h * T + t) * Dh;
      for (let i = 0; i < half; i++) {
        const a = x.data[o + i], b = x.data[o + half + i], c = cos[t * half + i], s = sin[t * half + i];
        out.data[o + i] = Math.fround(a * c) - Math.fround(b * s);
        out.data[o + half + i] = Math.fround(a * s) + Math.fround(b * c);
      }
    }
  }
  return out;
}

// Multi-head attention (section 3.2.2).   xQ (Tq, D) the queries' source; xKv (Tk, D) the keys'
// and values' source; wQ, wO (D, D); wK, wV (D, KV * Dh) with KV = kvHeads key/value heads
// (grouped-query attention; nHeads by default) and Dh = D / nHeads; b* their widths (or null);
// mask null or (Tq, Tk); rope null, or the base of rotary positions turning every head's queries
// and keys at positions 0, 1, ... (self-attention).   Returns {out (Tq, D), weights (H, Tq, Tk)}.
export function multiHeadAttentionForward(xQ, xKv, wQ, bQ, wK, bK, wV, bV, wO, bO, nHeads, mask = null,
                                          { kvHeads = nHeads, rope = null } = {}) {
  const D = xQ.shape[1];
  expect(D % nHeads === 0, `multi_head_attention: d_model ${D} is not divisible by n_heads ${nHeads}`);
  expect(kvHeads >= 1 && nHeads % kvHeads === 0, `multi_head_attention: kv_heads ${kvHeads} must divide n_heads ${nHeads}`);
  let q = splitHeads(linearForward(xQ, wQ, bQ), nHeads);       // (H, Tq, Dh)
  let k = splitHeads(linearForward(xKv, wK, bK), kvHeads);     // (KV, Tk, Dh)
  const v = splitHeads(linearForward(xKv, wV, bV), kvHeads);   // (KV, Tk, Dh)
  if (rope !== null) {
    q = ropeForward(q, 0, rope);
    k = ropeForward(k, 0, rope);
  }
  const group = nHeads / kvHeads;
  const { out, weights } = attentionForward(q, repeatKv(k, group), repeatKv(v, group), mask);   // (H, Tq, Dh)
  return { out: linearForward(mergeHeads(out), wO, bO), weights };
}

// attn/layers/layernorm.py: gamma * (x - mean) / sqrt(var + eps) + beta over each row.
// x (T, D); gamma (D); beta (D) -> (T, D)
export function layerNormForward(x, gamma, beta, eps = 1e-5) {
  const D = x.shape[x.shape.length - 1], R = x.data.length / D;
  const out = tensor(x.shape);
  for (let r = 0; r < R; r++) {
    const o = r * D;
    let mean = 0;
    for (let j = 0; j < D; j++) mean += x.data[o + j];
    mean /= D;
    let variance = 0;                                  // biased, as the paper's reference
    for (let j = 0; j < D; j++) variance += (x.data[o + j] - mean) ** 2;
    variance /= D;
    const rstd = 1 / Math.sqrt(variance + Math.fround(eps));
    for (let j = 0; j < D; j++) out.data[o + j] = (x.data[o + j] - mean) * rstd * gamma.data[j] + beta.data[j];
  }
  return out;
}

// attn/layers/rmsnorm.py: gamma * x / sqrt(mean(x^2) + eps) over each row: no mean taken, no shift.
// x (T, D); gamma (D) -> (T, D)
export function rmsNormForward(x, gamma, eps = 1e-6) {
  const D = x.shape[x.shape.length - 1], R = x.data.length / D;
  const out = tensor(x.shape);
  for (let r = 0; r < R; r++) {
    const o = r * D;
    let squares = 0;
    for (let j = 0; j < D; j++) squares += x.data[o + j] ** 2;
    const rrms = 1 / Math.sqrt(squares / D + Math.fround(eps));
    for (let j = 0; j < D; j++) out.data[o + j] = x.data[o + j] * rrms * gamma.data[j];
  }
  return out;
}

// attn/layers/activation.py: max(x, 0)
export function reluForward(x) {
  const out = tensor(x.shape);
  for (let i = 0; i < x.data.length; i++) out.data[i] = x.data[i] > 0 ? x.data[i] : 0;
  return out;
}

// attn/layers/feedforward.py: FFN(x) = max(0, x W1 + b1) W2 + b2.
// x (T, D); w1 (D, F); b1 (F); w2 (F, D); b2 (D) -> (T, D)
export function feedForwardForward(x, w1, b1, w2, b2) {
  return linearForward(reluForward(linearForward(x, w1, b1)), w2, b2);
}

// attn/layers/swiglu.py: FFN(x) = (SiLU(x W) * (x V)) W2, SiLU(a) = a * sigmoid(a), no biases.
// x (T, D); w, v (D, F); w2 (F, D) -> (T, D)
export function swigluForward(x, w, v, w2) {
  const a = linearForward(x, w), b = linearForward(x, v);
  const h = tensor(a.shape);
  for (let i = 0; i < a.data.length; i++) {
    const sigmoid = 0.5 * (1 + Math.tanh(0.5 * a.data[i]));     // as attn.layers.swiglu.silu: no exp to overflow
    h.data[i] = a.data[i] * sigmoid * b.data[i];
  }
  return linearForward(h, w2);
}

// x + y, elementwise (the residual connection)
export function add(x, y) {
  const out = tensor(x.shape);
  for (let i = 0; i < x.data.length; i++) out.data[i] = x.data[i] + y.data[i];
  return out;
}

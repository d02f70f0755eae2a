// The language model's page: type a prompt, watch the continuation appear token by token, and the
// masked self-attention of every layer and head over the text the model reads. The model is in
// attn/*.js (attn/lm.js generates); this file only draws. window.attnLm and
// document.body.dataset.state are there for tests.

import { bannedIds, cutAtStop, decodeText, generateSteps, parseStop, promptIds, stopWhen } from "./attn/lm.js";
import { loadModel } from "./attn/model.js";

const $ = (sel) => document.querySelector(sel);
const prompt = $("#prompt"), output = $("#output"), go = $("#generate"), stop = $("#stop");
const ROWS = 16, COLS = 48;   // the maps show the last ROWS generated tokens over the last COLS positions read
const MAX_TOKENS = 2000;      // the most tokens one press generates (the field's max)
const SLICE_MS = 8;           // the longest stretch of computing before the browser gets a turn

let model = null, vocab = null, reading = null;   // reading: model.json's language_model {char, context}
let generation = 0;           // a newer run (or stop) makes an older one end

function say(text) {
  $("#message").hidden = text === null;
  $("#message").textContent = text ?? "";
}

// The settings of the controls: {sampler, seed, maxTokens, stopAt}; an empty top-k, top-p or stop is off.
function settings() {
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  return { sampler: { temperature: num("#temperature") ?? 1, topK: num("#top-k"), topP: num("#top-p") },
           seed: num("#seed") ?? 0, maxTokens: num("#max-tokens") ?? 200, stopAt: parseStop($("#stop-at").value) };
}

function rgb(v) {             // white (0) to dark blue (1), as index.html's maps
  const t = Math.max(0, Math.min(1, v));
  return [Math.round(255 - t * 247), Math.round(255 - t * 207), Math.round(255 - t * 148)];
}

// One map (rows × cols of values) into canvas, a cell of cell pixels, the column labels above.
function drawMap(canvas, values, rows, cols, colLabels) {
  const cell = 9, top = 14, ctx = canvas.getContext("2d");
  canvas.width = cols * cell;
  canvas.height = top + rows * cell;
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      const [r, g, b] = rgb(values[i * cols + j]);
      ctx.fillStyle = `rgb(${r},${g},${b})`;
      ctx.fillRect(j * cell, top + i * cell, cell, cell);
    }
  }
  ctx.fillStyle = "#222";
  ctx.font = "9px ui-monospace, monospace";
  colLabels.forEach((s, j) => ctx.fillText(s.slice(0, 1), j * cell + 2, top - 3));
  Object.assign(canvas.dataset, { rows, cols });
}

// The maps of the last ROWS steps since the model last started afresh: per layer and head, a row
// per step, its weights over the positions read (the future blank).
function drawAttention(steps, seq) {
  const last = steps[steps.length - 1], recent = steps.filter((s) => s.start === last.start).slice(-ROWS);
  const read = (s) => s.selfWeights[0].shape[2];                  // positions the step's query read
  const width = read(recent[recent.length - 1]), from = Math.max(0, width - COLS), cols = width - from;
  const colLabels = seq.slice(last.start + from, last.start + width).map((id) => vocab.itos[id]);
  const grid = document.querySelector('.maps[data-kind="self"] .grid');
  const { n_decoder_layers: L, n_heads: H } = model.config;
  if (grid.children.length !== L * H) {
    grid.replaceChildren(...Array.from({ length: L * H }, (_, k) => {
      const box = document.createElement("div");
      box.className = "map";
      box.innerHTML = `<div class="title">layer ${Math.floor(k / H) + 1}, head ${(k % H) + 1}</div><canvas></canvas>`;
      return box;
    }));
  }
  [...grid.querySelectorAll("canvas")].forEach((canvas, k) => {
    const layer = Math.floor(k / H), head = k % H, values = new Float32Array(recent.length * cols);
    recent.forEach((s, i) => {
      const w = s.selfWeights[layer], n = w.shape[2];
      for (let j = from; j < n; j++) values[i * cols + j - from] = w.data[head * n + j];
    });
    drawMap(canvas, values, recent.length, cols, colLabels);
  });
}

// Generate from the prompt, drawing each token as it comes; a newer run ends this one.
async function run() {
  const mine = ++generation, { sampler, seed, maxTokens, stopAt } = settings();
  say(null);
  let ids, steps;
  try {
    if (!(Number.isInteger(maxTokens) && maxTokens >= 1 && maxTokens <= MAX_TOKENS)) {
      throw new RangeError(`tokens must be a whole number from 1 to ${MAX_TOKENS}, got ${$("#max-tokens").value}`);
    }
    if (!(Number.isInteger(seed) && seed >= 0)) throw new RangeError(`seed must be a whole number >= 0, got ${$("#seed").value}`);
    ids = promptIds(prompt.value, vocab, reading.char);
    steps = generateSteps(model, ids, { maxTokens, sampler, seed, banned: bannedIds(reading.char), window: reading.context,
                                        stop: stopWhen(stopAt, vocab, reading.char) });
  } catch (e) {
    say(`cannot generate: ${e.message}`);
    document.body.dataset.state = "error";
    return;
  }
  document.body.dataset.state = "busy";
  go.disabled = false;
  stop.disabled = false;
  const gen = document.createElement("span"), seq = [...ids], done = [], t0 = performance.now();
  gen.className = "gen";
  output.replaceChildren(document.createTextNode(prompt.value), gen);
  let sliceStart = performance.now();
  try {
    for (const step of steps) {
      seq.push(step.token);
      done.push(step);
      gen.textContent = cutAtStop(decodeText(seq.slice(ids.length), vocab, reading.char), stopAt);
      if (performance.now() - sliceStart > SLICE_MS) {
        drawAttention(done, seq);
        await new Promise((resolve) => requestAnimationFrame(() => resolve()));
        if (mine !== generation) return;
        sliceStart = performance.now();
      }
    }
  } catch (e) {
    say(`cannot generate: ${e.message}`);
    document.body.dataset.state = "error";
    return;
  }
  drawAttention(done, seq);
  const ms = performance.now() - t0;
  $("#timing").textContent = `${done.length} tokens in ${(ms / 1000).toFixed(2)} s (${(ms / done.length).toFixed(1)} ms a token)`;
  window.attnLm.last = { prompt: ids, tokens: done.map((s) => s.token), text: gen.textContent };
  stop.disabled = true;
  document.body.dataset.state = "done";
}

async function main() {
  const url = new URLSearchParams(location.search).get("model") ?? "model";
  document.body.dataset.state = "loading";
  let meta;
  try {
    if (new URL(url, location.href).origin !== location.origin) throw new Error(`${url} is on another site: this page loads models from its own origin only`);
    ({ model, vocab, meta } = await loadModel(url));
  } catch (e) {
    $("#model-info").textContent = `could not load the model from ${url}/`;
    say(`could not load the model: ${e.message}`);
    document.body.dataset.state = "error";
    return;
  }
  const c = model.config;
  if (c.n_encoder_layers) {
    say(`${url}/ holds a translator (an encoder-decoder), which this page does not run: open index.html?model=${url}`);
    document.body.dataset.state = "error";
    return;
  }
  reading = meta.language_model;
  $("#model-info").textContent = `model ${url}: d_model ${c.d_model}, ${c.n_decoder_layers} layers, ${c.n_heads} heads ` +
    `(${model.kvHeads} key/value), ${c.norm_position}-norm (${c.norm_kind}), ${c.positional} positions, ` +
    `vocabulary ${vocab.length} (${reading.char ? "characters" : vocab.bpe ? "BPE" : "words"}), context ${reading.context}`;
  prompt.disabled = go.disabled = false;
  if (!prompt.value) prompt.value = reading.char ? vocab.itos.slice(4).find((s) => /\w/.test(s)) ?? "\n" : "the";
  go.addEventListener("click", run);
  stop.addEventListener("click", () => { generation++; stop.disabled = true; document.body.dataset.state = "done"; });
  window.attnLm = { model, vocab, meta, run };
  document.body.dataset.state = "ready";
}

main();

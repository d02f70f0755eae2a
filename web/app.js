// The page: type a sentence, watch the translation appear token by token, and every attention
// weight of every layer and head as heatmaps. The model itself is in attn/*.js; this file only
// draws. window.attnPage and document.body.dataset.state are there for tests and measurements.

import { EOS } from "./attn/data.js";
import { attentionMatrices, beamSearchSteps, greedySteps, maxSourceTokens, source as sourceOf } from "./attn/decode.js";
import { loadModel } from "./attn/model.js";
import { detokenize } from "./attn/text.js";

const $ = (sel) => document.querySelector(sel);
const source = $("#source"), examples = $("#examples"), beam = $("#beam"), average = $("#average");
const stepInput = $("#step"), stepLabel = $("#step-label"), replay = $("#replay"), tooltip = $("#tooltip");
const KINDS = { encoder: "encoder", decoderSelf: "decoder self", cross: "cross" };

let model = null, vocab = null;
let current = null;           // {srcTokens, srcIds, encoderWeights, steps, done}
let generation = 0;           // a newer keystroke makes an older translation stop
let replayTimer = null;

const nextFrame = () => new Promise((resolve) => requestAnimationFrame(() => resolve()));
// A turn for the browser (input, painting when a frame is due), then back: a message to ourselves
// is a task of its own, without the 4 ms that nested setTimeouts wait.
const yieldToBrowser = () => new Promise((resolve) => {
  const channel = new MessageChannel();
  channel.port1.onmessage = () => resolve();
  channel.port2.postMessage(null);
});
const SLICE_MS = 8;           // the longest stretch of computing before the browser gets a turn

function tokenLabel(id) {
  return vocab.itos[id];
}

// ------------------------------------------------------------------ heatmaps

// Weights (rows, cols) of one head, or averaged over the heads of a (H, rows, cols) tensor.
function headValues(w, head) {
  const [H, R, C] = w.shape;
  if (head !== "avg") return w.data.subarray(head * R * C, (head + 1) * R * C);
  const out = new Float32Array(R * C);
  for (let i = 0; i < R * C; i++) {
    let s = 0;
    for (let h = 0; h < H; h++) s += w.data[h * R * C + i];
    out[i] = s / H;
  }
  return out;
}

function rgb(v) {          // white (0) to dark blue (1)
  const t = Math.max(0, Math.min(1, v));
  return [Math.round(255 - t * (255 - 8)), Math.round(255 - t * (255 - 48)), Math.round(255 - t * (255 - 107))];
}

// The cells of a map as an image of one pixel per cell (rows × cols), for drawImage to scale
// up without smoothing: one call instead of a fillRect per cell, which a 200-token sentence
// (40,000 cells a map) would make slow.
function cellImage(values, rows, cols) {
  const image = new ImageData(cols, rows);
  for (let i = 0; i < rows * cols; i++) {
    const [r, g, b] = rgb(values[i]);
    image.data[4 * i] = r;
    image.data[4 * i + 1] = g;
    image.data[4 * i + 2] = b;
    image.data[4 * i + 3] = 255;
  }
  const small = document.createElement("canvas");
  small.width = cols;
  small.height = rows;
  small.getContext("2d").putImageData(image, 0, 0);
  return small;
}

function fit(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  while (text.length > 1 && ctx.measureText(text + "…").width > width) text = text.slice(0, -1);
  return text + "…";
}

// One heatmap: values (rows × cols), labels on both axes; the geometry goes into the canvas's
// dataset so that hovering (and a test) can find a cell.
function drawMap(canvas, values, rows, cols, rowLabels, colLabels) {
  const cell = Math.max(9, Math.min(20, Math.floor(260 / Math.max(rows, cols, 1))));
  const ctx = canvas.getContext("2d");
  ctx.font = "11px system-ui, sans-serif";
  const labelW = Math.min(90, Math.max(20, ...rowLabels.map((s) => ctx.measureText(s).width)) + 6);
  const labelH = Math.min(90, Math.max(20, ...colLabels.map((s) => ctx.measureText(s).width)) + 6);
  const width = labelW + cols * cell + 2, height = labelH + rows * cell + 2;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = width * dpr;
  canvas.height = height * dpr;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  ctx.scale(dpr, dpr);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, width, height);
  if (rows && cols) {
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(cellImage(values, rows, cols), labelW, labelH, cols * cell, rows * cell);
  }
  ctx.strokeStyle = "#ccc";
  ctx.strokeRect(labelW, labelH, cols * cell, rows * cell);
  ctx.fillStyle = "#222";
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  rowLabels.forEach((s, i) => ctx.fillText(fit(ctx, s, labelW - 6), labelW - 3, labelH + (i + 0.5) * cell));
  ctx.save();
  ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "left";
  colLabels.forEach((s, j) => ctx.fillText(fit(ctx, s, labelH - 6), -labelH + 3, labelW + (j + 0.5) * cell));
  ctx.restore();
  Object.assign(canvas.dataset, { x0: labelW, y0: labelH, cell, rows, cols });
  canvas.values = values;
  canvas.rowLabels = rowLabels;
  canvas.colLabels = colLabels;
}

function showTooltip(event) {
  const canvas = event.target, d = canvas.dataset;
  const rect = canvas.getBoundingClientRect();
  const j = Math.floor((event.clientX - rect.left - d.x0) / d.cell), i = Math.floor((event.clientY - rect.top - d.y0) / d.cell);
  if (!(i >= 0 && j >= 0 && i < +d.rows && j < +d.cols)) { tooltip.hidden = true; return; }
  const w = canvas.values[i * +d.cols + j];
  const head = d.head === "avg" ? "average of the heads" : `head ${+d.head + 1}`;
  tooltip.textContent = `${KINDS[d.kind]}, layer ${+d.layer + 1}, ${head}: ${canvas.rowLabels[i]} → ${canvas.colLabels[j]}  ${w.toFixed(4)}`;
  Object.assign(tooltip.dataset, { weight: String(w), kind: d.kind, layer: d.layer, head: d.head, row: i, col: j });
  tooltip.style.left = `${event.clientX + 12}px`;
  tooltip.style.top = `${event.clientY + 12}px`;
  tooltip.hidden = false;
}

// Draw every map of one kind: a row of heads (or their average) per layer.
function drawKind(kind, weights, rowLabels, colLabels) {
  const grid = document.querySelector(`.maps[data-kind="${kind}"] .grid`);
  const heads = average.checked ? ["avg"] : [...Array(model.config.n_heads).keys()];
  const wanted = weights.length * heads.length;
  if (grid.children.length !== wanted) {
    grid.replaceChildren();
    weights.forEach((_, layer) => heads.forEach((head) => {
      const box = document.createElement("div");
      box.className = "map";
      const title = document.createElement("div");
      title.className = "title";
      title.textContent = `layer ${layer + 1}, ${head === "avg" ? "average of the heads" : `head ${head + 1}`}`;
      const canvas = document.createElement("canvas");
      Object.assign(canvas.dataset, { kind, layer, head });
      canvas.addEventListener("mousemove", showTooltip);
      canvas.addEventListener("mouseleave", () => { tooltip.hidden = true; });
      box.append(title, canvas);
      grid.append(box);
    }));
  }
  [...grid.querySelectorAll("canvas")].forEach((canvas) => {
    const w = weights[+canvas.dataset.layer];
    const head = canvas.dataset.head === "avg" ? "avg" : +canvas.dataset.head;
    if (canvas.drawn === w && canvas.drawnHead === head) return;   // the encoder's maps, while it decodes
    drawMap(canvas, headValues(w, head), w.shape[1], w.shape[2], rowLabels, colLabels);
    canvas.drawn = w;
    canvas.drawnHead = head;
  });
}

// Show the translation after `shown` steps: the tokens so far and all three kinds of maps.
function render(shown = current.steps.length) {
  const steps = current.steps.slice(0, shown);
  const out = $("#output");
  out.replaceChildren(...steps.map((s) => {
    const span = document.createElement("span");
    span.className = s.token === EOS ? "tok eos" : "tok";
    span.textContent = tokenLabel(s.token);
    return span;
  }));
  out.title = detokenize(vocab.decode(steps.map((s) => s.token)));
  const att = attentionMatrices(current.encoderWeights, steps);
  const inputs = steps.map((_, t) => (t === 0 ? "<s>" : tokenLabel(steps[t - 1].token)));
  drawKind("encoder", att.encoder, current.srcTokens, current.srcTokens);
  if (steps.length) {
    drawKind("decoderSelf", att.decoderSelf, inputs, inputs);
    drawKind("cross", att.cross, inputs, current.srcTokens);
  }
  stepLabel.textContent = steps.length ? `${shown} of ${current.steps.length}: ${inputs[shown - 1]} → ${tokenLabel(steps[shown - 1].token)}` : "";
}

// ------------------------------------------------------------------ translating

// A message above the translation (a refusal, an error), or none.
function say(text) {
  $("#message").textContent = text ?? "";
  $("#message").hidden = !text;
}

// Translate text (run), showing any error on the page rather than leaving it busy.
async function run(text, startedAt) {
  try {
    await translateAndDraw(text, startedAt);
  } catch (e) {
    generation += 1;                                  // whatever was under way stops
    say(`could not translate: ${e.message}`);
    document.body.dataset.state = "error";
  }
}

async function translateAndDraw(text, startedAt) {
  const mine = ++generation;
  clearInterval(replayTimer);
  document.body.dataset.state = "busy";
  say(null);
  const { srcTokens, srcIds, tooLong } = sourceOf(model, vocab, text, maxSourceTokens(window.attnMeta));
  if (tooLong || srcIds.length === 1) {               // too long to translate, or nothing but EOS: no sentence
    current = null;
    $("#output").replaceChildren();
    $("#timing").textContent = "";
    for (const grid of document.querySelectorAll(".grid")) grid.replaceChildren();
    stepInput.disabled = replay.disabled = true;
    if (tooLong) {
      say(`This sentence has ${tooLong.tokens.toLocaleString("en")} tokens; the model translates at most ` +
          `${tooLong.limit.toLocaleString("en")}. Shorten it to see its translation.`);
    }
    document.body.dataset.state = "done";
    return;
  }
  // The work comes in slices: after each piece (an encoder layer, a decoder position, a step of the
  // beam search) the page gives the browser a turn once SLICE_MS have passed, so typing and
  // painting go on while a long sentence decodes; a newer keystroke stops this translation there.
  let compute = 0, draw = 0, frames = 0, turns = 0, lastPaint = performance.now(), lastYield = lastPaint;
  const timed = (f) => { const t1 = performance.now(); const r = f(); compute += performance.now() - t1; return r; };
  const timedRender = () => { const d0 = performance.now(); render(); draw += performance.now() - d0; };
  const pause = async () => {                         // true when a newer translation took over
    const now = performance.now();
    if (now - lastPaint > 16 && current.steps.length) {   // a slow model: show each token as it comes
      timedRender();
      await nextFrame();
      frames += 1;
      lastPaint = lastYield = performance.now();
      turns += 1;
    } else if (now - lastYield > SLICE_MS) {
      await yieldToBrowser();
      lastYield = performance.now();
      turns += 1;
    }
    return mine !== generation;
  };
  current = { srcTokens, srcIds, encoderWeights: [], steps: [] };
  const layers = model.encodeLayers(srcIds);
  let encoded;
  for (;;) {
    const { value, done } = timed(() => layers.next());
    if (done) { encoded = value; break; }
    if (await pause()) return;
  }
  const { memory, weights } = encoded;
  current.encoderWeights = weights;
  lastPaint = performance.now();                      // tokens are shown a frame apart from here on
  const beamSize = +beam.value;
  if (beamSize > 1) {
    const search = beamSearchSteps(model, srcIds, { beamSize, memory });
    for (;;) {
      const { value, done } = timed(() => search.next());
      if (done) { current.steps = value.steps; break; }
      if (await pause()) return;
    }
  } else {
    const steps = greedySteps(model, srcIds, { memory });
    for (;;) {
      const { value, done } = timed(() => steps.next());
      if (done) break;
      current.steps.push(value);
      if (await pause()) return;
    }
  }
  timedRender();
  stepInput.max = String(current.steps.length);
  stepInput.value = String(current.steps.length);
  stepInput.disabled = replay.disabled = false;
  await nextFrame();                                  // the frame that shows the last token
  frames += 1;
  if (mine !== generation) return;
  const endedAt = performance.now(), ms = endedAt - startedAt;
  window.attnTiming = { ms, computeMs: compute, drawMs: draw, frames, turns, tokens: current.steps.length,
                        sourceTokens: srcIds.length, startedAt, endedAt };
  $("#timing").textContent = `${current.steps.length} tokens; ${ms.toFixed(1)} ms from keystroke to the last token ` +
    `(${compute.toFixed(1)} ms computing, ${draw.toFixed(1)} ms drawing)`;
  document.body.dataset.state = "done";
}

function startReplay() {
  if (!current) return;
  clearInterval(replayTimer);
  let t = 1;
  render(t);
  stepInput.value = "1";
  replayTimer = setInterval(() => {
    t += 1;
    if (t > current.steps.length) { clearInterval(replayTimer); return; }
    stepInput.value = String(t);
    render(t);
  }, 300);
}

// A model from another origin runs only when the reader asks for it twice: the address opts in
// to that origin (&allow-origin=ORIGIN, which policy.js lets fetch reach), and the reader
// presses the button the page shows. Resolves to true when the model may be loaded.
function mayLoad(url) {
  const params = new URLSearchParams(location.search);
  let where;
  try {
    where = new URL(url, location.href);
  } catch (e) {
    say(`?model=${url} is not an address.`);
    return Promise.resolve(false);
  }
  if (where.origin === location.origin) return Promise.resolve(true);
  const origin = where.origin, allow = params.get("allow-origin");
  let allowed = false;
  try { allowed = allow !== null && new URL(allow).origin === origin; } catch (e) { allowed = false; }
  if (!["http:", "https:"].includes(where.protocol) || !allowed) {
    say(`The model ${where.href} is on another site (${origin}). This page loads models from its own origin ` +
        `only; to run that one, add &allow-origin=${origin} to the address and confirm on the page.`);
    return Promise.resolve(false);
  }
  say(`Load the model from ${where.href}? It is on another site (${origin}), and this page will run what it ` +
      `sends: load it only if you trust that site.`);
  const button = document.createElement("button");
  button.id = "load-elsewhere";
  button.type = "button";
  button.textContent = `load the model from ${origin}`;
  $("#message").append(button);
  document.body.dataset.state = "confirm";
  return new Promise((resolve) => button.addEventListener("click", () => { say(null); resolve(true); }, { once: true }));
}

async function main() {
  const url = new URLSearchParams(location.search).get("model") ?? "model";
  if (!(await mayLoad(url))) {
    $("#model-info").textContent = `did not load the model from ${url}/`;
    document.body.dataset.state = "error";
    return;
  }
  document.body.dataset.state = "loading";
  try {
    ({ model, vocab } = await loadModel(url).then((r) => { window.attnMeta = r.meta; return r; }));
  } catch (e) {
    $("#model-info").textContent = `could not load the model from ${url}/`;
    say(`could not load the model: ${e.message}`);
    document.body.dataset.state = "error";
    return;
  }
  const c = model.config, meta = window.attnMeta;
  if (c.n_encoder_layers === 0) {                     // a decoder-only model writes: lm.html runs it
    $("#model-info").textContent = `model ${url}: a language model`;
    say(`${url}/ holds a language model (n_encoder_layers 0), which writes rather than translates: open lm.html?model=${url}`);
    document.body.dataset.state = "error";
    return;
  }
  $("#model-info").textContent = `model ${url}: d_model ${c.d_model}, ${c.n_encoder_layers}+${c.n_decoder_layers} layers, ` +
    `${c.n_heads} heads (${model.kvHeads} key/value), d_ff ${c.d_ff} (${c.ffn}), ${c.norm_position}-norm (${c.norm_kind}), ` +
    `${c.positional} positions, vocabulary ${vocab.length} ` +
    `(${vocab.bpe ? "BPE" : "words"}), weights ${meta.weights.dtype} (${meta.weights.bytes.toLocaleString("en")} bytes)`;
  const sentences = meta.sentences ?? [];             // optional: a model without examples has none to offer
  for (const s of sentences) examples.append(new Option(s, s));
  source.disabled = examples.disabled = false;
  source.addEventListener("input", (e) => run(source.value, e.timeStamp));
  examples.addEventListener("change", (e) => {
    if (!examples.value) return;
    source.value = examples.value;
    run(source.value, e.timeStamp);
  });
  beam.addEventListener("change", (e) => current && run(source.value, e.timeStamp));
  average.addEventListener("change", () => current && render(+stepInput.value));
  stepInput.addEventListener("input", () => { clearInterval(replayTimer); render(+stepInput.value); });
  replay.addEventListener("click", startReplay);
  window.attnPage = { model, vocab, meta, run: (text) => run(text, performance.now()) };
  const first = sentences[0];
  if (first && !source.value) {
    source.value = first;
    await run(first, performance.now());
  }
  if (document.body.dataset.state !== "error") document.body.dataset.state = "ready";
}

main();

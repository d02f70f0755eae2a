"""The model in the browser (web/, plain JavaScript) computes what attn computes in NumPy.

Headless Chromium (the system's, driven by Playwright) loads the page from a local server.
For 50 sentences of the toy test set with the shipped toy model (word vocabulary, sinusoidal
positions, post-norm, tied embeddings, float16 weights) and for a BPE model built here
(learned positions, pre-norm, separate embeddings, float32 weights, Unicode and byte
fallback), every output token must be NumPy's, every logit within 1e-4 and every attention
weight of every layer and head within 1e-5. A mutant JavaScript layer (no 1/sqrt(d_k), a
look-ahead mask off by one) must fail the same comparison. The tokeniser is compared on
tricky text and on the character class of every Unicode code point.

Without Playwright or a system Chromium the browser tests skip, saying which is missing; the
export tests run anyway. Screenshots go to tests/out/web/ (git ignores it).
"""
from __future__ import annotations

import base64
import contextlib
import functools
import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from attn.site import browser
from attn.data import BOS, EOS, Vocab, read_tsv
from attn.decode import EXTRA_LENGTH, beam_search, greedy_decode
from attn.evaluate import source_ids
from attn.site.export import ExportError, export_model, load_export, main as export_main
from attn.model import Transformer, TransformerConfig
from attn.text import _char_kind, detokenize, normalize, tokenize

ROOT = Path(__file__).resolve().parents[1]
TOY_MODEL = ROOT / "web" / "model"
OUT = ROOT / "tests" / "out" / "web"
LOGIT_TOL, ATTENTION_TOL = 1e-4, 1e-5

MISSING = browser.missing()
needs_browser = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

TRICKY = [
    "the old friend laughed .", "Hello, world!  It's 3.5km.", "It's 3.5 km, „quite“ far.", "Tom's car costs 1,000$",
    "don't -- well-known l'homme rock'n'roll 'quoted' -dash- a-", "Cafe\u0301 au\tlait \n", "soft\u00adhyphen",
    "zero\u200bwidth", "nbsp\u00a0here\u2028line\u2029para", "ctrl\x00\x1f\x7fchars", "\ufeffbom", "##, ###",
    "rtl \u200fmark\u200e", "👨\u200d👩\u200d👧 family", "🇩🇪 flag 1\ufe0f\u20e3", "नमस्ते दुनिया", "ภาษาไทย", "日本語の文",
    "مرحبا بالعالم", "Straße, Äpfel & Öl — 20 €", "e\u0301\u0301 double accent", "a\u200cb a\u200db \u200c", "x_y __init__",
    "   ", "", "½ ² Ⅻ ① ٣", "Ǆemal ǅ", "i\u0307 İ", "क्\u200dष", "the end.\u0085next",
]
DETOKENIZE = [["caf", "##<0xC3>", "##<0xA9>"], ["<0xE2>", "##<0x82>"], ["<0xFF>", "x"], ["a", "##<0xC3>", "b"],
              ["<0xF0>", "##<0x9F>", "##<0x98>"], ["<0xED>", "##<0xA0>", "##<0x80>"], ["##x", "<0x41>"], ["<0xc3>"]]


# --------------------------------------------------------------------------- models

def _bpe_model(tmp_path_factory):
    """A BPE vocabulary learned on the real-text fixture, and an untrained model that uses every
    option the toy model does not: learned positions, pre-norm, separate embeddings, float32."""
    pairs = read_tsv(ROOT / "tests" / "fixtures" / "real_text.tsv")
    texts = [s for s, _ in pairs] + [t for _, t in pairs]
    vocab = Vocab.build_bpe(texts, vocab_size=700)
    cfg = TransformerConfig(vocab_size=len(vocab), d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2,
                            n_decoder_layers=2, dropout=0.0, max_len=40, positional="learned", norm_position="pre",
                            share_embeddings=False)
    model = Transformer(cfg, seed=3)
    for name, p in model.params.items():          # untrained gains and biases would hide mistakes: perturb them
        if name.endswith((".gamma", ".beta")) or name.rsplit(".", 1)[1].startswith("b"):
            p += np.random.default_rng(len(name)).normal(0, 0.1, p.shape).astype(p.dtype)
    out = tmp_path_factory.mktemp("bpe-model")
    sentences = texts + [s for s in TRICKY if tokenize(s)][:12] + ["a \U0001F600 emoji and 漢字 never seen"]
    export_model(model, vocab, out, "float32", sentences, source="tests/test_web.py")
    return out


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return _bpe_model(tmp_path_factory)


# --------------------------------------------------------------------------- the format (no browser)

def test_the_shipped_model_reads_back_and_translates():
    model, vocab, doc = load_export(TOY_MODEL)
    assert doc["weights"]["dtype"] == "float16" and len(doc["sentences"]) >= 50
    assert (TOY_MODEL / "weights.bin").stat().st_size == doc["weights"]["bytes"] < 2_500_000
    from attn.evaluate import translate
    pairs = list(zip(doc["sentences"], (ROOT / "data" / "toy" / "test.tk").read_text().splitlines()))[:20]
    hyps = [t.text for t in translate(model, vocab, [s for s, _ in pairs])]
    assert sum(h == r for h, (_, r) in zip(hyps, pairs)) >= 15, "the shipped toy model should translate"


def test_export_round_trip_is_exact_and_float16_rounds(tmp_path, bpe_dir):
    model, vocab, doc = load_export(bpe_dir)
    assert vocab.bpe is not None and doc["config"]["positional"] == "learned"
    export_model(model, vocab, tmp_path / "f32", "float32")
    export_model(model, vocab, tmp_path / "f16", "float16")
    same, _, _ = load_export(tmp_path / "f32")
    half, _, doc16 = load_export(tmp_path / "f16")
    assert doc16["weights"]["bytes"] * 2 == doc["weights"]["bytes"]
    for name, p in model.params.items():
        assert np.array_equal(same.params[name], p), name
        assert np.array_equal(half.params[name], p.astype(np.float16).astype(np.float32)), name
    text = (bpe_dir / "model.json").read_text(encoding="utf-8")
    assert json.loads(text)["vocab"] == vocab.to_json()
    offsets = [(t["offset"], t["shape"]) for t in doc["weights"]["tensors"]]
    assert offsets[0][0] == 0 and all(o2 == o1 + 4 * int(np.prod(s1)) for (o1, s1), (o2, _) in zip(offsets, offsets[1:]))


def test_export_command_and_its_errors(tmp_path, capsys):
    model = Transformer(TransformerConfig.preset("toy", vocab_size=8), seed=0)
    vocab = Vocab(["<pad>", "<s>", "</s>", "<unk>", "a", "b", "c", "."])
    ckpt = model.save(tmp_path / "c.npz", extra_meta={"vocab": vocab.to_json()})
    (tmp_path / "s.txt").write_text("a b .\n\nc .\n", encoding="utf-8")
    assert export_main([str(ckpt), str(tmp_path / "out"), "--sentences", str(tmp_path / "s.txt")]) == 0
    assert "wrote" in capsys.readouterr().out
    back, v, doc = load_export(tmp_path / "out")
    assert doc["sentences"] == ["a b .", "c ."] and v == vocab
    assert np.array_equal(back.params["embedding.weight"], model.params["embedding.weight"])
    assert export_main([str(tmp_path / "missing.npz"), str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "out" / "weights.bin").write_bytes(b"\0" * 12)
    with pytest.raises(ExportError, match="has 12 bytes"):
        load_export(tmp_path / "out")
    with pytest.raises(ExportError, match="does not exist"):
        load_export(tmp_path / "nothing")
    big = Transformer(TransformerConfig.preset("toy", vocab_size=8), seed=0)
    big.params["embedding.weight"][0, 0] = 1e6
    with pytest.raises(ValueError, match="float16's range"):
        export_model(big, vocab, tmp_path / "o3", "float16")


# --------------------------------------------------------------------------- in the browser

def _broken(doc: dict, case: str) -> tuple[dict, int | None]:
    """``doc`` (the toy model's model.json) spoilt as ``case`` says; and weights.bin's new size
    (None: unchanged)."""
    doc = json.loads(json.dumps(doc))
    tensors = doc["weights"]["tensors"]
    if case == "missing-tensor":
        del tensors[5]
    elif case == "n-heads-3":
        doc["config"]["n_heads"] = 3
    elif case == "wrong-shape":
        doc["config"]["d_ff"] //= 2
    elif case == "extra-tensor":
        tensors.append({**tensors[-1], "name": "decoder.9.ffn.b2"})
    elif case == "vocabulary-size":
        doc["vocab"].append("an-extra-token")
    elif case == "unknown-field":
        doc["config"]["n_head"] = 4
    elif case == "short-weights":
        return doc, doc["weights"]["bytes"] - 2
    elif case == "layers-1e8":
        doc["config"]["n_encoder_layers"] = 10**8
    elif case == "both-layers-1e8":                       # as attn-train --layers 1e8 asks
        doc["config"]["n_encoder_layers"] = doc["config"]["n_decoder_layers"] = 10**8
    elif case == "max-len-1e6":
        doc["config"]["max_len"] = 10**6
    elif case == "source-limit-1e9":
        doc["max_source_tokens"] = 10**9
    elif case == "unknown-ffn":
        doc["config"]["ffn"] = "geglu"
    elif case == "no-sentences":
        del doc["sentences"]
    return doc, None


#: Each broken model, and what load_export's error and the page's both say.
BROKEN = {"missing-tensor": "does not fit the config: missing", "n-heads-3": "must be divisible by n_heads",
          "wrong-shape": "the config says", "extra-tensor": "unexpected", "vocabulary-size": "the vocabulary has",
          "unknown-field": "unknown fields", "short-weights": "bytes",
          "layers-1e8": "n_encoder_layers = 100,000,000 gives", "nan-weights": "holds NaN or infinite numbers",
          "both-layers-1e8": "n_encoder_layers = 100,000,000 and n_decoder_layers",
          "source-limit-1e9": "max_source_tokens must be an integer from 2 to 4,096",
          "max-len-1e6": "max_len must be at most 8,192",
          "unknown-ffn": "ffn must be one of"}


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory):
    """A folder of broken copies of the toy model: broken_dir/CASE/{model.json, weights.bin}."""
    root = tmp_path_factory.mktemp("broken")
    doc = json.loads((TOY_MODEL / "model.json").read_text(encoding="utf-8"))
    raw = (TOY_MODEL / "weights.bin").read_bytes()
    for case in [*BROKEN, "no-sentences"]:
        spoilt, size = _broken(doc, case)
        (root / case).mkdir()
        (root / case / "model.json").write_text(json.dumps(spoilt), encoding="utf-8")
        weights = raw if size is None else raw[:size]
        if case == "nan-weights":                     # the toy model's weights are float16: a NaN is 0x7e00
            weights = weights[:100] + b"\x00\x7e" + weights[102:]
        (root / case / "weights.bin").write_bytes(weights)
    return root


@pytest.fixture(scope="module")
def site(bpe_dir, broken_dir):
    if MISSING:
        pytest.skip(MISSING)
    with browser.serve(browser.WEB_DIR, {"/_test/bpe/": bpe_dir, "/_test/broken/": broken_dir}) as url, \
            browser.chromium() as chromium:
        yield url, chromium


RUN_JS = """async ({modelUrl, sentences, beamSize}) => {
  const { loadModel } = await import("/attn/model.js");
  const { translate } = await import("/attn/decode.js");
  const { model, vocab } = await loadModel(modelUrl);
  const pack = (arrays) => {
    const n = arrays.reduce((a, x) => a + x.length, 0), all = new Float32Array(n);
    let o = 0;
    for (const x of arrays) { all.set(x, o); o += x.length; }
    const bytes = new Uint8Array(all.buffer);
    let s = "";
    for (let i = 0; i < bytes.length; i += 8192) s += String.fromCharCode(...bytes.subarray(i, i + 8192));
    return btoa(s);
  };
  return sentences.map((text) => {
    const r = translate(model, vocab, text, { beamSize });
    return { srcTokens: r.srcTokens, srcIds: r.srcIds, ids: r.ids, text: r.text, score: r.score,
             logits: pack(r.steps.map((s) => s.logits)),
             encoder: pack(r.attention.encoder.map((w) => w.data)),
             decoderSelf: pack(r.attention.decoderSelf.map((w) => w.data)),
             cross: pack(r.attention.cross.map((w) => w.data)) };
  });
}"""


def _serve_mutant(old: str, new: str):
    """A route handler that serves the module with ``old`` replaced by ``new`` (Playwright calls
    it with the route and the request)."""
    def handler(route, request=None):
        body = route.fetch().text()
        assert old in body, f"the mutant's target {old!r} is not in {route.request.url}"
        route.fulfill(body=body.replace(old, new), content_type="text/javascript")
    return handler


@contextlib.contextmanager
def fresh_page(site, model_url, routes=None):
    """A page of a fresh browser context at index.html?model=MODEL_URL, once it has loaded; ``routes``
    {url glob: (old, new)} serve a module with one piece of text replaced (a mutant). What the page
    throws fails the test."""
    url, chromium = site
    context = chromium.new_context()
    errors = []
    try:
        for glob, (old, new) in (routes or {}).items():
            context.route(glob, _serve_mutant(old, new))
        page = context.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url + "index.html?model=" + model_url)
        page.wait_for_function("() => ['ready', 'done', 'error'].includes(document.body.dataset.state)", timeout=60_000)
        yield page
    finally:
        context.close()
    assert not errors, errors


def run_in_browser(site, model_url, sentences, beam_size=1, routes=None):
    """Translate ``sentences`` in a fresh page (``routes``: as fresh_page's). Returns the
    per-sentence results of RUN_JS."""
    with fresh_page(site, model_url, routes) as page:
        return page.evaluate(RUN_JS, {"modelUrl": site[0] + model_url, "sentences": sentences, "beamSize": beam_size})


def _floats(b64):
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


def compare(model, vocab, sentence, js, beam_size=1) -> list[str]:
    """Every way the browser's result for ``sentence`` differs from attn's in NumPy (empty: none)."""
    problems = []
    tokens = vocab.tokenize(sentence)
    src = source_ids(vocab, tokens)
    if model.config.positional == "learned":
        src = src[:model.config.max_len]          # as attn.evaluate.translate cuts it
    if js["srcTokens"] != (tokens + ["</s>"])[:len(src)] or js["srcIds"] != src:
        return [f"source tokens {js['srcTokens']} / ids {js['srcIds']}, NumPy {tokens} / {src}"]
    src_a = np.array([src])
    if beam_size == 1:
        res = greedy_decode(model, src_a)
    else:
        res = beam_search(model, src_a, beam_size=beam_size)
        if abs(res.scores[0] - js["score"]) > LOGIT_TOL:
            problems.append(f"beam score {js['score']}, NumPy {res.scores[0]}")
    limit = len(src) + EXTRA_LENGTH
    if model.config.positional == "learned":
        limit = min(limit, model.config.max_len)
    out = res.tokens[0]
    expected = out + [EOS] if len(out) < limit else out       # a search that stops at the limit has no EOS
    if js["ids"] != expected:
        return problems + [f"output ids {js['ids']}, NumPy {expected}"]
    tgt_in = np.array([[BOS] + expected[:-1]])
    logits, cache = model.forward(src_a, tgt_in)
    T, S, H, V = tgt_in.shape[1], len(src), model.config.n_heads, logits.shape[-1]
    err = np.abs(_floats(js["logits"]).reshape(T, V) - logits[0]).max()
    if not err <= LOGIT_TOL:
        problems.append(f"logits differ by {err:.3g}")
    weights = Transformer.attention_weights(cache)
    for kind, stack, shape in (("encoder", "encoder.{}.self_attn", (H, S, S)),
                               ("decoderSelf", "decoder.{}.self_attn", (H, T, T)),
                               ("cross", "decoder.{}.cross_attn", (H, T, S))):
        n = model.config.n_encoder_layers if kind == "encoder" else model.config.n_decoder_layers
        got = _floats(js[kind]).reshape(n, *shape)
        for i in range(n):
            err = np.abs(got[i] - weights[stack.format(i)][0]).max()
            if not err <= ATTENTION_TOL:
                problems.append(f"{stack.format(i)} weights differ by {err:.3g}")
    return problems


@needs_browser
def test_the_page_equals_numpy_on_50_toy_test_sentences(site):
    model, vocab, doc = load_export(TOY_MODEL)
    sentences = doc["sentences"][:50]
    results = run_in_browser(site, "model", sentences)
    problems = {s: p for s, js in zip(sentences, results) if (p := compare(model, vocab, s, js))}
    assert not problems, problems
    refs = (ROOT / "data" / "toy" / "test.tk").read_text(encoding="utf-8").splitlines()
    print(f"\n{sum(js['text'] == r for js, r in zip(results, refs))} of {len(sentences)} translations equal "
          f"the reference")


@needs_browser
def test_the_page_equals_numpy_with_bpe_learned_positions_pre_norm(site, bpe_dir):
    model, vocab, doc = load_export(bpe_dir)
    results = run_in_browser(site, "_test/bpe/", doc["sentences"])
    problems = {s: p for s, js in zip(doc["sentences"], results) if (p := compare(model, vocab, s, js))}
    assert not problems, problems
    assert any("<0x" in vocab.itos[i] for js in results for i in js["srcIds"]), "no byte fallback was exercised"


@needs_browser
def test_beam_search_equals_numpy(site):
    model, vocab, doc = load_export(TOY_MODEL)
    sentences = doc["sentences"][50:60]
    results = run_in_browser(site, "model", sentences, beam_size=4)
    problems = {s: p for s, js in zip(sentences, results) if (p := compare(model, vocab, s, js, beam_size=4))}
    assert not problems, problems


MUTANTS = {
    "attention without 1/sqrt(d_k)": ("**/attn/layers.js", ("const scale = Math.fround(1 / Math.sqrt(dk));",
                                                            "const scale = 1;")),
    "look-ahead mask off by one": ("**/attn/masks.js", ("j <= offset + i ? 1 : 0", "j < offset + i ? 1 : 0")),
    "cached decoding one position ahead": ("**/attn/model.js", ('this.embed("tgt", [token], t)',
                                                                'this.embed("tgt", [token], t + 1)')),
}


@needs_browser
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_mutant_layer_fails_the_comparison(site, mutant):
    glob, replace = MUTANTS[mutant]
    model, vocab, doc = load_export(TOY_MODEL)
    sentences = doc["sentences"][:5]
    results = run_in_browser(site, "model", sentences, routes={glob: replace})
    problems = [p for s, js in zip(sentences, results) for p in compare(model, vocab, s, js)]
    assert problems, f"the mutant '{mutant}' passed the comparison with NumPy"


def _open(site, query: str, until="() => ['ready', 'error'].includes(document.body.dataset.state)"):
    """A fresh page at index.html?QUERY, waited on until ``until``; returns (context, page,
    errors: what the page threw)."""
    url, chromium = site
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.goto(url + "index.html" + query)
    page.wait_for_function(until, timeout=60_000)
    return context, page, errors


@needs_browser
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_model_is_refused_with_a_message_on_the_page(site, broken_dir, case):
    """A model.json that lacks a tensor, has one too many, does not fit its config (n_heads 3
    against d_model 128, a shape, the vocabulary's size) or a weights.bin of the wrong size:
    load_export refuses it, and so does the page, saying why on the page, never busy for ever."""
    with pytest.raises(ExportError, match=BROKEN[case]):
        load_export(broken_dir / case)
    context, page, errors = _open(site, f"?model=_test/broken/{case}/")
    try:
        assert page.evaluate("document.body.dataset.state") == "error"
        message = page.locator("#message")
        assert message.is_visible() and BROKEN[case] in message.inner_text(), message.inner_text()
        assert "could not load the model" in message.inner_text() and page.locator("#source").is_disabled()
        assert not errors, errors
    finally:
        context.close()


@needs_browser
def test_a_model_without_example_sentences_loads_and_translates(site, broken_dir):
    """``sentences`` is optional in model.json: without it the page offers no examples, and
    translates what is typed (it waited for ever before)."""
    assert load_export(broken_dir / "no-sentences")[0] is not None
    context, page, errors = _open(site, "?model=_test/broken/no-sentences/")
    try:
        assert page.evaluate("document.body.dataset.state") == "ready"
        page.evaluate("window.attnPage.run('the old dog .')")
        page.wait_for_function("() => document.body.dataset.state === 'done'", timeout=60_000)
        assert page.locator("#output .tok").count() > 0 and not errors, errors
    finally:
        context.close()


@pytest.fixture(scope="module")
def limit_dir(tmp_path_factory):
    """The toy model with ``max_source_tokens`` 6 (five words and the end mark): the page's limit
    read from model.json."""
    out = tmp_path_factory.mktemp("limit-5")
    doc = json.loads((TOY_MODEL / "model.json").read_text(encoding="utf-8"))
    doc["max_source_tokens"] = 6
    (out / "model.json").write_text(json.dumps(doc), encoding="utf-8")
    (out / "weights.bin").write_bytes((TOY_MODEL / "weights.bin").read_bytes())
    return out


LONG_WORDS = "the old king found a car on young eggs and".split()


def _words(n: int) -> str:
    """A toy sentence of n word tokens."""
    return " ".join(LONG_WORDS[i % len(LONG_WORDS)] for i in range(n))


@needs_browser
def test_a_long_input_shows_a_message_and_is_not_translated(site):
    """1,000 words typed (pasted) into the page: no translation, no freeze, a message saying the
    limit (512 tokens with the end mark, attn-translate's default, as the toy model's model.json
    sets none); translate() in JavaScript refuses 512 words (513 tokens). (A sentence at the
    limit translating: the next test, with a limit of its own.)"""
    context, page, errors = _open(site, "")
    try:
        page.fill("#source", _words(1000))
        page.wait_for_function("() => document.body.dataset.state === 'done'", timeout=60_000)
        message = page.locator("#message")
        assert message.is_visible(), "no message for a sentence of 1,000 tokens"
        assert "1,001 tokens" in message.inner_text() and "at most 512" in message.inner_text()
        assert page.locator("#output .tok").count() == 0 and page.locator(".maps canvas").count() == 0
        refused = page.evaluate("""async (text) => {
          const { translate, MAX_SOURCE_TOKENS } = await import("/attn/decode.js");
          try { translate(window.attnPage.model, window.attnPage.vocab, text); return "translated"; }
          catch (e) { return `${e.name}: ${e.message} (${MAX_SOURCE_TOKENS})`; }
        }""", _words(512))
        assert refused == "RangeError: translate: 513 tokens, more than the 512 the model takes (512)"
        assert not errors, errors
    finally:
        context.close()


@needs_browser
def test_the_limit_comes_from_model_json_when_it_has_one(site, limit_dir):
    url, chromium = site
    with browser.serve(browser.WEB_DIR, {"/_test/limit/": limit_dir}) as url2:
        context, page, errors = _open((url2, chromium), "?model=_test/limit/")
        try:
            page.fill("#source", _words(6))
            page.wait_for_function("() => document.body.dataset.state === 'done'")
            assert "7 tokens" in page.inner_text("#message") and "at most 6" in page.inner_text("#message")
            page.fill("#source", _words(5))
            page.wait_for_function("() => document.body.dataset.state === 'done' && window.attnTiming.sourceTokens === 6")
            assert page.locator("#message").is_hidden() and page.locator("#output .tok").count() > 0
            assert not errors, errors
        finally:
            context.close()


#: Installed in the page: counts animation frames (all, and those while it is busy), the longest
#: gap between two frames while busy, and records the page's state at each keydown.
PROBE_JS = """() => {
  const probe = window.attnProbe = { frames: 0, busyFrames: 0, longestGap: 0, keys: [], last: null };
  const tick = (t) => {
    probe.frames += 1;
    if (document.body.dataset.state === "busy") {
      probe.busyFrames += 1;
      if (probe.last !== null) probe.longestGap = Math.max(probe.longestGap, t - probe.last);
      probe.last = t;
    } else probe.last = null;
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
  document.addEventListener("keydown", (e) => probe.keys.push({ key: e.key, state: document.body.dataset.state,
                                                                busyFrames: probe.busyFrames }), { capture: true });
}"""


@needs_browser
def test_the_page_answers_input_while_a_long_sentence_decodes(site):
    """A 200-token sentence with beam search 4 (the page's longest work): while it decodes, the page
    keeps painting (animation frames come while it is busy: Playwright's wait below polls in
    animation frames, so a page that froze until the end would never be seen busy) and handles
    keys (a keydown arrives while it is still busy). Counted, not timed; the figures are printed."""
    context, page, errors = _open(site, "")
    try:
        # Chromium's CPU slowed 4 times: the decoding outlasts Playwright's round trips on any machine.
        context.new_cdp_session(page).send("Emulation.setCPUThrottlingRate", {"rate": 4})
        page.evaluate(PROBE_JS)
        page.select_option("#beam", "4")
        page.wait_for_function("() => document.body.dataset.state === 'done'", timeout=60_000)
        page.evaluate("(text) => { window.attnPage.run(text); }", _words(200))     # not awaited
        page.wait_for_function("() => document.body.dataset.state === 'busy' && window.attnProbe.busyFrames >= 3",
                               polling="raf", timeout=60_000)
        for _ in range(3):
            page.keyboard.press("Shift")
        page.wait_for_function("() => document.body.dataset.state === 'done'", timeout=120_000)
        probe, timing = page.evaluate("[window.attnProbe, window.attnTiming]")
        assert [k["state"] for k in probe["keys"]].count("busy") >= 1, probe["keys"]
        assert timing["sourceTokens"] == 201 and timing["turns"] >= 3, timing
        assert not errors, errors
        print(f"\n200 tokens, beam 4, CPU slowed 4 times: {timing['ms']:.0f} ms, {timing['tokens']} tokens out; the browser got "
              f"{timing['turns']} turns, {probe['busyFrames']} animation frames while busy, the longest gap "
              f"between two {probe['longestGap']:.0f} ms; keys handled while busy: "
              f"{[k['state'] for k in probe['keys']].count('busy')} of {len(probe['keys'])}")
    finally:
        context.close()


@contextlib.contextmanager
def _another_site(directory):
    """``directory`` served on 127.0.0.1 at another port, another origin, that lets any origin
    read it (Access-Control-Allow-Origin: *); yields (its origin, the paths it was asked for)."""
    import http.server
    import threading
    asked = []

    class Handler(browser._Handler):
        def send_head(self):
            asked.append(self.path)
            return super().send_head()

        def end_headers(self):
            self.send_header("Access-Control-Allow-Origin", "*")
            super().end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@needs_browser
def test_a_model_from_another_origin_needs_the_readers_consent(site):
    """?model= on another origin (a site that allows it): without &allow-origin= the page fetches
    nothing from it and says how to opt in, and the Content-Security-Policy itself blocks a
    fetch there; with &allow-origin= naming that origin the page asks, fetches nothing until the
    reader presses its button, and then loads and translates. Other addresses are refused."""
    with _another_site(browser.WEB_DIR) as (origin, asked):
        model = f"{origin}/model/"
        context, page, errors = _open(site, f"?model={model}")
        try:
            assert page.evaluate("document.body.dataset.state") == "error"
            text = page.inner_text("#message")
            assert "another site" in text and f"&allow-origin={origin}" in text, text
            blocked = page.evaluate("""async (url) => {
              const seen = [];
              document.addEventListener("securitypolicyviolation", (e) => seen.push(e.violatedDirective));
              try { await fetch(url); return "fetched"; }
              catch (e) { await new Promise((r) => setTimeout(r, 50)); return seen.join(" ") || e.name; }
            }""", model + "model.json")
            assert blocked == "connect-src", blocked
            assert asked == [], asked
        finally:
            context.close()
        errors.clear()
        for query in (f"?model={model}&allow-origin=http://127.0.0.1:1", f"?model={model}&allow-origin=nonsense",
                      "?model=javascript:alert(1)//&allow-origin=javascript:alert(1)",
                      "?model=data:text/plain,x&allow-origin=data:text/plain,x"):
            context, page, _ = _open(site, query)
            try:
                assert page.evaluate("document.body.dataset.state") == "error", query
                assert "another site" in page.inner_text("#message"), query
            finally:
                context.close()
        assert asked == [], asked

        context, page, errors = _open(site, f"?model={model}&allow-origin={origin}",
                                      until="() => document.body.dataset.state === 'confirm'")
        try:
            assert f"Load the model from {model}?" in page.inner_text("#message")
            page.wait_for_timeout(200)
            assert asked == [], "the page fetched from another origin before the reader confirmed"
            page.click("#load-elsewhere")
            page.wait_for_function("() => ['ready', 'error'].includes(document.body.dataset.state)", timeout=60_000)
            assert page.evaluate("document.body.dataset.state") == "ready", page.inner_text("#message")
            assert sorted(asked) == ["/model/model.json", "/model/weights.bin"]
            assert page.locator("#output .tok").count() > 0 and page.locator("#message").is_hidden()
            assert not errors, errors
        finally:
            context.close()


CONFIGS = [{}, {"d_model": 12, "n_heads": 3, "d_ff": 7, "n_encoder_layers": 1, "n_decoder_layers": 3},
           {"share_embeddings": False, "vocab_size": 10, "tgt_vocab_size": 12, "positional": "learned", "norm_position": "pre",
            "max_len": 9}, {"d_model": 128, "n_heads": 3}, {"n_heads": 0}, {"d_model": -8}, {"d_ff": 1.5},
           {"n_encoder_layers": 0}, {"positional": "rotary"}, {"norm_position": "sandwich"}, {"dropout": 1.0},
           {"label_smoothing": -0.1}, {"share_embeddings": True, "vocab_size": 10, "tgt_vocab_size": 11},
           {"tgt_vocab_size": 0}, {"warmup_steps": 0}, {"heads": 4}, {"d_model": "512"},
           {"norm_position": "pre", "norm_kind": "rms", "positional": "rope", "ffn": "swiglu", "kv_heads": 2, "d_ff": 100},
           {"kv_heads": 8, "ffn": "swiglu", "d_ff": 7}, {"kv_heads": 1, "norm_kind": "rms"}, {"kv_heads": 3},
           {"kv_heads": 0}, {"d_model": 12, "n_heads": 4, "positional": "rope"}, {"norm_kind": "group"},
           {"ffn": "geglu"}, {"rope_base": 1}, {"vocab_size": 10**6, "d_model": 4096, "ffn": "swiglu", "kv_heads": 1},
           {"norm": "pre"}, {"norm": "sandwich"}, {"norm": "pre", "norm_position": "pre"},     # the old name
           {"n_encoder_layers": 0, "positional": "learned", "norm_position": "pre", "max_len": 9},   # decoder-only
           {"n_encoder_layers": 0, "share_embeddings": False}, {"n_encoder_layers": -1}]


@needs_browser
def test_the_page_checks_a_config_as_transformer_config_does(site):
    """Every config TransformerConfig refuses the page refuses; for the others (decoder-only ones,
    n_encoder_layers 0, too) the page expects exactly the tensors of attn.model.parameter_shapes,
    in its order, and counts parameter_count's numbers."""
    from attn.model import parameter_count, parameter_shapes
    url, chromium = site
    page = chromium.new_page()
    page.goto(url + "index.html")
    js = page.evaluate("""async (configs) => {
      const { checkConfig, parameterCount, parameterShapes } = await import("/attn/model.js");
      return configs.map((c) => {
        try { const k = checkConfig(c); return [[...parameterShapes(k)], parameterCount(k)]; } catch (e) { return e.message; }
      });
    }""", CONFIGS)
    page.close()
    for config, got in zip(CONFIGS, js):
        try:
            cfg = TransformerConfig.from_dict(config)
        except (ValueError, TypeError):
            assert isinstance(got, str) and got.startswith("config: "), (config, got)
            continue
        assert [[[n, list(s)] for n, s in parameter_shapes(cfg).items()], parameter_count(cfg)] == got, config


TEXT_JS = """async ({texts, pieces, detok}) => {
  const text = await import("/attn/text.js");
  const { Vocab } = await import("/attn/data.js");
  const meta = await (await fetch("/_test/bpe/model.json")).json();
  const vocab = Vocab.fromJson(meta.vocab);
  let kinds = "";
  for (let c = 0; c < 0x110000; c++) kinds += text.charKind(String.fromCodePoint(c));
  return { normalize: texts.map(text.normalize), tokenize: texts.map(text.tokenize),
           roundTrip: texts.map((s) => text.detokenize(text.tokenize(s))), bpe: texts.map((s) => vocab.tokenize(s)),
           detokenize: detok.map(text.detokenize), kinds };
}"""


@needs_browser
def test_the_tokeniser_and_bpe_equal_python(site, bpe_dir):
    url, chromium = site
    _, vocab, doc = load_export(bpe_dir)
    texts = TRICKY + doc["sentences"]
    page = chromium.new_page()
    page.goto(url + "index.html?model=_test/bpe/")
    js = page.evaluate(TEXT_JS, {"texts": texts, "pieces": [], "detok": DETOKENIZE})
    page.close()
    assert js["normalize"] == [normalize(s) for s in texts]
    assert js["tokenize"] == [tokenize(s) for s in texts]
    assert js["roundTrip"] == [normalize(s) for s in texts]
    assert js["bpe"] == [vocab.tokenize(s) for s in texts]
    assert js["detokenize"] == [detokenize(t) for t in DETOKENIZE]
    # Every code point's class: the two may differ only where Python's Unicode database
    # (unicodedata.unidata_version) leaves a character unassigned that the browser's newer one assigns.
    differ = [c for c, k in enumerate(js["kinds"]) if k != _char_kind(chr(c))]
    real = [f"U+{c:04X} {unicodedata.category(chr(c))}: browser {js['kinds'][c]}, Python {_char_kind(chr(c))}"
            for c in differ if unicodedata.category(chr(c)) != "Cn"]
    assert not real, real[:20]
    print(f"\n{len(differ)} code points unassigned in Unicode {unicodedata.unidata_version} are assigned in the browser")


@needs_browser
def test_typing_shows_every_head_and_the_hover_reads_the_weight(site):
    url, chromium = site
    model, vocab, _ = load_export(TOY_MODEL)
    cfg = model.config
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url + "index.html")
    page.wait_for_function("() => document.body.dataset.state === 'ready'", timeout=60_000)
    sentence = "the woman says that the big dog called the small cat ."
    page.fill("#source", sentence[:-1])
    page.wait_for_function("() => document.body.dataset.state === 'done'")
    page.type("#source", ".")
    page.wait_for_function(f"() => document.body.dataset.state === 'done' && "
                           f"window.attnTiming && window.attnTiming.sourceTokens === {len(tokenize(sentence)) + 1}")
    from attn.evaluate import translate
    expected = translate(model, vocab, [sentence])[0]
    shown = page.locator("#output .tok").all_inner_texts()
    assert shown == expected.tgt_tokens + ["</s>"]
    per_kind = {k: page.locator(f'.maps[data-kind="{k}"] canvas').count() for k in ("encoder", "decoderSelf", "cross")}
    assert per_kind == {"encoder": cfg.n_encoder_layers * cfg.n_heads, "decoderSelf": cfg.n_decoder_layers * cfg.n_heads,
                        "cross": cfg.n_decoder_layers * cfg.n_heads}
    # Hover one cell of the last cross-attention head: the tooltip reads NumPy's weight.
    src = np.array([source_ids(vocab, vocab.tokenize(sentence))])
    tgt = np.array([[BOS] + vocab.encode(expected.tgt_tokens)])
    _, cache = model.forward(src, tgt)
    want = Transformer.attention_weights(cache)[f"decoder.{cfg.n_decoder_layers - 1}.cross_attn"][0]
    canvas = page.locator(f'.maps[data-kind="cross"] canvas[data-layer="{cfg.n_decoder_layers - 1}"]'
                          f'[data-head="{cfg.n_heads - 1}"]')
    d = canvas.evaluate("c => ({...c.dataset})")
    canvas.scroll_into_view_if_needed()                   # the mouse moves within the viewport only
    box = canvas.bounding_box()
    row, col = 3, 2
    page.mouse.move(box["x"] + float(d["x0"]) + (col + 0.5) * float(d["cell"]),
                    box["y"] + float(d["y0"]) + (row + 0.5) * float(d["cell"]))
    tip = page.locator("#tooltip")
    assert tip.is_visible()
    assert abs(float(tip.get_attribute("data-weight")) - want[cfg.n_heads - 1, row, col]) <= ATTENTION_TOL
    assert f"{want[cfg.n_heads - 1, row, col]:.4f}" in tip.inner_text()
    OUT.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(OUT / "heads.png"), full_page=True)
    page.check("#average")
    assert page.locator(".maps canvas").count() == cfg.n_encoder_layers + 2 * cfg.n_decoder_layers
    canvas = page.locator(f'.maps[data-kind="cross"] canvas[data-layer="{cfg.n_decoder_layers - 1}"]')
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + float(d["x0"]) + (col + 0.5) * float(d["cell"]),
                    box["y"] + float(d["y0"]) + (row + 0.5) * float(d["cell"]))
    assert abs(float(tip.get_attribute("data-weight")) - want[:, row, col].mean()) <= ATTENTION_TOL
    page.screenshot(path=str(OUT / "average.png"), full_page=True)
    page.close()

"""The page continues a text with a decoder-only language model as attn computes it in NumPy.

Three small untrained language models are exported (perturbed gains and biases, as in
tests/test_web.py): the paper's block with a character vocabulary and a context shorter than
the text (so the page starts afresh from half the window, as attn.sample.generate does), the
later block (pre-norm, RMSNorm, rotary positions, SwiGLU, grouped-query attention, QK-norm) with
a word vocabulary, and learned positions stored as int8. The page feeds the prompt through the
key/value cache and generates token by token: greedy, its tokens must be attn.sample.generate's
and every step's logits within 1e-4 of NumPy's full forward over the text the model read;
sampling (temperature, top-k, top-p), every token must be
attn.sample.choose(attn.sample.distribution(NumPy's), u) for the page's u, a seed must reproduce
the text, and a mutant (the cache's key at the wrong position) must fail. lm.html generates and
draws every head; index.html refuses a language model in one line, lm.html a translator.
"""
from __future__ import annotations

import numpy as np
import pytest

from attn.data import Vocab, char_vocab, decode_text, encode_text
from attn.model import Transformer, TransformerConfig, log_softmax
from attn.sample import Sampler, choose, distribution, generate
from attn.site import browser
from attn.site.export import ExportError, export_model, load_export
from attn.text import tokenize
from test_web import LOGIT_TOL, MISSING, _floats, fresh_page, needs_browser

TEXT = "the cat sat on the mat.\nthe dog ran to the cat.\na bird sang.\n"
PROMPTS = {"char": "the ca", "words": "the dog", "int8": "a bi"}
STEPS = 24

GEN_JS = """async ({url, prompt, steps, sampler, seed}) => {
  const { loadModel } = await import("/attn/model.js");
  const lm = await import("/attn/lm.js");
  const { model, vocab, meta } = await loadModel(url);
  const { char, context } = meta.language_model;
  const ids = lm.promptIds(prompt, vocab, char), out = [];
  for (const s of lm.generateSteps(model, ids, { maxTokens: steps, sampler, seed, banned: lm.bannedIds(char),
                                                 window: context })) out.push(s);
  const logits = new Float32Array(out.flatMap((s) => [...s.logits]));
  const bytes = new Uint8Array(logits.buffer);
  let b64 = "";
  for (let i = 0; i < bytes.length; i += 8192) b64 += String.fromCharCode(...bytes.subarray(i, i + 8192));
  const tokens = out.map((s) => s.token);
  return { prompt: ids, tokens, u: out.map((s) => s.u), start: out.map((s) => s.start), logits: btoa(b64),
           text: lm.decodeText(tokens, vocab, char), lines: lm.decodeText([...ids, 2, ...tokens, 2, 0, 1, 3], vocab, char) };
}"""


def _model(vocab, seed, **options):
    cfg = TransformerConfig(vocab_size=len(vocab), d_model=16, n_heads=4, d_ff=24, n_encoder_layers=0,
                            n_decoder_layers=2, dropout=0.0, max_len=48, **options)
    model = Transformer(cfg, seed=seed)
    for name, p in model.params.items():           # untrained gains and biases would hide mistakes: perturb them
        if name.endswith(("gamma", ".beta")) or name.rsplit(".", 1)[1].startswith("b"):
            p += np.random.default_rng(len(name)).normal(0, 0.1, p.shape).astype(p.dtype)
    return model


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """lm_dir/char/, lm_dir/words/ and lm_dir/int8/ (learned positions, int8 weights): the exports."""
    root = tmp_path_factory.mktemp("lm")
    export_model(_model(char_vocab(TEXT), 0), char_vocab(TEXT), root / "char", char=True, context=12)
    words = Vocab.build([tokenize(line) for line in TEXT.split("\n")])
    later = dict(norm_position="pre", norm_kind="rms", positional="rope", ffn="swiglu", kv_heads=2, qk_norm=True)
    export_model(_model(words, 1, **later), words, root / "words", char=False)
    export_model(_model(char_vocab(TEXT), 3, positional="learned"), char_vocab(TEXT), root / "int8", "int8", char=True)
    return root


@pytest.fixture(scope="module")
def lm_site(lm_dir):
    if MISSING:
        pytest.skip(MISSING)
    with browser.serve(browser.WEB_DIR, {"/_test/lm/": lm_dir}) as url, browser.chromium() as chromium:
        yield url, chromium


def _generate(site, runs, routes=None) -> list:
    """The page's results (GEN_JS's) of runs [(case, sampler, seed)], in one page."""
    with fresh_page(site, "model", routes) as page:
        return [page.evaluate(GEN_JS, {"url": f"{site[0]}_test/lm/{case}/", "prompt": PROMPTS[case], "steps": STEPS,
                                       "sampler": sampler, "seed": seed}) for case, sampler, seed in runs]


def _problems(lm_dir, case, js, sampler) -> list[str]:
    """Every way the page's run differs from NumPy's (empty: none)."""
    model, vocab, doc = load_export(lm_dir / case)
    char, context = doc["language_model"]["char"], doc["language_model"]["context"]
    prompt = encode_text(PROMPTS[case], vocab, char)[:None if char else -1]       # the last line goes on
    if js["prompt"] != prompt:
        return [f"prompt ids {js['prompt']}, NumPy {prompt}"]
    banned = [0, 1, 3] + ([2] if char else [])
    logits = _floats(js["logits"]).reshape(STEPS, len(vocab))
    problems, seq, begin = [], list(prompt), max(0, len(prompt) - context + 1)
    for i, (token, u, start) in enumerate(zip(js["tokens"], js["u"], js["start"])):
        if len(seq) - begin >= context:                     # attn.sample.generate's window: from its last half
            begin = len(seq) - context // 2
        if start != begin:
            problems.append(f"step {i}: the model read the text from {start}, attn.sample.generate from {begin}")
        full, _ = model.forward(None, np.array([seq[start:]]))
        if not (err := np.abs(logits[i] - full[0, -1]).max()) <= LOGIT_TOL:
            problems.append(f"step {i}: logits differ by {err:.3g}")
        logp = log_softmax(full[0, -1]).astype("float64")
        logp[banned] = -np.inf
        if token != (want := choose(distribution(logp, **sampler), u)):
            problems.append(f"step {i}: token {token}, NumPy's sampler {want} for u {u}")
        seq.append(token)
    lines = decode_text([*prompt, 2, *js["tokens"], 2, 0, 1, 3], vocab, char)
    if js["text"] != decode_text(js["tokens"], vocab, char) or js["lines"] != lines:
        problems.append(f"text {js['text']!r} / {js['lines']!r}, NumPy's {lines!r}")
    if sampler["temperature"] == 0:
        want = generate(model, prompt, STEPS, Sampler(0.0), banned=banned, window=context)
        if js["tokens"] != want:
            problems.append(f"greedy tokens {js['tokens']}, attn.sample.generate's {want}")
    return problems


def _js_sampler(sampler: dict) -> dict:
    return {"temperature": sampler["temperature"], "topK": sampler.get("top_k"), "topP": sampler.get("top_p")}


RUNS = [("char", {"temperature": 0}, 0), ("words", {"temperature": 0}, 0),
        ("char", {"temperature": 0.8, "top_k": 5}, 7), ("words", {"temperature": 1.5, "top_p": 0.6}, 3),
        ("char", {"temperature": 0.8, "top_k": 5}, 7), ("char", {"temperature": 0.8, "top_k": 5}, 8),
        ("int8", {"temperature": 0}, 0)]


@needs_browser
def test_the_page_generates_as_numpy_greedy_and_sampled(lm_site, lm_dir):
    results = _generate(lm_site, [(case, _js_sampler(s), seed) for case, s, seed in RUNS])
    found = {i: p for i, ((case, s, _), js) in enumerate(zip(RUNS, results)) if (p := _problems(lm_dir, case, js, s))}
    assert not found, found
    assert max(results[0]["start"]) > 0, "the char model's text never reached its window"
    assert results[2]["tokens"] == results[4]["tokens"] != results[5]["tokens"], "a seed should reproduce a text"
    assert len(set(results[2]["tokens"])) > 1 and len(set(results[3]["tokens"])) > 1
    assert 3 not in results[1]["prompt"], "the word model should know the prompt's words"
    print("\n" + "\n".join(f"{case} {s}: {PROMPTS[case]!r} + {js['text']!r}" for (case, s, _), js in zip(RUNS, results)))


@needs_browser
def test_a_mutant_cache_fails_the_comparison(lm_site, lm_dir):
    routes = {"**/attn/model.js": ('this.heads(`${pre}.self_attn`, h, "k", t);', 'this.heads(`${pre}.self_attn`, h, "k", 0);')}
    js = _generate(lm_site, [("words", {"temperature": 0}, 0)], routes)[0]
    assert _problems(lm_dir, "words", js, {"temperature": 0}), "the mutant of the cache passed the comparison"


def test_a_language_model_exports_its_reading_and_is_checked(lm_dir, tmp_path):
    doc = load_export(lm_dir / "char")[2]
    assert doc["language_model"] == {"char": True, "context": 12}
    assert load_export(lm_dir / "words")[2]["language_model"] == {"char": False, "context": 48}
    model, vocab, _ = load_export(lm_dir / "char")
    with pytest.raises(ValueError, match="context must be an integer from 1 to the model's max_len"):
        export_model(model, vocab, tmp_path / "x", context=49)
    import json
    path = lm_dir / "char" / "model.json"
    for spoilt in ({"char": True}, {"char": "yes", "context": 4}, None):
        bad = tmp_path / str(len(list(tmp_path.iterdir())))
        bad.mkdir()
        (bad / "weights.bin").write_bytes((lm_dir / "char" / "weights.bin").read_bytes())
        d = json.loads(path.read_text())
        d["language_model"] = spoilt
        if spoilt is None:
            del d["language_model"]
        (bad / "model.json").write_text(json.dumps(d))
        with pytest.raises(ExportError, match="a decoder-only model needs language_model"):
            load_export(bad)


def _open(site, query: str):
    """A fresh page at site's query once it has loaded (or refused); returns (context, page)."""
    url, chromium = site
    context = chromium.new_context()
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + query)
    page.wait_for_function("() => ['ready', 'error'].includes(document.body.dataset.state)", timeout=60_000)
    return context, page, errors


@needs_browser
def test_the_writing_page_generates_draws_the_heads_and_each_page_refuses_the_other_model(lm_site, lm_dir):
    model, vocab, doc = load_export(lm_dir / "words")
    context, page, errors = _open(lm_site, "lm.html?model=_test/lm/words/")
    try:
        assert page.evaluate("document.body.dataset.state") == "ready", page.inner_text("#message")
        page.fill("#max-tokens", "0")
        page.click("#generate")
        page.wait_for_function("() => document.body.dataset.state === 'error'", timeout=10_000)
        refused = page.inner_text("#message")
        page.fill("#prompt", PROMPTS["words"])
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "12")
        page.click("#generate")
        page.wait_for_function("() => ['done', 'error'].includes(document.body.dataset.state)", timeout=60_000)
        last = page.evaluate("window.attnLm.last")
        shown = page.inner_text("#output")
        maps = page.eval_on_selector_all(".maps canvas", "cs => cs.map((c) => [+c.dataset.rows, +c.dataset.cols])")
        refusals = page.evaluate("""async () => {
          const { checkExport } = await import("/attn/model.js");
          const doc = await (await fetch("/_test/lm/words/model.json")).json(), lm = doc.language_model;
          return [undefined, { char: "no", context: 4 }, { char: true, context: 49 }].map((spoilt) => {
            try { checkExport({ ...doc, language_model: spoilt }); return "loaded"; } catch (e) { return e.message; }
          }).concat([checkExport({ ...doc, language_model: lm }).config.n_encoder_layers]);
        }""")
    finally:
        context.close()
    assert not errors, errors
    assert refused == "cannot generate: tokens must be a whole number from 1 to 2000, got 0", refused
    assert all(r.startswith("a decoder-only model needs language_model") for r in refusals[:3]) and refusals[3] == 0
    prompt = encode_text(PROMPTS["words"], vocab, False)[:-1]
    assert last["tokens"] == generate(model, prompt, 12, Sampler(0.0), banned=[0, 1, 3])
    assert shown == PROMPTS["words"] + decode_text(last["tokens"], vocab, False) == PROMPTS["words"] + last["text"]
    assert maps == [[12, len(prompt) + 11]] * (model.config.n_decoder_layers * model.config.n_heads)
    for query, says in (("index.html?model=_test/lm/char/", "holds a language model (n_encoder_layers 0), which writes"),
                        ("lm.html?model=model", "holds a translator (an encoder-decoder), which this page does not run")):
        context, page, errors = _open(lm_site, query)
        try:
            assert page.evaluate("document.body.dataset.state") == "error" and says in page.inner_text("#message")
        finally:
            context.close()
        assert not errors, errors


@needs_browser
def test_the_writing_page_stops_where_attn_generate_stops(lm_site, lm_dir):
    """A stop string ends the page's text after the token that completes it, as attn-generate's
    --stop does: the same tokens as attn.sample.generate's with that stop, the text cut at its end;
    a line end in it is written "\\n" in the field."""
    model, vocab, doc = load_export(lm_dir / "char")
    prompt, context, banned = encode_text(PROMPTS["char"], vocab, True), doc["language_model"]["context"], [0, 1, 2, 3]
    free = decode_text(generate(model, prompt, STEPS, Sampler(0.0), banned=banned, window=context), vocab, True)
    stop = free[5:8]
    ids = generate(model, prompt, STEPS, Sampler(0.0), stop=lambda new: stop in decode_text(new, vocab, True),
                   banned=banned, window=context)
    text = decode_text(ids, vocab, True)
    want = text[:text.index(stop) + len(stop)]
    assert len(ids) < STEPS and want != free, (stop, free)
    context_, page, errors = _open(lm_site, "lm.html?model=_test/lm/char/")
    try:
        page.fill("#prompt", PROMPTS["char"])
        page.fill("#temperature", "0")
        page.fill("#max-tokens", str(STEPS))
        page.fill("#stop-at", stop.replace("\n", "\\n"))
        page.click("#generate")
        page.wait_for_function("() => ['done', 'error'].includes(document.body.dataset.state)", timeout=30_000)
        last, shown = page.evaluate("window.attnLm.last"), page.inner_text("#output")
        parsed = page.evaluate("""async () => {
          const { parseStop, cutAtStop } = await import("/attn/lm.js");
          return [parseStop(""), parseStop("a\\\\nb"), cutAtStop("to be or", "be"), cutAtStop("to be", "or")];
        }""")
    finally:
        context_.close()
    assert not errors, errors
    assert last["tokens"] == ids, (last["tokens"], ids, stop)
    assert last["text"] == want and shown == PROMPTS["char"] + want, (shown, want)
    assert parsed == [None, "a\nb", "to be", "to be"], parsed


def test_the_export_command_reads_a_language_models_checkpoint(tmp_path, capsys):
    from attn.site.export import main as export_main
    vocab = char_vocab(TEXT)
    ckpt = _model(vocab, 2).save(tmp_path / "lm.npz", extra_meta={"vocab": vocab.to_json(),
                                                                  "args": {"char": True, "context": 10}})
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 0
    assert "a language model (characters, context 10)" in capsys.readouterr().out
    model, back, doc = load_export(tmp_path / "out")
    assert doc["language_model"] == {"char": True, "context": 10} and back == vocab
    assert model.config.n_encoder_layers == 0

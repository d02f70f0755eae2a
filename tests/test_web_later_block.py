"""The page computes the later models' block (lesson 26) as attn computes it in NumPy.

A small untrained model with each part alone (RMSNorm, rotary positions, SwiGLU, grouped-query
attention) and with all of them on a pre-norm block (one key/value head: multi-query) is
exported, and the page's greedy translations, and beam search on the last, are compared with
NumPy's as tests/test_web.py compares the paper's block: every output token, every logit within
1e-4, every attention weight within 1e-5. A mutant of each part (RoPE pairing neighbours instead
of the half split, a query head reading the wrong key/value head, SwiGLU's gate and value paths
exchanged, RMSNorm's mean over D - 1 features, a decoded key turned to position 0 instead of its
own) must fail the same comparison.
"""
from __future__ import annotations

import numpy as np
import pytest

from attn.site import browser
from attn.site.export import export_model, load_export
from attn.model import Transformer, TransformerConfig
from test_web import MISSING, RUN_JS, TOY_MODEL, compare, fresh_page, needs_browser

#: Each model's options beside the common ones of _config.
CASES = {
    "rms": {"norm_kind": "rms"},
    "rope": {"positional": "rope"},
    "swiglu": {"ffn": "swiglu"},
    "gqa": {"kv_heads": 2, "share_embeddings": False},
    "all": {"norm_position": "pre", "norm_kind": "rms", "positional": "rope", "ffn": "swiglu", "kv_heads": 1},
}
SENTENCES = 3


def _config(vocab_size, **options) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab_size, d_model=16, n_heads=4, d_ff=24, n_encoder_layers=2,
                             n_decoder_layers=2, dropout=0.0, max_len=64, **options)


@pytest.fixture(scope="module")
def later_dir(tmp_path_factory):
    """later_dir/CASE/: an export of an untrained model of the toy vocabulary with CASES[CASE]."""
    _, vocab, doc = load_export(TOY_MODEL)
    root = tmp_path_factory.mktemp("later")
    for i, (case, options) in enumerate(CASES.items()):
        model = Transformer(_config(len(vocab), **options), seed=i)
        for name, p in model.params.items():   # untrained gains and biases would hide mistakes: perturb them
            if name.endswith((".gamma", ".beta")) or name.rsplit(".", 1)[1].startswith("b"):
                p += np.random.default_rng(len(name)).normal(0, 0.1, p.shape).astype(p.dtype)
        export_model(model, vocab, root / case, "float32", doc["sentences"][:SENTENCES])
    return root


@pytest.fixture(scope="module")
def later_site(later_dir):
    if MISSING:
        pytest.skip(MISSING)
    with browser.serve(browser.WEB_DIR, {"/_test/later/": later_dir}) as url, browser.chromium() as chromium:
        yield url, chromium


def _translate(site, cases, beam_size=1, routes=None, sentences=SENTENCES) -> dict:
    """The page's results (RUN_JS's) for the first ``sentences`` of every case's, in one page:
    {case: [result, ...]}."""
    texts = load_export(TOY_MODEL)[2]["sentences"][:sentences]
    with fresh_page(site, f"_test/later/{cases[0]}/", routes) as page:
        assert page.evaluate("document.body.dataset.state") != "error", page.inner_text("#message")
        return {case: page.evaluate(RUN_JS, {"modelUrl": f"{site[0]}_test/later/{case}/", "sentences": texts,
                                             "beamSize": beam_size})
                for case in cases}


def _problems(later_dir, results, beam_size=1) -> dict:
    found = {}
    for case, js in results.items():
        model, vocab, doc = load_export(later_dir / case)
        for s, r in zip(doc["sentences"], js):
            if problems := compare(model, vocab, s, r, beam_size):
                found[(case, s)] = problems
    return found


@needs_browser
def test_the_page_equals_numpy_with_each_part_of_the_later_block_and_all(later_site, later_dir):
    results = _translate(later_site, list(CASES))
    assert not _problems(later_dir, results), _problems(later_dir, results)
    assert sum(len(r["ids"]) for js in results.values() for r in js) > 20 * len(CASES)
    beams = _translate(later_site, ["all"], beam_size=3)
    assert not _problems(later_dir, beams, beam_size=3)


MUTANTS = {
    "rope": ("**/attn/layers.js", ("const a = x.data[o + i], b = x.data[o + half + i]",
                                   "const a = x.data[o + 2 * i], b = x.data[o + 2 * i + 1]")),
    "gqa": ("**/attn/layers.js", ("const h = Math.floor(j / group);", "const h = j % KV;")),
    "swiglu": ("**/attn/layers.js", ("const a = linearForward(x, w), b = linearForward(x, v);",
                                     "const a = linearForward(x, v), b = linearForward(x, w);")),
    "rms": ("**/attn/layers.js", ("squares / D + Math.fround(eps)", "squares / (D - 1) + Math.fround(eps)")),
    "rope-cache": ("**/attn/model.js", ('p("self_attn.b_k")), KV), t);', 'p("self_attn.b_k")), KV), 0);')),
}


@needs_browser
@pytest.mark.parametrize("part", sorted(MUTANTS))
def test_a_mutant_part_fails_the_comparison(later_site, later_dir, part):
    glob, replace = MUTANTS[part]
    results = _translate(later_site, [part.split("-")[0]], routes={glob: replace}, sentences=1)
    assert _problems(later_dir, results), f"the mutant of {part} passed the comparison with NumPy"


CACHE_JS = """async (urls) => {
  const { loadModel } = await import("/attn/model.js");
  const shapes = [];
  for (const url of urls) {
    const { model } = await loadModel(url);
    let state = model.startDecoding(model.encode([4, 5, 6, 2]).memory);
    for (const token of [1, 7, 8]) state = model.decodeStep(token, state).state;
    shapes.push([state.selfKv[0].k.shape, state.selfKv[0].v.shape, state.crossKv[0].k.shape]);
  }
  return shapes;
}"""


@needs_browser
def test_the_pages_decoding_cache_holds_the_key_value_heads(later_site, later_dir):
    """Three steps on a source of four ids: the page's cache has NumPy's shapes, kv_heads heads."""
    url, chromium = later_site
    page = chromium.new_page()
    try:
        page.goto(url + "index.html?model=_test/later/gqa/")
        got = page.evaluate(CACHE_JS, [f"{url}_test/later/{case}/" for case in ("gqa", "all")])
    finally:
        page.close()
    for case, shapes in zip(("gqa", "all"), got):
        model = load_export(later_dir / case)[0]
        state = model.start_decoding(model.encode(np.array([[4, 5, 6, 2]]))[0], None)
        for token in (1, 7, 8):
            state = model.decode_step(np.array([token]), state)[1]
        (k, v), (ck, _) = state.self_kv[0], state.cross_kv[0]
        assert shapes == [list(k.shape[1:]), list(v.shape[1:]), list(ck.shape[1:])], case
        assert shapes[0][0] == CASES[case]["kv_heads"] < model.config.n_heads

"""The page translates with int8 weights (``attn-export --int8``) as attn does in NumPy.

The shipped toy model is exported with every matrix in int8 and a float32 scale per output
channel; the folder's weights are about a quarter of float32's bytes; ``load_export`` reads back
exactly the numbers of :func:`attn.quantize.quantize_model`; and the page's greedy translations of
a few sentences are NumPy's on those numbers, as tests/test_web.py compares the float exports. A
mutant reader that takes the bytes as unsigned fails the comparison, and a reader refuses a
matrix whose scales' axis or offset does not fit.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from attn.quantize import quantize_model
from attn.site import browser
from attn.site.export import ExportError, export_model, load_export
from test_web import MISSING, RUN_JS, TOY_MODEL, compare, fresh_page, needs_browser

SENTENCES = 2


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory):
    model, vocab, doc = load_export(TOY_MODEL)
    out = tmp_path_factory.mktemp("int8") / "toy"
    export_model(model, vocab, out, "int8", doc["sentences"][:SENTENCES])
    return out


def test_an_int8_export_is_a_quarter_of_the_bytes_and_reads_back_the_int8_model(int8_dir):
    model = load_export(TOY_MODEL)[0]
    doc = json.loads((int8_dir / "model.json").read_text())
    fp32 = 4 * model.num_parameters()
    assert doc["weights"]["dtype"] == "int8" and doc["weights"]["bytes"] < 0.27 * fp32
    back = load_export(int8_dir)[0]
    want = quantize_model(model).params
    assert all(np.array_equal(back.params[k], want[k]) for k in want)


@pytest.mark.parametrize("field, value, says", [("axis", 2, "axis"), ("scales", 2, "multiple of 4"),
                                                ("scales", 10**9, "past the end")])
def test_a_reader_refuses_scales_that_do_not_fit(int8_dir, tmp_path, field, value, says):
    bad = tmp_path / "bad"
    bad.mkdir()
    doc = json.loads((int8_dir / "model.json").read_text())
    doc["weights"]["tensors"][1][field] = value
    (bad / "model.json").write_text(json.dumps(doc))
    (bad / "weights.bin").write_bytes((int8_dir / "weights.bin").read_bytes())
    with pytest.raises(ExportError, match=says):
        load_export(bad)


@pytest.fixture(scope="module")
def int8_site(int8_dir):
    if MISSING:
        pytest.skip(MISSING)
    with browser.serve(browser.WEB_DIR, {"/_test/int8/": int8_dir.parent}) as url, browser.chromium() as chromium:
        yield url, chromium


def _page_problems(site, int8_dir, routes=None, sentences=SENTENCES) -> dict:
    model, vocab, doc = load_export(int8_dir)
    texts = doc["sentences"][:sentences]
    with fresh_page(site, "_test/int8/toy/", routes) as page:
        assert page.evaluate("document.body.dataset.state") != "error", page.inner_text("#message")
        js = page.evaluate(RUN_JS, {"modelUrl": f"{site[0]}_test/int8/toy/", "sentences": texts, "beamSize": 1})
    assert len(js) == len(texts) and sum(len(r["ids"]) for r in js) > 2 * len(texts)
    return {s: p for s, r in zip(texts, js) if (p := compare(model, vocab, s, r))}


@needs_browser
def test_the_page_translates_with_int8_weights_as_numpy_does(int8_site, int8_dir):
    assert not _page_problems(int8_site, int8_dir)


@needs_browser
def test_reading_the_bytes_unsigned_fails_the_comparison(int8_site, int8_dir):
    mutant = {"**/attn/model.js": ("view.getInt8(offset + r * C + c)", "view.getUint8(offset + r * C + c)")}
    assert _page_problems(int8_site, int8_dir, mutant, sentences=1), "the unsigned reader passed the comparison with NumPy"

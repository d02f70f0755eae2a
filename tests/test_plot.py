"""attn.plot lays out and saves any figure a lesson makes: with a colour bar made any way
(``fig.colorbar`` on a subplot, ``colorbar.make_axes``, an axes placed by hand), under
constrained layout, tight layout or none, and with titles, labels and token lists far longer
than the figure is wide. Each one saves, its titles and labels are wrapped to fit their
axes, and none of its texts overlap (what tests/test_book.py checks in the built book)."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colorbar import make_axes
from matplotlib.figure import Figure
from PIL import Image, PngImagePlugin

PngImagePlugin.MAX_TEXT_CHUNK = max(PngImagePlugin.MAX_TEXT_CHUNK, 64 * 2**20)    # a PNG carries its phone rendering
PngImagePlugin.MAX_TEXT_MEMORY = max(PngImagePlugin.MAX_TEXT_MEMORY, 128 * 2**20)
from attn.plot import plot_attention, show_figure

LONG = "dikant , ke mitsas rudan " + " ".join(["rudo"] * 20)
TOKENS = LONG.split()


def _heatmap(layout, colour_bar, title):
    fig = Figure(figsize=(5, 2 + 0.3 * len(TOKENS)), layout=layout)     # room for every token
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(np.random.default_rng(0).random((len(TOKENS), 4)), aspect="auto")
    ax.set_yticks(range(len(TOKENS)), TOKENS)
    ax.set_xticks(range(4), ["a-rather-long-source-token"] * 4, rotation=90)
    ax.set_title(title)
    ax.set_xlabel("source words, " + LONG)
    if colour_bar == "subplot":
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    elif colour_bar == "make_axes":
        cax, kw = make_axes(ax, fraction=0.046, pad=0.04)
        fig.colorbar(im, cax=cax, label="attention weight", **kw)
    elif colour_bar == "placed":
        fig.colorbar(im, cax=fig.add_axes((0.92, 0.1, 0.02, 0.8)), label="attention weight")
    return fig, ax


def _saved(fig, tmp_path, monkeypatch, name="f.png"):
    monkeypatch.setenv("ATTN_LESSONS_OUT", str(tmp_path))
    path = show_figure(fig, name)
    with Image.open(path) as im:
        return dict(im.text)


def _assert_fits(fig, ax):
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    for t in (ax.title, ax.xaxis.label):
        assert t.get_window_extent(renderer).width <= box.width * 1.05, f"{t.get_text()[:40]!r} is wider than its axes"


@pytest.mark.parametrize("layout", [None, "tight", "constrained", "lesson's tight_layout"])
@pytest.mark.parametrize("colour_bar", ["subplot", "make_axes", "placed", None])
def test_any_figure_saves_with_its_texts_fitted(layout, colour_bar, tmp_path, monkeypatch):
    title = "we know that you like red cats .\n-> " + LONG
    fig, ax = _heatmap(None if layout == "lesson's tight_layout" else layout, colour_bar, title)
    if layout == "lesson's tight_layout":
        fig.tight_layout()
    text = _saved(fig, tmp_path, monkeypatch)
    assert text["attn:overlaps"] == "", text["attn:overlaps"][:600]
    assert "attn:phone-text-px" not in text             # outside the book's build, no phone rendering
    if colour_bar != "placed":                          # a hand-placed colour bar is where it was put
        _assert_fits(fig, ax)


@pytest.mark.parametrize("n", [1, 25])
def test_plot_attention_lays_out_any_title_and_token_list(n, tmp_path):
    """The beam output of a weak model repeats a word to the length limit; the title quotes it."""
    tgt = TOKENS[:n]
    src = ["we", "know", "that", "you", "like", "red", "cats", ".", "</s>"]
    path = plot_attention(np.full((n, len(src)), 1 / len(src)), src, tgt, tmp_path / "a.png",
                          title=f"{' '.join(src)}\n-> {' '.join(tgt)}")
    with Image.open(path) as im:
        assert im.text["attn:overlaps"] == "", im.text["attn:overlaps"][:600]


def test_a_long_suptitle_is_wrapped_to_the_figure(tmp_path, monkeypatch):
    fig = Figure(figsize=(4, 3))
    for ax in fig.subplots(1, 2):
        ax.plot([0, 1], [0, 1])
    fig.suptitle(LONG)
    _saved(fig, tmp_path, monkeypatch)
    renderer = fig.canvas.get_renderer()
    assert fig._suptitle.get_window_extent(renderer).width <= fig.bbox.width * 1.02


def test_quick_steps_cuts_training_only_when_asked(monkeypatch):
    from attn.plot import quick_steps
    monkeypatch.delenv("ATTN_QUICK_WEAK", raising=False)
    assert quick_steps(500) == 500
    monkeypatch.setenv("ATTN_QUICK_WEAK", "1")
    assert quick_steps(500) == 50 and quick_steps(5) == 2


def test_a_figure_of_three_panels_is_drawn_again_for_a_phone(tmp_path, monkeypatch):
    """In the book's build, beside the wide figure, its PNG carries a phone rendering (book/conf.py
    serves it at phone widths, two image pixels a CSS pixel): its panels one under the other, no wider than the
    column of a 390-pixel phone (358 CSS pixels), its smallest text at least the body's 16 px, no
    texts overlapping, a nine-entry legend and a bar chart's nine categories included."""
    import base64
    import io
    names = [f"a block of kind {i}" for i in range(9)]
    fig = Figure(figsize=(18, 5))
    ax = fig.subplots(1, 3)
    for i, name in enumerate(names):
        ax[0].plot(range(6), np.arange(6) * (i + 1), "o-", label=name)
    ax[0].legend(fontsize=8)
    ax[0].set_xlabel("minutes of training")
    ax[1].barh(names, range(1, 10))
    im = ax[2].imshow(np.random.default_rng(0).random((6, 6)))
    fig.colorbar(im, ax=ax[2], label="weight")
    fig.tight_layout()
    monkeypatch.setenv("ATTN_PHONE_FIGURES", "1")
    text = _saved(fig, tmp_path, monkeypatch)
    assert "attn:phone-refused" not in text, text["attn:phone-refused"]
    assert text["attn:overlaps"] == "" and text["attn:phone-overlaps"] == "", text["attn:phone-overlaps"][:600]
    with Image.open(io.BytesIO(base64.b64decode(text["attn:phone"]))) as phone:
        width, height = phone.size
    assert width / 2 <= 358 and height > 2.5 * width, (width, height)       # three panels, one a row
    assert float(text["attn:phone-text-px"]) / 2 >= 16, text["attn:phone-text-px"]
    with Image.open(tmp_path / "f.png") as wide:
        assert wide.size[0] > wide.size[1], wide.size                         # the wide one is unchanged


def test_a_phone_rendering_that_would_not_read_is_refused(tmp_path, monkeypatch):
    """A hand-placed drawing whose labels run into each other once they are the body's size on
    a phone is not served there: the PNG says why, and carries no phone image."""
    fig = Figure(figsize=(6, 1))
    fig.add_axes([0, 0, 1, 1]).axis("off")
    fig.text(0.05, 0.5, "the encoder's stack of layers", fontsize=6)
    fig.text(0.4, 0.5, "the decoder's stack", fontsize=6)
    monkeypatch.setenv("ATTN_PHONE_FIGURES", "1")
    text = _saved(fig, tmp_path, monkeypatch)
    assert text["attn:overlaps"] == "" and "encoder" in text["attn:phone-overlaps"], text
    assert "overlap" in text["attn:phone-refused"] and "attn:phone" not in text, text["attn:phone-refused"]


def test_each_phone_panel_has_margins_of_its_own(tmp_path, monkeypatch):
    """Restacked for a phone, a panel keeps the column's width whatever its neighbours' labels:
    a line plot under a heatmap with long row names and a colour bar is not narrowed to the
    heatmap's inner width (one column of a grid shares its margins), so its numbered ticks,
    set one per step, do not run into each other; the rendering is served."""
    import base64
    import io
    fig = Figure(figsize=(8, 9))
    top, bottom = fig.subplots(2, 1)
    top.plot(range(2, 21), np.linspace(1, 0, 19), "o-")
    top.set_xticks(range(2, 21, 2))
    top.set_xlabel("sequence length")
    top.set_ylabel("token accuracy")
    im = bottom.imshow(np.random.default_rng(0).random((4, 4)))
    bottom.set_yticks(range(4), [f"a rather long token {i}" for i in range(4)])
    fig.colorbar(im, ax=bottom, label="weight")
    fig.tight_layout()
    monkeypatch.setenv("ATTN_PHONE_FIGURES", "1")
    text = _saved(fig, tmp_path, monkeypatch)
    assert "attn:phone-refused" not in text, text["attn:phone-refused"] + ": " + text["attn:phone-overlaps"][:300]
    with Image.open(io.BytesIO(base64.b64decode(text["attn:phone"]))) as phone:
        assert phone.size[0] / 2 <= 358, phone.size


def test_the_diagrams_phone_variants_are_served(tmp_path, monkeypatch):
    """A hand-placed diagram that restacking cannot rearrange carries a phone variant of its own
    (``attn_phone``): Figure 1's stacks with shorter names, Figure 2's halves one under the other,
    the key cache's steps with their
    shapes on lines of their own, beam search's tree top to bottom. Each is served (it fits the
    column, text at the body's size, none overlapping), and the wide figure stays as it was."""
    from attn import diagram
    monkeypatch.setenv("ATTN_PHONE_FIGURES", "1")
    words = "ba kuramos mika mitsa kurat amamos kuras . pomo letra regina sur juna".split()
    steps = [[(0, 0, -0.12), (0, 1, -5.29), (0, 2, -5.42), (0, 3, -6.06)],
             [(0, 1, -0.93), (0, 4, -2.22), (0, 5, -3.11), (0, 6, -3.53)],
             [(1, 7, -2.39), (0, 8, -3.01), (0, 9, -3.19), (2, 10, -3.20)]]
    from attn.model import TransformerConfig, parameter_shapes
    cfg = TransformerConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2)
    figures = {"attention": diagram.attention_figure(n_heads=4, d_k=4),
               "architecture": diagram.architecture(parameter_shapes(cfg), 2, 2, 32, 4, 64),
               "cache": diagram.kv_cache([(1, 4, t, 8) for t in range(1, 7)], (1, 4, 9, 8),
                                         ["<s>", "kas", "kin", "dek", "viren", "ba"]),
               "beams": diagram.beam_tree(steps, words.__getitem__, chosen=[0, 4, 7], greedy=[0, 1, 8])}
    for name, fig in figures.items():
        wide = tuple(fig.get_size_inches())
        text = _saved(fig, tmp_path, monkeypatch, f"{name}.png")
        assert "attn:phone-refused" not in text, (name, text["attn:phone-refused"], text["attn:phone-overlaps"][:300])
        assert float(text["attn:phone-text-px"]) / 2 >= 16 and text["attn:overlaps"] == "", (name, text)
        assert tuple(fig.get_size_inches()) == wide, name


def test_labels_of_ticks_outside_a_log_axis_view_are_not_counted():
    """matplotlib leaves a tick outside the view undrawn, judged in the axis' scale: on a log axis
    from about 3e-13, the locator's tick at 1e-15 shows no label, so it cannot run into the y
    axis' labels in the corner; drawn labels that crowd still count."""
    from attn.plot import text_overlaps
    fig = Figure(figsize=(3.3, 2.5), dpi=200)
    ax = fig.add_subplot()
    ax.loglog([1e-12, 1e-1], [1e-11, 1.0])
    ax.tick_params(labelsize=12)
    fig.set_layout_engine("constrained")
    assert text_overlaps(fig) == [], text_overlaps(fig)
    ax.tick_params(labelsize=40)
    assert text_overlaps(fig), "drawn labels that crowd must still count"


def test_a_diagram_comes_with_its_own_layout_for_a_phone(tmp_path, monkeypatch):
    """A hand-placed drawing that restacking cannot fit to a phone (the refused one above) is
    served there in the lesson's own layout for the column, checked like any phone rendering; the
    wide figure and its own chunks are kept."""
    import base64
    import io
    from attn.plot import show_figure_with_phone
    wide = Figure(figsize=(6, 1))
    wide.add_axes([0, 0, 1, 1]).axis("off")
    wide.text(0.05, 0.5, "the encoder's stack of layers", fontsize=6)
    wide.text(0.4, 0.5, "the decoder's stack", fontsize=6)
    phone = Figure(figsize=(3.3, 1.2))
    phone.add_axes([0, 0, 1, 1]).axis("off")
    phone.text(0.05, 0.7, "the encoder's stack of layers", fontsize=12)
    phone.text(0.05, 0.3, "the decoder's stack", fontsize=12)
    monkeypatch.setenv("ATTN_LESSONS_OUT", str(tmp_path))
    monkeypatch.setenv("ATTN_PHONE_FIGURES", "1")
    import IPython.display
    import attn.plot
    shown_bytes = []                                   # what a notebook (the book) shows inline
    monkeypatch.setattr(attn.plot, "_in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", lambda image: shown_bytes.append(image.data))
    path = show_figure_with_phone(wide, phone, "d.png")
    assert shown_bytes == [path.read_bytes()], "the page shows the file before its phone rendering was put in"
    with Image.open(path) as im:
        text, size = dict(im.text), im.size
    assert "attn:phone-refused" not in text and text["attn:phone-overlaps"] == "", text
    assert text["attn:overlaps"] == "" and text["Description"], text
    with Image.open(io.BytesIO(base64.b64decode(text["attn:phone"]))) as shown:
        assert shown.size[0] / 2 <= 358 and shown.size[1] > shown.size[0] / 3, shown.size    # two lines, not one
    assert size[0] > 4 * size[1], size                                                         # the wide one

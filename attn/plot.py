"""Figures, written to files with matplotlib's Agg renderer (no display needed).

Each function draws on its own ``Figure`` with an Agg canvas instead of going
through ``pyplot``: nothing global changes, so importing this module never
switches the backend of a program that has its own plots open.

The lessons share three helpers from here: :func:`lesson_output_dir` (one folder,
anchored at the repository root whatever the working directory, that git
ignores), :func:`show_figure` (save the figure there, and show it inline
when the lesson runs as a notebook or in an interactive window) and
:func:`quick_steps` (how long quick mode trains; ``ATTN_QUICK_WEAK=1`` cuts it).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from . import backend as B
from .figure_layout import (PHONE_BODY_PX, PHONE_COLUMN_PX, PHONE_DPI, PHONE_ENV, _colour_bars, _lay_out,
                            _relayout, _texts, _wrap_long_labels, restack_for_a_phone, text_overlaps)


#: The width, in CSS pixels, of the book's article column at a 1280-pixel window
#: (book/_static/attn.css): a wider figure is shrunk to it, its text with it.
COLUMN_PX = 880
#: The smallest text, in CSS pixels, a figure may show at that width (tests/test_book.py checks).
MIN_TEXT_PX = 9.5


class SavedFigure(type(Path())):
    """The path of a saved figure. A notebook shows the figure, not this path's repr, when a
    cell ends with :func:`show_figure`."""

    def _ipython_display_(self):
        pass


def describe(fig) -> str:
    """Alt text for a figure: its titles, and for an axes without one, what it plots against what."""
    if getattr(fig, "attn_alt", None):
        return fig.attn_alt
    parts = []
    if getattr(fig, "_suptitle", None) is not None and fig._suptitle.get_text():
        parts.append(fig._suptitle.get_text())
    for ax in fig.axes:
        title = " ".join(t for t in (ax.get_title("left"), ax.get_title(), ax.get_title("right")) if t)
        x, y = ax.get_xlabel(), ax.get_ylabel()
        if title:
            parts.append(title + (f" ({y} against {x})" if x and y else ""))
        elif x and y:
            parts.append(f"{y} against {x}")
    return "Figure: " + ("; ".join(p.replace("\n", " ") for p in parts) or "a plot")


def _shown_text_px(fig, dpi: float, column_px: float) -> float:
    """The smallest text of ``fig`` in CSS pixels, once saved with a tight bounding box at
    ``dpi`` and shown at most ``column_px`` wide."""
    FigureCanvasAgg(fig) if fig.canvas is None or type(fig.canvas).__name__ == "FigureCanvasBase" else None
    width_in = fig.get_tightbbox(fig.canvas.get_renderer()).width + 0.2      # savefig's pad_inches, twice
    smallest = min(t.get_fontsize() for t in _texts(fig))
    return smallest * dpi / 72.0 * min(1.0, column_px / (width_in * dpi))


def fit_text(fig, dpi: float = 110, column_px: float = COLUMN_PX, min_px: float = MIN_TEXT_PX,
             most: float = 3.0) -> float:
    """Scale a figure's text so that, shown ``column_px`` CSS pixels wide, none is under ``min_px``
    pixels (the book shrinks a wider figure to its column). Larger text can widen a figure's
    tight box (labels outside the axes), so it measures again after each scaling. Returns the
    factor (1: unchanged; at most ``most``)."""
    if not _texts(fig):
        return 1.0
    import warnings
    total = 1.0
    for _ in range(3):
        shown = _shown_text_px(fig, dpi, column_px)
        if shown >= min_px or total >= most:
            break
        factor = min(most / total, 1.02 * min_px / shown)
        ticks = [(ax, name, which, tk[0].label1.get_fontsize()) for ax in fig.axes
                 for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y"))
                 for which, tk in (("major", axis.get_major_ticks()), ("minor", axis.get_minor_ticks())) if tk]
        for t in _texts(fig):
            t.set_fontsize(t.get_fontsize() * factor)
        for ax, name, which, size in ticks:                 # ticks made later get the new size too
            ax.tick_params(axis=name, which=which, labelsize=size * factor)
        total *= factor
        _relayout(fig)
    return total


def _constrain(fig) -> None:
    """Lay out a figure of subplots with constrained layout, which keeps titles, labels and
    colour bars of neighbouring panels apart (tight layout, the lessons' habit, is done once,
    before the text is enlarged, and does not see a suptitle). A figure that places its own
    axes keeps them, and so does one with a colour bar made for another engine: constrained
    layout cannot move it (and matplotlib refuses to switch back), so tight layout stays."""
    from matplotlib.layout_engine import PlaceHolderLayoutEngine, TightLayoutEngine
    engine = fig.get_layout_engine()
    if (engine is None or isinstance(engine, (PlaceHolderLayoutEngine, TightLayoutEngine))) and fig.axes \
            and all(ax.get_subplotspec() is not None for ax in fig.axes) and not _colour_bars(fig):
        try:
            fig.set_layout_engine("constrained")
            _lay_out(fig)
        except RuntimeError:        # a colour bar matplotlib knows of and we did not: nothing changed
            pass
        except ZeroDivisionError:   # constrained layout found no room: the engine it had before
            fig.set_layout_engine(engine)
            _relayout(fig)


def _metadata(fig, dpi: float, prefix: str = "attn:") -> dict:
    """The smallest text's size, in pixels of an image saved at ``dpi``, and the texts that overlap."""
    smallest = min((t.get_fontsize() for t in _texts(fig)), default=72.0)
    return {f"{prefix}text-px": f"{smallest * dpi / 72.0:.2f}",
            f"{prefix}overlaps": " | ".join(f"{a!r} on {b!r}" for a, b in text_overlaps(fig))}


def _phone_rendering(fig) -> dict:
    """``fig`` drawn for a phone (:func:`attn.figure_layout.restack_for_a_phone`), or, where the figure carries one,
    the phone variant its maker drew (``fig.attn_phone``, a function returning a ``Figure``
    PHONE_WIDTH_IN wide, text at least PHONE_MIN_PT: a hand-placed drawing that restacking
    cannot rearrange, see attn/diagram.py): the PNG's text chunks, its text
    size and overlaps, and the PNG itself (``attn:phone``, base64) when it reads on a phone:
    at most PHONE_COLUMN_PX CSS pixels wide, no text under PHONE_BODY_PX, none overlapping;
    otherwise ``attn:phone-refused`` says why, and the book shows the wide figure (book/conf.py).
    Its warnings (a layout that collapsed) are not shown: the checks judge the result. Changes ``fig``."""
    import base64
    import io
    import warnings
    with warnings.catch_warnings():     # a layout tried and refused is no news for the lesson's output
        warnings.simplefilter("ignore")
        variant = getattr(fig, "attn_phone", None)     # a drawing laid out for the phone by its maker
        fig = variant() if variant is not None else fig
        fig.set_dpi(PHONE_DPI)
        if variant is None:
            restack_for_a_phone(fig)
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=PHONE_DPI, bbox_inches="tight")
        meta = _metadata(fig, PHONE_DPI, "attn:phone-")
    from PIL import Image
    with Image.open(out) as im:
        width = im.size[0] / 2                              # CSS pixels, at two image pixels each
    refused = [why for bad, why in (
        (width > PHONE_COLUMN_PX, f"{width:.0f} px wide, the column {PHONE_COLUMN_PX}"),
        (float(meta["attn:phone-text-px"]) / 2 < PHONE_BODY_PX, "text under the body's size"),
        (bool(meta["attn:phone-overlaps"]), "texts overlap")) if bad]
    if refused:
        meta["attn:phone-refused"] = "; ".join(refused)
    else:
        meta["attn:phone"] = base64.b64encode(out.getvalue()).decode("ascii")
    return meta


def phone_figures_wanted() -> bool:
    """Whether :func:`show_figure` draws the phone rendering too: in the book's build, which sets
    ``$ATTN_PHONE_FIGURES`` (attn/site/book.py), the only reader of it."""
    return os.environ.get(PHONE_ENV, "") == "1"


def _write(fig: Figure, path: Path, dpi: float, alt: str | None = None, **savefig_kwargs) -> SavedFigure:
    """Fit the text to the page, then save with the alt text, the smallest text's size (in
    pixels of the image) and the texts that overlap (none, tests/test_book.py checks) in the
    PNG, where the book reads them; in the book's build (:func:`phone_figures_wanted`), beside
    them, the figure drawn again for a phone's column (:func:`_phone_rendering`), which the
    book serves at phone widths (book/conf.py)."""
    import io
    path = SavedFigure(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fig.canvas is None or type(fig.canvas).__name__ == "FigureCanvasBase":
        FigureCanvasAgg(fig)
    _constrain(fig)
    _wrap_long_labels(fig)          # first, or an unwrapped title's width would make all text look small
    fit_text(fig, dpi)
    _wrap_long_labels(fig)
    savefig_kwargs.setdefault("bbox_inches", "tight")
    if path.suffix.lower() != ".png":
        fig.savefig(path, dpi=dpi, **savefig_kwargs)
        return path
    from PIL import Image, PngImagePlugin
    fig.set_dpi(dpi)
    metadata = {"Description": alt or describe(fig), **_metadata(fig, dpi)}
    wide = io.BytesIO()
    fig.savefig(wide, format="png", dpi=dpi, **savefig_kwargs)
    if phone_figures_wanted():
        metadata.update(_phone_rendering(fig))
    info = PngImagePlugin.PngInfo()
    for key, value in metadata.items():
        info.add_text(key, value, zip=len(value) > 200)
    with Image.open(wide) as im:
        im.save(path, pnginfo=info)
    return path


def _save(fig: Figure, path, alt: str | None = None) -> SavedFigure:
    return _write(fig, Path(path), 120, alt)


def repository_root() -> Path | None:
    """The attn checkout this package was imported from (the folder holding ``attn/``
    and ``lessons/``), or, for an installed copy, the nearest folder above the working
    directory that holds ``lessons/`` and ``setup.cfg``; None if there is neither."""
    here = Path(__file__).resolve().parent.parent
    if (here / "lessons").is_dir():
        return here
    for d in (Path.cwd(), *Path.cwd().parents):
        if (d / "lessons").is_dir() and (d / "setup.cfg").is_file():
            return d
    return None


def lesson_output_dir() -> Path:
    """Where the lessons write figures and runs: ``$ATTN_LESSONS_OUT`` if set, else
    ``<repository root>/lessons/out`` (listed in ``.gitignore``), the same folder
    whether a lesson is started from the root, from ``lessons/`` or from a notebook
    server anywhere. Outside a checkout: ``./attn-lessons-out``. Created if missing."""
    env = os.environ.get("ATTN_LESSONS_OUT")
    if env:
        out = Path(env).expanduser().resolve()
    else:
        root = repository_root()
        out = root / "lessons" / "out" if root is not None else Path.cwd() / "attn-lessons-out"
    out.mkdir(parents=True, exist_ok=True)
    return out


#: Set to 1, the lessons' quick mode trains a tenth of its steps: a deliberately weak model, so
#: that their checks and the book's build meet the models other machines (another BLAS, another
#: number of threads) train, without those machines (docs/ARCHITECTURE.md, "Testing as
#: another machine would").
WEAK_ENV = "ATTN_QUICK_WEAK"


def quick_steps(steps: int) -> int:
    """The optimizer steps a lesson's quick mode trains for: ``steps``, or a tenth of them (at
    least 2) when ``ATTN_QUICK_WEAK=1``. Lessons train by steps, never by a time budget, so
    a run's model depends on the machine's arithmetic only."""
    return max(2, steps // 10) if os.environ.get(WEAK_ENV) == "1" else steps


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (a notebook, VS Code's interactive window, nbclient)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def shown_path(path) -> str:
    """``path`` as a lesson prints it: relative to the repository (or to the working
    directory) when it lies inside, so that no page shows the machine's folders."""
    path = Path(path)
    for base in (repository_root(), Path.cwd()):
        if base is not None:
            try:
                return path.resolve().relative_to(base.resolve()).as_posix()
            except ValueError:
                pass
    return path.as_posix()


def show_figure(fig, name: str = "", dpi: int = 110, alt: str | None = None, **savefig_kwargs) -> Path:
    """Save a lesson's figure as ``lesson_output_dir() / name`` and show it.

    ``fig`` is a matplotlib ``Figure``, or the path of an image already written (by
    :func:`plot_attention` or :func:`plot_loss_curve`), which is then only shown.
    Text too small to read at the book's column width is enlarged first (:func:`fit_text`);
    ``alt`` (default: the figure's titles, :func:`describe`) is stored in the PNG, where the
    book reads the image's alt text. In a notebook or interactive window the saved image
    appears inline below the cell; run as a script, the file is the output, and its path
    (relative to the repository) is printed (not in a notebook: the book would show its
    build folder). A pyplot figure is closed afterwards, so a long lesson does not pile up
    open figures. Returns the path."""
    if isinstance(fig, (str, Path)):
        path = SavedFigure(fig)
    else:
        path = _write(fig, lesson_output_dir() / name, dpi, alt, **savefig_kwargs)
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:
            pyplot.close(fig)
    if _in_notebook():
        from IPython.display import Image, display
        display(Image(filename=str(path)))
    else:
        print("saved", shown_path(path))
    return path


def plot_attention(weights, src_tokens, tgt_tokens, path, title=None) -> Path:
    """Heatmap of attention weights: source tokens on the x axis, target tokens on the y axis.

    Inputs
    ------
    weights : (T, S) host array
        Row t is where target token t looked (e.g. the last decoder layer's
        cross-attention averaged over heads, :attr:`attn.decode.DecodeResult.cross_attention`).
    src_tokens : list of S str
    tgt_tokens : list of T str
    path : where to write the image (PNG by its suffix); folders are created.
    title : optional str

    Returns: the path written.
    """
    w = B.host.asarray(B.to_host(weights), dtype=float)
    if w.ndim != 2 or w.shape != (len(tgt_tokens), len(src_tokens)):
        raise ValueError(f"plot_attention: weights have shape {tuple(w.shape)}, but there are "
                         f"{len(tgt_tokens)} target and {len(src_tokens)} source tokens: "
                         f"expected ({len(tgt_tokens)}, {len(src_tokens)})")
    T, S = w.shape
    fig = Figure(figsize=(min(2.0 + 0.45 * S, 24.0), min(1.5 + 0.4 * T, 24.0)))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=max(float(w.max()) if w.size else 1.0, 1e-12),
                   aspect="auto", interpolation="nearest")
    ax.set_xticks(range(S))
    ax.set_xticklabels([str(t) for t in src_tokens], rotation=90)
    ax.set_yticks(range(T))
    ax.set_yticklabels([str(t) for t in tgt_tokens])
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    if title:
        ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    return _save(fig, path)


def plot_loss_curve(train_losses, val_points, path, title="training") -> Path:
    """Training loss per step (light) with its running mean, and validation loss.

    Inputs: train_losses, a list of floats (one per step); val_points, a list of
    (step, val_loss); path of the PNG. Returns the path written.
    """
    np = B.host
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    if len(train_losses):
        y = np.asarray(train_losses, dtype=float)
        x = np.arange(1, len(y) + 1)
        ax.plot(x, y, color="tab:blue", alpha=0.25, lw=0.8)
        k = max(1, min(50, len(y) // 20))
        smooth = np.convolve(y, np.ones(k) / k, mode="valid")
        ax.plot(x[k - 1:], smooth, color="tab:blue", label=f"train (mean of {k} steps)")
    if val_points:
        s, v = zip(*val_points)
        ax.plot(s, v, "o-", color="tab:orange", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("label-smoothed cross-entropy")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_precision_curves(curves: dict, path, k: int = 20, title: str = "") -> Path:
    """Training loss per step at each precision (``{"fp32": [...], "bf16": [...]}``), each as its
    running mean of ``k`` steps, and below it each curve's difference from fp32's. Returns the
    path written."""
    np = B.host
    fig = Figure(figsize=(6.4, 5.6))
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    colors = {"fp32": "black", "tf32": "tab:blue", "bf16": "tab:red"}

    def run_mean(y):
        y = np.asarray(y, dtype=float)
        kk = max(1, min(k, len(y)))
        return np.arange(kk, len(y) + 1), np.convolve(y, np.ones(kk) / kk, mode="valid")

    x0, ref = run_mean(curves["fp32"])
    for name, losses in curves.items():
        x, s = run_mean(losses)
        top.plot(x, s, color=colors.get(name), lw=1.2, label=name, ls="-" if name == "fp32" else "--")
        if name != "fp32":
            bottom.plot(x, s - ref, color=colors.get(name), lw=1.0, label=f"{name} - fp32")
    top.set_ylabel(f"loss (mean of {k} steps)")
    top.set_yscale("log")
    top.set_title("training loss by precision" + (f": {title}" if title else ""))
    top.grid(alpha=0.3)
    top.legend()
    bottom.axhline(0.0, color="black", lw=0.8)
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("difference from fp32")
    bottom.grid(alpha=0.3)
    bottom.legend()
    return _save(fig, path)


def named_bars(ax, names) -> None:
    """Each horizontal bar's name above it, inside the panel, instead of a tick label beside it:
    the panel keeps its width in a phone's narrow column."""
    ax.set_yticks([])
    ax.set_ylim(len(names) - 0.6, -1.0)
    for y, name in enumerate(names):
        ax.text(0.01, y - 0.27, name, transform=ax.get_yaxis_transform(), ha="left", va="bottom")


def show_figure_with_phone(fig, phone, name: str, dpi: int = 110, alt: str | None = None) -> Path:
    """:func:`show_figure` for a figure that no restacking fits to a phone's column (a diagram drawn
    by hand across the page), with ``phone``, the lesson's own layout of it for that column
    (PHONE_WIDTH_IN wide, its text PHONE_MIN_PT): in the book's build the PNG carries ``phone``'s
    rendering (:func:`_phone_rendering`, checked the same way) in place of ``fig``'s. Returns the path."""
    from PIL import Image, PngImagePlugin
    path = _write(fig, lesson_output_dir() / name, dpi, alt)
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close(fig)
    if phone_figures_wanted():                 # the phone chunks replaced before the page shows the file
        if phone.canvas is None or type(phone.canvas).__name__ == "FigureCanvasBase":
            FigureCanvasAgg(phone)
        meta = _phone_rendering(phone)
        with Image.open(path) as im:
            chunks = {k: v for k, v in im.text.items() if not k.startswith("attn:phone")}
            wide = im.copy()
        info = PngImagePlugin.PngInfo()
        for key, value in {**chunks, **meta}.items():
            info.add_text(key, value, zip=len(value) > 200)
        wide.save(path, pnginfo=info)
    return show_figure(path)

"""How a figure's texts are measured and laid out, and how a figure is laid out again for a
phone's column: the measuring :mod:`attn.plot` does before it saves a figure (the texts a drawing
shows, which overlap, labels wrapped to their panel) and the restacking of its phone rendering
(:func:`restack_for_a_phone`: panels one a row, titles and legends in rows of their own, text at
the body's size, crowded tick labels thinned). Nothing here saves a file; attn.plot does.
"""
from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg

def _texts(fig):
    from matplotlib.text import Text
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _lay_out(fig) -> None:
    """Lay ``fig`` out as a drawing would (layout engine, ticks, texts' sizes) without painting
    its pixels: what the measurements here need, at a fraction of a draw's time. Nothing to do
    when nothing changed since the last (matplotlib marks a changed figure stale)."""
    if fig.stale:
        fig.draw_without_rendering()


def _colour_bars(fig) -> list:
    """The axes of ``fig`` that hold a colour bar (``fig.colorbar`` labels them so)."""
    return [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]


def _relayout(fig) -> None:
    """Lay out again after the text changed size (constrained layout does it when drawing).
    A figure with no engine, or with tight layout's, is laid out tight; one that placed its
    axes by hand (no subplot grid) keeps them."""
    import warnings
    from matplotlib.layout_engine import ConstrainedLayoutEngine
    engine = fig.get_layout_engine()
    if isinstance(engine, ConstrainedLayoutEngine) or (engine is not None and not engine.adjust_compatible):
        return
    if not any(ax.get_subplotspec() is not None for ax in fig.axes):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig.tight_layout()


def _wrap_to(t, room: float, renderer) -> bool:
    """Break text ``t`` into lines at spaces (each line of it apart) so that it is at most
    ``room`` pixels long; True if it changed. Mathematics (``$``) is left whole."""
    import textwrap
    text = t.get_text()
    if not text.strip() or not t.get_visible() or "$" in text or room <= 0:
        return False
    extent = t.get_window_extent(renderer)
    long_side = max(extent.width, extent.height)
    if long_side <= room * 1.02:
        return False
    width = max(12, int(max(len(line) for line in text.split("\n")) * room / long_side))
    wrapped = "\n".join(textwrap.fill(" ".join(line.split()), width, break_on_hyphens=False, break_long_words=False)
                        for line in text.split("\n"))
    if wrapped == text:
        return False
    t.set_text(wrapped)
    return True


def _wrap_long_labels(fig) -> None:
    """Break a title or an axis label longer than its axes (it would run into the next
    panel), or a suptitle wider than the figure, into lines that fit, at spaces."""
    if fig.canvas is None or type(fig.canvas).__name__ == "FigureCanvasBase":
        FigureCanvasAgg(fig)
    for _ in range(3):
        _lay_out(fig)
        renderer = fig.canvas.get_renderer()
        labels = [(fig._suptitle, fig.bbox.width)] if getattr(fig, "_suptitle", None) is not None else []
        for ax in fig.axes:
            box = ax.get_window_extent(renderer)
            labels += [(ax.title, box.width), (ax._left_title, box.width), (ax._right_title, box.width),
                       (ax.xaxis.label, box.width), (ax.yaxis.label, box.height)]
        changed = [_wrap_to(t, room, renderer) for t, room in labels]
        if not any(changed):
            break
        _relayout(fig)


def _drawn_texts(fig) -> list:
    """The texts a drawing of ``fig`` shows: every visible, non-empty text but the tick labels
    of ticks outside their axis' view (matplotlib keeps those, undrawn). As matplotlib decides,
    in the axis' scale: on a logarithmic one, 1e-15 lies outside a view from 3e-13."""
    ticks, drawn = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            scale = axis.get_transform().transform
            lo, hi = sorted(float(v) for v in scale(list(axis.get_view_interval())))
            pad = 1e-9 * max(1.0, abs(hi - lo))
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks.update((id(tick.label1), id(tick.label2)))
                if lo - pad <= float(scale([tick.get_loc()])[0]) <= hi + pad:
                    drawn += [t for t in (tick.label1, tick.label2) if t.get_visible() and t.get_text().strip()]
    return [t for t in _texts(fig) if id(t) not in ticks] + drawn


def _corners(t, renderer):
    """The four corners, in pixels, of a drawn text's box, turned with the text: the
    renderer's extent of a turned text is the upright box around it, and neighbouring
    turned tick labels would seem to overlap."""
    import math
    box = t.get_window_extent(renderer)
    angle = math.radians(t.get_rotation())
    if abs(math.sin(angle)) < 1e-9 or abs(math.cos(angle)) < 1e-9:
        return [(box.x0, box.y0), (box.x1, box.y0), (box.x1, box.y1), (box.x0, box.y1)]
    rotation, figure, stale = t.get_rotation(), t.get_figure(root=True), t.get_figure(root=True).stale
    t.set_rotation(0)
    upright = t.get_window_extent(renderer)
    t.set_rotation(rotation)
    figure.stale = stale            # turned back: the layout still holds
    cx, cy, w, h = (box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2, upright.width / 2, upright.height / 2
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + c * dx - s * dy, cy + s * dx + c * dy) for dx, dy in ((-w, -h), (w, -h), (w, h), (-w, h))]


def _depth(a, b) -> float:
    """How far two convex quadrilaterals overlap: the least overlap of their projections on
    the normals of their edges (separating axes); 0 or less where they do not touch."""
    depth = float("inf")
    for poly in (a, b):
        for (x0, y0), (x1, y1) in zip(poly, poly[1:] + poly[:1]):
            nx, ny = y0 - y1, x1 - x0
            norm = (nx * nx + ny * ny) ** 0.5 or 1.0
            pa = [(x * nx + y * ny) / norm for x, y in a]
            pb = [(x * nx + y * ny) / norm for x, y in b]
            depth = min(depth, min(max(pa), max(pb)) - max(min(pa), min(pb)))
    return depth


def text_overlaps(fig, min_px: float = 1.0) -> list[tuple[str, str]]:
    """The pairs of texts of ``fig`` that overlap once it is drawn: their boxes, as
    matplotlib's renderer measures them (turned with the text), share more than ``min_px``
    pixels each way."""
    if fig.canvas is None or type(fig.canvas).__name__ == "FigureCanvasBase":
        FigureCanvasAgg(fig)
    _lay_out(fig)
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text().replace("\n", " "), _corners(t, renderer)) for t in _drawn_texts(fig)]
    spans = [(min(x for x, _ in p), max(x for x, _ in p), min(y for _, y in p), max(y for _, y in p))
             for _, p in boxes]
    near = lambda i, j: (min(spans[i][1], spans[j][1]) - max(spans[i][0], spans[j][0]) > min_px and   # noqa: E731
                         min(spans[i][3], spans[j][3]) - max(spans[i][2], spans[j][2]) > min_px)
    return [(boxes[i][0], boxes[j][0]) for i in range(len(boxes)) for j in range(i + 1, len(boxes))
            if near(i, j) and _depth(boxes[i][1], boxes[j][1]) > min_px]


#: The phone rendering of a figure (tests/test_book.py measures it at 390 px): drawn
#: PHONE_WIDTH_IN inches wide at PHONE_DPI, shown at half its pixels (a phone's two device pixels
#: per CSS pixel, ``srcset ... 2x``): 330 CSS pixels plus the saved margins, inside the 358-pixel
#: column; no text under PHONE_MIN_PT points, 12 pt * 200 / 72 / 2 = 16.7 CSS pixels, the body's 16.
PHONE_WIDTH_IN, PHONE_DPI, PHONE_MIN_PT = 3.3, 200, 12.0
#: What a phone rendering must keep to be served (tests/test_book.py measures the same at 390 px):
#: the article's column, in CSS pixels, and the body text's size.
PHONE_COLUMN_PX, PHONE_BODY_PX = 358, 16.0
#: Set to 1 (the book's build does), :func:`show_figure` draws each figure's phone rendering too.
PHONE_ENV = "ATTN_PHONE_FIGURES"


def _panels(fig) -> list:
    """The panels of ``fig`` in reading order (row by row), colour bars left out."""
    bars = _colour_bars(fig)
    return sorted((ax for ax in fig.axes if ax not in bars),
                  key=lambda ax: (round(-ax.get_position().y1, 2), ax.get_position().x0))


def restack_for_a_phone(fig) -> None:
    """Lay ``fig`` out for a phone's column: its panels one under the other, each as tall as it
    was for its width (within limits), PHONE_WIDTH_IN wide, with constrained layout; a panel's
    legend in a row of its own under it, colour bars drawn again under their panel (the panel
    keeps the column's width), each panel with margins of its own (a neighbour's long labels or
    colour bar do not narrow it, as one column of a grid would). A figure
    that placed its own axes (no subplot grid) only changes size."""
    import warnings
    panels, bars = _panels(fig), _colour_bars(fig)
    heights = []
    for ax in panels:
        box = ax.get_position()
        aspect = (box.height * fig.get_figheight()) / max(box.width * fig.get_figwidth(), 1e-6)
        heights.append(PHONE_WIDTH_IN * min(1.0, max(0.55, aspect)) + 0.9)
    stack = all(ax.get_subplotspec() is not None for ax in panels)
    again = []
    for bar in bars if stack else []:
        cb = getattr(bar, "_colorbar", None)
        label = bar.get_ylabel() or bar.get_xlabel()
        if cb is not None and getattr(cb.mappable, "axes", None) in panels:
            again.append((cb.mappable, label))
        bar.remove()
    if not stack:
        fig.set_size_inches(PHONE_WIDTH_IN, PHONE_WIDTH_IN * fig.get_figheight() / fig.get_figwidth())
        _phone_text(fig, panels)
        _relayout(fig)
        _wrap_long_labels(fig)
        _drop_crowded_minor_labels(fig)
        _within_the_column(fig)
        _thin_crowded_labels(fig)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig.set_layout_engine("constrained")
    rows = _legend_rows(panels, heights)
    fig.set_size_inches(PHONE_WIDTH_IN, sum(h for _, _, h in rows) + (0.4 if getattr(fig, "_suptitle", None) else 0.0))
    grid = fig.add_gridspec(len(rows), 1, height_ratios=[h for _, _, h in rows])
    row_axes = []
    for i, (ax, extra, _) in enumerate(rows):
        if ax is not None:
            ax.set_subplotspec(grid[i].subgridspec(1, 1)[0])     # its own margins, not its column's
        row_axes.append(ax if ax is not None else _title_holder(fig, grid[i], extra) if isinstance(extra, str)
                        else _legend_holder(fig, grid[i], *extra))
    for mappable, label in again:
        fig.colorbar(mappable, ax=mappable.axes, label=label, location="bottom", shrink=0.8)   # the width to the panel
    _phone_text(fig, panels)
    _relayout(fig)
    _wrap_long_labels(fig)
    _room_for_tick_labels(fig, row_axes, grid, [h for _, _, h in rows])
    _fill_the_width(fig, panels)
    _drop_crowded_minor_labels(fig)
    _within_the_column(fig)
    _thin_crowded_labels(fig)


def _legend_rows(panels, heights) -> list:
    """[(panel, None, height), (None, title, height) or (None, (handles, labels), height)]: each
    panel; above a panel that had a title, a row for it, as wide as the column (a panel narrowed
    by long tick labels would wrap its title into a tower of short lines); under a panel that had
    a legend, a row for it. Both are taken off the panel, wrapped for the phone."""
    import textwrap
    rows = []
    for ax, height in zip(panels, heights):
        titles = (ax._left_title, ax.title, ax._right_title)
        title = " ".join(t.get_text() for t in titles if t.get_text())
        if title and "$" not in title:
            [t.set_text("") for t in titles]
            title = _wrapped_to_the_column(ax.get_figure(root=True), " ".join(title.split()), TITLE_PT)
            rows.append((None, title, (1.3 * (title.count("\n") + 1)) * TITLE_PT / 72 + 0.12))
        rows.append((ax, None, height))
        legend = ax.get_legend()
        if legend is None or not legend.get_texts():
            continue
        handles = legend.legend_handles
        labels = [textwrap.fill(t.get_text(), 22) for t in legend.get_texts()]
        legend.remove()
        lines = sum(label.count("\n") + 1 for label in labels)
        rows.append((None, (handles, labels), (1.4 * lines + 0.8 * len(labels)) * PHONE_MIN_PT / 72 + 0.25))
    return rows


#: A phone rendering's titles, in points: 1.25 times its smallest text (:func:`_phone_text`).
TITLE_PT = 1.25 * PHONE_MIN_PT


def _wrapped_to_the_column(fig, text: str, size: float) -> str:
    """``text`` broken into lines at spaces, each at most PHONE_WIDTH_IN (less a margin) wide at ``size`` points."""
    import textwrap
    if fig.canvas is None or type(fig.canvas).__name__ == "FigureCanvasBase":
        FigureCanvasAgg(fig)
    probe = fig.text(0, 0, text, fontsize=size)
    per_char = probe.get_window_extent(fig.canvas.get_renderer()).width / max(len(text), 1) / fig.dpi
    probe.remove()
    return textwrap.fill(text, max(12, int(0.92 * PHONE_WIDTH_IN / max(per_char, 1e-6))), break_long_words=False)


def _title_holder(fig, spec, title):
    """An empty axes in its own row of the grid, holding a panel's title at the figure's left edge
    (kept out of the layout: the row's height is the room made for it)."""
    from matplotlib.transforms import blended_transform_factory
    holder = fig.add_subplot(spec)
    holder.axis("off")
    holder.text(0.02, 0.0, title, fontsize=TITLE_PT, va="bottom", ha="left", in_layout=False,
                transform=blended_transform_factory(fig.transFigure, holder.transAxes))
    return holder


def _legend_holder(fig, spec, handles, labels):
    """An empty axes in its own row of the grid, holding a legend at the figure's left edge (the
    legend kept out of the layout: the row's height is the room made for it)."""
    from matplotlib.transforms import blended_transform_factory
    holder = fig.add_subplot(spec)
    holder.axis("off")
    legend = holder.legend(handles, labels, loc="upper left", frameon=False, fontsize=PHONE_MIN_PT, borderaxespad=0,
                           bbox_to_anchor=(0.02, 1.0),
                           bbox_transform=blended_transform_factory(fig.transFigure, holder.transAxes))
    legend.set_in_layout(False)
    return holder


def _phone_text(fig, panels) -> None:
    """Every text scaled so that the smallest is PHONE_MIN_PT (none larger than 1.25 times that:
    the wide rendering may have enlarged a title for a wide column); tick labels at PHONE_MIN_PT;
    titles and axis labels unwrapped, to be wrapped again to the phone's panels.
    Panels that shared an axis, and hid its tick labels for their neighbour's, show their own now
    that each stands in its own row."""
    labels = [fig._suptitle] if getattr(fig, "_suptitle", None) is not None else []
    for ax in panels:
        labels += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
    for t in labels:                                   # wrapped again for the phone's panel
        if "$" not in t.get_text():
            t.set_text(" ".join(t.get_text().split()))
    texts = _texts(fig)
    factor = PHONE_MIN_PT / min((t.get_fontsize() for t in texts), default=PHONE_MIN_PT)
    for t in texts:
        t.set_fontsize(min(1.25 * PHONE_MIN_PT, t.get_fontsize() * factor))
    for ax in fig.axes:
        ax.tick_params(which="both", labelsize=PHONE_MIN_PT)
    for ax in panels:
        if len(ax.get_shared_y_axes().get_siblings(ax)) > 1:
            ax.tick_params(axis="y", labelleft=True)
        if len(ax.get_shared_x_axes().get_siblings(ax)) > 1:
            ax.tick_params(axis="x", labelbottom=True)


def _room_for_tick_labels(fig, panels, grid, heights) -> None:
    """A panel squeezed flat by its titles and labels (under 0.6 times its width), or whose y tick
    labels (a bar chart's categories) need more height than it has at a phone's text size, grows
    by the height it lacks (at most three times its own a round), and the figure with it, until it
    has the height and they fit a line apart."""
    for _ in range(4):
        for _ in range(2):                  # constrained layout settles over a few runs (ticks move)
            fig.stale = True
            _lay_out(fig)
        renderer = fig.canvas.get_renderer()
        lack = [0.0] * len(panels)          # inches a panel's row grows by: what the panel lacks
        for i, ax in enumerate(panels):
            if not ax.axison:               # a legend's or a title's row
                continue
            lo, hi = sorted(ax.yaxis.get_view_interval())
            labels = [t.label1 for t in ax.yaxis.get_major_ticks() if lo <= t.get_loc() <= hi and t.label1.get_text()]
            box = ax.get_window_extent(renderer)
            need = 0.6 * box.width if ax.get_aspect() == "auto" else 0.0
            if len(labels) > 1 and ax.get_aspect() == "auto":   # an image's width fixes its height: thinned instead
                need = max(need, 1.4 * len(labels) * max(t.get_window_extent(renderer).height for t in labels))
            lack[i] = min(3.0 * max(box.height, 0.3 * fig.dpi), max(0.0, need - box.height)) / fig.dpi
        if max(lack) <= 0.02:
            return
        heights[:] = [h + extra for h, extra in zip(heights, lack)]
        grid.set_height_ratios(heights)
        fig.set_size_inches(fig.get_figwidth(), fig.get_figheight() + sum(lack))


def _fill_the_width(fig, panels) -> None:
    """A panel of fixed aspect (an image) is as wide as the figure's height lets it be: where
    titles, labels and legends took so much height that it is narrower than the room its row
    gives it (under 90 %), the figure grows taller until it is not (at most three times)."""
    height = fig.get_figheight()
    for _ in range(3):
        _lay_out(fig)
        narrowest = min((ax.get_position().width / max(ax.get_position(original=True).width, 1e-6)
                         for ax in panels if ax.get_aspect() != "auto"), default=1.0)
        if narrowest >= 0.9 or fig.get_figheight() >= 3 * height:
            return
        fig.set_size_inches(fig.get_figwidth(), min(3 * height, fig.get_figheight() / narrowest))
        _relayout(fig)


def _within_the_column(fig) -> None:
    """Texts that stick out of the figure (a label beside a bar, a note at an axis' end) would
    widen the saved image past the column: each is broken into lines that end at the figure's
    edge, and where that is not enough the figure narrows until its tight box fits
    PHONE_WIDTH_IN (at most to half of it)."""
    for _ in range(3):
        _lay_out(fig)
        renderer = fig.canvas.get_renderer()
        box = fig.get_tightbbox(renderer)
        if box.width <= PHONE_WIDTH_IN + 0.02:
            return
        right, changed = fig.bbox.width, False
        for t in _texts(fig):
            extent = t.get_window_extent(renderer)
            if extent.x1 > right + 1 and extent.x0 < right - 24:
                changed |= _wrap_to(t, right - extent.x0, renderer)
        if not changed:
            width = max(PHONE_WIDTH_IN / 2, fig.get_figwidth() * PHONE_WIDTH_IN / box.width)
            fig.set_size_inches(width, fig.get_figheight())
            _relayout(fig)


def _drop_crowded_minor_labels(fig) -> None:
    """An axis whose tick labels run into each other once they are a phone's size: a logarithmic
    axis (2x10^2, 3x10^2, ... between its decades) keeps the labels of its major ticks, or within
    one decade those of 2 and 5 times a power of ten; an x axis of names turns them upright."""
    import math
    from matplotlib.ticker import FuncFormatter, NullFormatter
    _lay_out(fig)
    renderer = fig.canvas.get_renderer()
    for ax in (ax for ax in fig.axes if ax.axison):
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            minor = [t.label1 for t in axis.get_minor_ticks() if lo <= t.get_loc() <= hi and t.label1.get_text()]
            major = [t.label1 for t in axis.get_major_ticks() if lo <= t.get_loc() <= hi and t.label1.get_text()]
            boxes = [_corners(t, renderer) for t in minor + major]
            if not any(_depth(a, b) > 1 for i, a in enumerate(boxes) for b in boxes[i + 1:]):
                continue
            if minor and major:
                axis.set_minor_formatter(NullFormatter())
            elif minor:                     # within one decade: label 2 and 5 times a power of ten only
                axis.set_minor_formatter(FuncFormatter(
                    lambda v, pos: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
            elif axis is ax.xaxis:          # a bar chart's category names: upright
                ax.tick_params(axis="x", labelrotation=90)


def _thin_crowded_labels(fig) -> None:
    """Tick labels that still run into each other at a phone's size, numbers (2, 4, ... 20 set one
    per step) or an image's rows and columns (a heatmap's tokens), keep every k-th tick, the least
    k that sets them apart. A bar chart's category names are left whole: a bar needs its name."""
    import re
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter
    _lay_out(fig)
    renderer = fig.canvas.get_renderer()
    for ax in (ax for ax in fig.axes if ax.axison):
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            ticks = [t for t in axis.get_major_ticks() if lo <= t.get_loc() <= hi and t.label1.get_text()]
            texts = [t.label1.get_text() for t in ticks]
            numbers = all(re.search(r"\d", x) and not re.search(r"[a-df-zA-Z]", x.replace("\\mathdefault", ""))
                          for x in texts)
            if len(ticks) < 3 or not (numbers or ax.images):
                continue
            boxes = [_corners(t.label1, renderer) for t in ticks]
            apart = lambda k: all(_depth(boxes[i], boxes[i + k]) <= 1 for i in range(len(boxes) - k))  # noqa: E731
            k = next((k for k in range(1, len(ticks)) if apart(k)), len(ticks))
            if k == 1:
                continue
            axis.set_major_locator(FixedLocator([t.get_loc() for t in ticks[::k]]))
            axis.set_major_formatter(FixedFormatter(texts[::k]))
            axis.set_minor_formatter(NullFormatter())       # a log axis labels its decades between

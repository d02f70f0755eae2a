"""The paper's figures, drawn by the lessons from the code they explain.

Each function returns a matplotlib ``Figure`` (no ``pyplot``: nothing global changes) that
a lesson shows with :func:`attn.plot.show_figure`. What a figure draws comes from its
arguments, which the lesson takes from the library: the architecture from the model's
parameter names (:func:`attn.model.parameter_shapes`), the key/value cache from the shapes of
the cache a decoder grew, beam search's tree from the beams a search kept, the ring
all-reduce from the chunks each rank held after each round. So a figure cannot drift from
the code: change the model, and the figure changes with it.

Boxes and arrows are in data coordinates of one axes without ticks; sizes are chosen so
that the text stays legible at the book's column width (attn.plot.COLUMN_PX).
"""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch

from .figure_layout import PHONE_MIN_PT, PHONE_WIDTH_IN

COLORS = {"attention": "#fbe3c4", "ffn": "#d4ecf7", "norm": "#f6f3b7", "embed": "#f3d3dc",
          "linear": "#e2e2f4", "softmax": "#d9f0d3", "plain": "#f2f2f2", "mask": "#e8e8e8"}


def _canvas(width: float, height: float, xlim, ylim):
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis("off")
    return fig, ax


def _pt(size: float, phone: bool) -> float:
    """A text's size in points: ``size`` in the wide figure, at least PHONE_MIN_PT (and one point
    more than ``size``) in a phone variant."""
    return max(PHONE_MIN_PT, size + 1) if phone else size


def _box(ax, x, y, w, h, text, kind="plain", size=10, **kw):
    """A rounded box centred at (x, y), ``w`` by ``h``, with centred text."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=COLORS.get(kind, kind), ec="#333333", lw=1.0))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, **kw)


def _arrow(ax, a, b, color="#333333", style="-|>", **kw):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=11, color=color, lw=1.1,
                                 shrinkA=0, shrinkB=0, **kw))


def _sublayers(names, stack: str) -> list[str]:
    """The sub-layers of layer 0 of ``stack`` in the order the parameters list them:
    e.g. ['self_attn', 'norm1', 'ffn', 'norm2']."""
    seen = []
    for name in names:
        parts = name.split(".")
        if parts[:2] == [stack, "0"] and parts[2] not in seen:
            seen.append(parts[2])
    return seen


_LABELS = {("encoder", "self_attn"): ("Multi-head\nself-attention", "attention"),
           ("decoder", "self_attn"): ("Masked multi-head\nself-attention", "attention"),
           ("decoder", "cross_attn"): ("Multi-head\ncross-attention", "attention")}


def architecture(parameter_names, n_encoder_layers: int, n_decoder_layers: int, d_model: int,
                 n_heads: int, d_ff: int) -> Figure:
    """Figure 1 of the paper from the model's parameter names: the encoder stack (left), the
    decoder stack (right), each sub-layer followed by "Add & Norm" with its residual path drawn
    around it, the memory going into every cross-attention, the embeddings with the positional
    encoding below and the output projection and softmax above."""
    names = list(parameter_names)
    enc, dec = _sublayers(names, "encoder"), _sublayers(names, "decoder")
    h = 0.62                                              # a box's height; the layout is built bottom-up
    rows = max(len(enc), len(dec))
    top = 2.45 + rows / 2 * 1.3 + 2.6
    fig, ax = _canvas(8.6, 0.62 * top, (-0.4, 10.4), (-0.3, top))
    stacks = {}
    for stack, x, sub, n in (("encoder", 2.6, enc, n_encoder_layers), ("decoder", 7.2, dec, n_decoder_layers)):
        _inputs(ax, stack, x, h, d_model)
        stacks[stack] = _stack(ax, stack, x, h, sub, n, d_model, d_ff)
    ex, ey, _ = stacks["encoder"]
    dx, dy, dys = stacks["decoder"]
    _memory_and_outputs(ax, (ex, ey), (dx, dy), dys.get("cross_attn"))
    ax.text(ex, ey + 1.4, f"d_model {d_model}, {n_heads} heads,\nd_ff {d_ff}", ha="center", va="center", fontsize=10)
    fig.attn_alt = (f"The Transformer (the paper's Figure 1) as this model builds it: an encoder of {n_encoder_layers} "
                    f"layers ({', '.join(s for s in enc if not s.startswith('norm'))}, each followed by Add & Norm "
                    f"around a residual path) and a decoder of {n_decoder_layers} layers "
                    f"({', '.join(s for s in dec if not s.startswith('norm'))}, likewise); the encoder's output, "
                    "the memory, feeds every cross-attention; below each stack the positional encoding is added "
                    "to the embeddings, the output projection and softmax above.")
    fig.attn_phone = lambda: _architecture_for_a_phone(enc, dec, n_encoder_layers, n_decoder_layers, d_model,
                                                       n_heads, d_ff, fig.attn_alt)
    return fig


_PHONE_LABELS = {("encoder", "self_attn"): ("Self-\nattention", "attention"),
                 ("decoder", "self_attn"): ("Masked\nself-attention", "attention"),
                 ("decoder", "cross_attn"): ("Cross-\nattention", "attention")}


def _architecture_for_a_phone(enc, dec, n_enc, n_dec, d_model, n_heads, d_ff, alt) -> Figure:
    """:func:`architecture` drawn for a phone's column, in inches: the two stacks side by side with
    shorter names (the feed-forward's sizes go to the note above), the positional encoding (PE)
    entering both sums from between them, each stack's name and depth under its inputs."""
    pt, bw, top = _pt(10, True), 1.3, 2.1 + 1.15 * max(len(enc), len(dec)) / 2 + 2.0
    fig, ax = _canvas(PHONE_WIDTH_IN, top, (0, PHONE_WIDTH_IN), (0, top))
    ends = {}
    for stack, x, sub, n, out in (("encoder", 0.85, enc, n_enc, -1), ("decoder", 2.45, dec, n_dec, 1)):
        below = "inputs\n(source ids)" if stack == "encoder" else "outputs, shifted\nright: <s> +\ntarget ids"
        ax.text(x, 0.95, below, ha="center", va="top", fontsize=pt)
        ax.text(x, 0.02, f"{stack.capitalize()} x {n}", ha="center", va="bottom", fontsize=pt, weight="bold")
        _box(ax, x, 1.4, bw, 0.5, f"Embedding\nx √{d_model}", "embed", size=pt)
        _arrow(ax, (x, 1.0), (x, 1.15))
        ax.add_patch(Circle((x, 1.9), 0.08, fc="white", ec="#333333", lw=1.1))
        ax.plot([x - 0.05, x + 0.05], [1.9, 1.9], color="#333333", lw=1.1)
        ax.plot([x, x], [1.85, 1.95], color="#333333", lw=1.1)
        _arrow(ax, (x, 1.65), (x, 1.82))
        _arrow(ax, (1.65 + 0.17 * out, 1.9), (x - 0.09 * out, 1.9))
        y, y_in, ys = 2.1, 1.98, {}
        for name in (s for s in sub if not s.startswith("norm")):
            label, kind = _PHONE_LABELS.get((stack, name), ("Feed\nforward", "ffn"))
            _box(ax, x, y + 0.3, bw, 0.5, label, kind, size=pt)
            _box(ax, x, y + 0.85, bw, 0.3, "Add & Norm", "norm", size=pt)
            _arrow(ax, (x, y_in), (x, y + 0.05))
            _arrow(ax, (x, y + 0.55), (x, y + 0.7))
            rx = x + out * (bw / 2 + 0.1)
            ax.plot([x, rx, rx], [y_in + 0.04, y_in + 0.04, y + 0.85], color="#555555", lw=1.0)
            _arrow(ax, (rx, y + 0.85), (x + out * bw / 2, y + 0.85), color="#555555")
            ys[name], y_in, y = y + 0.3, y + 1.0, y + 1.15
        ax.add_patch(FancyBboxPatch((x - bw / 2 - (0.14 if out < 0 else 0.04), 2.02), bw + 0.18, y - 2.1,
                                    boxstyle="round,pad=0.02,rounding_size=0.08", fc="none", ec="#777777", lw=1.2))
        ends[stack] = (x, y_in, ys)
    ax.text(1.65, 1.9, "PE", ha="center", va="center", fontsize=pt)
    (ex, ey, _), (dx, dy, dys) = ends["encoder"], ends["decoder"]
    if "cross_attn" in dys:
        ax.plot([ex, ex, 1.65, 1.65], [ey, ey + 0.15, ey + 0.15, dys["cross_attn"]], color="#b05a00", lw=1.3)
        _arrow(ax, (1.65, dys["cross_attn"]), (dx - bw / 2, dys["cross_attn"]), color="#b05a00")
        ax.text(0.05, ey + 0.25, "memory (K, V)", color="#b05a00", fontsize=pt, va="bottom")
    _box(ax, dx, dy + 0.45, 1.5, 0.5, "Linear\n(x Embeddingᵀ)", "linear", size=pt)
    _box(ax, dx, dy + 1.05, 1.5, 0.3, "Softmax", "softmax", size=pt)
    for a, b in ((dy, dy + 0.2), (dy + 0.7, dy + 0.9), (dy + 1.2, dy + 1.4)):
        _arrow(ax, (dx, a), (dx, b))
    ax.text(PHONE_WIDTH_IN - 0.02, dy + 1.45, "output\nprobabilities", ha="right", va="bottom", fontsize=pt)
    ax.text(0.05, ey + 0.65, f"d_model {d_model},\n{n_heads} heads,\nd_ff {d_ff};\nPE: positional\nencoding",
            va="bottom", fontsize=pt)
    fig.attn_alt = alt
    return fig


def _inputs(ax, stack: str, x: float, h: float, d_model: int) -> None:
    """Below a stack: its input ids, the embedding and the positional encoding's sum."""
    side = "inputs (source ids)" if stack == "encoder" else "outputs, shifted right\n(<s> + target ids)"
    ax.text(x, 0.0, side, ha="center", va="center", fontsize=10)
    _box(ax, x, 0.9, 2.6, h, f"Embedding x √{d_model}", "embed")
    # the positional encoding enters the sum below the stack, from the outside, as in the paper
    out = 1 if stack == "decoder" else -1
    ax.add_patch(Circle((x, 1.65), 0.13, fc="white", ec="#333333", lw=1.1))
    ax.plot([x - 0.08, x + 0.08], [1.65, 1.65], color="#333333", lw=1.1)
    ax.plot([x, x], [1.57, 1.73], color="#333333", lw=1.1)
    _arrow(ax, (x + out * 0.95, 1.65), (x + out * 0.14, 1.65))
    ax.text(x + out * 1.02, 1.65, "Positional\nencoding", ha="left" if out > 0 else "right", va="center",
            fontsize=9)
    _arrow(ax, (x, 0.3), (x, 0.9 - h / 2))
    _arrow(ax, (x, 0.9 + h / 2), (x, 1.52))


def _stack(ax, stack: str, x: float, h: float, sub: list, n: int, d_model: int, d_ff: int):
    """A stack's sub-layers bottom-up, each with its Add & Norm and residual path, framed
    with "x n". Returns (x, the stack's output y, {sub-layer: its box's y})."""
    out = 1 if stack == "decoder" else -1
    y, y_in, ys = 2.45, 1.78, {}
    frame_lo = y - 0.35
    for name in sub:
        if name.startswith("norm"):
            continue
        label, kind = _LABELS.get((stack, name), (f"Feed forward\n{d_model} -> {d_ff} -> {d_model}", "ffn"))
        _box(ax, x, y + 0.3, 2.6, h + 0.08, label, kind)
        _box(ax, x, y + 0.95, 2.6, 0.36, "Add & Norm", "norm", size=9)
        _arrow(ax, (x, y_in), (x, y + 0.3 - (h + 0.08) / 2))
        _arrow(ax, (x, y + 0.3 + (h + 0.08) / 2), (x, y + 0.95 - 0.18))
        # the residual path: around the sub-layer, into Add & Norm
        rx = x - 1.55 if stack == "encoder" else x + 1.55
        branch = max(y_in + 0.12, frame_lo + 0.12)          # inside the stack's frame
        ax.plot([x, rx, rx], [branch, branch, y + 0.95], color="#555555", lw=1.0)
        _arrow(ax, (rx, y + 0.95), (x - 1.3 if stack == "encoder" else x + 1.3, y + 0.95), color="#555555")
        ys[name] = y + 0.3
        y_in = y + 0.95 + 0.18
        y += 1.3
    ax.add_patch(FancyBboxPatch((x - 1.85, frame_lo), 3.7, y - frame_lo - 0.2,
                                boxstyle="round,pad=0.05,rounding_size=0.2", fc="none", ec="#777777", lw=1.2))
    ax.text(x + out * 2.0, (frame_lo + y) / 2 + 0.25, f"x {n}", fontsize=13,
            ha="left" if out > 0 else "right", va="center", weight="bold")
    ax.text(x + out * 2.0, (frame_lo + y) / 2 - 0.3, stack.capitalize(), fontsize=11,
            ha="left" if out > 0 else "right", va="center", weight="bold")
    return x, y_in, ys


def _memory_and_outputs(ax, encoder_top, decoder_top, cross_y) -> None:
    """The encoder's output, the memory, into the decoder's cross-attention (at ``cross_y``,
    when there is one), and the output projection and softmax above the decoder."""
    (ex, ey), (dx, dy) = encoder_top, decoder_top
    if cross_y is not None:
        ax.plot([ex, ex, (ex + dx) / 2, (ex + dx) / 2], [ey, ey + 0.25, ey + 0.25, cross_y], color="#b05a00", lw=1.3)
        _arrow(ax, ((ex + dx) / 2, cross_y), (dx - 1.3, cross_y), color="#b05a00")
        ax.text((ex + dx) / 2 + 0.08, ey + 0.33, "memory (K, V)", color="#b05a00", fontsize=9)
    _box(ax, dx, dy + 0.75, 2.6, 0.5, "Linear (x Embeddingᵀ)", "linear", size=9)
    _box(ax, dx, dy + 1.5, 2.6, 0.5, "Softmax", "softmax", size=9)
    _arrow(ax, (dx, dy), (dx, dy + 0.5))
    _arrow(ax, (dx, dy + 1.0), (dx, dy + 1.25))
    _arrow(ax, (dx, dy + 1.75), (dx, dy + 2.15))
    ax.text(dx, dy + 2.35, "output probabilities", ha="center", va="center", fontsize=10)


def attention_figure(n_heads: int | None = None, d_k: int | None = None, phone: bool = False) -> Figure:
    """Figure 2 of the paper: scaled dot-product attention (left) and, given ``n_heads``,
    multi-head attention (right), with the shapes of one head's ``d_k``. ``phone``: drawn for
    a phone's column (:data:`PHONE_WIDTH_IN` wide), the multi-head drawing under the other;
    the wide figure carries that variant (``attn_phone``, which attn.plot serves to phones)."""
    two = n_heads is not None
    if phone:
        fig = Figure(figsize=(PHONE_WIDTH_IN, 4.0 * (2 if two else 1)))
        axes = [fig.add_axes((0, 0.5 if two else 0, 1, 0.5 if two else 1))]
        axes += [fig.add_axes((0, 0, 1, 0.5))] if two else []
        for ax, xlim in zip(axes, ((0, 4.6), (4.6, 10.9))):
            ax.set_xlim(*xlim)
            ax.set_ylim(0, 10)
            ax.axis("off")
    else:
        fig, ax = _canvas(9.0 if two else 4.2, 5.2, (0, 10 if two else 4.6), (0, 10))
        axes = [ax, ax]
    _scaled_dot_product(axes[0], d_k, phone)
    if two:
        _multi_head(axes[1], n_heads, phone)
    fig.attn_alt = ("Scaled dot-product attention (the paper's Figure 2): Q times K transposed, scaled by "
                    "1/sqrt(d_k), optionally masked, softmax over the keys, times V."
                    + (f" Multi-head attention: V, K and Q each through {n_heads} linear maps, {n_heads} "
                       "attentions in parallel, concatenated, one more linear map." if two else ""))
    if not phone:
        fig.attn_phone = lambda: attention_figure(n_heads, d_k, phone=True)
    return fig


def _scaled_dot_product(ax, d_k, phone: bool) -> None:
    """Figure 2's left half, centred at x = 2.3 of ``ax``."""
    x = 2.3
    steps = [("MatMul  Q Kᵀ", "linear"), (f"Scale  1/√d_k{f' = 1/√{d_k}' if d_k else ''}", "plain"),
             ("Mask (optional)", "mask"), ("SoftMax (over keys)", "softmax"), ("MatMul  · V", "linear")]
    for i, (label, kind) in enumerate(steps):
        _box(ax, x, 2.0 + 1.5 * i, 3.6, 0.8, label, kind, size=_pt(10, phone))
        if i:
            _arrow(ax, (x, 2.4 + 1.5 * (i - 1)), (x, 1.6 + 1.5 * i))
    for k, name in enumerate(("Q", "K")):
        qx = x - 0.8 + 1.6 * k
        ax.text(qx, 0.6, name, ha="center", va="center", fontsize=_pt(11, phone))
        _arrow(ax, (qx, 0.9), (qx, 1.6))
    ax.plot([x + 2.05, x + 2.05], [0.9, 8.0], color="#333333", lw=1.1)
    ax.text(x + 2.05, 0.6, "V", ha="center", va="center", fontsize=_pt(11, phone))
    _arrow(ax, (x + 2.05, 8.0), (x + 1.8, 8.0))
    _arrow(ax, (x, 8.4), (x, 9.2))
    ax.text(x, 9.5, "Scaled dot-product attention", ha="center", va="center", fontsize=_pt(11, phone),
            weight="bold")


def _multi_head(ax, n_heads: int, phone: bool) -> None:
    """Figure 2's right half, centred at x = 7.4 of ``ax``."""
    mx = 7.4
    for k, name in enumerate(("V", "K", "Q")):
        lx = mx - 1.6 + 1.6 * k
        ax.text(lx, 0.6, name, ha="center", va="center", fontsize=_pt(11, phone))
        _arrow(ax, (lx, 0.9), (lx, 1.55))
        for j in range(2, -1, -1):                    # a stack of h linear maps
            _box(ax, lx + 0.1 * j, 2.0 + 0.1 * j, 1.3, 0.7, "Linear" if j == 0 else "", "linear", size=_pt(9, phone))
        _arrow(ax, (lx, 2.4), (lx, 3.3))
    for j in range(2, -1, -1):
        _box(ax, mx + 0.12 * j, 4.2 + 0.12 * j, 4.4, 1.1 if phone else 0.9,
             "Scaled dot-product\nattention" if j == 0 else "", "attention", size=_pt(10, phone))
    ax.text(mx + 2.55, 4.7, f"h = {n_heads}", fontsize=_pt(11, phone), weight="bold", va="center")
    _box(ax, mx, 6.3, 2.4, 0.7, "Concat", "plain", size=_pt(10, phone))
    _box(ax, mx, 7.8, 2.4, 0.7, "Linear (W_O)", "linear", size=_pt(10, phone))
    _arrow(ax, (mx, 4.65 + (0.1 if phone else 0)), (mx, 5.95))
    _arrow(ax, (mx, 6.65), (mx, 7.45))
    _arrow(ax, (mx, 8.15), (mx, 9.0))
    ax.text(mx, 9.5, "Multi-head attention", ha="center", va="center", fontsize=_pt(11, phone), weight="bold")


def kv_cache(self_k_shapes, cross_k_shape=None, tokens=None, phone: bool = False) -> Figure:
    """The decoder's self-attention key cache after each step (one row of cells per step, one
    cell per cached position, the new one highlighted), from the shapes ``(B, H, t, d_k)`` the
    cache had after each step; ``cross_k_shape``, the cross-attention's keys, computed once.
    ``phone``: drawn for a phone's column, each step's name and shape on a line above its
    cells (the wide figure carries that variant as ``attn_phone``)."""
    steps = len(self_k_shapes)
    width = max(s[2] for s in self_k_shapes)
    if phone:
        fig, ax = _canvas(PHONE_WIDTH_IN, 1.4 + 0.62 * steps, (-0.1, max(width, 5) + 0.1),
                          (-2.1, 1.6 * (steps - 1) + 2.3))
    else:
        fig, ax = _canvas(8.6, 1.5 + 0.48 * steps, (-3.6, width + 4.2), (-1.2, steps + 0.9))
    size = _pt(10, phone)
    for i, shape in enumerate(self_k_shapes):
        y = 1.6 * (steps - 1 - i) if phone else steps - 1 - i
        t = shape[2]
        word = f" ({tokens[i]})" if tokens is not None and i < len(tokens) else ""
        if phone:
            ax.text(0.06, y + 0.1, f"step {i + 1}{word}: K {tuple(shape)}", va="bottom", fontsize=size)
        else:
            ax.text(-0.4, y, f"step {i + 1}{word}", ha="right", va="center", fontsize=size)
            ax.text(t + 0.3, y, f"K {tuple(shape)}", va="center", fontsize=size)
        for j in range(t):
            new = j == t - 1
            ax.add_patch(FancyBboxPatch((j + 0.06, y - (0.7 if phone else 0.34)), 0.88, 0.68, boxstyle="square,pad=0",
                                        fc="#f4a259" if new else "#cfe3f2", ec="#333333", lw=0.8))
    title = "self-attention keys in the cache{0}(values alike);{0}orange: this step's".format("\n" if phone else " ")
    cross = f"cross-attention K, V {tuple(cross_k_shape)}:{chr(10) if phone else ' '}computed once, before step 1" \
        if cross_k_shape is not None else None
    if phone:
        ax.text(0.06, 1.6 * (steps - 1) + 1.2, title, va="bottom", fontsize=size)
        if cross:
            ax.text(0.06, -1.0, cross, va="top", fontsize=size)
    else:
        ax.text(width / 2, steps + 0.35, title, ha="center", va="center", fontsize=size)
        if cross:
            ax.text(width / 2, -0.9, cross, ha="center", va="center", fontsize=size)
    fig.attn_alt = (f"The decoder's key cache over {steps} steps: after step t it holds t positions, shapes "
                    f"{tuple(self_k_shapes[0])} to {tuple(self_k_shapes[-1])}, one new row per step.")
    if not phone:
        fig.attn_phone = lambda: kv_cache(self_k_shapes, cross_k_shape, tokens, phone=True)
    return fig


def beam_tree(steps, words, chosen=(), greedy=(), phone: bool = False) -> Figure:
    """Beam search's tree: ``steps[t]`` lists the beams kept at step t as (parent index in
    ``steps[t-1]``, token id, log P); ``words`` maps a token id to its text. ``chosen`` and
    ``greedy`` are token lists whose paths are drawn thick (the best hypothesis, green) and
    dashed (greedy's output, red). Steps run left to right; ``phone``: top to bottom, the beams
    across, for a phone's column (the wide figure carries that variant as ``attn_phone``)."""
    T = len(steps)
    K = max(len(s) for s in steps)
    if phone:
        fig, ax = _canvas(PHONE_WIDTH_IN, 0.75 * (T + 1.8), (-0.5, K - 0.5), (-T - 0.5, 1.3))
        place = lambda t, k: (k, -t - 1)            # noqa: E731  step t's beam k; <s> is step -1
    else:
        fig, ax = _canvas(min(1.0 + 1.3 * (T + 1), 12.0), 1.2 + 0.75 * (K + 1), (-1.5, T - 0.5), (-K + 0.4, 1.0))
        place = lambda t, k: (t, -k)                # noqa: E731
    ax.text(*place(-1, 0), "<s>", ha="center", va="bottom", fontsize=_pt(10, phone), weight="bold")
    prefixes = {(-1, 0): []}

    def on(path, prefix):
        return list(path[:len(prefix)]) == prefix
    for t, beams in enumerate(steps):
        for k, (parent, tok, lp) in enumerate(beams):
            prefix = prefixes[(t - 1, parent if t else 0)] + [tok]
            prefixes[(t, k)] = prefix
            (x0, y0), (x1, y1) = place(t - 1, parent if t else 0), place(t, k)
            best, gre = on(chosen, prefix), on(greedy, prefix)
            color = "#2a9d3f" if best else ("#c0392b" if gre else "#999999")
            ends = ([x0, x1], [y0 - 0.32, y1 + 0.3]) if phone else ([x0 + 0.3, x1 - 0.3], [y0, y1])
            ax.plot(*ends, color=color, lw=2.4 if best else 1.0, ls="--" if gre and not best else "-")
            ax.text(x1, y1 + 0.02, words(tok), ha="center", va="bottom", fontsize=_pt(10, phone),
                    weight="bold" if best else "normal")
            ax.text(x1, y1 - 0.04, f"{lp:.2f}", ha="center", va="top", fontsize=_pt(9, phone), color="#555555")
    key = "green: the best hypothesis; red dashed: greedy's path; under each word, log P so far"
    if phone:
        ax.text(-0.45, 0.5, key.replace("; ", ";\n"), va="bottom", fontsize=_pt(10, phone))
    else:
        ax.text((T - 2) / 2, 0.7, key, ha="center", va="center", fontsize=10)
    fig.attn_alt = (f"Beam search's tree over {T} steps, {K} beams kept per step, each word with its log "
                    f"probability; the best hypothesis '{' '.join(words(x) for x in chosen)}' and greedy's "
                    f"'{' '.join(words(x) for x in greedy)}' part ways.")
    if not phone:
        fig.attn_phone = lambda: beam_tree(steps, words, chosen, greedy, phone=True)
    return fig


def ring_rounds(snapshots, phases) -> Figure:
    """The ring all-reduce, round by round: ``snapshots[i][r][c]`` is the set of ranks whose
    numbers chunk ``c`` of rank ``r`` holds after round ``i`` (round 0: before any), and
    ``phases[i]`` names the round. A full chunk (every rank's sum) is dark."""
    R = len(snapshots[0])
    n = len(snapshots)
    fig, ax = _canvas(8.8, 1.0 + 0.62 * n, (-3.2, R * (R + 1) + 0.2), (-n - 0.2, 1.3))
    for r in range(R):
        ax.text(r * (R + 1) + R / 2, 0.75, f"rank {r}", ha="center", va="center", fontsize=10, weight="bold")
    for i, (snap, phase) in enumerate(zip(snapshots, phases)):
        y = -i
        ax.text(-0.3, y, phase, ha="right", va="center", fontsize=9)
        for r in range(R):
            for c in range(R):
                have = snap[r][c]
                x = r * (R + 1) + c
                full = len(have) == R
                ax.add_patch(FancyBboxPatch((x + 0.04, y - 0.36), 0.92, 0.72, boxstyle="square,pad=0",
                                            fc="#1d5e8c" if full else ("#a9cce3" if len(have) > 1 else "#f2f2f2"),
                                            ec="#333333", lw=0.6))
                ax.text(x + 0.5, y, "".join(str(s) for s in sorted(have)), ha="center", va="center", fontsize=9,
                        color="white" if full else "black")
    ax.text(R * (R + 1) / 2, -n + 0.25, "each cell: one chunk of a rank's buffer, labelled by the ranks "
            "whose gradients it sums", ha="center", va="center", fontsize=9)
    fig.attn_alt = (f"The ring all-reduce on {R} ranks, round by round ({', '.join(phases)}): each rank's buffer "
                    f"in {R} chunks; reduce-scatter leaves each rank one chunk summed over all ranks, all-gather "
                    "passes the sums round until every rank has every chunk summed.")
    return fig

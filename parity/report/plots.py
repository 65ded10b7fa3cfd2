"""Figures for report.html: matplotlib figures rendered to SVG and inlined into the page.

No pyplot and no global backend switch: each figure is a bare ``matplotlib.figure.Figure`` saved
as SVG (vector output, text kept as ``<text>`` so it stays small and searchable). The SVG is made
fit for inlining: no XML prolog, no DOCTYPE, no metadata block, and element ids salted per figure
so that several figures in one page never share an id. Labels that come from configs or module
paths are passed with math text off (a ``$`` in a name stays a ``$``); matplotlib's SVG writer
escapes text, and nothing here reaches the page except through that writer.

Each ``*_svg`` function returns the SVG text, or None when there is nothing to draw.
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import matplotlib as mpl
from matplotlib.collections import PatchCollection
from matplotlib.colors import LinearSegmentedColormap, Normalize, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from parity.report.tables import tolerance_ratio

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

    from parity.compare.results import NodeResult

#: log10(max_abs / tolerance) below this is drawn at the floor (an exact match is -inf)
LOG_FLOOR = -6.0
OVER, UNDER, NEUTRAL, ISOLATED = "#c62828", "#1e88e5", "#9aa0aa", "#ef6c00"
#: quiet (pale blue) far below tolerance, pale yellow at it, orange to dark red above: failing cells stand out
RATIO_CMAP = LinearSegmentedColormap.from_list(
    "parity_ratio",
    [
        (0.0, "#e4ecf5"),
        (0.3, "#bcd3ea"),
        (0.46, "#eef0d0"),
        (0.5, "#ffe58a"),
        (0.6, "#fdae61"),
        (0.8, "#d73027"),
        (1.0, "#5e0016"),
    ],
)
#: under a zero tolerance every nonzero error fails: pale yellow (smallest error) to dark red (largest)
ERROR_CMAP = LinearSegmentedColormap.from_list(
    "parity_error",
    [(0.0, "#ffe58a"), (0.25, "#fdae61"), (0.65, "#d73027"), (1.0, "#5e0016")],
)
EXACT = "#e4ecf5"  # a cell with max_abs 0 under a zero tolerance
NO_METRICS = "#d9dce1"
STATUS_MARK = {"shape": "S", "missing": "M", "nonfinite": "N", "choice": "C"}
BAR_LIMIT = 160  # above this many values, draw a step line instead of bars
STEP_POINTS = 1024  # at most this many steps in a line

_RC: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",
    "text.parse_math": False,
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Helvetica", "Arial", "Liberation Sans"],
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e6e8ec",
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
}


def _styled(func):
    """Build the whole figure under the report's rcParams (they are read when artists are made)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with mpl.rc_context(_RC):
            return func(*args, **kwargs)

    return wrapper


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def to_svg(fig: Figure, salt: str) -> str:
    """The figure as inline-ready SVG text (``<svg ...>...</svg>``)."""
    buf = io.StringIO()
    with mpl.rc_context({**_RC, "svg.hashsalt": f"parity-{salt}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, count=1, flags=re.S)
    # collections mark their links target="_blank"; links here are in-page anchors
    text = re.sub(r'(<a xlink:href="#[^"]*") target="_blank"', r"\1", text)
    # matplotlib numbers its groups per figure (figure_1, axes_1...): prefix every id of this
    # figure, and the references to them, so that ids stay unique in a page of several figures
    own = set(re.findall(r'\bid="([^"]+)"', text))
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{salt}-{m.group(1)}"', text)
    text = re.sub(
        r'(url\(#|xlink:href="#)([^")]+)',
        lambda m: f"{m.group(1)}{salt}-{m.group(2)}" if m.group(2) in own else m.group(0),
        text,
    )
    return text.replace("<svg ", f'<svg class="plot" role="img" data-plot="{salt}" ', 1)


def _pow10(value: float, _pos=None) -> str:
    """Tick label without math text: 1e-4, 1, 1e3 (matplotlib's default needs math text)."""
    if value <= 0:
        return ""
    exponent = math.log10(value)
    if abs(exponent - round(exponent)) < 1e-9:
        exponent = int(round(exponent))
        return "1" if exponent == 0 else "10" if exponent == 1 else f"1e{exponent}"
    return f"{value:g}"


def _log_y(ax) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=7))
    ax.yaxis.set_major_formatter(FuncFormatter(_pow10))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _log_ratio(node) -> float | None:
    """log10(max_abs / tolerance), floored at LOG_FLOOR; None when the node has no metrics."""
    ratio = tolerance_ratio(node)
    if ratio is None:
        return None
    if ratio == 0:
        return LOG_FLOOR
    if math.isinf(ratio):
        return None
    return max(LOG_FLOOR, math.log10(ratio))


def error_scale(nodes) -> str:
    """What the depth plots measure: ``"ratio"`` (max_abs / tolerance, 1 is the line between pass and
    fail) or, when every node with metrics was judged with atol 0 and rtol 0 (bit-exact pairs), where
    that ratio is infinite for every failing node, ``"max_abs"`` (the error itself: any nonzero value
    fails)."""
    measured = [n for n in nodes if n.max_abs is not None and math.isfinite(n.max_abs)]
    return "max_abs" if measured and all(n.atol == 0 and n.rtol == 0 for n in measured) else "ratio"


def _log_value(node, scale: str) -> float | None:
    """The plotted log10 of a node's error on ``scale``: ``_log_ratio``, or log10(max_abs) with
    ``-inf`` for an exact match; None when the node has no finite metrics."""
    if scale == "ratio":
        return _log_ratio(node)
    value = node.max_abs
    if value is None or not math.isfinite(value):
        return None
    return -math.inf if value == 0 else math.log10(value)


def _max_abs_range(logs: Sequence[float]) -> tuple[int, int]:
    """Whole decades that hold every finite log10(max_abs) (at least one decade)."""
    finite = [v for v in logs if math.isfinite(v)]
    if not finite:
        return -1, 0
    low, high = math.floor(min(finite)), math.ceil(max(finite))
    return low, max(high, low + 1)


def _decade_ticks(low: int, high: int, limit: int = 8) -> list[int]:
    step = max(1, math.ceil((high - low) / limit))
    return list(range(high, low - 1, -step))[::-1]


def _values(values: Sequence[float | None]) -> tuple[list[float], list[int]]:
    """Finite values (None/NaN/inf replaced by 0) and the indices that were not finite."""
    out, bad = [], []
    for i, v in enumerate(values):
        if v is None or not math.isfinite(v):
            bad.append(i)
            out.append(0.0)
        else:
            out.append(float(v))
    return out, bad


def _error_bars(ax, values: Sequence[float | None], threshold: float | None, xlabel: str) -> None:
    """Max |ours - ref| per index on a log axis; red where it passes ``threshold``; non-finite marked."""
    vals, bad = _values(values)
    positive = [v for v in vals if v > 0]
    floor = min(positive + ([threshold] if threshold else [])) / 10 if positive or threshold else 1e-12
    top = max(positive + ([threshold] if threshold else []) + [floor * 10])
    shown = [max(v, floor) for v in vals]
    for i in bad:
        shown[i] = top * 3
    colors = [OVER if (i in bad or (threshold is not None and v > threshold)) else NEUTRAL for i, v in enumerate(vals)]
    x = list(range(len(vals)))
    if len(vals) <= BAR_LIMIT:
        ax.bar(x, [s - floor for s in shown], bottom=floor, color=colors, width=0.8, linewidth=0)
    else:  # one step line; long series as the max of each bin (peaks are what matter)
        size = math.ceil(len(vals) / STEP_POINTS)
        bins = [max(shown[i : i + size]) for i in range(0, len(shown), size)]
        edges = [i * size - 0.5 for i in range(len(bins))] + [len(vals) - 0.5]
        label = f"max over {size} consecutive" if size > 1 else None
        ax.stairs(bins, edges, baseline=None, color=UNDER, linewidth=0.8, label=label)
        if label:
            ax.legend(loc="upper right", fontsize=8, frameon=False)
    if bad:
        ax.scatter(bad, [top * 3] * len(bad), marker="x", color="black", s=16, zorder=4, label="non-finite")
        ax.legend(loc="upper left", fontsize=8, frameon=False)
    if threshold:
        ax.axhline(threshold, color=OVER, linestyle="--", linewidth=0.9)
        ax.annotate(
            "atol",
            (1, threshold),
            xycoords=("axes fraction", "data"),
            xytext=(2, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            color=OVER,
        )
    _log_y(ax)
    ax.set_ylim(floor, top * 6)
    ax.set_xlim(-0.7, len(vals) - 0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("max |ours - ref|")
    if len(vals) <= 32:
        ax.set_xticks(x)
    ax.grid(axis="x", visible=False)


@_styled
def profile_svg(
    values: Sequence[float | None] | None, threshold: float | None, xlabel: str, salt: str, width: float = 5.2
) -> str | None:
    """Error per token position / head / channel of one node."""
    if not values:
        return None
    fig = _figure(width, 2.3)
    _error_bars(fig.add_subplot(), values, threshold, xlabel)
    return to_svg(fig, salt)


def _layer_grid(nodes) -> tuple[list, list[str], dict[tuple, NodeResult]]:
    """Rows (layer indices, with each node outside the layers as a row of its own: the embedding
    on top, the final norm and the head below), the node kinds of the layers (columns, execution
    order) and the node of each cell (``(row, kind)``; an outside node's kind is None). Several nodes
    of one kind in one layer (the experts of a MoE layer) share a cell: it shows the earliest failing
    one, else the one nearest its tolerance."""
    layers = sorted({n.layer for n in nodes if n.layer is not None})
    first = min((n.index for n in nodes if n.layer is not None), default=None)
    kinds: list[str] = []
    cells: dict[tuple, NodeResult] = {}
    before: list[str] = []
    after: list[str] = []
    for n in nodes:
        if n.layer is None:
            (before if first is not None and n.index < first else after).append(n.name)
            cells[(n.name, None)] = n
            continue
        if n.kind not in kinds:
            kinds.append(n.kind)
        held = cells.get((n.layer, n.kind))
        if held is not None and (
            held.failed or (not n.failed and (_log_ratio(n) or -math.inf) <= (_log_ratio(held) or -math.inf))
        ):
            continue
        cells[(n.layer, n.kind)] = n
    return before + layers + after, kinds, cells


def cell_title(node) -> str:
    """The hover text of a node's cell: name, status and the size of its error."""
    ratio = tolerance_ratio(node)
    numbers = "" if node.max_abs is None else f", max_abs {node.max_abs:.3g}"
    if ratio is not None and (math.isinf(ratio) or (node.atol == 0 and node.rtol == 0)):
        numbers += ", tolerance 0 (atol 0, rtol 0)"
    elif ratio is not None:
        numbers += f", {ratio:.3g} x tolerance"
    if node.rel_l2 is not None and math.isfinite(node.rel_l2) and node.max_abs:
        numbers += f", rel_l2 {node.rel_l2:.3g}"
    return f"{node.name}\n{node.status}{numbers}"


def _add_titles(svg: str, titles: dict[str, str]) -> str:
    """A ``<title>`` (the browser's hover text) inside each link whose target has one."""
    from html import escape

    def add(m: re.Match) -> str:
        title = titles.get(m.group(1))
        return m.group(0) if title is None else f"{m.group(0)}<title>{escape(title)}</title>"

    return re.sub(r'<a xlink:href="(#[^"]+)"[^>]*>', add, svg)


class _Colours:
    """The colour of a cell and its numbered colour bar, on ``scale`` (see :func:`error_scale`).

    ``ratio``: log10(max_abs / tolerance) from 1e-6 to the largest decade, diverging at 1 (the
    tolerance). ``max_abs``: log10(max_abs) over the decades the errors span, pale yellow to dark red
    (every nonzero error fails a zero tolerance), pale blue for an exact match."""

    norm: Normalize

    def __init__(self, cells, scale: str):
        self.scale = scale
        logs = [v for v in (_log_value(n, scale) for n in cells) if v is not None]
        if scale == "ratio":
            vmax = max([1.0] + [math.ceil(v) for v in logs if math.isfinite(v)])
            self.norm, self.cmap = TwoSlopeNorm(vmin=LOG_FLOOR, vcenter=0.0, vmax=vmax), RATIO_CMAP
            step = 2 if vmax - LOG_FLOOR <= 14 else 4
            self.ticks = sorted({*range(0, int(LOG_FLOOR) - 1, -step), *range(0, int(vmax) + 1, step)})
        else:
            low, high = _max_abs_range(logs)
            self.norm, self.cmap = Normalize(vmin=low, vmax=high), ERROR_CMAP
            self.ticks = _decade_ticks(low, high)

    def face(self, node):
        value = _log_value(node, self.scale)
        if node.status == "nonfinite" or (value is None and node.failed and node.max_abs is not None):
            return self.cmap(1.0)  # non-finite, or (ratio scale) a nonzero error under a zero tolerance
        if value is None:
            return NO_METRICS
        if value == -math.inf:  # max_abs scale: an exact match
            return EXACT
        return self.cmap(self.norm(value))

    def colorbar(self, fig, ax, label: str, **kwargs):
        bar = fig.colorbar(mpl.cm.ScalarMappable(norm=self.norm, cmap=self.cmap), ax=ax, **kwargs)
        bar.set_ticks(self.ticks, labels=[_pow10(10.0**t) for t in self.ticks])
        if self.scale == "ratio":
            bar.set_label(label)
            bar.ax.axhline(0, color="black", linewidth=0.8)
        else:
            bar.set_label(label.replace("max_abs / tolerance", "max_abs (tolerance 0)"))
        return bar


@_styled
def depth_heatmap_svg(nodes, first_index: int | None, scale: str | None = None) -> str | None:
    """log10(max_abs / tolerance), or log10(max_abs) when the tolerance is 0 (``scale``, see
    :func:`error_scale`): one row per layer, one column per node kind (execution order), and a row
    of its own for each node outside the layers (embedding, final norm, head).

    Each cell links to its node's row in the table (``#node-<index>``) and names the node and the
    size of its error on hover; the first mismatch is outlined; shape / missing / non-finite nodes
    carry a letter (S / M / N). The colour bar is numbered in max_abs / tolerance (or max_abs).
    """
    rows, kinds, cells = _layer_grid(nodes)
    if not cells:
        return None
    kinds = kinds or [""]
    colours = _Colours(cells.values(), scale or error_scale(nodes))
    n_rows, n_cols = len(rows), len(kinds)
    cell_h = 0.16 if n_rows > 16 else 0.26
    fig = _figure(max(5.0, 2.2 + 0.36 * n_cols), max(2.9, 1.7 + cell_h * n_rows))
    ax = fig.add_subplot()
    ax.grid(False)
    row_of = {row: r for r, row in enumerate(rows)}
    patches, faces, urls, titles = [], [], [], {}
    for (row, kind), node in cells.items():
        r = row_of[row]
        c, width = (kinds.index(kind), 1) if kind is not None else (0, 1)  # an outside node is one cell, not a row
        face = colours.face(node)
        patches.append(Rectangle((c, r), width, 1))
        faces.append(face)
        urls.append(f"#node-{node.index}")
        titles[f"#node-{node.index}"] = cell_title(node)
        mark = STATUS_MARK.get(node.status)
        if mark:
            ax.text(
                c + width / 2,
                r + 0.5,
                mark,
                ha="center",
                va="center",
                fontsize=7,
                color="black" if face == NO_METRICS else "white",
            )
        if first_index is not None and node.index == first_index:
            ax.add_patch(
                Rectangle(
                    (c + 0.04, r + 0.04), width - 0.08, 0.92, fill=False, edgecolor="black", linewidth=1.8, zorder=3
                )
            )
    grid = PatchCollection(patches, facecolors=faces, edgecolors="white", linewidths=0.5)
    grid.set_urls(urls)
    ax.add_collection(grid)
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)
    ax.set_xticks([c + 0.5 for c in range(n_cols)], kinds, rotation=50, ha="right", rotation_mode="anchor")
    layer_rows = [r for r, row in enumerate(rows) if isinstance(row, int)]
    step = 1 if len(layer_rows) <= 16 else 2 if len(layer_rows) <= 40 else 4
    shown = [r for r in layer_rows[::step]] + [r for r, row in enumerate(rows) if not isinstance(row, int)]
    label = {row: cells[(row, None)].kind for row in rows if not isinstance(row, int)}
    ax.set_yticks([r + 0.5 for r in shown], [str(label.get(rows[r], rows[r])) for r in shown])
    ax.set_ylabel("layer")
    ax.tick_params(length=0)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    colours.colorbar(fig, ax, "max_abs / tolerance", fraction=0.04, pad=0.02)
    return _add_titles(to_svg(fig, "heatmap"), titles)


@_styled
def depth_line_svg(
    nodes, isolated, first_index: int | None, label: str = "chained", scale: str | None = None
) -> str | None:
    """max_abs / tolerance along execution order (log): ``nodes`` (drawn as ``label``) and, when
    given, ``isolated``; 1 is the tolerance. On the ``max_abs`` scale (every tolerance 0, see
    :func:`error_scale`) the y axis is max_abs itself, every point above the floor fails and exact
    matches sit on the floor.

    Nodes without a value are marked at the top, by why: non-finite values (status ``nonfinite``),
    not comparable (shape mismatch, missing), or, among nonzero tolerances, a node whose own
    tolerance is 0 (its ratio is infinite)."""
    if not nodes:
        return None
    scale = scale or error_scale(list(nodes) + list(isolated or []))
    fig = _figure(9.0, 2.8)
    ax = fig.add_subplot()
    series = [(label, nodes, UNDER)] + ([("isolated", isolated, ISOLATED)] if isolated else [])
    if scale == "ratio":
        floor, top = 10.0**LOG_FLOOR, 10.0
    else:
        low, high = _max_abs_range([v for g in series for v in (_log_value(n, scale) for n in g[1]) if v is not None])
        floor, top = 10.0 ** (low - 1), 10.0**high
    marks = []  # (x, series name, why) drawn at the top once the top is known
    for name, group, color in series:
        xs, ys = [], []
        for n in group:
            value = None if n.status == "nonfinite" else _log_value(n, scale)
            if value is None:
                if n.failed:
                    why = (
                        "not comparable"
                        if n.max_abs is None and n.status != "nonfinite"
                        else "non-finite"
                        if n.status == "nonfinite" or not math.isfinite(n.max_abs)
                        else "fails a zero tolerance"
                    )  # max_abs / 0 in a run of nonzero tolerances
                    marks.append((n.index, name, why))
                continue
            y = floor if value == -math.inf else max(10.0**value, floor)
            xs.append(n.index)
            ys.append(y)
            top = max(top, y * 3)
        ax.plot(
            xs, ys, color=color, linewidth=1.1, marker="o" if len(group) <= 120 else None, markersize=2.5, label=name
        )
        line = 1.0 if scale == "ratio" else floor
        fails = [(x, y) for x, y in zip(xs, ys) if y > line]
        if fails and group is nodes:
            fail_x, fail_y = zip(*fails)
            ax.scatter(fail_x, fail_y, s=9, color=OVER, zorder=3, linewidths=0)
    for (name, why), marker in zip(sorted({(m[1], m[2]) for m in marks}), "xv^+*"):
        xs = [x for x, n, w in marks if (n, w) == (name, why)]
        ax.scatter(xs, [top] * len(xs), marker=marker, color="black", s=18, zorder=4, label=f"{name}: {why}")
    if scale == "ratio":
        ax.axhline(1.0, color=OVER, linestyle="--", linewidth=0.9)
        ax.annotate(
            "tolerance",
            (0, 1.0),
            xycoords=("axes fraction", "data"),
            xytext=(2, 3),
            textcoords="offset points",
            fontsize=8,
            color=OVER,
        )
    else:
        ax.annotate(
            "tolerance 0: every point above the floor fails; exact = floor",
            (0, floor),
            xycoords=("axes fraction", "data"),
            xytext=(2, 3),
            textcoords="offset points",
            fontsize=8,
            color=OVER,
        )
    if first_index is not None:
        ax.axvline(first_index, color="black", linewidth=0.8, linestyle=":")
        ax.annotate(
            f"first mismatch (#{first_index})",
            (first_index, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -10),
            textcoords="offset points",
            fontsize=8,
        )
    starts: dict[int, int] = {}
    for n in nodes:
        if n.layer is not None:
            starts.setdefault(n.layer, n.index)
    if starts:
        layers = sorted(starts)
        step = max(1, math.ceil(len(layers) / 16))
        ax.set_xticks([starts[layer] for layer in layers[::step]], [str(layer) for layer in layers[::step]])
        ax.set_xlabel("node, in execution order (ticks: first node of each layer)")
    else:
        ax.set_xlabel("node, in execution order")
    _log_y(ax)
    ax.set_ylim(floor / 2, top * 2)
    ax.set_xlim(-1, len(nodes))
    ax.set_ylabel("max_abs / tolerance" if scale == "ratio" else "max_abs (tolerance 0)")
    ax.legend(loc="upper left", fontsize=8, frameon=False, ncols=3, bbox_to_anchor=(0, 1.16))
    return to_svg(fig, "depth")


@_styled
def logits_svg(logits: dict | None, batch_size: int = 1) -> str | None:
    """Per position: top-1 agreement, top-k overlap and KL(reference || ours)."""
    if not logits or not logits.get("top1_agree"):
        return None
    top1, _ = _values(logits["top1_agree"])
    overlap, _ = _values(logits["topk_overlap"])
    kl, kl_bad = _values(logits["kl"])
    n = len(top1)
    x = list(range(n))
    fig = _figure(9.0, 3.9)
    axes = fig.subplots(3, 1, sharex=True)
    bars = n <= BAR_LIMIT
    draw = (
        (lambda ax, ys, colors: ax.bar(x, ys, color=colors, width=0.85, linewidth=0))
        if bars
        else (lambda ax, ys, colors: ax.step(x, ys, where="mid", color=UNDER, linewidth=0.8))
    )
    draw(axes[0], [1.0] * n, ["#43a047" if v >= 1 else OVER for v in top1])
    axes[0].set_yticks([])
    axes[0].set_ylabel("top-1\nagrees", rotation=0, ha="right", va="center")
    axes[0].grid(False)
    draw(axes[1], overlap, [NEUTRAL if v >= 1 else OVER for v in overlap])
    axes[1].set_ylim(0, 1.05)
    axes[1].set_ylabel(f"top-{logits.get('k', 5)}\noverlap", rotation=0, ha="right", va="center")
    draw(axes[2], kl, [UNDER] * n)
    if kl_bad:
        axes[2].scatter(kl_bad, [max(kl + [1e-12])] * len(kl_bad), marker="x", color="black", s=16)
    axes[2].set_ylim(min(0.0, min(kl)), max(max(kl), 1e-6) * 1.15)
    axes[2].set_ylabel("KL(ref||ours)\nnats", rotation=0, ha="right", va="center")
    axes[2].set_xlabel(
        "token position" + (f" (the {batch_size} batch rows one after another)" if batch_size > 1 else "")
    )
    if n <= 32:
        axes[2].set_xticks(x)
    for ax in axes:
        ax.grid(axis="x", visible=False)
        ax.set_xlim(-0.7, n - 0.3)
    return to_svg(fig, "logits")


def _badness(node, scale: str = "ratio") -> tuple:
    """Order nodes by how badly they fail: failing first, then by max_abs / tolerance (or max_abs on
    the ``max_abs`` scale; inf when the tolerance is 0 or the node has no metrics)."""
    value = _log_value(node, scale)
    return (node.failed, value if value is not None else (math.inf if node.failed else -math.inf))


@_styled
def decode_heatmap_svg(nodes, first_index: int | None, scale: str | None = None) -> str | None:
    """A KV-cache run: log10(max_abs / tolerance) (or log10(max_abs) under a zero tolerance, see
    :func:`error_scale`) of the worst node per decode step (rows) and layer (columns; ``out`` for the
    nodes outside the layers). Each cell links to that worst node and names it on hover; the cell of
    the first mismatch is outlined."""
    scale = scale or error_scale(nodes)
    cells: dict[tuple[int, int | str], NodeResult] = {}
    for n in nodes:
        if "/" not in n.name or not n.name.startswith("step"):
            continue
        step = int(n.name.split("/", 1)[0][len("step") :])
        key = (step, n.layer if n.layer is not None else "out")
        worst = cells.get(key)
        if worst is None or _badness(n, scale) > _badness(worst, scale):
            cells[key] = n
    if not cells:
        return None
    steps = sorted({s for s, _ in cells})
    layers = sorted({c for _, c in cells if c != "out"}) + (["out"] if any(c == "out" for _, c in cells) else [])
    colours = _Colours(cells.values(), scale)
    fig = _figure(max(4.5, 2.0 + 0.4 * len(layers)), max(2.6, 1.5 + 0.24 * len(steps)))
    ax = fig.add_subplot()
    ax.grid(False)
    patches, faces, urls, titles = [], [], [], {}
    for (step, layer), node in cells.items():
        r, c = steps.index(step), layers.index(layer)
        face = colours.face(node)
        patches.append(Rectangle((c, r), 1, 1))
        faces.append(face)
        urls.append(f"#node-{node.index}")
        titles[f"#node-{node.index}"] = cell_title(node)
        if first_index is not None and node.index == first_index:
            ax.add_patch(
                Rectangle((c + 0.05, r + 0.05), 0.9, 0.9, fill=False, edgecolor="black", linewidth=1.8, zorder=3)
            )
    grid = PatchCollection(patches, facecolors=faces, edgecolors="white", linewidths=0.5)
    grid.set_urls(urls)
    ax.add_collection(grid)
    ax.set_xlim(0, len(layers))
    ax.set_ylim(len(steps), 0)
    ax.set_xticks([c + 0.5 for c in range(len(layers))], [str(x) for x in layers])
    ax.set_yticks([r + 0.5 for r in range(len(steps))], [str(s) for s in steps])
    ax.set_xlabel("layer")
    ax.set_ylabel("step")
    ax.tick_params(length=0)
    colours.colorbar(fig, ax, "max_abs / tolerance (worst node)", fraction=0.05, pad=0.02)
    return _add_titles(to_svg(fig, "decode"), titles)


@_styled
def prompt_kl_svg(text: dict | None) -> str | None:
    """KL(reference || ours) by prompt position, one line per prompt (a prompt set: ``result.text``),
    the reference's own KL against float64 in grey (the rounding floor), top-1 disagreements marked
    (red x; a hollow circle for a near-tie). Log scale; KL 0 drawn at the floor."""
    if not text or not text.get("prompts"):
        return None
    rows = [p["positions"] for p in text["prompts"]]
    values = [v for s in rows for v in s["kl"] + (s["noise_kl"] or []) if v is not None and v > 0]
    # KL below 1e-12 nats is rounding at any dtype: drawn at the floor, so the axis keeps a readable range
    floor = max(10 ** math.floor(math.log10(min(values))), 1e-12) if values else 1e-12
    top = max(values) if values else 1.0
    fig = _figure(9.0, 3.2)
    ax = fig.add_subplot()
    many = len(rows) > 12
    for s in rows:
        x = list(range(len(s["kl"])))
        ys = [max(v, floor) for v in s["kl"]]
        ax.plot(x, ys, color=UNDER, alpha=0.35 if many else 0.8, linewidth=0.9, marker=None if many else ".")
        if s["noise_kl"] is not None:
            ax.plot(x, [max(v, floor) for v in s["noise_kl"]], color=NEUTRAL, linewidth=0.7, alpha=0.5)
    ties = {(d["prompt"], d["position"]): d.get("near_tie") for d in text.get("disagreements", [])}
    index = {p["index"]: p["positions"] for p in text["prompts"]}
    for (prompt, position), tie in ties.items():
        y = max(index[prompt]["kl"][position], floor)
        if tie:
            ax.scatter([position], [y], marker="o", facecolors="none", edgecolors=OVER, s=28)
        else:
            ax.scatter([position], [y], marker="x", color=OVER, s=24)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=7))
    ax.yaxis.set_major_formatter(FuncFormatter(_pow10))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(floor / 2, max(top, floor * 10) * 2)
    ax.set_xlabel("token position in the prompt")
    ax.set_ylabel("KL(ref||ours), nats")
    ax.plot([], [], color=UNDER, label=f"ours ({len(rows)} prompt{'s' if len(rows) != 1 else ''})")
    if any(s["noise_kl"] is not None for s in rows):
        ax.plot([], [], color=NEUTRAL, label="reference vs float64")
    if ties:
        ax.scatter([], [], marker="x", color=OVER, label="top-1 differs")
    ax.legend(loc="upper left", fontsize=8, frameon=False, ncols=3, bbox_to_anchor=(0, 1.14))
    return to_svg(fig, "prompt-kl")

"""Pictures of maps and plans (matplotlib, Agg backend; the optional ``reshard[plot]`` extra).

:func:`draw_map` draws one parameter's F as a 2-D grid of elements (1-D F as one row; N-D F as
``shape[0]`` rows by ``prod(shape[1:])`` columns) with every block of F coloured by the rank that
holds it. A block held by several ranks is striped diagonally, one stripe colour per holder, so
a replicated block always carries more than one rank's colour. Scaled pieces are labelled
``×s`` (or marked with a star when the label does not fit), the padding outside ``valid_shape``
is greyed, and a legend names every colour.

Blocks are drawn as rectangles, one per box of a piece (``reshard.ir.geometry.view_boxes``),
never per element, so drawing cost grows with the number of pieces, not with the size of F.

:func:`draw_plan` draws a plan's bytes as a source-rank × target-rank heat map.

Pictures are a fixed size (``MAP_PNG_SIZE``, ``PLAN_PNG_SIZE`` pixels) and the map's axes sit at
the fixed figure fraction ``AXES_RECT``, so a pixel of the PNG can be traced back to an element of
F (the tests do). Without matplotlib every entry point raises :class:`PlotUnavailable`, whose
message says how to install it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError, PlotUnavailable
from ..ir.geometry import Box, view_boxes
from ..ir.param_map import ParamMap
from ..ir.piece import prod

__all__ = [
    "AXES_RECT",
    "MAP_PNG_SIZE",
    "PLAN_PNG_SIZE",
    "PlotUnavailable",
    "draw_map",
    "draw_plan",
    "rank_colors",
    "require_matplotlib",
]

INSTALL_HINT = "pip install 'reshard[plot]'"
DPI = 100
MAP_PNG_SIZE = (1200, 800)  # width, height in pixels
PLAN_PNG_SIZE = (1000, 800)
AXES_RECT = (0.08, 0.10, 0.64, 0.76)  # left, bottom, width, height of the map's axes (figure fraction)
AXES_RECT_1D = (0.08, 0.40, 0.64, 0.24)  # the same for a 1-D F, drawn as one row
STRIPE_PX = 12  # width of one stripe of a multi-holder block, along the diagonal, in pixels
MAX_RUNS = 4096  # rectangles one box may become before it is drawn as its envelope
MAX_LABELS = 200
PAD_COLOR = "#c8c8c8"


def require_matplotlib() -> None:
    """Raise :class:`PlotUnavailable` (with the install command) unless matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        raise PlotUnavailable(f"drawing a PNG needs matplotlib, which is not installed: {INSTALL_HINT}") from None


def _new_figure(size: tuple[int, int]):
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> None:
    try:
        fig.savefig(path, dpi=DPI, format="png")
    except OSError as e:
        raise OutputError(f"{path}: cannot write the PNG ({e})") from None


# -- colours --------------------------------------------------------------------------------------


def rank_colors(ranks: Sequence[int]) -> dict[int, tuple[float, float, float, float]]:
    """One distinct colour per rank, in rank order: tab10 (grey left out, it means padding) up to
    9 ranks, tab20 (greys left out) up to 18, evenly spaced 'turbo' beyond."""
    require_matplotlib()
    from matplotlib import colormaps

    ranks = sorted(ranks)
    n = len(ranks)
    if n <= 9:
        cmap = colormaps["tab10"]
        table = [cmap(i) for i in range(10) if i != 7]
    elif n <= 18:
        cmap = colormaps["tab20"]
        table = [cmap(i) for i in range(20) if i not in (14, 15)]
    else:
        cmap = colormaps["turbo"]
        table = [cmap(0.05 + 0.9 * i / (n - 1)) for i in range(n)]
    return {r: tuple(table[i]) for i, r in enumerate(ranks)}


def ranks_label(ranks: Iterable[int]) -> str:
    """``0-3``, ``0,2``, ``1,4-6``: consecutive runs collapsed."""
    rs = sorted(ranks)
    runs: list[list[int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


# -- geometry: boxes of F as rectangles of the 2-D picture ----------------------------------------


@dataclass(frozen=True, slots=True)
class Rect:
    """``rows [r0, r0 + nr) x cols [c0, c0 + nc)`` of the drawn grid."""

    r0: int
    c0: int
    nr: int
    nc: int


def grid_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The drawn grid: 1-D F is one row, N-D F is ``shape[0]`` rows by the rest flattened."""
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], prod(shape[1:])


def _runs(axes: Sequence[tuple[int, int, int]], dims: Sequence[int]) -> list[tuple[int, int]] | None:
    """``(start, length)`` runs of the row-major flattening of a box of ``dims``; ``None`` when
    there would be more than ``MAX_RUNS``."""
    if not dims:
        return [(0, 1)]
    strides = [prod(tuple(dims[k + 1 :])) for k in range(len(dims))]
    j = len(dims)  # axes j.. are full and contiguous: they merge into one inner run
    while j > 0 and axes[j - 1] == (0, 1, dims[j - 1]):
        j -= 1
    if j == 0:
        return [(0, prod(tuple(dims)))]
    s, t, c = axes[j - 1]
    inner = strides[j - 1]
    last = [(s * inner, c * inner)] if t == 1 else [((s + i * t) * inner, inner) for i in range(c)]
    count = len(last) * prod(tuple(a[2] for a in axes[: j - 1]))
    if count > MAX_RUNS:
        return None
    starts = [0]
    for (s0, t0, c0), st in zip(axes[: j - 1], strides):
        starts = [b + (s0 + i * t0) * st for b in starts for i in range(c0)]
    return [(b + a, n) for b in starts for a, n in last]


def _envelope(runs_axes: Sequence[tuple[int, int, int]], dims: Sequence[int]) -> tuple[int, int]:
    strides = [prod(tuple(dims[k + 1 :])) for k in range(len(dims))]
    lo = sum(s * st for (s, _, _), st in zip(runs_axes, strides))
    hi = sum((s + (c - 1) * t) * st for (s, t, c), st in zip(runs_axes, strides)) + 1
    return lo, hi - lo


def box_rects(box: Box, shape: tuple[int, ...]) -> tuple[list[Rect], bool]:
    """A box of F as rectangles of the drawn grid, and whether it had to be approximated by its
    envelope (only boxes that would need more than ``MAX_RUNS`` rectangles are)."""
    if not shape:
        return [Rect(0, 0, 1, 1)], False
    if len(shape) == 1:
        runs = _runs(box, shape)
        if runs is None:
            lo, n = _envelope(box, shape)
            return [Rect(0, lo, 1, n)], True
        return [Rect(0, a, 1, n) for a, n in runs], False
    (s, t, c), rest = box[0], box[1:]
    rows = [(s, c)] if t == 1 or c == 1 else [(s + i * t, 1) for i in range(c)]
    cols = _runs(rest, shape[1:])
    if cols is None or len(rows) * len(cols) > MAX_RUNS:
        lo, n = _envelope(rest, shape[1:])
        return [Rect(s, lo, (c - 1) * t + 1, n)], True
    return [Rect(r0, c0, nr, nc) for r0, nr in rows for c0, nc in cols], False


@dataclass(frozen=True, slots=True)
class Region:
    """One drawn block: rectangles of the grid held by ``holders`` at ``scale``."""

    rects: tuple[Rect, ...]
    holders: tuple[int, ...]
    scale: float
    approx: bool


def map_regions(m: ParamMap) -> list[Region]:
    """Every piece of ``m`` as drawn blocks, a block shared by several ranks drawn once."""
    seen: set = set()
    out: list[Region] = []
    for _, _, p in m.pieces():
        if p.is_empty:
            continue
        for box in view_boxes(p.source, p.shape, m.logical_shape):
            key = (box, p.locations, p.scale)
            if key in seen:
                continue
            seen.add(key)
            rects, approx = box_rects(box, m.logical_shape)
            out.append(Region(tuple(rects), tuple(sorted(p.locations)), p.scale, approx))
    return out


def padding_rects(m: ParamMap) -> list[Rect]:
    """The region of F outside ``valid_shape``, as rectangles."""
    shape, valid = m.logical_shape, m.valid_shape
    out: list[Rect] = []
    for d in range(len(shape)):
        if valid[d] == shape[d]:
            continue
        axes = tuple((0, 1, valid[k]) if k < d else (0, 1, shape[k]) for k in range(len(shape)))
        axes = axes[:d] + ((valid[d], 1, shape[d] - valid[d]),) + axes[d + 1 :]
        if any(a[2] == 0 for a in axes):
            continue
        out += box_rects(axes, shape)[0]
    return out


# -- drawing a map --------------------------------------------------------------------------------


def _clip(poly: list[tuple[float, float]], a: float, b: float, c: float) -> list[tuple[float, float]]:
    """The convex polygon ``poly`` cut to the half-plane ``a*x + b*y <= c``."""
    out = []
    n = len(poly)
    for i in range(n):
        p, q = poly[i], poly[(i + 1) % n]
        fp, fq = a * p[0] + b * p[1] - c, a * q[0] + b * q[1] - c
        if fp <= 0:
            out.append(p)
        if (fp < 0 < fq) or (fq < 0 < fp):
            k = fp / (fp - fq)
            out.append((p[0] + k * (q[0] - p[0]), p[1] + k * (q[1] - p[1])))
    return out


def _stripes(r: Rect, holders: Sequence[int], kx: float, ky: float):
    """Diagonal stripes over a rectangle (data coordinates, x = column, y = row); ``kx``/``ky``
    are pixels per element, so stripes are ``STRIPE_PX`` wide whatever the shape of F. Stripe
    ``k`` of the whole picture has colour ``holders[k % len(holders)]``, so a block drawn twice
    looks the same."""
    x0, y0, x1, y1 = r.c0, r.r0, r.c0 + r.nc, r.r0 + r.nr
    rect = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    lo = math.floor((x0 * kx + y0 * ky) / STRIPE_PX)
    hi = math.ceil((x1 * kx + y1 * ky) / STRIPE_PX)
    for k in range(lo, hi):
        poly = _clip(rect, kx, ky, (k + 1) * STRIPE_PX)
        poly = _clip(poly, -kx, -ky, -k * STRIPE_PX)
        if len(poly) >= 3:
            yield poly, holders[k % len(holders)]


def _rect_poly(r: Rect) -> list[tuple[float, float]]:
    return [(r.c0, r.r0), (r.c0 + r.nc, r.r0), (r.c0 + r.nc, r.r0 + r.nr), (r.c0, r.r0 + r.nr)]


def _scale_text(s: float) -> str:
    if s != 0 and abs(1 / s - round(1 / s)) < 1e-12 and abs(round(1 / s)) > 1:
        return f"×1/{round(1 / s)}"
    return f"×{s:g}"


def _label(b: Region) -> str:
    text = "r" + ranks_label(b.holders)
    return text + (f" {_scale_text(b.scale)}" if b.scale != 1.0 else "")


def axes_rect(shape: tuple[int, ...]) -> tuple[float, float, float, float]:
    """Where :func:`draw_map` puts the axes of F (figure fraction: left, bottom, width, height)."""
    return AXES_RECT_1D if len(shape) <= 1 else AXES_RECT


def draw_map(m: ParamMap, path: str | Path, *, name: str, topology: str, note: str | None = None,
             rank_names: Mapping[int, str] | None = None, beside: tuple[str, ParamMap] | None = None) -> None:
    """Write a PNG of ``m`` (see the module docstring) to ``path``. ``rank_names`` labels ranks in
    the legend (default ``rank N``). ``beside``: a second map drawn to its right in the same
    colours (a block-scaled payload's scales, ``ir.blocks.coarsen``), titled with its name."""
    fig = _new_figure(MAP_PNG_SIZE)
    rect = full = axes_rect(m.logical_shape)
    ranks = sorted(set(m.ranks) | (set(beside[1].ranks) if beside else set()))
    colors = rank_colors(ranks)
    if beside is not None:  # the payload in the left 60 %, the scales in the right third of the map's width
        left, bottom, width, height = rect
        rect = (left, bottom, width * 0.58, height)
        side = (left + width * 0.66, bottom, width * 0.34, height)
        sb, spads, sscaled = _draw_on(fig, side, beside[1], colors)
        fig.text(side[0], side[1] + side[3] + 0.012, f"{beside[0]} {list(beside[1].logical_shape)}", fontsize=10,
                 ha="left", va="bottom")
    blocks, pads, scaled = _draw_on(fig, rect, m, colors)
    if beside is not None:
        blocks, pads, scaled = blocks + sb, pads + spads, scaled or sscaled
    _legend(fig, full, colors, blocks, bool(pads), scaled, rank_names or {})
    shape_txt = f"F {list(m.logical_shape)}"
    if m.is_padded:
        shape_txt += f", valid {list(m.valid_shape)}"
    fig.text(AXES_RECT[0], 0.955, name, fontsize=13, weight="bold", ha="left", va="center")
    n = len(m.ranks)
    fig.text(AXES_RECT[0], 0.915, f"{shape_txt} · {topology} · {n} rank{'s' * (n != 1)} · {m.num_pieces} pieces",
             fontsize=11, ha="left", va="center")
    notes = [n for n in (note, _flatten_note(m.logical_shape), _approx_note(blocks)) if n]
    if notes:
        fig.text(AXES_RECT[0], 0.015, "  ".join(notes), fontsize=9, ha="left", va="bottom", color="#444444")
    _save(fig, path)


def _draw_on(fig, rect: tuple[float, float, float, float], m: ParamMap,
             colors: Mapping[int, tuple]) -> tuple[list[Region], list[Rect], bool]:
    """``m`` drawn in new axes at ``rect``: its regions, its padding and whether a piece is scaled."""
    from matplotlib.collections import PolyCollection

    rows, cols = grid_shape(m.logical_shape)
    ax = fig.add_axes(rect)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)  # row 0 at the top, like a printed matrix
    ax.set_facecolor("white")
    kx = rect[2] * MAP_PNG_SIZE[0] / cols  # pixels per element
    ky = rect[3] * MAP_PNG_SIZE[1] / rows
    blocks = map_regions(m)

    fill, fill_c, stripe, stripe_c = [], [], [], []
    for b in blocks:
        for r in b.rects:
            fill.append(_rect_poly(r))
            fill_c.append(colors[b.holders[0]])
            if len(b.holders) > 1:
                for poly, h in _stripes(r, b.holders, kx, ky):
                    stripe.append(poly)
                    stripe_c.append(colors[h])
    ax.add_collection(PolyCollection(fill, facecolors=fill_c, edgecolors="none", antialiased=False))
    if stripe:
        ax.add_collection(PolyCollection(stripe, facecolors=stripe_c, edgecolors="none", antialiased=False))
    outlines = [_rect_poly(r) for b in blocks for r in b.rects if r.nc * kx >= 4 and r.nr * ky >= 4]
    if outlines and len(outlines) <= 20000:
        ax.add_collection(PolyCollection(outlines, facecolors="none", edgecolors="white", linewidths=1.0))
    pads = padding_rects(m)
    if pads:
        ax.add_collection(PolyCollection([_rect_poly(r) for r in pads], facecolors=PAD_COLOR, alpha=0.85,
                                         edgecolors="#555555", linewidths=0.6, hatch="xx"))
    scaled = _annotate(ax, blocks, kx, ky)
    _axes_labels(ax, m.logical_shape)
    return blocks, pads, scaled


def _annotate(ax, blocks: list[Region], kx: float, ky: float) -> bool:
    """Label blocks big enough to hold a label with their holders (and scale); mark scaled blocks
    too small for a label with a star. Returns whether any block is scaled."""
    labels = 0
    stars_x, stars_y = [], []
    scaled = False
    for b in blocks:
        r = max(b.rects, key=lambda r: r.nr * r.nc)
        cx, cy = r.c0 + r.nc / 2, r.r0 + r.nr / 2
        text = _label(b)
        scaled |= b.scale != 1.0
        if labels < MAX_LABELS and r.nc * kx >= 7.5 * len(text) + 8 and r.nr * ky >= 18:
            ax.text(cx, cy, text, ha="center", va="center", fontsize=9,
                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.85, "linewidth": 0})
            labels += 1
        elif b.scale != 1.0:
            stars_x.append(cx)
            stars_y.append(cy)
    if stars_x:
        ax.scatter(stars_x, stars_y, marker="*", s=60, c="black", edgecolors="white", linewidths=0.5, zorder=5)
    return scaled


def _axes_labels(ax, shape: tuple[int, ...]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    if len(shape) <= 1:
        ax.set_xlabel("element of F (1-D, drawn as one row)")
        ax.set_yticks([])
    elif len(shape) == 2:
        ax.set_xlabel("column of F (elements)")
        ax.set_ylabel("row of F (elements)")
    else:
        ax.set_xlabel(f"dims 1..{len(shape) - 1} of F, flattened (elements)")
        ax.set_ylabel("dim 0 of F (elements)")


def _flatten_note(shape: tuple[int, ...]) -> str | None:
    if len(shape) <= 2:
        return None
    rows, cols = grid_shape(shape)
    return f"F is {len(shape)}-D {list(shape)}: drawn as {rows} × {cols} (dims 1..{len(shape) - 1} flattened)."


def _approx_note(blocks: list[Region]) -> str | None:
    if any(b.approx for b in blocks):
        return "Some strided blocks are drawn as their envelope (too many runs to draw one by one)."
    return None


def _legend(fig, rect: tuple[float, float, float, float], colors: Mapping[int, tuple], blocks: list[Region],
            padded: bool, scaled: bool, names: Mapping[int, str]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = []
    ranks = sorted(colors)
    shown = ranks if len(ranks) <= 24 else ranks[:: max(1, len(ranks) // 12)]
    for r in shown:
        handles.append(Patch(facecolor=colors[r], label=names.get(r, f"rank {r}")))
    if len(shown) < len(ranks):
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"... {len(ranks)} ranks in all"))
    multi = next((b for b in blocks if len(b.holders) > 1), None)
    if multi is not None:
        a, b = colors[multi.holders[0]], colors[multi.holders[1]]
        handles.append(Patch(facecolor=a, edgecolor=b, hatch="////", label="several holders: striped,\n"
                             "one stripe colour per rank"))
    if padded:
        handles.append(Patch(facecolor=PAD_COLOR, edgecolor="#555555", hatch="xx",
                             label="padding (outside valid_shape)"))
    if scaled:
        handles.append(Line2D([], [], marker="*", color="black", linestyle="none", markersize=10,
                              label="scaled piece: shard = F × s\n(labelled ×s where it fits)"))
    x = rect[0] + rect[2] + 0.02
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(x, rect[1] + rect[3]),
               frameon=False, fontsize=10, handleheight=1.4)


# -- drawing a plan -------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def draw_plan(matrix: Sequence[Sequence[int]], source_ranks: Sequence[int], target_ranks: Sequence[int],
              path: str | Path, *, title: str, subtitle: str = "") -> None:
    """Heat map of bytes moved: ``matrix[i][j]`` bytes from ``source_ranks[i]`` to
    ``target_ranks[j]``; cells where source and target are the same rank (local copies) are
    outlined, every cell is annotated when the matrix is small enough to read."""
    fig = _new_figure(PLAN_PNG_SIZE)
    import numpy as np
    from matplotlib.patches import Rectangle

    data = np.asarray(matrix, dtype=float).reshape(len(source_ranks), len(target_ranks))
    ax = fig.add_axes((0.12, 0.08, 0.68, 0.76))
    im = ax.imshow(data, cmap="Blues", aspect="auto", vmin=0, vmax=max(float(data.max()), 1.0),
                   interpolation="nearest")
    from matplotlib.ticker import FuncFormatter

    cb = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.03, format=FuncFormatter(lambda v, _: human_bytes(v)))
    cb.set_label("bytes")
    ax.set_xlabel("target rank")
    ax.set_ylabel("source rank")
    _rank_ticks(ax.set_xticks, ax.set_xticklabels, target_ranks)
    _rank_ticks(ax.set_yticks, ax.set_yticklabels, source_ranks)
    col = {r: j for j, r in enumerate(target_ranks)}
    for i, r in enumerate(source_ranks):
        if r in col:
            ax.add_patch(Rectangle((col[r] - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#d62728", linewidth=2))
    if data.shape[0] <= 16 and data.shape[1] <= 16:
        top = data.max() or 1.0
        for i in range(data.shape[0]):
            for j in range(data.shape[1]):
                v = data[i, j]
                ax.text(j, i, human_bytes(v), ha="center", va="center", fontsize=10,
                        color="white" if v > 0.6 * top else "black")
    fig.text(0.12, 0.955, title, fontsize=13, weight="bold", ha="left", va="center")
    if subtitle:
        fig.text(0.12, 0.918, subtitle, fontsize=10, ha="left", va="center")
    fig.text(0.12, 0.885, "rows send, columns receive; red outline: local copy (source rank = target rank)",
             fontsize=10, ha="left", va="center", color="#444444")
    _save(fig, path)


def _rank_ticks(set_ticks, set_labels, ranks: Sequence[int]) -> None:
    step = max(1, math.ceil(len(ranks) / 32))
    idx = list(range(0, len(ranks), step))
    set_ticks(idx)
    set_labels([str(ranks[i]) for i in idx])

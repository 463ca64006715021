"""A recovery timeline as a PNG, drawn from a journal alone.

The journal is the only input (through a ``Ledger``): no controller, runtime or clock is
consulted, so a journal copied off a production run draws exactly the way the demo's does,
and a picture can always be redrawn from the file an incident left behind. It uses
matplotlib's object API on the Agg canvas, never pyplot: no global state, no window, safe
from any thread.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .. import Label
from ..errors import RecoveryError
from . import palette
from .ledger import Ledger

ROW_IN = 0.5  # height of one row, inches
_LEFT_IN, _RIGHT_IN = 1.3, 0.3  # row names; air
_TOP_IN, _BOTTOM_IN = 0.6, 1.0  # title and sync labels; axis and legend
MARGINS_IN = _TOP_IN + _BOTTOM_IN
_LABEL_GAP_IN = 0.35  # a sync label closer than this to the next labelled one is left out
_SYNC_COLOR = "#555555"

# A group's rows: the colours and legend of every group state (``palette``), in legend order.
GROUP_SWATCHES = palette.of(Label.GROUP)
STATE_COLORS = {state: s.hex for state, s in GROUP_SWATCHES.items()}
EXPORT_COLORS = {
    "committed": "#6a51a3",
    "running": "#bcbddc",
    "failed": "#d62728",
    "cancelled": "#969696",
}
EXPORTS = "exports"


class NothingToDraw(RecoveryError, ValueError):
    """The journal holds no accepted event (only a header, refusals, or nothing)."""


@attrs.frozen
class TimelineInfo:
    path: Path
    rows: tuple[str, ...]  # top to bottom: the groups by first appearance, then "exports"
    size: tuple[int, int]  # (width, height) of the PNG in pixels
    legend: tuple[str, ...] = ()  # the legend's entries, in order


def draw(
    source: Ledger | str | os.PathLike[str],
    out_png: str | os.PathLike[str],
    *,
    title: str | None = None,
    width_in: float = 12.0,
    dpi: int = 100,
) -> TimelineInfo:
    """Draw one row per group (its states over time) and one of exports, with weight syncs,
    failures (x) and admissions (^) marked; write it to ``out_png``."""
    ledger = source if isinstance(source, Ledger) else Ledger.read(Path(source))
    t0, t1 = ledger.first_at, ledger.last_at
    if t0 is None or t1 is None:
        where = "" if isinstance(source, Ledger) else f" {os.fspath(source)}"
        raise NothingToDraw(f"the journal{where} records no event: nothing to draw")
    first_seen: dict[str, float] = {}
    for s in ledger.spans():  # by group, then time
        first_seen.setdefault(s.group, s.start)
    groups = sorted(first_seen, key=lambda g: (first_seen[g], g))
    rows = (*groups, EXPORTS)
    y = {name: i for i, name in enumerate(rows)}

    # Whole pixels (plus a hair, as Agg truncates), so the PNG is exactly the size we say.
    height_in = len(rows) * ROW_IN + MARGINS_IN
    px = (round(width_in * dpi), round(height_in * dpi))
    fig = Figure(figsize=((px[0] + 1e-3) / dpi, (px[1] + 1e-3) / dpi), dpi=dpi)
    canvas = FigureCanvasAgg(fig)  # Agg, whatever pyplot's backend is
    plot_w = width_in - _LEFT_IN - _RIGHT_IN
    plot_h = len(rows) * ROW_IN
    ax = fig.add_axes((_LEFT_IN / width_in, _BOTTOM_IN / height_in, plot_w / width_in,
                       plot_h / height_in))  # fmt: skip
    span_s = max(t1 - t0, 1e-9)
    ax.set_xlim(-0.01 * span_s, 1.02 * span_s)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("seconds since the first event")
    ax.grid(axis="x", color="#e5e5e5", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.axhline(len(groups) - 0.5, color="#999999", linewidth=0.8)

    drawn = set()
    for s in ledger.spans(until=t1):
        if s.end is not None and s.end > s.start:  # a pass-through state has no width
            drawn.add(s.state)
            ax.broken_barh([(s.start - t0, s.end - s.start)], (y[s.group] - 0.3, 0.6),
                           facecolors=STATE_COLORS.get(s.state, "white"))  # fmt: skip
    visible_s = 0.04 * span_s / plot_w  # an export of a few milliseconds is still drawn
    for e in ledger.exports:
        end = max(e.start, t1 if e.end is None else e.end)  # a live ledger may run ahead
        ax.broken_barh([(e.start - t0, max(end - e.start, visible_s))], (y[EXPORTS] - 0.3, 0.6),
                       facecolors=EXPORT_COLORS.get(e.outcome, "white"), edgecolors="white",
                       linewidth=0.6)  # fmt: skip
        if (end - e.start) / span_s * plot_w > 0.3:  # room for its version
            ax.text((e.start + end) / 2 - t0, y[EXPORTS], f"v{e.version}", ha="center",
                    va="center", fontsize=7, color="white")  # fmt: skip
    _syncs(ax, [(at - t0, v) for at, v in ledger.syncs], _LABEL_GAP_IN * span_s / plot_w)

    handles: list[Artist] = [
        *(Patch(color=s.hex, label=s.legend) for k, s in GROUP_SWATCHES.items() if k in drawn),
        *(Patch(color=c, label=f"export {k}") for k, c in EXPORT_COLORS.items()
          if any(e.outcome == k for e in ledger.exports)),
    ]  # fmt: skip
    if ledger.syncs:
        handles.append(Line2D([], [], color=_SYNC_COLOR, linewidth=0.8, linestyle="--",
                              label="weight sync"))  # fmt: skip
    crashes = [(m.at - t0, y[m.group]) for m in ledger.crashes]
    admissions = [(m.at - t0, y[m.group]) for m in ledger.admissions]
    if crashes:
        handles.append(_points(ax, crashes, "failure", marker="x", color="#a50f15", edge=2.0))
    if admissions:
        handles.append(_points(ax, admissions, "admitted (traffic routed)", marker="^",
                               color="black", edge=0.8))  # fmt: skip
    if handles:  # none when every state so far has no width
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8),
                   frameon=False, fontsize=8)  # fmt: skip
    summary = (f"{len(groups)} groups, {len(ledger.syncs)} syncs, {len(ledger.crashes)} failures, "
               f"{len(ledger.recoveries)} recoveries")  # fmt: skip
    ax.set_title(title or "recovery timeline", loc="left", fontsize=11, fontweight="bold", pad=16)
    ax.set_title(summary, loc="right", fontsize=9, color="#555555", pad=16)

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, format="png")
    legend = tuple(str(h.get_label()) for h in handles)
    return TimelineInfo(out, rows, canvas.get_width_height(physical=True), legend)


def _syncs(ax: Axes, syncs: list[tuple[float, int]], min_gap_s: float) -> None:
    """A thin line per sync across every row; the labels above the plot are thinned so that
    none overlaps (the last sync always keeps its label)."""
    labelled: list[tuple[float, int]] = []
    for x, v in reversed(syncs):
        ax.axvline(x, color=_SYNC_COLOR, linewidth=0.8, linestyle="--", zorder=3)
        if not labelled or labelled[-1][0] - x >= min_gap_s:
            labelled.append((x, v))
    for x, v in labelled:
        ax.text(x, 1.01, f"v{v}", transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=7, color="#333333")  # fmt: skip


def _points(
    ax: Axes, xy: list[tuple[float, int]], label: str, *, marker: str, color: str, edge: float
) -> Line2D:
    """Markers on the rows (an x in its own colour, a filled one edged in white)."""
    xs, ys = zip(*xy, strict=True)
    return ax.add_line(Line2D(xs, ys, label=label, linestyle="none", marker=marker, color=color,
                              markeredgecolor=color if marker == "x" else "white",
                              markersize=8, markeredgewidth=edge, zorder=4))  # fmt: skip

"""Line charts: one or more panels stacked, each with its own axes and its legend beside it.

A panel's legend sits to the right of its plot area, never on the data; panels share the
width, so their x axes line up. Series with few points get markers, so one evaluation (a run
shorter than an epoch) is a visible point, not a line of length zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tinyconv.lab.plot.svg import (
    LABEL_FONT,
    TICK_FONT,
    Doc,
    Entry,
    Scale,
    legend,
    legend_width,
    log2_ticks,
    nice_ticks,
    text_width,
    tick_label,
    title,
)

PLOT_W, PLOT_H = 480, 240
MARKERS_UP_TO = 40  # points: a series with more is drawn as a line only


@dataclass
class Series:
    """Points (x, y) of one named series; ``role`` says what it is: ``data``, ``paper`` (values from
    the paper, drawn as hollow diamonds), ``ideal`` (a dashed reference line) or ``band`` (a filled
    area whose outline the points trace: a stacked share's top edge forward, its bottom edge back)."""

    name: str
    points: list[tuple[float, float]]
    color: str
    dash: bool = False
    markers: bool | None = None  # None: markers when there are few points
    line: bool = True
    role: str = "data"
    width: float = 2.0

    def finite(self) -> list[tuple[float, float]]:
        return [(x, y) for x, y in self.points if _finite(x) and _finite(y)]

    def entry(self) -> Entry:
        if self.role in ("paper", "band"):
            return Entry(self.name, self.color, "hollow" if self.role == "paper" else "box")
        if not self.line:
            return Entry(self.name, self.color, "marker")
        return Entry(self.name, self.color, "dash" if self.dash else "line")


@dataclass
class Panel:
    """One plot area: its series, axis labels and scales. ``yfrom0``: the y axis starts at 0; else it spans
    the data, with a twentieth of its range to spare each side (a speedup of 1.5 to 2.0 fills the panel)."""

    series: list[Series]
    xlabel: str
    ylabel: str
    xlog: bool = False
    ylog: bool = False
    yfrom0: bool = True
    yformat: Callable[[float, Sequence[float]], str] = tick_label
    xformat: Callable[[float, Sequence[float]], str] = tick_label
    caption: str = ""  # above the plot area: what sets this panel apart from the others
    xinteger: bool = False  # x values are counts: no tick between two whole numbers
    extra_y: list[float] = field(default_factory=list)  # values the y axis must reach (an ideal line)


def _finite(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def line_chart(title_text: str, panels: Sequence[Panel]) -> str:
    """Panels stacked top to bottom under a title, each with its legend on its right; the SVG text."""
    ticks = [_ticks(p) for p in panels]
    left = 34 + max(
        max((text_width(p.yformat(v, yt), TICK_FONT) for v in yt), default=0)
        for p, (_, yt) in zip(panels, ticks, strict=True)
    )
    legend_w = max((legend_width([s.entry() for s in p.series]) for p in panels), default=0)
    width = left + PLOT_W + 24 + legend_w + 12
    doc = Doc()
    top = title(doc, title_text, width)
    for p, (xt, yt) in zip(panels, ticks, strict=True):
        entries = [s.entry() for s in p.series]
        if p.caption:
            doc.text(left, top + LABEL_FONT, p.caption, LABEL_FONT, cls="caption", bold=True)
            top += LABEL_FONT + 14
        height = max(PLOT_H, 16 * len(entries) + 8)
        _panel(doc, p, xt, yt, left, top, height)
        legend(doc, left + PLOT_W + 24, top, entries)
        top += height + 22 + TICK_FONT + LABEL_FONT + 18
    return doc.render(width, top)


def _ticks(p: Panel) -> tuple[list[float], list[float]]:
    xs = [x for s in p.series for x, _ in s.finite()] or [1.0]
    ys = [y for s in p.series for _, y in s.finite()] + p.extra_y or [1.0]
    if p.xlog:
        xt = log2_ticks(min(xs), max(xs))
    else:
        xt = _x_ticks(min(xs), max(xs), p.xformat, p.xinteger)
    if p.ylog:
        yt = log2_ticks(min(ys), max(ys))
    elif p.yfrom0:
        yt = nice_ticks(min(0.0, min(ys)), max(ys), 5)
    else:  # room each side, so no point sits on the frame; not below 0 for data that is not
        pad = (max(ys) - min(ys)) / 20 or abs(max(ys)) / 20
        yt = nice_ticks(max(min(ys) - pad, 0.0) if min(ys) >= 0 else min(ys) - pad, max(ys) + pad, 5)
    return xt, yt


def _x_ticks(lo: float, hi: float, fmt: Callable[[float, Sequence[float]], str], integer: bool) -> list[float]:
    """Round x ticks, fewer of them until their labels fit side by side (with a gap) under the plot."""
    for count in (6, 4, 3, 2):
        ticks = nice_ticks(lo, hi, count)
        if integer and ticks[1] - ticks[0] < 1:
            ticks = [float(v) for v in range(math.floor(lo), math.ceil(hi) + 1)]
        widest = max(text_width(fmt(v, ticks), TICK_FONT) for v in ticks)
        if widest + 8 <= PLOT_W / max(1, len(ticks) - 1):
            break
    return ticks


def _panel(doc: Doc, p: Panel, xt: list[float], yt: list[float], left: float, top: float, height: float) -> None:
    """Axes, ticks, grid and series of one panel in the box (left, top, PLOT_W, height)."""
    pad = 2**0.25 if p.xlog else 0  # log axes: half a step's room, so no marker sits on an axis
    sx = Scale(xt[0] / pad if pad else xt[0], xt[-1] * pad if pad else xt[-1], left, left + PLOT_W, p.xlog)
    ypad = 2**0.25 if p.ylog else 0
    sy = Scale(yt[0] / ypad if ypad else yt[0], yt[-1] * ypad if ypad else yt[-1], top + height, top, p.ylog)
    bottom = top + height
    doc.open("axes", ylabel=p.ylabel, xlabel=p.xlabel)
    for v in yt:
        doc.line(left, sy(v), left + PLOT_W, sy(v), "#e4e4e4")
        doc.text(left - 6, sy(v) + TICK_FONT * 0.35, p.yformat(v, yt), TICK_FONT, "end", cls="tick y")
    for v in xt:
        doc.line(sx(v), bottom, sx(v), bottom + 4)
        doc.text(sx(v), bottom + 6 + TICK_FONT, p.xformat(v, xt), TICK_FONT, "middle", cls="tick x")
    doc.line(left, bottom, left + PLOT_W, bottom)
    doc.line(left, bottom, left, top)
    doc.text(left + PLOT_W / 2, bottom + 14 + TICK_FONT + LABEL_FONT, p.xlabel, LABEL_FONT, "middle", cls="label")
    widest = max(text_width(p.yformat(v, yt), TICK_FONT) for v in yt)
    doc.text(left - 14 - widest, top + height / 2, p.ylabel, LABEL_FONT, "middle", cls="label", rotate=-90)
    doc.close()
    for s in p.series:
        _series(doc, s, sx, sy)


def _series(doc: Doc, s: Series, sx: Scale, sy: Scale) -> None:
    pts = [(sx(x), sy(y)) for x, y in s.finite()]
    doc.open("series", name=s.name, color=s.color, role=s.role)
    if s.role == "band":
        doc.area(pts, s.color, s.name)
    elif s.line and len(pts) > 1:
        doc.polyline(pts, s.color, s.width if s.role == "data" else 1.5, "5,3" if s.dash else "")
    markers = s.markers if s.markers is not None else (len(pts) <= MARKERS_UP_TO or not s.line)
    if s.role != "band" and (markers or len(pts) == 1):
        for x, y in pts:
            doc.marker(x, y, s.color, "diamond" if s.role == "paper" else "circle", hollow=s.role == "paper")
    doc.close()


def percent(value: float, ticks: Sequence[float]) -> str:
    """A fraction's tick as a percentage: 0.25 -> 25%."""
    return tick_label(value * 100, [t * 100 for t in ticks]) + "%"

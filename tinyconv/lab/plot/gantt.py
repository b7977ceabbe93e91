"""Gantt bars: a lane per participant, spans along a time axis, panels stacked under a title.

A span's kind picks its colour and legend entry; marks over the lanes name stretches of the axis
(an op: "conv1 fwd") where their names fit, with a dotted line at each one's start. Lanes' names
sit left of the plot, the legend right of it, as in the line charts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tinyconv.lab.plot.svg import (
    LABEL_FONT,
    TICK_FONT,
    Doc,
    Entry,
    Scale,
    legend,
    legend_width,
    nice_ticks,
    text_width,
    tick_label,
    title,
)

PLOT_W, LANE_H, SPAN_H = 560, 22, 14


@dataclass
class Span:
    """``length`` seconds of ``kind`` from ``start``, with a tooltip."""

    start: float
    length: float
    kind: str
    tip: str = ""


@dataclass
class Lanes:
    """One panel: a lane of spans per name, top to bottom, and named stretches (start, length, name)."""

    caption: str
    lanes: dict[str, list[Span]]
    marks: list[tuple[float, float, str]] = field(default_factory=list)


def gantt(title_text: str, xlabel: str, panels: Sequence[Lanes], kinds: Sequence[tuple[str, str, str]]) -> str:
    """``kinds``: (a span's kind, legend label, colour). The SVG text."""
    entries = [Entry(label, color, "box") for _, label, color in kinds]
    names = [n for p in panels for n in p.lanes]
    left = 24 + max((text_width(n, TICK_FONT) for n in names), default=0)
    width = left + PLOT_W + 24 + legend_width(entries) + 12
    doc = Doc()
    top = title(doc, title_text, width)
    for i, p in enumerate(panels):
        doc.text(left, top + LABEL_FONT, p.caption, LABEL_FONT, cls="caption", bold=True)
        top += LABEL_FONT + 8
        if i == 0:
            legend(doc, left + PLOT_W + 24, top, entries)
        bottom = _panel(doc, p, left, top, {k: c for k, _, c in kinds}, xlabel)
        top = max(bottom, top + 16 * len(entries) + 8 if i == 0 else 0) + 18
    return doc.render(width, top)


def _panel(doc: Doc, p: Lanes, left: float, top: float, colors: dict[str, str], xlabel: str) -> float:
    """Marks, lanes and the time axis from ``top`` down; returns the panel's bottom."""
    end = max((s.start + s.length for spans in p.lanes.values() for s in spans), default=1.0)
    xt = nice_ticks(0.0, end, 5)
    sx = Scale(xt[0], xt[-1], left, left + PLOT_W)
    lanes_top = top + TICK_FONT + 6  # the marks' names above the lanes
    bottom = lanes_top + LANE_H * len(p.lanes)
    doc.open("marks")
    for start, length, name in p.marks:
        doc.line(sx(start), lanes_top, sx(start), bottom, "#bbbbbb", 1, "2,2")
        if text_width(name, TICK_FONT - 1) + 4 <= sx(start + length) - sx(start):
            doc.text(sx(start + length / 2), lanes_top - 4, name, TICK_FONT - 1, "middle", cls="mark")
    doc.close()
    for row, (name, spans) in enumerate(p.lanes.items()):
        y = lanes_top + LANE_H * row + (LANE_H - SPAN_H) / 2
        doc.open("lane", name=name)
        doc.text(left - 6, y + SPAN_H / 2 + TICK_FONT * 0.35, name, TICK_FONT, "end", cls="lane")
        for s in spans:
            if s.length > 0:
                doc.rect(sx(s.start), y, sx(s.start + s.length) - sx(s.start), SPAN_H, colors[s.kind], s.tip)
        doc.close()
    doc.open("axes", ylabel="", xlabel=xlabel)
    doc.line(left, bottom, left + PLOT_W, bottom)
    for v in xt:
        doc.line(sx(v), bottom, sx(v), bottom + 4)
        doc.text(sx(v), bottom + 6 + TICK_FONT, tick_label(v, xt), TICK_FONT, "middle", cls="tick x")
    doc.text(left + PLOT_W / 2, bottom + 14 + TICK_FONT + LABEL_FONT, xlabel, LABEL_FONT, "middle", cls="label")
    doc.close()
    return bottom + 14 + TICK_FONT + LABEL_FONT

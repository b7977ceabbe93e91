"""Stacked bars in labelled groups: the paper's Fig. 6, comm / conv / comp per configuration.

Each bar is as wide as its own label needs, each group as wide as the longest word of its
label (which wraps onto lines under it): labels are laid out side by side, never on top of
each other, however many bars there are -- the chart grows wider instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tinyconv.lab.plot.lines import PLOT_H
from tinyconv.lab.plot.svg import (
    LABEL_FONT,
    TICK_FONT,
    Doc,
    Entry,
    Scale,
    abbreviate,
    legend,
    legend_width,
    nice_ticks,
    text_width,
    tick_label,
    title,
    wrap,
)

BAR_W, GROUP_GAP = 22, 18


@dataclass
class Bar:
    """One bar: a short label under it, its parts' values stacked bottom-up, a tooltip."""

    label: str
    parts: dict[str, float]
    tip: str = ""


@dataclass
class Group:
    """Bars side by side with one label under all of them (wrapped at spaces)."""

    label: str
    bars: list[Bar]


def _slot(bar: Bar) -> float:
    return max(BAR_W + 8, text_width(bar.label, TICK_FONT) + 8)


def _group_width(g: Group) -> float:
    label = abbreviate(g.label)
    words = max((text_width(w, TICK_FONT) for w in label.split()), default=0)
    short = min(text_width(label, TICK_FONT), 120)  # a short label on one line, a long one wrapped
    return max(sum(_slot(b) for b in g.bars), words + 8, short + 8)


def stacked_bars(title_text: str, ylabel: str, groups: Sequence[Group], parts: Sequence[tuple[str, str, str]]) -> str:
    """``parts``: (key in each bar's ``parts``, legend label, colour), bottom-up. The SVG text."""
    totals = [sum(b.parts.get(k, 0.0) for k, _, _ in parts) for g in groups for b in g.bars] or [1.0]
    yt = nice_ticks(0.0, max(totals) * 1.12 or 1.0, 5)  # room above the tallest bar for its total
    left = 34 + max(text_width(tick_label(v, yt), TICK_FONT) for v in yt)
    widths = [_group_width(g) for g in groups]
    plot_w = max(320.0, sum(widths) + GROUP_GAP * (len(groups) + 1))
    entries = [Entry(label, color, "box") for _, label, color in reversed(parts)]  # top part first, as stacked
    width = left + plot_w + 24 + legend_width(entries) + 12
    doc = Doc()
    top = title(doc, title_text, width)
    sy = Scale(yt[0], yt[-1], top + PLOT_H, top)
    _axes(doc, yt, sy, left, top, plot_w, ylabel)
    label_lines = max(
        (len(wrap(abbreviate(g.label), w, TICK_FONT)) for g, w in zip(groups, widths, strict=True)), default=0
    )
    x = left + (plot_w - sum(widths) - GROUP_GAP * (len(groups) - 1)) / 2  # centred
    for g, w in zip(groups, widths, strict=True):
        _group(doc, g, x, w, sy, parts)
        x += w + GROUP_GAP
    legend(doc, left + plot_w + 24, top, entries)
    height = top + PLOT_H + 14 + (TICK_FONT + 3) * (label_lines + 1) + 10
    return doc.render(width, max(height, top + 16 * len(entries) + 10))


def _axes(doc: Doc, yt: list[float], sy: Scale, left: float, top: float, plot_w: float, ylabel: str) -> None:
    doc.open("axes", ylabel=ylabel, xlabel="")
    for v in yt:
        doc.line(left, sy(v), left + plot_w, sy(v), "#e4e4e4")
        doc.text(left - 6, sy(v) + TICK_FONT * 0.35, tick_label(v, yt), TICK_FONT, "end", cls="tick y")
    doc.line(left, top + PLOT_H, left + plot_w, top + PLOT_H)
    doc.line(left, top + PLOT_H, left, top)
    widest = max(text_width(tick_label(v, yt), TICK_FONT) for v in yt)
    doc.text(left - 14 - widest, top + PLOT_H / 2, ylabel, LABEL_FONT, "middle", cls="label", rotate=-90)
    doc.close()


def _group(doc: Doc, g: Group, x: float, width: float, sy: Scale, parts: Sequence[tuple[str, str, str]]) -> None:
    """The group's bars, centred in its width, their labels under them and the group's label lowest."""
    base_y = sy(0.0)
    bx = x + (width - sum(_slot(b) for b in g.bars)) / 2
    doc.open("group", label=g.label)
    for bar in g.bars:
        slot = _slot(bar)
        cx = bx + slot / 2
        total = 0.0
        for key, label, color in parts:
            value = bar.parts.get(key, 0.0)
            if value > 0:
                y0, y1 = sy(total), sy(total + value)
                doc.rect(cx - BAR_W / 2, y1, BAR_W, y0 - y1, color, f"{bar.tip or g.label}: {label} {value:.3g} s")
            total += value
        tag = f"{total:.2g}" if total < 10 else f"{total:.0f}"
        if text_width(tag, TICK_FONT - 1) + 2 <= slot:  # the total above the bar, where it fits
            doc.text(cx, sy(total) - 4, tag, TICK_FONT - 1, "middle", cls="total")
        if bar.label:
            doc.text(cx, base_y + 6 + TICK_FONT, bar.label, TICK_FONT, "middle", cls="tick x")
        bx += slot
    first = base_y + 6 + TICK_FONT + (TICK_FONT + 3 if any(b.label for b in g.bars) else 0)
    for i, line in enumerate(wrap(abbreviate(g.label), width, TICK_FONT)):
        doc.text(x + width / 2, first + (TICK_FONT + 3) * i, line, TICK_FONT, "middle", cls="group")
    doc.close()

"""Stacked bars in labelled groups: the paper's Fig. 6, comm / conv / comp per configuration.

Two kinds: :func:`stacked_bars` stacks the values themselves (seconds, megabytes) on one axis;
:func:`share_bars` stacks each bar to 100 %, its parts as shares of its total and the total written
above it, in rows of about ROW_W px -- so a 2 % communication slice stays visible beside a bar
a hundred times taller, and twenty groups make three rows, not a 2,600 px strip.

Each bar is as wide as its own labels need, each group as wide as the longest word of its
label (which wraps onto lines under it): labels are laid out side by side, never on top of
each other. No part above zero is drawn thinner than MIN_SLICE px.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tinyconv.lab.plot.lines import PLOT_H, percent
from tinyconv.lab.plot.svg import (
    LABEL_FONT,
    ROW,
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

BAR_W, GROUP_GAP = 24, 18
ROW_W, SHARE_H = 900, 180  # px: a chart of shares wraps its groups at this width; the height of a row's axis
MIN_SLICE = 2.0  # px: the least a part above zero is drawn (a 0.5 % comm slice still shows), off the largest part
SHARE_FONT = 9  # the shares written inside their slices, where they fit


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


def _values(bar: Bar, parts: Sequence[tuple[str, str, str]]) -> list[float]:
    """The bar's parts bottom-up, a negative one (a rest computed as a difference, in rounding) as 0."""
    return [max(0.0, bar.parts.get(k) or 0.0) for k, _, _ in parts]


def _total(bar: Bar, parts: Sequence[tuple[str, str, str]]) -> float:
    return sum(_values(bar, parts))


def seconds(value: float) -> str:
    """A step time as a person reads it: "59 s", "4.2 s", "0.38 s", "0.0076 s"."""
    return f"{value:.0f} s" if value >= 10 else f"{value:.2g} s"


def _slot(bar: Bar, tag: str = "") -> float:
    """The bar's width with room either side: for its label under it and, in a chart of shares, its total above."""
    return max(BAR_W + 8, text_width(bar.label, TICK_FONT) + 8, text_width(tag, TICK_FONT - 1) + 6)


def _group_width(g: Group, tags: Sequence[str]) -> float:
    label = abbreviate(g.label)
    words = max((text_width(w, TICK_FONT) for w in label.split()), default=0)
    short = min(text_width(label, TICK_FONT), 120)  # a short label on one line, a long one wrapped
    return max(sum(_slot(b, t) for b, t in zip(g.bars, tags, strict=True)), words + 8, short + 8)


def stacked_bars(title_text: str, ylabel: str, groups: Sequence[Group], parts: Sequence[tuple[str, str, str]]) -> str:
    """``parts``: (key in each bar's ``parts``, legend label, colour), bottom-up. The SVG text."""
    totals = [_total(b, parts) for g in groups for b in g.bars] or [1.0]
    yt = nice_ticks(0.0, max(totals) * 1.12 or 1.0, 5)  # room above the tallest bar for its total
    left = 34 + max(text_width(tick_label(v, yt), TICK_FONT) for v in yt)
    tags = [["" for _ in g.bars] for g in groups]
    widths = [_group_width(g, t) for g, t in zip(groups, tags, strict=True)]
    plot_w = max(320.0, sum(widths) + GROUP_GAP * (len(groups) + 1))
    entries = [Entry(label, color, "box") for _, label, color in reversed(parts)]  # top part first, as stacked
    width = left + plot_w + 24 + legend_width(entries) + 12
    doc = Doc()
    top = title(doc, title_text, width)
    sy = Scale(yt[0], yt[-1], top + PLOT_H, top)
    _axes(doc, yt, sy, (left, top, plot_w, PLOT_H), ylabel)
    x = left + (plot_w - sum(widths) - GROUP_GAP * (len(groups) - 1)) / 2  # centred
    for g, w, t in zip(groups, widths, tags, strict=True):
        _group(doc, g, (x, w), sy, parts, t)
        x += w + GROUP_GAP
    legend(doc, left + plot_w + 24, top, entries)
    height = top + PLOT_H + 14 + (TICK_FONT + 3) * (_label_lines(groups, widths) + 1) + 10
    return doc.render(width, max(height, top + 16 * len(entries) + 10))


def share_bars(title_text: str, ylabel: str, groups: Sequence[Group], parts: Sequence[tuple[str, str, str]]) -> str:
    """Every bar stacked to 100 % of its total, the total (seconds) above it and each part's share in it
    where it fits; the groups in rows, each row on its own 0-100 % axis, the legend in a line under the title."""
    yt = nice_ticks(0.0, 1.0, 5)
    left = 34 + max(text_width(percent(v, yt), TICK_FONT) for v in yt)
    tags = [[seconds(_total(b, parts)) for b in g.bars] for g in groups]
    widths = [_group_width(g, t) for g, t in zip(groups, tags, strict=True)]
    rows: list[list[int]] = [[]]
    for i, w in enumerate(widths):  # as many groups to a row as fit in ROW_W
        if rows[-1] and sum(widths[j] + GROUP_GAP for j in rows[-1]) + w + 2 * GROUP_GAP > ROW_W - left - 16:
            rows.append([])
        rows[-1].append(i)
    plot_w = max(sum(widths[j] + GROUP_GAP for j in row) + GROUP_GAP for row in rows)
    width = max(ROW_W, left + plot_w + 16)
    doc = Doc()
    top = title(doc, title_text, width) - 10
    top += _legend_row(doc, left, top, [Entry(lb, c, "box") for _, lb, c in reversed(parts)], width - left - 16)
    for row in rows:
        box = (left, top + TICK_FONT + 10, plot_w, SHARE_H)  # room above for the totals
        sy = Scale(0.0, 1.0, box[1] + SHARE_H, box[1])
        _axes(doc, yt, sy, box, ylabel, percent)
        x = left + GROUP_GAP
        for j in row:
            _group(doc, groups[j], (x, widths[j]), sy, parts, tags[j])
            x += widths[j] + GROUP_GAP
        lines = _label_lines([groups[j] for j in row], [widths[j] for j in row])
        top = box[1] + SHARE_H + 14 + (TICK_FONT + 3) * (lines + 1) + 10
    return doc.render(width, top)


def _label_lines(groups: Sequence[Group], widths: Sequence[float]) -> int:
    return max((len(wrap(abbreviate(g.label), w, TICK_FONT)) for g, w in zip(groups, widths, strict=True)), default=0)


def _legend_row(doc: Doc, x: float, y: float, entries: Sequence[Entry], width: float) -> float:
    """The entries side by side from (x, y), onto a new line where the next would pass ``width``; their height."""
    cx, cy = x, y
    for e in entries:
        w = legend_width([e])
        if cx > x and cx + w > x + width:
            cx, cy = x, cy + ROW
        legend(doc, cx, cy, [e])
        cx += w + 18
    return cy - y + ROW + 4


def _axes(
    doc: Doc,
    yt: list[float],
    sy: Scale,
    box: tuple[float, float, float, float],
    ylabel: str,
    fmt: Callable[[float, Sequence[float]], str] = tick_label,
) -> None:
    left, top, plot_w, plot_h = box
    doc.open("axes", ylabel=ylabel, xlabel="")
    for v in yt:
        doc.line(left, sy(v), left + plot_w, sy(v), "#e4e4e4")
        doc.text(left - 6, sy(v) + TICK_FONT * 0.35, fmt(v, yt), TICK_FONT, "end", cls="tick y")
    doc.line(left, top + plot_h, left + plot_w, top + plot_h)
    doc.line(left, top + plot_h, left, top)
    widest = max(text_width(fmt(v, yt), TICK_FONT) for v in yt)
    doc.text(left - 14 - widest, top + plot_h / 2, ylabel, LABEL_FONT, "middle", cls="label", rotate=-90)
    doc.close()


def heights(values: Sequence[float], full: float) -> list[float]:
    """Pixel heights of ``values`` stacked to ``full`` px in proportion, none above zero thinner than
    MIN_SLICE: what that adds comes off the largest part, so the stack is still exactly ``full``."""
    total = sum(values)
    if total <= 0 or full <= 0:
        return [0.0 for _ in values]
    out = [full * v / total for v in values]
    thin = [i for i, v in enumerate(values) if v > 0 and out[i] < MIN_SLICE]
    largest = max(range(len(out)), key=out.__getitem__)
    for i in thin:
        out[largest] -= MIN_SLICE - out[i]
        out[i] = MIN_SLICE
    return out


def _group(
    doc: Doc, g: Group, span: tuple[float, float], sy: Scale, parts: Sequence[tuple[str, str, str]], tags: list[str]
) -> None:
    """The group's bars, centred in its span (x, width), labels under them and the group's label lowest.
    ``tags``: each bar's total written above it, for a chart of shares (empty: the value itself, where it fits)."""
    x, width = span
    base_y = sy(0.0)
    bx = x + (width - sum(_slot(b, t) for b, t in zip(g.bars, tags, strict=True))) / 2
    doc.open("group", label=g.label)
    for bar, tag in zip(g.bars, tags, strict=True):
        slot = _slot(bar, tag)
        cx, values = bx + slot / 2, _values(bar, parts)
        total = sum(values)
        y, full = base_y, base_y - sy(1.0 if tag else total)  # a chart of shares: every bar to 100 %
        for (_, label, color), value, h in zip(parts, values, heights(values, full), strict=True):
            if value > 0:
                y -= h
                share = f" ({value / total:.1%} of {seconds(total)})" if tag else ""
                doc.rect(cx - BAR_W / 2, y, BAR_W, h, color, f"{bar.tip or g.label}: {label} {value:.3g} s{share}")
                if tag and h >= SHARE_FONT + 3 and text_width(f"{value / total:.0%}", SHARE_FONT) <= BAR_W - 2:
                    doc.text(cx, y + h / 2 + SHARE_FONT * 0.35, f"{value / total:.0%}", SHARE_FONT, "middle",
                             cls="share", fill="white")  # fmt: skip
        tag = tag or (f"{total:.2g}" if total < 10 else f"{total:.0f}")
        if text_width(tag, TICK_FONT - 1) + 2 <= slot:  # the total above the bar, where it fits
            doc.text(cx, base_y - full - 4, tag, TICK_FONT - 1, "middle", cls="total")
        if bar.label:
            doc.text(cx, base_y + 6 + TICK_FONT, bar.label, TICK_FONT, "middle", cls="tick x")
        bx += slot
    first = base_y + 6 + TICK_FONT + (TICK_FONT + 3 if any(b.label for b in g.bars) else 0)
    for i, line in enumerate(wrap(abbreviate(g.label), width, TICK_FONT)):
        doc.text(x + width / 2, first + (TICK_FONT + 3) * i, line, TICK_FONT, "middle", cls="group")
    doc.close()

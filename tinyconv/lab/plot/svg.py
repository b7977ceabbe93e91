"""SVG primitives: a document of elements, text sizes, round ticks, scales, colours, a legend.

No plotting library: every chart is a handful of lines, rectangles and texts. Text widths are
*estimated* (0.6 x font size per character, generous for sans-serif), and every layout decision
-- margins, legend width, wrapped titles, bar widths -- is made from that estimate, so labels
that would collide are moved before they are drawn rather than after.
"""

from __future__ import annotations

import colorsys
import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

CHAR_WIDTH = 0.6  # of the font size: the width estimate of one character
TICK_FONT, LABEL_FONT, TITLE_FONT, LEGEND_FONT = 11, 12, 15, 11

# Tableau's 10: distinct at a glance; beyond them, hues by the golden angle
_BASE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def text_width(text: str, size: float) -> float:
    return CHAR_WIDTH * size * len(text)


def colors(n: int) -> list[str]:
    """``n`` distinct colours: Tableau's ten, then golden-angle hues (never a repeat)."""
    out = list(_BASE[:n])
    for i in range(len(out), n):
        hue = (i * 0.381966) % 1.0
        lightness = 0.38 + 0.14 * ((i // 10) % 2)
        r, g, b = colorsys.hls_to_rgb(hue, lightness, 0.7)
        c = f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"
        out.append(c if c not in out else f"#{(int(c[1:], 16) + i) % 0xFFFFFF:06x}")
    return out


def paired(n: int) -> list[tuple[str, str]]:
    """``n`` (colour, darker shade) pairs, one per run: a run's two lines read as one run, and every
    line still has a colour of its own."""
    out = []
    for c in colors(n):
        h, light, s = colorsys.rgb_to_hls(*(int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)))
        r, g, b = colorsys.hls_to_rgb(h, light * 0.55, s)
        out.append((c, f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"))
    return out


def shades(color: str, n: int) -> list[str]:
    """``n`` distinct shades of one hue, darkest first (``color`` itself among them)."""
    h, light, s = colorsys.rgb_to_hls(*(int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)))
    out = []
    for k in range(n):
        shade = light * (0.6 + 0.8 * k / max(1, n - 1)) if n > 1 else light
        r, g, b = colorsys.hls_to_rgb(h, min(0.85, shade), s)
        out.append(f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}")
    return out


# ---- ticks ---------------------------------------------------------------------------------------------------
def nice_step(span: float, count: int = 5) -> float:
    """The round step (1, 2 or 5 x 10^k) that cuts ``span`` into about ``count`` intervals."""
    if not span > 0:
        return 1.0
    raw = span / count
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw * 0.999)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values from a multiple of the step at or below ``lo`` to one at or above ``hi``."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    step = nice_step(hi - lo, count)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [_round(k * step, step) for k in range(first, last + 1)]


def log2_ticks(lo: float, hi: float) -> list[float]:
    """Powers of two from the one at or below ``lo`` to the one at or above ``hi``."""
    first = math.floor(math.log2(lo) + 1e-9)
    last = max(first + 1, math.ceil(math.log2(hi) - 1e-9))
    return [2.0**k for k in range(first, last + 1)]


def _round(v: float, step: float) -> float:
    """``v`` without float noise (0.30000000000000004 -> 0.3) at the step's precision."""
    return round(v, max(0, -math.floor(math.log10(step))) + 1)


def tick_label(value: float, ticks: Sequence[float]) -> str:
    """A tick's text with as many decimals as the step between ticks needs, and no more."""
    step = min((abs(b - a) for a, b in zip(ticks, ticks[1:], strict=False) if b != a), default=1.0)
    if value != 0 and abs(value) < 1 and all(t > 0 for t in ticks):  # log2 ticks: 0.25, 0.5, 1
        return f"{value:g}"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{decimals}f}"


@dataclass
class Scale:
    """Data values to pixels, linear or log2, over ``lo``..``hi`` onto ``start``..``end``."""

    lo: float
    hi: float
    start: float
    end: float
    log: bool = False

    def __call__(self, v: float) -> float:
        f = math.log2 if self.log else float
        span = f(self.hi) - f(self.lo)
        return self.start + (self.end - self.start) * ((f(v) - f(self.lo)) / span if span else 0.5)


# ---- the document ---------------------------------------------------------------------------------------------
class Doc:
    """An SVG document built element by element; ``render`` wraps them at the final size."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, raw: str) -> None:
        self.parts.append(raw)

    def text(
        self,
        x: float,
        y: float,
        s: str,
        size: float = LABEL_FONT,
        anchor: str = "start",
        cls: str = "",
        rotate: float = 0,
        bold: bool = False,
        fill: str = "",
    ) -> None:
        attrs = f'x="{x:.1f}" y="{y:.1f}" font-size="{size:g}" text-anchor="{anchor}"'
        if fill:
            attrs += f' fill="{fill}"'
        if cls:
            attrs += f' class="{cls}"'
        if rotate:
            attrs += f' transform="rotate({rotate:g} {x:.1f} {y:.1f})"'
        if bold:
            attrs += ' font-weight="bold"'
        self.parts.append(f"<text {attrs}>{escape(s)}</text>")

    def line(
        self, x1: float, y1: float, x2: float, y2: float, color: str = "black", width: float = 1, dash: str = ""
    ) -> None:
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" '
            f'stroke-width="{width:g}"{extra}/>'
        )

    def rect(self, x: float, y: float, w: float, h: float, fill: str, title: str = "") -> None:
        tip = f"<title>{escape(title)}</title>" if title else ""
        self.parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}">{tip}</rect>')

    def polyline(self, points: Sequence[tuple[float, float]], color: str, width: float = 2, dash: str = "") -> None:
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(
            f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="{width:g}"'
            f' stroke-linejoin="round"{extra}/>'
        )

    def area(self, points: Sequence[tuple[float, float]], color: str, title: str = "") -> None:
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        tip = f"<title>{escape(title)}</title>" if title else ""
        self.parts.append(f'<polygon points="{path}" fill="{color}" stroke="white" stroke-width="0.5">{tip}</polygon>')

    def marker(self, x: float, y: float, color: str, shape: str = "circle", hollow: bool = False) -> None:
        fill = "white" if hollow else color
        if shape == "diamond":
            pts = f"{x:.1f},{y - 5:.1f} {x + 5:.1f},{y:.1f} {x:.1f},{y + 5:.1f} {x - 5:.1f},{y:.1f}"
            self.parts.append(f'<polygon points="{pts}" fill="{fill}" stroke="{color}" stroke-width="1.5"/>')
        else:
            self.parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{fill}" stroke="{color}" stroke-width="1.5"/>'
            )

    def open(self, cls: str, **data: str) -> None:
        attrs = "".join(f" data-{k}={quoteattr(v)}" for k, v in data.items())
        self.parts.append(f'<g class="{cls}"{attrs}>')

    def close(self) -> None:
        self.parts.append("</g>")

    def render(self, width: float, height: float) -> str:
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif">'
        )
        return "\n".join(
            [head, f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>', *self.parts, "</svg>"]
        )


def wrap(text: str, max_width: float, size: float) -> list[str]:
    """``text`` in lines no wider than ``max_width`` (estimated), broken at spaces; a single word
    wider than that stays whole -- callers make room for their longest word."""
    lines: list[str] = []
    for word in text.split():
        if lines and text_width(f"{lines[-1]} {word}", size) <= max_width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines or [""]


def abbreviate(text: str, most: int = 24) -> str:
    """Each word of ``text`` longer than ``most`` characters cut in its middle: "a-run-with-a…longer-name"
    (a file name can be as long as it likes; the chart keeps the full one in a tooltip)."""
    half = (most - 1) // 2
    return " ".join(w if len(w) <= most else f"{w[:half]}\u2026{w[-half:]}" for w in text.split())


def title(doc: Doc, text: str, width: float) -> float:
    """The chart's title, wrapped to ``width``, centred; returns the height it took."""
    lines = wrap(text, width - 20, TITLE_FONT)
    for i, line in enumerate(lines):
        doc.text(width / 2, 8 + TITLE_FONT * (i + 1) * 1.2, line, TITLE_FONT, "middle", cls="title")
    return 22 + TITLE_FONT * 1.2 * len(lines)  # the top tick's label reaches above the plot area


# ---- the legend --------------------------------------------------------------------------------------------------
@dataclass
class Entry:
    """One legend row: a swatch (``line``, ``dash``, ``box``, ``marker`` or ``hollow``) and its label."""

    label: str
    color: str
    swatch: str = "line"


ROW = 16


def legend_width(entries: Sequence[Entry]) -> float:
    return 28 + max((text_width(e.label, LEGEND_FONT) for e in entries), default=0)


def legend(doc: Doc, x: float, y: float, entries: Sequence[Entry]) -> float:
    """Rows from (x, y) down, outside any plot area; returns their height."""
    doc.open("legend")
    for i, e in enumerate(entries):
        cy = y + ROW * i + ROW / 2
        if e.swatch == "box":
            doc.rect(x, cy - 5, 12, 10, e.color)
        elif e.swatch in ("marker", "hollow"):
            doc.marker(x + 10, cy, e.color, "diamond" if e.swatch == "hollow" else "circle", e.swatch == "hollow")
        else:
            doc.line(x, cy, x + 20, cy, e.color, 2, "5,3" if e.swatch == "dash" else "")
        doc.text(x + 26, cy + LEGEND_FONT * 0.35, e.label, LEGEND_FONT, cls="legend")
    doc.close()
    return ROW * len(entries)

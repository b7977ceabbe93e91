"""The simulator's CSV (``tinyconv simulate``) as a chart.

* <name>-nodes.svg -- predicted speedup against the number of nodes (1 to 128, both axes in
  powers of two, so the ideal is the diagonal and a link that saturates bends away from it):
  a panel per medium (Wi-Fi's shared channel, switched Ethernet) and whatever else varies
  between the rows, a series per bandwidth and split -- one hue per bandwidth, a shade of it
  per split, so the eye finds both. Where the rows have several wire formats (``--wire-precision``,
  the ``wire`` column; a CSV written before it read fp32), each split and format is a series of
  its own, named "5 MB/s, paper, wire bf16".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinyconv.lab.plot.lines import Panel, Series, line_chart
from tinyconv.lab.plot.svg import colors, shades
from tinyconv.lab.plot.tables import median, number, varying

PANEL_KEYS = ("arch", "batch", "medium")  # a panel per combination of those that vary
SPLIT_KEYS = ("label", "split", "fuse", "wire", "latency_ms")  # with the bandwidth, what makes a series
OLDER = {"wire": "fp32"}  # columns added since the first CSVs: what a row written before them means


def _sortable(v: Any) -> tuple:
    return (0, v) if isinstance(v, (int, float)) else (1, str(v))


def _split_text(values: dict[str, Any]) -> str:
    """ "paper" (the simulator's label), else "split kernels, fuse off"; "2 ms latency" where it varies."""
    words = [str(values["label"])] if "label" in values else []
    words += [f"{k} {values[k]}" for k in ("split", "fuse") if k in values and "label" not in values]
    words += [f"wire {values['wire']}"] if "wire" in values else []
    words += [f"{values['latency_ms']} ms latency"] if "latency_ms" in values else []
    return ", ".join(words)


def _panel(rows: Sequence[dict[str, Any]], split_keys: list[str], bandwidths: list[Any], title: str) -> Panel:
    """A series per (bandwidth, split), the ideal diagonal over the nodes the rows have."""
    cells: dict[tuple, dict[int, list[float | None]]] = {}
    for r in rows:
        nodes = number(r, "nodes")
        if nodes and nodes >= 1:
            key = (r.get("bandwidth_MBps"), *(r.get(k) for k in split_keys))
            cells.setdefault(key, {}).setdefault(int(nodes), []).append(number(r, "speedup"))
    hues = dict(zip(bandwidths, colors(len(bandwidths)), strict=True))
    series = []
    for bw in bandwidths:
        keys = sorted((k for k in cells if k[0] == bw), key=lambda t: tuple(_sortable(v) for v in t))
        for key, color in zip(keys, shades(hues[bw], len(keys)), strict=True):
            pts = [(float(n), median(v)) for n, v in sorted(cells[key].items())]
            split = _split_text(dict(zip(split_keys, key[1:], strict=True)))
            name = f"{bw:g} MB/s" if isinstance(bw, (int, float)) else f"{bw} MB/s"
            series.append(Series(f"{name}, {split}" if split else name, [(n, s) for n, s in pts if s], color))
    xs = sorted({x for s in series for x, _ in s.points}) or [1.0, 128.0]
    ideal = Series("ideal: speedup = nodes", [(xs[0], xs[0]), (xs[-1], xs[-1])], "#7f7f7f", dash=True,
                   markers=False, role="ideal")  # fmt: skip
    return Panel([*series, ideal], "nodes (participants)", "predicted speedup", xlog=True, ylog=True,
                 xformat=_power, yformat=_power, caption=title)  # fmt: skip


def nodes_chart(rows: Sequence[dict[str, Any]]) -> str:
    """Speedup against nodes on log2 axes: a panel per medium (...), a series per bandwidth and split
    (and wire format, where it varies)."""
    rows = [{**r, **{k: v for k, v in OLDER.items() if r.get(k) is None}} for r in rows]
    panel_keys = varying(rows, PANEL_KEYS)
    split_keys = [k for k in SPLIT_KEYS if k in varying(rows, SPLIT_KEYS)]
    if "label" in split_keys:  # the simulator's name for a split says what split and fuse would
        split_keys = [k for k in split_keys if k not in ("split", "fuse")]
    bandwidths = sorted({r.get("bandwidth_MBps") for r in rows}, key=_sortable)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in panel_keys), []).append(r)
    panels = []
    for key in sorted(groups, key=lambda t: tuple(_sortable(v) for v in t)):
        where = ", ".join(f"{v}" if k == "medium" else f"{k} {v}" for k, v in zip(panel_keys, key, strict=True))
        panels.append(_panel(groups[key], split_keys, bandwidths, where))
    what = ", ".join(sorted({f"{r.get('arch')} at batch {r.get('batch')}" for r in rows}))
    return line_chart(f"Predicted speedup against nodes ({what}): a series per link bandwidth and split", panels)


def _power(value: float, ticks: Sequence[float]) -> str:
    return f"{value:g}"

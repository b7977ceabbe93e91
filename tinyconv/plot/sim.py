"""The simulator's CSV (``tinyconv simulate``) as a chart.

* <name>-nodes.svg -- predicted speedup against the number of nodes (1 to 128, both axes in
  powers of two, so the ideal is the diagonal and a link that saturates bends away from it),
  a series per bandwidth and split (and whatever else varies between the rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinyconv.plot.lines import Panel, Series, line_chart
from tinyconv.plot.svg import colors
from tinyconv.plot.tables import median, number, varying

SERIES_KEYS = ("arch", "batch", "medium", "latency_ms", "bandwidth_MBps", "split")


def _label(values: dict[str, Any]) -> str:
    """ "5 MB/s, split kernels, wifi": the bandwidth first, then what else tells the series apart."""
    words = []
    for k, v in values.items():
        if k == "bandwidth_MBps":
            words.insert(0, f"{v:g} MB/s" if isinstance(v, (int, float)) else f"{v} MB/s")
        elif k == "latency_ms":
            words.append(f"{v} ms latency")
        elif k in ("medium", "arch"):
            words.append(str(v))
        else:
            words.append(f"{k} {v}")
    return ", ".join(words) or "predicted"


def nodes_chart(rows: Sequence[dict[str, Any]]) -> str:
    """Speedup against nodes on log2 axes, a series per bandwidth (and split, ...), the ideal diagonal."""
    keys = [k for k in SERIES_KEYS if k in varying(rows, SERIES_KEYS) or k in ("bandwidth_MBps", "split")]
    series_rows: dict[tuple, dict[int, list[float | None]]] = {}
    for r in rows:
        nodes = number(r, "nodes")
        if nodes and nodes >= 1:
            series_rows.setdefault(tuple(r.get(k) for k in keys), {}).setdefault(int(nodes), []).append(
                number(r, "speedup")
            )
    ordered = sorted(series_rows, key=lambda t: tuple(_sortable(v) for v in t))
    series = []
    for key, color in zip(ordered, colors(len(ordered)), strict=True):
        pts = [(float(n), median(v)) for n, v in sorted(series_rows[key].items())]
        series.append(Series(_label(dict(zip(keys, key, strict=True))), [(n, s) for n, s in pts if s], color))
    xs = sorted({x for s in series for x, _ in s.points}) or [1.0, 128.0]
    ideal = Series(
        "ideal: speedup = nodes", [(xs[0], xs[0]), (xs[-1], xs[-1])], "#7f7f7f", dash=True, markers=False, role="ideal"
    )
    panel = Panel(
        [*series, ideal],
        "nodes (participants)",
        "predicted speedup",
        xlog=True,
        ylog=True,
        xformat=_power,
        yformat=_power,
    )
    what = ", ".join(sorted({str(r.get("arch")) for r in rows}))
    return line_chart(f"Predicted speedup against nodes ({what}): a series per link bandwidth and split", [panel])


def _sortable(v: Any) -> tuple:
    return (0, v) if isinstance(v, (int, float)) else (1, str(v))


def _power(value: float, ticks: Sequence[float]) -> str:
    return f"{value:g}"

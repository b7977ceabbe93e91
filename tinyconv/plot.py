"""Charts from metrics files, as standalone SVG (no plotting library needed).

    tinyconv plot run.jsonl -o plots/                  # curves.svg and split.svg for one run
    tinyconv plot solo.jsonl w1.jsonl w2.jsonl -o plots/   # plus speedup.svg across runs

* curves.svg -- train/test loss and test accuracy per epoch;
* split.svg  -- the paper's stacked bars: median comm / conv / comp seconds per step, one bar a run;
* speedup.svg -- median step time of the first run divided by each run's, against its worker count.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinyconv.metrics import read_metrics

W, H, PAD = 640, 360, 56
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def _frame(title: str, xlabel: str, ylabel: str, xmax: float, ymax: float) -> list[str]:
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="15">{title}</text>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 20}" y2="{H - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{PAD}" y2="30" stroke="black"/>',
        f'<text x="{W / 2}" y="{H - 14}" text-anchor="middle">{xlabel}</text>',
        f'<text x="16" y="{H / 2}" text-anchor="middle" transform="rotate(-90 16 {H / 2})">{ylabel}</text>',
    ]
    for i in range(5):
        v = ymax * i / 4
        y = _y(v, ymax)
        out.append(f'<text x="{PAD - 6}" y="{y + 4}" text-anchor="end">{v:.3g}</text>')
        out.append(f'<line x1="{PAD}" y1="{y}" x2="{W - 20}" y2="{y}" stroke="#ddd"/>')
    for i in range(5):
        v = xmax * i / 4
        out.append(f'<text x="{_x(v, xmax)}" y="{H - PAD + 16}" text-anchor="middle">{v:.3g}</text>')
    return out


def _x(v: float, xmax: float) -> float:
    return PAD + (W - 20 - PAD) * v / (xmax or 1)


def _y(v: float, ymax: float) -> float:
    return H - PAD - (H - PAD - 30) * v / (ymax or 1)


def _legend(names: Sequence[str]) -> list[str]:
    return [
        f'<rect x="{W - 170}" y="{34 + 16 * i}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>'
        f'<text x="{W - 155}" y="{43 + 16 * i}">{name}</text>'
        for i, name in enumerate(names)
    ]


def line_chart(title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, float]]]) -> str:
    """Lines through (x, y) points, one colour per named series."""
    points = [p for s in series.values() for p in s]
    xmax = max((x for x, _ in points), default=1.0)
    ymax = max((y for _, y in points), default=1.0) * 1.05
    out = _frame(title, xlabel, ylabel, xmax, ymax)
    for i, pts in enumerate(series.values()):
        path = " ".join(f"{_x(x, xmax):.1f},{_y(y, ymax):.1f}" for x, y in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{COLORS[i % len(COLORS)]}" stroke-width="2"/>')
    return "\n".join(out + _legend(list(series)) + ["</svg>"])


def stacked_bars(title: str, ylabel: str, bars: dict[str, dict[str, float]]) -> str:
    """One bar per name, stacked from its parts (same part names for every bar)."""
    parts = list(next(iter(bars.values()))) if bars else []
    ymax = max((sum(b.values()) for b in bars.values()), default=1.0) * 1.1
    out = _frame(title, "", ylabel, 1.0, ymax)[:-5]  # no numeric x ticks for bars
    slot = (W - 20 - PAD) / max(1, len(bars))
    for i, (name, b) in enumerate(bars.items()):
        base = 0.0
        x = PAD + slot * i + slot * 0.2
        for j, part in enumerate(parts):
            top = base + b[part]
            out.append(
                f'<rect x="{x:.1f}" y="{_y(top, ymax):.1f}" width="{slot * 0.6:.1f}" '
                f'height="{_y(base, ymax) - _y(top, ymax):.1f}" fill="{COLORS[j % len(COLORS)]}"/>'
            )
            base = top
        out.append(f'<text x="{x + slot * 0.3:.1f}" y="{H - PAD + 16}" text-anchor="middle">{name}</text>')
    return "\n".join(out + _legend(parts) + ["</svg>"])


def _run_name(path: Path, events: list[dict[str, Any]]) -> str:
    run = next((e for e in events if e["event"] == "run"), {})
    n = len(run.get("workers") or [])
    return f"{path.stem} ({n} worker{'s' if n != 1 else ''})"


def plot_runs(paths: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the charts for these metrics files into ``out_dir``; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [(Path(p), read_metrics(p)) for p in paths]
    written = []

    curves: dict[str, list[tuple[float, float]]] = {}
    for path, events in runs:
        epochs = [e for e in events if e["event"] == "epoch"]
        name = path.stem
        curves[f"{name} train loss"] = [(e["epoch"], e["train_loss"]) for e in epochs if e["train_loss"] is not None]
        curves[f"{name} test loss"] = [(e["epoch"], e["test_loss"]) for e in epochs]
        curves[f"{name} test acc"] = [(e["epoch"], e["test_acc"]) for e in epochs]
    written.append(out_dir / "curves.svg")
    written[-1].write_text(line_chart("loss and test accuracy", "epoch", "loss / accuracy", curves))

    bars = {}
    for path, events in runs:
        steps = [e for e in events if e["event"] == "step"]
        if steps:
            bars[_run_name(path, events)] = {
                k: statistics.median(s[k] for s in steps) for k in ("comm_s", "conv_s", "comp_s")
            }
    if bars:
        written.append(out_dir / "split.svg")
        written[-1].write_text(stacked_bars("median time per step: comm / conv / comp", "seconds", bars))

    if len(runs) > 1:
        medians = []
        for _, events in runs:
            steps = [e["time_s"] for e in events if e["event"] == "step"]
            workers = len(next((e for e in events if e["event"] == "run"), {}).get("workers") or [])
            if steps:
                medians.append((workers, statistics.median(steps)))
        if len(medians) > 1:
            base = medians[0][1]
            pts = sorted((w, base / t) for w, t in medians)
            written.append(out_dir / "speedup.svg")
            written[-1].write_text(line_chart("speedup against the first run", "workers", "speedup", {"measured": pts}))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tinyconv plot", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs="+", help="metrics files (JSON lines) written by --metrics-out")
    p.add_argument("-o", "--out", default="plots", help="folder for the SVG files (default %(default)s)")
    args = p.parse_args(argv)
    try:
        files = plot_runs(args.metrics, args.out)
    except (OSError, ValueError, KeyError) as e:
        print(f"tinyconv plot: cannot read the metrics: {e}")
        return 2
    for f in files:
        print(f)
    return 0

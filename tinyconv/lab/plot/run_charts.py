"""Charts of runs, from their metrics files (``--metrics-out``).

* curves.svg  -- two panels on one step axis: the loss (each training step's, and the test
  loss at every evaluation) and the accuracy (training batches', and the test accuracy);
  per step, so a run shorter than an epoch has its curve too;
* split.svg   -- the paper's stacked bars as shares: median comm / conv / comp of a step, stacked to
  100 % with the step's seconds above, a bar a run (a run's communication shows beside a slower run's);
* speedup.svg -- (several runs) the first run's median step time over each run's, against the
  participants, beside the ideal, on an axis that spans the speedups rather than starting at 0;
* shares.svg, timeline.svg -- (distributed runs) how the work was shared: tinyconv/lab/plot/share_charts.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinyconv.lab.plot.bars import Bar, Group, share_bars
from tinyconv.lab.plot.lines import Panel, Series, line_chart, percent
from tinyconv.lab.plot.share_charts import shares_chart, timeline_chart
from tinyconv.lab.plot.svg import paired
from tinyconv.metrics import read_metrics

LOSS_POINTS, ACC_POINTS = 400, 80  # at most, per series: per-step values beyond that are averaged in bins
PARTS = (
    ("comp_s", "comp: the other layers, the update", "#7f7f7f"),
    ("conv_s", "conv: the slowest participant", "#1f77b4"),
    ("comm_s", "comm: transfers and waiting", "#d62728"),
)


def binned(points: Sequence[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    """``points`` as they are if there are at most ``most``, else the means of ``most`` equal bins:
    thousands of noisy steps become a readable curve (and a small file)."""
    if len(points) <= most:
        return list(points)
    size = len(points) / most
    out = []
    for i in range(most):
        chunk = points[round(i * size) : round((i + 1) * size)]
        out.append((statistics.fmean(x for x, _ in chunk), statistics.fmean(y for _, y in chunk)))
    return out


def _evaluations(events: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """Each epoch record with the global step it was evaluated at (older files lack ``steps``:
    the last step recorded in that epoch, else the epoch's number)."""
    out = []
    for e in (e for e in events if e["event"] == "epoch"):
        in_epoch = [s["step"] for s in events if s["event"] == "step" and s.get("epoch") == e["epoch"]]
        out.append((e.get("steps") or max(in_epoch, default=e["epoch"]), e))
    return out


def _curves(runs: list[tuple[str, list[dict[str, Any]]]]) -> str:
    loss, acc = [], []
    for (name, events), (color, dark) in zip(runs, paired(len(runs)), strict=True):
        steps = [e for e in events if e["event"] == "step"]
        evals = _evaluations(events)
        train_loss = [(s["step"], s["loss"]) for s in steps if s.get("loss") is not None]
        if not train_loss:  # no per-step losses: each epoch's mean
            train_loss = [(x, e["train_loss"]) for x, e in evals if e.get("train_loss") is not None]
        loss.append(Series(f"{name}: training loss", binned(train_loss, LOSS_POINTS), color, markers=False, width=1.5))
        loss.append(Series(f"{name}: test loss", [(x, e["test_loss"]) for x, e in evals], dark, markers=True))
        train_acc = [(s["step"], s["acc"]) for s in steps if s.get("acc") is not None]
        acc.append(Series(f"{name}: training accuracy", binned(train_acc, ACC_POINTS), color, markers=False, width=1.5))
        acc.append(Series(f"{name}: test accuracy", [(x, e["test_acc"]) for x, e in evals], dark, markers=True))
    return line_chart(
        "Loss and accuracy per training step (test: at each evaluation)",
        [Panel(loss, "training step", "loss", yfrom0=False), Panel(acc, "training step", "accuracy", yformat=percent)],
    )


def _participants(events: list[dict[str, Any]]) -> int:
    """Who computed the convolutions: the workers, and the master unless --master-share 0."""
    run = next((e for e in events if e["event"] == "run"), {})
    master = (run.get("train_config") or {}).get("master_share", "auto") != "0"
    return len(run.get("workers") or []) + int(master)


def run_name(path: Path, events: list[dict[str, Any]]) -> str:
    run = next((e for e in events if e["event"] == "run"), {})
    n = len(run.get("workers") or [])
    return f"{path.stem}: " + (f"{n} worker{'s' if n != 1 else ''}" if n else "the master alone")


def _split(runs: list[tuple[Path, list[dict[str, Any]]]]) -> str | None:
    groups = []
    for path, events in runs:
        steps = [e for e in events if e["event"] == "step"]
        if steps:
            parts = {k: statistics.median(s.get(k) or 0.0 for s in steps) for k, _, _ in PARTS}
            groups.append(Group(run_name(path, events), [Bar("", parts)]))
    if not groups:
        return None
    title = "Median step: comm / conv / comp as shares of it, its seconds above"
    return share_bars(title, "share of the step", groups, PARTS)


def _speedup(runs: list[tuple[Path, list[dict[str, Any]]]]) -> str | None:
    medians = []
    for path, events in runs:
        times = [e["time_s"] for e in events if e["event"] == "step"]
        if times:
            medians.append((_participants(events), statistics.median(times), path.stem))
    if len(medians) < 2:
        return None
    p0, t0, first = medians[0]
    points = sorted((p, t0 / t) for p, t, _ in medians)
    xs = sorted({p for p, _ in points})
    series = [
        Series(
            "ideal (participants / the first run's)",
            [(x, x / p0) for x in xs],
            "#7f7f7f",
            dash=True,
            markers=False,
            role="ideal",
        ),
        Series("measured", points, "#1f77b4", markers=True),
    ]
    xlabel = "participants (the master too, unless --master-share 0)"
    panel = Panel(series, xlabel, "speedup", xinteger=True, yfrom0=False)  # the axis spans the speedups, not 0
    return line_chart(f"Speedup against {first}: its median step time over each run's", [panel])


def plot_runs(paths: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the charts for these metrics files into ``out_dir``; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [(Path(p), read_metrics(p)) for p in paths]
    for path, events in runs:  # an empty chart would look like a run that learnt nothing
        if not any(e.get("event") == "step" for e in events):
            raise ValueError(f"{path} has no step records: the run ended before its first step, nothing to draw")
    charts = {"curves.svg": _curves([(p.stem, events) for p, events in runs]), "split.svg": _split(runs)}
    if len(runs) > 1:
        charts["speedup.svg"] = _speedup(runs)
    charts |= {"shares.svg": shares_chart(runs), "timeline.svg": timeline_chart(runs)}  # None: no run shared work
    written = []
    for name, svg in charts.items():
        if svg is not None:
            written.append(out_dir / name)
            written[-1].write_text(svg)
    return written

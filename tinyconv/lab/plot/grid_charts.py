"""Charts of the experiment grid's CSV (``tinyconv experiment grid``).

* <name>-speedup.svg   -- speedup against the batch size, a series per architecture and
  participant count and per value of each :data:`SETTINGS` column that differs (--rebalance
  off and on, --wire-precision bf16 and fp32, ...; the median of the repeats), the ideal
  (= participants) dashed, and the paper's speedups (tinyconv/lab/paper.py) beside ours as hollow
  diamonds on a dotted line: the paper does not record here which batch they came from, so
  they span the axis;
* <name>-breakdown.svg -- the paper's Fig. 6 as shares: a step's comm / conv / comp stacked to 100 %,
  its seconds above the bar, a bar per participant count (the master alone first), grouped by
  architecture and batch, the groups in rows. Shares, not seconds: one axis for a 59 s step and a
  0.4 s one flattens the small steps and their communication, which is what the paper is about.

The speedup axis spans the data (ours, the ideal and the paper's), not 0 to it: 1.5x and 1.9x
are the difference a reader looks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinyconv.lab.paper import PAPER_SPEEDUPS
from tinyconv.lab.plot.bars import Bar, Group, share_bars
from tinyconv.lab.plot.lines import Panel, Series, line_chart
from tinyconv.lab.plot.run_charts import PARTS
from tinyconv.lab.plot.svg import colors
from tinyconv.lab.plot.tables import describe, median, number, varying

# may differ between rows of one grid, and then tell series apart
SETTINGS = ("parallel", "norm", "fuse", "split", "rebalance", "wire", "pipeline", "backend", "transport", "link")
# how the participants share a step: the master alone's row has none of them (it says "-", or "model")
SHARING = ("parallel", "fuse", "split", "rebalance", "wire", "pipeline")
IDEAL_GREYS = ("#555555", "#888888", "#aaaaaa", "#bbbbbb")


def _arch_key(arch: str) -> tuple[int, ...]:
    try:
        return tuple(int(k) for k in str(arch).split(":"))
    except ValueError:
        return (1 << 30,)


def _speedup_of(row: dict[str, Any]) -> float | None:
    """The row's speedup, or the master alone's step time over its own where the column is empty."""
    given = number(row, "speedup")
    solo, step = number(row, "solo_step_s"), number(row, "step_s")
    return given if given is not None else (solo / step if solo and step else None)


def _cells(rows: Sequence[dict[str, Any]], key: Sequence[str]) -> dict[tuple, list[dict[str, Any]]]:
    """Rows by the values of ``key`` (the repeats of one configuration together), in a sensible order."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault(tuple(r.get(k) for k in key), []).append(r)
    return dict(sorted(cells.items(), key=lambda kv: tuple(_sortable(v) for v in kv[0])))


def _sortable(v: Any) -> tuple:
    return (0, _arch_key(v)) if isinstance(v, str) and ":" in v else (1, v if isinstance(v, (int, float)) else str(v))


def _settings(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The SETTINGS that differ between the rows: a SHARING one only if it differs between rows with
    participants, since the master alone's "-" (rebalance, wire, fuse, split) is no setting of its own."""
    shared = [r for r in rows if (number(r, "participants") or 0) > 1]
    return [k for k in SETTINGS if varying(shared if k in SHARING else rows, [k])]


def speedup_chart(rows: Sequence[dict[str, Any]]) -> str:
    """Speedup against batch size: ours per (arch, participants[, settings]), the ideal, the paper's."""
    settings = _settings(rows)
    key = ("arch", "participants", *settings)
    cells = _cells([r for r in rows if (number(r, "participants") or 0) > 1], ("batch", *key))
    lines: dict[tuple, list[tuple[float, float]]] = {}
    for (batch, *rest), repeats in cells.items():
        s = median(_speedup_of(r) for r in repeats)
        if s is not None and isinstance(batch, (int, float)):
            lines.setdefault(tuple(rest), []).append((float(batch), s))
    palette = colors(len(lines))
    series = []
    for (arch, p, *rest), color in zip(lines, palette, strict=True):
        config = dict(zip(settings, rest, strict=True))
        shown = [k for k in settings if config[k] not in (None, "-")]  # a data row's fuse/split do not apply
        extra = f", {describe(config, shown)}" if shown else ""
        series.append(Series(f"{arch} on {p} participants{extra}", lines[(arch, p, *rest)], color, markers=True))
    batches = sorted({x for pts in lines.values() for x, _ in pts}) or [64.0]
    if len(batches) == 1:  # one batch (a throttled grid, say): the ideal and the paper's span an octave each side
        batches = [batches[0] / 2, batches[0], batches[0] * 2]
    series += _paper(lines, palette, batches)
    counts = sorted({int(p) for _, p, *_ in lines})
    for p, grey in zip(counts, IDEAL_GREYS * len(counts), strict=False):
        series.append(
            Series(
                f"ideal: {p}x on {p} participants",
                [(batches[0], p), (batches[-1], p)],
                grey,
                dash=True,
                markers=False,
                role="ideal",
            )
        )
    panel = Panel(
        series,
        "batch size",
        "speedup",
        xlog=True,
        xformat=lambda v, _: f"{v:.0f}",
        yfrom0=False,
    )
    return line_chart(
        "Speedup against batch size: the master alone's step time over the participants' (median of the "
        "repeats), beside the paper's",
        [panel],
    )


def _paper(lines: dict[tuple, list], palette: list[str], batches: list[float]) -> list[Series]:
    """The paper's speedups for the architectures and participant counts we measured, in the colour of
    our series they compare with; a dotted line across the batches (the paper's batch is not recorded
    here) with a diamond at each end."""
    out = []
    ours = {(arch, int(p)): color for (arch, p, *_), color in zip(lines, palette, strict=True)}
    for ref in PAPER_SPEEDUPS:
        color = ours.get((ref.arch, ref.participants))
        if color is None:
            continue
        where = f"batch {ref.batch}" if ref.batch else "batch not recorded"
        label = f"paper: {ref.arch} on {ref.participants} {ref.device.upper()}s, {ref.speedup}x ({where})"
        xs = [float(ref.batch)] if ref.batch else [batches[0], batches[-1]]
        pts = [(x, ref.speedup) for x in xs]
        out.append(Series(label, pts, color, dash=True, markers=True, role="paper", width=1.5))
    return out


def breakdown_chart(rows: Sequence[dict[str, Any]]) -> str:
    """comm / conv / comp per configuration, as shares of the step: a group per (arch, batch[, settings]), a bar per
    participant count (1 = the master alone). The master alone shares nothing, so its bar opens every
    group of its arch, batch and other settings, whatever the group's --parallel, --fuse, --split,
    --rebalance or --wire-precision."""
    settings = _settings(rows)
    others = [k for k in settings if k not in SHARING]
    alone: dict[tuple, Bar] = {}
    groups: dict[tuple, list[Bar]] = {}
    for (arch, batch, *rest, p), repeats in _cells(rows, ("arch", "batch", *settings, "participants")).items():
        parts = {k: median(number(r, k) for r in repeats) or 0.0 for k, _, _ in PARTS}
        config = dict(zip(settings, rest, strict=True))
        if p == 1:
            tip = f"{arch}, batch {batch}, the master alone"
            alone[(arch, batch, *(config[k] for k in others))] = Bar("alone", parts, tip)
            continue
        tip = f"{arch}, batch {batch}, {p} participants"
        groups.setdefault((arch, batch, *rest), []).append(Bar(str(p), parts, tip))
    labelled, shared = [], set()
    for (arch, batch, *rest), bars in groups.items():
        config = dict(zip(settings, rest, strict=True))
        solo = alone.get(where := (arch, batch, *(config[k] for k in others)))
        shared.add(where)
        shown = [k for k in settings if config[k] not in (None, "-")]  # a data row's fuse/split do not apply
        extra = f" {describe(config, shown)}" if shown else ""
        labelled.append(Group(f"{arch} batch {batch}{extra}", ([solo] if solo else []) + bars))
    for key, solo in alone.items():  # the master alone with no participants' rows beside it
        if key not in shared:
            labelled.append(Group(f"{key[0]} batch {key[1]}", [solo]))
    return share_bars(
        "Where a step's time goes: comm / conv / comp as shares of the step, its seconds above the bar "
        "(median of the repeats); a bar per participant count, alone = the master alone",
        "share of the step",
        labelled,
        PARTS,
    )

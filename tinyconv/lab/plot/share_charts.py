"""Charts of how a distributed run shared its work, from its metrics files (``--metrics-out``).

* shares.svg   -- each layer's split among the participants as the run goes: a panel per run and
  layer, the participants' shares of the layer's kernels (its input channels, for a layer split by
  them; images, for a split of the batch) stacked to 100 % at every step, from each step's record;
  a dashed line where a worker was lost or joined. Stacked bands, not a line each: equal shares
  would draw their lines on top of one another; bands show each one and what a loss hands over.
* timeline.svg -- one step per participant, Gantt-like: a panel per run, its median step. Where its ops carry
  ``at_s`` and ``spans`` (docs/metrics.md), as it happened on the master's clock: each op where it began, in it
  every worker's task on its way, its compute and its result on its way, the master's compute and the rest of
  the op beside it, and comp (the step's other layers and update) between the ops and after the last. Older
  metrics record how long, not when: the ops back to back, in each every participant's compute first, then the
  rest of the op (its transfers, its wait), the master's busy time beyond its share (sending, summing) apart,
  and comp after them all.

A run that shared nothing (the master alone) has neither chart.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinyconv.lab.plot.gantt import Lanes, Span, gantt
from tinyconv.lab.plot.lines import Panel, Series, line_chart, percent
from tinyconv.lab.plot.svg import colors

Run = tuple[Path, list[dict[str, Any]]]
KINDS = (
    ("compute", "computing its share", "#1f77b4"),
    ("busy", "the master: sending, summing, copying", "#ff7f0e"),
    ("idle", "not computing: transfers and waiting", "#f2a7a7"),
    ("comp", "comp: the other layers, the update", "#7f7f7f"),
)
TITLES = {  # a timeline's title and x axis: every op's moments known (at_s, spans), or how long each took only
    True: (
        "One step per participant, on the master's clock: when its task went out, when it computed, when its "
        "result came back",
        "seconds from the step's first op's start, on the master's clock",
    ),
    False: (
        "One step per participant: when it computed its share and when it did not. Within an op the metrics "
        "record how long, not when: its compute is drawn first, and comp (run between the ops) last",
        "seconds from the step's start, the ops back to back as the master ran them",
    ),
}
TIMED = (  # the kinds of a step whose ops say when they ran
    ("task", "its task on its way: sent, not started", "#98df8a"),
    KINDS[0],
    ("result", "its result on its way: computed, not received", "#c5b0d5"),
    ("running", "the master beside its share: sending, waiting, summing", "#ffbb78"),
    KINDS[3],
)
MARK_GREYS = {"worker_lost": "#444444", "worker_joined": "#999999", "run": "#000000"}
OP_NAMES = {"forward": "fwd", "backward": "bwd"}
MOST_POINTS = 400  # of a share's line: a run that rebalances every step is thinned to this


def _units(step: dict[str, Any], layer: str) -> tuple[list[int], str]:
    """What ``layer`` was split by in ``step``, per participant, and its name."""
    if layer in (step.get("channel_shares") or {}):
        return step["channel_shares"][layer], "input channels"
    return step["shares"][layer], "images" if step.get("parallel") == "data" else "kernels"


def _staircase(values: list[tuple[int, float]]) -> list[tuple[float, float]]:
    """(step, value) as the outline of a value held over each step's stretch of the axis, (step - 1, step]:
    a point where it starts and ends, two where it changes. Too many changes (a rebalance at every step):
    every k-th step's value, so a line stays within about MOST_POINTS points."""
    points = [(values[0][0] - 1.0, values[0][1])]
    for (edge, before), (_, now) in zip(values, values[1:], strict=False):
        if now != before:
            points += [(float(edge), before), (float(edge), now)]
    if len(points) > MOST_POINTS and len(values) > 2:
        return _staircase(values[:: 2 * len(values) // MOST_POINTS + 1] + values[-1:])
    return points + [(float(values[-1][0]), values[-1][1])]


def _bands(steps: list[dict[str, Any]], layer: str, palette: dict[str, str]) -> tuple[list[Series], str]:
    """A band per participant that ever had a share of ``layer``, stacked in the palette's order, and the unit."""
    edges: dict[str, list[tuple[int, float]]] = {n: [] for n in palette}  # each band's bottom, then its top
    unit, tops = "kernels", {n: [] for n in palette}
    for s in (s for s in steps if layer in s["shares"]):
        counts, unit = _units(s, layer)
        got, below = dict(zip(s["participants"], counts, strict=False)), 0.0
        for name in palette:
            edges[name].append((s["step"], below))
            below += got.get(name, 0) / (sum(counts) or 1)
            tops[name].append((s["step"], below))
    bands = [
        Series(name, _staircase(tops[name]) + _staircase(edges[name])[::-1], palette[name], role="band")
        for name in palette
        if any(t > b for (_, t), (_, b) in zip(tops[name], edges[name], strict=True))
    ]
    return bands, unit


def _marks(events: list[dict[str, Any]]) -> list[Series]:
    """A dashed line where a worker was lost or joined, or the run resumed (a ``run`` event after steps), at
    the end of the steps finished then: the next step is the first with the new split."""
    marks, last = [], 0
    for e in events:
        last = e["step"] if e["event"] == "step" else last
        if e["event"] in ("worker_lost", "worker_joined"):
            name = f"{e.get('worker', 'a worker')} {e['event'][7:]} in step {e['step'] + 1}"
        elif e["event"] == "run" and last:
            name = f"resumed after step {last}"
        else:
            continue
        x = e.get("step", last)
        marks.append(Series(name, [(x, 0.0), (x, 1.0)], MARK_GREYS[e["event"]], dash=True, markers=False,
                            role="event"))  # fmt: skip
    return marks


def _share_panels(path: Path, events: list[dict[str, Any]], palette: dict[str, str]) -> list[Panel]:
    """A panel per layer of one run: the participants' shares stacked to 100 %, and its :func:`_marks`."""
    steps = sorted((e for e in events if e["event"] == "step" and e.get("shares")), key=lambda e: e["step"])
    marks = _marks(events)
    panels = []
    for layer in dict.fromkeys(k for s in steps for k in s["shares"]):
        bands, unit = _bands(steps, layer, palette)
        caption = f"{path.stem}: {layer}, its {unit} per participant"
        panels.append(Panel(bands + marks, "training step", f"share of the {unit}", yformat=percent,
                            caption=caption, xinteger=True, extra_y=[1.0]))  # fmt: skip
    return panels


def shares_chart(runs: Sequence[Run]) -> str | None:
    """Each layer's split among the participants over the steps, per run; None if no run shared work."""
    seen = {n for _, ev in runs for e in ev if e["event"] == "step" for n in e.get("participants") or []}
    names = sorted(seen, key=lambda n: (n != "master", len(n), n))  # the master, worker0, ..., worker10
    palette = dict(zip(names, colors(len(names)), strict=True))  # one colour per participant across the panels
    panels = [p for path, events in runs for p in _share_panels(path, events, palette)]
    if not panels:
        return None
    return line_chart("Each layer's split among the participants, step by step", panels)


def median_step(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The step record of the median step time among those with per-op timings (the lower one of an even count)."""
    steps = sorted((e for e in events if e["event"] == "step" and e.get("ops")), key=lambda e: e["time_s"])
    return steps[(len(steps) - 1) // 2] if steps else None


def step_lanes(caption: str, step: dict[str, Any]) -> Lanes:
    """One step's ops back to back, a lane per participant (see the module's note on what is drawn where)."""
    names = list(step["participants"])
    lanes: dict[str, list[Span]] = {"master": []} if "master" not in names else {}
    lanes |= {n: [] for n in names}
    marks, t = [], 0.0
    for op in step["ops"]:
        wall, what = op["wall_s"], f"{op['layer']} {OP_NAMES.get(op['op'], op['op'])}"
        marks.append((t, wall, what))
        for name, compute in zip(names, op["compute_s"], strict=False):
            c = min(compute, wall)
            rest = wall - c
            lanes[name].append(Span(t, c, "compute", f"{name}, {what}: computed {c:.3g} s of {wall:.3g} s"))
            if name == "master":  # its busy time beyond its share: running the op
                busy = min(rest, max(0.0, wall - (op.get("master_waited_s") or 0.0) - c))
                lanes[name].append(Span(t + c, busy, "busy", f"master, {what}: sending, summing {busy:.3g} s"))
                c, rest = c + busy, rest - busy
            lanes[name].append(Span(t + c, rest, "idle", f"{name}, {what}: not computing {rest:.3g} s"))
        t += wall
    comp = max(0.0, step["time_s"] - t)
    lanes["master"].append(Span(t, comp, "comp", f"master: the other layers and the update, {comp:.3g} s"))
    return Lanes(caption, lanes, marks)


def timed(step: dict[str, Any]) -> bool:
    """Whether the step's ops say when they ran (``at_s``, ``spans``), not only how long."""
    return all(op.get("at_s") is not None and op.get("spans") is not None for op in step["ops"])


def timed_lanes(caption: str, step: dict[str, Any]) -> Lanes:
    """One step's ops where they ran, from their ``at_s`` and ``spans`` (see the module's note)."""
    names = list(step["participants"])
    lanes: dict[str, list[Span]] = {"master": []} if "master" not in names else {}
    lanes |= {n: [] for n in names}
    marks, end = [], 0.0
    for op in step["ops"]:
        t, wall, what = op["at_s"], op["wall_s"], f"{op['layer']} {OP_NAMES.get(op['op'], op['op'])}"
        if t > end:
            lanes["master"].append(Span(end, t - end, "comp", f"master: the layers between the ops, {t - end:.3g} s"))
        marks.append((t, wall, what))
        spans = dict(zip(names, zip(op["spans"], op["compute_s"], strict=False), strict=False))
        for name, bars in lanes.items():
            bars += _phases(name, f"{name}, {what}", op, *spans.get(name, (None, 0.0)))
        end = max(end, t + wall)
    comp = max(0.0, step["time_s"] - end)
    tip = f"master: the update, and what ran before the first op (its batch), {comp:.3g} s"
    lanes["master"].append(Span(end, comp, "comp", tip))
    return Lanes(caption, lanes, marks)


def _phases(name: str, what: str, op: dict[str, Any], span: list | None, reported: float) -> list[Span]:
    """A participant's bars in ``op`` from its span: a worker's task on its way, its compute (and in the tip the
    compute it ``reported``), its result on its way; the master's compute and the rest of the op. A moment not
    known (None) is the one before it (0 for the first); none known: no part in the op."""
    t, wall, waited = op["at_s"], op["wall_s"], op.get("master_waited_s") or 0.0
    if span is None or all(v is None for v in span):
        return [Span(t, wall, "running", f"{what}: no share, waited {waited:.3g} s")] if name == "master" else []
    moments, last = [], 0.0
    for v in span:
        last = last if v is None else min(wall, max(last, v))
        moments.append(last)
    sent, started, computed, received = moments
    if name != "master":  # the master reads a worker's messages only between its own work: a `started` read late
        started = max(sent, min(started, computed - reported))  # goes back to where the reported compute puts it
    tip = f"{what}: computing until its computed was read, {computed - started:.3g} s (reported {reported:.3g} s)"
    work = Span(t + started, computed - started, "compute", tip)
    if name == "master":
        tip = f"{what}: beside its share {wall - computed + started:.3g} s, of which it waited {waited:.3g} s"
        return [Span(t, started, "running", tip), work, Span(t + computed, wall - computed, "running", tip)]
    return [
        Span(t + sent, started - sent, "task", f"{what}: its task on its way {started - sent:.3g} s"),
        work,
        Span(t + computed, received - computed, "result", f"{what}: its result on its way {received - computed:.3g} s"),
    ]


def timeline_chart(runs: Sequence[Run]) -> str | None:
    """Each run's median step, per participant; None if no run recorded per-op timings."""
    panels, exact = [], True
    for path, events in runs:
        step = median_step(events)
        if step is not None:
            count = sum(1 for e in events if e["event"] == "step" and e.get("ops"))
            caption = f"{path.stem}: step {step['step']}, {step['time_s']:.3g} s, the median of {count} steps"
            exact &= timed(step)
            panels.append(timed_lanes(caption, step) if timed(step) else step_lanes(caption, step))
    if not panels:
        return None
    used = {s.kind for p in panels for spans in p.lanes.values() for s in spans}
    kinds = TIMED if exact else KINDS + tuple(k for k in TIMED if k not in KINDS and k[0] in used)
    return gantt(*TITLES[exact], panels, kinds)

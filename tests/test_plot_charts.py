"""tinyconv plot's charts of shares, of sharing and of speedups, by rendering: fixture data made here,
the SVG parsed and measured in pixels -- 100 % bars that fill their axis, a communication slice of a
few percent that is drawn, speedup axes that span their data, each layer's split over the steps, and
one step per participant."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_plot import (
    GRID_COLUMNS,
    SVG,
    _png_renderer,
    _write_csv,
    check_readable,
    parse,
    polyline_points,
    series,
    texts,
    write_run,
)

from tinyconv.lab.plot import main, plot_files, plot_runs
from tinyconv.lab.plot.bars import MIN_SLICE
from tinyconv.lab.plot.share_charts import TIMED
from tinyconv.lab.plot.svg import TICK_FONT

PARTICIPANTS = ("master", "worker0", "worker1")


# ---- fixtures --------------------------------------------------------------------------------------------------
def grid_rows(cells: list[tuple[str, int, int, float, float, float]]) -> list[dict]:
    """Grid rows from (arch, batch, participants, step seconds, comm share, the master alone's step seconds);
    conv is 70 % of the rest of the step, comp 30 %."""
    rows = []
    for arch, batch, p, step, comm, solo in cells:
        rows.append(dict(arch=arch, norm="lrn", batch=batch, participants=p, fuse="on", split="auto",
                         backend="numpy", transport="zmq", repeat=0, steps=4, step_s=step, step_s_min=step,
                         step_s_max=step, comm_s=comm * step, conv_s=0.7 * (1 - comm) * step,
                         comp_s=0.3 * (1 - comm) * step, bytes_sent=0, bytes_recv=0, solo_step_s=solo,
                         speedup=None, shares="", link="", host="vm", timestamp="t"))  # fmt: skip
    return rows


def wide_grid(path: Path) -> Path:
    """The grid the issue found unreadable: a 59 s step beside 0.4 s ones, 2 % and 0.2 % comm among them,
    and speedups from 1.5 to 2.0."""
    cells = []
    for i, (arch, solo) in enumerate((("50:500", 0.4), ("300:1000", 6.0), ("500:1500", 59.0))):
        for batch in (64, 128, 256, 512):
            alone = solo * (batch / 64 if arch != "500:1500" else batch / 512)
            cells.append((arch, batch, 1, alone, 0.0, alone))
            cells.append((arch, batch, 2, alone / (1.5 + 0.1 * i + 0.05 * (batch // 128)), 0.02, alone))
            cells.append((arch, batch, 3, alone / 2.0, 0.002, alone))
    _write_csv(path, GRID_COLUMNS, grid_rows(cells))
    return path


def step(n: int, time_s: float, shares: dict[str, list[int]], names: tuple[str, ...], ops: list[dict]) -> dict:
    return {"event": "step", "epoch": 1, "step": n, "loss": 1.0, "acc": 0.5, "time_s": time_s, "comm_s": 0.1,
            "conv_s": 0.5, "comp_s": 0.1, "shares": shares, "participants": list(names), "ops": ops,
            "channel_shares": {"conv2": shares["conv2"]}}  # fmt: skip


def op(layer: str, kind: str, wall: float, compute: list[float], waited: float) -> dict:
    return {"layer": layer, "op": kind, "wall_s": wall, "compute_s": compute, "master_waited_s": waited}


def write_shared_run(path: Path) -> Path:
    """Eight steps of master + worker0 + worker1: conv1's kernels 4/2/2, rebalanced to 3/3/2 from step 4;
    worker1 lost in step 6 (its share to the others), worker2 joining in step 8; conv2 split by its input
    channels. Each step's ops: conv1's forward and backward, scaled to the step's time."""
    events: list[dict] = [{"event": "run", "workers": [{"index": 0}, {"index": 1}], "train_config": {}}]
    splits = {1: (4, 2, 2), 4: (3, 3, 2), 6: (4, 4), 8: (3, 3, 2)}
    names, counts = PARTICIPANTS, splits[1]
    for n in range(1, 9):
        counts = splits.get(n, counts)
        if n == 6:
            events.append({"event": "worker_lost", "step": 5, "worker": "worker1", "reason": "gone",
                           "shares": {"conv1": [4, 4]}})  # fmt: skip
            names = ("master", "worker0")
        if n == 8:
            events.append({"event": "worker_joined", "step": 7, "worker": "worker2", "shares": {"conv1": [3, 3, 2]}})
            names = ("master", "worker0", "worker2")
        t = (
            1.0 + n % 3
        )  # 2, 3, 1, 2, 3, 1, 2, 3 s: the median (the lower of two) is 2 s, steps 1, 4 and 7; 4 in sorted order
        ops = [op("conv1", "forward", 0.4 * t, [0.1 * t, 0.3 * t, 0.2 * t][: len(names)], 0.2 * t),
               op("conv1", "backward", 0.5 * t, [0.2 * t, 0.45 * t, 0.5 * t][: len(names)], 0.25 * t)]  # fmt: skip
        events.append(step(n, t, {"conv1": list(counts), "conv2": [2] * len(names)}, names, ops))
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return path


# ---- reading pixels back -----------------------------------------------------------------------------------------
def y_of_ticks(axes: ET.Element) -> dict[float, float]:
    """Each y tick's value -> its pixel (a tick's label is drawn 0.35 of the font below its line)."""
    return {float(t.text.rstrip("%")): float(t.get("y")) - TICK_FONT * 0.35 for t in texts(axes, "y")}


def x_scale(axes: ET.Element) -> tuple[float, float]:
    """(pixels per unit, pixel of 0) of an x axis, from its first two ticks."""
    (v0, x0), (v1, x1) = [(float(t.text), float(t.get("x"))) for t in texts(axes, "x")[:2]]
    per = (x1 - x0) / (v1 - v0)
    return per, x0 - v0 * per


def bars_of(root: ET.Element) -> list[list[ET.Element]]:
    """The rectangles of every bar (a bar: the rectangles of one group at one x), bottom-up."""
    out = []
    for g in (g for g in root.iter(SVG + "g") if g.get("class") == "group"):
        by_x: dict[str, list[ET.Element]] = {}
        for r in g.iter(SVG + "rect"):
            by_x.setdefault(r.get("x"), []).append(r)
        out += [sorted(rs, key=lambda r: -float(r.get("y"))) for rs in by_x.values()]
    return out


def share_of(tip: str) -> float:
    return float(tip.rsplit("(", 1)[1].split("%")[0]) / 100


# ---- the breakdown as shares ---------------------------------------------------------------------------------------
def test_the_grid_breakdown_is_shares_of_the_step_in_rows_of_readable_width(tmp_path):
    plot_files([wide_grid(tmp_path / "grid.csv")], tmp_path / "out")
    root = check_readable(tmp_path / "out" / "grid-breakdown.svg")
    assert 800 <= float(root.get("width")) <= 1000  # the 12 groups wrap, not one strip
    axes = [g for g in root.iter(SVG + "g") if g.get("class") == "axes"]
    assert len(axes) >= 2 and all(t.text.endswith("%") for a in axes for t in texts(a, "y"))
    rows = [(ticks[0.0], ticks[100.0]) for ticks in map(y_of_ticks, axes)]
    bars = bars_of(root)
    assert len(bars) == 12 * 3  # alone, 2 and 3 participants for each architecture and batch
    for rects in bars:
        bottom = float(rects[0].get("y")) + float(rects[0].get("height"))
        top = float(rects[-1].get("y"))
        assert any(abs(bottom - zero) < 0.15 and abs(top - full) < 0.15 for zero, full in rows)  # 100 % each
        assert abs(sum(float(r.get("height")) for r in rects) - (bottom - top)) < 0.3  # stacked, no gap
    totals = [t.text for t in texts(root, "total")]
    assert len(totals) == len(bars) and "59 s" in totals and "0.4 s" in totals and all(t.endswith(" s") for t in totals)


def test_a_small_comm_slice_is_drawn_in_proportion_and_a_tiny_one_still_shows(tmp_path):
    plot_files([wide_grid(tmp_path / "grid.csv")], tmp_path / "out")
    root = parse(tmp_path / "out" / "grid-breakdown.svg")
    full = next(
        y[0.0] - y[100.0] for y in map(y_of_ticks, (g for g in root.iter(SVG + "g") if g.get("class") == "axes"))
    )
    comm = {}
    for rects in bars_of(root):
        for r in rects:
            tip = r.find(SVG + "title").text
            if ": comm" in tip:
                comm.setdefault(round(share_of(tip), 3), []).append(float(r.get("height")))
    assert sorted(comm) == [0.002, 0.02]  # the master alone's bars have no comm slice
    assert all(abs(h - 0.02 * full) < 0.15 for h in comm[0.02])  # 2 % of the step: 2 % of the bar, visibly
    assert all(h == pytest.approx(MIN_SLICE, abs=0.06) for h in comm[0.002])  # 0.2 %: thin, never gone


def test_the_runs_split_is_shares_too_each_bar_with_its_seconds(tmp_path):
    solo = write_run(tmp_path / "solo.jsonl", 0, 40.0, (0.0, 0.0, 40.0))
    two = write_run(tmp_path / "two.jsonl", 1, 0.5, (0.01, 0.3, 0.19))
    plot_runs([solo, two], tmp_path / "out")
    root = check_readable(tmp_path / "out" / "split.svg")
    assert [t.text for t in texts(root, "total")] == ["40 s", "0.5 s"]
    (solo_bar,), (comp, conv, comm) = bars_of(root)
    assert float(solo_bar.get("height")) == pytest.approx(float(conv.get("height")) * 0.5 / 0.3, abs=0.3)
    assert float(comm.get("height")) == pytest.approx(float(conv.get("height")) / 30, abs=0.15)  # 2 % of a 0.5 s step


# ---- speedup axes ----------------------------------------------------------------------------------------------------
def test_speedup_axes_span_the_data_not_zero(tmp_path):
    plot_files([wide_grid(tmp_path / "grid.csv")], tmp_path / "out")
    root = check_readable(tmp_path / "out" / "grid-speedup.svg")
    (axes,) = [g for g in root.iter(SVG + "g") if g.get("class") == "axes"]
    ticks = y_of_ticks(axes)
    lo, hi = min(ticks), max(ticks)
    assert 1.0 <= lo <= 1.5 and 2.0 < hi <= 3.5  # ours 1.5-2.0, the paper's 1.69 and 1.98, the ideals 2x and 3x
    for g in series(root) + series(root, "ideal") + series(root, "paper"):
        for c in [*g.iter(SVG + "circle"), *polyline_points(g)]:
            y = float(c.get("cy")) if isinstance(c, ET.Element) else c[1]
            assert ticks[hi] < y < ticks[lo]  # inside the axis, none on its frame
    runs = [write_run(tmp_path / f"r{n}.jsonl", n, 2.0 / s, (0.1, 0.5, 0.4)) for n, s in ((1, 1.0), (2, 1.6), (3, 1.9))]
    plot_runs(runs, tmp_path / "runs")
    (axes,) = [g for g in parse(tmp_path / "runs" / "speedup.svg").iter(SVG + "g") if g.get("class") == "axes"]
    assert 0.5 <= min(y_of_ticks(axes)) <= 1.0 and max(y_of_ticks(axes)) >= 2.0  # 1.0 to 2.0 (the ideal): not from 0


# ---- shares over time and one step per participant ----------------------------------------------------------------
def band_extent(points: list[tuple[float, float]], x: float) -> tuple[float, float]:
    """(top, bottom) pixels of a band's outline at ``x``: its top edge runs to the right, its bottom edge back."""
    turn = max(range(len(points)), key=lambda i: (points[i][0], -i))  # the first point at the right end

    def at(edge: list[tuple[float, float]]) -> float:  # fmt: skip
        return next(
            a[1] for a, b in zip(edge, edge[1:], strict=False) if min(a[0], b[0]) < x < max(a[0], b[0]) and a[1] == b[1]
        )

    return at(points[: turn + 1]), at(points[turn + 1 :])


def test_shares_over_time_stack_each_layers_split_step_by_step(tmp_path):
    files = plot_runs([write_shared_run(tmp_path / "run.jsonl")], tmp_path / "out")
    assert sorted(f.name for f in files) == ["curves.svg", "shares.svg", "split.svg", "timeline.svg"]
    root = check_readable(tmp_path / "out" / "shares.svg")
    assert [t.text for t in texts(root, "caption")] == ["run: conv1, its kernels per participant",
                                                        "run: conv2, its input channels per participant"]  # fmt: skip
    axes = [g for g in root.iter(SVG + "g") if g.get("class") == "axes"]
    bands = series(root, "band")
    assert [g.get("data-name") for g in bands] == ["master", "worker0", "worker1", "worker2"] * 2
    assert [g.get("data-name") for g in series(root, "event")] == [
        "worker1 lost in step 6",
        "worker2 joined in step 8",
    ] * 2
    ticks, (per, x0) = y_of_ticks(axes[0]), x_scale(axes[0])
    full = ticks[0.0] - ticks[100.0]
    expected = {2: (0.5, 0.25, 0.25, 0), 5: (0.375, 0.375, 0.25, 0), 6: (0.5, 0.5, 0, 0), 8: (0.375, 0.375, 0, 0.25)}
    for n, shares in expected.items():
        x = x0 + (n - 0.5) * per  # the middle of step n's stretch, (n - 1, n]
        extents = [band_extent(polyline_points_of(g), x) if s else None for g, s in zip(bands[:4], shares, strict=True)]
        drawn = [(bottom - top) / full for top, bottom in filter(None, extents)]
        assert drawn == pytest.approx([s for s in shares if s], abs=0.01), n
        tops = sorted(e for e in extents if e)
        assert tops[0][0] == pytest.approx(ticks[100.0], abs=0.1) and tops[-1][1] == pytest.approx(ticks[0.0], abs=0.1)
    event_x = [float(polyline_points(g)[0][0]) for g in series(root, "event")[:2]]
    assert event_x == pytest.approx([x0 + 5 * per, x0 + 7 * per], abs=0.1)  # where the new split begins


def polyline_points_of(g: ET.Element) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in next(g.iter(SVG + "polygon")).get("points").split()]


def test_the_timeline_draws_the_median_step_per_participant(tmp_path):
    plot_runs([write_shared_run(tmp_path / "run.jsonl")], tmp_path / "out")
    root = check_readable(tmp_path / "out" / "timeline.svg")
    assert [t.text for t in texts(root, "caption")] == ["run: step 4, 2 s, the median of 8 steps"]
    lanes = {g.get("data-name"): g for g in root.iter(SVG + "g") if g.get("class") == "lane"}
    assert list(lanes) == list(PARTICIPANTS)
    per, x0 = x_scale(next(g for g in root.iter(SVG + "g") if g.get("class") == "axes"))
    spans = {n: [(float(r.get("x")), float(r.get("width")), r.find(SVG + "title").text) for r in g.iter(SVG + "rect")]
             for n, g in lanes.items()}  # fmt: skip
    computes = {n: [w / per for _, w, tip in s if "computed" in tip] for n, s in spans.items()}
    for name, seconds in {"master": [0.2, 0.4], "worker0": [0.6, 0.9], "worker1": [0.4, 1.0]}.items():
        assert computes[name] == pytest.approx(seconds, abs=0.01), name  # each op's compute, in proportion
    for name, s in spans.items():  # each lane fills both ops, 0.8 + 1.0 s, without gap or overlap
        in_ops = sorted((x, w) for x, w, tip in s if "the other layers" not in tip)
        assert in_ops[0][0] == pytest.approx(x0, abs=0.1)
        assert all(a + w == pytest.approx(b, abs=0.15) for (a, w), (b, _) in zip(in_ops, in_ops[1:], strict=False))
        assert in_ops[-1][0] + in_ops[-1][1] == pytest.approx(x0 + 1.8 * per, abs=0.15), name
    (comp,) = [(x, w) for x, w, tip in spans["master"] if "the other layers" in tip]
    assert comp[0] + comp[1] == pytest.approx(x0 + 2.0 * per, abs=0.15)  # the step's 2 s end with its comp
    busy = [w / per for _, w, tip in spans["master"] if "sending" in tip]
    assert busy == pytest.approx([0.2, 0.1], abs=0.01)  # its op time beyond its share and its wait
    assert [t.text for t in texts(root, "mark")] == ["conv1 fwd", "conv1 bwd"]
    assert "how long, not when" in " ".join(t.text for t in texts(root, "title"))  # the old records' schematic


# each op's span per participant, [sent, started, computed, received] from its start: worker1's backward said no
# "started" (its compute is drawn from its task's send)
TIMED_OPS = [
    (0.0, 0.8, [[0.1, 0.1, 0.5, 0.5], [0.05, 0.15, 0.6, 0.7], [0.08, 0.2, 0.4, 0.8]]),
    (1.2, 0.6, [[0.05, 0.05, 0.3, 0.3], [0.02, 0.1, 0.4, 0.5], [0.03, None, 0.45, 0.55]]),
]


def write_timed_run(path: Path) -> Path:
    """Three steps (2, 2.5 and 1.5 s) of master + worker0 + worker1 whose ops say when they ran (at_s, spans):
    conv1's forward at 0 s for 0.8 s, its backward at 1.2 s for 0.6 s, the other layers in between."""
    events: list[dict] = [{"event": "run", "workers": [{"index": 0}, {"index": 1}], "train_config": {}}]
    for n, t in ((1, 2.0), (2, 2.5), (3, 1.5)):
        ops = [op("conv1", kind, wall, [0.3, 0.4, 0.4], 0.1) | {"at_s": at, "spans": spans}
               for kind, (at, wall, spans) in zip(("forward", "backward"), TIMED_OPS, strict=True)]  # fmt: skip
        events.append(step(n, t, {"conv1": [3, 3, 2], "conv2": [2, 2, 2]}, PARTICIPANTS, ops))
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return path


def test_a_timeline_from_timed_ops_draws_each_op_and_each_span_where_it_was(tmp_path):
    plot_runs([write_timed_run(tmp_path / "run.jsonl")], tmp_path / "out")
    root = check_readable(tmp_path / "out" / "timeline.svg")
    title = " ".join(t.text for t in texts(root, "title"))
    assert "master's clock" in title and "not when" not in title
    per, x0 = x_scale(next(g for g in root.iter(SVG + "g") if g.get("class") == "axes"))
    kind = {color: name for name, _, color in TIMED}
    lanes = {g.get("data-name"): g for g in root.iter(SVG + "g") if g.get("class") == "lane"}
    assert list(lanes) == list(PARTICIPANTS)
    drawn = {n: [(kind[r.get("fill")], (float(r.get("x")) - x0) / per, float(r.get("width")) / per)
                 for r in g.iter(SVG + "rect")] for n, g in lanes.items()}  # fmt: skip
    want: dict[str, list] = {n: [] for n in PARTICIPANTS}
    for at, wall, spans in TIMED_OPS:
        (_, m0, m1, _), *workers = spans
        want["master"] += [("running", at, m0), ("compute", at + m0, m1 - m0), ("running", at + m1, wall - m1)]
        for name, (sent, started, computed, received) in zip(PARTICIPANTS[1:], workers, strict=True):
            started = sent if started is None else started
            # a started read after less than the worker's reported 0.4 s of compute goes back to computed - 0.4
            started = max(sent, min(started, computed - 0.4))
            bars = [("task", sent, started), ("compute", started, computed), ("result", computed, received)]
            want[name] += [(k, at + a, b - a) for k, a, b in bars if b > a]
    want["master"][3:3] = [("comp", 0.8, 0.4)]  # between the ops
    want["master"].append(("comp", 1.8, 0.2))  # the rest of the 2 s step, after the last op
    for name, bars in want.items():
        assert [k for k, _, _ in drawn[name]] == [k for k, _, _ in bars], name
        flat = [[v for _, a, w in spans for v in (a, w)] for spans in (drawn[name], bars)]  # start, length, ...
        assert flat[0] == pytest.approx(flat[1], abs=0.002), name
    assert [t.text for t in texts(root, "mark")] == ["conv1 fwd", "conv1 bwd"]
    marks = next(g for g in root.iter(SVG + "g") if g.get("class") == "marks")
    starts = [(float(line.get("x1")) - x0) / per for line in marks.iter(SVG + "line")]
    assert starts == pytest.approx([0.0, 1.2], abs=0.002)  # each op at its at_s, not back to back


def test_runs_that_shared_nothing_have_no_shares_nor_timeline_and_the_help_names_them(tmp_path, capsys):
    solo = write_run(tmp_path / "solo.jsonl", 0, 2.0, (0.0, 0.0, 2.0))
    assert "shares.svg" not in {f.name for f in plot_runs([solo], tmp_path / "solo")}
    files = plot_runs([solo, write_shared_run(tmp_path / "shared.jsonl")], tmp_path / "both")
    root = parse(tmp_path / "both" / "timeline.svg")
    assert {"shares.svg", "timeline.svg"} <= {f.name for f in files}
    assert [t.text.split(":")[0] for t in texts(root, "caption")] == ["shared"]  # the master alone has no panel
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "shares.svg" in (out := capsys.readouterr().out) and "timeline.svg" in out


def test_the_new_charts_render_to_png_where_a_renderer_is_installed(tmp_path):
    render = _png_renderer()
    if render is None:
        pytest.skip("no SVG renderer here (rsvg-convert or cairosvg)")
    for svg in plot_files([write_shared_run(tmp_path / "run.jsonl"), wide_grid(tmp_path / "g.csv")], tmp_path):
        render(svg, svg.with_suffix(".png"))
        assert svg.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", svg.name

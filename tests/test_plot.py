"""tinyconv plot, by rendering: each chart from small fixture data written here, its SVG parsed and
held to what a reader needs -- round increasing ticks, a colour per series, loss and accuracy on
axes of their own, the paper's values, no label on another, every point on the canvas."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from itertools import product
from pathlib import Path

import pytest

from tinyconv.lab.plot import main, plot_files, plot_runs
from tinyconv.lab.plot.svg import CHAR_WIDTH, colors, nice_ticks

SVG = "{http://www.w3.org/2000/svg}"
GRID_COLUMNS = (
    "arch norm batch participants fuse split backend transport repeat steps step_s step_s_min step_s_max "
    "comm_s conv_s comp_s bytes_sent bytes_recv solo_step_s speedup shares link host timestamp"
).split()
SIM_COLUMNS = "arch batch split medium bandwidth_MBps latency_ms nodes step_s comm_s conv_s comp_s speedup".split()


# ---- fixtures --------------------------------------------------------------------------------------------------
def write_run(path: Path, workers: int, step_s: float, split: tuple[float, float, float], steps: int = 8,
              steps_per_epoch: int = 4) -> Path:  # fmt: skip
    """A metrics file: ``steps`` steps, an evaluation at each epoch's end and at the last step."""
    events = [{"event": "run", "workers": [{"index": i} for i in range(workers)], "train_config": {}}]
    for s in range(1, steps + 1):
        comm, conv, comp = split
        epoch = (s - 1) // steps_per_epoch + 1
        events.append({"event": "step", "epoch": epoch, "step": s, "loss": 2.3 - 0.05 * s, "acc": 0.1 + 0.01 * s,
                       "time_s": step_s, "comm_s": comm, "conv_s": conv, "comp_s": comp})  # fmt: skip
        if s % steps_per_epoch == 0 or s == steps:
            events.append({"event": "epoch", "epoch": epoch, "steps": s, "complete": s % steps_per_epoch == 0,
                           "train_loss": 2.0, "test_loss": 2.1 - 0.04 * s, "test_acc": 0.1 + 0.02 * s})  # fmt: skip
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return path


def write_grid(path: Path) -> Path:
    """A grid: three architectures x batch 64-256 x 1-2 participants x 2 repeats, as the grid's CSV."""
    rows = []
    for arch, base in (("50:500", 0.2), ("300:1000", 1.5), ("500:1500", 3.0)):
        for batch in (64, 128, 256):
            solo = base * batch / 64
            for p in (1, 2):
                for repeat in (0, 1):
                    step = solo if p == 1 else solo / (1.4 + base / 10 + 0.1 * repeat + batch / 1024)
                    comm = 0.0 if p == 1 else 0.1 * step
                    rows.append(dict(arch=arch, norm="lrn", batch=batch, participants=p, fuse="on", split="auto",
                                     backend="numpy", transport="zmq", repeat=repeat, steps=10, step_s=step,
                                     step_s_min=step * 0.95, step_s_max=step * 1.05, comm_s=comm, conv_s=0.8 * step,
                                     comp_s=0.2 * step - comm / 2, bytes_sent=0, bytes_recv=0, solo_step_s=solo,
                                     speedup=solo / step, shares="{}", link="", host="vm", timestamp="t"))  # fmt: skip
    _write_csv(path, GRID_COLUMNS + ["warmup"], [{**r, "warmup": 2} for r in rows])  # a column beyond the contract
    return path


def write_sim(path: Path) -> Path:
    """As ``tinyconv simulate`` writes it: three splits (paper, fused, channels) x two bandwidths x two
    media x 1-128 nodes, with columns beyond the contract (fuse, label)."""
    rows = []
    for fuse, split, label in (("off", "kernels", "paper"), ("on", "kernels", "tinyconv fused"),
                               ("on", "channels", "tinyconv channels")):  # fmt: skip
        for medium in ("wifi", "ethernet"):
            for bandwidth in (5, 125):
                for k in range(8):
                    nodes = 2**k
                    cost = (0.5 if bandwidth == 5 else 0.02) * (2 if split == "channels" else 1)
                    speedup = nodes / (1 + nodes * cost * (2 if medium == "wifi" else 1))
                    rows.append(dict(arch="300:1000", batch=64, split=split, medium=medium, bandwidth_MBps=bandwidth,
                                     latency_ms=1.0, nodes=nodes, step_s=1 / speedup, comm_s=0.1, conv_s=0.5,
                                     comp_s=0.1, speedup=speedup, fuse=fuse, label=label))  # fmt: skip
    _write_csv(path, SIM_COLUMNS + ["fuse", "label"], rows)
    return path


def _write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


# ---- reading the SVG back ------------------------------------------------------------------------------------------
def parse(path: Path) -> ET.Element:
    return ET.parse(path).getroot()


def texts(root: ET.Element, cls: str | None = None) -> list[ET.Element]:
    return [t for t in root.iter(SVG + "text") if cls is None or cls in (t.get("class") or "").split()]


def text_box(t: ET.Element) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of a text, its width estimated as 0.6 x font size x characters, rotated as drawn."""
    x, y, size = float(t.get("x")), float(t.get("y")), float(t.get("font-size"))
    w = CHAR_WIDTH * size * len(t.text or "")
    x0 = {"start": x, "middle": x - w / 2, "end": x - w}[t.get("text-anchor", "start")]
    corners = [(x0, y - size * 0.8), (x0 + w, y - size * 0.8), (x0, y + size * 0.2), (x0 + w, y + size * 0.2)]
    m = re.match(r"rotate\(([-\d.]+) ([-\d.]+) ([-\d.]+)\)", t.get("transform") or "")
    if m:
        a, cx, cy = math.radians(float(m[1])), float(m[2]), float(m[3])
        corners = [(cx + (px - cx) * math.cos(a) - (py - cy) * math.sin(a),
                    cy + (px - cx) * math.sin(a) + (py - cy) * math.cos(a)) for px, py in corners]  # fmt: skip
    xs, ys = [c[0] for c in corners], [c[1] for c in corners]
    return min(xs), min(ys), max(xs), max(ys)


def coordinates(root: ET.Element) -> list[tuple[float, float]]:
    """Every point an element is drawn at: texts, lines, rectangles' corners, circles, polylines."""
    pts = []
    for el in root.iter():
        a = el.attrib
        for x, y in (("x", "y"), ("x1", "y1"), ("x2", "y2"), ("cx", "cy")):
            if x in a and y in a:
                pts.append((float(a[x]), float(a[y])))
        if "width" in a and "x" in a:
            pts.append((float(a["x"]) + float(a["width"]), float(a["y"]) + float(a["height"])))
        for pair in (a.get("points") or "").split():
            pts.append(tuple(float(v) for v in pair.split(",")))
    return pts


def check_readable(path: Path) -> ET.Element:
    """What every chart owes its reader: on the canvas, no overlapping labels, round increasing ticks."""
    root = parse(path)
    width, height = float(root.get("width")), float(root.get("height"))
    for x, y in coordinates(root):
        assert math.isfinite(x) and math.isfinite(y) and 0 <= x <= width and 0 <= y <= height, (path.name, x, y)
    boxes = [(t.text, text_box(t)) for t in texts(root)]
    for text, (x0, y0, x1, y1) in boxes:
        assert x0 >= 0 and x1 <= width and y0 >= 0 and y1 <= height, (path.name, text)
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1 :]:
            apart = ba[2] <= bb[0] or bb[2] <= ba[0] or ba[3] <= bb[1] or bb[3] <= ba[1]
            assert apart, f"{path.name}: {a!r} overlaps {b!r}"
    for axes in root.iter(SVG + "g"):
        if axes.get("class") == "axes":
            for direction in ("x", "y"):
                check_round_ticks([t.text for t in texts(axes, "tick") if direction in t.get("class").split()])
    return root


def check_round_ticks(labels: list[str]) -> None:
    if not labels:
        return
    values = [float(s.rstrip("%")) for s in labels]
    assert values == sorted(values) and len(set(values)) == len(values), labels
    steps = {round(b - a, 9) for a, b in zip(values, values[1:], strict=False)}
    ratios = {round(b / a, 9) for a, b in zip(values, values[1:], strict=False) if a > 0}
    if ratios == {2.0} and all(v > 0 and math.log2(v).is_integer() for v in values):
        return  # a log axis of powers of two (two of them, 64 and 128, have one step, as a linear axis)
    if len(steps) == 1:  # linear: one step, 1, 2 or 5 x 10^k, and every value a multiple of it
        (step,) = steps
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert round(mantissa, 6) in (1, 2, 5), labels
        assert all(abs(v / step - round(v / step)) < 1e-6 for v in values), labels
    else:  # log axes: powers of two
        assert ratios == {2.0} and all(math.log2(v).is_integer() for v in values), labels


def series(root: ET.Element, role: str = "data") -> list[ET.Element]:
    return [g for g in root.iter(SVG + "g") if g.get("class") == "series" and g.get("data-role") == role]


def circles(g: ET.Element) -> list[ET.Element]:
    return list(g.iter(SVG + "circle")) + list(g.iter(SVG + "polygon"))


def polyline_points(g: ET.Element) -> list[tuple[float, float]]:
    line = next(g.iter(SVG + "polyline"), None)
    return [] if line is None else [tuple(map(float, p.split(","))) for p in line.get("points").split()]


# ---- runs ------------------------------------------------------------------------------------------------------
def test_runs_give_curves_split_and_speedup(tmp_path):
    solo = write_run(tmp_path / "solo.jsonl", 0, 2.0, (0.0, 0.0, 2.0))
    two = write_run(tmp_path / "two.jsonl", 2, 1.0, (0.2, 0.5, 0.3))
    files = plot_runs([solo, two], tmp_path / "out")
    assert sorted(f.name for f in files) == ["curves.svg", "speedup.svg", "split.svg"]
    split = check_readable(tmp_path / "out" / "split.svg")
    groups = [g.get("data-label") for g in split.iter(SVG + "g") if g.get("class") == "group"]
    assert groups == ["solo: the master alone", "two: 2 workers"]
    assert {"comm: transfers and waiting", "conv: the slowest participant"} <= {t.text for t in texts(split, "legend")}
    speedup = check_readable(tmp_path / "out" / "speedup.svg")
    (measured,) = series(speedup)
    assert len(polyline_points(measured)) == 2  # (1 participant, 1.0) and (3 participants, 2.0)
    assert [t.text for t in texts(speedup, "x")] == ["1", "2", "3"]  # participants: no 1.5
    assert series(speedup, "ideal")


def test_a_run_shorter_than_an_epoch_has_its_per_step_curve(tmp_path):
    short = write_run(tmp_path / "short.jsonl", 1, 1.0, (0.1, 0.5, 0.4), steps=30, steps_per_epoch=1000)
    plot_runs([short], tmp_path / "out")
    root = check_readable(tmp_path / "out" / "curves.svg")
    by_name = {g.get("data-name"): g for g in series(root)}
    assert len(polyline_points(by_name["short: training loss"])) == 30  # every step, not one point per epoch
    assert len(circles(by_name["short: test loss"])) == 1  # the one evaluation, as a visible marker
    assert len(polyline_points(by_name["short: training accuracy"])) == 30


def test_loss_and_accuracy_have_axes_of_their_own(tmp_path):
    plot_runs([write_run(tmp_path / "a.jsonl", 0, 1.0, (0, 0, 1.0))], tmp_path / "out")
    root = parse(tmp_path / "out" / "curves.svg")
    axes = [g for g in root.iter(SVG + "g") if g.get("class") == "axes"]
    assert [g.get("data-ylabel") for g in axes] == ["loss", "accuracy"]
    loss_ticks, acc_ticks = ([t.text for t in texts(g, "y")] for g in axes)
    assert all(t.endswith("%") for t in acc_ticks) and not any(t.endswith("%") for t in loss_ticks)
    loss_top, acc_top = (min(float(t.get("y")) for t in texts(g, "y")) for g in axes)
    assert acc_top > loss_top + 100  # one panel under the other, not one axis for both


def test_every_series_has_a_colour_of_its_own(tmp_path):
    runs = [write_run(tmp_path / f"run{i}.jsonl", i, 1.0 + i, (0.1, 0.5, 0.4)) for i in range(8)]
    plot_runs(runs, tmp_path / "out")
    root = check_readable(tmp_path / "out" / "curves.svg")
    lines = series(root)
    assert len(lines) == 8 * 4  # per run: training and test loss, training and test accuracy
    for quantity in ("loss", "accuracy"):
        panel = [g.get("data-color") for g in lines if g.get("data-name").endswith(quantity)]
        assert len(panel) == 16 and len(set(panel)) == 16
    assert len(set(colors(60))) == 60


def test_the_readability_check_catches_overlaps_and_stray_points(tmp_path):
    canvas = '<svg xmlns="http://www.w3.org/2000/svg" width="200" height="100">{}</svg>'
    overlap = tmp_path / "overlap.svg"
    overlap.write_text(canvas.format('<text x="10" y="50" font-size="12">hello</text>'
                                     '<text x="30" y="52" font-size="12">world</text>'))  # fmt: skip
    with pytest.raises(AssertionError, match="overlaps"):
        check_readable(overlap)
    outside = tmp_path / "outside.svg"
    outside.write_text(canvas.format('<polyline points="10,10 250,20"/>'))
    with pytest.raises(AssertionError):
        check_readable(outside)


def test_long_names_wrap_and_shift_rather_than_collide(tmp_path):
    names = ["a-run-with-a-rather-long-descriptive-name", "another-run-with-an-even-longer-name-than-that", "x"]
    runs = [write_run(tmp_path / f"{n}.jsonl", i, 1.0, (0.1, 0.5, 0.4)) for i, n in enumerate(names)]
    for svg in plot_runs(runs, tmp_path / "out"):
        check_readable(svg)


# ---- the grid and the simulator -------------------------------------------------------------------------------------
def test_grid_speedup_has_our_series_the_ideal_and_the_papers(tmp_path):
    files = plot_files([write_grid(tmp_path / "grid.csv")], tmp_path / "out")
    assert [f.name for f in files] == ["grid-speedup.svg", "grid-breakdown.svg"]
    root = check_readable(tmp_path / "out" / "grid-speedup.svg")
    ours = series(root)
    assert [g.get("data-name") for g in ours] == [f"{a} on 2 participants" for a in ("50:500", "300:1000", "500:1500")]
    assert len({g.get("data-color") for g in ours}) == 3
    assert all(len(circles(g)) == 3 for g in ours)  # a marker per batch size
    assert [t.text for t in texts(root, "x")] == ["64", "128", "256"]
    paper = {g.get("data-name"): g for g in series(root, "paper")}
    assert len(paper) == 2 and any("1.69x" in n for n in paper) and any("1.98x" in n for n in paper)
    y_of = {name.split(", ")[1]: polyline_points(g)[0][1] for name, g in paper.items()}
    assert y_of["1.98x (batch not recorded)"] < y_of["1.69x (batch not recorded)"]  # higher up: a larger speedup
    colour_of = {g.get("data-name").split(" on ")[0]: g.get("data-color") for g in ours}
    assert next(g for n, g in paper.items() if "300:1000" in n).get("data-color") == colour_of["300:1000"]
    (ideal,) = series(root, "ideal")
    assert "2x" in ideal.get("data-name")


def test_grid_breakdown_stacks_every_configuration_the_master_alone_too(tmp_path):
    plot_files([write_grid(tmp_path / "grid.csv")], tmp_path / "out")
    root = check_readable(tmp_path / "out" / "grid-breakdown.svg")
    groups = [g for g in root.iter(SVG + "g") if g.get("class") == "group"]
    assert len(groups) == 9 and groups[0].get("data-label") == "50:500 batch 64"
    assert [t.text for t in texts(groups[0], "x")] == ["alone", "2"]
    tips = [r.find(SVG + "title").text for r in groups[-1].iter(SVG + "rect")]
    assert any(t.startswith("500:1500, batch 256, 2 participants: comm") for t in tips)


def test_grid_puts_data_parallel_rows_beside_model_parallel_ones(tmp_path):
    rows = []
    configs = (("model", "-", "-", 1, 1.0), ("model", "on", "auto", 2, 0.6), ("data", "-", "-", 2, 0.5))
    for batch, (parallel, fuse, split, p, step) in product((64, 256), configs):
        rows.append(dict(arch="50:500", norm="lrn", batch=batch, participants=p, fuse=fuse, split=split,
                         parallel=parallel,
                         backend="numpy", transport="zmq", repeat=0, steps=4, step_s=step, step_s_min=step,
                         step_s_max=step, comm_s=0.1 * (p - 1), conv_s=0.7 * step, comp_s=0.2 * step, bytes_sent=0,
                         bytes_recv=0, solo_step_s=1.0, speedup=1.0 / step, shares="{}", link="", host="vm",
                         timestamp="t"))  # fmt: skip
    _write_csv(tmp_path / "grid.csv", list(dict.fromkeys(GRID_COLUMNS + ["parallel"])), rows)
    plot_files([tmp_path / "grid.csv"], tmp_path / "out")
    root = check_readable(tmp_path / "out" / "grid-speedup.svg")
    assert [g.get("data-name") for g in series(root)] == [
        "50:500 on 2 participants, parallel data",  # its fuse and split do not apply, so they are not said
        "50:500 on 2 participants, parallel model, fuse on, split auto",
    ]
    root = check_readable(tmp_path / "out" / "grid-breakdown.svg")
    groups = [g for g in root.iter(SVG + "g") if g.get("class") == "group"]
    assert [g.get("data-label") for g in groups] == [
        f"50:500 batch {b} parallel {how}" for b in (64, 256) for how in ("data", "model, fuse on, split auto")
    ]
    assert all([t.text for t in texts(g, "x")] == ["alone", "2"] for g in groups)  # the master alone opens each


def test_grid_tells_rebalance_and_wire_apart_and_the_master_alone_opens_each_group(tmp_path):
    """A fixed split and a narrowed wire are series and bar groups of their own; the master alone's
    "-" for them is no setting, so a grid with one distributed configuration says none."""
    base = dict(arch="300:1000", norm="lrn", batch=64, backend="numpy", transport="zmq", repeat=0, steps=1,
                parallel="model", bytes_recv=0, shares="", link="5MB/s", host="vm", timestamp="t")  # fmt: skip
    configs = [(1, "-", "-", "-", "-", 20.0, 0)] + [
        (2, "off", "kernels", rebalance, wire, step, sent)
        for rebalance, wire, step, sent in (("on", "fp32", 60.0, 92e6), ("off", "fp32", 40.0, 92e6),
                                            ("off", "bf16", 25.0, 46e6))]  # fmt: skip
    rows = [dict(base, participants=p, fuse=fuse, split=split, rebalance=rebalance, wire=wire, step_s=step,
                 step_s_min=step, step_s_max=step, comm_s=0.5 * step * (p - 1), conv_s=0.4 * step, comp_s=0.1 * step,
                 solo_step_s=20.0, speedup=20.0 / step, bytes_sent=sent)
            for p, fuse, split, rebalance, wire, step, sent in configs]  # fmt: skip
    columns = list(dict.fromkeys(GRID_COLUMNS + ["parallel", "rebalance", "wire"]))
    _write_csv(tmp_path / "grid.csv", columns, rows)
    plot_files([tmp_path / "grid.csv"], tmp_path / "out")
    root = check_readable(tmp_path / "out" / "grid-speedup.svg")
    ways = (("off", "bf16"), ("off", "fp32"), ("on", "fp32"))
    assert [g.get("data-name") for g in series(root)] == [
        f"300:1000 on 2 participants, rebalance {r}, wire {w}" for r, w in ways
    ]
    root = check_readable(tmp_path / "out" / "grid-breakdown.svg")
    groups = [g for g in root.iter(SVG + "g") if g.get("class") == "group"]
    assert [g.get("data-label") for g in groups] == [f"300:1000 batch 64 rebalance {r}, wire {w}" for r, w in ways]
    assert all([t.text for t in texts(g, "x")] == ["alone", "2"] for g in groups)
    _write_csv(tmp_path / "one.csv", columns, rows[:2])  # the master alone and one fixed split: nothing to tell apart
    plot_files([tmp_path / "one.csv"], tmp_path / "one")
    root = check_readable(tmp_path / "one" / "one-speedup.svg")
    assert [g.get("data-name") for g in series(root)] == ["300:1000 on 2 participants"]
    (ideal,) = series(root, "ideal")  # one batch: the ideal still a line, an octave each side of it
    (left, y0), (right, y1) = polyline_points(ideal)
    (point,) = [(float(c.get("cx")), float(c.get("cy"))) for c in circles(series(root)[0])]
    assert left < point[0] < right and y0 == y1 and [t.text for t in texts(root, "x")] == ["32", "64", "128"]


def test_simulated_speedup_against_nodes(tmp_path):
    files = plot_files([write_sim(tmp_path / "sim.csv")], tmp_path / "out")
    assert [f.name for f in files] == ["sim-nodes.svg"]
    root = check_readable(files[0])
    assert [t.text for t in texts(root, "caption")] == ["ethernet", "wifi"]  # a panel per medium
    for axes in (g for g in root.iter(SVG + "g") if g.get("class") == "axes"):
        assert [t.text for t in texts(axes, "x")] == ["1", "2", "4", "8", "16", "32", "64", "128"]
    ours = series(root)
    names = [f"{bw} MB/s, {split}" for bw in (5, 125) for split in ("paper", "tinyconv channels", "tinyconv fused")]
    assert [g.get("data-name") for g in ours] == names * 2  # a series per bandwidth and split in each panel
    assert len({g.get("data-color") for g in ours[:6]}) == 6 and all(len(polyline_points(g)) == 8 for g in ours)
    ideal = series(root, "ideal")
    assert len(ideal) == 2
    (x0, y0), (x1, y1) = polyline_points(ideal[0])
    assert x1 > x0 and y1 < y0  # the diagonal, up to 128x


def test_simulated_wire_formats_are_series_of_their_own_and_an_old_csv_reads_fp32(tmp_path):
    """The simulator's ``wire`` column (--wire-precision): where it varies, a series per split and format;
    rows written before it (no column) are fp32, so they join the fp32 rows' series."""
    from tinyconv.lab.plot.sim_charts import nodes_chart

    def rows(wire: str | None, bandwidth: float) -> list[dict]:
        words = {"fp32": 4, "bf16": 2, None: 4}[wire]
        return [dict(arch="300:1000", batch=64, split="kernels", medium="ethernet", bandwidth_MBps=bandwidth,
                     latency_ms=1.0, nodes=n, speedup=n / (1 + n * 0.1 * words), fuse="off", label="paper",
                     **({} if wire is None else {"wire": wire})) for n in (1, 2, 4, 8)]  # fmt: skip

    new = rows("fp32", 5) + rows("bf16", 5)
    _write_csv(tmp_path / "sim.csv", SIM_COLUMNS + ["fuse", "label", "wire"], new)
    (path,) = plot_files([tmp_path / "sim.csv"], tmp_path / "out")
    root = check_readable(path)
    named = {g.get("data-name"): g for g in series(root)}
    assert sorted(named) == ["5 MB/s, wire bf16", "5 MB/s, wire fp32"]  # the split the same: unsaid
    assert len({g.get("data-color") for g in named.values()}) == 2
    bf16, fp32 = (polyline_points(named[f"5 MB/s, wire {w}"]) for w in ("bf16", "fp32"))
    assert all(b[1] < f[1] for b, f in zip(bf16[1:], fp32[1:], strict=True))  # higher speedup: drawn higher
    one = tmp_path / "one.svg"  # an old CSV's rows beside new fp32 rows: one fp32 series, no wire said
    one.write_text(nodes_chart(rows(None, 5) + rows("fp32", 125)))
    assert [g.get("data-name") for g in series(parse(one))] == ["5 MB/s", "125 MB/s"]
    mixed = tmp_path / "mixed.svg"  # the old rows (fp32) beside bf16 rows: the wire tells them apart
    mixed.write_text(nodes_chart(rows(None, 5) + rows("bf16", 5)))
    assert sorted(g.get("data-name") for g in series(parse(mixed))) == ["5 MB/s, wire bf16", "5 MB/s, wire fp32"]


# ---- ticks, inputs, PNG ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("lo", "hi"), [(0, 0.37), (1.3, 2.41), (0, 7800), (0.5, 0.5), (-3, 12)])
def test_ticks_are_round_and_cover_the_data(lo, hi):
    ticks = nice_ticks(lo, hi)
    check_round_ticks([f"{t:g}" for t in ticks])
    assert ticks[0] <= lo and ticks[-1] >= hi and 3 <= len(ticks) <= 8


def test_mixed_inputs_at_once_and_a_table_of_other_columns_refused(tmp_path, capsys):
    run = write_run(tmp_path / "run.jsonl", 1, 1.0, (0.1, 0.5, 0.4))
    assert main([str(run), str(write_grid(tmp_path / "g.csv")), str(write_sim(tmp_path / "s.csv")),
                 "-o", str(tmp_path / "out")]) == 0  # fmt: skip
    printed = capsys.readouterr().out.split()
    assert [Path(p).name for p in printed] == ["curves.svg", "split.svg", "g-speedup.svg", "g-breakdown.svg",
                                               "s-nodes.svg"]  # fmt: skip
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    assert main([str(other), "-o", str(tmp_path / "out")]) == 2
    assert "neither the grid's columns" in capsys.readouterr().err


def test_unreadable_metrics_is_a_message_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main([str(bad), "-o", str(tmp_path / "out")]) == 2
    assert "cannot read the input" in capsys.readouterr().err


def _png_renderer():
    if shutil.which("rsvg-convert"):
        return lambda svg, png: subprocess.run(["rsvg-convert", "-o", str(png), str(svg)], check=True, timeout=60)
    try:
        import cairosvg
    except ImportError:
        return None
    return lambda svg, png: cairosvg.svg2png(url=str(svg), write_to=str(png))


def test_every_chart_renders_to_png_where_a_renderer_is_installed(tmp_path):
    render = _png_renderer()
    if render is None:
        pytest.skip("no SVG renderer here (rsvg-convert or cairosvg)")
    runs = [write_run(tmp_path / "a.jsonl", 0, 2.0, (0, 0, 2.0)), write_run(tmp_path / "b.jsonl", 1, 1.0, (0, 1, 0))]
    inputs = [*runs, write_grid(tmp_path / "grid.csv"), write_sim(tmp_path / "sim.csv")]
    for svg in plot_files(inputs, tmp_path / "out"):
        png = svg.with_suffix(".png")
        render(svg, png)
        head = png.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n", svg.name
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        assert (width, height) == (round(float(parse(svg).get("width"))), round(float(parse(svg).get("height"))))

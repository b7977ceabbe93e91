"""``tinyconv simulate --against grid.csv``: the model beside the experiment grid's measured runs.

Each grid row (``tinyconv experiment grid``'s CSV: arch, norm, batch, participants, fuse, split,
step_s, comm_s, speedup, link, ...) whose arch, norm and batch the device file has is predicted
with that device copied to every participant, on an ``ethernet`` link (a loopback socket and a
veth pair are both full duplex): ``link`` "loopback" at the file's measured loopback bandwidth
(or ``--loopback-MBps``) and latency, a rate such as "5MB/s" or "40mbit" at that rate and
``--latency-ms``. ``split`` "auto" is by input channels with at most two workers, as
``Cluster`` decides for workers on the master's host (a worker in another network namespace
reports the same host name); the master alone (fuse and split "-") is predicted with the tails
fused. The relative error is predicted / measured - 1.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from typing import Any

from tinyconv.simulate.devices import Device
from tinyconv.simulate.link import MB, Link, parse_rate
from tinyconv.simulate.model import predict

NEEDED = ("arch", "norm", "batch", "participants", "fuse", "split", "step_s", "comm_s", "speedup", "link")


def read_grid(path: str) -> list[dict[str, str]]:
    """The grid's rows; a ValueError if the file is unreadable or lacks a needed column."""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = reader.fieldnames or []
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"cannot read grid CSV {path}: {e}") from None
    missing = [c for c in NEEDED if c not in columns]
    if missing:
        raise ValueError(f"{path} lacks the grid column(s) {', '.join(missing)}")
    return rows


def link_of(label: str, links: dict[str, dict[str, float]], loopback_mbps: float | None, latency_ms: float) -> Link:
    """The link model for a grid row's ``link`` label; a ValueError if it names none."""
    if label.strip().lower() == "loopback":
        measured = links.get("loopback")
        if measured is None and loopback_mbps is None:
            raise ValueError("no loopback bandwidth: measure one with --measure or give --loopback-MBps")
        bw = loopback_mbps if loopback_mbps is not None else measured["bandwidth_MBps"]
        lat = measured["latency_ms"] if measured else 0.0
        return Link("ethernet", bw * MB, lat / 1e3)
    return Link("ethernet", parse_rate(label), latency_ms / 1e3)


def compare_rows(
    grid: Sequence[dict[str, str]],
    devices: Sequence[Device],
    links: dict[str, dict[str, float]],
    loopback_mbps: float | None = None,
    latency_ms: float = 0.0,
) -> tuple[list[dict[str, Any]], list[str]]:
    """(compared rows, why each other row was skipped): each compared row has the measured and
    predicted step_s, comm_s and speedup, and the relative errors step_err, speedup_err."""
    from tinyconv.comm import conv_shapes
    from tinyconv.model import paper_net

    done, skipped = [], []
    for i, r in enumerate(grid, start=2):  # line numbers, the header being line 1
        try:
            n, batch = int(r["participants"]), int(r["batch"])
            device = next((d for d in devices if (d.arch, d.norm, d.batch) == (r["arch"], r["norm"], batch)), None)
            if device is None:
                skipped.append(f"line {i}: no device measured at {r['arch']} {r['norm']} batch {batch}")
                continue
            fuse = "on" if r["fuse"].strip().lower() in ("on", "true", "1", "yes", "-") else "off"
            split = r["split"].strip().lower()
            split = ("channels" if n <= 3 else "kernels") if split == "auto" else split
            split = "kernels" if n == 1 else split  # the master alone: "-", no split
            if split not in ("kernels", "channels"):
                raise ValueError(f"split {r['split']!r}")
            link = link_of(r["link"], links, loopback_mbps, latency_ms)
            convs = conv_shapes(paper_net(r["arch"], "numpy", r["norm"]), batch)
            p = predict(convs, [device], n, fuse, split, link)
            measured = {k: float(r[k]) for k in ("step_s", "comm_s", "speedup")}
        except (ValueError, KeyError) as e:
            skipped.append(f"line {i}: {e}")
            continue
        done.append({"arch": r["arch"], "norm": r["norm"], "batch": batch, "participants": n, "fuse": fuse,
                     "split": split, "link": r["link"], **{f"measured_{k}": v for k, v in measured.items()},
                     "step_s": p.step_s, "comm_s": p.comm_s, "speedup": p.speedup,
                     "step_err": p.step_s / measured["step_s"] - 1,
                     "speedup_err": p.speedup / measured["speedup"] - 1})  # fmt: skip
    return done, skipped


def compare(path: str, devices: Sequence[Device], links: dict[str, dict[str, float]],
            loopback_mbps: float | None, latency_ms: float) -> int:  # fmt: skip
    """Print the comparison table; 0 if any row was compared, 1 if none."""
    from tinyconv.report import format_table

    done, skipped = compare_rows(read_grid(path), devices, links, loopback_mbps, latency_ms)
    for why in skipped:
        print(f"skipped {why}")
    if not done:
        print(f"no row of {path} could be compared")
        return 1
    headers = ("arch", "batch", "P", "fuse", "split", "link", "step s", "predicted", "error", "comm s",
               "predicted", "speedup", "predicted", "error")  # fmt: skip
    table = [(d["arch"], d["batch"], d["participants"], d["fuse"], d["split"], d["link"], d["measured_step_s"],
              d["step_s"], f"{d['step_err']:+.1%}", d["measured_comm_s"], d["comm_s"], d["measured_speedup"],
              d["speedup"], f"{d['speedup_err']:+.1%}") for d in done]  # fmt: skip
    print(format_table(headers, table, title=f"measured ({path}) vs predicted, error = predicted / measured - 1"))
    steps = statistics.median(abs(d["step_err"]) for d in done)
    shared = [abs(d["speedup_err"]) for d in done if d["participants"] > 1]  # alone, 1x is 1x on both sides
    speedups = f", speedup {statistics.median(shared):.1%} over the {len(shared)} with workers" if shared else ""
    print(f"median |error|: step {steps:.1%} over {len(done)} rows{speedups}")
    return 0

"""``tinyconv simulate --against grid.csv``: the model beside the experiment grid's measured runs.

Each grid row (``tinyconv experiment grid``'s CSV: arch, norm, batch, participants, fuse, split,
step_s, comm_s, speedup, link, ...) whose arch, norm and batch the device file has is predicted
with that device copied to every participant, on an ``ethernet`` link (a loopback socket and a
veth pair are both full duplex): ``link`` "loopback" at the file's measured loopback bandwidth
(or ``--loopback-MBps``) and latency, a rate such as "5MB/s" or "40mbit" at that rate and
``--latency-ms``. ``split`` "auto" is by input channels when the row's workers all name one host,
as ``Cluster`` decides for workers on the master's host (a worker in another network namespace
reports the same host name), else by kernels; the master alone (fuse and split "-") is predicted with the tails
fused. A row of emulated devices (the grid's ``--cpu-quota``: its ``devices`` column, "0.5/0.5/0.25")
is predicted on each participant's own device: the one measured inside that CPU quota, or else the
one measured without a quota slowed by 1 / quota (:func:`row_devices`). The relative error is
predicted / measured - 1.

Each row is predicted in its own wire format (the grid's ``wire`` column: fp32, bf16, fp16, adt24,
s8, or adaptive at AWP's start; "-" for the master alone, which sends nothing), so a bf16 run is held
against a bf16 prediction. A grid written before the ``wire`` and ``rebalance`` columns reads fp32
and "on", as the grid itself reads it.

**The split.** With ``rebalance`` "off" the steps ran at the calibrated split, which the row's
``shares`` says ("conv1=85/215 conv2=446/554"): the prediction takes it (``split from`` "row"),
so its bytes are the ones that moved, exactly. Otherwise the prediction takes eq. 1's split on the
device file (``split from`` "eq. 1"): the split by input channels, and ``rebalance`` "on", where
the rebalancer kept moving kernels.

**Rows it cannot predict** are listed with the reason, not given an error that means nothing:
rows of another ``--parallel`` than model (the batch split, ``tinyconv/distributed/replica/``, is not
modelled), rows of an unknown wire format, and ``rebalance`` "on" where the model's own split
leaves the slowest participant's ready time (a worker's compute plus its transfers) more than the
rebalancer's threshold (10 %) behind the mean (``model.ready_lag``): on such a link (5 MB/s, say)
the rebalancer moves kernels towards the master once it has seen that for ``patience`` (3) steps
in a row -- at 5 MB/s it ended with all of them there -- and a fixed split's prediction would be
compared with something else. (Whether a short cell gave it the steps to, the row cannot say: its
``shares`` are the split at the end, and the calibrated one differs from eq. 1's on a loaded
machine anyway; so such a row is left out rather than guessed at.)
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from typing import Any

from tinyconv.lab.simulate.devices import Device, slowed
from tinyconv.lab.simulate.link_model import MB, LinkModel, parse_rate
from tinyconv.lab.simulate.predict import predict, words_of

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


def link_of(
    label: str, links: dict[str, dict[str, float]], loopback_mbps: float | None, latency_ms: float
) -> LinkModel:
    """The link model for a grid row's ``link`` label; a ValueError if it names none."""
    if label.strip().lower() == "loopback":
        measured = links.get("loopback")
        if measured is None and loopback_mbps is None:
            raise ValueError("no loopback bandwidth: measure one with --measure or give --loopback-MBps")
        bw = loopback_mbps if loopback_mbps is not None else measured["bandwidth_MBps"]
        lat = measured["latency_ms"] if measured else 0.0
        return LinkModel("ethernet", bw * MB, lat / 1e3)
    return LinkModel("ethernet", parse_rate(label), latency_ms / 1e3)


def parse_shares(text: str, names: Sequence[str], participants: int) -> list[list[int]] | None:
    """A grid row's ``shares`` ("conv1=85/215 conv2=446/554": each conv layer's kernels per
    participant, the master first) as lists in the order of ``names``; None if it is not that."""
    got: dict[str, list[int]] = {}
    for part in (text or "").split():
        name, _, counts = part.partition("=")
        try:
            got[name] = [int(k) for k in counts.split("/")]
        except ValueError:
            return None
    if sorted(got) != sorted(names) or any(len(got[n]) != participants for n in names):
        return None
    return [got[n] for n in names]


def sharing(r: dict[str, str], n: int) -> tuple[str, str, str]:
    """(parallel, rebalance, wire) of a grid row: "model", "on" and "fp32" where the column is older
    than the file (as ``experiment/table.py`` reads such rows) or "-" (the master alone)."""
    parallel = (r.get("parallel") or "model").strip().lower()
    rebalance = (r.get("rebalance") or "on").strip().lower()
    wire = (r.get("wire") or "fp32").strip().lower()
    if n == 1:
        return "model", "-", "fp32"  # the master alone: no rebalancer, nothing on the wire
    return parallel, rebalance, "fp32" if wire == "-" else wire


def compare_rows(
    grid: Sequence[dict[str, str]],
    devices: Sequence[Device],
    links: dict[str, dict[str, float]],
    loopback_mbps: float | None = None,
    latency_ms: float = 0.0,
) -> tuple[list[dict[str, Any]], list[str]]:
    """(compared rows, why each other row was skipped): each compared row has the measured and
    predicted step_s, comm_s and speedup, and the relative errors step_err, speedup_err; its wire,
    rebalance and where its split came from ("row" or "eq. 1")."""
    from tinyconv.distributed.rebalance import Rebalancer

    rebalancer = Rebalancer()  # its defaults, the grid's: the lag past which it moves kernels, and for how long
    done, skipped = [], []
    for i, r in enumerate(grid, start=2):  # line numbers, the header being line 1
        try:
            row = compare_row(r, devices, link_of(r["link"], links, loopback_mbps, latency_ms), rebalancer)
        except (ValueError, KeyError) as e:
            row = str(e)
        if isinstance(row, str):
            skipped.append(f"line {i}: {row}")
        else:
            done.append(row)
    return done, skipped


def compare_row(r: dict[str, str], devices: Sequence[Device], link: LinkModel, rebalancer: Any) -> dict[str, Any] | str:
    """One grid row measured beside its prediction, or why the model cannot predict it."""
    from tinyconv.distributed.conv_shapes import conv_shapes
    from tinyconv.model import paper_net

    n, batch = int(r["participants"]), int(r["batch"])
    parallel, rebalance, wire = sharing(r, n)
    if parallel != "model":
        return f"--parallel {parallel} splits the batch; the simulator models the split of the convolutions"
    words_of(wire)  # a ValueError naming the formats
    chosen = row_devices(r, devices)
    if isinstance(chosen, str):
        return chosen
    fuse = "on" if r["fuse"].strip().lower() in ("on", "true", "1", "yes", "-") else "off"
    split = r["split"].strip().lower()
    hosts = {w.rpartition("@")[2] for w in (r.get("workers") or "").split()}  # one: channels, as Cluster's auto
    split = ("channels" if len(hosts) <= 1 else "kernels") if split == "auto" else split
    split = "kernels" if n == 1 else split  # the master alone: "-", no split
    if split not in ("kernels", "channels"):
        raise ValueError(f"split {r['split']!r}")
    convs = conv_shapes(paper_net(r["arch"], "numpy", r["norm"]), batch)
    shares = None
    if rebalance == "off" and split == "kernels":  # the calibrated split, kept for every step
        shares = parse_shares(r.get("shares", ""), [c.name for c in convs], n)
    p = predict(convs, chosen[0], n, fuse, split, link, wire, shares)
    if rebalance == "on" and p.lag > rebalancer.threshold:
        return (
            f"{r['arch']} batch {batch} on {n} participants, {wire}, rebalance on at "
            f"{r['link']}: the model's split leaves the slowest {p.lag:.0%} behind the mean "
            f"(transfers included), past the rebalancer's {rebalancer.threshold:.0%}, which "
            f"moves kernels after {rebalancer.patience} such steps: the split may have moved "
            "during the timed steps, a fixed split's prediction would not be comparable "
            "(measure with --rebalance off)"
        )
    measured = {k: float(r[k]) for k in ("step_s", "comm_s", "speedup")}
    return {
        "arch": r["arch"],
        "norm": r["norm"],
        "batch": batch,
        "participants": n,
        "fuse": fuse,
        "split": split,
        "wire": wire,
        "rebalance": rebalance,
        "link": r["link"],
        "split_from": "-" if n == 1 else "row" if shares is not None else "eq. 1",
        "devices": r.get("devices") or "-",
        "devices_from": chosen[1],
        **{f"measured_{k}": v for k, v in measured.items()},
        "step_s": p.step_s,
        "comm_s": p.comm_s,
        "speedup": p.speedup,
        "bytes_sent": p.bytes_sent,
        "bytes_recv": p.bytes_recv,
        "step_err": p.step_s / measured["step_s"] - 1,
        "comm_err": p.comm_s / measured["comm_s"] - 1 if measured["comm_s"] > 0 else None,
        "speedup_err": p.speedup / measured["speedup"] - 1,
    }


def row_devices(r: dict[str, str], devices: Sequence[Device]) -> tuple[list[Device], str] | str:
    """The participants' devices for a grid row, the master first, and where they came from; or why none.
    A row on a core each ("-") takes a device measured without a quota, copied to every participant.
    A row of emulated devices ("0.5/0.5/0.25") takes, for each quota, the device measured inside it
    ("measured"), or else the one measured without a quota, slowed by 1 / quota ("scaled": what a
    quota is meant to do, which the comparison then tests)."""
    here = [d for d in devices if (d.arch, d.norm, d.batch) == (r["arch"], r["norm"], int(r["batch"]))]
    whole = next((d for d in here if d.cores is None), None)
    where = f"at {r['arch']} {r['norm']} batch {r['batch']}"
    text = (r.get("devices") or "-").strip()
    if text == "-":
        return ([whole], "-") if whole else f"no device measured without a CPU quota {where}"
    chosen, scaled = [], False
    for q in (float(x) for x in text.split("/")):
        at = next((d for d in here if d.cores is not None and abs(d.cores - q) < 1e-6), None)
        if at is None and whole is None:
            return f"no device measured at {q:g} cores, nor one without a quota to scale, {where}"
        scaled |= at is None
        chosen.append(at or slowed(whole, 1 / q))
    return chosen, "scaled" if scaled else "measured"


# the comparison table's columns: a row's settings, then each figure measured, predicted and the error
SETTINGS = ("arch", "batch", "participants", "devices", "fuse", "split", "wire", "rebalance", "split_from", "link")
HEADS = {"participants": "P", "split_from": "split from"}
FIGURES = (("step s", "step_s"), ("comm s", "comm_s"), ("speedup", "speedup"))


def compare(
    path: str,
    devices: Sequence[Device],
    links: dict[str, dict[str, float]],
    loopback_mbps: float | None,
    latency_ms: float,
) -> int:
    """Print the comparison table; 0 if any row was compared, 1 if none."""
    from tinyconv.report import format_table

    done, skipped = compare_rows(read_grid(path), devices, links, loopback_mbps, latency_ms)
    for why in skipped:
        print(f"skipped {why}")
    if not done:
        print(f"no row of {path} could be compared")
        return 1
    headers = [*(HEADS.get(k, k) for k in SETTINGS), *(h for head, _ in FIGURES for h in (head, "predicted", "error"))]
    table = [_row(d) for d in done]
    print(format_table(headers, table, title=f"measured ({path}) vs predicted, error = predicted / measured - 1"))
    steps = statistics.median(abs(d["step_err"]) for d in done)
    shared = [abs(d["speedup_err"]) for d in done if d["participants"] > 1]  # alone, 1x is 1x on both sides
    comms = [abs(d["comm_err"]) for d in done if d["comm_err"] is not None]
    speedups = f", speedup {statistics.median(shared):.1%} over the {len(shared)} with workers" if shared else ""
    speedups += f", comm {statistics.median(comms):.1%} over {len(comms)}" if comms else ""
    print(f"median |error|: step {steps:.1%} over {len(done)} rows{speedups}")
    if any(d["devices_from"] == "scaled" for d in done):
        print("devices *: a quota's device not measured inside it, but the device without a quota slowed by 1 / quota")
    if any(d["split_from"] == "row" for d in done):
        print(
            "split from: row = the calibrated split the row kept (--rebalance off, its shares column); "
            "eq. 1 = the model's on the device file"
        )
    return 0


def _row(d: dict[str, Any]) -> list[Any]:
    """One compared row of the table: its settings, then each figure measured, predicted and the error."""
    out = [_devices(d) if key == "devices" else d[key] for key in SETTINGS]
    for _, key in FIGURES:
        error = d[key.removesuffix("_s") + "_err"]
        out += [d[f"measured_{key}"], d[key], "" if error is None else f"{error:+.1%}"]
    return out


def _devices(d: dict[str, Any]) -> str:
    return d["devices"] + ("*" if d["devices_from"] == "scaled" else "")

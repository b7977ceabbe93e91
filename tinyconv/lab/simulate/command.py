"""``tinyconv simulate``: the prediction table and its CSV (the options: ``parser.py``; the model: ``predict.py``,
``link_model.py``)."""

from __future__ import annotations

import argparse
import csv
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinyconv.lab.simulate.devices import Device, load, measure_device, measure_loopback, save, slowed
from tinyconv.lab.simulate.link_model import MB, LinkModel
from tinyconv.lab.simulate.parser import WAYS, ways
from tinyconv.lab.simulate.predict import LABELS, Prediction, predict

# the CSV's columns; the first twelve are the contract the plots read ("batch": the batch size, "nodes": the
# participants, the master included)
COLUMNS = tuple(
    "arch batch split medium bandwidth_MBps latency_ms nodes step_s comm_s conv_s comp_s speedup fuse label wire "
    "norm devices bytes_sent bytes_recv solo_step_s worker_MBps".split()
)


def pick(devices: list[Device], args: argparse.Namespace) -> list[Device]:
    """The devices of the participants in turn, at the run's arch, norm and batch size; ValueError if missing."""
    at = (args.arch, args.norm, args.batch_size)
    here = [d for d in devices if (d.arch, d.norm, d.batch) == at]
    if not here:
        raise ValueError(
            f"no device measured at {args.arch} {args.norm} batch size {args.batch_size} in the file (measure "
            f"one with --measure --device-file FILE --arch {args.arch} --batch-size {args.batch_size})"
        )
    if not args.device_name:
        return here[:1]
    by_name = {d.name: d for d in here}
    missing = [n for n in args.device_name if n not in by_name]
    if missing:
        raise ValueError(
            f"no device {', '.join(missing)} at {args.arch} batch size {args.batch_size}; have {', '.join(by_name)}"
        )
    return [by_name[n] for n in args.device_name]


def rows_for(args: argparse.Namespace, devices: list[Device]) -> list[dict[str, Any]]:
    """One CSV row per split, wire format, medium, bandwidth and worker count; speedup against the model's own
    step of the master alone (solo_step_s is the measured one)."""
    from tinyconv.distributed.conv_shapes import conv_shapes
    from tinyconv.model import paper_net

    convs = conv_shapes(paper_net(args.arch, "numpy", args.norm), args.batch_size)
    own = tuple(w * MB for w in args.worker_bandwidth or ())
    rows = []
    for fuse, split in ways(args):
        for wire in args.wire_precision:
            for medium in args.medium:
                for bw in args.bandwidth:
                    link = LinkModel(medium, bw * MB, args.latency_ms / 1e3, own)
                    for workers in args.workers:
                        p = predict(convs, devices, workers + 1, fuse, split, link, wire)
                        rows.append(row(args, devices, (fuse, split), link, p, wire))
    return rows


def row(
    args: argparse.Namespace, devices: list[Device], way: tuple[str, str], link: LinkModel, p: Prediction, wire: str
) -> dict:
    return {
        "arch": args.arch,
        "batch": args.batch_size,
        "split": way[1],
        "medium": link.medium,
        "bandwidth_MBps": link.bandwidth / MB,
        "latency_ms": link.latency * 1e3,
        "nodes": p.nodes,
        "step_s": p.step_s,
        "comm_s": p.comm_s,
        "conv_s": p.conv_s,
        "comp_s": p.comp_s,
        "speedup": p.speedup,
        "fuse": way[0],
        "label": LABELS[way],
        "wire": wire,
        "norm": args.norm,
        "devices": " ".join(d.name for d in devices),
        "bytes_sent": p.bytes_sent,
        "bytes_recv": p.bytes_recv,
        "solo_step_s": devices[0].solo_step_s,
        "worker_MBps": " ".join(f"{w / MB:g}" for w in link.workers),
    }


def print_tables(rows: list[dict[str, Any]], wires: Sequence[str] = ("fp32",)) -> None:
    """One table per medium and bandwidth: a row per node count (participants); speedup, step and comm seconds
    per split (and wire format, when there are several)."""
    from tinyconv.report import format_table

    def way(r: dict[str, Any]) -> str:
        name = WAYS[r["fuse"], r["split"]]
        return f"{name} {r['wire']}" if len(wires) > 1 else name

    groups: dict[tuple[str, float], dict[int, dict[str, dict]]] = {}
    for r in rows:
        groups.setdefault((r["medium"], r["bandwidth_MBps"]), {}).setdefault(r["nodes"], {})[way(r)] = r
    splits = list(dict.fromkeys(way(r) for r in rows))
    columns = (("speedup", "speedup"), ("step s", "step_s"), ("comm s", "comm_s"))
    headers = ["nodes"] + [f"{head} {s}" for head, _ in columns for s in splits]
    for (medium, bw), by_nodes in groups.items():
        table = [[n] + [cells[s][key] for _, key in columns for s in splits] for n, cells in by_nodes.items()]
        print(format_table(headers, table, title=f"{medium}, {bw:g} MB/s, {rows[0]['latency_ms']:g} ms a message"))
        peaks = []
        for s in splits:
            n, best = max(((n, cells[s]["speedup"]) for n, cells in by_nodes.items()), key=lambda nb: nb[1])
            peaks.append(f"{s} {best:.2f}x at {n}")
        print("best: " + ", ".join(peaks))


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def measure_here(args: argparse.Namespace) -> None:
    """Time this machine into --device-file as --device-name, with a loopback link unless the file's is kept."""
    name = args.device_name[0] if args.device_name else f"{socket.gethostname()}-numpy"
    entry = measure_device(args.arch, args.batch_size, args.norm, args.repeats, name)
    entry["threads"] = int(os.environ.get("OPENBLAS_NUM_THREADS", "0") or 0) or None
    link = measure_loopback()
    print(f"loopback (zmq, tcp 127.0.0.1): {link['bandwidth_MBps']:.0f} MB/s, {link['latency_ms']:.3f} ms")
    # inside a CPU quota the link is the quota's too: a file's loopback measured without one is kept
    path = args.device_file
    keep = entry["cores"] is not None and Path(path).exists() and "loopback" in load(path)[1]
    if keep:
        print(f"inside a quota of {entry['cores']:g} cores: the file's loopback link, measured without one, kept")
    save(path, entry, {} if keep else {"loopback": link})
    print(f"wrote {name} at {args.arch} batch size {args.batch_size} to {path}")


def run(args: argparse.Namespace) -> int:
    """The checked options (``parser.parse``) -> 0, or 2 with one line on stderr for a file that will not do."""
    try:
        if args.measure:
            measure_here(args)
        devices, links = load(args.device_file)
        if args.against:  # every row at its own arch and batch
            from tinyconv.lab.simulate.against import compare

            return compare(args.against, devices, links, args.loopback_mbps, args.latency_ms)
        chosen = [slowed(d, args.slowdown) for d in pick(devices, args)]
        rows = rows_for(args, chosen)
    except ValueError as e:
        print(f"tinyconv simulate: error: {e}", file=sys.stderr)
        return 2
    adaptive = " (adaptive: AWP's start, maps s8, the rest bf16)" if "adaptive" in args.wire_precision else ""
    print(
        f"{args.arch} {args.norm} batch size {args.batch_size}, devices {' '.join(d.name for d in chosen)} in turn "
        f"(the master first), kernels by eq. 1 on their measured times, shards in "
        f"{', '.join(args.wire_precision)}{adaptive}"
    )
    print_tables(rows, args.wire_precision)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_csv(args.out, rows)
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0

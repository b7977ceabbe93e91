"""``tinyconv simulate``: options, the prediction table and its CSV (the model: ``predict.py``, ``link_model.py``)."""

from __future__ import annotations

import argparse
import csv
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from tinyconv.distributed.adaptive_precision import SETTINGS as WIRES  # --wire-precision, as the main job's
from tinyconv.lab.simulate.devices import Device, load, measure_device, measure_loopback, save, slowed
from tinyconv.lab.simulate.link_model import MB, MEDIA, LinkModel
from tinyconv.lab.simulate.predict import LABELS, SPLITS, Prediction, predict

# the CSV's columns; the first twelve are the contract the plots read
COLUMNS = ("arch", "batch", "split", "medium", "bandwidth_MBps", "latency_ms", "nodes", "step_s", "comm_s",
           "conv_s", "comp_s", "speedup", "fuse", "label", "wire", "norm", "devices", "bytes_sent", "bytes_recv",
           "solo_step_s", "worker_MBps")  # fmt: skip
SPLIT_NAMES = {"paper": SPLITS[0], "fused": SPLITS[1], "channels": SPLITS[2]}


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line on stderr and exit status 2 (argparse adds the usage)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog="tinyconv simulate",
        description="Predict a training step's time and speedup for 1 to 128 participants from measured devices "
        "(--measure times this machine), the bytes each split moves and a link model (bandwidth, latency, Wi-Fi's "
        "shared half-duplex channel or switched full-duplex Ethernet); --against holds it against a measured grid.",
    )
    p.add_argument("--devices", metavar="FILE", help="the measured device file to predict from")
    p.add_argument("--measure", metavar="FILE", help="time this machine (one BLAS thread), add it to FILE, predict")
    p.add_argument("--name", help="the measured device's name (default HOST-numpy)")
    p.add_argument("--repeats", type=int, default=3, help="timings per measurement, median (default %(default)s)")
    p.add_argument("--arch", default="300:1000", help="kernel counts C1:C2 (default %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="images per step (default %(default)s)")
    p.add_argument("--norm", default="lrn", choices=("lrn", "batch", "none"), help="(default %(default)s)")
    p.add_argument("--device", nargs="+", metavar="NAME",
                   help="participants' devices in turn, the master's first (default: the file's first at this "
                   "arch, norm and batch, copied to every node)")  # fmt: skip
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128],
                   help="participant counts, the master included (default 1 2 4 ... 128)")  # fmt: skip
    p.add_argument("--bandwidth", type=float, nargs="+", default=[5.0, 12.5, 125.0], metavar="MBPS",
                   help="link bandwidths in MB/s (10^6 bytes; default 5 12.5 125: the paper's Wi-Fi, 100 Mbit and "
                   "1 Gbit Ethernet)")  # fmt: skip
    p.add_argument("--worker-bandwidth", type=float, nargs="+", default=[], metavar="MBPS",
                   help="each worker's own link in MB/s, in worker order (the devices after the master's), "
                   "where one is slower than --bandwidth: Wi-Fi, a shaped link (default: none)")  # fmt: skip
    p.add_argument("--latency-ms", type=float, default=1.0, help="latency per message (default %(default)s ms)")
    p.add_argument("--medium", nargs="+", choices=MEDIA, default=list(MEDIA), help="(default: both)")
    p.add_argument("--split", nargs="+", choices=tuple(SPLIT_NAMES), default=list(SPLIT_NAMES),
                   help="paper: --fuse off --split kernels; fused: tinyconv's tails on the workers; channels: "
                   "conv2 by input channels (default: all three)")  # fmt: skip
    p.add_argument("--wire-precision", nargs="+", choices=WIRES, default=["fp32"], metavar="FORMAT",
                   help=f"the words the shards travel in, one or more of {', '.join(WIRES)}, as the main job's "
                   "--wire-precision and tinyconv comm count them: bf16 and fp16 2 bytes a number, adt24 3, fp32 4, "
                   "s8 1 and a 4-byte scale per plane; adaptive is predicted at AWP's starting formats (weights "
                   "bf16, maps s8, gradients bf16), not its settled end (default fp32)")  # fmt: skip
    p.add_argument("--slowdown", type=float, default=1.0, metavar="F",
                   help="every device F times slower than measured, e.g. to ask how the paper's slower 2017 "
                   "devices fared on the same link (default 1)")  # fmt: skip
    p.add_argument("--out", metavar="CSV", help="also write every prediction here, one row each")
    p.add_argument("--against", metavar="GRID_CSV", help="compare with the measured rows of an experiment grid CSV")
    p.add_argument(
        "--loopback-MBps",
        type=float,
        dest="loopback_mbps",
        help="loopback bandwidth for --against's loopback rows (default: the device file's measured)",
    )
    return p


def check(p: OneLineParser, args: argparse.Namespace) -> None:
    """Refuse nonsense before anything runs."""
    if not (args.devices or args.measure):
        p.error("needs --devices FILE, or --measure FILE to time this machine first")
    if args.batch < 1 or args.repeats < 1 or min(args.nodes) < 1 or not args.slowdown > 0:
        p.error("--batch, --repeats and --nodes must be 1 or more, --slowdown > 0")
    if min(args.bandwidth + args.worker_bandwidth) <= 0 or args.latency_ms < 0 or (args.loopback_mbps or 1) <= 0:
        p.error("bandwidths must be > 0 MB/s and --latency-ms >= 0")
    from tinyconv.model import parse_arch

    try:
        args.arch = ":".join(map(str, parse_arch(args.arch)))
    except ValueError as e:
        p.error(str(e))


def pick(devices: list[Device], args: argparse.Namespace) -> list[Device]:
    """The devices of the participants in turn, at the run's arch, norm and batch; ValueError if missing."""
    here = [d for d in devices if (d.arch, d.norm, d.batch) == (args.arch, args.norm, args.batch)]
    if not here:
        raise ValueError(f"no device measured at {args.arch} {args.norm} batch {args.batch} in the file "
                         f"(measure with --measure FILE --arch {args.arch} --batch {args.batch})")  # fmt: skip
    if not args.device:
        return here[:1]
    by_name = {d.name: d for d in here}
    missing = [n for n in args.device if n not in by_name]
    if missing:
        raise ValueError(f"no device {', '.join(missing)} at {args.arch} batch {args.batch}; have {', '.join(by_name)}")
    return [by_name[n] for n in args.device]


def rows_for(args: argparse.Namespace, devices: list[Device]) -> list[dict[str, Any]]:
    """One CSV row per split, medium, bandwidth and node count; speedup against the model's own step
    of the master alone (solo_step_s is the measured one)."""
    from tinyconv.distributed.conv_shapes import conv_shapes
    from tinyconv.model import paper_net

    convs = conv_shapes(paper_net(args.arch, "numpy", args.norm), args.batch)
    rows = []
    for name in args.split:
        fuse, split = SPLIT_NAMES[name]
        for wire in args.wire_precision:
            for medium in args.medium:
                for bw in args.bandwidth:
                    own = tuple(w * MB for w in args.worker_bandwidth)
                    link = LinkModel(medium, bw * MB, args.latency_ms / 1e3, own)
                    for n in args.nodes:
                        p = predict(convs, devices, n, fuse, split, link, wire)
                        rows.append(row(args, devices, (fuse, split), link, p, wire))
    return rows


def row(args: argparse.Namespace, devices: list[Device], fs: tuple[str, str], link: LinkModel, p: Prediction,
        wire: str) -> dict:  # fmt: skip
    return {"arch": args.arch, "batch": args.batch, "split": fs[1], "medium": link.medium,
            "bandwidth_MBps": link.bandwidth / MB, "latency_ms": link.latency * 1e3, "nodes": p.nodes,
            "step_s": p.step_s, "comm_s": p.comm_s, "conv_s": p.conv_s, "comp_s": p.comp_s, "speedup": p.speedup,
            "fuse": fs[0], "label": LABELS[fs], "wire": wire, "norm": args.norm,
            "devices": " ".join(d.name for d in devices), "bytes_sent": p.bytes_sent, "bytes_recv": p.bytes_recv,
            "solo_step_s": devices[0].solo_step_s,
            "worker_MBps": " ".join(f"{w / MB:g}" for w in link.workers)}  # fmt: skip


def print_tables(rows: list[dict[str, Any]], splits: Sequence[str], wires: Sequence[str] = ("fp32",)) -> None:
    """One table per medium and bandwidth: a row per node count; speedup, step and comm seconds per
    split (and wire format, when there are several)."""
    from tinyconv.report import format_table

    def way(r: dict[str, Any]) -> str:
        name = next(s for s, fs in SPLIT_NAMES.items() if fs == (r["fuse"], r["split"]))
        return f"{name} {r['wire']}" if len(wires) > 1 else name

    splits = [f"{s} {w}" if len(wires) > 1 else s for s in splits for w in wires]
    groups: dict[tuple[str, float], dict[int, dict[str, dict]]] = {}
    for r in rows:
        groups.setdefault((r["medium"], r["bandwidth_MBps"]), {}).setdefault(r["nodes"], {})[way(r)] = r
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


def run(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check(p, args)
    try:
        if args.measure:
            name = args.name or f"{socket.gethostname()}-numpy"
            entry = measure_device(args.arch, args.batch, args.norm, args.repeats, name)
            entry["threads"] = int(os.environ.get("OPENBLAS_NUM_THREADS", "0") or 0) or None
            link = measure_loopback()
            print(f"loopback (zmq, tcp 127.0.0.1): {link['bandwidth_MBps']:.0f} MB/s, {link['latency_ms']:.3f} ms")
            # inside a CPU quota the link is the quota's too: a file's loopback measured without one is kept
            keep = entry["cores"] is not None and Path(args.measure).exists() and "loopback" in load(args.measure)[1]
            if keep:
                print(
                    f"inside a quota of {entry['cores']:g} cores: the file's loopback link, measured without one, kept"
                )
            save(args.measure, entry, {} if keep else {"loopback": link})
            print(f"wrote {name} at {args.arch} batch {args.batch} to {args.measure}")
        devices, links = load(args.devices or args.measure)
        if args.against:  # every row at its own arch and batch
            from tinyconv.lab.simulate.against import compare

            return compare(args.against, devices, links, args.loopback_mbps, args.latency_ms)
        chosen = [slowed(d, args.slowdown) for d in pick(devices, args)]
        rows = rows_for(args, chosen)
    except ValueError as e:
        print(f"tinyconv simulate: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.arch} {args.norm} batch {args.batch}, devices {' '.join(d.name for d in chosen)} in turn "
          "(the master first), kernels by eq. 1 on their measured times, shards in "
          f"{', '.join(args.wire_precision)}" + (" (adaptive: AWP's start, maps s8, the rest bf16)"
                                                 if "adaptive" in args.wire_precision else ""))  # fmt: skip
    print_tables(rows, args.split, args.wire_precision)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_csv(args.out, rows)
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0

"""``tinyconv simulate``'s options, read before numpy loads: ``--measure`` times one BLAS thread, which BLAS
reads once, when numpy loads (``tinyconv/lab/simulate/__init__.py``).

The shared options come from :mod:`tinyconv.options`; the simulator sweeps ``--workers``,
``--fuse``, ``--split``, ``--wire-precision`` and its own link options, each a list.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tinyconv.lab.simulate.link_model import MEDIA
from tinyconv.options import NON_NEGATIVE, POSITIVE, Parser, UsageError, add, add_config, one_of

# a prediction's split, (--fuse, --split), by its name in the tables
WAYS = {
    ("off", "kernels"): "paper",
    ("on", "kernels"): "fused",
    ("off", "channels"): "channels unfused",
    ("on", "channels"): "channels",
}
EXAMPLES = """examples:
    tinyconv simulate --measure --device-file devices.json --arch 300:1000 --batch-size 64   # time this machine
    tinyconv simulate --device-file devices.json --workers 0 1 3 7 --bandwidth 5 125 --out sim.csv
    tinyconv simulate --device-file devices.json --device-name fast slow    # a mix: participants in turn
    tinyconv simulate --device-file devices.json --fuse off --split kernels # the paper's split alone
    tinyconv simulate --device-file devices.json --against grid.csv         # predicted against measured runs

A bad option is one line on stderr and exit 2."""


def build_parser() -> Parser:
    p = Parser(
        prog="tinyconv simulate",
        description="Predict a training step's time and speedup for 1 to 128 participants from measured devices\n"
        "(--measure times this machine), the bytes each split moves and a link model (bandwidth, latency,\n"
        "Wi-Fi's shared half-duplex channel or switched full-duplex Ethernet); --against holds it against\n"
        "a measured grid.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _devices(p)
    _sweep(p)
    _link(p)
    add_config(p)
    return p


def _devices(p: Parser) -> None:
    g = p.add_argument_group("the devices")
    add(g, "device_file", helps={"device_file": "to predict from; with --measure, the file this machine is added to"})
    g.add_argument(
        "--measure",
        action="store_true",
        help="time this machine (one BLAS thread) at --arch, --norm and --batch-size, add it to --device-file as "
        "--device-name, then predict",
    )
    add(
        g,
        "device_name",
        many=("device_name",),
        helps={
            "device_name": "with --measure, the name to record (one; default HOST-numpy); else the participants' "
            "devices in turn, the master's first (default: the file's first at this arch, norm and batch size, "
            "for every participant)"
        },
    )
    add(g, "repeats", defaults={"repeats": 3}, helps={"repeats": "with --measure"})
    add(
        g,
        "slowdown",
        defaults={"slowdown": 1.0},
        helps={"slowdown": "here every device, e.g. to ask how the paper's slower 2017 devices fared on the same link"},
    )


def _sweep(p: Parser) -> None:
    g = p.add_argument_group("the step and the splits (each a list: one prediction for every combination)")
    add(g, "arch", "batch_size", "norm", defaults={"arch": "300:1000", "batch_size": 64, "norm": "lrn"})
    add(
        g,
        "workers",
        "fuse",
        "split",
        "wire_precision",
        many=("workers", "fuse", "split", "wire_precision"),
        defaults={
            "workers": [0, 1, 3, 7, 15, 31, 63, 127],
            "fuse": ["off", "on"],
            "split": ["kernels", "channels"],
            "wire_precision": ["fp32"],
        },
        helps={
            "workers": "participants = workers + 1: 1 to 128 nodes by default",
            "fuse": "--fuse off --split kernels is the paper's split",
            "split": "auto is kernels here, the workers being on other machines",
            "wire_precision": "adaptive is predicted at AWP's starting formats (weights bf16, maps s8, gradients "
            "bf16), not its settled end",
        },
    )


def _link(p: Parser) -> None:
    g = p.add_argument_group("the link")
    g.add_argument(
        "--bandwidth",
        type=POSITIVE,
        nargs="+",
        default=[5.0, 12.5, 125.0],
        metavar="MBPS",
        help="link bandwidths in MB/s (10^6 bytes; default 5 12.5 125: the paper's Wi-Fi, 100 Mbit and 1 Gbit "
        "Ethernet)",
    )
    g.add_argument(
        "--worker-bandwidth",
        type=POSITIVE,
        nargs="+",
        metavar="MBPS",
        help="each worker's own link in MB/s, in worker order (the devices after the master's), where one is "
        "slower than --bandwidth: Wi-Fi, a shaped link (default: none)",
    )
    g.add_argument(
        "--latency-ms", type=NON_NEGATIVE, default=1.0, metavar="MS", help="latency per message (default 1 ms)"
    )
    g.add_argument(
        "--medium",
        nargs="+",
        type=one_of(MEDIA),
        default=list(MEDIA),
        metavar="MEDIUM",
        help="wifi (one shared half-duplex channel) or ethernet (switched full duplex), or both (default: both)",
    )
    add(g, "out", helps={"out": "every prediction as CSV, one row each"})
    g.add_argument("--against", metavar="GRID_CSV", help="compare with the measured rows of an experiment grid CSV")
    g.add_argument(
        "--loopback-MBps",
        type=POSITIVE,
        dest="loopback_mbps",
        metavar="MBPS",
        help="loopback bandwidth for --against's loopback rows (default: the device file's measured)",
    )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The checked options; a :class:`UsageError` for a bad one, before anything runs."""
    argv, see = list(argv), "(see tinyconv simulate --help)"
    if "--measure" in argv[:-1] and not argv[argv.index("--measure") + 1].startswith("-"):
        raise UsageError(f"--measure is a switch: --measure --device-file FILE times this machine into FILE {see}")
    if "--device" in argv:  # the simulator's old spelling; elsewhere --device is an OpenCL device
        raise UsageError(f"--device is now --device-name: the participants' devices in the file, in turn {see}")
    args = build_parser().parse_args(argv)
    if args.print_config:
        return args
    if not args.device_file:
        raise UsageError(f"needs --device-file FILE, with --measure to time this machine into it first {see}")
    if args.measure and args.device_name and len(args.device_name) > 1:
        raise UsageError(f"--measure records one device; got --device-name {' '.join(args.device_name)} {see}")
    return args


def ways(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (fuse, split) pairs to predict: every --fuse with every --split, auto as kernels."""
    splits = dict.fromkeys("kernels" if s == "auto" else s for s in args.split)
    return [(fuse, split) for split in splits for fuse in dict.fromkeys(args.fuse)]

"""The ``tinyconv`` command: one entry point for the things a user runs by hand (``tinyconv --help`` lists them).

Training is ``tinyconv train`` (``python examples/cifar10_dist.py`` runs the same). Nothing heavy is imported
before the subcommand is known: ``worker --threads`` must set BLAS thread counts
before numpy loads.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from importlib import import_module

COMMANDS = {  # name -> what it does; `tinyconv NAME --help` says how
    "train": "train the paper's CNN on CIFAR-10, its convolutions split across workers (the main job)",
    "worker": "serve convolution shards for a master",
    "devices": "list the backends and every OpenCL platform/device this machine can see",
    "backends": "the same as devices",
    "conformance": "run the backend conformance suite",
    "plot": "draw charts from metrics files, the grid's CSV or the simulator's",
    "keygen": "write a CURVE key pair, NAME.key (public) and NAME.key_secret",
    "comm": "the bytes a step moves: the paper's eq. 2 beside tinyconv's count",
    "experiment": "run the paper's speedup grid: archs x batches x participants",
    "simulate": "predict step time and speedup to 128 nodes from measured devices and a link model",
}
MAINS = {  # the commands whose main(argv) lives elsewhere, imported only when run
    "train": "tinyconv.commands.train",
    "worker": "tinyconv.distributed.worker.main",
    "comm": "tinyconv.lab.eq2",
    "experiment": "tinyconv.lab.experiment",
    "simulate": "tinyconv.lab.simulate",
    "plot": "tinyconv.lab.plot",
}


def _usage() -> str:
    lines = ["usage: tinyconv COMMAND [options]   (tinyconv --version; tinyconv COMMAND --help)", "", "commands:"]
    lines += [f"  {name:12s} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def devices(argv: Sequence[str] = ()) -> int:
    """Print every registered backend and every OpenCL device; never a traceback."""
    argparse.ArgumentParser(
        prog="tinyconv devices",
        description="List the registered backends and every OpenCL platform and device this machine can see, "
        "with the P:D index that --device takes.",
    ).parse_args(argv)
    from backends import available_backends

    print("backends:", ", ".join(available_backends()))
    try:
        from backends.opencl.device import list_devices
    except ImportError as e:
        print(f"OpenCL: unavailable ({e}); install pyopencl, and a runtime such as pocl-binary-distribution")
        return 0
    try:
        found = list_devices()
    except RuntimeError as e:
        print(f"OpenCL: {e}")
        return 0
    if not found:
        print("OpenCL: no devices; `pip install pocl-binary-distribution` gives a CPU device, a GPU needs its driver")
    for d in found:
        print(
            f"  {d['platform_index']}:{d['device_index']}  {d['name']}  [{d['kind']}, {d['compute_units']} CUs, "
            f"{d['global_mem_bytes'] / 2**30:.1f} GiB]  platform: {d['platform']}"
        )
    print("choose one with --device P:D (or a name substring), or TINYCONV_OPENCL_DEVICE")
    return 0


def keygen(argv: Sequence[str]) -> int:
    """``tinyconv keygen DIR --name NAME``: a key pair for the master or a worker, never over an old one."""
    p = argparse.ArgumentParser(
        prog="tinyconv keygen",
        description="Write a CURVE key pair: DIR/NAME.key, the public key to hand out (a worker's goes into "
        "the master's --authorized-keys folder, the master's to every worker's --master-key), and "
        "DIR/NAME.key_secret, which stays on this machine (mode 0600).",
    )
    p.add_argument("directory", help="where to write the two files (made if missing)")
    p.add_argument("--name", default="tinyconv", help="the files' name (default %(default)s)")
    args = p.parse_args(argv)
    from transports.curve import generate_keys

    try:
        public, secret = generate_keys(args.directory, args.name)
    except (OSError, ValueError) as e:
        print(f"tinyconv keygen: {e}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"tinyconv {version('tinyconv')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            print("tinyconv (not installed: `make setup` or `pip install -e .`)")
        return 0
    command, rest = args[0], args[1:]
    if command in MAINS:
        return import_module(MAINS[command]).main(rest)
    if command in ("devices", "backends"):
        return devices(rest)
    if command == "conformance":
        from backends.conformance.runner import main as conformance_main

        return conformance_main(rest, prog="tinyconv conformance")
    if command == "keygen":
        return keygen(rest)
    close = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f"; did you mean `tinyconv {close[0]}`?" if close else ""
    print(f"tinyconv: unknown command {command!r}{hint}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The command line of ``tinyconv experiment grid``: options, checks, the loop over the cells.

Bad input (an architecture that is not C1:C2, more participants than cores for local workers,
an --out that cannot be written or resumed) ends with exit code 2 and one line, before any
worker starts. A cell that fails ends the grid with exit code 1 and one line; the cells before
it are in the CSV, and the same command resumes after them.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from tinyconv.distributed.worker.main import THREAD_ENV_VARS
from tinyconv.lab.experiment.grid import BY_IMAGES, DATA_WIRE, PARALLELS, REBALANCES, Cell, cells, cost, pending

PROG = "tinyconv experiment grid"
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


class BadInput(ValueError):
    """Input the grid refuses before it starts: one line for the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum}")
        return value

    return parse


def _cores(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of cores") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a device is a share of one core, > 0 and at most 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    from tinyconv.distributed.adaptive_precision import SETTINGS as WIRE_PRECISIONS
    from tinyconv.distributed.shard.by_channels import PIPELINE
    from tinyconv.model import NORMS, PAPER_ARCHS  # imports numpy: after main() set the BLAS threads

    p = _Parser(prog="tinyconv experiment", description="The paper's experiments, one command each.")
    sub = p.add_subparsers(dest="experiment", required=True, parser_class=_Parser)
    g = sub.add_parser("grid", help="the speedup grid: archs x batches x participants x repeats, one CSV row a run",
                       description="Time training steps for every architecture x batch x participant count (x norm, "
                       "backend, fuse, split, parallel, rebalance, wire precision, pipeline) x repeat: the master "
                       "alone, and the master with P-1 workers, their steps alternated; one CSV and JSON row per run; "
                       "resumable.",
                       epilog="A re-run with the same --out skips the cells already in it (same arch, norm, batch, "
                       "participants, fuse, split, backend, parallel, rebalance, wire, pipeline, repeat and "
                       "--link-label; a CSV written before a column existed resumes as what it ran: parallel model, "
                       "rebalance on, wire fp32, pipeline 0) and appends the rest; a file "
                       "measured with other --steps, --warmup, --settle or --transport is refused, not mixed. The "
                       "progress bar's time left is the cost still to run (conv multiply-adds x steps, in Gflop) "
                       "over the average rate so far.")  # fmt: skip
    _add_cell_options(g, PAPER_ARCHS, NORMS, WIRE_PRECISIONS, PIPELINE)
    _add_worker_options(g)
    return p


def _add_cell_options(g: argparse.ArgumentParser, archs: Sequence[str], norms: Sequence[str],
                      wire_precisions: Sequence[str], pipeline: int) -> None:  # fmt: skip
    """What the grid's cells vary: the networks, batches, participants and every option of the step."""
    g.add_argument("--archs", nargs="+", default=list(archs), metavar="C1:C2", help="default: the paper's four")
    g.add_argument("--batches", nargs="+", type=_int(1), default=[64, 128, 256], metavar="N")
    g.add_argument("--participants", nargs="+", type=_int(1), metavar="P",
                   help="1 = the master alone, P = the master + P-1 workers (default: 1 2, or 1 to the number "
                   "of --devices)")  # fmt: skip
    g.add_argument("--repeats", type=_int(1), default=1, help="rounds over the whole grid (default %(default)s)")
    g.add_argument("--steps", type=_int(1), default=3, help="timed steps per side of a cell (default %(default)s)")
    g.add_argument("--warmup", type=_int(0), default=2, help="untimed steps first (default %(default)s)")
    g.add_argument("--settle", type=_int(0), default=1,
                   help="untimed steps after each solo/distributed switch (default %(default)s). 0 saves time but "
                        "times every step right after a switch, on the memory and caches the other side left: "
                        "300:1000 at batch 64 measured 1.61x with --settle 0 --warmup 3, 1.91x with --settle 1 "
                        "--warmup 5 (2-core Xeon, the same hour)")  # fmt: skip
    g.add_argument("--norm", nargs="+", choices=norms, default=["lrn"], help="one or more (default lrn)")
    g.add_argument("--backend", nargs="+", default=["numpy"], help="one or more, master and workers (default numpy)")
    g.add_argument("--fuse", nargs="+", choices=("on", "off"), default=["on"], help="one or both (default on)")
    g.add_argument("--split", nargs="+", choices=("auto", "channels", "kernels"), default=["auto"],
                   help="one or more (default auto)")  # fmt: skip
    g.add_argument("--parallel", nargs="+", choices=PARALLELS, default=["model"],
                   help="model (the paper's split of the convolutions), data (whole replicas, the batch split; "
                   "tinyconv/distributed/replica/), hybrid (the convolutions by images, the classifier on the "
                   "master), or several, to compare them (default model)")  # fmt: skip
    g.add_argument("--rebalance", nargs="+", choices=REBALANCES, default=["on"],
                   help="on: the rebalancer follows the measured times during the steps (warm-up included); off: "
                   "the calibrated split is kept for every step, e.g. a slow link's steady state; or both "
                   "(default on)")  # fmt: skip
    g.add_argument("--wire-precision", nargs="+", choices=wire_precisions, default=["fp32"], metavar="FORMAT",
                   help=f"the words the shards travel in, one or more of {', '.join(wire_precisions)} "
                   f"(tinyconv/distributed/wire_precision.py; default fp32); --parallel data and hybrid run at "
                   f"{DATA_WIRE} only, their cells at the others are left out")  # fmt: skip
    g.add_argument("--pipeline", nargs="+", type=_int(0), default=[pipeline], metavar="IMAGES",
                   help=f"images per chunk of a layer split by input channels, one or more (0: the whole batch at "
                   f"once; default {pipeline}); model-parallel cells only, the others say -")  # fmt: skip


def _add_worker_options(g: argparse.ArgumentParser) -> None:
    """Where the workers come from, how long to wait for them, and where the rows go."""
    g.add_argument("--transport", choices=("zmq", "inproc"), default="zmq",
                   help="zmq: worker processes (default); inproc: threads, for tests, not for timing")  # fmt: skip
    g.add_argument("--bind", metavar="ADDR", help="the master's address (default tcp://127.0.0.1:0, a free "
                   "loopback port; tcp://*:5555 with --external-workers); local workers connect to it")  # fmt: skip
    g.add_argument("--devices", nargs="+", type=_cores, metavar="CORES",
                   help="emulated devices: each participant, the master's first, in a cgroup CPU quota of CORES of "
                   "one core, e.g. 0.5 0.5 0.5 0.5 (four half-core devices on two cores) or 1 0.5 0.25; the master "
                   "alone runs at the first. Local worker processes; needs root and a cgroup cpu controller. A quota "
                   "slices a core's time: the devices still share its caches and the memory bandwidth")  # fmt: skip
    g.add_argument("--worker-prefix", metavar="CMD", help="put in front of each local worker's command line, "
                   "before its taskset, e.g. 'ip netns exec tinyconv-w'")  # fmt: skip
    g.add_argument(
        "--external-workers",
        type=_int(1),
        metavar="N",
        help="wait for N `tinyconv worker --serve` processes to connect instead of starting local ones",
    )
    g.add_argument("--insecure", action="store_true", help="with --external-workers: bind beyond loopback without keys")
    g.add_argument("--timeout", type=_int(1), default=120, help="seconds to wait for the workers (default %(default)s)")
    g.add_argument("--link-label", default="loopback", help="the link column, e.g. '5MB/s wifi' (default loopback)")
    g.add_argument("--out", default="runs/grid.csv", help="the CSV (default %(default)s); the JSON goes beside it")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (the line per cell stays)")


def main(argv: Sequence[str] | None = None) -> int:
    """``tinyconv experiment grid ...``: 0 when done, 2 for bad input, 1 when a cell fails."""
    for var in THREAD_ENV_VARS:  # one BLAS thread per process, as the paper's CPUs; read when numpy loads
        os.environ[var] = "1"
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help (0) or a bad option (2, its one line printed): a code, as main promises
        return int(e.code or 0)
    try:
        grid, rows = prepare(args)
    except BadInput as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run_grid(args, grid, rows)


def prepare(args: argparse.Namespace) -> tuple[list[Cell], list[dict[str, Any]]]:
    """Check the options and the --out file; the grid's cells and the rows already measured."""
    from backends import available_backends
    from tinyconv.lab.experiment import table
    from tinyconv.lab.experiment.workers import cores
    from tinyconv.model import parse_arch

    for arch in args.archs:
        try:
            parse_arch(arch)
        except ValueError as e:
            raise BadInput(f"unknown architecture: {e}") from None
    unknown = [b for b in args.backend if b not in available_backends()]
    if unknown:
        raise BadInput(f"unknown backend {', '.join(unknown)}; known: {', '.join(available_backends())}")
    if args.participants is None:
        args.participants = list(range(1, len(args.devices) + 1)) if args.devices else [1, 2]
    check_devices(args, cores())
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a"):
            pass
        rows, cut = table.read_rows(out)
        table.check_settings(out, rows, settings(args))
    except table.GridFileError as e:
        raise BadInput(str(e)) from None
    except OSError as e:
        raise BadInput(f"cannot write --out {args.out}: {e.strerror or e}") from None
    if cut:
        print(f"{out}: dropped a half-written last line (a run cut short); that cell runs again")
    grid = cells(args.archs, args.batches, args.participants, args.repeats, args.norm, args.fuse, args.split,
                 args.backend, args.parallel, args.rebalance, args.wire_precision, args.pipeline,
                 args.devices or ())  # fmt: skip
    narrowed = [w for w in args.wire_precision if w != DATA_WIRE]
    by_images = " and ".join(m for m in args.parallel if m in BY_IMAGES)
    if by_images and max(args.participants) > 1 and narrowed:
        print(f"{DATA_WIRE} only for --parallel {by_images}: their cells at --wire-precision {' '.join(narrowed)} "
              "are left out")  # fmt: skip
    if not grid:
        raise BadInput(f"no cells: {DATA_WIRE} is the only --wire-precision for --parallel {by_images}; add "
                       f"{DATA_WIRE} or --parallel model")  # fmt: skip
    return grid, rows


def check_devices(args: argparse.Namespace, cores: Sequence[int]) -> None:
    """BadInput unless the participants asked for can be had: cores for local workers (or room for their
    --devices' quotas), or enough external ones."""
    most, n_cores = max(args.participants), len(cores)
    local = args.transport == "zmq" and not args.external_workers
    if args.devices:
        _check_quotas(args.devices, most, local, cores)
        return
    if args.worker_prefix and not local:
        raise BadInput("--worker-prefix is for local worker processes (not --transport inproc or --external-workers)")
    if args.bind and args.transport == "inproc":
        raise BadInput("--bind needs --transport zmq: in-process workers are threads")
    if args.external_workers and args.transport == "inproc":
        raise BadInput("--external-workers needs --transport zmq")
    if args.external_workers and most - 1 > args.external_workers:
        raise BadInput(
            f"--participants {most} needs {most - 1} workers, --external-workers says {args.external_workers}"
        )
    if local and most > n_cores:
        raise BadInput(
            f"--participants {most} needs {most} cores (the master and {most - 1} pinned local workers), this "
            f"process may use {n_cores}; connect workers from elsewhere with --external-workers N"
        )


def _check_quotas(devices: Sequence[float], most: int, local: bool, cores: Sequence[int]) -> None:
    from tinyconv.lab.experiment.cpu_quota import unavailable
    from tinyconv.lab.experiment.workers import place

    if not local:
        raise BadInput("--devices are local worker processes in CPU quotas: not --transport inproc or "
                       "--external-workers")  # fmt: skip
    if most > len(devices):
        raise BadInput(f"--participants {most} needs {most} --devices, {len(devices)} given")
    try:
        place(devices[:most], cores)
    except ValueError as e:
        raise BadInput(f"--devices: {e} this process may use; give smaller quotas or fewer devices") from None
    why = unavailable()
    if why:
        raise BadInput(f"--devices: CPU quotas {why}")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The non-key settings every row of one CSV must share (``table.SETTINGS``)."""
    return {"steps": args.steps, "warmup": args.warmup, "settle": args.settle, "transport": args.transport}


def run_grid(args: argparse.Namespace, grid: list[Cell], rows: list[dict[str, Any]]) -> int:
    """Run the pending cells (workers started once), a row each; then the summary. The exit code."""
    from tinyconv.distributed.heap import keep_freed_memory
    from tinyconv.lab.experiment import table
    from tinyconv.lab.experiment.workers import grid_workers, split_prefix

    out = Path(args.out)
    todo = pending(grid, table.done_keys(rows), args.link_label)
    print(f"{len(grid)} cells, {len(grid) - len(todo)} already in {out}, {len(todo)} to run")
    if todo:
        keep_freed_memory()  # as the example, bench_speedup and the worker do (tinyconv/distributed/heap.py)
        n_workers = max(c.participants for c in todo) - 1
        try:
            with grid_workers(n_workers, args.transport, args.backend[0], bind=args.bind,
                              external=bool(args.external_workers), prefix=split_prefix(args.worker_prefix),
                              insecure=args.insecure, timeout=args.timeout,
                              devices=args.devices or ()) as (transport, workers):  # fmt: skip
                _loop(args, todo, rows, transport, workers)
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted; the finished cells are in {out}: the same command resumes", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as e:  # a worker lost or a timeout: one line, the rows so far kept
            print(f"{PROG}: {type(e).__name__}: {e}; the finished cells are in {out}: the same command resumes",
                  file=sys.stderr)  # fmt: skip
            return EXIT_FAILED
    table.write_json(table.json_path(out), rows)
    mine = [r for r in rows if r["link"] == args.link_label]
    if mine:
        print(table.summary(mine))
    return 0


def _loop(args: argparse.Namespace, todo: list[Cell], rows: list[dict[str, Any]], transport, workers) -> None:
    """Each pending cell in order: measured, appended to the CSV and JSON, a line printed."""
    from tqdm import tqdm

    from backends import get_backend
    from tinyconv.distributed.heap import release_freed_memory
    from tinyconv.lab.experiment import table
    from tinyconv.lab.experiment.run import run_cell
    from tinyconv.lab.experiment.workers import master_pinned
    from tinyconv.model import parse_arch

    # after the workers started (they must not inherit the master's core); its cores back at the end
    pinned = master_pinned() if args.transport != "inproc" else nullcontext()
    out, host = Path(args.out), cpu_model()
    backends = {name: get_backend(name) for name in args.backend}
    weights = [cost(c, *parse_arch(c.arch), args.steps, args.warmup, args.settle) for c in todo]
    bar = tqdm(total=sum(weights), desc="grid", disable=True if args.no_progress else None, smoothing=0,
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} Gflop [{elapsed}<{remaining}]")  # fmt: skip
    with pinned, bar:
        for i, (cell, weight) in enumerate(zip(todo, weights, strict=True), 1):
            bar.set_postfix_str(cell.label())
            # the cells before give their freed heap back: kept (keep_freed_memory), the master alone's
            # peak at 500:1500, batch 256 went on into the model cell's calibration, out of 24 GB
            release_freed_memory()
            measured = run_cell(cell, backends[cell.backend], transport, workers, args.steps, args.warmup, args.settle)
            used = workers[: cell.participants - 1]
            row = {**vars(cell), **measured, "transport": args.transport, "steps": args.steps, "warmup": args.warmup,
                   "settle": args.settle, "link": args.link_label, "host": host,
                   "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "workers": " ".join(f"{w.backend}@{w.hostname}" for w in used)}  # fmt: skip
            table.append_row(out, row)
            rows.append(row)
            table.write_json(table.json_path(out), rows)
            bar.write(f"[{i}/{len(todo)}] {cell.label()}: {cell_line(row)}")
            bar.update(weight)


def cell_line(row: dict[str, Any]) -> str:
    """What a finished cell measured, in one line."""
    line = f"step {row['step_s']:.3g} s"
    if row["participants"] > 1:
        line += f" (alone {row['solo_step_s']:.3g} s) speedup {row['speedup']:.2f}x"
        if row["devices"] != "-" and row["speeds"]:  # the ideal: every device's speed over the master's, summed
            line += f" of {sum(float(v) for v in row['speeds'].split('/')):.2f}x ideal (speeds {row['speeds']})"
    line += f"; comm {row['comm_s']:.3g} conv {row['conv_s']:.3g} comp {row['comp_s']:.3g} s"
    if row["bytes_sent"]:
        line += f"; {row['bytes_sent'] / 1e6:.1f} MB out {row['bytes_recv'] / 1e6:.1f} MB back"
    return line + f"; shares {row['shares']}"


def cpu_model() -> str:
    """This machine's CPU model, for the host column."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"

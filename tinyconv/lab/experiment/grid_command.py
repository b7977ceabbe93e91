"""The command line of ``tinyconv experiment grid``: options, the loop over the cells.

The options are :mod:`tinyconv.options`' wherever the concept is shared (``--arch``, ``--batch-size``,
``--workers``, ``--timed-steps`` ...; a sweep takes a list of them), and ``--config FILE`` / ``--print-config``
keep a grid's settings in a file. Bad input (an architecture that is not C1:C2, more workers than cores for
local ones, an --out that cannot be written or resumed: ``grid_checks.py``) ends with exit code 2 and one
line, before any worker starts. A cell that fails ends the grid with exit code 1 and one line; the cells before
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
from typing import Any

from tinyconv.distributed.worker.main import THREAD_ENV_VARS
from tinyconv.lab.experiment.grid import DATA_WIRE, PIPELINE, Cell, cost, pending
from tinyconv.lab.experiment.grid_checks import PROG, BadInput, fill_defaults, prepare, settings
from tinyconv.options import PAPER_ARCHS, Parser, UsageError, add, add_config, config_text, count

EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130
CELLS = {"arch": list(PAPER_ARCHS), "batch_size": [64, 128, 256], "workers": None}  # workers: fill_defaults'
STEP = {  # how each step is computed and shared, and the defaults: a list of values each
    "norm": ["lrn"],
    "backend": ["numpy"],
    "fuse": ["on"],
    "split": ["auto"],
    "parallel": ["model"],
    "rebalance": ["on"],
    "wire_precision": ["fp32"],
}
RENAMED = {  # the grid's old spellings that mean something else in other commands (options.RENAMED has the rest)
    "--steps": "--timed-steps",
    "--warmup": "--untimed-steps",
}
EXPERIMENTS = {"grid": "the speedup grid: archs x batch sizes x worker counts x repeats, one CSV row a run"}
ABOUT = (
    "Time training steps for every architecture x batch size x worker count (x norm, backend, fuse, split, "
    "parallel, rebalance, wire precision, pipeline) x repeat: the master alone, and the master with its "
    "workers, their steps alternated; one CSV and JSON row per run; resumable."
)
RESUMING = (
    "A re-run with the same --out skips the cells already in it (same arch, norm, batch size, workers, fuse, "
    "split, backend, parallel, rebalance, wire, pipeline, cpu quota, repeat and --link-label; a CSV written before "
    "a column existed resumes as what it ran: parallel model, rebalance on, wire fp32, pipeline 0) and appends "
    "the rest; a file measured with other --timed-steps, --untimed-steps, --settle or --transport is refused, not "
    "mixed. The CSV's participants column is --workers + 1 (the master and its workers). The progress bar's time "
    "left is the cost still to run (conv multiply-adds x steps, in Gflop) over the average rate so far."
)


def build_parser() -> Parser:
    """``tinyconv experiment grid``'s options (imports no numpy: main() sets the BLAS threads first)."""
    p = Parser(prog=PROG, description=ABOUT, epilog=RESUMING)
    _cell_options(p)
    _step_options(p)
    _worker_options(p)
    add_config(p)
    return p


def _cell_options(p: Parser) -> None:
    """What the grid's cells vary: the networks, batch sizes and worker counts, and the steps they time."""
    g = p.add_argument_group("the cells (a list of values each: every combination is a cell)")
    workers = "one or more (default 0 1, or 0 to one less than the --cpu-quota devices)"
    add(g, *CELLS, many=CELLS, defaults=CELLS, helps={"workers": workers})
    add(
        g,
        "repeats",
        "timed_steps",
        "untimed_steps",
        defaults={"repeats": 1, "timed_steps": 3, "untimed_steps": 2},
        helps={
            "repeats": "here rounds over the whole grid, a row each, of which the summary takes the median",
            "timed_steps": "per side of a cell: the master alone and the split, alternated step by step",
        },
    )
    settle = (
        "untimed steps after each switch between the master alone and the split (default 1). 0 saves time but "
        "times every step right after a switch, on the memory and caches the other side left: 300:1000 at batch "
        "size 64 measured 1.61x with --settle 0 --untimed-steps 3, 1.91x with --settle 1 --untimed-steps 5 (2-core "
        "Xeon, the same hour)"
    )
    g.add_argument("--settle", type=count(0), default=1, metavar="N", help=settle)


def _step_options(p: Parser) -> None:
    """How each step is computed and shared: one or more values each, every one a cell of its own."""
    g = p.add_argument_group("the step (one or more values each)")
    helps = {
        "backend": "the master's and its workers'",
        "rebalance": "on follows the measured times during the steps (untimed ones included); off keeps the "
        "calibrated split for every step, e.g. a slow link's steady state",
        "wire_precision": f"--parallel data and hybrid run at {DATA_WIRE} only: their cells at the others are left out",
    }
    add(g, *STEP, many=STEP, defaults=STEP, helps=helps)
    pipeline = (
        f"images per chunk of a layer split by input channels (0: the whole batch at once; default {PIPELINE}); "
        "model-parallel cells only, the others say -"
    )
    g.add_argument("--pipeline", nargs="+", type=count(0), default=[PIPELINE], metavar="IMAGES", help=pipeline)


def _worker_options(p: Parser) -> None:
    """Where the workers come from, how long to wait for them, and where the rows go."""
    g = p.add_argument_group("the workers and the output")
    helps = {
        "transport": "here zmq (worker processes) or inproc (threads, for tests, not for timing)",
        "bind": "default tcp://127.0.0.1:0, a free loopback port; tcp://*:5555 with --external-workers; local "
        "workers connect to it",
        "cpu_quota": "the master alone runs at the first. Local worker processes; needs root and a cgroup cpu "
        "controller. A quota slices a core's time: the devices still share its caches and the memory bandwidth",
    }
    add(g, "transport", "bind", "cpu_quota", many={"cpu_quota"}, defaults={"transport": "zmq"}, helps=helps)
    g.add_argument(
        "--worker-prefix",
        metavar="CMD",
        help="put in front of each local worker's command line, before its taskset, e.g. 'ip netns exec tinyconv-w'",
    )
    g.add_argument(
        "--external-workers",
        action="store_true",
        help="zmq: start no workers here; wait for as many `tinyconv worker --serve` as the largest --workers",
    )
    timeout = {"start_timeout": "here the workers' hello"}
    add(g, "insecure", "start_timeout", defaults={"start_timeout": 120.0}, helps=timeout)
    g.add_argument(
        "--link-label", default="loopback", metavar="TEXT", help="the link column, e.g. '5MB/s wifi' (default loopback)"
    )
    add(
        g,
        "out",
        "no_progress",
        defaults={"out": "runs/grid.csv"},
        helps={
            "out": "here the CSV, with the JSON beside it",
            "no_progress": "here the bar: the line per finished cell stays",
        },
    )


def experiments_parser() -> Parser:
    """``tinyconv experiment``: the list of experiments, for --help and for a name that is not one."""
    p = Parser(prog="tinyconv experiment", description="The paper's experiments, one command each.")
    sub = p.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name, about in EXPERIMENTS.items():
        sub.add_parser(name, help=about, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``tinyconv experiment grid ...``: 0 when done, 2 for bad input, 1 when a cell fails."""
    for var in THREAD_ENV_VARS:  # one BLAS thread per process, as the paper's CPUs; read when numpy loads
        os.environ[var] = "1"
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = PROG if argv[:1] == ["grid"] else "tinyconv experiment"
    try:
        if argv[:1] != ["grid"]:
            experiments_parser().parse_args(argv)  # --help, no experiment named, or one that is not
        refuse_old_spellings(argv[1:])
        args = build_parser().parse_args(argv[1:])
        fill_defaults(args)
        if args.print_config:
            print(config_text(vars(args)))
            return 0
        grid, rows = prepare(args)
    except SystemExit as e:  # --help: 0, as main promises a code
        return int(e.code or 0)
    except (UsageError, BadInput) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run_grid(args, grid, rows)


def refuse_old_spellings(argv: Sequence[str]) -> None:
    """UsageError for a spelling of the grid's that changed, naming today's."""
    see = f"(see {PROG} --help)"
    for i, word in enumerate(argv):
        flag = word.split("=", 1)[0]
        if flag in RENAMED:
            raise UsageError(f"{flag} is now {RENAMED[flag]} {see}")
        given = argv[i + 1] if i + 1 < len(argv) else ""
        if flag == "--external-workers" and ("=" in word or given.isdigit()):
            raise UsageError(
                "--external-workers takes no number now: the grid waits for as many external workers as its "
                f"largest --workers {see}"
            )


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
        workers = grid_workers(
            max(c.participants for c in todo) - 1,
            args.transport,
            args.backend[0],
            bind=args.bind,
            external=args.external_workers,
            prefix=split_prefix(args.worker_prefix),
            insecure=args.insecure,
            timeout=args.start_timeout,
            devices=args.cpu_quota or (),
        )
        try:
            with workers as (transport, infos):
                _loop(args, todo, rows, transport, infos)
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted; the finished cells are in {out}: the same command resumes", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as e:  # a worker lost or a timeout: one line, the rows so far kept
            why = f"{type(e).__name__}: {e}; the finished cells are in {out}: the same command resumes"
            print(f"{PROG}: {why}", file=sys.stderr)
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
    out, host, steps = Path(args.out), cpu_model(), (args.timed_steps, args.untimed_steps, args.settle)
    backends = {name: get_backend(name) for name in args.backend}
    weights = [cost(c, *parse_arch(c.arch), *steps) for c in todo]
    shape = "{l_bar}{bar}| {n:.0f}/{total:.0f} Gflop [{elapsed}<{remaining}]"
    bar = tqdm(
        total=sum(weights), desc="grid", disable=True if args.no_progress else None, smoothing=0, bar_format=shape
    )
    with pinned, bar:
        for i, (cell, weight) in enumerate(zip(todo, weights, strict=True), 1):
            bar.set_postfix_str(cell.label())
            # the cells before give their freed heap back: kept (keep_freed_memory), the master alone's
            # peak at 500:1500, batch 256 went on into the model cell's calibration, out of 24 GB
            release_freed_memory()
            measured = run_cell(cell, backends[cell.backend], transport, workers, *steps)
            row = {**vars(cell), **measured, **settings(args), "link": args.link_label, "host": host}
            row["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            row["workers"] = " ".join(f"{w.backend}@{w.hostname}" for w in workers[: cell.participants - 1])
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

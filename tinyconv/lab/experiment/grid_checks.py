"""``tinyconv experiment grid``'s checks before any worker starts: each refusal is one line (:class:`BadInput`,
exit 2). ``--workers W`` counts the workers beside the master; a cell, and the CSV's participants column,
counts the master too: W + 1."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinyconv.lab.experiment.grid import BY_IMAGES, DATA_WIRE, Cell, cells

PROG = "tinyconv experiment grid"
TRANSPORTS = ("zmq", "inproc")


class BadInput(ValueError):
    """Input the grid refuses before it starts: one line for the user."""


def fill_defaults(args: argparse.Namespace) -> None:
    """The defaults that follow other options: --workers 0 1, or one fewer than the --cpu-quota devices."""
    if args.workers is None:
        args.workers = list(range(len(args.cpu_quota))) if args.cpu_quota else [0, 1]


def participants(args: argparse.Namespace) -> list[int]:
    """The participant counts of the cells: the master and its --workers."""
    return [w + 1 for w in args.workers]


def prepare(args: argparse.Namespace) -> tuple[list[Cell], list[dict[str, Any]]]:
    """Check the options and the --out file; the grid's cells and the rows already measured."""
    from backends import available_backends
    from tinyconv.lab.experiment.workers import cores

    unknown = [b for b in args.backend if b not in available_backends()]
    if unknown:
        known = ", ".join(available_backends())
        raise BadInput(f"--backend {' '.join(unknown)}: not one of {known} (`tinyconv devices` lists them)")
    if args.transport not in TRANSPORTS:
        raise BadInput(f"--transport {args.transport}: the grid runs over {' or '.join(TRANSPORTS)}")
    check_devices(args, cores())
    rows = _rows_so_far(args)
    step = (args.norm, args.fuse, args.split, args.backend, args.parallel, args.rebalance, args.wire_precision)
    grid = cells(
        args.arch, args.batch_size, participants(args), args.repeats, *step, args.pipeline, args.cpu_quota or ()
    )
    narrowed = [w for w in args.wire_precision if w != DATA_WIRE]
    by_images = " and ".join(m for m in args.parallel if m in BY_IMAGES)
    if by_images and max(args.workers) > 0 and narrowed:
        print(
            f"{DATA_WIRE} only for --parallel {by_images}: their cells at --wire-precision {' '.join(narrowed)} "
            "are left out"
        )
    if not grid:
        raise BadInput(
            f"no cells: {DATA_WIRE} is the only --wire-precision for --parallel {by_images}; add {DATA_WIRE} or "
            "--parallel model"
        )
    return grid, rows


def _rows_so_far(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows --out already holds, measured with this grid's settings; BadInput if it cannot be resumed."""
    from tinyconv.lab.experiment import table

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
    return rows


def check_devices(args: argparse.Namespace, cores: Sequence[int]) -> None:
    """BadInput unless the workers asked for can be had: cores for local workers (or room for their
    --cpu-quota devices), or external ones over zmq."""
    most, n_cores = max(args.workers), len(cores)
    local = args.transport == "zmq" and not args.external_workers
    if args.cpu_quota:
        _check_quotas(args.cpu_quota, most + 1, local, cores)
        return
    if args.worker_prefix and not local:
        raise BadInput("--worker-prefix is for local worker processes (not --transport inproc or --external-workers)")
    if args.bind and args.transport == "inproc":
        raise BadInput("--bind needs --transport zmq: in-process workers are threads")
    if args.external_workers and args.transport == "inproc":
        raise BadInput("--external-workers needs --transport zmq")
    if local and most + 1 > n_cores:
        raise BadInput(
            f"--workers {most} needs {most + 1} cores (the master's and one per pinned local worker), this "
            f"process may use {n_cores}; connect workers from elsewhere with --external-workers"
        )


def _check_quotas(quotas: Sequence[float], most: int, local: bool, cores: Sequence[int]) -> None:
    """``most`` participants' devices: local worker processes whose quotas fit the cores, on a machine that
    can hold CPU quotas."""
    from tinyconv.lab.experiment.cpu_quota import unavailable
    from tinyconv.lab.experiment.workers import place

    if not local:
        raise BadInput("--cpu-quota devices are local worker processes: not --transport inproc or --external-workers")
    if most > len(quotas):
        raise BadInput(
            f"--workers {most - 1} needs {most} --cpu-quota devices (the master's first), {len(quotas)} given"
        )
    try:
        place(quotas[:most], cores)
    except ValueError as e:
        raise BadInput(f"--cpu-quota: {e} this process may use; give smaller quotas or fewer devices") from None
    why = unavailable()
    if why:
        raise BadInput(f"--cpu-quota: CPU quotas {why}")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The non-key settings every row of one CSV must share (``table.SETTINGS``), by their column names."""
    return {
        "steps": args.timed_steps,
        "warmup": args.untimed_steps,
        "settle": args.settle,
        "transport": args.transport,
    }

"""``tinyconv train``'s checks before any work: every option that cannot apply is refused here, in one line
(:class:`~tinyconv.options.UsageError`, exit 2), before the data loads, a worker starts or a socket
opens."""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

from backends import available_backends, has_devices
from tinyconv.checkpoint import Checkpoint, check_compatible, read_checkpoint
from tinyconv.cifar10 import default_data_dir, find_batches_dir
from tinyconv.memory import available_memory_bytes, format_bytes, step_memory_bytes
from tinyconv.model import parse_arch
from tinyconv.options import UsageError
from tinyconv.presets import PRESETS
from transports import available_transports
from transports.mpi_worker import rank_and_size

BY_IMAGES = ("data", "hybrid")  # the modes that share each batch out by images (tinyconv/distributed/replica/)


def check_args(args: argparse.Namespace) -> tuple[tuple[int, int], Checkpoint | None]:
    """Everything that can be refused before data, workers or training: -> (kernels, the checkpoint to resume)."""
    apply_preset(args)
    check_names(args)
    check_workers(args)
    check_plan(args)
    check_applies(args)
    kernels = architecture(args)
    check_memory(args, *kernels)
    check_devices(args)
    check_writable(args.metrics_out, "--metrics-out")
    check_writable(args.checkpoint, "--checkpoint")
    if (args.checkpoint_every or args.checkpoint_minutes) and not args.checkpoint:
        raise UsageError("--checkpoint-every and --checkpoint-minutes need --checkpoint FILE to save to")
    if args.max_restarts and not args.checkpoint:
        raise UsageError(
            "--max-restarts restarts training from its checkpoint: give --checkpoint FILE too "
            "(and --checkpoint-every N to lose at most N steps)"
        )
    if args.max_restarts and args.transport == "mpi":
        raise UsageError("--max-restarts supervises one master process; under mpiexec, run the job again with --resume")
    check_bind(args)
    check_data(args)
    return kernels, check_resume(args, *kernels)


def check_data(args: argparse.Namespace) -> None:
    """With --no-download, CIFAR-10 must already be where the run will look."""
    where = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    if args.dataset == "cifar10" and args.no_download and find_batches_dir(where) is None:
        raise UsageError(
            f"--no-download: CIFAR-10 is not in {where}; give --data-dir where cifar-10-batches-py/ is, "
            "or drop --no-download to fetch it (163 MB, once)"
        )


def check_names(args: argparse.Namespace) -> None:
    """--backend, --worker-backend and --transport name something installed."""
    for option, name, known, hint in (
        ("--backend", args.backend, available_backends(), " (`tinyconv devices` lists them)"),
        ("--worker-backend", args.worker_backend, available_backends(), " (`tinyconv devices` lists them)"),
        ("--transport", args.transport, available_transports(), ""),
    ):
        if name is not None and name not in known:
            raise UsageError(f"{option} {name}: not one of {', '.join(known)}{hint}")


ZMQ_ONLY = ("bind", "external_workers", "key", "authorized_keys", "insecure")


def check_applies(args: argparse.Namespace) -> None:
    """Refuse an option that the rest of the command line makes meaningless, naming what to drop."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    if args.transport != "zmq":
        for name in ZMQ_ONLY:
            if getattr(args, name):
                raise UsageError(f"{flag(name)} is for --transport zmq, not {args.transport}: drop it or use zmq")
    if args.workers == 0:
        given = [n for n in ("threads", "worker_backend", "worker_device") if getattr(args, n) is not None]
        given += ["wire_precision"] if args.wire_precision != "fp32" else []
        given += ["external_workers"] if args.external_workers else []
        if given:
            raise UsageError(f"{flag(given[0])} is for the workers, and --workers 0 has none: drop one of them")
    if args.parallel in BY_IMAGES and args.wire_precision != "fp32":
        sends = {"data": "the replicas of --parallel data send their weights and gradients"}.get(
            args.parallel, "--parallel hybrid sends its weights, gradients and features"
        )
        raise UsageError(
            f"--wire-precision {args.wire_precision} narrows the shards of --parallel model; {sends} in "
            "float32: drop one of them"
        )
    if args.parallel in BY_IMAGES:
        given = ["split"] if args.split != "auto" else []
        given += ["fuse"] if args.fuse != "on" else []
        if given:
            raise UsageError(
                f"{flag(given[0])} {getattr(args, given[0])} shapes the split of --parallel model; "
                f"--parallel {args.parallel} shares out images instead: drop one of them"
            )


def check_bind(args: argparse.Namespace) -> None:
    """A --bind address whose port another process holds is refused now, not after the data has loaded."""
    if args.transport != "zmq" or not args.bind or not args.bind.startswith("tcp://"):
        return
    host, _, port = args.bind[len("tcp://") :].rpartition(":")
    if not port.isdigit():
        raise UsageError(f"--bind {args.bind}: give tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555")
    probe = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq binds: a port in TIME_WAIT is free
    try:
        probe.bind(("" if host in ("*", "0.0.0.0") else host.strip("[]"), int(port)))
    except OSError as e:
        raise UsageError(f"--bind {args.bind}: {e.strerror or e}; choose another port or stop what holds it") from None
    finally:
        probe.close()


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 2


def default_local_workers() -> int:
    """One worker per core this process may run on, beside the master's, at least 1. Workers on this
    machine share its cores with the master: on 2 cores the quick preset took 1.00 s per step with 2 local
    workers and 0.50 s with 1 (oversubscribed processes wait for each other at every layer)."""
    return max(1, usable_cores() - 1)


def check_workers(args: argparse.Namespace) -> None:
    """--workers: by default one local worker per core beside the master's (2 external ones); under mpi,
    the ranks beside this one (``mpiexec -n N``: N - 1). --threads of local worker processes: by default
    the cores over the participants, so that the processes do not take each other's cores."""
    if args.transport != "mpi":
        if args.workers is None:
            args.workers = 2 if args.external_workers else default_local_workers()
        if args.threads is None and args.transport == "zmq" and args.workers and not args.external_workers:
            args.threads = max(1, usable_cores() // (args.workers + 1))
        return
    size = rank_and_size()[1]
    if args.workers is None:
        args.workers = size - 1
    elif args.workers != size - 1:
        raise UsageError(
            f"--workers {args.workers} under mpi needs mpiexec -n {args.workers + 1}, not -n {size}: "
            "the workers are the ranks beside the master (leave --workers out to use them all)"
        )
    if args.external_workers:
        raise UsageError("--external-workers is for zmq: under mpi the workers are the ranks mpiexec started")


def apply_preset(args: argparse.Namespace) -> None:
    """Fill the options not given from --preset; ``args.changed``: the options given that change it."""
    if args.warmup is not None and args.warmup_epochs is not None:
        raise UsageError("--warmup and --warmup-epochs both set the warm-up: give one of them")
    preset = PRESETS[args.preset]
    args.changed = []
    for key, value in preset.settings().items():
        given = getattr(args, key)
        if given is None:
            setattr(args, key, value)
        elif given != value:
            args.changed.append(f"--{key.replace('_', '-')} {given}")
    extras = (("conv1", args.conv1), ("conv2", args.conv2), ("warmup_epochs", args.warmup_epochs))
    extras += (("label_smoothing", args.label_smoothing or None),)  # no preset sets it
    for option, value in extras:
        if value is not None:
            args.changed.append(f"--{option.replace('_', '-')} {value:g}")
    if args.steps is not None:
        args.changed.append(f"--steps {args.steps}")


def check_plan(args: argparse.Namespace) -> None:
    """--plan fixed or equal never rebalances; --rebalance becomes on or off."""
    pinned = args.plan != "adaptive"
    if pinned and args.rebalance == "on":
        raise UsageError(f"--rebalance on contradicts --plan {args.plan}, whose split never changes: drop one of them")
    args.rebalance = "off" if pinned else (args.rebalance or "on")


def architecture(args: argparse.Namespace) -> tuple[int, int]:
    c1, c2 = parse_arch(args.arch)
    return args.conv1 or c1, args.conv2 or c2


def check_memory(args: argparse.Namespace, c1: int, c2: int) -> None:
    """Refuse a network whose training step cannot fit in this machine's memory."""
    available = available_memory_bytes()
    if available is None:
        return
    columns = not (args.external_workers and args.master_share == "0")  # else workers elsewhere build them
    need = step_memory_bytes(c1, c2, args.batch_size, args.norm, args.pool, columns=columns)
    if need > available:
        raise UsageError(
            f"--arch {c1}:{c2} with --batch-size {args.batch_size} needs about {format_bytes(need)} for a training "
            f"step (im2col columns, activations and their gradients, parameters), but this machine has "
            f"{format_bytes(available)} available: use a smaller --arch or --batch-size"
        )


def check_devices(args: argparse.Namespace) -> None:
    options = [("--device", args.device, args.backend)]
    if args.workers and not args.external_workers:  # external workers' backends live on their machines
        options.append(("--worker-device", args.worker_device, args.worker_backend or args.backend))
    for option, device, backend in options:
        if device and not has_devices(backend):
            raise UsageError(
                f"{option} {device}: the {backend} backend has no devices to choose from; drop {option} or use "
                f"a backend that has some ({', '.join(b for b in available_backends() if b != backend)})"
            )


def check_writable(path: str | None, option: str) -> None:
    """Refuse an output path that cannot be written: probe its nearest existing folder with a nameless
    temporary file, and an existing file by opening it to append (which changes nothing)."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {path} is a folder: give a file name")
    folder = next(f for f in [p.parent, *p.parent.parents] if f.exists() or f == f.parent)
    if not folder.is_dir():
        raise UsageError(f"{option} {path} cannot be written: {folder} is a file, not a folder")
    try:
        if p.exists():
            open(p, "ab").close()
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UsageError(f"{option} {path} cannot be written: {e.strerror or e} (in {folder})") from None


def check_resume(args: argparse.Namespace, c1: int, c2: int) -> Checkpoint | None:
    """The checkpoint to resume from, read whole and checked against this run's options."""
    if not args.resume:
        return None
    checkpoint = read_checkpoint(args.resume)
    here = {"arch": f"{c1}:{c2}", "norm": args.norm, "pool_kernel": args.pool}
    check_compatible(checkpoint.meta, here, args.batch_size, args.resume)
    return checkpoint

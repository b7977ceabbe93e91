#!/usr/bin/env python3
"""Train the paper's CNN on CIFAR-10, with its convolutions split by kernels across workers.

    python examples/cifar10_dist.py --transport zmq --backend opencl        # the main job
    python examples/cifar10_dist.py --preset quick --epochs 3               # a preset, one option changed
    python examples/cifar10_dist.py --dataset synthetic --steps 50          # a smoke run: a minute or two
    python examples/cifar10_dist.py --workers 0                             # the master alone
    mpiexec -n 3 python examples/cifar10_dist.py --transport mpi            # rank 0 the master, ranks 1-2 its workers
    python examples/cifar10_dist.py --checkpoint run.npz --checkpoint-every 200    # then, after a stop:
    python examples/cifar10_dist.py --checkpoint run.npz --resume run.npz          # bit-identical
    python examples/cifar10_dist.py --plan equal --seed 1                   # the same losses on every run
    python examples/cifar10_dist.py --parallel data --transport zmq --workers 1    # data parallelism instead
    python examples/cifar10_dist.py --parallel hybrid --transport zmq --workers 1  # convs by data, fc on the master

Reproduces Marques, Falcao & Alexandre, "Distributed learning of CNNs on
heterogeneous CPU/GPU architectures": the master trains every layer but the
convolutions, whose kernels are shared among workers in proportion to their speed.
With --parallel data, each participant trains a whole replica on its share of each batch
instead, and the master sums their gradients and updates the weights (a parameter server).
With --parallel hybrid (Krizhevsky's "one weird trick"), each participant runs the convolutions
on its share of the images, and the master the fully connected layer on the whole batch.

A preset (--preset, default best: 83.8 % in 89 minutes on 2 cores; quick: 77.0 % in 16; paper, the
paper's own network: 76.9 % in 51) gives the network and the training recipe; any option given beside
it wins. The first line after loading the data says the preset, the network, the epochs and steps,
and the accuracy and time to expect (as measured); the last line, the test accuracy reached and the
wall time.

Nothing is lost on the way out: with --checkpoint, an error, Ctrl-C (exit 130) or SIGTERM
(exit 143) checkpoints the last whole step before the run ends. A bad option is one line on
stderr and exit 2, before any work starts.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# runnable from a source checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import tinyconv as tc  # noqa: E402
from backends import available_backends, has_devices  # noqa: E402
from tinyconv.checkpoint import Checkpoint, check_compatible, read_checkpoint  # noqa: E402
from tinyconv.cifar10 import DataError, default_data_dir  # noqa: E402
from tinyconv.data import Dataset, load_dataset  # noqa: E402
from tinyconv.distributed.adaptive_precision import SETTINGS  # noqa: E402
from tinyconv.distributed.heap import keep_freed_memory  # noqa: E402
from tinyconv.distributed.rebalance import Rebalancer  # noqa: E402
from tinyconv.distributed.runtime import Runtime  # noqa: E402
from tinyconv.distributed.worker.handler import Worker  # noqa: E402
from tinyconv.memory import available_memory_bytes, format_bytes, step_memory_bytes  # noqa: E402
from tinyconv.metrics import MetricsWriter  # noqa: E402
from tinyconv.model import NORMS, PAPER_ARCHS, parse_arch  # noqa: E402
from tinyconv.presets import DEFAULT_PRESET, PRESETS, Preset  # noqa: E402
from tinyconv.report import summary_table  # noqa: E402
from tinyconv.schedule import SCHEDULES  # noqa: E402
from tinyconv.stopping import SignalGuard  # noqa: E402
from tinyconv.supervisor import restartable_command, supervise  # noqa: E402
from tinyconv.trainer import TrainConfig, Trainer, planned_steps  # noqa: E402
from transports import available_transports  # noqa: E402
from transports.mpi_worker import rank_and_size, serve_if_worker  # noqa: E402
from transports.session.settings import SECRET_ENV  # noqa: E402

PLANS = ("adaptive", "fixed", "equal")
ERRORS = (ValueError, FileNotFoundError, FloatingPointError, TimeoutError, OSError, RuntimeError)


class UsageError(Exception):
    """A bad command line: one line on stderr, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own complaints, in one line too
        raise UsageError(f"{message} (see --help)")


# ---- option types: a bad value is argparse's one-line error -----------------------------------------
def count(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {value}")
        return value

    return parse


def number(low: float, high: float = math.inf, low_open: bool = False, what: str = "") -> Callable[[str], float]:
    """A finite float in [low, high) (or (low, high) with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value < high):
            interval = f"{'(' if low_open else '['}{low:g}, {high:g})" if high < math.inf else None
            bound = f"in {interval}" if interval else f"{'>' if low_open else '>='} {low:g}"
            raise argparse.ArgumentTypeError(f"must be {what or 'a number'} {bound}, got {text}")
        return value

    return parse


POSITIVE = number(0, low_open=True)
NON_NEGATIVE = number(0)


# ---- the command line ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for add in (_preset, _network, _compute, _workers, _split, _training, _data, _output):
        add(p)
    return p


def preset_default(key: str) -> str:
    """How --help says an option's default: the preset's value, and the default preset's."""
    return f"default: the preset's; {DEFAULT_PRESET}: {getattr(PRESETS[DEFAULT_PRESET], key)}"


def _preset(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("preset (a whole recipe by name; any option below given beside it wins)")

    def about(p: Preset) -> str:  # with its figures where both are measured
        if p.expected_accuracy is None or p.expected_minutes is None:
            return f"{p.name}: {p.about}"
        return f"{p.name}: {p.about} ({p.expected_accuracy:.1%} in about {p.expected_minutes:.0f} min)"

    choices = "; ".join(about(p) for p in PRESETS.values())
    g.add_argument(
        "--preset",
        choices=PRESETS,
        default=DEFAULT_PRESET,
        help=f"{choices.replace('%', '%%')}. The run's first line says what to expect, as measured (default "
        "%(default)s; tinyconv/presets.py has each one's settings and how they were measured)",
    )


def _network(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network")
    g.add_argument(
        "--arch",
        help=f"kernel counts C1:C2 of the two conv layers; the paper's are {', '.join(PAPER_ARCHS)} "
        f"({preset_default('arch')})",
    )
    g.add_argument("--conv1", type=count(1), help="kernels of conv layer 1 (overrides --arch)")
    g.add_argument("--conv2", type=count(1), help="kernels of conv layer 2 (overrides --arch)")
    g.add_argument(
        "--norm", choices=NORMS, help=f"normalisation after each conv (lrn: the paper's; {preset_default('norm')})"
    )
    g.add_argument(
        "--pool",
        type=int,
        choices=(2, 3),
        default=3,
        help="max-pool window: 3 (3x3 stride 2, overlapping) or 2 (2x2 stride 2)",
    )


def _compute(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("compute")
    g.add_argument(
        "--backend",
        default="numpy",
        help=f"master's backend: {', '.join(available_backends())} (default %(default)s)",
    )
    g.add_argument(
        "--device",
        help="OpenCL device: PLATFORM:DEVICE index or a name substring "
        "(default $TINYCONV_OPENCL_DEVICE, else the first GPU); only for a backend with devices",
    )


PARALLEL = ("model", "data", "hybrid")
BY_IMAGES = ("data", "hybrid")  # the modes that share each batch out by images (tinyconv/distributed/replica/)


def parallel_mode(text: str) -> str:
    if text not in PARALLEL:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(PARALLEL)}, got {text!r}")
    return text


def _workers(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distribution (the paper's technique: conv kernels split across workers)")
    g.add_argument(
        "--parallel",
        type=parallel_mode,
        default="model",
        metavar="{model,data,hybrid}",
        help="model: the paper's split, each convolution's kernels across the participants, the rest on the "
        "master; data: every participant a whole replica and a share of each batch's images (by its speed), "
        "the master sums the gradients and updates the weights -- a step then moves the weights and gradients "
        "instead of feature maps; hybrid: the convolutions by data (each participant its share of the images, "
        "the conv weights whole), the fully connected layer and the loss on the master over the whole batch -- "
        "a step moves the conv weights and gradients and each image's pooled features both ways "
        "(docs/how-it-works.md compares the three; default %(default)s)",
    )
    g.add_argument(
        "--transport",
        default="inproc",
        help=f"how the master reaches its workers: {', '.join(available_transports())} (default %(default)s)",
    )
    g.add_argument(
        "--workers",
        type=count(0),
        help="workers (default: one per core beside the master's on this machine, at least 1 -- a second worker "
        "on a core halves both; 2 with --external-workers; under --transport mpi, the other ranks mpiexec "
        "started; 0: the master alone, the baseline)",
    )
    g.add_argument("--worker-backend", help="the workers' backend, may differ from the master's (default: --backend)")
    g.add_argument("--worker-device", help="the workers' OpenCL device (default: their own first GPU/device)")
    g.add_argument("--worker-threads", type=count(1), help="BLAS/OpenMP threads per local worker process")
    g.add_argument(
        "--bind",
        help="zmq: the master's address (default tcp://127.0.0.1:<free port> for local workers, "
        "tcp://*:5555 with --external-workers); ipc:///path works too",
    )
    g.add_argument(
        "--external-workers",
        action="store_true",
        help="zmq: don't start workers here; print the command to run on each worker machine and wait for them",
    )
    g.add_argument(
        "--start-timeout",
        type=POSITIVE,
        help="seconds to wait for every worker's hello (default 60; 600 with --external-workers); a local "
        "worker that fails ends the wait at once, with its own message",
    )
    g.add_argument(
        "--peer-timeout",
        type=POSITIVE,
        default=30.0,
        help="the most seconds a worker may be silent before it is lost and its share goes to the others: a "
        "ceiling, as the patience follows each peer's pace (4 heartbeats of 0.4 s, or 3 x the longest gap a slow "
        "link showed between the pieces of a large message); the workers give the master as much "
        "(default %(default)s)",
    )
    g.add_argument(
        "--key",
        metavar="FILE",
        help="zmq: the master's secret key file (NAME.key_secret from `tinyconv keygen`), with --authorized-keys: "
        "only workers with those keys can join, and the traffic is encrypted (needed to bind beyond loopback)",
    )
    g.add_argument("--authorized-keys", metavar="DIR", help="zmq: the folder of the workers' public keys (NAME.key)")
    g.add_argument(
        "--insecure",
        action="store_true",
        help="zmq: bind beyond loopback without keys: anyone who can reach the port can join as a worker",
    )


def _split(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the split")
    g.add_argument(
        "--master-share",
        choices=("auto", "0"),
        default="auto",
        help="auto: the master computes a share of kernels too, by its speed; 0: it only coordinates",
    )
    g.add_argument(
        "--plan",
        choices=PLANS,
        default="adaptive",
        help="adaptive: split by the calibrated speeds, then rebalanced as the step times say (with --rebalance); "
        "fixed: split by the calibrated speeds, never rebalanced, and on --resume the checkpoint's split (same "
        "participants only); equal: an equal split among whoever takes part, never rebalanced -- the same on every "
        "run, so the same seed gives bit-identical losses (default %(default)s)",
    )
    g.add_argument(
        "--rebalance",
        choices=("on", "off"),
        help="re-split kernels from measured step times when a worker lags (default on with --plan adaptive; "
        "a fixed or equal plan never rebalances)",
    )
    g.add_argument(
        "--rebalance-threshold",
        type=POSITIVE,
        default=0.10,
        help="rebalance when the slowest participant lags the mean finish time by more than this fraction for "
        "3 steps in a row (default %(default)s; lower follows small imbalances, higher ignores more noise)",
    )
    g.add_argument(
        "--fuse",
        choices=("on", "off"),
        default="on",
        help="on: workers also run the ReLU/LRN/batch norm/max pool after each conv on their own channels (with a "
        "2-channel halo for LRN) and return pooled maps; off: the paper's split, conv only, the rest on "
        "the master (default %(default)s)",
    )
    g.add_argument(
        "--split",
        choices=("auto", "channels", "kernels"),
        default="auto",
        help="how each conv after the first is split: kernels = the paper's way, every participant its "
        "kernels on all of the input (each builds the whole im2col and a full-size partial dX, summed); "
        "channels = the convolution by input channels (each the partial sums of its channels, added up "
        "where the tails run; its channels' dX and dW): nothing done twice, more bytes; "
        "auto = channels with every worker on this machine, else kernels (default %(default)s)",
    )
    g.add_argument(
        "--wire-precision",
        choices=SETTINGS,
        default="fp32",
        help="the words the shards (inputs, weights, maps, gradients) travel in, both ways; the arithmetic stays "
        "float32: fp32 (4 bytes), adt24 (3: float32's top 3 bytes), bf16 (2: its top 2), fp16 (2: IEEE half; "
        "an array that would overflow goes fp32), s8 (1: int8 times a float32 scale per plane, to 1/254 of the "
        "plane's largest; a plane with inf or NaN goes fp32), or adaptive (AWP: each layer's weights widen bf16 "
        "-> adt24 -> fp32 as their L2 norm settles, maps s8, gradients bf16); --parallel model only "
        "(default %(default)s)",
    )
    g.add_argument(
        "--spot-check",
        type=number(0, 1, what="a fraction"),
        default=0.03,
        metavar="FRACTION",
        help="the master recomputes samples of each worker's results (an image, a kernel; with --parallel data or "
        "hybrid, a whole task now and then) in at most this fraction of the worker's work, and drops a worker whose "
        "numbers are off by more than float32 round-off; 0 trusts them; not with a narrowed --wire-precision "
        "(default %(default)s)",
    )


def _training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=count(1), help=f"epochs ({preset_default('epochs')})")
    g.add_argument(
        "--steps", type=count(1), help="stop after N steps in total, then evaluate (smoke runs, quick checks)"
    )
    g.add_argument("--batch-size", type=count(1), help=preset_default("batch_size"))
    g.add_argument(
        "--lr", type=POSITIVE, help=f"peak learning rate ({preset_default('lr')}; much higher diverges the paper's net)"
    )
    g.add_argument(
        "--momentum", type=number(0, 1, what="a fraction"), default=0.9, help="in [0, 1) (default %(default)s)"
    )
    g.add_argument(
        "--weight-decay", type=NON_NEGATIVE, help=f"on conv and linear weights ({preset_default('weight_decay')})"
    )
    g.add_argument(
        "--classifier-lr",
        type=NON_NEGATIVE,
        help="a factor on the learning rate for the classifier (the last layer); 0.1 keeps the paper's 32,000-wide "
        f"classifier from throwing the first steps' loss to 30-40 ({preset_default('classifier_lr')})",
    )
    g.add_argument(
        "--label-smoothing",
        type=number(0, 1, what="a fraction"),
        default=0.0,
        metavar="EPS",
        help="train against (1 - EPS) onehot + EPS / 10 instead of the label alone (torch's label_smoothing); the "
        "test loss stays the plain cross-entropy (default %(default)s: no preset sets it; "
        "at 0.1, 2 epochs of 64:128 reached 69.2 %% against 69.4 %% without, benchmarks/bench_recipe.py)",
    )
    g.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help=f"learning-rate schedule after the warm-up; step divides by 10 at 50%% and 75%% of the steps after "
        f"the warm-up ({preset_default('schedule')})",
    )
    g.add_argument(
        "--warmup",
        type=number(0, 1, what="a fraction"),
        metavar="FRACTION",
        help="linear warm-up from 0 to --lr over this fraction of the run's planned steps (after --steps), "
        f"so that a short run warms up in proportion ({preset_default('warmup')})",
    )
    g.add_argument(
        "--warmup-epochs",
        type=NON_NEGATIVE,
        metavar="N",
        help="instead of --warmup: a warm-up of N epochs whatever the run's length (as before --warmup; "
        "checkpoints written then resume with it)",
    )
    g.add_argument("--no-augment", action="store_true", help="no random crop / horizontal flip")
    g.add_argument("--seed", type=int, default=0, help="seeds the weights, the shuffle and the augmentation")


def _data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=("cifar10", "synthetic"), default="cifar10", help="default %(default)s")
    g.add_argument(
        "--data-dir",
        help="folder holding cifar-10-batches-py/ (default $TINYCONV_DATA, else ~/.cache/tinyconv)",
    )
    g.add_argument("--no-download", action="store_true", help="fail instead of downloading CIFAR-10 when missing")


def _output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--metrics-out",
        help="write JSON-lines metrics (run, step, epoch, summary events) here; with --resume, appended to, "
        "without the steps the checkpoint does not have",
    )
    g.add_argument(
        "--checkpoint",
        help="save a checkpoint here (atomically) at each epoch end, at the stop, and on the way out: an error, "
        "Ctrl-C or SIGTERM saves the last whole step",
    )
    g.add_argument("--checkpoint-every", type=count(1), metavar="N", help="also save the checkpoint every N steps")
    g.add_argument(
        "--checkpoint-minutes",
        type=POSITIVE,
        metavar="M",
        help="also save the checkpoint when M minutes have passed since the last one",
    )
    g.add_argument(
        "--resume",
        help="resume bit-identically from this checkpoint (same --arch, --norm, --pool and --batch-size)",
    )
    g.add_argument(
        "--max-restarts",
        type=count(0),
        default=0,
        metavar="N",
        help="run training under a supervisor that restarts it from --checkpoint when it dies abnormally (a crash, "
        "SIGKILL, the out-of-memory killer), at most N times; workers rejoin the new master (default 0: no supervisor)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


# ---- checks before any work ------------------------------------------------------------------------------
def check_args(args: argparse.Namespace) -> tuple[tuple[int, int], Checkpoint | None]:
    """Everything that can be refused before data, workers or training: -> (kernels, the checkpoint to resume)."""
    apply_preset(args)
    check_workers(args)
    check_plan(args)
    if args.wire_precision != "fp32" and args.parallel in BY_IMAGES:
        raise UsageError(
            f"--wire-precision {args.wire_precision} narrows the shards of --parallel model; "
            + (
                "the replicas of --parallel data send their weights and gradients"
                if args.parallel == "data"
                else "--parallel hybrid sends its weights, gradients and features"
            )
            + " in float32: drop one of them"
        )
    kernels = architecture(args)
    check_memory(args, *kernels)
    check_devices(args)
    check_writable(args.metrics_out, "--metrics-out")
    check_writable(args.checkpoint, "--checkpoint")
    if (args.checkpoint_every or args.checkpoint_minutes) and not args.checkpoint:
        raise UsageError("--checkpoint-every and --checkpoint-minutes need --checkpoint FILE to save to")
    if args.max_restarts and not args.checkpoint:
        raise UsageError("--max-restarts restarts training from its checkpoint: give --checkpoint FILE too "
                         "(and --checkpoint-every N to lose at most N steps)")  # fmt: skip
    if args.max_restarts and args.transport == "mpi":
        raise UsageError("--max-restarts supervises one master process; under mpiexec, run the job again with --resume")
    return kernels, check_resume(args, *kernels)


def default_local_workers() -> int:
    """One worker per core this process may run on, beside the master's, at least 1. Workers on this
    machine share its cores with the master: on 2 cores the quick preset took 1.00 s per step with 2 local
    workers and 0.50 s with 1 (oversubscribed processes wait for each other at every layer)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 2
    return max(1, cores - 1)


def check_workers(args: argparse.Namespace) -> None:
    """--workers: by default one local worker per core beside the master's (2 external ones); under mpi,
    the ranks beside this one (``mpiexec -n N``: N - 1)."""
    if args.transport != "mpi":
        if args.workers is None:
            args.workers = 2 if args.external_workers else default_local_workers()
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


def serve_mpi_rank(args: argparse.Namespace) -> int | None:
    """mpiexec runs this script on every rank: rank 0 is the master (None); any other serves it, with
    the workers' backend, and its exit code ends this process here."""
    device = {"device": args.worker_device} if args.worker_device else {}
    make = lambda: Worker(tc.get_backend(args.worker_backend or args.backend, **device))  # noqa: E731
    return serve_if_worker(make, peer_timeout_s=args.peer_timeout)


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


# ---- the run ----------------------------------------------------------------------------------------------
def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        classifier_lr=args.classifier_lr,
        label_smoothing=args.label_smoothing,
        schedule=args.schedule,
        warmup=args.warmup,
        warmup_epochs=args.warmup_epochs,
        max_steps=args.steps,
        augment=not args.no_augment,
        seed=args.seed,
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        checkpoint_minutes=args.checkpoint_minutes,
        progress=not args.no_progress,
    )


def start_cluster(args: argparse.Namespace, net: tc.Network) -> Runtime | None:
    """The workers and the runtime sharing net's convolutions (--parallel model) or its batches
    (--parallel data, hybrid) with them; None with --workers 0."""
    if args.workers == 0:
        return None
    model = {"fuse": args.fuse == "on", "split": args.split, "wire_precision": args.wire_precision}
    cluster = tc.distribute(
        net,
        args.transport,
        args.workers,
        parallel=args.parallel,
        worker_backend=args.worker_backend or args.backend,
        worker_device=args.worker_device,
        bind=args.bind,
        external=args.external_workers,
        worker_threads=args.worker_threads,
        start_timeout=args.start_timeout or (600.0 if args.external_workers else 60.0),
        peer_timeout=args.peer_timeout,
        key=args.key,
        authorized_keys=args.authorized_keys,
        insecure=args.insecure,
        batch_size=args.batch_size,
        largest_batch=max(args.batch_size, TrainConfig.eval_batch_size),  # evaluation's batches too
        calibrate=False,  # below, once the workers are printed and the run recorded
        master_share=args.master_share,
        rebalance=args.rebalance == "on",
        rebalancer=Rebalancer(threshold=args.rebalance_threshold),
        spot_check=args.spot_check,
        **(model if args.parallel == "model" else {}),
    )
    what = {"data": ", a whole replica", "hybrid": ", the convolutions of a replica (hybrid)"}.get(args.parallel, "")
    for w in cluster.workers:  # who was admitted: where from, and with which key (its NAME.key's first characters)
        whence = (f" from {w.address}" if w.address else "") + (f", key {w.key[:12]}..." if w.key else "")
        print(f"worker {w.index}: {w.backend} on {w.device.get('device')} ({w.hostname or 'local'}{whence}){what}")
    return cluster


def record_run(metrics: MetricsWriter, args: argparse.Namespace, argv: list[str] | None, net, backend, cluster) -> None:
    workers = cluster.workers if cluster is not None else []
    metrics.write(
        "run",
        argv=sys.argv if argv is None else ["cifar10_dist.py", *argv],
        seed=args.seed,
        backend=backend.describe(),
        transport=args.transport if workers else None,
        parallel=args.parallel if workers else None,
        workers=[
            {
                "index": w.index,
                "backend": w.backend,
                "device": w.device,
                "host": w.hostname,
                "address": w.address,
                "key": w.key,
            }
            for w in workers
        ],  # fmt: skip
        arch=net.config,
        dataset=args.dataset,
        batch_size=args.batch_size,
        train_config=vars(args),
        versions={"tinyconv": tc.__version__, "numpy": np.__version__, "python": platform.python_version()},
    )


def split_layers(args: argparse.Namespace, cluster: Runtime, trainer: Trainer) -> None:
    """Split each layer: by the calibrated speeds, or equally (--plan equal)."""
    if args.plan == "equal":
        print(f"equal shares ({', '.join(cluster.participants)}), pinned by --plan equal")
        return
    timed = {"data": "a forward + backward of the batch", "hybrid": "a forward + backward of the batch's convolutions"}
    what = timed.get(args.parallel, "each convolution's shape")
    print(f"calibrating: timing {', '.join(cluster.participants)} on {what} ...", flush=True)
    calibration = cluster.calibrate(trainer.net, args.batch_size)
    trainer.metrics.write("calibration", **calibration)
    channels = calibration["channel_shares"]
    units = "images" if args.parallel in BY_IMAGES else "kernels"
    print(
        f"calibrated shares ({', '.join(cluster.participants)}): {units} {calibration['shares']}"
        + (f", input channels {channels}" if channels else "")
    )


def resume(args: argparse.Namespace, trainer: Trainer, checkpoint: Checkpoint) -> None:
    """Take up the checkpoint; --plan fixed insists on the checkpoint's split (--plan equal splits equally among
    whoever takes part: the workers that rejoin a restarted master may be others, or fewer)."""
    note = trainer.resume(checkpoint)
    pinned = args.plan == "fixed" and trainer.cluster is not None and checkpoint.meta.get("plan") is not None
    if pinned and not trainer.plan_restored:
        raise ValueError(
            f"{note}; --plan {args.plan} resumes only with its split: use the same workers or --plan adaptive"
        )
    print(f"resumed from {checkpoint.path} at step {trainer.step}" + (f"; {note}" if note else ""))


def train(args: argparse.Namespace, argv: list[str] | None, trainer: Trainer, backend, checkpoint) -> dict:
    """Start the workers, split the layers, resume, train; the workers stop whatever happens."""
    cluster = trainer.cluster = start_cluster(args, trainer.net)
    try:
        record_run(trainer.metrics, args, argv, trainer.net, backend, cluster)
        if cluster is not None:
            split_layers(args, cluster, trainer)
        if checkpoint is not None:
            resume(args, trainer, checkpoint)
        return trainer.fit()
    finally:
        if cluster is not None:
            cluster.close()


def run(args: argparse.Namespace, argv: list[str] | None, net, backend, data, checkpoint, started: float) -> int:
    """Train and report; -> the exit code. ``started``: time.monotonic() when the command began."""
    resume_step = checkpoint.meta["step"] if checkpoint is not None else None
    metrics = MetricsWriter(args.metrics_out, append=checkpoint is not None, resume_step=resume_step)
    trainer = None
    try:
        trainer = Trainer(net, data, train_config(args), metrics)
        summary = train(args, argv, trainer, backend, checkpoint)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM as the trainer's Stopped
        return stopped(getattr(e, "signum", signal.SIGINT), trainer)
    except ERRORS as e:
        return fail(e, trainer)
    finally:
        metrics.close()
    print(summary_table(summary, trainer.steps_per_epoch))
    if args.metrics_out:
        print(f"metrics: {args.metrics_out}")
    print(result_line(args, summary, time.monotonic() - started))
    return 0


INSECURE = (
    "--insecure: workers join without keys and the traffic is not encrypted: any process that reaches the "
    "master's address can join as a worker, read the batches and weights and send poisoned results"
)


def plan_line(args: argparse.Namespace, kernels: tuple[int, int], n_train: int) -> str:
    """What the run will do, in one line before it starts: the preset, the network, the epochs and steps,
    and what to expect (the preset's measured figures, which a changed option makes another run's)."""
    preset = PRESETS[args.preset]
    per_epoch, total, warmup = planned_steps(n_train, train_config(args))
    epochs = -(-total // per_epoch)
    norm = {"lrn": "with LRN", "batch": "with batch norm"}.get(args.norm, "without normalisation")
    warm = f"the first {warmup:,} a warm-up" if warmup else "no warm-up"
    classifier = f" (the classifier's {args.classifier_lr:g}x)" if args.classifier_lr != 1 else ""
    smoothing = f", label smoothing {args.label_smoothing:g}" if args.label_smoothing else ""
    line = (
        f"preset {preset.name}: {kernels[0]}:{kernels[1]} network {norm}, {epochs} epoch{'s' if epochs != 1 else ''} "
        f"({total:,} steps of batch {args.batch_size}, {warm}), lr {args.lr:g}{classifier} {args.schedule}"
        f"{smoothing}; {preset.expectation()}"
    )
    if args.changed:
        line += f" -- for the preset as it is; this run changes {', '.join(args.changed)}"
    if args.insecure:
        line += " -- INSECURE: workers join without keys"
    return line


def result_line(args: argparse.Namespace, summary: dict, seconds: float) -> str:
    """The run's last line: the test accuracy it reached and its wall time, beside the preset's expectation."""
    acc = summary.get("test_acc")
    reached = "no test accuracy" if acc is None else f"test accuracy {acc:.2%}"
    preset: Preset = PRESETS[args.preset]
    return (
        f"{reached} after {summary['steps']:,} steps, {seconds / 60:.1f} min in all "  # wall time, start-up included
        f"(preset {preset.name}: {preset.expectation()})"
    )


def fail(e: BaseException, trainer: Trainer | None = None) -> int:
    print(f"error: {e}", file=sys.stderr)
    note_checkpoint(trainer)
    return 2


def stopped(signum: int, trainer: Trainer | None) -> int:
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    print(f"{what}: workers stopped", file=sys.stderr)
    note_checkpoint(trainer)
    return 128 + signum


def note_checkpoint(trainer: Trainer | None) -> None:
    if trainer is not None and trainer.save_error is not None:
        print(f"could not checkpoint the last step: {trainer.save_error}", file=sys.stderr)
    if trainer is not None and trainer.saved is not None:
        step, path = trainer.saved
        print(f"last checkpoint: step {step} in {path}; continue with --resume {path}", file=sys.stderr)


def load_data(args: argparse.Namespace) -> Dataset:
    """The data set, with a line before (reading CIFAR-10 takes seconds, a first download minutes) and after."""
    where = f" from {args.data_dir or default_data_dir()}" if args.dataset == "cifar10" else ""
    print(f"loading {args.dataset}{where} ...", flush=True)
    data = load_dataset(
        args.dataset, data_dir=args.data_dir, download=not args.no_download, seed=args.seed,
        progress=not args.no_progress,
    )  # fmt: skip
    print(f"{args.dataset}: {len(data.x_train):,} training and {len(data.x_test):,} test images")
    return data


def main(argv: list[str] | None = None) -> int:
    with SignalGuard().installed():  # SIGTERM at any moment, start-up included, ends with a message and 143
        try:
            return start(argv)
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM before the trainer holds them
            return stopped(getattr(e, "signum", signal.SIGINT), None)


def start(argv: list[str] | None) -> int:
    """Check the options, load the data, build the network, then train (``run``); -> the exit code."""
    started = time.monotonic()
    try:
        args = build_parser().parse_args(argv)
        kernels, checkpoint = check_args(args)
        if args.max_restarts:  # this process only supervises; a child trains (tinyconv/supervisor.py)
            os.environ.setdefault(SECRET_ENV, secrets.token_hex(16))  # every child's: the workers rejoin a restart
            command = restartable_command(str(Path(__file__).resolve()), sys.argv[1:] if argv is None else argv)
            return supervise(command, Path(args.checkpoint), args.max_restarts)
        keep_freed_memory()  # each step reuses the last step's pages (tinyconv/distributed/heap.py)
        if args.transport == "mpi" and (code := serve_mpi_rank(args)) is not None:
            return code
        backend = tc.get_backend(args.backend, **({"device": args.device} if args.device else {}))
        data = load_data(args)
        if args.insecure:
            print(f"warning: {INSECURE}", file=sys.stderr)
        print(plan_line(args, kernels, len(data.x_train)), flush=True)
    except (UsageError, DataError, *ERRORS) as e:
        return fail(e)
    net = tc.paper_net(kernels, backend, args.norm, seed=args.seed, pool_kernel=args.pool)
    print(net)
    print(f"{net.num_params():,} parameters; master: {backend.describe()['device']} ({args.backend})")
    return run(args, argv, net, backend, data, checkpoint, started)


if __name__ == "__main__":
    sys.exit(main())

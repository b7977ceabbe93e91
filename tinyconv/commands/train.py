"""``tinyconv train``, the main job: check every option, load the data, build the network, start the workers,
split the convolutions by the calibrated speeds, train, and report.

``examples/cifar10_dist.py`` runs this same entry point. :func:`start` reads top to bottom as the run does;
the options are in train_parser.py and the checks that come before any work in train_checks.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import signal
import sys
import time
from pathlib import Path

import numpy as np

import tinyconv as tc
from tinyconv.checkpoint import Checkpoint
from tinyconv.cifar10 import DataError, default_data_dir
from tinyconv.commands.train_checks import BY_IMAGES, check_args
from tinyconv.commands.train_parser import build_parser
from tinyconv.data import Dataset, load_dataset
from tinyconv.distributed.heap import keep_freed_memory
from tinyconv.distributed.rebalance import Rebalancer
from tinyconv.distributed.runtime import Runtime
from tinyconv.distributed.worker.handler import Worker
from tinyconv.metrics import MetricsWriter
from tinyconv.options import UsageError, config_text
from tinyconv.presets import PRESETS, Preset
from tinyconv.report import summary_table
from tinyconv.stopping import SignalGuard
from tinyconv.supervisor import restartable_command, supervise
from tinyconv.trainer import TrainConfig, Trainer, planned_steps
from transports.mpi_worker import serve_if_worker
from transports.session.settings import SECRET_ENV

ERRORS = (ValueError, FileNotFoundError, FloatingPointError, TimeoutError, OSError, RuntimeError, DataError)
EXIT_FAILED, EXIT_USAGE = 1, 2


def serve_mpi_rank(args: argparse.Namespace) -> int | None:
    """mpiexec runs this script on every rank: rank 0 is the master (None); any other serves it, with
    the workers' backend, and its exit code ends this process here."""
    device = {"device": args.worker_device} if args.worker_device else {}
    make = lambda: Worker(tc.get_backend(args.worker_backend or args.backend, **device))  # noqa: E731
    return serve_if_worker(make, peer_timeout_s=args.peer_timeout)


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
        worker_threads=args.threads,
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
        argv=sys.argv if argv is None else ["tinyconv train", *argv],
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
        ],
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


def expectation(args: argparse.Namespace) -> str:
    """The preset's measured figures, when this run is the one they were measured on; else why there are none."""
    preset: Preset = PRESETS[args.preset]
    if args.dataset != "cifar10":
        return f"no expected accuracy: {args.dataset} data (preset {preset.name}'s figures are for CIFAR-10)"
    if args.changed:
        return f"no expected accuracy: this run changes preset {preset.name} ({', '.join(args.changed)})"
    return preset.expectation()


def plan_line(args: argparse.Namespace, kernels: tuple[int, int], n_train: int) -> str:
    """What the run will do, in one line before it starts: the network it trains (as built, --conv1 and
    --conv2 included), the epochs and steps, and what to expect, only where the preset's figures apply."""
    per_epoch, total, warmup = planned_steps(n_train, train_config(args))
    epochs = -(-total // per_epoch)
    norm = {"lrn": "with LRN", "batch": "with batch norm"}.get(args.norm, "without normalisation")
    warm = f"the first {warmup:,} a warm-up" if warmup else "no warm-up"
    classifier = f" (the classifier's {args.classifier_lr:g}x)" if args.classifier_lr != 1 else ""
    smoothing = f", label smoothing {args.label_smoothing:g}" if args.label_smoothing else ""
    line = (
        f"plan: {kernels[0]}:{kernels[1]} network {norm}, {epochs} epoch{'s' if epochs != 1 else ''} "
        f"({total:,} steps of batch {args.batch_size}, {warm}), lr {args.lr:g}{classifier} {args.schedule}"
        f"{smoothing} (preset {args.preset}); {expectation(args)}"
    )
    if args.insecure:
        line += " -- INSECURE: workers join without keys"
    return line


def result_line(args: argparse.Namespace, summary: dict, seconds: float) -> str:
    """The run's last line: the test accuracy it reached and its wall time, beside what was expected."""
    acc = summary.get("test_acc")
    reached = "no test accuracy" if acc is None else f"test accuracy {acc:.1%}"
    return f"{reached} after {summary['steps']:,} steps, {seconds / 60:.1f} min in all ({expectation(args)})"


def fail(e: BaseException, trainer: Trainer | None = None, code: int = EXIT_FAILED) -> int:
    """One line on stderr; -> ``code``: 2 for a usage error (before any work), 1 for a failure during the run."""
    print(f"error: {e}", file=sys.stderr)
    note_checkpoint(trainer)
    return code


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
        args.dataset,
        data_dir=args.data_dir,
        download=not args.no_download,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(f"{args.dataset}: {len(data.x_train):,} training and {len(data.x_test):,} test images")
    return data


def main(argv: list[str] | None = None) -> int:
    with SignalGuard().installed():  # SIGTERM at any moment, start-up included, ends with a message and 143
        try:
            return start(argv)
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM before the trainer holds them
            return stopped(getattr(e, "signum", signal.SIGINT), None)


def start(argv: list[str] | None) -> int:
    """The run, top to bottom; -> the exit code."""
    started = time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    # 1. every option checked, before any work: a bad one is one line and exit 2
    try:
        args = build_parser().parse_args(argv)
        kernels, checkpoint = check_args(args)
    except (UsageError, *ERRORS) as e:
        return fail(e, code=EXIT_USAGE)
    if args.print_config:
        print(config_text(vars(args) | {"changed": None}))
        return 0
    if args.max_restarts:  # this process only supervises; a child trains (tinyconv/supervisor.py)
        os.environ.setdefault(SECRET_ENV, secrets.token_hex(16))  # every child's: the workers rejoin a restart
        here = str(Path(tc.__file__).resolve().parent.parent)  # the child imports this tinyconv, installed or not
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        command = restartable_command([sys.executable, "-m", "tinyconv.cli", "train"], argv)
        return supervise(command, Path(args.checkpoint), args.max_restarts)
    keep_freed_memory()  # each step reuses the last step's pages (tinyconv/distributed/heap.py)
    if args.transport == "mpi" and (code := serve_mpi_rank(args)) is not None:
        return code  # this rank was a worker
    # 2. the master's backend and the data, then what the run will do
    try:
        backend = tc.get_backend(args.backend, **({"device": args.device} if args.device else {}))
        data = load_data(args)
    except ERRORS as e:
        return fail(e)
    if args.insecure:
        print(f"warning: {INSECURE}", file=sys.stderr)
    print(plan_line(args, kernels, len(data.x_train)), flush=True)
    # 3. the network, then the workers, the split and the training (run)
    net = tc.paper_net(kernels, backend, args.norm, seed=args.seed, pool_kernel=args.pool)
    print(net)
    print(f"{net.num_params():,} parameters; master: {backend.describe()['device']} ({args.backend})")
    return run(args, argv, net, backend, data, checkpoint, started)

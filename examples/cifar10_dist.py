#!/usr/bin/env python3
"""Train the paper's CNN on CIFAR-10, with its convolutions split by kernels across workers.

    python examples/cifar10_dist.py --transport zmq --backend opencl        # the main job
    python examples/cifar10_dist.py --dataset synthetic --steps 50          # a 30-second smoke run
    python examples/cifar10_dist.py --workers 0                             # the master alone

Reproduces Marques, Falcao & Alexandre, "Distributed learning of CNNs on
heterogeneous CPU/GPU architectures": the master trains every layer but the
convolutions, whose kernels are shared among workers in proportion to their speed.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

# runnable from a source checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import tinyconv as tc  # noqa: E402
from tinyconv.cifar10 import DataError  # noqa: E402
from tinyconv.data import load_dataset  # noqa: E402
from tinyconv.heap import keep_freed_memory  # noqa: E402
from tinyconv.metrics import MetricsWriter  # noqa: E402
from tinyconv.model import NORMS, PAPER_ARCHS, parse_arch  # noqa: E402
from tinyconv.plugins import available_backends, available_transports  # noqa: E402
from tinyconv.schedule import SCHEDULES  # noqa: E402
from tinyconv.shard.rebalance import Rebalancer  # noqa: E402
from tinyconv.trainer import TrainConfig, Trainer, summary_table  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("network")
    g.add_argument(
        "--arch",
        default="50:500",
        help=f"kernel counts C1:C2 of the two conv layers; the paper's are {', '.join(PAPER_ARCHS)} "
        "(default %(default)s)",
    )
    g.add_argument("--conv1", type=int, help="kernels of conv layer 1 (overrides --arch)")
    g.add_argument("--conv2", type=int, help="kernels of conv layer 2 (overrides --arch)")
    g.add_argument(
        "--norm",
        choices=NORMS,
        default="lrn",
        help="normalisation after each conv (default %(default)s, as the paper)",
    )
    g.add_argument(
        "--pool",
        type=int,
        choices=(2, 3),
        default=3,
        help="max-pool window: 3 (3x3 stride 2, overlapping) or 2 (2x2 stride 2)",
    )

    g = p.add_argument_group("compute")
    g.add_argument(
        "--backend",
        default="numpy",
        help=f"master's backend: {', '.join(available_backends())} (default %(default)s)",
    )
    g.add_argument(
        "--device",
        help="OpenCL device: PLATFORM:DEVICE index or a name substring "
        "(default $TINYCONV_OPENCL_DEVICE, else the first GPU)",
    )

    g = p.add_argument_group("distribution (the paper's technique: conv kernels split across workers)")
    g.add_argument(
        "--transport",
        default="inproc",
        help=f"how the master reaches its workers: {', '.join(available_transports())} (default %(default)s)",
    )
    g.add_argument(
        "--workers",
        type=int,
        default=2,
        help="workers (default %(default)s; 0: the master alone, the baseline)",
    )
    g.add_argument("--worker-backend", help="the workers' backend, may differ from the master's (default: --backend)")
    g.add_argument("--worker-device", help="the workers' OpenCL device (default: their own first GPU/device)")
    g.add_argument("--worker-threads", type=int, help="BLAS/OpenMP threads per local worker process")
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
        "--master-share",
        choices=("auto", "0"),
        default="auto",
        help="auto: the master computes a share of kernels too, by its speed; 0: it only coordinates",
    )
    g.add_argument(
        "--rebalance",
        choices=("on", "off"),
        default="on",
        help="re-split kernels from measured step times when a worker lags (default %(default)s)",
    )
    g.add_argument(
        "--rebalance-threshold",
        type=float,
        default=0.10,
        help="rebalance when the slowest participant lags the mean finish time by more than this fraction for "
        "3 steps in a row (default %(default)s; lower follows small imbalances, higher ignores more noise)",
    )
    g.add_argument(
        "--fuse",
        choices=("on", "off"),
        default="on",
        help="on: workers also run the ReLU/LRN/max pool after each conv on their own channels (with a "
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
        "auto = channels with at most 2 workers, all on this machine, else kernels (default %(default)s)",
    )
    g.add_argument(
        "--start-timeout",
        type=float,
        help="seconds to wait for every worker's hello (default 60; 600 with --external-workers)",
    )

    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=10, help="epochs (default %(default)s)")
    g.add_argument("--steps", type=int, help="stop after N steps in total, then evaluate (smoke runs, quick checks)")
    g.add_argument("--batch-size", type=int, default=64, help="default %(default)s")
    g.add_argument(
        "--lr",
        type=float,
        default=0.01,
        help="peak learning rate (default %(default)s; much higher diverges early)",
    )
    g.add_argument("--momentum", type=float, default=0.9, help="default %(default)s")
    g.add_argument("--weight-decay", type=float, default=5e-4, help="on conv and linear weights (default %(default)s)")
    g.add_argument(
        "--schedule", choices=SCHEDULES, default="cosine", help="learning-rate schedule (default %(default)s)"
    )
    g.add_argument(
        "--warmup-epochs", type=float, default=1.0, help="linear warm-up from 0 to --lr (default %(default)s)"
    )
    g.add_argument("--no-augment", action="store_true", help="no random crop / horizontal flip")
    g.add_argument("--seed", type=int, default=0, help="seeds the weights, the shuffle and the augmentation")

    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=("cifar10", "synthetic"), default="cifar10", help="default %(default)s")
    g.add_argument(
        "--data-dir",
        help="folder holding cifar-10-batches-py/ (default $TINYCONV_DATA, else ~/.cache/tinyconv)",
    )
    g.add_argument("--no-download", action="store_true", help="fail instead of downloading CIFAR-10 when missing")

    g = p.add_argument_group("output")
    g.add_argument("--metrics-out", help="write JSON-lines metrics (run, step, epoch, summary events) here")
    g.add_argument("--checkpoint", help="save a checkpoint here at each epoch end and at the stop")
    g.add_argument("--resume", help="resume bit-identically from this checkpoint")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        schedule=args.schedule,
        warmup_epochs=args.warmup_epochs,
        max_steps=args.steps,
        augment=not args.no_augment,
        seed=args.seed,
        checkpoint=args.checkpoint,
        progress=not args.no_progress,
    )


def start_cluster(args: argparse.Namespace, net: tc.Network) -> tc.Cluster | None:
    """The workers and the cluster sharing net's convolutions with them (None with --workers 0)."""
    if args.workers == 0:
        return None
    cluster = tc.distribute(
        net,
        args.transport,
        args.workers,
        worker_backend=args.worker_backend or args.backend,
        worker_device=args.worker_device,
        bind=args.bind,
        external=args.external_workers,
        worker_threads=args.worker_threads,
        start_timeout=args.start_timeout or (600.0 if args.external_workers else 60.0),
        calibrate=False,  # below, once the workers are printed and the run recorded
        master_share=args.master_share,
        rebalance=args.rebalance == "on",
        rebalancer=Rebalancer(threshold=args.rebalance_threshold),
        fuse=args.fuse == "on",
        split=args.split,
    )
    for w in cluster.workers:
        print(f"worker {w.index}: {w.backend} on {w.device.get('device')} ({w.hostname or 'local'})")
    return cluster


def record_run(metrics: MetricsWriter, args: argparse.Namespace, argv: list[str] | None, net, backend, cluster) -> None:
    workers = cluster.workers if cluster is not None else []
    metrics.write(
        "run",
        argv=sys.argv if argv is None else ["cifar10_dist.py", *argv],
        seed=args.seed,
        backend=backend.describe(),
        transport=args.transport if workers else None,
        workers=[{"index": w.index, "backend": w.backend, "device": w.device, "host": w.hostname} for w in workers],
        arch=net.config,
        dataset=args.dataset,
        batch_size=args.batch_size,
        train_config=vars(args),
        versions={"tinyconv": tc.__version__, "numpy": np.__version__, "python": platform.python_version()},
    )


def train(args: argparse.Namespace, argv: list[str] | None, net, backend, data, metrics) -> dict:
    """Start the workers, calibrate, train; the workers stop whatever happens."""
    cluster = start_cluster(args, net)
    try:
        record_run(metrics, args, argv, net, backend, cluster)
        if cluster is not None:
            calibration = cluster.calibrate(net, args.batch_size)
            metrics.write("calibration", **calibration)
            channels = calibration["channel_shares"]
            print(
                f"calibrated shares ({', '.join(cluster.participants)}): kernels {calibration['shares']}"
                + (f", input channels {channels}" if channels else "")
            )
        trainer = Trainer(net, data, train_config(args), metrics, cluster=cluster)
        if args.resume:
            trainer.resume(args.resume)
            print(f"resumed from {args.resume} at step {trainer.step}")
        return trainer.fit()
    finally:
        if cluster is not None:
            cluster.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()  # each step reuses the last step's pages (tinyconv/heap.py)
    try:
        c1, c2 = parse_arch(args.arch)
        backend = tc.get_backend(args.backend, **({"device": args.device} if args.device else {}))
        data = load_dataset(
            args.dataset, data_dir=args.data_dir, download=not args.no_download, seed=args.seed,
            progress=not args.no_progress,
        )  # fmt: skip
    except (DataError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    net = tc.paper_net((args.conv1 or c1, args.conv2 or c2), backend, args.norm, seed=args.seed, pool_kernel=args.pool)
    metrics = MetricsWriter(args.metrics_out, append=bool(args.resume))
    print(net)
    print(f"{net.num_params():,} parameters; master: {backend.describe()['device']} ({args.backend})")
    try:
        summary = train(args, argv, net, backend, data, metrics)
    except (ValueError, FileNotFoundError, FloatingPointError, TimeoutError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: workers stopped", file=sys.stderr)
        return 130
    finally:
        metrics.close()
    print(summary_table(summary))
    if args.metrics_out:
        print(f"metrics: {args.metrics_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

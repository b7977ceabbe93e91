"""``tinyconv train``'s options: the shared ones from :mod:`tinyconv.options`, and training's own.

An option a preset sets (the network and the recipe) defaults to None here, so that the run knows which
ones were given; :func:`tinyconv.commands.train_checks.apply_preset` fills the rest from the preset.
"""

from __future__ import annotations

import argparse

from tinyconv.options import NON_NEGATIVE, POSITIVE, Parser, add, add_config, count, number
from tinyconv.presets import DEFAULT_PRESET, PRESETS, Preset

PLANS = ("adaptive", "fixed", "equal")
USAGE = """examples:
    tinyconv train                                             # the quick preset: >= 75 % in about 16 minutes
    tinyconv train --preset best                               # 30 epochs, 83.8 % in about 90 minutes on 2 cores
    tinyconv train --dataset synthetic --steps 50              # a smoke run: a minute or two
    tinyconv train --workers 0                                 # the master alone
    tinyconv train --transport zmq --backend opencl            # the main job (examples/cifar10_dist.py)
    mpiexec -n 3 tinyconv train --transport mpi                # rank 0 the master, ranks 1-2 its workers
    tinyconv train --checkpoint run.npz --checkpoint-every 200 # then, after a stop:
    tinyconv train --checkpoint run.npz --resume run.npz       # bit-identical
    tinyconv train --plan equal --seed 1                       # the same losses on every run
    tinyconv train --parallel data --transport zmq --workers 1 # data parallelism instead
    tinyconv train --print-config > run.toml                   # the settings in a file; then --config run.toml

The master trains every layer but the convolutions, whose kernels are shared among the workers in proportion
to their speed (Marques, Falcao & Alexandre 2017). A preset gives the network and the recipe; any option
given beside it wins. The run's first line says what it will do and what to expect, as measured; the last,
the test accuracy reached and the wall time. With --checkpoint, an error, Ctrl-C (exit 130) or SIGTERM
(exit 143) checkpoints the last whole step. A bad option is one line on stderr and exit 2, before any work
starts; a failure during the run exits 1."""


def build_parser(prog: str = "tinyconv train") -> Parser:
    p = Parser(
        prog=prog,
        description="Train the paper's CNN on CIFAR-10, its convolutions split by kernels across workers.",
        epilog=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for group in (_preset, _network, _distribution, _split, _training, _data, _output):
        group(p)
    add_config(p)
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
        help=f"{choices.replace('%', '%%')} "
        "(default %(default)s; tinyconv/presets.py has each one's settings and how they were measured)",
    )


def _network(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network")
    add(g, "arch", "norm", helps={"arch": preset_default("arch"), "norm": preset_default("norm")})
    g.add_argument("--conv1", type=count(1), metavar="N", help="kernels of conv layer 1 (overrides --arch)")
    g.add_argument("--conv2", type=count(1), metavar="N", help="kernels of conv layer 2 (overrides --arch)")
    g.add_argument(
        "--pool",
        type=int,
        choices=(2, 3),
        default=3,
        help="max-pool window: 3 (3x3 stride 2, overlapping) or 2 (2x2 stride 2)",
    )
    add(g, "backend", "device", defaults={"backend": "numpy"}, helps={"backend": "the master's"})


def _distribution(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distribution (the paper's technique: conv kernels split across workers)")
    add(
        g,
        "parallel",
        "transport",
        "workers",
        defaults={"parallel": "model", "transport": "inproc"},
        helps={
            "parallel": "docs/how-it-works.md compares the three",
            "workers": "default: one per core beside the master's, at least 1; 2 with --external-workers; under "
            "--transport mpi, the other ranks mpiexec started",
        },
    )
    g.add_argument("--worker-backend", metavar="NAME", help="the workers' backend (default: --backend)")
    g.add_argument("--worker-device", metavar="P:D", help="the workers' OpenCL device (default: their first)")
    add(g, "threads", helps={"threads": "local workers; default: this machine's cores over the participants"})
    add(g, "bind", helps={"bind": "default tcp://127.0.0.1:<free port>, tcp://*:5555 with --external-workers"})
    g.add_argument(
        "--external-workers",
        action="store_true",
        help="zmq: don't start workers here; print the command to run on each worker machine and wait for them",
    )
    add(
        g,
        "start_timeout",
        "peer_timeout",
        defaults={"peer_timeout": 30.0},
        helps={
            "start_timeout": "default 60; 600 with --external-workers; a local worker that fails ends the wait "
            "at once, with its own message",
            "peer_timeout": "the workers give the master as much",
        },
    )
    g.add_argument(
        "--key",
        metavar="FILE",
        help="zmq: the master's secret key file (NAME.key_secret from `tinyconv "
        "keygen`), with --authorized-keys: only workers with those keys join, and the traffic is "
        "encrypted (needed to bind beyond loopback)",
    )
    g.add_argument("--authorized-keys", metavar="DIR", help="zmq: the folder of the workers' public keys (NAME.key)")
    add(g, "insecure")


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
        help="adaptive: split by the calibrated speeds, "
        "then rebalanced as the step times say; fixed: split by the calibrated speeds, never rebalanced, "
        "and on --resume the checkpoint's split; equal: an equal split, never rebalanced, so the same seed "
        "gives bit-identical losses (default %(default)s)",
    )
    add(g, "rebalance", helps={"rebalance": "default on with --plan adaptive; a fixed or equal plan never does"})
    g.add_argument(
        "--rebalance-threshold",
        type=POSITIVE,
        default=0.10,
        metavar="F",
        help="rebalance when the "
        "slowest participant lags the mean finish time by more than this fraction for 3 steps in a row "
        "(default %(default)s)",
    )
    add(
        g,
        "fuse",
        "split",
        defaults={"fuse": "on", "split": "auto"},
        helps={
            "split": "kernels builds the whole im2col on every participant and sums full-size partial dX; "
            "channels does nothing twice and moves more bytes"
        },
    )
    add(
        g,
        "wire_precision",
        defaults={"wire_precision": "fp32"},
        helps={
            "wire_precision": "the arithmetic stays float32; --parallel model only; docs/how-it-works.md "
            "describes each format"
        },
    )
    g.add_argument(
        "--spot-check",
        type=number(0, 1, what="a fraction"),
        default=0.03,
        metavar="FRACTION",
        help="the master recomputes samples of each worker's results in at most this fraction of the "
        "worker's work, and drops a worker whose numbers are off by more than float32 round-off; 0 "
        "trusts them; not with a narrowed --wire-precision (default %(default)s)",
    )


def _training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=count(1), metavar="N", help=f"epochs ({preset_default('epochs')})")
    g.add_argument("--steps", type=count(1), metavar="N", help="stop after N steps in total, then evaluate")
    add(g, "batch_size", helps={"batch_size": preset_default("batch_size")})
    g.add_argument("--lr", type=POSITIVE, help=f"peak learning rate ({preset_default('lr')})")
    g.add_argument("--momentum", type=number(0, 1, what="a fraction"), default=0.9, help="(default %(default)s)")
    g.add_argument(
        "--weight-decay", type=NON_NEGATIVE, help=f"on conv and linear weights ({preset_default('weight_decay')})"
    )
    g.add_argument(
        "--classifier-lr",
        type=NON_NEGATIVE,
        metavar="F",
        help="a factor on the learning rate of the "
        "classifier (the last layer): 0.1 keeps the paper's 32,000-wide classifier from throwing the first "
        f"steps' loss to 30-40 ({preset_default('classifier_lr')})",
    )
    g.add_argument(
        "--label-smoothing",
        type=number(0, 1, what="a fraction"),
        default=0.0,
        metavar="EPS",
        help="train against (1 - EPS) onehot + EPS / 10; the test loss stays the plain cross-entropy "
        "(default %(default)s; no preset sets it)",
    )
    g.add_argument(
        "--schedule",
        choices=("constant", "step", "cosine"),
        help="learning-rate schedule after the "
        f"warm-up; step divides by 10 at 50%% and 75%% ({preset_default('schedule')})",
    )
    g.add_argument(
        "--warmup",
        type=number(0, 1, what="a fraction"),
        metavar="FRACTION",
        help="linear learning-rate "
        "warm-up over this fraction of the run's planned steps (after --steps), so that a short run warms "
        f"up in proportion ({preset_default('warmup')})",
    )
    g.add_argument(
        "--warmup-epochs",
        type=NON_NEGATIVE,
        metavar="N",
        help="instead of --warmup: a learning-rate warm-up of N epochs, whatever the run's length",
    )
    g.add_argument("--no-augment", action="store_true", help="no random crop / horizontal flip")
    add(g, "seed")


def _data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=("cifar10", "synthetic"), default="cifar10", help="default %(default)s")
    g.add_argument(
        "--data-dir",
        metavar="DIR",
        help="folder holding cifar-10-batches-py/ (default $TINYCONV_DATA, else ~/.cache/tinyconv)",
    )
    g.add_argument("--no-download", action="store_true", help="fail instead of downloading CIFAR-10 when missing")


def _output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--metrics-out",
        metavar="FILE",
        help="write JSON-lines metrics (run, step, epoch, events, "
        "summary) here; with --resume, appended to, without the steps the checkpoint does not have",
    )
    g.add_argument(
        "--checkpoint",
        metavar="FILE",
        help="save a checkpoint here (atomically) at each epoch end, at "
        "the stop, and on the way out: an error, Ctrl-C or SIGTERM saves the last whole step",
    )
    g.add_argument("--checkpoint-every", type=count(1), metavar="N", help="also save the checkpoint every N steps")
    g.add_argument("--checkpoint-minutes", type=POSITIVE, metavar="M", help="also save it when M minutes have passed")
    g.add_argument(
        "--resume",
        metavar="FILE",
        help="resume bit-identically from this checkpoint (same --arch, --norm, --pool and --batch-size)",
    )
    g.add_argument(
        "--max-restarts",
        type=count(0),
        default=0,
        metavar="N",
        help="run training under a supervisor "
        "that restarts it from --checkpoint when it dies abnormally (a crash, SIGKILL, the out-of-memory "
        "killer), at most N times; workers rejoin the new master (default 0: no supervisor)",
    )
    add(g, "no_progress")

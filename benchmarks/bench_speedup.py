#!/usr/bin/env python3
"""The paper's speedup on one machine: the master alone, then master + 1 worker over ZeroMQ.

    python benchmarks/bench_speedup.py                      # 300:1000, batch 64
    python benchmarks/bench_speedup.py --fuse off --split kernels   # the paper's conv-only split
    python benchmarks/bench_speedup.py --arch 500:1500 --timed-steps 4
    python benchmarks/bench_speedup.py --batch-size 256 --pipeline 0 32 --rounds 2   # the pipeline's A/B

One device = one process pinned to one core with one BLAS thread, as the paper's
CPUs: the master runs on core 0, the worker (started here under ``taskset -c 1``, the
way a user starts one by hand) on core 1, and they talk over TCP on loopback.
Training steps (forward, loss, backward, SGD) are timed on random CIFAR-shaped data:
after calibration and --untimed-steps distributed steps (rebalancing settles), solo and
distributed steps alternate, so that a drift in the shared machine's speed hits both; after
each switch --settle untimed steps run first (the master alone's more while they still fault
memory in), so that each timed step is a steady one.
Printed: the median step of each and its split into comm / conv / comp (the paper's
Fig. 6), each participant's compute, the distributed step op by op (each participant's
compute and what the op waited beyond the slowest), the speedup, and the Amdahl bound
implied by the solo step's split, 1 / ((1 - f) + f / 2) with f = conv / step -- the bound
for the paper's split, which the fused tails (--fuse on) go past. No asserts.
"""

from __future__ import annotations

import os

# one BLAS thread per process: set before numpy is imported (here and in the worker)
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

from backends import get_backend  # noqa: E402
from tinyconv.distributed.heap import keep_freed_memory  # noqa: E402
from tinyconv.distributed.rebalance import Rebalancer  # noqa: E402
from tinyconv.distributed.shard.by_channels import PIPELINE  # noqa: E402
from tinyconv.distributed.shard.cluster import Cluster  # noqa: E402
from tinyconv.lab.experiment.run import alternate, med, one_step, solo_split, training_setup  # noqa: E402

# the timing itself lives in the library, where `tinyconv experiment grid` runs it for every cell
from tinyconv.lab.experiment.workers import grid_workers, pin_master  # noqa: E402
from tinyconv.lab.paper import PAPER_SPEEDUPS  # noqa: E402
from tinyconv.options import POSITIVE, Parser, UsageError, add, count  # noqa: E402
from tinyconv.report import format_table  # noqa: E402


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    add(
        p,
        "arch",
        "norm",
        "batch_size",
        "timed_steps",
        "untimed_steps",
        defaults={"arch": "300:1000", "norm": "lrn", "batch_size": 64, "timed_steps": 5, "untimed_steps": 12},
        helps={
            "timed_steps": "of each configuration, in each round",
            "untimed_steps": "here distributed steps after the calibration, for the rebalancer to settle",
        },
    )
    p.add_argument(
        "--settle",
        type=count(0),
        default=1,
        metavar="N",
        help="untimed steps of each configuration after every switch between them (default %(default)s): "
        "a step right after a switch runs on the caches and memory the other configuration left behind, "
        "which a real training run never does",
    )
    add(
        p,
        "backend",
        "fuse",
        "split",
        defaults={"backend": "numpy", "fuse": "on", "split": "auto"},
        helps={"backend": "the master's and the worker's"},
    )
    p.add_argument(
        "--rebalance-threshold",
        type=POSITIVE,
        default=0.03,
        metavar="F",
        help="rebalance when the slowest participant lags the mean finish time by more than this fraction "
        "for 3 steps (default %(default)s; the main job's default is 0.10, for noisier real clusters)",
    )
    p.add_argument(
        "--pipeline",
        type=count(0),
        nargs="+",
        default=[PIPELINE],
        metavar="IMAGES",
        help="images per chunk of conv2 split by input channels (0: the whole batch at once; default "
        "%(default)s); several values are timed in turn, each alternated with the master alone",
    )
    p.add_argument(
        "--rounds", type=count(1), default=1, metavar="N", help="times through the --pipeline values (default 1)"
    )
    return p


def timed(args: argparse.Namespace, be) -> tuple[dict[int, tuple[list, list]], dict, list[str], int]:
    """Calibrate, warm up, then alternate the master alone and master + 1 worker: each --pipeline value's step
    records (solo, distributed), the solo step's split (for the Amdahl bound), the participants, their count."""
    net, opt, x, y = training_setup(args.arch, args.norm, args.batch_size, be)
    # the worker, started as a user would (`tinyconv worker`), pinned to core 1 under taskset, over TCP
    # on loopback, one BLAS thread: the grid's local workers (tinyconv/lab/experiment/workers.py)
    with grid_workers(1, "zmq", args.backend, timeout=60) as (transport, workers):
        pin_master()  # the master: core 0, once the worker has its own core
        cluster = Cluster(
            transport,
            workers,
            be,
            master_share="auto",
            rebalancer=Rebalancer(threshold=args.rebalance_threshold),
            recv_timeout=600,
            fuse=args.fuse == "on",
            split=args.split,
            pipeline=args.pipeline[0],
        )
        calib = cluster.calibrate(net, args.batch_size)
        print(f"calibrated times (s, master/worker per layer): {calib['times']} -> shares {calib['shares']}")
        for _ in tqdm(range(args.untimed_steps), desc="warm-up", disable=None):
            one_step(net, opt, x, y, cluster)
        # Alternate the two configurations step by step, so that a drift in the shared
        # machine's speed hits both alike: solo = the same network with its own layers back
        # (what --workers 0 runs), while the worker waits on the other core.
        recs: dict[int, tuple[list, list]] = {v: ([], []) for v in args.pipeline}
        total = args.timed_steps * args.rounds * len(recs)
        with tqdm(total=total, desc="solo / distributed steps", disable=None) as bar:
            for _ in range(args.rounds):
                for v in recs:
                    cluster.pipeline = v
                    solo, dist = alternate(net, opt, x, y, cluster, args.timed_steps, args.settle, bar.update)
                    recs[v][0].extend(solo)
                    recs[v][1].extend(dist)
        cluster.detach(net)
        split = solo_split(net, x, y)  # one extra solo step, timed layer by layer for the Amdahl bound
        return recs, split, list(cluster.participants), len(cluster.placement)


def main() -> None:
    args = build_parser().parse_args()
    keep_freed_memory()  # as the example and the worker do (tinyconv/distributed/heap.py)
    taskset = shutil.which("taskset")
    be = get_backend(args.backend)
    print(
        f"{args.arch} norm={args.norm} batch size {args.batch_size}, backend {args.backend}, fuse {args.fuse}, "
        f"split {args.split}, 1 BLAS thread per process, master on core 0, "
        f"worker on core 1 ({'taskset' if taskset else 'unpinned'})"
    )
    recs, split, participants, n = timed(args, be)
    f = split["conv_s"] / split["time_s"]
    report_steps(args, recs, f)
    for v, (_, dist_recs) in recs.items():
        report_ops(args, v, dist_recs, f, participants, n)
    solo_t, dist_t = med(recs[args.pipeline[-1]][0], "time_s"), med(recs[args.pipeline[-1]][1], "time_s")
    two_cpus = [q for q in PAPER_SPEEDUPS if (q.participants, q.device) == (2, "cpu")]
    paper = ", ".join(f"{q.speedup:.2f}x on {q.arch}" for q in two_cpus)
    print(
        f"Amdahl bound for 2 devices 1/((1-f)+f/2) = {1 / ((1 - f) + f / 2):.2f}x with conv alone parallel; "
        f"measured {solo_t / dist_t:.2f}x with pipeline {args.pipeline[-1]} (paper, 2 CPUs: {paper})"
    )


def report_steps(args: argparse.Namespace, recs: dict[int, tuple[list, list]], f: float) -> None:
    """The median step of each configuration and its comm / conv / comp, and the speedup."""
    rows = []
    for v, (solo_recs, dist_recs) in recs.items():
        solo_t, dist_t = med(solo_recs, "time_s"), med(dist_recs, "time_s")
        rows.append((f"master alone (beside pipeline {v})", solo_t, 0.0, f * solo_t, (1 - f) * solo_t, 1.0, "-"))
        shares = str(dist_recs[-1]["shares"])
        shares += "".join(f", {name} input channels {c}" for name, c in dist_recs[-1]["channel_shares"].items())
        figures = [med(dist_recs, k) for k in ("comm_s", "conv_s", "comp_s")]
        rows.append((f"master + 1 worker (zmq), pipeline {v}", dist_t, *figures, solo_t / dist_t, shares))
    print(
        format_table(
            ("configuration", "step s", "comm s", "conv s", "comp s", "speedup", "kernels per participant"),
            rows,
            title=f"median of {args.timed_steps * args.rounds} training steps each, alternated",
        )
    )


def report_ops(args: argparse.Namespace, v: int, dist_recs: list, f: float, participants: list[str], n: int) -> None:
    """Each participant's conv compute, and the distributed step op by op (medians)."""
    per = [statistics.median(r["participant_conv_s"][i] for r in dist_recs) for i in range(n)]
    print(
        f"pipeline {v}: master alone's conv and comp split by the fraction of one step timed layer by layer "
        f"(f = conv / step = {f:.3f}); distributed: conv = slowest participant"
        + (" (conv + its fused ReLU/LRN/batch norm/pool)" if args.fuse == "on" else "")
        + "; each participant's conv compute per step: "
        + ", ".join(f"{name} {t:.2f} s" for name, t in zip(participants, per, strict=True))
    )
    # where the distributed step goes, op by op (medians): a step waits for the slowest participant
    # of each op, then for the transfers ("wait" = wall - slowest compute); "master busy" = wall - the time
    # the master sat blocked on a result: its compute, and its share of the I/O, copies and sums
    op_rows = []
    for j, op in enumerate(dist_recs[0]["ops"]):
        ops = [r["ops"][j] for r in dist_recs]
        computes = [statistics.median(o["compute_s"][i] for o in ops) for i in range(n)]
        wall = statistics.median(o["wall_s"] for o in ops)
        busy = statistics.median(o["wall_s"] - o["master_waited_s"] for o in ops)
        wait = statistics.median(o["wall_s"] - max(o["compute_s"]) for o in ops)
        op_rows.append((f"{op['layer']} {op['op']}", wall, *computes, busy, wait))
    print(
        format_table(
            ("op", "wall s", *(f"{name} compute s" for name in participants), "master busy s", "wait s"),
            op_rows,
            title=f"master + 1 worker, pipeline {v}, op by op (medians)",
        )
    )


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_speedup: error: {e}", file=sys.stderr)
        sys.exit(2)

#!/usr/bin/env python3
"""The paper's speedup on one machine: the master alone, then master + 1 worker over ZeroMQ.

    python benchmarks/bench_speedup.py                      # 300:1000, batch 64
    python benchmarks/bench_speedup.py --arch 500:1500 --steps 4

One device = one process pinned to one core with one BLAS thread, as the paper's
CPUs: the master runs on core 0, the worker (started here under ``taskset -c 1``, the
way a user starts one by hand) on core 1, and they talk over TCP on loopback.
Training steps (forward, loss, backward, SGD) are timed on random CIFAR-shaped data,
after --warmup steps. Printed per configuration: the median step and its split into
comm / conv / comp (the paper's Fig. 6), the speedup, and the Amdahl bound implied by
the solo run's split, 1 / ((1 - f) + f / 2) with f = conv / step. No asserts.
"""

from __future__ import annotations

import os

# one BLAS thread per process: set before numpy is imported (here and in the worker)
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from backends import get_backend  # noqa: E402
from tinyconv.distributed import ShardedConv  # noqa: E402
from tinyconv.model import paper_net, parse_arch  # noqa: E402
from tinyconv.optim import SGD  # noqa: E402
from tinyconv.report import format_table  # noqa: E402
from tinyconv.worker import stop_workers  # noqa: E402
from transports.zmq_transport import ZmqTransport  # noqa: E402


def time_steps(dist: ShardedConv, net, batch: int, steps: int, warmup: int) -> list[dict]:
    """Run warmup + steps training steps; return each timed step's split."""
    be = net.backend
    opt = SGD(net)
    rng = np.random.default_rng(0)
    x = be.asarray(rng.standard_normal((batch, 3, 32, 32)).astype(np.float32))
    y = rng.integers(0, 10, batch)
    records = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        net.train_step_grads(x, y)
        opt.step(0.001)
        be.synchronize()
        dt = time.perf_counter() - t
        split = dist.end_step()
        if i >= warmup:
            records.append({"time_s": dt, **split, "comp_s": max(0.0, dt - split["comm_s"] - split["conv_s"])})
    return records


def median_row(name: str, recs: list[dict], base: float | None) -> tuple:
    med = {k: statistics.median(r[k] for r in recs) for k in ("time_s", "comm_s", "conv_s", "comp_s")}
    shares = recs[-1]["shares"]
    return (
        name,
        med["time_s"],
        med["comm_s"],
        med["conv_s"],
        med["comp_s"],
        (base / med["time_s"]) if base else 1.0,
        str(shares),
    ), med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="300:1000")
    p.add_argument("--norm", default="lrn", choices=("lrn", "batch", "none"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (rebalancing settles here)")
    p.add_argument("--backend", default="numpy", help="backend of the master and the worker")
    args = p.parse_args()
    c1, c2 = parse_arch(args.arch)
    taskset = shutil.which("taskset")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})  # the master: core 0
    be = get_backend(args.backend)
    print(
        f"{args.arch} norm={args.norm} batch {args.batch}, backend {args.backend}, "
        f"1 BLAS thread per process, master on core 0, worker on core 1 ({'taskset' if taskset else 'unpinned'})"
    )

    # 1. the master alone: a ShardedConv with no workers computes every kernel itself,
    #    which times the conv layers with the same code path as the distributed run
    net = paper_net(be, c1, c2, args.norm, seed=0)
    solo = ShardedConv(None, [], be, master_share="auto", rebalance=False)  # type: ignore[arg-type]
    solo.attach(net)
    solo_recs = time_steps(solo, net, args.batch, args.steps, args.warmup)

    # 2. master + 1 worker over zmq on loopback; the worker started as a user would, pinned to core 1
    transport = ZmqTransport(bind="tcp://127.0.0.1:0", peer_timeout_s=60.0)
    cmd = [
        sys.executable,
        "-m",
        "tinyconv.worker",
        "--connect",
        transport.bound_address,
        "--backend",
        args.backend,
        "--threads",
        "1",
        "--quiet",
        "--timeout",
        "60",
    ]
    proc = subprocess.Popen(([taskset, "-c", "1"] if taskset else []) + cmd)
    try:
        workers = transport.start(1, timeout=60)
        net = paper_net(be, c1, c2, args.norm, seed=0)
        dist = ShardedConv(transport, workers, be, master_share="auto", rebalance=True, recv_timeout=600)
        calib = dist.calibrate(net, args.batch)
        print(f"calibrated times (s, master/worker per layer): {calib['times']} -> shares {calib['shares']}")
        dist_recs = time_steps(dist, net, args.batch, args.steps, args.warmup)
    finally:
        transport.close()
        stop_workers([proc])

    row_solo, med_solo = median_row("master alone", solo_recs, None)
    row_dist, med_dist = median_row("master + 1 worker (zmq)", dist_recs, med_solo["time_s"])
    f = med_solo["conv_s"] / med_solo["time_s"]
    print(
        format_table(
            ("configuration", "step s", "comm s", "conv s", "comp s", "speedup", "kernels per participant"),
            [row_solo, row_dist],
            title=f"median of {args.steps} training steps",
        )
    )
    print(
        f"conv fraction of the solo step f = {f:.3f}; Amdahl bound for 2 devices 1/((1-f)+f/2) = "
        f"{1 / ((1 - f) + f / 2):.2f}x; measured {med_solo['time_s'] / med_dist['time_s']:.2f}x "
        f"(paper, 2 CPUs: 1.69x on 300:1000, 1.98x on 500:1500)"
    )


if __name__ == "__main__":
    main()

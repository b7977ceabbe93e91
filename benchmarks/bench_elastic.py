#!/usr/bin/env python3
"""What a lost worker costs: a worker killed (SIGKILL) or stopped (SIGSTOP) mid-run over ZeroMQ.

    python benchmarks/bench_elastic.py                  # 32:64, batch 32, 2 workers, 10 steps, at step 5
    python benchmarks/bench_elastic.py --arch 50:500 --batch-size 64 --steps 8 --at 4

Three runs with the same seed, data and equal starting split (no calibration, no rebalancing,
so that only the loss changes who computes): an uninterrupted one, one where worker 1 is
SIGKILLed just before step --at, and one where it is SIGSTOPped there (and killed after the run).
Printed, per run: each step's time and loss, when the worker was declared lost and why, how long
that took from the signal (the detection time: a dead process's socket closes at once, a stopped
one is lost once silent for 4 heartbeats, 1.6 s), and the largest relative loss difference against the
uninterrupted run. No asserts: tests/test_elastic.py pins the behaviour.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from backends import get_backend  # noqa: E402
from tinyconv.distributed.pool import distribute  # noqa: E402
from tinyconv.model import paper_net  # noqa: E402
from tinyconv.optim import SGD  # noqa: E402
from tinyconv.report import format_table  # noqa: E402


def run(args: argparse.Namespace, sig: signal.Signals | None) -> dict:
    """One run; ``sig`` goes to worker 1 just before step ``args.at`` (1-based)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, 3, 32, 32), dtype=np.float32)
    y = rng.integers(0, 10, args.batch_size)
    net = paper_net(args.arch, get_backend("numpy"), seed=0)
    opt = SGD(net, lr=0.01, momentum=0.9)
    losses, times, signalled = [], [], None
    with distribute(
        net,
        transport="zmq",
        workers=2,
        calibrate=False,
        rebalance=False,
        peer_timeout=args.peer_timeout,
        batch_size=args.batch_size,
        announce=lambda _: None,
    ) as cluster:
        victim, declared, lose = cluster.workers[1], [], cluster.lose

        def timed_lose(workers: dict[int, str]) -> None:  # when the master gives up on the worker
            declared.append(time.perf_counter())
            lose(workers)

        cluster.lose = timed_lose
        label = "uninterrupted" if sig is None else sig.name
        try:
            for step in tqdm(range(1, args.steps + 1), desc=label, leave=False):
                if sig is not None and step == args.at:
                    signalled = time.perf_counter()
                    os.kill(victim.pid, sig)
                t = time.perf_counter()
                losses.append(net.train_step(x, y))
                opt.step()
                times.append(time.perf_counter() - t)
            events = cluster.pop_events()
        finally:
            if sig == signal.SIGSTOP:
                os.kill(victim.pid, signal.SIGKILL)
    lost = [e for e in events if e["event"] == "worker_lost"]
    return {
        "label": label,
        "losses": losses,
        "times": times,
        "lost": lost,
        "detected_s": declared[0] - signalled if declared else None,
        "signal_step_s": times[args.at - 1] if sig is not None else None,
    }


def main() -> None:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="32:64", help="conv1:conv2 kernel counts (default 32:64)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--at", type=int, default=5, help="the step before which worker 1 is signalled (1-based)")
    ceiling = "the most seconds of silence before a worker is lost (a stopped one goes after 4 heartbeats)"
    p.add_argument("--peer-timeout", type=float, default=30.0, help=ceiling)
    args = p.parse_args()
    if not 1 <= args.at <= args.steps:
        p.error(f"--at {args.at} must be between 1 and --steps {args.steps}")
    ref, *hurt = (run(args, s) for s in (None, signal.SIGKILL, signal.SIGSTOP))
    rows = []
    for r in (ref, *hurt):
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        lost = r["lost"][0] if r["lost"] else {}
        rows.append(
            [
                r["label"],
                f"{statistics.median(r['times']):.3f}",
                "-" if r["signal_step_s"] is None else f"{r['signal_step_s']:.2f}",
                "-" if r["detected_s"] is None else f"{r['detected_s']:.2f}",
                lost.get("reason", "-"),
                f"{diff:.1e}",
                f"{r['losses'][-1]:.6f}",
            ]
        )
    print(
        f"{args.arch}, batch {args.batch_size}, master + 2 zmq workers, {args.steps} steps, "
        f"worker 1 signalled before step {args.at}, --peer-timeout {args.peer_timeout:g} s"
    )
    print(
        format_table(
            ["run", "median step s", "that step s", "lost after s", "reason", "max rel loss diff", "last loss"], rows
        )
    )
    for r in hurt:
        print(f"{r['label']}: events {r['lost']}")


if __name__ == "__main__":
    main()

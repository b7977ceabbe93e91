#!/usr/bin/env python3
"""What the master's spot checks cost and catch (tinyconv/distributed/spot_check.py).

    python benchmarks/bench_spot_check.py                          # conv2 of 50:500, a third of it, batch 64
    python benchmarks/bench_spot_check.py --worker-backend opencl --honest-steps 10000 --arch 16:32 --batch-size 32

One worker (a real handler, in this process) answers block tasks of the paper's conv2 -- conv 5x5,
ReLU, LRN, max pool -- on a share of its kernels; the master samples its results with the default budget.
Printed: over ``--honest-steps`` honest steps, the samples taken, false alarms (should be 0), the
backward disagreements a second sample forgave, and the cost: the master's seconds on samples
against the worker's compute seconds, and against what the budget allowed.
Then, for each kind of wrong worker, honest until ``--fault-from`` and wrong from then on, the steps
it took to lose it (1: the fault's first step; median and worst over ``--seeds`` runs): x -50 poison,
1 % on every result, 1 % on dw alone, 1 % noise on dx alone. (A worker wrong from its first step is
always caught there: the first step is always sampled.)
No asserts: tests/test_spot_check.py pins the behaviour.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from backends import get_backend  # noqa: E402
from tinyconv.distributed.rpc import Lost  # noqa: E402
from tinyconv.distributed.shard.block import block_backward, block_forward  # noqa: E402
from tinyconv.distributed.spot_check import SpotCheck  # noqa: E402
from tinyconv.distributed.worker.handler import Worker  # noqa: E402
from tinyconv.report import format_table  # noqa: E402
from transports.base import Message  # noqa: E402

TAIL = [
    {"op": "relu"},
    {"op": "lrn", "size": 5, "alpha": 1e-4, "beta": 0.75, "k": 2.0},
    {"op": "maxpool", "kernel": 3, "stride": 2, "padding": 1},
]
Spoil = Callable[[str, np.ndarray, np.random.Generator], np.ndarray]
FAULTS: dict[str, Spoil] = {
    "x -50 poison": lambda name, a, rng: a * np.float32(-50),
    "1 % on every result": lambda name, a, rng: a * np.float32(1.01),
    "1 % on dw alone": lambda name, a, rng: a * np.float32(1.01) if name == "dw" else a,
    "1 % noise on dx alone": lambda name, a, rng: (
        (a * (1 + 0.01 * rng.standard_normal(a.shape))).astype(np.float32) if name == "dx" else a
    ),
}


def steps(args: argparse.Namespace, spot: SpotCheck, n_steps: int, spoil: Spoil | None, seed: int) -> dict:
    """Run ``n_steps`` steps of one worker's conv2 share; the step it was lost at (None) and its compute seconds."""
    rng = np.random.default_rng(seed)
    c, total = (int(v) for v in args.arch.split(":"))
    f = total // args.share + 8  # its share and LRN's halo
    n, hw = args.batch_size, 16
    worker, master = Worker(get_backend(args.worker_backend)), get_backend("numpy")
    x = rng.standard_normal((n, c, hw, hw), dtype=np.float32)
    w = rng.standard_normal((f, c, 5, 5), dtype=np.float32) / np.float32(np.sqrt(c * 25))
    b = np.zeros(f, np.float32)
    dy = rng.standard_normal((n, f, 8, 8), dtype=np.float32)
    compute, header = 0.0, {"stride": 1, "padding": 2, "tail": TAIL, "own": [4, f - 4], "layer": 1}
    if args.master_share == "auto":  # the master computes a share like it, and the cluster tells the check its speed
        times = []
        for _ in range(6):  # the first ones fault memory in: the median of the last three
            t0 = time.perf_counter()
            _, cache = block_forward(master, x, w, b, 1, 2, TAIL, (4, f - 4))
            block_backward(master, dy, cache, True)
            times.append(time.perf_counter() - t0)
        spot.master_rate[1] = statistics.median(times[3:]) / (3 * (f - 8) * n)
    for step in tqdm(range(1, n_steps + 1), desc="steps", leave=False, disable=n_steps < 100):
        x[rng.integers(n)] = rng.standard_normal((c, hw, hw), dtype=np.float32)  # the data moves on
        fwd = Message("block_forward", {**header, "task": 2 * step, "step": step}, {"x": x, "w": w, "b": b})
        bwd = Message("block_backward", {"need_dx": True, "task": 2 * step + 1, "step": step, "layer": 1}, {"dy": dy})
        for task in (fwd, bwd):
            reply = worker.handle(task)
            compute += reply.header["compute_s"]
            if spoil is not None and step >= args.fault_from:
                reply.arrays = {k: spoil(k, a, rng) for k, a in reply.arrays.items()}
            try:
                spot(1, task, reply, master)
            except Lost:
                return {"lost_at": step, "compute_s": compute}
    return {"lost_at": None, "compute_s": compute}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", default="50:500", help="conv1:conv2 kernels; the worker gets conv2 (default 50:500)")
    p.add_argument("--share", type=int, default=3, help="the worker owns 1/SHARE of conv2's kernels (default 3)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--worker-backend", default="numpy", help="the worker's backend; the master's is numpy")
    p.add_argument("--budget", type=float, default=0.03, help="the spot check's share of each worker's work")
    p.add_argument(
        "--master-share",
        choices=("auto", "0"),
        default="auto",
        help="auto: the master computes a share too, and its speed on it prices the budget (the cluster's default); "
        "0: it only coordinates, and its image samples price it",
    )
    p.add_argument("--honest-steps", type=int, default=200)
    p.add_argument("--fault-steps", type=int, default=60, help="steps each wrong worker runs at most")
    p.add_argument(
        "--fault-from", type=int, default=11, help="the step its fault starts at: honest before, sampled as usual"
    )
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args()

    spot = SpotCheck(args.budget, seed=0)
    honest = steps(args, spot, args.honest_steps, None, seed=0)
    print(
        f"honest: {args.honest_steps} steps of conv2 of {args.arch}, 1/{args.share} of its kernels, "
        f"batch {args.batch_size}, worker on {args.worker_backend}, master on numpy"
    )
    print(f"  lost at step {honest['lost_at']} (a false alarm)" if honest["lost_at"] else "  false alarms: 0")
    print(f"  samples {spot.samples}, forgiven {spot.forgiven}")
    print(
        f"  cost: {spot.seconds:.3f} s of the master against {honest['compute_s']:.3f} s of the worker "
        f"({100 * spot.seconds / honest['compute_s']:.2f} %; budget {100 * args.budget:g} % of the worker's work at "
        f"the master's speed: {spot.earned:.3f} s)"
    )
    rows = []
    for name, spoil in FAULTS.items():
        lost = [
            steps(args, SpotCheck(args.budget, seed=s), args.fault_steps, spoil, seed=s)["lost_at"]
            for s in range(args.seeds)
        ]
        caught = [s - args.fault_from + 1 for s in lost if s is not None and s >= args.fault_from]  # 1: at once
        early = sum(s is not None and s < args.fault_from for s in lost)  # lost while still honest: false alarms
        found = f"{len(caught)}/{len(lost)}" + (f" ({early} early)" if early else "")
        rows.append([name, found, statistics.median(caught) if caught else "-", max(caught, default="-")])
    print(f"wrong from step {args.fault_from} (x -50 and 1 % on every result show in the forward samples):")
    print(format_table(["wrong worker", "caught", "median steps to catch", "worst"], rows))


if __name__ == "__main__":
    main()

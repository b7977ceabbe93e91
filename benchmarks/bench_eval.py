#!/usr/bin/env python3
"""Evaluation time against training time, in the pattern of a run: some training steps, then
``Trainer.evaluate`` on the test images, again.

    python benchmarks/bench_eval.py                                   # 48:96 batch norm, numpy, master alone
    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_eval.py --images 5000
    python benchmarks/bench_eval.py --backend opencl --workers 1      # the main job's set-up: zmq, one local worker

Prints each evaluation's seconds per 10,000 images beside the median training step, and what a
forward-only pass over 10,000 images "should" cost: 10,000 / batch training steps' worth of
forward passes, about a third of their time (a forward is one GEMM per convolution of the three a
training step runs). Each evaluation follows training steps, as in a run, so it pays for whatever
memory those left it (tinyconv/distributed/heap.py is on, as in the main job). Random uint8 images: the time,
not the accuracy, is the point. Not a test: no asserts.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from tinyconv.distributed.heap import keep_freed_memory  # noqa: E402
from tinyconv.options import Parser, UsageError, add, count  # noqa: E402


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    add(
        p,
        "arch",
        "norm",
        "backend",
        "workers",
        "batch_size",
        "timed_steps",
        defaults={
            "arch": "48:96",
            "norm": "batch",
            "backend": "numpy",
            "workers": 0,
            "batch_size": 128,
            "timed_steps": 4,
        },
        helps={
            "workers": "local worker processes over zmq",
            "batch_size": "the training's",
            "timed_steps": "here the training steps before each evaluation",
        },
    )
    p.add_argument(
        "--images", type=count(1), default=10000, metavar="N", help="test images per evaluation (default 10000)"
    )
    p.add_argument(
        "--eval-batch",
        type=count(0),
        default=0,
        metavar="N",
        help="evaluation's batch (default 0: the training batch size)",
    )
    p.add_argument(
        "--rounds",
        type=count(1),
        default=2,
        metavar="N",
        help="how many times: the steps, then an evaluation (default 2)",
    )
    return p


def main() -> None:
    args = build_parser().parse_args()
    keep_freed_memory()

    import tinyconv as tc
    from tinyconv.data import Dataset
    from tinyconv.model import paper_net
    from tinyconv.trainer import TrainConfig, Trainer

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (args.images, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, 10, args.images)
    n_train = args.batch_size * args.timed_steps
    data = Dataset(x[:n_train], y[:n_train], x, y, "random", [str(i) for i in range(10)])
    net = paper_net(args.arch, args.backend, args.norm)
    config = TrainConfig(batch_size=args.batch_size, eval_batch_size=args.eval_batch, progress=False)
    eval_batch = args.eval_batch or args.batch_size

    def run(cluster=None) -> None:
        trainer = Trainer(net, data, config, cluster=cluster)
        evals, steps = [], []
        for _ in range(args.rounds):
            for b in range(args.timed_steps):
                t = time.perf_counter()
                trainer.train_step(
                    x[b * args.batch_size : (b + 1) * args.batch_size],
                    y[b * args.batch_size : (b + 1) * args.batch_size],
                )
                steps.append(time.perf_counter() - t)
            t = time.perf_counter()
            trainer.evaluate(x, y)
            evals.append((time.perf_counter() - t) * 10000 / args.images)
        step = float(np.median(steps[1:]))  # the first step builds kernels and plans
        per_10k = 10000 / args.batch_size * step
        print(
            f"{args.arch} {args.norm}, {args.backend}, workers {args.workers}, evaluation batch {eval_batch}: "
            f"{', '.join(f'{e:.1f}' for e in evals)} s per 10,000 images; training step {step:.3f} s "
            f"(x {10000 / args.batch_size:.0f} = {per_10k:.0f} s, a third {per_10k / 3:.0f} s)"
        )

    if args.workers == 0:
        run()
        return
    largest = max(args.batch_size, eval_batch)
    with tc.distribute(net, "zmq", args.workers, batch_size=args.batch_size, largest_batch=largest) as cluster:
        run(cluster)


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_eval: error: {e}", file=sys.stderr)
        sys.exit(2)

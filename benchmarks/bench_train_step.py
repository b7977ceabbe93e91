#!/usr/bin/env python3
"""Training-step time of the numpy backend against the same network in PyTorch (CPU).

    python benchmarks/bench_train_step.py                     # 50:500, batch 64 and 256, LRN
    python benchmarks/bench_train_step.py --norm batch --arch 150:800

One step = forward, softmax cross-entropy, backward and the SGD update, on random
CIFAR-shaped data. Both run with the same number of threads (torch.set_num_threads
and the BLAS pool numpy uses). Prints medians over --repeats steps after a warm-up,
and the ratio torch / numpy (> 1 means tinyconv is faster). Not a test: no asserts.
PyTorch is optional (`pip install torch`); without it only tinyconv's times print.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from tinyconv.model import paper_net, parse_arch  # noqa: E402
from tinyconv.optim import SGD  # noqa: E402
from tinyconv.plugins import get_backend  # noqa: E402
from tinyconv.report import format_table  # noqa: E402


def time_tinyconv(backend_name: str, c1: int, c2: int, norm: str, batch: int, repeats: int) -> list[float]:
    be = get_backend(backend_name)
    net = paper_net(be, c1, c2, norm, seed=0)
    opt = SGD(net, 0.9, 5e-4)
    rng = np.random.default_rng(0)
    x = be.asarray(rng.standard_normal((batch, 3, 32, 32)).astype(np.float32))
    y = rng.integers(0, 10, batch)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        t = time.perf_counter()
        net.train_step_grads(x, y)
        opt.step(0.01)
        be.synchronize()
        times.append(time.perf_counter() - t)
    return times[1:]


def time_torch(c1: int, c2: int, norm: str, batch: int, repeats: int, threads: int) -> list[float] | None:
    try:
        import torch
        import torch.nn as nn
    except ImportError:
        return None
    torch.set_num_threads(threads)
    torch.manual_seed(0)

    def norm_layer(c: int) -> list[nn.Module]:
        return {"lrn": [nn.LocalResponseNorm(5)], "batch": [nn.BatchNorm2d(c)], "none": []}[norm]

    model = nn.Sequential(
        nn.Conv2d(3, c1, 5, padding=2),
        nn.ReLU(),
        *norm_layer(c1),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(c1, c2, 5, padding=2),
        nn.ReLU(),
        *norm_layer(c2),
        nn.MaxPool2d(3, 2, 1),
        nn.Flatten(),
        nn.Linear(c2 * 8 * 8, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return times[1:]


def blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info

        return "; ".join(
            f"{i['internal_api']} {i.get('version')} {i.get('architecture')} x{i['num_threads']}"
            for i in threadpool_info()
        )
    except ImportError:
        return "threadpoolctl not installed (numpy.show_config() names the BLAS)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="50:500")
    p.add_argument("--norm", default="lrn", choices=("lrn", "batch", "none"))
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--backend", default="numpy")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads; set OPENBLAS_NUM_THREADS yourself to pin numpy's",
    )
    args = p.parse_args()
    c1, c2 = parse_arch(args.arch)
    print(f"network {args.arch} norm={args.norm}, threads={args.threads}, BLAS: {blas_info()}")
    rows = []
    for batch in args.batch:
        tc = float(np.median(time_tinyconv(args.backend, c1, c2, args.norm, batch, args.repeats)))
        tt = time_torch(c1, c2, args.norm, batch, args.repeats, args.threads)
        if tt is None:
            rows.append((batch, tc, "-", "-", batch / tc))
        else:
            tm = float(np.median(tt))
            rows.append((batch, tc, tm, tm / tc, batch / tc))
    print(
        format_table(
            (
                "batch",
                f"tinyconv {args.backend} s/step",
                "torch CPU s/step",
                "torch/tinyconv",
                "tinyconv img/s",
            ),
            rows,
            title="median training-step time (lower is better; ratio > 1: tinyconv faster)",
        )
    )


if __name__ == "__main__":
    main()

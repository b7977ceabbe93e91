#!/usr/bin/env python3
"""Training-step time of tinyconv against the same network in PyTorch (CPU), numerically the same.

    python benchmarks/bench_train_step.py                     # 50:500, batch 64 and 256, LRN
    python benchmarks/bench_train_step.py --norm batch --arch 150:800

One step = forward, softmax cross-entropy, backward and the SGD update, on random
CIFAR-shaped data. The PyTorch twin is built layer by layer from tinyconv's network and
starts from its weights: LRN with tinyconv's k, batch norm with its momentum and eps,
and weight decay on the weights only, as tinyconv's SGD does (two parameter groups). So
both compute the same numbers; the losses after the last step are printed side by side.
Both run with the same number of threads (torch.set_num_threads and the BLAS pool numpy
uses). Prints medians over --repeats steps after a warm-up, and the ratio torch /
tinyconv (> 1 means tinyconv is faster). Not a test: no asserts. PyTorch is optional
(`pip install torch`); without it only tinyconv's times print.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from tinyconv.layers import BatchNorm2D, Conv2D, Linear, LocalResponseNorm, MaxPool2D, ReLU  # noqa: E402
from tinyconv.model import Network, paper_net, parse_arch  # noqa: E402
from tinyconv.optim import SGD  # noqa: E402
from tinyconv.plugins import get_backend  # noqa: E402
from tinyconv.report import format_table  # noqa: E402

LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 5e-4


def time_tinyconv(net: Network, x: np.ndarray, y: np.ndarray, repeats: int) -> tuple[list[float], float]:
    """Step times after a warm-up step, and the last loss."""
    be = net.backend
    opt = SGD(net, LR, MOMENTUM, WEIGHT_DECAY)
    xd = be.asarray(x)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        t = time.perf_counter()
        loss = net.train_step(xd, y)
        opt.step()
        be.synchronize()
        times.append(time.perf_counter() - t)
    return times[1:], loss


def torch_twin(net: Network, state: dict[str, np.ndarray]):
    """tinyconv's network as a torch.nn.Sequential with the weights in ``state``, and its optimiser."""
    import torch
    import torch.nn as nn

    mods, decayed, rest = [], [], []
    for layer in net.layers:
        if isinstance(layer, Conv2D):
            m = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel, layer.stride, layer.padding)
        elif isinstance(layer, Linear):
            mods.append(nn.Flatten())
            m = nn.Linear(layer.in_features, layer.out_features)
        elif isinstance(layer, BatchNorm2D):
            m = nn.BatchNorm2d(layer.channels, eps=layer.eps, momentum=layer.momentum)
        elif isinstance(layer, LocalResponseNorm):
            m = nn.LocalResponseNorm(layer.size, layer.alpha, layer.beta, layer.k)
        elif isinstance(layer, MaxPool2D):
            m = nn.MaxPool2d(layer.kernel, layer.stride, layer.padding)
        elif isinstance(layer, ReLU):
            m = nn.ReLU()
        else:
            raise TypeError(f"no torch twin for {layer!r}")
        torch_names = {"w": "weight", "b": "bias", "gamma": "weight", "beta": "bias"}
        with torch.no_grad():
            for name in layer.params:
                p = getattr(m, torch_names[name])
                p.copy_(torch.from_numpy(state[f"{layer.name}.{name}"]))
                (decayed if name in layer.decay else rest).append(p)
        mods.append(m)
    model = nn.Sequential(*mods)
    groups = [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]
    return model, torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM)


def time_torch(net: Network, state: dict, x: np.ndarray, y: np.ndarray, repeats: int, threads: int):
    """Step times of the torch twin after a warm-up step, and the last loss; None without torch."""
    try:
        import torch
        import torch.nn as nn
    except ImportError:
        return None
    torch.set_num_threads(threads)
    model, opt = torch_twin(net, state)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xt), yt)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return times[1:], float(loss.detach())


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
    arch = parse_arch(args.arch)
    print(f"network {args.arch} norm={args.norm}, threads={args.threads}, BLAS: {blas_info()}")
    rows, losses = [], []
    for batch in args.batch:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
        y = rng.integers(0, 10, batch)
        net = paper_net(arch, get_backend(args.backend), args.norm, seed=0)
        state = net.state_dict()  # the starting weights, for the twin
        times, loss = time_tinyconv(net, x, y, args.repeats)
        tc = float(np.median(times))
        torch_result = time_torch(net, state, x, y, args.repeats, args.threads)
        if torch_result is None:
            rows.append((batch, tc, "-", "-", batch / tc))
            continue
        tm = float(np.median(torch_result[0]))
        rows.append((batch, tc, tm, tm / tc, batch / tc))
        losses.append(f"batch {batch}: tinyconv {loss:.6f}, torch {torch_result[1]:.6f}")
    print(
        format_table(
            ("batch", f"tinyconv {args.backend} s/step", "torch CPU s/step", "torch/tinyconv", "tinyconv img/s"),
            rows,
            title="median training-step time (lower is better; ratio > 1: tinyconv faster)",
        )
    )
    if losses:
        print(f"loss after {args.repeats + 1} steps from the same weights (the twins agree): " + "; ".join(losses))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Training-step time of tinyconv against the same network in PyTorch (CPU), numerically the same.

    python benchmarks/bench_train_step.py                     # 50:500, batch 64 and 256, LRN and batch norm
    python benchmarks/bench_train_step.py --norm batch --arch 150:800

One step = forward, softmax cross-entropy, backward and the SGD update, on random
CIFAR-shaped data. The PyTorch twin is built layer by layer from tinyconv's network and
starts from its weights: LRN with tinyconv's k, batch norm with its momentum and eps,
and weight decay on the weights only, as tinyconv's SGD does (two parameter groups). So
both compute the same numbers; the losses after the last step are printed side by side.
Both run with the same number of threads (torch.set_num_threads and the BLAS pool numpy
uses). Prints medians over --repeats steps after a warm-up, and the ratio torch /
tinyconv (> 1 means tinyconv is faster). The two take their steps in turn (tinyconv, torch,
tinyconv, ...), so on a shared machine both see the same load. The process keeps its freed
memory for reuse, as the main job does (tinyconv/distributed/heap.py; --keep-freed-memory off: glibc's
default). Each ``--norm`` (default both: the LRN network and the batch-norm one) and each batch size is a
row of one table, all timed in one run. ``--breakdown`` adds tinyconv's median time per layer, forward
and backward. Not a test: no asserts. PyTorch is optional (`pip install torch`); without it only tinyconv's times print.

    python benchmarks/bench_train_step.py --norm batch --batch-size 128 --arch 48:96 --breakdown
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from backends import get_backend  # noqa: E402
from tinyconv.distributed.heap import keep_freed_memory  # noqa: E402
from tinyconv.layers import BatchNorm2D, Conv2D, Linear, LocalResponseNorm, MaxPool2D, ReLU  # noqa: E402
from tinyconv.model import Network, paper_net, parse_arch  # noqa: E402
from tinyconv.optim import SGD  # noqa: E402
from tinyconv.options import Parser, UsageError, add, count  # noqa: E402
from tinyconv.report import format_table  # noqa: E402

LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 5e-4
# --isa avx2: an AVX2-only x86 CPU, as both sides would run on one. OPENBLAS_CORETYPE alone holds numpy's BLAS to
# AVX2 while PyTorch keeps AVX-512; these hold numpy's own SIMD loops, ATen's kernels and oneDNN's as well.
AVX2_ONLY = {
    "OPENBLAS_CORETYPE": "Haswell",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def tinyconv_step(net: Network, x: np.ndarray, y: np.ndarray):
    """A function running one training step of ``net`` on (x, y) and returning (seconds, loss)."""
    be = net.backend
    opt = SGD(net, LR, MOMENTUM, WEIGHT_DECAY)
    xd = be.asarray(x)

    def step() -> tuple[float, float]:
        t = time.perf_counter()
        loss = net.train_step(xd, y)
        opt.step()
        be.synchronize()
        return time.perf_counter() - t, loss

    return step


def layer_times(net: Network, x: np.ndarray, y: np.ndarray, repeats: int) -> list[tuple[str, float, float]]:
    """(layer, median forward ms, median backward ms) of training steps of ``net``, layer by layer
    (each layer's forward run alone, so a ReLU + LRN pair is timed as two ops here)."""
    be = net.backend
    xd = be.asarray(x)
    fwd: dict[str, list[float]] = {layer.name: [] for layer in net.layers}
    bwd: dict[str, list[float]] = {layer.name: [] for layer in net.layers}
    for _ in range(repeats + 1):
        h = xd
        for layer in net.layers:
            t = time.perf_counter()
            h = layer.forward(h, True)
            be.synchronize()
            fwd[layer.name].append(time.perf_counter() - t)
        _, d = net.loss_fn(h, y)
        for layer in reversed(net.layers):
            t = time.perf_counter()
            d = layer.backward(d)
            be.synchronize()
            bwd[layer.name].append(time.perf_counter() - t)
            if d is None:
                break
    return [
        (name, 1e3 * float(np.median(fwd[name][1:])), 1e3 * float(np.median(bwd[name][1:])) if bwd[name] else 0.0)
        for name in fwd
    ]


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


def torch_step(net: Network, state: dict, x: np.ndarray, y: np.ndarray, threads: int):
    """A function running one training step of the torch twin, returning (seconds, loss); None without torch."""
    try:
        import torch
        import torch.nn as nn
    except ImportError:
        return None
    torch.set_num_threads(threads)
    model, opt = torch_twin(net, state)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def step() -> tuple[float, float]:
        t = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xt), yt)
        loss.backward()
        opt.step()
        return time.perf_counter() - t, float(loss.detach())

    return step


def in_turn(steps: list, repeats: int) -> list[tuple[list[float], float]]:
    """Each step function once per round, in turn, after a warm-up round: (times, last loss) of each."""
    times: list[list[float]] = [[] for _ in steps]
    losses = [0.0] * len(steps)
    for r in range(repeats + 1):
        for i, step in enumerate(steps):
            dt, losses[i] = step()
            if r:  # round 0 is the warm-up
                times[i].append(dt)
    return list(zip(times, losses, strict=True))


def blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info

        return "; ".join(
            f"{i['internal_api']} {i.get('version')} {i.get('architecture')} x{i['num_threads']}"
            for i in threadpool_info()
        )
    except ImportError:
        return "threadpoolctl not installed (numpy.show_config() names the BLAS)"


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    add(
        p,
        "arch",
        "norm",
        "batch_size",
        "repeats",
        "backend",
        many=("batch_size", "norm"),
        defaults={
            "arch": "50:500",
            "norm": ["lrn", "batch"],
            "batch_size": [64, 256],
            "repeats": 7,
            "backend": "numpy",
        },
        helps={"repeats": "steps of each, after a warm-up one", "backend": "tinyconv's"},
    )
    p.add_argument(
        "--keep-freed-memory",
        choices=("on", "off"),
        default="on",
        help="keep freed memory for reuse, as the main job does (tinyconv/distributed/heap.py); off: glibc's default",
    )
    p.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="native: each library's best code for this CPU; avx2: both sides held to AVX2, as on an AVX2-only CPU "
        "(numpy's BLAS and SIMD loops, PyTorch's ATen and oneDNN; the script restarts itself with "
        + " ".join(f"{k}={v}" for k, v in AVX2_ONLY.items())
        + ")",
    )
    p.add_argument("--breakdown", action="store_true", help="also tinyconv's median ms per layer, forward and backward")
    p.add_argument(
        "--torch-threads",
        type=count(1),
        default=os.cpu_count() or 1,
        metavar="N",
        help="PyTorch's threads (default: the cores); set OPENBLAS_NUM_THREADS yourself to pin numpy's",
    )
    return p


def measure(args, norm: str, batch: int):
    """One row of the table, for one network and batch size: (row, the two losses or None, breakdown or None)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    net = paper_net(parse_arch(args.arch), get_backend(args.backend), norm, seed=0)
    state = net.state_dict()  # the starting weights, for the twin
    twin = torch_step(net, state, x, y, args.torch_threads)
    results = in_turn([tinyconv_step(net, x, y)] + ([twin] if twin else []), args.repeats)
    tc = float(np.median(results[0][0]))
    breakdown = layer_times(net, x, y, args.repeats) if args.breakdown else None
    if twin is None:
        return (norm, batch, tc, "-", "-", batch / tc), None, breakdown
    tm = float(np.median(results[1][0]))
    loss = f"--norm {norm}, batch {batch}: tinyconv {results[0][1]:.6f}, torch {results[1][1]:.6f}"
    return (norm, batch, tc, tm, tm / tc, batch / tc), loss, breakdown


def isa_info() -> str:
    """What SIMD each side runs: numpy's widest dispatched loops, and PyTorch's ATen capability."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    numpy_isa = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)][-1:] or ["baseline"]
    torch_isa = "-"
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch_isa = torch.backends.cpu.get_cpu_capability()
    blas = os.environ.get("OPENBLAS_CORETYPE", "its own choice")
    return f"OpenBLAS core: {blas}, numpy loops up to {numpy_isa[0]}, torch {torch_isa}"


def main() -> None:
    args = build_parser().parse_args()
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ONLY.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ONLY})  # before numpy loads
    if args.keep_freed_memory == "on":
        keep_freed_memory()
    parse_arch(args.arch)
    print(f"network {args.arch}, torch threads={args.torch_threads}, BLAS: {blas_info()}; {isa_info()}")
    runs = [(norm, batch, *measure(args, norm, batch)) for norm in args.norm for batch in args.batch_size]
    print(
        format_table(
            (
                "norm",
                "batch",
                f"tinyconv {args.backend} s/step",
                "torch CPU s/step",
                "torch/tinyconv",
                "tinyconv img/s",
            ),
            [row for *_, row, _, _ in runs],
            title="median training-step time (lower is better; ratio > 1: tinyconv faster)",
        )
    )
    losses = [loss for *_, loss, _ in runs if loss]
    if losses:
        print(f"loss after {args.repeats + 1} steps from the same weights (the twins agree): " + "; ".join(losses))
    for norm, batch, _, _, layers in runs:
        if layers is None:
            continue
        total = sum(f + b for _, f, b in layers)
        print(
            format_table(
                ("layer", "forward ms", "backward ms", "share"),
                [(name, f, b, f"{(f + b) / total:.0%}") for name, f, b in layers],
                title=f"tinyconv {args.backend}, --norm {norm}, batch {batch}: median per layer ({total:.0f} ms, "
                "loss and SGD aside)",
            )
        )


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_train_step: error: {e}", file=sys.stderr)
        sys.exit(2)

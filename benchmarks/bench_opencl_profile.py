#!/usr/bin/env python3
"""Where an OpenCL training step goes: each op beside numpy's, and each kernel on the device.

    python benchmarks/bench_opencl_profile.py                       # 50:500, batch 64
    python benchmarks/bench_opencl_profile.py --arch 150:800 --norm batch --repeats 5

A training step of the paper's network (forward, loss, backward, SGD update) on random
CIFAR-shaped data, first unobserved (the step time a user gets), then with every backend
op (``backends/base.py``'s list: conv2d_forward, lrn_backward, asarray, ...) timed on the host
with a synchronize after it, on numpy and on OpenCL: the first table, so the slow ops are
named by measurement (an op made of others, as numpy's relu_lrn_forward, is charged only its
own time). Then the OpenCL kernels by name, from the queue's profiling events:
device seconds per step, launches per step, and what is left of each op's host time once its
kernels' device time is taken out (launch overhead, buffer allocation, host work and
transfers). Medians over --repeats steps after a warm-up step (which compiles, and may
autotune the GEMM). A script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout too

from backends import get_backend  # noqa: E402
from backends.base import Backend  # noqa: E402
from tinyconv.model import paper_net  # noqa: E402
from tinyconv.optim import SGD  # noqa: E402
from tinyconv.options import Parser, UsageError, add  # noqa: E402
from tinyconv.report import format_table  # noqa: E402

OPS = tuple(
    name
    for name, value in vars(Backend).items()
    if callable(value) and not name.startswith("_") and name not in ("describe", "synchronize")
)


def observe(be: Backend, spent: dict[str, list[float]]) -> None:
    """Time each op of ``be`` on the host (synchronized after it) into ``spent[op]``.

    An op that calls others (the default relu_lrn_forward runs relu_forward and lrn_forward) is
    charged only its own time, so that no time is counted twice in the sum of the ops."""
    inner: list[float] = []  # per op running: the time of the ops it called

    def timed(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            be.synchronize()
            t = time.perf_counter()
            inner.append(0.0)
            out = op(*args, **kwargs)
            be.synchronize()
            took = time.perf_counter() - t
            spent[name].append(took - inner.pop())
            if inner:
                inner[-1] += took
            return out

        return run

    for name in OPS:
        setattr(be, name, timed(name, getattr(be, name)))


def steps(be: Backend, args: argparse.Namespace, repeats: int, after: Callable[[], None]) -> list[float]:
    """Step times of ``repeats`` steps after a warm-up one; ``after()`` runs after each step."""
    rng = np.random.default_rng(0)
    net = paper_net(args.arch, be, norm=args.norm, seed=0)
    opt = SGD(net, 0.01, 0.9, 5e-4)
    x = be.asarray(rng.standard_normal((args.batch_size, 3, 32, 32), dtype=np.float32))
    y = rng.integers(0, 10, args.batch_size)
    times = []
    for i in range(repeats + 1):
        be.synchronize()
        t = time.perf_counter()
        net.train_step(x, y)
        opt.step()
        be.synchronize()
        if i:
            times.append(time.perf_counter() - t)
        after()
    return times


def profile(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The plain step time, the ops' host times and (OpenCL) the kernels' device times, per step."""
    options = {"device": args.device, "profile": True} if name == "opencl" else {}
    be = get_backend(name, **options)
    plain = statistics.median(steps(be, args, args.repeats, lambda: None))
    spent: dict[str, list[float]] = defaultdict(list)
    per_step_ops: list[dict[str, float]] = []
    per_step_kernels: list[dict[str, tuple[int, float]]] = []
    rt = getattr(be, "rt", None)

    def collect() -> None:  # after each step: its ops' host times and its kernels' (launches, device s)
        per_step_ops.append({op: sum(t) for op, t in spent.items()})
        spent.clear()
        per_step_kernels.append(rt.kernel_times() if rt is not None else {})

    if rt is not None:
        rt.kernel_times()  # drop the plain steps' events
    observe(be, spent)
    observed = steps(be, args, args.repeats, collect)
    ops_med = {op: statistics.median(s.get(op, 0.0) for s in per_step_ops[1:]) for op in per_step_ops[-1]}
    kernel_table = {
        k: (per_step_kernels[-1][k][0], statistics.median(s.get(k, (0, 0.0))[1] for s in per_step_kernels[1:]))
        for k in per_step_kernels[-1]
    }
    return {
        "step": plain,
        "observed": statistics.median(observed),
        "ops": ops_med,
        "kernels": kernel_table,
        "describe": be.describe(),
    }


def main() -> None:
    head, _, rest = __doc__.partition("\n\n")
    p = Parser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    add(
        p,
        "arch",
        "norm",
        "batch_size",
        "repeats",
        "device",
        defaults={"arch": "50:500", "norm": "lrn", "batch_size": 64, "repeats": 3},
        helps={"repeats": "profiled steps after the warm-up one"},
    )
    args = p.parse_args()
    runs = {name: profile(name, args) for name in ("numpy", "opencl")}
    np_, cl_ = runs["numpy"], runs["opencl"]
    print(
        f"paper_net {args.arch} ({args.norm}), batch size {args.batch_size}, training step; OpenCL: {cl_['describe']}"
    )
    print(
        f"step (unobserved): numpy {np_['step']:.3f} s, opencl {cl_['step']:.3f} s, "
        f"opencl/numpy {cl_['step'] / np_['step']:.2f}x   (observed, with a sync after each op: "
        f"{np_['observed']:.3f} s, {cl_['observed']:.3f} s)"
    )
    ops = sorted(set(np_["ops"]) | set(cl_["ops"]), key=lambda op: -cl_["ops"].get(op, 0.0))
    rows = []
    for op in ops:
        a, b = np_["ops"].get(op, 0.0), cl_["ops"].get(op, 0.0)
        rows.append([op, f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", f"{b / a:.2f}" if a else "-"])
    rows.append(
        [
            "sum of ops",
            f"{sum(np_['ops'].values()) * 1e3:.1f}",
            f"{sum(cl_['ops'].values()) * 1e3:.1f}",
            f"{sum(cl_['ops'].values()) / sum(np_['ops'].values()):.2f}",
        ]
    )
    print(
        format_table(
            ["op", "numpy ms/step", "opencl ms/step", "opencl/numpy"],
            rows,
            "each op's host time per step, synchronized (slowest on OpenCL first)",
        )
    )
    kernels = sorted(cl_["kernels"].items(), key=lambda kv: -kv[1][1])
    device = sum(s for _, s in cl_["kernels"].values())
    rows = [[k, str(n), f"{s * 1e3:.1f}", f"{s / device:.0%}"] for k, (n, s) in kernels]
    host = sum(cl_["ops"].values())
    rows.append(["all kernels", str(sum(n for n, _ in cl_["kernels"].values())), f"{device * 1e3:.1f}", "100%"])
    rows.append(["ops' host time - kernels' device time", "", f"{(host - device) * 1e3:.1f}", ""])
    print(
        format_table(
            ["OpenCL kernel", "launches/step", "device ms/step", "share"],
            rows,
            "the OpenCL kernels on the device, per step (queue profiling events)",
        )
    )


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_opencl_profile: error: {e}", file=sys.stderr)
        sys.exit(2)

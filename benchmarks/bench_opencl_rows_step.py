#!/usr/bin/env python3
"""The training step with the OpenCL rows kernels, without them, and on numpy, taken in turn.

    python benchmarks/bench_opencl_rows_step.py                     # 50:500, batch 64, LRN
    python benchmarks/bench_opencl_rows_step.py --norm batch --repeats 7

One OpenCL backend runs the paper's network twice from the same weights, once with the
per-element kernels (what GPUs run: ``backend.rows = False``) and once with the rows kernels
(what CPUs run by default; see backends/opencl/ops.cl), and the numpy backend runs it a third
time; the three take their steps in turn (per-element, rows, numpy, per-element, ...), so on a
shared machine all three see the same load. Prints each one's median step time (forward,
loss, backward, SGD update, synchronized) after one warm-up step each, and the ratios. A
script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import get_backend  # noqa: E402
from tinyconv.model import paper_net  # noqa: E402
from tinyconv.optim import SGD  # noqa: E402
from tinyconv.options import Parser, UsageError, add  # noqa: E402


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
        defaults={"arch": "50:500", "norm": "lrn", "batch_size": 64, "repeats": 5},
        helps={"repeats": "timed steps of each, after a warm-up one"},
    )
    a = p.parse_args()
    cl, ref = get_backend("opencl", device=a.device), get_backend("numpy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.batch_size, 3, 32, 32), dtype=np.float32)
    y = rng.integers(0, 10, a.batch_size)
    runs = {}
    for name, be, rows in (("per-element", cl, False), ("rows", cl, True), ("numpy", ref, None)):
        net = paper_net(a.arch, be, norm=a.norm, seed=0)
        runs[name] = (be, rows, net, SGD(net, 0.01, 0.9, 5e-4), be.asarray(x), [])
    for i in range(a.repeats + 1):
        for be, rows, net, opt, xb, times in runs.values():
            if rows is not None:
                be.rows = rows
            be.synchronize()
            t = time.perf_counter()
            net.train_step(xb, y)
            opt.step()
            be.synchronize()
            if i:
                times.append(time.perf_counter() - t)
    med = {name: statistics.median(r[-1]) for name, r in runs.items()}
    print(
        f"paper_net {a.arch} ({a.norm}), batch size {a.batch_size}, {cl.rt.device.name.strip()}; "
        f"median of {a.repeats} steps each, taken in turn"
    )
    for name, t in med.items():
        print(f"  {name:12} {t:7.3f} s/step")
    print(
        f"  rows / per-element {med['rows'] / med['per-element']:.2f}x, rows / numpy "
        f"{med['rows'] / med['numpy']:.2f}x, per-element / numpy {med['per-element'] / med['numpy']:.2f}x"
    )


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_opencl_rows_step: error: {e}", file=sys.stderr)
        sys.exit(2)

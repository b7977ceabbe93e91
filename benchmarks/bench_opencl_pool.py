"""Benchmark: max pool and ReLU of the paper's network on the OpenCL device, in GB/s.

    python benchmarks/bench_opencl_pool.py                  # 50:500, batch 64, 21 launches each
    python benchmarks/bench_opencl_pool.py --arch 50:500 --batch 64 --repeats 41

For pool1 (N x C1 x 32 x 32) and pool2 (N x C2 x 16 x 16), 3x3 stride 2 pad 1 as in
tinyconv/model.py, prints the median device time (profiling events, summed over the op's
launches) of max pool forward and backward and of ReLU forward and backward on the same input,
and the bytes each moves (read + written) over that time; beside each, the numpy backend's
median wall time for the same op. ReLU is the bandwidth reference: a pool moves about as many
bytes. A script, not a test: it asserts nothing. Other processes on the machine show up in the
timings: run variants back to back and compare medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.numpy_backend import NumpyBackend  # noqa: E402
from tinyconv.plugins import get_backend  # noqa: E402


def device_ms(rt, fn, repeats: int) -> float:
    """Median over ``repeats`` calls of fn's kernels' device time (one warm-up call first)."""
    fn()
    rt.kernel_times()
    times = []
    for _ in range(repeats):
        fn()
        times.append(sum(seconds for _, seconds in rt.kernel_times().values()))
    return statistics.median(times) * 1e3


def wall_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def gather(be, dy, cache):
    """maxpool_backward's per-element gather kernel, which the backend runs on GPUs (on CPUs: per row)."""
    x_shape, arg, geometry, window = cache
    n, c, h, w = x_shape
    dx = be.rt.empty(x_shape)
    be.rt.launch("maxpool_backward", (w, h, n * c), dy.data, arg.data, *geometry, dx.data, defines=window)
    return dx


def ops_of(be, ref, x: np.ndarray) -> list:
    """(name, bytes moved, OpenCL call, numpy call) of each op timed on input x."""
    y_ref, cache_ref = ref.maxpool_forward(x, 3, 2, 1)
    dy = np.random.default_rng(1).standard_normal(y_ref.shape, dtype=np.float32)
    xd, dyd = be.asarray(x), be.asarray(dy)
    _, cache = be.maxpool_forward(xd, 3, 2, 1)
    pool_bytes = x.nbytes + 2 * y_ref.nbytes  # x in, y and its int32 argmax out; backward the reverse
    return [
        ("maxpool fwd", pool_bytes, lambda: be.maxpool_forward(xd, 3, 2, 1), lambda: ref.maxpool_forward(x, 3, 2, 1)),
        ("maxpool bwd", pool_bytes, lambda: be.maxpool_backward(dyd, cache),
         lambda: ref.maxpool_backward(dy, cache_ref)),
        ("maxpool bwd, gather", pool_bytes, lambda: gather(be, dyd, cache),
         lambda: ref.maxpool_backward(dy, cache_ref)),
        ("relu fwd", 2 * x.nbytes, lambda: be.relu_forward(xd), lambda: ref.relu_forward(x)),
        ("relu bwd", 3 * x.nbytes, lambda: be.relu_backward(xd, xd), lambda: ref.relu_backward(x, x)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="50:500", help="C1:C2, the channels of the two conv layers")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=21)
    a = ap.parse_args()
    c1, c2 = (int(c) for c in a.arch.split(":"))
    be, ref = get_backend("opencl", profile=True), NumpyBackend()
    rng = np.random.default_rng(0)
    print(f"{be.rt.device.name.strip()}; median of {a.repeats}; GB/s = bytes read + written / time")
    print(f"{'op':26} {'opencl ms':>10} {'GB/s':>6} {'numpy ms':>10} {'GB/s':>6}")
    for label, shape in (("pool1", (a.batch, c1, 32, 32)), ("pool2", (a.batch, c2, 16, 16))):
        for name, nbytes, on_device, on_numpy in ops_of(be, ref, rng.standard_normal(shape, dtype=np.float32)):
            t_cl, t_np = device_ms(be.rt, on_device, a.repeats), wall_ms(on_numpy, a.repeats)
            gbs_cl, gbs_np = nbytes / t_cl / 1e6, nbytes / t_np / 1e6
            print(f"{label + ' ' + name:26} {t_cl:10.2f} {gbs_cl:6.2f} {t_np:10.2f} {gbs_np:6.2f}")


if __name__ == "__main__":
    main()

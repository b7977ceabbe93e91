"""Benchmark: bf16 wire words converted on the OpenCL device or on the host, for the paper's conv2.

    python benchmarks/bench_wire_convert.py                     # 50:500, batch 64, 15 repeats
    python benchmarks/bench_wire_convert.py --arch 50:500 --batch-size 64 --repeats 31

A worker narrows its results before they go back and widens the narrowed inputs it receives
(tinyconv/distributed/wire_codec.py). For an array on an OpenCL device there are two ways, giving the
same words (tests/test_wire_convert.py checks them bit for bit)::

    narrow, host     (a) read the float32 map back (4 bytes a number), wire_precision.narrow it in numpy
    narrow, device   (b) the narrow_bf16 kernel (wire.cl), read back the bf16 words (2 bytes a number)
    widen, host      (a) wire_precision.widen in numpy, write the float32 map (4 bytes a number)
    widen, device    (b) write the bf16 words (2 bytes a number), the widen_bf16 kernel

timed here wall clock, each the median of ``--repeats`` after a warm-up, the four taken in turn in
every repeat so all see the same load, for conv2's output of the paper's net, N x C2 x 16 x 16,
and its input (pool1's output), N x C1 x 16 x 16. Random N(0, 1) maps. A script, not a test: it
asserts nothing. Other processes show up in the timings: compare medians of runs back to back.

Measured (PoCL 5 on this machine's 2-core CPU, the machine shared with other jobs; 50:500, batch
64, --repeats 15, ms, median)::

    map                         MB f32  narrow host  narrow dev  widen host  widen dev
    conv2 output 64x500x16x16     32.8        99.62        3.31        6.92       3.37
    conv2 input 64x50x16x16        3.3         1.28        0.57        0.35       0.33

(``--repeats 9``.) The device wins both ways even here, where its buffers are host memory:
numpy's narrowing is a dozen passes over the map (shifts, masks, the NaN and overflow checks,
each a temporary) against the kernel's one, and the read-back is half the bytes; widening saves
one pass and half the write. So the OpenCL backend converts bf16 on the device on every device
(``wire_on_device``, set in its __init__); on a GPU the halved bus traffic only adds to that.

"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import get_backend  # noqa: E402
from backends.base import Backend  # noqa: E402
from tinyconv.distributed import wire_precision  # noqa: E402
from tinyconv.options import Parser, UsageError, add  # noqa: E402


def medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``fns`` over ``repeats`` rounds (one warm-up round first), taken in turn."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def time_conversions(be: Backend, host: np.ndarray, repeats: int) -> dict[str, float]:
    """Median seconds of the four ways (module docstring) on the map ``host``: nh, nd, wh, wd."""
    x = be.asarray(host)
    words = wire_precision.narrow(host, "bf16").carried

    def narrow_host() -> np.ndarray:
        return wire_precision.narrow(be.to_numpy(x), "bf16").carried

    def narrow_device() -> np.ndarray:
        return be.narrow_wire(x, "bf16")[0]

    def widen_host() -> None:
        be.asarray(wire_precision.widen(words, "bf16"))
        be.synchronize()

    def widen_device() -> None:
        be.widen_wire(words, "bf16")
        be.synchronize()

    return medians({"nh": narrow_host, "nd": narrow_device, "wh": widen_host, "wd": widen_device}, repeats)


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add(
        p,
        "arch",
        "batch_size",
        "repeats",
        "device",
        defaults={"arch": "50:500", "batch_size": 64, "repeats": 15},
        helps={"repeats": "timed rounds of each way, after a warm-up one"},
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    be = get_backend("opencl", device=args.device, autotune=False)
    chosen = "device" if be.wire_on_device else "host"
    be.wire_on_device = True  # time the device path whatever the backend would choose
    d = be.describe()
    print(
        f"device: {d['device']} ({d['kind']}, {d['compute_units']} compute units); the backend converts "
        f"bf16 on the {chosen} by default"
    )
    c1, c2 = (int(c) for c in args.arch.split(":"))
    rng = np.random.default_rng(0)
    print(
        f"{'map':<28} {'MB f32':>7} {'narrow host':>12} {'narrow dev':>11} {'widen host':>11} "
        f"{'widen dev':>10}   cheaper"
    )
    for what, shape in (
        ("conv2 output", (args.batch_size, c2, 16, 16)),
        ("conv2 input", (args.batch_size, c1, 16, 16)),
    ):
        host = rng.standard_normal(shape, dtype=np.float32)
        t = time_conversions(be, host, args.repeats)
        cheaper = (
            f"narrow on the {'device' if t['nd'] < t['nh'] else 'host'} ({t['nh'] / t['nd']:.2f}x), "
            f"widen on the {'device' if t['wd'] < t['wh'] else 'host'} ({t['wh'] / t['wd']:.2f}x)"
        )
        label = f"{what} {'x'.join(map(str, shape))}"
        print(
            f"{label:<28} {host.nbytes / 1e6:7.1f} {t['nh'] * 1e3:12.2f} {t['nd'] * 1e3:11.2f} "
            f"{t['wh'] * 1e3:11.2f} {t['wd'] * 1e3:10.2f}   {cheaper}"
        )


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_wire_convert: error: {e}", file=sys.stderr)
        sys.exit(2)

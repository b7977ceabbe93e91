"""Benchmark: the OpenCL backend's per-element and per-row ops on the paper's maps, in GB/s.

    python benchmarks/bench_opencl_pool.py                  # 50:500, batch 64, 21 launches each
    python benchmarks/bench_opencl_pool.py --arch 50:500 --batch-size 64 --repeats 41 --only pool
    python benchmarks/bench_opencl_pool.py --only im2col --nb 24       # the im2col kernels side by side

For the maps of the paper's two layers -- conv1's output N x C1 x 32 x 32 and conv2's
N x C2 x 16 x 16 -- prints each op's median device time (profiling events, summed over the op's
launches) and the bytes it moves (read + written, below) over that time, twice: with the
per-element kernels (one work-item per element, what GPUs run) and with the rows kernels (one
work-item walks a chunk, a plane or a row -- max pool: one or more planes, their size compiled
in, forward 8 windows a vector where rows allow --, what CPUs run; see backends/opencl/ops.cl);
then the numpy backend's median wall time for the same op. Ops: ReLU, LRN, ReLU+LRN fused, batch
norm (training), max pool 3x3 stride 2 pad 1 as in tinyconv/model.py, forward and backward; SGD
on conv2's weights; the bf16 wire words' narrowing and widening (no numpy column: the host's
conversion is the transports'). The last columns: a plain copy's GB/s on as many elements
(dst[i] = src[i], in the fastest of a few forms, picked first and printed above the table), the
variant the backend runs on this device (rows on CPUs, per element elsewhere) and its GB/s as a
percentage of the copy's: how near the op comes to the memory's bandwidth. The per-element
variant, the copy and the rows variant are taken in turn in every repeat, so all three see the
same load (other processes on the machine show up in the timings). The copy is a reference, not
a bound: which buffers stay in cache differs, and a small op can pass 100 %. A script, not a
test: it asserts nothing.

Bytes per op, in maps of the op's input size (4 bytes an element): relu fwd 2 (x in, y out),
bwd 3; lrn fwd 4 (y, s, p out), bwd 6; relu+lrn fwd 3, bwd 5; batch norm fwd 5 (x read for the
mean, for the variance, then x in and xhat, y out), bwd 6 (dy for dbeta; dy, xhat for dgamma;
dy, xhat in and dx out); max pool x plus y and its int32 argmax (each a quarter map), backward
the reverse; SGD 5 arrays of the weights (param, grad, velocity in; param, velocity out); the
wire's narrowing 1.5 (float32 in, 16-bit words out), widening the reverse; the copy 2.

Then a second table: im2col into the GEMM's B
panels (width --nb) for each convolution's forward (conv1 on the N x 3 x 32 x 32 images, conv2 on
pool1's N x C1 x 16 x 16; 5x5, pad 2) and conv2's dx GEMM (its dy, a 1x1 "im2col"), and im2row,
[cols^T | 1] for each dW GEMM: the input read once and the panels written; and conv2's col2im
(dcols read, dx written). Each with its three
kernels (backends/opencl/layout.cl): per element (GPUs), the row walk and the 8-pixel lanes
(CPUs; conv.lanes_fit and conv.col2im_lanes_fit pick between them, * marks the pick), taken in
turn in every repeat so all three see the same load; then numpy's im2col or col2im (the same
values, not in panels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import get_backend  # noqa: E402
from backends.numpy_backend import NumpyBackend, col2im, im2col  # noqa: E402
from backends.opencl import conv  # noqa: E402
from backends.opencl.gemm import cdiv  # noqa: E402
from tinyconv.options import Parser, UsageError, add, count  # noqa: E402

GROUPS = ("relu", "lrn", "relu_lrn", "bn", "pool", "sgd", "wire", "im2col")

# The copy the ops are measured against, in the forms a CPU's OpenCL may vectorise best: per
# element, a work-item walking a chunk of floats, or of float16 vectors (the chunk in floats).
COPY_SOURCE = """
__kernel void copy(__global const float* src, const int total, __global float* dst)
{
    const int e = get_global_id(0);
    if (e < total) dst[e] = src[e];
}
__kernel void copy_rows(__global const float* restrict src, const int total, __global float* restrict dst,
                        const int chunk)
{
    const int start = get_global_id(0) * chunk, end = total - start < chunk ? total : start + chunk;
    for (int e = start; e < end; e++) dst[e] = src[e];
}
__kernel void copy_rows16(__global const float16* restrict src, const int total, __global float16* restrict dst,
                          const int chunk)
{
    const int vectors = total / 16, start = get_global_id(0) * (chunk / 16);
    const int end = vectors - start < chunk / 16 ? vectors : start + chunk / 16;
    for (int e = start; e < end; e++) dst[e] = src[e];
}
"""


def with_rows(be, rows: bool, fn):
    """fn, run with the rows kernels (``rows``) or the per-element ones."""

    def call() -> None:
        be.rows = rows
        fn()

    return call


def wall_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def ops_of(be, ref, x: np.ndarray, w_shape: tuple[int, ...]) -> list:
    """(group, name, bytes moved, OpenCL call, numpy call) of each op timed on the map x."""
    rng = np.random.default_rng(1)
    c = x.shape[1]
    dy = rng.standard_normal(x.shape, dtype=np.float32)
    xd, dyd = be.asarray(x), be.asarray(dy)
    m = x.nbytes  # one map
    lrn = (5, 1e-4, 0.75, 2.0)
    _, lrn_cache = be.lrn_forward(xd, *lrn)
    _, lrn_ref = ref.lrn_forward(x, *lrn)
    _, rl_cache = be.relu_lrn_forward(xd, *lrn)
    _, rl_ref = ref.relu_lrn_forward(x, *lrn)
    g, b = np.ones(c, np.float32), np.zeros(c, np.float32)
    gd, bd, rm, rv = be.asarray(g), be.asarray(b), be.asarray(b), be.asarray(g)
    _, bn_cache = be.batchnorm_forward(xd, gd, bd, rm, rv, True)
    rm_np, rv_np = b.copy(), g.copy()
    _, bn_ref = ref.batchnorm_forward(x, g, b, rm_np, rv_np, True)
    y_ref, pool_ref = ref.maxpool_forward(x, 3, 2, 1)
    pdy = rng.standard_normal(y_ref.shape, dtype=np.float32)
    pdyd = be.asarray(pdy)
    _, pool_cache = be.maxpool_forward(xd, 3, 2, 1)
    pool_bytes = m + 2 * y_ref.nbytes  # x in, y and its int32 argmax out; backward the reverse
    p, gw, v = (rng.standard_normal(w_shape, dtype=np.float32) for _ in range(3))
    pd, gwd, vd = be.asarray(p), be.asarray(gw), be.asarray(v)
    return [
        ("relu", "relu fwd", 2 * m, lambda: be.relu_forward(xd), lambda: ref.relu_forward(x)),
        ("relu", "relu bwd", 3 * m, lambda: be.relu_backward(dyd, xd), lambda: ref.relu_backward(dy, x)),
        ("lrn", "lrn fwd", 4 * m, lambda: be.lrn_forward(xd, *lrn), lambda: ref.lrn_forward(x, *lrn)),
        ("lrn", "lrn bwd", 6 * m, lambda: be.lrn_backward(dyd, lrn_cache), lambda: ref.lrn_backward(dy, lrn_ref)),
        (
            "relu_lrn",
            "relu+lrn fwd",
            3 * m,
            lambda: be.relu_lrn_forward(xd, *lrn),
            lambda: ref.relu_lrn_forward(x, *lrn),
        ),
        (
            "relu_lrn",
            "relu+lrn bwd",
            5 * m,
            lambda: be.relu_lrn_backward(dyd, rl_cache),
            lambda: ref.relu_lrn_backward(dy, rl_ref),
        ),
        (
            "bn",
            "batchnorm fwd",
            5 * m,
            lambda: be.batchnorm_forward(xd, gd, bd, rm, rv, True),
            lambda: ref.batchnorm_forward(x, g, b, rm_np, rv_np, True),
        ),
        (
            "bn",
            "batchnorm bwd",
            6 * m,
            lambda: be.batchnorm_backward(dyd, bn_cache),
            lambda: ref.batchnorm_backward(dy, bn_ref),
        ),
        (
            "pool",
            "maxpool fwd",
            pool_bytes,
            lambda: be.maxpool_forward(xd, 3, 2, 1),
            lambda: ref.maxpool_forward(x, 3, 2, 1),
        ),
        (
            "pool",
            "maxpool bwd",
            pool_bytes,
            lambda: be.maxpool_backward(pdyd, pool_cache),
            lambda: ref.maxpool_backward(pdy, pool_ref),
        ),
        (
            "sgd",
            "sgd (conv2 weights)",
            5 * p.nbytes,
            lambda: be.sgd_update(pd, gwd, vd, 0.01, 0.9, 5e-4),
            lambda: ref.sgd_update(p, gw, v, 0.01, 0.9, 5e-4),
        ),
    ]


def wire_ops(be, x: np.ndarray) -> list:
    """(group, name, bytes moved, OpenCL call, None: no numpy call) of the bf16 wire words' kernels on x."""
    xd = be.asarray(x)
    words, _ = be.narrow_wire(xd, "bf16")
    return [
        ("wire", "narrow to bf16", 3 * x.nbytes // 2, lambda: be.narrow_wire(xd, "bf16"), None),
        ("wire", "widen from bf16", 3 * x.nbytes // 2, lambda: be.widen_wire(words, "bf16"), None),
    ]


def copy_calls(rt, elements: int) -> dict:
    """{form: call} of the copy over ``elements`` floats, in each form."""
    program = cl.Program(rt.context, COPY_SOURCE).build()
    kernels = {name: cl.Kernel(program, name) for name in ("copy", "copy_rows", "copy_rows16")}
    src = cla.to_device(rt.queue, np.ones(elements, np.float32), allocator=rt.pool)
    dst = rt.empty((elements,))
    total = np.int32(elements)

    def launch(name: str, items: int, *chunk: np.int32) -> None:
        local = min(items, max(1, items // (16 * rt.limits.compute_units)), 256) if chunk else min(items, 256)
        grid = cdiv(items, local) * local
        rt.ran(name, kernels[name](rt.queue, (grid,), (local,), src.data, total, dst.data, *chunk))

    calls = {"per element": lambda: launch("copy", elements)}
    for chunk in (2048, 8192):
        calls[f"rows {chunk}"] = lambda chunk=chunk: launch("copy_rows", cdiv(elements, chunk), np.int32(chunk))
        if elements % 16 == 0:
            calls[f"float16 rows {chunk}"] = lambda chunk=chunk: launch(
                "copy_rows16", cdiv(elements, chunk), np.int32(chunk)
            )
    return calls


def im2col_ops(be, x: np.ndarray, k: int, pad: int, nb: int, transposed: bool = False) -> tuple:
    """(bytes moved, {kernel: OpenCL call}, the kernel conv.py runs on CPUs, numpy call) of im2col
    into panels of width nb, stride 1, or (``transposed``) im2row, the dW GEMM's [cols^T | 1]."""
    n, c, h, w = x.shape
    oh, ow = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    kdim, npix = c * k * k, n * oh * ow
    xd = be.asarray(x)
    pixel, tap = conv.im2col_tables(be.rt, x.shape, k, k, 1, pad, oh, ow)
    out = be.rt.empty((cdiv(kdim + 1, nb) * npix * nb,) if transposed else (cdiv(npix, nb) * kdim * nb,))
    i32 = np.int32

    kind, panels = ("im2row", cdiv(kdim + 1, nb)) if transposed else ("im2col", cdiv(npix, nb))
    simple = (xd.data, pixel.data, tap.data, i32(h), i32(w), i32(npix), i32(kdim), i32(nb), out.data)
    geometry = (xd.data, i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(n), i32(nb), out.data)
    grids = {  # kernel: grid, as conv.py launches them
        f"{kind}_panels": (nb, npix, panels) if transposed else (nb, kdim, panels),
        f"{kind}_panels_rows": (panels, n) if transposed else (kdim, n),
        f"{kind}_panels_lanes": (panels, n) if transposed else (panels,),
    }
    calls = {
        name: (lambda name=name, grid=grid: be.rt.launch(name, grid, *simple))
        if name.endswith("_panels")
        else (
            lambda name=name, grid=grid: be.rt.launch(
                name, grid, *geometry, defines=conv.window(k, k, 1, pad), rows=True
            )
        )
        for name, grid in grids.items()
    }
    if conv.lanes_fit(k, k, 1, ow, nb, transposed):
        pick = f"{kind}_panels_lanes"
    else:
        pick = f"{kind}_panels_rows"
        if ow % 8 or nb % 8 or nb > 64:  # the lanes kernel cannot run this shape at all
            del calls[f"{kind}_panels_lanes"]
    return x.nbytes + out.size * 4, calls, pick, lambda: im2col(x, k, k, 1, pad)


def column_of(kernel: str) -> str:
    """The second table's column of a kernel: its lanes, row walk or per-element variant."""
    return "lanes" if kernel.endswith("_lanes") else "walk" if kernel.endswith("_rows") else "element"


def device_ms_in_turn(rt, calls: dict, repeats: int) -> dict[str, float]:
    """Per call, the median over ``repeats`` of its kernels' device time, the calls taken in turn
    in every repeat (so all see the same load on a shared machine), after a warm-up of each."""
    for fn in calls.values():
        fn()
    rt.kernel_times()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            fn()
            times[name].append(sum(seconds for _, seconds in rt.kernel_times().values()))
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def col2im_ops(be, x_shape: tuple[int, ...], k: int, pad: int) -> tuple:
    """(bytes moved, {kernel: OpenCL call}, the kernel conv.py runs on CPUs, numpy call) of col2im,
    stride 1: dcols (C*K*K, N*OH*OW) -> dx, with its three kernels (per element, row walk, lanes)."""
    n, c, h, w = x_shape
    oh, ow = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    npix = n * oh * ow
    dcols = np.random.default_rng(2).standard_normal((c * k * k, npix), dtype=np.float32)
    dd, dx = be.asarray(dcols), be.rt.empty(x_shape)
    i32 = np.int32
    args = (dd.data, i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(npix), i32(n * c), dx.data)
    grids = {"col2im": (w, h, n * c), "col2im_rows": (h, n * c), "col2im_lanes": (h, n * c)}  # as conv.py
    calls = {
        name: (
            lambda name=name, grid=grid: be.rt.launch(
                name, grid, *args, defines=conv.window(k, k, 1, pad), rows=name != "col2im"
            )
        )
        for name, grid in grids.items()
    }
    pick = "col2im_lanes" if conv.col2im_lanes_fit(1, w, c * k * k, npix) else "col2im_rows"
    if pick != "col2im_lanes":  # the lanes kernel cannot run this shape
        del calls["col2im_lanes"]
    return dcols.nbytes + dx.size * 4, calls, pick, lambda: col2im(dcols, x_shape, k, k, 1, pad)


def build_parser() -> Parser:
    head, _, rest = __doc__.partition("\n\n")
    p = Parser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    add(
        p,
        "arch",
        "batch_size",
        "repeats",
        "device",
        defaults={"arch": "50:500", "batch_size": 64, "repeats": 21},
        helps={"repeats": "launches of each op and variant"},
    )
    p.add_argument("--only", nargs="+", choices=GROUPS, default=GROUPS, help="these ops only (default: all)")
    p.add_argument("--no-numpy", action="store_true", help="skip the numpy timings (faster)")
    p.add_argument("--nb", type=count(1), default=16, help="im2col's panel width, the GEMM's NB (default %(default)s)")
    return p


def main() -> None:
    a = build_parser().parse_args()
    c1, c2 = (int(c) for c in a.arch.split(":"))
    be, ref = get_backend("opencl", device=a.device, profile=True), NumpyBackend()
    rng = np.random.default_rng(0)
    print(f"{be.rt.device.name.strip()}; median of {a.repeats}; GB/s = bytes read + written / time")
    timed, panels = [], []
    w_shape = (c2, c1, 5, 5)
    for label, shape in (("conv1", (a.batch_size, c1, 32, 32)), ("conv2", (a.batch_size, c2, 16, 16))):
        x = rng.standard_normal(shape, dtype=np.float32)
        ops = ops_of(be, ref, x, w_shape) + wire_ops(be, x)
        timed += [
            (f"{label} {name}", int(np.prod(w_shape)) if group == "sgd" else x.size, *rest)
            for group, name, *rest in ops
            if group in a.only
        ]
    if "im2col" in a.only:
        for label, shape, k, pad, transposed in (
            ("conv1 im2col", (a.batch_size, 3, 32, 32), 5, 2, False),
            ("conv2 im2col", (a.batch_size, c1, 16, 16), 5, 2, False),
            ("conv2 dx: dy panels", (a.batch_size, c2, 16, 16), 1, 0, False),
            ("conv1 dW: im2row", (a.batch_size, 3, 32, 32), 5, 2, True),
            ("conv2 dW: im2row", (a.batch_size, c1, 16, 16), 5, 2, True),
        ):
            x = rng.standard_normal(shape, dtype=np.float32)
            panels.append((label, *im2col_ops(be, x, k, pad, a.nb, transposed)))
        panels.append(("conv2 dx: col2im", *col2im_ops(be, (a.batch_size, c1, 16, 16), 5, 2)))
    print_ops(a, be, timed)
    if not panels:
        return
    print(f"\nim2col/im2row into GEMM panels of width {a.nb}, and col2im, the kernels in turn (* what CPUs run)")
    print(
        f"{'op':30} {'per-element ms':>14} {'GB/s':>6} {'walk ms':>9} {'GB/s':>6} {'lanes ms':>9} {'GB/s':>6} "
        f"{'numpy ms':>9} {'GB/s':>6}"
    )
    for name, nbytes, calls, pick, on_numpy in panels:
        ms = device_ms_in_turn(be.rt, calls, a.repeats)
        row = f"{name:30}"
        for column, width in (("element", 14), ("walk", 9), ("lanes", 9)):
            kernel = next((k for k in calls if column_of(k) == column), None)
            if kernel is None:
                row += f" {'-':>{width}} {'-':>6}"
            else:
                mark = "*" if kernel == pick else ""
                row += f" {mark + f'{ms[kernel]:.2f}':>{width}} {nbytes / ms[kernel] / 1e6:6.2f}"
        print(row + numpy_cell(a, on_numpy, nbytes), flush=True)


def print_ops(a: argparse.Namespace, be, timed: list) -> None:
    """The copy's forms on each size, then the first table: each op's two variants, numpy, the copy
    in the copy's fastest form, and the % of the copy the variant this device runs reaches."""
    runs = be.rows  # the variant this device runs: rows on CPUs
    copies = {}  # elements: the copy's fastest form, timed beside each op over as many elements
    for elements in sorted({elements for _, elements, *_ in timed}):
        calls = copy_calls(be.rt, elements)
        ms = device_ms_in_turn(be.rt, calls, a.repeats)
        form = min(ms, key=ms.get)
        copies[elements] = calls[form]
        print(f"copy of {elements} floats: {8 * elements / ms[form] / 1e6:.2f} GB/s ({form}; each form: ", end="")
        print(", ".join(f"{name} {8 * elements / t / 1e6:.1f}" for name, t in ms.items()) + ")")
    if timed:
        print(
            f"{'op':30} {'per-element ms':>14} {'GB/s':>6} {'rows ms':>9} {'GB/s':>6} {'numpy ms':>9} {'GB/s':>6} "
            f"{'copy GB/s':>9} {'runs':>11} {'% of copy':>9}"
        )
    for name, elements, nbytes, on_device, on_numpy in timed:
        # per element, the copy, rows: the copy and the rows variant each after a kernel on other buffers
        calls = {False: with_rows(be, False, on_device), "copy": copies[elements], True: with_rows(be, True, on_device)}
        ms = device_ms_in_turn(be.rt, calls, a.repeats)
        row, copy = f"{name:30}", 8 * elements / ms["copy"] / 1e6
        for rows, width in ((False, 14), (True, 9)):
            row += f" {ms[rows]:{width}.2f} {nbytes / ms[rows] / 1e6:6.2f}"
        share = f"{100 * nbytes / ms[runs] / 1e6 / copy:.0f}"
        print(f"{row}{numpy_cell(a, on_numpy, nbytes)} {copy:9.2f} {'rows' if runs else 'per element':>11} {share:>9}")
    be.rows = runs


def numpy_cell(a: argparse.Namespace, on_numpy, nbytes: int) -> str:
    """The numpy column of a row: its wall ms and GB/s, or dashes with --no-numpy or no numpy call."""
    if a.no_numpy or on_numpy is None:
        return f" {'-':>9} {'-':>6}"
    t = wall_ms(on_numpy, a.repeats)
    return f" {t:9.2f} {nbytes / t / 1e6:6.2f}"


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_opencl_pool: error: {e}", file=sys.stderr)
        sys.exit(2)

"""Benchmark: the OpenCL backend against the numpy reference and plain OpenBLAS SGEMM.

    python benchmarks/bench_opencl.py                      # the 50:500 layers and training step, batch 64
    python benchmarks/bench_opencl.py --arch 50:500 150:800 300:1000 500:1500 --repeats 3

Prints, for each convolution of the paper's network (conv1: 3 -> C1, 5x5 pad 2 on
32x32; conv2: C1 -> C2, 5x5 pad 2 on 16x16), the median GFLOP/s of forward and of
backward (dW and db, plus dX for conv2 -- conv1 needs no dX in the network) on
the numpy backend, the OpenCL backend, and numpy's float32 matmul of the same
GEMM shapes (what OpenBLAS alone does: no im2col, no layout changes) and, where Debian's
libclblast1 is installed, CLBlast's SGEMM of the same shapes on the OpenCL device; then the
median time of a training step (forward, loss, backward) of paper_net with LRN
on both backends. A script, not a test: it asserts nothing.

The first OpenCL run of each shape compiles kernels and may autotune the GEMM;
that is excluded (one warm-up run). Timings call backend.synchronize().
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout too

from backends import get_backend  # noqa: E402
from backends.base import Backend  # noqa: E402
from tinyconv.model import paper_net, parse_arch  # noqa: E402
from tinyconv.options import Parser, UsageError, add, count  # noqa: E402


def median_time(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: compilation, autotuning, first-touch allocation
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def openblas_path() -> str | None:
    """The OpenBLAS shared library numpy loaded (Linux: from /proc/self/maps), or None."""
    np.ones((2, 2), np.float32) @ np.ones((2, 2), np.float32)  # make sure BLAS is loaded
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line]
    except OSError:
        return None
    return paths[0] if paths else None


def openblas_function(name: str) -> Callable | None:
    """An OpenBLAS C function of numpy's library (scipy-openblas renames them), or None."""
    path = openblas_path()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    for prefix in ("", "scipy_"):
        for suffix in ("", "64_"):
            fn = getattr(lib, f"{prefix}{name}{suffix}", None)
            if fn is not None:
                return fn
    return None


def openblas_info() -> str:
    """Which OpenBLAS numpy calls, its core kernel and thread count (asked from the library itself)."""
    names = ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    env = {k: os.environ[k] for k in names if k in os.environ}
    if openblas_function("openblas_get_config") is None:
        return f"OpenBLAS not found among the loaded libraries; env {env or 'none'}"

    def call(name: str, restype: type) -> object:
        fn = openblas_function(name)
        fn.restype = restype
        return fn()

    def text(name: str) -> str:
        value = call(name, ctypes.c_char_p)
        return value.decode().strip() if isinstance(value, bytes) else "?"

    threads = call("openblas_get_num_threads", ctypes.c_int)
    return (
        f"{Path(openblas_path()).name}: core {text('openblas_get_corename')}, {threads} threads, "
        f"config '{text('openblas_get_config')}'; env {env or 'none (OPENBLAS_CORETYPE unset)'}"
    )


def clblast_sgemm() -> Callable | None:
    """CLBlast's SGEMM (Debian's libclblast1), the second anchor, or None where it is not installed.

    The returned ``sgemm(queue, m, n, k, a, ta, b, tb, c)`` computes row-major C (m x n) =
    op(A) op(B) on OpenCL buffers, op = transpose where ``ta``/``tb``. CLBlast ships tuned
    parameters for many GPUs and none for CPU runtimes such as PoCL, where it runs its defaults.
    """
    try:
        fn = ctypes.CDLL("libclblast.so.1").CLBlastSgemm
    except (OSError, AttributeError):
        return None
    size, ptr = ctypes.c_size_t, ctypes.c_void_p
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        size,
        size,
        size,
        ctypes.c_float,
        ptr,
        size,
        size,
        ptr,
        size,
        size,
        ctypes.c_float,
        ptr,
        size,
        size,
        ctypes.POINTER(ptr),
        ctypes.POINTER(ptr),
    ]
    row_major, no, yes = 101, 111, 112  # CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes

    def sgemm(queue, m: int, n: int, k: int, a, ta: bool, b, tb: bool, c) -> None:
        q = ptr(queue.int_ptr)
        status = fn(
            row_major,
            yes if ta else no,
            yes if tb else no,
            m,
            n,
            k,
            1.0,
            a.int_ptr,
            0,
            m if ta else k,
            b.int_ptr,
            0,
            k if tb else n,
            0.0,
            c.int_ptr,
            0,
            n,
            ctypes.byref(q),
            None,
        )
        if status != 0:
            raise RuntimeError(f"CLBlastSgemm returned status {status}")

    return sgemm


def conv_shapes(archs: list[str], batch: int) -> list[tuple[str, int, int, int, int, bool]]:
    """(label, N, C, F, size, need_dx) for each distinct convolution of the architectures."""
    seen, out = set(), []
    for arch in archs:
        c1, c2 = parse_arch(arch)
        layers = ((f"conv1 3->{c1}", 3, c1, 32, False), (f"conv2 {c1}->{c2}", c1, c2, 16, True))
        for label, c, f, size, need_dx in layers:
            if (c, f, size) not in seen:
                seen.add((c, f, size))
                out.append((label, batch, c, f, size, need_dx))
    return out


def bench_conv(backends: dict[str, Backend], shape, repeats: int, rng: np.random.Generator) -> list[str]:
    label, n, c, f, size, need_dx = shape
    k, pad = 5, 2
    x = rng.standard_normal((n, c, size, size)).astype(np.float32)
    w = (rng.standard_normal((f, c, k, k)) * 0.05).astype(np.float32)
    b = np.zeros(f, np.float32)
    dy = rng.standard_normal((n, f, size, size)).astype(np.float32)
    gemm_flop = 2.0 * f * (c * k * k) * (n * size * size)
    fwd_flop, bwd_flop = gemm_flop, gemm_flop * (2 if need_dx else 1)
    rows, times = [], {}
    for name, be in backends.items():
        xd, wd, bd, dyd = be.asarray(x), be.asarray(w), be.asarray(b), be.asarray(dy)
        _, cache = be.conv2d_forward(xd, wd, bd, 1, pad)

        def forward(be=be, xd=xd, wd=wd, bd=bd):
            return be.conv2d_forward(xd, wd, bd, 1, pad)

        def backward(be=be, cache=cache, dyd=dyd):
            return be.conv2d_backward(dyd, cache, need_dx)

        tf = median_time(forward, be.synchronize, repeats)
        tb = median_time(backward, be.synchronize, repeats)
        times[name] = (tf, tb)
    # the same GEMMs on OpenBLAS alone, operands already in GEMM layout
    w2 = w.reshape(f, -1)
    cols = rng.standard_normal((c * k * k, n * size * size)).astype(np.float32)
    dy2 = dy.transpose(1, 0, 2, 3).reshape(f, -1).copy()
    tf = median_time(lambda: w2 @ cols, lambda: None, repeats)
    tb = median_time(lambda: (dy2 @ cols.T, w2.T @ dy2 if need_dx else None), lambda: None, repeats)
    times["sgemm"] = (tf, tb)
    # and on CLBlast, on the OpenCL backend's device
    sgemm_cl, ocl = clblast_sgemm(), backends.get("opencl")
    if sgemm_cl is not None and ocl is not None:
        q, kk, npix = ocl.rt.queue, c * k * k, n * size * size
        w_d, cols_d, dy_d = ocl.asarray(w2), ocl.asarray(cols), ocl.asarray(dy2)
        y_d, dw_d, dx_d = ocl.rt.empty((f * npix,)), ocl.rt.empty((f * kk,)), ocl.rt.empty((kk * npix,))

        def cl_forward():
            sgemm_cl(q, f, npix, kk, w_d.data, False, cols_d.data, False, y_d.data)

        def cl_backward():
            sgemm_cl(q, f, kk, npix, dy_d.data, False, cols_d.data, True, dw_d.data)
            if need_dx:
                sgemm_cl(q, kk, npix, f, w_d.data, True, dy_d.data, False, dx_d.data)

        times["clblast"] = (median_time(cl_forward, q.finish, repeats), median_time(cl_backward, q.finish, repeats))
    for name, (tf, tb) in times.items():
        rows.append(
            f"{label:<22} {name:<8} {tf * 1e3:9.1f} {fwd_flop / tf / 1e9:8.1f}   "
            f"{tb * 1e3:9.1f} {bwd_flop / tb / 1e9:8.1f}"
        )
    o, npy, s, cb = times.get("opencl"), times["numpy"], times["sgemm"], times.get("clblast")
    if o:
        vs_clblast = f"; opencl/clblast fwd {o[0] / cb[0]:.2f}x bwd {o[1] / cb[1]:.2f}x" if cb else ""
        rows.append(
            f"{'':<22} {'ratio':<8} opencl/numpy fwd {o[0] / npy[0]:.2f}x bwd {o[1] / npy[1]:.2f}x; "
            f"opencl/sgemm fwd {o[0] / s[0]:.2f}x bwd {o[1] / s[1]:.2f}x{vs_clblast} "
            "(time ratios, < 1: faster)"
        )
    return rows


def bench_step(backends: dict[str, Backend], arch: str, batch: int, repeats: int) -> list[str]:
    c1, c2 = parse_arch(arch)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    labels = rng.integers(0, 10, size=batch)
    rows, times = [], {}
    for name, be in backends.items():
        net = paper_net((c1, c2), be, "lrn")
        xd = be.asarray(x)

        def step(net=net, xd=xd):
            return net.train_step(xd, labels)

        times[name] = median_time(step, be.synchronize, repeats)
        rows.append(f"train step {arch} lrn   {name:<8} {times[name] * 1e3:9.1f} ms")
    if "opencl" in times:
        rows.append(f"{'':<22} {'ratio':<8} opencl/numpy {times['opencl'] / times['numpy']:.2f}x")
    return rows


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    add(
        p,
        "batch_size",
        "repeats",
        "arch",
        "device",
        many=("arch",),
        defaults={"batch_size": 64, "repeats": 5, "arch": ["50:500"]},
        helps={"arch": "one or more; the training step uses the first"},
    )
    p.add_argument("--no-step", action="store_true", help="skip the training-step benchmark")
    p.add_argument(
        "--blas-threads",
        type=count(1),
        metavar="N",
        help="set OpenBLAS's thread count (default: leave it). On a loaded machine 1 can be "
        "much faster: OpenBLAS threads busy-wait for each other",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    archs = args.arch

    if args.blas_threads is not None:
        set_threads = openblas_function("openblas_set_num_threads")
        if set_threads is None:
            p.error("--blas-threads: numpy's OpenBLAS was not found")
        set_threads(args.blas_threads)
    backends: dict[str, Backend] = {"numpy": get_backend("numpy")}
    try:
        backends["opencl"] = get_backend("opencl", device=args.device)
    except RuntimeError as e:  # NoOpenCLDevice: still show numpy and OpenBLAS
        print(f"opencl: unavailable ({e})")
    for name, be in backends.items():
        print(f"{name}: {be.describe()}")
    print(f"numpy {np.__version__}, {openblas_info()}")
    print(f"batch size {args.batch_size}, median of {args.repeats} runs\n")

    rng = np.random.default_rng(0)
    print(f"{'convolution':<22} {'backend':<8} {'fwd ms':>9} {'GFLOP/s':>8}   {'bwd ms':>9} {'GFLOP/s':>8}")
    for shape in conv_shapes(archs, args.batch_size):
        for row in bench_conv(backends, shape, args.repeats, rng):
            print(row, flush=True)
    if not args.no_step:
        print()
        for row in bench_step(backends, archs[0], args.batch_size, args.repeats):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as e:
        print(f"bench_opencl: error: {e}", file=sys.stderr)
        sys.exit(2)

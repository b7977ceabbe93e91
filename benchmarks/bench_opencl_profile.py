#!/usr/bin/env python3
"""Where a training step goes, op by op on numpy and on OpenCL, each against this machine's roof;
then each OpenCL kernel on the device.

    python benchmarks/bench_opencl_profile.py                       # 50:500, batch 64
    python benchmarks/bench_opencl_profile.py --arch 150:800 --norm batch --repeats 5

A training step of the paper's network (forward, loss, backward, SGD update) on random
CIFAR-shaped data, first unobserved (the step time a user gets), then with every backend op
the network calls (``backends/base.py``'s list: conv2d_forward, relu_lrn_backward, sgd_update,
...) timed on the host with a synchronize before and after it, on numpy and on OpenCL. An op
made of others (numpy's relu_lrn_forward runs relu_forward and lrn_forward) is charged its
whole time; its parts are not rows.

The first table gives each op's ms per step and its rate: GFLOP/s for the GEMM ops (the
convolutions and the linear layer), GB/s for the memory-bound rest, from the shapes it was
called with (the FLOPS and BYTES tables in this script); and that rate as a % of the roof, measured in the same
run: for the GEMM ops OpenBLAS's SGEMM (numpy's ``@`` at the shape of the largest convolution's
GEMM), for both columns; for the memory-bound ops a plain copy moving the same bytes as each
call of the op, numpy's ``np.copyto`` for the numpy column and a copy kernel on the device for
the OpenCL column. Ops with no model (asarray, to_numpy) have no rate.

The second table gives the OpenCL kernels by name, from the queue's profiling events: device
ms per step, launches per step, and what is left of the ops' host time once the kernels'
device time is taken out (launch overhead, buffer allocation, host work and transfers).
Medians over --repeats steps after a warm-up step (which compiles, and may autotune the
GEMM); each roof is the best of 7 tries (ROOF_TRIES) after that backend's steps, SGEMM's the
better of its two. A script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import statistics
import sys
import time
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
Call = dict[str, Any]  # one op call: "op", "seconds", "out" (its result's shape), each argument (an array's shape)
F32 = 4  # bytes per value
ROOF_TRIES = 7
GEMM_COLUMNS = 4096  # the SGEMM roof's columns at most: BLAS reaches its speed well before


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# ---- the work of each op, from the shapes it was called with (a backward's "cache" is its forward's call) ----
# GEMM ops, in flops: 2*M*N*K per GEMM, ``out`` holding its M*N sums of K products; a backward is
# dW and dX, each its forward's count (no dX where need_dx is False, the first layer). Biases are left out.
FLOPS: dict[str, Callable[[Call], int]] = {
    "conv2d_forward": lambda c: 2 * numel(c["out"]) * numel(c["w"][1:]),
    "conv2d_partial": lambda c: 2 * numel(c["out"]) * numel(c["w"][1:]),
    "conv2d_backward": lambda c: (1 + c["need_dx"]) * FLOPS["conv2d_forward"](c["cache"]),
    "linear_forward": lambda c: 2 * numel(c["out"]) * c["w"][1],
    "linear_backward": lambda c: 2 * FLOPS["linear_forward"](c["cache"]),
}


# Memory-bound ops, in bytes read + written (float32), each array once: what the op cannot do with less.
def forward_bytes(c: Call) -> int:  # reads x, writes y
    return F32 * (numel(c["x"]) + numel(c["out"]))


def backward_bytes(c: Call) -> int:  # reads dy and its forward's x, writes dx
    return F32 * (numel(c["dy"]) + 2 * numel(c["cache"]["x"]))


BYTES: dict[str, Callable[[Call], int]] = {
    **dict.fromkeys(("relu_forward", "lrn_forward", "relu_lrn_forward", "batchnorm_forward"), forward_bytes),
    **dict.fromkeys(("relu_backward", "lrn_backward", "relu_lrn_backward", "batchnorm_backward"), backward_bytes),
    "maxpool_forward": forward_bytes,
    "maxpool_backward": backward_bytes,
    "softmax_cross_entropy": lambda c: F32 * 2 * numel(c["logits"]),  # reads logits, writes dlogits
    "sgd_update": lambda c: F32 * 5 * numel(c["param"]),  # reads param, grad, velocity; writes param, velocity
}


def observe(be: Backend, calls: list[Call]) -> None:
    """Record each op the network calls on ``be`` into ``calls``: its host time (synchronized before and
    after), its arguments (arrays as shapes) and its result's shape. An op called by another op is its
    caller's time, not a call of its own; a backward's cache is replaced by its forward's call."""
    depth = 0
    forwards: dict[int, tuple[Any, Call]] = {}  # id(cache) -> (the cache, kept alive till its backward; the call)

    def shape(v: Any) -> Any:
        return tuple(v.shape) if hasattr(v, "shape") else v

    def timed(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(op)

        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal depth
            if depth:
                return op(*args, **kwargs)
            be.synchronize()
            t = time.perf_counter()
            depth += 1
            try:
                out = op(*args, **kwargs)
            finally:
                depth -= 1
            be.synchronize()
            call = {"op": name, "seconds": time.perf_counter() - t}
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            call |= {k: shape(v) for k, v in bound.arguments.items() if k != "cache"}
            if "cache" in bound.arguments:
                call["cache"] = forwards.pop(id(bound.arguments["cache"]), (None, None))[1]
            results = out if isinstance(out, tuple) else (out,)
            call["out"] = next((shape(r) for r in results if hasattr(r, "shape")), None)
            if name.endswith(("_forward", "_partial")) and isinstance(out, tuple):
                forwards[id(out[1])] = (out[1], call)
            calls.append(call)
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


# ---- the roofs, measured on this machine in the same run ----
def best(run: Callable[[], Any], sync: Callable[[], Any] = lambda: None) -> float:
    """The fastest of ROOF_TRIES runs of ``run()`` (each ended by ``sync()``) after a warm-up one, in seconds."""
    run()
    sync()
    times = []
    for _ in range(ROOF_TRIES):
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def sgemm_roof(calls: list[Call]) -> tuple[str, float]:
    """OpenBLAS's SGEMM flop/s (numpy's ``@`` on float32, numpy's BLAS threads) at the GEMM shape of the
    largest convolution among ``calls``, F x C*KH*KW times C*KH*KW x N*OH*OW (at most GEMM_COLUMNS columns)."""
    conv = max((c for c in calls if c["op"] == "conv2d_forward"), key=FLOPS["conv2d_forward"])
    m, k = conv["w"][0], numel(conv["w"][1:])
    cols = min(numel(conv["out"]) // m, GEMM_COLUMNS)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, cols), dtype=np.float32)
    return f"{m}x{k} @ {k}x{cols}", 2 * m * k * cols / best(lambda: a @ b)


def numpy_copy(nbytes: int) -> float:
    """Seconds numpy's np.copyto takes to move ``nbytes``: read an array of nbytes/2 and write its copy."""
    src = np.ones(max(1, nbytes // (2 * F32)), np.float32)
    dst = np.empty_like(src)
    return best(lambda: np.copyto(dst, src))


# A plain copy on the device: on CPUs (the backend's rows kernels' way) a work-item copies a chunk of
# floats, the loop PoCL turns into vector code; elsewhere one float per work-item, neighbours side by side.
COPY_CL = """
__kernel void copy_rows(__global const float* restrict src, __global float* restrict dst,
                        const int total, const int chunk)
{
    const long start = (long)get_global_id(0) * chunk;
    const long end = min(start + chunk, (long)total);
    for (long e = start; e < end; e++) dst[e] = src[e];
}

__kernel void copy(__global const float* restrict src, __global float* restrict dst, const int total)
{
    const int e = get_global_id(0);
    if (e < total) dst[e] = src[e];
}
"""


def opencl_copy(rt: Any) -> Callable[[int], float]:
    """Seconds COPY_CL takes on ``rt``'s device (backends/opencl/cl_runtime.py) to move ``nbytes``: read
    nbytes/2 and write them, launched as the backend launches its rows or per-element kernels, timed on
    the host with the queue finished before and after (the clock of the ops' times)."""
    import pyopencl as cl
    import pyopencl.array as cla

    program = cl.Program(rt.context, COPY_CL).build()
    kernel = cl.Kernel(program, "copy_rows" if rt.rows else "copy")

    def seconds(nbytes: int) -> float:
        total = max(1, nbytes // (2 * F32))
        src = cla.zeros(rt.queue, total, np.float32)
        dst = cla.empty_like(src)
        if rt.rows:
            items, extra = -(-total // rt.CHUNK), (np.int32(rt.CHUNK),)
            local = min(256, max(1, items // (16 * rt.limits.compute_units)))  # as ClRuntime.launch(rows=True)
        else:
            items, extra, local = total, (), rt.wg
        grid = -(-items // local) * local
        return best(
            lambda: kernel(rt.queue, (grid,), (local,), src.data, dst.data, np.int32(total), *extra), rt.queue.finish
        )

    return seconds


# ---- a run ----
def profile(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The plain step time; per op, its host time, its calls and (memory-bound ops) the seconds a plain copy
    of the same bytes takes on this backend; (OpenCL) the kernels' device times; all per step. And the
    SGEMM roof, measured after the steps."""
    options = {"device": args.device, "profile": True} if name == "opencl" else {}
    be = get_backend(name, **options)
    plain = statistics.median(steps(be, args, args.repeats, lambda: None))
    calls: list[Call] = []
    per_step_calls: list[list[Call]] = []
    per_step_kernels: list[dict[str, tuple[int, float]]] = []
    rt = getattr(be, "rt", None)

    def collect() -> None:  # after each step: its ops' calls and its kernels' (launches, device s)
        per_step_calls.append(calls[:])
        calls.clear()
        per_step_kernels.append(rt.kernel_times() if rt is not None else {})

    if rt is not None:
        rt.kernel_times()  # drop the plain steps' events
    observe(be, calls)
    observed = steps(be, args, args.repeats, collect)
    last = per_step_calls[-1]
    copy = functools.cache(numpy_copy if rt is None else opencl_copy(rt))
    ops = {}
    for op in dict.fromkeys(c["op"] for c in last):
        mine = [c for c in last if c["op"] == op]
        ops[op] = {
            "seconds": statistics.median(sum(c["seconds"] for c in s if c["op"] == op) for s in per_step_calls[1:]),
            "calls": mine,
            "copy_seconds": sum(copy(BYTES[op](c)) for c in mine) if op in BYTES else None,
        }
    kernel_table = {
        k: (per_step_kernels[-1][k][0], statistics.median(s.get(k, (0, 0.0))[1] for s in per_step_kernels[1:]))
        for k in per_step_kernels[-1]
    }
    return {
        "step": plain,
        "observed": statistics.median(observed),
        "ops": ops,
        "kernels": kernel_table,
        "describe": be.describe(),
        "sgemm": sgemm_roof(last),  # after each backend's steps: main keeps the better of the two
    }


def si(value: float, unit: str) -> str:
    """``value`` to three significant digits with the prefix that fits: 2.87 MFLOP, 138 MB."""
    scale, prefix = next(((s, p) for s, p in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if value >= s), (1.0, ""))
    return f"{value / scale:.3g} {prefix}{unit}"


def work(op: str, calls: list[Call]) -> tuple[float, str] | None:
    """An op's work in ``calls``: (flops, "FLOP") for a GEMM op, (bytes, "B") for a memory-bound one; None
    for an op with no model."""
    for model, unit in ((FLOPS, "FLOP"), (BYTES, "B")):
        if op in model:
            return sum(map(model[op], calls)), unit
    return None


def profile_table(np_: dict[str, Any], cl_: dict[str, Any], gemm_roof: float) -> str:
    """The first table: per op, for numpy and OpenCL side by side, ms per step, rate and % of the roof
    (``gemm_roof`` in flop/s for the GEMM ops; a copy of the same bytes on the same backend for the rest)."""
    ops = sorted(set(np_["ops"]) | set(cl_["ops"]), key=lambda op: -cl_["ops"].get(op, {"seconds": 0.0})["seconds"])
    rows = []
    for op in ops:
        runs = np_["ops"].get(op), cl_["ops"].get(op)
        done = work(op, next(r for r in runs if r)["calls"])
        row = [op, si(*done) if done else "-"]
        for run in runs:
            if run is None or done is None:
                row += ["-"] * 3 if run is None else [f"{run['seconds'] * 1e3:.1f}", "-", "-"]
                continue
            rate = done[0] / run["seconds"]
            roof = gemm_roof if op in FLOPS else done[0] / run["copy_seconds"]
            row += [f"{run['seconds'] * 1e3:.1f}", f"{rate / 1e9:.3g} G{done[1]}/s", f"{rate / roof:.0%}"]
        row.append(f"{runs[1]['seconds'] / runs[0]['seconds']:.2f}" if all(runs) else "-")
        rows.append(row)
    total = [sum(op["seconds"] for op in r["ops"].values()) for r in (np_, cl_)]
    rows.append(["sum of ops", "", f"{total[0] * 1e3:.1f}", "", "", f"{total[1] * 1e3:.1f}", "", ""])
    rows[-1].append(f"{total[1] / total[0]:.2f}")
    headers = ["op", "work/step", "numpy ms/step", "numpy rate", "numpy % roof"]
    headers += ["opencl ms/step", "opencl rate", "opencl % roof", "opencl/numpy"]
    title = "each op per step, synchronized, its rate and the rate's % of the roof (slowest on OpenCL first)"
    return format_table(headers, rows, title)


def roof_lines(np_: dict[str, Any], cl_: dict[str, Any], shape: str, gemm_roof: float) -> str:
    """The roofs above the first table: SGEMM's, and each memory-bound op's copy bandwidth on each backend."""
    lines = [
        f"roofs, measured in this run after each backend's steps (the best of {ROOF_TRIES} tries; SGEMM's the better"
        " of its two):",
        f"  GEMM ops, both columns: OpenBLAS SGEMM (numpy @ on float32 at {shape}, the largest convolution's GEMM;"
        f" numpy's BLAS threads): {gemm_roof / 1e9:.1f} GFLOP/s",
        "  memory-bound ops: a plain copy of the op's bytes, call by call: numpy's np.copyto | a copy kernel on the"
        " OpenCL device",
    ]
    for op in sorted(set(np_["ops"]) & set(cl_["ops"]) & set(BYTES)):
        nbytes = work(op, np_["ops"][op]["calls"])[0]
        numpy_gbs, opencl_gbs = (nbytes / r["ops"][op]["copy_seconds"] / 1e9 for r in (np_, cl_))
        lines.append(f"    {op:<22} {numpy_gbs:6.3g} | {opencl_gbs:6.3g} GB/s")
    return "\n".join(lines)


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
    shape, gemm_roof = max(np_["sgemm"], cl_["sgemm"], key=lambda roof: roof[1])
    print(
        f"paper_net {args.arch} ({args.norm}), batch size {args.batch_size}, training step; OpenCL: {cl_['describe']}"
    )
    print(
        f"step (unobserved): numpy {np_['step']:.3f} s, opencl {cl_['step']:.3f} s, "
        f"opencl/numpy {cl_['step'] / np_['step']:.2f}x   (observed, with a sync around each op: "
        f"{np_['observed']:.3f} s, {cl_['observed']:.3f} s)"
    )
    print(roof_lines(np_, cl_, shape, gemm_roof))
    print(profile_table(np_, cl_, gemm_roof))
    kernels = sorted(cl_["kernels"].items(), key=lambda kv: -kv[1][1])
    device = sum(s for _, s in cl_["kernels"].values())
    rows = [[k, str(n), f"{s * 1e3:.1f}", f"{s / device:.0%}"] for k, (n, s) in kernels]
    host = sum(op["seconds"] for op in cl_["ops"].values())
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

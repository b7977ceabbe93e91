#!/usr/bin/env python3
"""What the master's spot checks cost and catch (tinyconv/distributed/spot_check.py, replica/replay_check.py).

    python benchmarks/bench_spot_check.py                          # conv2 of 50:500, a third of it, batch 64
    python benchmarks/bench_spot_check.py --split channels         # the same, split by input channels
    python benchmarks/bench_spot_check.py --parallel data --norm batch  # a replica on a third of the batch
    python benchmarks/bench_spot_check.py --parallel hybrid        # its conv part on a third of the batch
    python benchmarks/bench_spot_check.py --norm batch             # conv2's tail with batch norm, not LRN
    python benchmarks/bench_spot_check.py --worker-backend opencl --honest-steps 10000 --arch 16:32 --batch-size 32

One worker (a real handler, in this process) answers the tasks of the paper's conv2 -- conv 5x5, ReLU,
LRN (``--norm batch``: batch norm), max pool -- on a share of it: by kernels (``--split kernels``),
the block of a third of its kernels and their halo; by input channels, the middle one of three, a
third of its input channels for every kernel and the tail of a third of the kernels, in chunks of 32
images, the others' partial sums and
conv-output gradients random; by images (``--parallel data``: data parallelism, a whole replica of the
paper's network, ``--norm``; ``--parallel hybrid``: its conv part) on a third of the batch: the master checks
one image of it a step and replays the whole now and then (samples: replays). The master samples its
results within ``--spot-check`` (the main job's default budget), priced at its
own speed on a like share (the worker's, step by step, when both run numpy; else timed every 50 steps).
Printed: over ``--honest-steps`` honest steps, the samples taken, false alarms (should be 0), the
backward disagreements a second sample forgave, and the cost: the master's seconds on samples
against the worker's compute seconds, and against what the budget allowed.
Then, for each kind of wrong worker, honest until ``--fault-from`` and wrong from then on, the steps
it took to lose it (1: the fault's first step; median and worst over ``--seeds`` runs): x -50 poison,
1 % on every result, 1 % on dw (by images: the gradient) alone, 1 % noise on dx (the logits, or the
hybrid's features) alone, and by images 1 % on conv1's gradient alone and two faults inside the worker's
backward that its own sums follow: 1 % on every convolution's dx, and on the norm's. (A
worker wrong from its first step is always caught there: the first step is always sampled.)
No asserts: tests/test_spot_check.py pins the behaviour.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from backends import get_backend  # noqa: E402
from backends.base import Backend  # noqa: E402
from tinyconv.distributed.replica import flat  # noqa: E402
from tinyconv.distributed.replica.conv_part import conv_part  # noqa: E402
from tinyconv.distributed.replica.replay_check import ReplayCheck  # noqa: E402
from tinyconv.distributed.replica.replica import spec_of  # noqa: E402
from tinyconv.distributed.rpc import Lost  # noqa: E402
from tinyconv.distributed.shard.by_channels import PIPELINE  # noqa: E402
from tinyconv.distributed.spot_check import SpotCheck  # noqa: E402
from tinyconv.distributed.worker.handler import Worker  # noqa: E402
from tinyconv.model import paper_net  # noqa: E402
from tinyconv.options import Parser, UsageError, add, count, number  # noqa: E402
from tinyconv.report import format_table  # noqa: E402
from transports.base import Message  # noqa: E402

TAIL = [
    {"op": "relu"},
    {"op": "lrn", "size": 5, "alpha": 1e-4, "beta": 0.75, "k": 2.0},
    {"op": "maxpool", "kernel": 3, "stride": 2, "padding": 1},
]
BN_TAIL = [TAIL[0], {"op": "bn", "eps": 1e-5, "training": True}, TAIL[2]]  # the default preset's block
Spoil = Callable[[str, np.ndarray, np.random.Generator], np.ndarray]
FAULTS: dict[str, Spoil] = {
    "x -50 poison": lambda name, a, rng: a * np.float32(-50),
    "1 % on every result": lambda name, a, rng: a * np.float32(1.01),
    "1 % on dw alone": lambda name, a, rng: a * np.float32(1.01) if name in ("dw", "grads") else a,
    "1 % noise on dx alone": lambda name, a, rng: (
        (a * (1 + 0.01 * rng.standard_normal(a.shape))).astype(np.float32)
        if name in ("dx", "logits", "features")
        else a
    ),
}
Check = SpotCheck | ReplayCheck
# by images, faults inside the worker's backward that its own sums then follow: dX 1 % off in every convolution
# that computes one (a faulty dX GEMM), or the norm's backward (LRN's, batch norm's)
INSIDE = {"1 % on conv dx, inside": "conv2d_backward", "1 % on the norm's dx, inside": "norm"}


def faulty(backend: Backend, op: str, on: Callable[[], bool]) -> Backend:
    """``backend`` with ``op``'s dx (the norm: LRN's, ReLU + LRN's or batch norm's) 1 % off while ``on()``."""
    ops = ("lrn_backward", "relu_lrn_backward", "batchnorm_backward") if op == "norm" else (op,)
    for name in ops:
        honest = getattr(backend, name)

        def spoiled(*args, honest=honest, **kwargs):
            out = honest(*args, **kwargs)
            dx = out[0] if isinstance(out, tuple) else out
            if dx is None or not on():
                return out
            dx = backend.asarray(backend.to_numpy(dx) * np.float32(1.01))
            return (dx, *out[1:]) if isinstance(out, tuple) else dx

        setattr(backend, name, spoiled)
    return backend


def first_conv_off(args: argparse.Namespace) -> Spoil:
    """By images: 1 % on conv1's gradient alone, where u^T dW v is 1-6 % of its terms' sizes (replica/probe.py)."""
    net = paper_net(args.arch, get_backend("numpy"), args.norm, seed=0)
    at = flat.spans(conv_part(net) if args.parallel == "hybrid" else net)["conv1.w"]

    def spoil(name: str, a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if name != "grads":
            return a
        a = a.copy()
        a[at] *= np.float32(1.01)
        return a

    return spoil


def check(args: argparse.Namespace, seed: int) -> Check:
    """The master's check of the split: samples of a model split's tasks, or replays of a replica's."""
    return ReplayCheck(args.spot_check, seed=seed) if args.way == "images" else SpotCheck(args.spot_check, seed=seed)


def tasks(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[tuple[str, dict, dict]], int]:
    """One step's tasks of the worker's share of conv2, (kind, header, arrays) in order, and its kernels F'."""
    c, total = (int(v) for v in args.arch.split(":"))
    n, hw = args.batch_size, 16
    tail, e = (TAIL, 4) if args.norm == "lrn" else (BN_TAIL, 0)  # e: LRN's halo; batch norm has none
    if args.way == "images":  # a replica on 1/SHARE of the batch, the weights sent whole
        net, m = paper_net(args.arch, get_backend("numpy"), args.norm, seed=0), n // args.share
        x, y = rng.standard_normal((m, 3, 32, 32), dtype=np.float32), rng.integers(0, 10, m)
        arrays = {"x": x, "y": y, "params": flat.pack(net)} | (
            {"buffers": b} if (b := flat.pack(net, "buffers")).size else {}
        )
        if args.parallel == "hybrid":  # the conv part's forward, then its backward from random dL/dfeatures
            conv = conv_part(net)
            arrays = {"x": x, "params": flat.pack(conv)} | (
                {"buffers": b} if (b := flat.pack(conv, "buffers")).size else {}
            )
            fc = net.layers[-1].params["w"]  # dL/dfeatures = dL/dlogits W, as the master's classifier makes it
            d = (rng.standard_normal((m, fc.shape[0]), dtype=np.float32) / np.float32(n)) @ fc
            return [
                ("hybrid_forward", {"net": spec_of(net), "batch": n}, arrays),
                ("hybrid_backward", {}, {"dfeatures": d}),
            ], m
        return [("replica_step", {"net": spec_of(net), "batch": n}, arrays)], m
    if args.way == "kernels":  # it owns 1/SHARE of the kernels, computes them and their halo over all of x
        f = total // args.share + 2 * e
        x = rng.standard_normal((n, c, hw, hw), dtype=np.float32)
        w = rng.standard_normal((f, c, 5, 5), dtype=np.float32) / np.float32(np.sqrt(c * 25))
        header = {"stride": 1, "padding": 2, "tail": tail, "own": [e, f - e]}
        dy = rng.standard_normal((n, f, 8, 8), dtype=np.float32)
        fwd = ("block_forward", header, {"x": x, "w": w, "b": np.zeros(f, np.float32)} | norm_arrays(tail, f, rng))
        return [fwd, ("block_backward", {"need_dx": True}, {"dy": dy})], f
    # by input channels: the middle one of SHARE, 1/SHARE of the input channels, all F kernels, in chunks
    ci, own = c // args.share, total // args.share
    lo, hi = own, 2 * own  # its own kernels; the others' halos reach into them by e
    halo = [lo - e, hi + e]
    x = rng.standard_normal((n, ci, hw, hw), dtype=np.float32)
    w = rng.standard_normal((total, ci, 5, 5), dtype=np.float32) / np.float32(np.sqrt(c * 25))
    settings = {"stride": 1, "padding": 2, "tail": tail, "halo": halo, "own": [e, e + own], "give": [lo + e, hi - e]}
    parts = [(a, min(a + PIPELINE, n)) for a in range(0, n, PIPELINE)]
    out = []
    for a, b in parts:
        arrays = {"x": x[a:b]} | ({"w": w} if a == 0 else {})
        out.append(("partial_forward", settings | {"images": [a, b, n]}, arrays))
    for a, b in parts:  # the others' partials over its halo, and its biases with the first chunk (the protocol)
        arrays = {"sum": rng.standard_normal((own + 2 * e, b - a, hw, hw), dtype=np.float32)}
        out.append(
            (
                "tail_forward",
                {"images": [a, b, n]},
                arrays
                | ({"b": np.zeros(own + 2 * e, np.float32)} | norm_arrays(tail, own + 2 * e, rng) if a == 0 else {}),
            )
        )
    dy = rng.standard_normal((n, own + 2 * e, 8, 8), dtype=np.float32)
    for a, b in parts if tail is TAIL else [(0, n)]:  # by the tail's chunks: batch norm's are the whole batch
        out.append(("tail_backward", {"images": [a, b, n]}, {"dy": dy[a:b]}))
    for a, b in parts:  # the others' conv-output gradients
        arrays = {"dyc_lo": rng.standard_normal((lo, b - a, hw, hw), dtype=np.float32)}
        arrays["dyc_hi"] = rng.standard_normal((total - hi, b - a, hw, hw), dtype=np.float32)
        out.append(("partial_backward", {"need_dx": True, "images": [a, b, n]}, arrays))
    return out, own


def norm_arrays(tail: list[dict], f: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A training batch norm's gamma and beta for ``f`` kernels (none without one)."""
    if BN_TAIL is not tail:
        return {}
    return {"gamma": rng.uniform(0.5, 2.0, f).astype(np.float32), "beta": rng.standard_normal(f, dtype=np.float32)}


def steps(args: argparse.Namespace, spot: Check, n_steps: int, spoil: Spoil | str | None, seed: int) -> dict:
    """Run ``n_steps`` steps of one worker's conv2 share; the step it was lost at (None) and its compute seconds.
    ``spoil``: what a wrong worker does to its answers, or the op of ``INSIDE`` it gets wrong."""
    rng = np.random.default_rng(seed)
    step_tasks, _ = tasks(args, rng)
    now = [0]
    backend = get_backend(args.worker_backend)
    if isinstance(spoil, str):
        backend, spoil = faulty(backend, spoil, lambda: now[0] >= args.fault_from), None
    worker = Worker(backend)
    master = get_backend("numpy")
    compute, task_id = 0.0, 0

    probed = paper_net(args.arch, master, args.norm, seed=0)  # what the replica's probe covers
    probed = conv_part(probed) if args.parallel == "hybrid" else probed

    def run(step: int, spot: Check | None = None, handler: Worker = worker) -> float:
        nonlocal task_id
        took = 0.0
        for kind, header, arrays in step_tasks:
            task_id += 1
            layer = {} if args.way == "images" else {"layer": 1}  # a replica's task is the whole network's
            if isinstance(spot, ReplayCheck) and kind in ("replica_step", "hybrid_forward"):  # as the runtime's
                arrays = arrays | spot.probe_for(1, probed)
            task = Message(kind, {**header, "task": task_id, "step": step} | layer, arrays)
            if isinstance(spot, SpotCheck):  # its probe of dw, as the runtime's Op.send asks for it
                task.arrays = task.arrays | spot.ask(1, task)
            reply = handler.handle(task)
            took += reply.header["compute_s"]
            if spoil is not None and step >= args.fault_from:
                reply.arrays = {k: spoil(k, a, rng) for k, a in reply.arrays.items()}
            if spot is not None:
                spot(1, task, reply, master)
        return took

    first = step_tasks[0][2]
    replay = isinstance(spot, ReplayCheck)
    # a replay is priced in the master's seconds per image of a whole replica step; a sample in its seconds per
    # kernel-channel-image of the block, forward (1) and backward (2)
    work = first["x"].shape[0] if replay else first["w"].shape[0] * first["x"].shape[1] * args.batch_size

    def set_rate(seconds: float) -> None:
        """Tell the check the master's speed, from its ``seconds`` on a share like the worker's."""
        if replay:
            spot.master_rate = seconds / work
        else:
            spot.master_rate[1] = seconds / (3 * work)

    same = args.worker_backend == "numpy"  # the master's backend: its share's speed is the worker's, step by step
    if args.master_share == "auto":  # the master computes a share like it, and the cluster tells the check its speed
        mine = Worker(master)
        times = [run(-i, None, mine) for i in range(6)]  # the first ones fault memory in: the median of the last 3
        set_rate(statistics.median(times[3:]))
    for step in tqdm(range(1, n_steps + 1), desc="steps", leave=False, disable=n_steps < 100):
        x = first["x"]
        x[rng.integers(x.shape[0])] = rng.standard_normal(x.shape[1:], dtype=np.float32)  # the data moves on
        now[0] = step
        try:
            took = run(step, spot)
        except Lost as e:
            return {"lost_at": step, "compute_s": compute, "why": "; ".join(e.workers.values())}
        compute += took
        if args.master_share == "auto" and same:  # as the cluster measures it, on this step (the machine's load moves)
            set_rate(took)
        elif args.master_share == "auto" and step % 50 == 0:  # another backend's: the master's share timed again
            times.append(run(-step, None, mine))
            set_rate(statistics.median(times[-3:]))
    return {"lost_at": None, "compute_s": compute}


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add(
        p,
        "arch",
        "parallel",
        "split",
        "norm",
        "batch_size",
        defaults={"arch": "50:500", "parallel": "model", "split": "kernels", "norm": "lrn", "batch_size": 64},
        helps={
            "arch": "the worker gets conv2",
            "parallel": "here model (conv2 split, its tasks sampled), data (a whole replica) or hybrid (its conv part)",
            "split": "here conv2's, with --parallel model (auto: channels, the worker being in this process)",
            "norm": "conv2's tail's, or the replica's: lrn or batch",
        },
    )
    p.add_argument(
        "--share",
        type=count(1),
        default=3,
        metavar="SHARE",
        help="the worker owns 1/SHARE of conv2's kernels (and input channels), or of the batch (default 3)",
    )
    p.add_argument("--worker-backend", default="numpy", help="the worker's backend; the master's is numpy")
    p.add_argument(
        "--spot-check",
        type=number(0, 1, low_open=True, what="a fraction"),
        default=0.03,
        metavar="FRACTION",
        help="the master's samples in at most this fraction of each worker's work, as the main job's (default 0.03)",
    )
    p.add_argument(
        "--master-share",
        choices=("auto", "0"),
        default="auto",
        help="auto: the master computes a share too, and its speed on it prices the budget (the cluster's default); "
        "0: it only coordinates, and its image samples price it",
    )
    p.add_argument("--honest-steps", type=count(1), default=200, metavar="N", help="(default 200)")
    p.add_argument(
        "--fault-steps", type=count(1), default=60, metavar="N", help="steps each wrong worker runs at most (60)"
    )
    p.add_argument(
        "--fault-from",
        type=count(1),
        default=11,
        metavar="N",
        help="the step its fault starts at: honest before, sampled as usual (default 11)",
    )
    p.add_argument("--seeds", type=count(1), default=5, metavar="N", help="runs of each wrong worker (default 5)")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.norm == "none":
        p.error(f"--norm {args.norm}: this benchmark takes lrn or batch")
    args.way = "images" if args.parallel in ("data", "hybrid") else "channels" if args.split == "auto" else args.split

    spot = check(args, seed=0)
    honest = steps(args, spot, args.honest_steps, None, seed=0)
    print(
        f"honest: {args.honest_steps} steps of {'a replica' if args.way == 'images' else 'conv2'} of {args.arch} "
        f"split by {args.way}, 1/{args.share} of it, "
        f"batch {args.batch_size}, worker on {args.worker_backend}, master on numpy"
    )
    print(
        f"  lost at step {honest['lost_at']} (a false alarm: {honest['why']})"
        if honest["lost_at"]
        else "  false alarms: 0"
    )
    images = f", images checked {spot.images}, backward {spot.backwards}" if isinstance(spot, ReplayCheck) else ""
    print(f"  samples {spot.samples}{images}, forgiven {getattr(spot, 'forgiven', 0)}")
    free, cost = getattr(spot, "free_seconds", 0.0), spot.seconds  # free: a model split's checks of every step
    print(
        f"  cost: {cost:.3f} s of the master against {honest['compute_s']:.3f} s of the worker "
        f"({100 * cost / honest['compute_s']:.2f} %; budget {100 * args.spot_check:g} % of the worker's "
        f"work at the master's speed: {spot.earned:.3f} s)"
        + (f"; of it the floors and projections {free:.3f} s" if free else "")
    )
    rows = []
    faults = FAULTS | ({"1 % on conv1's dw alone": first_conv_off(args)} | INSIDE if args.way == "images" else {})
    for name, spoil in faults.items():
        lost = [steps(args, check(args, seed=s), args.fault_steps, spoil, seed=s)["lost_at"] for s in range(args.seeds)]
        caught = [s - args.fault_from + 1 for s in lost if s is not None and s >= args.fault_from]  # 1: at once
        early = sum(s is not None and s < args.fault_from for s in lost)  # lost while still honest: false alarms
        found = f"{len(caught)}/{len(lost)}" + (f" ({early} early)" if early else "")
        rows.append([name, found, statistics.median(caught) if caught else "-", max(caught, default="-")])
    print(f"wrong from step {args.fault_from}:")
    print(format_table(["wrong worker", "caught", "median steps to catch", "worst"], rows))


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_spot_check: error: {e}", file=sys.stderr)
        sys.exit(2)

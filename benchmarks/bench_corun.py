#!/usr/bin/env python3
"""What two busy cores cost each other: one participant's convolution work, alone and beside a twin.

    python benchmarks/bench_corun.py                                 # 300:1000 at batch 64 and 256
    python benchmarks/bench_corun.py --arch 500:1500 --batch-size 64 128 256 --repeats 5

The experiment grid's 2-participant speedups fall with the batch (300:1000: 1.91x at batch 64,
1.50x at 256) although comm stays under 1 % of the step. This separates the machine from
tinyconv: each child process is pinned to a core with one BLAS thread and runs the forward and
backward of both convolutions (numpy backend) on a share of the kernels -- half of them, one
participant's part of a 2-participant step -- on random CIFAR-shaped data, the way a participant
does in a step, but with no master, no messages and no other work. It is timed

* **alone**: one child on core 0, the other core idle (the master alone's situation, but on half
  the kernels), and
* **together**: two children started at the same instant on cores 0 and 1 (a distributed step's
  situation: both participants computing at once),

alternating, and the whole layer's work (all kernels, alone) too. A *together* slower than *alone*
is what the cores share -- the L3 cache, the memory bus, the VM's host -- and the speedup it
leaves, ``whole alone / half together``, is the most any 2-participant split of the convolutions
can reach on this machine. Children run ``--untimed-steps`` passes before the timed ones and keep their
freed memory (``tinyconv/distributed/heap.py``), as the grid's participants do. No asserts; medians.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # one BLAS thread per process, before numpy is imported

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tinyconv.options import Parser, UsageError, add, count  # noqa: E402
from tinyconv.report import format_table  # noqa: E402

START_TIMEOUT_S = 600.0  # a child answers "ready" after its warm-up; more than this is a hang


def child(arch: str, batch: int, share: float, core: int, warmup: int, repeats: int, split: str) -> None:
    """Warm up, say "ready", wait for "go" on stdin, then time ``repeats`` passes; print the seconds."""
    from backends import get_backend
    from tinyconv.distributed.heap import keep_freed_memory

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    keep_freed_memory()
    be = get_backend("numpy")
    c1, c2 = (int(k) for k in arch.split(":"))
    rng = np.random.default_rng(core)
    f1 = max(1, round(c1 * share))
    # conv2 by kernels: a share of its kernels on all of its input; by channels: all of its kernels on a
    # share of its input channels (a partial sum of the whole output, as tinyconv's --split channels)
    f2, cin2 = (max(1, round(c2 * share)), c1) if split == "kernels" else (c2, max(1, round(c1 * share)))
    # conv1 on the images, conv2 on pool1's output (3x3 stride 2 pad 1: 32 -> 16), as in the network
    x1 = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
    w1 = rng.standard_normal((f1, 3, 5, 5), dtype=np.float32) * 0.1
    x2 = rng.standard_normal((batch, cin2, 16, 16), dtype=np.float32)
    w2 = rng.standard_normal((f2, cin2, 5, 5), dtype=np.float32) * 0.05

    def one_pass() -> float:
        t = time.perf_counter()
        y1, cache1 = be.conv2d_forward(x1, w1, np.zeros(f1, np.float32), 1, 2)
        y2, cache2 = be.conv2d_forward(x2, w2, np.zeros(f2, np.float32), 1, 2)
        be.conv2d_backward(np.ones_like(y2), cache2, need_dx=True)  # conv2 sends its dx on to pool1
        be.conv2d_backward(np.ones_like(y1), cache1, need_dx=False)  # the images need none
        return time.perf_counter() - t

    for _ in range(warmup):
        one_pass()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    print(json.dumps([one_pass() for _ in range(repeats)]), flush=True)


def run(arch: str, batch: int, share: float, cores: list[int], warmup: int, repeats: int, split: str) -> list[float]:
    """One child per core, released together; every child's pass times, pooled."""
    cmd = [sys.executable, __file__, "--child", "--arch", arch, "--untimed-steps", str(warmup)]
    cmd += ["--repeats", str(repeats), "--split", split, "--batch-size", str(batch), "--share", str(share)]
    procs = [
        subprocess.Popen([*cmd, "--core", str(c)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for c in cores
    ]
    try:
        for p in procs:
            if _line(p) != "ready":
                raise RuntimeError(f"a child on core {cores} did not get ready (exit code {p.poll()})")
        for p in procs:  # the two "go"s leave within microseconds of each other
            p.stdin.write("go\n")
            p.stdin.flush()
        times = [t for p in procs for t in json.loads(_line(p))]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
            p.wait(timeout=10)
    return times


def _line(p: subprocess.Popen) -> str:
    """The child's next line, or a RuntimeError after START_TIMEOUT_S (no receive without a timeout)."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=START_TIMEOUT_S):
            raise RuntimeError(f"a child said nothing for {START_TIMEOUT_S:.0f} s")
    return p.stdout.readline().strip()


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    add(
        p,
        "arch",
        "batch_size",
        "repeats",
        "untimed_steps",
        "split",
        many=("batch_size",),
        defaults={"arch": "300:1000", "batch_size": [64, 256], "repeats": 3, "untimed_steps": 1, "split": "kernels"},
        helps={
            "repeats": "here the timed passes of each child in a round, all pooled into the median",
            "untimed_steps": "here passes of the convolutions",
            "split": "here conv2's half: its kernels on all input channels (the paper's), or all its kernels on "
            "half the input channels (auto: channels, the two children being on one machine); conv1 (3 input "
            "channels) is always split by kernels",
        },
    )
    p.add_argument(
        "--rounds", type=count(1), default=2, metavar="N", help="alone/together alternations per batch size (default 2)"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--share", type=float, help=argparse.SUPPRESS)
    p.add_argument("--core", type=int, help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = build_parser().parse_args()
    split = "channels" if args.split == "auto" else args.split
    if args.child:
        child(args.arch, args.batch_size[0], args.share, args.core, args.untimed_steps, args.repeats, split)
        return
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
    if len(cores) < 2:
        sys.exit("bench_corun needs 2 cores to run a twin beside a child; this process may use one")
    pair = cores[:2]
    rows = []
    todo = [(b, r, w) for b in args.batch_size for r in range(args.rounds) for w in ("whole", "alone", "together")]
    medians: dict[tuple[int, str], list[float]] = {}
    for batch, _, what in tqdm(todo, desc="co-run", unit="run"):
        share, on = {"whole": (1.0, pair[:1]), "alone": (0.5, pair[:1]), "together": (0.5, pair)}[what]
        times = run(args.arch, batch, share, on, args.untimed_steps, args.repeats, split)
        medians.setdefault((batch, what), []).extend(times)
    base = None
    for batch in args.batch_size:
        whole, alone, together = (statistics.median(medians[(batch, w)]) for w in ("whole", "alone", "together"))
        base = base or (batch, whole, together)
        per_image = (whole / base[1] * base[0] / batch, together / base[2] * base[0] / batch)
        ratios = (f"{together / alone:.2f}x", f"{whole / together:.2f}x", f"{per_image[0]:.2f}", f"{per_image[1]:.2f}")
        rows.append([batch, f"{whole:.3f}", f"{alone:.3f}", f"{together:.3f}", *ratios])
    print(
        f"\n{args.arch}, conv2 by {split}: both convolutions' forward + backward, numpy, 1 BLAS thread "
        "per pinned core; seconds "
        f"per pass, median of {args.rounds} rounds x {args.repeats} passes (x 2 children together)"
    )
    first = args.batch_size[0]
    headers = ["batch size", "whole alone", "half alone", "half together", "together / alone"]
    headers += ["whole / half together", f"whole, per image vs {first}", f"half together, per image vs {first}"]
    print(format_table(headers, rows))
    print("whole / half together: the most a 2-participant split of the convolutions can speed up here")


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_corun: error: {e}", file=sys.stderr)
        sys.exit(2)

#!/usr/bin/env python3
"""Does a slower device keep its share? The main job, the master computing nothing, and two external workers,
each held to a CPU quota (tinyconv/lab/experiment/cpu_quota.py): one step's shares and time per line, from its
metrics file.

    sudo .venv/bin/python benchmarks/bench_slow_worker.py                      # 1.0 and 0.5 core, 30:90, batch 32
    sudo .venv/bin/python benchmarks/bench_slow_worker.py --cores 1 1 --slowdown 1 2   # the issue's --slowdown 2
    sudo .venv/bin/python benchmarks/bench_slow_worker.py --steps 40 --out runs/slow.jsonl

The run: ``examples/cifar10_dist.py --dataset synthetic --arch 30:90 --batch-size 32 --master-share 0
--transport zmq --external-workers --workers 2`` on loopback, its workers ``tinyconv worker --threads 1``, each
started behind its quota's prefix (and with ``--slowdown`` where given), each with a CURVE key of its own: the
metrics file names a worker by its key, so the slow one is known whichever joins first. The rebalancer should keep every
worker working in proportion to its measured speed: a worker 2x slower, about a third of conv2. Each row: the
step, its time, and the slow worker's kernels of conv1 and conv2, with its share of conv2;
then the medians of the step time and of the share over the last half of the steps. Needs root (the quotas);
without it, or with ``--cores 0 0`` (no quotas), the workers run unlimited. No asserts:
tests/test_rebalance.py pins the rule.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinyconv.lab.experiment.cpu_quota import CpuQuota, unavailable  # noqa: E402
from tinyconv.options import NON_NEGATIVE, Parser, UsageError, add, count  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keys(folder: Path) -> dict[str, str]:
    """CURVE key pairs for the master and the two workers (``tinyconv keygen``), the workers' public keys in
    ``folder/authorized``; returns each worker's public key (z85), by which the metrics file names it."""
    for name in ("master", "w0", "w1"):
        where = folder / ("authorized" if name != "master" else "")
        keygen = [sys.executable, "-m", "tinyconv.cli", "keygen", "--name", name, str(where)]
        subprocess.run(keygen, check=True, capture_output=True)
    text = {name: (folder / "authorized" / f"{name}.key").read_text() for name in ("w0", "w1")}
    return {name: t.split('public-key = "')[1].split('"')[0] for name, t in text.items()}


def run(args: argparse.Namespace, out: Path, folder: Path) -> int:
    """The master and the two workers, each worker in its quota; ``out``: the master's metrics file. Returns the
    index the slow worker (the second) got in the run."""
    public = keys(folder)
    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    master = [sys.executable, str(ROOT / "examples/cifar10_dist.py"), "--no-progress", "--dataset", "synthetic"]
    master += ["--arch", args.arch, "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--epochs", "1"]
    master += ["--master-share", "0", "--transport", "zmq", "--external-workers", "--workers", "2", "--bind", address]
    master += ["--start-timeout", "60", "--metrics-out", str(out), "--key", str(folder / "master.key_secret")]
    master += ["--authorized-keys", str(folder / "authorized")]
    worker = [sys.executable, "-m", "tinyconv.distributed.worker", "--connect", address, "--threads", "1"]
    worker += ["--no-progress", "--master-key", str(folder / "master.key")]
    limited = not unavailable() and all(c > 0 for c in args.cores)
    with ExitStack() as stack:
        procs = [subprocess.Popen(master, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)]
        for i, (cores, slowdown) in enumerate(zip(args.cores, args.slowdown, strict=True)):
            prefix = (
                stack.enter_context(CpuQuota(cores, name=f"tinyconv-cpu-{os.getpid()}-{i}")).prefix() if limited else []
            )
            secret = ["--key", str(folder / "authorized" / f"w{i}.key_secret"), "--slowdown", str(slowdown)]
            procs.append(subprocess.Popen([*prefix, *worker, *secret], env=env, cwd=ROOT))
        for proc in procs:
            proc.wait(timeout=600)
    if not limited:
        print(f"no quotas: {unavailable() or '--cores 0'}")
    (started,) = [e for e in map(json.loads, out.read_text().splitlines()) if e["event"] == "run"]
    return [w["key"] for w in started["workers"]].index(public["w1"])


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0], epilog="see the module docstring")
    p.add_argument(
        "--cores",
        type=NON_NEGATIVE,
        nargs=2,
        default=[1.0, 0.5],
        metavar="CORES",
        help="each worker's CPU quota, in cores (default 1 0.5; 0 0: no quotas)",
    )
    add(
        p,
        "slowdown",
        "arch",
        "batch_size",
        many=("slowdown",),
        defaults={"slowdown": [1.0, 1.0], "arch": "30:90", "batch_size": 32},
        helps={"slowdown": "each worker's, two of them"},
    )
    p.add_argument("--steps", type=count(1), default=30, metavar="N", help="stop the run after N steps (default 30)")
    add(p, "out", helps={"out": "keep the master's metrics file here"})
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    if len(args.slowdown) != 2:
        p.error(f"--slowdown takes one factor for each of the two workers, got {len(args.slowdown)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "run.jsonl"
        slow = run(args, out, Path(tmp))
        steps = [e for e in map(json.loads, out.read_text().splitlines()) if e["event"] == "step"]
    conv2 = sum(steps[0]["shares"]["conv2"])
    print(
        f"workers at {args.cores[0]:g} and {args.cores[1]:g} core, --slowdown {args.slowdown[0]:g} and "
        f"{args.slowdown[1]:g}; the second (the slow one) is worker {slow}"
    )
    print("step  time_s  conv1  conv2  conv2 share")
    for e in steps:
        c1, c2 = e["shares"]["conv1"][slow], e["shares"]["conv2"][slow]
        print(f"{e['step']:4d}  {e['time_s']:6.3f}  {c1:5d}  {c2:5d}  {c2 / conv2:.2f}")
    late = steps[len(steps) // 2 :]
    print(
        f"last {len(late)} steps: median step {statistics.median(e['time_s'] for e in late):.3f} s, median conv2 "
        f"share {statistics.median(e['shares']['conv2'][slow] / conv2 for e in late):.2f}"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as e:
        print(f"bench_slow_worker: error: {e}", file=sys.stderr)
        sys.exit(2)

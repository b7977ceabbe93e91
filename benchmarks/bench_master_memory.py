#!/usr/bin/env python3
"""The master's memory over a long run: its resident set at steps 10, 100, ... 100,000.

    python benchmarks/bench_master_memory.py                     # 100,000 steps, about 10 minutes here
    python benchmarks/bench_master_memory.py --steps 20000

It runs the main job (examples/cifar10_dist.py) on the synthetic dataset with a tiny network
(6:6, batch 2) and two in-process workers on an equal split, so
that every step is a distributed one and steps are milliseconds; it follows the job's metrics
file and reads the job's VmRSS (/proc) as each milestone step goes by. In-process workers count in
it. Printed: a table of step and resident MB, and the growth per step from step 1,000 on -- what a
run keeps per step (the issue measured 3.9 KB a step before the summaries were aggregated as they
go). Linux only. No asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyconv.options import Parser, UsageError, add, count  # noqa: E402
from tinyconv.report import format_table  # noqa: E402

POLL_S = 0.05  # how often the metrics file and /proc are read while the job runs


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def main() -> None:
    head, _, rest = __doc__.partition("\n\n")
    p = Parser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=count(1), default=100_000, metavar="N", help="stop the run after N steps (100000)")
    add(p, "arch", defaults={"arch": "6:6"})
    args = p.parse_args()
    milestones = [s for s in (10, 100, 1_000, 10_000, 100_000) if s <= args.steps] + [args.steps]
    with tempfile.TemporaryDirectory(prefix="tinyconv-mem-") as tmp:
        metrics = Path(tmp) / "run.jsonl"
        job = [sys.executable, str(ROOT / "examples/cifar10_dist.py"), "--dataset", "synthetic", "--arch", args.arch]
        job += ["--batch-size", "2", "--epochs", "1000", "--steps", str(args.steps), "--transport", "inproc"]
        job += ["--workers", "2", "--plan", "equal", "--no-progress", "--metrics-out", str(metrics)]
        proc = subprocess.Popen(job, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        rows, step, t0, seen, partial = [], 0, time.monotonic(), None, ""
        while proc.poll() is None and milestones:
            if seen is None and metrics.exists():
                seen = metrics.open()
            *lines, partial = (partial + (seen.read() if seen else "")).split("\n")  # the last may be half written
            for line in lines:
                if '"event": "step"' in line:
                    step = json.loads(line)["step"]
            if step >= milestones[0]:
                rows.append([step, round(rss_mb(proc.pid), 1), round(time.monotonic() - t0)])
                milestones = [m for m in milestones if m > step]
            time.sleep(POLL_S)  # polling a running job: nothing to synchronise with
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"the job failed ({proc.returncode}):\n{err[-2000:]}")
    print(f"the main job, {args.arch}, batch 2, master + 2 in-process workers (equal split), pid {proc.pid}:")
    print(format_table(["step", "resident MB", "seconds in"], rows))
    base = next((r for r in rows if r[0] >= 1_000), None)
    if base is not None and rows[-1][0] > base[0]:
        per_step = (rows[-1][1] - base[1]) * 1024 * 1024 / (rows[-1][0] - base[0])
        print(f"growth from step {base[0]:,} to {rows[-1][0]:,}: {per_step:.1f} bytes a step")
    print(f"(host: {os.uname().machine}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_master_memory: error: {e}", file=sys.stderr)
        sys.exit(2)

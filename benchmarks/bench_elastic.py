#!/usr/bin/env python3
"""What a lost worker costs: each fault the master detects, how long that took, and what it cost the run.

    python benchmarks/bench_elastic.py                  # 32:64, batch 32, 2 workers, 10 steps, at step 5
    python benchmarks/bench_elastic.py --arch 50:500 --batch-size 64 --steps 8 --at 4

Every run has the same seed, data and equal starting split (no calibration, no rebalancing, so that
only the loss changes who computes), a master and 2 workers; worker 1 goes wrong just before step --at.

Over ZeroMQ, worker processes: SIGKILL (the master notices a dead worker when a send to it fails: the
step's tasks go before its socket has closed, so it is the next heartbeat's, within 0.4 s) and SIGSTOP
(silent, heartbeats too, and its task never said "started": lost after 4 heartbeats, 1.6 s, well before
--peer-timeout; killed after the run).

The worker process has no hook to misbehave on purpose (``worker/main.py`` serves a plain Worker), so
the other faults run on in-process workers (threads on InprocTransport, split by kernels so that the
spot check samples them), from step --at on: an error reply (a device out of memory), a forward one
kernel short (wrong shape), NaNs, every number times -50 (finite, well formed: the spot check's to
catch), and a hung worker whose heartbeats flow (an in-process worker has no heartbeats to stop: only
its compute deadline catches it, twice its expected compute and a second from its "started": by its last
steps at step --at; in step 1 by the master's own share, the equal plan's, or, "calibrated", by the calibration).

One table, a row per run: the median step, and the slowest from step --at on (the first step pays for
first-use allocations); the stall, that slowest step past the uninterrupted run's median (of the same
transport); the detection time, from the fault (the signal, or the worker's first wrong answer) to the
master's ``worker_lost``, and its reason; the largest relative loss difference against the
uninterrupted run.

Then the master's own faults, on the main job (examples/cifar10_dist.py on synthetic data, --plan equal,
a checkpoint every step) with 2 external ``tinyconv worker --serve`` processes on loopback, after step
--at: SIGKILL of its training process under --max-restarts 1 (its supervisor restarts it from the
checkpoint), and SIGTERM (exit 143) followed at once by the same command with --resume. A second table:
the time from the signal until the next step is done (the restarted or resumed master's first), the
steps its metrics file then holds, and below it what the master and the workers printed.
No asserts: tests/test_elastic.py, tests/test_chaos.py and tests/test_chaos_processes.py pin the behaviour.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from tempfile import TemporaryDirectory  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from backends import get_backend  # noqa: E402
from tinyconv.distributed.pool import distribute  # noqa: E402
from tinyconv.distributed.protocol import VERSION  # noqa: E402
from tinyconv.distributed.runtime import Runtime  # noqa: E402
from tinyconv.distributed.shard.cluster import Cluster  # noqa: E402
from tinyconv.distributed.worker.handler import Worker  # noqa: E402
from tinyconv.model import Network, paper_net  # noqa: E402
from tinyconv.optim import SGD  # noqa: E402
from tinyconv.options import Parser, UsageError, add, count  # noqa: E402
from tinyconv.report import format_table  # noqa: E402
from transports.base import Message  # noqa: E402
from transports.inproc import InprocTransport  # noqa: E402
from transports.session.settings import SECRET_ENV  # noqa: E402

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}
FAULTS = ("error reply", "wrong shape", "NaN", "x -50", "hung", "hung in step 1", "hung in step 1, calibrated")


class Faulty(Worker):
    """An in-process worker that answers wrongly from the first task of step ``at`` (0-based) on, as ``fault``
    says; ``wrong_at``, the time of its first wrong answer (or of the task it hangs on)."""

    def __init__(self, backend, fault: str | None, at: int) -> None:
        super().__init__(backend)
        self.fault, self.at, self.wrong_at = fault, at, None
        self.released = threading.Event()  # set when the run is over: a hung task then ends

    def handle(self, msg: Message) -> Message | None:
        if self.fault is None or msg.header.get("step", -1) < self.at:
            return super().handle(msg)
        self.wrong_at = self.wrong_at or time.perf_counter()
        if self.fault == "hung":
            self.released.wait(600)
            return None
        if self.fault == "error reply":
            raise MemoryError("out of device memory")
        reply = super().handle(msg)
        if self.fault == "wrong shape" and "y" in reply.arrays:
            reply.arrays["y"] = reply.arrays["y"][:, 1:]
        elif self.fault == "NaN":
            for a in reply.arrays.values():
                a.fill(np.nan)
        elif self.fault == "x -50":
            reply.arrays = {k: a * np.float32(-50) for k, a in reply.arrays.items()}
        return reply


@contextmanager
def zmq_run(args: argparse.Namespace, net: Network, sig: str | None) -> Iterator[tuple[Runtime, Callable, Callable]]:
    """Master and 2 ZeroMQ worker processes; ``sig`` goes to worker 1 just before step --at. Yields the
    cluster, what to do before each step (1-based), and the time of the fault (None before it)."""
    fault_at = []
    with distribute(
        net,
        transport="zmq",
        workers=2,
        calibrate=False,
        rebalance=False,
        peer_timeout=args.peer_timeout,
        batch_size=args.batch_size,
        announce=lambda _: None,
    ) as cluster:
        victim = cluster.workers[1]

        def before(step: int) -> None:
            if sig is not None and step == args.at:
                fault_at.append(time.perf_counter())
                os.kill(victim.pid, SIGNALS[sig])

        try:
            yield cluster, before, lambda: fault_at[0] if fault_at else None
        finally:
            if sig == "SIGSTOP":
                os.kill(victim.pid, signal.SIGKILL)


@contextmanager
def inproc_run(
    args: argparse.Namespace, net: Network, fault: str | None
) -> Iterator[tuple[Runtime, Callable, Callable]]:
    """Master and 2 in-process workers, worker 1 wrong from step --at (or 1) on as ``fault`` says."""
    kind, at = ("hung", 0) if fault and fault.startswith("hung in step 1") else (fault, args.at - 1)
    workers = [Faulty(get_backend("numpy"), None, 0), Faulty(get_backend("numpy"), kind, at)]
    transport = InprocTransport(lambda i: workers[i], protocol=VERSION)
    with transport:
        infos = transport.start(2, timeout=60.0)
        cluster = Cluster(transport, infos, get_backend("numpy"), split="kernels", rebalance=False, recv_timeout=60.0)
        if fault and fault.endswith("calibrated"):
            cluster.calibrate(net, args.batch_size)
        else:
            cluster.attach(net)
        try:
            yield cluster, lambda step: None, lambda: workers[1].wrong_at
        finally:
            workers[1].released.set()
            cluster.close()


def run(args: argparse.Namespace, transport: str, fault: str | None) -> dict:
    """One run of --steps steps; ``fault`` (a signal's name over zmq, one of FAULTS in-process) hits worker 1."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, 3, 32, 32), dtype=np.float32)
    y = rng.integers(0, 10, args.batch_size)
    net = paper_net(args.arch, get_backend("numpy"), seed=0)
    opt = SGD(net, lr=0.01, momentum=0.9)
    losses, times, declared = [], [], []
    start = zmq_run if transport == "zmq" else inproc_run
    with start(args, net, fault) as (cluster, before, fault_at):
        lose = cluster.lose

        def timed_lose(workers: dict[int, str], refuse: bool = False) -> None:  # when the master gives up on it
            declared.append(time.perf_counter())
            lose(workers, refuse)

        cluster.lose = timed_lose
        for step in tqdm(range(1, args.steps + 1), desc=f"{transport} {fault or 'uninterrupted'}", leave=False):
            before(step)
            t = time.perf_counter()
            losses.append(cluster.train_batch(net, x, y)[0])  # what the trainer calls
            opt.step()
            times.append(time.perf_counter() - t)
        events, wrong_at = cluster.pop_events(), fault_at()
    lost = [e for e in events if e["event"] == "worker_lost"]
    return {
        "transport": transport,
        "fault": fault or "uninterrupted",
        "losses": losses,
        "times": times,
        "lost": lost,
        "detected_s": declared[0] - wrong_at if declared and wrong_at is not None else None,
        "at": 1 if fault and "step 1" in fault else args.at,
    }


class MainJob:
    """The main job and its 2 external workers on loopback, each process's output in a file in ``folder``."""

    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.folder, self.metrics, self.checkpoint = folder, folder / "run.jsonl", folder / "run.npz"
        with socket.socket() as sock:  # a free port, the same for every master of the run
            sock.bind(("127.0.0.1", 0))
            self.address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        job = [sys.executable, str(ROOT / "examples" / "cifar10_dist.py"), "--no-progress", "--dataset", "synthetic"]
        job += [
            "--arch",
            args.arch,
            "--batch-size",
            str(args.batch_size),
            "--steps",
            str(args.steps),
            "--plan",
            "equal",
        ]
        job += ["--transport", "zmq", "--external-workers", "--workers", "2", "--bind", self.address]
        job += ["--checkpoint", str(self.checkpoint), "--checkpoint-every", "1", "--metrics-out", str(self.metrics)]
        self.command = job
        self.env = {k: v for k, v in os.environ.items() if k != SECRET_ENV} | {"PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(self.folder / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        return self.procs[name]

    def said(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def steps(self) -> list[int]:
        text = self.metrics.read_text() if self.metrics.exists() else ""
        lines = [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]
        return [e["step"] for e in lines if e["event"] == "step"]

    def until(self, done: Callable[[], object], what: str, timeout: float = 120.0) -> float:
        """Poll until ``done()``; -> the time it was seen. The files the run writes are the synchronisation."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_elastic: no {what} within {timeout:g} s; see {self.folder}")
            time.sleep(0.01)
        return time.perf_counter()

    def begin(self, *extra: str) -> None:
        """The master, then its workers with the join secret it announced."""
        self.start("master", [*self.command, *extra])
        self.until(lambda: "tinyconv worker --connect" in self.said("master"), "the command for the workers")
        self.env[SECRET_ENV] = re.search(rf"{SECRET_ENV}=(\w+) ", self.said("master"))[1]  # and its restarts'
        for i in range(2):
            worker = [sys.executable, "-m", "tinyconv.distributed.worker", "--connect", self.address]
            self.start(f"worker{i}", [*worker, "--threads", "1", "--serve"])

    def end(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=60)


def master_fault(args: argparse.Namespace, fault: str) -> dict:
    """One run of the main job whose master is SIGKILLed (under --max-restarts 1) or SIGTERMed (then resumed)
    after step --at: the seconds from the signal to the next step done, and what the processes printed."""
    with TemporaryDirectory(prefix="bench-elastic-") as tmp:
        job = MainJob(args, Path(tmp))
        job.begin(*(["--max-restarts", "1"] if fault == "SIGKILL" else []))
        try:
            job.until(lambda: len(job.steps()) >= args.at, f"step {args.at}")
            if fault == "SIGKILL":
                first = job.said("master").splitlines()[0]  # "supervisor: training in process PID"
                t0 = time.perf_counter()
                os.kill(int(first.split()[-1]), signal.SIGKILL)
                job.until(lambda: "resumed from" in job.said("master"), "restart")
                done = job.until(lambda: len(job.steps()) > args.at or args.at == args.steps, "next step")
                code = job.procs["master"].wait(timeout=120)
            else:
                t0 = time.perf_counter()
                job.procs["master"].send_signal(signal.SIGTERM)
                stopped = job.procs["master"].wait(timeout=60)
                job.start("resumed", [*job.command, "--resume", str(job.checkpoint)])
                done = job.until(lambda: "resumed from" in job.said("resumed") and len(job.steps()) > args.at, "step")
                code = f"{stopped}, then {job.procs['resumed'].wait(timeout=120)}"
            steps = job.steps()
        finally:
            job.end()
        keep = re.compile(
            r"supervisor|stopped|checkpoint|resumed|lost|hello|serving|shutdown|waiting for|error|Traceback"
        )
        printed = [f"{name}: {line}" for name in job.procs for line in job.said(name).splitlines() if keep.search(line)]
    return {"fault": fault, "back_s": done - t0, "exit": code, "steps": steps, "printed": printed}


def report_master_faults(args: argparse.Namespace) -> None:
    runs = [master_fault(args, f) for f in ("SIGKILL", "SIGTERM")]
    print(
        f"\nthe master's faults after step {args.at}: the main job, {args.arch}, batch {args.batch_size}, "
        f"2 external workers on loopback, a checkpoint every step"
    )
    what = {"SIGKILL": "SIGKILL of training, --max-restarts 1", "SIGTERM": "SIGTERM, then --resume"}
    rows = []
    for r in runs:
        once = r["steps"] == list(range(1, args.steps + 1))
        rows.append([what[r["fault"]], f"{r['back_s']:.2f}", str(r["exit"]), "each once" if once else str(r["steps"])])
    print(format_table(["fault", "signal -> next step done, s", "exit", f"steps 1..{args.steps}"], rows))
    for r in runs:
        print(f"{what[r['fault']]}, what the terminals printed:")
        print("\n".join(f"    {line}" for line in r["printed"]))


def build_parser() -> Parser:
    head, _, rest = __doc__.partition("\n\n")
    p = Parser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    add(p, "arch", "batch_size", defaults={"arch": "32:64", "batch_size": 32})
    p.add_argument("--steps", type=count(1), default=10, metavar="N", help="steps of each run in total (default 10)")
    p.add_argument(
        "--at", type=count(1), default=5, metavar="N", help="the step before which worker 1 goes wrong (default 5)"
    )
    add(
        p,
        "peer_timeout",
        defaults={"peer_timeout": 30.0},
        helps={"peer_timeout": "the master's over zmq; a stopped worker goes after 4 heartbeats"},
    )
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.at > args.steps:
        p.error(f"--at {args.at} must be between 1 and --steps {args.steps}")
    runs = {
        "zmq": [run(args, "zmq", f) for f in (None, *SIGNALS)],
        "inproc": [run(args, "inproc", f) for f in (None, *FAULTS)],
    }
    rows = []
    for ref, *hurt in runs.values():
        median = statistics.median(ref["times"])
        for r in (ref, *hurt):
            slowest = max(r["times"][r["at"] - 1 :])
            diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"], strict=True))
            lost = r["lost"][0] if r["lost"] else {}
            rows.append(
                [
                    r["transport"],
                    r["fault"],
                    f"{statistics.median(r['times']):.3f}",
                    f"{slowest:.3f}",
                    f"{slowest - median:.3f}",
                    "-" if r["detected_s"] is None else f"{r['detected_s']:.3f}",
                    f"{lost.get('reason', '-'):.70}",
                    f"{diff:.1e}",
                    f"{r['losses'][-1]:.6f}",
                ]
            )
    print(
        f"{args.arch}, batch {args.batch_size}, master + 2 workers, {args.steps} steps, worker 1 wrong from step "
        f"{args.at} (or 1), --peer-timeout {args.peer_timeout:g} s (zmq); stall: the slowest from then past the clean "
        "median"
    )
    headers = ["transport", "fault", "median step s", "slowest s from --at", "stall s", "lost after s", "reason"]
    headers += ["max rel loss diff", "last loss"]
    print(format_table(headers, rows))
    for r in (r for rs in runs.values() for r in rs[1:]):
        print(f"{r['transport']} {r['fault']}: events {[(e['worker'], e['step'], e['reason']) for e in r['lost']]}")
    report_master_faults(args)


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_elastic: error: {e}", file=sys.stderr)
        sys.exit(2)

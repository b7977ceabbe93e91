#!/usr/bin/env python3
"""Run a master and its workers across a throttled link: two network namespaces, a veth pair, tc.

    sudo .venv/bin/python benchmarks/throttled_link.py --rate 5MB/s --check         # what the link carries
    sudo .venv/bin/python benchmarks/throttled_link.py --rate 5MB/s --check-worker  # one step across it
    sudo .venv/bin/python benchmarks/throttled_link.py --rate 5MB/s [--delay-ms 2] -- \\
        .venv/bin/tinyconv experiment grid --arch 300:1000 --batch-size 64 --split kernels ...
    sudo .venv/bin/python benchmarks/throttled_link.py --rate 5MB/s -- grid --arch 300:1000 \\
        --batch-size 64 --fuse off --split kernels --rebalance off --wire-precision fp32 bf16 --out runs/link5.csv
    sudo .venv/bin/python benchmarks/throttled_link.py --rate 250kB/s --external 1 -- .venv/bin/python \
        examples/cifar10_dist.py --transport zmq --external-workers --workers 1 --insecure --arch 16:32 \
        --batch-size 128 --split kernels --steps 4 --metrics-out runs/slow.jsonl   # the main job across it
    sudo .venv/bin/python benchmarks/throttled_link.py --teardown                   # leftovers of a killed run

The paper's devices talked over 5 MB/s Wi-Fi; loopback carries gigabytes a second. This makes a
link of a chosen rate on one Linux machine:

* namespaces ``tinyconv-m`` (the master, 10.77.0.1/24) and ``tinyconv-w`` (the workers,
  10.77.0.2/24), each with its loopback up, joined by a veth pair created inside them;
* on each veth end (so each direction) ``tc qdisc ... root tbf rate R burst B latency 50ms``: a
  token bucket, R in bits/s (``--rate`` takes 5MB/s = 5*10^6 bytes/s, or 40mbit), a burst of
  max(64 KB, R / 50 s) -- the bytes that may pass at full speed after a pause -- and up to 50 ms
  of queue. With ``--delay-ms`` it first tries ``netem delay`` as the root with the tbf beneath
  it; where the kernel has no netem ("Specified qdisc kind is unknown", as on the development
  VM) it says so and shapes the rate alone;
* ``COMMAND`` runs inside ``tinyconv-m`` with ``--bind tcp://10.77.0.1:PORT --worker-prefix "ip
  netns exec tinyconv-w" --link-label LABEL`` appended, the options ``tinyconv experiment grid``
  takes: it starts its local workers behind that prefix, in the other namespace, so every task
  and result crosses the shaped veth. A COMMAND that starts with the word ``grid`` is short for
  this Python's ``tinyconv experiment grid`` (:func:`expand`), every grid option after it: the
  ``--rebalance`` and ``--wire-precision`` axes among them. ``--rebalance off`` measures a slow
  link's steady state with the calibrated split: with the rebalancer on, 300:1000 at 5 MB/s
  moves every kernel to the master while the steps are timed, and the rows mix that move with
  its probes;
* on exit -- the command's end, an error, Ctrl-C or SIGTERM -- both namespaces are deleted,
  which deletes the veth pair and its qdiscs.

All traffic stays between the two namespaces. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and
iproute2's ``ip`` and ``tc``; without them it says so and exits 1. Note: a process in a network
namespace keeps the machine's host name, so a master sees these workers as local (``--split
auto`` splits conv2 by input channels, which moves about twice the bytes; pass ``--split`` to
choose), and 10.77.0.1 is not loopback, so a master binding it needs CURVE keys or
``--insecure`` -- nothing outside the two namespaces can reach it. (The grid's local workers get
a fresh key pair of their own: the grid needs neither.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyconv.lab.simulate.link_model import parse_rate  # noqa: E402
from tinyconv.options import NON_NEGATIVE, POSITIVE, Parser, UsageError, count  # noqa: E402

MASTER_IP, WORKER_IP = "10.77.0.1", "10.77.0.2"


@dataclass(frozen=True)
class Names:
    """The two namespaces and their veth ends; ``suffix`` keeps parallel runs (tests) apart."""

    suffix: str = ""

    @property
    def master(self) -> str:
        return f"tinyconv-m{self.suffix}"

    @property
    def worker(self) -> str:
        return f"tinyconv-w{self.suffix}"

    veth_master, veth_worker = "veth-m", "veth-w"  # created inside the namespaces: no clash between runs


def in_namespace(ns: str, cmd: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


GRID = [sys.executable, "-m", "tinyconv.cli", "experiment", "grid"]  # what a COMMAND's leading "grid" stands for


def expand(cmd: Sequence[str]) -> list[str]:
    """``grid ARGS`` -> this Python's ``tinyconv experiment grid ARGS``; any other command as it is."""
    return [*GRID, *cmd[1:]] if cmd and cmd[0] == "grid" else list(cmd)


def appended(cmd: Sequence[str], names: Names, port: int, label: str) -> list[str]:
    """``cmd`` run in the master's namespace, with the options that put its workers across the link."""
    extra = ["--bind", f"tcp://{MASTER_IP}:{port}", "--worker-prefix", f"ip netns exec {names.worker}"]
    return in_namespace(names.master, [*cmd, *extra, "--link-label", label])


def with_workers(cmd: Sequence[str], names: Names, port: int) -> tuple[list[str], list[str]]:
    """(``cmd`` in the master's namespace with only ``--bind`` appended, a ``tinyconv worker`` across the link to
    it): for a master that waits for external workers, such as the main job with ``--external-workers``."""
    address = f"tcp://{MASTER_IP}:{port}"
    worker = [sys.executable, "-m", "tinyconv.cli", "worker", "--connect", address, "--retry-for", "60"]
    return in_namespace(names.master, [*cmd, "--bind", address]), in_namespace(names.worker, worker)


def run_with_workers(cmd: Sequence[str], names: Names, port: int, n: int) -> int:
    """The master ``cmd`` and ``n`` workers across the link; the workers end with its "train over" (or are
    stopped 30 s after it, as the pool stops its own)."""
    from tinyconv.distributed.pool import stop_workers  # here: the other modes need no tinyconv

    master, worker = with_workers(cmd, names, port)
    workers = [subprocess.Popen(worker) for _ in range(n)]
    try:
        return run_command(master)
    finally:
        stop_workers(workers, timeout=30)


def tbf(rate_bytes: float) -> list[str]:
    """tbf's arguments for ``rate_bytes`` bytes/s: the rate in bits/s, a burst of at least 64 KB."""
    burst = max(64_000, int(rate_bytes / 50))
    return ["tbf", "rate", f"{int(rate_bytes * 8)}bit", "burst", str(burst), "latency", "50ms"]


def unavailable() -> str | None:
    """Why this machine cannot make the link, or None."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (ip netns and tc need CAP_SYS_ADMIN and CAP_NET_ADMIN): run it with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"needs iproute2's {' and '.join(missing)}" if missing else None


def run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def setup(names: Names, rate_bytes: float, delay_ms: float = 0.0) -> list[str]:
    """Make the namespaces, the veth pair and the shaping; returns notes (netem missing). On a
    failure, removes what it made and raises RuntimeError with ip's or tc's message."""
    notes: list[str] = []
    try:
        for ns in (names.master, names.worker):
            run(["ip", "netns", "add", ns])
        pair = ["type", "veth", "peer", "name", names.veth_worker, "netns", names.worker]
        run(["ip", "link", "add", names.veth_master, "netns", names.master, *pair])
        for ns, dev, ip in ((names.master, names.veth_master, MASTER_IP), (names.worker, names.veth_worker, WORKER_IP)):
            run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev])
            run(["ip", "-n", ns, "link", "set", dev, "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            notes += shape(ns, dev, rate_bytes, delay_ms)
    except subprocess.CalledProcessError as e:
        teardown(names)
        raise RuntimeError(f"{' '.join(e.cmd)}: {(e.stderr or '').strip() or e}") from None
    return sorted(set(notes))


def shape(ns: str, dev: str, rate_bytes: float, delay_ms: float) -> list[str]:
    """Limit what ``dev`` sends to ``rate_bytes`` bytes/s, after ``delay_ms`` of netem delay where the
    kernel has netem; returns a note when it has not."""
    tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
    if delay_ms > 0:
        got = run([*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms"], check=False)
        if got.returncode == 0:
            run([*tc, "parent", "1:", "handle", "2:", *tbf(rate_bytes)])
            return []
        note = f"no netem here ({got.stderr.strip()}): the link has its rate but no added delay"
        run([*tc, "root", *tbf(rate_bytes)])
        return [note]
    run([*tc, "root", *tbf(rate_bytes)])
    return []


def teardown(names: Names) -> None:
    """Delete both namespaces (and with them the veth pair and its qdiscs); absent ones are fine."""
    for ns in (names.master, names.worker):
        run(["ip", "netns", "del", ns], check=False)


def exists(names: Names) -> list[str]:
    listed = run(["ip", "netns", "list"], check=False).stdout.split()
    return [ns for ns in (names.master, names.worker) if ns in listed]


# The two ends of --check's transfer, run with `python -c` in each namespace: the receiver prints
# "ready" once it listens (the sender starts only then), and "BYTES SECONDS" from its first byte
# to the end; the first read (up to the burst) is not counted, since it came at full speed.
RECEIVER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
c, _ = s.accept()
first = c.recv(1 << 20)
t, n = time.perf_counter(), 0
while chunk := c.recv(1 << 20):
    n += len(chunk)
print(n, time.perf_counter() - t, flush=True)
"""
SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as c:
    c.sendall(bytes(int(sys.argv[3])))
"""


def measure(names: Names, nbytes: int, port: int = 5599) -> float:
    """Bytes per second a TCP transfer of ``nbytes`` from the workers' namespace to the master's gets."""
    py = sys.executable
    receiver = subprocess.Popen(
        in_namespace(names.master, [py, "-c", RECEIVER, MASTER_IP, str(port)]), stdout=subprocess.PIPE, text=True
    )
    try:
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError("the receiver in the master's namespace did not start")
        subprocess.run(
            in_namespace(names.worker, [py, "-c", SENDER, MASTER_IP, str(port), str(nbytes)]), check=True, timeout=120
        )
        got, seconds = receiver.communicate(timeout=120)[0].split()
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return int(got) / float(seconds)


class Terminated(KeyboardInterrupt):
    """A SIGTERM: it ends a run through its teardown, as Ctrl-C does."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def run_command(cmd: list[str]) -> int:
    """Run ``cmd`` (already prefixed for the namespace) and return its status; on Ctrl-C or SIGTERM
    let it stop first (at most 30 s), then raise on, to the teardown."""
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt as e:  # a Ctrl-C reached it too (same process group); a SIGTERM did not
        if isinstance(e, Terminated):
            proc.terminate()
        try:  # give it time to stop its workers
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def check_worker(names: Names) -> int:
    """One training step of a tiny network, the master in its namespace, a real worker in the other."""
    prefix = f"ip netns exec {names.worker}"
    return run_command(in_namespace(names.master, [sys.executable, __file__, "--step-across", prefix]))


def step_across(worker_prefix: str, arch: str = "4:8", batch: int = 4) -> int:
    """(Run in the master's namespace.) Bind 10.77.0.1, start ``tinyconv worker`` behind
    ``worker_prefix``, run one distributed training step and print what crossed the link."""
    import shlex
    import time

    import numpy as np

    from tinyconv.distributed.pool import stop_workers
    from tinyconv.distributed.protocol import VERSION
    from tinyconv.distributed.shard.cluster import Cluster
    from tinyconv.model import paper_net
    from transports.zmq_master import ZmqTransport

    # 10.77.0.1 is not loopback, so it needs keys or insecure: only the two namespaces can reach it
    transport = ZmqTransport(bind=f"tcp://{MASTER_IP}:0", peer_timeout_s=30.0, protocol=VERSION, insecure=True)
    worker = [sys.executable, "-m", "tinyconv.distributed.worker", "--connect", transport.bound_address]
    worker += ["--threads", "1", "--no-progress", "--peer-timeout", "30"]
    proc = subprocess.Popen([*shlex.split(worker_prefix), *worker], cwd=ROOT)
    try:
        (info,) = transport.start(1, timeout=60)
        net = paper_net(arch, "numpy", seed=0)
        cluster = Cluster(transport, [info], net.backend, split="kernels", rebalance=False, recv_timeout=60)
        cluster.calibrate(net, batch)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
        t = time.perf_counter()
        net.train_step(x, rng.integers(0, 10, batch))
        seconds, step = time.perf_counter() - t, cluster.last_step
    finally:
        transport.close()
        stop_workers([proc])
    print(
        f"one step of {arch} at batch {batch}: master {transport.bound_address}, worker at "
        f"{info.address or '?'} (host {info.hostname}); {seconds:.3f} s, {step['bytes_sent'] / 1e6:.3f} MB "
        f"to the worker, {step['bytes_recv'] / 1e6:.3f} MB back, comm {step['comm_s']:.3f} s, "
        f"shares {step['shares']}"
    )
    return 0


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    options, command = argv[:cut], argv[cut + 1 :]
    p = Parser(description=__doc__.split("\n\n")[0], epilog="see the module docstring")
    p.add_argument("--rate", help="the link's rate each way: 5MB/s (10^6 bytes), 12.5MB/s, 40mbit, 1gbit")
    p.add_argument(
        "--delay-ms", type=NON_NEGATIVE, default=0.0, help="netem delay each way, where the kernel has netem"
    )
    p.add_argument("--port", type=count(1), default=5555, help="the master's port in --bind (default %(default)s)")
    p.add_argument("--label", help="--link-label for the command (default: --rate as given)")
    p.add_argument(
        "--external",
        type=count(0),
        default=0,
        metavar="N",
        help="COMMAND is a master waiting for N external workers (the main job with --external-workers "
        "--insecure): only --bind is appended, and N `tinyconv worker`s run across the link",
    )
    p.add_argument("--check", action="store_true", help="measure the shaped link's throughput and exit")
    p.add_argument("--check-mb", type=POSITIVE, default=20.0, help="MB --check sends (default %(default)s)")
    p.add_argument("--check-worker", action="store_true", help="run one tiny training step across the link")
    p.add_argument("--teardown", action="store_true", help="only remove the namespaces of an earlier run")
    p.add_argument("--suffix", default="", help=argparse.SUPPRESS)  # tests: names of their own
    p.add_argument("--step-across", metavar="PREFIX", help=argparse.SUPPRESS)  # --check-worker's master side
    args = p.parse_args(options)
    if args.step_across:
        return args, command
    if not args.teardown and not args.rate:
        p.error("--rate is required (e.g. --rate 5MB/s)")
    if not (args.teardown or args.check or args.check_worker or command):
        p.error("give a COMMAND after --, or --check, --check-worker or --teardown")
    return args, command


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, command = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"throttled_link: error: {e}", file=sys.stderr)
        return 2
    if args.step_across:
        return step_across(args.step_across)
    why = unavailable()
    if why:
        print(f"throttled_link: {why}", file=sys.stderr)
        return 1
    names = Names(args.suffix)
    if args.teardown:
        teardown(names)
        return 0
    try:
        rate = parse_rate(args.rate)
    except ValueError as e:
        print(f"throttled_link: {e}", file=sys.stderr)
        return 2
    if exists(names):
        print(
            f"throttled_link: {', '.join(exists(names))} exist: another run, or a killed one (remove with --teardown)",
            file=sys.stderr,
        )
        return 1
    signal.signal(signal.SIGTERM, _terminated)
    try:
        for note in setup(names, rate, args.delay_ms):
            print(f"throttled_link: {note}", file=sys.stderr)
        print(
            f"throttled_link: {names.master} ({MASTER_IP}) <-> {names.worker} ({WORKER_IP}), "
            f"{rate / 1e6:g} MB/s each way",
            file=sys.stderr,
        )
        if args.check:
            got = measure(names, int(args.check_mb * 1e6))
            print(
                f"measured {got / 1e6:.2f} MB/s ({got * 8 / 1e6:.1f} Mbit/s) for {args.check_mb:g} MB, "
                f"configured {rate / 1e6:g} MB/s"
            )
        code = check_worker(names) if args.check_worker else 0
        if command and args.external:
            code = run_with_workers(expand(command), names, args.port, args.external)
        elif command:
            code = run_command(appended(expand(command), names, args.port, args.label or args.rate))
        return code
    except RuntimeError as e:
        print(f"throttled_link: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("throttled_link: interrupted", file=sys.stderr)
        return 130
    finally:
        teardown(names)


if __name__ == "__main__":
    sys.exit(main())

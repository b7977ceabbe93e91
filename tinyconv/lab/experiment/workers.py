"""The grid's workers: started once, before the first cell, and serving every cell after it.

Local (the default): one ``tinyconv worker --serve`` process per worker (``--workers``), pinned
one per core the way ``benchmarks/bench_speedup.py`` pins its worker -- the master on the
first core this process may use (``sched_setaffinity``), worker i under ``taskset -c`` on the
(i+1)-th, each with one BLAS thread, over ZeroMQ on TCP. ``--worker-prefix`` goes in front of
each worker's command line and the taskset after it, so that e.g. ``ip netns exec tinyconv-w``
runs the pinned worker inside a network namespace (``benchmarks/throttled_link.py``); the
worker connects to the address the master bound (``--bind``).

Emulated devices (``--cpu-quota 0.5 0.5 0.5 0.5``): each participant, the master included, in a cgroup
of its own held to that share of one core (``cpu_quota.py``), the groups placed on the cores by
:func:`place`, so that four half-core devices fit two cores. Cores that share caches and memory
bandwidth are not separate machines, and a quota slices time, not the silicon: it emulates a slower
device's speed, not its memory or its caches.

External (``--external-workers``): the grid binds ``--bind`` (default tcp://*:5555) and waits for as
many ``tinyconv worker --serve`` processes as its largest ``--workers`` to connect, as
``tinyconv.distributed.pool`` does.
In-process (``--transport inproc``): worker threads, for tests; not for timing.

One transport serves the whole grid: each cell builds its own Cluster on it with as many of
the workers as it needs, and the others wait. Every wait for workers has a timeout.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

from tinyconv.distributed.pool import LOCAL_BIND, _handshake, _keys, _local_worker_args, stop_workers, worker_pool
from tinyconv.distributed.protocol import VERSION
from tinyconv.lab.experiment.cpu_quota import CpuQuota
from transports import get_transport
from transports.base import Transport, WorkerInfo

PEER_TIMEOUT_S = 60.0  # as bench_speedup: a busy master still heartbeats, this is for a dead one


def cores() -> list[int]:
    """The cores this process may run on, in order (all of them where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin_master() -> None:
    """The master on the first core it may use, as bench_speedup's master is on core 0."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cores()[0]})


@contextmanager
def master_pinned() -> Iterator[None]:
    """:func:`pin_master` for the duration, then the cores it had back: a grid run inside a longer
    process (a test, a notebook) must not leave it, and the processes it starts later, on one core."""
    before = cores()
    pin_master()
    try:
        yield
    finally:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, before)


def worker_command(
    connect: str, backend: str, core: int | None, prefix: Sequence[str] = (), extra: Sequence[str] = (),
    taskset: str | None = None,
) -> list[str]:  # fmt: skip
    """The command line of one local worker: ``prefix``, then ``taskset -c core`` (when there is a
    taskset and a core), then ``tinyconv worker --serve`` connecting to ``connect`` with one BLAS thread."""
    pin = [taskset, "-c", str(core)] if taskset and core is not None else []
    worker = [sys.executable, "-m", "tinyconv.distributed.worker", "--connect", connect, "--backend", backend]
    worker += ["--threads", "1", "--no-progress", "--serve"]
    return [*prefix, *pin, *worker, *extra]


def place(quotas: Sequence[float], cores: Sequence[int]) -> list[int]:
    """The core each device runs on: the one with the most time free (the first of equals: the master's
    device on the first core, where :func:`pin_master` pins it), so that 0.5 0.5 0.5 0.5 on two cores
    alternate 0 1 0 1 and a cell of two has a core each. ValueError when they need more time than that."""
    free = dict.fromkeys(cores, 1.0)
    placed = []
    for q in quotas:
        core = max(free, key=lambda c: free[c])  # max keeps the first of equals
        if free[core] < q - 1e-9:
            raise ValueError(f"devices of {' + '.join(f'{x:g}' for x in quotas)} cores do not fit {len(free)} cores")
        free[core] -= q
        placed.append(core)
    return placed


def split_prefix(text: str | None) -> list[str]:
    """--worker-prefix "ip netns exec tinyconv-w" -> its words, as a shell would split them."""
    return shlex.split(text) if text else []


@contextmanager
def grid_workers(
    n: int, transport: str = "zmq", backend: str = "numpy", *, bind: str | None = None, external: bool = False,
    prefix: Sequence[str] = (), insecure: bool = False, timeout: float = 60.0, devices: Sequence[float] = (),
) -> Iterator[tuple[Transport | None, list[WorkerInfo]]]:  # fmt: skip
    """Yield (transport, workers) for ``n`` workers (none: (None, [])), stopped at the end. With ``devices``
    (CPU quotas, the master's first), this process and each local worker run in a quota of their own."""
    if devices:
        with quota_devices(devices[: n + 1]) as (groups, placed):
            with _local_pinned(n, transport, backend, bind or LOCAL_BIND, prefix, timeout, groups, placed) as got:
                yield got
        return
    if n == 0:
        yield None, []
        return
    if transport == "inproc" or external:
        pool = worker_pool(transport, n, worker_backend=backend, bind=bind, external=external, start_timeout=timeout,
                           peer_timeout=PEER_TIMEOUT_S, insecure=insecure)  # fmt: skip
        with pool as got:
            yield got
        return
    with _local_pinned(n, transport, backend, bind or LOCAL_BIND, prefix, timeout) as got:
        yield got


@contextmanager
def quota_devices(quotas: Sequence[float]) -> Iterator[tuple[list[CpuQuota], list[int]]]:
    """A CPU quota group per device and the core each is placed on; this process (the master) in the
    first group until the end, when it goes back to its own group, every group is removed and whatever
    still ran in one is back at the root."""
    placed = place(quotas, cores())
    with ExitStack() as stack:
        groups = [stack.enter_context(CpuQuota(q, name=f"tinyconv-grid-{os.getpid()}-{i}"))
                  for i, q in enumerate(quotas)]  # fmt: skip
        stack.enter_context(groups[0].holding(os.getpid()))
        yield groups, placed


@contextmanager
def _local_pinned(
    n: int, transport: str, backend: str, bind: str, prefix: Sequence[str], timeout: float,
    groups: Sequence[CpuQuota] = (), placed: Sequence[int] = (),
) -> Iterator[tuple[Transport | None, list[WorkerInfo]]]:  # fmt: skip
    """``n`` local --serve workers, pinned one per core after the master's, on a transport bound at ``bind``;
    with quota ``groups``, worker i in groups[i + 1] on core placed[i + 1] (the master's are the first)."""
    if n == 0:
        yield None, []
        return
    stack = ExitStack()
    keys = _keys(bind, False, None, None, False, stack)  # a fresh CURVE pair if the bind leaves loopback
    pool = get_transport(transport, bind=bind, peer_timeout_s=PEER_TIMEOUT_S, protocol=VERSION,
                         curve=keys[0] if keys else None)  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        connect = pool.bound_address.replace("0.0.0.0", "127.0.0.1")
        extra = _local_worker_args(None, PEER_TIMEOUT_S, keys) + ["--start-timeout", str(timeout)]
        taskset, free = shutil.which("taskset"), list(placed[1:]) if groups else cores()[1:]
        commands = [worker_command(connect, backend, free[i] if i < len(free) else None,
                                   [*groups[i + 1].prefix(), *prefix] if groups else prefix, extra, taskset)
                    for i in range(n)]  # fmt: skip
        procs = [subprocess.Popen(c, stderr=subprocess.PIPE) for c in commands]
        yield pool, _handshake(pool, n, timeout, procs, shlex.join(commands[0]))
    finally:
        pool.close()
        stack.close()
        for p in procs:  # a --serve worker would wait for the next master: tell it the grid is over
            if p.poll() is None:
                p.terminate()
        stop_workers(procs)

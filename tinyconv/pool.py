"""The master's pool of workers: starting them, stopping them, and :func:`distribute`.

    import tinyconv as tc
    net = tc.paper_net("50:500")
    with tc.distribute(net, transport="zmq", workers=2) as cluster:   # two local worker processes
        loss = net.train_step(x, y)                                  # the convolutions run in shards
        print(cluster.last_step["shares"])

:func:`distribute` starts the workers (:func:`worker_pool`), builds the
:class:`~tinyconv.shard.cluster.Cluster`, times every participant and splits each layer by
the paper's eq. 1, and puts a ShardedBlock in the network for each convolution. Closing the
cluster puts the network's own layers back and stops the workers.

:func:`worker_pool` is a context manager, so the workers go away whatever happens (a
finished run, an exception, Ctrl-C): the transport tells every worker the training is
over, and local worker processes are waited for, then terminated, then killed. No
orphans, no ports left bound.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from tinyconv.model import Network
from tinyconv.plugins import get_backend, get_transport
from tinyconv.shard.cluster import Cluster
from tinyconv.shard.protocol import VERSION
from tinyconv.worker.handler import Worker
from transports.base import Transport, WorkerInfo
from transports.zmq_master import connect_hint

DEFAULT_PUBLIC_BIND = "tcp://*:5555"
LOCAL_BIND = "tcp://127.0.0.1:0"  # a free port on loopback, for workers this process starts


def distribute(
    net: Network,
    transport: str = "inproc",
    workers: int = 2,
    *,
    worker_backend: str | None = None,
    worker_device: str | None = None,
    bind: str | None = None,
    external: bool = False,
    worker_threads: int | None = None,
    start_timeout: float = 60.0,
    batch_size: int = 64,
    image_size: int = 32,
    calibrate: bool = True,
    announce: Callable[[str], None] = print,
    **options: Any,
) -> Cluster:
    """Start ``workers`` workers over ``transport`` ("inproc" threads, or "zmq" processes -- with
    ``external``, on other machines) and shard ``net``'s convolutions across them and the master.

    ``worker_backend`` defaults to the master's. ``calibrate``: time everyone on ``batch_size``
    images of ``image_size`` pixels and split by eq. 1; otherwise start from an equal split.
    ``options`` go to :class:`Cluster` (master_share, split, fuse, rebalance, rebalancer,
    recv_timeout). Returns the cluster; ``close()`` it, or use it in a ``with`` block.
    """
    stack = ExitStack()
    try:
        pool, infos = stack.enter_context(
            worker_pool(
                transport,
                workers,
                worker_backend=worker_backend or net.backend.name,
                worker_device=worker_device,
                bind=bind,
                external=external,
                worker_threads=worker_threads,
                start_timeout=start_timeout,
                announce=announce,
            )
        )
        cluster = Cluster(pool, infos, net.backend, **options)
        cluster.on_close = stack.close
        if calibrate:
            cluster.calibrate(net, batch_size, image_size)
        else:
            cluster.attach(net)
    except BaseException:
        stack.close()
        raise
    return cluster


@contextmanager
def worker_pool(
    transport: str,
    n_workers: int,
    worker_backend: str = "numpy",
    worker_device: str | None = None,
    bind: str | None = None,
    external: bool = False,
    worker_threads: int | None = None,
    start_timeout: float = 60.0,
    peer_timeout: float = 30.0,
    announce: Callable[[str], None] = print,
) -> Iterator[tuple[Transport, list[WorkerInfo]]]:
    """Yield (transport, the workers' hellos) for ``n_workers`` >= 1 workers.

    transport "inproc": ``n_workers`` threads, each with its own ``worker_backend``.
    Any other (zmq, or one registered by another package): the master binds ``bind``
    (default: a free loopback port for local workers, ``tcp://*:5555`` with ``external``);
    without ``external`` it starts ``n_workers`` worker processes here, with ``external`` it
    announces the command to run on the other machines and waits for them.
    """
    if n_workers < 1:
        raise ValueError(f"a pool needs at least one worker, got {n_workers}")
    device = {"device": worker_device} if worker_device else {}
    if transport == "inproc":
        if external:
            raise ValueError("--external-workers needs --transport zmq: in-process workers are threads here")
        factory = lambda i: Worker(get_backend(worker_backend, **device))  # noqa: E731
        pool = get_transport("inproc", handler_factory=factory, protocol=VERSION)
    else:
        address = bind or (DEFAULT_PUBLIC_BIND if external else LOCAL_BIND)
        pool = get_transport(transport, bind=address, peer_timeout_s=peer_timeout, protocol=VERSION)
    procs: list[subprocess.Popen] = []
    command = ""  # how a worker joins this master, for the messages
    try:
        if transport != "inproc":
            command = f"tinyconv worker --connect {connect_hint(pool.bound_address)} --backend {worker_backend}"
        if external:
            announce(f"waiting for {n_workers} worker(s); on each worker machine run:\n    {command}")
        elif transport != "inproc":
            extra = (["--device", worker_device] if worker_device else []) + ["--timeout", str(peer_timeout)]
            connect = pool.bound_address.replace("0.0.0.0", "127.0.0.1")
            procs = spawn_local_workers(n_workers, connect, worker_backend, extra, worker_threads)
        yield pool, _handshake(pool, n_workers, start_timeout, procs, command)
    finally:
        pool.close()
        if procs:
            codes = stop_workers(procs)
            if any(c not in (0, None) for c in codes):
                print(f"note: local workers exited with codes {codes}", file=sys.stderr)


def _handshake(
    pool: Transport, n: int, timeout: float, procs: list[subprocess.Popen], command: str
) -> list[WorkerInfo]:
    """Every worker's hello; a timeout says why, if a local worker died, or how a worker joins."""
    try:
        return pool.start(n, timeout=timeout)
    except TimeoutError as e:
        dead = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
        if dead:  # say why, rather than only that they were not heard from
            codes = ", ".join(f"process {i} exited with code {code}" for i, code in dead)
            raise TimeoutError(f"{e}; local workers died before saying hello ({codes}; see their message above)") from e
        raise TimeoutError(f"{e}; a worker joins with: {command}" if command else str(e)) from e


def spawn_local_workers(
    n: int,
    connect: str,
    backend: str = "numpy",
    extra_args: Sequence[str] = (),
    threads: int | None = None,
    quiet: bool = True,
) -> list[subprocess.Popen]:
    """Start ``n`` worker processes on this machine that connect to ``connect``.

    They stay in this process's group, so a Ctrl-C reaches them too; and each exits on
    its own within its ``--timeout`` if this process dies. Stop them with
    :func:`stop_workers` after closing the transport.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    cmd = [sys.executable, "-m", "tinyconv.worker", "--connect", connect, "--backend", backend]
    if threads:
        cmd += ["--threads", str(threads)]
    if quiet:
        cmd.append("--quiet")
    cmd += list(extra_args)
    return [subprocess.Popen(cmd) for _ in range(n)]


def stop_workers(procs: Sequence[subprocess.Popen], timeout: float = 5.0) -> list[int]:
    """Wait up to ``timeout`` s for the workers to exit, then terminate, then kill. Returns exit codes."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]

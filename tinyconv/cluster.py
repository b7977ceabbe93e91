"""A pool of workers for one run: start the transport, the local workers, the handshake; stop them all.

``worker_pool`` is a context manager, so the workers go away whatever happens
(a finished run, an exception, Ctrl-C): the transport tells every worker the
training is over, and local worker processes are waited for, then terminated,
then killed. No orphans, no ports left bound.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tinyconv.plugins import get_backend, get_transport
from tinyconv.worker import ConvWorker, spawn_local_workers, stop_workers
from transports.base import Transport, WorkerInfo

DEFAULT_PUBLIC_BIND = "tcp://*:5555"
LOCAL_BIND = "tcp://127.0.0.1:0"  # a free port on loopback, for workers this process starts


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
    announce: Any = print,
) -> Iterator[tuple[Transport | None, list[WorkerInfo]]]:
    """Yield (transport, workers' hello info); (None, []) when ``n_workers`` is 0.

    transport "inproc": ``n_workers`` threads, each with its own ``worker_backend``.
    transport "zmq": the master binds ``bind`` (default: a free loopback port for
    local workers, ``tcp://*:5555`` with ``external``); without ``external`` it
    starts ``n_workers`` worker processes here, with ``external`` it prints the
    command to run on the other machines and waits for them.
    """
    if n_workers < 0:
        raise ValueError(f"--workers must be >= 0, got {n_workers}")
    if n_workers == 0:
        yield None, []
        return
    device_opts = {"device": worker_device} if worker_device else {}
    if transport == "inproc":
        if external:
            raise ValueError("--external-workers needs --transport zmq: in-process workers are threads here")
        pool = get_transport("inproc", handler_factory=lambda i: ConvWorker(get_backend(worker_backend, **device_opts)))
    else:
        address = bind or (DEFAULT_PUBLIC_BIND if external else LOCAL_BIND)
        pool = get_transport(transport, bind=address, peer_timeout_s=peer_timeout)
    procs = []
    try:
        if transport != "inproc":
            connect = pool.bound_address.replace("0.0.0.0", "127.0.0.1")
            extra = ["--device", worker_device] if worker_device else []
            extra += ["--timeout", str(peer_timeout)]
            if external:
                from transports.zmq_transport import connect_hint

                cmd = f"tinyconv worker --connect {connect_hint(pool.bound_address)} --backend {worker_backend}"
                announce(f"waiting for {n_workers} worker(s); on each worker machine run:\n    {cmd}")
            else:
                procs = spawn_local_workers(n_workers, connect, worker_backend, extra, threads=worker_threads)
        try:
            infos = pool.start(n_workers, timeout=start_timeout)
        except TimeoutError as e:
            dead = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
            if dead:  # say why, rather than only that they were not heard from
                codes = ", ".join(f"process {i} exited with code {code}" for i, code in dead)
                raise TimeoutError(
                    f"{e}; local workers died before saying hello ({codes}; see their message above)"
                ) from e
            raise
        yield pool, infos
    finally:
        pool.close()
        if procs:
            codes = stop_workers(procs)
            bad = [c for c in codes if c not in (0, None)]
            if bad:
                print(f"note: local workers exited with codes {codes}", file=sys.stderr)

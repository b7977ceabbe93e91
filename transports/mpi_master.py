"""MPI, the master's side: rank 0 of an ``mpiexec`` job, whose ranks 1.. are its workers (a closed group:
worker ``k`` is rank ``k + 1``). What maps to what, and why: docs/writing-a-transport.md, "A second worked
example: MPI". The session's one I/O thread makes every MPI call, polling every :data:`~transports.mpi_link.POLL_S`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any

from transports import wire
from transports.base import WorkerInfo
from transports.mpi_link import POLL_S, MpiChannel, require_mpi
from transports.session.link import Arrival
from transports.session.link import Link as SessionLink
from transports.session.master import SessionTransport
from transports.session.settings import check_options

log = logging.getLogger(__name__)

MASTER = 0  # the master's rank
SHUTDOWN_LINGER_S = 5.0  # at close, how long the workers may take to say bye (they do within a poll or two)


class MpiLink(SessionLink):
    """Ranks 1.. of ``comm``, a closed group; a peer is a rank, and worker ``k`` is rank ``k + 1``."""

    def __init__(self, comm: Any, max_bytes: int) -> None:
        self.group = list(range(1, comm.Get_size()))
        self.link = MpiChannel(comm, self.group, max_bytes)
        self.kick = threading.Event()
        self._gone: set[int] = set()  # ranks already reported gone

    def wait(self, timeout: float) -> None:
        self.kick.wait(min(timeout, POLL_S))  # woken at once by send() and close(); else the next poll is due
        self.kick.clear()

    def wake(self) -> None:
        self.kick.set()

    def receive(self) -> list[Arrival]:
        out = self.link.poll()
        gone = {rank: "its process ended the session (it said bye)" for rank in self.link.said_bye}
        gone |= {rank: f"its messages cannot be read: {why}" for rank, why in self.link.broken.items()}
        for rank in sorted(gone.keys() - self._gone):
            out.append(Arrival(rank, address=f"MPI rank {rank}", gone=gone[rank]))
            self._gone.add(rank)
            self.link.send(rank, [])  # a bye: it exits (one that said bye waits for this one)
        return out

    def send(self, peer: Hashable, frames: list, *, control: bool = False) -> str:
        if peer in self.link.bye_sent:
            return "this rank's session with it is over"
        self.link.send(peer, frames)
        return ""

    def let_go(self, peer: Hashable) -> None:
        self.link.send(peer, [])  # a bye: it exits

    def close(self, graceful: bool) -> None:
        """Bye to every rank, and what they still send read and dropped until each said bye: with nothing
        left in flight, MPI can finalise when this process exits."""
        missing = self.link.finish(self.group, SHUTDOWN_LINGER_S)
        if missing:
            log.warning("MPI rank(s) %s did not say bye within %.0f s; MPI may complain as this process exits",
                        ", ".join(map(str, missing)), SHUTDOWN_LINGER_S)  # fmt: skip


class MpiTransport(SessionTransport):
    """Master side, on rank 0 of ``comm`` (default ``MPI.COMM_WORLD``); ranks 1.. are workers 0...
    The options are the session's (:class:`~transports.session.master.SessionTransport`)."""

    name = "mpi"

    def __init__(self, *, comm: Any = None, **options: Any) -> None:
        check_options(**options)
        comm = require_mpi().COMM_WORLD if comm is None else comm
        rank, self.size = comm.Get_rank(), comm.Get_size()
        if rank != MASTER:
            raise RuntimeError(
                f"MpiTransport is the master's, on rank {MASTER}; this is rank {rank}, which should serve as a "
                "worker (transports.mpi_worker.serve_if_worker)"
            )
        if self.size < 2:
            raise RuntimeError(
                "this MPI job has one rank, the master, and no workers: launch it with mpiexec -n N "
                "(rank 0 the master, ranks 1..N-1 the workers), e.g. mpiexec -n 3 for 2 workers"
            )
        self.bound_address = f"mpi://ranks 1..{self.size - 1}"  # where the workers are; nothing to connect to
        super().__init__(MpiLink(comm, int(options.get("max_message_bytes", wire.DEFAULT_MAX_BYTES))), **options)

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        """Wait until every other rank said hello (``n_workers`` must be ``size - 1``); return them, by index."""
        if isinstance(n_workers, int) and n_workers >= 1 and n_workers != self.size - 1:
            raise ValueError(
                f"{n_workers} worker(s) asked for, but mpiexec started {self.size} ranks: rank 0 the master and "
                f"{self.size - 1} worker(s); launch with mpiexec -n {n_workers + 1}, or ask for {self.size - 1}"
            )
        return super().start(n_workers, timeout)

    def missing(self, live: list[WorkerInfo], n_workers: int, timeout: float) -> str:
        silent = sorted(set(range(1, self.size)) - {w.index + 1 for w in live})
        return (
            f"only {len(live)} of {n_workers} MPI ranks said hello within {timeout:g} s; still silent: "
            f"rank(s) {', '.join(map(str, silent))}. Each rank must run the same program, whose "
            "ranks > 0 call transports.mpi_worker.serve_if_worker before anything slow"
        )

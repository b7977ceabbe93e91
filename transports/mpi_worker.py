"""MPI, the worker's side: ranks 1.. of an ``mpiexec`` job serve rank 0, the master.

Every rank runs the same script, which calls :func:`serve_if_worker` early: it serves on ranks 1.. and
returns their exit code, and returns None on rank 0 (docs/writing-a-transport.md, "A second worked example:
MPI"). The ranks are fixed when the job starts, so a master silent beyond its patience, or one that
refuses the worker, ends it.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from typing import Any

from transports import wire
from transports.base import Handler, Message
from transports.mpi_link import POLL_S, MpiChannel, require_mpi
from transports.mpi_master import MASTER, SHUTDOWN_LINGER_S
from transports.session.link import WorkerLink
from transports.session.settings import EXIT_FAILED, EXIT_INTERRUPTED, MASTER_LOST, Settings, to_stderr
from transports.session.welcome import serve_master
from transports.session.worker import Compute
from transports.wakeup import Wakeup


def rank_and_size(comm: Any = None) -> tuple[int, int]:
    """(this process's rank, the number of ranks) in ``comm`` (default COMM_WORLD); MpiUnavailable without MPI."""
    comm = require_mpi().COMM_WORLD if comm is None else comm
    return comm.Get_rank(), comm.Get_size()


def serve_if_worker(
    make_handler: Callable[[], Handler],
    comm: Any = None,
    *,
    heartbeat_s: float = 0.4,
    peer_timeout_s: float = 30.0,
    welcome_timeout_s: float = 600.0,
    max_message_bytes: int = wire.DEFAULT_MAX_BYTES,
    log_line: Callable[[str], None] = to_stderr,
    quiet: bool = False,
) -> int | None:
    """On rank 0 of ``comm`` (default COMM_WORLD): None (this process is the master). On any other rank: serve
    ``make_handler()`` to rank 0 until it says shutdown, and return an exit code.

    Waits up to ``welcome_timeout_s`` for the welcome (the master may load its data first: the default
    is generous). Returns EXIT_OK on shutdown (also one before the welcome); EXIT_FAILED when refused,
    never welcomed, the master was silent beyond its patience, or the handler cannot be built (the
    master is told why, and its ``start`` raises with this rank's message); EXIT_INTERRUPTED on Ctrl-C.
    Problems go to ``log_line``, one line each, prefixed with the rank; ``quiet`` drops the rest.
    """
    comm = require_mpi().COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    if rank == MASTER:
        return None

    def say(line: str) -> None:
        log_line(f"MPI rank {rank}: {line}")

    channel = MpiChannel(comm, [MASTER], max_message_bytes)
    try:
        handler = make_handler()
    except Exception as e:  # unknown backend, missing driver, no such device: tell the master, in one line
        say(f"cannot start: {type(e).__name__}: {e}")
        channel.send(MASTER, wire.encode(Message("error", {"message": f"{type(e).__name__}: {e}"})))
        channel.finish([MASTER], SHUTDOWN_LINGER_S)  # the master answers with its bye
        return EXIT_FAILED
    info = (lambda line: None) if quiet else say
    settings = Settings(
        heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s, max_bytes=max_message_bytes, say=say, info=info
    )
    giving_up = (
        f"no welcome from the master (rank {MASTER}) within {welcome_timeout_s:g} s; is rank 0 running the "
        "same program, with the mpi transport?"
    )
    compute = Compute(handler)
    link = MpiWorkerLink(channel, compute.wakeup)
    try:
        deadline = time.monotonic() + welcome_timeout_s
        code = serve_master(link, compute, settings, master="the master", deadline=deadline, giving_up=giving_up)
        if code == MASTER_LOST:
            say("the master went away; worker exiting")
        return EXIT_FAILED if code == MASTER_LOST else code
    except KeyboardInterrupt:
        say("interrupted; worker stopping")
        return EXIT_INTERRUPTED
    finally:
        compute.stop()
        # the closing handshake: MPI cannot finalise while a message sent to this rank is unread
        if channel.finish([MASTER], SHUTDOWN_LINGER_S):
            say(f"the master did not say bye within {SHUTDOWN_LINGER_S:g} s; MPI may complain as this rank exits")


class MpiWorkerLink(WorkerLink):
    """The link to rank 0, polled every POLL_S (MPI cannot wake a thread) or when the compute thread wakes."""

    def __init__(self, link: MpiChannel, wakeup: Wakeup) -> None:
        self.link, self.wakeup = link, wakeup

    def wait(self, timeout: float) -> None:
        if select.select([self.wakeup.fileno()], [], [], min(timeout, POLL_S))[0]:
            self.wakeup.drain()

    def receive(self) -> list[list | None]:
        out: list[list | None] = [got.frames for got in self.link.poll()]
        if MASTER in self.link.broken:
            self.gone = f"cannot read the master any more: {self.link.broken[MASTER]}"
        elif MASTER in self.link.said_bye:
            self.gone = "the master ended the session without a shutdown; worker exiting"
        return out

    def send(self, frames: list, *, control: bool = False) -> bool:
        self.link.send(MASTER, frames)
        return True

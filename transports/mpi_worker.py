"""MPI, the worker's side: ranks 1.. of an ``mpiexec`` job serve rank 0, the master.

``mpiexec -n 3 python examples/cifar10_dist.py --transport mpi`` runs the same script on
three ranks. The script calls :func:`serve_if_worker` early, once it knows its options:

    code = serve_if_worker(lambda: Worker(get_backend("numpy")))
    if code is not None:      # ranks 1..: they served the master, and are done
        return code
    ...                       # rank 0: the master, with transport "mpi" (transports.mpi_master)

:func:`serve` is the worker loop, the same session as ZeroMQ's
(:mod:`transports.zmq_worker`): ``hello`` (``handler.hello()``) to rank 0, wait for its
``welcome``, then serve tasks until ``shutdown``; heartbeats when quiet. The compute thread
is ZeroMQ's :class:`transports.worker_loop.Compute`: the handler's calls run there, one at a
time, so this thread keeps polling MPI and heartbeating while a long task computes.

There is no second master to look for: the ranks of an MPI job are fixed when it starts.
A master silent for ``peer_timeout_s`` ends the worker (EXIT_FAILED), and so does a master
that refuses it (another task-protocol version). A master that dies takes the whole job
with it (``mpiexec`` ends every rank).
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from transports import wire
from transports.base import Handler, Message
from transports.mpi_link import POLL_S, Link, require_mpi
from transports.mpi_master import MASTER, SHUTDOWN_LINGER_S
from transports.wakeup import Wakeup
from transports.worker_loop import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, Compute, Hello

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "rank_and_size", "serve", "serve_if_worker"]

_SESSION = 1  # Compute tags each call with a session; an MPI worker serves one master


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def rank_and_size(comm: Any = None) -> tuple[int, int]:
    """(this process's rank, the number of ranks) in ``comm`` (default COMM_WORLD); MpiUnavailable without MPI."""
    comm = require_mpi().COMM_WORLD if comm is None else comm
    return comm.Get_rank(), comm.Get_size()


def serve_if_worker(make_handler: Callable[[], Handler], comm: Any = None, **options: Any) -> int | None:
    """On rank 0: None (this process is the master). On any other rank: serve ``make_handler()`` to
    rank 0 until it says shutdown, and return the exit code (:func:`serve`'s ``options``).

    A handler that cannot be built (no such device, say) is reported to the master, whose
    ``start`` then raises with this rank's message, and the rank exits with EXIT_FAILED.
    """
    comm = require_mpi().COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    if rank == MASTER:
        return None
    log_line = options.get("log_line", _stderr)
    try:
        handler = make_handler()
    except Exception as e:  # unknown backend, missing driver, no such device: tell the master, in one line
        why = f"{type(e).__name__}: {e}"
        log_line(f"MPI rank {rank}: cannot start: {why}")
        _tell_master(comm, Message("error", {"message": why}), options.get("max_message_bytes"))
        return EXIT_FAILED
    return serve(handler, comm, **options)


def _tell_master(comm: Any, msg: Message, max_bytes: int | None) -> None:
    """Send one message to the master, then end the session (the master answers with its bye)."""
    link = Link(comm, [MASTER], max_bytes or wire.DEFAULT_MAX_BYTES)
    link.send(MASTER, wire.encode(msg))
    link.finish([MASTER], SHUTDOWN_LINGER_S)


def serve(
    handler: Handler,
    comm: Any = None,
    *,
    heartbeat_s: float = 1.0,
    peer_timeout_s: float = 5.0,
    welcome_timeout_s: float = 600.0,
    max_message_bytes: int = wire.DEFAULT_MAX_BYTES,
    log_line: Callable[[str], None] = _stderr,
    quiet: bool = False,
) -> int:
    """Serve ``handler`` to rank 0 of ``comm`` (default COMM_WORLD) until it says shutdown; return an exit code.

    Says hello once and waits up to ``welcome_timeout_s`` for the welcome (the master may
    load its data first: the default is generous). Then tasks in, replies out, a heartbeat
    after ``heartbeat_s`` of quiet (or sooner, if the welcome asks for a faster pace). Returns
    EXIT_OK on shutdown (also one that comes before the welcome: the master ended early);
    EXIT_FAILED when refused, never welcomed, or the master was silent for ``peer_timeout_s``;
    EXIT_INTERRUPTED on Ctrl-C. Problems are reported through ``log_line``, one line each,
    prefixed with the rank; ``quiet`` drops the informational ones.
    """
    comm = require_mpi().COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    if rank == MASTER:
        raise ValueError(f"rank {MASTER} is the master; serve() runs on the other ranks")

    def say(line: str) -> None:
        log_line(f"MPI rank {rank}: {line}")

    info: Callable[[str], None] = (lambda line: None) if quiet else say
    wakeup = Wakeup()
    compute = Compute(handler, wakeup)
    link = Link(comm, [MASTER], max_message_bytes)
    try:
        loop = _Loop(link, compute, wakeup, heartbeat_s, peer_timeout_s, say, info)
        return loop.run(welcome_timeout_s)
    except KeyboardInterrupt:
        say("interrupted; worker stopping")
        return EXIT_INTERRUPTED
    finally:
        compute.stop()
        # the closing handshake: MPI cannot finalise while a message sent to this rank is unread
        if link.finish([MASTER], SHUTDOWN_LINGER_S):
            say(f"the master did not say bye within {SHUTDOWN_LINGER_S:g} s; MPI may complain as this rank exits")
        wakeup.close()


class _Loop:
    """This thread's loop: the only code that calls MPI. Replies go out as soon as the compute thread
    has them (it wakes this thread through ``wakeup``); what the master sends is polled for."""

    def __init__(self, link: Link, compute: Compute, wakeup: Wakeup, heartbeat_s: float, peer_timeout_s: float,
                 say: Callable[[str], None], info: Callable[[str], None]) -> None:  # fmt: skip
        self.link, self.compute, self.wakeup = link, compute, wakeup
        self.heartbeat_s, self.peer_timeout_s = heartbeat_s, peer_timeout_s
        self.say, self.info = say, info
        self.heartbeat = wire.encode(Message("heartbeat"))
        self.welcomed = False
        self.last_heard = self.last_sent = time.monotonic()

    def run(self, welcome_timeout_s: float) -> int:
        self.compute.submit(_SESSION, None)  # the hello, made in the compute thread like every handler call
        deadline = time.monotonic() + welcome_timeout_s
        while True:
            self._wait()
            code = self._send_results()
            for got in self.link.poll():
                if isinstance(got.problem, wire.VersionMismatch) and not self.welcomed:
                    e = got.problem
                    mismatch = wire.VersionMismatch(e.what, e.theirs, e.ours, peer="the master", here="this worker")
                    self.say(f"cannot talk to the master: {mismatch}")
                    return EXIT_FAILED
                if got.problem is not None:
                    self.say(f"bad message from the master: {got.problem}")
                    self._send(wire.encode(wire.error_reply(None, f"bad message: {got.problem}")))
                    continue
                code = code if code is not None else self._on_message(got.message)
                self.last_heard = time.monotonic()
            if MASTER in self.link.broken:
                self.say(f"cannot read the master any more: {self.link.broken[MASTER]}")
                return EXIT_FAILED
            if MASTER in self.link.said_bye and code is None:
                self.say("the master ended the session without a shutdown; worker exiting")
                return EXIT_FAILED
            if code is not None:
                return code
            code = self._tick(deadline, welcome_timeout_s)
            if code is not None:
                return code

    def _wait(self) -> None:
        """Until the compute thread has a result, or the next poll is due."""
        if select.select([self.wakeup.fileno()], [], [], POLL_S)[0]:
            self.wakeup.drain()

    def _send(self, frames: list) -> None:
        self.link.send(MASTER, frames)
        self.last_sent = time.monotonic()

    def _send_results(self) -> int | None:
        for result in self.compute.take(_SESSION):
            if isinstance(result, Hello):
                if result.frames is None:
                    self.say(result.problem)
                    self._send(wire.encode(Message("error", {"message": result.problem})))
                    return EXIT_FAILED
                self._send(result.frames)
                continue
            try:
                frames = wire.encode(result)
            except wire.ProtocolError as e:  # call_handler checked it; a handler that changed it since: report
                frames = wire.encode(wire.error_reply(result, f"the worker produced an unsendable reply: {e}"))
            self._send(frames)
        return None

    def _on_message(self, msg: Message) -> int | None:
        """Before the welcome: wait for it (or a refusal, or shutdown). After: tasks to the compute thread."""
        if msg.kind == "shutdown":
            self.info(f"shutdown: {msg.header['reason']}")
            return EXIT_OK
        if not self.welcomed:
            if msg.kind == "welcome":
                self.welcomed = True
                self.heartbeat_s = min(self.heartbeat_s, float(msg.header["heartbeat_s"]))  # never quieter than asked
                self.peer_timeout_s = max(self.peer_timeout_s, 3 * float(msg.header["heartbeat_s"]))
                self.info(f"worker {msg.header['index']} serving the master, rank {MASTER} (pid {os.getpid()}, "
                          f"{socket.gethostname()})")  # fmt: skip
            elif msg.kind == "error":
                self.say(f"the master refused this worker: {msg.header['message']}")
                return EXIT_FAILED
            return None  # a heartbeat, or a task before the welcome (never sent): nothing to do yet
        if msg.kind not in wire.SESSION_KINDS:
            self.compute.submit(_SESSION, msg)
        elif msg.kind == "error":
            self.say(f"the master reports: {msg.header['message']}")
        elif msg.kind == "hello":
            self._send(wire.encode(wire.error_reply(msg, "a worker does not accept 'hello' messages")))
        return None  # heartbeat, or a repeated welcome: last_heard is all they change

    def _tick(self, deadline: float, welcome_timeout_s: float) -> int | None:
        now = time.monotonic()
        if not self.welcomed:
            if now >= deadline:
                self.say(f"no welcome from the master (rank {MASTER}) within {welcome_timeout_s:g} s; is rank 0 "
                         "running the same program, with the mpi transport?")  # fmt: skip
                return EXIT_FAILED
            return None
        if now - self.last_heard > self.peer_timeout_s:
            self.say(f"lost the master: nothing heard for {now - self.last_heard:.1f} s; worker exiting")
            return EXIT_FAILED
        if now - self.last_sent >= self.heartbeat_s:
            self._send(self.heartbeat)
        return None

"""MPI, the master's side: rank 0 of an ``mpiexec`` job, whose other ranks are its workers.

    mpiexec -n 3 python examples/cifar10_dist.py --transport mpi     # rank 0 the master, ranks 1, 2 workers

Every rank runs the same script; :func:`transports.mpi_worker.serve_if_worker` sends
ranks 1.. to the worker loop, and rank 0 builds this transport. What the ZeroMQ
transport does with sockets it does with MPI point-to-point messages
(:mod:`transports.mpi_link`: the wire's frames as byte buffers, never pickled):

* worker ``k`` is rank ``k + 1``: the job's size is fixed when it starts, so ``start(n)``
  needs exactly ``size - 1`` workers, and ``joined`` never has anything new;
* each worker says ``hello``; ``start`` answers ``welcome`` (``index``, ``heartbeat_s``) and
  refuses a rank of another task-protocol version by raising :class:`VersionMismatch`
  (after telling that rank why: it exits), since no other rank could take its place;
* heartbeats both ways whenever a side was quiet for ``heartbeat_s``; a worker silent for
  ``peer_timeout_s`` is lost (:class:`WorkerLost`), e.g. a rank stopped with SIGSTOP;
* ``close`` sends ``shutdown`` to every rank that was not refused, lost ones included, then
  ends with the closing handshake (:meth:`transports.mpi_link.Link.finish`): MPI cannot
  finalise while a message sent to a rank was never received.

A worker *process* that dies is another matter: MPI jobs are all or nothing, and
``mpiexec`` (MPICH's Hydra) ends every rank, this one included, when one exits abnormally
or is killed. So over MPI a dead worker ends the run rather than raising WorkerLost;
checkpoints (``--checkpoint``) are how such a run goes on.

As with ZeroMQ, one *I/O thread* makes every MPI call (MPI needs at least
``MPI_THREAD_SERIALIZED`` for that, and mpi4py asks for ``MPI_THREAD_MULTIPLE``): it
sends what :meth:`~MpiTransport.send` queued as soon as it is queued, polls for what
arrives (every :data:`~transports.mpi_link.POLL_S`: MPI cannot wake a thread), and queues
it for :meth:`~MpiTransport.recv`. It also keeps the replies moving while the caller
computes: a large message moves only while its receiver calls MPI.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from transports import wire
from transports.base import Message, Transport, WorkerInfo, WorkerLost
from transports.mpi_link import POLL_S, Link, Received, require_mpi

log = logging.getLogger(__name__)

MASTER = 0  # the master's rank
SHUTDOWN_LINGER_S = 5.0  # at close, how long the workers may take to say bye (they do within a poll or two)
_JOIN_TIMEOUT_S = SHUTDOWN_LINGER_S + 4.0

__all__ = ["MASTER", "MpiTransport"]


@dataclass
class _Book:
    """What the I/O thread and the caller's threads share; ``cond`` guards every field."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    admitting: bool = False  # start() was called
    admitted: dict[int, WorkerInfo] = field(default_factory=dict)  # worker index -> its hello
    lost: dict[int, str] = field(default_factory=dict)
    traffic: dict[int, list[int]] = field(default_factory=dict)  # worker index -> [sent, received]
    refusal: BaseException | None = None  # why start() cannot succeed: a refused or failed rank
    failure: BaseException | None = None  # the I/O thread died of this


class _MasterIO:
    """Runs in its own thread (:meth:`run`); talks to the caller through ``book``, ``inbox``
    (("message" | "malformed" | "lost" | "failed", worker index, payload)), ``outbox``
    ((worker index, frames)) and ``kick`` (set when the outbox has something, or to stop)."""

    def __init__(self, comm: Any, book: _Book, *, protocol: int, heartbeat_s: float, peer_timeout_s: float,
                 max_bytes: int) -> None:  # fmt: skip
        self.comm, self.book = comm, book
        self.protocol, self.heartbeat_s, self.peer_timeout_s = protocol, heartbeat_s, peer_timeout_s
        self.link = Link(comm, list(range(1, comm.Get_size())), max_bytes)
        self.inbox: queue.Queue[tuple[str, int | None, Any]] = queue.Queue()
        self.outbox: queue.Queue[tuple[int, list]] = queue.Queue()
        self.kick = threading.Event()
        self.stop = threading.Event()
        self._hellos: dict[int, Message] = {}  # rank -> its hello, held until start()
        self._heard: dict[int, float] = {}  # live workers only, by index: when each was last heard from
        self._said: dict[int, float] = {}  # and when last sent to
        self._gone: set[int] = set()  # ranks refused, failed, left or lost: never workers again
        self._heartbeat = wire.encode(Message("heartbeat"))

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.kick.wait(POLL_S)  # woken at once by send() and close(); else the next poll is due
                self.kick.clear()
                self._flush_outbox()
                for got in self.link.poll():
                    self._on_received(got)
                self._tick()
            self._flush_outbox()  # tasks sent just before close() still go first
            self._say_goodbye()
        except BaseException as e:  # report, never die silently: the caller's next call raises it
            log.exception("mpi I/O thread failed")
            with self.book.cond:
                self.book.failure = e
                self.book.cond.notify_all()
            self.inbox.put(("failed", None, e))
            self._finish()

    # ---- sending ----------------------------------------------------------------------
    def _flush_outbox(self) -> None:
        while True:
            try:
                k, frames = self.outbox.get_nowait()
            except queue.Empty:
                return
            self._send_to(k, frames)

    def _send_to(self, k: int, frames: list) -> None:
        if k not in self._heard:  # lost: nothing more goes to it
            return
        nbytes = self.link.send(k + 1, frames)
        self._said[k] = time.monotonic()
        with self.book.cond:
            self.book.traffic[k][0] += nbytes

    def _say_goodbye(self) -> None:
        """The paper's "train over" flag to every rank this side has not said bye to yet, welcomed or not,
        lost or not (the job ends when every rank has: a lost rank that comes back exits at once); then
        the closing handshake."""
        frames = wire.encode(Message("shutdown", {"reason": "train over"}))
        for rank in range(1, self.comm.Get_size()):
            if rank not in self.link.bye_sent:
                self.link.send(rank, frames)
        self._finish()

    def _finish(self) -> None:
        """Bye to every rank, and what they still send read and dropped until each said bye: with nothing
        left in flight, MPI can finalise when this process exits."""
        missing = self.link.finish(list(range(1, self.comm.Get_size())), SHUTDOWN_LINGER_S)
        if missing:
            log.warning("MPI rank(s) %s did not say bye within %.0f s; MPI may complain as this process exits",
                        ", ".join(map(str, missing)), SHUTDOWN_LINGER_S)  # fmt: skip

    # ---- receiving --------------------------------------------------------------------
    def _on_received(self, got: Received) -> None:
        rank, k = got.source, got.source - 1
        if k in self._heard:
            self._from_worker(k, got)
        elif got.message is not None and rank not in self._gone:
            self._from_stranger(rank, got.message)
        else:
            log.debug("dropped what rank %d sent: %s", rank, got.problem or got.message.kind)

    def _from_worker(self, k: int, got: Received) -> None:
        """Replies and errors go to recv(); the session's own kinds stop here."""
        self._heard[k] = time.monotonic()
        with self.book.cond:
            self.book.traffic[k][1] += got.nbytes
        if got.problem is not None:
            self.link.send(k + 1, wire.encode(wire.error_reply(None, f"the master could not read your message: "
                                                                     f"{got.problem}")))  # fmt: skip
            self.inbox.put(("malformed", k, str(got.problem)))
            return
        msg = got.message
        if msg.kind not in wire.SESSION_KINDS or msg.kind == "error":
            self.inbox.put(("message", k, msg))
        elif msg.kind == "hello":
            self._send_to(k, wire.encode(Message("welcome", {"index": k, "heartbeat_s": self.heartbeat_s})))
        elif msg.kind in ("welcome", "shutdown"):
            log.warning("worker %d sent %r, which only a master sends; ignored", k, msg.kind)
        # heartbeat: _heard is all it changes

    def _from_stranger(self, rank: int, msg: Message) -> None:
        """A rank not yet admitted: its hello waits for start(); an error means it could not start."""
        if msg.kind == "hello":
            self._hellos[rank] = msg
        elif msg.kind == "error":
            self._give_up_on(rank, RuntimeError(f"MPI rank {rank} could not start: {msg.header['message']}"))
        else:
            log.debug("rank %d sent %r before its hello; dropped", rank, msg.kind)

    def _give_up_on(self, rank: int, why: BaseException) -> None:
        """A rank that will never be a worker here: bye to it (it exits), and start() raises ``why``."""
        self._gone.add(rank)
        self.link.send_bye(rank)
        with self.book.cond:
            if self.book.refusal is None:
                self.book.refusal = why
            self.book.cond.notify_all()

    # ---- the clock ----------------------------------------------------------------------
    def _tick(self) -> None:
        """Admit the held hellos once start() was called, heartbeat, spot silent or broken workers."""
        with self.book.cond:
            admitting = self.book.admitting
        if admitting and self._hellos:
            hellos, self._hellos = self._hellos, {}
            for rank, hello in sorted(hellos.items()):
                self._admit(rank, hello)
        for rank, why in list(self.link.broken.items()):
            if rank not in self._gone:
                if rank - 1 in self._heard:
                    self._mark_lost(rank - 1, f"its messages cannot be read: {why}")
                else:
                    self._give_up_on(rank, RuntimeError(f"MPI rank {rank} sent what cannot be read: {why}"))
        for rank in sorted(self.link.said_bye - self.link.bye_sent):  # it ended its session: it is exiting
            if rank - 1 in self._heard:
                self._mark_lost(rank - 1, "its process ended the session (it said bye)")
            elif rank not in self._gone:
                self._give_up_on(rank, RuntimeError(f"MPI rank {rank} left before it was welcomed"))
            self.link.send_bye(rank)  # it waits for this one before it exits
        now = time.monotonic()
        for k in list(self._heard):
            silent = now - self._heard[k]
            if silent > self.peer_timeout_s:
                self._mark_lost(k, f"silent for {silent:.1f} s (peer timeout {self.peer_timeout_s:g} s)")
            elif now - self._said[k] >= self.heartbeat_s:
                self._send_to(k, self._heartbeat)

    def _admit(self, rank: int, hello: Message) -> None:
        h, k = hello.header, rank - 1
        if h["protocol"] != self.protocol:
            mismatch = wire.VersionMismatch(
                "task protocol", h["protocol"], self.protocol, peer=f"MPI rank {rank}", here="the master"
            )
            told = wire.VersionMismatch("task protocol", h["protocol"], self.protocol, peer="the worker",
                                        here="the master")  # fmt: skip
            self.link.send(rank, wire.encode(Message("error", {"message": str(told)})))
            self._give_up_on(rank, mismatch)
            return
        welcome = wire.encode(Message("welcome", {"index": k, "heartbeat_s": self.heartbeat_s}))
        now = time.monotonic()
        self._heard[k] = self._said[k] = now
        info = WorkerInfo(k, h["backend"], h["device"], address=f"MPI rank {rank}", hostname=h["hostname"],
                          pid=h["pid"])  # fmt: skip
        with self.book.cond:
            self.book.traffic[k] = [0, 0]
            self.book.admitted[k] = info
            self.book.cond.notify_all()
        self._send_to(k, welcome)
        log.info("worker %d: %s on %s (MPI rank %d, pid %d)", k, h["backend"], h["device"].get("device"), rank,
                 h["pid"])  # fmt: skip

    def _mark_lost(self, k: int, reason: str) -> None:
        """Nothing more goes to worker k but the shutdown at close; what it still sends is dropped."""
        self._heard.pop(k, None)
        self._said.pop(k, None)
        self._gone.add(k + 1)
        with self.book.cond:
            self.book.lost[k] = reason
            self.book.cond.notify_all()
        log.warning("worker %d lost: %s", k, reason)
        self.inbox.put(("lost", k, reason))


class MpiTransport(Transport):
    """Master side, on rank 0 of ``comm`` (default ``MPI.COMM_WORLD``); ranks 1.. are workers 0...

    ``protocol`` is the version of the task protocol the master speaks. A worker silent for
    ``peer_timeout_s`` is lost; both sides heartbeat after ``heartbeat_s`` of quiet.
    ``max_message_bytes`` caps the array data of one message, checked from its prefix before
    anything is allocated. Arrays handed to :meth:`send` are sent without copying, so leave
    them unmodified until the worker's reply arrives. Options of other transports (``bind``,
    ``curve``, ...) are accepted and ignored.
    """

    name = "mpi"

    def __init__(
        self,
        *,
        protocol: int,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 5.0,
        max_message_bytes: int = wire.DEFAULT_MAX_BYTES,
        comm: Any = None,
        **_: Any,
    ) -> None:
        if not wire.Int.accepts(protocol):
            raise TypeError(f"protocol must be an int, the version of the task protocol; got {protocol!r}")
        if not heartbeat_s > 0 or not peer_timeout_s > heartbeat_s:
            raise ValueError(f"need 0 < heartbeat_s < peer_timeout_s, got {heartbeat_s} and {peer_timeout_s}")
        MPI = require_mpi()
        self._comm = MPI.COMM_WORLD if comm is None else comm
        rank, size = self._comm.Get_rank(), self._comm.Get_size()
        if rank != MASTER:
            raise RuntimeError(
                f"MpiTransport is the master's, on rank {MASTER}; this is rank {rank}, which should serve as a "
                "worker (transports.mpi_worker.serve_if_worker)"
            )
        if size < 2:
            raise RuntimeError(
                "this MPI job has one rank, the master, and no workers: launch it with mpiexec -n N "
                "(rank 0 the master, ranks 1..N-1 the workers), e.g. mpiexec -n 3 for 2 workers"
            )
        self.size = size
        self._book = _Book()
        self._io = _MasterIO(self._comm, self._book, protocol=protocol, heartbeat_s=float(heartbeat_s),
                             peer_timeout_s=float(peer_timeout_s), max_bytes=int(max_message_bytes))  # fmt: skip
        self._started = False
        self._closed = False
        self._thread = threading.Thread(target=self._io.run, name="mpi-master-io", daemon=True)
        self._thread.start()

    @property
    def bound_address(self) -> str:
        """Where workers are: the other ranks of this MPI job (for messages; nothing to connect to)."""
        return f"mpi://ranks 1..{self.size - 1}"

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        """Wait until every other rank said hello (``n_workers`` must be ``size - 1``); return them, by index.

        Raises VersionMismatch for a rank of another task protocol and RuntimeError for one that
        could not start (each told the master why), TimeoutError when some are still silent.
        """
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
        if n_workers != self.size - 1:
            raise ValueError(
                f"{n_workers} worker(s) asked for, but mpiexec started {self.size} ranks: rank 0 the master and "
                f"{self.size - 1} worker(s); launch with mpiexec -n {n_workers + 1}, or ask for {self.size - 1}"
            )
        book = self._book
        with book.cond:
            if self._started or self._closed:
                raise RuntimeError("start() can be called once, on a transport that is not closed")
            self._started = book.admitting = True
        self._io.kick.set()
        deadline = time.monotonic() + timeout
        with book.cond:
            while True:
                if book.failure is not None:
                    raise RuntimeError(f"the mpi transport's I/O thread failed: {book.failure!r}") from book.failure
                if book.refusal is not None:
                    raise book.refusal
                live = [w for k, w in sorted(book.admitted.items()) if k not in book.lost]
                if len(live) >= n_workers:
                    return live
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    silent = sorted(set(range(1, self.size)) - {w.index + 1 for w in live})
                    raise TimeoutError(
                        f"only {len(live)} of {n_workers} MPI ranks said hello within {timeout:g} s; still silent: "
                        f"rank(s) {', '.join(map(str, silent))}. Each rank must run the same program, whose "
                        "ranks > 0 call transports.mpi_worker.serve_if_worker before anything slow"
                    )
                book.cond.wait(remaining)

    def send(self, worker: int, msg: Message) -> None:
        with self._book.cond:
            self._check_open("send")
            if not isinstance(worker, int) or worker not in self._book.admitted:
                raise ValueError(f"no worker {worker!r}; workers are 0..{self.size - 2}")
            if worker in self._book.lost:
                raise WorkerLost(worker, self._book.lost[worker])
        self._io.outbox.put((worker, wire.encode(msg)))  # encode validates: a bad message fails here, in the caller
        self._io.kick.set()

    def recv(self, timeout: float) -> tuple[int, Message]:
        """The next message from a worker; raises TimeoutError, WorkerLost, or ProtocolError for a
        message the worker sent that the master could not read."""
        with self._book.cond:
            self._check_open("recv")
        try:
            event, k, payload = self._io.inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise TimeoutError(f"no message from any MPI worker within {timeout:g} s") from None
        if event == "message":
            return k, payload
        if event == "lost":
            raise WorkerLost(k, payload)
        if event == "failed":
            raise RuntimeError(f"the mpi transport's I/O thread failed: {payload!r}") from payload
        raise wire.ProtocolError(f"worker {k} sent a malformed message: {payload}")

    def _check_open(self, what: str) -> None:
        if not self._started or self._closed:
            raise RuntimeError(f"{what}() needs a started, open transport")
        if self._book.failure is not None:
            raise RuntimeError(f"the mpi transport's I/O thread failed: {self._book.failure!r}")

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Bytes (sent to, received from) each worker: every frame, heartbeats included (not the prefixes)."""
        with self._book.cond:
            return {k: (s, r) for k, (s, r) in sorted(self._book.traffic.items())}

    def close(self) -> None:
        """Send ``shutdown`` to every rank still there, stop the I/O thread. Idempotent.

        MPI itself stays initialised: mpi4py finalises it when the process exits.
        """
        with self._book.cond:
            if self._closed:
                return
            self._closed = True
            self._book.cond.notify_all()
        self._io.stop.set()
        self._io.kick.set()
        self._thread.join(timeout=_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            log.error("mpi I/O thread did not stop within %.0f s", _JOIN_TIMEOUT_S)

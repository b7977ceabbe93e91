"""The caller's side of a session: :class:`SessionTransport`, a :class:`~transports.base.Transport`
whose workers a :class:`~transports.session.master.MasterSession` admits, heartbeats and loses
over a :class:`~transports.session.link.Link`. A transport built on it makes its link and
passes it to the constructor; everything else is here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from transports import wire
from transports.base import Message, Transport, WorkerInfo, WorkerLost
from transports.session.book import Book
from transports.session.link import Link
from transports.session.master import MasterSession

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # at close, how long the I/O thread may take to say goodbye and stop


def check_options(protocol: Any, heartbeat_s: float = 1.0, peer_timeout_s: float = 5.0, **_: Any) -> None:
    """TypeError or ValueError for options no session can run with; call it before making a link."""
    if not wire.Int.accepts(protocol):
        raise TypeError(f"protocol must be an int, the version of the task protocol; got {protocol!r}")
    if not heartbeat_s > 0 or not peer_timeout_s > heartbeat_s:
        raise ValueError(f"need 0 < heartbeat_s < peer_timeout_s, got {heartbeat_s} and {peer_timeout_s}")


class SessionTransport(Transport):
    """The Transport API over a link: ``start``, ``joined``, ``send``, ``recv``, ``traffic``, ``close``.

    ``protocol`` is the version of the task protocol the master speaks: a worker whose hello
    says another is refused, and told why. A worker silent for ``peer_timeout_s`` is lost;
    both sides heartbeat after ``heartbeat_s`` of quiet. ``max_message_bytes`` caps the array
    data of one message. Arrays handed to :meth:`send` are sent without copying, so leave them
    unmodified until the worker's reply arrives. Options meant for other transports are ignored.
    """

    def __init__(
        self,
        link: Link,
        *,
        protocol: int,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 5.0,
        max_message_bytes: int = wire.DEFAULT_MAX_BYTES,
        **_: Any,
    ) -> None:
        check_options(protocol, heartbeat_s, peer_timeout_s)
        self._link, self._book = link, Book()
        self._io = MasterSession(
            link,
            self._book,
            protocol=protocol,
            heartbeat_s=float(heartbeat_s),
            peer_timeout_s=float(peer_timeout_s),
            max_bytes=int(max_message_bytes),
        )
        self._started = self._closed = False
        self._thread = threading.Thread(target=self._io.run, name=f"{self.name}-master-io", daemon=True)
        self._thread.start()

    def missing(self, live: list[WorkerInfo], n_workers: int, timeout: float) -> str:
        """What start()'s TimeoutError says when only ``live`` said hello: where workers should come from."""
        return f"only {len(live)} of {n_workers} workers said hello within {timeout:g} s"

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        """Wait until ``n_workers`` workers are admitted and alive; return them, by index.

        Hellos that came before are admitted first. A worker lost meanwhile is not returned
        (so the indices need not be 0..n-1); workers admitted beyond the first ``n_workers``
        are reported by :meth:`joined`. In a closed group a member that cannot be admitted
        ends the wait at once with why (VersionMismatch, RuntimeError).
        """
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
        book = self._book
        with book.cond:
            if self._started or self._closed:
                raise RuntimeError("start() can be called once, on a transport that is not closed")
            self._started = book.admitting = True
        self._link.wake()
        deadline = time.monotonic() + timeout
        with book.cond:
            while True:
                if self._closed:
                    raise RuntimeError("the transport was closed while start() waited for workers")
                self._check_failure()
                if book.refusal is not None:
                    raise book.refusal
                live = [w for w in book.fresh if w.index not in book.lost]
                remaining = deadline - time.monotonic()
                if len(live) >= n_workers:
                    break
                if remaining <= 0:
                    raise TimeoutError(self.missing(live, n_workers, timeout))
                book.cond.wait(remaining)
            chosen, book.fresh = live[:n_workers], live[n_workers:]
            book.known.update(w.index for w in chosen)
        return sorted(chosen, key=lambda w: w.index)

    def joined(self) -> list[WorkerInfo]:
        """Workers admitted since start() or the previous call, and still alive; never blocks."""
        with self._book.cond:
            fresh = [w for w in self._book.fresh if w.index not in self._book.lost]
            self._book.fresh = []
            self._book.known.update(w.index for w in fresh)
        return fresh

    def send(self, worker: int, msg: Message) -> None:
        with self._book.cond:
            self._check_open("send")
            if not isinstance(worker, int) or worker not in self._book.known:
                raise ValueError(f"no worker {worker!r}; the workers are those start() and joined() returned")
            if worker in self._book.lost:
                raise WorkerLost(worker, self._book.lost[worker])
        self._io.outbox.put((worker, wire.encode(msg)))  # encode validates: a bad message fails here, in the caller
        self._link.wake()

    def recv(self, timeout: float) -> tuple[int, Message]:
        """The next message from a worker that start() or joined() returned; raises TimeoutError,
        WorkerLost, or ProtocolError for a message the worker sent that the master could not read."""
        with self._book.cond:
            self._check_open("recv")
        deadline = time.monotonic() + timeout
        while True:
            try:
                event, k, payload = self._io.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no message from any worker within {timeout:g} s") from None
            if event == "failed":
                raise RuntimeError(f"the {self.name} transport's I/O thread failed: {payload!r}") from payload
            with self._book.cond:
                known = k in self._book.known
            if not known:  # a worker the caller never heard of (lost, or unsolicited, before joined())
                log.debug("dropping %s from worker %s, not yet reported by joined()", event, k)
                continue
            if event == "message":
                return k, payload
            if event == "lost":
                raise WorkerLost(k, payload)
            raise wire.ProtocolError(f"worker {k} sent a malformed message: {payload}")

    def _check_open(self, what: str) -> None:
        if not self._started or self._closed:
            raise RuntimeError(f"{what}() needs a started, open transport")
        self._check_failure()

    def _check_failure(self) -> None:
        failure = self._book.failure
        if failure is not None:
            raise RuntimeError(f"the {self.name} transport's I/O thread failed: {failure!r}") from failure

    def dropped(self) -> dict[str, int]:
        """How many messages the master dropped since it was made, by kind (see transports.droplog.KINDS):
        from peers that were not workers, or from workers declared lost."""
        return self._io.drops.counts()

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Bytes (sent to, received from) each worker, all frames including heartbeats."""
        with self._book.cond:
            return {k: (s, r) for k, (s, r) in sorted(self._book.traffic.items())}

    def close(self) -> None:
        """Send ``shutdown`` to every worker, stop the I/O thread, release the link. Idempotent."""
        with self._book.cond:
            if self._closed:
                return
            self._closed = True
            self._book.cond.notify_all()  # a start() still waiting gives up
        self._io.stop.set()
        self._link.wake()
        self._thread.join(timeout=JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # never seen; the link's medium may still be in use, so leave it
            log.error("the %s transport's I/O thread did not stop within %.0f s", self.name, JOIN_TIMEOUT_S)
        else:
            self._link.release()

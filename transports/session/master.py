"""The master's side of a session: :class:`SessionTransport`, the Transport the caller's threads use, and
:class:`MasterSession`, the one I/O thread that calls the :class:`~transports.session.link.Link`. They share a
:class:`~transports.session.admission.Book` and queues; who becomes a worker is ``admission.py``'s.

One task's way: ``send`` encodes it (:func:`transports.wire.encode` validates it, in the caller) into the
``outbox``; the I/O thread hands its frames to the link; the reply arrives as an ``Arrival``, is decoded
(:func:`transports.wire.decode`) into the ``inbox``, where ``recv`` takes it. Meanwhile the I/O thread
heartbeats after ``heartbeat_s`` of quiet, declares a worker lost when it was silent beyond its patience
(``patience.py``) or the link cannot reach it, and at the end says goodbye.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from transports import wire
from transports.base import Message, Transport, WorkerInfo, WorkerLost
from transports.droplog import DropLog
from transports.session.admission import Admission, Book
from transports.session.link import Arrival, Link
from transports.session.patience import Patience
from transports.session.settings import HEARTBEAT, MasterSettings, check_options

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # at close, how long the I/O thread may take to say goodbye and stop


class SessionTransport(Transport):
    """The Transport API over a link. ``protocol``: the task protocol's version; a worker whose hello says
    another is refused, and told why. ``peer_timeout_s``: the ceiling of a worker's patience. ``max_message_bytes``
    caps the array data of one message; with ``secret``, only workers whose hello carries it are admitted. Arrays
    handed to :meth:`send` go without copying: leave them unmodified until the reply arrives. Options meant for
    other transports are ignored.
    """

    def __init__(
        self,
        link: Link,
        *,
        protocol: int,
        heartbeat_s: float = 0.4,
        peer_timeout_s: float = 30.0,
        max_message_bytes: int = wire.DEFAULT_MAX_BYTES,
        secret: str | None = None,
        **_: Any,
    ) -> None:
        check_options(protocol, heartbeat_s, peer_timeout_s)
        self._link, self._book = link, Book()
        settings = MasterSettings(protocol, float(heartbeat_s), float(peer_timeout_s), int(max_message_bytes), secret)
        self._io = MasterSession(link, self._book, settings)
        self._closed = False
        self._thread = threading.Thread(target=self._io.run, name=f"{self.name}-master-io", daemon=True)
        self._thread.start()

    def missing(self, live: list[WorkerInfo], n_workers: int, timeout: float) -> str:
        """What start()'s TimeoutError says when only ``live`` said hello: where workers should come from."""
        return f"only {len(live)} of {n_workers} workers said hello within {timeout:g} s"

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        """Wait until ``n_workers`` workers are admitted and alive; return them, by index (a worker lost
        meanwhile is not returned; those beyond the first ``n_workers`` come from :meth:`joined`). In a closed
        group a member that cannot be admitted ends the wait at once with why (VersionMismatch, RuntimeError)."""
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
        book = self._book
        with book.cond:
            if book.admitting or self._closed:
                raise RuntimeError("start() can be called once, on a transport that is not closed")
            book.admitting = True
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

    def refuse(self, worker: int, why: str) -> bool:
        return self._let_go(worker, f"refused: {why}", why)

    def drop(self, worker: int, why: str) -> bool:
        return self._let_go(worker, why)

    def _let_go(self, worker: int, lost: str, refused: str | None = None) -> bool:
        """Worker ``worker`` is lost (``lost`` says why) from now on; the I/O thread stops serving it, and tells it
        why it is ``refused`` (then turned away for a while), or nothing, so that it says hello again."""
        with self._book.cond:
            self._book.lost.setdefault(worker, lost)
        self._io.letting_go.put((worker, refused))
        self._link.wake()
        return True

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
        if not self._book.admitting or self._closed:
            raise RuntimeError(f"{what}() needs a started, open transport")
        self._check_failure()

    def _check_failure(self) -> None:
        failure = self._book.failure
        if failure is not None:
            raise RuntimeError(f"the {self.name} transport's I/O thread failed: {failure!r}") from failure

    def dropped(self) -> dict[str, int]:
        """Messages dropped since the start, from peers that were not workers or were lost, by kind (droplog.KINDS)."""
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


class MasterSession:
    """The I/O thread (:meth:`run`); the caller's side talks to it through ``book``, ``inbox`` (what
    ``recv`` reads: ("message" | "malformed" | "lost" | "failed", index, payload)), ``outbox``
    ((index, frames) to send, then ``link.wake()``) and ``stop``."""

    def __init__(self, link: Link, book: Book, settings: MasterSettings) -> None:
        self.link, self.book, self.settings = link, book, settings
        self.inbox: queue.Queue[tuple[str, int | None, Any]] = queue.Queue()
        self.outbox: queue.Queue[tuple[int, list]] = queue.Queue()
        self.letting_go: queue.Queue[tuple[int, str | None]] = queue.Queue()  # (worker, why it is refused, or None)
        self.stop = threading.Event()
        self.drops = DropLog(log)
        self.admission = Admission(link, book, self.drops, settings)
        self._heard: dict[int, Patience] = {}  # live workers only: how long each has been silent, and may be

    def run(self) -> None:
        graceful = False
        try:
            while not self.stop.is_set():
                self.link.wait(self.settings.heartbeat_s / 4)  # a quarter heartbeat: timers stay accurate
                self._flush_outbox()
                for arrival in self.link.receive():
                    self._on_arrival(arrival)
                self._tick()
            self._flush_outbox()  # tasks sent just before close() still go first
            self._say_goodbye()
            graceful = True
        except BaseException as e:  # report, never die silently: the caller's next call raises it
            log.exception("the session's I/O thread failed")
            with self.book.cond:
                self.book.failure = e
                self.book.cond.notify_all()
            self.inbox.put(("failed", None, e))
        finally:
            self.link.close(graceful)

    def _tick(self) -> None:
        """Log what is due, let admission forget and admit, send heartbeats, spot silent workers."""
        now = time.monotonic()
        self.drops.flush()
        for k in self.admission.admit_waiting(now):
            self._admitted(k)
        for k in list(self._heard):
            if why := self._heard[k].lost(now):
                self._mark_lost(k, why)
            elif now - self._heard[k].said >= self.settings.heartbeat_s:
                self._send_to(k, HEARTBEAT, control=True)

    def _admitted(self, k: int) -> None:  # welcomed: k keeps the welcome's pace, this master's heartbeat_s
        self._heard[k] = Patience(self.settings.heartbeat_s, self.settings.peer_timeout_s, time.monotonic())

    def _flush_outbox(self) -> None:
        while not self.outbox.empty():  # this thread is the only one that takes from it
            self._send_to(*self.outbox.get_nowait())
        while not self.letting_go.empty():
            k, refused = self.letting_go.get_nowait()
            if refused is not None:
                seconds = self.admission.refuse(k, refused, time.monotonic())
                bye = f"refused for {seconds:g} s: {refused[:200]}"
                self._send_to(k, wire.encode(Message("shutdown", {"reason": bye})))
            self._heard.pop(k, None)  # gone quietly: the caller already counts it lost

    def _send_to(self, k: int, frames: list, control: bool = False) -> None:
        if k not in self._heard:  # lost: nothing more goes to it
            return
        why = self.link.send(self.admission.peer[k], frames, control=control)
        if why:
            self._mark_lost(k, why)
            return
        self._heard[k].said = time.monotonic()
        with self.book.cond:
            self.book.traffic[k][0] += wire.frames_nbytes(frames)

    def _mark_lost(self, k: int, reason: str) -> None:
        self._heard.pop(k, None)
        with self.book.cond:
            self.book.lost[k] = reason
            self.book.cond.notify_all()
            known = k in self.book.known
        # a worker the caller knows: the runtime tells the user, with who it was and what follows; else only here
        log.log(logging.INFO if known else logging.WARNING, "worker %d lost: %s", k, reason)
        self.inbox.put(("lost", k, reason))

    def _say_goodbye(self) -> None:
        """The paper's "train over" flag: every worker, admitted or still waiting (in a closed group,
        every member: one that was lost and comes back exits at once), may go."""
        frames = wire.encode(Message("shutdown", {"reason": "train over"}))
        live = {self.admission.peer[k] for k in self._heard}
        for k in list(self._heard):
            self._send_to(k, frames)
        for peer in self.admission.pending if self.link.group is None else self.link.group:
            if peer not in live:
                self.link.send(peer, frames)  # best effort: it is not (or no longer) a worker

    def _on_arrival(self, a: Arrival) -> None:
        k = self.admission.index.get(a.peer)
        if k is None or k not in self._heard:  # not a live worker: admission answers
            for new in self.admission.hear(a):
                self._admitted(new)
            return
        self._heard[k].arrived(time.monotonic(), piece=a.frames is None and not a.gone)  # any bytes show it alive
        if a.gone:
            self._mark_lost(k, a.gone)
        elif a.frames is not None:
            self._from_worker(k, a)

    def _from_worker(self, k: int, a: Arrival) -> None:
        """A message from live worker k: replies, errors and a task's progress go to recv(); the session's own
        kinds stop here."""
        with self.book.cond:
            self.book.traffic[k][1] += wire.frames_nbytes(a.frames)
        try:
            msg = wire.decode(a.frames, self.settings.max_bytes)
        except wire.ProtocolError as e:
            self.link.send(a.peer, wire.encode(wire.error_reply(None, f"the master could not read your message: {e}")))
            self.inbox.put(("malformed", k, str(e)))
            return
        if msg.kind not in wire.SESSION_KINDS or msg.kind == "error" or msg.kind in wire.PROGRESS:
            self.inbox.put(("message", k, msg))
        elif msg.kind == "hello":  # it has not heard its welcome yet: say it again
            self._send_to(k, self.admission.welcome(k))
        elif msg.kind in ("welcome", "shutdown"):
            log.warning("worker %d sent %r, which only a master sends; ignored", k, msg.kind)
        # heartbeat: _heard is all it changes

"""The master's session: the I/O thread that turns a :class:`~transports.session.link.Link` into workers.

It sends the tasks the caller queued (:meth:`MasterSession._flush_outbox`) and queues what
workers send for ``recv`` (:meth:`MasterSession._from_worker`, which checks and decodes it);
between them, it sends heartbeats after ``heartbeat_s`` of quiet and declares a worker lost
when nothing came from it for ``peer_timeout_s``, when the link cannot reach it, or when the
link says it is gone. At the end it says goodbye. Who becomes a worker, and who is turned
away, is :class:`~transports.session.admission.Admission`'s.

One task's way: the caller's ``send`` encodes it and puts it in ``outbox``; this thread hands
its frames to the link; the worker's reply arrives as an :class:`~transports.session.link.Arrival`,
is checked against ``max_bytes`` and decoded (:func:`transports.wire.decode`), and goes to
``inbox``, where the caller's ``recv`` takes it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Hashable
from typing import Any

from transports import wire
from transports.base import Message
from transports.droplog import DropLog
from transports.session.admission import Admission, oversize
from transports.session.book import Book
from transports.session.link import Arrival, Link

log = logging.getLogger(__name__)

_GOODBYE = Message("shutdown", {"reason": "train over"})


class MasterSession:
    """Runs in its own thread (:meth:`run`); the caller's side talks to it through ``book``,
    ``inbox`` (what ``recv`` reads: ("message" | "malformed" | "lost" | "failed", index, payload)),
    ``outbox`` ((index, frames) to send, then ``link.wake()``) and ``stop``."""

    def __init__(
        self, link: Link, book: Book, *, protocol: int, heartbeat_s: float, peer_timeout_s: float, max_bytes: int
    ) -> None:
        self.link, self.book = link, book
        self.heartbeat_s, self.peer_timeout_s, self.max_bytes = heartbeat_s, peer_timeout_s, max_bytes
        self.inbox: queue.Queue[tuple[str, int | None, Any]] = queue.Queue()
        self.outbox: queue.Queue[tuple[int, list]] = queue.Queue()
        self.stop = threading.Event()
        self.drops = DropLog(log)
        self.admission = Admission(
            link, book, self.drops, protocol=protocol, heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s
        )
        self._heard: dict[int, float] = {}  # live workers only: when anything last came from each
        self._said: dict[int, float] = {}  # and when last sent to
        self._heartbeat = wire.encode(Message("heartbeat"))

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        graceful = False
        try:
            while not self.stop.is_set():
                self.link.wait(self.heartbeat_s / 4)  # a quarter heartbeat: timers stay accurate
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
            self._heard[k] = self._said[k] = time.monotonic()
        for k in list(self._heard):
            silent = now - self._heard[k]
            if silent > self.peer_timeout_s:
                self._mark_lost(k, f"silent for {silent:.1f} s (peer timeout {self.peer_timeout_s:g} s)")
            elif now - self._said[k] >= self.heartbeat_s:
                self._send_to(k, self._heartbeat, control=True)

    # ---- sending ----------------------------------------------------------------------
    def _flush_outbox(self) -> None:
        while True:
            try:
                k, frames = self.outbox.get_nowait()
            except queue.Empty:
                return
            self._send_to(k, frames)

    def _send_to(self, k: int, frames: list, control: bool = False) -> None:
        if k not in self._heard:  # lost: nothing more goes to it
            return
        why = self.link.send(self.admission.peer[k], frames, control=control)
        if why:
            self._mark_lost(k, why)
            return
        self._said[k] = time.monotonic()
        with self.book.cond:
            self.book.traffic[k][0] += wire.frames_nbytes(frames)

    def _send_raw(self, peer: Hashable, msg: Message) -> None:
        """Best effort to a peer that is not (or no longer) a worker."""
        self.link.send(peer, wire.encode(msg))

    def _mark_lost(self, k: int, reason: str) -> None:
        self._heard.pop(k, None)
        self._said.pop(k, None)
        with self.book.cond:
            self.book.lost[k] = reason
            self.book.cond.notify_all()
        log.warning("worker %d lost: %s", k, reason)
        self.inbox.put(("lost", k, reason))

    def _say_goodbye(self) -> None:
        """The paper's "train over" flag: every worker, admitted or still waiting (in a closed group,
        every member: one that was lost and comes back exits at once), may go."""
        frames = wire.encode(_GOODBYE)
        live = {self.admission.peer[k] for k in self._heard}
        for k in list(self._heard):
            self._send_to(k, frames)
        for peer in self.admission.pending if self.link.group is None else self.link.group:
            if peer not in live:
                self._send_raw(peer, _GOODBYE)

    # ---- receiving --------------------------------------------------------------------
    def _on_arrival(self, a: Arrival) -> None:
        k = self.admission.index.get(a.peer)
        if k is None or k not in self._heard:  # not a live worker: admission answers
            for new in self.admission.hear(a):
                self._heard[new] = self._said[new] = time.monotonic()
            return
        self._heard[k] = time.monotonic()  # any bytes from a worker show it is alive
        if a.gone:
            self._mark_lost(k, a.gone)
        elif a.frames is not None:
            self._from_worker(k, a)

    def _from_worker(self, k: int, a: Arrival) -> None:
        """A message from live worker k: replies and errors go to recv(); the session's own kinds stop here."""
        with self.book.cond:
            self.book.traffic[k][1] += wire.frames_nbytes(a.frames)
        try:
            problem = oversize(a.frames, self.max_bytes)
            if problem:
                raise wire.ProtocolError(f"refused a message of {problem}")
            msg = wire.decode(a.frames, self.max_bytes)
        except wire.ProtocolError as e:
            self._send_raw(a.peer, wire.error_reply(None, f"the master could not read your message: {e}"))
            self.inbox.put(("malformed", k, str(e)))
            return
        if msg.kind not in wire.SESSION_KINDS or msg.kind == "error":
            self.inbox.put(("message", k, msg))
        elif msg.kind == "hello":  # it has not heard its welcome yet: say it again
            self._send_to(k, self.admission.welcome(k))
        elif msg.kind in ("welcome", "shutdown"):
            log.warning("worker %d sent %r, which only a master sends; ignored", k, msg.kind)
        # heartbeat: _heard is all it changes

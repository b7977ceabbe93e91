"""The master's session: the I/O thread that turns a :class:`~transports.session.link.Link` into workers.

It admits workers (a hello of the right wire and task-protocol versions), sends their
welcomes, the tasks the caller queued and the heartbeats; queues what workers send for
``recv``; and declares a worker lost when nothing came from it for ``peer_timeout_s``, when
the link cannot reach it, or when the link says it is gone. At the end it says goodbye.

Before start() it holds hellos back (in an open group it forgets a peer that said hello and
then nothing for ``peer_timeout_s``). From start() on it admits every hello, each under a new
index (a worker that comes back after being lost is a new worker). Nothing a peer that is not
a worker sends can end the run: a hello of another version is answered with both versions,
anything else unreadable is dropped, and each kind is logged in one line per 10 s
(:class:`~transports.droplog.DropLog`). In a closed group (MPI's ranks) a peer that cannot be
admitted is given up on and ``start`` raises why: no other could take its place.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from transports import wire
from transports.base import Message, WorkerInfo
from transports.droplog import DropLog
from transports.session.link import Arrival, Link

log = logging.getLogger(__name__)

MAX_PENDING = 1000  # peers whose hello waits for start(); more are turned away
_GOODBYE = Message("shutdown", {"reason": "train over"})


@dataclass
class Book:
    """What the I/O thread and the caller's threads share; ``cond`` guards every field."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    admitting: bool = False  # start() was called
    fresh: list[WorkerInfo] = field(default_factory=list)  # admitted, not yet handed to the caller
    known: set[int] = field(default_factory=set)  # handed to the caller by start() or joined()
    lost: dict[int, str] = field(default_factory=dict)
    traffic: dict[int, list[int]] = field(default_factory=dict)  # worker index -> [sent, received]
    refusal: BaseException | None = None  # closed group: why start() cannot succeed
    failure: BaseException | None = None  # the I/O thread died of this


@dataclass
class _Pending:
    hello: Message
    address: str
    heard: float


def oversize(body: list, max_bytes: int) -> str | None:
    """Why the frames of one message are too many or too big to decode, or None: at most a header of
    MAX_HEADER_BYTES and MAX_ARRAYS array frames adding up to ``max_bytes``."""
    if len(body) > 1 + wire.MAX_ARRAYS:
        return f"{len(body)} frames, more than a header and {wire.MAX_ARRAYS} arrays"
    if body and len(body[0]) > wire.MAX_HEADER_BYTES:
        return f"a header frame of {len(body[0])} bytes, over the {wire.MAX_HEADER_BYTES} limit"
    total = sum(len(f) for f in body[1:])
    if total > max_bytes:
        return (
            f"array frames adding up to {total} bytes, over the limit of {max_bytes} bytes "
            "(raise max_message_bytes if this is intended)"
        )
    return None


def _label(a: Arrival) -> str:
    return a.address or f"peer {a.peer.hex()[:8] if isinstance(a.peer, bytes) else a.peer}"


class MasterSession:
    """Runs in its own thread (:meth:`run`); the caller's side talks to it through ``book``,
    ``inbox`` (what ``recv`` reads: ("message" | "malformed" | "lost" | "failed", index, payload)),
    ``outbox`` ((index, frames) to send, then ``link.wake()``) and ``stop``."""

    def __init__(
        self, link: Link, book: Book, *, protocol: int, heartbeat_s: float, peer_timeout_s: float, max_bytes: int
    ) -> None:
        self.link, self.book = link, book
        self.protocol, self.heartbeat_s, self.peer_timeout_s = protocol, heartbeat_s, peer_timeout_s
        self.max_bytes = max_bytes
        self.inbox: queue.Queue[tuple[str, int | None, Any]] = queue.Queue()
        self.outbox: queue.Queue[tuple[int, list]] = queue.Queue()
        self.stop = threading.Event()
        self.drops = DropLog(log)
        self._index: dict[Hashable, int] = {}  # peer -> index, for every worker ever admitted
        self._peer: dict[int, Hashable] = {}  # and back
        self._heard: dict[int, float] = {}  # live workers only: when anything last came from each
        self._said: dict[int, float] = {}  # and when last sent to
        self._pending: dict[Hashable, _Pending] = {}  # hellos before start(), oldest first
        self._given_up: set[Hashable] = set()  # closed group: peers that will never be workers
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
        """Log what is due, forget silent hellos, admit waiting ones once start() was called, send
        heartbeats, spot silent workers."""
        now = time.monotonic()
        self.drops.flush()
        if self.link.group is None:
            self._forget_silent(now)
        with self.book.cond:
            admitting = self.book.admitting
        if admitting and self._pending:
            pending, self._pending = self._pending, {}
            for peer, p in pending.items():
                self._admit(peer, p.hello, p.address)
        for k in list(self._heard):
            silent = now - self._heard[k]
            if silent > self.peer_timeout_s:
                self._mark_lost(k, f"silent for {silent:.1f} s (peer timeout {self.peer_timeout_s:g} s)")
            elif now - self._said[k] >= self.heartbeat_s:
                self._send_to(k, self._heartbeat, control=True)

    def _forget_silent(self, now: float) -> None:
        """A hello followed by silence frees its place: the peer must say hello again."""
        for peer, p in list(self._pending.items()):
            silent = now - p.heard
            if silent > self.peer_timeout_s:
                del self._pending[peer]
                where, pid = p.address or "?", p.hello.header["pid"]
                log.info("forgot a peer at %s (pid %d): it said hello, then nothing for %.1f s", where, pid, silent)

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
        why = self.link.send(self._peer[k], frames, control=control)
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
        live = {self._peer[k] for k in self._heard}
        for k in list(self._heard):
            self._send_to(k, frames)
        for peer in self._pending if self.link.group is None else self.link.group:
            if peer not in live:
                self._send_raw(peer, _GOODBYE)

    # ---- receiving --------------------------------------------------------------------
    def _on_arrival(self, a: Arrival) -> None:
        k = self._index.get(a.peer)
        live = k is not None and k in self._heard
        if live:
            self._heard[k] = time.monotonic()  # any bytes from a worker show it is alive
        if a.gone:
            if live:
                self._mark_lost(k, a.gone)
            elif k is None and a.peer not in self._given_up and self.link.group is not None:
                self._give_up(a.peer, RuntimeError(f"{_label(a)} is gone before its welcome: {a.gone}"))
            self._pending.pop(a.peer, None)
        elif a.frames is None:
            if a.peer in self._pending:
                self._pending[a.peer].heard = time.monotonic()
        elif live:
            self._from_worker(k, a)
        elif k is not None:
            self.drops.drop("lost", _label(a), f"worker {k} was declared lost; to come back it must say hello again")
        elif a.peer in self._given_up:
            self.drops.drop("stray", _label(a), "a peer this master gave up on")
        else:
            self._from_stranger(a)

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
            self._send_to(k, wire.encode(Message("welcome", {"index": k, "heartbeat_s": self.heartbeat_s})))
        elif msg.kind in ("welcome", "shutdown"):
            log.warning("worker %d sent %r, which only a master sends; ignored", k, msg.kind)
        # heartbeat: _heard is all it changes

    def _from_stranger(self, a: Arrival) -> None:
        """A peer that is not a worker: only a hello (one small frame) or, while its hello waits for
        start(), a heartbeat make sense (and, in a closed group, an error: it could not start);
        anything else is dropped and counted."""
        label, body = _label(a), a.frames
        if len(body) != 1:
            self.drops.drop("stray", label, f"{len(body)} frames; a peer must say hello (one frame) first")
            return
        if len(body[0]) > wire.MAX_HEADER_BYTES:
            self.drops.drop("oversized", label, f"a frame of {len(body[0])} bytes from a peer that has not said hello")
            return
        try:
            msg = wire.decode(body, 0)
        except wire.VersionMismatch as e:
            self._refuse(a, e.what, e.theirs)
            return
        except wire.ProtocolError as e:
            self.drops.drop("unreadable", label, str(e))
            return
        if msg.kind == "hello":
            self._on_hello(a, msg)
        elif msg.kind == "heartbeat" and a.peer in self._pending:
            self._pending[a.peer].heard = time.monotonic()
        elif msg.kind == "error" and self.link.group is not None:
            self._give_up(a.peer, RuntimeError(f"{label} could not start: {msg.header['message']}"))
        else:
            self.drops.drop("stray", label, f"a {msg.kind!r} message")

    def _refuse(self, a: Arrival, what: str, theirs: object) -> None:
        """Turn away a worker that speaks another version of ``what``, telling it both versions."""
        ours = wire.WIRE_VERSION if what == "wire" else self.protocol
        told = wire.VersionMismatch(what, theirs, ours, peer="the worker", here="the master")
        self._send_raw(a.peer, Message("error", {"message": f"{told} (worker at {a.address or 'unknown address'})"}))
        if self.link.group is None:
            self.drops.drop("version", _label(a), str(told))
        else:
            self._give_up(a.peer, wire.VersionMismatch(what, theirs, ours, peer=_label(a), here="the master"))

    def _give_up(self, peer: Hashable, why: BaseException) -> None:
        """A member of a closed group that will never be a worker: the link lets it go, start() raises ``why``."""
        self._given_up.add(peer)
        self.link.let_go(peer)
        with self.book.cond:
            if self.book.refusal is None:
                self.book.refusal = why
            self.book.cond.notify_all()

    def _on_hello(self, a: Arrival, msg: Message) -> None:
        if msg.header["protocol"] != self.protocol:
            self._refuse(a, "task protocol", msg.header["protocol"])
            return
        with self.book.cond:
            admitting = self.book.admitting
        if admitting:
            self._admit(a.peer, msg, a.address)
        elif a.peer in self._pending or len(self._pending) < MAX_PENDING:
            if a.peer not in self._pending:
                log.debug(
                    "holding the hello of a worker at %s (pid %d) until start()", a.address or "?", msg.header["pid"]
                )
            self._pending[a.peer] = _Pending(msg, a.address, time.monotonic())
        else:
            self.drops.drop("crowd", _label(a), f"{MAX_PENDING} peers already wait for start()")

    def _admit(self, peer: Hashable, msg: Message, address: str) -> None:
        h = msg.header
        # The book stays locked from the welcome's send to the worker's entry in it, so that a
        # worker holding its welcome is already in joined() (the send does not block).
        with self.book.cond:
            k = len(self._index) if self.link.group is None else self.link.group.index(peer)
            welcome = wire.encode(Message("welcome", {"index": k, "heartbeat_s": self.heartbeat_s}))
            why = self.link.send(peer, welcome)
            if why:  # it said hello, then left: not a worker
                log.info("a worker at %s left before its welcome (%s); not counting it", address or "?", why)
                return
            info = WorkerInfo(k, h["backend"], h["device"], address=address, hostname=h["hostname"], pid=h["pid"])
            self._index[peer], self._peer[k] = k, peer
            self._heard[k] = self._said[k] = time.monotonic()
            self.book.traffic[k] = [wire.frames_nbytes(welcome), 0]
            self.book.fresh.append(info)
            self.book.cond.notify_all()
        log.info("worker %d: %s on %s (%s, pid %d)", k, h["backend"], h["device"].get("device"), address, h["pid"])

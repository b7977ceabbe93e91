"""The master's I/O thread: the one thread that owns the ROUTER socket.

It admits workers (a hello of the right task-protocol version, from a peer that got past
CURVE if the master uses it), sends their welcomes, the tasks the caller queued and the
heartbeats; queues what workers send for ``recv``; and declares a worker lost when
nothing came from it for ``peer_timeout_s``, or when it disconnected.

Before start() it holds hellos back, and forgets a peer that said hello and then nothing
for ``peer_timeout_s``. From start() on it admits every hello, each under a new index
(a worker that comes back after being lost is a new worker). Nothing a peer that is not a
worker sends can end the run: a hello of another version is answered with both versions,
anything else unreadable is dropped, and each kind is logged in one line per 10 s
(:class:`~transports.droplog.DropLog`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from transports import wire
from transports.base import Message, WorkerInfo
from transports.droplog import DropLog
from transports.endpoints import peer_address
from transports.wakeup import Wakeup

log = logging.getLogger(__name__)

SHUTDOWN_LINGER_S = 1.0  # at close, how long queued shutdown messages may take to leave
_DRAIN_BATCH = 256  # messages read per wake-up before heartbeats get their turn again
MAX_PENDING = 1000  # peers whose hello waits for start(); more are turned away


@dataclass
class Book:
    """What the I/O thread and the caller's threads share; ``cond`` guards every field."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    ids: list[bytes] = field(default_factory=list)  # worker index -> zmq identity
    lost: dict[int, str] = field(default_factory=dict)
    traffic: list[list[int]] = field(default_factory=list)  # worker index -> [sent, received]
    fresh: list[WorkerInfo] = field(default_factory=list)  # admitted, not yet handed to the caller
    known: set[int] = field(default_factory=set)  # handed to the caller by start() or joined()
    admitting: bool = False  # start() was called
    failure: BaseException | None = None


@dataclass
class _Pending:
    hello: Message
    peer: str
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


def _label(peer: str, identity: bytes) -> str:
    return peer or f"peer {identity.hex()[:8]}"


class MasterIO:
    """Runs in its own thread (:meth:`run`); the caller's side talks to it through ``book``,
    ``inbox`` (what ``recv`` reads: ("message" | "malformed" | "lost" | "failed", index, payload)),
    ``outbox`` ((index, frames) to send) and ``wakeup``."""

    def __init__(
        self,
        sock: zmq.Socket,
        book: Book,
        wakeup: Wakeup,
        *,
        protocol: int,
        heartbeat_s: float,
        peer_timeout_s: float,
        max_bytes: int,
    ) -> None:
        self.sock, self.book, self.wakeup = sock, book, wakeup
        self.protocol, self.heartbeat_s, self.peer_timeout_s, self.max_bytes = (
            protocol,
            heartbeat_s,
            peer_timeout_s,
            max_bytes,
        )
        self.inbox: queue.Queue[tuple[str, int | None, Any]] = queue.Queue()
        self.outbox: queue.Queue[tuple[int, list]] = queue.Queue()
        self.stop = threading.Event()
        self.drops = DropLog(log)
        self._workers: dict[bytes, int] = {}  # identity -> index, for every worker ever admitted
        self._heard: dict[int, float] = {}  # live workers only: when each was last heard from
        self._said: dict[int, float] = {}  # and when last sent to
        self._pending: dict[bytes, _Pending] = {}  # hellos before start(), oldest first
        self._heartbeat = wire.encode(Message("heartbeat"))

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wakeup.fileno(), zmq.POLLIN)
        tick_ms = max(1, int(self.heartbeat_s * 250))  # a quarter heartbeat: timers stay accurate
        linger_ms = 0
        try:
            while not self.stop.is_set():
                ready = dict(poller.poll(tick_ms))
                if self.wakeup.fileno() in ready:
                    self.wakeup.drain()
                self._flush_outbox()
                if self.sock in ready:
                    self._drain_socket()
                self._tick()
            self._flush_outbox()  # tasks sent just before close() still go first
            self._say_goodbye()
            linger_ms = int(SHUTDOWN_LINGER_S * 1000)
        except BaseException as e:  # report, never die silently: the caller's next call raises it
            log.exception("zmq I/O thread failed")
            with self.book.cond:
                self.book.failure = e
                self.book.cond.notify_all()
            self.inbox.put(("failed", None, e))
        finally:
            self.sock.close(linger=linger_ms)

    def _tick(self) -> None:
        """Log what is due, forget silent hellos, admit waiting ones once start() was called, send
        heartbeats, spot silent workers."""
        now = time.monotonic()
        self.drops.flush()
        self._forget_silent(now)
        with self.book.cond:
            admitting = self.book.admitting
        if admitting and self._pending:
            pending, self._pending = self._pending, {}
            for identity, p in pending.items():
                self._admit(identity, p.hello, p.peer)
        for k in list(self._heard):
            silent = now - self._heard[k]
            if silent > self.peer_timeout_s:
                self._mark_lost(k, f"silent for {silent:.1f} s (peer timeout {self.peer_timeout_s:g} s)")
            elif now - self._said[k] >= self.heartbeat_s:
                self._send_to(k, self._heartbeat)

    def _forget_silent(self, now: float) -> None:
        """A hello followed by silence frees its place: the peer must say hello again."""
        for identity, p in list(self._pending.items()):
            silent = now - p.heard
            if silent > self.peer_timeout_s:
                del self._pending[identity]
                where, pid = p.peer or "?", p.hello.header["pid"]
                log.info("forgot a peer at %s (pid %d): it said hello, then nothing for %.1f s", where, pid, silent)

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
        with self.book.cond:
            identity = self.book.ids[k]
        try:
            self.sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._mark_lost(k, "its queue is full: the worker stopped reading")
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._mark_lost(k, "disconnected")
            return
        self._said[k] = time.monotonic()
        with self.book.cond:
            self.book.traffic[k][0] += wire.frames_nbytes(frames)

    def _send_raw(self, identity: bytes, msg: Message) -> None:
        """Best effort to a peer that is not (or not yet) a worker."""
        try:
            self.sock.send_multipart([identity, *wire.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _mark_lost(self, k: int, reason: str) -> None:
        self._heard.pop(k, None)
        self._said.pop(k, None)
        with self.book.cond:
            self.book.lost[k] = reason
            self.book.cond.notify_all()
        log.warning("worker %d lost: %s", k, reason)
        self.inbox.put(("lost", k, reason))

    def _say_goodbye(self) -> None:
        """The paper's "train over" flag: every worker, admitted or still waiting, may go."""
        frames = wire.encode(Message("shutdown", {"reason": "train over"}))
        for k in list(self._heard):
            self._send_to(k, frames)
        for identity in self._pending:
            self._send_raw(identity, Message("shutdown", {"reason": "train over"}))

    # ---- receiving --------------------------------------------------------------------
    def _drain_socket(self) -> None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, body = frames[0].bytes, frames[1:]
            k = self._workers.get(identity)
            if k is None:
                self._from_stranger(identity, body)
            elif k in self._heard:
                self._from_worker(k, identity, body)
            else:
                peer = _label(peer_address(body[0]) if body else "", identity)
                self.drops.drop("lost", peer, f"worker {k} was declared lost; to come back it must say hello again")

    def _from_worker(self, k: int, identity: bytes, body: list) -> None:
        """A message from live worker k: replies and errors go to recv(); the session's own kinds stop here."""
        self._heard[k] = time.monotonic()
        with self.book.cond:
            self.book.traffic[k][1] += sum(len(f) for f in body)
        try:
            problem = oversize(body, self.max_bytes)
            if problem:
                raise wire.ProtocolError(f"refused a message of {problem}")
            msg = wire.decode(body, self.max_bytes)
        except wire.ProtocolError as e:
            self._send_raw(identity, wire.error_reply(None, f"the master could not read your message: {e}"))
            self.inbox.put(("malformed", k, str(e)))
            return
        if msg.kind not in wire.SESSION_KINDS or msg.kind == "error":
            self.inbox.put(("message", k, msg))
        elif msg.kind == "hello":  # it has not heard its welcome yet: say it again
            self._send_to(k, wire.encode(Message("welcome", {"index": k, "heartbeat_s": self.heartbeat_s})))
        elif msg.kind in ("welcome", "shutdown"):
            log.warning("worker %d sent %r, which only a master sends; ignored", k, msg.kind)
        # heartbeat: _heard is all it changes

    def _from_stranger(self, identity: bytes, body: list) -> None:
        """A peer that is not a worker: only a hello (one small frame) or, while its hello waits for
        start(), a heartbeat make sense; anything else is dropped and counted."""
        peer = peer_address(body[0]) if body else ""
        label = _label(peer, identity)
        if len(body) != 1:
            self.drops.drop("stray", label, f"{len(body)} frames; a peer must say hello (one frame) first")
            return
        if len(body[0]) > wire.MAX_HEADER_BYTES:
            self.drops.drop("oversized", label, f"a frame of {len(body[0])} bytes from a peer that has not said hello")
            return
        try:
            msg = wire.decode(body, 0)
        except wire.VersionMismatch as e:
            self._refuse(identity, e.what, e.theirs, peer)
            return
        except wire.ProtocolError as e:
            self.drops.drop("unreadable", label, str(e))
            return
        if msg.kind == "hello":
            self._on_hello(identity, msg, peer)
        elif msg.kind == "heartbeat" and identity in self._pending:
            self._pending[identity].heard = time.monotonic()
        else:
            self.drops.drop("stray", label, f"a {msg.kind!r} message")

    def _refuse(self, identity: bytes, what: str, theirs: object, peer: str) -> None:
        """Turn away a worker that speaks another version of ``what``, telling it both versions."""
        ours = wire.WIRE_VERSION if what == "wire" else self.protocol
        mismatch = wire.VersionMismatch(what, theirs, ours, peer="the worker", here="the master")
        self._send_raw(identity, Message("error", {"message": f"{mismatch} (worker at {peer or 'unknown address'})"}))
        self.drops.drop("version", _label(peer, identity), str(mismatch))

    def _on_hello(self, identity: bytes, msg: Message, peer: str) -> None:
        if msg.header["protocol"] != self.protocol:
            self._refuse(identity, "task protocol", msg.header["protocol"], peer)
            return
        with self.book.cond:
            admitting = self.book.admitting
        if admitting:
            self._admit(identity, msg, peer)
        elif identity in self._pending or len(self._pending) < MAX_PENDING:
            if identity not in self._pending:
                log.debug("holding the hello of a worker at %s (pid %d) until start()", peer or "?", msg.header["pid"])
            self._pending[identity] = _Pending(msg, peer, time.monotonic())
        else:
            self.drops.drop("crowd", _label(peer, identity), f"{MAX_PENDING} peers already wait for start()")

    def _admit(self, identity: bytes, msg: Message, peer: str) -> None:
        h = msg.header
        # The book stays locked from the welcome's send to the worker's entry in it, so that a
        # worker holding its welcome is already in joined() (the send does not block).
        with self.book.cond:
            k = len(self.book.ids)
            welcome = wire.encode(Message("welcome", {"index": k, "heartbeat_s": self.heartbeat_s}))
            try:
                self.sock.send_multipart([identity, *welcome], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # it said hello, then left: not a worker
                log.info("a worker at %s left before its welcome (%s); not counting it", peer or "?", e)
                return
            now = time.monotonic()
            info = WorkerInfo(k, h["backend"], h["device"], address=peer, hostname=h["hostname"], pid=h["pid"])
            self._workers[identity] = k
            self._heard[k] = self._said[k] = now
            self.book.ids.append(identity)
            self.book.traffic.append([wire.frames_nbytes(welcome), 0])
            self.book.fresh.append(info)
            self.book.cond.notify_all()
        log.info("worker %d: %s on %s (%s, pid %d)", k, h["backend"], h["device"].get("device"), peer, h["pid"])

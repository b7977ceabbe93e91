"""Admission: which peers become workers of a master's session, under which index, and which are turned away
(docs/writing-a-transport.md, "The master side" and "Crossing a process boundary"). Nothing a peer that is
not a worker sends can end the run, but in a closed group (MPI's ranks) a peer that cannot be admitted ends
``start``: no other could take its place.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from transports import wire
from transports.base import Message, WorkerInfo
from transports.droplog import DropLog
from transports.session.link import Arrival, Link
from transports.session.settings import SECRET_ENV, MasterSettings

log = logging.getLogger(__name__)

MAX_PENDING = 1000  # peers whose hello waits for start(); more are turned away
REFUSED_S = 60.0  # how long a peer is first turned away for wrong answers or a failed calibration; then twice that


@dataclass
class Book:
    """What the session's I/O thread and the caller's threads share; ``cond`` guards every field."""

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
    key: str = ""


def worker_info(k: int, hello: dict, address: str, key: str = "") -> WorkerInfo:
    """Worker ``k`` as its hello's header describes it, at ``address``, with its public ``key``."""
    return WorkerInfo(k, hello["backend"], hello["device"], address, hello["hostname"], hello["pid"], key)


def _label(a: Arrival) -> str:
    return a.address or f"peer {a.peer.hex()[:8] if isinstance(a.peer, bytes) else a.peer}"


class Admission:
    """The I/O thread's record of who is a worker (``index``, ``peer``), who waits for start()
    (``pending``) and who never will be; it answers whatever comes from a peer that is not a live worker."""

    def __init__(self, link: Link, book: Book, drops: DropLog, settings: MasterSettings) -> None:
        self.link, self.book, self.drops, self.settings = link, book, drops, settings
        self.index: dict[Hashable, int] = {}  # peer -> index, for every worker ever admitted
        self.peer: dict[int, Hashable] = {}  # and back
        self.pending: dict[Hashable, _Pending] = {}  # hellos before start(), oldest first
        self._given_up: set[Hashable] = set()  # closed group: peers that will never be workers
        self.who: dict[int, str] = {}  # worker -> its key, else its address: what a refusal turns away
        self.refused: dict[str, tuple[float, int, str]] = {}  # who -> (refused until, refusals so far, why)

    def welcome(self, k: int) -> list:
        """The frames of worker ``k``'s welcome: its index and the heartbeat pace."""
        return wire.encode(Message("welcome", {"index": k, "heartbeat_s": self.settings.heartbeat_s}))

    def admit_waiting(self, now: float) -> list[int]:
        """Forget silent hellos (open group) and, once start() was called, admit the waiting ones; their indices."""
        if self.link.group is None:
            self._forget_silent(now)
        with self.book.cond:
            admitting = self.book.admitting
        admitted: list[int] = []
        if admitting and self.pending:
            pending, self.pending = self.pending, {}
            for peer, p in pending.items():
                admitted += self._admit(peer, p.hello, p.address, p.key)
        return admitted

    def hear(self, a: Arrival) -> list[int]:
        """Answer what came from a peer that is not a live worker; [the index of the worker it became], or []."""
        k = self.index.get(a.peer)
        if a.gone:
            if k is None and a.peer not in self._given_up and self.link.group is not None:
                self._give_up(a.peer, RuntimeError(f"{_label(a)} is gone before its welcome: {a.gone}"))
            self.pending.pop(a.peer, None)
        elif a.frames is None:
            if a.peer in self.pending:
                self.pending[a.peer].heard = time.monotonic()
        elif k is not None:
            self.drops.drop("lost", _label(a), f"worker {k} was declared lost; to come back it must say hello again")
        elif a.peer in self._given_up:
            self.drops.drop("stray", _label(a), "a peer this master gave up on")
        else:
            return self._from_stranger(a)
        return []

    def _forget_silent(self, now: float) -> None:
        """A hello followed by silence frees its place: the peer must say hello again."""
        for peer, p in list(self.pending.items()):
            silent = now - p.heard
            if silent > self.settings.peer_timeout_s:
                del self.pending[peer]
                where, pid = p.address or "?", p.hello.header["pid"]
                log.info("forgot a peer at %s (pid %d): it said hello, then nothing for %.1f s", where, pid, silent)

    def _from_stranger(self, a: Arrival) -> list[int]:
        """A peer that is not a worker: only a hello (one small frame), a heartbeat while its hello waits, or
        in a closed group an error (it could not start) make sense; anything else is dropped and counted."""
        label, body = _label(a), a.frames
        if len(body) != 1:
            self.drops.drop("stray", label, f"{len(body)} frames; a peer must say hello (one frame) first")
            return []
        if len(body[0]) > wire.MAX_HEADER_BYTES:
            self.drops.drop("oversized", label, f"a frame of {len(body[0])} bytes from a peer that has not said hello")
            return []
        try:
            msg = wire.decode(body, 0)
        except wire.VersionMismatch as e:
            self._refuse(a, e.what, e.theirs)
            return []
        except wire.ProtocolError as e:
            self.drops.drop("unreadable", label, str(e))
            return []
        if msg.kind == "hello":
            return self._on_hello(a, msg)
        elif msg.kind == "heartbeat" and a.peer in self.pending:
            self.pending[a.peer].heard = time.monotonic()
        elif msg.kind == "error" and self.link.group is not None:
            self._give_up(a.peer, RuntimeError(f"{label} could not start: {msg.header['message']}"))
        else:
            self.drops.drop("stray", label, f"a {msg.kind!r} message")
        return []

    def _refuse(self, a: Arrival, what: str, theirs: object) -> None:
        """Turn away a worker that speaks another version of ``what``, telling it both versions."""
        ours = wire.WIRE_VERSION if what == "wire" else self.settings.protocol
        told = wire.VersionMismatch(what, theirs, ours, peer="the worker", here="the master")
        refusal = Message("error", {"message": f"{told} (worker at {a.address or 'unknown address'})"})
        self.link.send(a.peer, wire.encode(refusal))  # best effort: the peer is no worker
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

    def refuse(self, k: int, why: str, now: float) -> float:
        """Turn worker k's peer away from ``now`` on, for a time that doubles with each of its refusals; that time."""
        who = self.who.get(k, "")
        _, n, _ = self.refused.get(who, (0.0, 0, ""))
        seconds = REFUSED_S * 2**n
        self.refused[who] = (now + seconds, n + 1, why[:200])
        log.warning("worker %d (%s) refused for %g s: %s", k, who or "?", seconds, why)
        return seconds

    def _on_hello(self, a: Arrival, msg: Message) -> list[int]:
        if msg.header["protocol"] != self.settings.protocol:
            self._refuse(a, "task protocol", msg.header["protocol"])
            return []
        until, _, why = self.refused.get(a.key or a.address, (0.0, 0, ""))
        if (left := until - time.monotonic()) > 0:
            told = f"this master refuses this worker for another {left:.0f} s: {why}"
            self.link.send(a.peer, wire.encode(Message("error", {"message": told})))  # best effort: no worker
            self.drops.drop("refused", _label(a), told)
            return []
        secret = self.settings.secret
        if secret is not None and not hmac.compare_digest(msg.header.get("secret", "").encode(), secret.encode()):
            told = f"this master admits only the workers it started or gave its join secret ({SECRET_ENV})"
            self.link.send(a.peer, wire.encode(Message("error", {"message": told})))  # best effort: no worker
            self.drops.drop("secret", _label(a), "a hello without this run's secret")
            return []
        with self.book.cond:
            admitting = self.book.admitting
        if admitting:
            return self._admit(a.peer, msg, a.address, a.key)
        if a.peer in self.pending or len(self.pending) < MAX_PENDING:
            if a.peer not in self.pending:
                log.debug(
                    "holding the hello of a worker at %s (pid %d) until start()", a.address or "?", msg.header["pid"]
                )
            self.pending[a.peer] = _Pending(msg, a.address, time.monotonic(), a.key)
        else:
            self.drops.drop("crowd", _label(a), f"{MAX_PENDING} peers already wait for start()")
        return []

    def _admit(self, peer: Hashable, msg: Message, address: str, key: str = "") -> list[int]:
        """Welcome ``peer`` as a new worker: [its index], or [] if the welcome cannot reach it."""
        h = msg.header
        # The book stays locked from the welcome's send to the worker's entry in it, so that a
        # worker holding its welcome is already in joined() (the send does not block).
        with self.book.cond:
            k = len(self.index) if self.link.group is None else self.link.group.index(peer)
            welcome = self.welcome(k)
            why = self.link.send(peer, welcome)
            if why:  # it said hello, then left: not a worker
                log.info("a worker at %s left before its welcome (%s); not counting it", address or "?", why)
                return []
            self.index[peer], self.peer[k], self.who[k] = k, peer, key or address
            self.book.traffic[k] = [wire.frames_nbytes(welcome), 0]
            self.book.fresh.append(worker_info(k, h, address, key))
            self.book.cond.notify_all()
        log.info("worker %d: %s on %s (%s, pid %d)", k, h["backend"], h["device"].get("device"), address, h["pid"])
        return [k]

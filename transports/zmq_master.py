"""ZeroMQ, the master's side: a ROUTER socket that every worker's DEALER
(:mod:`transports.zmq_worker`) connects to, over ``tcp://`` or ``ipc://``. Messages
are :mod:`transports.wire` frames: arrays travel zero-copy, never pickled.

A zmq socket belongs to one thread, yet the master must keep talking to its
workers while it computes. So one *I/O thread* owns the socket: it admits hellos
of the right task-protocol version, sends welcomes, the tasks :meth:`~ZmqTransport.send`
queued (waking it with a :class:`~transports.wakeup.Wakeup`) and heartbeats, queues
what arrives for :meth:`~ZmqTransport.recv`, and declares a worker lost when
nothing at all came from it for ``peer_timeout_s``.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import zmq

from transports import wire
from transports.base import Message, Transport, WorkerInfo, WorkerLost
from transports.wakeup import Wakeup

log = logging.getLogger(__name__)

SHUTDOWN_LINGER_S = 1.0  # at close, how long queued shutdown messages may take to leave
_JOIN_TIMEOUT_S = SHUTDOWN_LINGER_S + 4.0
_DRAIN_BATCH = 256  # messages read per wake-up before heartbeats get their turn again


def connect_hint(endpoint: str) -> str:
    """The address a worker should connect to, given what the master bound.

    ``tcp://0.0.0.0:5555`` (a wildcard bind) becomes ``tcp://<this host's name>:5555``.
    """
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.hostname in ("0.0.0.0", "*", "::", None):
        return f"tcp://{socket.gethostname()}:{parts.port}"
    return endpoint


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address") or ""
    except (zmq.ZMQError, ValueError, TypeError):  # not every transport knows it (ipc)
        return ""


class ZmqTransport(Transport):
    """Master side: a ROUTER bound at ``bind``, one DEALER per worker.

    ``bind`` is ``tcp://*:5555`` (all interfaces), ``tcp://127.0.0.1:0`` (a free
    port; read :attr:`bound_address`), or ``ipc:///path``. ``protocol`` is the
    version of the task protocol the master speaks: a worker whose hello says
    another is refused, and told why. Arrays handed to :meth:`send` are sent
    without copying, so leave them unmodified until the worker's reply arrives.
    """

    name = "zmq"

    def __init__(
        self,
        bind: str = "tcp://*:5555",
        *,
        protocol: int,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 10.0,
        max_message_bytes: int = wire.DEFAULT_MAX_BYTES,
        **_: Any,
    ) -> None:
        if not wire.Int.accepts(protocol):
            raise TypeError(f"protocol must be an int, the version of the task protocol; got {protocol!r}")
        if not heartbeat_s > 0 or not peer_timeout_s > heartbeat_s:
            raise ValueError(f"need 0 < heartbeat_s < peer_timeout_s, got {heartbeat_s} and {peer_timeout_s}")
        self._protocol = protocol
        self._heartbeat_s = float(heartbeat_s)
        self._peer_timeout_s = float(peer_timeout_s)
        self._max_bytes = int(max_message_bytes)

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker raises, not vanishes
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker that reconnects keeps its identity
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(self._max_bytes, wire.MAX_HEADER_BYTES))  # per frame
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            raise OSError(
                f"cannot bind {bind!r}: {e}; use e.g. tcp://*:5555, tcp://127.0.0.1:0 (a free port) "
                "or ipc:///tmp/workers.sock, and make sure no other process holds the address"
            ) from e
        self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

        self._wakeup = Wakeup()
        self._outbox: queue.Queue[tuple[int, list]] = queue.Queue()
        # I/O thread -> callers: (event, worker index or None, payload)
        self._inbox: queue.Queue[tuple[str, int | None, Any]] = queue.Queue()
        self._lock = threading.Lock()  # guards the fields below, shared with the I/O thread
        self._expected: int | None = None
        self._ids: list[bytes] = []  # worker index -> zmq identity
        self._lost: dict[int, str] = {}
        self._traffic: list[list[int]] = []
        # I/O thread only
        self._index: dict[bytes, int] = {}
        self._pending: list[tuple[bytes, Message, str]] = []  # hellos that arrived before start()
        self._last_seen: list[float] = []
        self._last_sent: list[float] = []
        self._heartbeat_frames = wire.encode(Message("heartbeat"))

        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._closed = False
        self._started = False
        self._thread = threading.Thread(target=self._run, name="zmq-master-io", daemon=True)
        self._thread.start()

    @property
    def bound_address(self) -> str:
        """The endpoint actually bound, e.g. ``tcp://127.0.0.1:41234`` after binding port 0."""
        return self._endpoint

    # ---- the caller's API ------------------------------------------------------------
    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
        with self._lock:
            if self._started or self._closed:
                raise RuntimeError("start() can be called once, on a transport that is not closed")
            self._started = True
            self._expected = n_workers
        self._wakeup.wake()
        deadline = time.monotonic() + timeout
        infos: dict[int, WorkerInfo] = {}
        later = []  # anything else that arrived meanwhile, for recv()
        try:
            while len(infos) < n_workers:
                try:
                    event, k, payload = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(
                        f"only {len(infos)} of {n_workers} workers said hello within {timeout:g} s; "
                        f"start workers that connect to {connect_hint(self._endpoint)}"
                    ) from None
                if event == "hello":
                    infos[k] = payload
                elif event == "refused":
                    raise wire.ProtocolError(f"refused a worker: {payload}")
                else:
                    self._raise_event(event, k, payload, later)
        finally:
            for item in later:
                self._inbox.put(item)
        return [infos[k] for k in range(n_workers)]

    def send(self, worker: int, msg: Message) -> None:
        with self._lock:
            self._check_open("send")
            if not isinstance(worker, int) or not 0 <= worker < len(self._ids):
                raise ValueError(f"no worker {worker!r}; workers are 0..{len(self._ids) - 1}")
            if worker in self._lost:
                raise WorkerLost(worker, self._lost[worker])
        self._outbox.put((worker, wire.encode(msg)))  # encode validates: a bad message fails here, in the caller
        self._wakeup.wake()

    def recv(self, timeout: float) -> tuple[int, Message]:
        self._check_open("recv")
        deadline = time.monotonic() + timeout
        while True:
            try:
                event, k, payload = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no message from any worker within {timeout:g} s") from None
            if event == "message":
                return k, payload
            self._raise_event(event, k, payload)

    def _check_open(self, what: str) -> None:
        if not self._started or self._closed:
            raise RuntimeError(f"{what}() needs a started, open transport")
        if self._failure is not None:
            raise RuntimeError(f"the zmq transport's I/O thread failed: {self._failure!r}") from self._failure

    def _raise_event(self, event: str, k: int | None, payload: Any, later: list | None = None) -> None:
        """Turn an I/O-thread report into the exception the caller should see."""
        if event == "lost":
            raise WorkerLost(k, payload)
        if event == "malformed":
            raise wire.ProtocolError(f"worker {k} sent a malformed message: {payload}")
        if event == "failed":
            raise RuntimeError(f"the zmq transport's I/O thread failed: {payload!r}") from payload
        if event != "refused" and later is not None:  # a late worker refused: _refuse logged it
            later.append((event, k, payload))

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Bytes (sent to, received from) each worker, all frames including heartbeats."""
        with self._lock:
            return {k: (s, r) for k, (s, r) in enumerate(self._traffic)}

    def close(self) -> None:
        """Send ``shutdown`` to every worker, stop the I/O thread, release the sockets. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wakeup.wake()
        self._thread.join(timeout=_JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # never seen; term() would wait on its socket, so leave it
            log.error("zmq I/O thread did not stop within %.0f s", _JOIN_TIMEOUT_S)
        else:
            self._ctx.term()
        self._wakeup.close()

    # ---- the I/O thread ------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.fileno(), zmq.POLLIN)
        tick_ms = max(1, int(self._heartbeat_s * 250))  # a quarter heartbeat: timers stay accurate
        linger_ms = 0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(tick_ms))
                if self._wakeup.fileno() in ready:
                    self._wakeup.drain()
                self._flush_outbox()
                if self._sock in ready:
                    self._drain_socket()
                self._tick()
            self._flush_outbox()  # tasks sent just before close() still go first
            self._say_goodbye()
            linger_ms = int(SHUTDOWN_LINGER_S * 1000)
        except BaseException as e:  # report, never die silently: send()/recv() raise it in the caller
            log.exception("zmq I/O thread failed")
            self._failure = e
            self._inbox.put(("failed", None, e))
        finally:
            self._sock.close(linger=linger_ms)

    def _flush_outbox(self) -> None:
        while True:
            try:
                k, frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send_to(k, frames)

    def _send_to(self, k: int, frames: list) -> None:
        with self._lock:
            if k in self._lost:
                return
            identity = self._ids[k]
        try:
            self._sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._mark_lost(k, "its queue is full: the worker stopped reading")
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._mark_lost(k, "disconnected")
            return
        self._last_sent[k] = time.monotonic()
        with self._lock:
            self._traffic[k][0] += wire.frames_nbytes(frames)

    def _send_raw(self, identity: bytes, msg: Message) -> None:
        """Best effort to a peer that is not (or not yet) a worker."""
        try:
            self._sock.send_multipart([identity, *wire.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _mark_lost(self, k: int, reason: str) -> None:
        with self._lock:
            if k in self._lost:
                return
            self._lost[k] = reason
        log.warning("worker %d lost: %s", k, reason)
        self._inbox.put(("lost", k, reason))

    def _drain_socket(self) -> None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, body = frames[0].bytes, frames[1:]
            k = self._index.get(identity)
            if k is not None:
                self._last_seen[k] = time.monotonic()
                with self._lock:
                    self._traffic[k][1] += wire.frames_nbytes(body)
            try:
                msg = wire.decode(body, self._max_bytes)
            except wire.ProtocolError as e:
                self._on_bad_frames(identity, k, body, e)
                continue
            if k is not None:
                self._on_message(k, msg)
            elif msg.kind == "hello":
                self._on_hello(identity, msg, _peer_address(body[0]) if body else "")
            # else: a stray peer (say, a worker of an earlier master) that never said hello: ignore

    def _on_message(self, k: int, msg: Message) -> None:
        """A message from worker k: replies and errors go to recv(); the session's own kinds stop here."""
        if msg.kind not in wire.SESSION_KINDS or msg.kind == "error":
            self._inbox.put(("message", k, msg))
        elif msg.kind in ("welcome", "shutdown"):
            log.warning("worker %d sent %r, which only a master sends; ignored", k, msg.kind)
        # heartbeat: _last_seen is updated; hello: a repeat of the one that admitted it

    def _on_bad_frames(self, identity: bytes, k: int | None, body: list, e: wire.ProtocolError) -> None:
        if k is None:
            peer = (_peer_address(body[0]) if body else "") or "unknown address"
            if isinstance(e, wire.VersionMismatch):  # a real worker of another version: the user must know
                self._refuse(identity, e.what, e.theirs, e.ours, peer)
            else:  # not one of our workers, or a broken one: tell it, but it is not ours to fail over
                log.warning("ignoring an unreadable message from %s: %s", peer, e)
                self._send_raw(identity, Message("error", {"message": f"unreadable message: {e}"}))
        else:
            self._send_raw(identity, wire.error_reply(None, f"the master could not read your message: {e}"))
            self._inbox.put(("malformed", k, str(e)))

    def _refuse(self, identity: bytes, what: str, theirs: object, ours: int, peer: str) -> None:
        """Turn away a worker that speaks another version of ``what``; it and the caller learn both versions."""
        mismatch = wire.VersionMismatch(what, theirs, ours, peer="the worker", here="the master")
        text = f"{mismatch} (worker at {peer or 'unknown address'})"
        log.error("refusing a worker: %s", text)
        self._send_raw(identity, Message("error", {"message": text}))
        self._inbox.put(("refused", None, text))

    def _on_hello(self, identity: bytes, msg: Message, peer: str) -> None:
        if msg.header["protocol"] != self._protocol:
            self._refuse(identity, "task protocol", msg.header["protocol"], self._protocol, peer)
            return
        with self._lock:
            expected, admitted = self._expected, len(self._ids)
        if expected is None:
            if all(identity != p[0] for p in self._pending):
                self._pending.append((identity, msg, peer))
        elif admitted < expected:
            self._admit(identity, msg, peer)
        else:
            log.warning("a worker at %s said hello, but all %d workers are already here", peer, expected)
            text = f"this master already has all {expected} workers it wanted"
            self._send_raw(identity, Message("error", {"message": text}))

    def _admit(self, identity: bytes, msg: Message, peer: str) -> None:
        h = msg.header
        with self._lock:
            k = len(self._ids)
        welcome = wire.encode(Message("welcome", {"index": k, "heartbeat_s": self._heartbeat_s}))
        try:
            self._sock.send_multipart([identity, *welcome], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # it said hello, then left (before start(), say): not a worker
            log.warning("a worker at %s left before its welcome (%s); not counting it", peer, e)
            return
        now = time.monotonic()
        with self._lock:  # only this thread appends, so k is still the next index
            self._ids.append(identity)
            self._traffic.append([wire.frames_nbytes(welcome), 0])
        self._index[identity] = k
        self._last_seen.append(now)
        self._last_sent.append(now)
        info = WorkerInfo(k, h["backend"], h["device"], address=peer, hostname=h["hostname"], pid=h["pid"])
        log.info("worker %d: %s on %s (%s, pid %d)", k, h["backend"], h["device"].get("device"), peer, h["pid"])
        self._inbox.put(("hello", k, info))

    def _tick(self) -> None:
        """Admit early hellos once start() said how many, send heartbeats, spot silent workers."""
        with self._lock:
            expected = self._expected
        if expected is not None and self._pending:
            pending, self._pending = self._pending, []
            for identity, msg, peer in pending:
                self._on_hello(identity, msg, peer)
        now = time.monotonic()
        for k in range(len(self._last_seen)):
            silent = now - self._last_seen[k]
            if silent > self._peer_timeout_s:
                self._mark_lost(k, f"silent for {silent:.1f} s (peer timeout {self._peer_timeout_s:g} s)")
            elif now - self._last_sent[k] >= self._heartbeat_s:
                self._send_to(k, self._heartbeat_frames)

    def _say_goodbye(self) -> None:
        """The paper's "train over" flag: every worker, admitted or still waiting, may exit."""
        frames = wire.encode(Message("shutdown", {"reason": "train over"}))
        for k in range(len(self._last_seen)):
            self._send_to(k, frames)
        for identity, _msg, _peer in self._pending:
            self._send_raw(identity, Message("shutdown", {"reason": "train over"}))

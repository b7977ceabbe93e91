"""ZeroMQ transport: the master binds a ROUTER socket, every worker connects a DEALER.

Works over ``tcp://`` across machines and ``ipc://`` on one machine. Messages are
:mod:`transports.wire` frames, so arrays travel zero-copy and are never pickled.

Threads and sockets. A zmq socket must only be used by one thread, yet both sides
must keep talking while something else is busy: the master while it computes the
layers it keeps, a worker while a long convolution runs. So on each side one
*I/O thread* owns the socket and does nothing but move messages and heartbeats;
the other thread hands it work through a queue and wakes it through a
``socket.socketpair`` (which zmq can poll next to its own socket).

* Master (:class:`ZmqTransport`): the I/O thread admits hellos, sends welcomes,
  queued tasks and heartbeats (to any worker it has sent nothing to for
  ``heartbeat_s``), and declares a worker lost when nothing at all came from it
  for ``peer_timeout_s``. ``recv`` reads what it queued and raises
  :class:`WorkerLost` or :class:`ProtocolError` when it reported one.
* Worker (:func:`serve`): the calling thread is the I/O loop; the handler runs in
  a compute thread. The worker exits cleanly on ``shutdown`` and with a message
  when the master refuses it, never welcomes it, or goes silent.
"""

from __future__ import annotations

import logging
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import zmq

from transports.base import PROTOCOL_VERSION, Handler, Message, Transport, WorkerInfo, WorkerLost
from transports.wire import (
    DEFAULT_MAX_BYTES,
    MAX_HEADER_BYTES,
    ProtocolError,
    VersionMismatch,
    call_handler,
    decode,
    encode,
    error_reply,
    frames_nbytes,
)

log = logging.getLogger(__name__)

EXIT_OK = 0  # the master said shutdown
EXIT_FAILED = 1  # refused, never welcomed, master gone, bad address
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM / the stop event

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


def _wake(sock: socket.socket) -> None:
    """Nudge an I/O thread out of its poll. A full buffer already means 'awake'."""
    try:
        sock.send(b"\0")
    except (BlockingIOError, OSError):
        pass


def _drain_wake(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _wake_pair() -> tuple[socket.socket, socket.socket]:
    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    return r, w


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address") or ""
    except (zmq.ZMQError, ValueError, TypeError):  # not every transport knows it (ipc)
        return ""


class ZmqTransport(Transport):
    """Master side: a ROUTER bound at ``bind``, one DEALER per worker.

    ``bind`` is ``tcp://*:5555`` (all interfaces), ``tcp://127.0.0.1:0`` (a free
    port; read :attr:`bound_address`), or ``ipc:///path``. Workers connect with
    ``tinyconv worker --connect <address>``. Arrays handed to :meth:`send` are sent
    without copying, so leave them unmodified until the worker's reply arrives.
    """

    name = "zmq"

    def __init__(
        self,
        bind: str = "tcp://*:5555",
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 10.0,
        max_message_bytes: int = DEFAULT_MAX_BYTES,
        **_: Any,
    ) -> None:
        if not heartbeat_s > 0 or not peer_timeout_s > heartbeat_s:
            raise ValueError(
                f"need 0 < heartbeat_s < peer_timeout_s, got heartbeat_s={heartbeat_s}, "
                f"peer_timeout_s={peer_timeout_s}"
            )
        self._heartbeat_s = float(heartbeat_s)
        self._peer_timeout_s = float(peer_timeout_s)
        self._max_bytes = int(max_message_bytes)

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker raises, not vanishes
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker that reconnects keeps its identity
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(self._max_bytes, MAX_HEADER_BYTES))  # per frame
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            raise OSError(
                f"cannot bind {bind!r}: {e}; use e.g. tcp://*:5555, tcp://127.0.0.1:0 (a free port) "
                "or ipc:///tmp/tinyconv.sock, and make sure no other process holds the address"
            ) from e
        self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

        self._wake_r, self._wake_w = _wake_pair()
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
        self._heartbeat_frames = encode(Message("heartbeat"))

        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._closed = False
        self._started = False
        self._thread = threading.Thread(target=self._run, name="tinyconv-zmq-master", daemon=True)
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
        _wake(self._wake_w)
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
                        f"start workers with: tinyconv worker --connect {connect_hint(self._endpoint)} "
                        "--backend numpy"
                    ) from None
                if event == "hello":
                    infos[k] = payload
                elif event == "refused":
                    raise ProtocolError(f"refused a worker: {payload}")
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
        self._outbox.put((worker, encode(msg)))  # encode validates: a bad message fails here, in the caller
        _wake(self._wake_w)

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
            raise ProtocolError(f"worker {k} sent a malformed message: {payload}")
        if event == "failed":
            raise RuntimeError(f"the zmq transport's I/O thread failed: {payload!r}") from payload
        if event == "refused":  # a late worker of another version; the pool is unaffected
            log.error("refused a worker: %s", payload)
            return
        if later is not None:
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
        _wake(self._wake_w)
        self._thread.join(timeout=_JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # never seen; term() would wait on its socket, so leave it
            log.error("zmq I/O thread did not stop within %.0f s", _JOIN_TIMEOUT_S)
        else:
            self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    # ---- the I/O thread ------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        tick_ms = max(1, int(self._heartbeat_s * 250))  # a quarter heartbeat: timers stay accurate
        linger_ms = 0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(tick_ms))
                if self._wake_r.fileno() in ready:
                    _drain_wake(self._wake_r)
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
            self._traffic[k][0] += frames_nbytes(frames)

    def _send_raw(self, identity: bytes, msg: Message) -> None:
        """Best effort to a peer that is not (or not yet) a worker."""
        try:
            self._sock.send_multipart([identity, *encode(msg)], flags=zmq.NOBLOCK)
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
                    self._traffic[k][1] += frames_nbytes(body)
            try:
                msg = decode(body, self._max_bytes)
            except ProtocolError as e:
                self._on_bad_frames(identity, k, body, e)
                continue
            if k is not None:
                if msg.kind not in ("heartbeat", "hello"):
                    self._inbox.put(("message", k, msg))
            elif msg.kind == "hello":
                self._on_hello(identity, msg, _peer_address(body[0]) if body else "")
            # else: a stray peer (say, a worker of an earlier master) that never said hello: ignore

    def _on_bad_frames(self, identity: bytes, k: int | None, body: list, e: ProtocolError) -> None:
        if k is None:
            peer = _peer_address(body[0]) if body else "unknown address"
            if isinstance(e, VersionMismatch):  # a real worker of another version: the user must know
                self._refuse(identity, f"{e} (worker at {peer})")
            else:  # not a tinyconv worker, or a broken one: tell it, but it is not ours to fail over
                log.warning("ignoring an unreadable message from %s: %s", peer, e)
                self._send_raw(identity, Message("error", {"message": f"unreadable message: {e}"}))
        else:
            self._send_raw(identity, error_reply(None, f"the master could not read your message: {e}"))
            self._inbox.put(("malformed", k, str(e)))

    def _refuse(self, identity: bytes, text: str) -> None:
        log.error("refusing a worker: %s", text)
        self._send_raw(identity, Message("error", {"message": text}))
        self._inbox.put(("refused", None, text))

    def _on_hello(self, identity: bytes, msg: Message, peer: str) -> None:
        if msg.header["protocol"] != PROTOCOL_VERSION:
            err = VersionMismatch(msg.header["protocol"])
            self._refuse(identity, f"{err} (worker at {peer or 'unknown address'})")
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
            self._send_raw(
                identity,
                Message("error", {"message": f"this master already has all {expected} workers it wanted"}),
            )

    def _admit(self, identity: bytes, msg: Message, peer: str) -> None:
        h = msg.header
        with self._lock:
            k = len(self._ids)
        welcome = encode(Message("welcome", {"index": k, "heartbeat_s": self._heartbeat_s}))
        try:
            self._sock.send_multipart([identity, *welcome], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # it said hello, then left (before start(), say): not a worker
            log.warning("a worker at %s left before its welcome (%s); not counting it", peer, e)
            return
        now = time.monotonic()
        with self._lock:  # only this thread appends, so k is still the next index
            self._ids.append(identity)
            self._traffic.append([frames_nbytes(welcome), 0])
        self._index[identity] = k
        self._last_seen.append(now)
        self._last_sent.append(now)
        info = WorkerInfo(
            index=k,
            backend=h["backend"],
            device=h["device"],
            address=peer,
            hostname=h["hostname"],
            pid=h["pid"],
        )
        log.info(
            "worker %d: %s on %s (%s, pid %d)", k, h["backend"], h["device"].get("device"), peer, h["pid"]
        )
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
        frames = encode(Message("shutdown", {"reason": "train over"}))
        for k in range(len(self._last_seen)):
            self._send_to(k, frames)
        for identity, _msg, _peer in self._pending:
            self._send_raw(identity, Message("shutdown", {"reason": "train over"}))


# ---- the worker side ------------------------------------------------------------------------


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _compute_loop(
    handler: Handler, tasks: queue.Queue, results: queue.Queue, wake: socket.socket, done: threading.Event
) -> None:
    """The worker's compute thread: run tasks one by one, hand replies to the I/O loop."""
    while not done.is_set():
        try:
            msg = tasks.get(timeout=0.5)  # the timeout only lets it notice `done`
        except queue.Empty:
            continue
        if msg is None:  # the I/O loop is finishing
            return
        reply = call_handler(handler, msg)
        if reply is not None:
            results.put(reply)
            _wake(wake)


def serve(
    connect: str,
    handler: Handler,
    heartbeat_s: float = 1.0,
    peer_timeout_s: float = 10.0,
    welcome_timeout_s: float = 60.0,
    max_message_bytes: int = DEFAULT_MAX_BYTES,
    stop: threading.Event | None = None,
    log_line: Callable[[str], None] = _stderr,
    quiet: bool = False,
) -> int:
    """Serve ``handler`` to the master at ``connect`` until it says shutdown; return an exit code.

    Sends ``hello`` (``handler.hello()``), waits up to ``welcome_timeout_s`` for the
    welcome, then serves. A heartbeat goes out after ``heartbeat_s`` without
    sending (or sooner, if the welcome asks for a faster pace), also while a task
    computes.

    Returns :data:`EXIT_OK` on shutdown; :data:`EXIT_FAILED` when refused, never
    welcomed, or when the master was silent for ``peer_timeout_s``;
    :data:`EXIT_INTERRUPTED` when ``stop`` is set or on Ctrl-C. Problems are
    reported through ``log_line``, one line each; ``quiet`` drops the
    informational lines.
    """
    info = (lambda line: None) if quiet else log_line
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max(int(max_message_bytes), MAX_HEADER_BYTES))
    wake_r, wake_w = _wake_pair()
    done = threading.Event()
    tasks: queue.Queue[Message | None] = queue.Queue()
    results: queue.Queue[Message] = queue.Queue()
    compute: threading.Thread | None = None
    try:
        try:
            sock.connect(connect)
        except zmq.ZMQError as e:
            log_line(f"cannot connect to {connect!r}: {e}; expected tcp://HOST:PORT or ipc:///path")
            return EXIT_FAILED
        try:
            hello = encode(Message("hello", handler.hello()))
        except ProtocolError as e:
            log_line(f"this worker's hello does not follow the protocol: {e}")
            return EXIT_FAILED
        sock.send_multipart(hello, flags=zmq.NOBLOCK, copy=False)

        welcome = _await_welcome(sock, connect, welcome_timeout_s, max_message_bytes, stop, log_line)
        if isinstance(welcome, int):
            return welcome
        master_heartbeat_s = float(welcome.header["heartbeat_s"])
        heartbeat_s = min(heartbeat_s, master_heartbeat_s)  # never quieter than the master expects
        # never give up on the master between two of its heartbeats
        peer_timeout_s = max(peer_timeout_s, 3 * master_heartbeat_s)
        info(f"worker {welcome.header['index']} serving the master at {connect}")

        compute = threading.Thread(
            target=_compute_loop,
            args=(handler, tasks, results, wake_w, done),
            name="tinyconv-compute",
            daemon=True,
        )
        compute.start()
        return _io_loop(
            sock, wake_r, tasks, results, heartbeat_s, peer_timeout_s, max_message_bytes, stop, log_line, info
        )
    except KeyboardInterrupt:
        log_line("interrupted; worker stopping")
        return EXIT_INTERRUPTED
    finally:
        done.set()
        tasks.put(None)
        if compute is not None:
            compute.join(timeout=1.0)  # a daemon: if a task is still running it ends with the process
        sock.close(linger=0)
        ctx.term()  # only this thread ever touched zmq, so this cannot wait on another thread
        wake_r.close()
        wake_w.close()


def _await_welcome(
    sock: zmq.Socket,
    connect: str,
    timeout: float,
    max_bytes: int,
    stop: threading.Event | None,
    log_line: Callable[[str], None],
) -> Message | int:
    """The master's welcome, or the exit code to return."""
    deadline = time.monotonic() + timeout
    while True:
        if stop is not None and stop.is_set():
            return EXIT_INTERRUPTED
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            log_line(
                f"no welcome from a master at {connect} within {timeout:g} s; is the master running, "
                "waiting for workers, and reachable from this machine?"
            )
            return EXIT_FAILED
        if not sock.poll(int(min(remaining, 0.25) * 1000) + 1):  # short slices: notice `stop`
            continue
        try:
            msg = decode(sock.recv_multipart(copy=False), max_bytes)
        except VersionMismatch as e:
            log_line(f"the master at {connect} refused this worker: {e}")
            return EXIT_FAILED
        except ProtocolError as e:
            log_line(f"the master at {connect} sent a malformed reply to hello: {e}")
            return EXIT_FAILED
        if msg.kind == "welcome":
            return msg
        if msg.kind == "error":
            log_line(f"the master at {connect} refused this worker: {msg.header['message']}")
            return EXIT_FAILED
        if msg.kind == "shutdown":
            log_line(
                f"the master at {connect} shut down before welcoming this worker ({msg.header['reason']})"
            )
            return EXIT_OK


def _io_loop(
    sock: zmq.Socket,
    wake_r: socket.socket,
    tasks: queue.Queue,
    results: queue.Queue,
    heartbeat_s: float,
    peer_timeout_s: float,
    max_bytes: int,
    stop: threading.Event | None,
    log_line: Callable[[str], None],
    info: Callable[[str], None],
) -> int:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake_r.fileno(), zmq.POLLIN)
    tick_ms = max(1, int(heartbeat_s * 250))
    heartbeat = encode(Message("heartbeat"))
    last_heard = last_sent = time.monotonic()

    def send(frames: list) -> None:
        nonlocal last_sent
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            last_sent = time.monotonic()
        except zmq.Again:  # the pipe to the master is full: it is not reading; the timeout will tell
            log_line("the master is not reading; dropped a message")

    while True:
        if stop is not None and stop.is_set():
            info("stop requested; worker stopping")
            return EXIT_INTERRUPTED
        ready = dict(poller.poll(tick_ms))
        if wake_r.fileno() in ready:
            _drain_wake(wake_r)
        while True:
            try:
                reply = results.get_nowait()
            except queue.Empty:
                break
            try:
                frames = encode(reply)
            except ProtocolError as e:  # e.g. a numpy scalar deep in a header: report, keep serving
                frames = encode(error_reply(reply, f"the worker produced an unsendable reply: {e}"))
            send(frames)
        if sock in ready:
            for _ in range(_DRAIN_BATCH):
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                last_heard = time.monotonic()
                try:
                    msg = decode(frames, max_bytes)
                except ProtocolError as e:
                    log_line(f"bad message from the master: {e}")
                    send(encode(error_reply(None, f"bad message: {e}")))
                    continue
                if msg.kind in ("calibrate", "conv_forward", "conv_backward"):
                    tasks.put(msg)
                elif msg.kind == "shutdown":
                    info(f"shutdown: {msg.header['reason']}")
                    return EXIT_OK
                elif msg.kind == "error":
                    log_line(f"the master reports: {msg.header['message']}")
                elif msg.kind not in ("heartbeat", "welcome"):
                    send(encode(error_reply(msg, f"a worker does not accept {msg.kind!r} messages")))
        now = time.monotonic()
        if now - last_heard > peer_timeout_s:
            log_line(f"master went away: nothing heard for {now - last_heard:.1f} s; worker exiting")
            return EXIT_FAILED
        if now - last_sent >= heartbeat_s:
            send(heartbeat)

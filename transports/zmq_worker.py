"""ZeroMQ, the worker's side: a DEALER that connects to the master's ROUTER and serves a handler.

:func:`serve` says hello (``handler.hello()``), waits for the welcome, then runs
two threads: the calling thread is the *I/O loop*, the only one that touches the
socket, and a compute thread runs ``handler.handle`` on one task at a time. So
heartbeats keep flowing while a long task computes. Every message whose kind is
not a session kind (:data:`transports.wire.SESSION_KINDS`) is a task for the
handler; the session kinds are the transport's business. The worker exits
cleanly on ``shutdown``, and with a one-line message when the master refuses it,
never welcomes it, or goes silent.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from transports import wire
from transports.base import Handler, Message
from transports.wakeup import Wakeup

EXIT_OK = 0  # the master said shutdown
EXIT_FAILED = 1  # refused, never welcomed, master gone, bad address
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM / the stop event

_DRAIN_BATCH = 256  # messages read per wake-up before heartbeats get their turn again
_POLL_SLICE_S = 0.25  # while waiting for the welcome, how often to look at the stop event


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def serve(
    connect: str,
    handler: Handler,
    heartbeat_s: float = 1.0,
    peer_timeout_s: float = 10.0,
    welcome_timeout_s: float = 60.0,
    max_message_bytes: int = wire.DEFAULT_MAX_BYTES,
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
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    wakeup = Wakeup()
    done = threading.Event()
    tasks: queue.Queue[Message | None] = queue.Queue()
    results: queue.Queue[Message] = queue.Queue()
    compute = threading.Thread(
        target=_compute_loop, args=(handler, tasks, results, wakeup, done), name="worker-compute", daemon=True
    )
    try:
        if not _say_hello(sock, connect, handler, max_message_bytes, log_line):
            return EXIT_FAILED
        welcome = _await_welcome(sock, connect, welcome_timeout_s, max_message_bytes, stop, log_line)
        if isinstance(welcome, int):
            return welcome
        master_heartbeat_s = float(welcome.header["heartbeat_s"])
        loop = _ServeLoop(
            sock,
            wakeup,
            tasks,
            results,
            heartbeat_s=min(heartbeat_s, master_heartbeat_s),  # never quieter than the master expects
            peer_timeout_s=max(peer_timeout_s, 3 * master_heartbeat_s),  # nor give up between its heartbeats
            max_bytes=max_message_bytes,
            stop=stop,
            log_line=log_line,
            quiet=quiet,
        )
        loop.info(f"worker {welcome.header['index']} serving the master at {connect}")
        compute.start()
        return loop.run()
    except KeyboardInterrupt:
        log_line("interrupted; worker stopping")
        return EXIT_INTERRUPTED
    finally:
        done.set()
        tasks.put(None)
        if compute.is_alive():
            compute.join(timeout=1.0)  # a daemon: if a task is still running it ends with the process
        sock.close(linger=0)
        ctx.term()  # only this thread ever touched zmq, so this cannot wait on another thread
        wakeup.close()


def _say_hello(
    sock: zmq.Socket, connect: str, handler: Handler, max_bytes: int, log_line: Callable[[str], None]
) -> bool:
    """Connect and send the hello; False (the reason logged) when that cannot be done."""
    sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max(int(max_bytes), wire.MAX_HEADER_BYTES))
    try:
        sock.connect(connect)
    except zmq.ZMQError as e:
        log_line(f"cannot connect to {connect!r}: {e}; expected tcp://HOST:PORT or ipc:///path")
        return False
    try:
        hello = wire.encode(Message("hello", handler.hello()))
    except Exception as e:  # a ProtocolError, or the handler's own failure
        log_line(f"this worker cannot say hello: {type(e).__name__}: {e}")
        return False
    sock.send_multipart(hello, flags=zmq.NOBLOCK, copy=False)
    return True


def _compute_loop(
    handler: Handler, tasks: queue.Queue, results: queue.Queue, wakeup: Wakeup, done: threading.Event
) -> None:
    """The worker's compute thread: run tasks one by one, hand replies to the I/O loop."""
    while not done.is_set():
        try:
            msg = tasks.get(timeout=0.5)  # the timeout only lets it notice `done`
        except queue.Empty:
            continue
        if msg is None:  # the I/O loop is finishing
            return
        reply = wire.call_handler(handler, msg)
        if reply is not None:
            results.put(reply)
            wakeup.wake()


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
        if not sock.poll(int(min(remaining, _POLL_SLICE_S) * 1000) + 1):
            continue
        try:
            msg = wire.decode(sock.recv_multipart(copy=False), max_bytes)
        except wire.VersionMismatch as e:
            mismatch = wire.VersionMismatch(e.what, e.theirs, e.ours, peer="the master", here="this worker")
            log_line(f"cannot talk to the master at {connect}: {mismatch}")
            return EXIT_FAILED
        except wire.ProtocolError as e:
            log_line(f"the master at {connect} sent a malformed reply to hello: {e}")
            return EXIT_FAILED
        if msg.kind == "welcome":
            return msg
        if msg.kind == "error":
            log_line(f"the master at {connect} refused this worker: {msg.header['message']}")
            return EXIT_FAILED
        if msg.kind == "shutdown":
            log_line(f"the master at {connect} shut down before welcoming this worker ({msg.header['reason']})")
            return EXIT_OK


class _ServeLoop:
    """The I/O loop once welcomed: tasks in, replies and heartbeats out, until shutdown."""

    def __init__(
        self,
        sock: zmq.Socket,
        wakeup: Wakeup,
        tasks: queue.Queue,
        results: queue.Queue,
        heartbeat_s: float,
        peer_timeout_s: float,
        max_bytes: int,
        stop: threading.Event | None,
        log_line: Callable[[str], None],
        quiet: bool,
    ) -> None:
        self.sock, self.wakeup, self.tasks, self.results = sock, wakeup, tasks, results
        self.heartbeat_s, self.peer_timeout_s, self.max_bytes = heartbeat_s, peer_timeout_s, max_bytes
        self.stop, self.log_line = stop, log_line
        self.info: Callable[[str], None] = (lambda line: None) if quiet else log_line
        self.heartbeat = wire.encode(Message("heartbeat"))
        self.last_heard = self.last_sent = time.monotonic()

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wakeup.fileno(), zmq.POLLIN)
        tick_ms = max(1, int(self.heartbeat_s * 250))  # a quarter heartbeat: timers stay accurate
        while True:
            if self.stop is not None and self.stop.is_set():
                self.info("stop requested; worker stopping")
                return EXIT_INTERRUPTED
            ready = dict(poller.poll(tick_ms))
            if self.wakeup.fileno() in ready:
                self.wakeup.drain()
            self._send_results()
            code = self._drain_socket() if self.sock in ready else None
            if code is None:
                code = self._tick()
            if code is not None:
                return code

    def _send(self, frames: list) -> None:
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self.last_sent = time.monotonic()
        except zmq.Again:  # the pipe to the master is full: it is not reading; the timeout will tell
            self.log_line("the master is not reading; dropped a message")

    def _send_results(self) -> None:
        while True:
            try:
                reply = self.results.get_nowait()
            except queue.Empty:
                return
            try:
                frames = wire.encode(reply)
            except wire.ProtocolError as e:  # call_handler checked it; a handler that changed it since: report
                frames = wire.encode(wire.error_reply(reply, f"the worker produced an unsendable reply: {e}"))
            self._send(frames)

    def _drain_socket(self) -> int | None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            self.last_heard = time.monotonic()
            try:
                msg = wire.decode(frames, self.max_bytes)
            except wire.ProtocolError as e:
                self.log_line(f"bad message from the master: {e}")
                self._send(wire.encode(wire.error_reply(None, f"bad message: {e}")))
                continue
            code = self._on_message(msg)
            if code is not None:
                return code
        return None

    def _on_message(self, msg: Message) -> int | None:
        """A task goes to the compute thread; the session's own kinds are handled here."""
        if msg.kind not in wire.SESSION_KINDS:
            self.tasks.put(msg)
        elif msg.kind == "shutdown":
            self.info(f"shutdown: {msg.header['reason']}")
            return EXIT_OK
        elif msg.kind == "error":
            self.log_line(f"the master reports: {msg.header['message']}")
        elif msg.kind == "hello":
            self._send(wire.encode(wire.error_reply(msg, "a worker does not accept 'hello' messages")))
        return None  # heartbeat, or a repeated welcome: last_heard is all they change

    def _tick(self) -> int | None:
        now = time.monotonic()
        if now - self.last_heard > self.peer_timeout_s:
            self.log_line(f"master went away: nothing heard for {now - self.last_heard:.1f} s; worker exiting")
            return EXIT_FAILED
        if now - self.last_sent >= self.heartbeat_s:
            self._send(self.heartbeat)
        return None

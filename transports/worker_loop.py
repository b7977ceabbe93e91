"""A ZeroMQ worker's two threads while it serves one master (:func:`transports.zmq_worker.serve` runs them).

* :class:`Compute`, the compute thread, makes every call into the handler
  (``hello()`` and ``handle(msg)``), one at a time, so heartbeats keep flowing while a
  long task computes. Each call is tagged with the *session* (one per master) it is
  for: a result that comes back after its master is gone is dropped, never sent to
  the next master.
* :class:`ServeLoop`, the I/O loop once a master welcomed the worker: the only code
  that touches the socket; tasks in, replies and heartbeats out, until the master
  says shutdown or goes silent.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from transports import wire
from transports.base import Handler, Message
from transports.wakeup import Wakeup

EXIT_OK = 0  # the master said shutdown
EXIT_FAILED = 1  # refused, never welcomed, master gone for good, bad address
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM / the stop event
MASTER_LOST = -1  # not an exit code: the master went silent; look for one again

_DRAIN_BATCH = 256  # messages read per wake-up before heartbeats get their turn again
_IDLE_POLL_S = 0.5  # how often an idle compute thread looks whether the worker is done


@dataclass
class Hello:
    """What the compute thread made of ``handler.hello()``: the encoded hello, or why there is none."""

    frames: list | None
    problem: str = ""


class Compute:
    """The compute thread: the handler's calls, in order, each tagged with its session."""

    def __init__(self, handler: Handler, wakeup: Wakeup) -> None:
        self.handler, self.wakeup = handler, wakeup
        self.tasks: queue.Queue[tuple[int, Message | None] | None] = queue.Queue()  # None: stop
        self.results: queue.Queue[tuple[int, Message | Hello]] = queue.Queue()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="worker-compute", daemon=True)
        self.thread.start()

    def submit(self, session: int, msg: Message | None) -> None:
        """A task of ``session``'s master, or None: say hello to a new master."""
        self.tasks.put((session, msg))

    def forget(self) -> None:
        """Drop the tasks not yet started: their master is gone."""
        try:
            while True:
                self.tasks.get_nowait()
        except queue.Empty:
            pass

    def take(self, session: int) -> list[Message | Hello]:
        """What the thread has finished for ``session``; results of earlier sessions are dropped."""
        out = []
        while True:
            try:
                tag, result = self.results.get_nowait()
            except queue.Empty:
                return out
            if tag == session:
                out.append(result)

    def stop(self) -> None:
        self.done.set()
        self.tasks.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout=1.0)  # a daemon: if a task is still running it ends with the process

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                item = self.tasks.get(timeout=_IDLE_POLL_S)  # the timeout only lets it notice `done`
            except queue.Empty:
                continue
            if item is None:
                return
            session, msg = item
            result = self._hello() if msg is None else wire.call_handler(self.handler, msg)
            if result is not None:
                self.results.put((session, result))
                self.wakeup.wake()

    def _hello(self) -> Hello:
        try:
            return Hello(wire.encode(Message("hello", self.handler.hello())))
        except Exception as e:  # a ProtocolError, or the handler's own failure
            return Hello(None, f"this worker cannot say hello: {type(e).__name__}: {e}")


class ServeLoop:
    """The I/O loop once welcomed: tasks in, replies and heartbeats out, until shutdown.

    :meth:`run` returns EXIT_OK on the master's shutdown, MASTER_LOST when it was silent
    for ``peer_timeout_s``, EXIT_INTERRUPTED when ``stop`` is set.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        compute: Compute,
        session: int,
        *,
        heartbeat_s: float,
        peer_timeout_s: float,
        max_bytes: int,
        stop: threading.Event | None,
        log_line: Callable[[str], None],
        info: Callable[[str], None],
    ) -> None:
        self.sock, self.compute, self.session = sock, compute, session
        self.heartbeat_s, self.peer_timeout_s, self.max_bytes = heartbeat_s, peer_timeout_s, max_bytes
        self.stop, self.log_line, self.info = stop, log_line, info
        self.heartbeat = wire.encode(Message("heartbeat"))
        self.last_heard = self.last_sent = time.monotonic()
        self.complained = False

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.compute.wakeup.fileno(), zmq.POLLIN)
        tick_ms = max(1, int(self.heartbeat_s * 250))  # a quarter heartbeat: timers stay accurate
        while True:
            if self.stop is not None and self.stop.is_set():
                self.info("stop requested; worker stopping")
                return EXIT_INTERRUPTED
            ready = dict(poller.poll(tick_ms))
            if self.compute.wakeup.fileno() in ready:
                self.compute.wakeup.drain()
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
        except zmq.Again:  # the pipe to the master is full: the timeout will tell
            if not self.complained:
                self.log_line("the master is not reading; dropping messages to it")
                self.complained = True

    def _send_results(self) -> None:
        for reply in self.compute.take(self.session):
            if not isinstance(reply, Message):  # a hello made for this session: the welcome already came
                continue
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
            self.compute.submit(self.session, msg)
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
            self.log_line(f"lost the master: nothing heard for {now - self.last_heard:.1f} s")
            return MASTER_LOST
        if now - self.last_sent >= self.heartbeat_s:
            self._send(self.heartbeat)
        return None

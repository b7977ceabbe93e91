"""The worker's session, over any :class:`~transports.session.link.WorkerLink`: its two threads while it
serves one master, and what the master's first answer to its hello means.

* :class:`Compute`, the compute thread, makes every call into the handler (``hello()`` and
  ``handle(msg)``), one at a time, so heartbeats keep flowing while a long task computes. Each
  call is tagged with the *session* (one per master) it is for: a result that comes back after
  its master is gone is dropped, never sent to the next master.
* :func:`answer_to_hello` reads what a master sends a worker that waits for its welcome, and
  :func:`await_welcome` waits for it on a link that needs no search (a fixed peer, MPI's rank 0).
* :class:`Serving`, the I/O loop once a master welcomed the worker: the only code that calls
  the link; tasks in, replies and heartbeats out, until the master says shutdown, goes silent
  or goes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from transports import wire
from transports.base import Handler, Message
from transports.session.link import WorkerLink
from transports.wakeup import Wakeup

EXIT_OK = 0  # the master said shutdown
EXIT_FAILED = 1  # refused, never welcomed, master gone for good, bad address
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM / the stop event
MASTER_LOST = -1  # not an exit code: the master went silent; look for one again
SHUTDOWN = -2  # not an exit code: the master said shutdown before it welcomed this worker

_IDLE_POLL_S = 0.5  # how often an idle compute thread looks whether the worker is done


@dataclass
class Hello:
    """What the compute thread made of ``handler.hello()``: the encoded hello, or why there is none."""

    frames: list | None
    problem: str = ""


class Compute:
    """The compute thread: the handler's calls, in order, each tagged with its session. It wakes the
    I/O thread through ``wakeup`` (which that thread's link waits on) when a result is ready."""

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


def answer_to_hello(
    frames: list,
    max_bytes: int,
    master: str,
    say: Callable[[str], None],
    info: Callable[[str], None],
    unreadable: Callable[[str], None],
) -> Message | int | None:
    """What ``master`` (e.g. "the master at tcp://...") sent a worker that waits for its welcome: the
    welcome; EXIT_FAILED when it refused this worker or speaks another wire; SHUTDOWN when it ended
    first; None for anything else (wait on). Each outcome but the welcome is said in one line, through
    ``say``, ``info`` or, for what cannot be read, ``unreadable``."""
    try:
        msg = wire.decode(frames, max_bytes)
    except wire.VersionMismatch as e:
        say(f"cannot talk to {master}: {wire.VersionMismatch(e.what, e.theirs, e.ours, 'the master', 'this worker')}")
        return EXIT_FAILED
    except wire.ProtocolError as e:
        unreadable(f"{master} sent something unreadable: {e}; waiting on")
        return None
    if msg.kind == "welcome":
        return msg
    if msg.kind == "error":
        say(f"{master} refused this worker: {msg.header['message']}")
        return EXIT_FAILED
    if msg.kind == "shutdown":
        info(f"shutdown: {msg.header['reason']} (from {master}, before it welcomed this worker)")
        return SHUTDOWN
    return None


def await_welcome(
    link: WorkerLink,
    compute: Compute,
    session: int,
    *,
    max_bytes: int,
    timeout_s: float,
    master: str,
    giving_up: str,
    say: Callable[[str], None],
    info: Callable[[str], None],
) -> Message | int:
    """Say hello once (the compute thread makes it) and wait up to ``timeout_s`` for ``master``'s welcome.

    Returns the welcome, SHUTDOWN, or EXIT_FAILED (refused, another wire, ``giving_up`` said at the
    deadline, the link gone, or a handler that cannot say hello: the master is told why instead).
    """
    compute.submit(session, None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        link.wait(min(0.25, timeout_s))
        for hello in compute.take(session):
            if isinstance(hello, Hello) and hello.frames is None:
                say(hello.problem)
                link.send(wire.encode(Message("error", {"message": hello.problem})))
                return EXIT_FAILED
            if isinstance(hello, Hello):
                link.send(hello.frames)
        for frames in link.receive():
            found = None if frames is None else answer_to_hello(frames, max_bytes, master, say, info, say)
            if found is not None:
                return found
        if link.gone:
            say(link.gone)
            return EXIT_FAILED
    say(giving_up)
    return EXIT_FAILED


class Serving:
    """The I/O loop once welcomed: tasks in, replies and heartbeats out, until shutdown.

    :meth:`run` returns EXIT_OK on the master's shutdown, MASTER_LOST when nothing came from it
    for ``peer_timeout_s``, EXIT_FAILED when the link says it is gone, EXIT_INTERRUPTED when
    ``stop`` is set. The welcome's ``heartbeat_s`` can only make this side's pace faster, and its
    patience longer: never quieter than the master expects, nor giving up between its heartbeats.
    """

    def __init__(
        self,
        link: WorkerLink,
        compute: Compute,
        session: int,
        welcome: Message,
        *,
        heartbeat_s: float,
        peer_timeout_s: float,
        max_bytes: int,
        stop: threading.Event | None,
        say: Callable[[str], None],
        info: Callable[[str], None],
    ) -> None:
        master_heartbeat_s = float(welcome.header["heartbeat_s"])
        self.link, self.compute, self.session = link, compute, session
        self.heartbeat_s = min(heartbeat_s, master_heartbeat_s)
        self.peer_timeout_s = max(peer_timeout_s, 3 * master_heartbeat_s)
        self.max_bytes, self.stop, self.say, self.info = max_bytes, stop, say, info
        self.heartbeat = wire.encode(Message("heartbeat"))
        self.last_heard = self.last_sent = time.monotonic()
        self.complained = False

    def run(self) -> int:
        while True:
            if self.stop is not None and self.stop.is_set():
                self.info("stop requested; worker stopping")
                return EXIT_INTERRUPTED
            self.link.wait(self.heartbeat_s / 4)  # a quarter heartbeat: timers stay accurate
            self._send_results()
            code = self._receive()
            if code is None and self.link.gone:
                self.say(self.link.gone)
                return EXIT_FAILED
            if code is None:
                code = self._tick()
            if code is not None:
                return code

    def _send(self, frames: list, control: bool = False) -> None:
        if self.link.send(frames, control=control):
            self.last_sent = time.monotonic()
        elif not self.complained:  # the pipe to the master is full: its silence will tell
            self.say("the master is not reading; dropping messages to it")
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

    def _receive(self) -> int | None:
        for frames in self.link.receive():
            self.last_heard = time.monotonic()  # any bytes from the master show it is alive
            if frames is None:
                continue
            try:
                msg = wire.decode(frames, self.max_bytes)
            except wire.ProtocolError as e:
                self.say(f"bad message from the master: {e}")
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
            self.say(f"the master reports: {msg.header['message']}")
        elif msg.kind == "hello":
            self._send(wire.encode(wire.error_reply(msg, "a worker does not accept 'hello' messages")))
        return None  # heartbeat, or a repeated welcome: last_heard is all they change

    def _tick(self) -> int | None:
        now = time.monotonic()
        if now - self.last_heard > self.peer_timeout_s:
            self.say(f"lost the master: nothing heard for {now - self.last_heard:.1f} s")
            return MASTER_LOST
        if now - self.last_sent >= self.heartbeat_s:
            self._send(self.heartbeat, control=True)
        return None

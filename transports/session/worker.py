"""The worker's session, over any :class:`~transports.session.link.WorkerLink`: its two threads while it
serves one master, and what the master's first answer to its hello means.

* :class:`Compute`, the compute thread, makes every call into the handler (``hello()`` and
  ``handle(msg)``), one at a time, so heartbeats keep flowing while a long task computes. Each
  call is tagged with the *session* (one per master) it is for: a result that comes back after
  its master is gone is dropped, never sent to the next master.
* :func:`greet` says hello and waits for the welcome (:func:`answer_to_hello` reads what the
  master sends meanwhile); :func:`serve_master` is a whole session with a master the link
  reaches without a search (MPI's rank 0), ZeroMQ's worker greets each master it finds.
* :class:`Serving`, the I/O loop once a master welcomed the worker: the only code that calls
  the link; tasks in, replies and heartbeats out, until the master says shutdown, goes silent
  or goes.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
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

BACKOFF_FIRST_S = 0.5  # a hello is said again after this long without a welcome...
BACKOFF_MAX_S = 10.0  # ... doubling up to this
_SLICE_S = 0.25  # while waiting for a welcome, how often to look at the clock and the stop event
_HEARTBEAT = wire.encode(Message("heartbeat"))
_FIXED = 1  # the session of a worker that serves one fixed master
_IDLE_POLL_S = 0.5  # how often an idle compute thread looks whether the worker is done


def to_stderr(line: str) -> None:
    """A worker's default way to say a line."""
    print(line, file=sys.stderr, flush=True)


@dataclass(kw_only=True)
class Settings:
    """How a worker keeps its sessions. A welcome's ``heartbeat_s`` can only make the pace faster and the
    patience longer: never quieter than the master expects, nor giving up between its heartbeats."""

    heartbeat_s: float = 1.0  # a heartbeat after this long without sending
    peer_timeout_s: float = 5.0  # a master silent for this long is lost
    max_bytes: int = wire.DEFAULT_MAX_BYTES  # the array data of one message
    say: Callable[[str], None] = to_stderr  # problems, one line each
    info: Callable[[str], None] = to_stderr  # what happens (a quiet worker passes a no-op)
    stop: threading.Event | None = None  # set: the worker stops

    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()


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
    frames: list, master: str, settings: Settings, unreadable: Callable[[str], None]
) -> Message | int | None:
    """What ``master`` (e.g. "the master at tcp://...") sent a worker that waits for its welcome: the
    welcome; EXIT_FAILED when it refused this worker or speaks another wire; SHUTDOWN when it ended
    first; None for anything else (wait on). Each outcome but the welcome is said in one line, through
    the settings' ``say`` and ``info`` or, for what cannot be read, ``unreadable``."""
    say, info = settings.say, settings.info
    try:
        msg = wire.decode(frames, settings.max_bytes)
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


def greet(
    link: WorkerLink,
    compute: Compute,
    session: int,
    settings: Settings,
    *,
    master: str,
    deadline: float | None,
    giving_up: str,
) -> tuple[Message, list] | int:
    """Say hello to ``master`` and wait for its welcome until ``deadline`` (None: no limit).

    The hello, made by the compute thread (once the previous master's last task is done), goes
    again with backoff (BACKOFF_FIRST_S doubling to BACKOFF_MAX_S), and at once over a link that
    was ``renewed``; heartbeats go meanwhile, so a master that is not admitting yet keeps this
    worker's place. Returns (the welcome, what arrived after it in the same receive), SHUTDOWN, or
    an exit code: EXIT_INTERRUPTED when ``stop`` is set, EXIT_FAILED when refused, at the deadline
    (``giving_up`` said), when the link is gone, or when the handler cannot say hello (the master
    is told why instead).
    """
    compute.submit(session, None)
    hello, delay, next_hello, last_sent = None, BACKOFF_FIRST_S, 0.0, None
    unreadable = _Once(settings.say)
    while deadline is None or time.monotonic() < deadline:
        if settings.stopped():
            return EXIT_INTERRUPTED
        slice_s = min(_SLICE_S, settings.heartbeat_s)
        link.wait(slice_s if deadline is None else max(0.0, min(slice_s, deadline - time.monotonic())))
        for made in compute.take(session):
            if isinstance(made, Hello) and made.frames is None:
                settings.say(made.problem)
                link.send(wire.encode(Message("error", {"message": made.problem})))
                return EXIT_FAILED
            hello = made.frames if isinstance(made, Hello) else hello
        now = time.monotonic()
        if link.renewed:  # a new connection, perhaps to a new master: hello at once
            next_hello, link.renewed = now, False
        if hello is not None and now >= next_hello:
            if link.send(hello):
                next_hello, delay, last_sent = now + delay, min(2 * delay, BACKOFF_MAX_S), now
            else:  # the link cannot send yet: try again soon
                next_hello = now + _SLICE_S
        elif last_sent is not None and now - last_sent >= settings.heartbeat_s and link.send(_HEARTBEAT, control=True):
            last_sent = now
        arrived = link.receive()
        for i, frames in enumerate(arrived):
            found = None if frames is None else answer_to_hello(frames, master, settings, unreadable)
            if isinstance(found, Message):
                return found, arrived[i + 1 :]
            if found is not None:
                return found
        if link.gone:
            settings.say(link.gone)
            return EXIT_FAILED
    settings.say(giving_up)
    return EXIT_FAILED


class _Once:
    """Says its first line only."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say, self.said = say, False

    def __call__(self, line: str) -> None:
        if not self.said:
            self.say(line)
            self.said = True


def serve_master(
    link: WorkerLink, compute: Compute, settings: Settings, *, master: str, timeout_s: float, giving_up: str
) -> int:
    """Serve ``master``, a peer the link reaches without a search (MPI's rank 0): :func:`greet` it for
    up to ``timeout_s``, then serve until shutdown. Returns EXIT_OK on shutdown (also one before the
    welcome), MASTER_LOST when the master went silent, else :func:`greet`'s or :class:`Serving`'s code."""
    found = greet(
        link, compute, _FIXED, settings, master=master, deadline=time.monotonic() + timeout_s, giving_up=giving_up
    )
    if isinstance(found, int):
        return EXIT_OK if found == SHUTDOWN else found
    welcome, arrived = found
    settings.info(f"worker {welcome.header['index']} serving {master}")
    return Serving(link, compute, _FIXED, welcome, settings).run(arrived)


class Serving:
    """The I/O loop once welcomed: tasks in, replies and heartbeats out, until shutdown.

    :meth:`run` returns EXIT_OK on the master's shutdown, MASTER_LOST when nothing came from it
    for ``peer_timeout_s``, EXIT_FAILED when the link says it is gone, EXIT_INTERRUPTED when
    ``stop`` is set.
    """

    def __init__(self, link: WorkerLink, compute: Compute, session: int, welcome: Message, settings: Settings) -> None:
        master_heartbeat_s = float(welcome.header["heartbeat_s"])
        self.link, self.compute, self.session = link, compute, session
        self.heartbeat_s = min(settings.heartbeat_s, master_heartbeat_s)
        self.peer_timeout_s = max(settings.peer_timeout_s, 3 * master_heartbeat_s)
        self.max_bytes, self.stop, self.say, self.info = settings.max_bytes, settings.stop, settings.say, settings.info
        self.last_heard = self.last_sent = time.monotonic()
        self.complained = False

    def run(self, arrived: Sequence[list | None] = ()) -> int:
        """Serve, starting with what ``arrived`` after the welcome, in the same receive as it."""
        code = self._handle(arrived)
        while code is None:
            if self.stop is not None and self.stop.is_set():
                self.info("stop requested; worker stopping")
                return EXIT_INTERRUPTED
            self.link.wait(self.heartbeat_s / 4)  # a quarter heartbeat: timers stay accurate
            self._send_results()
            code = self._handle(self.link.receive())
            if code is None and self.link.gone:
                self.say(self.link.gone)
                return EXIT_FAILED
            if code is None:
                code = self._tick()
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

    def _handle(self, arrived: Sequence[list | None]) -> int | None:
        for frames in arrived:
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
            self._send(_HEARTBEAT, control=True)
        return None

"""The worker's side of a session, over any :class:`~transports.session.link.WorkerLink`: two threads.

:class:`Compute`, the compute thread, makes every call into the handler, so the link keeps being read and
heartbeats keep flowing while a long task computes; each call is tagged with its session (one per master), so
that a result whose master is gone never reaches the next one. :class:`Serving`, the I/O loop once a master
welcomed the worker (``welcome.py``), is the only code that calls the link. One task's way: ``_handle`` decodes
its frames (:func:`transports.wire.decode` checks everything), ``_on_message`` hands it to the compute thread,
which calls the handler through :func:`call_handler`, and ``_send_results`` sends what that said, in order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from transports import wire
from transports.base import Handler, Message, still_computing
from transports.session.link import WorkerLink
from transports.session.patience import HEARTBEATS, Patience
from transports.session.settings import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    HEARTBEAT,
    MASTER_LOST,
    Settings,
)
from transports.wakeup import Wakeup


def call_handler(handler: Handler, msg: Message, tell: Callable[[Message], None]) -> Message | None:
    """``handler.handle(msg)``, made safe for a worker loop: an exception becomes an ``error`` reply, and so
    does a reply that breaks the wire, so a bad task never kills the worker and the master always gets a message
    it can decode. Around it ``tell`` sends the master ``started`` (the task came whole and is computed now) and
    ``computed`` (the reply follows, in order): the master gives the compute a deadline and leaves the transfers
    to the peer's patience. Small messages: any transport that keeps messages in order carries them."""
    if (started := wire.progress("started", msg)) is not None:
        tell(started)
    going = still_computing.set(partial(tell, started) if started is not None else lambda: None)  # "started" again
    try:
        reply = handler.handle(msg)
        if reply is not None:
            wire.check_message(reply)
    except wire.ProtocolError as e:
        reply = wire.error_reply(msg, f"{msg.kind}: the worker produced an invalid reply: {e}")
    except Exception as e:  # report and keep serving; the traceback is no use to the master
        reply = wire.error_reply(msg, f"{msg.kind} failed: {type(e).__name__}: {e}")
    finally:
        still_computing.reset(going)
    if started is not None:
        tell(wire.progress("computed", msg))
    return reply


class Compute:
    """The compute thread: the handler's calls, in order, each tagged with its session. It wakes the
    I/O thread through ``wakeup`` (which that thread's link waits on) when a result is ready."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.wakeup = handler, Wakeup()
        self.tasks: queue.Queue[tuple[int, Message | Callable[[Handler], object]] | None] = queue.Queue()  # None: stop
        self.results: queue.Queue[tuple[int, object]] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="worker-compute", daemon=True)
        self.thread.start()

    def submit(self, session: int, task: Message | Callable[[Handler], object]) -> None:
        """A task of ``session``'s master, or a call to make of the handler on this thread (``welcome.make_hello``)."""
        self.tasks.put((session, task))

    def forget(self) -> None:
        """Drop the tasks not yet started: their master is gone."""
        try:
            while True:
                self.tasks.get_nowait()
        except queue.Empty:
            pass

    def take(self, session: int) -> list[object]:
        """What the thread has finished for ``session``; results of earlier sessions are dropped."""
        out = []
        while not self.results.empty():  # the I/O thread is the only one that takes from it
            tag, result = self.results.get_nowait()
            if tag == session:
                out.append(result)
        return out

    def stop(self) -> None:
        """Drop the tasks not started, end the thread (a task still running ends with the process: the thread
        is a daemon), close ``wakeup``."""
        self.forget()
        self.tasks.put(None)
        self.thread.join(timeout=1.0)
        self.wakeup.close()

    def _run(self) -> None:
        while (item := self.tasks.get()) is not None:
            session, task = item
            if isinstance(task, Message):
                result = call_handler(self.handler, task, partial(self._put, session))
            else:
                result = task(self.handler)
            if result is not None:
                self._put(session, result)

    def _put(self, session: int, result: object) -> None:
        self.results.put((session, result))
        self.wakeup.wake()


class Serving:
    """The I/O loop once welcomed. :meth:`run` returns EXIT_OK on the master's shutdown, MASTER_LOST when
    it was silent beyond its patience, EXIT_FAILED when the link says it is gone, EXIT_INTERRUPTED
    when ``stop`` is set."""

    def __init__(self, link: WorkerLink, compute: Compute, session: int, welcome: Message, settings: Settings) -> None:
        master_heartbeat_s = float(welcome.header["heartbeat_s"])
        self.link, self.compute, self.session, self.settings = link, compute, session, settings
        self.heartbeat_s = min(settings.heartbeat_s, master_heartbeat_s)
        ceiling_s = max(settings.peer_timeout_s, HEARTBEATS * master_heartbeat_s)
        self.patience = Patience(master_heartbeat_s, ceiling_s, time.monotonic())
        self.complained = False

    def run(self, arrived: Sequence[list | None] = ()) -> int:
        """Serve, starting with what ``arrived`` after the welcome, in the same receive as it."""
        code = self._handle(arrived)
        while code is None:
            if self.settings.stopped():
                self.settings.info("stop requested; worker stopping")
                return EXIT_INTERRUPTED
            self.link.wait(self.heartbeat_s / 4)  # a quarter heartbeat: timers stay accurate
            self._send_results()
            code = self._handle(self.link.receive())
            if code is None and self.link.gone:
                self.settings.say(self.link.gone)
                return EXIT_FAILED
            if code is None:
                code = self._tick()
        return code

    def _send(self, frames: list, control: bool = False) -> None:
        if self.link.send(frames, control=control):
            self.patience.said = time.monotonic()
        elif not self.complained:  # the pipe to the master is full: its silence will tell
            self.settings.say("the master is not reading; dropping messages to it")
            self.complained = True

    def _send_results(self) -> None:
        for reply in self.compute.take(self.session):
            if not isinstance(reply, Message):  # a hello made for this session: the welcome already came
                continue
            try:
                frames = wire.encode(reply)
            except wire.ProtocolError as e:  # call_handler checked the header; the envelope may pass its limit
                frames = wire.encode(wire.error_reply(reply, f"the worker produced an unsendable reply: {e}"))
            self._send(frames)

    def _handle(self, arrived: Sequence[list | None]) -> int | None:
        for frames in arrived:
            self.patience.arrived(time.monotonic(), piece=frames is None)  # any bytes show it alive
            if frames is None:
                continue
            try:
                msg = wire.decode(frames, self.settings.max_bytes)
            except wire.ProtocolError as e:
                self.settings.say(f"bad message from the master: {e}")
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
            self.settings.info(f"shutdown: {msg.header['reason']}")
            return EXIT_OK
        elif msg.kind == "error":
            self.settings.say(f"the master reports: {msg.header['message']}")
        elif msg.kind == "hello":
            self._send(wire.encode(wire.error_reply(msg, "a worker does not accept 'hello' messages")))
        return None  # heartbeat, or a repeated welcome: the patience's clock is all they change

    def _tick(self) -> int | None:
        now = time.monotonic()
        if why := self.patience.lost(now):
            self.settings.say(f"lost the master: {why}")
            return MASTER_LOST
        if now - self.patience.said >= self.heartbeat_s:
            self._send(HEARTBEAT, control=True)
        return None

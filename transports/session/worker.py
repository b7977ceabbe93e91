"""The worker's session, over any :class:`~transports.session.link.WorkerLink`: serving one master.

A worker runs two threads. The compute thread (:class:`~transports.session.compute.Compute`)
makes every call into the handler; this module's :class:`Serving` is the other, the I/O loop
once a master welcomed the worker (:func:`~transports.session.welcome.greet` waits for that):
the only code that calls the link. One task's way through it:

1. the link's :meth:`~transports.session.link.WorkerLink.receive` returns the task's frames;
2. :meth:`Serving._handle` decodes them (:func:`transports.wire.decode` checks everything);
3. :meth:`Serving._on_message` hands a task to the compute thread, which calls the handler;
4. :meth:`Serving._send_results` takes the reply, encodes it and sends it to the master.

Meanwhile a heartbeat goes out after ``heartbeat_s`` of quiet, and anything from the master
shows it is alive, until it says shutdown, goes silent or goes. :func:`serve_master` is a whole
session with a master the link reaches without a search (MPI's rank 0); ZeroMQ's worker greets
each master it finds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from transports import wire
from transports.base import Message
from transports.session.compute import Compute
from transports.session.link import WorkerLink
from transports.session.settings import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    HEARTBEAT,
    MASTER_LOST,
    SHUTDOWN,
    Settings,
)
from transports.session.welcome import greet

_FIXED = 1  # the session of a worker that serves one fixed master


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
            self._send(HEARTBEAT, control=True)
        return None

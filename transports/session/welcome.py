"""A worker's hello (:func:`make_hello`) and its wait for the welcome (:func:`greet`, reading what comes meanwhile
with :func:`answer_to_hello`), and :func:`serve_master`, a whole session: greet, then serve
(:class:`~transports.session.worker.Serving`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from transports import wire
from transports.base import Handler, Message
from transports.session.link import WorkerLink
from transports.session.settings import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, HEARTBEAT, SECRET_ENV, Settings
from transports.session.worker import Compute, Serving

BACKOFF_FIRST_S = 0.5  # a hello is said again after this long without a welcome...
BACKOFF_MAX_S = 10.0  # ... doubling up to this
_SLICE_S = 0.25  # while waiting for a welcome, how often to look at the clock and the stop event


@dataclass
class Hello:
    """What the compute thread made of ``handler.hello()``: the encoded hello, or why there is none."""

    frames: list | None
    problem: str = ""


def make_hello(handler: Handler) -> Hello:
    """``handler``'s hello, with the secret of the master that started this worker, if one did; on the compute
    thread, which makes every call into the handler."""
    try:
        secret = {"secret": s} if (s := os.environ.get(SECRET_ENV)) else {}
        return Hello(wire.encode(Message("hello", {**handler.hello(), **secret})))
    except Exception as e:  # a ProtocolError, or the handler's own failure
        return Hello(None, f"this worker cannot say hello: {type(e).__name__}: {e}")


def answer_to_hello(
    frames: list, master: str, settings: Settings, unreadable: Callable[[str], None]
) -> Message | int | None:
    """What ``master`` sent a worker that waits for its welcome: the welcome; EXIT_FAILED when it refused this
    worker or speaks another wire; EXIT_OK when it ended first; None for anything else (wait on). Each
    outcome but the welcome is said in one line (what cannot be read, through ``unreadable``)."""
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
        return EXIT_OK
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

    The hello, made by the compute thread, goes again with backoff, and at once over a link that was
    ``renewed``; heartbeats go meanwhile, so a master that is not admitting yet keeps this worker's place.
    Returns (the welcome, what arrived after it in the same receive), EXIT_OK (a shutdown), EXIT_INTERRUPTED when
    ``stop`` is set, or EXIT_FAILED: refused, at the deadline (``giving_up`` said), the link gone, or a
    handler that cannot say hello (the master is told why).
    """
    compute.submit(session, make_hello)
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
        elif last_sent is not None and now - last_sent >= settings.heartbeat_s and link.send(HEARTBEAT, control=True):
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


def serve_master(
    link: WorkerLink,
    compute: Compute,
    settings: Settings,
    *,
    master: str,
    deadline: float | None,
    giving_up: str,
    session: int = 1,  # a worker that serves one master has one session
) -> int:
    """A whole session with ``master``: :func:`greet` it until ``deadline``, then serve until shutdown. Returns
    EXIT_OK on shutdown (also one before the welcome), MASTER_LOST when the master went silent, else
    :func:`greet`'s or :class:`~transports.session.worker.Serving`'s code."""
    found = greet(link, compute, session, settings, master=master, deadline=deadline, giving_up=giving_up)
    if isinstance(found, int):
        return found
    welcome, arrived = found
    link.welcomed()
    settings.info(f"worker {welcome.header['index']} serving {master}")
    return Serving(link, compute, session, welcome, settings).run(arrived)


class _Once:
    """Says its first line only."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say, self.said = say, False

    def __call__(self, line: str) -> None:
        if not self.said:
            self.say(line)
            self.said = True

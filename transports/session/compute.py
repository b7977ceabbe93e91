"""A worker's compute thread: every call into its handler, one at a time, apart from the link.

:class:`Compute` makes the handler's calls (``hello()`` and ``handle(msg)``) in a thread of its
own, so the worker's I/O thread keeps reading the link and heartbeats keep flowing while a long
task computes. Each call is tagged with the *session* (one per master) it is for: a result that
comes back after its master is gone is dropped, never sent to the next master.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from transports import wire
from transports.base import Handler, Message
from transports.wakeup import Wakeup

_IDLE_POLL_S = 0.5  # how often an idle compute thread looks whether the worker is done


def call_handler(handler: Handler, msg: Message) -> Message | None:
    """``handler.handle(msg)``, made safe for a worker loop.

    An exception becomes an ``error`` reply, and so does a reply that breaks the
    wire, so a bad task (or a handler bug) never kills the worker and the master
    always gets a message it can decode.
    """
    try:
        reply = handler.handle(msg)
        if reply is not None:
            wire.check_message(reply)
        return reply
    except wire.ProtocolError as e:
        return wire.error_reply(msg, f"{msg.kind}: the worker produced an invalid reply: {e}")
    except Exception as e:  # report and keep serving; the traceback is no use to the master
        return wire.error_reply(msg, f"{msg.kind} failed: {type(e).__name__}: {e}")


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
            result = self._hello() if msg is None else call_handler(self.handler, msg)
            if result is not None:
                self.results.put((session, result))
                self.wakeup.wake()

    def _hello(self) -> Hello:
        try:
            return Hello(wire.encode(Message("hello", self.handler.hello())))
        except Exception as e:  # a ProtocolError, or the handler's own failure
            return Hello(None, f"this worker cannot say hello: {type(e).__name__}: {e}")

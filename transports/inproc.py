"""In-process transport: every worker is a thread of the master's process.

No serialisation at all: a task's arrays reach the worker's handler as the very same numpy objects,
and so do the replies. Messages are still checked as the wire checks them
(:func:`transports.wire.check_message`), so code that works here sends messages the other transports
accept too. Worker i's thread calls ``handler_factory(i)`` (so it builds its own Backend there), says
hello, and serves tasks until shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from transports.base import HandlerFactory, Message, Transport, WorkerInfo, WorkerLost
from transports.session.admission import worker_info
from transports.session.settings import check_options
from transports.session.worker import call_handler
from transports.wire import SESSION_KINDS, VersionMismatch, check_message, error_reply

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0


class InprocTransport(Transport):
    """Workers as threads; ``handler_factory(i)`` builds worker i's :class:`~transports.base.Handler`.
    ``protocol`` is the version of the task protocol the master speaks; a worker whose hello says another
    is refused."""

    name = "inproc"

    def __init__(self, handler_factory: HandlerFactory, *, protocol: int, **_: Any) -> None:
        if not callable(handler_factory):  # one set of options goes to every transport: this one needs it
            raise TypeError(f"InprocTransport needs handler_factory, a callable i -> Handler; got {handler_factory!r}")
        check_options(protocol)  # the protocol's type, checked as every transport checks it
        self._factory, self._protocol = handler_factory, protocol
        # worker threads -> master: ("hello" | "reply" | "lost", worker index, payload)
        self._inbox: queue.Queue[tuple[str, int, Any]] = queue.Queue()
        self._tasks: list[queue.Queue[Message]] = []
        self._threads: list[threading.Thread] = []
        self._lost: dict[int, str] = {}
        self._traffic: dict[int, list[int]] = {}
        self._started = self._closed = False

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        if self._started or self._closed:
            raise RuntimeError("start() can be called once, on a transport that is not closed")
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
        self._started = True
        for i in range(n_workers):
            self._tasks.append(queue.Queue())
            self._traffic[i] = [0, 0]
            t = threading.Thread(target=self._serve, args=(i,), name=f"inproc-worker-{i}", daemon=True)
            self._threads.append(t)
            t.start()
        deadline = time.monotonic() + timeout
        infos: dict[int, WorkerInfo] = {}
        while len(infos) < n_workers:
            try:
                kind, i, payload = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"only {len(infos)} of {n_workers} in-process workers said hello within {timeout:g} s; "
                    "a handler factory is slow or stuck"
                ) from None
            if kind == "hello":
                check_message(Message("hello", payload))
                if payload["protocol"] != self._protocol:
                    who = f"in-process worker {i}"
                    raise VersionMismatch("task protocol", payload["protocol"], self._protocol, who, "the master")
                infos[i] = worker_info(i, payload, "inproc")
            else:  # before its hello, only its error (a factory that failed) or its loss (its thread died)
                why = payload.header["message"] if kind == "reply" else payload
                raise RuntimeError(f"in-process worker {i} could not start: {why}")
        return [infos[i] for i in range(n_workers)]

    def send(self, worker: int, msg: Message) -> None:
        if not self._started or self._closed:
            raise RuntimeError("send() needs a started, open transport")
        if not isinstance(worker, int) or not 0 <= worker < len(self._tasks):
            raise ValueError(f"no worker {worker!r}; workers are 0..{len(self._tasks) - 1}")
        if worker in self._lost:
            raise WorkerLost(worker, self._lost[worker])
        check_message(msg)
        self._traffic[worker][0] += msg.nbytes()
        self._tasks[worker].put(msg)

    def recv(self, timeout: float) -> tuple[int, Message]:
        if not self._started or self._closed:
            raise RuntimeError("recv() needs a started, open transport")
        try:
            kind, i, payload = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no reply from any in-process worker within {timeout:g} s") from None
        if kind == "lost":
            self._lost[i] = payload
            raise WorkerLost(i, payload)
        self._traffic[i][1] += payload.nbytes()
        return i, payload

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Array bytes handed to and received from each worker (nothing is copied in-process)."""
        return {i: (s, r) for i, (s, r) in self._traffic.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # before the shutdowns: a worker thread that ends after one is not lost
        for q in self._tasks:
            q.put(Message("shutdown", {"reason": "train over"}))
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            if t.is_alive():  # a handler still computing; the thread is a daemon and ends with it
                log.warning("%s still busy after %.0f s; leaving it to finish", t.name, _JOIN_TIMEOUT_S)

    def _serve(self, i: int) -> None:
        """Worker i's thread."""
        reason = "its thread ended unexpectedly"
        try:
            try:
                handler = self._factory(i)
                hello = handler.hello()
            except Exception as e:
                reason = f"could not start: {type(e).__name__}: {e}"
                self._inbox.put(("reply", i, Message("error", {"message": reason})))
                return
            self._inbox.put(("hello", i, hello))
            while True:
                msg = self._tasks[i].get()  # close() puts a shutdown in every queue
                if msg.kind == "shutdown":
                    return
                if msg.kind == "hello":
                    reply = error_reply(msg, "a worker does not accept 'hello' messages")
                elif msg.kind in SESSION_KINDS:  # welcome, heartbeat, an error from the master
                    continue
                else:
                    reply = call_handler(handler, msg, lambda said: self._inbox.put(("reply", i, said)))
                if reply is not None:
                    self._inbox.put(("reply", i, reply))
        except BaseException as e:  # e.g. SystemExit from a handler: tell the master, don't vanish
            reason = f"its thread died: {type(e).__name__}: {e}"
            raise
        finally:
            if not self._closed:
                self._inbox.put(("lost", i, reason))

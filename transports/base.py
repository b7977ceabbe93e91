"""The Transport interface: the master's view of a pool of workers.

A transport moves :class:`Message` objects between the master and N workers. It
knows nothing about the tasks it carries: the worker side is a *handler*
(:class:`Handler`) supplied by the application, and a task's kind, header and
arrays mean something only to the handler and the master's code. This package
never imports the application.

Lifecycle, as the master sees it::

    workers = transport.start(n_workers, timeout)   # wait for every hello
    transport.send(k, msg)                          # a task to worker k
    k, reply = transport.recv(timeout)              # the next reply, from anyone
    new = transport.joined()                        # workers that came since (never blocks)
    transport.close()                               # "train over": workers exit

``recv`` raises :class:`TimeoutError` when nothing arrives in time and
:class:`WorkerLost` when a worker is known to be gone; nothing blocks forever.
Workers may come and go: a lost index is never used again, and a worker that
comes back, like any new one, is reported by ``joined`` under a new index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass
class Message:
    """One message: a kind, a small header of plain values, and named arrays.

    ``header`` holds only plain data: str keys; None, bool, int, float, str,
    lists and maps as values (task id, step, timings, ...). ``arrays`` holds
    numpy arrays, which cross a process boundary as raw frames, never pickled.
    """

    kind: str
    header: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


@dataclass
class WorkerInfo:
    """What a worker said in its hello: its index here, backend and device facts."""

    index: int
    backend: str
    device: dict[str, Any]
    address: str = ""
    hostname: str = ""
    pid: int = 0


@runtime_checkable
class Handler(Protocol):
    """The worker side of every transport: what actually serves tasks.

    ``hello()`` returns the header of the worker's ``hello`` message:
    ``protocol`` (the version of the task protocol it speaks, which the master
    compares with its own), ``backend``, ``device``, ``pid``, ``hostname``.
    ``handle(msg)`` answers one task -- any message whose kind is not one of the
    transport's session kinds (``transports.wire.SESSION_KINDS``) -- with a reply
    message, or None for no reply. Transports turn an exception from ``handle``
    into an ``error`` reply, so a worker never dies of a bad task.

    A worker may serve several masters in turn (its master went away and another
    took its address, or the worker serves ``forever``): ``hello()`` is called once
    for every new master, before any of that master's tasks, so a handler may drop
    what it kept for the previous master there. Both methods are called from one
    thread, one call at a time.
    """

    def hello(self) -> dict[str, Any]: ...

    def handle(self, msg: Message) -> Message | None: ...


# Builds worker i's handler. The in-process transport calls it in worker i's own
# thread, so each worker creates its own Backend there.
HandlerFactory = Callable[[int], Handler]


class WorkerLost(RuntimeError):
    """A worker stopped answering heartbeats or disconnected."""

    def __init__(self, worker: int, reason: str) -> None:
        super().__init__(f"worker {worker} lost: {reason}")
        self.worker = worker
        self.reason = reason


class Transport(ABC):
    """Abstract master-side transport. Subclasses set ``name``."""

    name: str = "abstract"

    @abstractmethod
    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        """Wait until ``n_workers`` workers said hello; raise TimeoutError with a clear message otherwise."""

    @abstractmethod
    def send(self, worker: int, msg: Message) -> None:
        """Queue ``msg`` for worker ``worker`` (0-based). Never blocks indefinitely."""

    @abstractmethod
    def recv(self, timeout: float) -> tuple[int, Message]:
        """The next message from any worker, as (worker index, message): any task reply, or an ``error``."""

    @abstractmethod
    def close(self) -> None:
        """Tell every worker the training is over and release all resources. Idempotent."""

    def joined(self) -> list[WorkerInfo]:
        """Workers admitted since start() or the previous call, each under a new index; never blocks.

        A transport whose workers cannot come late (the base class, in-process threads)
        returns []. Messages from a worker reported here arrive through ``recv`` like
        any other's.
        """
        return []

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Bytes (sent to, received from) each worker since start."""
        return {}

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The Transport interface: the master's view of a pool of workers (docs/how-it-works.md, "Transports").

A transport moves :class:`Message` objects between the master and N workers, knowing nothing of the
tasks it carries: the worker side is the application's :class:`Handler`. A lost index is never used
again: a worker that comes back, like any new one, is reported by ``joined`` under a new index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass
class Message:
    """One message: a kind, a header of plain data (str keys; None, bool, int, float, str, lists and maps),
    and named numpy arrays, which cross a process boundary as raw frames, never pickled."""

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
    key: str = ""  # the public key it authenticated with (z85, as in its NAME.key file); "" without keys


@runtime_checkable
class Handler(Protocol):
    """The worker side of every transport: what actually serves tasks.

    ``hello()`` returns the header of the worker's ``hello``: ``protocol`` (the version of the task
    protocol it speaks), ``backend``, ``device``, ``pid``, ``hostname``. It is called once for every
    new master (a worker may serve several in turn), before that master's tasks, so a handler may drop
    what it kept for the previous one there. ``handle(msg)`` answers one task (a message whose kind is
    not a session kind) with a reply, or None; an exception becomes an ``error`` reply. Both are called
    from one thread, one call at a time. A task's long first-run work (building kernels, an autotuner
    timing its variants) calls :data:`still_computing` between its steps, so the master does not take
    it for hung.
    """

    def hello(self) -> dict[str, Any]: ...

    def handle(self, msg: Message) -> Message | None: ...


# While a worker's loop runs a task's handle(): tells the master the compute goes on, which opens its deadline again
still_computing: ContextVar[Callable[[], None]] = ContextVar("still_computing", default=lambda: None)

# Builds worker i's handler; the in-process transport calls it in worker i's own thread.
HandlerFactory = Callable[[int], Handler]


class WorkerLost(RuntimeError):
    """A worker stopped answering heartbeats or disconnected."""

    def __init__(self, worker: int, reason: str) -> None:
        super().__init__(f"worker {worker} lost: {reason}")
        self.worker, self.reason = worker, reason


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
        [] where workers cannot come late."""
        return []

    def refuse(self, worker: int, why: str) -> bool:
        """``worker`` answered wrongly or failed its calibration: say goodbye, and turn away its peer (by key,
        else by address) for a time that doubles with each refusal; whether it does. A transport whose
        workers cannot come back (threads in this process) has no more to do than the runtime, which
        leaves the worker out: False."""
        return False

    def drop(self, worker: int, why: str) -> bool:
        """The runtime gave ``worker`` up (past its deadline) while its link may still live: stop serving it, so
        that it says hello again and comes back as a joiner; whether it does. False where workers cannot come
        back."""
        return False

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Bytes (sent to, received from) each worker since start."""
        return {}

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

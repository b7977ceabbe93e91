"""The Transport interface: the master's view of a pool of workers.

A transport moves :class:`Message` objects between the master and N workers. It
knows nothing about convolutions: the worker side is a *handler* (a callable
``Message -> Message``) supplied by ``tinyconv.worker``, so this package never
imports ``tinyconv``.

Lifecycle, as the master sees it::

    workers = transport.start(n_workers, timeout)   # wait for every hello
    transport.send(k, msg)                          # a task to worker k
    k, reply = transport.recv(timeout)              # the next reply, from anyone
    transport.close()                               # "train over": workers exit

``recv`` raises :class:`TimeoutError` when nothing arrives in time and
:class:`WorkerLost` when a worker is known to be gone; nothing blocks forever.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

# 2: conv_forward may carry a fused tail (tinyconv/block.py); 3, 4: conv_backward in parts;
# 5: a layer split by input channels goes in parts both ways: forward "conv" (a partial
# convolution) and "tail", backward "tail" and "conv" (see tinyconv/worker.py)
PROTOCOL_VERSION = 5

# Message kinds. Master -> worker: calibrate, conv_forward, conv_backward, shutdown.
# Worker -> master: hello (first), result, error. Either way: heartbeat.
KINDS = (
    "hello",
    "welcome",
    "calibrate",
    "conv_forward",
    "conv_backward",
    "result",
    "error",
    "heartbeat",
    "shutdown",
)


@dataclass
class Message:
    """One message: a kind, a small header of plain values, and named arrays.

    ``header`` holds only msgpack-able scalars, strings, lists and dicts (task id,
    step, layer, stride, padding, timings, ...). ``arrays`` holds numpy arrays,
    which cross a process boundary as raw frames, never pickled.
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

    ``hello()`` returns the header of the worker's ``hello`` message
    (``protocol``, ``backend``, ``device``, ``pid``, ``hostname``); ``handle(msg)``
    answers one task (``calibrate``, ``conv_forward``, ``conv_backward``) with a
    ``result`` or ``error`` message, or None for no reply. Transports turn an
    exception from ``handle`` into an ``error`` reply, so a worker never dies of
    a bad task. ``tinyconv.worker.ConvWorker`` is the implementation.
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
        """The next message from any worker, as (worker index, message)."""

    @abstractmethod
    def close(self) -> None:
        """Tell every worker the training is over and release all resources. Idempotent."""

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Bytes (sent to, received from) each worker since start."""
        return {}

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

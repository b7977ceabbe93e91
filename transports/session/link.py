"""What the session layer needs from a medium: a :class:`Link` that moves frames, and nothing else.

A link knows peers only as opaque, hashable ids (a ZeroMQ identity, an MPI rank, a socket)
and messages only as lists of frames (:func:`transports.wire.encode`'s). Hello, welcome,
admission, heartbeats, loss and goodbye are the session's (:mod:`transports.session.master`,
:mod:`transports.session.admission`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class Arrival:
    """What a link got from ``peer``, one of three things:

    * ``frames``: a whole message, as :func:`transports.wire.encode` made it on the other side;
    * neither ``frames`` nor ``gone``: only a sign of life (the first bytes of a large message
      arrived), which keeps the peer alive as a whole message would;
    * ``gone``: the link can no longer talk with the peer (it ended its session, or its framing
      broke), and why, in words that follow "worker k lost: ".

    ``address`` names the peer for logs and :class:`~transports.base.WorkerInfo` ("" if unknown).
    """

    peer: Hashable
    frames: list | None = None
    address: str = ""
    gone: str = ""


class Link(ABC):
    """The master's end of a medium; one thread (the session's) calls every method but :meth:`wake`.

    ``group`` is None for an open membership (anyone who reaches the master may say hello, and
    come again after being lost) or, for a closed one, every peer there will ever be, in index
    order: peer ``group[k]`` is worker ``k``, a refused peer cannot be replaced, and the
    session says goodbye to each of them at the end.
    """

    group: list[Hashable] | None = None

    @abstractmethod
    def wait(self, timeout: float) -> None:
        """Return when something may have arrived, :meth:`wake` was called, or after ``timeout`` s."""

    @abstractmethod
    def wake(self) -> None:
        """End a :meth:`wait` now; called from any thread."""

    @abstractmethod
    def receive(self) -> list[Arrival]:
        """What arrived since the last call, never blocking; each peer's in the order it was sent."""

    @abstractmethod
    def send(self, peer: Hashable, frames: list, *, control: bool = False) -> str:
        """Queue ``frames`` for ``peer`` without blocking; "" when queued, else why the peer cannot be reached.

        ``control`` marks a small session message (a heartbeat) that may overtake the bulk
        frames queued before it: a link with a second lane (a socket, an MPI tag) for control
        sends it there, so liveness does not wait behind a large task. A link with one lane
        sends it in order.
        """

    def let_go(self, peer: Hashable) -> None:  # noqa: B027 (a medium that cannot tell a peer does nothing)
        """Nothing more goes to ``peer``, a refused member of a closed group; tell it if the medium can."""

    @abstractmethod
    def close(self, graceful: bool) -> None:
        """Called by the session's thread as it ends: let what is queued leave if ``graceful``, then let go."""

    def release(self) -> None:  # noqa: B027 (a medium that holds nothing does nothing)
        """Free what the medium holds, from the caller's thread once the session's thread ended."""


class WorkerLink(ABC):
    """A worker's end of a medium, to its one master; only the worker's I/O thread calls it.

    ``gone`` turns from "" to why, in a line, once the master can no longer be heard (it ended
    the session, its framing broke, it refused this worker's keys): the worker stops. A link sets
    ``renewed`` when its connection was made anew, perhaps to another master: a worker waiting
    for its welcome says hello again at once.
    """

    gone: str = ""
    renewed: bool = False

    @abstractmethod
    def wait(self, timeout: float) -> None:
        """Return when something may have arrived, the compute thread woke this thread, or after ``timeout`` s."""

    @abstractmethod
    def receive(self) -> list[list | None]:
        """What arrived since the last call, never blocking: each message's frames, or None for only a
        sign of life (the first bytes of a large message)."""

    @abstractmethod
    def send(self, frames: list, *, control: bool = False) -> bool:
        """Queue ``frames`` for the master without blocking; False if they were not (no connection yet, or
        the master is not reading). ``control`` is :meth:`Link.send`'s."""

"""What the session needs from a medium: a :class:`Link` (the master's end) and a :class:`WorkerLink` that
move frames (:func:`transports.wire.encode`'s) between peers known only as hashable ids (a ZeroMQ
identity, an MPI rank, a socket), and nothing else."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class Arrival:
    """What a link got from ``peer``: a whole message's ``frames``; or, when the link can no longer talk
    with it, why it is ``gone`` (words that follow "worker k lost: "); or neither: only a sign of life
    (the first bytes of a large message). ``address`` names the peer for logs ("" if unknown); ``key`` is
    the public key it authenticated with, where the medium has keys (ZeroMQ's CURVE), else ""."""

    peer: Hashable
    frames: list | None = None
    address: str = ""
    gone: str = ""
    key: str = ""


class Link(ABC):
    """The master's end of a medium; the session's thread calls every method but :meth:`wake`.

    ``group`` is None for an open membership (anyone who reaches the master may say hello, and come
    again after being lost) or, for a closed one, every peer there will ever be: peer ``group[k]`` is
    worker ``k``, and a refused peer cannot be replaced.
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
        ``control`` marks a heartbeat, which a link with a second lane may send ahead of bulk frames."""

    def let_go(self, peer: Hashable) -> None:  # noqa: B027 (a medium that cannot tell a peer does nothing)
        """Nothing more goes to ``peer``, a refused member of a closed group; tell it if the medium can."""

    @abstractmethod
    def close(self, graceful: bool) -> None:
        """Called by the session's thread as it ends: let what is queued leave if ``graceful``, then let go."""

    def release(self) -> None:  # noqa: B027 (a medium that holds nothing does nothing)
        """Free what the medium holds, from the caller's thread once the session's thread ended."""


class WorkerLink(ABC):
    """A worker's end of a medium, to its one master; only the worker's I/O thread calls it.

    ``gone`` turns from "" to why once the master can no longer be heard: the worker stops. ``renewed``
    is set when the connection was made anew, perhaps to another master: a waiting worker says hello.
    """

    gone: str = ""
    renewed: bool = False

    @abstractmethod
    def wait(self, timeout: float) -> None:
        """Return when something may have arrived, the compute thread woke this thread, or after ``timeout`` s."""

    @abstractmethod
    def receive(self) -> list[list | None]:
        """What arrived since the last call, never blocking: each message's frames, or None for a sign of life."""

    def welcomed(self) -> None:  # noqa: B027 (a link with nothing to change once welcomed does nothing)
        """The master welcomed this worker: a link may stop watching how its connection is made."""

    @abstractmethod
    def send(self, frames: list, *, control: bool = False) -> bool:
        """Queue ``frames`` for the master without blocking; False if not (no connection yet, or the master
        is not reading). ``control`` is :meth:`Link.send`'s."""

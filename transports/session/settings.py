"""What a session is told and what it tells: a master's options (:func:`check_options`,
:class:`MasterSettings`), a worker's :class:`Settings` and its exit codes."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transports import wire
from transports.base import Message

EXIT_OK = 0  # the master said shutdown
EXIT_FAILED = 1  # refused, never welcomed, master gone for good, bad address
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM / the stop event
MASTER_LOST = -1  # not an exit code: the master went silent; look for one again

HEARTBEAT = wire.encode(Message("heartbeat"))  # sent after heartbeat_s of quiet, waiting or serving
# A master that starts its own workers may admit only them: it gives each this run's secret in this
# environment variable (another user cannot read a process's environment, unlike its command line),
# and a worker's hello carries it.
SECRET_ENV = "TINYCONV_JOIN_SECRET"


def check_options(protocol: Any, heartbeat_s: float = 0.4, peer_timeout_s: float = 30.0, **_: Any) -> None:
    """TypeError or ValueError for options no session can run with; call it before making a link."""
    if not wire.Int.accepts(protocol):
        raise TypeError(f"protocol must be an int, the version of the task protocol; got {protocol!r}")
    if not heartbeat_s > 0 or not peer_timeout_s > heartbeat_s:
        raise ValueError(f"need 0 < heartbeat_s < peer_timeout_s, got {heartbeat_s} and {peer_timeout_s}")


@dataclass(frozen=True)
class MasterSettings:
    """How a master keeps its sessions (:class:`~transports.session.master.SessionTransport`'s options)."""

    protocol: int  # the version of the task protocol it speaks: a worker's hello must say the same
    heartbeat_s: float  # a heartbeat after this long without sending; also the welcome's pace
    peer_timeout_s: float  # the ceiling of a worker's patience: one silent this long is lost, whatever its pace
    max_bytes: int  # the array data of one message
    secret: str | None = None  # if given, a hello must carry it (SECRET_ENV): only the workers given it join


def to_stderr(line: str) -> None:
    """A worker's default way to say a line."""
    print(line, file=sys.stderr, flush=True)


@dataclass(kw_only=True)
class Settings:
    """How a worker keeps its sessions. A welcome's ``heartbeat_s`` can only make the pace faster and the
    patience's ceiling higher: never quieter than the master expects, nor giving up within 4 of its heartbeats."""

    heartbeat_s: float = 0.4  # a heartbeat after this long without sending
    peer_timeout_s: float = 30.0  # the ceiling of the master's patience (transports/session/patience.py)
    max_bytes: int = wire.DEFAULT_MAX_BYTES  # the array data of one message
    say: Callable[[str], None] = to_stderr  # problems, one line each
    info: Callable[[str], None] = to_stderr  # what happens (a quiet worker passes a no-op)
    stop: threading.Event | None = None  # set: the worker stops

    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

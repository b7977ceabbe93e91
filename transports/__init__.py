"""Transport registry: transports are found by name through the ``tinyconv.transports``
entry-point group, so a separate package can add one without touching this repo.

The built-in transports register the same way (see ``pyproject.toml``); the table
below is only the fallback for a source checkout that was never pip-installed.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from transports.base import (
    PROTOCOL_VERSION,
    Handler,
    HandlerFactory,
    Message,
    Transport,
    WorkerInfo,
    WorkerLost,
)
from transports.wire import ProtocolError, VersionMismatch

ENTRY_POINT_GROUP = "tinyconv.transports"

_BUILTIN = {
    "inproc": "transports.inproc:InprocTransport",
    "zmq": "transports.zmq_transport:ZmqTransport",
}


def _load(target: str) -> type[Transport]:
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)


def _discovered() -> dict[str, str]:
    found = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.value
    return found


def available_transports() -> list[str]:
    """Names of every transport that can be asked for."""
    return sorted(_discovered())


def get_transport(name: str, **options: Any) -> Transport:
    """Instantiate the transport registered as ``name``; options go to its constructor.

    Every built-in transport ignores options meant for another one, so a caller
    can pass one set (``handler_factory=...``, ``bind=...``, ``heartbeat_s=...``).
    """
    table = _discovered()
    if name not in table:
        raise ValueError(
            f"unknown transport {name!r}; available: {', '.join(sorted(table))}. "
            f"A third-party transport registers under the entry-point group {ENTRY_POINT_GROUP!r}."
        )
    cls = _load(table[name])
    return cls(**options)


__all__ = [
    "ENTRY_POINT_GROUP",
    "PROTOCOL_VERSION",
    "Handler",
    "HandlerFactory",
    "Message",
    "ProtocolError",
    "Transport",
    "VersionMismatch",
    "WorkerInfo",
    "WorkerLost",
    "available_transports",
    "get_transport",
]

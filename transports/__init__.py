"""Transports: how a master reaches its workers (docs/writing-a-transport.md says which file does what). This
package never imports the application. A transport is found by name (``get_transport("zmq", ...)``): a class
registered under the entry-point group ``tinyconv.transports``; :data:`BUILTIN` is the fallback for a source
checkout that was never pip-installed.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from transports.base import Handler, HandlerFactory, Message, Transport, WorkerInfo, WorkerLost
from transports.wire import SESSION_KINDS, WIRE_VERSION, ProtocolError, VersionMismatch

__all__ = [
    "SESSION_KINDS",
    "WIRE_VERSION",
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
    "load_transport",
]

GROUP = "tinyconv.transports"
BUILTIN = {
    "inproc": "transports.inproc:InprocTransport",
    "zmq": "transports.zmq_master:ZmqTransport",
    "mpi": "transports.mpi_master:MpiTransport",
}


def load_transport(name: str) -> type[Transport]:
    """The class registered as ``name``; a ValueError listing the choices for an unknown one."""
    table = {**BUILTIN, **{ep.name: ep.value for ep in entry_points(group=GROUP)}}
    if name not in table:
        raise ValueError(
            f"unknown transport {name!r}; available: {', '.join(sorted(table))}. "
            f"A third-party transport registers under the entry-point group {GROUP!r}."
        )
    module, _, attr = table[name].partition(":")
    return getattr(import_module(module), attr)


def available_transports() -> list[str]:
    """Names of every transport that can be asked for."""
    return sorted({*BUILTIN, *(ep.name for ep in entry_points(group=GROUP))})


def get_transport(name: str, **options: Any) -> Transport:
    """A new instance of the transport registered as ``name``; options go to its constructor (every built-in
    one ignores options meant for another, so a caller can pass one set)."""
    return load_transport(name)(**options)

"""Transports: the Transport interface (``transports/base.py``), the wire (``transports/wire.py``)
and the ways a master reaches its workers: threads (``inproc.py``), and for workers in other
processes one session layer (``session/``: hello, admission, heartbeats, loss, joins, goodbye)
over links that move frames: ZeroMQ (``zmq_master.py``, ``zmq_worker.py``, with CURVE keys in
``curve.py`` for workers on other machines) and MPI (``mpi_master.py``, ``mpi_worker.py``,
``mpi_link.py``).

A transport moves envelopes and admits workers by the version of the task protocol they speak;
what the tasks mean is the application's business; this package never imports the application.
The application finds a transport by name (``get_transport("zmq", ...)``): a class registered
under the entry-point group ``tinyconv.transports``, so a separate package can add one
(docs/writing-a-transport.md). The built-in ones register the same way (``pyproject.toml``);
:data:`BUILTIN` is only the fallback for a source checkout that was never pip-installed.
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
    """A new instance of the transport registered as ``name``; options go to its constructor.

    Every built-in transport ignores options meant for another one, so a caller can
    pass one set (``handler_factory=...``, ``bind=...``, ``protocol=...``).
    """
    return load_transport(name)(**options)

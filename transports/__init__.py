"""Transports: the Transport interface (``transports/base.py``), the wire (``transports/wire.py``)
and the ways a master reaches its workers.

Find one by name with ``tinyconv.plugins.get_transport("zmq", ...)``; a separate package
registers its own under the entry-point group ``tinyconv.transports``.
"""

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

__all__ = [
    "PROTOCOL_VERSION",
    "Handler",
    "HandlerFactory",
    "Message",
    "ProtocolError",
    "Transport",
    "VersionMismatch",
    "WorkerInfo",
    "WorkerLost",
]

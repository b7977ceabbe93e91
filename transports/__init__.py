"""Transports: the Transport interface (``transports/base.py``), the wire (``transports/wire.py``)
and the ways a master reaches its workers: threads (``inproc.py``), and for workers in other
processes one session layer (``session/``: hello, admission, heartbeats, loss, joins, goodbye)
over links that move frames: ZeroMQ (``zmq_master.py``, ``zmq_worker.py``, with CURVE keys in
``curve.py`` for workers on other machines) and MPI (``mpi_master.py``, ``mpi_worker.py``,
``mpi_link.py``).

A transport moves envelopes and admits workers by the version of the task
protocol they speak; what the tasks mean is the application's business. The
application finds a transport by name through an entry-point registry
(docs/writing-a-transport.md); this package never imports the application.
"""

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
]

"""ZeroMQ, the master's side: a ROUTER socket that every worker's DEALER (:mod:`transports.zmq_worker`)
connects to, over ``tcp://`` or ``ipc://``. :class:`ZmqLink` moves frames between the socket and the
session (:mod:`transports.session`); only the session's I/O thread touches the socket, woken by a
:class:`~transports.wakeup.Wakeup` polled beside it. The group is open: workers may come and go. With
``curve`` (:class:`transports.curve.CurveServer`) only authorised workers get in, and traffic is encrypted.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import zmq

from transports import wire
from transports.curve import CurveServer
from transports.endpoints import check_exposure, connect_hint, frame_property
from transports.pieces import Reassembly, is_piece, pieces
from transports.session.link import Arrival, Link
from transports.session.master import SessionTransport
from transports.session.settings import check_options
from transports.wakeup import Wakeup

SHUTDOWN_LINGER_S = 1.0  # at close, how long queued shutdown messages may take to leave
_DRAIN_BATCH = 256  # messages read per wake-up before heartbeats get their turn again


def _bind(ctx: zmq.Context, bind: str, max_bytes: int, curve: CurveServer | None) -> tuple[zmq.Socket, Any]:
    """The master's ROUTER, bound, with its authenticator (None without CURVE)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker raises, not vanishes
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker that reconnects keeps its identity
    sock.setsockopt(zmq.MAXMSGSIZE, max(max_bytes, wire.MAX_HEADER_BYTES))  # per frame; the session caps the total
    auth = None
    try:
        if curve is not None:
            auth = curve.apply(ctx, sock)
        sock.bind(bind)
        if bind.startswith("ipc://"):  # the socket file: only this user may connect (others could take a slot)
            os.chmod(bind[len("ipc://") :], 0o600)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        raise OSError(
            f"cannot bind {bind!r}: {e}; use e.g. tcp://*:5555, tcp://127.0.0.1:0 (a free port) "
            "or ipc:///tmp/workers.sock, and make sure no other process holds the address"
        ) from e
    return sock, auth


class ZmqLink(Link):
    """The bound ROUTER: a peer is a DEALER's identity; its address comes with each message it sends. A large
    message goes, and comes, in pieces (``pieces.py``): each piece shows its sender alive."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, auth: Any, max_bytes: int) -> None:
        self.ctx, self.sock, self.auth, self.max_bytes = ctx, sock, auth, max_bytes
        self.assembling: dict[bytes, Reassembly] = {}  # by peer: the message in pieces it is sending
        self.wakeup = Wakeup()
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.wakeup.fileno(), zmq.POLLIN)

    def wait(self, timeout: float) -> None:
        if self.wakeup.fileno() in dict(self.poller.poll(max(1, int(timeout * 1000)))):
            self.wakeup.drain()

    def wake(self) -> None:
        self.wakeup.wake()

    def receive(self) -> list[Arrival]:
        out = []
        for _ in range(_DRAIN_BATCH):
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            peer, body = frames[0].bytes, frames[1:]
            first = body[0] if body else None
            address, key = frame_property(first, "Peer-Address"), frame_property(first, "User-Id")
            if not is_piece(body):
                out.append(Arrival(peer, body, address=address, key=key))
                continue
            try:  # None until its last piece: a sign of life
                whole = self.assembling.setdefault(peer, Reassembly(self.max_bytes)).add(body)
                out.append(Arrival(peer, whole, address=address, key=key))
            except wire.ProtocolError as e:
                out.append(Arrival(peer, address=address, key=key, gone=f"its message in pieces broke: {e}"))
        return out

    def send(self, peer: Hashable, frames: list, *, control: bool = False) -> str:
        try:
            for message in pieces(frames) or [frames]:
                self.sock.send_multipart([peer, *message], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return "its queue is full: the worker stopped reading"
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return "disconnected"
        return ""

    def close(self, graceful: bool) -> None:
        self.sock.close(linger=int(SHUTDOWN_LINGER_S * 1000) if graceful else 0)

    def release(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        self.wakeup.close()


class ZmqTransport(SessionTransport):
    """Master side: a ROUTER bound at ``bind``: ``tcp://*:5555`` (all interfaces), ``tcp://127.0.0.1:0``
    (a free port: read :attr:`bound_address`) or ``ipc:///path``. Binding beyond this machine without
    ``curve`` raises ValueError unless ``insecure``. The other options are the session's
    (:class:`~transports.session.master.SessionTransport`).
    """

    name = "zmq"

    def __init__(
        self, bind: str = "tcp://*:5555", *, curve: CurveServer | None = None, insecure: bool = False, **options: Any
    ) -> None:
        check_options(**options)
        if curve is not None and not isinstance(curve, CurveServer):
            raise TypeError(f"curve must be a transports.curve.CurveServer, got {type(curve).__name__}")
        check_exposure(bind, secured=curve is not None, insecure=insecure)
        self.secured = curve is not None
        max_bytes = int(options.get("max_message_bytes", wire.DEFAULT_MAX_BYTES))
        ctx = zmq.Context()
        try:
            sock, auth = _bind(ctx, bind, max_bytes, curve)
        except BaseException:
            ctx.term()
            raise
        self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # e.g. tcp://127.0.0.1:41234 for port 0
        super().__init__(ZmqLink(ctx, sock, auth, max_bytes), **options)
        if auth is not None:  # a refused key never reaches the session: the authenticator reports it there
            auth.on_refused = lambda address, why: self._io.drops.drop("key", address, f"a key refused ({why})")

    def missing(self, live: list, n_workers: int, timeout: float) -> str:
        hint = connect_hint(self.bound_address)
        return f"{super().missing(live, n_workers, timeout)}; start workers that connect to {hint}"

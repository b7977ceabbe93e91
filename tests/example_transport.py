"""A transport over plain TCP sockets, on top of the session layer: the example of docs/writing-a-transport.md.

Only the medium is here: how frames cross a socket (:class:`Stream`), the master's end
(:class:`TcpLink`: a listening socket, one connection per worker) and a worker's
(:class:`TcpWorkerLink`). Hello and welcome, admission, heartbeats, loss and goodbye are
the session's (:mod:`transports.session`). On the wire a message is its frame count and
lengths (``!I`` and ``!Q`` each, network order), then the frames.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import time
from collections.abc import Hashable
from itertools import accumulate, pairwise
from typing import Any

from transports import wire
from transports.base import Handler
from transports.session.link import Arrival, Link, WorkerLink
from transports.session.master import SessionTransport
from transports.session.settings import EXIT_FAILED, MASTER_LOST, Settings, check_options
from transports.session.welcome import serve_master
from transports.session.worker import Compute
from transports.wakeup import Wakeup

SEND_TIMEOUT_S = 5.0  # a peer that takes no bytes for this long has stopped reading
LINGER_S = 2.0  # at close, how long the workers may take to close their ends


class Stream:
    """Messages over one connected socket: :meth:`send` frames; :meth:`feed` bytes in, whole messages out."""

    def __init__(self, sock: socket.socket, max_bytes: int) -> None:
        self.sock, self.max_bytes = sock, max_bytes
        self.sock.settimeout(SEND_TIMEOUT_S)  # recv is called only when readable, so only sends can wait
        self.buffer = bytearray()
        self.closed = ""  # why this stream ended, once it has

    def send(self, frames: list) -> bool:
        lengths = [wire.frames_nbytes([f]) for f in frames]
        try:
            self.sock.sendall(struct.pack(f"!I{len(frames)}Q", len(frames), *lengths))
            for frame in frames:
                self.sock.sendall(frame)
        except OSError:
            return False
        return True

    def feed(self) -> list[list | None]:
        """What the readable socket holds: each whole message's frames, or None when only part of one came."""
        try:
            data = self.sock.recv(1 << 20)
        except OSError as e:
            data, self.closed = b"", str(e)
        if not data:
            self.closed = self.closed or "it closed the connection"
            return []
        self.buffer += data
        out: list[list | None] = []
        while not self.closed and (frames := self._take()) is not None:
            out.append(frames)
        return out or [None]

    def _take(self) -> list | None:
        """The first whole message in the buffer, or None; one over the limits ends the stream."""
        n = struct.unpack_from("!I", self.buffer)[0] if len(self.buffer) >= 4 else 0
        if len(self.buffer) >= 4 and not 1 <= n <= 1 + wire.MAX_ARRAYS:  # bound what a peer can make us hold
            self.closed = f"a message of {n} frames"
        if not n or self.closed or len(self.buffer) < 4 + 8 * n:
            return None
        ends = list(accumulate(struct.unpack_from(f"!{n}Q", self.buffer, 4), initial=4 + 8 * n))
        if ends[-1] > self.max_bytes + wire.MAX_HEADER_BYTES:
            self.closed = f"a message of {ends[-1]} bytes"
        if self.closed or len(self.buffer) < ends[-1]:
            return None
        frames = [bytes(self.buffer[a:b]) for a, b in pairwise(ends)]
        del self.buffer[: ends[-1]]
        return frames


class TcpLink(Link):
    """The master's end: a listening socket; a peer is the number of its connection."""

    def __init__(self, host: str, port: int, max_bytes: int) -> None:
        self.server = socket.create_server((host, port))
        self.server.setblocking(False)
        self.max_bytes, self.wakeup = max_bytes, Wakeup()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ)
        self.selector.register(self.wakeup, selectors.EVENT_READ)
        self.streams: dict[int, Stream] = {}
        self.ready: list[Any] = []

    def wait(self, timeout: float) -> None:
        self.ready = [key for key, _ in self.selector.select(timeout)]

    def wake(self) -> None:
        self.wakeup.wake()

    def receive(self) -> list[Arrival]:
        out = []
        for key in self.ready:
            if key.fileobj is self.wakeup:
                self.wakeup.drain()
            elif key.fileobj is self.server:
                sock, (host, _) = self.server.accept()
                peer = len(self.streams)
                self.streams[peer] = Stream(sock, self.max_bytes)
                self.selector.register(sock, selectors.EVENT_READ, (peer, host))
            else:
                (peer, host), stream = key.data, self.streams[key.data[0]]
                out += [Arrival(peer, frames, host) for frames in stream.feed()]
                if stream.closed:
                    out.append(Arrival(peer, address=host, gone=stream.closed))
                    self.selector.unregister(stream.sock)
        self.ready = []
        return out

    def send(self, peer: Hashable, frames: list, *, control: bool = False) -> str:
        stream = self.streams.get(peer)
        if stream is None or stream.closed:
            return "disconnected"
        return "" if stream.send(frames) else "it stopped reading"

    def close(self, graceful: bool) -> None:
        """Send FIN after what is queued, then read and drop until each worker closed its end: closing
        a socket with unread bytes would reset the connection, and the goodbye could be lost."""
        for stream in self.streams.values():
            with contextlib.suppress(OSError):
                stream.sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + (LINGER_S if graceful else 0.0)
        while any(not s.closed for s in self.streams.values()) and time.monotonic() < deadline:
            self.wait(deadline - time.monotonic())
            self.receive()
        for stream in self.streams.values():
            stream.sock.close()
        self.server.close()

    def release(self) -> None:
        self.selector.close()
        self.wakeup.close()


class TcpTransport(SessionTransport):
    """Master side: workers connect to ``bind`` (``HOST:PORT``; port 0 picks a free one, see ``bound_address``)."""

    name = "tcp"

    def __init__(self, bind: str = "127.0.0.1:0", **options: Any) -> None:
        check_options(**options)
        host, port = bind.rsplit(":", 1)
        link = TcpLink(host, int(port), options.get("max_message_bytes", wire.DEFAULT_MAX_BYTES))
        self.bound_address = "{}:{}".format(*link.server.getsockname()[:2])
        super().__init__(link, **options)


class TcpWorkerLink(WorkerLink):
    """A worker's end: its connection to the master, waited on beside the compute thread's wake-up."""

    def __init__(self, stream: Stream, wakeup: Wakeup) -> None:
        self.stream, self.wakeup = stream, wakeup
        self.selector = selectors.DefaultSelector()
        self.selector.register(stream.sock, selectors.EVENT_READ)
        self.selector.register(wakeup, selectors.EVENT_READ)
        self.readable = False

    def wait(self, timeout: float) -> None:
        ready = {key.fileobj for key, _ in self.selector.select(timeout)}
        if self.wakeup in ready:
            self.wakeup.drain()
        self.readable = self.stream.sock in ready

    def receive(self) -> list[list | None]:
        out = self.stream.feed() if self.readable and not self.stream.closed else []
        self.readable, self.gone = False, self.stream.closed and f"the master is gone: {self.stream.closed}"
        return out

    def send(self, frames: list, *, control: bool = False) -> bool:
        return self.stream.send(frames)


def serve(address: str, handler: Handler, welcome_timeout_s: float = 60.0, **settings: Any) -> int:
    """Serve ``handler`` to the master at ``address`` (``HOST:PORT``) until it says shutdown; an exit code.
    ``settings`` are :class:`~transports.session.settings.Settings`' (``heartbeat_s``, ``say``, ...)."""
    host, port = address.rsplit(":", 1)
    settings = Settings(**settings)
    compute = Compute(handler)
    link = TcpWorkerLink(Stream(socket.create_connection((host, int(port))), settings.max_bytes), compute.wakeup)
    try:
        code = serve_master(
            link,
            compute,
            settings,
            master=f"the master at {address}",
            deadline=time.monotonic() + welcome_timeout_s,
            giving_up=f"no welcome from {address} within {welcome_timeout_s:g} s",
        )
        return EXIT_FAILED if code == MASTER_LOST else code  # this worker does not look for another master
    finally:
        compute.stop()
        link.stream.sock.close()
